"""Request validation: what every request must look like to share a batch.

The layout of the policy's in_keys (dtype, feature shape after the batch
dimensions, device) is fixed by the first accepted request, or given up front
(:func:`layout_of`: from a TorchRL ``Composite`` spec or a sample TensorDict).
Until a batch has been served successfully there is no layout: each request
is checked on its own (kinds, odd tensors) and carries its own layout to the
serve loop, which runs each layout as its own forward; the first layout served
successfully becomes the server's (:meth:`Layout.confirm`). A layout is thus
learned only from requests that were served, and a malformed request can
never lock the correct ones out. A collate transform can declare keys it writes itself
(``provided_keys``) and feature dims that may vary between requests
(``variable_dims``, e.g. the sequence length that a padding collate pads),
and a ``check`` of its own for what the layout cannot express (e.g. that the
padded entries of one request share one length).

An entry is one of three kinds, fixed by the first request: a tensor (dtype,
feature shape, device), a nested TensorDict (the dtype and feature shape of
each of its leaves) or non-tensor data (``NonTensorData``, e.g. a game's FEN
string), which travels as is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDictBase, is_non_tensor, is_tensor_collection, is_tensorclass

from torchrl_batchserve.errors import BadRequestError, raisable
from torchrl_batchserve.weights import as_integer, key_path

__all__ = ["KeySpec", "Layout", "Validated", "flat_rows", "layout_of", "request_entries", "shaped_rows"]


Fields = tuple[tuple[tuple[str, ...], Any, Any], ...]  # (leaf path, dtype, feature shape)


class KeySpec(NamedTuple):
    """What one in_key must hold: ``None`` in ``shape`` marks a dim that may vary.

    A tensor has a ``dtype``; a nested TensorDict has ``fields`` (leaf key,
    dtype, feature shape), and a tensorclass its ``cls`` too; non-tensor data
    has neither.
    """

    dtype: torch.dtype | None
    shape: tuple[int | None, ...] | None
    device: torch.device | None
    fields: Fields | None = None
    cls: type | None = None

    @property
    def kind(self) -> str:
        if self.dtype is not None:
            return "tensor"
        return "tensordict" if self.fields is not None else "non-tensor"


def _fields(td: TensorDictBase, batch_dims: int) -> Fields:
    fields: list[tuple[tuple[str, ...], Any, Any]] = []
    for key, leaf in td.items(include_nested=True, leaves_only=True):
        path = key_path(key)
        if isinstance(leaf, torch.Tensor):
            fields.append((path, leaf.dtype, tuple(leaf.shape[batch_dims:])))
        else:
            fields.append((path, None, None))
    return tuple(sorted(fields, key=lambda f: f[0]))


def holds_tensors(value: Any) -> bool:
    """Whether ``value`` is tensor data: a tensor, or a TensorDict or tensorclass that is not non-tensor data."""
    return isinstance(value, torch.Tensor) or (is_tensor_collection(value) and not is_non_tensor(value))


def _tensorclass(value: Any) -> type | None:
    return type(value) if is_tensorclass(value) else None


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "tensordict" if holds_tensors(value) else "non-tensor"


class Validated(NamedTuple):
    inputs: tuple[Any, ...]
    rows: int
    batch_shape: torch.Size
    device: torch.device | None
    cost: int = 0
    layout: tuple[KeySpec, ...] | None = None  # the request's own, while the server has none confirmed


def request_entries(td: Any, keys: Sequence[Any]) -> list[Any]:
    """``td``'s entry under each key, once ``td`` is a request: a TensorDict that carries them and takes outputs.

    Raises :class:`BadRequestError` naming what is wrong, before anything is
    sent or queued (the outputs are written into ``td``, as a
    ``TensorDictModule`` writes them, so a locked one could not take them).
    """
    if not isinstance(td, TensorDictBase):
        raise BadRequestError(f"a request must be a TensorDictBase, got {type(td).__name__}")
    if td.is_locked:
        raise BadRequestError(
            "a request's TensorDict must be unlocked: the outputs are written into it; this one is locked "
            "(share_memory_, memmap_ and lock_ lock it): send td.clone() or unlock_() it"
        )
    try:
        return _entries(td, keys)
    except _Missing as missing:
        raise BadRequestError(
            f"key {missing.key!r}: missing; the policy reads {list(keys)}, the request has {missing.has}"
        ) from None


class Layout:
    """Checks requests against the layout of their keys.

    Args:
        keys: the entries a request must carry (the policy's in_keys, minus
            those the collate provides).
        variable_dims: per key, the feature dims (counted after the batch
            dims) whose size may differ between requests.
        specs: an explicit layout; otherwise the first request fixes it.
        check: ``check(keys, values, batch_dims)`` run on every request after
            the layout checks (the collate's own rules); raises
            :class:`BadRequestError`.
        cost_fn: ``cost_fn(td) -> int``, a request's share of ``max_cost``.
        max_cost: the most a batch may cost; a request costing more alone is
            refused.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_batchserve.layout import Layout
        >>> layout = Layout(["obs"])
        >>> first = layout.check(TensorDict(obs=torch.zeros(4)))
        >>> first.rows, layout.specs is None  # nothing served yet: the request carries its own layout
        (1, True)
        >>> layout.confirm(first.layout)  # a batch of that layout was served
        True
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
        check: Callable[[Sequence[Any], Sequence[Any], int], None] | None = None,
        cost_fn: Callable[[TensorDictBase], int] | None = None,
        max_cost: int | None = None,
    ) -> None:
        self.keys = tuple(keys)
        self._check = check
        self._cost_fn = cost_fn
        self._max_cost = max_cost
        self._variable = {key: tuple(dims) for key, dims in (variable_dims or {}).items()}
        self._specs: tuple[KeySpec, ...] | None = tuple(specs) if specs is not None else None
        self._lock = threading.Lock()

    @property
    def specs(self) -> tuple[KeySpec, ...] | None:
        """The confirmed layout, or ``None`` until a batch has been served."""
        return self._specs

    def check(self, td: Any) -> Validated:
        """Validate ``td`` and return its inputs; raise :class:`BadRequestError`."""
        values = request_entries(td, self.keys)
        batch_shape = td.batch_size
        batch_dims = len(batch_shape)
        own = None
        specs = self._specs
        if specs is None:  # nothing served yet: the request's own layout, which the serve loop groups by
            for key, value in zip(self.keys, values):
                _check_plain(key, value)
            specs = own = _key_specs(self.keys, values, batch_dims, self._variable)
        device = None
        for key, value, spec in zip(self.keys, values, specs):
            if not isinstance(value, torch.Tensor):
                kind = _kind(value)
                if kind != spec.kind:
                    raise BadRequestError(f"key {key!r}: expected {_an(spec.kind)}, got {type(value).__name__}")
                if kind == "tensordict":
                    want = "a TensorDict" if spec.cls is None else f"a tensorclass {spec.cls.__name__}"
                    if _tensorclass(value) is not spec.cls:
                        raise BadRequestError(f"key {key!r}: expected {want}, got {type(value).__name__}")
                    fields = _fields(value, batch_dims)
                    if fields != spec.fields:
                        raise BadRequestError(
                            f"key {key!r}: expected {want} with leaves {_fmt_fields(spec.fields)}, "
                            f"got {_fmt_fields(fields)}"
                        )
                continue  # non-tensor data (e.g. a string) travels as is
            if spec.dtype is None:
                raise BadRequestError(f"key {key!r}: expected {_an(spec.kind)}, got a tensor")
            _check_plain(key, value)
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
        if self._check is not None:
            try:
                self._check(self.keys, values, batch_dims)
            except StopIteration as err:
                raise raisable(err) from err
        if batch_dims == 0:
            rows = 1
        else:
            rows = batch_shape.numel()
            if rows == 0:
                raise BadRequestError(f"a request needs at least one row, got batch size {list(batch_shape)}")
            if batch_dims > 1:
                values = [flat_rows(v, batch_dims) for v in values]
        if td.device is not None:
            device = td.device
        cost = 0 if self._cost_fn is None else self._cost(td)
        return Validated(tuple(values), rows, batch_shape, device, cost, own)

    def _cost(self, td: TensorDictBase) -> int:
        got = call_user_fn("cost_fn", self._cost_fn, td)
        cost = as_integer(got)
        if cost is None or cost < 0:
            raise BadRequestError(f"cost_fn must return an int >= 0 for each request, got {got!r}")
        if self._max_cost is not None and cost > self._max_cost:
            raise BadRequestError(f"the request costs {cost} (cost_fn), more than max_batch_cost={self._max_cost}")
        return cost

    def confirm(self, specs: tuple[KeySpec, ...]) -> bool:
        """A batch of layout ``specs`` was served: it is the layout from now on (the first one wins).

        Returns whether ``specs`` is the confirmed layout.
        """
        with self._lock:
            if self._specs is None:
                self._specs = specs
            return self._specs == specs

    def _shape_matches(self, key: Any, feature: torch.Size, expected: tuple[int | None, ...] | None) -> bool:
        if expected is None:
            return True
        if key not in self._variable:
            return feature == expected
        return len(feature) == len(expected) and all(e is None or e == f for f, e in zip(feature, expected))


def call_user_fn(name: str, fn: Any, td: TensorDictBase) -> Any:
    """``fn(td)`` for a user's ``key_fn`` or ``cost_fn``; what it raises is a bad request naming ``td``'s entries."""
    try:
        return fn(td)
    except BadRequestError:
        raise
    except Exception as err:
        raise BadRequestError(
            f"{name} failed on entries {sorted(map(str, td.keys(True, True)))}: {err!r}. From worker "
            "processes and other nodes a request carries only the entries the policy reads"
        ) from err


def _check_plain(key: Any, value: Any) -> None:
    """Refuse tensors that no collate can batch: sparse, nested (jagged) and other non-strided layouts."""
    if isinstance(value, torch.Tensor) and (value.layout is not torch.strided or value.is_nested):
        raise BadRequestError(
            f"key {key!r}: expected a dense (strided) tensor, got layout {value.layout}"
            + (" (a nested tensor)" if value.is_nested else "")
        )


def layout_of(
    spec: Any, keys: Sequence[Any], variable_dims: Mapping[Any, Sequence[int]] | None = None
) -> tuple[KeySpec, ...]:
    """The layout of ``keys`` as ``spec`` describes them, for :class:`Layout`'s ``specs``.

    Args:
        spec: a TorchRL ``Composite`` (e.g. ``env.observation_spec``), whose
            shape is the batch dims, or a sample request (a TensorDict, e.g.
            ``env.reset()``), whose batch size is; entries of other keys are
            ignored.
        keys: the entries requests must carry.
        variable_dims: per key, the feature dims left free (a collate's).

    Examples:
        >>> import torch
        >>> from torchrl.data import Composite, Unbounded
        >>> from torchrl_batchserve.layout import Layout, layout_of
        >>> spec = Composite(observation=Unbounded(shape=(3, 4)), shape=(3,))  # 3 envs, 4 features
        >>> layout = Layout(["observation"], specs=layout_of(spec, ["observation"]))
        >>> layout.specs[0].shape
        (4,)
    """
    from torchrl.data import Composite

    if isinstance(spec, Composite):
        sample: Any = spec.zero()  # the same dtypes, shapes and devices, nested specs included
    elif isinstance(spec, TensorDictBase):
        sample = spec
    else:
        raise TypeError(
            f"input_spec must be a torchrl.data.Composite or a TensorDict (a sample request), got {type(spec).__name__}"
        )
    try:
        values = _entries(sample, keys)
    except _Missing as missing:
        raise ValueError(
            f"input_spec has no entry {missing.key!r}; the policy reads {list(keys)} from requests, "
            f"the spec has {missing.has}"
        ) from None
    return _key_specs(keys, values, sample.batch_dims, variable_dims or {})


class _Missing(Exception):
    """A key ``td`` lacks (``key``), and the keys it has (``has``); each caller words its own error."""

    def __init__(self, key: Any, has: list[str]) -> None:
        super().__init__(key)
        self.key, self.has = key, has


def _entries(td: Any, keys: Sequence[Any]) -> list[Any]:
    """``td``'s entry under each key; raises :class:`_Missing` for the first it lacks.

    A read that fails (a lazy stack of differing shapes) is a bad request.
    """
    values = []
    for key in keys:
        try:
            value = td.get(key, None)
        except (RuntimeError, ValueError) as err:
            raise BadRequestError(f"key {key!r}: cannot be read as one batched entry ({err})") from None
        if value is None:
            raise _Missing(key, sorted(map(str, td.keys(True, True))))
        values.append(value)
    return values


def _key_specs(
    keys: Sequence[Any], values: Sequence[Any], batch_dims: int, variable: Mapping[Any, Sequence[int]]
) -> tuple[KeySpec, ...]:
    specs = []
    for key, value in zip(keys, values):
        kind = _kind(value)
        if kind == "tensor":
            shape: list[int | None] = list(value.shape[batch_dims:])
            for dim in variable.get(key, ()):
                if -len(shape) <= dim < len(shape):
                    shape[dim] = None
            specs.append(KeySpec(value.dtype, tuple(shape), value.device))
        elif kind == "tensordict":
            specs.append(KeySpec(None, None, None, _fields(value, batch_dims), _tensorclass(value)))
        else:
            specs.append(KeySpec(None, None, None))
    return tuple(specs)


def flat_rows(value: Any, batch_dims: int) -> Any:
    """``value`` (batch dims first) with its rows in one dim: non-tensor data as a flat list of rows."""
    if isinstance(value, torch.Tensor) or _kind(value) == "tensordict":
        return value.flatten(0, batch_dims - 1)  # not reshape(-1, ...): ambiguous for a tensor of no elements
    items = value.tolist() if hasattr(value, "tolist") else value
    for _ in range(batch_dims - 1):
        items = [item for sub in items for item in sub]
    return items


def shaped_rows(items: list[Any], batch_shape: Sequence[int]) -> list[Any]:
    """The inverse of :func:`flat_rows` for non-tensor data: a flat list of rows nested as ``batch_shape``."""
    for size in reversed(batch_shape[1:]):
        items = [items[i : i + size] for i in range(0, len(items), size)]
    return items


def _an(kind: str) -> str:
    return {"tensor": "a tensor", "tensordict": "a nested TensorDict", "non-tensor": "non-tensor data"}[kind]


def _fmt_fields(fields: Fields | None) -> str:
    if not fields:
        return "{}"
    parts = []
    for path, dtype, shape in fields:
        name = ".".join(path)
        parts.append(f"{name}: non-tensor" if dtype is None else f"{name}: {dtype} {tuple(shape)}")
    return "{" + ", ".join(parts) + "}"


def _fmt(shape: tuple[int | None, ...] | None) -> str:
    if shape is None:
        return "any"
    return "(" + ", ".join("*" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
