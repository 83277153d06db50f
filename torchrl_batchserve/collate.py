"""Collate transforms: how requests become one batch, and the output goes back.

A collate is any object with two methods (:class:`Collate`)::

    collate(requests, keys) -> TensorDictBase     # the batch the policy sees
    split(output, requests, keys) -> columns      # columns[k][i]: key k of request i

``split`` gets the policy's output, or, when the results go to another device
than the forward's, only the keys it is asked for. A collate may also declare
``provided_keys`` (policy in_keys the collate writes itself,
which requests then need not carry), ``variable_dims`` (feature dims that
may differ between requests) and ``cut_keys`` (policy out_keys it cuts back
to each request's own length). :class:`StackCollate` is the default and the fast
path; :class:`FunctionCollate` adapts a TorchRL-style
``collate_fn(list[TensorDict]) -> TensorDict``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase

from torchrl_batchserve.errors import PolicyError
from torchrl_batchserve.layout import holds_tensors, shaped_rows
from torchrl_batchserve.request import Request

__all__ = ["Collate", "FunctionCollate", "StackCollate", "all_single", "as_collate", "split_rows"]


@runtime_checkable
class Collate(Protocol):
    """The collate protocol (see the module docstring)."""

    def collate(self, requests: Sequence[Request], keys: Sequence[Any]) -> TensorDictBase: ...

    def split(
        self, output: TensorDictBase, requests: Sequence[Request], keys: Sequence[Any]
    ) -> Sequence[Sequence[Any]]: ...


def all_single(requests: Sequence[Request]) -> bool:
    """Whether every request is a single row (batch size ``[]``)."""
    for request in requests:
        if request.batch_shape:
            return False
    return True


def split_rows(output: TensorDictBase, requests: Sequence[Request], keys: Sequence[Any]) -> list[Sequence[Any]]:
    """Cut each ``output[key]`` into the rows of each request, shaped like its batch.

    One ``unbind`` per key when every request is a single row; views, no copies.
    """
    total = 0
    for request in requests:
        total += request.rows
    single = all_single(requests)
    columns: list[Sequence[Any]] = []
    for key in keys:
        value = output.get(key)  # there: the serve loop checked the out_keys
        if not holds_tensors(value):
            columns.append(_split_non_tensor(value, requests, total))
            continue
        if not value.shape or value.shape[0] != total:
            raise PolicyError(
                f"the policy output {key!r} has shape {tuple(value.shape)}; "
                f"its leading dim must be the batch's {total} rows"
            )
        if single:
            columns.append(value.unbind(0))
            continue
        column = []
        for request, chunk in zip(requests, value.split([r.rows for r in requests])):
            shape = request.batch_shape
            if not shape:
                column.append(chunk[0])
            elif len(shape) == 1:
                column.append(chunk)
            else:
                column.append(chunk.reshape(*shape, *chunk.shape[1:]))
        columns.append(column)
    return columns


def _split_non_tensor(value: Any, requests: Sequence[Request], total: int) -> list[Any]:
    items = value.tolist() if hasattr(value, "tolist") else list(value)
    if len(items) != total:
        raise PolicyError(f"a non-tensor output holds {len(items)} items for {total} rows")
    column, start = [], 0
    for request in requests:
        chunk = items[start : start + request.rows]
        start += request.rows
        column.append(shaped_rows(chunk, request.batch_shape) if request.batch_shape else chunk[0])
    return column


class StackCollate:
    """Stack single-row requests (concatenate multi-row ones) key by key.

    Each key costs one ``torch.stack`` or ``torch.cat`` over the request
    tensors that validation already extracted; no TensorDict is built per
    request. With ``pin_memory=True`` the batch is written into page-locked
    host memory so the copy to a CUDA device can be asynchronous (PyTorch's
    caching host allocator keeps a block until its copy has completed).

    Keyword Args:
        pin_memory: stage batches in pinned memory (the server sets it when it
            serves a CUDA policy from CPU requests). It needs a CUDA (or other
            accelerator) device: without one, ``ValueError``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_batchserve import BatchedPolicyServer, StackCollate
        >>> from tensordict.nn import TensorDictModule
        >>> policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["obs"], out_keys=["act"])
        >>> with BatchedPolicyServer(policy, collate=StackCollate()) as server:
        ...     server.remote_policy()(TensorDict(obs=torch.ones(3)))["act"].shape
        torch.Size([2])
    """

    provided_keys: frozenset = frozenset()
    variable_dims: dict = {}

    def __init__(self, *, pin_memory: bool = False) -> None:
        if not isinstance(pin_memory, bool):
            raise ValueError(f"pin_memory must be a bool (got {pin_memory!r})")
        if pin_memory and not torch.accelerator.is_available():  # else every batch would fail
            raise ValueError("pin_memory=True: this torch build or machine has no CUDA (or other accelerator) device")
        self.pin_memory = pin_memory

    def collate(self, requests: Sequence[Request], keys: Sequence[Any]) -> TensorDictBase:
        total = 0
        for request in requests:
            total += request.rows
        batch = TensorDict(batch_size=[total])
        for key, value in zip(keys, self.stack(requests, total)):
            batch.set(key, value)
        return batch

    def stack(self, requests: Sequence[Request], total: int) -> list[Any]:
        """The batched value of each key, in the order of the requests' inputs."""
        single = all_single(requests)
        pin = self.pin_memory
        return [
            stack_column([r.inputs[j] for r in requests], requests, total, single, pin)
            for j in range(len(requests[0].inputs))
        ]

    def split(self, output: TensorDictBase, requests: Sequence[Request], keys: Sequence[Any]) -> list[Sequence[Any]]:
        return split_rows(output, requests, keys)


def stack_column(
    items: list[Any], requests: Sequence[Request], total: int, single: bool | None = None, pin_memory: bool = False
) -> Any:
    """Batch one key: ``items[i]`` is request ``i``'s value (a row, or ``(rows, ...)``).

    Tensors and nested TensorDicts are stacked (single rows) or concatenated;
    non-tensor data becomes a ``NonTensorStack`` of one item per row.
    """
    if single is None:
        single = all_single(requests)
    first = items[0]
    if not isinstance(first, torch.Tensor):
        if not holds_tensors(first):
            return _stack_non_tensor(items, requests)
        return torch.stack(items) if single else torch.cat(_as_rows(items, requests))
    if not single:
        items = _as_rows(items, requests)
    if pin_memory and first.device.type == "cpu":
        feature = first.shape if single else items[0].shape[1:]
        out = torch.empty((total, *feature), dtype=first.dtype, pin_memory=True)
        return torch.stack(items, out=out) if single else torch.cat(items, out=out)
    return torch.stack(items) if single else torch.cat(items)


def _as_rows(items: list[Any], requests: Sequence[Request]) -> list[Any]:
    return [t if r.batch_shape else t.unsqueeze(0) for t, r in zip(items, requests)]


def _stack_non_tensor(items: list[Any], requests: Sequence[Request]) -> Any:
    flat: list[Any] = []
    for item, request in zip(items, requests):
        if request.batch_shape:
            flat.extend(item.tolist() if hasattr(item, "tolist") else item)
        else:
            flat.append(item)
    return NonTensorStack(*flat)


class FunctionCollate:
    """Adapt a TorchRL-style ``collate_fn(list[TensorDict]) -> TensorDict``.

    The function receives one TensorDict per row, in arrival order (a
    request of several rows gives its rows, as ``td.reshape(-1).unbind(0)``),
    holding the entries the policy reads (new TensorDicts: what the policy
    writes into the batch, e.g. into a ``lazy_stack`` of them, never reaches
    the callers' own), and must return a batch whose leading dim is their
    number; outputs are split back by rows, as with :class:`StackCollate`.

    Args:
        fn: the collate function, e.g. :func:`tensordict.lazy_stack`.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl_batchserve import BatchedPolicyServer
        >>> policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["obs"], out_keys=["act"])
        >>> with BatchedPolicyServer(policy, collate=lazy_stack) as server:  # wrapped for you
        ...     server.remote_policy()(TensorDict(obs=torch.ones(3)))["act"].shape
        torch.Size([2])
    """

    provided_keys: frozenset = frozenset()
    variable_dims: dict = {}

    def __init__(self, fn: Callable[[list[TensorDictBase]], TensorDictBase]) -> None:
        if not callable(fn):  # else every batch would fail on it
            raise TypeError(f"fn must be callable as fn(list of TensorDicts) -> TensorDict, got {type(fn).__name__}")
        self.fn = fn

    def collate(self, requests: Sequence[Request], keys: Sequence[Any]) -> TensorDictBase:
        rows: list[TensorDictBase] = []
        for request in requests:
            td = request.td.select(*keys)
            rows.extend(td.reshape(-1).unbind(0) if request.batch_shape else [td])
        batch = self.fn(rows)
        if not isinstance(batch, TensorDictBase):
            raise PolicyError(
                f"{self!r} returned {type(batch).__name__}; expected a TensorDict of the {len(rows)} rows"
            )
        return batch

    def split(self, output: TensorDictBase, requests: Sequence[Request], keys: Sequence[Any]) -> list[Sequence[Any]]:
        return split_rows(output, requests, keys)

    def __repr__(self) -> str:
        return f"FunctionCollate({getattr(self.fn, '__name__', self.fn)!r})"


def as_collate(collate: Any) -> Any:
    """Return ``collate`` as a collate object (``None`` gives :class:`StackCollate`)."""
    if collate is None:
        return StackCollate()
    if isinstance(collate, type):  # a class has the protocol's methods too, unbound
        raise TypeError(
            f"collate must be a collate object or a collate_fn, got the class {collate.__name__}: "
            f"pass an instance, e.g. {collate.__name__}(...)"
        )
    if isinstance(collate, Collate):
        return collate
    if callable(collate):
        return FunctionCollate(collate)
    raise TypeError(
        f"collate must be a Collate (collate/split methods) or a callable collate_fn, got {type(collate).__name__}"
    )
