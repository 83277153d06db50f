"""Soak: mixed actors for a long time, every result checked, every resource counted.

Actor threads (``remote(td)`` and ``remote.submit(td)``), asyncio tasks
(``await remote.acall(td)``) and spawned worker processes (a pickled
``RemotePolicy``, shared by a blocking caller and asyncio tasks) send
requests of random sizes (single rows and 1-4 rows) while a trainer thread
pushes new weights throughout. The weights of version ``v`` are a pure
function of ``v`` (:func:`weights_at`), so every actor, in any process,
checks each result against a direct forward of the weights of the
version stamped on it. Counted:

* ``lost``: requests sent that never completed;
* ``errors``: calls that failed other than as the faults make them fail;
* ``duplicated``: results delivered twice (a Future's callback run twice), or
  in a TensorDict other than the one sent;
* ``wrong``: results that differ from the direct forward at their version, or
  whose version breaks the server's promise (:class:`Checker`).

``--replicas 2`` serves on two CPU replicas fed from one queue; ``--cache``
adds an :class:`~torchrl_batchserve.EvaluationCache` and draws every row
from one small pool of observations shared by all actors, so rows hit the
cache and identical rows in flight coalesce, across actors and processes,
while the versions change under them. ``--modes`` runs each worker process under an interaction type of its own
(RANDOM, DETERMINISTIC, MODE in turn; the other actors under none) and the
policy adds an offset per type, so a row served under another's type is
``wrong``: with ``--replicas 2`` batches of different types wait for each
other. ``--faults`` makes one request in 200
hold a row that makes its batch raise (``refused``: that batch's requests,
failed with the policy's error), cancels one call in 7 (``cancelled``) and
kills one more worker process with ``SIGKILL`` a second into the run.

Resources are read before the server starts, after warm-up and after close:
RSS, open file descriptors, threads, and entries in ``/dev/shm``.

    python benchmarks/soak.py                   # 10^6 requests; writes docs/reliability.md
    python benchmarks/soak.py --requests 20000  # a short run (the test suite runs a small one)
    python benchmarks/soak.py --requests 200000 --replicas 2 --cache  # replicas and the cache too
    python benchmarks/soak.py --requests 200000 --faults  # poisoned rows, cancelled calls, a killed worker
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import random
import threading
import time
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import InteractionType, TensorDictModule, set_interaction_type
from tensordict.nn.probabilistic import interaction_type

from torchrl_batchserve import BatchedPolicyServer, EvaluationCache

ROOT = Path(__file__).resolve().parents[1]
FEATURES, ACTIONS = 8, 3
POOL = 64  # distinct observation rows with --cache
POISON = 1e6  # a row whose first feature is this fails its batch (--faults)
MODES = (InteractionType.RANDOM, InteractionType.DETERMINISTIC, InteractionType.MODE)  # of the workers (--modes)
OFFSET = {None: 0.0, **{mode: 10.0 * (i + 1) for i, mode in enumerate(MODES)}}  # added by the policy per type
TIMEOUTS = (TimeoutError, asyncio.TimeoutError, FutureTimeoutError)  # a caller's own timeout (one class from 3.11)


def make_net() -> torch.nn.Module:
    """The base net, the same in every process and thread (its own generator: the global one is shared)."""
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, ACTIONS))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in net.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    return net


class Poisonable(torch.nn.Module):
    """The soak's net, raising for a batch that holds a poisoned row (a policy's own error, ``--faults``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[..., 0] == POISON).any()):
            raise ValueError("poisoned row")
        return self.net(x) + OFFSET[interaction_type()]  # 0 under no type: the plain net


def weights_at(version: int) -> dict[str, torch.Tensor]:
    """The weights served as ``version``: the base net's, shifted by a step per version (1,000 distinct)."""
    base = make_net().state_dict()
    return {k: v + 0.001 * (version % 1000) for k, v in base.items()}


class Checker:
    """Direct forwards at each version, and the counts of one actor.

    What is checked of a result's version is what the server promises: a
    caller with one request at a time never sees it go backwards
    (``caller``), and no request gets a version older than the newest staged
    before it was submitted (``floor``). Requests of one caller in flight
    together may come back in any order (a cache hit is answered at once,
    two replicas finish in either order).
    """

    def __init__(self, mode: InteractionType | None = None) -> None:
        self.offset = OFFSET[mode]  # what the policy adds under the actor's interaction type
        self._nets: dict[int, torch.nn.Module] = {}
        self.sent = self.done = self.wrong = self.duplicated = self.errors = self.refused = self.cancelled = 0
        self._last: dict[Any, int] = {}  # the newest version each caller has seen
        self.samples: list[str] = []

    def reference(self, version: int) -> torch.nn.Module:
        net = self._nets.get(version)
        if net is None:
            net = make_net()
            net.load_state_dict(weights_at(version))
            if len(self._nets) >= 4:  # results come back at a few recent versions
                del self._nets[min(self._nets)]
            self._nets[version] = net
        return net

    def check(self, td: TensorDict, sent: TensorDict, floor: int = -1, caller: Any = None) -> None:
        """``td``: the result of ``sent``; ``floor``: a version staged before it was submitted."""
        self.done += 1
        version = int(td["policy_version"].reshape(-1)[0])
        if td is not sent:
            self.duplicated += 1  # a result that is not this request's
            return
        if bool((td["observation"][..., 0] == POISON).any()):
            self.wrong += 1  # its batch raised: it cannot have a result
            return
        with torch.no_grad():
            want = self.reference(version)(td["observation"]) + self.offset
        least = max(floor, self._last.get(caller, -1)) if caller is not None else floor
        if version < least or not torch.allclose(td["logits"], want, rtol=1e-4, atol=1e-5):
            self.wrong += 1
            if len(self.samples) < 3:
                diff = (td["logits"] - want).abs().max().item()
                self.samples.append(f"v{version}, at least v{least}, rows {list(td.batch_size)}, diff {diff:.3g}")
        if caller is not None:
            self._last[caller] = max(self._last.get(caller, -1), version)

    def failed(self, error: BaseException, timed_out: bool = False) -> None:
        """A call that raised: cancelled by its caller, or its batch held a poisoned row; anything else is wrong.

        ``timed_out``: the caller gave it a timeout (a ``TimeoutError`` is then its caller's cancellation).
        """
        if isinstance(error, CancelledError) or (timed_out and isinstance(error, TIMEOUTS)):
            self.cancelled += 1  # cancelled by its caller (--faults)
        elif "poisoned row" in str(error):
            self.refused += 1  # its batch held a poisoned row: a row of its own or of a neighbour's
        else:
            self.errors += 1
            if len(self.samples) < 3:
                self.samples.append(repr(error))

    def counts(self) -> dict[str, Any]:
        names = ("sent", "done", "wrong", "duplicated", "errors", "refused", "cancelled", "samples")
        return {k: getattr(self, k) for k in names}


def pool() -> torch.Tensor:
    """The observations every actor draws from with ``--cache`` (the same in every process)."""
    return torch.randn(POOL, FEATURES, generator=torch.Generator().manual_seed(1))


def _unknown() -> int:
    return -1  # a worker process does not see the trainer's pushes


class Mix:
    """What every actor of one soak shares.

    Args:
        rows_of: draw every row from this pool (``--cache``), else random rows.
        faults: poison one request in 200 (its batch raises) and cancel one
            call in 7 (a Future at once, a task's call after 0.5 ms).
        staged: a version staged by now (the trainer's process only).
    """

    def __init__(
        self, rows_of: torch.Tensor | None, faults: bool, staged: Any = _unknown, mode: InteractionType | None = None
    ) -> None:
        self.rows_of, self.faults, self.staged, self.mode = rows_of, faults, staged, mode

    def request(self, rng: random.Random) -> TensorDict:
        """A fresh request of a single row or 1-4 rows."""
        rows = rng.choice([0, 0, 1, 2, 4])  # 0: a single row (batch size [])
        shape = [rows] if rows else []
        if self.rows_of is None:
            obs = torch.randn(*shape, FEATURES)
        else:
            obs = self.rows_of[[rng.randrange(len(self.rows_of)) for _ in range(max(rows, 1))]]
            obs = obs.reshape(*shape, FEATURES)
        if self.faults and rng.random() < 0.005:
            obs.view(-1, FEATURES)[0, 0] = POISON
        return TensorDict(observation=obs, batch_size=shape)

    def cancels(self, rng: random.Random) -> bool:
        return self.faults and rng.random() < 1 / 7


PLAIN = Mix(None, False)  # random rows, no faults


def blocking_actor(remote: Any, seed: int, n: int, mix: Mix) -> dict[str, Any]:
    rng, checker = random.Random(seed), Checker(mix.mode)
    for _ in range(n):
        td = mix.request(rng)
        checker.sent += 1
        floor = mix.staged()
        try:
            out = remote(td)
        except Exception as err:
            checker.failed(err)
            continue
        checker.check(out, td, floor, caller=0)
    return checker.counts()


def future_actor(remote: Any, seed: int, n: int, mix: Mix, depth: int = 4) -> dict[str, Any]:
    """Keeps ``depth`` futures in flight; counts every callback."""
    rng, checker = random.Random(seed), Checker(mix.mode)
    lock = threading.Lock()
    pending: list[tuple[Future, TensorDict, int, list[int]]] = []

    settled: list[list[int]] = []

    def settle(entry: tuple[Future, TensorDict, int, list[int]]) -> None:
        future, sent, floor, calls = entry
        settled.append(calls)
        try:
            out = future.result(60)
        except Exception as err:
            checker.failed(err)
            return
        checker.check(out, sent, floor)  # several in flight: no order between them

    for _ in range(n):
        checker.sent += 1
        calls = [0]

        def count(_: Future, calls: list[int] = calls) -> None:
            with lock:
                calls[0] += 1

        td = mix.request(rng)
        floor = mix.staged()
        future = remote.submit(td)
        future.add_done_callback(count)
        if mix.cancels(rng):
            future.cancel()  # refused once it runs; then it completes as usual
        pending.append((future, td, floor, calls))
        if len(pending) >= depth:
            settle(pending.pop(0))
    for entry in pending:
        settle(entry)
    # A future's callbacks run right after its result is set: by the time
    # every result has been read and a later request served, they have run.
    while True:
        try:
            remote(PLAIN.request(rng))
            break
        except Exception as err:  # --faults: its batch held another actor's poisoned row; serve another
            if "poisoned row" not in str(err):
                raise
    with lock:
        checker.duplicated += sum(calls[0] != 1 for calls in settled)
    return checker.counts()


def task_actors(remote: Any, seed: int, tasks: int, n: int, mix: Mix) -> dict[str, Any]:
    checker = Checker(mix.mode)

    async def one(k: int) -> None:
        rng = random.Random(seed + k)
        for _ in range(n):
            td = mix.request(rng)
            checker.sent += 1
            floor = mix.staged()
            timeout = 5e-4 if mix.cancels(rng) else None  # --faults: cancelled if it takes longer
            try:
                out = await asyncio.wait_for(remote.acall(td), timeout)
            except Exception as err:
                checker.failed(err, timed_out=timeout is not None)
                continue
            checker.check(out, td, floor, caller=k)  # each task is a caller with one request at a time

    async def main() -> None:
        await asyncio.gather(*(one(k) for k in range(tasks)))

    asyncio.run(main())
    return checker.counts()


def process_actor(
    remote: Any, seed: int, n: int, cached: bool, faults: bool, tasks: int, results: Any, mode: Any = None
) -> None:
    """A worker process: a blocking caller and ``tasks`` asyncio tasks (another thread) share its one copy.

    ``mode``: the interaction type of the whole process (``--modes``).
    """
    torch.set_num_threads(1)
    set_interaction_type(mode).__enter__()  # for the process's life: it is one value per process
    mix = Mix(pool() if cached else None, faults, mode=mode)
    of_tasks: list[dict[str, Any]] = []  # (no tasks: counts of zero)
    loop = threading.Thread(target=lambda: of_tasks.append(task_actors(remote, seed + 1000, tasks, n, mix)))
    loop.start()
    counts = blocking_actor(remote, seed, n, mix)
    loop.join()
    counts = {k: v + of_tasks[0][k] for k, v in counts.items()}  # (the samples are lists)
    if results is not None:
        results.put(counts)


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def resources() -> dict[str, Any]:
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    return {
        "rss_mb": rss,
        "fds": len(os.listdir("/proc/self/fd")),
        "fd_targets": sorted(_target(fd) for fd in os.listdir("/proc/self/fd")),
        # the process's reaper left out: started with the first server, it lives as long as the process
        "threads": len(os.listdir("/proc/self/task"))
        - sum(t.name == "batchserve-reaper" for t in threading.enumerate()),
        "dev_shm": len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0,
    }


def run(
    requests: int,
    threads: int = 4,
    futures: int = 2,
    tasks: int = 16,
    processes: int = 2,
    worker_tasks: int = 4,
    replicas: int = 1,
    cache: bool = False,
    faults: bool = False,
    modes: bool = False,
) -> dict[str, Any]:
    """One soak of about ``requests`` requests; the counts and the resources before, after warm-up and after.

    ``worker_tasks``: asyncio tasks in each worker process, besides its
    blocking caller. ``replicas``: CPU replicas serving the one queue.
    ``cache``: an evaluation cache, and every row drawn from :func:`pool`.
    ``faults``: poisoned rows and cancelled calls (:class:`Mix`), and one
    more worker process, killed (``SIGKILL``) a second into the run with
    requests in flight. ``modes``: each worker process under an interaction
    type of its own (:data:`MODES` in turn).
    """
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    results_queue = ctx.Queue()
    gc.collect()
    before = resources()
    actors = threads + futures + 1 + processes  # the tasks share one event loop thread
    per_actor = max(1, requests // (threads + futures + tasks + processes * (1 + worker_tasks)))
    policy = TensorDictModule(Poisonable(), in_keys=["observation"], out_keys=["logits"])
    trainer = TensorDictModule(Poisonable(), in_keys=["observation"], out_keys=["logits"])
    started = time.perf_counter()
    totals = dict.fromkeys(("sent", "done", "wrong", "duplicated", "errors", "refused", "cancelled"), 0)
    served = {"device": ["cpu"] * replicas} if replicas > 1 else {}
    if cache:
        served["cache"] = EvaluationCache(capacity=POOL // 2)  # smaller than the pool: entries are evicted too
    with BatchedPolicyServer(policy, max_batch_size=32, timeout=0.002, **served) as server:
        remote = server.remote_policy()
        stop = threading.Event()
        pushes = [0]

        def push_forever() -> None:
            version = 0
            while not stop.wait(0.05):
                version += 1
                trainer.module.net.load_state_dict(weights_at(version))
                assert server.update_weights(trainer) == version
                pushes[0] = version

        def staged() -> int:
            return pushes[0]  # staged once update_weights returned: a result submitted now is no older

        mix = Mix(pool() if cache else None, faults, staged)
        blocking_actor(remote, 999, 50, PLAIN)  # warm-up: the layout, the first batches
        warm = resources()
        pusher = threading.Thread(target=push_forever, daemon=True)
        pusher.start()
        workers = [
            ctx.Process(
                target=process_actor,
                args=(remote, 100 + i, per_actor, cache, faults, worker_tasks, results_queue),
                kwargs={"mode": MODES[i % len(MODES)] if modes else None},
            )
            for i in range(processes)
        ]
        victim = None
        if faults:  # calls until it is killed; it reports nothing
            victim = ctx.Process(target=process_actor, args=(remote, 99, 10**9, cache, faults, worker_tasks, None))
        for w in [*workers, victim] if victim is not None else workers:
            w.start()
        outcomes: list[dict[str, int]] = []
        lock = threading.Lock()

        def record(fn: Any, *args: Any) -> None:
            counts = fn(*args)
            with lock:
                outcomes.append(counts)

        local = [
            threading.Thread(target=record, args=(blocking_actor, remote, i, per_actor, mix)) for i in range(threads)
        ]
        local += [
            threading.Thread(target=record, args=(future_actor, remote, 50 + i, per_actor, mix)) for i in range(futures)
        ]
        local.append(threading.Thread(target=record, args=(task_actors, remote, 200, tasks, per_actor, mix)))
        for t in local:
            t.start()
        if victim is not None:
            time.sleep(1.0)  # mid-run, with requests in flight
            victim.kill()
            victim.join()
            victim.close()
        for t in local:
            t.join()
        outcomes += [results_queue.get(timeout=600) for _ in workers]
        for w in workers:
            w.join(60)
            w.close()  # its sentinel pipe
        stop.set()
        pusher.join(10)
        stats = server.statistics()
        assert len(outcomes) == actors
    elapsed = time.perf_counter() - started
    samples: list[str] = []
    for counts in outcomes:
        samples += counts.pop("samples")
        for k, v in counts.items():
            totals[k] += v
    gc.collect()
    time.sleep(0.2)  # threads that were told to stop finish returning
    after = resources()
    return {
        **totals,
        "wrong_samples": samples[:5],
        "lost": totals["sent"] - totals["done"] - totals["errors"] - totals["refused"] - totals["cancelled"],
        "elapsed_s": elapsed,
        "requests_per_s": totals["sent"] / elapsed,
        "pushes": pushes[0],
        "batches": stats.batches,
        "mean_batch": stats.mean_batch_size,
        "replica_batches": [r.batches for r in stats.replicas],
        "cache_hits": stats.cache_hits,
        "cache_coalesced": stats.cache_coalesced,
        "before": before,
        "warm": warm,
        "after": after,
    }


_TITLE = "# Reliability: the soak"
_INTRO = (
    "Actor threads (blocking calls and Futures, four in flight each), asyncio tasks and spawned worker "
    "processes (a blocking caller and four asyncio tasks each, on one RemotePolicy copy) send requests of "
    "1 to 4 rows or single rows while a trainer thread pushes new weights every "
    "50 ms. Every result is checked against a direct forward of the weights of the version stamped on it, "
    "and its version against what the server promises: never older than the newest staged before the request "
    "was sent, and never older than the last one its caller got for a caller with one request at a time. "
    "With faults, one request in 200 holds a row that makes its batch raise (that batch's requests are refused "
    "with the policy's error), one call in 7 is cancelled by its caller, and one more worker process is killed "
    "with SIGKILL a second into the run. With modes, the worker processes run under interaction types of their "
    "own (RANDOM, DETERMINISTIC), the other actors under none, and the policy adds an offset per type: a row "
    "served under another caller's type is wrong. Entries in /dev/shm are every program's (leftovers of others "
    "included): close must leave as many as there were before the server. Threads leave out the one a "
    "process keeps from its first server on (it closes servers dropped without close)."
)


def write_report(result: dict[str, Any], args: Any) -> Path:
    """Write this configuration's section of ``reliability.md``; the other configurations' sections stay."""
    b, w, a = result["before"], result["warm"], result["after"]
    flags = f" --replicas {args.replicas}" * (args.replicas > 1) + " --cache" * args.cache + " --faults" * args.faults
    flags += " --modes" * args.modes
    setting = (
        f"{args.replicas} CPU replica{'s' * (args.replicas > 1)}"
        + (f", the evaluation cache (rows drawn from one pool of {POOL}, a cache of {POOL // 2})" if args.cache else "")
        + (", faults" if args.faults else "")
        + (", worker processes under interaction types of their own" if args.modes else "")
    )
    section = [
        f"## {setting}",
        "",
        f"Produced by `python benchmarks/soak.py --requests {args.requests}{flags}` on this machine "
        f"({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}.",
        "",
        "| requests | lost | duplicated | wrong | errors | refused (poisoned batch) | cancelled | weight pushes "
        "| batches | mean batch | req/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {result['sent']:,} | {result['lost']} | {result['duplicated']} | {result['wrong']} | {result['errors']} "
        f"| {result['refused']:,} | {result['cancelled']:,} | {result['pushes']} | {result['batches']:,} "
        f"| {result['mean_batch']:.1f} "
        f"| {result['requests_per_s']:,.0f} |",
        "",
        f"Batches per replica: {', '.join(f'{n:,}' for n in result['replica_batches'])}. "
        f"Cache hits: {result['cache_hits']:,}; coalesced rows: {result['cache_coalesced']:,}.",
        "",
        "| resource | before the server | after warm-up | after close |",
        "|---|---:|---:|---:|",
        f"| RSS (MB) | {b['rss_mb']:.0f} | {w['rss_mb']:.0f} | {a['rss_mb']:.0f} |",
        f"| open file descriptors | {b['fds']} | {w['fds']} | {a['fds']} |",
        f"| threads | {b['threads']} | {w['threads']} | {a['threads']} |",
        f"| entries in /dev/shm | {b['dev_shm']} | {w['dev_shm']} | {a['dev_shm']} |",
        "",
        f"RSS growth after warm-up: {a['rss_mb'] - w['rss_mb']:+.0f} MB.",
        "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "reliability.md"
    sections = path.read_text().split("\n## ")[1:] if path.exists() else []
    kept = ["## " + text.rstrip("\n") + "\n" for text in sections if not text.startswith(f"{setting}\n")]
    mine = "\n".join(section)
    body = sorted([*kept, mine])  # one replica first
    path.write_text("\n".join([_TITLE, "", _INTRO, "", *body]))
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--replicas", type=int, default=1, help="CPU replicas serving the one queue")
    parser.add_argument("--cache", action="store_true", help="an evaluation cache, rows from one shared pool")
    parser.add_argument("--faults", action="store_true", help="poisoned rows, cancelled calls, a killed worker")
    parser.add_argument("--modes", action="store_true", help="worker processes under interaction types of their own")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="the folder reliability.md goes in")
    args = parser.parse_args(argv)
    result = run(args.requests, replicas=args.replicas, cache=args.cache, faults=args.faults, modes=args.modes)
    print({k: v for k, v in result.items() if k not in ("before", "warm", "after")})
    print("before", result["before"], "\nwarm  ", result["warm"], "\nafter ", result["after"])
    if args.requests >= 100_000:
        print("report:", write_report(result, args))
    return result


if __name__ == "__main__":
    main()
