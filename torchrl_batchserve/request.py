"""One record per request, and the three ways a result reaches its caller.

A :class:`Request` is made by an endpoint once its input passed validation,
travels through the queue and a serve loop, and is completed exactly once,
with :meth:`Request.finish` or :meth:`Request.fail`: whichever comes first
wins, later ones are ignored. How completion wakes the caller depends on how
it asked:

* :class:`BlockingRequest` (``remote(td)``): a lock the caller sleeps on,
  released by the serve loop; the caller writes its outputs after it wakes.
* :class:`FutureRequest` (``remote.submit(td)``): a real
  :class:`concurrent.futures.Future`.
* :class:`AsyncRequest` (``await remote.acall(td)``): an :class:`asyncio.Future`;
  :func:`resolve` settles all requests of one event loop with a single
  ``call_soon_threadsafe`` per batch, so thousands of tasks cost one wake-up.

A request's states: *queued* (in the queue), *taken* (in a batch; a
cancelled or abandoned one is dropped here by :meth:`Request.claim`),
*completed* (``done``). Nothing leaves the queue without being taken or
failed, and every taken request is completed by the serve loop's ``finally``
at the latest.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import InteractionType

from torchrl_batchserve.errors import ServerBrokenError, own_copy

__all__ = [
    "AsyncRequest",
    "BlockingRequest",
    "FutureRequest",
    "Relay",
    "Request",
    "call_in_loop",
    "fail_all",
    "resolve",
    "write_outputs",
]


class Request:
    """A request accepted by the server, from submission to completion.

    Args:
        td: the caller's TensorDict; outputs are written into it.
        inputs: the policy's in_key entries of ``td``, flattened to
            ``(rows, *feature_shape)`` when ``td`` has batch dimensions.
        rows: how many rows the request counts for in a batch.
        batch_shape: ``td.batch_size``; outputs are reshaped back to it.
        caller: an identity for the batching rule (thread, task or client).
        interaction: the caller's tensordict interaction type, under which its
            batch runs.
        device: where the outputs go.
        cost: the request's share of ``max_batch_cost`` (0 without ``cost_fn``).
        layout: the request's own layout while the server has none confirmed
            (the serve loop runs each layout as its own forward), else ``None``.

    ``cache_keys`` are its rows' keys when the server has an evaluation
    cache. ``extra`` is the collate's per-request note between ``collate`` and
    ``split`` (e.g. the length a padding collate trims outputs back to).
    """

    __slots__ = (
        "batch_shape",
        "cache_keys",
        "caller",
        "cost",
        "device",
        "done",
        "enqueued_at",
        "error",
        "extra",
        "inputs",
        "interaction",
        "keys",
        "layout",
        "nested",
        "rows",
        "td",
        "values",
    )
    loop: asyncio.AbstractEventLoop | None = None

    def __init__(
        self,
        td: TensorDictBase,
        inputs: tuple[Any, ...],
        rows: int,
        batch_shape: torch.Size,
        caller: Any,
        interaction: InteractionType | None,
        device: torch.device | None,
        cost: int = 0,
        layout: Any = None,
    ) -> None:
        self.td = td
        self.inputs = inputs
        self.rows = rows
        self.batch_shape = batch_shape
        self.caller = caller
        self.interaction = interaction
        self.device = device
        self.cost = cost
        self.layout = layout
        self.nested = False  # made inside a running forward of this process (gate.InteractionGate.inside)
        self.extra: Any = None
        self.cache_keys: list[Any] | None = None
        self.enqueued_at = time.monotonic()
        self.keys: Sequence[Any] = ()
        self.values: Sequence[Any] = ()
        self.error: BaseException | None = None
        self.done = False

    def claim(self) -> bool:
        """Whether the request should still run (False once its caller cancelled or left)."""
        return not self.done

    def finish(self, keys: Sequence[Any], values: Sequence[Any]) -> None:
        """Store the outputs of this request and wake its caller."""
        if self._store(keys, values, None):
            self._wake()

    def fail(self, error: BaseException) -> None:
        """Complete this request with ``error`` and wake its caller."""
        if self._store((), (), error):
            self._wake()

    def _store(self, keys: Sequence[Any], values: Sequence[Any], error: BaseException | None) -> bool:
        """Record the outcome once; False if the request was already completed."""
        if self.done:
            return False
        self.done, self.keys, self.values, self.error = True, keys, values, error
        return True

    def _wake(self) -> None:
        raise NotImplementedError

    def _result(self) -> TensorDictBase:
        if self.error is not None:
            raise self.error
        write_outputs(self.td, self.keys, self.values)
        return self.td


class BlockingRequest(Request):
    """A request whose caller blocks in :meth:`wait` until it is completed.

    Completed blocking requests are woken through a :class:`Relay`.
    """

    __slots__ = ("_lock", "abandoned", "next", "relay")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._lock = threading.Lock()
        self._lock.acquire()
        self.abandoned = False
        self.next: BlockingRequest | None = None
        self.relay: Relay | None = None

    def claim(self) -> bool:
        return not self.abandoned and not self.done

    def _wake(self) -> None:
        self._lock.release()

    def wait(self, is_alive: Callable[[], bool], check_every: float = 1.0) -> TensorDictBase:
        """Block until completed; fail if the serve loop died without answering.

        The periodic check is a watchdog, not a poll: completion wakes the
        caller at once. A caller interrupted while it waits (a
        ``KeyboardInterrupt``, a signal handler's exception) abandons the
        request: the serve loop drops it if it has not run yet.
        """
        try:
            while not self._lock.acquire(timeout=check_every):
                if self.done:  # completed, but not woken (yet): it waits no more, so no relay may wait for it
                    self.abandoned = True
                    break
                if not is_alive():
                    self.fail(ServerBrokenError("the serve loop stopped without answering"))
        except BaseException:
            self.abandoned = True  # before reading relay: a chain started later leaves this request out
            raise
        finally:
            relay = self.relay
            if relay is not None:
                relay.pass_on(self)  # woken or abandoned: the callers after it in the relay must not wait for it
        return self._result()


class Relay:
    """Wakes the callers of completed batches, and tells the serve loop when they are all awake.

    Waking a thread costs the waker a system call with the GIL held, and a
    woken thread that finds the GIL taken sleeps again until it is free:
    woken all at once, the callers of a batch pile up on the GIL with the
    serve loop and with each other. So the serve loop wakes only the first
    blocking caller of a batch, and each caller wakes the next as it wakes
    (:meth:`pass_on`). The callers of a batch completed while a chain is
    still being passed along join its end rather than start a second chain.
    The asyncio callers of a batch are settled by one callback in their event
    loop (:meth:`settle`), and count as waking until the tasks it resumed
    have run on to their next ``await``.

    A forward gives the GIL back at every torch op and must win it back from
    the waking callers each time; so when a batch took less time than waking
    its callers will, the serve loop waits until they are all awake
    (:meth:`wait_idle`) before it takes the next batch.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._awake = threading.Condition(self._lock)  # notified when every caller is awake
        self._tail: BlockingRequest | None = None
        self._loops = 0  # settle callbacks sent whose tasks have not all run yet
        self._round = 0  # a settle counts only in the round it was sent in (see wait_idle)
        self._started = 0.0
        self._woken = 0
        self._per_wake: deque[float] = deque(maxlen=7)  # seconds per caller woken, in recent wakes

    def start(self, chain: list[BlockingRequest]) -> None:
        """Wake ``chain`` one after another, after any chain running now.

        Its callers abandoned by now are left out; one abandoned later
        passes the chain on itself (it reads ``relay`` after it is
        abandoned, and its ``pass_on`` waits for the chain to be linked).
        """
        with self._lock:
            for request in chain:
                request.relay = self
            chain = [request for request in chain if not request.abandoned]
            if not chain:
                return
            for before, after in zip(chain, chain[1:]):
                before.next = after
            running = self._tail
            if running is not None:
                running.next = chain[0]
            else:
                self._started, self._woken = time.perf_counter(), 0
            self._tail = chain[-1]
        if running is None:
            chain[0]._lock.release()

    def pass_on(self, request: BlockingRequest) -> None:
        """``request``'s caller woke (or left): wake the next one."""
        with self._lock:
            follower, request.next = request.next, None
            self._woken += 1
            if follower is None and self._tail is request:
                self._tail = None
                self._per_wake.append((time.perf_counter() - self._started) / self._woken)
                if self._idle():
                    self._awake.notify_all()
        if follower is not None:
            follower._lock.release()

    def _idle(self) -> bool:
        """Whether no caller is waking any more (under the lock)."""
        return self._tail is None and not self._loops

    def settle(self, loop: asyncio.AbstractEventLoop, requests: list[Request]) -> None:
        """Settle the futures of ``requests``, all of ``loop``, with one callback in it."""
        with self._lock:
            self._loops += 1
            sent = self._round
        if not call_in_loop(loop, self._in_loop, loop, requests, sent):
            self._ran(sent)

    def _in_loop(self, loop: asyncio.AbstractEventLoop, requests: list[Request], sent: int) -> None:
        # The work these callers cost the loop's thread, in CPU time (neither the loop's wake-up nor its waits for
        # the GIL): settling their futures, then running the tasks it resumes, which are queued right after the
        # first callback below and right before the second.
        cost = [0.0, 0.0]  # CPU seconds spent settling; the thread's CPU time when the resumed tasks begin
        loop.call_soon(_resumed, cost)
        began = time.thread_time()
        try:
            _settle(requests)
        finally:
            cost[0] = time.thread_time() - began
            loop.call_soon(self._ran, sent, len(requests), cost)

    def _ran(self, sent: int, woken: int = 0, cost: Sequence[float] = ()) -> None:
        with self._lock:
            if woken:
                self._per_wake.append((cost[0] + time.thread_time() - cost[1]) / woken)
            if sent != self._round:
                return  # forgotten by wait_idle
            self._loops -= 1
            if self._idle():
                self._awake.notify_all()

    def seconds_per_wake(self) -> float:
        """How long waking takes per caller: in the running chain so far, else in recent chains and settles."""
        with self._lock:
            if self._tail is not None and self._woken:
                return (time.perf_counter() - self._started) / self._woken
            # The median: a garbage collection during one wake is no rule.
            return statistics.median(self._per_wake) if self._per_wake else 0.0

    def wait_idle(self, timeout: float) -> None:
        """Block until every caller is awake, for at most ``timeout`` seconds.

        An event loop that has not run its callback by then (busy with
        other work, or stopped) is no longer waited for.
        """
        with self._lock:
            if not self._awake.wait_for(self._idle, timeout):
                self._round, self._loops = self._round + 1, 0


class FutureRequest(Request):
    """A request completed through a :class:`concurrent.futures.Future`."""

    __slots__ = ("future",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.future: Future[TensorDictBase] = Future()

    def claim(self) -> bool:
        # Only a pending future can be claimed; a cancelled one is dropped here.
        return not self.done and (self.future.running() or self.future.set_running_or_notify_cancel())

    def _wake(self) -> None:
        future = self.future
        # Running from here on (a batch claimed it, or now): a cancel() can no longer succeed while the outputs
        # are written into the caller's td. One cancelled before (a coalesced request, a cache hit): nobody waits.
        if not (future.running() or future.set_running_or_notify_cancel()):
            return
        if self.error is not None:
            future.set_exception(self.error)
            return
        try:
            result = self._result()
        except BaseException as err:  # a write into the caller's td failed
            future.set_exception(err)
        else:
            future.set_result(result)


class AsyncRequest(Request):
    """A request completed through an :class:`asyncio.Future` of its event loop."""

    __slots__ = ("future", "loop")

    def __init__(self, *args: Any, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(*args)
        self.loop = loop
        self.future: asyncio.Future[TensorDictBase] = loop.create_future()

    def claim(self) -> bool:
        # A bool the loop thread sets: at worst a cancelled request runs once
        # more, and its result is then dropped in _settle.
        return not self.done and not self.future.cancelled()

    def _wake(self) -> None:
        call_in_loop(self.future.get_loop(), _settle, (self,))

    def _settle(self) -> None:
        if self.future.done():
            return
        if self.error is not None:
            self.future.set_exception(self.error)
            return
        try:
            self.future.set_result(self._result())
        except BaseException as err:
            self.future.set_exception(err)


def _resumed(cost: list[float]) -> None:
    cost[1] = time.thread_time()


def _settle(requests: Sequence[Any]) -> None:
    for request in requests:
        request._settle()


def call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> bool:
    """Call ``fn(*args)`` in ``loop``'s thread; False if the loop is closed (nobody is left to wait)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def resolve(requests: Sequence[Request], keys: Sequence[Any], columns: Sequence[Sequence[Any]], relay: Relay) -> None:
    """Complete ``requests[i]`` with ``columns[k][i]`` for each key ``keys[k]``.

    Through ``relay``: requests of an event loop are settled with one call
    per loop, blocking callers woken one after another; futures directly.
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[Request]] = {}
    chain: list[BlockingRequest] = []
    me = threading.get_ident()  # a lone caller running its own batch: it needs no waking
    rows = zip(*columns) if columns else [()] * len(requests)
    for request, values in zip(requests, rows):
        if request.loop is not None:
            if request._store(keys, values, None):
                by_loop.setdefault(request.loop, []).append(request)
        elif type(request) is BlockingRequest and request.caller != me:
            if request._store(keys, values, None):
                chain.append(request)  # unless abandoned by the time the chain starts (Relay.start)
        else:
            request.finish(keys, values)
    for loop, group in by_loop.items():
        relay.settle(loop, group)
    if chain:
        relay.start(chain)


def fail_all(requests: Sequence[Request], error: BaseException) -> None:
    """Complete every request not yet completed with ``error``, each with a copy of its own (``errors.own_copy``)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Request]] = {}
    for i, request in enumerate(requests):
        own = own_copy(error) if i else error
        if request.loop is None:
            request.fail(own)
        elif request._store((), (), own):
            by_loop.setdefault(request.loop, []).append(request)
    for loop, group in by_loop.items():
        call_in_loop(loop, _settle, group)


def write_outputs(td: TensorDictBase, keys: Sequence[Any], values: Sequence[Any]) -> None:
    """Write ``values`` under ``keys`` into ``td``, as a TensorDictModule would."""
    for key, value in zip(keys, values):
        td.set(key, value)
