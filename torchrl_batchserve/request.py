"""One record per request, and the three ways a result reaches its caller.

A :class:`Request` is created by :class:`~torchrl_batchserve.RemotePolicy` once
the input passed validation, travels through the queue and the serve loop, and
is completed exactly once with :meth:`Request.finish` or :meth:`Request.fail`.
How completion wakes the caller depends on how it asked:

* :class:`BlockingRequest` (``remote(td)``): a bare lock, released by the
  worker; the caller writes its own outputs after it wakes, off the worker's
  critical path. This is the cheapest wake-up CPython has.
* :class:`FutureRequest` (``remote.submit(td)``): a real
  :class:`concurrent.futures.Future`.
* :class:`AsyncRequest` (``await remote.acall(td)``): an :class:`asyncio.Future`;
  the worker resolves all requests of one event loop with a single
  ``call_soon_threadsafe`` per batch, so thousands of tasks cost one wake-up.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import InteractionType

from torchrl_batchserve.errors import ServerBrokenError
from torchrl_batchserve.wakeup import hush, restore, sleeper_id, unhush

__all__ = [
    "AsyncRequest",
    "BlockingRequest",
    "FutureRequest",
    "Relay",
    "Request",
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
        cost: the request's share of ``max_batch_cost`` (the server's
            ``cost_fn``; 0 when batches are bounded by rows only).

    ``cache_keys`` are its rows' keys when the server has an evaluation
    cache. ``extra`` is the collate's per-request note between ``collate`` and
    ``split`` (e.g. the length a padding collate trims outputs back to).

    A request type whose ``takes_rows`` is true copies its outputs out as
    soon as it completes (a worker process's, into its slot): for a batch of
    single rows of such requests only, the serve loop may give it, instead
    of one view per output, ``(batch tensor, row)`` pairs (plain contiguous
    CPU tensors), and skip making the views.
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
        "rows",
        "td",
        "values",
    )
    loop: asyncio.AbstractEventLoop | None = None
    takes_rows = False

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
    ) -> None:
        self.td = td
        self.inputs = inputs
        self.rows = rows
        self.batch_shape = batch_shape
        self.caller = caller
        self.interaction = interaction
        self.device = device
        self.cost = cost
        self.extra: Any = None
        self.cache_keys: list[Any] | None = None
        self.enqueued_at = time.monotonic()
        self.keys: Sequence[Any] = ()
        self.values: Sequence[Any] = ()
        self.error: BaseException | None = None
        self.done = False

    def claim(self) -> bool:
        """Whether the request should still run (False once its caller cancelled)."""
        return True

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

    Completed requests are woken as a relay (:class:`Relay`): the serve loop
    releases the first, and each releases the next as it wakes.
    """

    __slots__ = ("_lock", "hushed", "next", "relay", "sleeper")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._lock = threading.Lock()
        self._lock.acquire()
        self.next: BlockingRequest | None = None
        self.relay: Relay | None = None
        self.sleeper = 0  # the waiting thread's id for wakeup.hush, while the relay may still wake it
        self.hushed = 0  # the thread id the relay hushed, until its policy is given back

    def _wake(self) -> None:
        self._lock.release()

    def wait(self, is_alive: Callable[[], bool], check_every: float = 1.0) -> TensorDictBase:
        """Block until completed; fail if the serve loop died without answering.

        The periodic check is a watchdog, not a poll: normal completion wakes
        the caller at once.
        """
        if not self._lock.acquire(blocking=False):
            self.sleeper = sleeper_id()
            try:
                while not self._lock.acquire(timeout=check_every):
                    if self.done:
                        break  # completed, but the relay stalled before us: go on
                    if not is_alive():
                        self.fail(ServerBrokenError("the serve loop stopped without answering"))
            except BaseException:  # interrupted while waiting: leave with this thread's own policy
                self.sleeper = 0  # first: a relay that reads it from now on hushes nobody
                relay = self.relay
                if relay is not None:
                    relay.awake(self)
                raise
        if self.relay is not None:
            self.relay.pass_on(self)
        return self._result()


class Relay:
    """Wakes completed blocking callers one after another, in one chain.

    Waking a sleeping thread is a syscall that costs tens of microseconds with
    the GIL held, and a woken thread that finds the GIL taken sleeps again
    until it is free. So the serve loop wakes only the first caller of a
    batch, and each caller wakes the next as it wakes (:meth:`pass_on`): one
    caller runs Python at a time instead of a pile-up on the GIL. The
    callers of a batch completed while a chain is still being passed along
    join its end rather than start a second chain (with more callers than
    ``max_batch_size``, batches complete faster than their chains run out).

    A forward gives the GIL back at every torch op and must win it back from
    the callers of a running chain each time. So when a batch took less time
    than waking its callers will (:meth:`seconds_per_wake` each), the serve
    loop's worker waits for the chain to run out (:meth:`wait_idle`) before
    it takes its next batch (vector payload, 256 threads: 27k -> 34k
    requests/s); a longer forward (a conv net on pixels) overlaps the chain,
    which then costs it little.

    Each caller is hushed just before it is woken, so that it cannot preempt
    the thread that woke it, whose GIL it needs (:mod:`torchrl_batchserve.wakeup`).
    The waker gives it its policy back right after the wake, still holding
    the GIL, so the caller runs its first line of Python under its own
    policy and never re-queues itself to restore it (the dearer way: at 256
    threads ~3% fewer requests/s, and 0.12 instead of 0.01 involuntary
    context switches per request). A caller that runs before its waker got
    that far (the waker lost the GIL in between) restores its own, and the
    waker then leaves it alone: whoever finds ``hushed`` set under the
    relay's lock clears it and restores.
    """

    __slots__ = ("_idle_waiter", "_last_per_wake", "_lock", "_started", "_tail", "_woken")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tail: BlockingRequest | None = None
        self._idle_waiter: Any = None
        self._started = 0.0  # when the running chain started
        self._woken = 0  # callers it has woken so far
        self._last_per_wake = 0.0

    def start(self, head: BlockingRequest, tail: BlockingRequest) -> None:
        """Wake the chain ``head`` ... ``tail`` (linked by ``next``), after any running one."""
        with self._lock:
            running = self._tail
            if running is not None:
                running.next = head
            else:
                self._started, self._woken = time.perf_counter(), 0
                head.hushed = hush(head.sleeper)
            self._tail = tail
        if running is None:
            head._lock.release()
            self._give_back(head)

    def awake(self, request: BlockingRequest) -> None:
        """``request``'s caller is awake: it may no longer be hushed, and gets its policy back if it was."""
        with self._lock:
            self._awake(request)

    def _awake(self, request: BlockingRequest) -> None:
        request.sleeper = 0
        if request.hushed:  # awake before its waker gave its policy back
            request.hushed = 0
            unhush()

    def _give_back(self, request: BlockingRequest) -> None:
        """The waker's half of :meth:`_awake`: ``request``'s caller gets its policy back, if still hushed."""
        if request.hushed:  # read without the lock first: the caller almost never ran before this
            with self._lock:
                tid, request.hushed = request.hushed, 0
                if tid:
                    restore(tid)

    def pass_on(self, request: BlockingRequest) -> None:
        """``request``'s caller woke: wake the next one."""
        idle = None
        with self._lock:
            self._awake(request)
            follower = request.next
            request.next = None
            self._woken += 1
            if follower is not None:
                follower.hushed = hush(follower.sleeper)
            if follower is None and self._tail is request:
                self._tail = None
                self._last_per_wake = (time.perf_counter() - self._started) / self._woken
                idle, self._idle_waiter = self._idle_waiter, None
        if follower is not None:
            follower._lock.release()
            self._give_back(follower)
        elif idle is not None:
            idle.release()

    def seconds_per_wake(self) -> float:
        """How long the chain takes per caller: the running one's so far, else the last one's."""
        with self._lock:
            if self._tail is not None and self._woken:
                return (time.perf_counter() - self._started) / self._woken
            return self._last_per_wake

    def wait_idle(self, timeout: float) -> None:
        """Block until no chain is being passed along, for at most ``timeout`` seconds.

        One thread waits at a time (the serve loop's worker). The bound
        matters only if a chain stalls (a caller interrupted while it
        waited), which its followers' watchdog repairs.
        """
        with self._lock:
            if self._tail is None:
                return
            waiter = self._idle_waiter = threading.Lock()
            waiter.acquire()
        if not waiter.acquire(timeout=timeout):
            with self._lock:
                if self._idle_waiter is waiter:
                    self._idle_waiter = None


class FutureRequest(Request):
    """A request completed through a :class:`concurrent.futures.Future`."""

    __slots__ = ("future",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.future: Future[TensorDictBase] = Future()

    def claim(self) -> bool:
        return self.future.set_running_or_notify_cancel()

    def _wake(self) -> None:
        if self.error is not None:
            if not self.future.done():
                self.future.set_exception(self.error)
            return
        try:
            result = self._result()
        except BaseException as err:  # a write into the caller's td failed
            self.future.set_exception(err)
        else:
            self.future.set_result(result)


class AsyncRequest(Request):
    """A request completed through an :class:`asyncio.Future` of its event loop."""

    __slots__ = ("future", "loop")

    def __init__(self, *args: Any, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(*args)
        self.loop = loop
        self.future: asyncio.Future[TensorDictBase] = loop.create_future()

    def claim(self) -> bool:
        # Reading a bool set by the loop thread: at worst a cancelled request
        # runs once more, and its result is then dropped in _settle.
        return not self.future.cancelled()

    def _wake(self) -> None:
        # Woken in bulk by resolve(); a lone wake (e.g. close) still works.
        _call_in_loop(self.loop, _settle, (self,))

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


def _settle(requests: Sequence[Any]) -> None:
    for request in requests:
        request._settle()


def _call_in_loop(loop: asyncio.AbstractEventLoop | None, fn: Callable, arg: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)  # type: ignore[union-attr]
    except RuntimeError:
        pass  # the loop is closed: nobody is left to wait for these results


def resolve(
    requests: Sequence[Request], keys: Sequence[Any], columns: Sequence[Sequence[Any]], relay: Relay | None = None
) -> None:
    """Complete ``requests[i]`` with ``columns[k][i]`` for each key ``keys[k]``.

    Blocking requests of other threads are woken through ``relay`` (a chain
    of their own when ``None``); asyncio requests are settled with one call
    per event loop (``call_soon`` when it is the loop running here); futures
    directly.
    """
    me = threading.get_ident()
    relay = relay or Relay()
    by_loop: dict[asyncio.AbstractEventLoop, list[Request]] = {}
    head: BlockingRequest | None = None
    tail: BlockingRequest | None = None
    rows = zip(*columns) if columns else [()] * len(requests)
    for request, values in zip(requests, rows):
        if request.loop is not None:
            if request._store(keys, values, None):
                by_loop.setdefault(request.loop, []).append(request)
        elif type(request) is BlockingRequest and request.caller != me:
            if request._store(keys, values, None):
                request.relay = relay
                if tail is None:
                    head = request
                else:
                    tail.next = request
                tail = request
        else:
            request.finish(keys, values)
    if head is not None:
        assert tail is not None
        relay.start(head, tail)
    _settle_by_loop(by_loop)


def fail_all(requests: Sequence[Request], error: BaseException) -> None:
    """Complete every request not yet completed with ``error``."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Request]] = {}
    for request in requests:
        if request.loop is None:
            request.fail(error)
        elif request._store((), (), error):
            by_loop.setdefault(request.loop, []).append(request)
    _settle_by_loop(by_loop)


def _settle_by_loop(by_loop: dict[asyncio.AbstractEventLoop, list[Request]]) -> None:
    # One call per event loop; no self-pipe write for the loop running here.
    running = asyncio._get_running_loop()
    for loop, group in by_loop.items():
        if loop is running:
            loop.call_soon(_settle, group)
        else:
            _call_in_loop(loop, _settle, group)


def write_outputs(td: TensorDictBase, keys: Sequence[Any], values: Sequence[Any]) -> None:
    """Write ``values`` under ``keys`` into ``td``, as a TensorDictModule would.

    Values come from the serve loop already shaped like ``td``'s batch and on
    its device, so a plain unlocked TensorDict takes them without re-checking
    (ten times cheaper than ``td.set``); any other TensorDict type, or a value
    on another device, goes through the public, validating ``set``.
    """
    if type(td) is TensorDict and not td._is_locked:
        device = td._device
        for key, value in zip(keys, values):
            if isinstance(value, torch.Tensor) and (device is None or value.device == device):
                if type(key) is str:
                    td._set_str(key, value, inplace=False, validated=True)
                else:
                    td._set_tuple(key, value, inplace=False, validated=True)
            else:
                td.set(key, value)
        return
    for key, value in zip(keys, values):
        td.set(key, value)
