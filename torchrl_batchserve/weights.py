"""Versioned weights: staged by whoever pushes, applied by each replica between two batches.

The server never serves the module it was given: each replica serves its own
copy (see :mod:`torchrl_batchserve.replica`), so a trainer may train the
module it passed in while the server serves. New weights reach the replicas
only through :meth:`ShadowWeights.stage`, in the pushing thread: their
names, shapes and dtypes are checked against the served layout, and they are
copied into a snapshot that nothing changes afterwards. Each replica, at its
next batch boundary, copies the newest snapshot into its parameters in place
(compiled or CUDA-graph policies keep their storage) and stamps that
version on every result of the batch. A forward therefore never sees half
written weights, and the trainer's parameters are only ever read.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.nn.parameter import is_lazy

from torchrl_batchserve.errors import WeightSyncError

__all__ = ["ShadowWeights", "Snapshot", "as_weights", "castable", "non_persistent"]


def as_weights(weights: Any) -> TensorDictBase:
    """A TensorDict of weights from a TensorDict, a module or a state_dict."""
    if isinstance(weights, TensorDictBase):
        td = weights
    elif isinstance(weights, nn.Module):
        td = TensorDict.from_module(weights)
    elif isinstance(weights, Mapping):
        td = TensorDict(dict(weights), batch_size=[]).unflatten_keys(".")
    else:
        raise WeightSyncError(
            f"weights must be a TensorDict, an nn.Module or a state_dict, got {type(weights).__name__}"
        )
    lazy = [key for key, value in td.items(True, True) if is_lazy(value)]
    if lazy:
        raise WeightSyncError(f"weights {lazy} are not initialized (lazy modules): run the module once first")
    return td


class Snapshot:
    """One staged version: its number, its tensors and, on CUDA, the event after which they are complete."""

    __slots__ = ("ready", "tensors", "version")

    def __init__(self, version: int, tensors: TensorDictBase | None, ready: Any = None) -> None:
        self.version = version
        self.tensors = tensors
        self.ready = ready


class ShadowWeights:
    """The staging area of one server's weights.

    Args:
        layout: the served parameters and buffers (``TensorDict.from_module``
            of a served copy): pushes must match their names, shapes and dtypes.
        device: where snapshots are kept (the first replica's device).
        optional: keys of ``layout`` a push may leave out, which then keep
            the values of the last push that had them (before any, the served
            ones): the buffers a ``state_dict`` leaves out (:func:`non_persistent`).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_batchserve.weights import ShadowWeights
        >>> net = torch.nn.Linear(2, 2)
        >>> shadow = ShadowWeights(TensorDict.from_module(net))
        >>> shadow.stage({"weight": torch.zeros(2, 2), "bias": torch.ones(2)})
        1
        >>> snapshot = shadow.latest()
        >>> snapshot.version, snapshot.tensors["bias"].tolist()
        (1, [1.0, 1.0])
    """

    def __init__(self, layout: TensorDictBase, device: torch.device | None = None, optional: Any = ()) -> None:
        self._layout = layout
        self._device = device
        self.optional = frozenset(optional)
        self._lock = threading.Lock()
        self._latest = Snapshot(0, None)
        self.mode: bool | None = None  # the training mode to serve in (``server.train()``); None: as copied

    @property
    def served(self) -> TensorDictBase:
        """The layout pushes must match (a TensorDict of the served parameters and buffers)."""
        return self._layout

    @property
    def latest_version(self) -> int:
        """The version of the newest weights staged (0: the ones the server was built with)."""
        return self._latest.version

    @property
    def serving(self) -> tuple[int, bool | None]:
        """What a batch started now computes with: the newest version and the mode (the cache's tag)."""
        return self._latest.version, self.mode

    def latest(self) -> Snapshot:
        """The newest staged snapshot."""
        return self._latest

    def renaming(self, names: set[tuple[str, ...]]) -> dict[tuple[str, ...], tuple[str, ...]] | None:
        """The served name of each pushed name to serve, if ``names`` hold the served weights named otherwise.

        ``None`` when ``names`` are the served ones, or when they hold them
        nowhere (or in more than one place). A server of
        ``TensorDictModule(net, ...)``, or of a plain ``net`` it wraps, serves
        ``net``'s weights under ``"module"``, and one of ``torch.compile(net)``
        under ``"_orig_mod"``: a push of ``net`` itself, compiled or not
        (``update_weights(net)``, its state_dict, a weight group's push of
        it), names them without these. A push of a module that holds the
        served one as a submodule (a trainer's ``ProbabilisticActor`` around
        the network that actors serve and sample from locally) names them
        under its path; its other weights serve nothing and are left out.
        """
        served = {key_path(k) for k in self._layout.keys(True, True)}
        required = served - {key_path(k) for k in self.optional}
        if required <= names <= served:
            return None
        plain = {_plain(k): k for k in served}
        if len(plain) != len(served) or not required:
            return None
        top = list(self._layout.keys())
        wrapper = len(top) == 1 and isinstance(self._layout.get(top[0]), TensorDictBase)
        anchor = max(map(_plain, required))  # every place that holds the served weights holds this one
        pushed = {n: _plain(n) for n in names}
        found: dict[frozenset, dict[tuple[str, ...], tuple[str, ...]]] = {}
        for prefix in ((), (top[0],)) if wrapper else ((),):
            tail = anchor[len(prefix) :]
            for path in pushed.values():
                cut = len(path) - len(tail)  # the served weights would sit under path[:cut]
                if cut < 0 or path[cut:] != tail:
                    continue
                under = {n: plain.get(prefix + p[cut:]) for n, p in pushed.items() if p[:cut] == path[:cut]}
                got = set(under.values())
                if None not in got and len(got) == len(under) and required <= got:
                    found[frozenset(under.items())] = under  # type: ignore[assignment]
        return next(iter(found.values())) if len(found) == 1 else None

    def fit(self, weights: TensorDictBase) -> TensorDictBase:
        """``weights`` named as served (:meth:`renaming`); :class:`WeightSyncError` if they do not match."""
        renamed = self.renaming({key_path(k) for k in weights.keys(True, True)})
        if renamed is not None:
            weights = TensorDict(
                {renamed[key_path(k)]: v for k, v in weights.items(True, True) if key_path(k) in renamed}, batch_size=[]
            )
        self.check(weights)
        return weights

    def check(self, weights: TensorDictBase) -> None:
        """Raise :class:`WeightSyncError` unless ``weights`` matches the served layout."""
        served = set(self._layout.keys(True, True))
        given = set(weights.keys(True, True))  # tensors only
        for key in served - given:
            value = weights.get(key, None)
            if value is not None:  # non-tensor data where a tensor is served
                raise WeightSyncError(f"weight {key!r}: expected a tensor, got {type(value).__name__}")
        if not served - self.optional <= given <= served:
            missing = sorted(map(str, served - given - self.optional))
            extra = sorted(map(str, given - served))
            if not served:
                raise WeightSyncError(
                    "weights do not match the served policy: it holds none that TensorDict.from_module sees (a "
                    "dynamically quantized module keeps its packed weights out of it), so none can be pushed; serve "
                    f"other weights with a new server. Unexpected {extra}"
                )
            raise WeightSyncError(f"weights do not match the served policy: missing {missing}, unexpected {extra}")
        for key in given:
            target, value = self._layout.get(key), weights.get(key)
            if value.is_meta:
                raise WeightSyncError(f"weight {key!r}: is on the meta device (it holds no values to serve)")
            if target.shape != value.shape or not castable(value.dtype, target.dtype):
                raise WeightSyncError(
                    f"weight {key!r}: expected shape {tuple(target.shape)} and dtype {target.dtype}, "
                    f"got shape {tuple(value.shape)} and dtype {value.dtype}"
                )

    def stage(self, weights: Any, version: int | None = None) -> int:
        """Check and copy ``weights``; return the version they serve as from every replica's next batch."""
        version = check_version(version)
        weights = self.fit(as_weights(weights))
        keys = list(weights.keys(True, True))
        layout = self._layout if len(keys) == len(self._layout.keys(True, True)) else self._layout.select(*keys)
        with torch.no_grad():
            tensors = layout.apply(
                lambda ref, w: w.detach().to(self._device or ref.device, dtype=ref.dtype, copy=True), weights
            )
        with self._lock:
            earlier = self._latest
            if version is None:
                version = stampable(earlier.version + 1)
            elif version <= earlier.version:
                raise WeightSyncError(f"version must increase: staged {earlier.version}, got {version}")
            after = None
            if layout is not self._layout and earlier.tensors is not None:
                # A replica applies the newest snapshot only: left-out entries carry the values pushed before
                # (before any push, the served ones, which every replica shares).
                tensors.update(earlier.tensors.exclude(*keys))
                after = earlier.ready
            ready = _record_event(tensors, after) if tensors.device is None or tensors.device.type == "cuda" else None
            self._latest = Snapshot(version, tensors, ready)
        return version


_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def castable(pushed: torch.dtype, served: torch.dtype) -> bool:
    """Whether a pushed weight of dtype ``pushed`` is served as ``served``: the same, or both plain floats.

    A trainer in float32 may push to a server of the same policy in bfloat16
    or float16 (each weight is cast as it is staged), as TorchRL's own
    ``update_`` of a policy's weights casts. Any other dtype must match: an
    integer buffer, a quantized (float8) weight.
    """
    return pushed == served or (pushed in _FLOATS and served in _FLOATS)


def non_persistent(module: nn.Module) -> frozenset:
    """The keys (as ``TensorDict.from_module`` names them) of the buffers ``module``'s state_dict leaves out."""
    kept = set(module.state_dict(keep_vars=True))
    names = (tuple(name.split(".")) for name, _ in module.named_buffers() if name not in kept)
    return frozenset(path[0] if len(path) == 1 else path for path in names)


def as_integer(value: Any) -> int | None:
    """``value`` as an int if it is an integer (an int, a numpy integer, a one-element integer tensor; not a
    bool, nor a float tensor, which would be truncated), else ``None``."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


MAX_VERSION = 2**63 - 1  # results carry their version as an int64 stamp


def check_version(version: Any) -> int | None:
    """``version`` as an int (``None``: the next one); :class:`WeightSyncError` if it is no integer."""
    if version is None:
        return None
    number = as_integer(version)
    if number is None:
        raise WeightSyncError(f"version must be an int (or None: the next one), got {version!r}")
    return stampable(number)


def stampable(version: int) -> int:
    """``version``, if an int64 stamp holds it; else :class:`WeightSyncError`."""
    if version > MAX_VERSION:
        raise WeightSyncError(f"version must be at most 2**63 - 1 (results carry it as an int64), got {version}")
    return version


def key_path(key: Any) -> tuple[str, ...]:
    """A TensorDict key as a tuple of names: ``"a"`` is ``("a",)``."""
    return (key,) if isinstance(key, str) else tuple(key)


def _plain(path: tuple[str, ...]) -> tuple[str, ...]:
    """``path`` without the ``_orig_mod`` levels that ``torch.compile`` adds."""
    return tuple(p for p in path if p != "_orig_mod")


def _record_event(tensors: TensorDictBase, after: Any = None) -> Any:
    """An event on the current stream of the snapshot's CUDA device, after its copies and ``after``.

    ``None`` on CPU. ``after``: the event of an earlier snapshot whose tensors this one shares.
    """
    if not torch.cuda.is_available():
        return None
    for value in tensors.values(True, True):
        if value.is_cuda:
            stream = torch.cuda.current_stream(value.device)
            if after is not None:
                stream.wait_event(after)
            return stream.record_event()
    return None
