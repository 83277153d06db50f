"""The server side of worker-process actors: a Unix socket and shared-memory slots.

Each unpickled :class:`~torchrl_batchserve.RemotePolicy` in another process
connects once (its own client: replies can never reach another worker) and
then has one request at a time in flight. Tensors travel through the client's
two slots (inputs, outputs: :mod:`~torchrl_batchserve.transport.slots`); the
socket carries only a few bytes per request, and its blocking ``recv`` is how
both sides wait: no polling. The socket is also the liveness signal: a worker
that dies closes it, and the hub drops the worker (its slot memory goes with
the last mapping); a server that dies or closes ends every client's ``recv``.

One hub thread reads every client (one ``epoll`` set), turns
each message into a :class:`ProcessRequest` and queues it through the
server's endpoint; when a request completes a batch, the hub thread runs it
itself, as an event loop's coroutine does. Replies are written by whichever thread
completes the request.

Messages (pickled tuples, framed by :mod:`~torchrl_batchserve.transport.wire`;
tensors only in the first request of a layout, or when they do not fit the
slot):

* client -> hub: ``("req", rows, batch_shape, interaction, sleeper, inputs | None)``,
  ``sleeper`` the waiting thread's id for :func:`~torchrl_batchserve.wakeup.hush`
  (0: leave it alone)
* hub -> client: ``("slot", "in" | "out", fields, capacity, size)`` with the
  slot's descriptor attached (``SCM_RIGHTS``); ``("done", error, outputs | None,
  keys)``; ``("closed",)``.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import selectors
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, Listener
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import InteractionType

from torchrl_batchserve.errors import BadRequestError, BatchServeError
from torchrl_batchserve.request import Request
from torchrl_batchserve.transport.slots import Slot
from torchrl_batchserve.transport.wire import DONE_FRAME, Wire, frame
from torchrl_batchserve.wakeup import hush

__all__ = ["ProcessHub", "ProcessRequest"]

_log = logging.getLogger(__name__)
_CPU = torch.device("cpu")


_MODES = {m.value: m for m in InteractionType}


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class _Client:
    """A connected worker: its socket and its two slots."""

    def __init__(self, conn: Connection, ident: int) -> None:
        self.wire = Wire(conn, receives_fds=False)  # workers send no descriptors
        self.ident = ident
        self.caller = ("process", ident)
        self.send_lock = threading.Lock()
        self.inputs: Slot | None = None
        self.outputs: Slot | None = None
        self.varying = False
        self.alive = True
        self.sleeper = 0  # the thread to hush before the next reply wakes it
        self._pid = _peer_pid(self.wire.sock)
        self._checked = (0, False)  # the last sleeper id the client sent, and whether it is one of its threads

    def waits_in(self, sleeper: int) -> None:
        """The client's request came from thread ``sleeper`` (its native id, 0 for none)."""
        if sleeper and self._checked[0] != sleeper:
            # Only a thread of the process at the other end of the socket (an
            # id from another PID namespace would name someone else here).
            own = self._pid is not None and os.path.exists(f"/proc/{self._pid}/task/{sleeper}")
            self._checked = (sleeper, own)
        self.sleeper = sleeper if sleeper and self._checked[1] else 0

    def send(self, message: Any, fd: int | None = None) -> None:
        """Send ``message`` (``None``: a plain "done"), with the descriptor ``fd`` if any (then closed here)."""
        with self.send_lock:
            try:
                if not self.alive:
                    return
                if self.sleeper:
                    hush(self.sleeper)
                    self.sleeper = 0
                self.wire.send_frame(DONE_FRAME if message is None else frame(message), fd)
            except OSError:
                self.alive = False  # the worker is gone; its reader sees EOF too
            finally:
                if fd is not None:
                    os.close(fd)  # sent or not: the worker has its own copy or never will


def _peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a Unix socket (Linux), else ``None``."""
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (AttributeError, OSError):
        return None
    return pid or None


class ProcessRequest(Request):
    """A request from a worker process; its outputs go back through the client's slot."""

    __slots__ = ("client",)
    takes_rows = True  # its outputs are copied into the client's slot at once

    def __init__(self, *args: Any, client: _Client) -> None:
        super().__init__(*args)
        self.client = client

    def _wake(self) -> None:
        client = self.client
        if self.error is not None:
            client.send(("done", _portable(self.error), None, None))
            return
        try:
            self._reply(client)
        except Exception as err:  # e.g. no memory for a slot: this request fails, not the batch
            client.send(("done", _portable(err), None, None))

    def _reply(self, client: _Client) -> None:
        values = self.values
        if values and type(values[0]) is tuple:  # (batch tensor, row) pairs: Request.takes_rows
            slot = client.outputs
            if slot is not None and slot.fits_row(values):
                slot.write_row(values)
                client.send(None)
                return
            values = [v[i] for v, i in values]  # a new slot's first reply: its own views
        values, rows, dims = list(values), self.rows, len(self.batch_shape)
        slot = client.outputs
        if slot is None or not slot.fits(values, rows, self.batch_shape):
            if not all(isinstance(v, torch.Tensor) for v in values):
                client.send(("done", None, values, list(self.keys)))  # non-tensor outputs: pickled
                return
            capacity = max(rows, slot.capacity if slot is not None else 1)
            specs = [(k, v.dtype, tuple(v.shape[dims:])) for k, v in zip(self.keys, values)]
            slot, fd = Slot.create(specs, capacity)
            client.outputs = slot
            client.send(("slot", "out", *slot.describe()), fd=fd)
        slot.write(values, rows, self.batch_shape)  # copy_ brings device values over
        client.send(None)


class ProcessHub:
    """Accepts worker connections and feeds their requests to the server's queue.

    Args:
        keys: the entries requests carry (the layout's keys), in slot order.
        make_request: ``make_request(cls, td, caller, interaction, **kwargs)``,
            the endpoint's validation (raises ``BadRequestError``).
        enqueue: ``enqueue(request, may_serve=, keeps_time=) -> batch | None``
            (admission and queueing; may raise when the server is closed or
            full).
        serve: runs a batch the queue handed this thread.
        take_due: the queue's :meth:`~torchrl_batchserve.queue.RequestQueue.take_due`:
            the hub keeps the timeout of the requests it queues (it sleeps
            in ``epoll`` until the next message or the oldest request's
            timeout), so their arrival wakes no other thread. ``epoll``
            counts in milliseconds, rounded up: a batch of worker requests
            that fires on timeout does so up to 1 ms after it.
        trusted_slots: requests read from a slot skip validation (the slot's
            layout was validated when it was made); the server sets it when
            nothing needs the request's TensorDict (stacking collate, no
            ``cost_fn``, no cache ``key_fn``).
    """

    def __init__(
        self,
        keys: Sequence[Any],
        make_request: Callable[..., Request],
        enqueue: Callable[..., Any],
        serve: Callable[..., None],
        take_due: Callable[[], Any],
        trusted_slots: bool = False,
    ) -> None:
        self._keys = list(keys)
        self._trusted = trusted_slots
        self._make_request = make_request
        self._enqueue = enqueue
        self._serve = serve
        self._take_due = take_due
        self._dir = tempfile.mkdtemp(prefix="torchrl_batchserve-")
        self.address = os.path.join(self._dir, "hub.sock")
        self.authkey = secrets.token_bytes(16)
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._pending: list[_Client] = []
        self._clients: dict[int, _Client] = {}
        self._next_id = 0
        self._closed = False
        self._accepter = threading.Thread(target=self._accept_forever, name="batchserve-hub-accept", daemon=True)
        self._reader = threading.Thread(target=self._read_forever, name="batchserve-hub", daemon=True)
        self._accepter.start()
        self._reader.start()

    @property
    def clients(self) -> int:
        """How many worker clients are connected now."""
        return len(self._clients) + len(self._pending)

    def _accept_forever(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except Exception:  # closed, or a client that failed the handshake (wrong authkey, hung up)
                if self._closed:
                    return
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._next_id += 1
                self._pending.append(_Client(conn, self._next_id))
            os.write(self._wake_w, b"x")

    def _wake_accepter(self) -> None:
        """End the accept thread's ``accept()``: closing the listening socket does not (Linux).

        A connection that hangs up at once: its handshake fails, and the thread sees the hub closed.
        """
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as knock:
                knock.connect(self.address)
        except OSError:
            pass

    def _read_forever(self) -> None:
        torch.set_grad_enabled(False)
        selector = selectors.DefaultSelector()  # one epoll set for the hub's life, not one per wake
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        wait: float | None = None  # until the oldest queued request times out
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    for client in self._pending:
                        self._clients[client.ident] = client
                        selector.register(client.wire, selectors.EVENT_READ, client)
                    self._pending.clear()
                for key, _ in selector.select(wait):
                    client = key.data
                    if client is None:
                        os.read(self._wake_r, 4096)
                        continue
                    try:
                        if not client.alive:  # a reply found it gone
                            raise EOFError
                        messages = client.wire.read()
                    except (EOFError, OSError):
                        selector.unregister(client.wire)
                        self._drop(client)
                        continue
                    try:
                        for message in messages:
                            self._handle(client, message)
                    except Exception:
                        _log.exception("bad message from worker client %d; dropping it", client.ident)
                        selector.unregister(client.wire)
                        self._drop(client)
                wait = self._serve_due()
        finally:
            selector.close()

    def _serve_due(self) -> float | None:
        """Run the batches the timeout made due; the seconds until the next one, or ``None``."""
        while True:
            due = self._take_due()
            if not isinstance(due, tuple):
                return due
            self._serve(*due)

    def _handle(self, client: _Client, message: tuple) -> None:
        _, rows, batch_shape, interaction, sleeper, data = message
        mode = None if interaction is None else _MODES[interaction]
        client.waits_in(sleeper)
        try:
            if data is not None:
                request = self._make_request(ProcessRequest, data, client.caller, mode, client=client)
                self._offer_slot(client, request)
            else:  # the inputs are in the client's slot
                request = self._from_slot(client, rows, batch_shape, mode)
            batch = self._enqueue(request, may_serve=True, keeps_time=True)
        except BatchServeError as err:
            client.send(("done", _portable(err), None, None))
            return
        if batch is not None:
            self._serve(*batch)

    def _from_slot(self, client: _Client, rows: int, batch_shape: tuple, mode: Any) -> Request:
        slot = client.inputs
        if slot is None:
            raise BadRequestError("the client wrote to a slot it was never given")
        if rows > slot.capacity:
            raise BadRequestError(f"the request has {rows} rows; the client's slot holds {slot.capacity}")
        if not self._trusted:
            views = slot.read(rows, batch_shape, clone=False)
            td = TensorDict(dict(zip(slot.keys, views)), batch_size=batch_shape)
            return self._make_request(ProcessRequest, td, client.caller, mode, client=client)
        # The slot's layout was validated with the request that made it: only
        # the rows are new. Inputs are views, as validation would return them.
        inputs = tuple(slot.views(rows, (rows,) if batch_shape else ()))
        return ProcessRequest(None, inputs, rows, torch.Size(batch_shape), client.caller, mode, _CPU, client=client)

    def _offer_slot(self, client: _Client, request: Request) -> None:
        """A request came with its tensors: give the client a slot for the next ones."""
        inputs = request.inputs
        if client.varying or not all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in inputs):
            return  # non-tensor or device inputs always travel pickled
        dims = 1 if request.batch_shape else 0
        specs = [(k, v.dtype, tuple(v.shape[dims:])) for k, v in zip(self._keys, inputs)]
        old = client.inputs
        if old is not None and old.specs() != specs:
            client.varying = True  # variable-length inputs: one slot per length would cost more than it saves
            return
        capacity = max(request.rows, old.capacity if old is not None else 1)
        slot, fd = Slot.create(specs, capacity)
        client.inputs = slot
        client.send(("slot", "in", *slot.describe()), fd=fd)

    def _drop(self, client: _Client) -> None:
        self._clients.pop(client.ident, None)
        with client.send_lock:  # a reply being written finishes first; later ones see alive=False
            client.alive = False
            try:
                client.wire.close()  # its descriptor number may be reused at once
            except OSError:
                pass
        client.inputs = client.outputs = None  # the memory goes with the last view

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop accepting, tell every client the server closed, release everything."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            clients = list(self._clients.values()) + self._pending
            self._pending.clear()
        os.write(self._wake_w, b"x")
        self._wake_accepter()
        self._listener.close()  # removes the socket file
        self._accepter.join(timeout)
        self._reader.join(timeout)
        for client in clients:
            client.send(("closed",))
            self._drop(client)
        self._clients.clear()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        try:
            os.rmdir(self._dir)
        except OSError:
            pass
