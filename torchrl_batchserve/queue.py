"""The request queue and the batching rule.

The rule, in :meth:`RequestQueue.take_batch` and nowhere else:

1. ``full``: as soon as ``max_batch_size`` rows are queued (or requests
   whose costs add up to ``max_batch_cost``), take them;
2. ``all_waiting``: if every caller the queue knows of is already waiting,
   waiting longer cannot grow the batch: take what is queued;
3. ``timeout``: once ``timeout`` seconds have passed since the oldest queued
   request arrived, take what is queued;
4. ``closing``: after a graceful ``close``, queued requests run at once.

A caller is *known* once it has been served; it counts as *idle* from the
moment its result is ready until it submits again (a caller with another
request still queued is waiting, not idle). Rule 2 fires when no known
caller is idle. A caller that does not come back before a batch fires on
timeout is forgotten, so actors that leave never hold batches back for longer
than one timeout.

Requests are taken whole and in arrival order, as many as fit both bounds; a
request is split across forwards only when it alone exceeds ``max_batch_size``
(the server does that; a request whose cost alone exceeds ``max_batch_cost`` is
refused before it is queued).

Who runs a batch: one batch runs at a time (the *serving* token, held under
the queue's lock). When a caller's own request makes the rule fire and no
batch is running, :meth:`RequestQueue.put` may hand that caller the batch to
run in its own thread, so no thread is woken on the critical path (a wake-up
costs tens of microseconds). The event loop thread of asyncio callers takes
any such batch. A blocking thread takes it only when it runs by itself
(``solo_only``: its request alone makes the batch, and it was alone in the
last batch too); with other callers around, the worker runs the batch, and
its forward overlaps their Python work instead of holding them all until the
batch is done. Otherwise the worker runs it; the worker is woken only when a
rule may have become true, not per request.

Who keeps the time: the worker, woken when a request enters an empty queue.
A caller that waits for events anyway can keep it instead (``keeps_time``:
the hub of worker processes sleeps in ``epoll`` until the next message or
the oldest request's timeout, whichever comes first, and then asks
:meth:`RequestQueue.take_due`); its requests then wake nobody on arrival.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from torchrl_batchserve.errors import QueueFullError, ServerBrokenError, ServerClosedError
from torchrl_batchserve.request import Request

__all__ = ["FireReason", "RequestQueue"]


class FireReason(str, enum.Enum):
    """Why a batch was taken from the queue."""

    FULL = "full"
    ALL_WAITING = "all_waiting"
    TIMEOUT = "timeout"
    CLOSING = "closing"


class RequestQueue:
    """A FIFO of :class:`~torchrl_batchserve.request.Request` with the batching rule.

    Args:
        max_batch_size: rows that make a batch full.
        timeout: seconds the oldest request may wait for a fuller batch.
        max_queue_size: the most rows that may be queued; ``None`` for no bound.
        max_batch_cost: the most total ``Request.cost`` a batch may hold;
            ``None`` for no bound.

    Examples:
        >>> import torch
        >>> from torchrl_batchserve.queue import RequestQueue
        >>> q = RequestQueue(max_batch_size=2, timeout=10.0)
        >>> class R:  # anything with rows, cost, caller and enqueued_at
        ...     rows, cost, caller, enqueued_at = 1, 0, None, 0.0
        >>> q.put(R()); q.put(R()); q.put(R())
        >>> batch, reason = q.take_batch()
        >>> len(batch), reason.value
        (2, 'full')
        >>> q.done_serving([None])
    """

    def __init__(
        self,
        max_batch_size: int,
        timeout: float,
        max_queue_size: int | None = None,
        max_batch_cost: int | None = None,
    ) -> None:
        self._max_batch_size = max_batch_size
        self._max_batch_cost = math.inf if max_batch_cost is None else max_batch_cost
        self._timeout = timeout
        self._max_queue_size = max_queue_size
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._items: deque[Request] = deque()
        self._rows = 0
        self._cost = 0
        self._idle: set[Any] = set()
        self._queued_by_caller: dict[Any, int] = {}
        self._closed = False
        self._serving = False
        self._solo: Any = None  # the only caller of the last batch, if it had one
        self._broken: BaseException | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def put(
        self, request: Request, may_serve: bool = False, solo_only: bool = False, keeps_time: bool = False
    ) -> tuple[list[Request], FireReason] | None:
        """Enqueue ``request``, or raise at once if it can never be served.

        With ``may_serve`` (a caller that waits anyway), returns a batch for
        the caller to run itself when the rule fires now and no batch is
        running; it must then call :meth:`done_serving`. With ``solo_only``
        too, only when ``request`` alone makes the batch and its caller was
        the only caller of the last batch. With ``keeps_time``, the caller
        undertakes to call :meth:`take_due` again when the oldest request's
        timeout is due (:meth:`take_due` says in how long), so the worker is
        not woken to start the clock.
        """
        with self._lock:  # the bare lock: a Condition's `with` is Python code, and put runs per request
            if self._closed:
                raise self._closed_error()
            if self._max_queue_size is not None and self._rows + request.rows > self._max_queue_size:
                raise QueueFullError(
                    f"max_queue_size={self._max_queue_size} rows: {self._rows} are queued, "
                    f"the request adds {request.rows}"
                )
            was_empty = not self._items
            self._items.append(request)
            self._rows += request.rows
            self._cost += request.cost
            caller = request.caller
            self._queued_by_caller[caller] = self._queued_by_caller.get(caller, 0) + 1
            self._idle.discard(caller)
            if self._serving:
                return None  # done_serving() looks at the queue next
            if self._full():
                reason = FireReason.FULL
            elif not self._idle:
                reason = FireReason.ALL_WAITING
            else:
                if was_empty and not keeps_time:
                    self._cond.notify()  # start the worker's timeout clock
                return None
            if may_serve and (not solo_only or (len(self._items) == 1 and caller == self._solo)):
                self._serving = True
                return self._pop(), reason
            self._cond.notify()
            return None

    def waiting(self, caller: Any) -> None:
        """``caller`` now waits on a request outside the queue (a coalesced row)."""
        with self._cond:
            if caller in self._idle:
                self._idle.discard(caller)
                if not self._idle and self._items and not self._serving:
                    self._cond.notify()  # all_waiting may hold now

    def take_batch(self) -> tuple[list[Request], FireReason] | None:
        """Block until the rule fires and no batch runs; return the batch and why.

        The caller holds the serving token until :meth:`done_serving`.
        Returns ``None`` once the queue is closed and empty.
        """
        with self._cond:
            while True:
                if self._items and not self._serving:
                    taken = self._take()
                    if isinstance(taken, tuple):
                        return taken
                    self._cond.wait(taken)
                    continue
                if self._closed and not self._items and not self._serving:
                    return None
                self._cond.wait()

    def take_due(self) -> tuple[list[Request], FireReason] | float | None:
        """Without blocking: the batch if the rule fires now (the caller then
        holds the serving token), else the seconds until the oldest queued
        request's timeout; ``None`` when nothing is queued or a batch runs
        (whoever serves it looks at the queue next).
        """
        with self._cond:
            if not self._items or self._serving:
                return None
            return self._take()

    def _take(self) -> tuple[list[Request], FireReason] | float:
        """The batch and why, taking the serving token, if the rule fires; else the seconds until it may.

        Called with the lock held, requests queued and no batch running.
        """
        reason = self._rule()
        if not isinstance(reason, FireReason):
            return reason
        self._serving = True
        return self._pop(), reason

    def _rule(self) -> FireReason | float:
        """Why the queued requests run now, or the seconds until they time out (see :meth:`_take`)."""
        if self._full():
            return FireReason.FULL
        if self._closed:
            return FireReason.CLOSING
        if not self._idle:
            return FireReason.ALL_WAITING
        remaining = self._items[0].enqueued_at + self._timeout - time.monotonic()
        if remaining > 0:
            return remaining
        self._idle.clear()
        return FireReason.TIMEOUT

    def done_serving(self, callers: Iterable[Any]) -> None:
        """Release the serving token; ``callers`` were just served (call before waking them)."""
        with self._cond:
            self._serving = False
            served = set(callers)
            self._solo = next(iter(served)) if len(served) == 1 else None
            queued = self._queued_by_caller
            self._idle.update(served.difference(queued))  # served callers with nothing queued
            if self._items or self._closed:
                self._cond.notify()

    def close(self, cancel_pending: bool = False) -> list[Request]:
        """Refuse new requests; return the queued ones if ``cancel_pending``.

        Without ``cancel_pending`` the queued requests stay for the worker,
        which serves them at once (``closing``) and then stops.
        """
        with self._cond:
            self._closed = True
            pending = self._drain() if cancel_pending else []
            self._cond.notify_all()
        return pending

    def break_(self, cause: BaseException) -> list[Request]:
        """Mark the queue broken by ``cause`` and return every queued request."""
        with self._cond:
            self._closed = True
            self._broken = cause
            pending = self._drain()
            self._cond.notify_all()
        return pending

    def _full(self) -> bool:
        return self._rows >= self._max_batch_size or self._cost >= self._max_batch_cost

    def _closed_error(self) -> ServerClosedError | ServerBrokenError:
        if self._broken is not None:
            error = ServerBrokenError(f"the serve loop died: {self._broken!r}")
            error.__cause__ = self._broken
            return error
        return ServerClosedError("the server is closed and accepts no more requests")

    def _drain(self) -> list[Request]:
        pending = list(self._items)
        self._items.clear()
        self._queued_by_caller.clear()
        self._rows = 0
        self._cost = 0
        return pending

    def _pop(self) -> list[Request]:
        items = self._items
        limit, cost_limit = self._max_batch_size, self._max_batch_cost
        taken = [items.popleft()]
        rows, cost = taken[0].rows, taken[0].cost
        while items and rows + items[0].rows <= limit and cost + items[0].cost <= cost_limit:
            request = items.popleft()
            taken.append(request)
            rows += request.rows
            cost += request.cost
        self._rows -= rows
        self._cost -= cost
        queued = self._queued_by_caller
        for request in taken:
            left = queued[request.caller] - 1
            if left:
                queued[request.caller] = left
            else:
                del queued[request.caller]
        return taken
