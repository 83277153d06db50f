"""The batching rule, driven directly: no threads, no sleeps."""

from __future__ import annotations

import os

import pytest

from torchrl_batchserve.errors import QueueFullError, ServerBrokenError, ServerClosedError
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
    assert q.put(R(cost=30), may_serve=True) is None  # 90 < 100, rows < 64: keep waiting
    batch = q.put(R(cost=20), may_serve=True)  # 110 >= 100: full by cost
    assert batch is not None
    requests, reason = batch
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


def test_waits_while_a_known_caller_is_idle():
    q = RequestQueue(max_batch_size=64, timeout=1e9)
    q.done_serving(["a", "b"])
    q.put(R(caller="a"))
    # b is known and idle: waiting can still grow the batch, so put does not fire
    assert q.put(R(caller="a"), may_serve=True) is None
    fired = q.put(R(caller="b"), may_serve=True)  # now every known caller waits
    assert fired is not None
    batch, reason = fired
    assert reason is FireReason.ALL_WAITING and len(batch) == 3


def test_put_hands_a_blocking_caller_the_batch_only_when_nothing_runs():
    q = RequestQueue(max_batch_size=2, timeout=1e9)
    q.done_serving(["x"])
    assert q.put(R(), may_serve=True) is None
    batch, reason = q.put(R(), may_serve=True)
    assert reason is FireReason.FULL and len(batch) == 2
    # the token is held: a full batch now waits for done_serving
    q.put(R())
    assert q.put(R(), may_serve=True) is None
    q.done_serving([])
    assert q.take_batch()[1] is FireReason.FULL


def test_solo_only_hands_over_a_batch_only_to_a_caller_that_runs_by_itself():
    q = RequestQueue(max_batch_size=64, timeout=1e9)
    # a first request: nobody is known yet, so the worker runs it
    assert q.put(R(caller="a"), may_serve=True, solo_only=True) is None
    batch, reason = q.take_batch()
    q.done_serving([r.caller for r in batch])
    # a was alone in that batch and is alone again: it runs its own batch
    fired = q.put(R(caller="a"), may_serve=True, solo_only=True)
    assert fired is not None and fired[1] is FireReason.ALL_WAITING and len(fired[0]) == 1
    q.done_serving(["a", "b"])  # now b is a caller too
    q.put(R(caller="b"))
    # the batch would hold b's request as well: a leaves it to the worker
    assert q.put(R(caller="a"), may_serve=True, solo_only=True) is None
    batch, reason = q.take_batch()
    assert reason is FireReason.ALL_WAITING and [r.caller for r in batch] == ["b", "a"]
    q.done_serving(["b", "a"])
    q.waiting("b")  # b waits on something else (e.g. a coalesced row)
    # a's request alone makes the batch, but a was not alone in the last one
    assert q.put(R(caller="a"), may_serve=True, solo_only=True) is None
    batch, reason = q.take_batch()
    assert reason is FireReason.ALL_WAITING and [r.caller for r in batch] == ["a"]


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


class Waiter:
    """What Relay needs of a BlockingRequest: a held lock, a ``next`` link, no thread to hush."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self._lock.acquire()
        self.next = None
        self.sleeper, self.hushed = 0, 0

    def woken(self):
        return not self._lock.locked()


def test_relay_wakes_one_caller_at_a_time_and_later_batches_join_the_running_chain():

    from torchrl_batchserve.request import Relay

    a, b, c, d = Waiter(), Waiter(), Waiter(), Waiter()
    a.next = b
    relay = Relay()
    relay.start(a, b)
    assert [w.woken() for w in (a, b)] == [True, False]
    relay.start(c, c)  # a second batch completes while a's chain runs
    assert not c.woken()
    relay.pass_on(a)
    assert b.woken() and not c.woken()
    relay.pass_on(b)
    assert c.woken()
    relay.pass_on(c)  # the chain ran out
    relay.start(d, d)
    assert d.woken()


def test_relay_wait_idle_returns_once_the_chain_runs_out_or_after_its_timeout():
    import threading
    import time

    from torchrl_batchserve.request import Relay

    relay = Relay()
    relay.wait_idle(30.0)  # no chain: returns at once
    a, b = Waiter(), Waiter()
    a.next = b
    relay.start(a, b)
    waiter = threading.Thread(target=relay.wait_idle, args=(30.0,))
    waiter.start()
    deadline = time.monotonic() + 10
    while relay._idle_waiter is None and time.monotonic() < deadline:
        time.sleep(0.001)  # until the thread registered as the idle waiter
    assert relay._idle_waiter is not None and waiter.is_alive()
    relay.pass_on(a)  # b is still to wake: the chain runs on
    assert relay._idle_waiter is not None and waiter.is_alive()
    relay.pass_on(b)
    waiter.join(timeout=10)
    assert not waiter.is_alive() and relay._idle_waiter is None and relay.seconds_per_wake() > 0
    # A chain that never runs out (a caller that never woke) holds it back only for the timeout.
    c = Waiter()
    relay.start(c, c)
    started = time.monotonic()
    relay.wait_idle(0.05)
    assert time.monotonic() - started >= 0.04 and relay._idle_waiter is None


needs_policies = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="scheduling policies are Linux's")


def _wake_through_relay(setup=None):
    """A thread blocks in BlockingRequest.wait; the relay wakes it. Returns (policy when woken, policy after)."""
    import threading
    import time

    import torch
    from tensordict import TensorDict

    from torchrl_batchserve.request import BlockingRequest, Relay

    request = BlockingRequest(TensorDict(), (), 1, torch.Size([]), "caller", None, None)
    seen = {}

    class SpyLock:  # the request's lock; notes the sleeper's policy at the moment the relay releases it
        def __init__(self, lock):
            self.lock = lock

        def acquire(self, *args, **kwargs):
            return self.lock.acquire(*args, **kwargs)

        def release(self):
            seen["woken"] = os.sched_getscheduler(seen["tid"])
            self.lock.release()

    request._lock = SpyLock(request._lock)

    def caller():
        if setup is not None:
            setup()
        seen["tid"] = threading.get_native_id()
        request.wait(lambda: True)
        seen["after"] = os.sched_getscheduler(0)

    thread = threading.Thread(target=caller)
    thread.start()
    deadline = time.monotonic() + 10
    while "tid" not in seen or (setup is None and not request.sleeper):
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.001)  # until the caller is about to sleep
    request._store(["x"], [torch.ones(1)], None)
    request.relay = Relay()
    request.relay.start(request, request)
    thread.join(timeout=10)
    assert not thread.is_alive()
    return seen["woken"], seen["after"]


@needs_policies
def test_the_relay_wakes_a_caller_hushed_and_the_caller_gets_its_policy_back():
    # Woken as SCHED_BATCH, it cannot preempt the thread that woke it (and
    # holds the GIL it needs); awake, it runs its own code as SCHED_OTHER.
    woken, after = _wake_through_relay()
    assert (woken, after) == (os.SCHED_BATCH, os.SCHED_OTHER)


@needs_policies
def test_the_relay_leaves_a_thread_of_another_policy_alone():
    woken, after = _wake_through_relay(setup=lambda: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)))
    assert (woken, after) == (os.SCHED_IDLE, os.SCHED_IDLE)


@needs_policies
def test_the_waker_gives_a_hushed_caller_its_policy_back_unless_the_caller_took_it_back_first(monkeypatch):
    import queue
    import threading

    from torchrl_batchserve import request as request_module
    from torchrl_batchserve.request import Relay
    from torchrl_batchserve.wakeup import hush

    relay, caller = Relay(), Waiter()
    unhushed = []
    real_unhush = request_module.unhush
    monkeypatch.setattr(request_module, "unhush", lambda: (unhushed.append(1), real_unhush()))
    todo, answers = queue.Queue(), queue.Queue()

    def a_caller_thread():  # runs what it is sent, in its own thread
        for job in iter(todo.get, None):
            answers.put(job())

    thread = threading.Thread(target=a_caller_thread)
    thread.start()
    try:
        todo.put(threading.get_native_id)
        tid = answers.get(timeout=10)
        policy = lambda: os.sched_getscheduler(tid)  # noqa: E731

        # The waker gets there first (the common case): it gives the policy back, the caller has nothing to do.
        caller.sleeper = tid
        caller.hushed = tid if hush(tid) else 0
        assert caller.hushed == tid and policy() == os.SCHED_BATCH
        relay._give_back(caller)
        assert caller.hushed == 0 and policy() == os.SCHED_OTHER
        todo.put(lambda: relay.awake(caller))
        answers.get(timeout=10)
        assert unhushed == [] and policy() == os.SCHED_OTHER

        # The caller runs first: it restores its own policy, and the waker must not touch it afterwards.
        caller.sleeper = tid
        caller.hushed = tid if hush(tid) else 0
        todo.put(lambda: (relay.awake(caller), os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))))
        answers.get(timeout=10)
        assert unhushed == [1] and caller.hushed == 0 and policy() == os.SCHED_IDLE
        relay._give_back(caller)
        assert policy() == os.SCHED_IDLE
    finally:
        todo.put(None)
        thread.join(timeout=10)


@needs_policies
def test_a_caller_interrupted_after_it_was_hushed_leaves_with_its_own_policy():
    import threading

    import torch
    from tensordict import TensorDict

    from torchrl_batchserve.request import BlockingRequest, Relay
    from torchrl_batchserve.wakeup import hush

    request = BlockingRequest(TensorDict(), (), 1, torch.Size([]), "caller", None, None)
    request.relay = Relay()
    hushed, seen = threading.Event(), {}

    class Interrupted:  # a lock whose timed wait ends in an exception once the caller is hushed
        def acquire(self, blocking=True, timeout=-1):
            if not blocking:
                return False
            hushed.wait(10)
            raise KeyboardInterrupt

    request._lock = Interrupted()

    def caller():
        try:
            request.wait(lambda: True)
        except KeyboardInterrupt:
            seen["after"] = os.sched_getscheduler(0)

    thread = threading.Thread(target=caller)
    thread.start()
    while not request.sleeper and thread.is_alive():
        threading.Event().wait(0.001)  # until the caller is about to sleep
    with request.relay._lock:  # what the relay does just before it would wake the caller
        request.hushed = request.sleeper if hush(request.sleeper) else 0
    assert request.hushed and os.sched_getscheduler(request.sleeper) == os.SCHED_BATCH
    hushed.set()
    thread.join(timeout=10)
    assert seen == {"after": os.SCHED_OTHER}


def test_take_due_gives_the_batch_the_rule_fires_or_the_seconds_until_the_timeout():
    import time

    q = RequestQueue(max_batch_size=2, timeout=60.0)
    assert q.take_due() is None  # nothing queued
    q.done_serving(["idle"])  # a known caller that is not waiting keeps all_waiting out
    assert q.put(R(enqueued_at=time.monotonic()), may_serve=True, keeps_time=True) is None
    remaining = q.take_due()
    assert isinstance(remaining, float) and 59.0 < remaining <= 60.0
    q.put(R(caller="b"), keeps_time=True)
    batch, reason = q.take_due()  # two rows: full
    assert reason is FireReason.FULL and len(batch) == 2
    assert q.take_due() is None  # a batch runs: whoever serves it looks at the queue next
    q.done_serving(["a", "b"])
    q.put(R(enqueued_at=0.0), keeps_time=True)  # queued long ago: its timeout has passed
    batch, reason = q.take_due()
    assert reason is FireReason.TIMEOUT and len(batch) == 1
