"""Whole messages over a Unix stream socket, with descriptors when some come along.

A message is a frame: a 4-byte big-endian length, then the pickled payload.
Descriptors (a slot's memory file, a client's eventfds) travel in the same
``sendmsg`` as the frame that announces them, so a frame and its descriptors
are never read apart (the kernel ends a read at a message that carries
descriptors).
One read takes whatever frames have arrived; a partial frame is kept for the
next read. Every payload of the package's transports is pickled by
:func:`dumps`, which carries CPU tensors as raw bytes: faster than torch's
own pickling, and for every dtype.

:meth:`Wire.recv` waits in ``poll`` for the socket to become readable
before it reads: a thread asleep in a blocking ``recv`` on a Unix stream
socket is also woken when the peer *reads* what this end sent, and would
sleep again; ``poll`` filters by event.
"""

from __future__ import annotations

import array
import errno
import io
import os
import pickle
import select
import socket
import struct
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Wire", "dumps", "frame"]

_HEADER = struct.Struct("!i")
MAX_FDS = 3
_FDS = socket.CMSG_SPACE(MAX_FDS * array.array("i", [0]).itemsize)
_CHUNK = 1 << 16


class _Pickler(pickle.Pickler):
    """Carries a plain CPU tensor as its raw bytes, its dtype and its shape.

    torch's own tensor pickling writes and reads each storage through
    ``torch.save``, slower (``docs/performance.md``), and
    cannot restore some dtypes at all (``uint16``, ``uint32``, ``uint64``,
    ``float8``). Any other tensor (on a device, requiring grad, a subclass,
    sparse, quantized, nested) pickles as torch pickles it.
    """

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is torch.Tensor
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
            and not (obj.requires_grad or obj.is_quantized or obj.is_nested)
        ):
            flat = obj.resolve_conj().resolve_neg().contiguous().view(-1)
            data = pickle.PickleBuffer(flat.view(torch.uint8).numpy().data) if flat.numel() else b""
            return _from_bytes, (data, obj.dtype, tuple(obj.shape))
        return NotImplemented


def _from_bytes(data: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if torch.is_inference_mode_enabled():  # a normal tensor: the reading thread may be reading for others too
        with torch.inference_mode(False):
            return _from_bytes(data, dtype, shape)
    if not len(data):
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)  # the unpickled bytearray's memory


def dumps(obj: Any) -> bytes:
    """``pickle.dumps(obj)``, with plain CPU tensors carried as raw bytes (``pickle.loads`` restores them)."""
    buffer = io.BytesIO()
    _Pickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def frame(message: Any) -> bytes:
    """``message`` pickled and framed, ready for :meth:`Wire.send_frame`."""
    payload = dumps(message)
    return _HEADER.pack(len(payload)) + payload


def _rights(fds: Sequence[int]) -> list[tuple[int, int, array.array]]:
    """The ancillary data that passes ``fds`` (at most :data:`MAX_FDS`) with a message's first byte."""
    assert len(fds) <= MAX_FDS
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]


class Wire:
    """One end of a connected Unix stream socket, read and written as whole messages.

    Args:
        sock: the connected socket; the wire owns it from now on.
        receives_fds: whether descriptors may come this way (a client's end).

    Not thread-safe: one thread reads, with either :meth:`read` (all that
    arrived: the hub's event loop) or :meth:`recv` (one message at a time: a
    client), never both; writers take turns under a lock of their own.
    """

    def __init__(self, sock: socket.socket, receives_fds: bool = True) -> None:
        sock.setblocking(True)
        self.sock = sock
        self.receives_fds = receives_fds
        self._buffer = bytearray()
        self._fds: deque[int] = deque()
        self._inbox: deque[Any] = deque()
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_frame(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """Send a framed message; ``fds`` (at most :data:`MAX_FDS`) go with its first byte (``SCM_RIGHTS``)."""
        if not fds:
            self.sock.sendall(data)
            return
        sent = self.sock.sendmsg([data], _rights(fds))
        if sent < len(data):
            self.sock.sendall(data[sent:])

    def send(self, message: Any, fds: Sequence[int] = ()) -> None:
        self.send_frame(frame(message), fds)

    def send_some(self, data: bytes | memoryview, fds: Sequence[int] = ()) -> int:
        """Send what the socket takes now, without waiting; how many bytes (``fds`` go with the first)."""
        try:
            if not fds:
                return self.sock.send(data, socket.MSG_DONTWAIT)
            return self.sock.sendmsg([data], _rights(fds), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0

    def read(self) -> list[Any]:
        """Read once (blocks only if nothing has arrived); return the messages completed.

        Raises ``EOFError`` when the peer closed its end or died, and
        ``OSError`` (``EMFILE``) when descriptors sent were dropped: this
        process is at its open-file limit. A frame that does not unpickle
        raises its error; the frames after it stay.
        """
        if self.receives_fds:
            data, ancdata, flags, _ = self.sock.recvmsg(_CHUNK, _FDS)
            for level, kind, fds in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    self._fds.extend(array.array("i", fds[: len(fds) - len(fds) % 4]))
            if flags & socket.MSG_CTRUNC:  # the kernel could not give this process the descriptors sent
                raise OSError(
                    errno.EMFILE,
                    "descriptors the server sent were dropped: this process is at its open-file limit (ulimit -n)",
                )
        else:
            data = self.sock.recv(_CHUNK)
        if not data:
            raise EOFError("the peer closed the connection")
        buffer = self._buffer
        buffer += data
        frames = []
        while len(buffer) >= 4:
            (size,) = _HEADER.unpack_from(buffer)
            if len(buffer) < size + 4:
                break
            frames.append(bytes(buffer[4 : size + 4]))
            del buffer[: size + 4]
        return [pickle.loads(f) for f in frames]

    def recv(self) -> Any:
        """The next message, blocking until it has arrived (``EOFError``: the peer is gone)."""
        inbox = self._inbox
        while not inbox:
            self._readable.poll()  # returns on data, end-of-file or error (see the module docstring)
            inbox.extend(self.read())
        return inbox.popleft()

    def take_fd(self) -> int:
        """The next descriptor received (they come with the messages that announce them, in order)."""
        if not self._fds:
            raise EOFError("a message announced a descriptor that did not come")
        return self._fds.popleft()

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self.sock.close()
