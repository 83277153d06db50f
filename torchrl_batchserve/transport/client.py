"""The worker-process side: a RemotePolicy's endpoint in another process.

Connects to the server's :class:`~torchrl_batchserve.transport.hub.ProcessHub`
on first use (so a policy can be pickled, unpickled and never called), then
serves one request at a time through its slots. Waiting is a blocking read
of the socket: a reply, a ``closed`` notice, or end-of-file when the
server's process is gone; nothing waits forever. Each request has a sequence
number, and a reply to an earlier, interrupted call is dropped.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import threading
import weakref
from concurrent.futures import Future
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

    One request is in flight at a time per client; calls from several
    threads of the worker take turns.
    """

    def __init__(self, address: str, authkey: bytes, in_keys: list[Any]) -> None:
        self.address = address
        self.authkey = authkey
        self.in_keys = list(in_keys)
        self._lock = threading.Lock()
        self._conn: Wire | None = None
        self._inputs: Slot | None = None
        self._outputs: Slot | None = None
        self._closed = False
        self._seq = 0
        _CLIENTS.add(self)

    def process_address(self) -> tuple[str, bytes, list]:
        """Where another copy connects (a copy of a copy is a client of the same server)."""
        return self.address, self.authkey, self.in_keys

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
        with self._lock:
            conn = self._connection()
            batch_shape = tuple(td.batch_size)
            rows = td.batch_size.numel()
            inputs = [entry(td, key) for key in self.in_keys]
            slot = self._inputs
            if slot is not None and slot.fits(inputs, rows, batch_shape):
                slot.write(inputs, rows, batch_shape)
                payload = None
            else:
                present = [k for k, v in zip(self.in_keys, inputs) if v is not None]
                payload = pickle.dumps(td.select(*present, strict=False), protocol=pickle.HIGHEST_PROTOCOL)
            self._seq += 1
            mode = interaction_type()
            try:
                conn.send(("req", self._seq, rows, batch_shape, None if mode is None else mode.value, payload))
            except OSError as err:
                self._closed = True
                raise ServerClosedError(f"the server is closed or gone ({err})") from err
            return self._wait(conn, td, rows, batch_shape)

    def _wait(self, conn: Wire, td: TensorDictBase, rows: int, batch_shape: tuple[int, ...]) -> TensorDictBase:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError) as err:
                self._closed = True
                raise ServerBrokenError("the server's process ended while this request was in flight") from err
            kind = message[0]
            if kind == "slot":
                _, which, fields, capacity, size = message
                slot = Slot.attach(fields, capacity, size, conn.take_fd())
                if which == "in":
                    self._inputs = slot
                else:
                    self._outputs = slot
                continue
            if kind == "closed":
                self._closed = True
                raise ServerClosedError("the server was closed before this request ran")
            _, seq, error, values, keys = message
            if seq != self._seq:
                continue  # the reply to a call that was interrupted
            if error is not None:
                raise error
            if values is None:
                out = self._outputs
                assert out is not None
                keys, values = out.keys, out.read(rows, batch_shape)
            write_outputs(td, keys, values)
            return td

    def submit(self, td: TensorDictBase) -> Future[TensorDictBase]:
        """Serve ``td`` from a helper thread; the Future resolves to it."""
        future: Future[TensorDictBase] = Future()

        def run() -> None:
            try:
                future.set_result(self.call(td))
            except BaseException as err:
                future.set_exception(err)

        threading.Thread(target=run, daemon=True).start()
        return future

    async def acall(self, td: TensorDictBase) -> TensorDictBase:
        """``await``-able :meth:`call` (runs in the loop's default executor)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.call, td)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._inputs = self._outputs = None

    def _forget(self) -> None:
        """In a forked child: drop the parent's connection (its descriptor closed), connect anew on use."""
        self._lock = threading.Lock()  # the parent's may have been held by another thread at the fork
        conn, self._conn, self._inputs, self._outputs = self._conn, None, None, None
        if conn is not None:
            conn.sock.close()
