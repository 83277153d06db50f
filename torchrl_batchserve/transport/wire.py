"""Whole messages over a Unix stream socket, with a descriptor when one comes along.

The hub and its clients authenticate with :mod:`multiprocessing.connection`
(its ``authkey`` challenge) and then talk through a :class:`Wire` on the same
socket. A message is a frame: a 4-byte big-endian length, then the pickled
payload (the framing ``Connection`` uses, so a peer could read it with
``recv_bytes``). What a ``Wire`` adds over ``Connection``:

* one read (``recvmsg`` on a client's end, which takes the descriptors sent
  with the frames; a plain ``recv`` on the hub's) takes whatever frames have
  arrived, where ``Connection.recv_bytes`` makes two ``read`` calls
  per message and :func:`multiprocessing.reduction.recv_handle` a third
  (on the hot path a request and its reply are one frame each way, so this
  halves the reads);
* a descriptor travels in the same ``sendmsg`` as the frame that announces
  it, so the frame and its descriptor can never be read apart;
* :meth:`Wire.recv` waits in ``poll`` for the socket to become readable
  before it reads. A thread asleep in a blocking ``recv`` on a Unix stream
  socket is also woken when the peer *reads* what this end sent (the
  kernel's write-space wake-up shares the socket's wait queue and does not
  look at the event): the hub reading a client's request woke the client
  once for nothing, and it slept again. ``poll`` filters by event: one
  sleep per reply instead of two (worker processes: 1.95 -> 1.00 voluntary
  context switches per request).
"""

from __future__ import annotations

import array
import os
import pickle
import select
import socket
import struct
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["Wire", "frame"]

_HEADER = struct.Struct("!i")
_FDS = socket.CMSG_SPACE(array.array("i", [0]).itemsize)
_CHUNK = 1 << 16


DONE = ("done", None, None, None)
"""The most common message: a reply whose outputs are in the client's slot
(:meth:`Wire.read` returns it without unpickling when a read brings exactly its frame)."""


def frame(message: Any) -> bytes:
    """``message`` pickled and framed, ready for :meth:`Wire.send_frame`."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


DONE_FRAME = frame(DONE)
""":data:`DONE`, framed once."""


class Wire:
    """One end of an authenticated connection, read and written as whole messages.

    Args:
        conn: a ``Connection`` that passed the ``authkey`` handshake; the wire
            takes its socket over (``conn`` is closed).
        receives_fds: whether descriptors may come this way (a client's
            end); without, reads are a plain ``recv``.

    Not thread-safe: one thread reads, with either :meth:`read` (all that
    arrived: the hub's event loop) or :meth:`recv` (one message at a time: a
    client), never both; writers take turns (the hub's clients hold a lock
    around :meth:`send_frame`).
    """

    def __init__(self, conn: Connection, receives_fds: bool = True) -> None:
        self.receives_fds = receives_fds
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno()))
        conn.close()
        self._buffer = bytearray()
        self._fds: deque[int] = deque()
        self._inbox: deque[Any] = deque()
        self._readable = select.poll()
        self._readable.register(self.sock, select.POLLIN)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_frame(self, data: bytes, fd: int | None = None) -> None:
        """Send a framed message; ``fd`` goes with its first byte (``SCM_RIGHTS``)."""
        if fd is None:
            self.sock.sendall(data)
            return
        sent = self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        if sent < len(data):
            self.sock.sendall(data[sent:])

    def send(self, message: Any, fd: int | None = None) -> None:
        self.send_frame(frame(message), fd)

    def read(self) -> list[Any]:
        """Read once (blocks only if nothing has arrived); return the messages completed.

        Raises ``EOFError`` when the peer closed its end or died.
        """
        if self.receives_fds:
            data, ancdata, _, _ = self.sock.recvmsg(_CHUNK, _FDS)
            for level, kind, fds in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    self._fds.extend(array.array("i", fds[: len(fds) - len(fds) % 4]))
        else:
            data = self.sock.recv(_CHUNK)
        if not data:
            raise EOFError("the peer closed the connection")
        buffer = self._buffer
        if data == DONE_FRAME and not buffer:  # the most common message: nothing to unpickle
            return [DONE]
        if not buffer and len(data) >= 4:  # the common case: exactly one whole frame
            (size,) = _HEADER.unpack_from(data)
            if len(data) == size + 4:
                return [pickle.loads(memoryview(data)[4:])]
        buffer += data
        messages = []
        while len(buffer) >= 4:
            (size,) = _HEADER.unpack_from(buffer)
            if len(buffer) < size + 4:
                break
            messages.append(pickle.loads(buffer[4 : size + 4]))
            del buffer[: size + 4]
        return messages

    def recv(self) -> Any:
        """The next message, blocking until it has arrived (``EOFError``: the peer is gone)."""
        inbox = self._inbox
        while not inbox:
            self._readable.poll()  # returns on data, end-of-file or error (see the module docstring)
            inbox.extend(self.read())
        return inbox.popleft()

    def take_fd(self) -> int:
        """The next descriptor received (one came with each message that announces one)."""
        if not self._fds:
            raise EOFError("a message announced a descriptor that did not come")
        return self._fds.popleft()

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self.sock.close()
