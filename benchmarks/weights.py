"""Weight updates while serving: ours vs TorchRL's InferenceServer, same run.

64 actor threads query a server while a trainer thread pushes new weights
every ``--period`` seconds; measured with and without pushes:

* ``ours``: ``server.update_weights(weights)`` (copy into a shadow in the
  trainer's thread; the serve loop swaps it in at a batch boundary);
* ``torchrl``: ``InferenceServer.update_model(fn)``, its in-process update
  (the copy runs under the model lock, between batches).

Reported: requests/s with and without pushes, and the time from the start
of a push to the first result stamped with its version (median over pushes).
Two policy sizes: the vector MLP of ``benchmarks/run.py`` and a wide one
(64-2048-2048-8, 4.3 M parameters) where the copy is not free.

    python benchmarks/weights.py            # writes docs/benchmarks_weights.md
    python benchmarks/weights.py --quick    # seconds; a smoke test
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import torch
from run import ONE_INTRAOP_THREAD, common_parser, parse_common, provenance, restart_with, save_report
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules.inference_server import InferenceServer, ThreadingTransport

from torchrl_batchserve import BatchedPolicyServer


def make_policy(width: int, seed: int) -> TensorDictModule:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 8),
    )
    return TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])


def measure(system: str, width: int, pushing: bool, args: Any) -> dict:
    policy = make_policy(width, 0)
    versions = [TensorDict.from_module(make_policy(width, s)).data.clone() for s in (1, 2)]
    stop = threading.Event()
    first_seen: dict[int, float] = {}
    pushed: dict[int, float] = {}
    counts = [0] * args.actors
    lock = threading.Lock()
    kw = {"max_batch_size": args.max_batch_size, "timeout": args.timeout}
    server: Any = (
        BatchedPolicyServer(policy, **kw) if system == "ours" else InferenceServer(policy, ThreadingTransport(), **kw)
    )
    with server:
        call = server.remote_policy() if system == "ours" else server.client()

        def actor(i: int) -> None:
            g = torch.Generator().manual_seed(i)
            td = TensorDict(observation=torch.randn(64, generator=g))
            with torch.no_grad():
                while not stop.is_set():
                    out = call(td.clone())
                    counts[i] += 1
                    v = int(out["policy_version"])
                    if v not in first_seen:
                        with lock:
                            first_seen.setdefault(v, time.perf_counter())

        def trainer() -> None:
            n = 0
            while not stop.wait(args.period):
                weights = versions[n % 2]
                began = time.perf_counter()
                if system == "ours":
                    v = server.update_weights(weights)
                else:
                    server.update_model(lambda m, w=weights: w.to_module(m))
                    v = server.policy_version
                pushed[v] = began
                n += 1

        threads = [threading.Thread(target=actor, args=(i,)) for i in range(args.actors)]
        if pushing:
            threads.append(threading.Thread(target=trainer))
        for t in threads:
            t.start()
        time.sleep(args.warmup)
        start_counts, start = sum(counts), time.perf_counter()
        time.sleep(args.seconds)
        done, elapsed = sum(counts) - start_counts, time.perf_counter() - start
        stop.set()
        for t in threads:
            t.join()
    lags = [first_seen[v] - t for v, t in pushed.items() if v in first_seen]
    return {
        "rps": done / elapsed,
        "pushes": len(pushed),
        "lag_ms": statistics.median(lags) * 1e3 if lags else float("nan"),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = common_parser(__doc__)
    parser.add_argument("--actors", type=int, default=64)
    parser.add_argument("--period", type=float, default=0.02, help="seconds between pushes")
    args = parse_common(parser, argv)
    args.seconds, args.warmup = (0.5, 0.2) if args.quick else (3.0, 0.5)
    if args.quick:
        args.actors = min(args.actors, 8)
    torch.set_num_threads(1)
    rows = []
    for width in (256, 2048):
        runs: dict[tuple[str, bool], list[dict]] = {}
        for repeat in range(args.repeats):
            for system in ("ours", "torchrl"):
                for pushing in (False, True):
                    r = measure(system, width, pushing, args)
                    runs.setdefault((system, pushing), []).append(r)
                    print(
                        f"[{repeat}] width {width} {system:8s} {'pushing' if pushing else 'idle':8s} "
                        f"{r['rps']:8.0f} req/s pushes {r['pushes']:4d} push->result {r['lag_ms']:.2f} ms",
                        flush=True,
                    )
        row: dict[str, Any] = {"width": width}
        for system in ("ours", "torchrl"):
            idle, busy = runs[(system, False)], runs[(system, True)]
            row[system] = {
                "idle": statistics.median(r["rps"] for r in idle),
                "pushing": statistics.median(r["rps"] for r in busy),
                "kept": statistics.median(b["rps"] / i["rps"] for b, i in zip(busy, idle)),
                "lag_ms": statistics.median(r["lag_ms"] for r in busy),
                "pushes": statistics.median(r["pushes"] for r in busy),
            }
        row["x_torchrl"] = statistics.median(
            o["rps"] / t["rps"] for o, t in zip(runs[("ours", True)], runs[("torchrl", True)])
        )
        rows.append(row)
    write_report(rows, args)
    return {"rows": rows}


def write_report(rows: list[dict], args: Any) -> None:
    lines = [
        "# Weight updates while serving",
        "",
        provenance("weights.py", args),
        "",
        f"{args.actors} actor threads; a trainer thread pushes new weights every {args.period * 1e3:.0f} ms; "
        f"{args.seconds:.0f} s measured per run; medians of {args.repeats} repeat(s). Ours: `update_weights` (shadow "
        "copy in the trainer's thread, swap at a batch boundary). TorchRL: `InferenceServer.update_model` (copy "
        "under the model lock). One intra-op thread in every thread (`OMP_NUM_THREADS=1`).",
        "",
        "| policy | system | req/s idle | req/s pushing | kept | x TorchRL (pushing) | push start → first result ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        params = "64-256-256-8" if r["width"] == 256 else "64-2048-2048-8 (4.3 M params)"
        for system in ("ours", "torchrl"):
            s = r[system]
            ratio = f"**{r['x_torchrl']:.2f}**" if system == "ours" else "1.00"
            lines.append(
                f"| {params} | {system} | {s['idle']:,.0f} | {s['pushing']:,.0f} | {s['kept']:.0%} | {ratio} "
                f"| {s['lag_ms']:.2f} |"
            )
    save_report(lines, args, "benchmarks_weights", "weights.py")


if __name__ == "__main__":
    restart_with(ONE_INTRAOP_THREAD)
    main()
