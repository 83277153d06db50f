"""BatchedPolicyServer and RemotePolicy with threads and asyncio tasks."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import pickle
import re
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import GatedPolicy, make_mlp, obs, wait_for
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, TensorDict
from tensordict.nn import (
    InteractionType,
    TensorDictModule,
    TensorDictModuleBase,
    TensorDictSequential,
    set_interaction_type,
)
from tensordict.nn.probabilistic import interaction_type

from torchrl_batchserve import (
    BadRequestError,
    BatchedPolicyServer,
    EvaluationCache,
    LengthCost,
    PolicyError,
    QueueFullError,
    RemotePolicy,
    ServerBrokenError,
    ServerClosedError,
    ServerStatistics,
    WeightSyncError,
)
from torchrl_batchserve.replica import Replica, served_copy
from torchrl_batchserve.request import AsyncRequest, BlockingRequest, Relay, resolve
from torchrl_batchserve.weights import ShadowWeights

# -- every caller gets policy(its own input) -----------------------------------------


def test_64_threads_get_their_own_results_and_batches_form(policy, net):
    with BatchedPolicyServer(policy, max_batch_size=32, timeout=0.05) as server:
        remote = server.remote_policy()
        barrier = threading.Barrier(64)

        def actor(seed):
            gen = torch.Generator().manual_seed(seed)
            barrier.wait()
            outs = []
            for _ in range(20):
                td = TensorDict(observation=torch.randn(8, generator=gen))
                x = td["observation"].clone()
                out = remote(td)
                assert out is td  # written in place, as a TensorDictModule does
                outs.append((x, out["logits"].clone(), int(out["policy_version"])))
            return outs

        with ThreadPoolExecutor(64) as pool:
            results = [r for rs in pool.map(actor, range(64)) for r in rs]
        stats = server.statistics()
    with torch.no_grad():
        for x, logits, version in results:
            torch.testing.assert_close(logits, net(x))
            assert version == 0
    assert stats.requests == 64 * 20 and stats.rows == 64 * 20
    assert stats.mean_batch_size > 1


def test_1000_asyncio_tasks_batch_together(policy, net):
    async def main(remote):
        tds = [obs() for _ in range(1000)]
        inputs = [td["observation"].clone() for td in tds]
        outs = await asyncio.gather(*(remote.acall(td) for td in tds))
        return inputs, outs

    with BatchedPolicyServer(policy, max_batch_size=64, timeout=0.05) as server:
        inputs, outs = asyncio.run(main(server.remote_policy()))
        stats = server.statistics()
    with torch.no_grad():
        for x, out in zip(inputs, outs):
            torch.testing.assert_close(out["logits"], net(x))
            assert int(out["policy_version"]) == 0
    assert stats.requests == 1000
    assert stats.mean_batch_size > 8  # one event loop: thousands of tasks share batches


def test_tasks_of_four_event_loops_share_one_batch_and_each_loop_gets_its_own_results(net):
    gated = GatedPolicy(net, block_first=1)
    results: dict[int, list] = {}
    loop_errors: list = []  # in debug mode, a loop touched from another loop's thread raises there

    async def tasks(remote, loop_index: int) -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
        tds = [obs() for _ in range(16)]
        inputs = [td["observation"].clone() for td in tds]
        outs = await asyncio.gather(*(remote.acall(td) for td in tds))
        results[loop_index] = list(zip(inputs, outs))

    with BatchedPolicyServer(gated, max_batch_size=64, timeout=60.0) as server:
        remote = server.remote_policy()
        held = server.submit(obs())
        assert gated.entered.wait(10)  # the serve loop is held: the 64 requests queue behind it
        threads = [
            threading.Thread(target=asyncio.run, args=(tasks(remote, i),), kwargs={"debug": True}, daemon=True)
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
        wait_for(lambda: server._queue._rows == 64, "the four loops' 64 requests queued")
        gated.gate.set()
        held.result(10)
        for thread in threads:
            thread.join(30)
    assert sorted(results) == [0, 1, 2, 3] and not loop_errors, loop_errors  # each loop settled its own tasks
    assert gated.batches == [1, 64]  # one batch for the four loops
    with torch.no_grad():
        for pairs in results.values():
            for x, out in pairs:
                torch.testing.assert_close(out["logits"], net(x))


def test_an_idle_server_keeps_no_result_of_finished_asyncio_tasks_alive(policy):
    # The queue remembers the callers it served until a batch fires on its timeout (60 s: never here, every
    # batch of one row is full). Remembered as tasks, the finished tasks would hold their results.
    import gc
    import weakref

    async def burst(remote) -> list:
        tds = [obs() for _ in range(32)]
        await asyncio.gather(*(remote.acall(td) for td in tds))
        return [weakref.ref(td) for td in tds]

    with BatchedPolicyServer(policy, max_batch_size=1, timeout=60.0) as server:
        refs = asyncio.run(burst(server.remote_policy()))
        gc.collect()
        alive = sum(ref() is not None for ref in refs)
        assert server.statistics().fired == {"full": 32}
    assert alive == 0, f"{alive} of 32 results outlived their callers, held by the idle server"


def _spin(cpu_seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < cpu_seconds:
        pass


def test_the_relay_counts_asyncio_callers_as_waking_until_their_resumed_tasks_reach_their_next_await():
    # The serve loop waits for a short batch's callers to be awake before it takes the next (Relay.wait_idle),
    # so that its forward does not fight them for the GIL: for asyncio callers, until the tasks their results
    # resumed have run on, not merely until their futures are set. Its estimate of their cost counts that work.
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    relay = Relay()
    requests = [AsyncRequest(obs(), (), 1, torch.Size([]), i, None, None, loop=loop) for i in range(3)]
    ran: list[int] = []

    async def caller(request: AsyncRequest, i: int) -> None:
        await request.future
        _spin(0.02)  # what a task does with its result before its next request
        ran.append(i)

    async def start() -> list:
        return [asyncio.ensure_future(caller(r, i)) for i, r in enumerate(requests)]

    try:
        tasks = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        resolve(requests, ["logits"], [[torch.zeros(2)] * 3], relay)
        relay.wait_idle(30)
        assert sorted(ran) == [0, 1, 2], "the relay was idle before the resumed tasks ran"
        assert relay.seconds_per_wake() >= 0.015  # each caller's 20 ms of CPU after its result
        assert all(t.done() for t in tasks)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_the_serve_loops_of_two_replicas_waiting_for_the_same_callers_both_go_on_once_they_are_awake():
    relay = Relay()
    caller = BlockingRequest(obs(), (), 1, torch.Size([]), 0, None, None)
    caller._store(["logits"], [torch.zeros(2)], None)
    relay.start([caller])  # woken, but its caller has not run yet
    loops = [threading.Thread(target=relay.wait_idle, args=(60,)) for _ in range(2)]
    for loop in loops:
        loop.start()
    wait_for(lambda: len(relay._awake._waiters) == 2, "both serve loops waiting")
    caller.wait(lambda: True)  # the caller wakes: nobody is waking any more
    for loop in loops:
        loop.join(20)
    assert not any(loop.is_alive() for loop in loops), "a serve loop kept waiting for callers already awake"


def test_an_event_loop_that_does_not_run_holds_the_relay_up_for_one_wait_at_most():
    # A loop stopped (or busy elsewhere) with results sent to it: the serve loop gives up on it after one
    # wait, and later batches are not held up by it again.
    loop = asyncio.new_event_loop()
    relay = Relay()
    try:
        request = AsyncRequest(obs(), (), 1, torch.Size([]), 0, None, None, loop=loop)
        resolve([request], ["logits"], [[torch.zeros(2)]], relay)
        relay.wait_idle(0.01)  # gives up on it
        started = time.monotonic()
        relay.wait_idle(30)
        assert time.monotonic() - started < 10, "a loop that never ran its callback held up a second wait"
    finally:
        loop.close()
    resolve(
        [AsyncRequest(obs(), (), 1, torch.Size([]), 0, None, None, loop=loop)], ["logits"], [[torch.zeros(2)]], relay
    )
    started = time.monotonic()
    relay.wait_idle(30)  # a closed loop: nobody waits for its results
    assert time.monotonic() - started < 10


def test_threads_and_tasks_share_one_server(policy, net):
    with BatchedPolicyServer(policy, max_batch_size=16, timeout=0.05) as server:
        remote = server.remote_policy()

        async def tasks():
            tds = [obs() for _ in range(100)]
            return tds, await asyncio.gather(*(remote.acall(td) for td in tds))

        with ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(remote, obs()) for _ in range(100)]
            tds, outs = asyncio.run(tasks())
            thread_outs = [f.result() for f in futs]
    with torch.no_grad():
        for td in list(outs) + thread_outs:
            torch.testing.assert_close(td["logits"], net(td["observation"]))


@settings(max_examples=15, deadline=None)
@given(shapes=st.lists(st.sampled_from([(), (1,), (3,), (2, 2), (5,)]), min_size=1, max_size=12))
def test_multi_row_requests_take_their_shape_back(shapes):
    net = make_mlp()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, max_batch_size=4, timeout=0.01) as server:
        remote = server.remote_policy()
        futs = [remote.submit(obs(*shape)) for shape in shapes]
        outs = [f.result(timeout=30) for f in futs]
        stats = server.statistics()
    assert stats.rows == sum(torch.Size(s).numel() for s in shapes)
    with torch.no_grad():
        for shape, td in zip(shapes, outs):
            assert td["logits"].shape == (*shape, 3)
            assert td["policy_version"].shape == shape
            torch.testing.assert_close(td["logits"], net(td["observation"]))


def test_general_path_for_composite_policies(net):
    # TensorDictSequential is not a plain TensorDictModule: the TensorDict path serves it.
    head = torch.nn.Linear(3, 1)
    policy = TensorDictSequential(
        TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]),
        TensorDictModule(head, in_keys=["logits"], out_keys=["value"]),
    )
    with BatchedPolicyServer(policy, max_batch_size=8) as server:
        remote = server.remote_policy()
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(remote, [obs() for _ in range(40)]))
    with torch.no_grad():
        for td in outs:
            torch.testing.assert_close(td["value"], head(net(td["observation"])))


def test_plain_module_with_keys_and_the_server_called_like_a_policy(net):
    with BatchedPolicyServer(net, in_keys=["observation"], out_keys=["logits"]) as server:
        assert server.in_keys == ["observation"] and server.out_keys == ["logits"]
        assert list(server.parameters()) == list(net.parameters())  # the trainer's module, not the served copy
        td = server(obs(5))  # called like a policy, the server serves the request batched
        out = server.remote_policy()(obs())
        assert server.statistics().requests == 2
        for call in (server, server.remote_policy()):  # an argument the call would not honour: it was dropped
            with pytest.raises(TypeError, match="unexpected keyword argument 'tensordict_out'"):
                call(obs(), tensordict_out=obs())
        for move in (lambda: server.to(torch.float64), lambda: server.double(), lambda: server.to("cpu")):
            with pytest.raises(TypeError, match=r"would change only the module it was given .* device="):
                move()  # it moved the trainer's module, and the served copies stayed as they were
        assert all(p.dtype == torch.float32 for p in net.parameters())
    with torch.no_grad():
        torch.testing.assert_close(td["logits"], net(td["observation"]))
    assert int(td["policy_version"][0]) == 0 and out["logits"].shape == (3,)


def test_oversized_request_runs_in_slices():
    gated = GatedPolicy(make_mlp(), block_first=0)
    with BatchedPolicyServer(gated, max_batch_size=4) as server:
        td = server.remote_policy()(obs(10))
    assert gated.batches == [4, 4, 2]
    with torch.no_grad():
        torch.testing.assert_close(td["logits"], gated.net(td["observation"]))


def test_nested_keys_and_version_key_none():
    net = make_mlp()
    policy = TensorDictModule(net, in_keys=[("agent", "obs")], out_keys=[("agent", "logits")])
    with BatchedPolicyServer(policy, policy_version_key=None) as server:
        td = TensorDict({"agent": {"obs": torch.randn(8)}})
        out = server.remote_policy()(td)
    assert "policy_version" not in out.keys()
    with torch.no_grad():
        torch.testing.assert_close(out["agent", "logits"], net(out["agent", "obs"]))


def test_an_output_the_policy_drops_with_the_out_key_underscore_is_not_expected_from_it():
    # tensordict's out_keys=[..., "_"] discards that output; a sequence lists the "_" among its out_keys.
    net = make_mlp()
    first = TensorDictModule(lambda x: (net(x), x), in_keys=["observation"], out_keys=["logits", "_"])
    policy = TensorDictSequential(first, TensorDictModule(torch.tanh, in_keys=["logits"], out_keys=["action"]))
    assert "_" in policy.out_keys
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        out = remote(obs())
    assert remote.out_keys == ["logits", "action"] and "_" not in out.keys()
    with torch.no_grad():
        torch.testing.assert_close(out["action"], torch.tanh(net(out["observation"])))


def test_a_composite_distribution_actor_needs_only_the_observation_from_its_callers():
    # ProbabilisticActor(in_keys=["params"]) over heads writing ("params", name, ...) lists "params" in its in_keys,
    # though it writes them itself: the plain actor runs on a TensorDict of the observation alone, so must the server.
    from tensordict.nn import CompositeDistribution, NormalParamExtractor
    from torch import distributions
    from torchrl.modules import ProbabilisticActor

    torch.manual_seed(0)
    heads = TensorDictSequential(
        TensorDictModule(torch.nn.Linear(8, 3), in_keys=["observation"], out_keys=[("params", "cat", "logits")]),
        TensorDictModule(
            torch.nn.Sequential(torch.nn.Linear(8, 2), NormalParamExtractor()),
            in_keys=["observation"],
            out_keys=[("params", "normal", "loc"), ("params", "normal", "scale")],
        ),
    )
    actor = ProbabilisticActor(
        heads,
        in_keys=["params"],
        distribution_class=CompositeDistribution,
        distribution_kwargs={
            "distribution_map": {"cat": distributions.Categorical, "normal": distributions.Normal},
            "name_map": {"cat": ("action", "cat"), "normal": ("action", "normal")},
        },
        out_keys=[("action", "cat"), ("action", "normal")],
        return_log_prob=True,
    )
    assert "params" in actor.in_keys
    with BatchedPolicyServer(actor) as server, set_interaction_type(InteractionType.DETERMINISTIC):
        remote = server.remote_policy()
        worker = pickle.loads(pickle.dumps(remote))  # a worker process's client (the hub's path)
        outs = [remote(obs()), worker(obs(3)), worker(obs(3))]
        assert remote.in_keys == ["observation"]
        for out in outs:
            want = actor(out.select("observation"))
            for key in want.keys(True, True):
                torch.testing.assert_close(out[key], want[key])


def test_multi_agent_requests_keep_their_agents_apart_from_other_rows():
    # TorchRL's multi-agent layout: ("agents", ...) entries with an agent dim after the batch dims.
    # A centralised MultiAgentMLP mixes the agents of a row; batching must not mix rows.
    from torchrl.modules import MultiAgentMLP

    torch.manual_seed(0)
    net = MultiAgentMLP(n_agent_inputs=4, n_agent_outputs=2, n_agents=3, centralised=True, share_params=False, depth=1)
    policy = TensorDictModule(net, in_keys=[("agents", "observation")], out_keys=[("agents", "action")])

    def request(i: int) -> TensorDict:
        shape = [[], [2]][i % 2]  # one env, or two
        agents = TensorDict(observation=torch.randn(*shape, 3, 4), batch_size=[*shape, 3])
        return TensorDict(agents=agents, batch_size=shape)

    with BatchedPolicyServer(policy, max_batch_size=16) as server:
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(server.remote_policy(), [request(i) for i in range(64)]))
        assert server.statistics().mean_batch_size > 1
    with torch.no_grad():
        for td in outs:
            assert td["agents", "action"].shape == (*td.batch_size, 3, 2)
            torch.testing.assert_close(td["agents", "action"], net(td["agents", "observation"]))


class OneShape(TensorDictModuleBase):
    """Runs batches of exactly ``rows`` rows, as a CUDA graph captured at that size does; records them."""

    def __init__(self, net, rows: int, wrong: bool = False) -> None:
        super().__init__()
        self.net, self.rows, self.wrong = net, rows, wrong
        self.in_keys, self.out_keys = ["observation"], ["logits"]
        self.seen: list[int] = []

    def forward(self, td):
        assert td.batch_size == (self.rows,), f"captured at {self.rows} rows, got {td.batch_size}"
        self.seen.append(td.batch_size[0])
        if self.wrong:
            return td[:1].set("logits", self.net(td["observation"][:1]))
        return td.set("logits", self.net(td["observation"]))


def test_a_static_batch_size_pads_every_forward_and_drops_the_padded_rows(net):
    policy = OneShape(net, rows=8)
    with BatchedPolicyServer(policy, max_batch_size=8, static_batch_size=8) as server:
        remote = server.remote_policy()
        requests = [obs(), obs(3), obs(2, 2), obs(19)] + [obs() for _ in range(40)]  # 19 rows: slices of 8, 8, 3
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(remote, requests))
        stats = server.statistics()
        served = server._replicas[0].module  # the server's own copy, which saw every forward
    assert set(served.seen) == {8} and stats.rows == 1 + 3 + 4 + 19 + 40
    with torch.no_grad():
        for td in outs:
            torch.testing.assert_close(td["logits"], net(td["observation"]))
            assert td["logits"].shape == (*td.batch_size, 3)
    with BatchedPolicyServer(OneShape(net, rows=8, wrong=True), max_batch_size=8, static_batch_size=8) as server:
        with pytest.raises(PolicyError, match=r"static_batch_size=8: the policy must return 8 rows, got \[1\]"):
            server.remote_policy()(obs())


@pytest.mark.parametrize("settings", [{"max_batch_size": 4}, {"max_batch_size": 4, "static_batch_size": 8}])
def test_a_module_that_returns_its_outputs_in_a_new_tensordict_runs_in_slices_and_padded(net, settings):
    # TensorDictModule(..., inplace=False) returns a TensorDict of batch size []: a request larger than a batch
    # failed with tensordict's bare RuntimeError, and every padded forward was refused as a PolicyError.
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"], inplace=False)
    with BatchedPolicyServer(policy, **settings) as server:
        outs = [server.remote_policy()(obs(rows)) for rows in (1, 3, 10)]
    with torch.no_grad():
        for td in outs:
            torch.testing.assert_close(td["logits"], net(td["observation"]))


def test_remote_policy_is_a_module_without_parameters(policy):
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        assert isinstance(remote, TensorDictModuleBase) and isinstance(remote, RemotePolicy)
        assert remote.in_keys == ["observation"] and remote.out_keys == ["logits"]
        assert repr(remote) == "RemotePolicy(in_keys=['observation'], out_keys=['logits'])"
        assert list(remote.parameters()) == []
        logits = remote(observation=torch.randn(8))  # keyword call: returns the out_keys' tensors
        assert isinstance(logits, torch.Tensor) and logits.shape == (3,)
        twin = copy.deepcopy(remote)  # a copy in this process is served in-process, as the original is
        assert twin(obs())["logits"].shape == (3,) and server._endpoint.lazy_hub.hub is None


# -- the batching rule through the server ------------------------------------------------


def test_a_remote_policy_of_a_policy_without_state_gives_no_primer_that_breaks_a_search_for_primers(policy):
    # TorchRL's get_primers_from_module composes every submodule's make_tensordict_primer()
    from tensordict.nn import TensorDictSequential
    from torchrl.modules import LSTMModule
    from torchrl.modules.utils import get_primers_from_module

    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        assert len(remote.make_tensordict_primer()) == 0  # an empty Compose
        lstm = LSTMModule(input_size=3, hidden_size=4, in_key="logits", out_key="embed")
        found = get_primers_from_module(TensorDictSequential(remote, lstm))
    assert [sorted(t.primers.keys()) for t in found if hasattr(t, "primers")] == [
        ["recurrent_state_c", "recurrent_state_h"]
    ]


@pytest.mark.parametrize("cache", ["None", "EvaluationCache()"])
def test_serving_a_policy_of_no_torchrl_module_does_not_import_torchrls_modules_to_look_for_any(cache):
    # Looking for primers with TorchRL's get_primers_from_module, or for exploration modules that the cache must
    # not answer, imported all of torchrl.modules (about half a second and 50 MB) for a policy that has none.
    script = (
        "import sys, torch\n"
        "from tensordict import TensorDict\n"
        "from tensordict.nn import TensorDictModule\n"
        "from torchrl_batchserve import BatchedPolicyServer, EvaluationCache\n"
        "policy = TensorDictModule(torch.nn.Linear(2, 2), in_keys=['o'], out_keys=['a'])\n"
        f"with BatchedPolicyServer(policy, cache={cache}) as server:\n"
        "    server.remote_policy()(TensorDict(o=torch.ones(2)))\n"
        "print('torchrl.modules' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False"]


def test_full_batch_and_cancelled_future_dropped():
    gated = GatedPolicy(make_mlp())
    with BatchedPolicyServer(gated, max_batch_size=4, timeout=1e6) as server:
        remote = server.remote_policy()
        first = remote.submit(obs())
        assert gated.entered.wait(10)  # the loop is busy with `first`
        futs = [remote.submit(obs()) for _ in range(5)]
        assert futs[1].cancel()
        gated.gate.set()
        first.result(10)
        outs = [f.result(10) for i, f in enumerate(futs) if i != 1]
        stats = server.statistics()
    # 5 queued, 1 cancelled: the full batch takes 4 requests, drops the cancelled one
    assert gated.batches[:2] == [1, 3] and sum(gated.batches) == 5
    assert stats.fired["full"] >= 1
    assert all(o["logits"].shape == (3,) for o in outs)


def test_timeout_fires_a_partial_batch():
    gated = GatedPolicy(make_mlp())
    with BatchedPolicyServer(gated, max_batch_size=64, timeout=0.001) as server:
        remote = server.remote_policy()
        first = remote.submit(obs())
        assert gated.entered.wait(10)
        # `first`'s caller becomes idle (known, not waiting) once served; the
        # next batch cannot fill up, so it waits out the timeout.
        gated.gate.set()
        first.result(10)
        server.remote_policy().submit(obs()).result(10)
        stats = server.statistics()
    assert stats.fired.get("timeout", 0) + stats.fired.get("all_waiting", 0) == stats.batches


# -- the error model ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"observation": torch.randn(8)}, "a request must be a TensorDictBase, got dict"),
        (TensorDict(obs=torch.randn(8)), "key 'observation': missing; the policy reads \\['observation'\\]"),
        (
            TensorDict(observation=torch.randn(8).double()),
            "key 'observation': expected dtype torch.float32, got torch.float64",
        ),
        (
            TensorDict(observation=torch.randn(5)),
            r"key 'observation': expected feature shape \(8,\) after the batch dims \[\], got shape \(5,\)",
        ),
        (TensorDict(observation=torch.randn(8, device="meta")), "key 'observation': expected device cpu, got meta"),
        (
            TensorDict(observation=torch.randn(0, 8), batch_size=[0]),
            r"a request needs at least one row, got batch size \[0\]",
        ),
        (
            TensorDict(observation=torch.randn(8)).share_memory_(),
            r"a request's TensorDict must be unlocked: the outputs are written into it; this one is locked",
        ),
    ],
)
def test_bad_requests_fail_their_caller_only(policy, net, bad, message):
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        good = remote(obs())  # fixes the layout
        # remote(x) with a non-TensorDict x reads x as the first in_key (dispatch)
        call_message = "key 'observation': expected a tensor, got TensorDict" if isinstance(bad, dict) else message
        with pytest.raises(BadRequestError, match=call_message):
            remote(bad)
        with pytest.raises(BadRequestError, match=message):
            remote.submit(bad)
        with pytest.raises(BadRequestError, match=message):
            asyncio.run(remote.acall(bad))
        after = remote(obs())  # the server keeps serving
        stats = server.statistics()
    assert stats.rejected_requests == 3 and stats.failed_batches == 0
    with torch.no_grad():
        for td in (good, after):
            torch.testing.assert_close(td["logits"], net(td["observation"]))


def test_a_failed_first_batch_does_not_fix_the_layout(net):
    calls = []

    def flaky(x):
        calls.append(x.shape)
        if x.shape[-1] != 8:
            raise ValueError("wrong width")
        return net(x)

    policy = TensorDictModule(flaky, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        with pytest.raises(ValueError, match="wrong width"):
            remote(obs(n=5))
        assert remote(obs())["logits"].shape == (3,)  # 8 wide is accepted now


@pytest.mark.parametrize("kind", ["composite", "sample"])
def test_an_input_spec_fixes_the_layout_before_the_first_request(net, kind):
    from torchrl.data import Composite, Unbounded

    spec = (
        Composite(observation=Unbounded(shape=(3, 8)), shape=(3,))  # e.g. the observation_spec of 3 envs
        if kind == "composite"
        else TensorDict(observation=torch.zeros(3, 8), batch_size=[3])  # e.g. their reset()
    )
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, input_spec=spec) as server:
        remote = server.remote_policy()
        with pytest.raises(
            BadRequestError, match=r"expected feature shape \(8,\) after the batch dims \[\], got shape \(5,\)"
        ):
            remote(obs(n=5))  # the first request: it fixes nothing
        with pytest.raises(BadRequestError, match="key 'observation': expected dtype torch.float32, got torch.float64"):
            remote(TensorDict(observation=torch.randn(8).double()))
        one, many = remote(obs()), remote(obs(2, 2))  # any batch dims: the spec's 3 envs are not the requests'
        assert server.statistics().rejected_requests == 2
    with torch.no_grad():
        for td in (one, many):
            torch.testing.assert_close(td["logits"], net(td["observation"]))


def test_an_input_spec_leaves_the_collates_variable_dims_free():
    from torchrl_batchserve import PadCollate

    policy = TensorDictModule(lambda tokens, mask: tokens * 2, in_keys=["tokens", "mask"], out_keys=["logits"])
    spec = TensorDict(tokens=torch.zeros(16, 3))  # the mask is the collate's: the spec need not have it
    with BatchedPolicyServer(policy, collate=PadCollate(["tokens"]), input_spec=spec) as server:
        assert server.submit(TensorDict(tokens=torch.ones(5, 3))).result(10)["logits"].shape == (5, 3)
        with pytest.raises(BadRequestError, match=r"key 'tokens': expected feature shape \(\*, 3\)"):
            server.submit(TensorDict(tokens=torch.ones(5, 4)))


def test_a_refused_server_leaves_the_policy_where_it_was(policy):
    with pytest.raises(ValueError, match="input_spec has no entry 'observation'"):
        BatchedPolicyServer(policy, device=["cpu", "cpu"], input_spec=TensorDict(obs=torch.zeros(8)))
    with pytest.raises(ValueError, match="the meta device holds no values to serve"):
        BatchedPolicyServer(policy, device="meta")
    assert {p.device.type for p in policy.parameters()} == {"cpu"}


class GatedExploding(GatedPolicy):
    def forward(self, td):
        super().forward(td)
        if (td["observation"] == 1000).any():
            raise ValueError("policy exploded")
        return td


def test_policy_exception_reaches_every_caller_of_the_batch_and_serving_goes_on(net):
    gated = GatedExploding(net)
    with BatchedPolicyServer(gated, max_batch_size=3, timeout=1e6) as server:
        remote = server.remote_policy()
        first = remote.submit(obs())
        assert gated.entered.wait(10)
        bomb = obs()
        bomb["observation"][0] = 1000
        futs = [remote.submit(bomb), remote.submit(obs()), remote.submit(obs())]
        gated.gate.set()
        first.result(10)
        for f in futs:
            with pytest.raises(ValueError, match="policy exploded"):
                f.result(10)
        ok = remote(obs())
        stats = server.statistics()
    assert ok["logits"].shape == (3,)
    assert stats.failed_batches == 1


def test_close_cancel_pending_fails_queued_and_lets_inflight_finish():
    gated = GatedPolicy(make_mlp())
    server = BatchedPolicyServer(gated, max_batch_size=2, timeout=1e6).start()
    remote = server.remote_policy()
    inflight = remote.submit(obs())
    assert gated.entered.wait(10)
    queued = [remote.submit(obs()) for _ in range(3)]
    assert server.close(wait=False, cancel_pending=True) is False  # the forward still runs
    for f in queued:
        with pytest.raises(ServerClosedError, match="closed before this request ran"):
            f.result(10)
    with pytest.raises(ServerClosedError):
        remote.submit(obs())
    with pytest.raises(ServerClosedError):
        remote(obs())
    gated.gate.set()
    assert inflight.result(10)["logits"].shape == (3,)
    assert server.close() is True and server.close() is True  # idempotent


def test_graceful_close_serves_what_was_queued():
    gated = GatedPolicy(make_mlp())
    server = BatchedPolicyServer(gated, max_batch_size=64, timeout=1e6).start()
    remote = server.remote_policy()
    first = remote.submit(obs())
    assert gated.entered.wait(10)
    queued = [remote.submit(obs()) for _ in range(3)]
    server.close(wait=False)
    gated.gate.set()
    assert all(f.result(10)["logits"].shape == (3,) for f in [first, *queued])
    assert server.close() is True
    assert server.statistics().fired["closing"] == 1


def test_a_close_timeout_that_is_no_number_of_seconds_is_refused_and_the_server_serves_on():
    with BatchedPolicyServer(make_mlp(), in_keys=["observation"], out_keys=["logits"]) as server:
        remote = server.remote_policy()
        for bad in (-1, float("nan"), "5"):
            with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds >= 0 \(got"):
                server.close(timeout=bad)
        with pytest.raises(ValueError, match="timeout must be at most threading.TIMEOUT_MAX"):
            server.close(timeout=1e10)
        assert not server.closed
        assert remote(obs())["logits"].shape == (3,)
    assert server.closed


def test_close_wakes_blocked_thread_callers():
    gated = GatedPolicy(make_mlp())
    server = BatchedPolicyServer(gated, max_batch_size=1, timeout=1e6).start()
    remote = server.remote_policy()
    first = remote.submit(obs())
    assert gated.entered.wait(10)
    errors = []
    queued = threading.Event()

    def blocked():
        fut = remote.submit(obs())  # queued behind the gate
        queued.set()
        try:
            fut.result(30)
        except ServerClosedError as err:
            errors.append(err)

    t = threading.Thread(target=blocked)
    t.start()
    assert queued.wait(10)
    server.close(wait=False, cancel_pending=True)
    t.join(10)
    assert len(errors) == 1
    gated.gate.set()
    first.result(10)
    assert server.close()


def test_never_started_server_fails_queued_on_close(policy):
    server = BatchedPolicyServer(policy)
    assert server.close() is True
    with pytest.raises(ServerClosedError):
        server.start()
    with pytest.raises(ServerClosedError):
        server.remote_policy().submit(obs())


def test_a_closed_server_takes_no_weights_and_joins_no_weight_group(policy):
    server = BatchedPolicyServer(policy)
    assert server.update_weights(policy) == 1
    server.close()
    with pytest.raises(ServerClosedError, match="the server is closed and takes no more weights"):
        server.update_weights(policy)
    with pytest.raises(ServerClosedError, match="the server is closed and takes no more weights"):
        server.weight_sync_scheme().send(policy)
    threads = threading.active_count()
    with pytest.raises(ServerClosedError, match="the server is closed and joins no weight group"):
        server.receive_weights("127.0.0.1", 1, 1, 2, timeout=1)  # refused before it would wait for a trainer
    assert server.policy_version == 1 and threading.active_count() == threads


def test_broken_serve_loop_fails_everyone_with_a_typed_error(policy):
    server = BatchedPolicyServer(policy).start()
    remote = server.remote_policy()
    remote(obs())

    def crash():
        raise RuntimeError("loop bug")

    server._replicas[0].refresh = crash  # a failure outside any one batch breaks the loop
    fut = remote.submit(obs())
    with pytest.raises(ServerBrokenError) as info:
        fut.result(10)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(ServerBrokenError):
        remote(obs())
    server.close()


def test_queue_full_is_refused_at_once_and_counted_as_rejected():
    gated = GatedPolicy(make_mlp())
    with BatchedPolicyServer(gated, max_batch_size=64, timeout=1e6, max_queue_size=2) as server:
        remote = server.remote_policy()
        first = remote.submit(obs())
        assert gated.entered.wait(10)
        queued = remote.submit(obs())
        with pytest.raises(QueueFullError):
            remote.submit(obs(2))
        with pytest.raises(BadRequestError, match="the request has 3 rows, more than max_queue_size=2"):
            remote.submit(obs(3))
        gated.gate.set()
        first.result(10), queued.result(10)
        stats = server.statistics()
    assert (stats.rejected_requests, stats.requests) == (2, 2)  # load shed shows: neither refusal ran


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_batch_size": 0}, r"max_batch_size must be an int >= 1 \(got 0\)"),
        ({"max_batch_size": True}, r"max_batch_size must be an int >= 1 \(got True\)"),
        ({"timeout": -1}, r"timeout must be a finite number of seconds >= 0 \(got -1\)"),
        ({"timeout": float("inf")}, r"timeout must be a finite number of seconds >= 0 \(got inf\)"),
        # accepted before, and the serve loop died on its first timed wait (OverflowError), failing its callers
        ({"timeout": 1e10}, r"timeout must be at most threading.TIMEOUT_MAX = 9.2\d+e\+09 seconds, .* \(got 1"),
        ({"forward_timeout": 1e10}, r"forward_timeout must be at most threading.TIMEOUT_MAX = 9.2"),
        ({"max_queue_size": 0}, r"max_queue_size must be an int >= 1 \(got 0\)"),
        ({"device": "nonsense"}, r"device must be a torch.device or a device string \(got 'nonsense'\)"),
        ({"device": []}, r"device must name at least one device \(got an empty sequence\)"),
        ({"device": ["cpu", "nonsense"]}, r"device\[1\] must be a torch.device or a device string"),
        ({"device": ["cpu", None]}, r"device: a sequence names a device for each replica; None is none \(got \["),
        ({"device": ["cpu", "meta"]}, r"device\[1\]='meta': the meta device holds no values to serve"),
        ({"output_device": "meta"}, r"output_device='meta': the meta device holds no values to serve"),
        ({"cost_fn": 3, "max_batch_cost": 4}, r"cost_fn must be callable as cost_fn\(td\) -> int \(got 3\)"),
        ({"cost_fn": LengthCost, "max_batch_cost": 4}, r"cost_fn must be callable .* \(got <class .*LengthCost'>\)"),
        ({"in_keys": ["x"]}, "in_keys/out_keys are taken from a TensorDictModuleBase policy; do not pass them"),
        ({"collate": 3}, "collate must be a Collate"),
        (
            {"input_spec": TensorDict(obs=torch.zeros(8))},
            r"input_spec has no entry 'observation'; the policy reads \['observation'\] from requests, "
            r"the spec has \['obs'\]",
        ),
        ({"input_spec": {"observation": 8}}, "input_spec must be a torchrl.data.Composite or a TensorDict"),
        ({"static_batch_size": 0}, r"static_batch_size must be an int >= 1 \(got 0\)"),
        ({"max_batch_size": 8, "static_batch_size": 4}, r"static_batch_size must be >= max_batch_size=8: .* \(got 4\)"),
        ({"policy_version_key": "logits"}, r"policy_version_key='logits' is one of the policy's out_keys: the stamp"),
        (
            {"policy_version_key": ("observation",)},
            r"policy_version_key=\('observation',\) is one of the policy's in_keys",
        ),
        ({"policy_version_key": 3}, r"policy_version_key: expected a key \(a str or a tuple of str\), got 3"),
        ({"policy_version_key": ("v", 3)}, r"policy_version_key: expected a key .* got \('v', 3\)"),
        ({"policy_version_key": ()}, r"policy_version_key: expected a key .* got \(\)"),
        ({"policy_version_key": ""}, r"policy_version_key: expected a key .* got ''"),
        (
            {"policy_version_key": ("logits", "version")},
            r"policy_version_key=\('logits', 'version'\) nests with the policy's out_keys entry \('logits',\)",
        ),
        (
            {"policy_version_key": ("observation", "version")},
            r"policy_version_key=\('observation', 'version'\) nests with the policy's in_keys entry",
        ),
    ],
)
def test_constructor_validates_arguments(policy, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        BatchedPolicyServer(policy, **kwargs)


def test_a_cuda_device_that_is_not_there_is_refused_at_construction(policy):
    missing = r"there are \d+ CUDA devices" if torch.cuda.is_available() else "this torch build or machine has no CUDA"
    with pytest.raises(ValueError, match=rf"device='cuda:99': {missing}"):
        BatchedPolicyServer(policy, device="cuda:99")
    with pytest.raises(ValueError, match=rf"device\[1\]='cuda:99': {missing}"):
        BatchedPolicyServer(policy, device=["cpu", "cuda:99"])
    with pytest.raises(ValueError, match=rf"output_device='cuda:99': {missing}"):
        BatchedPolicyServer(policy, output_device="cuda:99")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda': this torch build or machine has no CUDA device"):
            BatchedPolicyServer(policy, device="cuda")


def test_only_the_delivered_outputs_go_to_the_output_device(policy):
    # A TensorDictModule returns the batch's inputs with its outputs: they must not travel back from the device.
    replica = Replica(served_copy(policy, None), None, ShadowWeights(TensorDict.from_module(policy)), 0)
    output = TensorDict(observation=torch.randn(4, 8), logits=torch.randn(4, 3), batch_size=[4])
    moved = replica.fetch(output, ["logits"], torch.device("meta"))
    assert set(moved.keys()) == {"logits"} and moved["logits"].is_meta
    assert replica.fetch(output, ["logits"], torch.device("cpu")) is output  # already there: nothing moves


def test_a_server_passed_where_its_policy_goes_is_refused_with_what_to_pass(policy):
    with BatchedPolicyServer(policy) as server:
        with pytest.raises(TypeError, match=r"pass server.remote_policy\(\) to actors"):
            BatchedPolicyServer(server)


def test_update_weights_takes_the_version_given_refuses_one_that_does_not_increase_and_bad_weights(policy):
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        weights = TensorDict.from_module(policy).data.clone()
        assert server.update_weights(weights, version=10) == 10
        assert int(remote(obs())["policy_version"]) == 10
        with pytest.raises(WeightSyncError, match="version must increase: staged 10, got 10"):
            server.update_weights(weights, version=10)
        for odd in (10.5, True, "11"):  # 10.5 was staged, and stamped on results as a version
            with pytest.raises(WeightSyncError, match=f"version must be an int .*, got {odd!r}"):
                server.update_weights(weights, version=odd)
        with pytest.raises(
            WeightSyncError, match="weights must be a TensorDict, an nn.Module or a state_dict, got list"
        ):
            server.update_weights([weights])
        odd = weights.clone()
        odd.set(("module", "0", "bias"), NonTensorData("zeros"))
        with pytest.raises(WeightSyncError, match=r"weight \('module', '0', 'bias'\): expected a tensor"):
            server.update_weights(odd)
        assert server.update_weights(weights) == 11  # the refused pushes changed nothing
        assert int(remote(obs())["policy_version"]) == 11
        assert server.update_weights(weights, version=torch.tensor(12)) == 12  # an integer tensor is an int
        # Results carry the version as an int64: 2**63 was staged, and then every batch failed on its stamp.
        with pytest.raises(WeightSyncError, match=r"version must be at most 2\*\*63 - 1 .*, got 9223372036854775808"):
            server.update_weights(weights, version=2**63)
        assert server.update_weights(weights, version=2**63 - 1) == 2**63 - 1
        with pytest.raises(WeightSyncError, match="version must be at most"):
            server.update_weights(weights)  # the next one would not fit either
        assert int(remote(obs())["policy_version"]) == 2**63 - 1


@pytest.mark.parametrize("wrapped", ["plain", "TensorDictModule", "compiled", "compiled trainer"])
def test_the_weights_of_the_module_a_tensordictmodule_wraps_are_taken_as_its_own(wrapped):
    # a served TensorDictModule(net) names net's weights under "module", a torch.compile(net) under "_orig_mod"
    net = make_mlp()
    if wrapped == "compiled":
        net = torch.compile(net, backend="eager")
    keys = {"in_keys": ["observation"], "out_keys": ["logits"]}
    server = (
        BatchedPolicyServer(net, **keys) if wrapped == "plain" else BatchedPolicyServer(TensorDictModule(net, **keys))
    )
    with server:
        remote = server.remote_policy()
        trained = make_mlp(seed=3)
        pushed = torch.compile(trained, backend="eager") if wrapped == "compiled trainer" else trained
        assert server.update_weights(pushed) == 1  # the module itself, not the wrapper the server serves
        assert server.update_weights(pushed.state_dict()) == 2
        out = remote(obs())
        with torch.no_grad():
            torch.testing.assert_close(out["logits"], trained(out["observation"]))
        other = trained.state_dict()
        other["0.weight"] = other["0.weight"].to(torch.int32)
        with pytest.raises(
            WeightSyncError, match=r"weight \('module', .*'0', 'weight'\): expected .*dtype torch.float32"
        ):
            server.update_weights(other)  # nested, then checked like any push
        with pytest.raises(WeightSyncError, match="weights do not match the served policy"):
            server.update_weights(torch.nn.Linear(8, 3))


def test_a_dynamically_quantized_policy_is_served_and_refuses_pushes_saying_why():
    # Its packed weights are no parameters or buffers: a push found the served policy missing nothing and said only that.
    net = make_mlp(seed=3)
    quantized = torch.ao.quantization.quantize_dynamic(net, {torch.nn.Linear}, dtype=torch.qint8)
    policy = TensorDictModule(quantized, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        out = server.remote_policy()(obs())
        torch.testing.assert_close(out["logits"], quantized(out["observation"].unsqueeze(0))[0])
        with pytest.raises(WeightSyncError, match="it holds none that TensorDict.from_module sees .*quantized"):
            server.update_weights(net)


def test_a_server_in_half_precision_takes_a_float32_trainers_weights_cast_and_refuses_other_dtypes():
    # Serving in bfloat16 while training in float32: each floating weight is cast as it is staged.
    served = make_mlp().to(torch.bfloat16)
    policy = TensorDictModule(served, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        trainer = make_mlp(seed=4)
        assert server.update_weights(trainer) == 1
        td = server.remote_policy()(TensorDict(observation=torch.randn(8, dtype=torch.bfloat16)))
        expected = copy.deepcopy(trainer).to(torch.bfloat16)
        with torch.no_grad():
            torch.testing.assert_close(td["logits"], expected(td["observation"]))
        assert all(p.dtype == torch.float32 for p in trainer.parameters())  # read, never cast in place
        with pytest.raises(WeightSyncError, match=r"dtype torch.bfloat16, got shape .* and dtype torch.int64"):
            server.update_weights({k: v.long() for k, v in trainer.state_dict().items()})


class WithConstant(torch.nn.Module):
    """A linear layer on the input plus a non-persistent buffer (as a positional encoding often is)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(8, 3)
        self.register_buffer("offset", torch.full((8,), float(seed)), persistent=False)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.linear(observation + self.offset)


def test_a_state_dict_may_leave_out_the_buffers_a_state_dict_leaves_out():
    # state_dict() has no non-persistent buffers, so every push of one was refused as "missing"
    served = WithConstant(seed=0)
    with BatchedPolicyServer(TensorDictModule(served, in_keys=["observation"], out_keys=["logits"])) as server:
        remote = server.remote_policy()
        trained = WithConstant(seed=5)
        assert server.update_weights(trained.state_dict()) == 1  # the served offset stays
        out = remote(obs())
        with torch.no_grad():
            torch.testing.assert_close(out["logits"], trained.linear(out["observation"] + served.offset))
        assert server.update_weights(trained) == 2  # a module pushes its offset too
        out = remote(obs())
        with torch.no_grad():
            torch.testing.assert_close(out["logits"], trained(out["observation"]))
        partial = {"linear.weight": trained.linear.weight}
        with pytest.raises(WeightSyncError, match=r"missing \[.*'linear', 'bias'"):  # a parameter may not be
            server.update_weights(partial)


def test_a_push_that_leaves_out_a_buffer_keeps_the_value_an_earlier_push_gave_it_even_if_no_batch_ran_between():
    # A replica applies only the newest snapshot: one that left the buffer out made it skip the value of the
    # push before it, so results stamped with the newest version used the buffer the server was built with.
    served = WithConstant(seed=0)
    policy = TensorDictModule(served, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, device=["cpu", "cpu"]) as server:
        remote = server.remote_policy()
        remote(obs())  # both replicas are built; neither has served a push
        pushed, later = WithConstant(seed=5), WithConstant(seed=7)
        assert server.update_weights(pushed) == 1  # offset 5
        assert server.update_weights(later.state_dict()) == 2  # no offset: 5 stays
        results = [remote(obs()) for _ in range(8)]
    assert all(int(out["policy_version"]) == 2 for out in results)
    with torch.no_grad():
        for out in results:
            torch.testing.assert_close(out["logits"], later.linear(out["observation"] + pushed.offset))


def test_a_policy_whose_batch_norm_or_dropout_is_in_training_mode_is_served_with_a_warning_to_call_eval():
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 3)
    )
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with pytest.warns(UserWarning) as caught:
        BatchedPolicyServer(policy).close()
    messages = [str(w.message) for w in caught if "training mode" in str(w.message)]
    assert len(messages) == 2
    assert re.search(r"batch norms \['module.1'\] are in training mode.*policy.eval\(\)", messages[0])
    assert re.search(r"dropouts \['module.2'\] are in training mode: each forward zeroes units", messages[1])
    policy.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with BatchedPolicyServer(policy) as server:  # served in eval mode: no warning, a row of one is fine
            td = server.remote_policy()(obs())
    with torch.no_grad():
        torch.testing.assert_close(td["logits"], net(td["observation"].unsqueeze(0))[0])


class Moded(torch.nn.Module):
    """Its output says the mode it ran in: the input, plus 1 in training mode (as dropout or NoisyLinear differ)."""

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return observation[..., :3] + float(self.training)


@pytest.mark.parametrize("device", [None, ["cpu", "cpu"]])  # a lone caller's batches, or two replicas'
def test_server_eval_and_train_switch_the_served_copies_from_the_next_batch_and_leave_the_trainers_module(device):
    # Before, server.eval() went on to the module the server was built with (the trainer's) and served on unchanged.
    policy = TensorDictModule(Moded(), in_keys=["observation"], out_keys=["logits"]).eval()
    with BatchedPolicyServer(policy, device=device) as server:
        remote, worker = server.remote_policy(), pickle.loads(pickle.dumps(server.remote_policy()))
        modes = [server.training]
        for switch in (server.train, server.eval, server.train):
            switch()
            modes.append(server.training)
            for out in [remote(obs()) for _ in range(4)] + [worker(obs(3))]:
                torch.testing.assert_close(out["logits"], out["observation"][..., :3] + float(server.training))
        remote.eval()  # a RemotePolicy's mode is its own: nothing served changes
        out = remote(obs())
        torch.testing.assert_close(out["logits"], out["observation"][..., :3] + 1.0)
        with pytest.raises(ValueError, match="mode must be a bool"):
            server.train("eval")
    assert modes == [False, True, False, True]
    assert not policy.training and not policy.module.training  # the trainer's module kept its mode


def test_the_cache_never_answers_in_one_mode_with_an_evaluation_computed_in_the_other():
    policy = TensorDictModule(Moded(), in_keys=["observation"], out_keys=["logits"]).eval()
    row = obs()
    with BatchedPolicyServer(policy, cache=EvaluationCache()) as server:
        remote = server.remote_policy()
        outs = [remote(row.clone())]  # computed in eval mode, and kept
        for switch in (server.train, server.eval, server.eval):
            switch()
            outs.append(remote(row.clone()))  # the same row: computed again in the other mode, then a hit
        stats = server.statistics()
    for out, trained in zip(outs, [0.0, 1.0, 0.0, 0.0]):
        torch.testing.assert_close(out["logits"], row["observation"][:3] + trained)
    assert (stats.cache_misses, stats.cache_hits) == (3, 1)


def test_a_policy_with_uninitialized_lazy_weights_is_refused_naming_them():
    # Before, torch's bare error from deep inside the copy; a served copy would also initialize on its own.
    from torchrl.modules import MLP

    policy = TensorDictModule(MLP(out_features=2, num_cells=[8]), in_keys=["observation"], out_keys=["logits"])
    with pytest.raises(ValueError, match=r"\['module.0.weight', 'module.0.bias'\] are not initialized .*policy\(env"):
        BatchedPolicyServer(policy)
    policy(obs())  # initialized: served, with the trainer's weights
    with BatchedPolicyServer(policy) as server:
        out = server.remote_policy()(obs())
        lazy = TensorDictModule(MLP(out_features=2, num_cells=[8]), in_keys=["observation"], out_keys=["logits"])
        for weights in (lazy, lazy.state_dict()):  # a bare RuntimeError from torch before
            with pytest.raises(WeightSyncError, match=r"\('module', '0', 'weight'\).* are not initialized"):
                server.update_weights(weights)
    torch.testing.assert_close(out["logits"], policy(out.clone())["logits"])


def test_a_policy_with_weights_on_the_meta_device_is_refused_naming_them():
    # Before, accepted: every batch then failed with torch's "Tensor on device meta is not on the expected device".
    with torch.device("meta"):
        net = make_mlp()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    for device in (None, "cpu"):
        with pytest.raises(ValueError, match=r"\['module.0.weight', 'module.0.bias', .*\] are on the meta device"):
            BatchedPolicyServer(policy, device=device)
    net.to_empty(device="cpu").load_state_dict(make_mlp().state_dict())
    with BatchedPolicyServer(policy) as server:
        out = server.remote_policy()(obs())
    torch.testing.assert_close(out["logits"], make_mlp()(out["observation"]))


def _compiled_or_pruned(kind: str) -> torch.nn.Module:
    net = make_mlp()
    if kind == "prune":  # its weight is computed from weight_orig and a mask, by a hook, at every call
        from torch.nn.utils import prune

        prune.l1_unstructured(net[0], "weight", amount=0.5)
        return net
    return torch.jit.script(net) if kind == "script" else torch.jit.trace(net, torch.zeros(1, 8))


@pytest.mark.parametrize("kind", ["script", "trace", "prune"])
def test_torchscript_and_pruned_policies_are_served_and_serve_the_weights_their_trainer_pushes(kind):
    # Before, both refused at construction: a ScriptModule's deepcopy cloned its parameters into non-leaf
    # tensors (autograd's "you can only change requires_grad flags of leaf variables"), and a pruned
    # module's computed weight cannot be deep-copied ("Only Tensors created explicitly by the user").
    module = _compiled_or_pruned(kind)
    policy = TensorDictModule(module, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        first = remote(obs())
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.5)  # trained in place, as a trainer does
        assert server.update_weights() == 1
        second = remote(obs())
    with torch.no_grad():
        torch.testing.assert_close(second["logits"], module(second["observation"]))
        torch.testing.assert_close(first["logits"], _compiled_or_pruned(kind)(first["observation"]))
    assert (int(first["policy_version"]), int(second["policy_version"])) == (0, 1)


def test_constructor_rejects_policies_without_keys():
    with pytest.raises(TypeError, match="plain nn.Module: pass in_keys= and out_keys="):
        BatchedPolicyServer(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="policy must be a TensorDictModuleBase or an nn.Module, got int"):
        BatchedPolicyServer(3)


# -- interaction type, statistics, weights -----------------------------------------------------


class Recorder(TensorDictModuleBase):
    def __init__(self):
        super().__init__()
        self.in_keys, self.out_keys = ["observation"], ["seen"]

    def forward(self, td):
        mode = interaction_type()
        td["seen"] = torch.full(td.batch_size, -1 if mode is None else list(InteractionType).index(mode))
        return td


def test_each_request_runs_under_its_callers_interaction_type():
    with BatchedPolicyServer(Recorder(), policy_version_key=None) as server:
        remote = server.remote_policy()
        with set_interaction_type(InteractionType.RANDOM):
            random_td = remote(obs())
        with set_interaction_type(InteractionType.DETERMINISTIC):
            det = remote.submit(obs()).result(10)
        assert int(random_td["seen"]) == list(InteractionType).index(InteractionType.RANDOM)
        assert int(det["seen"]) == list(InteractionType).index(InteractionType.DETERMINISTIC)
        # a relay passes its callers' type, whatever is in effect in the process
        relayed = server.submit(obs(), interaction=InteractionType.MODE).result(10)
        with set_interaction_type(InteractionType.RANDOM):
            unset = server.submit(obs(), interaction=None).result(10)
        assert int(relayed["seen"]) == list(InteractionType).index(InteractionType.MODE)
        assert int(unset["seen"]) == -1
        with pytest.raises(TypeError, match="interaction must be an InteractionType or None"):
            server.submit(obs(), interaction="random")
        # a caller the queue cannot count by: it was queued, and the serve loop died on it, breaking the server
        with pytest.raises(TypeError, match=r"caller must be hashable: it names who waits .*, got \['relay'\]"):
            server.submit(obs(), caller=["relay"])
        served = server.submit(obs(), caller=("relay", 1)).result(10)  # a hashable name is served
        assert "seen" in served.keys() and not server.closed  # and the server serves on


def test_a_batch_leaves_the_process_wide_interaction_type_as_the_callers_left_it(net):
    # tensordict's interaction type is one value for the whole process: the serve thread sets it for a
    # batch only when it differs, and puts the old one back only if nobody changed it meanwhile.
    gated = GatedPolicy(net)
    with BatchedPolicyServer(gated, policy_version_key=None) as server:
        remote = server.remote_policy()
        with set_interaction_type(InteractionType.RANDOM):
            future = remote.submit(obs())
            assert gated.entered.wait(10)  # the batch runs under RANDOM, which the caller set
        assert interaction_type() is None  # the caller's block ended while the batch ran
        gated.gate.set()
        future.result(10)
        assert interaction_type() is None  # the batch did not put back the RANDOM it found
        with set_interaction_type(InteractionType.MODE):
            seen = remote(obs())  # runs under MODE: set by the batch, and put back after it
            assert interaction_type() is InteractionType.MODE
        assert interaction_type() is None
        with set_interaction_type(InteractionType.DETERMINISTIC):
            deterministic = remote.submit(obs())
        deterministic.result(10)  # the batch found DETERMINISTIC (and ran under None once the block ended) or None
        # (then set DETERMINISTIC and put None back): either way, None is what the caller left
        assert interaction_type() is None
    assert seen["logits"].shape == (3,)


def test_forwards_that_end_under_a_type_a_thread_changed_meanwhile_say_so_once_per_process(net, monkeypatch, caplog):
    # A caller's block that ends while its submit's forward runs hands that forward the type it puts back
    # (tensordict keeps one per process): what no server can undo, it can at least say.
    from torchrl_batchserve.gate import GATE

    monkeypatch.setattr(GATE, "_warned", False)
    caplog.set_level(logging.WARNING, logger="torchrl_batchserve.gate")
    gated = GatedPolicy(net, block_first=3)
    gated.gate.set()

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "interaction type changed" in r.getMessage()]

    with BatchedPolicyServer(gated, policy_version_key=None) as server:
        remote = server.remote_policy()
        with set_interaction_type(InteractionType.RANDOM):
            remote(obs())  # a blocking call is done before its block ends
        assert said() == []
        for mode in (InteractionType.RANDOM, InteractionType.MODE):
            gated.gate.clear()
            gated.entered.clear()
            with set_interaction_type(mode):
                future = remote.submit(obs())
                assert gated.entered.wait(10)  # its forward runs under the caller's type
            gated.gate.set()  # the block has ended: the forward goes on under None
            future.result(10)
    assert len(said()) == 1 and "from random to None" in said()[0], said()  # the second time: not again


def test_statistics_is_a_frozen_snapshot(policy):
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        for _ in range(5):
            remote(obs())
        stats = server.statistics()
    assert isinstance(stats, ServerStatistics)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.requests = 0
    assert stats.requests == 5 and stats.batches == sum(stats.batch_size_histogram.values())
    assert sum(stats.fired.values()) == stats.batches
    assert 0 <= stats.queue_wait_p50 <= stats.queue_wait_p99
    assert 0 < stats.forward_p50 <= stats.forward_p99
    assert "requests=5" in stats.summary()


def test_statistics_percentiles_tell_a_held_forward_and_its_queued_request_from_the_typical_ones():
    gated = GatedPolicy(make_mlp())
    hold = 0.5
    with BatchedPolicyServer(gated) as server:
        remote = server.remote_policy()
        held = remote.submit(obs())
        assert gated.entered.wait(10)
        queued = remote.submit(obs())  # waits in the queue while the forward is held
        time.sleep(hold)  # how long the forward is held: a lower bound on its time and on the queued wait
        gated.gate.set()
        held.result(10), queued.result(10)
        for _ in range(98):
            remote(obs())
        stats = server.statistics()
    assert (stats.requests, stats.batches) == (100, 100)
    assert stats.forward_p99 >= hold > stats.forward_p50  # 1 of 100 samples: the 99th percentile is the slowest
    assert stats.queue_wait_p99 >= hold > stats.queue_wait_p50


def test_update_weights_stamps_new_version_on_results(policy, net):
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        before = remote(obs())
        new = make_mlp(seed=1)
        reference = TensorDictModule(new, in_keys=["observation"], out_keys=["logits"])
        assert server.update_weights(reference.state_dict()) == 1
        after = remote(obs())
        assert server.update_weights(TensorDict.from_module(reference)) == 2
        with pytest.raises(WeightSyncError, match=r"weight .*: expected shape \(32, 8\)"):
            bad = TensorDict.from_module(reference).clone()
            bad["module", "0", "weight"] = torch.zeros(32, 9)
            server.update_weights(bad)
        with pytest.raises(WeightSyncError, match="missing"):
            server.update_weights({"module.0.weight": torch.zeros(32, 8)})
        last = remote(obs())
    assert int(before["policy_version"]) == 0
    assert int(after["policy_version"]) == 1 and int(last["policy_version"]) == 2
    with torch.no_grad():
        torch.testing.assert_close(after["logits"], new(after["observation"]))
        torch.testing.assert_close(last["logits"], new(last["observation"]))
    assert server.statistics().weight_updates == 2


def test_statistics_count_the_rows_computed_with_weights_that_a_push_during_their_forward_made_old():
    gated = GatedPolicy(make_mlp())
    with BatchedPolicyServer(gated, max_batch_size=4, timeout=0.0) as server:
        remote = server.remote_policy()
        start = server.statistics()
        running = remote.submit(obs(3))
        assert gated.entered.wait(30)  # its forward runs with the weights of version 0
        assert server.update_weights() == 1 and server.update_weights() == 2
        gated.gate.set()
        assert int(running.result(30)["policy_version"][0]) == 0
        fresh = remote(obs(2))  # the next batch swaps version 2 in: nothing behind
        assert int(fresh["policy_version"][0]) == 2
        stats = server.statistics()
        assert stats.policy_lag_histogram == {0: 2, 2: 3}
        assert (stats.stale_rows, stats.max_policy_lag) == (3, 2)
        assert stats.as_dict()["stale_rows"] == 3 and "stale_rows=3 max_policy_lag=2" in stats.summary()
        remote(obs())
        later = server.statistics(since=stats)
        assert later.policy_lag_histogram == {0: 1} and (later.stale_rows, later.max_policy_lag) == (0, 0)
        assert server.statistics(since=start).policy_lag_histogram == {0: 3, 2: 3}


def test_torchrls_policy_age_filter_drops_rows_stamped_too_long_before_the_servers_version(policy):
    # TorchRL's bounded-staleness filter reads a live version (server.policy_version) and each row's stamp.
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.envs.transforms import PolicyAgeFilter

    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        age = PolicyAgeFilter(lambda: server.policy_version, max_policy_lag=1)
        buffer = ReplayBuffer(storage=LazyTensorStorage(64), transform=age, batch_size=64)
        for version in range(3):
            buffer.extend(remote(obs(4)))  # rows of this version
            assert server.update_weights() == version + 1 == server.policy_version
        assert len(buffer) == 12
        assert set(buffer.sample()["policy_version"].tolist()) == {2}  # versions 0 and 1 lag 3 by more than 1


class SideEffect(TensorDictModuleBase):
    """A policy that writes nothing back (no out_keys): callers still complete."""

    def __init__(self):
        super().__init__()
        self.in_keys, self.out_keys, self.seen = ["observation"], [], 0

    def forward(self, td):
        self.seen += td.batch_size[0]
        return td


def test_requests_complete_when_nothing_is_delivered():
    policy = SideEffect()
    with BatchedPolicyServer(policy, policy_version_key=None) as server:
        remote = server.remote_policy()
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(remote, [obs() for _ in range(20)]))
        assert asyncio.run(remote.acall(obs())) is not None
        served = server.statistics().rows
    assert len(outs) == 20 and served == 21


def _omp_max_threads():
    """The calling thread's OpenMP thread count, read without going through torch."""
    import ctypes
    import pathlib

    lib = next(pathlib.Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*"), None)
    if lib is None:
        pytest.skip("this torch build bundles no libgomp")
    return ctypes.CDLL(str(lib)).omp_get_max_threads


def test_every_serving_thread_runs_the_policy_with_torchs_intra_op_thread_count():
    # torch.set_num_threads reaches a thread only once that thread asks torch
    # for its count; a serving thread that never did would run MKL on an
    # OpenMP team of one thread per core.
    probe = _omp_max_threads()
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append((threading.current_thread().name, probe()))
            return x + 1

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        policy = TensorDictModule(Probe(), in_keys=["x"], out_keys=["y"])
        with BatchedPolicyServer(policy, max_batch_size=4, timeout=0.001) as server:
            remote = server.remote_policy()

            def actor():
                for _ in range(3):  # the serve thread runs the first batch, this lone caller the next ones
                    remote(TensorDict(x=torch.zeros(2)))

            thread = threading.Thread(target=actor, name="fresh-actor")
            thread.start()
            thread.join()
    finally:
        torch.set_num_threads(before)
    assert {name for name, _ in seen} == {"fresh-actor", "batchserve-replica-0"}
    assert [n for _, n in seen] == [1, 1, 1]


def test_statistics_since_an_earlier_snapshot_cover_only_what_came_after(policy):
    with BatchedPolicyServer(policy, max_batch_size=4, timeout=0.001) as server:
        remote = server.remote_policy()
        for _ in range(5):
            remote(obs())
        start = server.statistics()
        futures = [remote.submit(obs(2)) for _ in range(3)]
        for f in futures:
            f.result(timeout=30)
        window = server.statistics(since=start)
        total = server.statistics()
    assert (window.requests, window.rows) == (3, 6)
    assert window.requests + start.requests == total.requests and window.batches == total.batches - start.batches
    assert sum(window.batch_size_histogram.values()) == window.batches
    assert sum(window.fired.values()) == window.batches
    assert sum(r.batches for r in window.replicas) == window.batches
    assert window.forward_p99 > 0
    assert 0 < window.uptime < total.uptime - start.uptime + 1e-6  # the span since start: requests / uptime is a rate
    assert server.statistics().uptime == server.statistics().uptime >= total.uptime  # it stopped at close
    with pytest.raises(TypeError, match="since must be a ServerStatistics .*, got int"):
        server.statistics(since=5)
    # Taken off the wrong counters, these gave negative or inflated counts, silently.
    with BatchedPolicyServer(policy) as other:
        with pytest.raises(ValueError, match=r"an earlier statistics\(\) of this server.*\(got another server's\)"):
            other.statistics(since=start)
    with pytest.raises(ValueError, match=r"taken without since= \(got the difference a statistics\(since=...\)"):
        server.statistics(since=window)


def test_statistics_flatten_for_loggers_and_convert_with_asdict(policy):
    import dataclasses

    from torchrl_batchserve import log_statistics

    with BatchedPolicyServer(policy, max_batch_size=4) as server:
        server.remote_policy()(obs())
        stats = server.statistics()
    flat = stats.as_dict()
    assert flat["requests"] == 1 and flat["mean_batch_size"] == 1.0 and "replica0/batches" in flat
    assert all(isinstance(v, int | float) for v in flat.values())
    assert sum(v for k, v in flat.items() if k.startswith("fired/")) == 1
    assert dataclasses.asdict(stats)["batch_size_histogram"] == {1: 1}

    class Recorder:
        def __init__(self):
            self.scalars = {}

        def log_scalar(self, name, value, step=None):
            self.scalars[name] = (value, step)

    recorder = Recorder()
    log_statistics(recorder, stats, step=7, prefix="serve/")
    assert recorder.scalars["serve/requests"] == (1.0, 7) and len(recorder.scalars) == len(flat)
    with pytest.raises(TypeError, match=r"a ServerStatistics \(server.statistics\(\)\), got BatchedPolicyServer"):
        log_statistics(recorder, server)  # the server where its statistics go
    with pytest.raises(TypeError, match=r"a TorchRL Logger .*got Logger; for a logging.Logger, log statistics.summary"):
        log_statistics(logging.getLogger("trainer"), stats)  # the standard library's, which has no log_scalar


def test_batches_that_mostly_fire_on_the_timeout_far_below_capacity_log_advice_once(policy, caplog, monkeypatch):
    from torchrl_batchserve import stats as stats_module

    monkeypatch.setattr(stats_module, "ADVICE_BATCHES", 32)

    async def one_task_after_another(remote) -> None:
        # Each request from a new task: the last one, served and gone, is a caller the queue still
        # expects, so every batch waits the timeout out, with one row.
        for _ in range(100):
            await asyncio.create_task(remote.acall(obs()))

    with caplog.at_level("WARNING", logger="torchrl_batchserve"):
        with BatchedPolicyServer(policy, max_batch_size=64, timeout=0.0005) as server:
            asyncio.run(one_task_after_another(server.remote_policy()))
            assert server.statistics().fired.get("timeout", 0) >= 90
    advice = [r.getMessage() for r in caplog.records if "fire on the timeout" in r.getMessage()]
    assert len(advice) == 1  # rate-limited: three windows of 32 batches, one message
    assert "max_batch_size=64" in advice[0] and "timeout=0.5 ms" in advice[0] and "1.0 rows" in advice[0]


def test_full_batches_give_no_tuning_advice(policy, caplog, monkeypatch):
    from torchrl_batchserve import stats as stats_module

    monkeypatch.setattr(stats_module, "ADVICE_BATCHES", 8)
    with caplog.at_level("WARNING", logger="torchrl_batchserve"):
        with BatchedPolicyServer(policy, max_batch_size=4, timeout=10.0) as server:
            remote = server.remote_policy()
            for _ in range(16):
                remote.submit(obs(4)).result(timeout=30)  # 4 rows: full at once
    assert not [r for r in caplog.records if "fire on the timeout" in r.getMessage()]


def test_a_zero_timeout_gives_no_tuning_advice(policy, caplog, monkeypatch):
    # every batch "fires on the timeout" at once there: the advice said to lower a timeout of 0 ms
    from torchrl_batchserve import stats as stats_module

    monkeypatch.setattr(stats_module, "ADVICE_BATCHES", 32)

    async def one_task_after_another(remote) -> None:
        for _ in range(100):  # each from a new task: the last one is still expected
            await asyncio.create_task(remote.acall(obs()))

    with caplog.at_level("WARNING", logger="torchrl_batchserve"):
        with BatchedPolicyServer(policy, max_batch_size=64, timeout=0.0) as server:
            asyncio.run(one_task_after_another(server.remote_policy()))
            assert server.statistics().fired.get("timeout", 0) >= 90
    assert not [r for r in caplog.records if "fire on the timeout" in r.getMessage()]
