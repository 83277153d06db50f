"""Weight updates that never stall serving.

:class:`ShadowWeights` receives new weights beside the serve loop: it checks
their metadata against the served parameters (names, shapes, dtypes), copies
them into a shadow on the parameters' devices, and hands them over. The serve
loop applies the newest shadow between two batches, in place into the served
parameters (compiled or CUDA-graph policies keep their storage), so each batch
is computed with exactly one version and a transfer never blocks a forward.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from torchrl_batchserve.errors import WeightSyncError

__all__ = ["ShadowWeights", "as_weights"]


def as_weights(weights: Any) -> TensorDictBase:
    """A TensorDict of weights from a TensorDict, a module or a state_dict."""
    if isinstance(weights, TensorDictBase):
        return weights
    if isinstance(weights, nn.Module):
        return TensorDict.from_module(weights)
    if isinstance(weights, Mapping):
        return TensorDict(dict(weights), batch_size=[]).unflatten_keys(".")
    raise WeightSyncError(f"weights must be a TensorDict, an nn.Module or a state_dict, got {type(weights).__name__}")


class ShadowWeights:
    """Stage weights for a module and apply them at the serve loop's boundaries.

    Args:
        module: the served module whose parameters and buffers are updated.
        version: the version of the weights it holds now.

    Examples:
        >>> import torch
        >>> from torchrl_batchserve.weights import ShadowWeights
        >>> net = torch.nn.Linear(2, 2)
        >>> shadow = ShadowWeights(net)
        >>> shadow.stage({"weight": torch.zeros(2, 2), "bias": torch.ones(2)})
        1
        >>> shadow.apply_pending()
        1
        >>> net.bias.tolist(), shadow.version
        ([1.0, 1.0], 1)
    """

    def __init__(self, module: nn.Module, version: int = 0) -> None:
        self._served = TensorDict.from_module(module)
        self._lock = threading.Lock()
        self._pending: tuple[TensorDictBase, int] | None = None
        self._version = version
        self._staged_version = version
        self.last_apply_seconds = 0.0

    @property
    def version(self) -> int:
        """The version of the weights the served module holds."""
        return self._version

    @property
    def served(self) -> TensorDictBase:
        """The served parameters and buffers (a TensorDict view of the module)."""
        return self._served

    @property
    def latest_version(self) -> int:
        """The version of the newest weights given (staged or served)."""
        return self._staged_version

    def check(self, weights: TensorDictBase) -> None:
        """Raise :class:`WeightSyncError` unless ``weights`` matches the served layout."""
        served = set(self._served.keys(True, True))
        given = set(weights.keys(True, True))
        if served != given:
            missing = sorted(map(str, served - given))
            extra = sorted(map(str, given - served))
            raise WeightSyncError(f"weights do not match the served policy: missing {missing}, unexpected {extra}")
        for key in served:
            target, value = self._served.get(key), weights.get(key)
            if target.shape != value.shape or target.dtype != value.dtype:
                raise WeightSyncError(
                    f"weight {key!r}: expected shape {tuple(target.shape)} and dtype {target.dtype}, "
                    f"got shape {tuple(value.shape)} and dtype {value.dtype}"
                )

    def stage(self, weights: Any, version: int | None = None) -> int:
        """Check and copy ``weights`` into a shadow; return the version it will serve as."""
        weights = as_weights(weights)
        self.check(weights)
        with torch.no_grad():
            shadow = self._served.apply(lambda p, w: w.detach().to(p.device, copy=True), weights)
        if shadow.device is None or shadow.device.type == "cuda":
            _sync_cuda(shadow)
        with self._lock:
            if version is None:
                version = self._staged_version + 1
            elif version <= self._staged_version:
                raise WeightSyncError(f"version must increase: staged {self._staged_version}, got {version}")
            self._staged_version = version
            self._pending = (shadow, version)
        return version

    def apply_pending(self) -> int | None:
        """Copy the newest staged weights into the served module; return their version."""
        if self._pending is None:
            return None
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return None
        shadow, version = pending
        start = time.perf_counter()
        with torch.no_grad():
            self._served.update_(shadow)
        self.last_apply_seconds = time.perf_counter() - start
        self._version = version
        return version


def _sync_cuda(td: TensorDictBase) -> None:
    # The shadow must be complete before the serve loop copies from it on
    # another stream; one synchronize per update, off the serve loop.
    if torch.cuda.is_available():
        for value in td.values(True, True):
            if value.is_cuda:
                torch.cuda.synchronize(value.device)
                return
