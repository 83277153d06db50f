"""The pickled paths' cost: ``transport.wire.dumps`` against torch's own tensor pickling, in one run.

What travels pickled: a worker's first request and any that fits no lane,
replies that do not go back in a lane, and every gateway batch of a Ray-served
server, both ways. For each payload of ``benchmarks/run.py`` (one row, and a
gateway batch of ``--rows`` rows), it times encoding and decoding with
``wire.dumps`` / ``pickle.loads`` (CPU tensors as raw bytes) and with
``pickle.dumps`` / ``pickle.loads`` (``torch.save`` per storage), taking turns;
medians of ``--repeats``.

    python benchmarks/pickling.py
    python benchmarks/pickling.py --quick   # a smoke run, not a measurement
"""

from __future__ import annotations

import argparse
import functools
import pickle
import statistics
import time
from collections.abc import Callable

import torch
from run import make_payload

from torchrl_batchserve.transport.wire import dumps


def per_call_us(fn: Callable[[], object], seconds: float = 0.2) -> float:
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="rows of a gateway batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one repeat of a few milliseconds each")
    args = parser.parse_args(argv)
    seconds, repeats = (0.005, 1) if args.quick else (0.2, args.repeats)
    rows = []
    print("| payload | encode us: wire.dumps / pickle.dumps | decode us: wire / torch |")
    print("|---|---:|---:|")
    for name in ("vector", "pixels"):
        _, make = make_payload(name)
        g = torch.Generator().manual_seed(0)
        row = make(g)
        for label, td in ((f"{name}, one row", row), (f"{name}, {args.rows} rows", torch.stack([make(g)] * args.rows))):
            ours, theirs = dumps(td), pickle.dumps(td, pickle.HIGHEST_PROTOCOL)
            if not (pickle.loads(ours) == td).all():
                raise AssertionError(f"{label}: wire.dumps did not round-trip")
            calls = {
                "enc ours": functools.partial(dumps, td),
                "enc torch": functools.partial(pickle.dumps, td, pickle.HIGHEST_PROTOCOL),
                "dec ours": functools.partial(pickle.loads, ours),
                "dec torch": functools.partial(pickle.loads, theirs),
            }
            times: dict[str, list[float]] = {k: [] for k in calls}
            for _ in range(repeats):  # the four take turns
                for k, call in calls.items():
                    times[k].append(per_call_us(call, seconds))
            m = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"payload": label, **m})
            print(
                f"| {label} | {m['enc ours']:.0f} / {m['enc torch']:.0f} | {m['dec ours']:.0f} / {m['dec torch']:.0f} |"
            )
    return rows


if __name__ == "__main__":
    main()
