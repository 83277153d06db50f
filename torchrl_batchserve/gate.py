"""The interaction-type gate: one per process (:data:`GATE`), passed by every forward of every server."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tensordict.nn import set_interaction_type
from tensordict.nn.probabilistic import interaction_type

if TYPE_CHECKING:  # a forward's owner; its ``broken`` is all the gate reads
    from torchrl_batchserve.serve import Serving

__all__ = ["GATE", "InteractionGate"]

_log = logging.getLogger(__name__)


class _Forwards(threading.local):
    depth = 0  # how many forwards this thread is inside (a class default: no exception for a new thread)


class InteractionGate:
    """Forwards under one interaction type run together; under another, after them.

    tensordict's interaction type is one value for the whole process, read
    by the policy's modules while they run: two forwards under different
    types at once (on two replicas, a gateway's batches in flight, two
    servers of one process) would each run under whichever was set last. So
    the process has one gate (:data:`GATE`), which every serve loop passes.
    The first forward of a run sets its type if it differs, the last puts
    back the one found if nobody changed it meanwhile (the callers' threads
    set and reset it too). Once a forward of another type waits, new ones
    wait too, so it is not starved. While a run's type is set, the callers of
    this process read the one it replaced (:meth:`callers_mode`), not the
    forward's. A request that a forward makes itself (a policy that calls a
    server of this process) runs under that forward's type and joins its run
    (:meth:`inside`): waiting for the run to end would wait for itself.

    What the gate cannot stop is another thread setting or resetting the type
    while a run is on (a caller's block that ends while its ``submit`` runs):
    the run's forwards may then read that thread's type. A run that ends
    under another type than its own says so, once per process, in a warning.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._mode: Any = None
        self._running: dict[Any, int] = {}  # the forwards running now, by the server they belong to
        self._waiting = 0
        self._setting: set_interaction_type | None = None
        self._found: Any = None  # the type a run's setting replaced
        self._warned = False  # that a thread changed the type while a run was on
        self._forwards = _Forwards()

    @contextlib.contextmanager
    def under(self, mode: Any, owner: Serving, nested: bool = False) -> Iterator[None]:
        """Run the block, a forward of ``owner``, under the interaction type ``mode``.

        ``nested``: the forward serves a request made inside a running
        forward, so it joins the run even if a forward of another type waits.
        Raises ``owner.broken`` once it is set (:meth:`release`), rather than wait.
        """
        with self._cond:
            if self._running and (mode != self._mode or (self._waiting and not nested)):
                self._waiting += 1
                while self._running and owner.broken is None:
                    self._cond.wait()
                self._waiting -= 1
            if owner.broken is not None:  # a forward that never ends holds the run: the server is broken
                raise owner.broken
            if not self._running:
                self._mode = mode
                found = interaction_type()
                if found != mode:
                    self._found = found
                    self._setting = set_interaction_type(mode)
                    self._setting.__enter__()
            self._running[owner] = self._running.get(owner, 0) + 1
        forwards = self._forwards
        forwards.depth += 1
        try:
            yield
        finally:
            forwards.depth -= 1
            with self._cond:
                left = self._running.get(owner, 0) - 1  # -1: released by its broken server (release)
                if left > 0:
                    self._running[owner] = left
                elif left == 0:
                    del self._running[owner]
                    self._end_run()

    def _end_run(self) -> None:
        if self._running:
            return
        now = interaction_type()
        if now != self._mode and not self._warned:
            self._warned = True
            _log.warning(
                "the interaction type changed from %s to %s while forwards ran under the first: a thread of "
                "this process set or reset it (tensordict keeps one type per process), and they may have run "
                "under the second. Give such callers their type with server.submit(td, interaction=...), or "
                "call from worker processes (docs/guide.md, 'Interaction types'). Said once per process.",
                self._mode,
                now,
            )
        if self._setting is not None and now == self._mode:
            self._setting.__exit__(None, None, None)
        self._setting = None
        self._cond.notify_all()

    def inside(self) -> bool:
        """Whether this thread is running a forward (a request it makes now is part of it)."""
        return self._forwards.depth > 0

    def callers_mode(self) -> Any:
        """The type a caller of this process is under: the one in effect, or the one a running forward's replaced.

        Inside a forward, the one in effect: the forward's.
        """
        with self._cond:
            mode = interaction_type()
            outside = self._setting is not None and mode == self._mode and not self.inside()
            return self._found if outside else mode

    def after_fork(self) -> None:
        """In a forked child no forward of the parent runs: take its type back, and start free."""
        if self._setting is not None and interaction_type() == self._mode:
            self._setting.__exit__(None, None, None)
        self._reset()

    def release(self, owner: Serving) -> None:
        """``owner`` broke: its forwards (one may never end) hold the gate no longer; its waiting ones fail."""
        with self._cond:
            if self._running.pop(owner, 0):
                self._end_run()
            self._cond.notify_all()


GATE = InteractionGate()
os.register_at_fork(after_in_child=GATE.after_fork)  # in place: modules that imported GATE keep it
