"""The server side of worker-process actors: a Unix socket and shared-memory slots.

Each unpickled :class:`~torchrl_batchserve.RemotePolicy` in another process
connects once (its own client: replies can never reach another worker); any
number of its process's threads and tasks may have requests in flight. Tensors travel through the
client's two slots (inputs, outputs: :mod:`~torchrl_batchserve.transport.slots`);
the socket carries a few bytes per request, and its blocking read is how both
sides wait. The socket is also the liveness signal: a worker that dies closes
it and the hub drops the worker (its slot memory goes with the last mapping);
a server that dies or closes ends every client's read.

Threads: one accept thread; one short-lived thread per connection for its
handshake (bounded by ``HANDSHAKE_TIMEOUT``, so a client that never answers
blocks no one); one reader thread for every client (one ``epoll`` set),
which turns each message into a :class:`ProcessRequest` through the server's
:class:`~torchrl_batchserve.intake.Intake`, the same checks as in-process
callers. A message that fails in any way fails that request only. Replies
are written by the serve loop that completes the request.

Messages (pickled tuples, framed by :mod:`~torchrl_batchserve.transport.wire`):

* client -> hub: the 16-byte authkey once, then
  ``("req", seq, rows, batch_shape, interaction, payload, into_slot)``;
  ``payload`` is the pickled inputs, or ``None`` when they are in the
  client's input slot of capacity ``into_slot`` (0: none; the reply's
  outputs then go to the output slot too).
* hub -> client: ``("slot", "in" | "out", fields, capacity, size)`` with the
  slot's descriptor attached (``SCM_RIGHTS``); ``("done", seq, error, values, keys)``
  (``values`` ``None``: in the output slot); ``("closed",)``.

``seq`` numbers a client's requests, several of which may be in flight (the
threads and tasks of one worker): each reply goes to the caller of its
``seq``, and one nobody waits for (a call interrupted by a signal) is
dropped. At most one request at a time holds the slots, from its request
until its reply is read, so a later call never reads an earlier call's
outputs.

In a child forked from the server's process, every descriptor of the hub is
closed at once (``os.register_at_fork``): a worker forked later must not hold
the hub's end of an earlier worker's socket, or that worker would never see
the server die.
"""

from __future__ import annotations

import hmac
import logging
import os
import pickle
import secrets
import selectors
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import InteractionType

from torchrl_batchserve.errors import BadRequestError
from torchrl_batchserve.intake import Intake
from torchrl_batchserve.request import Request
from torchrl_batchserve.transport.slots import Slot
from torchrl_batchserve.transport.wire import Wire, frame

__all__ = ["HANDSHAKE_TIMEOUT", "ProcessHub", "ProcessRequest"]

_log = logging.getLogger(__name__)
_MODES = {m.value: m for m in InteractionType}
HANDSHAKE_TIMEOUT = 5.0
"""Seconds a new connection has to send its key; then it is dropped."""
AUTHKEY_BYTES = 16


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class _Client:
    """A connected worker: its socket and its two slots."""

    def __init__(self, sock: socket.socket, ident: int) -> None:
        self.wire = Wire(sock, receives_fds=False)  # workers send no descriptors
        self.ident = ident
        self.caller = ("process", ident)
        self.send_lock = threading.Lock()
        self.inputs: dict[int, Slot] = {}  # by capacity: each new one is larger, and requests name theirs
        self.outputs: Slot | None = None
        self.varying = False
        self.alive = True

    def send(self, message: Any, fd: int | None = None) -> None:
        """Send ``message``, with the descriptor ``fd`` if any (closed here, sent or not)."""
        with self.send_lock:
            self._send(message, fd)

    def _send(self, message: Any, fd: int | None = None) -> None:
        try:
            if self.alive:
                self.wire.send_frame(frame(message), fd)
        except OSError:
            self.alive = False  # the worker is gone; the reader sees EOF too
        finally:
            if fd is not None:
                os.close(fd)

    def reply(self, request: ProcessRequest) -> None:
        """Send ``request``'s outcome: its outputs through the output slot, or pickled."""
        with self.send_lock:
            seq = request.seq
            if request.error is not None:
                self._send(("done", seq, _portable(request.error), None, None))
            elif not request.into_slot:
                self._send(("done", seq, None, list(request.values), list(request.keys)))  # pickled
            else:
                try:
                    self._reply(request)
                except Exception as err:  # e.g. no memory for a slot: this request fails, not the batch
                    self._send(("done", seq, _portable(err), None, None))

    def _reply(self, request: ProcessRequest) -> None:
        values, keys, rows, shape = list(request.values), list(request.keys), request.rows, request.batch_shape
        slot = self.outputs
        if slot is None or not slot.fits(values, rows, shape):
            if not all(isinstance(v, torch.Tensor) for v in values):
                self._send(("done", request.seq, None, values, keys))  # non-tensor outputs: pickled
                return
            dims = len(shape)
            capacity = max(rows, slot.capacity if slot is not None else 1)
            slot, fd = Slot.create([(k, v.dtype, tuple(v.shape[dims:])) for k, v in zip(keys, values)], capacity)
            self.outputs = slot
            self._send(("slot", "out", *slot.describe()), fd=fd)
        slot.write(values, rows, shape)  # copy_ brings device values over
        self._send(("done", request.seq, None, None, None))


class ProcessRequest(Request):
    """A request from a worker process; its outcome goes back over the client's socket."""

    __slots__ = ("client", "into_slot", "seq")

    def __init__(self, *args: Any, client: _Client, seq: int, into_slot: bool = False) -> None:
        super().__init__(*args)
        self.client = client
        self.seq = seq
        self.into_slot = into_slot  # its inputs are in the client's slot, and its outputs go there

    def claim(self) -> bool:
        return not self.done and self.client.alive

    def _wake(self) -> None:
        self.client.reply(self)


_HUBS: weakref.WeakSet[ProcessHub] = weakref.WeakSet()


def _forget_in_child() -> None:
    for hub in list(_HUBS):
        hub._forget()


os.register_at_fork(after_in_child=_forget_in_child)


def _remove_folder(folder: str, owner: int) -> None:
    if os.getpid() == owner:  # never from a forked child: the socket is the parent's
        shutil.rmtree(folder, ignore_errors=True)


class ProcessHub:
    """Accepts worker connections and feeds their requests to the server's intake.

    Args:
        keys: the entries requests carry (the layout's keys), in slot order.
        intake: the server's validation, admission and queueing.
    """

    def __init__(self, keys: Sequence[Any], intake: Intake) -> None:
        self._keys = list(keys)
        self._intake = intake
        self._dir = tempfile.mkdtemp(prefix="torchrl_batchserve-")
        self._finalizer = weakref.finalize(self, _remove_folder, self._dir, os.getpid())
        self.address = os.path.join(self._dir, "hub.sock")
        self.authkey = secrets.token_bytes(AUTHKEY_BYTES)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(128)
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._pending: list[_Client] = []
        self._clients: dict[int, _Client] = {}
        self._next_id = 0
        self._closed = False
        _HUBS.add(self)
        self._accepter = threading.Thread(target=self._accept_forever, name="batchserve-hub-accept", daemon=True)
        self._reader = threading.Thread(target=self._read_forever, name="batchserve-hub", daemon=True)
        self._accepter.start()
        self._reader.start()

    @property
    def clients(self) -> int:
        """How many worker clients are connected now."""
        return len(self._clients) + len(self._pending)

    # -- connections -----------------------------------------------------------------

    def _accept_forever(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            if self._closed:
                sock.close()
                return
            threading.Thread(target=self._handshake, args=(sock,), name="batchserve-hub-handshake", daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        """Admit ``sock`` if it sends the key within ``HANDSHAKE_TIMEOUT``; else drop it."""
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            key = b""
            while len(key) < AUTHKEY_BYTES:
                chunk = sock.recv(AUTHKEY_BYTES - len(key))
                if not chunk:
                    raise OSError("hung up during the handshake")
                key += chunk
            if not hmac.compare_digest(key, self.authkey):
                raise OSError("wrong authkey")
            sock.sendall(b"\x01")
        except OSError:
            sock.close()
            return
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._next_id += 1
            self._pending.append(_Client(sock, self._next_id))
        os.write(self._wake_w, b"x")

    def _knock(self) -> None:
        """End the accept thread's ``accept()``: closing the listening socket does not (Linux)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as knock:
                knock.connect(self.address)
        except OSError:
            pass

    # -- requests -------------------------------------------------------------------------

    def _read_forever(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    for client in self._pending:
                        self._clients[client.ident] = client
                        selector.register(client.wire, selectors.EVENT_READ, client)
                    self._pending.clear()
                for key, _ in selector.select():
                    client = key.data
                    if client is None:
                        os.read(self._wake_r, 4096)
                    elif not self._read(client):
                        selector.unregister(client.wire)
                        self._drop(client)
        except BaseException:
            _log.exception("the process hub's reader died")  # only a bug gets here
        finally:
            selector.close()

    def _read(self, client: _Client) -> bool:
        """Handle what ``client`` sent; False once it is gone (or sent what is not a message)."""
        try:
            if not client.alive:  # a reply found it gone
                return False
            messages = client.wire.read()
        except (EOFError, OSError):
            return False
        except Exception:  # not a frame of ours: the client is not speaking our protocol
            _log.exception("undecodable message from worker client %d; dropping it", client.ident)
            return False
        for message in messages:
            self._handle(client, message)
        return True

    def _handle(self, client: _Client, message: Any) -> None:
        try:
            _, seq, rows, batch_shape, interaction, payload, into_slot = message
        except (TypeError, ValueError):
            _log.error("malformed message from worker client %d: %r", client.ident, message)
            return
        try:
            mode = None if interaction is None else _MODES[interaction]
            if payload is not None:
                td = pickle.loads(payload)
                request = self._intake.request(ProcessRequest, td, client.caller, mode, client=client, seq=seq)
                self._offer_slot(client, request)
            elif into_slot:  # the capacity of the input slot its inputs are in
                request = self._from_slot(client, seq, rows, tuple(batch_shape), mode, into_slot)
            else:
                raise BadRequestError("the request came with neither its inputs nor a slot")
            self._intake.put(request)
        except BaseException as err:  # whatever the message did, it fails this request only
            client.send(("done", seq, _portable(err), None, None))

    def _from_slot(self, client: _Client, seq: int, rows: int, batch_shape: tuple, mode: Any, capacity: int) -> Request:
        slot = client.inputs.get(capacity)
        if slot is None:
            raise BadRequestError("the client wrote to a slot it was never given")
        if rows > slot.capacity:
            raise BadRequestError(f"the request has {rows} rows; the client's slot holds {slot.capacity}")
        # Views of the slot: the client writes it again only once this request is answered.
        td = TensorDict(dict(zip(slot.keys, slot.views(rows, batch_shape))), batch_size=batch_shape)
        return self._intake.request(ProcessRequest, td, client.caller, mode, client=client, seq=seq, into_slot=True)

    def _offer_slot(self, client: _Client, request: Request) -> None:
        """A request came with its tensors: give the client a slot for the next ones."""
        inputs = request.inputs
        if client.varying or not all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in inputs):
            return  # non-tensor or device inputs always travel pickled
        dims = 1 if request.batch_shape else 0
        specs = [(k, v.dtype, tuple(v.shape[dims:])) for k, v in zip(self._keys, inputs)]
        old = client.inputs[max(client.inputs)] if client.inputs else None
        if old is not None and old.specs() != specs:
            client.varying = True  # variable-length inputs: one slot per length would cost more than it saves
            return
        if old is not None and request.rows <= old.capacity:
            return  # it came pickled because its slot was taken by another of the client's requests
        # A larger slot; the older ones stay, since requests in flight may name them.
        slot, fd = Slot.create(specs, max(request.rows, 2 * old.capacity if old is not None else 1))
        client.inputs[slot.capacity] = slot
        client.send(("slot", "in", *slot.describe()), fd=fd)

    def _drop(self, client: _Client) -> None:
        self._clients.pop(client.ident, None)
        with client.send_lock:  # a reply being written finishes first; later ones see alive=False
            client.alive = False
            try:
                client.wire.close()
            except OSError:
                pass
        client.inputs, client.outputs = {}, None  # the memory goes with the last view

    # -- lifecycle ------------------------------------------------------------------------

    def close(self, timeout: float | None = 5.0) -> bool:
        """Stop accepting, tell every client the server closed, release everything; whether both threads ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            clients = list(self._clients.values()) + self._pending
            self._pending.clear()
        os.write(self._wake_w, b"x")
        self._knock()
        self._listener.close()
        self._finalizer()  # the socket file and its folder
        for thread in (self._accepter, self._reader):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for client in clients:
            client.send(("closed",))
            self._drop(client)
        self._clients.clear()
        stopped = not (self._accepter.is_alive() or self._reader.is_alive())
        if stopped:
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
        return stopped

    def _forget(self) -> None:
        """In a forked child: close every descriptor of the parent's hub, touch nothing else."""
        self._closed = True
        self._finalizer.detach()
        for client in list(self._clients.values()) + self._pending:
            client.alive = False
            client.wire.sock.close()
        self._listener.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
