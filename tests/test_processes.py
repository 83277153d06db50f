"""Worker processes as actors: pickling, correctness, liveness, collectors, no leaks."""

from __future__ import annotations

import asyncio
import copy
import errno
import gc
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import process_workers as pw
import pytest
import torch
from conftest import BigOutputs, GatedPolicy, no_thread_named, wait_for
from tensordict import TensorDict
from tensordict.nn import InteractionType, TensorDictModule
from torch import nn

from torchrl_batchserve import BatchedPolicyServer, ServerBrokenError, ServerClosedError, WeightSyncError
from torchrl_batchserve.transport import client as client_module
from torchrl_batchserve.transport import connection as connection_module
from torchrl_batchserve.transport.client import ProcessClient
from torchrl_batchserve.transport.connection import Connection
from torchrl_batchserve.transport.hub import ProcessHub
from torchrl_batchserve.transport.slots import Slot

SPAWN = mp.get_context("spawn")


def slot_mappings() -> int:
    """Shared memory (slots, headers) and eventfds (bells) this process still maps or holds a descriptor of.

    Collected first: dropped clients of earlier tests, still in reference cycles, would otherwise go in the middle
    of a test that counts before and after.
    """
    gc.collect()
    with open("/proc/self/maps") as f:
        mapped = sum("torchrl_batchserve-" in line for line in f)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        fds += "torchrl_batchserve-" in target or target == "anon_inode:[eventfd]"
    return mapped + fds


def report(results, processes: list, timeout: float = 100.0):
    """The next report on ``results``; fails at once if one of ``processes`` died without reporting.

    A worker that raises exits non-zero and never reports: without the
    check, the test would wait out its whole timeout and say nothing of why.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            dead = {p.pid: p.exitcode for p in processes if p.exitcode not in (None, 0)}
            assert not dead, f"worker processes exited without reporting (pid: exit code): {dead}"
            assert time.monotonic() < deadline, f"no report within {timeout} s"


def run_workers(ctx, target, args_per_worker: list[tuple]) -> list:
    """Start one ``ctx`` process per argument tuple (``results`` queue appended); collect one report each."""
    results = ctx.Queue()
    workers = [ctx.Process(target=target, args=(*args, results)) for args in args_per_worker]
    for w in workers:
        w.start()
    outs = [report(results, workers) for _ in workers]
    for w in workers:
        w.join(30)
    return outs


def check_results(net, results) -> int:
    rows = 0
    for obs, logits, versions, shape in results:
        obs, logits = torch.tensor(obs), torch.tensor(logits)
        with torch.no_grad():
            torch.testing.assert_close(logits, net(obs))
        assert list(obs.shape[:-1]) == shape and torch.tensor(versions).eq(0).all()
        rows += max(1, obs[..., 0].numel())
    return rows


def test_n_workers_m_requests_each_get_their_own_results():
    before = slot_mappings()  # (what earlier tests of this process may still hold)
    net = pw.make_net()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, max_batch_size=16, timeout=0.01) as server:
        remote = server.remote_policy()  # one object handed to every worker
        outs = run_workers(SPAWN, pw.random_requests, [(remote, seed, 40) for seed in range(3)])
        stats = server.statistics()
        address, arrived = server._endpoint.lazy_hub.hub.address, dict(server._endpoint.lazy_hub.hub.arrived)
        wait_for(lambda: server._endpoint.lazy_hub.hub.clients == 0, "the hub to drop the workers that exited")
        gc.collect()
        assert slot_mappings() == before  # their lanes and bells went with them
    assert sorted(seed for seed, _, _ in outs) == [0, 1, 2] and len({pid for _, pid, _ in outs}) == 3
    for _, _, out in outs:
        check_results(net, out)
    assert stats.requests == 120 and stats.mean_batch_size > 1  # batched across processes
    # A worker's requests come pickled only until it has lanes that fit them (a lane per batch shape's
    # size here, at most 3 a worker): then through its lanes, no socket message each.
    assert arrived["socket"] <= 3 * 3 and arrived["lane"] == 120 - arrived["socket"]
    assert not os.path.exists(os.path.dirname(address))  # the socket and its folder are gone with the server


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_remote_policy_survives_every_start_method(method):
    ctx = mp.get_context(method)
    net = pw.make_net()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, timeout=0.01) as server:
        remote = server.remote_policy()
        outs = run_workers(ctx, pw.random_requests, [(remote, seed, 10) for seed in range(2)])
    assert sorted(seed for seed, _, _ in outs) == [0, 1]
    for _, _, out in outs:
        assert len(out) == 10
        check_results(net, out)


def test_a_connected_client_inherited_by_fork_connects_anew_in_the_child():
    net = pw.make_net()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, timeout=0.01) as server:
        client = pickle.loads(pickle.dumps(server.remote_policy()))
        client(TensorDict(observation=torch.zeros(8)))  # connected, its slots mapped
        outs = run_workers(mp.get_context("fork"), pw.random_requests, [(client, 0, 10)])
        mine = client(TensorDict(observation=torch.ones(8)))  # the parent's connection still answers the parent
        stats = server.statistics()
    check_results(net, outs[0][2])
    assert outs[0][1] != os.getpid() and stats.requests == 12
    with torch.no_grad():
        torch.testing.assert_close(mine["logits"], net(torch.ones(8)))


def test_a_fork_while_the_hub_sends_a_descriptor_gives_the_child_none_to_close_twice(monkeypatch):
    # The hub closes a descriptor once it went with its message. A fork at that moment (a worker started while
    # the server serves others) gave the child the message still listing it: the child's fork hook closed that
    # number again (EBADF, or another file's by then), stopped there and kept the hub's other descriptors open.
    policy = TensorDictModule(pw.make_net(), in_keys=["observation"], out_keys=["logits"])
    parent, children = os.getpid(), []
    real_close_all = connection_module.close_all

    def close_all(fds):
        real_close_all(fds)
        if fds and os.getpid() == parent and not children:
            pid = os.fork()  # just after: the fork hooks run in the child, on the outbox as the hub left it
            if pid == 0:
                os._exit(0 if hub._listener.fileno() == -1 else 1)  # the hook closed all of the hub's
            children.append(pid)

    monkeypatch.setattr(connection_module, "close_all", close_all)
    with BatchedPolicyServer(policy) as server:
        client = ProcessClient(*server._endpoint.process_address())
        hub = server._endpoint.lazy_hub.hub
        client.call(TensorDict(observation=torch.zeros(8)))  # pickled: the hub offers a lane, its descriptor sent
        client.call(TensorDict(observation=torch.ones(8)))  # in the lane: its first outputs bring a slot
    assert children and os.waitpid(children[0], 0)[1] == 0


def test_pickled_copies_are_separate_clients_and_close_their_connections_when_dropped():
    before = slot_mappings()
    policy = TensorDictModule(pw.make_net(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        a, b = pickle.loads(pickle.dumps(remote)), pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(remote))))
        assert isinstance(a._endpoint, ProcessClient) and a._endpoint is not b._endpoint
        ta, tb = a(TensorDict(observation=torch.zeros(8))), b(TensorDict(observation=torch.ones(8)))
        assert server._endpoint.lazy_hub.hub.clients == 2
        with torch.no_grad():
            torch.testing.assert_close(tb["logits"], policy.module(torch.ones(8)))
            torch.testing.assert_close(ta["logits"], policy.module(torch.zeros(8)))
        assert slot_mappings() > before  # each client: its bells, headers and a lane, mapped on both sides
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del a, b, ta, tb
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]  # closed, not left to the GC
        wait_for(lambda: server._endpoint.lazy_hub.hub.clients == 0, "the hub to drop the closed clients")
    assert slot_mappings() == before  # anonymous memory files: nothing named to leak, nothing left once unused


class _Transposed(nn.Module):
    """Outputs that are views of another layout (not contiguous), and a second output of another dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.net = pw.make_net()

    def forward(self, obs):
        logits = self.net(obs)
        return logits.t().contiguous().t(), logits.argmax(-1)


@pytest.mark.parametrize("module", ["plain", "transposed"])
def test_single_row_replies_carry_each_rows_outputs_and_the_version_served(module):
    net = pw.make_net() if module == "plain" else _Transposed()
    out_keys = ["logits"] if module == "plain" else ["logits", "action"]
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=out_keys)
    trainer = copy.deepcopy(policy)  # the served policy's weights change only through the server
    with BatchedPolicyServer(policy, max_batch_size=4, timeout=0.05) as server:
        clients = [pickle.loads(pickle.dumps(server.remote_policy())) for _ in range(3)]  # one batch of three
        for version in (0, 1, 2):
            if version:
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.add_(0.5)
                assert server.update_weights(TensorDict.from_module(trainer)) == version
            obs = torch.randn(3, 8)
            tds = [TensorDict(observation=o) for o in obs]
            threads = [threading.Thread(target=c, args=(td,)) for c, td in zip(clients, tds)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            with torch.no_grad():
                want = trainer(TensorDict(observation=obs, batch_size=[3]))
            for i, td in enumerate(tds):
                for key in out_keys:
                    torch.testing.assert_close(td[key], want[key][i])
                assert td["policy_version"].item() == version and td["policy_version"].shape == ()
        assert server.statistics().mean_batch_size > 1


def test_close_leaves_no_thread_of_the_hub_behind():
    policy = TensorDictModule(pw.make_net(), in_keys=["observation"], out_keys=["logits"])
    server = BatchedPolicyServer(policy)
    client = pickle.loads(pickle.dumps(server.remote_policy()))
    client(TensorDict(observation=torch.zeros(8)))  # the hub accepted, and reads, a client
    hub = server._endpoint.lazy_hub.hub
    threads = [hub._accepter, hub._reader]
    assert all(t.is_alive() for t in threads)
    assert server.close(timeout=10)
    assert [t.name for t in threads if t.is_alive()] == []  # joined by close, not left blocked in accept()


def test_a_hub_whose_socket_file_is_gone_still_ends_its_threads_when_closed():
    # At exit, weakref's finalizers run newest first: the hub folder's (made when the hub started) removes the
    # socket file before the server's closes the hub. The accept thread was woken by connecting to that file,
    # so it stayed in accept() and every program that left such a server open took EXIT_WAIT more to exit.
    policy = TensorDictModule(pw.make_net(), in_keys=["observation"], out_keys=["logits"])
    server = BatchedPolicyServer(policy)
    pickle.dumps(server.remote_policy())  # starts the hub
    hub = server._endpoint.lazy_hub.hub
    hub._finalizer()  # what the interpreter's exit runs first
    assert not os.path.exists(hub.address)
    server.close(timeout=10)
    assert [t.name for t in (hub._accepter, hub._reader) if t.is_alive()] == []


class HeldUnlessZero(nn.Module):
    """Holds each forward of a nonzero observation (setting ``entered``) until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.net = pw.make_net()
        self.entered, self.release = threading.Event(), threading.Event()  # shared by the served copy

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        if observation.any():
            self.entered.set()
            assert self.release.wait(60), "the test never released the forward"
        return self.net(observation)


@pytest.mark.parametrize("first_call", [True, False], ids=["lane", "pickled"])
@pytest.mark.parametrize("mode", ["acall", "submit"])
def test_a_worker_exits_while_the_server_still_holds_a_request_it_cancelled(mode, first_call):
    # A thread of the client's pool waited for the cancelled request until its reply came, and a pool's
    # threads are joined at exit: the worker could not exit while the server held the forward. (Pickled,
    # a submit's Future could not even be cancelled: it was the pool's, running.)
    module = HeldUnlessZero()
    with BatchedPolicyServer(TensorDictModule(module, in_keys=["observation"], out_keys=["logits"])) as server:
        results, held = SPAWN.Queue(), SPAWN.Event()
        args = (server.remote_policy(), mode, first_call, held, results)
        worker = SPAWN.Process(target=pw.cancel_when_held, args=args)
        worker.start()
        try:
            assert module.entered.wait(120)  # the request is in the forward the server holds
            held.set()
            assert report(results, [worker]) == "cancelled"
            worker.join(30)
            assert (worker.is_alive(), worker.exitcode) == (False, 0)
        finally:
            module.release.set()
            worker.join(30)


def test_the_hub_fires_timeouts_for_the_requests_it_queued():
    # Two clients are known; while one stays away, the other's requests can
    # only run on timeout.
    policy = TensorDictModule(pw.make_net(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, timeout=0.02) as server:
        remote = server.remote_policy()
        a, b = pickle.loads(pickle.dumps(remote)), pickle.loads(pickle.dumps(remote))
        a(TensorDict(observation=torch.zeros(8))), b(TensorDict(observation=torch.zeros(8)))
        before = server.statistics().fired.get("timeout", 0)
        outs: list = []
        caller = threading.Thread(target=lambda: outs.append(a(TensorDict(observation=torch.ones(8)))))
        caller.start()
        caller.join(timeout=30)
        assert not caller.is_alive() and len(outs) == 1
        assert server.statistics().fired.get("timeout", 0) - before == 1
        with torch.no_grad():
            torch.testing.assert_close(outs[0]["logits"], policy.module(torch.ones(8)))


def test_a_worker_killed_mid_request_wedges_nothing_and_its_slot_is_reclaimed():
    before = slot_mappings()
    gated = GatedPolicy(pw.make_net(), block_first=1)
    with BatchedPolicyServer(gated, timeout=0.01) as server:
        remote = server.remote_policy()
        started, results = SPAWN.Event(), SPAWN.Queue()
        victim = SPAWN.Process(target=pw.call_until_told, args=(remote, started, results))
        victim.start()
        assert gated.entered.wait(120)  # the victim's request is in the forward
        pw.kill(victim.pid)
        victim.join(30)
        gated.gate.set()  # the dead worker's batch completes; its reply goes nowhere
        wait_for(lambda: server._endpoint.lazy_hub.hub.clients == 0, "the hub to drop the dead worker")
        outs = run_workers(SPAWN, pw.random_requests, [(remote, seed, 15) for seed in (5, 6)])
        assert results.empty()  # the victim never reported anything
    assert [len(out) for _, _, out in outs] == [15, 15]
    for _, _, out in outs:
        check_results(gated.net, out)
    gc.collect()
    assert slot_mappings() == before


def test_a_stopped_worker_with_a_reply_too_big_for_its_socket_holds_up_no_other_caller():
    # The serve loop wrote such a reply with a blocking sendall: until the worker read it, no other caller of
    # the server was served, and a worker stopped for good (SIGSTOP, a debugger, a frozen container) stopped
    # the server for good. The reply now waits in the worker's outbox, and the hub's reader sends it.
    gated = GatedPolicy(BigOutputs(), block_first=1)
    with BatchedPolicyServer(gated) as server:
        results = SPAWN.Queue()
        worker = SPAWN.Process(target=pw.one_call, args=(server.remote_policy(), results))
        worker.start()
        try:
            assert gated.entered.wait(120), "the worker's request never reached the forward"
            os.kill(worker.pid, signal.SIGSTOP)
            gated.gate.set()  # the worker's 32 MB reply now goes to a process that reads nothing
            local = server.submit(TensorDict(observation=torch.ones(8))).result(30)
            assert local["logits"].shape == (1 << 23,)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        assert report(results, [worker]) == ((1 << 23,), float(1 << 23))  # all of it, once the worker reads
        worker.join(30)


def test_a_slot_offered_to_a_worker_already_gone_leaks_no_descriptor():
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = Connection(here, ident=1, on_backlog=lambda client: None)
    os.close(client.headers_fd)  # (the handshake sends it, then closes it)
    there.close()
    client.alive = False  # a reply found the worker gone
    slot, fd = Slot.create([("observation", torch.float32, (8,))], 1)
    client.send(("lane", 0, *slot.describe()), fds=[fd])
    with pytest.raises(OSError):
        os.fstat(fd)  # closed, though never sent
    client.close()


def test_closing_the_server_fails_waiting_workers_promptly():
    gated = GatedPolicy(pw.make_net(), block_first=1)
    server = BatchedPolicyServer(gated, timeout=1e6)
    remote = server.remote_policy()
    local = server.submit(TensorDict(observation=torch.zeros(8)))  # holds the serve loop
    assert gated.entered.wait(10)
    started, results = SPAWN.Event(), SPAWN.Queue()
    worker = SPAWN.Process(target=pw.call_until_told, args=(remote, started, results))
    worker.start()
    assert started.wait(120)  # a spawned child imports torch first: slow on a busy host, as is its first call
    wait_for(lambda: server.statistics().requests == 0 and server._queue._items, "the worker's request to queue", 120)
    t = time.monotonic()
    server.close(wait=False, cancel_pending=True)
    kind, message = report(results, [worker], timeout=30)
    assert kind == "ServerClosedError" and "closed" in message and time.monotonic() - t < 10
    gated.gate.set()
    local.result(10)
    assert server.close(timeout=10)
    worker.join(30)
    late = pickle.loads(pickle.dumps(remote))
    with pytest.raises(ServerClosedError, match="closed or gone .*its own host only .*serve_on_ray"):
        late(TensorDict(observation=torch.zeros(8)))  # (no socket: closed, or a copy sent to another host)


@pytest.fixture
def dead_hubs() -> Iterator[list[str]]:
    """The addresses of hubs whose server process a test kills: their folders, which nobody else removes, go after."""
    addresses: list[str] = []
    yield addresses
    for address in addresses:
        shutil.rmtree(os.path.dirname(address), ignore_errors=True)


def test_workers_waiting_on_a_dead_server_process_get_broken_error(dead_hubs):
    pickled, entered = SPAWN.Queue(), SPAWN.Event()
    host = SPAWN.Process(target=pw.serve_then_hang, args=(pickled, entered))
    host.start()
    remote = pickle.loads(report(pickled, [host]))
    dead_hubs.append(remote._endpoint.address)
    outcome: list = []

    def call() -> None:
        try:
            remote(TensorDict(observation=torch.ones(8)))
        except ServerBrokenError as err:
            outcome.append(err)

    caller = threading.Thread(target=call)
    caller.start()
    assert entered.wait(60)  # the request is in the server's forward
    pw.kill(host.pid)
    caller.join(30)
    assert not caller.is_alive() and outcome and "ended" in str(outcome[0])
    host.join(10)
    with pytest.raises(ServerBrokenError, match="broken: the server's process ended"):  # later calls: the same class
        remote(TensorDict(observation=torch.ones(8)))


@pytest.mark.parametrize("rows", [1, 3], ids=["lane", "pickled"])
def test_a_worker_idle_when_its_server_process_died_gets_broken_error_on_its_next_call(rows, dead_hubs):
    pickled = SPAWN.Queue()
    host = SPAWN.Process(target=pw.serve_then_hang, args=(pickled,))
    host.start()
    remote = pickle.loads(report(pickled, [host]))
    dead_hubs.append(remote._endpoint.address)
    remote(TensorDict(observation=torch.ones(8)))  # connected, with a lane of one row
    pw.kill(host.pid)
    host.join(10)
    with pytest.raises(ServerBrokenError, match="process ended"):  # three rows fit no lane: they travel pickled
        remote(TensorDict(observation=torch.ones(rows, 8), batch_size=[rows]))
    late = pickle.loads(pickle.dumps(remote))  # connects anew: its hub's socket file is there, nobody listens
    with pytest.raises(ServerBrokenError, match="gone: its process ended"):
        late(TensorDict(observation=torch.ones(rows, 8), batch_size=[rows]))


@pytest.mark.parametrize("rows", [1, 3], ids=["lane", "pickled"])
def test_a_worker_idle_when_its_server_closed_gets_closed_error_on_its_next_call(policy, rows):
    server = BatchedPolicyServer(policy)
    remote = pickle.loads(pickle.dumps(server.remote_policy()))  # a client of the hub, as in a worker
    remote(TensorDict(observation=torch.ones(8)))
    assert server.close(timeout=10)
    with pytest.raises(ServerClosedError, match="closed before this request ran"):
        remote(TensorDict(observation=torch.ones(rows, 8), batch_size=[rows]))


@pytest.mark.parametrize("then, error", [("dies", ServerBrokenError), ("closes", ServerClosedError)])
def test_a_hub_gone_during_the_handshake_is_told_dead_or_closed(tmp_path, then, error):
    address = str(tmp_path / "hub.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(1)

    def hub() -> None:  # takes the key and goes without an answer, as one dying or closing mid-handshake
        conn, _ = listener.accept()
        conn.recv(16)
        listener.close()  # dies: its socket file stays, nobody listens
        if then == "closes":
            os.unlink(address)  # as ProcessHub.close does before it closes its listener
        conn.close()

    thread = threading.Thread(target=hub)
    thread.start()
    client = ProcessClient(address, bytes(16), ["observation"])
    with pytest.raises(error, match="gone: its process ended" if then == "dies" else "closed or gone"):
        client.call(TensorDict(observation=torch.ones(8)))
    thread.join(10)


@pytest.mark.parametrize("missing", ["eventfd", "memfd_create"])
def test_pickling_a_remote_policy_where_the_os_lacks_eventfd_or_memfd_says_so_and_the_server_serves_on(
    policy, missing, monkeypatch
):
    # macOS has neither: the process path is Linux's; the server's own threads are served as anywhere.
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        monkeypatch.delattr(os, missing)
        with pytest.raises(NotImplementedError, match=rf"worker processes reach a server through Linux's .*{missing}"):
            pickle.dumps(remote)
        assert remote(TensorDict(observation=torch.ones(8)))["logits"].shape == (3,)


def test_a_hub_that_cannot_make_a_lane_serves_its_workers_pickled_and_says_why_once(net, policy, monkeypatch, caplog):
    def out_of_descriptors(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(Slot, "create", out_of_descriptors)
    monkeypatch.setattr(connection_module, "_SLOTS_WARNED", False)
    obs = [torch.randn(8, generator=torch.Generator().manual_seed(i)) for i in range(16)]

    async def rounds(remote) -> list:
        return [await asyncio.gather(*(remote.acall(TensorDict(observation=x)) for x in obs)) for _ in range(3)]

    with BatchedPolicyServer(policy) as server:
        remote = pickle.loads(pickle.dumps(server.remote_policy()))  # a client of the hub, as in a worker
        with caplog.at_level("WARNING", logger="torchrl_batchserve"):
            outs = asyncio.run(rounds(remote))
    for out in outs:  # lanes only save time: no request failed for want of one
        for td, x in zip(out, obs):
            torch.testing.assert_close(td["logits"], net(x))
    assert remote._endpoint._lanes == []
    said = [r.getMessage() for r in caplog.records if "no shared-memory lane" in r.getMessage()]
    assert len(said) == 1 and "Too many open files" in said[0] and "ulimit -n" in said[0]


def test_a_worker_that_finds_the_hubs_backlog_full_waits_for_room_instead_of_giving_up(policy, monkeypatch):
    # Connecting with a timeout, a Unix socket is refused at once (EAGAIN) while the hub's backlog of
    # connections not yet accepted is full: of hundreds of workers connecting at once, those past it found the
    # server "closed or gone" for good.
    real = socket.socket.connect
    full = {"refusals": 3}

    def connect(sock, address):  # as the kernel does: a blocking socket waits for room instead
        if sock.family == socket.AF_UNIX and sock.gettimeout() is not None and full["refusals"]:
            full["refusals"] -= 1
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return real(sock, address)

    with BatchedPolicyServer(policy) as server:
        remote = pickle.loads(pickle.dumps(server.remote_policy()))  # a client of the hub, as in a worker
        monkeypatch.setattr(socket.socket, "connect", connect)
        assert remote(TensorDict(observation=torch.ones(8)))["logits"].shape == (3,)
        assert full["refusals"] == 0


def test_a_worker_that_a_live_hub_admits_too_slowly_connects_again_instead_of_finding_it_closed(policy, monkeypatch):
    # Thousands of copies connecting at once (64 workers of 64 threads, each unpickling its own) kept the hub from
    # admitting some within the handshake's bound: those copies found the server "closed or gone" for good.
    monkeypatch.setattr(client_module, "HANDSHAKE_TIMEOUT", 0.2)
    admit, release, held = ProcessHub._handshake, threading.Event(), []

    def slowly(hub, sock):
        if not held:
            held.append(sock)
            release.wait(10)  # the first connection is answered after the client's bound
        admit(hub, sock)

    monkeypatch.setattr(ProcessHub, "_handshake", slowly)
    with BatchedPolicyServer(policy) as server:
        remote = pickle.loads(pickle.dumps(server.remote_policy()))  # a client of the hub, as in a worker
        try:
            out = remote(TensorDict(observation=torch.ones(8)))
        finally:
            release.set()
        again = remote(TensorDict(observation=torch.zeros(8)))
    assert len(held) == 1  # it was held, and the copy connected anew
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], policy.module(torch.ones(8)))
        torch.testing.assert_close(again["logits"], policy.module(torch.zeros(8)))


def test_a_hub_that_cannot_start_a_handshake_thread_admits_the_worker_itself(policy, monkeypatch):
    # Under a container's process limit, starting a thread raises: the accept thread died of it, and no worker
    # connected again.
    monkeypatch.setattr(client_module, "HANDSHAKE_TIMEOUT", 0.5)
    with BatchedPolicyServer(policy) as server:
        remote = pickle.loads(pickle.dumps(server.remote_policy()))  # a client of the hub, as in a worker
        with no_thread_named("batchserve-hub-handshake"):
            outs = [remote.submit(TensorDict(observation=torch.ones(8))).result(timeout=30)]  # (a pool thread connects)
            outs.append(remote(TensorDict(observation=torch.ones(8))))
            second = pickle.loads(pickle.dumps(server.remote_policy()))
            outs.append(second(TensorDict(observation=torch.zeros(8))))
            assert server._endpoint.lazy_hub.hub._accepter.is_alive()
    with torch.no_grad():
        for out, x in zip(outs, [torch.ones(8), torch.ones(8), torch.zeros(8)]):
            torch.testing.assert_close(out["logits"], policy.module(x))


def test_a_worker_at_its_open_file_limit_is_told_so_when_a_lane_cannot_reach_it(policy):
    # Before, it was told "a message announced a descriptor that did not come", as if the server had broken.
    with BatchedPolicyServer(policy) as server:
        outs = run_workers(SPAWN, pw.call_at_the_open_file_limit, [(server.remote_policy(),)])
        assert server.remote_policy()(TensorDict(observation=torch.ones(8)))["logits"].shape == (3,)  # serves on
    name, message = outs[0]
    assert name == "ServerBrokenError" and "open-file limit (ulimit -n)" in message


def test_a_temporary_folder_too_deep_for_a_unix_socket_leaves_the_hubs_socket_in_tmp(policy, tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 100)  # a cluster job's TMPDIR may be this long
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with BatchedPolicyServer(policy) as server:
        remote = pickle.loads(pickle.dumps(server.remote_policy()))  # a client of the hub, as in a worker
        assert remote(TensorDict(observation=torch.ones(8)))["logits"].shape == (3,)
        address = server._endpoint.lazy_hub.address[0]
        assert address.startswith("/tmp/torchrl_batchserve-") and os.path.exists(address)
    assert not os.path.exists(os.path.dirname(address)) and not list(deep.iterdir())


def test_a_hub_reader_that_dies_fails_every_worker_instead_of_leaving_it_waiting(policy, monkeypatch):
    def bug(self, client):
        raise RuntimeError("a bug in the reader")

    monkeypatch.setattr(ProcessHub, "_rung", bug)  # a worker's second call rings its lane: the reader dies
    with BatchedPolicyServer(policy) as server:
        results = SPAWN.Queue()
        workers = [SPAWN.Process(target=pw.call_until_it_fails, args=(server.remote_policy(), results))]
        workers[0].start()
        done, kind, message = report(results, workers, timeout=60)
        assert kind == "ServerBrokenError" and "a bug in the reader" in message
        assert 0 < done < 50  # served until a call came through a lane (its first, or second, travels pickled)
        workers.append(SPAWN.Process(target=pw.call_until_it_fails, args=(server.remote_policy(), results)))
        workers[1].start()  # connects after the reader died: told at once
        done, kind, message = report(results, workers, timeout=60)
        assert (done, kind) == (0, "ServerBrokenError") and "hub failed" in message
        served = server.remote_policy()(TensorDict(observation=torch.ones(8)))  # in-process: served on
        assert served["logits"].shape == (3,)
    for worker in workers:
        worker.join(30)


def test_workers_carry_their_interaction_type_as_made_and_a_relays_submit_the_one_it_gives():
    # The worker's first submit is sent from its client's pool (no free lane yet), after its caller's block ended.
    # (In a worker, as in a real one: in the server's own process such a block ending while the forward runs
    # would change the forward's type too, tensordict's type being one per process; docs/guide.md.)
    policy = TensorDictModule(pw.ModeEcho(), in_keys=["observation"], out_keys=["mode"])
    with BatchedPolicyServer(policy, policy_version_key=None) as server:
        results = SPAWN.Queue()
        worker = SPAWN.Process(target=pw.interaction_of_requests, args=(server.remote_policy(), results))
        worker.start()
        assert report(results, [worker]) == [2] * 4 + [1] * 4 + [1, 2]
        worker.join(30)
        endpoint, pid = server._endpoint, server._endpoint._pid
        endpoint._pid = -1  # as in a process forked from the server's: the endpoint goes through a client
        try:
            future = server.submit(TensorDict(observation=torch.ones(8)), interaction=InteractionType.RANDOM)
            assert int(future.result(30)["mode"]) == 2  # the explicit type went along
        finally:
            endpoint._pid = pid


@pytest.mark.parametrize("spec", [False, True])
def test_bad_requests_from_a_worker_get_typed_errors(spec):
    from torchrl.data import Composite, Unbounded

    policy = TensorDictModule(pw.make_net(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(
        policy, input_spec=Composite(observation=Unbounded(shape=(8,))) if spec else None
    ) as server:
        remote = pickle.loads(pickle.dumps(server.remote_policy()))
        if not spec:
            remote(TensorDict(observation=torch.zeros(8)))  # the first request fixes the layout
        from torchrl_batchserve import BadRequestError

        with pytest.raises(BadRequestError, match=r"key 'observation': expected feature shape \(8,\)"):
            remote(TensorDict(observation=torch.zeros(5)))
        with pytest.raises(BadRequestError, match=r"key 'observation': missing; .* the request has \['other'\]"):
            remote(TensorDict(other=torch.zeros(8)))
        with pytest.raises(BadRequestError, match="a request's TensorDict must be unlocked"):
            remote(TensorDict(observation=torch.zeros(8)).lock_())  # refused before it is sent, on every path
        with pytest.raises(BadRequestError, match="a request's TensorDict must be unlocked"):
            remote.submit(TensorDict(observation=torch.zeros(8)).lock_())
        with pytest.raises(BadRequestError, match="a request's TensorDict must be unlocked"):
            asyncio.run(remote.acall(TensorDict(observation=torch.zeros(8)).lock_()))
        assert remote(TensorDict(observation=torch.zeros(4, 8), batch_size=[4]))["logits"].shape == (4, 3)


class PendulumPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return 2 * torch.tanh(self.lin(torch.stack([th.sin(), th.cos(), thdot], -1)))


@pytest.mark.parametrize("kind", ["Collector", "MultiSyncCollector", "MultiAsyncCollector", "num_collectors"])
def test_collectors_store_the_policys_actions(kind):
    from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
    from torchrl.envs import PendulumEnv

    net = PendulumPolicy()
    policy = TensorDictModule(net, in_keys=["th", "thdot"], out_keys=["action"])
    kw = {"auto_register_policy_transforms": False}
    with BatchedPolicyServer(policy, max_batch_size=8, timeout=0.005) as server:
        remote = server.remote_policy()
        if kind == "Collector":
            collector = Collector(PendulumEnv, remote, frames_per_batch=16, total_frames=32, **kw)
        elif kind == "MultiSyncCollector":
            collector = MultiSyncCollector([PendulumEnv] * 2, remote, frames_per_batch=32, total_frames=64, **kw)
        elif kind == "MultiAsyncCollector":
            collector = MultiAsyncCollector([PendulumEnv] * 2, remote, frames_per_batch=16, total_frames=64, **kw)
        else:
            collector = Collector(PendulumEnv, remote, frames_per_batch=32, total_frames=64, num_collectors=2, **kw)
        frames = 0
        try:
            for batch in collector:
                with torch.no_grad():
                    torch.testing.assert_close(batch["action"], net(batch["th"], batch["thdot"]))
                assert batch["policy_version"].eq(0).all()
                frames += batch.numel()
                collector.update_policy_weights_()  # no weight-sync configuration: harmless
        finally:
            collector.shutdown()
        stats = server.statistics()
    assert frames >= 32 and stats.requests > 0 and stats.failed_batches == 0


def test_env_rollout_steps_a_single_and_a_batched_env_through_the_server():
    # env.rollout(n, remote): each step is one request with the env's batch size (three rows for three envs)
    from torchrl.envs import PendulumEnv, SerialEnv

    net = PendulumPolicy()
    policy = TensorDictModule(net, in_keys=["th", "thdot"], out_keys=["action"])
    batched_env = SerialEnv(3, PendulumEnv)
    try:
        with BatchedPolicyServer(policy) as server:
            remote = server.remote_policy()
            single = PendulumEnv().rollout(5, remote)
            batched = batched_env.rollout(5, remote)
            stats = server.statistics()
    finally:
        batched_env.close()
    assert single.batch_size == (5,) and batched.batch_size == (3, 5)
    for td in (single, batched):
        with torch.no_grad():
            torch.testing.assert_close(td["action"], net(td["th"], td["thdot"]))
        assert td["policy_version"].eq(0).all()
    assert (stats.requests, stats.rows) == (10, 5 + 15)


@pytest.mark.parametrize("kind", ["Collector", "MultiSyncCollector"])
@pytest.mark.parametrize("registered", ["by hand", "by the collector"])
def test_a_recurrent_policy_carries_each_envs_own_state(kind, registered):
    # An LSTM policy reads its state from the request and writes the next one
    # under ("next", ...): every row of a batch must get its own env's state.
    # The env's transforms (InitTracker, the state's primer) are added by hand, or by the collector from
    # the RemotePolicy's make_tensordict_primer(), as for the served policy itself.
    from process_workers import recurrent_pendulum, recurrent_policy
    from torchrl.collectors import Collector, MultiSyncCollector
    from torchrl.envs import PendulumEnv

    policy = recurrent_policy()
    state = ["recurrent_state_h", "recurrent_state_c"]
    assert set(policy.in_keys) == {"th", "thdot", *state, "is_init"}
    make_env = recurrent_pendulum if registered == "by hand" else PendulumEnv
    kw = {"auto_register_policy_transforms": registered != "by hand"}
    with BatchedPolicyServer(policy, max_batch_size=8, timeout=0.005) as server:
        remote = server.remote_policy()
        if kind == "Collector":
            collector = Collector(make_env, remote, frames_per_batch=20, total_frames=40, **kw)
        else:
            envs = [make_env] * 3
            collector = MultiSyncCollector(envs, remote, frames_per_batch=60, total_frames=120, **kw)
        collector.set_seed(0)  # each env its own seed: rows handed to the wrong env would differ
        batches = []
        try:
            for batch in collector:
                batches.append(batch)
        finally:
            collector.shutdown()
        stats = server.statistics()
    data = torch.cat(batches, -1)  # (envs, steps) for MultiSyncCollector, (steps,) for Collector
    with torch.no_grad():
        expected = policy(data.select(*policy.in_keys).clone())
    for key in ["action", *(("next", k) for k in state)]:
        torch.testing.assert_close(data[key], expected[key])
    # The state travels: a step reads the state the step before wrote, unless it starts a trajectory.
    within = ~data["is_init"][..., 1:, 0]
    for k in state:
        written = data["next", k][..., :-1, :, :]
        torch.testing.assert_close(data[k][..., 1:, :, :][within], written[within])
        assert written.abs().sum() > 0  # computed, not the primer's zeros
    assert stats.failed_batches == 0 and (kind == "Collector" or stats.mean_batch_size > 1)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_until(remote, version: int, dtype: torch.dtype = torch.float32) -> None:
    """Call ``remote`` until its results carry ``version`` (a push is received in a thread of the server)."""
    ones = TensorDict(observation=torch.ones(8, dtype=dtype))
    wait_for(lambda: int(remote(ones.clone())["policy_version"]) == version, f"v{version}")


def weight_group(server: BatchedPolicyServer) -> tuple:
    """A trainer's WeightBroadcaster (in a thread of this process) and ``server``'s receiver, joined."""
    from torchrl_batchserve import WeightBroadcaster

    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        trainer = pool.submit(WeightBroadcaster, "127.0.0.1", port, 2, timeout=10)
        receiver = server.receive_weights("127.0.0.1", port, 1, 2, timeout=10)
        return trainer.result(timeout=60), receiver


def result_at(server: BatchedPolicyServer, trainer, receiver, version: int, dtype=torch.float32) -> TensorDict:
    """``server``'s result for ones once it serves ``version``; its receiver stayed healthy; the trainer leaves."""
    remote = server.remote_policy()
    serve_until(remote, version, dtype)
    out = remote(TensorDict(observation=torch.ones(8, dtype=dtype)))
    assert receiver.alive and receiver.error is None
    trainer.close()
    return out


def test_trainer_pushes_versions_to_two_server_processes_over_a_dedicated_group():
    import torch.distributed as dist

    from torchrl_batchserve import WeightBroadcaster

    port, final = free_port(), 5
    reached = [SPAWN.Event(), SPAWN.Event()]
    stop, results = SPAWN.Event(), SPAWN.Queue()
    servers = [
        SPAWN.Process(target=pw.weight_server, args=(rank, 3, port, final, reached[rank - 1], stop, results))
        for rank in (1, 2)
    ]
    for s in servers:
        s.start()
    trainer = WeightBroadcaster("127.0.0.1", port, 3, timeout=60)  # returns once both servers joined
    try:
        for version in range(1, final - 1):
            net = TensorDictModule(pw.make_net(version), in_keys=["observation"], out_keys=["logits"])
            assert trainer.push(net) == version
        wrong = TensorDictModule(
            nn.Sequential(nn.Linear(8, 17), nn.Tanh(), nn.Linear(17, 3)), in_keys=["observation"], out_keys=["logits"]
        )
        with pytest.raises(WeightSyncError, match=r"version 4 rejected.*rank 1: metadata mismatch.*rank 2"):
            trainer.push(wrong)
        assert trainer.version == final - 2  # the rejected push changed nothing
        net = TensorDictModule(pw.make_net(final), in_keys=["observation"], out_keys=["logits"])
        assert trainer.push(net, version=final) == final
        for event in reached:
            assert event.wait(60)  # every server served the last version
        stop.set()
        outs = sorted(report(results, servers, timeout=60) for _ in servers)
    finally:
        stop.set()
        trainer.close()
        for s in servers:
            s.join(30)
    assert [out[0] for out in outs] == [1, 2]
    for _rank, seen, monotonic, mismatches, served, default_group in outs:
        assert monotonic and mismatches == 0 and served > 0
        assert seen[0] == 0 and seen[-1] == final and set(seen) <= {0, 1, 2, 3, final}
        assert not default_group
    assert not dist.is_initialized()


def served_by_a_process(port: int, final: int, push) -> tuple:
    """``push()`` as the trainer of a weight group on ``port`` whose one server (rank 1) is a spawned process.

    The server's actors call it until one is served version ``final``; returns its report (rank, versions seen,
    whether they never went backwards, mismatches with each version's reference, calls served, default group).
    """
    reached, stop, results = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    server = SPAWN.Process(target=pw.weight_server, args=(1, 2, port, final, reached, stop, results))
    server.start()
    try:
        push()
        assert reached.wait(60)  # the server served the last version pushed
        stop.set()
        return report(results, [server], timeout=60)
    finally:
        stop.set()
        server.join(30)


def test_a_weight_sync_scheme_with_an_address_pushes_to_a_server_process_over_the_group():
    from torchrl_batchserve import BatchServeWeightSyncScheme

    port, final = free_port(), 3
    trained = TensorDictModule(pw.make_net(final), in_keys=["observation"], out_keys=["logits"])
    scheme = BatchServeWeightSyncScheme(address="127.0.0.1", port=port, world_size=2, timeout=60, module=trained)

    def push() -> None:
        scheme.init_on_sender(model_id="policy", context=None)  # what a collector does with its schemes
        scheme.connect()  # joins the group as rank 0: returns once the server joined
        assert "weight group 127.0.0.1" in repr(scheme)
        for version in range(1, final):
            trainer = TensorDictModule(pw.make_net(version), in_keys=["observation"], out_keys=["logits"])
            assert scheme.send(trainer) == version
        assert scheme.send() == final  # no weights given (update_policy_weights_()): module='s current ones

    try:
        _rank, seen, monotonic, mismatches, served, _ = served_by_a_process(port, final, push)
    finally:
        scheme.shutdown()
    assert monotonic and mismatches == 0 and served > 0 and seen[-1] == final
    unaimed = BatchServeWeightSyncScheme(address="127.0.0.1", port=port, world_size=2)
    with pytest.warns(UserWarning, match="nothing was sent"):  # no weights, and no module to take them from
        assert unaimed.send() is None
    with pytest.raises(ValueError, match="module= is for a weight group"):
        BatchServeWeightSyncScheme(server=object(), module=trained)


def test_the_legacy_weight_updater_pushes_over_a_weight_group_it_joins_at_its_first_push():
    # Nothing connects a scheme given to the legacy adapter: its first push raised "connect() the scheme
    # (the collector does)", and no collector would.
    from torchrl_batchserve import BatchServeWeightSyncScheme, weight_updater

    port, final = free_port(), 2
    scheme = BatchServeWeightSyncScheme(address="127.0.0.1", port=port, world_size=2, timeout=60)
    updater = weight_updater(scheme)

    def push() -> None:
        for version in range(1, final + 1):
            updater(TensorDictModule(pw.make_net(version), in_keys=["observation"], out_keys=["logits"]))

    try:
        _rank, seen, monotonic, mismatches, served, _ = served_by_a_process(port, final, push)
    finally:
        scheme.shutdown()
    assert monotonic and mismatches == 0 and served > 0 and seen[-1] == final


@pytest.mark.parametrize("kind", ["Collector", "MultiSyncCollector", "legacy weight_updater"])
def test_collector_weight_updates_reach_the_server(kind):
    import copy

    from torchrl.collectors import Collector, MultiSyncCollector
    from torchrl.envs import PendulumEnv

    from torchrl_batchserve import weight_updater

    policy = TensorDictModule(PendulumPolicy(), in_keys=["th", "thdot"], out_keys=["action"])
    trainer = copy.deepcopy(policy)
    kw = {"frames_per_batch": 32, "total_frames": 96, "auto_register_policy_transforms": False}
    with BatchedPolicyServer(policy, max_batch_size=8, timeout=0.005) as server:
        remote = server.remote_policy()
        if kind == "Collector":
            collector = Collector(
                PendulumEnv, remote, weight_sync_schemes={"policy": server.weight_sync_scheme()}, **kw
            )
        elif kind == "MultiSyncCollector":
            schemes = {"policy": server.weight_sync_scheme()}
            collector = MultiSyncCollector([PendulumEnv] * 2, remote, weight_sync_schemes=schemes, **kw)
        else:
            collector = Collector(PendulumEnv, remote, weight_updater=weight_updater(server), **kw)
        seen = []
        try:
            for batch in collector:
                with torch.no_grad():  # every action is the trainer's current policy's
                    torch.testing.assert_close(batch["action"], trainer.module(batch["th"], batch["thdot"]))
                seen.append(batch["policy_version"].unique().tolist())
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.add_(0.1)
                collector.update_policy_weights_(trainer)
        finally:
            collector.shutdown()
    assert seen == [[0], [1], [2]]  # new rollouts carry the new version


def test_a_multi_async_collectors_rows_each_carry_the_version_that_computed_their_action():
    # Its workers collect while the trainer pushes: a batch may mix versions, each row computed by its own.
    # TorchRL tells a worker to go on before it yields that worker's batch, so the next one may begin before
    # the push that follows. A batch whose worker was told to go on after a push (all but each worker's first,
    # and the second of the worker of iteration 0) carries that push's version or a newer one.
    from torchrl.collectors import MultiAsyncCollector
    from torchrl.envs import PendulumEnv

    policy = TensorDictModule(PendulumPolicy(), in_keys=["th", "thdot"], out_keys=["action"])
    trainer = copy.deepcopy(policy)
    weights = [TensorDict.from_module(trainer).data.clone()]  # by version
    with BatchedPolicyServer(policy, max_batch_size=8, timeout=0.005) as server:
        collector = MultiAsyncCollector(
            [PendulumEnv] * 2,
            server.remote_policy(),
            weight_sync_schemes={"policy": server.weight_sync_scheme()},
            frames_per_batch=32,
            total_frames=160,
            auto_register_policy_transforms=False,
        )
        oldest = []
        try:
            for batch in collector:
                versions = batch["policy_version"]
                assert int(versions.max()) < len(weights)  # none newer than the pushes made so far
                for version in versions.unique().tolist():
                    rows, net = batch[versions == version], copy.deepcopy(policy.module)
                    weights[version]["module"].to_module(net)
                    with torch.no_grad():
                        torch.testing.assert_close(rows["action"], net(rows["th"], rows["thdot"]))
                oldest.append(int(versions.min()))
                with torch.no_grad():
                    trainer.module.lin.weight.add_(0.25)
                collector.update_policy_weights_(trainer)
                weights.append(TensorDict.from_module(trainer).data.clone())
        finally:
            collector.shutdown()
    assert len(oldest) == 5 and server.policy_version == 5
    assert sum(v >= 1 for v in oldest) >= 2, oldest


@pytest.mark.parametrize("kind", ["Collector", "MultiSyncCollector"])
def test_a_collector_whose_policy_holds_no_remote_policy_is_refused_by_our_scheme_for_its_policy(kind):
    # The pushes would reach the server while the collector ran its own copy of the weights, never updated.
    from torchrl.collectors import Collector, MultiSyncCollector
    from torchrl.envs import PendulumEnv

    policy = TensorDictModule(PendulumPolicy(), in_keys=["th", "thdot"], out_keys=["action"])
    local = copy.deepcopy(policy)
    kw = {"frames_per_batch": 32, "total_frames": 64, "auto_register_policy_transforms": False}
    make = Collector if kind == "Collector" else lambda env, *a, **k: MultiSyncCollector([env] * 2, *a, **k)
    with BatchedPolicyServer(policy, max_batch_size=8) as server:
        with pytest.raises(TypeError, match=rf"the {kind}'s policy \(TensorDictModule\) holds no RemotePolicy"):
            make(PendulumEnv, local, weight_sync_schemes={"policy": server.weight_sync_scheme()}, **kw)
        if kind == "Collector":  # under another name the scheme updates the server beside the collector's policy
            collector = Collector(PendulumEnv, local, weight_sync_schemes={"served": server.weight_sync_scheme()}, **kw)
            try:
                for _ in collector:
                    collector.update_policy_weights_(weights_dict={"served": policy})
            finally:
                collector.shutdown()
            assert server.policy_version == 2


@pytest.mark.parametrize("kind", ["Collector", "MultiSyncCollector"])
def test_our_scheme_refuses_a_collector_served_by_another_server_and_a_push_to_some_workers_only(kind):
    # Two servers in one process (say one to collect, one to evaluate): the other's scheme would push weights
    # the collector never runs, each version stamped as if it did. And a push to some workers only is refused.
    from torchrl.collectors import Collector, MultiSyncCollector
    from torchrl.envs import PendulumEnv

    policy = TensorDictModule(PendulumPolicy(), in_keys=["th", "thdot"], out_keys=["action"])
    kw = {"frames_per_batch": 32, "total_frames": 32, "auto_register_policy_transforms": False}
    make = Collector if kind == "Collector" else lambda env, *a, **k: MultiSyncCollector([env] * 2, *a, **k)
    with BatchedPolicyServer(policy) as collecting, BatchedPolicyServer(copy.deepcopy(policy)) as other:
        remote = collecting.remote_policy()
        with pytest.raises(ValueError, match=rf"the {kind}'s RemotePolicy is served by another server"):
            make(PendulumEnv, remote, weight_sync_schemes={"policy": other.weight_sync_scheme()}, **kw)
        collector = make(PendulumEnv, remote, weight_sync_schemes={"policy": collecting.weight_sync_scheme()}, **kw)
        try:
            collector.update_policy_weights_(policy)
            with pytest.raises(ValueError, match=r"worker_ids=\[0\]: the collector's workers share the served weights"):
                collector.update_policy_weights_(policy, worker_ids=[0])  # one server: it cannot update some only
        finally:
            collector.shutdown()
        assert (collecting.policy_version, other.policy_version) == (1, 0)


def test_a_multi_process_collectors_modules_around_its_remote_policy_share_their_state_with_its_workers():
    # TorchRL sends the policy to the workers on the meta device for the scheme to fill: an exploration module
    # around the RemotePolicy failed every worker with "Cannot copy out of meta tensor". Filled with the
    # collector's own tensors in shared memory, the trainer's annealing reaches the workers, as with TorchRL's
    # own multi-process weights.
    from tensordict.nn import TensorDictSequential
    from torchrl.collectors import MultiSyncCollector
    from torchrl.data import Bounded
    from torchrl.envs import PendulumEnv
    from torchrl.modules import AdditiveGaussianModule

    policy = TensorDictModule(PendulumPolicy(), in_keys=["th", "thdot"], out_keys=["action"])
    wide = Bounded(-100.0, 100.0, shape=(1,))  # the noise is never clamped, so its spread is sigma's
    explore = AdditiveGaussianModule(spec=wide, sigma_init=0.5, sigma_end=0.1, annealing_num_steps=10)
    kw = {"frames_per_batch": 64, "total_frames": 192, "auto_register_policy_transforms": False}
    spread = []
    with BatchedPolicyServer(policy, max_batch_size=8) as server:
        scheme = {"policy": server.weight_sync_scheme()}
        collector = MultiSyncCollector(
            [PendulumEnv] * 2, TensorDictSequential(server.remote_policy(), explore), weight_sync_schemes=scheme, **kw
        )
        try:
            for batch in collector:
                with torch.no_grad():
                    served = policy.module(batch["th"], batch["thdot"])
                spread.append(float((batch["action"] - served).std()))
                explore.step(10)  # annealed in place, to sigma_end, in the trainer's process only
                collector.update_policy_weights_()
        finally:
            collector.shutdown()
    # 64 draws a batch. The second batch may have begun before the step (TorchRL lets the workers go on
    # before it yields a batch); the third began after it.
    assert 0.3 < spread[0] < 0.75 and 0.06 < spread[2] < 0.15, spread
    assert server.policy_version == 3


@pytest.mark.parametrize("target", ["server", "scheme"])
def test_the_legacy_weight_updater_serves_the_trained_module_on_an_update_with_no_argument(target):
    # It dropped update_policy_weights_() with no argument: a trainer training the served module in place
    # kept collecting with the weights of version 0.
    from torchrl.collectors import Collector
    from torchrl.envs import PendulumEnv

    from torchrl_batchserve import weight_updater

    policy = TensorDictModule(PendulumPolicy(), in_keys=["th", "thdot"], out_keys=["action"])
    kw = {"frames_per_batch": 16, "total_frames": 48, "auto_register_policy_transforms": False}
    with BatchedPolicyServer(policy, max_batch_size=8, timeout=0.005) as server:
        updater = weight_updater(server if target == "server" else server.weight_sync_scheme())
        collector = Collector(PendulumEnv, server.remote_policy(), weight_updater=updater, **kw)
        seen = []
        try:
            for batch in collector:
                with torch.no_grad():  # the module trained in place, as it was at the last update
                    torch.testing.assert_close(batch["action"], policy.module(batch["th"], batch["thdot"]))
                seen.append(batch["policy_version"].unique().tolist())
                with torch.no_grad():
                    for p in policy.parameters():
                        p.add_(0.1)
                collector.update_policy_weights_()
            with pytest.raises(ValueError, match=r"worker_ids=0: the collector's workers share the served weights"):
                collector.update_policy_weights_(worker_ids=[0])  # one server: no push for some workers only
        finally:
            collector.shutdown()
    assert seen == [[0], [1], [2]] and server.policy_version == 3
    with pytest.raises(TypeError, match="target must be a BatchedPolicyServer or a BatchServeWeightSyncScheme, got"):
        weight_updater(policy)  # accepted before: the collector's first update_policy_weights_ failed


def test_scheme_arguments_and_clean_import():
    import subprocess
    import sys

    from torchrl_batchserve import BatchServeWeightSyncScheme

    with pytest.raises(ValueError, match="give either server= .* or address=, port= and world_size="):
        BatchServeWeightSyncScheme()
    with pytest.raises(ValueError, match="give either server="):
        BatchServeWeightSyncScheme(object(), address="127.0.0.1", port=1, world_size=2)
    with pytest.raises(ValueError, match=r"port must be an int in 1..65535 \(got 'x'\)"):  # not at the first push
        BatchServeWeightSyncScheme(address="127.0.0.1", port="x", world_size=2)
    # accepted before, and the collector's first push failed on them
    with pytest.raises(TypeError, match="server must be a BatchedPolicyServer .*, got str"):
        BatchServeWeightSyncScheme(server="server")
    with pytest.raises(TypeError, match=r"module must be the trainer's policy \(an nn.Module, .*\), got int"):
        BatchServeWeightSyncScheme(address="127.0.0.1", port=1, world_size=2, module=3)
    from torchrl_batchserve import WeightBroadcaster

    # checked before anything binds or connects (torch's TCPStore named none of them, or waited on a bad one)
    for kwargs, message in (
        ({"world_size": "2"}, r"world_size must be an int >= 2: .* \(got '2'\)"),
        ({"port": "29500"}, r"port must be an int in 1..65535 \(got '29500'\)"),
        ({"address": None}, r"address must be a host name or an IP address \(got None\)"),
        ({"timeout": -1}, r"timeout must be a finite number of seconds > 0 \(got -1\)"),
        ({"timeout": 9e9}, r"timeout must be at most 1e\+09 seconds .* \(got 9000000000.0\)"),  # its store hung
    ):
        args = {"address": "127.0.0.1", "port": 1, "world_size": 2, **kwargs}
        with pytest.raises(ValueError, match=message):
            WeightBroadcaster(args["address"], args["port"], args["world_size"], timeout=args.get("timeout", 60.0))
    policy = TensorDictModule(pw.make_net(0), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        with pytest.raises(ValueError, match=r"a server's rank must be an int in 1..1 \(got 0\)"):
            server.receive_weights("127.0.0.1", 1, 0, 2)
        with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds > 0 \(got nan\)"):
            server.receive_weights("127.0.0.1", 1, 1, 2, timeout=float("nan"))
    code = "import warnings; warnings.simplefilter('error'); import torchrl_batchserve"
    subprocess.run([sys.executable, "-c", code], check=True)  # no DeprecationWarning from WeightUpdaterBase


def test_a_weight_group_that_does_not_form_in_time_raises_weight_sync_error_saying_who_was_waited_for():
    # torch.distributed's errors named a store key ("/torchrl_batchserve/weights/0/1") or a socket, not the group
    from torchrl_batchserve import WeightBroadcaster

    port = free_port()
    for _ in range(2):  # the port is free again: a trainer may retry once its servers are up
        with pytest.raises(
            WeightSyncError,
            match=rf"the weight group at 127.0.0.1:{port} \(world_size=2, timeout=1 s\) could not form: the trainer "
            r"\(rank 0\) waits for servers 1..1 to join \(server.receive_weights\)\. \w+Error: ",  # torch's, after
        ):
            WeightBroadcaster("127.0.0.1", port, 2, timeout=1)
    with socket.create_server(("127.0.0.1", 0)) as taken:  # another program listens there
        with pytest.raises(
            WeightSyncError, match=rf"127.0.0.1:{taken.getsockname()[1]} .* could not form: the trainer"
        ):
            WeightBroadcaster("127.0.0.1", taken.getsockname()[1], 2, timeout=1)
    policy = TensorDictModule(pw.make_net(0), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        with pytest.raises(
            WeightSyncError, match=r"\(world_size=2, timeout=1 s\) could not form: server rank 1 waits for the trainer"
        ):
            server.receive_weights("127.0.0.1", free_port(), 1, 2, timeout=1)
        assert server.remote_policy()(TensorDict(observation=torch.ones(8)))["logits"].shape == (3,)  # serves on


def test_a_push_that_loses_to_a_local_update_is_dropped_and_the_receiver_takes_the_next():
    # update_weights() in the server's process may stage a newer version while a pushed one is in transfer.
    policy = TensorDictModule(pw.make_net(0), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        trainer, receiver = weight_group(server)
        stage = server._weights.stage

        def local_push_wins(weights, version=None):  # the local push lands between the check and the stage
            server._weights.stage = stage
            server.update_weights(policy, version=10)
            return stage(weights, version)

        server._weights.stage = local_push_wins
        pushed = TensorDictModule(pw.make_net(11), in_keys=["observation"], out_keys=["logits"])
        trainer.push(pushed, version=1)  # staged too late: dropped
        trainer.push(pushed, version=11)
        out = result_at(server, trainer, receiver, 11)
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], pw.make_net(11)(torch.ones(8)))


def test_a_push_the_server_fails_to_stage_is_dropped_and_the_receiver_takes_the_next():
    # e.g. out of device memory for the copy: that version is lost, the receiver is not
    policy = TensorDictModule(pw.make_net(0), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        trainer, receiver = weight_group(server)
        stage = server._weights.stage

        def out_of_memory(weights, version=None):
            server._weights.stage = stage
            raise RuntimeError("CUDA out of memory")

        server._weights.stage = out_of_memory
        trainer.push(TensorDictModule(pw.make_net(1), in_keys=["observation"], out_keys=["logits"]))
        assert trainer.push(TensorDictModule(pw.make_net(2), in_keys=["observation"], out_keys=["logits"])) == 2
        out = result_at(server, trainer, receiver, 2)
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], pw.make_net(2)(torch.ones(8)))


@pytest.mark.parametrize("compiled", [False, True])
def test_a_trainer_may_push_the_module_that_the_served_tensordictmodule_wraps(compiled):
    net = torch.compile(pw.make_net(0), backend="eager") if compiled else pw.make_net(0)  # served under "_orig_mod"
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        trainer, receiver = weight_group(server)
        assert trainer.push(pw.make_net(5)) == 1  # its names lack the wrapper's "module."
        with pytest.raises(WeightSyncError, match="version must be an int .*, got 2.5"):
            trainer.push(pw.make_net(6), version=2.5)  # refused before anything is sent
        with pytest.raises(WeightSyncError, match="version must be at most 2"):
            trainer.push(pw.make_net(6), version=2**63)
        out = result_at(server, trainer, receiver, 1)
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], pw.make_net(5)(torch.ones(8)))


def test_a_weight_group_push_of_a_module_holding_the_served_one_serves_that_one():
    # a trainer's actor and critic: the critic's weights travel with the push and are left out by the server
    with BatchedPolicyServer(TensorDictModule(pw.make_net(0), in_keys=["observation"], out_keys=["logits"])) as server:
        trainer, receiver = weight_group(server)
        actor = TensorDictModule(pw.make_net(7), in_keys=["observation"], out_keys=["logits"])
        assert trainer.push(nn.ModuleDict({"actor": actor, "critic": nn.Linear(8, 1)})) == 1
        out = result_at(server, trainer, receiver, 1)
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], pw.make_net(7)(torch.ones(8)))


def test_a_weight_group_push_from_a_float32_trainer_serves_a_bfloat16_server_its_weights_cast():
    served = TensorDictModule(pw.make_net(0).to(torch.bfloat16), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(served) as server:
        trainer, receiver = weight_group(server)
        assert trainer.push(pw.make_net(3)) == 1
        out = result_at(server, trainer, receiver, 1, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], pw.make_net(3).to(torch.bfloat16)(out["observation"]))


def test_a_weight_group_push_of_a_state_dict_may_leave_out_non_persistent_buffers():
    class WithConstant(nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.net = pw.make_net(seed)
            self.register_buffer("offset", torch.full((8,), float(seed)), persistent=False)

        def forward(self, observation):
            return self.net(observation + self.offset)

    served = WithConstant(0)
    with BatchedPolicyServer(TensorDictModule(served, in_keys=["observation"], out_keys=["logits"])) as server:
        trainer, receiver = weight_group(server)
        trained = WithConstant(4)
        assert trainer.push(trained.state_dict()) == 1  # no offset in it: the served one stays
        out = result_at(server, trainer, receiver, 1)
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], trained.net(torch.ones(8) + served.offset))


def test_a_weight_group_push_carries_weights_of_dtypes_gloo_does_not_broadcast():
    # float8 (a quantized policy's weights and scales) and uint16: gloo refuses them as they are.
    class Quantized(nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.net = pw.make_net(seed)
            self.register_buffer("scale", torch.full((3,), 0.5 + seed, dtype=torch.float8_e4m3fn))
            self.register_buffer("offset", torch.full((3,), seed, dtype=torch.uint16))

        def forward(self, observation):
            return self.net(observation) * self.scale.float() + self.offset.float()

    with BatchedPolicyServer(TensorDictModule(Quantized(0), in_keys=["observation"], out_keys=["logits"])) as server:
        trainer, receiver = weight_group(server)
        trained = Quantized(2)
        assert trainer.push(trained) == 1
        out = result_at(server, trainer, receiver, 1)
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], trained(torch.ones(8)))


def test_a_push_whose_weights_cannot_be_read_fails_before_the_servers_hear_of_it_and_the_next_push_lands():
    # Weights on the meta device (a deferred-init trainer) hold no values: the servers must not be left
    # waiting mid-push for buffers that never come (their receiver would stop for good at the timeout).
    policy = TensorDictModule(pw.make_net(0), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        trainer, receiver = weight_group(server)
        with pytest.raises(WeightSyncError, match="version 1"):
            trainer.push(pw.make_net(3).to("meta"))
        assert trainer.version == 0
        t = time.monotonic()
        assert trainer.push(pw.make_net(4)) == 1
        assert time.monotonic() - t < 5  # not after the servers' timeout
        out = result_at(server, trainer, receiver, 1)
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], pw.make_net(4)(torch.ones(8)))


def test_a_dead_trainer_leaves_the_server_serving_its_last_version():
    port = free_port()
    pushed = SPAWN.Event()
    trainer = SPAWN.Process(target=pw.trainer_then_hang, args=(port, 2, pushed))
    trainer.start()
    policy = TensorDictModule(pw.make_net(0), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        receiver = server.receive_weights("127.0.0.1", port, 1, 2, timeout=30)
        assert pushed.wait(60)
        remote = server.remote_policy()
        serve_until(remote, 1)
        pw.kill(trainer.pid)
        trainer.join(10)
        wait_for(lambda: not receiver.alive, "the receiver to notice the trainer is gone")
        out = remote(TensorDict(observation=torch.ones(8)))  # still serving, the last complete version
    assert int(out["policy_version"]) == 1 and receiver.error is not None
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], pw.make_net(1)(torch.ones(8)))


@pytest.mark.parametrize(
    "trainer",
    [
        "WeightBroadcaster('127.0.0.1', {port}, 2)",
        "BatchServeWeightSyncScheme(address='127.0.0.1', port={port}, world_size=2, module=trained)",
    ],
    ids=["broadcaster", "scheme"],
)
def test_a_trainer_that_exits_with_its_weight_group_open_leaves_it_on_the_way_out(trainer):
    # Left to the interpreter's exit, the gloo group and the store aborted the trainer's process now and then
    # (std::terminate, rc -6) after its work was done, and the servers never heard it leave.
    import subprocess
    import sys

    port = free_port()
    code = f"""
import torch
from tensordict.nn import TensorDictModule
from torchrl_batchserve import BatchServeWeightSyncScheme, WeightBroadcaster
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
trained = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
trainer = {trainer.format(port=port)}
assert (trainer.push(trained) if hasattr(trainer, "push") else trainer.send()) == 1
"""
    policy = TensorDictModule(pw.make_net(0), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        process = subprocess.Popen([sys.executable, "-c", code])
        try:
            receiver = server.receive_weights("127.0.0.1", port, 1, 2, timeout=30)
            assert process.wait(60) == 0
        finally:
            process.kill()
        wait_for(lambda: not receiver.alive, "the receiver to stop")
        assert receiver.error is None  # told to stop, not cut off
        assert server.policy_version == 1


def test_a_forked_childs_exit_leaves_its_parents_weight_group_alone():
    # The exit hook that leaves a process's weight groups ran in a forked child too, on its copies of the
    # parent's: it announced a push there and the parent's receiver timed out waiting for it.
    from torchrl_batchserve import WeightBroadcaster
    from torchrl_batchserve.distributed import _close_members

    port = free_port()
    policy = TensorDictModule(pw.make_net(0), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server, ThreadPoolExecutor(1) as pool:
        joining = pool.submit(WeightBroadcaster, "127.0.0.1", port, 2, timeout=5)
        receiver = server.receive_weights("127.0.0.1", port, 1, 2, timeout=5)
        trainer = joining.result(30)
        assert trainer.push(pw.make_net(1)) == 1
        pid = os.fork()
        if pid == 0:
            _close_members()  # what the child's exit runs
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert trainer.push(pw.make_net(2)) == 2  # the group is in step: no push was announced by the child
        wait_for(lambda: server.policy_version == 2, "the second push to be staged")
        assert receiver.alive
        trainer.close()


def test_a_server_dropped_without_close_leaves_its_weight_group_so_the_trainers_next_push_fails():
    # Its receiver took every later push for a server nobody could reach: the trainer never heard it was gone.
    from torchrl_batchserve import WeightBroadcaster

    server = BatchedPolicyServer(TensorDictModule(pw.make_net(), in_keys=["observation"], out_keys=["logits"]))
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(WeightBroadcaster, "127.0.0.1", port, 2, timeout=3)
        receiver = server.receive_weights("127.0.0.1", port, 1, 2, timeout=10)
        trainer = joining.result(timeout=60)
    try:
        assert trainer.push(TensorDictModule(pw.make_net(1), in_keys=["observation"], out_keys=["logits"])) == 1
        serve_until(server.remote_policy(), 1)
        del server
        gc.collect()
        wait_for(lambda: not receiver.alive, "the collected server's receiver to stop")
        with pytest.raises(WeightSyncError, match="pushing version 2 failed"):
            trainer.push(TensorDictModule(pw.make_net(2), in_keys=["observation"], out_keys=["logits"]))
    finally:
        trainer.close()


def test_a_push_to_a_dead_server_fails_instead_of_hanging():
    from torchrl_batchserve import WeightBroadcaster

    port, joining, joined = free_port(), SPAWN.Event(), SPAWN.Event()
    host = SPAWN.Process(target=pw.join_weight_group_then_hang, args=(port, 2, joining, joined))
    host.start()
    assert joining.wait(120)  # the group's 10 s start now, not while the spawned host imports torch
    trainer = WeightBroadcaster("127.0.0.1", port, 2, timeout=10)
    assert joined.wait(60)
    pw.kill(host.pid)
    host.join(10)
    t = time.monotonic()
    with pytest.raises(WeightSyncError, match="pushing version 1 failed"):
        trainer.push(TensorDictModule(pw.make_net(1), in_keys=["observation"], out_keys=["logits"]))
    assert time.monotonic() - t < 30 and trainer.version == 0


def test_a_client_with_the_wrong_key_is_refused_and_the_hub_keeps_accepting():
    from multiprocessing.connection import Client

    policy = TensorDictModule(pw.make_net(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        address, _, _ = server._endpoint.process_address()
        with pytest.raises(Exception):  # noqa: B017 - multiprocessing raises AuthenticationError or EOFError
            Client(address, family="AF_UNIX", authkey=b"wrong key").recv_bytes()
        copy = pickle.loads(pickle.dumps(remote))
        assert copy(TensorDict(observation=torch.ones(8)))["logits"].shape == (3,)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_worker_of_a_server_process_that_dies_gets_broken_error_while_a_later_child_lives(method, dead_hubs):
    # A process the server starts after a worker connected must not hold the hub's end
    # of that worker's socket, or the worker would never see the server die.
    results, info, ready = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Event()
    host = SPAWN.Process(target=pw.host_forking_workers, args=(method, results, info, ready))
    host.start()
    assert ready.wait(120), "the host never had its worker waiting"
    address, bystander = report(info, [host])
    dead_hubs.append(address)
    try:
        pw.kill(host.pid)
        kind, message = report(results, [], timeout=90)
    finally:
        pw.kill(bystander)
    host.join(10)
    assert kind == "ServerBrokenError", message


@pytest.mark.parametrize("mode, callers", [("threads", 8), ("tasks", 64), ("futures", 16)])
def test_threads_tasks_and_futures_of_one_worker_share_its_remote_policy_and_batch_together(mode, callers):
    net = pw.make_net()
    gated = GatedPolicy(net, block_first=1)
    with BatchedPolicyServer(gated, max_batch_size=64, timeout=0.01) as server:
        results = SPAWN.Queue()
        worker = SPAWN.Process(target=pw.many_callers, args=(server.remote_policy(), mode, callers, 5, results))
        worker.start()
        assert gated.entered.wait(120)  # the first batch is in the forward; the others queue behind it
        # Every caller's first request is then in the held batch or queued behind it (the held batch may hold
        # several, taken by a serve loop slow to wake), so one of the two holds at least half of them.
        wait_for(lambda: gated.batches[0] + len(server._queue._items) == callers, "the worker's callers to queue")
        gated.gate.set()
        out = report(results, [worker])
        worker.join(30)
        arrived = server._endpoint.lazy_hub.hub.arrived
    assert len(out) == callers * 5
    assert max(gated.batches) >= callers // 2  # requests of several callers of one process in one batch
    assert arrived["lane"] >= callers * 5 // 2  # a lane for each caller in flight (all but the first round)
    with torch.no_grad():
        for obs, logits in out:
            torch.testing.assert_close(torch.tensor(logits), net(torch.tensor(obs)))


class ServerOnlyError(Exception):
    """An error of a class that worker processes cannot import (its module exists in the server's process only)."""


def test_a_reply_a_worker_cannot_take_fails_that_request_alone():
    # Outputs that do not pickle broke the serve loop (the server served no one after), and an error of a class
    # the worker cannot import broke the worker's connection (every later call: "the server is closed").
    import sys
    import types

    from tensordict import NonTensorStack
    from tensordict.nn import TensorDictModuleBase

    class Picky(TensorDictModuleBase):
        in_keys, out_keys = ["observation"], ["logits", "info"]

        def forward(self, td):
            first = td["observation"][:, 0]
            if bool((first < -5).any()):
                raise ServerOnlyError("a policy error of a class only the server's process has")
            td.set("logits", td["observation"] * 2)
            return td.set("info", NonTensorStack(*[threading.Lock() if v < 0 else "fine" for v in first.tolist()]))

    module = types.ModuleType("server_only_errors")
    module.ServerOnlyError = ServerOnlyError
    saved = (ServerOnlyError.__module__, sys.modules.get(module.__name__))
    ServerOnlyError.__module__, sys.modules[module.__name__] = module.__name__, module
    try:
        with BatchedPolicyServer(Picky()) as server:
            [got] = run_workers(SPAWN, pw.outcomes, [(server.remote_policy(), [-1.0, 1.0, -10.0, 1.0, -1.0, 1.0])])
            assert server._serving.broken is None
            assert server.remote_policy()(TensorDict(observation=torch.ones(8)))["info"] == "fine"  # serves on
    finally:
        ServerOnlyError.__module__ = saved[0]
        if saved[1] is None:
            del sys.modules[module.__name__]
    kinds = [kind for kind, _ in got]
    assert kinds == ["PolicyError", "ok", "BatchServeError", "ok", "PolicyError", "ok"], got
    assert "outputs do not pickle" in got[0][1] and "cannot be read in this process" in got[2][1]
    assert "server_only_errors" in got[2][1] and got[1] == ("ok", 2.0)


def test_a_request_answered_before_the_hub_offers_a_lane_still_earns_the_client_one():
    from torchrl_batchserve import EvaluationCache

    net = pw.make_net()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, cache=EvaluationCache()) as server:
        seen = torch.ones(8)
        server.remote_policy()(TensorDict(observation=seen.clone()))  # cached: a worker's copy of it is a hit
        client = pickle.loads(pickle.dumps(server.remote_policy()))
        client(TensorDict(observation=seen.clone()))  # pickled, and answered at once, inside the hub's intake
        fresh = torch.zeros(8)
        out = client(TensorDict(observation=fresh.clone()))  # through the lane that first request earned
        assert server._endpoint.lazy_hub.hub.arrived == {"lane": 1, "socket": 1}
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], net(fresh))


def test_a_worker_sends_and_gets_tensors_of_dtypes_torch_cannot_unpickle():
    # uint16 depth images, float8 scales: every request of such a worker failed, the first (pickled) one and
    # so every later one too (the lane comes with a first request that arrives)
    class Shift(nn.Module):
        def forward(self, depth, scale):
            return depth.to(torch.int32).add(1).to(torch.uint16), (scale.float() * 2).to(torch.float8_e4m3fn)

    policy = TensorDictModule(Shift(), in_keys=["depth", "scale"], out_keys=["next_depth", "next_scale"])
    with BatchedPolicyServer(policy) as server:
        client = pickle.loads(pickle.dumps(server.remote_policy()))
        outs = [
            client(
                TensorDict(
                    depth=torch.full((4,), 60000 + i, dtype=torch.uint16),
                    scale=torch.full((2,), 0.5, dtype=torch.float8_e4m3fn),
                )
            )
            for i in range(2)
        ]
        assert server._endpoint.lazy_hub.hub.arrived == {"lane": 1, "socket": 1}  # pickled, then in a lane
    for i, out in enumerate(outs):
        assert out["next_depth"].dtype == torch.uint16 and out["next_depth"].tolist() == [60001 + i] * 4
        assert out["next_scale"].dtype == torch.float8_e4m3fn and out["next_scale"].float().tolist() == [1.0, 1.0]


def test_a_device_input_from_a_worker_with_lanes_travels_pickled_keeping_its_device():
    from torchrl_batchserve import BadRequestError

    policy = TensorDictModule(pw.make_net(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy) as server:
        client = pickle.loads(pickle.dumps(server.remote_policy()))
        for _ in range(2):
            client(TensorDict(observation=torch.ones(8)))  # the second through the lane the first earned
        # A lane would have copied it to the CPU and served it there; it reaches the server on its device,
        # whose check names it, as an in-process caller's would be.
        with pytest.raises(BadRequestError, match="key 'observation': expected device cpu, got meta"):
            client(TensorDict(observation=torch.ones(8, device="meta")))
        assert server._endpoint.lazy_hub.hub.arrived == {"lane": 1, "socket": 1}  # (refused: not counted)
        assert client(TensorDict(observation=torch.ones(8)))["logits"].shape == (3,)


class _Holdable(torch.nn.Module):
    """Serves at once until ``hold`` is set; then each forward waits for ``release``."""

    def __init__(self, net: nn.Module, hold: threading.Event, entered: threading.Event, release: threading.Event):
        super().__init__()
        self.net, self.hold, self.entered, self.release = net, hold, entered, release

    def __deepcopy__(self, memo):
        return type(self)(copy.deepcopy(self.net, memo), self.hold, self.entered, self.release)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        if self.hold.is_set():
            self.entered.set()
            assert self.release.wait(30), "the test never released the forward"
        return self.net(observation)


def _tasks_on_lanes(tasks: int = 8):
    """A server whose forwards can be held, a worker-side copy of its policy, and warm-up rounds of ``tasks``."""
    hold, entered, release = threading.Event(), threading.Event(), threading.Event()
    net = pw.make_net()
    policy = TensorDictModule(_Holdable(net, hold, entered, release), in_keys=["observation"], out_keys=["logits"])
    server = BatchedPolicyServer(policy, max_batch_size=64, timeout=0.005)
    remote = pickle.loads(pickle.dumps(server.remote_policy()))  # a client of the hub, as in a worker

    async def warm_up() -> None:
        hub = server._endpoint.lazy_hub.hub
        for _ in range(5):  # each round offers a lane to the tasks that found none free
            before = sum(hub.arrived.values())
            hold.set()  # all of the round's requests in flight at once, as the hub counts them for its offers
            calls = asyncio.gather(*(remote.acall(TensorDict(observation=torch.zeros(8))) for _ in range(tasks)))
            deadline = time.monotonic() + 30
            while sum(hub.arrived.values()) - before < tasks:
                assert time.monotonic() < deadline, "the round's requests never reached the hub"
                await asyncio.sleep(0.001)
            hold.clear()
            release.set()
            await asyncio.wait_for(calls, 30)  # a reply nobody reads fails here, not by hanging
            entered.clear()
            release.clear()
            if len(remote._endpoint._lanes) >= tasks:
                return
        raise AssertionError("the hub never offered a lane per task")

    asyncio.run(warm_up())
    return server, remote, net, (hold, entered, release)


def test_asyncio_tasks_wait_for_lane_replies_in_their_event_loop_and_a_cancelled_one_frees_its_lane():
    server, remote, net, (hold, entered, release) = _tasks_on_lanes(8)
    obs = [torch.randn(8, generator=torch.Generator().manual_seed(i)) for i in range(8)]

    async def held_round() -> list:
        before = server._endpoint.lazy_hub.hub.arrived["lane"]
        hold.set()
        tasks = [asyncio.create_task(remote.acall(TensorDict(observation=x))) for x in obs]
        ticks = 0
        while not (entered.is_set() and server._endpoint.lazy_hub.hub.arrived["lane"] - before == 8):
            ticks += 1  # the loop runs on while every task waits for its reply
            await asyncio.sleep(0.001)
        tasks[0].cancel()
        hold.clear()
        release.set()
        out = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
        again = await asyncio.wait_for(asyncio.gather(*(remote.acall(TensorDict(observation=x)) for x in obs)), 20)
        return [ticks, out, again]

    try:
        ticks, out, again = asyncio.run(held_round())
    finally:
        release.set()
        server.close()
    assert ticks > 0 and isinstance(out[0], asyncio.CancelledError)
    with torch.no_grad():
        for x, td in zip(obs[1:], out[1:]):
            torch.testing.assert_close(td["logits"], net(x))
        for x, td in zip(obs, again):  # the cancelled task's lane serves the next request, its reply dropped
            torch.testing.assert_close(td["logits"], net(x))


def test_tasks_of_four_event_loops_sharing_one_worker_copy_are_each_settled_in_their_own_loop():
    server, remote, net, (hold, entered, release) = _tasks_on_lanes(16)
    results: dict[int, list] = {}
    loop_errors: list = []  # in debug mode, a loop touched from another loop's thread raises there

    async def tasks(loop_index: int) -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
        xs = [torch.randn(8) for _ in range(4)]
        calls = asyncio.gather(*(remote.acall(TensorDict(observation=x)) for x in xs))
        results[loop_index] = list(zip(xs, await asyncio.wait_for(calls, 10)))

    try:
        hub = server._endpoint.lazy_hub.hub
        before = hub.arrived["lane"]
        hold.set()  # all 16 in flight at once: the client's reader settles several loops' replies per pass
        threads = [
            threading.Thread(target=asyncio.run, args=(tasks(i),), kwargs={"debug": True}, daemon=True)
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
        wait_for(lambda: hub.arrived["lane"] - before == 16, "the four loops' requests at the hub, in lanes")
        hold.clear()
        release.set()
        for thread in threads:
            thread.join(30)
    finally:
        release.set()
        server.close()
    assert sorted(results) == [0, 1, 2, 3] and not loop_errors, loop_errors
    with torch.no_grad():
        for pairs in results.values():
            for x, td in pairs:
                torch.testing.assert_close(td["logits"], net(x))


def test_a_closing_server_fails_every_task_waiting_on_a_lane_promptly():
    server, remote, _, (hold, entered, release) = _tasks_on_lanes(8)

    async def closed_round() -> list:
        before = server._endpoint.lazy_hub.hub.arrived["lane"]
        hold.set()
        tasks = [asyncio.create_task(remote.acall(TensorDict(observation=torch.zeros(8)))) for _ in range(8)]
        while not (entered.is_set() and server._endpoint.lazy_hub.hub.arrived["lane"] - before == 8):
            await asyncio.sleep(0.001)
        server.close(wait=False, cancel_pending=True)
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)

    try:
        out = asyncio.run(closed_round())
    finally:
        release.set()
        server.close(timeout=10)
    assert all(isinstance(err, ServerClosedError) for err in out), out


def test_a_submitted_futures_callback_may_call_the_policy_again():
    server, remote, net, (hold, entered, release) = _tasks_on_lanes(1)
    x, y = torch.randn(8), torch.randn(8)
    again: queue.Queue = queue.Queue()
    try:
        hold.set()
        future = remote.submit(TensorDict(observation=x))  # through the lane
        assert entered.wait(20)
        hold.clear()
        future.add_done_callback(lambda f: again.put(remote(TensorDict(observation=y))))  # runs when it settles
        release.set()
        td = again.get(timeout=20)  # not a reader waiting on itself
    finally:
        release.set()
        server.close()
    with torch.no_grad():
        torch.testing.assert_close(future.result(0)["logits"], net(x))
        torch.testing.assert_close(td["logits"], net(y))
