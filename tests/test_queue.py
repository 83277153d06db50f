"""The batching rule, driven directly: no threads, no sleeps."""

from __future__ import annotations

import time

import pytest

from torchrl_batchserve.errors import BadRequestError, QueueFullError, ServerBrokenError, ServerClosedError
from torchrl_batchserve.queue import FireReason, RequestQueue


class R:
    def __init__(self, rows=1, caller="a", enqueued_at=0.0, cost=0):
        self.rows, self.caller, self.enqueued_at, self.cost = rows, caller, enqueued_at, cost


def test_full_fires_at_max_rows_and_never_splits_requests():
    q = RequestQueue(max_batch_size=4, timeout=1e9)
    q.done_serving(["someone-idle"])  # keep all_waiting out of the way
    for rows in (3, 3, 1):
        q.put(R(rows))
    batch, reason = q.take_batch()
    assert reason is FireReason.FULL
    assert [r.rows for r in batch] == [3]  # 3 + 3 > 4: the second waits whole
    q.done_serving([])
    batch, reason = q.take_batch()
    assert reason is FireReason.FULL and [r.rows for r in batch] == [3, 1]


def test_cost_bound_caps_batches_and_fires_when_reached():
    q = RequestQueue(max_batch_size=64, timeout=1e9, max_batch_cost=100)
    q.done_serving(["someone-idle"])
    q.put(R(cost=60))
    q.put(R(cost=30))
    assert q._rule() > 0  # 90 < 100, rows < 64: keep waiting
    q.put(R(cost=20))  # 110 >= 100: full by cost
    requests, reason = q.take_batch()
    assert reason is FireReason.FULL and [r.cost for r in requests] == [60, 30]  # + 20 would exceed 100
    q.done_serving([])
    q.close()
    requests, reason = q.take_batch()
    assert [r.cost for r in requests] == [20] and reason is FireReason.CLOSING


def test_oversized_request_is_taken_alone():
    q = RequestQueue(max_batch_size=4, timeout=1e9)
    q.put(R(10))
    q.put(R(1))
    batch, reason = q.take_batch()
    assert [r.rows for r in batch] == [10] and reason is FireReason.FULL


def test_timeout_fires_with_what_is_queued_and_forgets_absent_callers():
    q = RequestQueue(max_batch_size=64, timeout=0.0)
    q.done_serving(["b"])  # b was served and has not come back
    q.put(R(caller="a"))
    q.put(R(caller="a"))
    batch, reason = q.take_batch()
    assert reason is FireReason.TIMEOUT and len(batch) == 2
    q.done_serving([])
    q.put(R(caller="a"))  # b was forgotten on timeout: nobody known is idle now
    assert q.take_batch()[1] is FireReason.ALL_WAITING


def test_callers_that_never_come_back_are_forgotten_though_every_batch_fills():
    # Each request from a caller of its own (a gather of new asyncio tasks per step) and every batch full: no
    # batch fired on timeout, and the queue kept every caller it had served as idle, one more per request.
    timeout = 0.001
    q = RequestQueue(max_batch_size=2, timeout=timeout)
    for pair in range(50):
        callers = [2 * pair, 2 * pair + 1]
        for caller in callers:
            q.put(R(caller=caller, enqueued_at=time.monotonic()))
        assert q.take_batch()[1] is FireReason.FULL
        q.done_serving(callers)
    last = time.monotonic()
    while time.monotonic() - last <= timeout:  # until every caller above was served over a timeout ago
        pass
    q.put(R(rows=2, caller="next", enqueued_at=time.monotonic()))
    q.take_batch()
    q.done_serving(["next"])
    assert list(q._idle) == ["next"]  # the 100 others forgotten
    q.put(R(caller="next", enqueued_at=time.monotonic()))
    assert q._rule() is FireReason.ALL_WAITING  # nobody known is idle: no wait for the 100 that left


def test_waits_while_a_known_caller_is_idle():
    q = RequestQueue(max_batch_size=64, timeout=1e9)
    q.done_serving(["a", "b"])
    q.put(R(caller="a"))
    q.put(R(caller="a"))
    assert q._rule() > 0  # b is known and idle: waiting can still grow the batch
    q.put(R(caller="b"))  # now every known caller waits
    batch, reason = q.take_batch()
    assert reason is FireReason.ALL_WAITING and len(batch) == 3


def test_closing_serves_queued_then_returns_none():
    q = RequestQueue(max_batch_size=64, timeout=1e9)
    q.done_serving(["idle"])
    q.put(R())
    assert q.close() == []
    batch, reason = q.take_batch()
    assert reason is FireReason.CLOSING and len(batch) == 1
    q.done_serving([])
    assert q.take_batch() is None
    with pytest.raises(ServerClosedError):
        q.put(R())


def test_close_cancel_pending_returns_queued():
    q = RequestQueue(max_batch_size=64, timeout=1e9)
    q.done_serving(["idle"])
    q.put(R())
    q.put(R())
    assert len(q.close(cancel_pending=True)) == 2
    assert q.take_batch() is None


def test_max_queue_size_counts_rows():
    q = RequestQueue(max_batch_size=64, timeout=1e9, max_queue_size=3)
    q.done_serving(["idle"])
    q.put(R(2))
    with pytest.raises(QueueFullError, match="max_queue_size=3 rows: 2 are queued, the request adds 2"):
        q.put(R(2))
    q.put(R(1))
    with pytest.raises(BadRequestError, match="the request has 4 rows, more than max_queue_size=3"):
        q.put(R(4))  # it could never be queued: not a retry-later error


def test_broken_queue_refuses_with_cause():
    q = RequestQueue(max_batch_size=64, timeout=1e9)
    q.done_serving(["idle"])
    q.put(R())
    cause = RuntimeError("boom")
    assert len(q.break_(cause)) == 1
    with pytest.raises(ServerBrokenError) as info:
        q.put(R())
    assert info.value.__cause__ is cause


def test_a_served_caller_with_another_request_queued_is_not_idle():
    q = RequestQueue(max_batch_size=1, timeout=1e9)
    q.put(R(caller="a"))
    q.put(R(caller="a"))
    batch, _ = q.take_batch()
    q.done_serving([r.caller for r in batch])
    # "a" still waits for its second request: nobody is idle, so it fires at once
    assert q.take_batch()[1] in (FireReason.FULL, FireReason.ALL_WAITING)


def test_with_two_runners_two_batches_run_at_once_and_a_third_waits_for_one():
    q = RequestQueue(max_batch_size=1, timeout=1e9, runners=2)
    for caller in "abc":
        q.put(R(caller=caller))
    first, second = q.take_batch(0), q.take_batch(1)  # two replicas: both taken without done_serving
    assert [r.caller for r in first[0] + second[0]] == ["a", "b"]
    assert not q._free
    q.done_serving(["a"], 0)
    assert [r.caller for r in q.take_batch(0)[0]] == ["c"]


def test_a_lone_blocking_caller_is_handed_its_own_batch_and_never_one_with_others():
    q = RequestQueue(max_batch_size=64, timeout=1e9)
    assert q.put(R(caller="a"), may_serve=lambda: True) is None  # nobody is known yet: the serve loop runs it
    batch, _ = q.take_batch()
    q.done_serving([r.caller for r in batch])
    taken = q.put(R(caller="a"), may_serve=lambda: True)  # a was alone in that batch, and is alone again
    assert taken is not None and [r.caller for r in taken[0]] == ["a"] and taken[2] == 0
    assert q.put(R(caller="a"), may_serve=lambda: True) is None  # its replica is busy: queued
    shared = RequestQueue(max_batch_size=64, timeout=1e9)
    shared.put(R(caller="a"))
    shared.put(R(caller="b"))
    batch, _ = shared.take_batch()
    shared.done_serving([r.caller for r in batch])
    shared.put(R(caller="b"))
    assert shared.put(R(caller="a"), may_serve=lambda: True) is None  # a was not alone: the serve loop runs it
    assert len(shared.take_batch()[0]) == 2
