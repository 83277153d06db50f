"""Functions that run in worker processes (importable by spawned children)."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import threading
import time
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import InteractionType, TensorDictModule, set_interaction_type
from torch import nn

from torchrl_batchserve import BatchedPolicyServer, BatchServeError


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def random_requests(remote: Any, seed: int, n: int, results: Any) -> None:
    """``n`` requests of random batch shapes; sends back (inputs, outputs, versions) as lists."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        shape = [(), (3,), (2, 2)][int(torch.randint(0, 3, (), generator=g))]
        td = remote(TensorDict(observation=torch.randn(*shape, 8, generator=g), batch_size=shape))
        out.append((td["observation"].tolist(), td["logits"].tolist(), td["policy_version"].tolist(), list(shape)))
    results.put((seed, os.getpid(), out))


def call_until_told(remote: Any, started: Any, results: Any) -> None:
    """One request; reports its outcome (used while the server is gated, killed or closed)."""
    started.set()
    try:
        td = remote(TensorDict(observation=torch.ones(8)))
        results.put(("ok", td["logits"].tolist()))
    except BatchServeError as err:
        results.put((type(err).__name__, str(err)))


def interaction_of_requests(remote: Any, results: Any) -> None:
    """The types requests ran under: submits (the first sent from the client's pool), tasks, then calls.

    Each caller's block ends before its replies are read: a request carries the type it was made under.
    """
    with set_interaction_type(InteractionType.RANDOM):
        futures = [remote.submit(TensorDict(observation=torch.ones(8))) for _ in range(4)]
    out = [int(f.result(30)["mode"]) for f in futures]

    async def tasks() -> list:
        with set_interaction_type(InteractionType.DETERMINISTIC):
            calls = [asyncio.ensure_future(remote.acall(TensorDict(observation=torch.ones(8)))) for _ in range(4)]
            await asyncio.sleep(0)  # each task made its request under DETERMINISTIC
        return [int(td["mode"]) for td in await asyncio.gather(*calls)]

    out += asyncio.run(tasks())
    for mode in (InteractionType.DETERMINISTIC, InteractionType.RANDOM):
        with set_interaction_type(mode):
            out.append(int(remote(TensorDict(observation=torch.ones(8)))["mode"]))
    results.put(out)


class ModeEcho(nn.Module):
    """Returns 1 under DETERMINISTIC, 2 under RANDOM, 0 otherwise (the batch's interaction type)."""

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        from tensordict.nn.probabilistic import interaction_type

        code = {InteractionType.DETERMINISTIC: 1, InteractionType.RANDOM: 2}.get(interaction_type(), 0)
        return torch.full(observation.shape[:-1], code)


class Blocking(nn.Module):
    """A policy that never returns: the server process is killed while it runs."""

    def __init__(self, entered: Any) -> None:
        super().__init__()
        self.entered = entered

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        threading.Event().wait()
        return observation


def cancel_when_held(remote: Any, mode: str, first_call: bool, held: Any, results: Any) -> None:
    """An ``acall`` or a ``submit``, cancelled by its caller once the server holds it (``held`` is set); returns.

    ``first_call``: a call before it, so that its client has a lane for it; else it travels pickled.
    """
    if first_call:
        remote(TensorDict(observation=torch.zeros(8)))
    td = TensorDict(observation=torch.ones(8))
    if mode == "submit":
        future = remote.submit(td)
        assert held.wait(90)
        assert future.cancel()
    else:

        async def cancelled() -> None:
            task = asyncio.ensure_future(remote.acall(td))
            assert await asyncio.to_thread(held.wait, 90)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(cancelled())
    results.put("cancelled")


def serve_then_hang(pickled: Any, entered: Any = None) -> None:
    """A server in its own process: hands out a pickled RemotePolicy and serves; with ``entered``, its forward
    blocks (and sets it)."""
    module = make_net() if entered is None else Blocking(entered)
    policy = TensorDictModule(module, in_keys=["observation"], out_keys=["logits"])
    server = BatchedPolicyServer(policy).start()
    pickled.put(pickle.dumps(server.remote_policy()))
    while True:
        time.sleep(3600)


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def weight_server(rank: int, world: int, port: int, final: int, reached: Any, stop: Any, results: Any) -> None:
    """A server process in a weight group: actors query it while the trainer pushes versions."""
    import torch.distributed as dist

    policy = TensorDictModule(make_net(0), in_keys=["observation"], out_keys=["logits"])
    records: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[], []]
    with BatchedPolicyServer(policy, max_batch_size=8, timeout=0.001) as server:
        server.receive_weights("127.0.0.1", port, rank, world, timeout=60)

        def actor(i: int) -> None:
            remote = server.remote_policy()
            g = torch.Generator().manual_seed(rank * 10 + i)
            while not stop.is_set():
                x = torch.randn(8, generator=g)
                td = remote(TensorDict(observation=x))
                version = int(td["policy_version"])
                records[i].append((version, x, td["logits"]))
                if version >= final:
                    reached.set()

        threads = [threading.Thread(target=actor, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    references: dict[int, nn.Module] = {}
    mismatches, monotonic = 0, True
    for record in records:
        versions = [v for v, _, _ in record]
        monotonic &= versions == sorted(versions)
        for version, x, y in record:
            net = references.setdefault(version, make_net(version))
            with torch.no_grad():
                mismatches += not torch.allclose(net(x), y, atol=1e-6)
    seen = sorted({v for record in records for v, _, _ in record})
    results.put((rank, seen, monotonic, mismatches, sum(map(len, records)), dist.is_initialized()))


def trainer_then_hang(port: int, world: int, pushed: Any) -> None:
    """A trainer process: pushes version 1, then waits to be killed."""
    from torchrl_batchserve import WeightBroadcaster

    trainer = WeightBroadcaster("127.0.0.1", port, world, timeout=30)
    trainer.push(TensorDictModule(make_net(1), in_keys=["observation"], out_keys=["logits"]))
    pushed.set()
    while True:
        time.sleep(3600)


def join_weight_group_then_hang(port: int, world: int, joining: Any, joined: Any) -> None:
    """A server process that joins the weight group (``joining`` set as it starts to), then waits to be killed."""
    policy = TensorDictModule(make_net(0), in_keys=["observation"], out_keys=["logits"])
    server = BatchedPolicyServer(policy).start()
    joining.set()
    server.receive_weights("127.0.0.1", port, 1, world, timeout=30)
    joined.set()
    while True:
        time.sleep(3600)


def host_forking_workers(method: str, results: Any, info: Any, ready: Any) -> None:
    """A server process: a worker waits on it, then another process is started and stays alive.

    Reports its hub's address and the second process's pid on ``info``; the test kills this one, and
    the waiting worker must report ``ServerBrokenError`` on ``results`` though
    the other lives on. (Two queues: a queue's writers share one lock, and a
    process killed just after its put may still hold it, so the host never
    writes to the queue the worker reports on.)
    """
    import multiprocessing as mp

    entered = threading.Event()
    policy = TensorDictModule(Blocking(entered), in_keys=["observation"], out_keys=["logits"])
    server = BatchedPolicyServer(policy, timeout=0.001)
    remote = server.remote_policy()
    ctx = mp.get_context(method)
    started = ctx.Event()  # kept: a spawned child unpickles it after start() returns
    worker = ctx.Process(target=call_until_told, args=(remote, started, results))
    worker.start()
    assert entered.wait(120)  # the worker's request is in the forward: the hub holds its socket
    bystander = ctx.Process(target=time.sleep, args=(3600,))
    bystander.start()  # started later: it must not hold the hub's end of the worker's socket
    info.put((server._endpoint.lazy_hub.address[0], bystander.pid))
    ready.set()
    while True:
        time.sleep(3600)


def many_callers(remote: Any, mode: str, callers: int, per_caller: int, results: Any) -> None:
    """``callers`` threads, asyncio tasks or submits in flight of this one process share ``remote``; reports (obs, logits)."""
    import asyncio

    torch.set_num_threads(1)
    out: list[tuple[list, list]] = []

    def record(td: TensorDict) -> None:
        out.append((td["observation"].tolist(), td["logits"].tolist()))

    if mode == "threads":

        def actor(seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            for _ in range(per_caller):
                record(remote(TensorDict(observation=torch.randn(8, generator=g))))

        threads = [threading.Thread(target=actor, args=(i,)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elif mode == "futures":  # one thread with ``callers`` submits in flight at a time
        gens = [torch.Generator().manual_seed(seed) for seed in range(callers)]
        for _ in range(per_caller):
            futures = [remote.submit(TensorDict(observation=torch.randn(8, generator=g))) for g in gens]
            for future in futures:
                record(future.result(60))
    else:

        async def task(seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            for _ in range(per_caller):
                record(await remote.acall(TensorDict(observation=torch.randn(8, generator=g))))

        async def main() -> None:
            await asyncio.gather(*(task(i) for i in range(callers)))

        asyncio.run(main())
    results.put(out)


class PendulumFeatures(nn.Module):
    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return torch.stack([th.sin(), th.cos(), thdot], -1)


def recurrent_policy(hidden: int = 16) -> Any:
    """A TorchRL LSTM policy for PendulumEnv: features -> LSTMModule -> action (its state in the TensorDict)."""
    from tensordict.nn import TensorDictSequential
    from torchrl.modules import LSTMModule

    torch.manual_seed(0)
    features = TensorDictModule(PendulumFeatures(), in_keys=["th", "thdot"], out_keys=["features"])
    lstm = LSTMModule(input_size=3, hidden_size=hidden, in_key="features", out_key="embed")
    head = TensorDictModule(nn.Linear(hidden, 1), in_keys=["embed"], out_keys=["action"])
    return TensorDictSequential(features, lstm, head)


def recurrent_pendulum() -> Any:
    """PendulumEnv that marks resets (``is_init``) and carries the LSTM state of :func:`recurrent_policy`."""
    from torchrl.envs import InitTracker, PendulumEnv, TransformedEnv

    lstm = recurrent_policy()[1]
    return TransformedEnv(PendulumEnv(), InitTracker()).append_transform(lstm.make_tensordict_primer())


def call_until_it_fails(remote: Any, results: Any) -> None:
    """Calls until a call fails (at most 50); reports how many succeeded and the error."""
    for done in range(50):
        try:
            remote(TensorDict(observation=torch.ones(8)))
        except BatchServeError as err:
            results.put((done, type(err).__name__, str(err)))
            return
    results.put((50, None, None))


def outcomes(remote: Any, values: list[float], results: Any) -> None:
    """Calls with an observation of each value; reports each outcome: the error's type, or its first logit."""
    out = []
    for value in values:
        try:
            out.append(("ok", float(remote(TensorDict(observation=torch.full((8,), value)))["logits"][0])))
        except Exception as err:
            out.append((type(err).__name__, str(err)))
    results.put(out)


def one_call(remote: Any, results: Any) -> None:
    """One call (a worker's first travels pickled, and so does its reply); reports the logits' shape and sum."""
    logits = remote(TensorDict(observation=torch.ones(8)))["logits"]
    results.put((tuple(logits.shape), float(logits.sum())))


def call_at_the_open_file_limit(remote: Any, results: Any) -> None:
    """Connects, then calls at this process's open-file limit (a new lane's descriptor cannot come); the outcome."""
    import resource

    remote(TensorDict(observation=torch.ones(8)))  # connected, with a lane of one row
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # no new descriptor (they take the lowest)
    try:
        remote(TensorDict(observation=torch.ones(3, 8), batch_size=[3]))  # three rows: the hub offers a lane
        outcome = (None, None)
    except BatchServeError as err:
        outcome = (type(err).__name__, str(err))
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    results.put(outcome)
