"""Shared-memory slots: one anonymous memory file per slot, tensors as views.

A slot holds, for each key, a ``(capacity, *feature_shape)`` tensor. Its
memory is an anonymous file (``memfd_create``): it has no name in
``/dev/shm``, crosses to the other process as a file descriptor over the
client's Unix socket, and is freed by the kernel once both processes have
unmapped it or died. Nothing can leak, whatever kills whom.

Writing a request's inputs (a worker) or a reply's outputs (the hub) into a
slot is a ``memmove`` of the value's bytes when it is a plain, contiguous
CPU tensor without a lazy negation or conjugation, and a ``copy_``
otherwise.
Both sides run on busy CPUs whose caches the other processes keep emptying;
a ``memmove`` touches far less code than torch's copy (its dispatch and
iterator setup), and the shape and dtype are the slot's by then.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["Slot", "SlotField"]

_ALIGN = 64
_STRIDED = torch.strided


class SlotField(NamedTuple):
    key: Any
    dtype: torch.dtype
    feature: tuple[int, ...]
    offset: int


def _row_bytes(dtype: torch.dtype, feature: tuple[int, ...]) -> int:
    n = 1
    for d in feature:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


class Slot:
    """Per-key tensors of ``capacity`` rows in one shared memory file.

    Create with :meth:`create` (the owner) or :meth:`attach` (the peer, from
    the descriptor the owner sent and the same ``fields``/``capacity``).
    """

    def __init__(self, fields: Sequence[SlotField], capacity: int, size: int, fd: int) -> None:
        self.fields = tuple(fields)
        self.capacity = capacity
        self.size = size
        self._mmap = mmap.mmap(fd, size)
        raw = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.tensors: dict[Any, torch.Tensor] = {}
        for f in self.fields:
            nbytes = capacity * _row_bytes(f.dtype, f.feature)
            self.tensors[f.key] = raw[f.offset : f.offset + nbytes].view(f.dtype).view(capacity, *f.feature)
        self.keys = [f.key for f in self.fields]
        self._rows = [(self.tensors[f.key].data_ptr(), _row_bytes(f.dtype, f.feature)) for f in self.fields]
        self._shape: tuple[int, tuple[int, ...]] | None = None  # the batch shape of the views kept
        self._views: list[torch.Tensor] = []
        self._batch: tuple[int, ...] | None = None  # the batch shape of the shapes kept
        self._expected: list[torch.Size] = []

    @classmethod
    def create(cls, specs: Sequence[tuple[Any, torch.dtype, tuple[int, ...]]], capacity: int) -> tuple[Slot, int]:
        """A new slot for ``(key, dtype, feature shape)`` specs; returns it and its descriptor."""
        fields, offset = [], 0
        for key, dtype, feature in specs:
            fields.append(SlotField(key, dtype, tuple(feature), offset))
            offset += capacity * _row_bytes(dtype, tuple(feature))
            offset = (offset + _ALIGN - 1) // _ALIGN * _ALIGN
        size = max(offset, _ALIGN)
        fd = os.memfd_create("torchrl_batchserve-slot", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fields, capacity, size, fd), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fields: Sequence[SlotField], capacity: int, size: int, fd: int) -> Slot:
        """Map the slot the owner created; closes ``fd`` (the mapping keeps the memory)."""
        try:
            return cls(fields, capacity, size, fd)
        finally:
            os.close(fd)

    def describe(self) -> tuple[tuple[SlotField, ...], int, int]:
        """What the peer needs besides the descriptor: ``(fields, capacity, size)``."""
        return self.fields, self.capacity, self.size

    def fits(self, values: Sequence[Any], rows: int, batch_shape: Sequence[int]) -> bool:
        """Whether ``values`` (one per field, shaped ``(*batch_shape, *feature)``) fit these rows."""
        if rows > self.capacity or len(values) != len(self.fields):
            return False
        if batch_shape != self._batch:  # the full shapes to expect, kept for the last batch shape asked
            self._batch = tuple(batch_shape)
            self._expected = [torch.Size((*batch_shape, *f.feature)) for f in self.fields]
        for f, v, shape in zip(self.fields, values, self._expected):
            if not isinstance(v, torch.Tensor) or v.dtype is not f.dtype or v.shape != shape:
                return False
            if not v.is_cpu or v.layout is not _STRIDED:
                return False
        return True

    def fits_row(self, pairs: Sequence[tuple[torch.Tensor, int]]) -> bool:
        """Whether row ``i`` of each ``(batch, i)`` in ``pairs`` (plain contiguous CPU tensors) fits one row."""
        if len(pairs) != len(self.fields):
            return False
        for f, (batch, i) in zip(self.fields, pairs):
            if batch.dtype is not f.dtype or batch.shape[1:] != f.feature or not 0 <= i < batch.shape[0]:
                return False
        return True

    def write_row(self, pairs: Sequence[tuple[torch.Tensor, int]]) -> None:
        """Copy row ``i`` of each ``(batch, i)`` (that :meth:`fits_row` accepted) into the first row."""
        for (batch, i), (address, row_bytes) in zip(pairs, self._rows):
            ctypes.memmove(address, batch.data_ptr() + i * row_bytes, row_bytes)

    def views(self, rows: int, batch_shape: Sequence[int]) -> list[torch.Tensor]:
        """Each field's first ``rows`` rows shaped ``(*batch_shape, *feature)``.

        Views of the shared memory, kept for the last shape asked (a client
        asks for the same one call after call; indexing costs microseconds).
        """
        shape = (rows, tuple(batch_shape))
        if shape != self._shape:
            dims = len(batch_shape)
            if dims == 0:
                views = [t[0] for t in self.tensors.values()]
            elif dims == 1:
                views = [t[:rows] for t in self.tensors.values()]
            else:
                views = [t[:rows].view(*batch_shape, *t.shape[1:]) for t in self.tensors.values()]
            self._shape, self._views = shape, views
        return self._views

    def write(self, values: Sequence[torch.Tensor], rows: int, batch_shape: Sequence[int]) -> None:
        """Copy ``values`` (that :meth:`fits` accepted) into the first ``rows`` rows."""
        for view, value, (address, row_bytes) in zip(self.views(rows, batch_shape), values, self._rows):
            if (
                type(value) is torch.Tensor
                and value.is_cpu  # the hub's replies may come from a device: copy_ brings them over
                and value.is_contiguous()
                and not (value.is_neg() or value.is_conj())
                and value.nbytes == rows * row_bytes  # exactly the rows written (copy_ says why not)
            ):
                ctypes.memmove(address, value.data_ptr(), rows * row_bytes)  # its bytes as they are
            else:
                view.copy_(value)

    def read(self, rows: int, batch_shape: Sequence[int], clone: bool) -> list[torch.Tensor]:
        views = self.views(rows, batch_shape)
        return [v.clone() for v in views] if clone else list(views)

    def specs(self) -> list[tuple[Any, torch.dtype, tuple[int, ...]]]:
        return [(f.key, f.dtype, f.feature) for f in self.fields]
