"""Side-by-side benchmark: torchrl_batchserve vs TorchRL 0.14's InferenceServer.

One process run measures, on the same policies, inputs and machine:

* ``ours``: BatchedPolicyServer + RemotePolicy;
* ``torchrl``: ``torchrl.modules.inference_server.InferenceServer`` with its
  ThreadingTransport (threads call the client; asyncio tasks await
  ``asyncio.wrap_future(client.submit(td))``);
* ``naive``: every actor calls the policy itself (one shared model, no batching);
* ``floor``: the policy's own batched forward at the batch size the actors can
  form (min(actors, max_batch_size)), with no server at all.

Both servers get the same ``max_batch_size`` and ``timeout``. Each scenario is
repeated, the systems in turn (first to last, then last to first: none always
runs first); ratios are taken within a repeat and reported as medians.

    python benchmarks/run.py            # full run, writes docs/benchmarks.md and a PNG
    python benchmarks/run.py --quick    # seconds; a smoke test
    python benchmarks/run.py --device cuda   # both servers run the policy on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules.inference_server import InferenceServer, ThreadingTransport

from torchrl_batchserve import BatchedPolicyServer

ROOT = Path(__file__).resolve().parents[1]


class PixelNet(torch.nn.Module):
    """A small Atari-style conv net over 4x84x84 uint8 frames."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(4, 16, 8, stride=4),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 4, stride=2),
            torch.nn.ReLU(),
            torch.nn.Flatten(-3),
            torch.nn.Linear(32 * 9 * 9, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 6),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.float() / 255.0)


def make_payload(name: str) -> tuple[TensorDictModule, Callable[[torch.Generator], TensorDict]]:
    torch.manual_seed(0)
    if name == "vector":
        net = torch.nn.Sequential(
            torch.nn.Linear(64, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 8),
        )
        return TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]), (
            lambda g: TensorDict(observation=torch.randn(64, generator=g))
        )
    net = PixelNet()
    return TensorDictModule(net, in_keys=["pixels"], out_keys=["logits"]), (
        lambda g: TensorDict(pixels=torch.randint(0, 256, (4, 84, 84), dtype=torch.uint8, generator=g))
    )


@dataclass
class Measurement:
    system: str
    payload: str
    mode: str  # threads | tasks | floor
    actors: int
    repeat: int
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    mean_batch: float
    cpu_us: float


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3 if ordered else 0.0


def drive_threads(call: Callable, make: Callable, actors: int, per_actor: int) -> tuple[float, list[float], float]:
    barrier = threading.Barrier(actors + 1)
    latencies: list[list[float]] = [[] for _ in range(actors)]

    def actor(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        lat = latencies[i]
        with torch.no_grad():
            barrier.wait()
            for _ in range(per_actor):
                td = make(g)  # a fresh TensorDict per request, as an env step makes
                t = time.perf_counter()
                call(td)
                lat.append(time.perf_counter() - t)

    threads = [threading.Thread(target=actor, args=(i,)) for i in range(actors)]
    for t in threads:
        t.start()
    barrier.wait()
    start, cpu = time.perf_counter(), time.process_time()
    for t in threads:
        t.join()
    return time.perf_counter() - start, [x for lat in latencies for x in lat], time.process_time() - cpu


def drive_tasks(acall: Callable, make: Callable, tasks: int, per_task: int) -> tuple[float, list[float], float]:
    """Like :func:`drive_threads`: the clock starts once every task is running and has been served once."""
    latencies: list[float] = []
    served_once = 0

    async def task(i: int, all_served: asyncio.Event, go: asyncio.Event) -> None:
        nonlocal served_once
        g = torch.Generator().manual_seed(i)
        await acall(make(g))
        served_once += 1
        if served_once == tasks:
            all_served.set()
        await go.wait()  # (asyncio.Barrier is Python 3.11+)
        for _ in range(per_task):
            td = make(g)  # a fresh TensorDict per request, as an env step makes
            t = time.perf_counter()
            await acall(td)
            latencies.append(time.perf_counter() - t)

    async def main() -> tuple[float, float]:
        all_served, go = asyncio.Event(), asyncio.Event()
        running = asyncio.gather(*(task(i, all_served, go) for i in range(tasks)))
        await all_served.wait()
        start, cpu = time.perf_counter(), time.process_time()
        go.set()
        await running
        return time.perf_counter() - start, time.process_time() - cpu

    elapsed, cpu = asyncio.run(main())
    return elapsed, latencies, cpu


def measure(system: str, payload: str, mode: str, actors: int, repeat: int, total: int, args: Any) -> Measurement:
    # Every measurement starts with no garbage from the ones before: a full
    # collection of this process's heap takes ~200 ms here, and each system
    # should pay only for the collections its own allocations trigger.
    gc.collect()
    policy, make = make_payload(payload)
    per_actor = max(1, total // actors)
    mean_batch = 1.0
    device = getattr(args, "device", None)  # where both servers (and the naive actors) run the policy
    if system == "ours":
        with BatchedPolicyServer(
            policy, max_batch_size=args.max_batch_size, timeout=args.timeout, **served_on(device)
        ) as server:
            remote = server.remote_policy()
            if mode == "threads":
                elapsed, lat, cpu = drive_threads(remote, make, actors, per_actor)
            else:
                elapsed, lat, cpu = drive_tasks(remote.acall, make, actors, per_actor)
            mean_batch = server.statistics().mean_batch_size
    elif system == "torchrl":
        with InferenceServer(
            policy,
            ThreadingTransport(),
            max_batch_size=args.max_batch_size,
            timeout=args.timeout,
            **served_on(device),
        ) as server:
            client = server.client()
            if mode == "threads":
                elapsed, lat, cpu = drive_threads(client, make, actors, per_actor)
            else:
                elapsed, lat, cpu = drive_tasks(
                    lambda td: asyncio.wrap_future(client.submit(td)), make, actors, per_actor
                )
            mean_batch = float(server.stats().get("avg_batch_size", 0.0))
    elif system == "naive":
        call = called_on(policy, device)
        if mode == "threads":
            elapsed, lat, cpu = drive_threads(call, make, actors, per_actor)
        else:

            async def direct(td: TensorDict) -> TensorDict:
                with torch.no_grad():
                    return call(td)

            elapsed, lat, cpu = drive_tasks(direct, make, actors, per_actor)
    else:
        raise ValueError(system)
    n = per_actor * actors
    return Measurement(
        system,
        payload,
        mode,
        actors,
        repeat,
        n,
        n / elapsed,
        _pct(lat, 0.5),
        _pct(lat, 0.99),
        mean_batch,
        cpu / n * 1e6,
    )


def called_on(policy: TensorDictModule, device: torch.device | None) -> Callable[[TensorDict], TensorDict]:
    """``policy`` as a caller without a server runs it: on ``device``, its inputs sent there and its outputs back."""
    if device is None:
        return policy
    policy = policy.to(device)
    return lambda td: policy(td.to(device)).to("cpu")  # .to("cpu") waits for the device


def measure_floor(payload: str, batch: int, repeat: int, total: int, device: torch.device | None = None) -> Measurement:
    """The policy's batched forward alone: requests/s if every batch were full and free.

    On a ``device``, a batch also goes there and its outputs come back, as a server's do.
    """
    policy, make = make_payload(payload)
    g = torch.Generator().manual_seed(0)
    batch_td = torch.stack([make(g) for _ in range(batch)])
    forward = called_on(policy, device)
    iters = max(3, total // batch)
    lat = []
    with torch.no_grad():
        forward(batch_td.clone())
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(iters):
            t = time.perf_counter()
            forward(batch_td)
            lat.append(time.perf_counter() - t)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    n = iters * batch
    return Measurement(
        "floor",
        payload,
        "floor",
        batch,
        repeat,
        n,
        n / elapsed,
        _pct(lat, 0.5),
        _pct(lat, 0.99),
        float(batch),
        cpu / n * 1e6,
    )


def scenarios(quick: bool) -> list[tuple[str, str, int, int]]:
    """(payload, mode, actors, total requests)."""
    out = []
    for payload, scale in (("vector", 1), ("pixels", 8)):
        for threads, full in ((1, 5000), (8, 10000), (64, 20000), (256, 20000)):
            total = (512 if quick else full) // scale
            out.append((payload, "threads", threads, max(total, threads)))
        for tasks in (64, 1024):
            total = (1024 if quick else 24000) // scale
            out.append((payload, "tasks", tasks, max(total, tasks)))
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(results: list[Measurement], max_batch_size: int) -> list[dict]:
    rows = []
    keys = sorted(
        {(m.payload, m.mode, m.actors) for m in results if m.mode != "floor"},
        key=lambda k: (k[0] != "vector", k[1], k[2]),
    )
    for payload, mode, actors in keys:
        by_sys: dict[str, list[Measurement]] = {}
        for m in results:
            if (m.payload, m.mode, m.actors) == (payload, mode, actors):
                by_sys.setdefault(m.system, []).append(m)
        floor_batch = min(actors, max_batch_size)
        floor = [m for m in results if m.mode == "floor" and m.payload == payload and m.actors == floor_batch]
        row: dict[str, Any] = {"payload": payload, "mode": mode, "actors": actors}
        for system, ms in by_sys.items():
            row[system] = {
                "rps": median([m.rps for m in ms]),
                "p50_ms": median([m.p50_ms for m in ms]),
                "p99_ms": median([m.p99_ms for m in ms]),
                "mean_batch": median([m.mean_batch for m in ms]),
                "cpu_us": median([m.cpu_us for m in ms]),
            }
        if floor:
            row["floor"] = {"rps": median([m.rps for m in floor]), "p50_ms": median([m.p50_ms for m in floor])}
        ours, theirs = by_sys.get("ours", []), by_sys.get("torchrl", [])
        naive = by_sys.get("naive", [])
        pairs = [(o, t) for o in ours for t in theirs if o.repeat == t.repeat]
        row["x_torchrl"] = median([o.rps / t.rps for o, t in pairs])
        row["p99_vs_torchrl"] = median([o.p99_ms / t.p99_ms for o, t in pairs])
        row["cpu_vs_torchrl"] = median([o.cpu_us / t.cpu_us for o, t in pairs])
        row["x_naive"] = median([o.rps / n.rps for o in ours for n in naive if o.repeat == n.repeat])
        rows.append(row)
    return rows


def single_actor_overhead(results: list[Measurement]) -> dict[str, float]:
    """p50 latency of one actor minus the bare forward of one row, per system (vector payload)."""
    floor1 = median([m.p50_ms for m in results if m.mode == "floor" and m.payload == "vector" and m.actors == 1])
    out = {}
    for system in ("ours", "torchrl"):
        p50 = median(
            [
                m.p50_ms
                for m in results
                if m.system == system and m.payload == "vector" and m.mode == "threads" and m.actors == 1
            ]
        )
        out[system] = (p50 - floor1) * 1e3  # microseconds
    out["bare_forward_us"] = floor1 * 1e3
    return out


def criteria(rows: list[dict], overhead: dict[str, float]) -> list[tuple[str, str, bool]]:
    def row(payload: str, mode: str, actors: int) -> dict:
        return next(r for r in rows if (r["payload"], r["mode"], r["actors"]) == (payload, mode, actors))

    out = []
    r64 = row("vector", "threads", 64)
    out.append(("64 threads, vector: >= 4x TorchRL throughput", f"{r64['x_torchrl']:.2f}x", r64["x_torchrl"] >= 4))
    out.append(
        ("64 threads, vector: p99 <= 1/2 TorchRL's", f"{r64['p99_vs_torchrl']:.2f}", r64["p99_vs_torchrl"] <= 0.5)
    )
    out.append(("64 threads, vector: faster than naive", f"{r64['x_naive']:.2f}x", r64["x_naive"] > 1))
    r1024 = row("vector", "tasks", 1024)
    out.append(("1024 tasks: >= 5x TorchRL", f"{r1024['x_torchrl']:.2f}x", r1024["x_torchrl"] >= 5))
    r256 = row("vector", "threads", 256)
    out.append(("256 threads: >= 4x TorchRL", f"{r256['x_torchrl']:.2f}x", r256["x_torchrl"] >= 4))
    out.append(
        (
            "1 actor: overhead over bare forward <= 100 us",
            f"{overhead['ours']:+.0f} us (TorchRL {overhead['torchrl']:+.0f} us)",
            overhead["ours"] <= 100,
        )
    )
    rpx = row("pixels", "threads", 64)
    out.append(("pixels, 64 threads: >= 1.5x TorchRL", f"{rpx['x_torchrl']:.2f}x", rpx["x_torchrl"] >= 1.5))
    out.append(
        ("64 threads: CPU/request <= 1/3 TorchRL's", f"{r64['cpu_vs_torchrl']:.2f}", r64["cpu_vs_torchrl"] <= 1 / 3)
    )
    return out


def wake_round_trip_us(rounds: int = 2000) -> float:
    """Microseconds for a thread to wake another through a lock and be woken back: this host's wake-up cost.

    Every blocking caller is woken this way once per request, so thread
    figures follow it; it differs widely between hosts (an idle vCPU of a VM
    is slow to wake), which is why each report states it.
    """
    ping, pong = threading.Lock(), threading.Lock()
    ping.acquire()
    pong.acquire()

    def echo() -> None:
        for _ in range(rounds):
            ping.acquire()
            pong.release()

    thread = threading.Thread(target=echo)
    thread.start()
    start = time.perf_counter()
    for _ in range(rounds):
        ping.release()
        pong.acquire()
    elapsed = time.perf_counter() - start
    thread.join()
    return elapsed / rounds * 1e6


def provenance(script: str, args: Any) -> str:
    """The first line of every report: the command, the machine, the versions, the wake-up cost and the date."""
    command = f"python benchmarks/{script}" + (" --quick" if args.quick else "")
    device = getattr(args, "device", None)  # run.py and processes.py take --device
    command += f" --device {device}" if device is not None else ""
    return (
        f"Produced by `{command}` on {platform.node() or 'this machine'}: {os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}, "
        f"torchrl {__import__('torchrl').__version__}, tensordict {__import__('tensordict').__version__}; "
        f"a thread wake-up round trip takes {wake_round_trip_us():.0f} us here; {time.strftime('%Y-%m-%d')}."
    )


def save_report(lines: list[str], args: Any, stem: str, script: str, reproduce: str | None = None) -> Path:
    """Write ``lines`` and how to reproduce them to ``args.out/<stem>[_quick].md``."""
    reproduce = reproduce or f"`python benchmarks/{script}` (add `--quick` for a smoke run)."
    path = args.out / (f"{stem}_quick.md" if args.quick else f"{stem}.md")
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*lines, "", f"Reproduce: {reproduce}", ""]))
    return path


def write_report(rows: list[dict], overhead: dict, checks: list, args: Any, plot: Path | None) -> None:
    lines = [
        "# Benchmarks: torchrl_batchserve vs TorchRL's InferenceServer",
        "",
        provenance("run.py", args),
        "",
        f"Both servers: `max_batch_size={args.max_batch_size}`, `timeout={args.timeout}`, {device_note(args.device)}. "
        f"Medians of {args.repeats} repeat(s); ratios are taken within a repeat. "
        "One intra-op thread in every thread (`torch.set_num_threads(1)`, `OMP_NUM_THREADS=1`, `MKL_NUM_THREADS=1`); "
        "glibc malloc with fixed thresholds (`MALLOC_MMAP_THRESHOLD_=64MiB`, `MALLOC_TRIM_THRESHOLD_=256MiB`: "
        "without them, pixel batches fault their freed activations back in, in some runs and not others; "
        'see `docs/guide.md`, "Large observations"); each measurement starts after `gc.collect()`.',
        "Payloads: `vector` = 64 floats into an MLP 64-256-256-8; `pixels` = 4x84x84 uint8 into a small conv net.",
        "`floor` = the policy's own batched forward at min(actors, max_batch_size) rows, no server; "
        "`naive` = every actor calls the shared policy itself.",
        "",
        "| payload | actors | ours req/s | TorchRL req/s | x TorchRL | naive req/s | floor req/s "
        "| ours p50/p99 ms | TorchRL p50/p99 ms | ours/TorchRL mean batch | CPU us/req ours/TorchRL |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o, t, n, f = r.get("ours", {}), r.get("torchrl", {}), r.get("naive", {}), r.get("floor", {})
        lines.append(
            f"| {r['payload']} | {r['actors']} {r['mode']} | {o.get('rps', 0):,.0f} | {t.get('rps', 0):,.0f} "
            f"| **{r['x_torchrl']:.2f}** | {n.get('rps', 0):,.0f} | {f.get('rps', 0):,.0f} "
            f"| {o.get('p50_ms', 0):.2f}/{o.get('p99_ms', 0):.2f} | {t.get('p50_ms', 0):.2f}/{t.get('p99_ms', 0):.2f} "
            f"| {o.get('mean_batch', 0):.1f}/{t.get('mean_batch', 0):.1f} "
            f"| {o.get('cpu_us', 0):.0f}/{t.get('cpu_us', 0):.0f} |"
        )
    lines += [
        "",
        f"One actor (vector): the policy called on a one-row TensorDict takes {overhead['bare_forward_us']:.0f} us "
        f"(p50); a request's p50 latency adds to that: ours {overhead['ours']:+.0f} us, "
        f"TorchRL {overhead['torchrl']:+.0f} us. Both servers call the TensorDictModule on the batch, as the bare "
        'call does; a lone caller runs its own batch in its thread (`docs/design.md`, "Who runs a batch").',
        "",
        "## The targets of the benchmark (issues #3 and #20)",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ] + [f"| {name} | {value} | {'yes' if ok else 'no'} |" for name, value, ok in checks]
    if plot is not None:
        lines += ["", f"![throughput vs actors]({plot.name})"]
    lines += [
        "",
        "Why actor threads gain less than asyncio tasks: the tasks of one event loop are woken once per batch, "
        "while each blocking thread is woken on its own, one after another under the GIL (a context switch, half "
        "the wake-up round trip above, and the caller's own Python a step), each waking the next (the relay, "
        "`docs/performance.md`). Thread figures move by +-20% between runs of this machine; the ratios, taken "
        "within a repeat, move less. The floor is far above both servers for the vector payload: the per-request "
        "cost is the server, not the forward.",
    ]
    save_report(
        lines, args, "benchmarks", "run.py", "`make bench` (or `python benchmarks/run.py [--quick] [--repeats N]`)."
    )


def make_plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, payload in zip(axes, ("vector", "pixels")):
        rs = [r for r in rows if r["payload"] == payload and r["mode"] == "threads"]
        if not rs:
            ax.set_visible(False)
            continue
        xs = [r["actors"] for r in rs]
        for system, style in (("ours", "o-"), ("torchrl", "s-"), ("naive", "^--"), ("floor", "k:")):
            ys = [r.get(system, {}).get("rps", float("nan")) for r in rs]
            ax.plot(
                xs,
                ys,
                style,
                label={
                    "ours": "torchrl_batchserve",
                    "torchrl": "TorchRL InferenceServer",
                    "naive": "naive (each actor calls the model)",
                    "floor": "floor (batched forward alone)",
                }[system],
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("actor threads")
        ax.set_ylabel("requests / s")
        ax.set_title(f"{payload} payload")
        ax.grid(True, which="both", alpha=0.3)
    next(ax for ax in axes if ax.get_visible()).legend(fontsize=8)  # (with --only pixels the first is hidden)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# torch applies ``torch.set_num_threads(1)`` to a thread only once that thread
# asks torch for its thread count. A thread that never does (TorchRL's server
# thread, the naive baseline's actors) runs MKL's matrix products on an OpenMP
# team of one thread per core, which here means two cores for one system and
# one for the other. OpenMP reads these when torch loads.
ONE_INTRAOP_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# glibc's malloc gives large blocks back to the OS when they are freed (munmap,
# or trimming a thread's heap), depending on thresholds it adapts as it goes.
# A pixel forward frees ~15 MB of activations a batch; in a run where they go
# back, the next batch faults ~4000 pages in again (+50% CPU per request, in
# some measurements and not others). Fixed thresholds keep them. glibc reads
# these at start-up; both systems run under them.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


def restart_with(wanted: dict[str, str]) -> None:
    """Restart this script with ``wanted`` in its environment, unless it is there already."""
    if all(os.environ.get(k) == v for k, v in wanted.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **wanted})


def in_turn(systems: Sequence[str], repeat: int) -> Sequence[str]:
    """``systems`` in the order of this repeat: first to last, then last to first, so none always runs first."""
    return systems if repeat % 2 == 0 else systems[::-1]


def common_parser(doc: str | None, repeats: int = 3) -> argparse.ArgumentParser:
    """The options every benchmark script shares; ``repeats``: how many by default (1 with ``--quick``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke test, not a measurement")
    parser.add_argument("--repeats", type=int, default=None, help=f"default: 1 with --quick, else {repeats}")
    parser.set_defaults(full_repeats=repeats)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=0.002)
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where the report goes")
    parser.add_argument(
        "--device",
        default=None,
        help="where both servers run the policy (e.g. cuda); requests and results stay on the CPU, as an env's do",
    )
    return parser


def parse_common(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; ``args.repeats`` resolved to its default when not given."""
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else args.full_repeats)
    if args.device is not None:
        args.device = torch.device(args.device)
        if args.device.type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: this torch build or machine has no CUDA device")
    return args


def served_on(device: torch.device | None) -> dict[str, Any]:
    """The keywords that put a server's policy on ``device`` and its results on the CPU (both servers take them).

    Ours hands results back on each request's own device by default;
    TorchRL's leaves them where the policy put them unless told.
    """
    return {} if device is None else {"device": device, "output_device": "cpu"}


def device_note(device: torch.device | None) -> str:
    """Where the policy ran, for a report's settings line."""
    if device is None:
        return "the policy on the CPU"
    name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    return f"the policy on `{device}`{name}, requests and results on the CPU"


def main(argv: list[str] | None = None) -> dict:
    parser = common_parser(__doc__)
    parser.add_argument("--only", default=None, help="comma list of payloads to run (vector,pixels)")
    args = parse_common(parser, argv)
    torch.set_num_threads(1)
    results: list[Measurement] = []
    todo = [s for s in scenarios(args.quick) if not args.only or s[0] in args.only.split(",")]
    for repeat in range(args.repeats):
        for payload in sorted({s[0] for s in todo}):
            for batch in sorted({min(s[2], args.max_batch_size) for s in todo if s[0] == payload} | {1}):
                results.append(measure_floor(payload, batch, repeat, 256 if args.quick else 2048, args.device))
        for payload, mode, actors, total in todo:
            for system in in_turn(("ours", "torchrl", "naive"), repeat):
                # the naive baseline is an order of magnitude slower and steady: a quarter of the requests
                n = total if system != "naive" else max(actors, total // 4)
                m = measure(system, payload, mode, actors, repeat, n, args)
                results.append(m)
                print(
                    f"[{repeat}] {payload:6s} {actors:5d} {mode:7s} {system:8s} {m.rps:9.0f} req/s "
                    f"p50 {m.p50_ms:7.2f} p99 {m.p99_ms:7.2f} ms batch {m.mean_batch:5.1f} cpu {m.cpu_us:6.0f} us",
                    flush=True,
                )
    rows = summarize(results, args.max_batch_size)
    overhead = single_actor_overhead(results)
    checks = criteria(rows, overhead) if not args.only else []
    args.out.mkdir(parents=True, exist_ok=True)
    name = "benchmarks_quick" if args.quick else "benchmarks"
    plot = make_plot(rows, args.out / f"{name}.png")
    write_report(rows, overhead, checks, args, plot)
    results_dir = ROOT / "benchmarks" / "results"
    results_dir.mkdir(exist_ok=True)
    (results_dir / f"{name}.json").write_text(json.dumps([asdict(m) for m in results], indent=1))
    for name_, value, ok in checks:
        print(f"{'PASS' if ok else 'MISS'}  {name_}: {value}")
    return {"rows": rows, "overhead": overhead, "checks": checks}


if __name__ == "__main__":
    restart_with({**ONE_INTRAOP_THREAD, **STEADY_MALLOC})
    main()
