"""Collates for variable-length entries: padding with a mask, and packing.

Both follow the :class:`~torchrl_batchserve.collate.Collate` protocol and
declare what the server needs to accept requests of different lengths:
``variable_dims`` (the dim that may vary, so validation does not pin it),
``provided_keys`` (the mask or offsets they write, which requests need not
carry) and ``check`` (the padded or packed entries of one request share one
length, and fit the largest bucket). Entries they are not told about are
stacked as :class:`~torchrl_batchserve.collate.StackCollate` does.

Each request's length is noted on the request (``Request.extra``) by
``collate`` and read back by ``split``, which returns every caller its own
elements and never a padded one.
"""

from __future__ import annotations

import bisect
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey, unravel_key
from torch.nn import functional
from torch.nn.utils.rnn import pad_sequence

from torchrl_batchserve.checks import check_int
from torchrl_batchserve.collate import all_single, split_rows, stack_column
from torchrl_batchserve.errors import BadRequestError, PolicyError
from torchrl_batchserve.request import Request

__all__ = ["LengthCost", "PackCollate", "PadCollate"]


def as_key(key: Any, name: str = "key") -> NestedKey:
    """``key`` as a TensorDict key; ``TypeError`` naming ``name`` for what is none (an empty one included)."""
    if not _is_key(key):
        raise TypeError(f"{name}: expected a key (a str or a tuple of str), got {key!r}")
    return key if isinstance(key, str) else unravel_key(tuple(key))  # lists from YAML become nested keys


def _is_key(key: Any) -> bool:
    if isinstance(key, str):
        return bool(key)
    return isinstance(key, (tuple, list)) and bool(key) and all(map(_is_key, key))


def _refuse_overwrite(keys: Sequence[NestedKey], **written: NestedKey | None) -> None:
    """Refuse a key the collate writes (a mask, offsets) that is one of the entries it collates, or another
    that it writes: one would overwrite the other in every batch."""
    seen: dict[NestedKey, str] = {key: "one of keys" for key in keys}
    for name, key in written.items():
        if key is not None:
            if key in seen:
                raise ValueError(f"{name}={key!r} is also {seen[key]}: one would overwrite the other in the batch")
            seen[key] = name


def _key_set(name: str, keys: Any, *, required: bool) -> tuple[NestedKey, ...]:
    if keys is None:
        keys = ()
    if isinstance(keys, str):
        keys = (keys,)
    if not isinstance(keys, Iterable):
        raise TypeError(f"{name}: expected a list of keys (each a str or a tuple of str), got {keys!r}")
    out = tuple(as_key(k, name) for k in keys)
    if required and not out:
        raise ValueError(f"{name} must name at least one entry (got {keys!r})")
    return out


def _shared_length(
    keys: Sequence[Any], values: Sequence[Any], batch_dims: int, varying: tuple[NestedKey, ...], dim: int
) -> tuple[Any, int]:
    """The one length of the ``varying`` entries of a request, or a bad request."""
    lengths = {}
    for key, value in zip(keys, values):
        if key in varying:
            if not isinstance(value, torch.Tensor):
                raise BadRequestError(
                    f"key {key!r}: a variable-length entry must be a tensor, got {type(value).__name__}"
                )
            if value.ndim - batch_dims <= dim:
                raise BadRequestError(
                    f"key {key!r}: expected a variable-length dim {dim} after the batch dims "
                    f"{batch_dims}, got shape {tuple(value.shape)}"
                )
            lengths[key] = value.shape[batch_dims + dim]
    first = next(iter(lengths))
    if len(set(lengths.values())) > 1:
        raise BadRequestError(
            f"keys {list(lengths)}: the variable-length entries of one request must share one length "
            f"along dim {dim}, got {lengths}"
        )
    return first, lengths[first]


def _lengths(requests: Sequence[Request], column: int, dim: int) -> list[int]:
    # inputs are (rows, *feature) for batched requests and (*feature) for single rows
    return [r.inputs[column].shape[dim + (1 if r.batch_shape else 0)] for r in requests]


def _row_lengths(requests: Sequence[Request], lengths: list[int], device: torch.device) -> torch.Tensor:
    per_request = torch.tensor(lengths, dtype=torch.long, device=device)
    if all_single(requests):
        return per_request
    return per_request.repeat_interleave(torch.tensor([r.rows for r in requests], device=device))


class PadCollate:
    """Pad variable-length entries to one length per batch; mask; trim outputs back.

    The entries named in ``keys`` may differ in size along ``dim`` between
    requests (all of one request's padded entries share one length). A batch
    pads them to its longest request, or to the smallest of ``buckets`` that
    holds it, so a compiled or CUDA-graph policy sees few shapes; a request
    longer than the largest bucket is refused at submit. The mask
    (``rows × length``, True on real elements) is written under ``mask_key``,
    which requests need not carry. Outputs named in ``trim_keys`` carry the
    padded dim at ``dim`` too (e.g. per-token logits) and go back to each
    caller cut to its own length; other outputs return as computed.

    Args:
        keys: the variable-length entries (nested keys allowed).

    Keyword Args:
        dim: the dim that varies, counted in the request's feature dims
            (after its batch dims). Default 0.
        mask_key: where the boolean mask goes; ``None`` writes none.
        trim_keys: outputs to cut back to each request's length along ``dim``.
        buckets: lengths to pad to; ``None`` pads to the batch maximum.
        pad_values: per key, the padding value, a number (default 0, False
            for bool) that the entry's dtype holds: a request whose entry
            cannot hold it is refused at submit.

    ``mask_key`` must differ from the padded ``keys`` (as ``PackCollate``'s
    ``offsets_key`` and ``segment_ids_key`` must from its ``keys`` and from
    each other): one would overwrite the other, so it is a ``ValueError``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl_batchserve import BatchedPolicyServer, PadCollate
        >>> def masked_mean(tokens, mask):  # (B, L, D), (B, L) -> (B, D)
        ...     return (tokens * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        >>> class MaskedMean(torch.nn.Module):
        ...     def forward(self, tokens, mask):
        ...         return masked_mean(tokens, mask), tokens * 2
        >>> policy = TensorDictModule(MaskedMean(), in_keys=["tokens", "mask"], out_keys=["mean", "doubled"])
        >>> collate = PadCollate(["tokens"], trim_keys=["doubled"], buckets=[4, 8])
        >>> with BatchedPolicyServer(policy, collate=collate, timeout=0.01) as server:
        ...     remote = server.remote_policy()
        ...     futures = [remote.submit(TensorDict(tokens=torch.ones(n, 2) * n)) for n in (1, 3, 6)]
        ...     tds = [f.result(timeout=10) for f in futures]
        >>> [td["mean"].tolist() for td in tds]
        [[1.0, 1.0], [3.0, 3.0], [6.0, 6.0]]
        >>> [tuple(td["doubled"].shape) for td in tds]
        [(1, 2), (3, 2), (6, 2)]
    """

    def __init__(
        self,
        keys: Sequence[NestedKey],
        *,
        dim: int = 0,
        mask_key: NestedKey | None = "mask",
        trim_keys: Sequence[NestedKey] | None = None,
        buckets: Sequence[int] | None = None,
        pad_values: Mapping[NestedKey, float | int | bool] | None = None,
    ) -> None:
        self.keys = _key_set("keys", keys, required=True)
        self.dim = check_int("dim", dim, 0, ", counted after the request's batch dims")
        self.mask_key = None if mask_key is None else as_key(mask_key, "mask_key")
        self.trim_keys = _key_set("trim_keys", trim_keys, required=False)
        if buckets is not None:
            if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
                raise ValueError(f"buckets must be a non-empty list of ints >= 1 (got {buckets!r})")
            buckets = sorted(set(buckets))
        self.buckets: list[int] | None = buckets
        self.pad_values = {as_key(k, "pad_values"): v for k, v in (pad_values or {}).items()}
        unknown = [k for k in self.pad_values if k not in self.keys]
        if unknown:
            raise ValueError(f"pad_values names {unknown}, which are not among the padded keys {list(self.keys)}")
        for key, value in self.pad_values.items():  # else every batch would fail in torch's pad_sequence
            if not isinstance(value, numbers.Real):
                raise ValueError(f"pad_values[{key!r}] must be a number (an int, float or bool), got {value!r}")
        _refuse_overwrite(self.keys, mask_key=self.mask_key)
        self.provided_keys = frozenset() if self.mask_key is None else frozenset({self.mask_key})
        self.variable_dims = {key: (self.dim,) for key in self.keys}
        self.cut_keys = self.trim_keys

    def check(self, keys: Sequence[Any], values: Sequence[Any], batch_dims: int) -> None:
        """Validation at submit: one length per request, within the largest bucket."""
        key, length = _shared_length(keys, values, batch_dims, self.keys, self.dim)
        if self.buckets is not None and length > self.buckets[-1]:
            raise BadRequestError(
                f"key {key!r}: length {length} along dim {self.dim} exceeds the largest bucket {self.buckets[-1]}"
            )
        if self.pad_values:
            for key, value in zip(keys, values):
                pad = self.pad_values.get(key)
                if pad is not None and not _holds(value.dtype, pad):
                    raise BadRequestError(
                        f"key {key!r}: its pad value {pad!r} is no {value.dtype} value (torch would round it or "
                        "fail every batch); give pad_values a value of the entry's dtype"
                    )

    def padded_length(self, longest: int) -> int:
        """The length a batch whose longest request is ``longest`` is padded to."""
        if self.buckets is None:
            return longest
        return self.buckets[bisect.bisect_left(self.buckets, longest)]

    def collate(self, requests: Sequence[Request], keys: Sequence[Any]) -> TensorDictBase:
        columns = [j for j, key in enumerate(keys) if key in self.keys]
        lengths = _lengths(requests, columns[0], self.dim)
        length = self.padded_length(max(lengths))
        total = sum(r.rows for r in requests)
        single = all_single(requests)
        batch = TensorDict(batch_size=[total])
        for j, key in enumerate(keys):
            items = [r.inputs[j] for r in requests]
            if j in columns:
                batch.set(key, self._pad(key, items, requests, length))
            else:
                batch.set(key, stack_column(items, requests, total, single))
        for request, n in zip(requests, lengths):
            request.extra = n
        if self.mask_key is not None:
            device = requests[0].inputs[columns[0]].device
            mask = torch.arange(length, device=device) < _row_lengths(requests, lengths, device).unsqueeze(1)
            batch.set(self.mask_key, mask)
        return batch

    def _pad(self, key: Any, items: list[torch.Tensor], requests: Sequence[Request], length: int) -> torch.Tensor:
        # pad_sequence pads a list of (L_i, *rest) in one C++ call (3x a loop of
        # narrow().copy_()); the padded dim goes first for it and back after.
        dim = self.dim
        sequences: list[torch.Tensor] = []
        for item, request in zip(items, requests):
            if request.batch_shape:
                sequences.extend(row.movedim(dim, 0) for row in item.unbind(0))
            else:
                sequences.append(item.movedim(dim, 0))
        value = self.pad_values.get(key, False if items[0].dtype is torch.bool else 0)
        out = pad_sequence(sequences, batch_first=True, padding_value=value)
        if out.shape[1] < length:  # up to the bucket
            out = functional.pad(out, [0, 0] * (out.ndim - 2) + [0, length - out.shape[1]], value=value)
        return out.movedim(1, dim + 1).contiguous() if dim else out

    def split(self, output: TensorDictBase, requests: Sequence[Request], keys: Sequence[Any]) -> list[Sequence[Any]]:
        columns = split_rows(output, requests, keys)
        for k, key in enumerate(keys):
            if key in self.trim_keys:
                dim = self.dim
                columns[k] = [_narrow(key, v, len(r.batch_shape) + dim, r.extra) for v, r in zip(columns[k], requests)]
        return columns

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(keys={list(self.keys)}, dim={self.dim}, mask_key={self.mask_key!r}, "
            f"trim_keys={list(self.trim_keys)}, buckets={self.buckets})"
        )


def _holds(dtype: torch.dtype, value: float | int | bool) -> bool:
    """Whether a tensor of ``dtype`` holds the number ``value`` as it is (floats: within their range)."""
    if dtype is torch.bool:
        return value in (0, 1)
    if dtype.is_floating_point or dtype.is_complex:
        return not abs(value) > torch.finfo(dtype).max or value in (float("inf"), float("-inf"))
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max and value == int(value)


def _narrow(key: Any, value: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    if value.ndim <= dim or value.shape[dim] < length:
        raise PolicyError(
            f"the policy output {key!r} has shape {tuple(value.shape)} per request; "
            f"trimming it needs a dim {dim} of at least {length}"
        )
    return value.narrow(dim, 0, length)


class PackCollate:
    """Concatenate variable-length entries of a batch into one packed tensor.

    For set, graph and sequence policies that take ragged input without
    padding. The entries named in ``keys`` vary in their first feature dim
    (the elements: tokens, set members, nodes; all of one request's packed
    entries share one count). A batch holds each of them as one tensor of
    ``(total elements, ...)``, with ``offsets`` (``rows + 1`` starts, int64)
    and ``segment_ids`` (the row of each element, int64) written beside them.
    Other entries are stacked, one per row. The batch has no batch dim.

    Outputs with one entry per row are split by rows; outputs named in
    ``element_keys`` have one entry per element and go back to each caller as
    its own ``(length, ...)`` elements. A request larger than
    ``max_batch_size`` runs whole (a packed batch cannot be sliced by rows).

    Args:
        keys: the packed entries.

    Keyword Args:
        offsets_key: where the row offsets go; ``None`` writes none.
        segment_ids_key: where the element-to-row ids go; ``None`` writes none.
        element_keys: outputs with one entry per element.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl_batchserve import BatchedPolicyServer, PackCollate
        >>> class SetSum(torch.nn.Module):  # a permutation-invariant set policy
        ...     def forward(self, items, segment_ids, offsets):
        ...         sums = torch.zeros(len(offsets) - 1, items.shape[-1]).index_add_(0, segment_ids, items)
        ...         return sums, items - sums[segment_ids]
        >>> policy = TensorDictModule(
        ...     SetSum(), in_keys=["items", "segment_ids", "offsets"], out_keys=["total", "residual"]
        ... )
        >>> with BatchedPolicyServer(policy, collate=PackCollate(["items"], element_keys=["residual"])) as server:
        ...     remote = server.remote_policy()
        ...     futures = [remote.submit(TensorDict(items=torch.ones(n, 2))) for n in (1, 3)]
        ...     tds = [f.result(timeout=10) for f in futures]
        >>> [td["total"].tolist() for td in tds], [tuple(td["residual"].shape) for td in tds]
        ([[1.0, 1.0], [3.0, 3.0]], [(1, 2), (3, 2)])
    """

    def __init__(
        self,
        keys: Sequence[NestedKey],
        *,
        offsets_key: NestedKey | None = "offsets",
        segment_ids_key: NestedKey | None = "segment_ids",
        element_keys: Sequence[NestedKey] | None = None,
    ) -> None:
        self.keys = _key_set("keys", keys, required=True)
        self.offsets_key = None if offsets_key is None else as_key(offsets_key, "offsets_key")
        self.segment_ids_key = None if segment_ids_key is None else as_key(segment_ids_key, "segment_ids_key")
        self.element_keys = _key_set("element_keys", element_keys, required=False)
        _refuse_overwrite(self.keys, offsets_key=self.offsets_key, segment_ids_key=self.segment_ids_key)
        self.provided_keys = frozenset(k for k in (self.offsets_key, self.segment_ids_key) if k is not None)
        self.variable_dims = {key: (0,) for key in self.keys}
        self.cut_keys = self.element_keys

    def check(self, keys: Sequence[Any], values: Sequence[Any], batch_dims: int) -> None:
        """Validation at submit: the packed entries of a request share one length."""
        _shared_length(keys, values, batch_dims, self.keys, 0)

    def collate(self, requests: Sequence[Request], keys: Sequence[Any]) -> TensorDictBase:
        columns = [j for j, key in enumerate(keys) if key in self.keys]
        lengths = _lengths(requests, columns[0], 0)
        total = sum(r.rows for r in requests)
        single = all_single(requests)
        batch = TensorDict()
        for j, key in enumerate(keys):
            items = [r.inputs[j] for r in requests]
            if j in columns:
                flat = [t.flatten(0, 1) if r.batch_shape else t for t, r in zip(items, requests)]
                batch.set(key, torch.cat(flat))
            else:
                batch.set(key, stack_column(items, requests, total, single))
        for request, n in zip(requests, lengths):
            request.extra = n
        device = requests[0].inputs[columns[0]].device
        row_lengths = _row_lengths(requests, lengths, device)
        if self.offsets_key is not None:
            offsets = torch.zeros(total + 1, dtype=torch.long, device=device)
            torch.cumsum(row_lengths, 0, out=offsets[1:])
            batch.set(self.offsets_key, offsets)
        if self.segment_ids_key is not None:
            rows = torch.arange(total, device=device)
            batch.set(self.segment_ids_key, rows.repeat_interleave(row_lengths))
        return batch

    def split(self, output: TensorDictBase, requests: Sequence[Request], keys: Sequence[Any]) -> list[Sequence[Any]]:
        row_keys = [key for key in keys if key not in self.element_keys]
        by_rows = dict(zip(row_keys, split_rows(output, requests, row_keys)))
        elements = sum(r.rows * r.extra for r in requests)
        columns: list[Sequence[Any]] = []
        for key in keys:
            if key not in self.element_keys:
                columns.append(by_rows[key])
                continue
            value = output.get(key, None)
            if not isinstance(value, torch.Tensor) or value.ndim == 0 or value.shape[0] != elements:
                shape = None if value is None else tuple(getattr(value, "shape", ()))
                raise PolicyError(f"the policy output {key!r} has shape {shape}; expected {elements} elements first")
            chunks = value.split([r.rows * r.extra for r in requests])
            columns.append([c.reshape(*r.batch_shape, r.extra, *c.shape[1:]) for c, r in zip(chunks, requests)])
        return columns

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(keys={list(self.keys)}, offsets_key={self.offsets_key!r}, "
            f"segment_ids_key={self.segment_ids_key!r}, element_keys={list(self.element_keys)})"
        )


class LengthCost:
    """A ``cost_fn`` for variable-length requests: rows × length along ``dim``.

    With ``BatchedPolicyServer(..., cost_fn=LengthCost("tokens"), max_batch_cost=4096)``
    no batch holds more than 4096 real tokens (a padded batch holds at most
    ``rows × its longest request``).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_batchserve import LengthCost
        >>> LengthCost("tokens")(TensorDict(tokens=torch.zeros(3, 7, 2), batch_size=[3]))
        21
    """

    def __init__(self, key: NestedKey, *, dim: int = 0) -> None:
        self.key = as_key(key, "LengthCost key")
        self.dim = check_int("dim", dim, 0, ", counted after the request's batch dims")

    def __call__(self, td: TensorDictBase) -> int:
        value = td.get(self.key, None)
        dim = td.batch_dims + self.dim
        if not isinstance(value, torch.Tensor) or value.ndim <= dim:
            got = "nothing" if value is None else f"shape {tuple(getattr(value, 'shape', ()))}"
            raise BadRequestError(
                f"{self!r}: key {self.key!r}: expected a dim {self.dim} after the batch dims, got {got}"
            )
        return td.batch_size.numel() * value.shape[dim]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key!r}, dim={self.dim})"
