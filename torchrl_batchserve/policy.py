"""The policy a server is given: taken as a ``TensorDictModuleBase``, its keys read, and what cannot be
served refused (hidden per-env state, a version stamp over its own entries) or warned of (training mode)."""

from __future__ import annotations

import sys
import warnings
from typing import Any

from tensordict.nn import TensorDictModule, TensorDictModuleBase, TensorDictSequential
from tensordict.utils import NestedKey, unravel_key_list
from torch import nn

from torchrl_batchserve.varlen import as_key
from torchrl_batchserve.weights import key_path

__all__ = ["as_policy", "check_stamp_key", "read_keys", "refuse_hidden_state", "warn_if_training"]


def as_policy(policy: Any, in_keys: Any, out_keys: Any) -> TensorDictModuleBase:
    """``policy`` as a ``TensorDictModuleBase``: a plain ``nn.Module`` is wrapped with its keys (given or its own)."""
    if isinstance(policy, TensorDictModuleBase):
        if in_keys is not None or out_keys is not None:
            raise TypeError("in_keys/out_keys are taken from a TensorDictModuleBase policy; do not pass them")
        return policy
    if isinstance(policy, nn.Module):
        in_keys = in_keys if in_keys is not None else getattr(policy, "in_keys", None)
        out_keys = out_keys if out_keys is not None else getattr(policy, "out_keys", None)
        if in_keys is None or out_keys is None:
            raise TypeError(
                f"policy {type(policy).__name__} is a plain nn.Module: pass in_keys= and out_keys= "
                "(or give the module in_keys/out_keys attributes)"
            )
        return TensorDictModule(policy, in_keys=in_keys, out_keys=out_keys)
    raise TypeError(f"policy must be a TensorDictModuleBase or an nn.Module, got {type(policy).__name__}")


def read_keys(policy: TensorDictModuleBase) -> list[NestedKey]:
    """``policy``'s ``in_keys`` less those its own modules write entries under before any reads them.

    A ``TensorDictSequential`` leaves out of its ``in_keys`` a key an earlier module writes, but not one
    whose entries it writes: a ``ProbabilisticActor(..., in_keys=["params"])`` over a module writing
    ``("params", "cat", "logits")`` (a ``CompositeDistribution``'s) lists ``"params"``, which no request holds.
    """
    read: set[tuple] = set()
    written: list[tuple] = []
    internal: set[tuple] = set()

    def walk(module: TensorDictModuleBase) -> None:
        if isinstance(module, TensorDictSequential):
            for inner in module.module:
                walk(inner)
            return
        for path in map(key_path, unravel_key_list(list(module.in_keys))):
            if path not in read:
                read.add(path)
                if any(len(w) > len(path) and w[: len(path)] == path for w in written):
                    internal.add(path)
        written.extend(map(key_path, unravel_key_list(list(module.out_keys))))

    walk(policy)
    return [k for k in unravel_key_list(list(policy.in_keys)) if key_path(k) not in internal]


# Modules whose training mode changes what a served row gets, and how.
_TRAINING_MODE = (
    (
        "batch norms",
        (
            nn.BatchNorm1d,
            nn.BatchNorm2d,
            nn.BatchNorm3d,
            nn.LazyBatchNorm1d,
            nn.LazyBatchNorm2d,
            nn.LazyBatchNorm3d,
            nn.SyncBatchNorm,
        ),
        "each row's outputs would depend on the other rows of its batch (and a batch of one row fails)",
    ),
    (
        "dropouts",
        (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout),
        "each forward zeroes units at random",
    ),
)


def warn_if_training(policy: nn.Module) -> None:
    for kind, classes, effect in _TRAINING_MODE:
        training = [
            name or type(m).__name__ for name, m in policy.named_modules() if isinstance(m, classes) and m.training
        ]
        if training:
            warnings.warn(
                f"the policy's {kind} {training} are in training mode: {effect}. The server serves its copy in the "
                "mode the policy has when the server is built: call policy.eval() first, or server.eval()",
                UserWarning,
                stacklevel=3,
            )


def refuse_hidden_state(policy: nn.Module) -> None:
    """Refuse TorchRL modules that read their per-env state back from entries their ``in_keys`` do not list."""
    if "torchrl.modules" not in sys.modules:  # else no module of it exists here, and importing it costs 50 MB
        return
    from torchrl.modules import MultiStepActorWrapper, OrnsteinUhlenbeckProcessModule

    for name, module in policy.named_modules():
        if isinstance(module, (OrnsteinUhlenbeckProcessModule, MultiStepActorWrapper)):
            kind = f"{name!r} ({type(module).__name__})" if name else type(module).__name__
            raise ValueError(
                f"the policy's {kind} reads the state it writes ({module.out_keys}) back from the "
                f"next step's TensorDict, but lists only {module.in_keys} as in_keys: no request carries that state "
                "to the server, so every served step would start it anew. Serve what it wraps and wrap each "
                "RemotePolicy in it instead, e.g. TensorDictSequential(server.remote_policy(), "
                "OrnsteinUhlenbeckProcessModule(...)) or MultiStepActorWrapper(server.remote_policy(), n_steps=...)"
            )


def check_stamp_key(key: Any, policy: TensorDictModuleBase) -> None:
    """Refuse a ``policy_version_key`` that is no key, or that would overwrite (or nest in) a policy's entry."""
    stamp = key_path(as_key(key, "policy_version_key"))
    for kind in ("out_keys", "in_keys"):
        for entry in map(key_path, unravel_key_list(list(getattr(policy, kind)))):
            if entry == stamp:
                raise ValueError(
                    f"policy_version_key={key!r} is one of the policy's {kind}: the stamp would overwrite it in "
                    "every result. Pass another key (or None for no stamp)"
                )
            if entry[: len(stamp)] == stamp or stamp[: len(entry)] == entry:
                raise ValueError(
                    f"policy_version_key={key!r} nests with the policy's {kind} entry {entry!r}: the stamp would "
                    "overwrite that entry, or be written inside it. Pass another key (or None for no stamp)"
                )
