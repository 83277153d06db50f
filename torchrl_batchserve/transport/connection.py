"""One worker's connection to the :class:`~torchrl_batchserve.transport.hub.ProcessHub`, as the hub holds it.

A :class:`Connection` owns the worker's socket and outbox, its two bells, its
lane headers and its lanes; a :class:`ProcessRequest` is one of its requests,
whose outcome :meth:`Connection.reply` sends back: the outputs written into
the request's lane and the reply bell rung, or a ``done`` message over the
socket.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from torchrl_batchserve.errors import PolicyError, portable
from torchrl_batchserve.replica import host_copies, to_host
from torchrl_batchserve.request import Request
from torchrl_batchserve.transport.slots import Headers, Lane, Slot, storable
from torchrl_batchserve.transport.wire import Wire, dumps, frame

__all__ = ["Connection", "ProcessRequest", "close_all", "done_message", "new_slot"]

_log = logging.getLogger(__name__)


class Connection:
    """A connected worker: its socket, its bells and headers, and its lanes.

    Nothing waits on its socket: what the socket does not take at once waits
    in its outbox, in order, and the reader sends it when the socket is
    writable again (``on_backlog`` tells it). A worker that stops reading
    (stopped, or its threads starved) holds up no serve loop.
    """

    def __init__(self, sock: socket.socket, ident: int, on_backlog: Callable[[Connection], None]) -> None:
        self.wire = Wire(sock, receives_fds=False)  # workers send no descriptors
        self.ident = ident
        self.caller = ("process", ident)
        self.send_lock = threading.Lock()
        self.outbox: deque[tuple[memoryview, list[int]]] = deque()  # (the rest of a frame, its descriptors)
        self._on_backlog = on_backlog
        self.requests_bell = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.replies_bell = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        headers, self.headers_fd = Headers.create()
        self.headers: Headers | None = headers
        self.lanes: list[Lane] = []
        self.in_flight = 0  # requests accepted and not yet answered (under send_lock)
        self.varying = False
        self.alive = True
        self.closed = False

    def send(self, message: Any, fds: Sequence[int] = ()) -> None:
        """Send ``message``, with the descriptors ``fds`` if any (closed here, sent or not)."""
        with self.send_lock:
            self._send(message, fds)

    def _send(self, message: Any, fds: Sequence[int] = ()) -> None:
        """Send ``message``, or queue it behind what waits; ``fds`` are closed once sent (or not to be)."""
        try:
            data = memoryview(frame(message))
        except BaseException:
            close_all(fds)
            raise
        if not self.alive:
            close_all(fds)
            return
        self.outbox.append((data, list(fds)))
        if len(self.outbox) == 1 and not self.flush_locked():
            self._on_backlog(self)

    def flush(self) -> bool:
        """Send what waits in the outbox, as far as the socket takes it; whether it is empty."""
        with self.send_lock:
            return self.flush_locked()

    def flush_locked(self) -> bool:
        outbox = self.outbox
        try:
            while outbox and self.alive:
                data, fds = outbox[0]
                sent = self.wire.send_some(data, fds)
                if sent:  # they went with the first byte: out of the outbox first, so a fork meanwhile gives a
                    taken = fds[:]  # child none to close again (by then another file's number)
                    fds.clear()
                    close_all(taken)
                if sent < len(data):
                    outbox[0] = (data[sent:], fds)
                    return False
                outbox.popleft()
        except OSError:
            self.alive = False  # the worker is gone; the reader sees EOF too
        if not self.alive:
            while outbox:
                close_all(outbox.popleft()[1])
        return True

    def reply(self, request: ProcessRequest) -> None:
        """Send ``request``'s outcome: its outputs in its lane, or over the socket.

        It fails this request alone, never the serve loop that completes it.
        """
        with self.send_lock:
            lane, seq = request.lane, request.seq
            self.in_flight -= 1
            try:
                if request.error is not None:
                    self._send(done_message(seq, request.error))
                    return
                if lane is None:
                    self._send_outputs(request)
                else:
                    with host_copies(request.values):  # the lane's copies, device outputs included
                        self._reply(request, lane)
            except Exception as err:  # e.g. no memory for a slot
                self._send(done_message(seq, err))

    def _send_outputs(self, request: ProcessRequest) -> None:
        """The outputs pickled; ones that do not pickle fail the request with a :class:`PolicyError`.

        A request made on the CPU gets them on the CPU, as through a lane
        (a worker's device inputs travel pickled, and keep their device).
        """
        keys, values = list(request.keys), list(request.values)
        if request.device is not None and request.device.type == "cpu":
            values = [to_host(v) for v in values]
        try:
            message = done_message(request.seq, values=values, keys=keys)
        except Exception as err:
            error = PolicyError(f"out_keys {keys}: the outputs do not pickle, so they cannot reach a worker ({err!r})")
            message = done_message(request.seq, error)
        self._send(message)

    def _reply(self, request: ProcessRequest, lane: Lane) -> None:
        values, keys, rows, shape = list(request.values), list(request.keys), request.rows, request.batch_shape
        slot = lane.outputs
        if slot is not None and slot.fits(values, rows, shape):
            slot.write(values, rows, shape)  # device outputs too: a worker gets its results on the CPU
            try:
                if self.alive:
                    os.eventfd_write(self.replies_bell, 1 << lane.index)
            except OSError:  # a client that rang a lane twice overflowed its bell: it gets nothing more
                self.alive = False
            return
        if not all(storable(v) for v in values):
            self._send_outputs(request)  # non-tensor outputs: pickled
            return
        # The lane's first outputs (or of a new shape): a new output slot comes with this reply.
        specs = [(k, v.dtype, tuple(v.shape[len(shape) :])) for k, v in zip(keys, values)]
        made = new_slot(specs, lane.inputs.capacity)
        if made is None:
            self._send_outputs(request)
            return
        slot, fd = made
        slot.write(values, rows, shape)
        lane.outputs = slot
        self._send(done_message(request.seq, out=slot.describe()), fds=[fd])

    def close(self) -> None:
        """Close every descriptor, once (the caller holds ``send_lock`` or is the only thread left).

        Once, whoever calls again: a number closed twice may by then be
        another file's.
        """
        self.alive = False
        self.flush_locked()  # (dead: drops what waits, its descriptors closed)
        if self.closed:
            return
        self.closed = True
        for close in (self.wire.close, lambda: os.close(self.requests_bell), lambda: os.close(self.replies_bell)):
            try:
                close()
            except OSError:
                pass


def new_slot(specs: Sequence[tuple[Any, Any, tuple[int, ...]]], capacity: int) -> tuple[Slot, int] | None:
    """A new slot and its descriptor; ``None`` where the process has no descriptor or memory left for one.

    Lanes only save time: without one, requests and replies travel pickled.
    Said once a process, on the ``torchrl_batchserve`` logger.
    """
    global _SLOTS_WARNED
    try:
        return Slot.create(specs, capacity)
    except OSError as err:
        if not _SLOTS_WARNED:
            _SLOTS_WARNED = True
            _log.warning(
                "no shared-memory lane for a worker (%s): its requests and replies travel pickled, which is "
                "slower; raise the open-file limit (ulimit -n) if it is out of descriptors",
                err,
            )
        return None


_SLOTS_WARNED = False


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


def done_message(
    seq: int, error: BaseException | None = None, values: Any = None, keys: Any = None, out: Any = None
) -> tuple:
    """The ``done`` message of request ``seq``: its outcome pickled on its own (``None``: outputs in the lane).

    So an outcome the worker cannot unpickle (an error or an output of a class
    it cannot import) fails that request alone, not the worker's connection.
    """
    outcome = None
    if error is not None or values is not None:
        outcome = dumps((None if error is None else portable(error), values, keys))
    return ("done", seq, outcome, out)


class ProcessRequest(Request):
    """A request from a worker process; its outcome goes back through its lane or the client's socket."""

    __slots__ = ("client", "lane", "seq")

    def __init__(self, *args: Any, client: Connection, seq: int, lane: Lane | None = None) -> None:
        super().__init__(*args)
        self.client = client
        self.seq = seq
        self.lane = lane  # where its inputs are and its outputs go (None: pickled both ways)

    def claim(self) -> bool:
        return not self.done and self.client.alive

    def _wake(self) -> None:
        self.client.reply(self)
