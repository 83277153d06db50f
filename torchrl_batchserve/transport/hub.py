"""The server side of worker-process actors: a Unix socket, shared-memory lanes and eventfds.

Each unpickled :class:`~torchrl_batchserve.RemotePolicy` in another process
connects once (its own client: replies can never reach another worker); any
number of its process's threads and tasks may have requests in flight.

A client's requests travel in its **lanes**: a lane is a pair of slots
(inputs, outputs: :mod:`~torchrl_batchserve.transport.slots`) with a header
(seq, rows, batch shape, interaction), and holds one request at a time. The
client writes a request into a free lane and rings its **request bell**, an
eventfd, adding the lane's bit (``1 << lane``). The hub's reader thread waits
on every client's bell and socket in one ``epoll``; one read of a bell
returns every lane rung since the last read, so a client pays the server one
system call per pass, however many of its requests it brings, and bells rung
while the reader is at work wake nobody. The serve loop writes a lane's outputs in
place and rings the client's **reply bell** with the lane's bit. The bells'
reads and writes order the shared memory between the two processes (the
kernel's lock on the eventfd), on any CPU. No socket message crosses per
request.

The socket carries the rest: the client's bells and headers once, at the
handshake; a lane when the hub offers one; requests that fit no free lane
(their inputs pickled: the first of a client, non-tensor, device or varying
inputs, more batch dims than a header holds); a reply that cannot go in its
lane (an error, non-tensor outputs, a lane's first outputs, whose slot comes
with it); and ``closed``. It is also the liveness signal: a worker that dies
closes it and the hub drops the worker (its lanes' memory goes with the last
mapping); a server that dies or closes ends every client's wait.

Lanes are offered as a client needs them: after a pickled request whose
inputs are CPU tensors of the layout of its earlier ones, when the client has
fewer lanes that fit it than requests in flight (at most
:data:`~torchrl_batchserve.transport.slots.MAX_LANES`). So a worker with one
caller gets one lane, and one with 16 asyncio tasks gets 16 within a few
requests.

Threads: one accept thread; one short-lived thread per connection for its
handshake (bounded by ``HANDSHAKE_TIMEOUT``, so a client that never answers
blocks no one); one reader thread for every client, which turns each request
into a :class:`~torchrl_batchserve.transport.connection.ProcessRequest` through
the server's :class:`~torchrl_batchserve.intake.Intake`, the same checks as
in-process callers. A request that fails in any way fails alone; if the reader
itself dies (a bug), every worker is told and dropped, since no one would read
its requests. Replies are written by the serve loop that completes the request,
through the client's :class:`~torchrl_batchserve.transport.connection.Connection`;
what its socket does not take at once waits, in order, in its outbox, which the
reader sends as the socket drains: no serve loop ever waits on a worker (one
stopped with a large reply due holds up no one).
The reader alone closes the descriptors of the clients it reads (a worker that
hung up, and every worker when the hub closes), so none is closed under it,
and its own wake-up pipe as it ends (a close that stops waiting for it leaks none).

Messages (pickled tuples, framed by :mod:`~torchrl_batchserve.transport.wire`):

* client -> hub: the 16-byte authkey once (answered with one byte: admitted, or
  refused because the reader died), then ``("req", seq, interaction, payload)``
  (``payload``: the pickled inputs).
* hub -> client: ``("bells",)`` with the headers' memory, the request bell and
  the reply bell; ``("lane", index, fields, capacity, size)`` with its input
  slot; ``("done", seq, outcome, out)``, where ``outcome`` is ``(error,
  values, keys)`` pickled on its own (a worker that cannot read it fails that
  request alone), or ``None`` when the outputs are in the lane, and ``out`` is
  ``(fields, capacity, size)`` when a new output slot comes with it; ``("closed",)``,
  or ``("broken", reason)`` if the reader died (a bug) or the server had broken
  when the hub closed; then end-of-file.

``seq`` numbers a client's requests: each reply goes to the caller of its
``seq``, and one nobody waits for (a call interrupted by a signal) is
dropped.

In a child forked from the server's process, every descriptor of the hub is
closed at once (``os.register_at_fork``): a worker forked later must not hold
the hub's end of an earlier worker's socket, or that worker would never see
the server die.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import os
import pickle
import secrets
import selectors
import shutil
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict
from tensordict.nn import InteractionType

from torchrl_batchserve.errors import BadRequestError
from torchrl_batchserve.intake import Intake
from torchrl_batchserve.request import Request
from torchrl_batchserve.transport.connection import Connection, ProcessRequest, close_all, done_message, new_slot
from torchrl_batchserve.transport.slots import MAX_BATCH_DIMS, MAX_LANES, Lane, on_host, storable

__all__ = ["HANDSHAKE_TIMEOUT", "ProcessHub"]

_log = logging.getLogger(__name__)
_MODES = {m.value: m for m in InteractionType}
HANDSHAKE_TIMEOUT = 5.0
"""Seconds a new connection has to send its key; then it is dropped."""
AUTHKEY_BYTES = 16
ADMITTED, REFUSED_BROKEN = b"\x01", b"\x02"  # the hub's answer to a client's key


_HUBS: weakref.WeakSet[ProcessHub] = weakref.WeakSet()


def _forget_in_child() -> None:
    for hub in list(_HUBS):
        hub._forget()


os.register_at_fork(after_in_child=_forget_in_child)


def _socket_folder() -> str:
    """A private folder for the hub's socket.

    In the temporary folder, or in ``/tmp`` where a path there would be too
    long for a Unix socket (108 bytes; a cluster job's ``TMPDIR`` may be).
    """
    folder = tempfile.mkdtemp(prefix="torchrl_batchserve-")
    if len(os.fsencode(os.path.join(folder, "hub.sock"))) < 108:
        return folder
    os.rmdir(folder)
    return tempfile.mkdtemp(prefix="torchrl_batchserve-", dir="/tmp")


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
        missing = [name for name in ("eventfd", "memfd_create") if not hasattr(os, name)]
        if missing:
            raise NotImplementedError(
                f"worker processes reach a server through Linux's {' and '.join(missing)}, which this platform "
                f"({sys.platform}) lacks: here, serve the threads and asyncio tasks of the server's process"
            )
        self._keys = list(keys)
        self._intake = intake
        self._dir = _socket_folder()
        self._finalizer = weakref.finalize(self, _remove_folder, self._dir, os.getpid())
        self.address = os.path.join(self._dir, "hub.sock")
        self.authkey = secrets.token_bytes(AUTHKEY_BYTES)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(4096)  # (the kernel caps it at net.core.somaxconn) workers may all connect at once
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._pending: list[Connection] = []
        self._clients: dict[int, Connection] = {}
        self._backlogged: set[Connection] = set()  # clients whose outbox waits for their socket
        self.arrived = {"lane": 0, "socket": 0}  # requests accepted, by how they came (written by the reader only)
        self._next_id = 0
        self._closed = False
        self._broken: str | None = None  # why the reader died, if it did
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
            handshake = threading.Thread(
                target=self._handshake, args=(sock,), name="batchserve-hub-handshake", daemon=True
            )
            try:
                handshake.start()
            except RuntimeError:  # no thread to be had (a container's process limit): admit it here
                self._handshake(sock)

    def _handshake(self, sock: socket.socket) -> None:
        """Admit ``sock`` if it sends the key within ``HANDSHAKE_TIMEOUT``; else drop it."""
        client = None
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
            if self._broken is not None:
                sock.sendall(REFUSED_BROKEN)  # nobody would read its requests
                raise OSError("the reader died")
            sock.sendall(ADMITTED)
            with self._lock:
                self._next_id += 1
                client = Connection(sock, self._next_id, self._backlog)
            client.wire.send(("bells",), fds=[client.headers_fd, client.requests_bell, client.replies_bell])
        except OSError:
            if client is not None:
                client.close()
            sock.close()
            return
        finally:
            if client is not None:
                os.close(client.headers_fd)  # the mapping keeps the memory
        with self._lock:
            if not self._closed and self._broken is None:
                self._pending.append(client)
                self._wake()
                return
            broken = self._broken
        if broken is not None:
            client.send(("broken", broken))  # it died while this client was being admitted
        client.close()

    # -- requests -------------------------------------------------------------------------

    def _read_forever(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while True:
                with self._lock:
                    if self._closed:
                        break
                    for client in self._pending:
                        self._clients[client.ident] = client
                        selector.register(client.wire, selectors.EVENT_READ, (client, self._read))
                        selector.register(client.requests_bell, selectors.EVENT_READ, (client, self._rung))
                    self._pending.clear()
                    backlogged, self._backlogged = self._backlogged, set()
                for client in backlogged:  # wait for their sockets to take what waits in their outboxes
                    if client.ident in self._clients:
                        selector.modify(client.wire, selectors.EVENT_READ | selectors.EVENT_WRITE, (client, self._read))
                for key, events in selector.select():  # rung, written to, writable, hung up, or woken
                    if key.data is None:
                        os.read(self._wake_r, 4096)
                        continue
                    client, handle = key.data
                    if client.ident not in self._clients:
                        continue  # dropped a moment ago, when its other descriptor was ready
                    if events & selectors.EVENT_WRITE and client.flush():
                        selector.modify(client.wire, selectors.EVENT_READ, key.data)  # all sent
                    if not (client.alive and (not events & selectors.EVENT_READ or handle(client))):
                        selector.unregister(client.wire)
                        selector.unregister(client.requests_bell)
                        self._drop(client)
            last_word = self._last_word()
            for client in list(self._clients.values()):  # closed: this thread alone releases what it reads
                client.send(last_word)
                self._drop(client)
        except BaseException as err:
            _log.exception("the process hub's reader died")  # only a bug gets here
            self._break(f"the server's process hub failed: {err!r}")
        finally:
            selector.close()
            with self._lock:  # last: a close() that gave up waiting for this thread leaves the pipe to it
                pipe, self._wake_w = (self._wake_r, self._wake_w), -1
                close_all(pipe)

    def _wake(self) -> None:
        """Wake the reader (under ``_lock``), unless it has ended."""
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")

    def _backlog(self, client: Connection) -> None:
        """``client``'s socket took less than was sent: the reader sends the rest when it can."""
        with self._lock:
            if not self._closed:
                self._backlogged.add(client)
                self._wake()

    def _break(self, reason: str) -> None:
        """The reader died: nobody would read a worker's requests, so every worker's calls fail now."""
        with self._lock:
            self._broken = reason  # a worker that connects later is told at once (``_handshake``)
            clients = list(self._clients.values()) + self._pending
            self._pending.clear()
        for client in clients:
            client.send(("broken", reason))
            self._drop(client)

    def _rung(self, client: Connection) -> bool:
        """Take in the requests of every lane ``client`` rang since the last time."""
        try:
            bits = os.eventfd_read(client.requests_bell)
        except BlockingIOError:
            return True
        while bits:
            low = bits & -bits
            bits ^= low
            self._from_lane(client, low.bit_length() - 1)
        return True

    def _from_lane(self, client: Connection, index: int) -> None:
        seq = 0
        try:
            if index >= len(client.lanes):
                raise BadRequestError(f"the client rang lane {index}; it has {len(client.lanes)}")
            lane, headers = client.lanes[index], client.headers
            assert headers is not None  # (a dropped client is never read)
            seq = headers.seq(index)
            if seq <= (lane.seq or 0):
                return  # rung twice for one request (a bug of the client's): taken once
            _, rows, batch_shape, mode = headers.read(index)
            if rows > lane.inputs.capacity or rows != math.prod(batch_shape):
                raise BadRequestError(
                    f"lane {index}: {rows} rows of batch shape {list(batch_shape)}; it holds {lane.inputs.capacity}"
                )
            lane.seq = seq  # the last request taken from this lane
            # Views of the lane: the client writes it again only once this request is answered.
            td = TensorDict(dict(zip(lane.inputs.keys, lane.inputs.views(rows, batch_shape))), batch_size=batch_shape)
            request = self._intake.request(ProcessRequest, td, client.caller, mode, client=client, seq=seq, lane=lane)
            self._queue(client, request)
            self.arrived["lane"] += 1
        except BaseException as err:  # whatever the lane held, it fails this request only
            if seq:
                client.send(done_message(seq, err))
            else:
                _log.error("worker client %d rang lane %d with no request in it: %r", client.ident, index, err)

    def _read(self, client: Connection) -> bool:
        """Handle what ``client`` sent; False once it is gone (or sent what is not a message)."""
        try:
            messages = client.wire.read()
        except (EOFError, OSError):
            return False
        except Exception:  # not a frame of ours: the client is not speaking our protocol
            _log.exception("undecodable message from worker client %d; dropping it", client.ident)
            return False
        for message in messages:
            self._handle(client, message)
        return True

    def _handle(self, client: Connection, message: Any) -> None:
        try:
            _, seq, interaction, payload = message
        except (TypeError, ValueError):
            _log.error("malformed message from worker client %d: %r", client.ident, message)
            return
        try:
            mode = None if interaction is None else _MODES[interaction]
            td = pickle.loads(payload)
            request = self._intake.request(ProcessRequest, td, client.caller, mode, client=client, seq=seq)
            self._offer_lane(client, request)  # before it can be answered: the client has the lane by then
            self._queue(client, request)
            self.arrived["socket"] += 1
        except BaseException as err:  # whatever the message did, it fails this request only
            client.send(done_message(seq, err))

    def _queue(self, client: Connection, request: ProcessRequest) -> None:
        """Count ``request`` in flight until its reply, and put it."""
        with client.send_lock:
            client.in_flight += 1
        try:
            self._intake.put(request)
        except BaseException:
            with client.send_lock:
                client.in_flight -= 1
            raise

    def _offer_lane(self, client: Connection, request: Request) -> None:
        """A request came pickled: give the client a lane for the next ones, if it has fewer than it uses.

        Called before ``request`` is queued, so that the lane reaches the
        client before any reply can (both go down its socket, in order).
        """
        inputs, shape = request.inputs, request.batch_shape
        if client.varying or len(shape) > MAX_BATCH_DIMS or len(client.lanes) >= MAX_LANES:
            return
        if not all(storable(v) and on_host(v) for v in inputs):
            return  # non-tensor or device inputs always travel pickled
        dims = 1 if shape else 0
        specs = [(k, v.dtype, tuple(v.shape[dims:])) for k, v in zip(self._keys, inputs)]
        lanes = client.lanes
        if lanes and lanes[0].inputs.specs() != specs:
            client.varying = True  # variable-length inputs: one slot per length would cost more than it saves
            return
        if sum(lane.inputs.capacity >= request.rows for lane in lanes) >= client.in_flight + 1:  # with this one
            return  # as many lanes as requests in flight: it came pickled for a reason of its own
        largest = max((lane.inputs.capacity for lane in lanes), default=0)
        capacity = largest if request.rows <= largest else max(request.rows, 2 * largest)
        made = new_slot(specs, capacity)
        if made is None:
            return
        slot, fd = made
        lanes.append(Lane(len(lanes), slot))
        client.send(("lane", len(lanes) - 1, *slot.describe()), fds=[fd])

    def _drop(self, client: Connection) -> None:
        with client.send_lock:  # a reply being written finishes first; later ones see alive=False
            client.close()
        client.lanes, client.headers = [], None  # the memory goes with the last view
        self._clients.pop(client.ident, None)  # last: ``clients`` counts it until all of it is released

    # -- lifecycle ------------------------------------------------------------------------

    def close(self, timeout: float | None = 5.0) -> bool:
        """Stop accepting and tell every client the server closed; whether both threads ended.

        The reader tells the clients it reads and releases them on its way
        out, so that no descriptor it may be reading is closed under it
        (``timeout`` may end the wait for it first).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            pending, self._pending = self._pending, []
            self._wake()
        # The socket file goes first: a client that finds none knows the server closed, while one refused at
        # a file with nobody listening knows its process died (ProcessClient).
        self._finalizer()
        # Ends the accept thread's accept(), which closing the listening socket does not (Linux). Not by
        # connecting to the file: at exit its finalizer may have run before this one.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        last_word = self._last_word()
        for client in pending:  # admitted, not yet read
            client.send(last_word)
            self._drop(client)
        for thread in (self._accepter, self._reader):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not (self._accepter.is_alive() or self._reader.is_alive())

    def _last_word(self) -> tuple:
        """What the clients hear as the hub closes: that the server closed, or that it had broken (as a thread's
        later call says)."""
        broken = self._intake.queue.broken
        return ("closed",) if broken is None else ("broken", f"the server broke: {broken!r}")

    def _forget(self) -> None:
        """In a forked child: close every descriptor of the parent's hub, touch nothing else."""
        self._closed = True
        self._finalizer.detach()
        for client in list(self._clients.values()) + self._pending:
            client.close()
        self._listener.close()
        if self._wake_w >= 0:  # (else the parent's reader had closed the pipe)
            close_all((self._wake_r, self._wake_w))
