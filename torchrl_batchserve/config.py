"""Hydra/OmegaConf at the edge: structured configs that compose with TorchRL's, and builders.

This is the only module that imports Hydra or OmegaConf; the core takes typed
arguments. Five nodes, registered in Hydra's ConfigStore when this module is
imported, in the style of ``torchrl.trainers.algorithms.configs``
(``ConfigBase`` dataclasses with a ``_target_``):

- ``server/batchserve`` (:class:`ServerConfig`): one
  :class:`~torchrl_batchserve.BatchedPolicyServer`, built (and started) once
  per ``name`` and its ``policy`` node;
- ``policy/batchserve_remote`` (:class:`RemotePolicyConfig`): that server's
  ``remote_policy()``, e.g. as ``collector.policy``;
- ``weight_sync_scheme/batchserve`` (:class:`WeightSyncSchemeConfig`): that
  server's ``weight_sync_scheme()``, e.g. as
  ``collector.weight_sync_schemes.policy``;
- ``server/batchserve_ray`` (:class:`RayServerConfig`): a server started as a
  Ray actor (:func:`~torchrl_batchserve.ray.serve_on_ray`), whose handle the
  two nodes above take too, and which TorchRL's collector node with
  ``backend: ray`` takes as its ``policy`` (``policy: ${server}``);
- ``model/batchserve_served`` (:class:`ServedModuleConfig`): a server node's
  ``module``, the one it was built with, for the trainer to train in place,
  e.g. as ``loss.actor_network`` of TorchRL's ``trainer: ppo`` (whose
  ``weight_update_map: {policy: loss_module.actor_network}`` then pushes it
  through the scheme after each batch: ``docs/configuration.md``).

The remote policy, scheme and module nodes hold the server node (``server:
${server}``); however many nodes refer to it, instantiating them builds one
server::

    defaults:
      - collector: sync                 # TorchRL's Collector config
      - server@server: batchserve
      - _self_
    server:
      name: pendulum
      policy: {_target_: my_recipe.make_policy}
      max_batch_size: 32
    collector:
      create_env_fn: ...
      policy: {_target_: torchrl_batchserve.config.remote_policy, server: "${server}"}
      weight_sync_schemes:
        policy: {_target_: torchrl_batchserve.config.weight_sync_scheme, server: "${server}"}

Every field is typed, so a wrong value (``server.timeout=fast``) fails when
the config is composed, naming the key, before anything runs.
:func:`build_server` builds a server from a server node around a policy made
by the caller.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from tensordict import TensorDict
from torchrl.trainers.algorithms.configs.common import ConfigBase

from torchrl_batchserve.server import BatchedPolicyServer

__all__ = [
    "RayServerConfig",
    "RemotePolicyConfig",
    "ServedModuleConfig",
    "ServerConfig",
    "WeightSyncSchemeConfig",
    "build_server",
    "ray_server",
    "register_configs",
    "remote_policy",
    "served_module",
    "server",
    "weight_sync_scheme",
]


@dataclass
class ServerConfig(ConfigBase):
    """A :class:`~torchrl_batchserve.BatchedPolicyServer`: its keyword arguments, its policy and its name.

    ``policy`` is a node with a ``_target_`` that builds the policy (only
    needed when the node itself is instantiated; :func:`build_server` takes
    the policy as an argument). ``collate``, ``cost_fn`` and ``cache`` are
    nodes with ``_target_`` too, or ``None``. ``input_spec`` is one (e.g. a
    ``torchrl.data.Composite``), or each entry's feature ``shape``, ``dtype``
    (a torch dtype's name, default ``float32``) and ``device`` (default
    ``cpu``) by key, nested keys as nested mappings.

    Examples:
        >>> from hydra.utils import instantiate
        >>> from omegaconf import OmegaConf
        >>> from torchrl_batchserve.config import ServerConfig
        >>> policy = {"_target_": "tensordict.nn.TensorDictModule", "in_keys": ["obs"], "out_keys": ["act"],
        ...           "module": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2}}
        >>> cfg = OmegaConf.merge(OmegaConf.structured(ServerConfig), {"name": "doc", "max_batch_size": 8,
        ...                                                          "policy": policy})
        >>> server = instantiate(cfg)          # built and started, once per name
        >>> server is instantiate(cfg), server.max_batch_size
        (True, 8)
        >>> server.close()
        True
    """

    _target_: str = "torchrl_batchserve.config.server"
    _recursive_: bool = False  # the policy and the parts are built once, by server()
    name: str = "server"
    policy: Any = None
    max_batch_size: int = 64
    timeout: float = 0.002
    device: Any = None
    output_device: str | None = None
    max_queue_size: int | None = None
    cost_fn: Any = None
    max_batch_cost: int | None = None
    cache: Any = None
    policy_version_key: Any = "policy_version"  # a nested key as a list: [stats, version]
    collate: Any = None
    input_spec: Any = None
    forward_timeout: float | None = None
    static_batch_size: int | None = None
    in_keys: list[Any] | None = None  # a plain nn.Module policy's; a nested key as a list: [[agents, obs]]
    out_keys: list[Any] | None = None

    def __post_init__(self) -> None:
        """Nothing to derive: every field is a keyword of the server."""


@dataclass
class RayServerConfig(ServerConfig):
    """A server started as a Ray actor (:func:`~torchrl_batchserve.ray.serve_on_ray`): a server node, placed.

    ``policy`` is built in the server actor, from the node (its ``_target_``
    must be importable there). ``num_gpus``, ``num_cpus``, ``resources``,
    ``max_restarts``, ``gateway_depth`` and ``start_timeout`` are ``serve_on_ray``'s; the other
    fields are the server's, as in :class:`ServerConfig`. Instantiating it
    needs a connected Ray (``ray.init``) and gives the handle
    (:class:`~torchrl_batchserve.ray.RayServer`), once per ``name``.
    """

    _target_: str = "torchrl_batchserve.config.ray_server"
    num_gpus: float = 0
    num_cpus: float = 1
    resources: dict[str, float] | None = None
    max_restarts: int = 0
    gateway_depth: int = 2
    start_timeout: float = 120.0


@dataclass
class RemotePolicyConfig(ConfigBase):
    """``server.remote_policy()`` of the server node ``server`` (e.g. ``server: ${server}``)."""

    _target_: str = "torchrl_batchserve.config.remote_policy"
    server: Any = MISSING

    def __post_init__(self) -> None:
        """Nothing to derive."""


@dataclass
class WeightSyncSchemeConfig(ConfigBase):
    """``server.weight_sync_scheme()`` of the server node ``server``: a TorchRL ``WeightSyncScheme``."""

    _target_: str = "torchrl_batchserve.config.weight_sync_scheme"
    server: Any = MISSING

    def __post_init__(self) -> None:
        """Nothing to derive."""


@dataclass
class ServedModuleConfig(ConfigBase):
    """``server.module`` of the server node ``server``: the module it was built with, for a trainer to train."""

    _target_: str = "torchrl_batchserve.config.served_module"
    server: Any = MISSING

    def __post_init__(self) -> None:
        """Nothing to derive."""


# name -> (settings, server): held weakly, so a server nobody uses any more (a closed one, its
# replicas' device memory included) is not kept alive by its name.
_SERVERS: dict[str, tuple[dict, weakref.ref[Any]]] = {}
_SERVERS_LOCK = threading.RLock()  # a policy node may build another server node inside the first one's build
_NOT_KWARGS = ("_target_", "_recursive_", "name", "policy")


def server(name: str = "server", policy: Any = None, **kwargs: Any) -> BatchedPolicyServer:
    """The started server called ``name``, built from these arguments the first time.

    Called by Hydra for a :class:`ServerConfig` node; later calls with the
    same name and the same arguments return the same server (until it is
    closed, or until nothing holds it), so every node that refers to it
    shares one. The same name with other arguments raises ``ValueError``.
    """
    return _named(name, policy, kwargs, lambda: build_server(kwargs, instantiate(policy, _convert_="all")).start())


_PLACEMENT = ("num_gpus", "num_cpus", "resources", "max_restarts", "gateway_depth", "start_timeout")


def ray_server(name: str = "server", policy: Any = None, **kwargs: Any) -> Any:
    """The handle of the Ray-served server called ``name``, started the first time (as :func:`server`).

    Called by Hydra for a :class:`RayServerConfig` node: ``serve_on_ray``'s
    placement keywords go to it, the others to the server. The policy node
    travels to the server actor and is instantiated there.
    """
    from torchrl_batchserve.ray import serve_on_ray

    placement = {k: _plain(kwargs.pop(k)) for k in _PLACEMENT if k in kwargs}

    def start() -> Any:
        factory = functools.partial(instantiate, _plain(policy), _convert_="all")
        return serve_on_ray(factory, **placement, **_server_kwargs(kwargs))

    return _named(name, policy, {**kwargs, **placement}, start)


def _named(name: str, policy: Any, kwargs: dict[str, Any], start: Callable[[], Any]) -> Any:
    """The open server called ``name`` if it was built from these arguments; else ``start()``'s, under that name."""
    settings = {"policy": _plain(policy), **{k: _plain(v) for k, v in kwargs.items()}}
    with _SERVERS_LOCK:
        known = _SERVERS.get(name)
        existing = None if known is None else known[1]()
        if known is not None and existing is not None and not existing.closed:
            if known[0] != settings:
                differ = {k: (known[0].get(k), v) for k, v in settings.items() if known[0].get(k) != v}
                raise ValueError(f"server {name!r} already exists with other settings (built with, got): {differ}")
            return existing
        if policy is None:
            raise ValueError(f"server {name!r}: the server node needs a policy node with a _target_ (got None)")
        built = start()
        _SERVERS[name] = (settings, weakref.ref(built))
        return built


def remote_policy(server: Any) -> Any:
    """``server.remote_policy()`` (a server node's, or a Ray server node's): the node of a collector's ``policy``."""
    return _of_server(server, "remote_policy")()


def weight_sync_scheme(server: Any) -> Any:
    """``server.weight_sync_scheme()`` (a server node's, or a Ray server node's): a collector's scheme."""
    return _of_server(server, "weight_sync_scheme")()


def _of_server(server: Any, method: str) -> Callable[[], Any]:
    """``server``'s ``method``; a ``TypeError`` naming what ``server`` should be when it is no server."""
    found = getattr(server, method, None)
    if not callable(found):
        raise TypeError(
            f"server must be a server node's server (server/batchserve or server/batchserve_ray), "
            f"got {type(server).__name__}: {server!r}"
        )
    return found


def served_module(server: Any) -> torch.nn.Module:
    """``server.module``: the module a server node's server was built with, e.g. a loss's ``actor_network``.

    The server serves its own copy of its weights; training this module
    changes nothing served until it is pushed (``update_policy_weights_()``
    through the server's scheme, or ``server.update_weights()``). A Ray
    server node has no module in this process: ``TypeError``.
    """
    module = getattr(server, "module", None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"a model/batchserve_served node needs a server node built in this process, got {type(server).__name__}: "
            "a Ray-served policy lives in its actor, so build the trainer's module from the policy node and push "
            "it (weight_update_map, or handle.update_weights(module))"
        )
    return module


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value


def build_server(cfg: DictConfig | ServerConfig | dict, policy: Any, **overrides: Any) -> BatchedPolicyServer:
    """Build a :class:`BatchedPolicyServer` for ``policy`` from a server config node.

    Interpolations in ``cfg`` resolve against the config it belongs to (a
    recipe's ``server: {max_batch_size: ${searchers}}``), before the merge.
    """
    return BatchedPolicyServer(policy, **{**_server_kwargs(cfg), **overrides})


def _server_kwargs(cfg: DictConfig | ServerConfig | dict) -> dict[str, Any]:
    """A server node's keyword arguments of the server (not its name and policy), its parts built."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    node = OmegaConf.merge(OmegaConf.structured(ServerConfig), cfg)
    kwargs: dict[str, Any] = OmegaConf.to_container(node, resolve=True)  # type: ignore[assignment]
    for name in _NOT_KWARGS:
        kwargs.pop(name)
    for name in ("in_keys", "out_keys"):  # a nested key is a list in YAML, as in TorchRL's configs
        if kwargs[name] is not None:
            kwargs[name] = [_key(key) for key in kwargs[name]]
    kwargs["policy_version_key"] = _key(kwargs["policy_version_key"])
    for name in ("collate", "cost_fn", "cache"):
        if kwargs[name] is not None:
            kwargs[name] = instantiate(getattr(node, name), _convert_="all")
    spec = kwargs["input_spec"]
    if spec is not None:
        kwargs["input_spec"] = instantiate(node.input_spec, _convert_="all") if "_target_" in spec else _sample(spec)
    return kwargs


def _key(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


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
        name = ".".join(path)
        unknown = sorted(set(entry) - {"shape", "dtype", "device"})
        if unknown:
            raise ValueError(f"input_spec entry {name!r}: unknown fields {unknown} (it takes shape, dtype, device)")
        shape = entry["shape"]
        if not isinstance(shape, list | tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"input_spec entry {name!r}: shape must be a list of sizes >= 0, got {shape!r}")
        dtype = getattr(torch, str(entry.get("dtype", "float32")).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"input_spec entry {name!r}: dtype must name a torch dtype, got {entry['dtype']!r}")
        try:
            device = torch.device(entry.get("device", "cpu"))
            sample[key] = torch.zeros(tuple(shape), dtype=dtype, device=device)
        except (RuntimeError, AssertionError) as err:  # a bad name, or a device this build lacks
            where = entry["device"]
            raise ValueError(f"input_spec entry {name!r}: device {where!r} is unusable here ({err})") from None
    return sample


def register_configs() -> None:
    """Register the nodes in Hydra's ConfigStore (done on import; calling it again is harmless).

    ``server/batchserve``, ``server/batchserve_ray``, ``policy/batchserve_remote``,
    ``weight_sync_scheme/batchserve`` and ``model/batchserve_served``, next to
    TorchRL's own groups.
    """
    store = ConfigStore.instance()
    store.store(group="server", name="batchserve", node=ServerConfig)
    store.store(group="server", name="batchserve_ray", node=RayServerConfig)
    store.store(group="policy", name="batchserve_remote", node=RemotePolicyConfig)
    store.store(group="weight_sync_scheme", name="batchserve", node=WeightSyncSchemeConfig)
    store.store(group="model", name="batchserve_served", node=ServedModuleConfig)


register_configs()
