"""The faults a training loop meets (#21): each one fails only whom it must, and nothing hangs."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref

import pytest
import torch
from conftest import GatedPolicy, make_mlp, no_thread_named, obs, wait_for
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict
from tensordict.nn import TensorDictModule, TensorDictModuleBase

from torchrl_batchserve import (
    BadRequestError,
    BatchedPolicyServer,
    BatchServeError,
    EvaluationCache,
    ForwardTimeoutError,
    PolicyError,
    QueueFullError,
    ServerBrokenError,
    ServerClosedError,
    StackCollate,
    WeightSyncError,
)
from torchrl_batchserve.errors import own_copy
from torchrl_batchserve.intake import Intake
from torchrl_batchserve.queue import RequestQueue
from torchrl_batchserve.request import BlockingRequest, Relay
from torchrl_batchserve.transport.connection import Connection


def client_of(server):
    """A process client of ``server`` in this process (the path a worker process takes)."""
    return pickle.loads(pickle.dumps(server.remote_policy()))


def test_a_reply_the_client_cannot_take_fails_the_caller_reading_it_with_the_typed_error_as_every_other(
    monkeypatch,
):
    # Before, the caller whose thread was reading got the raw exception; the others a ServerBrokenError.
    from torchrl_batchserve.transport.client import ProcessClient

    with BatchedPolicyServer(TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])) as server:
        client = client_of(server)
        client(obs())

        def a_bug(self, conn, message):
            raise RuntimeError("a bug in taking a message")

        monkeypatch.setattr(ProcessClient, "_dispatch", a_bug)
        with pytest.raises(ServerBrokenError, match="reading the server's replies failed") as caught:
            client(obs(3))  # three rows fit no lane: pickled, its reply a message
        assert isinstance(caught.value.__cause__, RuntimeError)
        with pytest.raises(ServerBrokenError, match="reading the server's replies failed"):
            client(obs())  # later calls: the same class


def test_an_interrupted_worker_call_never_shifts_the_replies_of_later_calls():
    gated = GatedPolicy(make_mlp(), block_first=1)
    with BatchedPolicyServer(gated, timeout=0.001) as server:
        client = client_of(server)
        endpoint = client._endpoint
        interrupted = threading.Event()

        def interrupt_after_send(*args):  # the call is interrupted while it waits
            interrupted.set()
            raise KeyboardInterrupt

        real_wait = endpoint._wait
        endpoint._wait = interrupt_after_send
        with pytest.raises(KeyboardInterrupt):
            client(TensorDict(observation=torch.zeros(8)))
        endpoint._wait = real_wait
        assert gated.entered.wait(10)  # the interrupted request is in the forward
        gated.gate.set()
        for _ in range(3):
            td = obs()
            out = client(td)
            with torch.no_grad():
                torch.testing.assert_close(out["logits"], gated.net(td["observation"]))


class OneRowTooMany(TensorDictModuleBase):
    def __init__(self):
        super().__init__()
        self.in_keys, self.out_keys = ["observation"], ["logits"]

    def forward(self, td):
        return TensorDict(logits=torch.zeros(td.batch_size[0] + 1, 3), batch_size=[td.batch_size[0] + 1])


def test_a_policy_returning_wrong_rows_fails_every_path_with_policy_error():
    with BatchedPolicyServer(OneRowTooMany()) as server:
        with pytest.raises(PolicyError, match="out_key 'logits'"):
            server.remote_policy()(obs())
        with pytest.raises(PolicyError, match="out_key 'logits'"):
            client_of(server)(obs())


class StopsOnNegative(torch.nn.Module):
    def forward(self, x):
        if bool((x < 0).any()):
            raise StopIteration("no more moves")  # e.g. next() on an exhausted iterator
        return x[..., :3]


class ChecksStopOnNegative(StackCollate):
    def check(self, keys, values, batch_dims):  # at submit: in the caller's thread, or a worker's hub
        StopsOnNegative()(values[0])


@pytest.mark.parametrize("source", ["policy", "collate check"])
@pytest.mark.parametrize("path", ["thread", "worker"])
def test_a_stop_iteration_from_user_code_reaches_every_caller_as_a_runtime_error_and_asyncio_ones_too(path, source):
    # An asyncio future refuses a StopIteration: its callers waited forever (the loop logged a TypeError).
    net = StopsOnNegative() if source == "policy" else torch.nn.Identity()
    collate = ChecksStopOnNegative() if source == "collate check" else None
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, collate=collate, timeout=0.001) as server:
        remote = server.remote_policy() if path == "thread" else client_of(server)

        async def calls() -> list:
            tds = [TensorDict(observation=torch.ones(8) if i % 2 else -torch.ones(8)) for i in range(6)]
            return await asyncio.gather(*(asyncio.wait_for(remote.acall(td), 30) for td in tds), return_exceptions=True)

        outcomes = [*asyncio.run(calls())]
        with pytest.raises(RuntimeError, match=r"raised StopIteration\('no more moves'\)") as caught:
            remote(TensorDict(observation=-torch.ones(8)))
        if path == "thread":
            assert isinstance(caught.value.__cause__, StopIteration)
        assert remote(TensorDict(observation=torch.ones(8)))["logits"].shape[0] > 0  # and serving goes on
    failed = [o for o in outcomes if isinstance(o, BaseException)]  # a failed batch fails its positive rows too
    assert len(failed) >= 3 and all(type(e) is RuntimeError and "StopIteration" in str(e) for e in failed), outcomes


class FailsOnSeveralRows(torch.nn.Module):
    def forward(self, x):
        if x.shape[0] > 1:
            raise ValueError("boom")
        return x[:, :3]


def _frames(error: BaseException) -> list[str]:
    return [frame.f_code.co_name for frame, _ in traceback.walk_tb(error.__traceback__)]


def test_each_caller_of_a_failed_batch_gets_its_own_exception_with_only_its_own_frames():
    # One instance raised by every caller would gather each raise's frames in its traceback: the second
    # caller's would show the first caller's call too, and keep its frames alive.
    policy = GatedPolicy(FailsOnSeveralRows())

    def result_of(future):
        return future.result(10)

    with BatchedPolicyServer(policy, max_batch_size=4, timeout=60.0) as server:
        first = server.submit(obs())
        assert policy.entered.wait(10)
        futures = [server.submit(obs()) for _ in range(4)]  # queued behind the held batch: one batch of 4
        policy.gate.set()
        first.result(10)
        errors = []
        for future in futures:
            with pytest.raises(ValueError, match="boom") as caught:
                result_of(future)
            errors.append(caught.value)
    assert policy.batches == [1, 4]
    assert len({id(e) for e in errors}) == 4
    for error in errors:
        frames = _frames(error)
        assert frames.count("result_of") == 1, frames  # its own call, nobody else's
        assert frames[-1] == "forward" and "_run" in frames  # and the server's frames down to the policy's raise


def test_each_thread_of_a_worker_waiting_when_the_server_closes_gets_its_own_exception():
    policy = GatedPolicy(make_mlp(), block_first=100)
    policy.gate.set()
    server = BatchedPolicyServer(policy, max_batch_size=8, timeout=60.0)
    errors: dict[int, BaseException] = {}

    def call_in_thread(i: int) -> None:
        try:
            client(obs())
        except BaseException as err:
            errors[i] = err

    try:
        client = client_of(server)
        client(obs())  # connected
        hub = server._endpoint.lazy_hub.hub
        before = sum(hub.arrived.values())
        policy.gate.clear()
        threads = [threading.Thread(target=call_in_thread, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        wait_for(lambda: sum(hub.arrived.values()) - before == 3, "the three requests at the hub")
        server.close(wait=False)  # the hub tells the client, whose three callers are still waiting
        for thread in threads:
            thread.join(30)
    finally:
        policy.gate.set()
        server.close(timeout=10)
    assert sorted(errors) == [0, 1, 2] and all(isinstance(e, ServerClosedError) for e in errors.values()), errors
    assert len({id(e) for e in errors.values()}) == 3
    assert all(_frames(e).count("call_in_thread") == 1 for e in errors.values())


def test_cancelling_a_coalesced_request_leaves_the_serve_loop_serving():
    gated = GatedPolicy(make_mlp(), block_first=1)
    with BatchedPolicyServer(gated, cache=EvaluationCache(), timeout=0.001) as server:
        remote = server.remote_policy()
        warm = remote.submit(obs())
        assert gated.entered.wait(10)
        same = torch.ones(8)
        leader = remote.submit(TensorDict(observation=same.clone()))
        follower = remote.submit(TensorDict(observation=same.clone()))  # joins the leader's row
        assert server.statistics().cache_coalesced == 1
        assert follower.cancel()
        gated.gate.set()
        warm.result(10)
        assert leader.result(10)["logits"].shape == (3,)
        after = remote.submit(obs()).result(10)  # the loop is alive
        assert after["logits"].shape == (3,)
    assert server.close() is True


def test_a_malformed_request_queued_before_any_success_never_locks_the_good_ones_out():
    calls = {"n": 0}
    net = make_mlp()

    class Flaky(GatedPolicy):
        def forward(self, td):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("transient")
            return super().forward(td)

    gated = Flaky(net, block_first=1)
    with BatchedPolicyServer(gated, timeout=0.001, max_batch_size=1) as server:
        remote = server.remote_policy()
        with pytest.raises(RuntimeError, match="transient"):
            remote(obs())
        good = remote.submit(obs())
        assert gated.entered.wait(10)  # the next batch runs
        bad = remote.submit(obs(n=5))  # no layout yet: accepted, queued
        later = remote.submit(obs())
        gated.gate.set()
        assert good.result(10)["logits"].shape == (3,)
        with pytest.raises(BadRequestError, match=r"key 'observation': expected feature shape \(8,\)"):
            bad.result(10)
        assert later.result(10)["logits"].shape == (3,)
        with pytest.raises(BadRequestError):
            remote(obs(n=5))  # refused at submit from now on


class CastsToFloat(GatedPolicy):
    def forward(self, td):
        td.set("observation", td.get("observation").float())
        return super().forward(td)


def test_two_layouts_served_at_once_by_two_replicas_fix_one_and_the_others_callers_get_bad_request_error():
    gated = CastsToFloat(make_mlp(), block_first=2)
    with BatchedPolicyServer(gated, device=["cpu", "cpu"], timeout=0.001, max_batch_size=1) as server:
        remote = server.remote_policy()
        single = remote.submit(obs())
        wait_for(lambda: len(gated.batches) == 1, "a replica in the first forward")
        double = remote.submit(TensorDict(observation=torch.randn(8, dtype=torch.float64)))
        wait_for(lambda: len(gated.batches) == 2, "the other replica in the second forward")  # no layout yet
        gated.gate.set()
        outcomes = [f.exception(10) for f in (single, double)]
        won = outcomes.index(None)  # the first to finish fixes the layout: the other's outputs are not handed out
        assert isinstance(outcomes[1 - won], BadRequestError), outcomes
        kinds = [obs, lambda: TensorDict(observation=torch.randn(8, dtype=torch.float64))]
        assert remote(kinds[won]())["logits"].shape == (3,)  # the winner's layout is the server's
        with pytest.raises(BadRequestError, match="dtype"):
            remote(kinds[1 - won]())  # refused at submit from now on


class Bomb:
    """Pickles fine, and raises when the hub unpickles it."""

    def __reduce__(self):
        return (_explode, ())


def _explode():
    raise RuntimeError("this message cannot be read")


def test_a_message_the_hub_cannot_read_fails_that_request_only():
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        client = client_of(server)
        with pytest.raises(RuntimeError, match="this message cannot be read"):
            client(TensorDict(observation=NonTensorData(Bomb())))
        assert client(obs())["logits"].shape == (3,)  # the hub survived
        assert client_of(server)(obs())["logits"].shape == (3,)


def test_a_client_stalled_in_the_handshake_blocks_no_one():
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    server = BatchedPolicyServer(policy)
    client = client_of(server)
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.connect(server._endpoint.lazy_hub.hub.address)  # and never sends its key
    try:
        assert client(obs())["logits"].shape == (3,)
        start = time.monotonic()
        assert server.close(timeout=5) is True
        assert time.monotonic() - start < 5
    finally:
        stalled.close()


def test_a_hanging_forward_fails_its_callers_past_forward_timeout_and_close_gives_up_on_time():
    gated = GatedPolicy(make_mlp(), block_first=1)
    server = BatchedPolicyServer(gated, forward_timeout=0.2, max_batch_size=1)
    remote = server.remote_policy()
    stuck = remote.submit(obs())
    assert gated.entered.wait(10)
    queued = remote.submit(obs())
    with pytest.raises(ForwardTimeoutError):
        stuck.result(10)
    with pytest.raises(ServerBrokenError):
        queued.result(10)
    with pytest.raises(ServerBrokenError):
        remote(obs())
    assert server.close(timeout=0.5) is False  # the stuck thread cannot be stopped
    gated.gate.set()


def test_a_lone_blocking_caller_whose_forward_hangs_gets_the_timeout_too():
    # A lone blocking caller runs its own batch, in its own thread: stuck in a forward that hung, it could never
    # be told of forward_timeout. With forward_timeout set, the serve loop runs every batch.
    gated = GatedPolicy(make_mlp(), block_first=3)
    server = BatchedPolicyServer(gated, forward_timeout=0.2)
    remote = server.remote_policy()
    gated.gate.set()
    outcome: dict = {}

    def lone_caller() -> None:
        remote(obs())  # the only caller of its batch, twice: a lone caller from now on
        remote(obs())
        gated.gate.clear()  # the next forward hangs
        try:
            remote(obs())
        except ForwardTimeoutError as err:
            outcome["error"] = err

    caller = threading.Thread(target=lone_caller)
    caller.start()
    caller.join(10)
    assert not caller.is_alive() and "error" in outcome
    assert server.close(timeout=0.5) is False
    gated.gate.set()


def test_close_that_gives_up_fails_every_queued_request():
    gated = GatedPolicy(make_mlp(), block_first=1)
    server = BatchedPolicyServer(gated, max_batch_size=1, timeout=1e6)
    remote = server.remote_policy()
    first = remote.submit(obs())
    assert gated.entered.wait(10)
    queued = [remote.submit(obs()) for _ in range(3)]
    assert server.close(timeout=0.3) is False
    for f in queued:
        with pytest.raises(ServerClosedError):
            f.result(1)
    gated.gate.set()
    assert first.result(10)["logits"].shape == (3,)


def test_an_identical_request_after_update_weights_gets_the_new_version():
    gated = GatedPolicy(make_mlp(), block_first=1)
    with BatchedPolicyServer(gated, cache=EvaluationCache(), timeout=0.001) as server:
        remote = server.remote_policy()
        same = torch.ones(8)
        leader = remote.submit(TensorDict(observation=same.clone()))
        assert gated.entered.wait(10)  # in flight with version 0
        version = server.update_weights(gated)
        after = remote.submit(TensorDict(observation=same.clone()))  # must not join the old computation
        gated.gate.set()
        assert int(leader.result(10)["policy_version"]) == 0
        assert int(after.result(10)["policy_version"]) == version == 1


@pytest.mark.parametrize(
    "value, message",
    [
        (torch.randn(8).to_sparse(), "expected a dense \\(strided\\) tensor, got layout torch.sparse_coo"),
        (torch.nested.nested_tensor([torch.randn(8)]), "a nested tensor"),
    ],
)
def test_tensors_no_collate_can_batch_are_refused_at_submit(value, message):
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        with pytest.raises(BadRequestError, match=message):
            remote.submit(TensorDict(observation=value, batch_size=[]))
        assert remote(obs())["logits"].shape == (3,)
        with pytest.raises(BadRequestError, match=message):
            remote.submit(TensorDict(observation=value, batch_size=[]))


def test_zero_rows_are_refused_the_same_way_in_process_and_from_a_worker():
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        worker = client_of(server)
        for remote in (server.remote_policy(), worker):
            with pytest.raises(BadRequestError, match="at least one row"):
                remote(obs(0))
        worker(obs())  # a worker's request in its lane, and a refused one there too
        with pytest.raises(BadRequestError, match="at least one row"):
            worker(obs(0))
        assert worker(obs())["logits"].shape == (3,)
        assert server._endpoint.lazy_hub.hub.arrived == {"lane": 1, "socket": 1}  # (refused requests are not counted)


def test_a_lazy_stack_of_rows_of_differing_shapes_is_refused_by_key_in_process_and_from_a_worker():
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        for remote in (server.remote_policy(), client_of(server)):
            rows = LazyStackedTensorDict(obs(), obs(n=5), stack_dim=0)
            with pytest.raises(BadRequestError, match="key 'observation': cannot be read as one batched entry"):
                remote(rows)
            assert remote(LazyStackedTensorDict(obs(), obs(), stack_dim=0))["logits"].shape == (2, 3)


def test_meta_weights_are_refused_with_a_weight_sync_error():
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        with pytest.raises(WeightSyncError, match="meta device"):
            server.update_weights(TensorDict.from_module(policy).to("meta"))
        assert int(server.remote_policy()(obs())["policy_version"]) == 0


def test_a_server_dropped_without_close_ends_its_threads_and_releases_its_socket_and_descriptors(monkeypatch):
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    server = BatchedPolicyServer(policy)
    client = client_of(server)
    client(obs())
    hub = server._endpoint.lazy_hub.hub
    threads, folder = [*server._serving.threads, hub._accepter, hub._reader], os.path.dirname(hub.address)
    pipe = {fd: os.fstat(fd).st_ino for fd in (hub._wake_r, hub._wake_w)}  # the reader's wake-up pipe
    # The hub's reader is busy with a request when the server goes, so the finalizer's close cannot wait for it.
    busy, release, outcome = threading.Event(), threading.Event(), []
    take = Intake.request

    def held(*args, **kwargs):
        busy.set()
        release.wait(10)
        return take(*args, **kwargs)

    monkeypatch.setattr(Intake, "request", held)

    def call():
        try:
            client(obs())
        except BatchServeError as err:
            outcome.append(err)

    caller = threading.Thread(target=call)
    caller.start()
    assert busy.wait(10)
    ref, queue = weakref.ref(server), server._queue
    del server, hub
    gc.collect()
    assert ref() is None
    # The reaper thread abandons it: released before that, the request would be queued and served.
    wait_for(lambda: queue.closed, "the dropped server's queue closed by the reaper")
    release.set()
    for t in [*threads, caller]:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    wait_for(lambda: not os.path.exists(folder), "the hub's folder removed")  # by the reaper, after its threads end
    assert isinstance(outcome[0], ServerClosedError)
    assert not [fd for fd, inode in pipe.items() if inode == _inode(fd)]  # closed by the reader on its way out


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def test_a_remote_policy_keeps_its_server_serving_after_the_last_other_reference_is_gone():
    # Collector(env, BatchedPolicyServer(policy).remote_policy()) must keep serving.
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    server = BatchedPolicyServer(policy)
    remote, ref, threads = server.remote_policy(), weakref.ref(server), list(server._serving.threads)
    del server
    gc.collect()
    x = obs()
    with torch.no_grad():
        expected = policy(x.clone())["logits"]
    torch.testing.assert_close(remote(x)["logits"], expected)
    del remote
    gc.collect()
    assert ref() is None  # the last RemotePolicy gone: the server is collected, its finalizer ends its loops
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def test_a_server_collected_inside_its_serve_loops_queue_lock_fails_what_is_queued_rather_than_hang(monkeypatch):
    # A server in a reference cycle is collected inside whichever allocation of whichever thread runs the garbage
    # collector: here one in its serve loop, under its queue's lock, which the finalizer waited for forever.
    pop = RequestQueue._pop

    def collecting(self):
        gc.collect()  # what any allocation made here may run
        return pop(self)

    gated = GatedPolicy(make_mlp())
    server = BatchedPolicyServer(gated, max_batch_size=2)
    remote, ref, threads = server.remote_policy(), weakref.ref(server), list(server._serving.threads)
    first = remote.submit(obs())
    assert gated.entered.wait(10)
    futures = [first, *(remote.submit(obs()) for _ in range(4))]
    gc.disable()
    try:
        monkeypatch.setattr(RequestQueue, "_pop", collecting)
        del server, remote
        assert ref() is not None  # a cycle: only a collection frees it
        gated.gate.set()
        outcomes = []
        for future in futures:
            try:
                outcomes.append(future.result(20)["logits"].shape)
            except ServerClosedError:
                outcomes.append("closed")
    finally:
        gc.enable()
    assert ref() is None and outcomes[0] == (3,) and "closed" in outcomes
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def test_a_server_whose_second_serve_thread_cannot_start_raises_and_leaves_no_thread_waiting(monkeypatch):
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    started: list = []
    start = threading.Thread.start

    def recorded(thread):
        if thread.name.startswith("batchserve-replica"):
            started.append(thread)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", recorded)
    with no_thread_named("batchserve-replica-1"), pytest.raises(RuntimeError, match="can't start new thread"):
        BatchedPolicyServer(policy, device=["cpu", "cpu"])
    assert [t.name for t in started] == ["batchserve-replica-0"]
    started[0].join(10)
    assert not started[0].is_alive()  # it waited for requests forever


def test_a_program_that_exits_while_an_unclosed_servers_forward_runs_exits_cleanly():
    # The serve thread was ended inside torch as the interpreter finalized: "terminate called without an active
    # exception", and the process aborted (exit code 134) on Python 3.11-3.13.
    script = (
        "import threading, torch\n"
        "from tensordict import TensorDict\n"
        "from tensordict.nn import TensorDictModule\n"
        "from torchrl_batchserve import BatchedPolicyServer\n"
        "entered = threading.Event()\n"
        "class Slow(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        entered.set()\n"
        "        a = torch.randn(600, 600)\n"
        "        for _ in range(30):\n"
        "            a = a @ a / 600\n"
        "        return x[..., :2] + a[0, 0]\n"
        "server = BatchedPolicyServer(TensorDictModule(Slow(), ['observation'], ['logits']))\n"
        "future = server.remote_policy().submit(TensorDict(observation=torch.randn(4)))\n"
        "assert entered.wait(30)\n"
        "print('exits while the forward runs')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout.strip()) == (0, "exits while the forward runs"), out.stderr[-2000:]


def test_a_hub_client_dropped_twice_closes_no_descriptor_that_reused_its_numbers():
    # Closing a client is idempotent: the numbers of its descriptors may be another file's by the second call.
    ours, theirs = socket.socketpair()
    client = Connection(ours, 1, on_backlog=lambda client: None)
    os.close(client.headers_fd)  # (the handshake's, once the worker has it)
    bells = {client.requests_bell, client.replies_bell}
    client.close()
    reused = []
    while not bells <= set(reused):  # Linux gives the lowest free numbers: the bells' are taken again
        reused.append(os.eventfd(0))
        assert len(reused) <= 8, "the freed numbers were not reused"
    try:
        client.close()
        for fd in reused:
            os.fstat(fd)  # still open: the second close closed nothing of anyone else's
    finally:
        for fd in reused:
            with contextlib.suppress(OSError):
                os.close(fd)
        theirs.close()


class HeldCheck(StackCollate):
    """A collate whose request check (run by whoever validates: the hub's reader for a worker) can be held."""

    def __init__(self):
        super().__init__()
        self.hold, self.entered, self.release = threading.Event(), threading.Event(), threading.Event()

    def check(self, keys, values, batch_dims):
        if self.hold.is_set():
            self.entered.set()
            assert self.release.wait(30)


def test_a_closing_hub_leaves_a_workers_descriptors_to_the_reader_that_is_reading_them():
    collate = HeldCheck()
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    server = BatchedPolicyServer(policy, collate=collate)
    client = client_of(server)
    client(obs())
    hub = server._endpoint.lazy_hub.hub
    [worker] = hub._clients.values()
    outcome: list = []

    def call() -> None:
        try:
            client(obs())
        except BatchServeError as err:
            outcome.append(err)

    collate.hold.set()
    caller = threading.Thread(target=call)
    caller.start()
    assert collate.entered.wait(30)  # the reader is inside this worker's request
    server.close(wait=False)  # the hub's close does not wait for the reader
    try:
        assert not worker.closed  # its bells are the reader's to close
        os.fstat(worker.requests_bell)
    finally:
        collate.release.set()
    caller.join(30)
    assert not caller.is_alive() and isinstance(outcome[0], ServerClosedError)
    wait_for(lambda: worker.closed and not hub._reader.is_alive(), "the reader to release the worker and end")


class DropsAKey(TensorDictModuleBase):
    def __init__(self):
        super().__init__()
        self.in_keys, self.out_keys = ["observation"], ["logits", "value"]

    def forward(self, td):
        td.set("logits", torch.zeros(td.batch_size[0], 3))
        return td  # no "value"


class ReturnsATensor(TensorDictModuleBase):
    def __init__(self):
        super().__init__()
        self.in_keys, self.out_keys = ["observation"], ["logits"]

    def forward(self, td):
        return td["observation"][..., :3]


@pytest.mark.parametrize(
    "policy, message",
    [
        (DropsAKey, "out_key 'value': missing"),
        (ReturnsATensor, "the policy returned Tensor; expected a TensorDict"),
    ],
)
def test_a_policy_breaking_its_contract_fails_every_path_with_policy_error(policy, message):
    with BatchedPolicyServer(policy()) as server:
        for remote in (server.remote_policy(), client_of(server)):
            with pytest.raises(PolicyError, match=message):
                remote(obs())


class NeedsTwo(Exception):
    def __init__(self, what, why):
        super().__init__(f"{what}: {why}")


class RebuiltAsAnother(Exception):
    def __reduce__(self):
        return RuntimeError, self.args


def test_own_copy_keeps_cause_context_and_traceback_and_shares_what_it_cannot_rebuild():
    def raised(error):
        try:
            raise error from KeyError("the cause")
        except BaseException as err:
            return err

    original = raised(ValueError("boom"))
    copied = own_copy(original)
    assert copied is not original and type(copied) is ValueError and copied.args == ("boom",)
    assert copied.__cause__ is original.__cause__ and copied.__suppress_context__
    assert copied.__traceback__ is original.__traceback__
    unbuildable = raised(NeedsTwo("a", "b"))  # its args are ("a: b",): NeedsTwo("a: b") fails
    assert own_copy(unbuildable) is unbuildable
    other = RebuiltAsAnother("x")  # a copy of another class would reach a caller as another error
    assert own_copy(other) is other


class Raises(TensorDictModuleBase):
    """A policy whose every forward raises ``make_error()``."""

    def __init__(self, make_error):
        super().__init__()
        self.in_keys, self.out_keys = ["observation"], ["logits"]
        self.make_error = make_error

    def forward(self, td):
        raise self.make_error()


def test_a_policy_raising_a_base_exception_breaks_the_server_and_every_caller_learns_it():
    server = BatchedPolicyServer(Raises(lambda: SystemExit("the policy called sys.exit")))
    remote = server.remote_policy()
    with pytest.raises(ServerBrokenError) as info:
        remote(obs())
    assert isinstance(info.value.__cause__, SystemExit)
    with pytest.raises(ServerBrokenError):
        remote.submit(obs())
    assert server.closed  # it takes no more requests, though nobody closed it
    assert server.close(timeout=10) is True


def test_a_broken_server_once_closed_is_still_broken_to_a_worker_process_as_to_a_thread():
    # A worker's client idle while the server broke heard "closed" when it closed, and said so from then on,
    # where a thread of the server's process is told the server is broken.
    server = BatchedPolicyServer(Raises(lambda: SystemExit("the policy called sys.exit")))
    remote = server.remote_policy()
    worker = pickle.loads(pickle.dumps(remote))  # a client of the hub, as in a worker process
    worker._endpoint._connection()  # connected, nothing in flight
    with pytest.raises(ServerBrokenError):
        remote(obs())
    assert server.close(timeout=10) is True
    for caller in (remote, worker):
        with pytest.raises(ServerBrokenError, match="SystemExit"):
            caller(obs())


class InterruptedOnMarker(TensorDictModuleBase):
    """Raises KeyboardInterrupt (a Ctrl-C landing in the forward) for an observation starting with 1000."""

    def __init__(self, net):
        super().__init__()
        self.in_keys, self.out_keys, self.net = ["observation"], ["logits"], net

    def forward(self, td):
        if (td["observation"][..., 0] == 1000).any():
            raise KeyboardInterrupt
        td.set("logits", self.net(td["observation"]))
        return td


def test_a_ctrl_c_in_a_batch_a_lone_caller_runs_itself_reaches_it_and_the_server_serves_on():
    net = make_mlp()
    with BatchedPolicyServer(InterruptedOnMarker(net)) as server:
        remote = server.remote_policy()
        remote(obs())  # the serve thread runs the first batch; this caller runs its next ones itself
        marked = obs()
        marked["observation"][0] = 1000
        with pytest.raises(KeyboardInterrupt):
            remote(marked)
        after = remote(obs())
    with torch.no_grad():
        torch.testing.assert_close(after["logits"], net(after["observation"]))


def test_a_blocking_call_from_a_done_callback_in_the_serve_loop_is_refused_not_hung():
    gated = GatedPolicy(make_mlp(), block_first=1)
    outcome: list = []
    done = threading.Event()

    def again(_future) -> None:  # runs in the serve loop's thread, which completes the future
        try:
            outcome.append(remote(obs()))
        except BaseException as err:
            outcome.append(err)
        done.set()

    with BatchedPolicyServer(gated) as server:
        remote = server.remote_policy()
        future = remote.submit(obs())
        assert gated.entered.wait(10)  # the future is still pending: its callback runs when the batch completes
        future.add_done_callback(again)
        gated.gate.set()
        assert done.wait(20), "the serve loop hung on a call that waits for itself"
        assert isinstance(outcome[0], BatchServeError) and "serve loop" in str(outcome[0])
        assert remote(obs())["logits"].shape == (3,)  # and it serves on
        future.result(10)


class CallsItsServer(TensorDictModuleBase):
    """A policy whose forward of a batch holding a marked row (first feature > 100) runs ``hooks["action"]()``.

    The served copy shares ``hooks``, where the forward also leaves the thread that ran it and sets
    ``hooks["entered"]``.
    """

    def __init__(self, net: torch.nn.Module, hooks: dict | None = None):
        super().__init__()
        self.in_keys, self.out_keys = ["observation"], ["logits"]
        self.net = net
        self.hooks = {"entered": threading.Event()} if hooks is None else hooks

    def __deepcopy__(self, memo):
        return type(self)(copy.deepcopy(self.net, memo), self.hooks)

    def forward(self, td):
        if bool((td["observation"][..., 0] > 100).any()):
            self.hooks["thread"] = threading.current_thread()
            self.hooks["entered"].set()
            self.hooks["action"]()
        td.set("logits", self.net(td["observation"]))
        return td


def marked() -> TensorDict:
    td = obs()
    td["observation"][0] = 1000.0
    return td


@pytest.mark.parametrize("how", ["call", "acall"])
def test_a_call_to_its_own_server_from_a_forward_that_a_lone_caller_runs_is_refused_not_hung(how):
    policy = CallsItsServer(make_mlp())
    outcome: list = []

    def call_again() -> None:
        try:
            if how == "call":
                outcome.append(remote(obs()))
            else:  # an event loop of the forward's own: the batch cannot end while it waits
                outcome.append(asyncio.run(asyncio.wait_for(remote.acall(obs()), 10)))
        except BaseException as err:
            outcome.append(err)

    policy.hooks["action"] = call_again
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        remote(obs())  # this thread is the server's only caller now: it runs its next batch itself
        assert remote(marked())["logits"].shape == (3,)
        assert policy.hooks["thread"] is threading.current_thread()
        assert isinstance(outcome[0], BatchServeError) and "inside a batch of this server" in str(outcome[0])
        assert remote(obs())["logits"].shape == (3,)  # and it serves on


def test_a_forward_that_a_lone_caller_runs_inside_another_servers_forward_may_not_call_back_into_that_server():
    # A's forward calls B, whose batch this thread runs too, and B's forward calls A: A's replica is this thread's.
    first, second = CallsItsServer(make_mlp()), CallsItsServer(make_mlp())
    first.hooks["action"] = lambda: remote_b(marked())
    second.hooks["action"] = lambda: remote_a(obs())
    with BatchedPolicyServer(first) as a, BatchedPolicyServer(second) as b:
        remote_a, remote_b = a.remote_policy(), b.remote_policy()
        remote_a(obs()), remote_b(obs())  # this thread is each server's only caller: it runs their next batches
        with pytest.raises(BatchServeError, match="inside a batch of this server"):
            remote_a(marked())
        assert first.hooks["thread"] is second.hooks["thread"] is threading.current_thread()
        assert remote_a(obs())["logits"].shape == remote_b(obs())["logits"].shape == (3,)  # both serve on


def test_close_from_a_forward_that_a_lone_caller_runs_neither_waits_for_itself_nor_drops_what_is_queued():
    net = make_mlp()
    policy = CallsItsServer(net)
    queued = threading.Event()
    closed: list = []
    policy.hooks["action"] = lambda: closed.append(queued.wait(20) and server.close())
    x = torch.randn(8)

    def queue_one() -> None:
        assert policy.hooks["entered"].wait(20)
        future = remote.submit(TensorDict(observation=x))  # queued behind the running batch
        queued.set()
        results.append(future.result(20))

    results: list = []
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        remote(obs())  # this thread is the server's only caller now: it runs its next batch itself
        other = threading.Thread(target=queue_one)
        other.start()
        assert remote(marked())["logits"].shape == (3,)
        other.join(30)
        assert policy.hooks["thread"] is threading.current_thread()
        assert closed == [False]  # it could not wait for the serve loop, which waits for this batch
        with torch.no_grad():
            torch.testing.assert_close(results[0]["logits"], net(x))  # served as a close serves what is queued
        assert server.close(timeout=20)
        with pytest.raises(ServerClosedError):
            remote(obs())


def test_close_from_a_done_callback_in_the_serve_loop_serves_what_is_queued():
    gated = GatedPolicy(make_mlp(), block_first=1)
    closed: list = []
    with BatchedPolicyServer(gated, max_batch_size=8) as server:
        remote = server.remote_policy()
        first = remote.submit(obs())
        assert gated.entered.wait(10)
        first.add_done_callback(lambda _future: closed.append(server.close()))  # runs in the serve loop
        queued = [remote.submit(obs()) for _ in range(3)]
        gated.gate.set()
        assert [f.result(20)["logits"].shape for f in queued] == [(3,)] * 3  # not failed as given up on
        assert closed == [False] and server.close(timeout=20)


def test_a_done_callback_in_the_serve_loop_runs_with_grad_on_as_in_any_thread():
    # The serve loop turned grad off for its whole thread, so a callback training a module there got no grad
    # ("element 0 of tensors does not require grad"), where a worker's callbacks, in its pool, had it.
    gated = GatedPolicy(make_mlp(), block_first=1)
    seen: list = []
    done = threading.Event()

    def record(_future) -> None:
        seen.append((threading.current_thread().name, torch.is_grad_enabled()))
        done.set()

    with BatchedPolicyServer(gated) as server:
        future = server.remote_policy().submit(obs())
        assert gated.entered.wait(10)  # still pending: its callback runs when the serve loop completes it
        future.add_done_callback(record)
        gated.gate.set()
        assert done.wait(20)
    assert seen[0][0].startswith("batchserve-replica") and seen[0][1]
    assert not future.result()["logits"].requires_grad


class Interrupted(Exception):
    """What a signal handler raises in a waiting caller (as Ctrl-C raises KeyboardInterrupt)."""


@contextlib.contextmanager
def interrupted_while_waiting():
    """Raise :class:`Interrupted` in the main thread once it is blocked in ``BlockingRequest.wait``.

    A repeating SIGALRM looks at the frame it lands in and raises only there,
    so the interruption reaches the wait itself, whenever the thread gets to it.
    """
    wait = BlockingRequest.wait.__code__

    def handler(signum, frame):
        if frame is not None and frame.f_code is wait:
            signal.setitimer(signal.ITIMER_REAL, 0)
            raise Interrupted

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_blocking_caller_interrupted_while_queued_is_dropped_and_the_others_are_served():
    gated = GatedPolicy(make_mlp(), block_first=1)
    results: dict = {}

    def call(name: str) -> None:
        td = obs()
        results[name] = (td["observation"].clone(), remote(td)["logits"])

    with BatchedPolicyServer(gated) as server:
        remote = server.remote_policy()
        first = threading.Thread(target=call, args=("first",))
        first.start()
        assert gated.entered.wait(10)  # the serve loop is held: what comes next stays queued
        others = [threading.Thread(target=call, args=(name,)) for name in ("b", "c")]
        for thread in others:
            thread.start()
        with interrupted_while_waiting(), pytest.raises(Interrupted):
            remote(obs())  # queued behind the held batch, and interrupted there
        gated.gate.set()
        for thread in [first, *others]:
            thread.join(20)
            assert not thread.is_alive(), "a caller was left waiting"
        after = remote(obs())  # the interrupted thread calls again and is served
    assert sorted(results) == ["b", "c", "first"]
    with torch.no_grad():
        for observation, logits in results.values():
            torch.testing.assert_close(logits, gated.net(observation))
        torch.testing.assert_close(after["logits"], gated.net(after["observation"]))
    assert sum(gated.batches) == 4  # the three callers and the last call: the abandoned row never ran


def test_a_caller_interrupted_in_the_middle_of_a_relay_wakes_the_callers_after_it():
    relay = Relay()
    first, middle, last = (BlockingRequest(obs(), (), 1, torch.Size([]), i, None, None) for i in range(3))
    for request in (first, middle, last):
        request._store(["logits"], [torch.zeros(3)], None)  # completed by a batch, as resolve() does
    relay.start([first, middle, last])  # wakes `first`, whose caller never comes back: `middle` waits on it
    woken: list = []
    waiter = threading.Thread(target=lambda: woken.append(last.wait(lambda: True, check_every=60)))
    waiter.start()
    with interrupted_while_waiting(), pytest.raises(Interrupted):
        middle.wait(lambda: True, check_every=60)
    waiter.join(20)  # its own watchdog would only look again after 60 s: the interrupted caller woke it
    assert not waiter.is_alive() and woken[0]["logits"].shape == (3,)
    assert middle.abandoned


@pytest.mark.parametrize("left", ["interrupted", "watchdog"])
def test_a_caller_that_left_after_its_batch_ran_but_before_its_relay_started_holds_up_nobody(left):
    # resolve() completes the callers of a batch, then starts their relay. One that stopped waiting in between
    # (interrupted, or its watchdog saw it completed) found no relay to pass on, and was woken first, by
    # nobody's thread: the caller after it waited for its watchdog (here 60 s).
    relay = Relay()
    first, last = (BlockingRequest(obs(), (), 1, torch.Size([]), i, None, None) for i in range(2))
    if left == "interrupted":
        with interrupted_while_waiting(), pytest.raises(Interrupted):
            first.wait(lambda: True, check_every=60)
    for request in (first, last):
        request._store(["logits"], [torch.zeros(3)], None)
    if left == "watchdog":
        assert first.wait(lambda: True, check_every=0.01)["logits"].shape == (3,)
    relay.start([first, last])
    woken: list = []
    waiter = threading.Thread(target=lambda: woken.append(last.wait(lambda: True, check_every=60)))
    waiter.start()
    waiter.join(20)
    assert not waiter.is_alive() and woken[0]["logits"].shape == (3,)
    assert relay._tail is None  # the chain ran out


def test_a_worker_task_cancelled_while_its_first_request_runs_never_writes_into_its_tensordict_later():
    # A worker's first request travels pickled, awaited from a pool thread that wrote the outputs into the
    # caller's TensorDict when they came, cancelled or not: a TensorDict the task had reused by then (a new
    # observation set, a second call answered) got the first call's stale outputs.
    gated = GatedPolicy(make_mlp(), block_first=1)

    async def main(client) -> tuple:
        td = obs()
        first = asyncio.create_task(client.acall(td))
        assert await asyncio.to_thread(gated.entered.wait, 10)  # its forward holds replica 0
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        td["observation"] = torch.randn(8)  # the task moves on with the same TensorDict
        second = await client.acall(td)  # served by replica 1
        return td, second["logits"].clone()

    with BatchedPolicyServer(gated, device=["cpu", "cpu"]) as server:
        client = client_of(server)
        td, answered = asyncio.run(main(client))
        gated.gate.set()
        wait_for(lambda: server.statistics().requests == 2, "the first request to be answered")
        client._endpoint._executor.shutdown(wait=True)  # what its pool thread does with the reply is done
    torch.testing.assert_close(td["logits"], answered)
    with torch.no_grad():
        torch.testing.assert_close(td["logits"], gated.net(td["observation"]))


def test_a_worker_submit_whose_outputs_are_being_written_can_no_longer_be_cancelled(monkeypatch):
    # Its future stayed pending while the outputs were written into the caller's TensorDict: a cancel() then
    # succeeded, and the caller, told its call was cancelled, had the outputs written into its TensorDict after.
    from torchrl_batchserve.transport import client as client_module

    writing, release = threading.Event(), threading.Event()
    write = client_module.write_outputs

    def held_write(td, keys, values):
        if threading.current_thread().name.startswith("batchserve-client"):  # the submit's settling
            writing.set()
            assert release.wait(10)
        write(td, keys, values)

    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        client = client_of(server)
        client(obs())  # connected, with a lane: a submit goes through it and the client's pool settles it
        monkeypatch.setattr(client_module, "write_outputs", held_write)
        td = obs()
        future = client.submit(td)
        assert writing.wait(10)
        cancelled = future.cancel()
        release.set()
        assert not cancelled and future.result(10) is td
    with torch.no_grad():
        torch.testing.assert_close(td["logits"], policy.module(td["observation"]))


def test_a_coalesced_submit_whose_outputs_are_being_written_can_no_longer_be_cancelled(monkeypatch):
    # A follower's future is never claimed by a batch: it stayed pending while its outputs were written, so a
    # cancel() then succeeded and the caller, told its call was cancelled, had outputs written into its td.
    from torchrl_batchserve import request as request_module

    writing, release = threading.Event(), threading.Event()
    write = request_module.write_outputs
    same = torch.ones(8)
    follower_td = TensorDict(observation=same.clone())

    def held_write(td, keys, values):
        if td is follower_td:
            writing.set()
            assert release.wait(10)
        write(td, keys, values)

    gated = GatedPolicy(make_mlp(), block_first=1)
    monkeypatch.setattr(request_module, "write_outputs", held_write)
    with BatchedPolicyServer(gated, cache=EvaluationCache()) as server:
        warm = server.submit(obs())
        assert gated.entered.wait(10)
        leader = server.submit(TensorDict(observation=same.clone()))
        follower = server.submit(follower_td)  # joins the leader's row
        assert server.statistics().cache_coalesced == 1
        gated.gate.set()
        assert writing.wait(10)
        cancelled = follower.cancel()
        release.set()
        assert not cancelled and follower.result(10) is follower_td
        warm.result(10)
        torch.testing.assert_close(follower_td["logits"], leader.result(10)["logits"])


def test_cancelled_asyncio_callers_are_dropped_while_queued_and_ignored_once_running():
    gated = GatedPolicy(make_mlp(), block_first=1)
    loop_errors: list = []

    async def main() -> tuple:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
        running = asyncio.create_task(remote.acall(obs()))
        assert await asyncio.to_thread(gated.entered.wait, 10)  # its batch is held in the forward
        kept_td = obs()
        queued = asyncio.create_task(remote.acall(obs()))
        kept = asyncio.create_task(remote.acall(kept_td))
        await asyncio.sleep(0)  # both tasks run up to their await: their requests are queued
        queued.cancel()
        running.cancel()
        gated.gate.set()
        result = await kept
        for task in (queued, running):
            with pytest.raises(asyncio.CancelledError):
                await task
        return kept_td, result

    with BatchedPolicyServer(gated) as server:
        remote = server.remote_policy()
        kept_td, result = asyncio.run(main())
        again = remote(obs())  # and it serves on
    assert not loop_errors  # a result for a cancelled task is dropped, never set on its future
    with torch.no_grad():
        torch.testing.assert_close(result["logits"], gated.net(kept_td["observation"]))
        torch.testing.assert_close(again["logits"], gated.net(again["observation"]))
    assert sum(gated.batches) == 3  # the running row, the kept one, the last call: the queued one never ran


def test_a_worker_request_refused_by_a_full_queue_gets_queue_full_error_and_counts_no_longer_in_flight():
    gated = GatedPolicy(make_mlp(), block_first=1)
    with BatchedPolicyServer(gated, max_queue_size=1) as server:
        remote, client = server.remote_policy(), client_of(server)
        held = remote.submit(obs())
        assert gated.entered.wait(10)  # the serve loop is held: the queue fills
        queued_td = obs()
        queued = threading.Thread(target=lambda: client(queued_td))
        queued.start()
        wait_for(lambda: server._queue._rows == 1, "the worker's first request to fill the queue")
        with pytest.raises(QueueFullError, match="max_queue_size=1"):
            client(obs())
        gated.gate.set()
        held.result(10)
        queued.join(20)
        assert not queued.is_alive()
        after = client(obs())  # the worker is served on
        [worker] = server._endpoint.lazy_hub.hub._clients.values()
        assert worker.in_flight == 0  # the refused request was taken off the count it was put on
    with torch.no_grad():
        torch.testing.assert_close(queued_td["logits"], gated.net(queued_td["observation"]))
        torch.testing.assert_close(after["logits"], gated.net(after["observation"]))


def connect_raw(server):
    """A worker that speaks the hub's protocol by hand: a client's connection and request bell, no reader."""
    from torchrl_batchserve.transport.client import ProcessClient

    client = ProcessClient(*server._endpoint.process_address())
    wire = client._connection()  # the handshake: key, then the bells and headers
    return client, wire, client._bells[0]


def test_a_worker_that_breaks_the_protocol_fails_alone_and_the_hub_serves_on():
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        worker = client_of(server)
        worker(obs())
        raw, wire, bell = connect_raw(server)
        wire.send(("req", 1, None, b"not a pickle"))  # a request whose payload does not load: it fails alone
        kind, seq, outcome, _ = wire.recv()
        assert (kind, seq) == ("done", 1) and pickle.loads(outcome)[0] is not None
        wire.send(("req",))  # not a request at all: logged and ignored
        os.eventfd_write(bell, 1 << 5)  # a lane it was never given: logged, nothing to answer
        td = obs()
        wire.send(("req", 2, None, pickle.dumps(td)))  # and the same worker is served on
        replies = [wire.recv()]
        while replies[-1][0] != "done":  # (a lane may be offered first)
            replies.append(wire.recv())
        kind, seq, outcome, _ = replies[-1]
        error, values, keys = pickle.loads(outcome)
        assert (kind, seq, error) == ("done", 2, None)
        with torch.no_grad():
            torch.testing.assert_close(dict(zip(keys, values))["logits"], policy.module(td["observation"]))
        _, lane, _, capacity, _ = next(r for r in replies if r[0] == "lane")  # offered for its next requests
        raw._headers.write(lane, 3, capacity + 1, (capacity + 1,), None)  # more rows than the lane holds
        os.eventfd_write(bell, 1 << lane)
        kind, seq, outcome, _ = wire.recv()  # that request fails alone
        assert (kind, seq) == ("done", 3) and isinstance(pickle.loads(outcome)[0], BadRequestError)
        wire.sock.sendall(b"\x00\x00\x00\x04junk")  # a frame that is not a message: the hub drops the worker
        with pytest.raises(EOFError):
            wire.recv()
        del raw, wire  # its bells close with it
        assert worker(obs())["logits"].shape == (3,)  # the other worker never noticed
        assert server.remote_policy()(obs())["logits"].shape == (3,)


@pytest.mark.parametrize("where", ["in-process", "worker"])
@pytest.mark.parametrize("via", ["submit", "acall"])
def test_a_caller_whose_tensordict_is_locked_while_its_request_runs_gets_the_writes_error_and_the_server_serves_on(
    where, via
):
    gated = GatedPolicy(make_mlp(), block_first=2)
    gated.gate.set()  # the first batch passes: a worker's first request is pickled, and brings it a lane
    loop_errors: list = []

    async def acall(td, remote):
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
        task = asyncio.create_task(remote.acall(td))
        assert await asyncio.to_thread(gated.entered.wait, 10)
        td.lock_()  # its outputs can no longer be written into it
        gated.gate.set()
        return await asyncio.wait_for(task, 10)

    with BatchedPolicyServer(gated, timeout=0.001) as server:
        remote = server.remote_policy() if where == "in-process" else client_of(server)
        remote(obs())
        gated.gate.clear()
        gated.entered.clear()
        td = obs()
        with pytest.raises(RuntimeError, match="locked"):
            if via == "acall":
                asyncio.run(acall(td, remote))
            else:
                future = remote.submit(td)
                assert gated.entered.wait(10)
                td.lock_()
                gated.gate.set()
                future.result(10)
        again = remote(obs())  # and it serves on
        assert server.statistics().failed_batches == 0  # the write failed, not the batch
        if where == "worker":  # its outputs came back in its lane, and were written by the client's reader
            assert server._endpoint.lazy_hub.hub.arrived["lane"] >= 1
    assert not loop_errors and "logits" not in td.keys()
    with torch.no_grad():
        torch.testing.assert_close(again["logits"], gated.net(again["observation"]))


def test_a_blocking_caller_left_unanswered_by_a_serve_loop_that_is_gone_gets_server_broken_error():
    request = BlockingRequest(obs(), (), 1, torch.Size([]), 0, None, None)
    with pytest.raises(ServerBrokenError, match="stopped without answering"):
        request.wait(lambda: False, check_every=0.01)  # no serve loop alive, and nothing completed it
    assert request.done


def test_a_connection_with_the_wrong_key_is_dropped_without_an_answer():
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        address, authkey, _ = server._endpoint.process_address()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(address)
            sock.sendall(bytes(b ^ 0xFF for b in authkey))
            assert sock.recv(1) == b""  # hung up on: neither admitted nor given bells
        assert server._endpoint.lazy_hub.hub.clients == 0
        assert client_of(server)(obs())["logits"].shape == (3,)  # the right key is served


class Unpicklable(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()  # what it holds cannot travel to another process


def test_a_worker_whose_batch_failed_with_an_exception_that_cannot_travel_gets_a_runtime_error_naming_it():
    with BatchedPolicyServer(Raises(lambda: Unpicklable("boom"))) as server:
        with pytest.raises(Unpicklable, match="boom"):
            server.remote_policy()(obs())  # a thread of the server's process gets the exception itself
        with pytest.raises(RuntimeError, match="^Unpicklable: boom$"):
            client_of(server)(obs())
        assert server.statistics().failed_batches == 2


@pytest.mark.parametrize("ending", ["served", "failed by close"])
def test_a_request_whose_event_loop_closed_while_it_waited_is_dropped_and_breaks_nothing(ending):
    gated = GatedPolicy(make_mlp(), block_first=1)
    server = BatchedPolicyServer(gated, max_batch_size=8, timeout=60.0)
    try:
        remote = server.remote_policy()
        held = server.submit(obs())
        assert gated.entered.wait(10)  # the requests below queue behind the held batch
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(lambda *_: None)  # (asyncio's "Task was destroyed but it is pending!": meant)
        orphan = loop.create_task(remote.acall(obs()))
        loop.run_until_complete(asyncio.sleep(0))  # the task ran up to its await: its request is queued
        loop.close()  # and its loop is gone, the task still pending: nobody is left to settle its future
        if ending == "served":
            gated.gate.set()
            held.result(10)
            assert remote(obs())["logits"].shape == (3,)  # the server serves on
            assert server.statistics().failed_batches == 0
        else:
            server.close(wait=False, cancel_pending=True)  # fails it, and raises nothing
            gated.gate.set()
            assert server.close(timeout=10)
        assert not orphan.done()
    finally:
        gated.gate.set()
        server.close(timeout=10)
