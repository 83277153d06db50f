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
      input_spec: null         # or {observation: {shape: [64], dtype: float32}}, or a _target_ node

and built with :func:`build_server` around a policy made by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict

from torchrl_batchserve.server import BatchedPolicyServer

__all__ = ["ServerConfig", "build_server", "register_configs"]


@dataclass
class ServerConfig:
    """The keyword arguments of :class:`~torchrl_batchserve.BatchedPolicyServer`.

    ``collate``, ``cost_fn`` and ``cache`` are Hydra nodes with ``_target_``
    (instantiated), or ``None``. ``input_spec`` is one too (e.g. a
    ``torchrl.data.Composite``), or each entry's feature ``shape``, ``dtype``
    (a torch dtype's name, default ``float32``) and ``device`` (default
    ``cpu``) by key, nested keys as nested mappings.

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
    input_spec: Any = None


def build_server(cfg: DictConfig | ServerConfig | dict, policy: Any, **overrides: Any) -> BatchedPolicyServer:
    """Build a :class:`BatchedPolicyServer` for ``policy`` from a server config node.

    Interpolations in ``cfg`` resolve against the config it belongs to (a
    recipe's ``server: {max_batch_size: ${searchers}}``), before the merge.
    """
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    node = OmegaConf.merge(OmegaConf.structured(ServerConfig), cfg)
    kwargs: dict[str, Any] = OmegaConf.to_container(node, resolve=True)  # type: ignore[assignment]
    for name in ("collate", "cost_fn", "cache"):
        if kwargs[name] is not None:
            kwargs[name] = instantiate(getattr(node, name), _convert_="all")
    spec = kwargs["input_spec"]
    if spec is not None:
        kwargs["input_spec"] = instantiate(node.input_spec, _convert_="all") if "_target_" in spec else _sample(spec)
    kwargs.update(overrides)
    return BatchedPolicyServer(policy, **kwargs)


def _sample(entries: dict, prefix: tuple = ()) -> TensorDict:
    """A one-row sample request of zeros from ``{key: {shape, dtype, device}}`` (nested keys nest)."""
    sample = TensorDict()
    for key, entry in entries.items():
        path = (*prefix, key)
        if not isinstance(entry, dict):
            raise ValueError(f"input_spec entry {'.'.join(path)!r} must be a mapping, got {entry!r}")
        if "shape" not in entry:
            sample[key] = _sample(entry, path)
            continue
        dtype = getattr(torch, str(entry.get("dtype", "float32")).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(
                f"input_spec entry {'.'.join(path)!r}: dtype must name a torch dtype, got {entry['dtype']!r}"
            )
        sample[key] = torch.zeros(tuple(entry["shape"]), dtype=dtype, device=entry.get("device", "cpu"))
    return sample


def register_configs() -> None:
    """Register :class:`ServerConfig` in Hydra's ConfigStore as ``batchserve/server``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="batchserve", name="server", node=ServerConfig)
