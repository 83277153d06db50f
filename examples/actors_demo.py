"""N actor threads and M asyncio tasks share one BatchedPolicyServer.

The demo prints throughput and the server's statistics, then checks every
result against a direct forward of the same policy.

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
    least = {"threads": 0, "tasks": 0, "requests_per_actor": 1, "obs_dim": 1, "hidden": 1, "actions": 1}
    for key, n in least.items():  # else a stack of no results failed at the end, or a negative count ran none
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int) or cfg[key] < n:
            raise ValueError(f"{key} must be an int >= {n} (got {cfg[key]!r})")
    if cfg.threads + cfg.tasks == 0:
        raise ValueError("threads + tasks must be at least 1: no actor would call the server")
    policy = make_policy(cfg)
    n = cfg.requests_per_actor
    total = (cfg.threads + cfg.tasks) * n
    # Actors keep (input, output) pairs; they are checked against a direct
    # forward after the timed part, so the throughput is the server's.
    records: list[tuple[torch.Tensor, torch.Tensor]] = []
    bar = tqdm(total=total, desc="requests", unit="req", mininterval=0.5)
    step = 50

    def record(td: TensorDict, done: int) -> None:
        records.append((td["observation"], td["logits"].clone()))  # list.append is atomic
        if done % step == 0:
            bar.update(step)

    with build_server(cfg.server, policy) as server:
        remote = server.remote_policy()

        def actor(seed: int) -> None:
            gen = torch.Generator().manual_seed(seed)
            for i in range(1, n + 1):
                record(remote(TensorDict(observation=torch.randn(cfg.obs_dim, generator=gen))), i)

        async def task(seed: int) -> None:
            gen = torch.Generator().manual_seed(10_000 + seed)
            for i in range(1, n + 1):
                record(await remote.acall(TensorDict(observation=torch.randn(cfg.obs_dim, generator=gen))), i)

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
    with torch.no_grad():
        observations = torch.stack([o for o, _ in records])
        served = torch.stack([logits for _, logits in records])
        expected = policy.module(observations)
    mismatches = int((~torch.isclose(served, expected, atol=1e-5).all(dim=-1)).sum())
    print(
        f"{total} requests from {cfg.threads} threads + {cfg.tasks} tasks in {elapsed:.2f} s: "
        f"{total / elapsed:,.0f} requests/s; {mismatches} results differ from a direct forward"
    )
    print(stats.summary())
    return {"requests": len(records), "mismatches": mismatches, "seconds": elapsed, "statistics": stats}


@hydra.main(config_path="../conf", config_name="actors_demo", version_base=None)
def main(cfg: DictConfig) -> None:
    result = run(cfg)
    if result["mismatches"]:
        raise SystemExit(f"{result['mismatches']} results differ from a direct forward")


if __name__ == "__main__":
    main()
