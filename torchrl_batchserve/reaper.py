"""Servers dropped without ``close()``, and servers still open at exit.

A server's finalizer hands its parts here: queued requests fail, its serve loops, its hub and its weight
groups end. At exit, the servers still open get :data:`EXIT_WAIT` seconds for the forwards they run.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from queue import SimpleQueue

from torchrl_batchserve.distributed import WeightReceiver
from torchrl_batchserve.queue import RequestQueue
from torchrl_batchserve.serve import Serving
from torchrl_batchserve.transport.local import LazyHub

__all__ = ["EXIT_WAIT", "abandon", "collected", "start_reaper"]

_log = logging.getLogger(__name__)


def abandon(
    queue: RequestQueue, serving: Serving, hub: LazyHub, receivers: list[WeightReceiver], wait: float = 0.0
) -> None:
    """A server collected without ``close()``: fail what is queued, end its loops, its hub and its weight groups.

    A group member that stops receiving fails the trainer's next push, rather than take it for nobody.
    ``wait``: the seconds its running forwards and its hub's threads get to end (at exit: :data:`EXIT_WAIT`).
    """
    deadline = time.monotonic() + wait
    serving.fail_closed(queue.close(cancel_pending=True))
    serving.close()
    hub.close(wait)
    for receiver in receivers:
        receiver.close(0.0)
    serving.join(max(0.0, deadline - time.monotonic()))


# At exit, the seconds a server left unclosed gets for the forwards it runs and its hub's threads: a daemon
# thread still inside torch when the interpreter finalizes is ended there (pthread_exit, Python <= 3.13), which
# aborts the process.
EXIT_WAIT = 10.0


# A server in a reference cycle is collected inside whichever allocation of whichever thread the garbage
# collector runs in: a serve loop holding its queue's lock, say, which _abandon would then wait for forever.
# So its finalizer only puts its parts in a queue whose put may interrupt another (SimpleQueue's), and one
# thread of the process, the reaper, abandons them. At exit, once the reaper may no longer run, the
# finalizers of the servers still alive abandon them themselves (atexit, in the main thread).
_abandoned: SimpleQueue[tuple[RequestQueue, Serving, LazyHub, list]] = SimpleQueue()
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()
_exiting = False


def collected(pid: int, queue: RequestQueue, serving: Serving, hub: LazyHub, receivers: list) -> None:
    """The finalizer of a server: collected without ``close()``, or alive at exit."""
    if os.getpid() != pid:
        return  # a forked child's copy: its serve loops and hub are its parent's
    if _exiting and threading.current_thread() is threading.main_thread():  # atexit's, not a collection elsewhere
        abandon(queue, serving, hub, receivers, wait=EXIT_WAIT)
    else:
        _abandoned.put((queue, serving, hub, receivers))


def _reap() -> None:
    while True:
        parts = _abandoned.get()
        try:
            abandon(*parts)
        except Exception:  # the next one is still closed
            _log.exception("could not close a server collected without close()")


def start_reaper() -> None:
    """Start the process's reaper, if none runs; called after a server's finalizer is made."""
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            atexit.unregister(_at_exit)
            atexit.register(_at_exit)  # after weakref's own hook, made with the first finalizer: so it runs first
            _reaper = threading.Thread(target=_reap, name="batchserve-reaper", daemon=True)
            _reaper.start()


def _at_exit() -> None:
    global _exiting
    _exiting = True
    while not _abandoned.empty():
        abandon(*_abandoned.get(), wait=EXIT_WAIT)


def _forget_reaper_in_child() -> None:
    global _abandoned, _reaper, _reaper_lock
    # The parent's (its lock perhaps held by another of its threads): a server made here starts the child's own.
    _abandoned, _reaper, _reaper_lock = SimpleQueue(), None, threading.Lock()


os.register_at_fork(after_in_child=_forget_reaper_in_child)
