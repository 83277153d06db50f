"""What a worker process's CPU per request is made of, and what running cold adds to it.

N spawned workers (default 8) each call a pickled ``RemotePolicy`` of the
``vector`` payload one request at a time, every request a fresh TensorDict
(``td.clone()``, as in ``benchmarks/processes.py``). Each worker measures its
thread's CPU time (``time.thread_time_ns``) per request for:

* ``make``: making the request's TensorDict, inside the serving loop;
* ``call``: ``remote(td)``: the client's work, the wait's system calls and
  writing the outputs into ``td``;
* ``make, hot``: the same ``td.clone()`` in a tight loop afterwards, with no
  call (and no sleep) between two of them.

``make`` over ``make, hot`` is what running after every wake-up costs the same
code on this host (caches and TLB refilled after the other processes ran); it
weighs on the call's work the same way.

    python benchmarks/worker_cost.py --procs 8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
from run import ONE_INTRAOP_THREAD, STEADY_MALLOC, make_payload, restart_with

from torchrl_batchserve import BatchedPolicyServer


def worker(remote: Any, seed: int, calls: int, barrier: Any, results: Any) -> None:
    torch.set_num_threads(1)
    _, make = make_payload("vector")
    td = make(torch.Generator().manual_seed(seed))
    for _ in range(100):  # connect, get a lane, warm up
        remote(td.clone())
    barrier.wait()
    making = calling = 0
    for _ in range(calls):
        t0 = time.thread_time_ns()
        fresh = td.clone()
        t1 = time.thread_time_ns()
        remote(fresh)
        calling += time.thread_time_ns() - t1
        making += t1 - t0
    t0 = time.thread_time_ns()
    for _ in range(calls):
        td.clone()
    hot = time.thread_time_ns() - t0
    results.put((making / calls / 1e3, calling / calls / 1e3, hot / calls / 1e3))


def main(argv: list[str] | None = None) -> list[tuple[float, float, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3000, help="timed calls per worker")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    policy, _ = make_payload("vector")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(args.procs), ctx.Queue()
    with BatchedPolicyServer(policy, max_batch_size=64, timeout=0.002) as server:
        remote = server.remote_policy()
        workers = [
            ctx.Process(target=worker, args=(remote, i, args.calls, barrier, results)) for i in range(args.procs)
        ]
        for w in workers:
            w.start()
        rows = [results.get(timeout=600) for _ in workers]
        for w in workers:
            w.join(60)
    make, call, hot = (statistics.median(column) for column in zip(*rows))
    print(f"{args.procs} workers, thread CPU us/request (median over workers):")
    print(f"  make {make:.1f}   call {call:.1f}   make, hot {hot:.1f}   make / make, hot {make / hot:.1f}x")
    return rows


if __name__ == "__main__":
    restart_with({**ONE_INTRAOP_THREAD, **STEADY_MALLOC})
    main()
