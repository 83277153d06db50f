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
timeout, or within ``timeout`` of being served, is forgotten, so actors that
leave never hold batches back for longer than one timeout, and those that
never come back (finished asyncio tasks, ended threads) are not kept while
every batch fills.

Requests are taken whole and in arrival order, as many as fit both bounds; a
request is split across forwards only when it alone exceeds ``max_batch_size``
(the server does that; a request whose cost alone exceeds ``max_batch_cost`` is
refused before it is queued).

Who runs a batch, decided here and nowhere else: a replica runs one batch
at a time, taken by its serve loop (:meth:`RequestQueue.take_batch`), with
one exception: a blocking caller that runs by itself (its request alone
makes the batch, and it was the only caller of the last batch) is handed
its own batch by :meth:`RequestQueue.put` (``may_serve``) and runs it in its
thread, so a lone actor's request wakes no thread at all. With other
callers around, or a ``forward_timeout`` (a caller stuck in a forward of
its own could not be told it timed out), the serve loop runs every batch.
A serve loop is woken when a rule may have become true (a request enters an
empty queue, a batch fills, every caller waits), not per request.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

from torchrl_batchserve.errors import BadRequestError, QueueFullError, ServerBrokenError, ServerClosedError
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
        runners: how many batches may run at once (one per replica).
        inline: whether a lone blocking caller may run its own batch.

    Examples:
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
        runners: int = 1,
        inline: bool = True,
    ) -> None:
        self._max_batch_size = max_batch_size
        self._max_batch_cost = math.inf if max_batch_cost is None else max_batch_cost
        self._timeout = timeout
        self._max_queue_size = max_queue_size
        self._cond = threading.Condition(threading.Lock())
        self._items: deque[Request] = deque()
        self._rows = 0
        self._cost = 0
        self._idle: OrderedDict[Any, float] = OrderedDict()  # caller -> when it was served, oldest first
        self._queued_by_caller: dict[Any, int] = {}
        self._closed = False
        self._free = set(range(runners))  # the replicas not running a batch now
        self._solo: Any = None  # the only caller of the last batch, if it had only one
        self._inline = inline
        self._broken: BaseException | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> BaseException | None:
        """What broke the server (see :meth:`break_`); ``None`` while it is not broken."""
        return self._broken

    @property
    def timeout(self) -> float:
        return self._timeout

    def put(
        self, request: Request, may_serve: Callable[[], bool] | None = None
    ) -> tuple[list[Request], FireReason, int] | None:
        """Enqueue ``request``, or raise at once if it can never be served (closed, broken, too big, full).

        With ``may_serve`` (a blocking caller's), returns ``(batch, reason,
        replica)`` when the caller runs by itself (see the module docstring),
        ``replica`` is free and ``may_serve()`` (asked only then) says its
        thread may run it: the caller runs the batch on it.
        """
        with self._cond:
            if self._closed:
                raise self._closed_error()
            bound = self._max_queue_size
            if bound is not None and self._rows + request.rows > bound:
                if request.rows > bound:
                    raise BadRequestError(
                        f"the request has {request.rows} rows, more than max_queue_size={bound}: it can never be queued"
                    )
                raise QueueFullError(
                    f"max_queue_size={bound} rows: {self._rows} are queued, the request adds {request.rows}"
                )
            was_empty = not self._items
            self._items.append(request)
            self._rows += request.rows
            self._cost += request.cost
            caller = request.caller
            self._queued_by_caller[caller] = self._queued_by_caller.get(caller, 0) + 1
            self._idle.pop(caller, None)
            if not self._free:
                return None  # done_serving() looks at the queue next
            fires = self._full() or not self._idle
            solo = fires and self._inline and caller == self._solo and len(self._items) == 1
            if solo and may_serve is not None and may_serve():
                index = min(self._free)
                self._free.discard(index)
                return self._pop(), FireReason.FULL if self._full() else FireReason.ALL_WAITING, index
            # Wake the serve loops only when a rule may have become true for a
            # free replica: the queue was empty (start the timeout clock), the
            # batch is full, or every caller now waits.
            if was_empty or fires:
                self._cond.notify_all()
            return None

    def waiting(self, caller: Any) -> None:
        """``caller`` now waits on a request outside the queue (a coalesced row)."""
        with self._cond:
            if self._idle.pop(caller, None) is not None:
                if not self._idle and self._items and self._free:
                    self._cond.notify_all()  # all_waiting may hold now

    def take_batch(self, replica: int = 0) -> tuple[list[Request], FireReason] | None:
        """Block until the rule fires and ``replica`` is free; return the batch and why.

        The caller runs the batch on ``replica`` and then calls :meth:`done_serving`.
        Returns ``None`` once the queue is closed and empty.
        """
        with self._cond:
            while True:
                if self._items and replica in self._free:
                    reason = self._rule()
                    if isinstance(reason, FireReason):
                        self._free.discard(replica)
                        batch = self._pop()
                        if self._items and self._free:
                            self._cond.notify_all()  # another replica's loop may take what is left
                        return batch, reason
                    self._cond.wait(reason)
                    continue
                if self._closed and not self._items:
                    return None
                self._cond.wait()

    def _rule(self) -> FireReason | float:
        """Why the queued requests run now, or the seconds until they time out."""
        if self._full():
            return FireReason.FULL
        if self._closed:
            return FireReason.CLOSING
        if not self._idle:
            return FireReason.ALL_WAITING
        remaining = self._items[0].enqueued_at + self._timeout - time.monotonic()
        if remaining > 0:
            return remaining
        self._idle.clear()  # callers that did not come back are forgotten
        return FireReason.TIMEOUT

    def done_serving(self, callers: Iterable[Any], replica: int = 0) -> None:
        """``replica`` is free again; ``callers`` were just served (call before waking them)."""
        with self._cond:
            self._free.add(replica)
            served = set(callers)
            self._solo = next(iter(served)) if len(served) == 1 else None
            idle, now = self._idle, time.monotonic()
            for caller in served.difference(self._queued_by_caller):  # served, nothing queued
                idle[caller] = now
                idle.move_to_end(caller)
            while idle and now - next(iter(idle.values())) > self._timeout:
                idle.popitem(last=False)  # not back within a timeout: forgotten
            if self._items or self._closed:
                self._cond.notify_all()

    def close(self, cancel_pending: bool = False) -> list[Request]:
        """Refuse new requests; return the queued ones if ``cancel_pending``.

        Without ``cancel_pending`` the queued requests stay for the serve
        loops, which serve them at once (``closing``) and then stop.
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
            if self._broken is None:
                self._broken = cause
            pending = self._drain()
            self._cond.notify_all()
        return pending

    def _full(self) -> bool:
        return self._rows >= self._max_batch_size or self._cost >= self._max_batch_cost

    def _closed_error(self) -> ServerClosedError | ServerBrokenError:
        if self._broken is not None:
            error = ServerBrokenError(f"the server is broken: {self._broken!r}")
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
