"""Waking a caller without letting it preempt the thread that wakes it.

When the serve loop (or a woken caller, passing the relay on; or the hub of
worker processes, writing a reply) wakes a sleeping caller, Linux puts the
woken thread on a CPU and, if that CPU is busy, lets it preempt the thread
running there when it judges the sleeper more deserving, which a thread that
slept for a whole batch usually is. On a small VM whose idle vCPUs halt, the
kernel packs woken threads onto the busy vCPU, so the woken caller preempts
the very thread that woke it. For an in-process caller this is pure loss: it
needs the GIL that the waker still holds, so it runs a few microseconds,
sleeps again on the GIL and switches back. For a worker process it breaks the
hub's reply loop into one context switch pair per worker.

Per sched(7), ``SCHED_BATCH`` differs from the default ``SCHED_OTHER`` only
in its wake-ups, which are "mildly disfavored": in Linux's fair scheduler a
woken ``SCHED_BATCH`` thread never preempts the running one. So the waker
*hushes* a sleeping caller just before it wakes it (:func:`hush`:
``SCHED_BATCH``, set while the caller sleeps, which costs nothing else: a
thread that changes its own policy while it runs is rescheduled, and
measured slower). Its policy comes back before it runs any code of its own:
an in-process caller's from its waker, right after the wake and still
holding the GIL the caller needs first (:func:`restore`: the woken thread is
queued but not running, which is cheaper than restoring a running one); a
worker process's from the worker itself once the reply is read
(:func:`unhush`: across processes no GIL keeps the woken worker from
running before the hub could restore it), as does an in-process caller that
ran before its waker got that far. Only threads that
were ``SCHED_OTHER`` when they began to wait are hushed (a thread the user
gave another policy is left alone).

Measured (vector payload, ``benchmarks/run.py``'s 64 actor threads on this
2-vCPU VM): involuntary context switches 0.3 -> 0.03 per request, 38-41k
-> 41-46k requests/s in alternating runs; the waker restoring the policy
instead of the woken caller: 0.12 -> 0.01 involuntary switches per request
and ~3% more requests/s at 256 threads; worker processes: see
``docs/design.md``. Not Linux (no ``SCHED_BATCH``), or not allowed (a
seccomp filter): every function here does nothing.
"""

from __future__ import annotations

import os
import threading

__all__ = ["hush", "restore", "sleeper_id", "unhush"]

_BATCH: int | None = getattr(os, "SCHED_BATCH", None)
_OTHER: int | None = getattr(os, "SCHED_OTHER", None)
_NO_PRIORITY = os.sched_param(0) if _BATCH is not None else None
# Each thread's native id, asked once (threading.get_native_id is a system
# call each time); a forked child's thread has an id of its own.
_thread = threading.local()
os.register_at_fork(after_in_child=lambda: _thread.__dict__.clear())


def sleeper_id() -> int:
    """The calling thread's native id if a waker may hush it, else 0.

    Call it right before sleeping: it checks the thread's policy each time,
    so a policy the user sets between two requests is respected.
    """
    if _BATCH is None:
        return 0
    try:
        if os.sched_getscheduler(0) != _OTHER:
            return 0
        tid = getattr(_thread, "native_id", 0)
        if not tid:
            tid = _thread.native_id = threading.get_native_id()
        return tid
    except OSError:
        return 0


def hush(tid: int) -> int:
    """Make the sleeping thread ``tid`` (from :func:`sleeper_id`) ``SCHED_BATCH``; ``tid`` if it was, else 0."""
    if not tid:
        return 0
    try:
        os.sched_setscheduler(tid, _BATCH, _NO_PRIORITY)  # type: ignore[arg-type]
    except OSError:  # gone, or not ours to change
        return 0
    return tid


def restore(tid: int) -> None:
    """Give the thread ``tid`` (0: the calling one), hushed by :func:`hush`, its ``SCHED_OTHER`` back."""
    try:
        os.sched_setscheduler(tid, _OTHER, _NO_PRIORITY)  # type: ignore[arg-type]
    except OSError:
        pass


def unhush() -> None:
    """Give the calling thread, hushed while it slept, its ``SCHED_OTHER`` back."""
    restore(0)
