"""N actor threads and M asyncio tasks share one BatchedPolicyServer.

Every actor checks its results against a direct forward of the same policy,
then the demo prints throughput and the server's statistics.

    python examples/actors_demo.py threads=64 tasks=1024
"""

from __future__ import annotations

import asyncio
import threading
import time

import hydra
import torch
from omegaconf import DictConfig
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from tqdm import tqdm

from torchrl_batchserve.config import build_server


def make_policy(cfg: DictConfig) -> TensorDictModule:
    torch.manual_seed(cfg.seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(cfg.obs_dim, cfg.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(cfg.hidden, cfg.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(cfg.hidden, cfg.actions),
    )
    return TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])


def run(cfg: DictConfig) -> dict:
    policy = make_policy(cfg)
    n = cfg.requests_per_actor
    total = (cfg.threads + cfg.tasks) * n
    mismatches = 0
    lock = threading.Lock()
    bar = tqdm(total=total, desc="requests", unit="req", mininterval=0.2)

    def check(td: TensorDict) -> None:
        nonlocal mismatches
        with torch.no_grad():
            expected = policy.module(td["observation"])
        ok = torch.allclose(td["logits"], expected, atol=1e-5)
        with lock:
            mismatches += not ok
            bar.update(1)

    with build_server(cfg.server, policy) as server:
        remote = server.remote_policy()

        def actor(seed: int) -> None:
            gen = torch.Generator().manual_seed(seed)
            for _ in range(n):
                check(remote(TensorDict(observation=torch.randn(cfg.obs_dim, generator=gen))))

        async def task(seed: int) -> None:
            gen = torch.Generator().manual_seed(10_000 + seed)
            for _ in range(n):
                check(await remote.acall(TensorDict(observation=torch.randn(cfg.obs_dim, generator=gen))))

        async def all_tasks() -> None:
            await asyncio.gather(*(task(i) for i in range(cfg.tasks)))

        start = time.perf_counter()
        threads = [threading.Thread(target=actor, args=(i,)) for i in range(cfg.threads)]
        threads.append(threading.Thread(target=lambda: asyncio.run(all_tasks())))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        stats = server.statistics()
    bar.close()
    print(
        f"{total} requests from {cfg.threads} threads + {cfg.tasks} tasks in {elapsed:.2f} s: "
        f"{total / elapsed:,.0f} requests/s, {mismatches} mismatches"
    )
    print(stats.summary())
    return {"requests": total, "mismatches": mismatches, "seconds": elapsed, "statistics": stats}


@hydra.main(config_path="../conf", config_name="actors_demo", version_base=None)
def main(cfg: DictConfig) -> None:
    result = run(cfg)
    if result["mismatches"]:
        raise SystemExit(f"{result['mismatches']} results differ from a direct forward")


if __name__ == "__main__":
    main()
