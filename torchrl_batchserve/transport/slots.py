"""Shared memory between a worker and the hub: slots of tensors, and request headers.

A slot holds, for each key, a ``(capacity, *feature_shape)`` tensor. Its
memory is an anonymous file (``memfd_create``): it has no name in
``/dev/shm``, crosses to the other process as a file descriptor over the
client's Unix socket, and is freed by the kernel once both processes have
unmapped it or died. Nothing can leak, whatever kills whom.

:class:`Headers` holds, for each of a client's lanes (a pair of input and
output slots, one request in flight on it), the request's sequence number,
rows, batch shape and interaction type: what the socket message of a request
would have said.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from tensordict.nn import InteractionType

__all__ = ["MAX_BATCH_DIMS", "MAX_LANES", "Headers", "Lane", "Slot", "SlotField", "on_host", "storable"]

_ALIGN = 64
MAX_LANES = 63
"""Lanes per client: each is one bit of a 64-bit eventfd counter (the kernel caps it below 2**64 - 1)."""
MAX_BATCH_DIMS = 4
"""Batch dims a header holds; a request with more travels pickled."""
_WORDS = 4 + MAX_BATCH_DIMS  # seq, rows, batch dims, interaction, the batch shape
_MODES = (None, *InteractionType)  # a header's interaction word indexes this


def _memfd(name: str, size: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map(fd: int, size: int) -> torch.Tensor:
    """The shared memory file ``fd`` as a ``uint8`` tensor of ``size`` bytes, holding no descriptor.

    Mapped by torch: Python's ``mmap`` keeps a duplicate of the descriptor
    open as long as it lives, two per lane on each side, which ran a server
    of many busy workers out of descriptors (``ulimit -n``, often 1024).
    A normal tensor, whatever the calling thread has on: one made in a
    caller's inference mode could not be written (in place) by the client's
    other callers, nor read into their normal results.
    """
    with torch.inference_mode(False):
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)


def storable(value: Any) -> bool:
    """Whether ``value`` can be written into a slot: a dense tensor (a nested one has no shape to compare).

    A device tensor is copied to the slot's host memory: it comes out on the
    CPU.
    """
    return isinstance(value, torch.Tensor) and value.layout is torch.strided and not value.is_nested


def on_host(value: Any) -> bool:
    """Whether ``value`` is not a device tensor: a worker's device inputs travel pickled, keeping their device."""
    return not isinstance(value, torch.Tensor) or value.device.type == "cpu"


class SlotField(NamedTuple):
    key: Any
    dtype: torch.dtype
    feature: tuple[int, ...]
    offset: int


def _row_bytes(dtype: torch.dtype, feature: tuple[int, ...]) -> int:
    return math.prod(feature) * dtype.itemsize


class Slot:
    """Per-key tensors of ``capacity`` rows in one shared memory file.

    Create with :meth:`create` (the owner) or :meth:`attach` (the peer, from
    the descriptor the owner sent and the same ``fields``/``capacity``).
    """

    def __init__(self, fields: Sequence[SlotField], capacity: int, size: int, fd: int) -> None:
        self.fields = tuple(fields)
        self.capacity = capacity
        self.size = size
        self.tensors: dict[Any, torch.Tensor] = {}
        raw = _map(fd, size)
        with torch.inference_mode(False):
            for f in self.fields:
                nbytes = capacity * _row_bytes(f.dtype, f.feature)
                self.tensors[f.key] = raw[f.offset : f.offset + nbytes].view(f.dtype).view(capacity, *f.feature)
        self.keys = [f.key for f in self.fields]
        self._views: dict[tuple, list[torch.Tensor]] = {}

    @classmethod
    def create(cls, specs: Sequence[tuple[Any, torch.dtype, tuple[int, ...]]], capacity: int) -> tuple[Slot, int]:
        """A new slot for ``(key, dtype, feature shape)`` specs; returns it and its descriptor."""
        fields, offset = [], 0
        for key, dtype, feature in specs:
            fields.append(SlotField(key, dtype, tuple(feature), offset))
            offset += capacity * _row_bytes(dtype, tuple(feature))
            offset = (offset + _ALIGN - 1) // _ALIGN * _ALIGN
        size = max(offset, _ALIGN)
        fd = _memfd("torchrl_batchserve-slot", size)
        try:
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
            if not storable(v):
                return False
            if v.dtype is not f.dtype or v.shape != (*batch_shape, *f.feature):
                return False
        return True

    def views(self, rows: int, batch_shape: Sequence[int]) -> list[torch.Tensor]:
        """Each field's first ``rows`` rows shaped ``(*batch_shape, *feature)``: views of the shared memory.

        The same view objects come back for the same shape (a request, then
        the next on the same lane): read or write them, never resize them.
        """
        shape = (rows, *batch_shape)
        views = self._views.get(shape)
        if views is None:
            if len(self._views) >= 16:  # a worker of many batch shapes: keep the memory bounded
                self._views.clear()
            views = self._views[shape] = [t[:rows].view((*batch_shape, *t.shape[1:])) for t in self.tensors.values()]
        return views

    def write(self, values: Sequence[torch.Tensor], rows: int, batch_shape: Sequence[int]) -> None:
        """Copy ``values`` (that :meth:`fits` accepted) into the first ``rows`` rows.

        Values only: a caller's tensor that requires grad leaves no autograd
        history on the slot (it would hold the caller's graph, and grow with
        every later write).
        """
        with torch.no_grad():
            for view, value in zip(self.views(rows, batch_shape), values):
                view.copy_(value)

    def read(self, rows: int, batch_shape: Sequence[int]) -> list[torch.Tensor]:
        """Copies of the first ``rows`` rows, shaped ``(*batch_shape, *feature)``.

        Normal tensors, never inference ones: the reader may be any caller of
        the client, in its ``torch.inference_mode``, reading for the others too.
        """
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return self.read(rows, batch_shape)
        return [v.clone() for v in self.views(rows, batch_shape)]

    def specs(self) -> list[tuple[Any, torch.dtype, tuple[int, ...]]]:
        return [(f.key, f.dtype, f.feature) for f in self.fields]


class Lane:
    """One request slot of a client, on either side: its input slot, its output slot once known, its request."""

    __slots__ = ("index", "inputs", "outputs", "seq")

    def __init__(self, index: int, inputs: Slot) -> None:
        self.index = index
        self.inputs = inputs
        self.outputs: Slot | None = None
        # The client's: the request on it, until its reply is read. The hub's: the last request taken from it.
        self.seq: int | None = None


class Headers:
    """The request header of each of a client's lanes, as int64 words in one shared memory file.

    The client writes a lane's header before it rings the hub for that lane;
    the hub reads it after the ring (the eventfd's read and write order them).
    """

    SIZE = MAX_LANES * _WORDS * 8

    def __init__(self, fd: int) -> None:
        self._words = _map(fd, self.SIZE).numpy().data.cast("q")

    @classmethod
    def create(cls) -> tuple[Headers, int]:
        fd = _memfd("torchrl_batchserve-headers", cls.SIZE)
        try:
            return cls(fd), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> Headers:
        try:
            return cls(fd)
        finally:
            os.close(fd)

    def write(self, lane: int, seq: int, rows: int, batch_shape: Sequence[int], interaction: Any) -> None:
        """``batch_shape`` has at most :data:`MAX_BATCH_DIMS` dims; ``interaction`` an InteractionType or None."""
        base = lane * _WORDS
        for i, word in enumerate((seq, rows, len(batch_shape), _MODES.index(interaction), *batch_shape)):
            self._words[base + i] = word

    def seq(self, lane: int) -> int:
        return self._words[lane * _WORDS]

    def read(self, lane: int) -> tuple[int, int, tuple[int, ...], Any]:
        """``(seq, rows, batch_shape, interaction)``; ``ValueError`` if the words are not a header."""
        base = lane * _WORDS
        seq, rows, dims, mode = self._words[base : base + 4].tolist()
        if not (0 <= dims <= MAX_BATCH_DIMS and 0 <= mode < len(_MODES) and rows >= 0):
            raise ValueError(f"lane {lane}: not a request header ({dims} dims, mode {mode}, {rows} rows)")
        return seq, rows, tuple(self._words[base + 4 : base + 4 + dims].tolist()), _MODES[mode]
