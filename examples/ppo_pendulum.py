"""PPO on TorchRL's PendulumEnv: collector workers query one server; the trainer pushes every iteration.

A training recipe on TorchRL's own config groups (``conf/ppo_pendulum.yaml``):
``collector: multi_sync`` is TorchRL's ``MultiSyncCollectorConfig``, whose
``policy`` is our ``remote_policy`` node and whose
``weight_sync_schemes.policy`` is our ``weight_sync_scheme`` node, both
referring to one ``server/batchserve`` node. The collector's worker
processes step their envs and send every observation to that one server,
which batches them. The trainer trains the module the server serves
(``server.module``, through TorchRL's ``ClipPPOLoss`` and ``GAE``) and calls
``collector.update_policy_weights_()`` after each iteration: the next
frames carry the new ``policy_version``. A progress bar shows frames and
reward; the reward curve and the run's config go to the run's folder, with
the server's statistics of each iteration (``log_statistics`` to TorchRL's
``CSVLogger``).

    python examples/ppo_pendulum.py                        # learn (a few minutes)
    python examples/ppo_pendulum.py collector.total_frames=20000   # shorter
    python examples/ppo_pendulum.py measure=true           # frames/s: the server vs policy copies vs
                                                           # TorchRL's AsyncBatchedCollector, same envs
                                                           # (docs/processes.md has the numbers)

The update is written out with TorchRL's pieces rather than run by TorchRL's
``trainer: ppo`` config, whose hooks would hide the few lines that make the
point here; that config trains the served module too, through our
``model/batchserve_served`` node (``docs/configuration.md``).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDictBase
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.envs import PendulumEnv
from torchrl.modules import ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE
from torchrl.record.loggers import CSVLogger
from tqdm import tqdm

import torchrl_batchserve.config  # noqa: F401  (registers server/batchserve before Hydra composes)
from torchrl_batchserve import log_statistics


class Features(nn.Module):
    """The angle as (sin, cos) and the angular speed, then an MLP."""

    def __init__(self, out: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, out)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(torch.stack([th.sin(), th.cos(), thdot], -1)))


class GaussianHead(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.features = Features(2, hidden)
        self.split = NormalParamExtractor(scale_lb=0.05)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loc, scale = self.split(self.features(th, thdot))
        return 2 * torch.tanh(loc), scale  # torques in [-2, 2], the env's range


def make_actor(hidden: int = 64, seed: int = 0) -> ProbabilisticActor:
    """The Gaussian policy the server serves (and the trainer trains)."""
    torch.manual_seed(seed)
    module = TensorDictModule(GaussianHead(hidden), in_keys=["th", "thdot"], out_keys=["loc", "scale"])
    return ProbabilisticActor(
        module,
        in_keys=["loc", "scale"],
        out_keys=["action"],
        distribution_class=torch.distributions.Normal,
        return_log_prob=True,
    )


def make_critic(hidden: int, seed: int) -> ValueOperator:
    torch.manual_seed(seed + 1)
    return ValueOperator(Features(1, hidden), in_keys=["th", "thdot"])


def ppo_update(
    loss: ClipPPOLoss, gae: GAE, optim: torch.optim.Optimizer, batch: TensorDictBase, cfg: DictConfig
) -> None:
    """``cfg.ppo.epochs`` passes of clipped PPO over ``batch`` in minibatches, advantages by GAE."""
    batch = batch.clone()
    batch["next", "reward"] = batch["next", "reward"] * cfg.ppo.reward_scale
    for _ in range(cfg.ppo.epochs):
        with torch.no_grad():
            gae(batch)
        flat = batch.reshape(-1)
        for rows in flat[torch.randperm(flat.numel())].split(cfg.ppo.minibatch):
            out = loss(rows)
            total = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]
            optim.zero_grad()
            total.backward()
            nn.utils.clip_grad_norm_(loss.parameters(), cfg.ppo.max_grad_norm)
            optim.step()


def train(cfg: DictConfig, out_dir: Path) -> dict:
    collector = instantiate(cfg.collector)
    server = instantiate(cfg.server)  # the one server the collector's policy and scheme refer to
    actor = server.module  # trained in place; update_policy_weights_() serves its weights
    critic = make_critic(cfg.server.policy.hidden, cfg.seed)
    loss = ClipPPOLoss(
        actor, critic, clip_epsilon=cfg.ppo.clip, entropy_coeff=cfg.ppo.entropy, normalize_advantage=True
    )
    gae = GAE(gamma=cfg.ppo.gamma, lmbda=cfg.ppo.lmbda, value_network=critic, average_gae=False)
    optim = torch.optim.Adam(loss.parameters(), lr=cfg.ppo.lr)
    logger = CSVLogger("ppo_pendulum", log_dir=str(out_dir))
    history: list[dict] = []
    bar = tqdm(total=cfg.collector.total_frames, unit="frame", desc="ppo pendulum", disable=not cfg.progress)
    start, frames, mark = time.perf_counter(), 0, server.statistics()
    try:
        for batch in collector:
            frames += batch.numel()
            reward = float(batch["next", "reward"].mean())
            versions = sorted(batch["policy_version"].unique().tolist())
            ppo_update(loss, gae, optim, batch, cfg)
            collector.update_policy_weights_()  # server.module's new weights, from the server's next batch on
            now = server.statistics()
            log_statistics(logger, server.statistics(since=mark), step=frames)
            logger.log_scalar("reward", reward, step=frames)
            mark = now
            seconds = time.perf_counter() - start
            history.append({"frames": frames, "reward": reward, "versions": versions, "seconds": seconds})
            bar.update(batch.numel())
            bar.set_postfix(reward=f"{reward:.2f}", version=server.policy_version, batch=f"{now.mean_batch_size:.1f}")
    finally:
        bar.close()
        collector.shutdown()
        stats = server.statistics()
        server.close()
    return {"history": history, "frames": frames, "statistics": stats.as_dict()}


def measure(cfg: DictConfig) -> dict:
    """Frames/s of the same envs and policy: through the server, with the collector's own copies, and TorchRL's
    AsyncBatchedCollector (its own inference server). No training: collection only, equal frames."""
    from torchrl.collectors import AsyncBatchedCollector, MultiSyncCollector

    frames, workers = cfg.measure_frames, cfg.collector.num_workers
    kw = {"frames_per_batch": cfg.collector.frames_per_batch, "total_frames": frames}

    def rate(collector: Any) -> float:
        batches = iter(collector)
        next(batches)  # warm-up: workers started, first batch out
        start, got = time.perf_counter(), 0
        for batch in batches:
            got += batch.numel()
        elapsed = time.perf_counter() - start
        collector.shutdown()
        return got / elapsed

    results = {}
    collector = instantiate(cfg.collector, total_frames=frames)
    server = instantiate(cfg.server)
    results["MultiSyncCollector, one server"] = rate(collector)
    results["server mean batch"] = server.statistics().mean_batch_size
    server.close()
    common = {**kw, "max_frames_per_traj": cfg.collector.max_frames_per_traj}
    copies = MultiSyncCollector([PendulumEnv] * workers, make_actor(cfg.server.policy.hidden), **common)
    results["MultiSyncCollector, a policy copy per worker"] = rate(copies)
    for transport in ("driver", "auto"):  # its server in this process's thread, or in a process of its own
        batched = AsyncBatchedCollector(
            [PendulumEnv] * workers,
            policy_factory=functools.partial(make_actor, cfg.server.policy.hidden),
            env_backend="multiprocessing",
            max_batch_size=cfg.server.max_batch_size,
            transport=transport,
            **kw,
        )
        results[f"AsyncBatchedCollector (TorchRL's server), transport={transport!r}"] = rate(batched)
    return results


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["frames"] for h in history], [h["reward"] for h in history])
    ax.set(xlabel="frames", ylabel="mean reward per frame", title="PPO on Pendulum through one server")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: DictConfig) -> dict:
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out_dir / "config.yaml", resolve=True)
    if cfg.measure:
        result = measure(cfg)
        for name, value in result.items():
            print(f"{name}: {value:,.1f}")
    else:
        result = train(cfg, out_dir)
        plot(result["history"], out_dir / "reward.png")
        rewards = [h["reward"] for h in result["history"]]
        first, last = rewards[: max(1, len(rewards) // 10)], rewards[-max(1, len(rewards) // 10) :]
        result["reward_before"], result["reward_after"] = sum(first) / len(first), sum(last) / len(last)
        print(
            f"{result['frames']} frames; mean reward per frame {result['reward_before']:.2f} (first tenth) -> "
            f"{result['reward_after']:.2f} (last tenth); server mean batch "
            f"{result['statistics']['mean_batch_size']:.1f} rows; results in {out_dir}"
        )
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


@hydra.main(config_path="../conf", config_name="ppo_pendulum", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
