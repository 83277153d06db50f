"""Actors on other nodes of a Ray cluster: torchrl_batchserve vs TorchRL's RayTransport vs Ray Serve.

A local Ray cluster of three nodes (``ray.cluster_utils.Cluster``): the
servers run on the head node, N actors (Ray actors, half on each of two other
nodes) each call the policy on one fresh observation at a time for a fixed
time. The same actors, policy and batching settings serve all three, one
after the other, in one run:

* ``ours``: :func:`torchrl_batchserve.ray.serve_on_ray`, each actor with the
  handle's ``RemotePolicy`` (shared memory to its node's gateway, one Ray call
  per gateway batch);
* ``torchrl``: TorchRL 0.14.1's ``InferenceServer(service_backend="ray",
  transport="ray")``, i.e. its ``RayTransport`` (Ray queues: a queue
  operation per request and per reply), one ``client()`` per actor;
* ``serve``: a Ray Serve deployment whose ``__call__`` is ``@serve.batch``
  (same ``max_batch_size``, ``batch_wait_timeout_s`` = ``timeout``), called
  through its ``DeploymentHandle``.

Throughput is all calls over the span from the first start to the last end;
latencies are per call, as the actor sees them. Ray listens on 127.0.0.1 only:
the script runs itself inside ``tools/loopback-only``.

    python benchmarks/ray.py            # writes docs/benchmarks_ray.md
    python benchmarks/ray.py --quick    # a smoke run

(``benchmarks/ray.py`` runs this module's ``main``.)
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import run
import torch
from ray import cloudpickle, serve
from ray.cluster_utils import Cluster
from run import ONE_INTRAOP_THREAD, _pct, common_parser, make_payload, parse_common, provenance, save_report
from tensordict import TensorDict

# Ray workers do not have benchmarks/ on their path: what they run from here travels by value.
cloudpickle.register_pickle_by_value(run)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("ours", "torchrl", "serve")


def policy_factory() -> Any:
    return make_payload("vector")[0]


def observation() -> TensorDict:
    return TensorDict(observation=torch.randn(64))


@ray.remote(num_cpus=0)
class Actor:
    """One actor: calls ``call`` on a fresh observation at a time from ``start`` for ``seconds``."""

    def __init__(self) -> None:
        torch.set_num_threads(1)

    def ready(self) -> bool:
        return True

    def prepare(self, call: Any) -> bool:
        """Connect (ours: find the node's gateway) and warm up, before any clock starts."""
        self.call = call
        for _ in range(3):
            call(observation())
        return True

    def run(self, start: float, seconds: float) -> tuple[float, float, list[float]]:
        call = self.call
        while time.time() < start:
            time.sleep(0.001)
        latencies = []
        first = time.time()
        while time.time() < start + seconds:
            td = observation()
            t = time.perf_counter()
            out = call(td)
            latencies.append(time.perf_counter() - t)
            assert out["logits"].shape == (8,)
        return first, time.time(), latencies


class ServeCall:
    """A Ray Serve handle as a policy call."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __call__(self, td: TensorDict) -> TensorDict:
        return self.handle.remote(td).result()


@serve.deployment(max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0, "resources": {"server": 0.01}})
class BatchedDeployment:
    def __init__(self, max_batch_size: int, timeout: float) -> None:
        torch.set_num_threads(1)
        self.policy = policy_factory()
        self.batched = serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=timeout)(self.forward)

    async def forward(self, tds: list[TensorDict]) -> list[TensorDict]:
        with torch.no_grad():
            out = self.policy(torch.stack(tds))
        return list(out.select("logits").unbind(0))

    async def __call__(self, td: TensorDict) -> TensorDict:
        return await self.batched(td)


def start(system: str, args: Any, actors: int) -> tuple[list[Any], Any]:
    """The per-actor calls of ``system`` and what stops it."""
    if system == "ours":
        from torchrl_batchserve.ray import serve_on_ray

        handle = serve_on_ray(
            policy_factory,
            num_cpus=0,
            resources={"server": 0.01},
            max_batch_size=args.max_batch_size,
            timeout=args.timeout,
        )
        remote = handle.remote_policy()
        return [remote] * actors, handle.close
    if system == "torchrl":
        from torchrl.modules.inference_server import InferenceServer

        server = InferenceServer(
            policy_factory=policy_factory,
            transport="ray",
            service_backend="ray",
            service_backend_options={"remote_config": {"num_cpus": 0, "resources": {"server": 0.01}}},
            max_batch_size=args.max_batch_size,
            timeout=args.timeout,
        )
        server.start()
        return server.clients(actors), server.shutdown
    handle = serve.run(BatchedDeployment.bind(args.max_batch_size, args.timeout), name="bench", route_prefix=None)
    return [ServeCall(handle)] * actors, lambda: serve.delete("bench")


def measure(system: str, pool: list[Any], args: Any) -> dict:
    calls, stop = start(system, args, len(pool))
    try:
        ray.get([a.prepare.remote(c) for a, c in zip(pool, calls)])
        at = time.time() + 1.0
        results = ray.get([a.run.remote(at, args.seconds) for a in pool])
    finally:
        stop()
    latencies = [x for _, _, lat in results for x in lat]
    span = max(end for _, end, _ in results) - min(first for first, _, _ in results)
    return {
        "system": system,
        "actors": len(pool),
        "requests": len(latencies),
        "rps": len(latencies) / span,
        "p50_ms": _pct(latencies, 0.5),
        "p99_ms": _pct(latencies, 0.99),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common_parser(__doc__, repeats=2)
    parser.set_defaults(max_batch_size=32)
    parser.add_argument("--actors", type=int, nargs="+", default=None, help="default: 8 32 (4 with --quick)")
    parser.add_argument("--seconds", type=float, default=None, help="each measurement; default 8 (2 with --quick)")
    parser.add_argument("--only", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    args = parse_common(parser, argv)
    args.actors = args.actors or ([4] if args.quick else [8, 32])
    args.seconds = args.seconds or (2.0 if args.quick else 8.0)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"server": 1}})
    for name in ("actors_a", "actors_b"):
        cluster.add_node(num_cpus=1, resources={name: 1000})
    ray.init(address=cluster.address, runtime_env={"env_vars": ONE_INTRAOP_THREAD}, log_to_driver=False)
    rows = []
    try:
        cluster.wait_for_nodes()
        serve.start(proxy_location="Disabled")
        pool: list[Any] = []
        for n in sorted(args.actors):
            # The actors of this count only: idle Ray workers cost every system CPU on a small host.
            pool += [
                Actor.options(resources={("actors_a", "actors_b")[i % 2]: 1}).remote() for i in range(len(pool), n)
            ]
            ray.get([a.ready.remote() for a in pool])
            for repeat in range(args.repeats):
                for system in args.only:
                    row = measure(system, pool, args)
                    row["repeat"] = repeat
                    rows.append(row)
                    print(
                        f"{system:8s} {n:3d} actors: {row['rps']:8,.0f} req/s  "
                        f"p50 {row['p50_ms']:.2f} ms  p99 {row['p99_ms']:.2f} ms",
                        flush=True,
                    )
    finally:
        ray.shutdown()
        cluster.shutdown()
    write_report(rows, args)
    return rows


def write_report(rows: list[dict], args: Any) -> None:
    def runs(system: str, n: int) -> list[dict]:
        return sorted((r for r in rows if r["system"] == system and r["actors"] == n), key=lambda r: r["repeat"])

    def median(system: str, n: int, key: str) -> float:
        return statistics.median(r[key] for r in runs(system, n)) if runs(system, n) else float("nan")

    def ratio(n: int, peer: str) -> float:  # the median of the ratios taken within one repeat
        pairs = list(zip(runs("ours", n), runs(peer, n)))
        return statistics.median(a["rps"] / b["rps"] for a, b in pairs) if pairs else float("nan")

    lines = [
        "# Actors on other nodes: torchrl_batchserve vs TorchRL's RayTransport vs Ray Serve",
        "",
        provenance("ray.py", args),
        "",
        f"A local Ray cluster of three nodes on this machine (`ray.cluster_utils.Cluster`): the servers on the head "
        f"node, the actors (Ray actors, one fresh observation per call) split over the two other nodes; "
        f"`max_batch_size={args.max_batch_size}`, `timeout={args.timeout}` (Ray Serve's `batch_wait_timeout_s`) for "
        f"all three; {args.seconds:g} s per measurement; the `vector` policy of `docs/benchmarks.md`. "
        f"{args.repeats} repeat(s): medians, and ratios are the median of the ratios within a repeat.",
        "",
        "| actors | ours req/s | TorchRL RayTransport req/s | Ray Serve req/s | x TorchRL | x Ray Serve "
        "| p50/p99 ms ours | TorchRL | Ray Serve |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in args.actors:
        rps = {s: median(s, n, "rps") for s in SYSTEMS}
        lat = {s: f"{median(s, n, 'p50_ms'):.1f}/{median(s, n, 'p99_ms'):.1f}" for s in SYSTEMS}
        lines.append(
            f"| {n} | {rps['ours']:,.0f} | {rps['torchrl']:,.0f} | {rps['serve']:,.0f} "
            f"| **{ratio(n, 'torchrl'):.1f}** | **{ratio(n, 'serve'):.1f}** "
            f"| {lat['ours']} | {lat['torchrl']} | {lat['serve']} |"
        )
    lines += [
        "",
        "Where the time goes: TorchRL's `RayTransport` pays Ray queue operations per request and per reply (each "
        "client's reply queue is an actor of its own); Ray Serve pays a Ray call per request through its router, "
        "then batches. Ours pays one shared-memory request to the node's gateway, and one TCP round trip per "
        "gateway batch. On this 2-vCPU host the actors, three raylets and the servers share two cores, so "
        "absolute numbers move by tens of percent between repeats (the table below); the ratios within a repeat "
        "are what to read.",
        "",
        "Every measurement, in the order run:",
        "",
        "| repeat | actors | system | req/s | p50/p99 ms |",
    ]
    lines.append("|---:|---:|---|---:|---:|")
    for r in rows:
        lines.append(
            f"| {r['repeat']} | {r['actors']} | {r['system']} | {r['rps']:,.0f} | {r['p50_ms']:.1f}/{r['p99_ms']:.1f} |"
        )
    path = save_report(lines, args, "benchmarks_ray", "ray.py")
    print(f"wrote {path}")


def loopback_only() -> bool:
    """Whether this process's network namespace has loopback only (``tools/loopback-only``)."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def run_in_loopback_namespace() -> None:
    """Run this command again inside ``tools/loopback-only``, unless it is there already."""
    if not loopback_only():
        wrapper = str(ROOT / "tools" / "loopback-only")
        os.execv(wrapper, [wrapper, sys.executable, *sys.argv])
