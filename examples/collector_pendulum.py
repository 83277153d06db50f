"""TorchRL collectors whose worker processes share one policy server.

A Gaussian policy for TorchRL's ``PendulumEnv`` (no extra install) is served
by one ``BatchedPolicyServer`` in this process, its request layout given by
the env's ``observation_spec``. A ``MultiSyncCollector`` or
``MultiAsyncCollector`` steps its environments in spawned worker processes
with the server's ``RemotePolicy`` as their policy, so the workers'
observations share batched forwards (``collector_class=Collector``: one env, in
this process). The collectors sample actions (``exploration_type`` RANDOM):
each request carries that interaction type to the server.

The policy learns by imitation on its own states (DAgger): after each batch
the trainer fits it to what a swing-up controller (pump energy, then
balance) would have done in every state the served policy has visited, and
pushes its weights with ``collector.update_policy_weights_()`` through the
server's ``WeightSyncScheme``; the next rollouts carry the new
``policy_version``. With the defaults the reward per frame goes from about
-6 (the untrained policy) to about -1 in 20 batches; the controller itself
scores about -0.7.

It checks that every stored ``loc`` is what the trainer's policy, at the
version stamped on that frame, computes for the stored observation.

    python examples/collector_pendulum.py collector_class=MultiAsyncCollector workers=8
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDictBase
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.collectors import BaseCollector, Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.envs import PendulumEnv
from torchrl.modules import ProbabilisticActor
from tqdm import tqdm

from torchrl_batchserve.config import build_server


class PendulumFeatures(nn.Module):
    """The angle as (sin, cos) and the angular speed, then an MLP to (loc, scale)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 2), NormalParamExtractor(scale_lb=0.05)
        )

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loc, scale = self.net(torch.stack([th.sin(), th.cos(), thdot], -1))
        return loc * 2, scale  # shaped like the env's action, whose torques it clamps to [-2, 2]


def swing_up(th: torch.Tensor, thdot: torch.Tensor, g: float = 10.0) -> torch.Tensor:
    """The teacher: pump energy towards the upright's (``dE/dt = 3 u thdot`` here), then balance."""
    energy = 0.5 * thdot**2 + 1.5 * g * (torch.cos(th) - 1)  # 0 upright at rest
    pump = -0.4 * energy * thdot
    angle = torch.remainder(th + math.pi, 2 * math.pi) - math.pi
    balance = -(10.0 * angle + 2.0 * thdot)
    return torch.where(torch.cos(th) > 0.85, balance, pump).clamp(-2, 2).unsqueeze(-1)


def make_policy(cfg: DictConfig) -> ProbabilisticActor:
    torch.manual_seed(cfg.seed)
    module = TensorDictModule(PendulumFeatures(cfg.hidden), in_keys=["th", "thdot"], out_keys=["loc", "scale"])
    return ProbabilisticActor(
        module, in_keys=["loc", "scale"], out_keys=["action"], distribution_class=torch.distributions.Normal
    )


def make_collector(cfg: DictConfig, policy: nn.Module, scheme: object) -> BaseCollector:
    kw = {
        "frames_per_batch": cfg.frames_per_batch,
        "total_frames": cfg.total_frames,
        "max_frames_per_traj": cfg.max_frames_per_traj,
        "weight_sync_schemes": {"policy": scheme},
        "auto_register_policy_transforms": False,
    }
    if cfg.collector_class == "Collector":
        return Collector(PendulumEnv, policy, **kw)
    kinds = {"MultiSyncCollector": MultiSyncCollector, "MultiAsyncCollector": MultiAsyncCollector}
    if cfg.collector_class not in kinds:
        raise ValueError(
            f"collector_class must be Collector, MultiSyncCollector or MultiAsyncCollector, got {cfg.collector_class!r}"
        )
    return kinds[cfg.collector_class]([PendulumEnv] * cfg.workers, policy, **kw)


def imitation_steps(
    trainer: ProbabilisticActor, optimizer: torch.optim.Optimizer, states: TensorDictBase, cfg: DictConfig
) -> None:
    """Fit the trainer's action distribution to the teacher's actions, in minibatches of ``states``."""
    for _ in range(cfg.train_steps):
        rows = states[torch.randint(len(states), (cfg.train_batch,))]
        teacher = swing_up(rows["th"], rows["thdot"])
        loss = -trainer.get_dist(rows).log_prob(teacher).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


# Counts of the config, refused by key when out of range (else each failed deep inside TorchRL, or trained on nothing).
COUNTS = ("workers", "frames_per_batch", "total_frames", "max_frames_per_traj", "hidden", "train_steps", "train_batch")


def run(cfg: DictConfig) -> dict:
    for key in COUNTS:
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"{key} must be an int >= 1 (got {cfg[key]!r})")
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out_dir / "config.yaml", resolve=True)
    policy = make_policy(cfg)
    trainer = copy.deepcopy(policy)  # the learner's copy; the server serves the other
    versions = [copy.deepcopy(trainer.module[0])]  # its (loc, scale) module at each version, to check the frames
    optimizer = torch.optim.Adam(trainer.parameters(), lr=cfg.lr)
    with build_server(cfg.server, policy, input_spec=PendulumEnv().observation_spec) as server:
        collector = make_collector(cfg, server.remote_policy(), server.weight_sync_scheme())
        frames, mismatches, rewards, seen = 0, 0, [], []
        states: TensorDictBase | None = None
        start = time.perf_counter()
        bar = tqdm(total=cfg.total_frames, unit="frame", desc=cfg.collector_class, disable=not cfg.progress)
        try:
            for batch in collector:
                batch = batch.reshape(-1)
                stamped = batch["policy_version"]
                for version in stamped.unique().tolist():
                    rows = batch[stamped == version]
                    with torch.no_grad():
                        expected = versions[version](rows.select("th", "thdot").clone())["loc"]
                    mismatches += int((~torch.isclose(rows["loc"], expected, atol=1e-5)).sum())
                seen.append(sorted(stamped.unique().tolist()))
                rewards.append(float(batch["next", "reward"].mean()))
                frames += batch.numel()
                visited = batch.select("th", "thdot")
                states = visited if states is None else torch.cat([states, visited])  # DAgger: keep them all
                imitation_steps(trainer, optimizer, states, cfg)
                versions.append(copy.deepcopy(trainer.module[0]))
                collector.update_policy_weights_(trainer)  # served from the server's next batch on
                bar.update(batch.numel())
                bar.set_postfix(reward=f"{rewards[-1]:.2f}", version=server.policy_version)
        finally:
            bar.close()
            collector.shutdown()
        elapsed = time.perf_counter() - start
        stats = server.statistics()
    print(
        f"{cfg.collector_class} with {cfg.workers if cfg.collector_class != 'Collector' else 1} worker process(es): "
        f"{frames} frames in {elapsed:.1f} s ({frames / elapsed:,.0f} frames/s), "
        f"mean batch {stats.mean_batch_size:.1f} rows; {mismatches} stored locs differ from the trainer's policy"
    )
    print(f"policy versions per collected batch: {seen}")
    print("mean reward per frame, batch by batch: " + " ".join(f"{r:.1f}" for r in rewards))
    print(stats.summary())
    plot(rewards, out_dir / "reward.png")
    print(f"reward curve and config in {out_dir}")
    return {"frames": frames, "mismatches": mismatches, "versions": seen, "rewards": rewards, "statistics": stats}


def plot(rewards: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(rewards) + 1), rewards, marker="o")
    ax.set(xlabel="collected batch", ylabel="mean reward per frame", title="Pendulum: imitation through one server")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@hydra.main(config_path="../conf", config_name="collector_pendulum", version_base=None)
def main(cfg: DictConfig) -> None:
    result = run(cfg)
    if result["mismatches"]:
        raise SystemExit(f"{result['mismatches']} stored locs differ from the trainer's policy")


if __name__ == "__main__":
    main()
