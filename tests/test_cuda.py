"""CUDA paths: device moves, pinned staging, non-blocking copies. Skipped without a GPU."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import load_script, make_mlp
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from torchrl_batchserve import BatchedPolicyServer, PadCollate, StackCollate

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
        storage = next(server.policy.parameters()).data_ptr()
        new = TensorDictModule(make_mlp(seed=3), in_keys=["observation"], out_keys=["logits"])
        assert server.update_weights(TensorDict.from_module(new)) == 1
        td = server.remote_policy()(TensorDict(observation=torch.ones(8)))
        assert next(server.policy.parameters()).data_ptr() == storage  # in place: CUDA graphs keep their storage
    assert int(td["policy_version"]) == 1
    torch.testing.assert_close(td["logits"], reference(make_mlp(seed=3), torch.ones(8)), atol=1e-5, rtol=1e-4)


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


def test_replicas_on_cuda_devices_serve_exact_results_and_every_push():
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] * (2 if torch.cuda.device_count() == 1 else 1)
    net, cpu_net = make_mlp(), make_mlp()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, device=devices, max_batch_size=4, timeout=0.001) as server:
        remote = server.remote_policy()
        for version in range(1, 4):
            with torch.no_grad():
                for p_cpu, p in zip(cpu_net.parameters(), net.parameters()):
                    p.add_(0.1)
                    p_cpu.copy_(p)
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
