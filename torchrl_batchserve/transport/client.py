"""The worker-process side: a RemotePolicy's endpoint in another process.

Connects to the server's :class:`~torchrl_batchserve.transport.hub.ProcessHub`
on first use (so a policy can be pickled, unpickled and never called), then
serves any number of concurrent callers of that process. Waiting is a
blocking read of the socket: a reply, a ``closed`` notice, or end-of-file
when the server's process is gone; nothing waits forever. Each request has a
sequence number, and a reply to an earlier, interrupted call is dropped.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tensordict import TensorDictBase
from tensordict.nn.probabilistic import interaction_type

from torchrl_batchserve.errors import BadRequestError, ServerBrokenError, ServerClosedError
from torchrl_batchserve.layout import entry
from torchrl_batchserve.request import write_outputs
from torchrl_batchserve.transport.hub import HANDSHAKE_TIMEOUT
from torchrl_batchserve.transport.slots import Slot
from torchrl_batchserve.transport.wire import Wire

__all__ = ["ProcessClient"]

_CLIENTS: weakref.WeakSet[ProcessClient] = weakref.WeakSet()


def _forget_in_child() -> None:
    for client in list(_CLIENTS):
        client._forget()


os.register_at_fork(after_in_child=_forget_in_child)


class ProcessClient:
    """One worker's connection to a server in another process.

    Args:
        address: the hub's Unix socket path.
        authkey: the hub's key.
        in_keys: the entries to send (the policy's in_keys, minus those the
            server's collate provides).

    Any number of threads and asyncio tasks of the worker may call it at
    once; their requests are in flight together and batch with everyone
    else's. One request at a time holds the client's two shared-memory slots
    (the common case: one caller); the others travel pickled. Whichever
    waiting thread finds nobody reading the socket reads it for all, and hands
    each reply to the caller whose ``seq`` it carries; a reply nobody waits
    for (an interrupted call) is dropped.
    """

    def __init__(self, address: str, authkey: bytes, in_keys: list[Any]) -> None:
        self.address = address
        self.authkey = authkey
        self.in_keys = list(in_keys)
        self._reset()
        _CLIENTS.add(self)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._conn: Wire | None = None
        self._inputs: Slot | None = None
        self._outputs: Slot | None = None
        self._closed = False
        self._failure: BaseException | None = None  # what every waiter gets once the server is gone
        self._seq = 0
        self._waiting: dict[int, tuple[int, tuple[int, ...]]] = {}  # seq -> (rows, batch shape)
        self._replies: dict[int, tuple[Any, Any, Any]] = {}  # seq -> (error, keys, values)
        self._slot_seq: int | None = None  # the request whose inputs and outputs are in the slots
        self._reading = False
        self._executor: ThreadPoolExecutor | None = None

    def process_address(self) -> tuple[str, bytes, list]:
        """Where another copy connects (a copy of a copy is a client of the same server)."""
        return self.address, self.authkey, self.in_keys

    def __reduce__(self) -> tuple:
        return ProcessClient, self.process_address()

    def _connection(self) -> Wire:
        if self._closed:
            raise ServerClosedError("the server is closed and accepts no more requests")
        if self._conn is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(HANDSHAKE_TIMEOUT)
                sock.connect(self.address)
                sock.sendall(self.authkey)
                if sock.recv(1) != b"\x01":
                    raise OSError("the hub refused the connection")
            except OSError as err:
                sock.close()
                self._closed = True
                raise ServerClosedError(f"the server at {self.address} is closed or gone ({err})") from err
            self._conn = Wire(sock)
        return self._conn

    def call(self, td: TensorDictBase) -> TensorDictBase:
        """Serve ``td`` and block until its outputs are written into it."""
        if not isinstance(td, TensorDictBase):
            raise BadRequestError(f"a request must be a TensorDictBase, got {type(td).__name__}")
        batch_shape = tuple(td.batch_size)
        rows = td.batch_size.numel()
        inputs = [entry(td, key) for key in self.in_keys]
        mode = interaction_type()
        with self._cond:
            conn = self._connection()
            self._seq += 1
            seq = self._seq
            slot = self._inputs
            into_slot = 0  # the capacity of the slot its inputs are in (0: pickled)
            if self._slot_seq is None and slot is not None and slot.fits(inputs, rows, batch_shape):
                slot.write(inputs, rows, batch_shape)
                self._slot_seq, payload, into_slot = seq, None, slot.capacity
            else:
                present = [k for k, v in zip(self.in_keys, inputs) if v is not None]
                payload = pickle.dumps(td.select(*present, strict=False), protocol=pickle.HIGHEST_PROTOCOL)
            self._waiting[seq] = (rows, batch_shape)
            try:
                conn.send(("req", seq, rows, batch_shape, None if mode is None else mode.value, payload, into_slot))
            except OSError as err:
                self._closed = True
                self._waiting.pop(seq)
                raise ServerClosedError(f"the server is closed or gone ({err})") from err
        try:
            error, keys, values = self._wait(conn, seq)
        finally:
            with self._cond:
                self._waiting.pop(seq, None)
        if error is not None:
            raise error
        write_outputs(td, keys, values)
        return td

    def _wait(self, conn: Wire, seq: int) -> tuple[Any, Any, Any]:
        """The reply to ``seq``: from whoever reads the socket, or read here if nobody does."""
        with self._cond:
            while True:
                if seq in self._replies:
                    return self._replies.pop(seq)
                if self._failure is not None:
                    raise self._failure
                if not self._reading:
                    self._reading = True
                    break
                self._cond.wait()
        try:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError) as err:
                    failure = ServerBrokenError("the server's process ended while this request was in flight")
                    failure.__cause__ = err
                    with self._cond:
                        self._closed, self._failure = True, failure
                    raise failure from err
                with self._cond:
                    self._dispatch(conn, message)
                    if seq in self._replies:
                        return self._replies.pop(seq)
                    if self._failure is not None:
                        raise self._failure
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()

    def _dispatch(self, conn: Wire, message: Any) -> None:
        """Take in one message from the hub (the reader holds the lock)."""
        kind = message[0]
        if kind == "slot":
            _, which, fields, capacity, size = message
            slot = Slot.attach(fields, capacity, size, conn.take_fd())
            if which == "in":
                self._inputs = slot
            else:
                self._outputs = slot
            return
        if kind == "closed":
            self._closed = True
            self._failure = ServerClosedError("the server was closed before this request ran")
            return
        _, seq, error, values, keys = message
        shape = self._waiting.get(seq)
        if error is None and values is None and shape is not None:  # the outputs are in the slot
            out = self._outputs
            assert out is not None
            keys, values = out.keys, out.read(*shape)
        if seq == self._slot_seq:
            self._slot_seq = None  # read out (or nobody waits): the slots are free again
        if shape is not None:
            self._replies[seq] = (error, keys, values)
            self._cond.notify_all()

    def _pool(self) -> ThreadPoolExecutor:
        with self._cond:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=256, thread_name_prefix="batchserve-client")
            return self._executor

    def submit(self, td: TensorDictBase) -> Future[TensorDictBase]:
        """Serve ``td`` from a thread of this client's pool; the Future resolves to it."""
        return self._pool().submit(self.call, td)

    async def acall(self, td: TensorDictBase) -> TensorDictBase:
        """``await``-able :meth:`call`: waits in the client's pool, never in the event loop."""
        return await asyncio.wrap_future(self.submit(td))

    def close(self) -> None:
        with self._cond:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._inputs = self._outputs = None

    def _forget(self) -> None:
        """In a forked child: drop the parent's connection (its descriptor closed), connect anew on use."""
        conn = self._conn
        self._reset()  # the parent's lock may have been held by another thread at the fork
        if conn is not None:
            conn.sock.close()
