"""CUDA paths: device moves, pinned staging, non-blocking copies. Skipped without a GPU."""

from __future__ import annotations

import pickle
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import GatedPolicy, load_script, make_mlp
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from torchrl_batchserve import BatchedPolicyServer, EvaluationCache, PadCollate, StackCollate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def reference(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return net.to("cpu")(x.cpu())


def test_cpu_requests_served_on_cuda_come_back_on_cpu():
    net = make_mlp()
    cpu_net = make_mlp()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, device="cuda", timeout=0.01) as server:
        assert isinstance(server.collate, StackCollate) and server.collate.pin_memory
        remote = server.remote_policy()
        futures = [remote.submit(TensorDict(observation=torch.randn(8))) for _ in range(32)]
        outs = [f.result(30) for f in futures]
    for td in outs:
        assert td["logits"].device.type == "cpu" and td["policy_version"].device.type == "cpu"
        torch.testing.assert_close(td["logits"], reference(cpu_net, td["observation"]), atol=1e-5, rtol=1e-4)


def test_output_device_and_cuda_requests():
    net = make_mlp().cuda()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, device="cuda", output_device="cuda") as server:
        # "cuda" is named by its index, as tensors name their device: results already there are not moved again
        assert server.statistics().replicas[0].device == f"cuda:{torch.cuda.current_device()}"
        td = server.remote_policy()(TensorDict(observation=torch.randn(8)))
        assert td["logits"].device.type == "cuda" and td["policy_version"].device.type == "cuda"
    with BatchedPolicyServer(policy) as server:  # requests on the GPU: served there, answered there
        td = server.remote_policy()(TensorDict(observation=torch.randn(4, 8, device="cuda"), batch_size=[4]))
        assert td["logits"].device.type == "cuda" and td["logits"].shape == (4, 3)
        assert td["policy_version"].device == td["logits"].device  # the stamp is made where the results go


def test_weight_updates_reach_a_cuda_policy_in_place():
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, device="cuda") as server:
        served = server._replicas[0].module  # the server's own copy, on the GPU
        storage = next(served.parameters()).data_ptr()
        new = TensorDictModule(make_mlp(seed=3), in_keys=["observation"], out_keys=["logits"])
        assert server.update_weights(TensorDict.from_module(new)) == 1
        td = server.remote_policy()(TensorDict(observation=torch.ones(8)))
        assert next(served.parameters()).is_cuda
        assert next(served.parameters()).data_ptr() == storage  # in place: CUDA graphs keep their storage
    assert int(td["policy_version"]) == 1
    torch.testing.assert_close(td["logits"], reference(make_mlp(seed=3), torch.ones(8)), atol=1e-5, rtol=1e-4)


class _Held(torch.nn.Module):
    """An MLP whose forward, while ``hold`` is set, tells ``entered`` and waits for ``go`` (events are shared
    with the served copy: they cannot be deep-copied)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_mlp()
        self.hold, self.entered, self.go = threading.Event(), threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hold.is_set():
            self.entered.set()
            assert self.go.wait(30)
        return self.net(x)


def test_a_result_left_on_cuda_keeps_its_memory_while_the_caller_reads_it_after_a_later_batch_began():
    # The caller reads its result on the default stream behind slow work and frees it while the next batch
    # runs on the replica's stream: the caching allocator must not give that batch the result's memory.
    held = _Held()
    policy = TensorDictModule(held, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, device="cuda", output_device="cuda", max_batch_size=1, timeout=0) as server:
        remote = server.remote_policy()
        x = torch.randn(8, device="cuda")
        first = remote(TensorDict(observation=x))
        expected = reference(make_mlp(), x)
        held.hold.set()
        with ThreadPoolExecutor(1) as pool:
            later = pool.submit(remote, TensorDict(observation=torch.randn(8, device="cuda")))
            assert held.entered.wait(30)  # the next batch runs on the replica's stream, past its wait for ours
            busy = torch.randn(2048, 2048, device="cuda")
            for _ in range(200):  # keep the default stream busy: the read below runs after all this
                busy = torch.tanh(busy @ busy)
            read = first["logits"] * 1
            del first  # freed while the read is still queued
            held.go.set()
            later.result(30)
        torch.cuda.current_stream().synchronize()
    torch.testing.assert_close(read.cpu(), expected, atol=1e-5, rtol=1e-4)


def test_a_lone_caller_on_a_stream_of_its_own_has_its_request_read_after_that_stream_made_it():
    # A lone caller runs its own batch, stacking its request on its current stream: the replica's stream
    # must wait for that stream, not only for the default one.
    ran_in: list[int] = []
    net = make_mlp()
    net.register_forward_pre_hook(lambda module, args: ran_in.append(threading.get_ident()))  # kept by the copy
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, device="cuda", output_device="cuda") as server:
        remote = server.remote_policy()
        remote(TensorDict(observation=torch.randn(8, device="cuda")))  # now the lone caller: it runs its batches
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            busy = torch.randn(2048, 2048, device="cuda")
            for _ in range(200):  # slow work on the caller's stream, ahead of its request
                busy = torch.tanh(busy @ busy)
            x = torch.full((8,), 0.5, device="cuda") + busy[0, :8] * 0
            result = remote(TensorDict(observation=x))["logits"] * 1
        stream.synchronize()
    assert ran_in[-1] == threading.get_ident()  # the caller ran the batch itself
    torch.testing.assert_close(result.cpu(), reference(make_mlp(), torch.full((8,), 0.5)), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("caller", ["thread", "worker"])
def test_a_batch_of_cpu_requests_waits_for_no_trainers_kernels_on_the_default_stream(caller):
    # CPU requests are copied in, run and copied out on the replica's stream alone, and a worker's outputs left
    # on the GPU (output_device="cuda") reach its lane through a copy on a stream kept for that: the kernels a
    # trainer queued on the default stream (its usual stream) before the request hold neither up.
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    kwargs = {"forward_timeout": 60} if caller == "thread" else {"output_device": "cuda"}  # 60: the serve thread
    with BatchedPolicyServer(policy, device="cuda", **kwargs) as server:  # runs every batch, not the caller
        remote = server.remote_policy()
        if caller == "worker":
            remote = pickle.loads(pickle.dumps(remote))  # the process path, in this process
        for _ in range(2):  # warmed up (a worker's first request travels pickled, the second in its lane)
            remote(TensorDict(observation=torch.ones(8)))
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(400):  # the trainer's work, about a second of it, queued on the default stream
            busy = torch.tanh(busy @ busy)
        td = remote(TensorDict(observation=torch.ones(8)))
        trainer_still_busy = not torch.cuda.default_stream().query()
        torch.cuda.synchronize()
    assert trainer_still_busy
    assert td["logits"].device.type == "cpu"
    torch.testing.assert_close(td["logits"], reference(make_mlp(), torch.ones(8)), atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_requests_made_on_another_device_are_read_after_that_devices_stream_made_them():
    # The replica's stream on cuda:0 waits for the stream the batch was stacked on, on the inputs' device.
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, device="cuda:0", forward_timeout=60) as server:
        remote = server.remote_policy()
        busy = torch.randn(4096, 4096, device="cuda:1")
        for _ in range(200):  # slow work on cuda:1's default stream, ahead of the request's input
            busy = torch.tanh(busy @ busy)
        x = torch.full((8,), 0.5, device="cuda:1") + busy[0, :8] * 0
        td = remote(TensorDict(observation=x))
        logits = td["logits"].cpu()
    torch.testing.assert_close(logits, reference(make_mlp(), torch.full((8,), 0.5)), atol=1e-5, rtol=1e-4)


class _BufferedBesideATrainer(torch.nn.Module):
    """An MLP that writes its outputs into a buffer it keeps (as a CUDA-graph replay does), while a trainer's
    slow kernels are queued on the default stream."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_mlp()
        self.register_buffer("out", torch.zeros(64, 3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(torch.cuda.default_stream(x.device)):
            busy = torch.randn(2048, 2048, device=x.device)
            for _ in range(200):
                busy = torch.tanh(busy @ busy)
        rows = x.shape[0]
        self.out[:rows].copy_(self.net(x))
        return self.out[:rows]


def test_a_caller_on_a_stream_of_its_own_reads_copied_outputs_and_the_stamp_done_though_the_default_stream_is_busy():
    # The buffer's rows are copied for each caller and the version stamped on the replica's stream before the
    # results are handed out: queued on the serve thread's default stream, behind the trainer's work, they would
    # still be pending when this caller's stream reads them.
    policy = TensorDictModule(_BufferedBesideATrainer(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, device="cuda", output_device="cuda", forward_timeout=60) as server:
        remote = server.remote_policy()  # (forward_timeout: the serve thread runs every batch, on its own stream)
        x = torch.full((8,), 0.5, device="cuda")  # made on the default stream, which the batch is stacked after
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            td = remote(TensorDict(observation=x))
            logits, version = td["logits"] * 1, td["policy_version"] + 0
        stream.synchronize()
        torch.cuda.synchronize()
    torch.testing.assert_close(logits.cpu(), reference(make_mlp(), torch.full((8,), 0.5)), atol=1e-5, rtol=1e-4)
    assert int(version) == 0


def test_cached_rows_reach_hits_and_followers_on_a_stream_of_their_own_done_though_the_default_stream_is_busy():
    # The cache's copies of a batch's rows are made on the replica's stream: a follower's copy is done before it
    # is handed out, and a hit copies an entry on its caller's stream after the entry's event. Made on the serve
    # thread's default stream, behind the trainer's work, they would be read before they were made.
    gated = GatedPolicy(_BufferedBesideATrainer())
    with BatchedPolicyServer(
        gated, device="cuda", output_device="cuda", cache=EvaluationCache(), timeout=1e6, forward_timeout=60
    ) as server:
        remote = server.remote_policy()
        first = remote.submit(TensorDict(observation=torch.zeros(8, device="cuda")))
        assert gated.entered.wait(10)  # the serve loop is held: what comes next queues together
        x = torch.full((8,), 0.5, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            same = [remote.submit(TensorDict(observation=x)) for _ in range(3)]  # one leads, two follow
            gated.gate.set()
            computed = [f.result(60)["logits"] * 1 for f in same]
            hit = remote(TensorDict(observation=x))["logits"] * 1
        stream.synchronize()
        first.result(60)
        stats = server.statistics()
    assert (stats.cache_misses, stats.cache_coalesced, stats.cache_hits) == (2, 2, 1)
    expected = reference(make_mlp(), torch.full((8,), 0.5))
    for logits in [*computed, hit]:
        torch.testing.assert_close(logits.cpu(), expected, atol=1e-5, rtol=1e-4)


def test_padded_batches_on_cuda():
    policy = TensorDictModule(lambda tokens, mask: tokens * 2, in_keys=["tokens", "mask"], out_keys=["out"])
    collate = PadCollate(["tokens"], trim_keys=["out"])
    with BatchedPolicyServer(policy, device="cuda", collate=collate, timeout=0.01) as server:
        futures = [server.submit(TensorDict(tokens=torch.randn(n, 3))) for n in (2, 5)]
        for f in futures:
            td = f.result(30)
            assert td["out"].device.type == "cpu"
            torch.testing.assert_close(td["out"], td["tokens"] * 2)


def test_worker_process_clients_of_a_cuda_server():
    net = make_mlp()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, device="cuda") as server:
        copy = pickle.loads(pickle.dumps(server.remote_policy()))  # the process path, in this process
        td = copy(TensorDict(observation=torch.ones(8)))
        assert td["logits"].device.type == "cpu"
    torch.testing.assert_close(td["logits"], reference(make_mlp(), torch.ones(8)), atol=1e-5, rtol=1e-4)


def test_worker_process_clients_of_a_server_whose_outputs_stay_on_cuda():
    # Device outputs are copied into the client's slot by torch (never by address).
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, device="cuda", output_device="cuda") as server:
        copy = pickle.loads(pickle.dumps(server.remote_policy()))
        tds = [copy(TensorDict(observation=torch.full((8,), float(i)))) for i in range(3)]
    for i, td in enumerate(tds):
        assert td["logits"].device.type == "cpu" and int(td["policy_version"]) == 0
        torch.testing.assert_close(
            td["logits"], reference(make_mlp(), torch.full((8,), float(i))), atol=1e-5, rtol=1e-4
        )


@pytest.mark.parametrize("mixed", [False, True])
def test_replicas_on_cuda_devices_serve_exact_results_and_every_push(mixed):
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] * (2 if torch.cuda.device_count() == 1 else 1)
    if mixed:  # a CPU replica reads the pushes staged on the first device
        devices = [devices[0], "cpu"]
    net, cpu_net = make_mlp(), make_mlp()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, device=devices, max_batch_size=4, timeout=0.001) as server:
        remote = server.remote_policy()
        for version in range(1, 4):
            with torch.no_grad():
                for p_cpu, p in zip(cpu_net.parameters(), net.parameters()):
                    p.add_(0.1)
                    p_cpu.copy_(p)
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):  # staged on a stream of the pusher's own: replicas wait for its copies
                assert server.update_weights() == version
            futures = [remote.submit(TensorDict(observation=torch.randn(8))) for _ in range(32)]
            for td in (f.result(30) for f in futures):
                assert int(td["policy_version"]) == version and td["logits"].device.type == "cpu"
                torch.testing.assert_close(td["logits"], reference(cpu_net, td["observation"]), atol=1e-5, rtol=1e-4)
        assert len(server.statistics().replicas) == len(devices)


def test_the_side_by_side_benchmarks_serve_the_policy_on_cuda(tmp_path):
    out = load_script("benchmarks", "run").main(
        ["--quick", "--only", "vector", "--device", "cuda", "--out", str(tmp_path)]
    )
    assert "the policy on `cuda`" in (tmp_path / "benchmarks_quick.md").read_text()
    assert all(row["ours"]["rps"] > 0 and row["torchrl"]["rps"] > 0 for row in out["rows"])
    argv = ["--quick", "--only", "vector", "--procs", "2", "--device", "cuda", "--out", str(tmp_path)]
    rows = load_script("benchmarks", "processes").main(argv)["rows"]
    assert rows[0]["ours"]["rps"] > 0 and rows[0]["torchrl"]["rps"] > 0
