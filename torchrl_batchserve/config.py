"""Hydra/OmegaConf at the edge: structured configs and builders.

This is the only module that imports Hydra or OmegaConf; the core takes typed
arguments. A server is described in YAML as

.. code-block:: yaml

    server:
      max_batch_size: 64
      timeout: 0.002
      device: null
      output_device: null
      max_queue_size: null
      policy_version_key: policy_version
      cost_fn: null            # or {_target_: torchrl_batchserve.LengthCost, key: tokens}
      max_batch_cost: null
      collate: null            # or {_target_: torchrl_batchserve.PadCollate, keys: [tokens]}
      cache: null              # or {_target_: torchrl_batchserve.EvaluationCache, capacity: 100000}

and built with :func:`build_server` around a policy made by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from torchrl_batchserve.server import BatchedPolicyServer

__all__ = ["ServerConfig", "build_server", "register_configs"]


@dataclass
class ServerConfig:
    """The keyword arguments of :class:`~torchrl_batchserve.BatchedPolicyServer`.

    ``collate``, ``cost_fn`` and ``cache`` are Hydra nodes with ``_target_``
    (instantiated), or ``None``.

    Examples:
        >>> import torch
        >>> from omegaconf import OmegaConf
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl_batchserve.config import ServerConfig, build_server
        >>> cfg = OmegaConf.merge(OmegaConf.structured(ServerConfig), {"max_batch_size": 8})
        >>> policy = TensorDictModule(torch.nn.Linear(2, 2), in_keys=["obs"], out_keys=["act"])
        >>> build_server(cfg, policy).max_batch_size
        8
    """

    max_batch_size: int = 64
    timeout: float = 0.002
    device: str | None = None
    output_device: str | None = None
    max_queue_size: int | None = None
    cost_fn: Any = None
    max_batch_cost: int | None = None
    cache: Any = None
    policy_version_key: str | None = "policy_version"
    collate: Any = None


def build_server(cfg: DictConfig | ServerConfig | dict, policy: Any, **overrides: Any) -> BatchedPolicyServer:
    """Build a :class:`BatchedPolicyServer` for ``policy`` from a server config node."""
    node = OmegaConf.merge(OmegaConf.structured(ServerConfig), cfg)
    kwargs: dict[str, Any] = OmegaConf.to_container(node, resolve=True)  # type: ignore[assignment]
    for name in ("collate", "cost_fn", "cache"):
        if kwargs[name] is not None:
            kwargs[name] = instantiate(getattr(node, name), _convert_="all")
    kwargs.update(overrides)
    return BatchedPolicyServer(policy, **kwargs)


def register_configs() -> None:
    """Register :class:`ServerConfig` in Hydra's ConfigStore as ``batchserve/server``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="batchserve", name="server", node=ServerConfig)
