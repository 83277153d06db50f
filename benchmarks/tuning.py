"""Tuning curves: throughput and p99 latency vs ``max_batch_size`` and vs ``timeout``.

Our server only, the ``vector`` payload of ``benchmarks/run.py`` (64 floats
into an MLP), three kinds of actors: 64 threads, 256 asyncio tasks, 8 worker
processes. One knob moves at a time: ``max_batch_size`` in 8..128 at
``timeout=2 ms``, then ``timeout`` in 0.5..32 ms at ``max_batch_size=64``.

    python benchmarks/tuning.py            # writes docs/tuning_curves.md and docs/tuning_curves.png
    python benchmarks/tuning.py --quick    # seconds; a smoke test (2 worker processes, not 8)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import processes
import run
from run import ONE_INTRAOP_THREAD, provenance, restart_with

ROOT = Path(__file__).resolve().parents[1]
SIZES = (8, 16, 32, 64, 128)
TIMEOUTS = (0.0005, 0.002, 0.008, 0.032)


# Actors of each kind; spawning a worker process takes seconds, so the smoke run starts 2.
ACTORS = {"threads": 64, "tasks": 256, "processes": 8}


def label(mode: str, actors: dict) -> str:
    return f"{actors[mode]} {'asyncio tasks' if mode == 'tasks' else mode}"


def point(mode: str, max_batch_size: int, timeout: float, total: int, actors: dict) -> dict:
    args = SimpleNamespace(max_batch_size=max_batch_size, timeout=timeout, replicas=1)
    if mode == "processes":
        procs = actors[mode]
        out = processes.measure("ours", "vector", procs, max(1, total // procs), args)
        rps, p99, batch = out["rps"], out["p99_ms"], out["mean_batch"]
    else:
        m = run.measure("ours", "vector", mode, actors[mode], 0, total, args)
        rps, p99, batch = m.rps, m.p99_ms, m.mean_batch
    return {"mode": mode, "max_batch_size": max_batch_size, "timeout": timeout, "rps": rps, "p99_ms": p99} | {
        "batch": batch
    }


def plot(rows: list[dict], path: Path, actors: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for mode in ("threads", "tasks", "processes"):
        sizes = [r for r in rows if r["mode"] == mode and r["timeout"] == 0.002]
        times = sorted((r for r in rows if r["mode"] == mode and r["max_batch_size"] == 64), key=lambda r: r["timeout"])
        name = label(mode, actors)
        axes[0][0].plot([r["max_batch_size"] for r in sizes], [r["rps"] for r in sizes], marker="o", label=name)
        axes[1][0].plot([r["max_batch_size"] for r in sizes], [r["p99_ms"] for r in sizes], marker="o", label=name)
        axes[0][1].plot([r["timeout"] * 1e3 for r in times], [r["rps"] for r in times], marker="o", label=name)
        axes[1][1].plot([r["timeout"] * 1e3 for r in times], [r["p99_ms"] for r in times], marker="o", label=name)
    for (i, j), (xlabel, ylabel) in {
        (0, 0): ("max_batch_size (timeout 2 ms)", "requests/s"),
        (1, 0): ("max_batch_size (timeout 2 ms)", "p99 latency, ms"),
        (0, 1): ("timeout, ms (max_batch_size 64)", "requests/s"),
        (1, 1): ("timeout, ms (max_batch_size 64)", "p99 latency, ms"),
    }.items():
        axes[i][j].set(xscale="log", xlabel=xlabel, ylabel=ylabel)
        axes[i][j].legend(fontsize=8)
    fig.suptitle("Tuning: one knob at a time (vector payload)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=20000, help="per point")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args(argv)
    if argv is None:
        restart_with(ONE_INTRAOP_THREAD)
    total = 800 if args.quick else args.requests
    sizes, timeouts = ((8, 64), (0.0005, 0.002)) if args.quick else (SIZES, TIMEOUTS)
    actors = ACTORS | {"processes": 2} if args.quick else ACTORS
    rows = []
    for mode in ("threads", "tasks", "processes"):
        for size in sizes:
            rows.append(point(mode, size, 0.002, total, actors))
            print(json.dumps(rows[-1]))
        for timeout in timeouts:
            if timeout != 0.002:
                rows.append(point(mode, 64, timeout, total, actors))
                print(json.dumps(rows[-1]))
    stem = "tuning_curves_quick" if args.quick else "tuning_curves"
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, args.out / f"{stem}.png", actors)
    lines = [
        "# Tuning curves",
        "",
        provenance("tuning.py", args)
        + f" {total} requests per point; actors: "
        + ", ".join(label(m, actors) for m in ACTORS)
        + ".",
        "",
        "| actors | max_batch_size | timeout, ms | requests/s | p99, ms | mean batch |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {r['mode']} | {r['max_batch_size']} | {r['timeout'] * 1e3:g} | {r['rps']:,.0f} | "
            f"{r['p99_ms']:.2f} | {r['batch']:.1f} |"
            for r in sorted(rows, key=lambda r: (r["mode"], r["timeout"], r["max_batch_size"]))
        ),
        "",
        f"![tuning curves]({stem}.png)",
    ]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
