"""The worker-process side: a RemotePolicy's endpoint in another process.

Connects to the server's :class:`~torchrl_batchserve.transport.hub.ProcessHub`
on first use (so a policy can be pickled, unpickled and never called), then
serves one request at a time through its slots. Waiting is a blocking
``recv`` on the socket: a reply, a ``closed`` notice, or end-of-file when the
server's process is gone; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from multiprocessing.connection import Client
from typing import Any

from tensordict import TensorDict, TensorDictBase

from torchrl_batchserve.errors import BadRequestError, ServerBrokenError, ServerClosedError
from torchrl_batchserve.layout import entry
from torchrl_batchserve.request import write_outputs
from torchrl_batchserve.transport.caller import current_interaction, forks
from torchrl_batchserve.transport.slots import Slot
from torchrl_batchserve.transport.wire import Wire, frame
from torchrl_batchserve.wakeup import sleeper_id, unhush

__all__ = ["ProcessClient"]


class ProcessClient:
    """One worker's connection to a server in another process.

    Args:
        address: the hub's Unix socket path.
        authkey: the hub's authentication key.
        in_keys: the entries to send (the policy's in_keys, minus those the
            server's collate provides).

    One request is in flight at a time per client; calls from several
    threads of the worker take turns (give each thread its own copy of the
    policy to overlap them).
    """

    def __init__(self, address: str, authkey: bytes, in_keys: list[Any]) -> None:
        self.address = address
        self.authkey = authkey
        self.in_keys = list(in_keys)
        self._lock = threading.Lock()
        self._conn: Wire | None = None
        self._forks = forks()
        self._inputs: Slot | None = None
        self._outputs: Slot | None = None
        self._closed = False
        self._last_head: Any = None
        self._last_frame = b""

    def process_address(self) -> tuple[str, bytes, list]:
        """Where another copy connects (a copy of a copy is a client of the same server)."""
        return self.address, self.authkey, self.in_keys

    def _connection(self) -> Wire:
        if self._forks != forks():  # forked with a connection: start afresh
            self._forks, self._conn, self._inputs, self._outputs = forks(), None, None, None
        if self._closed:
            raise ServerClosedError("the server is closed and accepts no more requests")
        if self._conn is None:
            try:
                self._conn = Wire(Client(self.address, family="AF_UNIX", authkey=self.authkey))
            except (OSError, EOFError) as err:
                self._closed = True
                raise ServerClosedError(f"the server at {self.address} is closed or gone ({err})") from err
        return self._conn

    def call(self, td: TensorDictBase) -> TensorDictBase:
        """Serve ``td`` and block until its outputs are written into it."""
        if type(td) is not TensorDict and not isinstance(td, TensorDictBase):
            raise BadRequestError(f"a request must be a TensorDictBase, got {type(td).__name__}")
        with self._lock:
            conn = self._connection()
            batch_shape = tuple(td.batch_size)
            rows = 1
            for d in batch_shape:
                rows *= d
            mode = current_interaction()
            inputs = [entry(td, key) for key in self.in_keys]
            slot = self._inputs
            if slot is not None and slot.fits(inputs, rows, batch_shape):
                slot.write(inputs, rows, batch_shape)
                payload = None
            else:
                payload = td.select(*[k for k, v in zip(self.in_keys, inputs) if v is not None], strict=False)
            sleeper = sleeper_id()  # the hub hushes this thread before it wakes it (wakeup.py)
            try:
                if payload is None:  # a slot request: the same few bytes as last time, most often
                    head = (rows, batch_shape, mode, sleeper)
                    if head != self._last_head:
                        self._last_head = head
                        self._last_frame = frame(("req", rows, batch_shape, _value(mode), sleeper, None))
                    conn.send_frame(self._last_frame)
                else:
                    conn.send(("req", rows, batch_shape, _value(mode), sleeper, payload))
            except OSError as err:
                self._closed = True
                raise ServerClosedError(f"the server is closed or gone ({err})") from err
            try:
                return self._wait(conn, td, rows, batch_shape)
            finally:
                if sleeper:
                    unhush()

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
            _, error, values, keys = message
            if error is not None:
                raise error
            if values is None:
                out = self._outputs
                assert out is not None
                keys = out.keys
                values = out.read(rows, batch_shape, clone=True)
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


def _value(mode: Any) -> Any:
    return None if mode is None else mode.value
