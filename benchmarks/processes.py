"""Process actors: torchrl_batchserve vs TorchRL's best cross-process transport.

N spawned worker processes each call the policy on one observation at a time,
in one process run, on the same policies and inputs as ``benchmarks/run.py``:

* ``ours``: a ``RemotePolicy`` pickled into each worker (Unix socket +
  shared-memory slots);
* ``torchrl``: TorchRL 0.14.1's ``InferenceServer`` with its
  ``ProcessSlotTransport`` (fixed shared-memory slots and process semaphores),
  one ``transport.client()`` per worker: the fastest of TorchRL's
  cross-process transports in ``docs/benchmarks_torchrl_transports.md``
  (``--torchrl-transports`` measures ``ProcessSlotTransport``,
  ``SharedMemoryTransport`` and ``MPTransport`` side by side);
* ``floor`` (one call in flight per worker only): :class:`FloorServer`, the
  least a lane server can do per request (a slot and two eventfds per worker,
  one thread, one gather and one scatter a batch) and none of what a server
  owes its callers: no checks, one key in and out, no versions, no faults
  handled. What no design of the process path can beat on this host.

Both servers: the same ``max_batch_size``, ``timeout`` and ``--device`` (where
the policy runs; requests and results stay on the CPU), in this process.
Workers warm up (three calls each; a worker's asyncio tasks together, as
they then run), synchronise on a barrier, then time their calls; throughput is all
calls over the span from the first start to the last end. The two servers
take turns, and the one that goes first alternates between repeats. Five repeats by
default (``--repeats``): at 8 processes on two vCPUs a single repeat of ours
ranges over ±10% from run to run, and the median of three moved the ratio by
as much as the gap it was read against.

    python benchmarks/processes.py            # writes docs/benchmarks_processes.md
    python benchmarks/processes.py --quick    # seconds; a smoke test
    python benchmarks/processes.py --torchrl-transports  # TorchRL's transports only:
                                              # docs/benchmarks_torchrl_transports.md
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import select
import statistics
import threading
import time
from multiprocessing.reduction import DupFd
from typing import Any

import torch
from run import (
    ONE_INTRAOP_THREAD,
    STEADY_MALLOC,
    _pct,
    common_parser,
    device_note,
    in_turn,
    make_payload,
    parse_common,
    provenance,
    restart_with,
    save_report,
    served_on,
)
from tensordict import TensorDict, TensorDictBase
from torchrl.modules.inference_server import InferenceServer, MPTransport, ProcessSlotTransport, SharedMemoryTransport

from torchrl_batchserve import BatchedPolicyServer

_MEDIANS = ("rps", "p50_ms", "p99_ms", "mean_batch", "server_cpu_us", "worker_cpu_us")
# TorchRL's cross-process transports; "torchrl" (ProcessSlotTransport) is the one compared with ours.
_TRANSPORTS: dict[str, Any] = {
    "torchrl": ProcessSlotTransport,
    "torchrl-shm": SharedMemoryTransport,
    "torchrl-mp": MPTransport,
}


class FloorServer:
    """The floor of the process path: per worker a row of an input and an output tensor in shared memory,
    a request eventfd and a reply eventfd; one thread gathers the rows of the workers that rang, once all
    have (or ``timeout`` after the first), runs the policy on them and rings each one back.
    """

    def __init__(self, policy: Any, sample: TensorDictBase, workers: int, timeout: float) -> None:
        (self.in_key,), (self.out_key,) = policy.in_keys, policy.out_keys
        with torch.no_grad():
            out = policy(sample.unsqueeze(0).clone()).get(self.out_key)
        value = sample.get(self.in_key)
        self.inputs = torch.zeros(workers, *value.shape, dtype=value.dtype).share_memory_()
        self.outputs = torch.zeros(workers, *out.shape[1:], dtype=out.dtype).share_memory_()
        self.bells = [(os.eventfd(0), os.eventfd(0)) for _ in range(workers)]
        self._policy, self._timeout, self._stop = policy, timeout, os.eventfd(0)
        self.batches = self.rows = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def client(self, index: int) -> FloorClient:
        return FloorClient(self, index)

    def _serve(self) -> None:
        torch.set_grad_enabled(False)
        torch.get_num_threads()  # this thread's intra-op team (as in the package's serve loop)
        poller = select.epoll()
        worker_of = {request: i for i, (request, _) in enumerate(self.bells)}
        for request in [*worker_of, self._stop]:
            poller.register(request, select.EPOLLIN)
        rung: list[int] = []
        first = 0.0
        while True:
            wait = -1.0 if not rung else max(0.0, first + self._timeout - time.monotonic())
            for fd, _ in poller.poll(wait):
                if fd == self._stop:
                    return
                os.eventfd_read(fd)
                first = first if rung else time.monotonic()
                rung.append(worker_of[fd])
            if rung and (len(rung) == len(self.bells) or time.monotonic() - first >= self._timeout):
                index = torch.tensor(rung)
                batch = TensorDict({self.in_key: self.inputs.index_select(0, index)}, batch_size=[len(rung)])
                self.outputs.index_copy_(0, index, self._policy(batch).get(self.out_key))
                for i in rung:
                    os.eventfd_write(self.bells[i][1], 1)
                self.batches, self.rows, rung = self.batches + 1, self.rows + len(rung), []

    def __enter__(self) -> FloorServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        os.eventfd_write(self._stop, 1)
        self._thread.join()
        for fd in [self._stop, *(fd for pair in self.bells for fd in pair)]:
            os.close(fd)


class FloorClient:
    """A worker's end of :class:`FloorServer`: write the row, ring, wait, copy the outputs out."""

    def __init__(self, server: FloorServer, index: int) -> None:
        self.row, self.out = server.inputs[index], server.outputs[index]
        self.keys, (self.request, self.reply) = (server.in_key, server.out_key), server.bells[index]

    def __reduce__(self) -> tuple:
        return _floor_client, (self.row, self.out, self.keys, DupFd(self.request), DupFd(self.reply))

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        self.row.copy_(td.get(self.keys[0]))
        os.eventfd_write(self.request, 1)
        os.eventfd_read(self.reply)
        td.set(self.keys[1], self.out.clone())
        return td


def _floor_client(row: torch.Tensor, out: torch.Tensor, keys: tuple, request: Any, reply: Any) -> FloorClient:
    client = FloorClient.__new__(FloorClient)
    client.row, client.out, client.keys = row, out, keys
    client.request, client.reply = request.detach(), reply.detach()
    return client


def worker(calls_of: list, payload: str, seed: int, calls: int, barrier: Any, results: Any) -> None:
    """Time ``calls`` requests; with several entries in ``calls_of``, as that many asyncio tasks at once.

    Ours: one pickled RemotePolicy, awaited with ``acall`` by every task.
    TorchRL's clients have one request in flight each and no asyncio call: a
    task per client, each awaiting its client's blocking call in a thread.
    """
    torch.set_num_threads(1)
    _, make = make_payload(payload)
    td = make(torch.Generator().manual_seed(seed))
    if len(calls_of) == 1:
        for _ in range(3):  # connect, get slots, warm up
            calls_of[0](td.clone())
    else:  # the tasks together, as they will run: ours offers a worker its lanes as its requests overlap
        asyncio.run(_tasks(calls_of, td, 3, []))
    barrier.wait()
    latencies: list[float] = []
    start, cpu = time.monotonic(), time.process_time()
    if len(calls_of) == 1:
        call = calls_of[0]
        for _ in range(calls):
            t = time.perf_counter()
            call(td.clone())  # a fresh TensorDict per request, as an env step makes
            latencies.append(time.perf_counter() - t)
    else:
        asyncio.run(_tasks(calls_of, td, calls // len(calls_of), latencies))
    results.put((start, time.monotonic(), latencies, time.process_time() - cpu))


async def _tasks(calls_of: list, td: Any, each: int, latencies: list[float]) -> None:
    async def task(call: Any) -> None:
        for _ in range(each):
            t = time.perf_counter()
            if hasattr(call, "acall"):
                await call.acall(td.clone())
            else:
                await asyncio.to_thread(call, td.clone())
            latencies.append(time.perf_counter() - t)

    await asyncio.gather(*(task(c) for c in calls_of))


def measure(system: str, payload: str, procs: int, calls: int, args: Any, tasks: int = 1) -> dict:
    ctx = mp.get_context("spawn")
    policy, make = make_payload(payload)
    barrier, results = ctx.Barrier(procs + 1), ctx.Queue()  # this process passes it too: its CPU clock starts
    device = getattr(args, "device", None)  # (tuning.py passes its own settings)
    kw = {"max_batch_size": args.max_batch_size, "timeout": args.timeout, **served_on(device)}
    if system == "ours":
        if args.replicas > 1:
            kw["device"] = [device or torch.device("cpu")] * args.replicas
        server: Any = BatchedPolicyServer(policy, **kw)
        clients = [[server.remote_policy()] * tasks for _ in range(procs)]
    elif system == "floor":
        server = FloorServer(policy, make(torch.Generator().manual_seed(0)), procs, args.timeout)
        clients = [[server.client(i)] for i in range(procs)]
    else:
        sample = make(torch.Generator().manual_seed(0))
        with torch.no_grad():
            response = policy(sample.clone()).select(*policy.out_keys)
        response["policy_version"] = torch.zeros((), dtype=torch.long)
        kind = _TRANSPORTS[system]
        if kind is MPTransport:  # pickles whole TensorDicts: no slot layout to give
            transport = kind(ctx)
        else:
            transport = kind(sample, response, num_slots=procs * tasks, ctx=ctx)
        server = InferenceServer(policy, transport, **kw)
        clients = [[transport.client() for _ in range(tasks)] for _ in range(procs)]
    with server:
        workers = [
            ctx.Process(target=worker, args=(clients[i], payload, i, calls, barrier, results)) for i in range(procs)
        ]
        for w in workers:
            w.start()
        barrier.wait()
        server_cpu = time.process_time()
        out = [results.get(timeout=600) for _ in workers]
        server_cpu = time.process_time() - server_cpu
        for w in workers:
            w.join(60)
        if system == "ours":
            mean_batch = server.statistics().mean_batch_size
        elif system == "floor":
            mean_batch = server.rows / server.batches
        else:
            mean_batch = float(server.stats().get("avg_batch_size", 0))
    starts, ends = [o[0] for o in out], [o[1] for o in out]
    latencies = [x for o in out for x in o[2]]
    n = len(latencies)
    return {
        "system": system,
        "payload": payload,
        "procs": procs,
        "tasks": tasks,
        "rps": n / (max(ends) - min(starts)),
        "p50_ms": _pct(latencies, 0.5),
        "p99_ms": _pct(latencies, 0.99),
        "mean_batch": mean_batch,
        "server_cpu_us": 1e6 * server_cpu / n,
        "worker_cpu_us": 1e6 * sum(o[3] for o in out) / n,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = common_parser(__doc__, repeats=5)
    parser.add_argument("--only", default=None, help="comma list of payloads (vector,pixels)")
    parser.add_argument(
        "--procs", default="2,4,8,32,64,8x16", help="worker processes; PxT: P processes of T asyncio tasks each"
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="ours: this many replicas on --device (default: the CPU)"
    )
    parser.add_argument(
        "--torchrl-transports", action="store_true", help="measure TorchRL's cross-process transports only"
    )
    args = parse_common(parser, argv)
    torch.set_num_threads(1)
    payloads = args.only.split(",") if args.only else ["vector", "pixels"]
    systems = list(_TRANSPORTS) if args.torchrl_transports else ["ours", "torchrl"]
    runs: dict[tuple, list[dict]] = {}
    for repeat in range(args.repeats):
        for payload in payloads:
            for spec in args.procs.split(","):
                procs, tasks = (int(n) for n in (spec.split("x") if "x" in spec else (spec, 1)))
                # Fewer calls per process in the large fleets: each run stays near the same length.
                calls = (20 if args.quick else 1500) // (1 if payload == "vector" else 4) * min(8, procs) // procs
                calls = max(calls, 20 * tasks)  # per process, shared by its tasks
                floor = ["floor"] if tasks == 1 and args.device is None and not args.torchrl_transports else []
                for system in in_turn(systems + floor, repeat):
                    r = measure(system, payload, procs, calls, args, tasks)
                    runs.setdefault((payload, spec, system), []).append(r)
                    print(
                        f"[{repeat}] {payload:6s} {spec} procs {system:8s} {r['rps']:8.0f} req/s "
                        f"p50 {r['p50_ms']:6.2f} p99 {r['p99_ms']:6.2f} ms batch {r['mean_batch']:5.1f} "
                        f"CPU us/req server {r['server_cpu_us']:4.0f} workers {r['worker_cpu_us']:4.0f}",
                        flush=True,
                    )
    if args.torchrl_transports:
        write_transports_report(runs, args)
        return {"runs": runs}
    rows = []
    for (payload, procs, system), rs in runs.items():
        if system != "ours":
            continue
        theirs, floor = runs[(payload, procs, "torchrl")], runs.get((payload, procs, "floor"))
        rows.append(
            {
                "payload": payload,
                "procs": procs,
                "ours": {k: statistics.median(r[k] for r in rs) for k in _MEDIANS},
                "torchrl": {k: statistics.median(r[k] for r in theirs) for k in _MEDIANS},
                "x_torchrl": statistics.median(a["rps"] / b["rps"] for a, b in zip(rs, theirs)),
                "floor": floor and {k: statistics.median(r[k] for r in floor) for k in _MEDIANS},
                "of_floor": floor and statistics.median(a["rps"] / b["rps"] for a, b in zip(rs, floor)),
            }
        )
    write_report(rows, args)
    return {"rows": rows}


def write_report(rows: list[dict], args: Any) -> None:
    lines = [
        "# Process actors: torchrl_batchserve vs TorchRL's ProcessSlotTransport",
        "",
        provenance("processes.py", args),
        "",
        f"Spawned workers, one call at a time each (`P x T`: P workers of T asyncio tasks each; ours: one "
        f"RemotePolicy per worker, `await acall`; TorchRL: a client per task, its blocking call in a thread); "
        f"both servers in the parent with "
        f"`max_batch_size={args.max_batch_size}`, `timeout={args.timeout}`, {device_note(args.device)}; "
        f"medians of {args.repeats} repeat(s), ratios within a repeat. Payloads, one intra-op thread in every "
        "thread and glibc malloc settings as in "
        "`docs/benchmarks.md`. "
        "CPU per request: the server's process (all its threads) and the workers' timed loops, over all requests. "
        "`floor`: the least a lane server can do (`FloorServer`: no checks, no versions, no faults handled; "
        "one call in flight per worker): its req/s and CPU us/req of the server and of the workers, and ours "
        "as a share of its req/s, in the same repeats.",
        "",
        "| payload | worker processes | ours req/s | TorchRL req/s | x TorchRL | ours p50/p99 ms "
        "| TorchRL p50/p99 ms | mean batch ours/TorchRL | CPU us/req server ours/TorchRL "
        "| CPU us/req workers ours/TorchRL | floor req/s (server/workers CPU us/req) | ours / floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        o, t = r["ours"], r["torchrl"]
        procs = r["procs"].replace("x", " x ") + (" tasks" if "x" in r["procs"] else "")
        lines.append(
            f"| {r['payload']} | {procs} | {o['rps']:,.0f} | {t['rps']:,.0f} | **{r['x_torchrl']:.2f}** "
            f"| {o['p50_ms']:.2f}/{o['p99_ms']:.2f} | {t['p50_ms']:.2f}/{t['p99_ms']:.2f} "
            f"| {o['mean_batch']:.1f}/{t['mean_batch']:.1f} | {o['server_cpu_us']:.0f}/{t['server_cpu_us']:.0f} "
            f"| {o['worker_cpu_us']:.0f}/{t['worker_cpu_us']:.0f} | {_floor_cells(r)} |"
        )
    save_report(lines, args, "benchmarks_processes", "processes.py")


def _floor_cells(row: dict) -> str:
    f = row["floor"]
    if not f:
        return "| "
    return f"{f['rps']:,.0f} ({f['server_cpu_us']:.0f}/{f['worker_cpu_us']:.0f}) | {row['of_floor']:.2f}"


def write_transports_report(runs: dict[tuple, list[dict]], args: Any) -> None:
    lines = [
        "# TorchRL's cross-process transports, side by side",
        "",
        provenance("processes.py --torchrl-transports", args),
        "",
        "TorchRL 0.14.1's `InferenceServer` in the parent with each of its cross-process transports, "
        "the same spawned workers, policies and settings as `docs/benchmarks_processes.md`; "
        f"requests per second, medians of {args.repeats} repeat(s), the fastest of each row in bold. "
        "`benchmarks/processes.py` compares ours with `ProcessSlotTransport`.",
        "",
        "| payload | worker processes | " + " | ".join(kind.__name__ for kind in _TRANSPORTS.values()) + " |",
        "|---|---:|" + "---:|" * len(_TRANSPORTS),
    ]
    for payload, procs in dict.fromkeys((p, n) for p, n, _ in runs):
        rps = [statistics.median(r["rps"] for r in runs[(payload, procs, system)]) for system in _TRANSPORTS]
        best = max(rps)
        cells = [f"**{v:,.0f}**" if v == best else f"{v:,.0f}" for v in rps]
        lines.append(f"| {payload} | {procs} | " + " | ".join(cells) + " |")
    save_report(
        lines,
        args,
        "benchmarks_torchrl_transports",
        "processes.py",
        reproduce="`python benchmarks/processes.py --torchrl-transports`",
    )


if __name__ == "__main__":
    restart_with({**ONE_INTRAOP_THREAD, **STEADY_MALLOC})
    main()
