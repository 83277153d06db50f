"""Shared-memory slots: one anonymous memory file per slot, tensors as views.

A slot holds, for each key, a ``(capacity, *feature_shape)`` tensor. Its
memory is an anonymous file (``memfd_create``): it has no name in
``/dev/shm``, crosses to the other process as a file descriptor over the
client's Unix socket, and is freed by the kernel once both processes have
unmapped it or died. Nothing can leak, whatever kills whom.

"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["Slot", "SlotField"]

_ALIGN = 64


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
        for f, v in zip(self.fields, values):
            if not isinstance(v, torch.Tensor) or v.layout is not torch.strided or v.is_nested:
                return False  # (a nested tensor has no shape to compare)
            if v.dtype is not f.dtype or v.shape != (*batch_shape, *f.feature):
                return False
        return True

    def views(self, rows: int, batch_shape: Sequence[int]) -> list[torch.Tensor]:
        """Each field's first ``rows`` rows shaped ``(*batch_shape, *feature)``: views of the shared memory."""
        return [t[:rows].view((*batch_shape, *t.shape[1:])) for t in self.tensors.values()]

    def write(self, values: Sequence[torch.Tensor], rows: int, batch_shape: Sequence[int]) -> None:
        """Copy ``values`` (that :meth:`fits` accepted) into the first ``rows`` rows."""
        for view, value in zip(self.views(rows, batch_shape), values):
            view.copy_(value)

    def read(self, rows: int, batch_shape: Sequence[int]) -> list[torch.Tensor]:
        """Copies of the first ``rows`` rows, shaped ``(*batch_shape, *feature)``."""
        return [v.clone() for v in self.views(rows, batch_shape)]

    def specs(self) -> list[tuple[Any, torch.dtype, tuple[int, ...]]]:
        return [(f.key, f.dtype, f.feature) for f in self.fields]
