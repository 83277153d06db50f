"""Two facts about the caller that every request reads, read cheaply.

* **Which process this is.** An endpoint made in one process and used in a
  child forked from it must become a client of the server's hub instead of
  queueing into a queue nobody serves there. :func:`forks` is a counter that
  ``os.register_at_fork`` raises in every forked child, so comparing it with
  the value an endpoint saved replaces a ``getpid`` system call per request.
  It counts forks made through ``os.fork`` (``multiprocessing``'s fork and
  forkserver start methods use it); the servers' own fork hook, which starts
  their process hub, relies on the same thing.
* **tensordict's interaction type**, which each request carries to its
  batch. ``tensordict.nn.interaction_type()`` takes a lock and asks torch
  whether it is compiling before it returns one attribute (~0.3 µs warm,
  several times that on a relay step whose caches the other callers
  emptied); :func:`current_interaction` reads that attribute directly when
  the installed tensordict has it, and calls the public function otherwise.

Measured together (vector payload, alternating runs against the code before,
on a busy host): 64 actor threads were faster in 11 runs of 12, by ~4% in the
medians; 8 worker processes moved within the noise.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from tensordict.nn.probabilistic import interaction_type

__all__ = ["current_interaction", "forks"]

_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)


def forks() -> int:
    """A number that differs, in every process forked from this one, from its value here."""
    return _forks


def _interaction_reader() -> Callable[[], Any]:
    try:
        from tensordict.nn.probabilistic import _interaction_type as holder

        holder._mode  # noqa: B018  (the attribute the public getter returns)
    except (ImportError, AttributeError):
        return interaction_type
    return lambda: holder._mode


current_interaction: Callable[[], Any] = _interaction_reader()
"""The tensordict interaction type in effect now (process-global in tensordict)."""
