"""Soak: mixed actors for a long time, every result checked, every resource counted.

Actor threads (``remote(td)`` and ``remote.submit(td)``), asyncio tasks
(``await remote.acall(td)``) and spawned worker processes (a pickled
``RemotePolicy``) send requests of random sizes (single rows and 1-4 rows)
while a trainer thread pushes new weights throughout. The weights of version
``v`` are a pure function of ``v`` (:func:`weights_at`), so every actor, in any
process, checks each result against a direct forward of the weights of the
version stamped on it. Counted:

* ``lost``: requests sent that never completed (or completed with an error);
* ``duplicated``: results delivered twice (a Future's callback run twice, a
  reply for another request);
* ``wrong``: results that differ from the direct forward at their version, or
  whose version went backwards for their actor.

Resources are read before the server starts, after warm-up and after close:
RSS, open file descriptors, threads, and entries in ``/dev/shm``.

    python benchmarks/soak.py                   # 10^6 requests; writes docs/reliability.md
    python benchmarks/soak.py --requests 20000  # a short run (the test suite runs a small one)
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
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from torchrl_batchserve import BatchedPolicyServer

ROOT = Path(__file__).resolve().parents[1]
FEATURES, ACTIONS = 8, 3


def make_net() -> torch.nn.Module:
    """The base net, the same in every process and thread (its own generator: the global one is shared)."""
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, ACTIONS))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in net.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    return net


def weights_at(version: int) -> dict[str, torch.Tensor]:
    """The weights served as ``version``: the base net's, shifted by a step per version (1,000 distinct)."""
    base = make_net().state_dict()
    return {k: v + 0.001 * (version % 1000) for k, v in base.items()}


class Checker:
    """Direct forwards at each version, and the counts of one actor."""

    def __init__(self) -> None:
        self._nets: dict[int, torch.nn.Module] = {}
        self.sent = self.done = self.wrong = self.duplicated = self.errors = 0
        self.last_version = -1
        self.samples: list[str] = []

    def reference(self, version: int) -> torch.nn.Module:
        net = self._nets.get(version)
        if net is None:
            net = make_net()
            net.load_state_dict(weights_at(version))
            self._nets = {version: net}  # versions only grow per actor: keep the newest
        return net

    def check(self, td: TensorDict, marker: float) -> None:
        self.done += 1
        version = int(td["policy_version"].reshape(-1)[0])
        if td["observation"].reshape(-1)[0].item() != marker:
            self.duplicated += 1  # a result that is not this request's
            return
        with torch.no_grad():
            want = self.reference(version)(td["observation"])
        if version < self.last_version or not torch.allclose(td["logits"], want, rtol=1e-4, atol=1e-5):
            self.wrong += 1
            if len(self.samples) < 3:
                diff = (td["logits"] - want).abs().max().item()
                self.samples.append(
                    f"v{version} after v{self.last_version}, rows {list(td.batch_size)}, diff {diff:.3g}"
                )
        self.last_version = max(self.last_version, version)

    def counts(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("sent", "done", "wrong", "duplicated", "errors", "samples")}


def request(rng: random.Random, marker: float) -> TensorDict:
    rows = rng.choice([0, 0, 1, 2, 4])  # 0: a single row (batch size [])
    shape = [rows] if rows else []
    obs = torch.randn(*shape, FEATURES)
    obs.view(-1)[0] = marker  # which request this is: a result must carry its own input back
    return TensorDict(observation=obs, batch_size=shape)


def blocking_actor(remote: Any, seed: int, n: int) -> dict[str, int]:
    rng, checker = random.Random(seed), Checker()
    for i in range(n):
        marker = float(i)  # exact in float32 up to 2**24 requests per actor
        td = request(rng, marker)
        checker.sent += 1
        try:
            out = remote(td)
        except Exception:
            checker.errors += 1
            continue
        checker.check(out, marker)
    return checker.counts()


def future_actor(remote: Any, seed: int, n: int, depth: int = 4) -> dict[str, int]:
    """Keeps ``depth`` futures in flight; counts every callback."""
    rng, checker = random.Random(seed), Checker()
    lock = threading.Lock()
    pending: list[tuple[Future, float, list[int]]] = []

    settled: list[list[int]] = []

    def settle(entry: tuple[Future, float, list[int]]) -> None:
        future, marker, calls = entry
        settled.append(calls)
        try:
            out = future.result(60)
        except Exception:
            checker.errors += 1
            return
        checker.check(out, marker)

    for i in range(n):
        marker = float(i)
        checker.sent += 1
        calls = [0]

        def count(_: Future, calls: list[int] = calls) -> None:
            with lock:
                calls[0] += 1

        future = remote.submit(request(rng, marker))
        future.add_done_callback(count)
        pending.append((future, marker, calls))
        if len(pending) >= depth:
            settle(pending.pop(0))
    for entry in pending:
        settle(entry)
    for future, _, _ in pending:
        future.result(60)
    # A future's callbacks run right after its result is set: by the time
    # every result has been read and a later request served, they have run.
    remote(request(rng, -1.0))
    with lock:
        checker.duplicated += sum(calls[0] != 1 for calls in settled)
    return checker.counts()


def task_actors(remote: Any, seed: int, tasks: int, n: int) -> dict[str, int]:
    checker = Checker()

    async def one(k: int) -> None:
        rng = random.Random(seed + k)
        for i in range(n):
            marker = float(i)
            checker.sent += 1
            try:
                out = await remote.acall(request(rng, marker))
            except Exception:
                checker.errors += 1
                continue
            checker.check(out, marker)

    async def main() -> None:
        await asyncio.gather(*(one(k) for k in range(tasks)))

    asyncio.run(main())
    return checker.counts()


def process_actor(remote: Any, seed: int, n: int, results: Any) -> None:
    torch.set_num_threads(1)
    results.put(blocking_actor(remote, seed, n))


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
        "threads": len(os.listdir("/proc/self/task")),
        "dev_shm": len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0,
    }


def run(requests: int, threads: int = 4, futures: int = 2, tasks: int = 16, processes: int = 2) -> dict[str, Any]:
    """One soak of about ``requests`` requests; the counts and the resources before, after warm-up and after."""
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    results_queue = ctx.Queue()
    gc.collect()
    before = resources()
    actors = threads + futures + 1 + processes  # the tasks share one event loop thread
    per_actor = max(1, requests // (threads + futures + tasks + processes))
    policy = TensorDictModule(make_net(), in_keys=["observation"], out_keys=["logits"])
    trainer = TensorDictModule(make_net(), in_keys=["observation"], out_keys=["logits"])
    started = time.perf_counter()
    totals = {"sent": 0, "done": 0, "wrong": 0, "duplicated": 0, "errors": 0}
    with BatchedPolicyServer(policy, max_batch_size=32, timeout=0.002) as server:
        remote = server.remote_policy()
        stop = threading.Event()
        pushes = [0]

        def push_forever() -> None:
            version = 0
            while not stop.wait(0.05):
                version += 1
                trainer.module.load_state_dict(weights_at(version))
                assert server.update_weights(trainer) == version
                pushes[0] = version

        blocking_actor(remote, 999, 50)  # warm-up: the layout, the first batches
        warm = resources()
        pusher = threading.Thread(target=push_forever, daemon=True)
        pusher.start()
        workers = [
            ctx.Process(target=process_actor, args=(remote, 100 + i, per_actor, results_queue))
            for i in range(processes)
        ]
        for w in workers:
            w.start()
        outcomes: list[dict[str, int]] = []
        lock = threading.Lock()

        def record(fn: Any, *args: Any) -> None:
            counts = fn(*args)
            with lock:
                outcomes.append(counts)

        local = [threading.Thread(target=record, args=(blocking_actor, remote, i, per_actor)) for i in range(threads)]
        local += [
            threading.Thread(target=record, args=(future_actor, remote, 50 + i, per_actor)) for i in range(futures)
        ]
        local.append(threading.Thread(target=record, args=(task_actors, remote, 200, tasks, per_actor)))
        for t in local:
            t.start()
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
        "lost": totals["sent"] - totals["done"] - totals["errors"],
        "elapsed_s": elapsed,
        "requests_per_s": totals["sent"] / elapsed,
        "pushes": pushes[0],
        "batches": stats.batches,
        "mean_batch": stats.mean_batch_size,
        "before": before,
        "warm": warm,
        "after": after,
    }


def write_report(result: dict[str, Any], args: Any) -> Path:
    b, w, a = result["before"], result["warm"], result["after"]
    lines = [
        "# Reliability: the soak",
        "",
        f"Produced by `python benchmarks/soak.py --requests {args.requests}` on this machine "
        f"({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}.",
        "",
        "Actor threads (blocking calls and Futures, four in flight each), asyncio tasks and spawned worker "
        "processes send requests of 1 to 4 rows or single rows while a trainer thread pushes new weights every "
        "50 ms. Every result is checked against a direct forward of the weights of the version stamped on it.",
        "",
        "| requests | lost | duplicated | wrong | errors | weight pushes | batches | mean batch | req/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {result['sent']:,} | {result['lost']} | {result['duplicated']} | {result['wrong']} | {result['errors']} "
        f"| {result['pushes']} | {result['batches']:,} | {result['mean_batch']:.1f} "
        f"| {result['requests_per_s']:,.0f} |",
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
    path = args.out / "reliability.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args(argv)
    result = run(args.requests)
    print({k: v for k, v in result.items() if k not in ("before", "warm", "after")})
    print("before", result["before"], "\nwarm  ", result["warm"], "\nafter ", result["after"])
    if args.requests >= 100_000:
        print("report:", write_report(result, args))
    return result


if __name__ == "__main__":
    main()
