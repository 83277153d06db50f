"""The worker-process side: a RemotePolicy's endpoint in another process.

Connects to the server's :class:`~torchrl_batchserve.transport.hub.ProcessHub`
on first use (so a policy can be pickled, unpickled and never called), then
serves any number of concurrent callers of that process, one lane each
(:mod:`~torchrl_batchserve.transport.hub` has the protocol). Waiting is a
``poll`` of the reply bell and the socket: a reply, a ``closed`` notice, or
end-of-file when the server's process is gone; nothing waits forever. Each
request has a sequence number, and a reply to an earlier, interrupted call
is dropped.

One waiter at a time is the *reader*: it polls for everyone and hands each
reply to the caller of its ``seq``. A blocking caller reads while it waits;
an asyncio task (its event loop must not block) and a ``submit`` (it returns
at once) never do: they write their request into a free lane (else a thread
of the client's pool sends it and waits for it), and while only they wait,
one thread of the pool reads for them, until none is left that its caller
did not cancel (so no thread holds up the process's exit for a reply nobody
waits for). Their futures are
settled away from the reader, one call per pass: a task's in its event loop
(``call_soon_threadsafe``), a submit's in another pool thread, where its
callbacks may call the client again.
"""

from __future__ import annotations

import asyncio
import errno
import os
import pickle
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

from tensordict import TensorDictBase

from torchrl_batchserve.errors import BatchServeError, ServerBrokenError, ServerClosedError, own_copy
from torchrl_batchserve.gate import GATE
from torchrl_batchserve.intake import CURRENT
from torchrl_batchserve.layout import request_entries
from torchrl_batchserve.request import call_in_loop, write_outputs
from torchrl_batchserve.transport.hub import ADMITTED, HANDSHAKE_TIMEOUT, REFUSED_BROKEN
from torchrl_batchserve.transport.slots import MAX_BATCH_DIMS, Headers, Lane, Slot, on_host
from torchrl_batchserve.transport.wire import Wire, dumps

__all__ = ["ProcessClient"]

CANCEL_CHECK = 1.0  # seconds after which a pool thread that reads for tasks and submits sees they were cancelled

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
    else's. Each request takes a free lane that fits it (or travels pickled,
    and the hub offers a lane for the next). One waiter reads for all (see
    the module docstring) and hands each reply to the caller whose ``seq`` it
    carries; a reply nobody waits for (an interrupted or cancelled call) is
    dropped.
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
        self._headers: Headers | None = None
        self._bells: tuple[int, int] | None = None  # (requests, replies)
        self._lanes: list[Lane] = []
        self._closed = False
        self._failure: BaseException | None = None  # what every waiter gets once the server is gone
        self._seq = 0
        # seq -> (rows, shape, lane, waiter) until answered; waiter: None for a blocked thread, else
        # (loop, future, td): an asyncio task's future and loop, or a submit's Future and None
        self._waiting: dict[int, tuple[int, tuple[int, ...], Lane | None, Any]] = {}
        self._replies: dict[int, tuple[Any, Any, Any]] = {}  # seq -> (error, keys, values), for threads
        self._settled: list[tuple[Any, tuple[Any, Any, Any]]] = []  # (waiter, reply) of futures, to settle
        self._reading = False  # someone polls the bell and the socket for everyone
        self._executor: ThreadPoolExecutor | None = None
        self._release: Any = lambda: None  # closes the bells (once connected)

    def process_address(self) -> tuple[str, bytes, list]:
        """Where another copy connects (a copy of a copy is a client of the same server)."""
        return self.address, self.authkey, self.in_keys

    def __reduce__(self) -> tuple:
        return ProcessClient, self.process_address()

    def _connection(self) -> Wire:
        if self._closed:
            if isinstance(self._failure, ServerBrokenError):  # died or broke, not closed: as an in-process call says
                error = ServerBrokenError(f"the server is broken: {self._failure}")
                error.__cause__ = self._failure
                raise error
            raise ServerClosedError("the server is closed and accepts no more requests")
        while self._conn is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn = None
            try:
                sock.settimeout(HANDSHAKE_TIMEOUT)
                _connect(sock, self.address)
                sock.sendall(self.authkey)
                answer = sock.recv(1)
                if answer == REFUSED_BROKEN:
                    sock.close()
                    self._closed = True
                    raise ServerBrokenError(f"the server at {self.address} serves no worker processes: its hub failed")
                if answer != ADMITTED:
                    raise OSError("the hub refused the connection")
                conn = Wire(sock)  # blocking: a hub that admitted it sends the bells at once, or hangs up
                if conn.recv() != ("bells",):
                    raise OSError("the hub sent no bells")
                self._headers = Headers.attach(conn.take_fd())
                self._bells = conn.take_fd(), conn.take_fd()
                # the socket and the bells go with the client
                self._release = weakref.finalize(self, _close_connection, self._bells, conn)
            except (OSError, EOFError) as err:
                (sock if conn is None else conn).close()  # the wire closes descriptors it received, not taken
                if isinstance(err, TimeoutError):
                    # It listens (a dead hub refuses, a closed one resets): slow to admit, with thousands of
                    # copies connecting at once. Again.
                    continue
                self._closed = True
                if _died(self.address):
                    self._failure = ServerBrokenError(f"the server at {self.address} is gone: its process ended")
                    raise own_copy(self._failure) from err
                where = (  # no such socket here: closed, or this copy travelled to another host
                    "; a pickled RemotePolicy reaches a server on its own host only (actors on other hosts: "
                    "torchrl_batchserve.ray.serve_on_ray)"
                    if isinstance(err, FileNotFoundError)
                    else ""
                )
                raise ServerClosedError(f"the server at {self.address} is closed or gone ({err}){where}") from err
            self._conn = conn
        return self._conn

    def call(self, td: TensorDictBase, interaction: Any = CURRENT) -> TensorDictBase:
        """Serve ``td`` and block until its outputs are written into it (``interaction``: default, the current)."""
        write_outputs(td, *self._outputs(td, _mode(interaction)))
        return td

    def _outputs(self, td: TensorDictBase, mode: Any, abandoned: Callable[[], bool] | None = None) -> tuple[Any, Any]:
        """Send ``td``'s request and block until its reply: the ``(keys, values)`` of its outputs.

        ``abandoned``: whether its caller gave up on it (then ``CancelledError``, within ``CANCEL_CHECK``).
        """
        conn, seq = self._send(td, mode)  # type: ignore[misc]
        try:
            error, keys, values = self._wait(conn, seq, abandoned)
        finally:
            with self._cond:  # (interrupted: its reply is dropped when it comes)
                self._waiting.pop(seq, None)
                self._replies.pop(seq, None)
        if error is not None:
            raise error
        return keys, values

    async def acall(self, td: TensorDictBase) -> TensorDictBase:
        """``await``-able :meth:`call`; the event loop never waits on the server.

        A request that fits a free lane is written from the loop; any other
        (the first, one that travels pickled) is sent and waited for by a
        thread of the client's pool. Either way its reply comes back to the loop.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[TensorDictBase] = loop.create_future()
        self._send_soon(td, GATE.callers_mode(), (loop, future, td))
        return await future  # (cancelled: so is ``future``, and its reply is dropped when it comes)

    def _send(self, td: TensorDictBase, mode: Any, task: Any = None) -> tuple[Wire, int] | None:
        """Send ``td``'s request, to run under the interaction type ``mode``, and register its waiter.

        Returns ``(connection, seq)``. ``task``: the waiter of a caller that does not block (an asyncio
        task, a ``submit``), which sends only through a free lane of a
        connected client (``None`` otherwise: the caller waits in :meth:`_wait`).
        """
        inputs = request_entries(td, self.in_keys)  # a bad request is refused here, with the hub's words
        batch_shape = tuple(td.batch_size)
        rows = td.batch_size.numel()
        with self._cond:
            if task is not None and self._conn is None and not self._closed:
                return None  # connecting may block
            conn = self._connection()  # closed: ServerClosedError at once
            lane = self._free_lane(inputs, rows, batch_shape)
            if task is not None and lane is None:
                return None  # sending pickled may block
            self._seq += 1
            seq = self._seq
            try:
                if lane is not None:
                    lane.inputs.write(inputs, rows, batch_shape)
                    self._headers.write(lane.index, seq, rows, batch_shape, mode)  # type: ignore[union-attr]
                    lane.seq = seq
                    os.eventfd_write(self._bells[0], 1 << lane.index)  # type: ignore[index]
                else:
                    payload = dumps(td.select(*self.in_keys))
                    conn.send(("req", seq, None if mode is None else mode.value, payload))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the hub's end is shut: its last word ("closed"), or the end of the socket, answers it
            except OSError as err:
                self._closed = True
                raise ServerClosedError(f"the server is closed or gone ({err})") from err
            self._waiting[seq] = (rows, batch_shape, lane, task)
            if task is not None and not self._reading:
                self._start_reader(conn)
        return conn, seq

    def _send_soon(self, td: TensorDictBase, mode: Any, waiter: Any) -> None:
        """Send the request of a caller that does not block: now through a free lane, else from the pool.

        A pool thread sends it and waits for its reply as a blocking caller would, unless or until its
        caller cancels it. (So a task whose request travels pickled, which costs the server more, is back
        later than one in a lane: lanes, once free, mostly go to requests that fit them.)
        """
        if self._send(td, mode, waiter) is not None:
            return

        def serve() -> None:
            future = waiter[1]
            if future.done():
                return  # cancelled before it was sent
            reply: tuple[Any, Any, Any]
            try:
                reply = (None, *self._outputs(td, mode, future.done))
            except BaseException as err:  # (its caller waits for its future, not for this job)
                reply = (err, None, None)
            self._settle([(waiter, reply)])  # (cancelled meanwhile: dropped there)

        self._pool().submit(serve)

    def _free_lane(self, inputs: list[Any], rows: int, batch_shape: tuple[int, ...]) -> Lane | None:
        """The smallest free lane that ``inputs`` fit (the caller holds the lock).

        None for device inputs: in a lane they would reach the server on the
        CPU, and their results come back there; pickled, they keep their device.
        """
        if len(batch_shape) > MAX_BATCH_DIMS or not all(on_host(v) for v in inputs):
            return None
        best = None
        for lane in self._lanes:
            if lane.seq is None and (best is None or lane.inputs.capacity < best.inputs.capacity):
                if lane.inputs.fits(inputs, rows, batch_shape):
                    best = lane
        return best

    def _wait(self, conn: Wire, seq: int, abandoned: Callable[[], bool] | None = None) -> tuple[Any, Any, Any]:
        """The reply to ``seq``: read here, or handed over by whoever reads (``abandoned``: see ``_outputs``)."""
        check = None if abandoned is None else CANCEL_CHECK
        given_up = abandoned or (lambda: False)
        with self._cond:
            while True:
                if seq in self._replies:
                    return self._replies.pop(seq)
                if self._failure is not None:
                    raise own_copy(self._failure)
                if given_up():
                    raise CancelledError
                if not self._reading:
                    self._reading = True
                    break
                self._cond.wait(check)
        self._read(conn, lambda: seq in self._replies or given_up(), check)
        with self._cond:
            if seq in self._replies:
                return self._replies.pop(seq)
            if self._failure is None:
                raise CancelledError
            raise own_copy(self._failure)

    def _awaited(self) -> bool:
        """Whether a task or a submit still waits for its reply (the caller holds the lock).

        Not one whose caller cancelled it meanwhile (its reply is dropped when it comes): a pool thread
        reading for it would keep the process from exiting (its pool's threads are joined at exit) for
        as long as the server takes to answer.
        """
        return any(waiter is not None and not waiter[1].done() for *_, waiter in self._waiting.values())

    def _start_reader(self, conn: Wire) -> None:
        """Read for the callers that do not block, from a pool thread (the caller holds the lock; nobody reads)."""
        self._reading = True
        self._pool().submit(self._read, conn, lambda: not self._awaited(), CANCEL_CHECK)

    def _read(self, conn: Wire, done: Callable[[], bool], check_every: float | None = None) -> None:
        """Be the reader until ``done()`` or the server is gone, then hand the role on.

        ``check_every``: the seconds after which ``done()`` is asked again without a reply (a watchdog for
        cancellations, which wake nobody); ``None``: only when a reply or a message comes.
        """
        bell = self._bells[1]  # type: ignore[index]
        ready = select.poll()
        ready.register(conn.fileno(), select.POLLIN)
        ready.register(bell, select.POLLIN)
        timeout = None if check_every is None else check_every * 1000
        try:
            while True:
                with self._cond:
                    if done() or self._failure is not None:
                        return
                events = ready.poll(timeout)
                try:
                    messages = conn.read() if any(fd != bell for fd, _ in events) else []
                except (EOFError, OSError) as err:
                    failure = ServerBrokenError(
                        f"this process cannot take the server's replies: {err.strerror}"
                        if isinstance(err, OSError) and err.errno == errno.EMFILE  # (Wire.read)
                        else "the server's process ended with requests of this process in flight"
                    )
                    failure.__cause__ = err
                    with self._cond:
                        self._fail(failure)
                    return
                with self._cond:
                    self._replied(bell)
                    for message in messages:
                        self._dispatch(conn, message)
                    settled, self._settled = self._settled, []
                self._settle(settled)
        except Exception as err:  # not a caller's interruption: nobody could read on
            failure = ServerBrokenError(f"reading the server's replies failed: {err!r}")
            with self._cond:
                self._fail(failure)
            raise own_copy(failure) from err  # to a caller that was reading, as to every other
        finally:
            with self._cond:
                self._reading = False
                left = self._waiting.values()
                if self._failure is None and self._awaited() and all(waiter is not None for *_, waiter in left):
                    self._start_reader(conn)  # only tasks and futures wait: they cannot read
                settled, self._settled = self._settled, []
                self._cond.notify_all()  # a waiting thread takes over the reading
            self._settle(settled)

    def _settle(self, settled: list[tuple[Any, tuple[Any, Any, Any]]]) -> None:
        """Settle each waiter's future, one call per event loop (or pool job) and pass.

        A task's future is settled in its loop; a submit's in a pool thread,
        never in the reader: its callbacks run there and may call this
        client again.
        """
        by_loop: dict[Any, list[Any]] = {}
        for waiter, reply in settled:
            by_loop.setdefault(waiter[0], []).append((waiter, reply))
        for loop, replies in by_loop.items():
            if loop is None:
                self._pool().submit(_set_results, replies)
                continue
            call_in_loop(loop, _set_results, replies)

    def _fail(self, failure: BaseException) -> None:
        """The server is gone or closed: every waiter gets ``failure`` (the caller holds the lock)."""
        self._closed, self._failure = True, failure
        for seq, (_, _, _, waiter) in list(self._waiting.items()):
            if waiter is not None:
                self._settled.append((waiter, (own_copy(failure), None, None)))
                del self._waiting[seq]
        self._cond.notify_all()

    def _replied(self, bell: int) -> None:
        """Read out every lane the hub rang (the reader holds the lock)."""
        try:
            bits = os.eventfd_read(bell)
        except BlockingIOError:
            return
        while bits:
            low = bits & -bits
            bits ^= low
            lane = self._lanes[low.bit_length() - 1]
            if lane.seq is not None:
                self._complete(lane.seq, None, None, None)

    def _complete(self, seq: int, error: Any, keys: Any, values: Any) -> None:
        """Hand ``seq`` its reply (``values`` ``None``: in its lane's output slot) and free its lane."""
        waiting = self._waiting.pop(seq, None)  # answered: ``_waiting`` holds only who still waits
        lane = self._lane_of(seq) if waiting is None else waiting[2]  # (None: an interrupted call's)
        if error is None and values is None and lane is not None and waiting is not None:
            keys, values = lane.outputs.keys, lane.outputs.read(waiting[0], waiting[1])  # type: ignore[union-attr]
        if lane is not None and lane.seq == seq:
            lane.seq = None  # read out (or nobody waits): free for the next request
        if waiting is None:
            return
        task = waiting[3]
        if task is not None:
            self._settled.append((task, (error, keys, values)))
        else:
            self._replies[seq] = (error, keys, values)
            self._cond.notify_all()

    def _lane_of(self, seq: int) -> Lane | None:
        """The lane ``seq`` is on (``None``: it travels pickled), whether or not its caller still waits."""
        waiting = self._waiting.get(seq)
        if waiting is not None:
            return waiting[2]
        return next((lane for lane in self._lanes if lane.seq == seq), None)

    def _dispatch(self, conn: Wire, message: Any) -> None:
        """Take in one message from the hub (the reader holds the lock)."""
        kind = message[0]
        if kind == "lane":
            _, index, fields, capacity, size = message
            assert index == len(self._lanes), "lanes are offered in order"
            self._lanes.append(Lane(index, Slot.attach(fields, capacity, size, conn.take_fd())))
            return
        if kind == "closed":
            self._fail(ServerClosedError("the server was closed before this request ran"))
            return
        if kind == "broken":
            self._fail(ServerBrokenError(message[1]))
            return
        _, seq, outcome, out = message
        error = values = keys = None
        if outcome is not None:
            try:
                error, values, keys = pickle.loads(outcome)
            except Exception as err:  # an error or an output of a class this process cannot import
                error = BatchServeError(f"the server's reply cannot be read in this process: {err!r}")
        if out is not None:  # the lane's new output slot, its outputs in it
            fields, capacity, size = out
            slot = Slot.attach(fields, capacity, size, conn.take_fd())
            lane = self._lane_of(seq)
            if lane is not None:
                lane.outputs = slot
        self._complete(seq, error, keys, values)

    def _pool(self) -> ThreadPoolExecutor:
        with self._cond:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=256, thread_name_prefix="batchserve-client")
            return self._executor

    def submit(self, td: TensorDictBase, interaction: Any = CURRENT) -> Future[TensorDictBase]:
        """Send ``td``; the Future resolves to it with its outputs written.

        Sent at once through a free lane (its reply settles the Future), or
        else from a pool thread, which waits for its reply; under the
        interaction type in effect now (or ``interaction``). Cancelled, its reply is dropped.
        """
        future: Future[TensorDictBase] = Future()
        self._send_soon(td, _mode(interaction), (None, future, td))
        return future

    def _forget(self) -> None:
        """In a forked child: drop the parent's connection (its descriptors closed), connect anew on use."""
        release = self._release
        self._reset()  # the parent's lock may have been held by another thread at the fork
        release()


def _mode(interaction: Any) -> Any:
    """The interaction type a request runs under: ``interaction``, or the caller's for ``CURRENT``.

    The caller's: the one in effect, unless a forward of a server of this process replaced it meanwhile
    (:meth:`~torchrl_batchserve.gate.InteractionGate.callers_mode`).
    """
    return GATE.callers_mode() if interaction is CURRENT else interaction


def _set_results(replies: list[Any]) -> None:
    for waiter, reply in replies:
        _set_result(waiter, reply)


def _set_result(waiter: tuple[Any, Any, TensorDictBase], reply: tuple[Any, Any, Any]) -> None:
    """Resolve ``waiter``'s future to its TensorDict with the outputs written, or to the error."""
    loop, future, td = waiter
    error, keys, values = reply
    try:
        if loop is None and not future.set_running_or_notify_cancel():  # a submit's: cannot be cancelled from now
            return  # cancelled by its caller
        if future.done():
            return  # an asyncio task's, cancelled
        if error is not None:
            future.set_exception(error)
            return
        try:
            write_outputs(td, keys, values)
        except BaseException as err:  # a write into the caller's td failed
            future.set_exception(err)
        else:
            future.set_result(td)
    except InvalidStateError:
        pass  # cancelled a moment ago: nobody waits


def _connect(sock: socket.socket, address: str) -> None:
    """Connect ``sock`` (which has a timeout) to the hub, waiting for room in its backlog.

    A Unix socket with a timeout is refused at once (``EAGAIN``) while the
    listener's backlog of connections not yet accepted is full (thousands of
    workers connecting at once), where a blocking one would wait: so try
    again. A full backlog is a hub that listens; one that died refuses.
    """
    while True:
        try:
            sock.connect(address)
            return
        except BlockingIOError:
            time.sleep(0.001)


def _died(address: str) -> bool:
    """Whether the hub at ``address``, which a connection just failed to reach, died.

    A hub that dies leaves its socket file with nobody listening (a refused
    connection); one that closes removes the file first. Asked once more, the
    file tells which, however the connection failed (refused, or cut during
    the handshake).
    """
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(HANDSHAKE_TIMEOUT)
            probe.connect(address)
    except ConnectionRefusedError:
        return True
    except OSError:  # no file (it closed), or a failure that says nothing
        return False
    return False  # it listens: alive


def _close_connection(bells: tuple[int, ...], conn: Wire) -> None:
    conn.close()
    for fd in bells:
        try:
            os.close(fd)
        except OSError:
            pass
