"""Request validation: what every request must look like to share a batch.

The layout of the policy's in_keys (dtype, feature shape after the batch
dimensions, device) is fixed by the first accepted request, or given up front.
It is provisional until a batch built on it has run: if that first batch fails,
the layout is forgotten, so one malformed first request cannot lock every later
one out. A collate transform can declare keys it writes itself
(``provided_keys``) and feature dims that may vary between requests
(``variable_dims``, e.g. the sequence length that a padding collate pads).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase

from torchrl_batchserve.errors import BadRequestError

__all__ = ["KeySpec", "Layout", "Validated"]


class KeySpec(NamedTuple):
    """What one in_key must hold: ``None`` in ``shape`` marks a dim that may vary."""

    dtype: torch.dtype | None
    shape: tuple[int | None, ...] | None
    device: torch.device | None


class Validated(NamedTuple):
    inputs: tuple[Any, ...]
    rows: int
    batch_shape: torch.Size
    device: torch.device | None


def _get(td: TensorDictBase, key: Any) -> Any:
    if type(key) is str and type(td) is TensorDict:
        return td._get_str(key, None)
    return td.get(key, None)


class Layout:
    """Checks requests against the layout of their keys.

    Args:
        keys: the entries a request must carry (the policy's in_keys, minus
            those the collate provides).
        variable_dims: per key, the feature dims (counted after the batch
            dims) whose size may differ between requests.
        specs: an explicit layout; otherwise the first request fixes it.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_batchserve.layout import Layout
        >>> layout = Layout(["obs"])
        >>> layout.check(TensorDict(obs=torch.zeros(4))).rows
        1
        >>> layout.check(TensorDict(obs=torch.zeros(3, 4), batch_size=[3])).rows
        3
        >>> layout.check(TensorDict(obs=torch.zeros(5)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchrl_batchserve.errors.BadRequestError: key 'obs': expected feature shape (4,) ... got shape (5,)
    """

    def __init__(
        self,
        keys: Sequence[Any],
        variable_dims: Mapping[Any, Sequence[int]] | None = None,
        specs: Sequence[KeySpec] | None = None,
    ) -> None:
        self.keys = tuple(keys)
        self._variable = {key: tuple(dims) for key, dims in (variable_dims or {}).items()}
        self._specs: tuple[KeySpec, ...] | None = tuple(specs) if specs is not None else None
        self._confirmed = specs is not None
        self._lock = threading.Lock()

    @property
    def specs(self) -> tuple[KeySpec, ...] | None:
        return self._specs

    def check(self, td: Any) -> Validated:
        """Validate ``td`` and return its inputs; raise :class:`BadRequestError`."""
        if not isinstance(td, TensorDictBase):
            raise BadRequestError(f"a request must be a TensorDictBase, got {type(td).__name__}")
        batch_shape = td.batch_size
        batch_dims = len(batch_shape)
        values = []
        for key in self.keys:
            value = _get(td, key)
            if value is None:
                raise BadRequestError(
                    f"key {key!r}: missing; the policy reads {list(self.keys)}, "
                    f"the request has {sorted(map(str, td.keys(True, True)))}"
                )
            values.append(value)
        specs = self._specs
        if specs is None:
            specs = self._establish(values, batch_dims)
        device = None
        for key, value, spec in zip(self.keys, values, specs):
            if not isinstance(value, torch.Tensor):
                if spec.dtype is not None or isinstance(value, TensorDictBase):
                    raise BadRequestError(f"key {key!r}: expected a tensor, got {type(value).__name__}")
                continue  # non-tensor data (e.g. a string) travels as is
            if value.dtype != spec.dtype:
                raise BadRequestError(f"key {key!r}: expected dtype {spec.dtype}, got {value.dtype}")
            feature = value.shape[batch_dims:]
            if not self._shape_matches(key, feature, spec.shape):
                raise BadRequestError(
                    f"key {key!r}: expected feature shape {_fmt(spec.shape)} after the batch dims "
                    f"{list(batch_shape)}, got shape {tuple(value.shape)}"
                )
            if value.device != spec.device:
                raise BadRequestError(f"key {key!r}: expected device {spec.device}, got {value.device}")
            device = spec.device
        if batch_dims == 0:
            rows = 1
        else:
            rows = batch_shape.numel()
            if rows == 0:
                raise BadRequestError(f"a request needs at least one row, got batch size {list(batch_shape)}")
            if batch_dims > 1:
                values = [v.reshape(rows, *v.shape[batch_dims:]) if isinstance(v, torch.Tensor) else v for v in values]
        if td.device is not None:
            device = td.device
        return Validated(tuple(values), rows, batch_shape, device)

    def confirm(self) -> None:
        """A batch built on this layout ran: keep it for good."""
        self._confirmed = True

    def forget_unconfirmed(self) -> None:
        """The first batch failed: let the next request fix the layout again."""
        with self._lock:
            if not self._confirmed:
                self._specs = None

    def _establish(self, values: list[Any], batch_dims: int) -> tuple[KeySpec, ...]:
        specs = []
        for key, value in zip(self.keys, values):
            if isinstance(value, torch.Tensor):
                shape: list[int | None] = list(value.shape[batch_dims:])
                for dim in self._variable.get(key, ()):
                    if dim < len(shape):
                        shape[dim] = None
                specs.append(KeySpec(value.dtype, tuple(shape), value.device))
            else:
                specs.append(KeySpec(None, None, None))
        with self._lock:
            if self._specs is None:
                self._specs = tuple(specs)
            return self._specs

    def _shape_matches(self, key: Any, feature: torch.Size, expected: tuple[int | None, ...] | None) -> bool:
        if expected is None:
            return True
        if key not in self._variable:
            return feature == expected
        return len(feature) == len(expected) and all(e is None or e == f for f, e in zip(feature, expected))


def _fmt(shape: tuple[int | None, ...] | None) -> str:
    if shape is None:
        return "any"
    return "(" + ", ".join("*" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
