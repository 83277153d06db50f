"""The errors of torchrl_batchserve.

Every failure a caller can see has its own class, so that ``except`` clauses
say what they handle::

    BatchServeError
    ├── ServerClosedError      the server was closed before the request ran
    ├── ServerBrokenError      the serve loop died; nothing more will be served
    │   └── ForwardTimeoutError   a forward ran past forward_timeout
    ├── BadRequestError        this request can never be served (key, shape, dtype, ...)
    ├── QueueFullError         max_queue_size rows are already waiting
    ├── PolicyError            the policy broke its contract (missing out_key, wrong rows, ...)
    ├── SearchError            a tree search stopped: an evaluation or an env step failed (mcts.TreeSearch)
    └── WeightSyncError        a weight update was rejected; the old weights stay

A policy that raises during a batch is not wrapped: every caller of that batch
gets the policy's own exception, as from ``policy(batch)``, each a copy of its
own (:func:`own_copy`). Every path (thread, asyncio task, worker process)
raises the same class for the same failure: an error crosses to a worker
process as it is, or, if it does not pickle, as a ``RuntimeError`` naming it
(:func:`portable`).
"""

from __future__ import annotations

import copy
import pickle

__all__ = [
    "BadRequestError",
    "BatchServeError",
    "ForwardTimeoutError",
    "PolicyError",
    "QueueFullError",
    "SearchError",
    "ServerBrokenError",
    "ServerClosedError",
    "WeightSyncError",
    "own_copy",
    "portable",
    "raisable",
]


class BatchServeError(Exception):
    """Root of every error raised by torchrl_batchserve itself."""


class ServerClosedError(BatchServeError):
    """The server is closed: the request was refused, or cancelled by ``close``."""


class ServerBrokenError(BatchServeError):
    """The serve loop died unexpectedly; its cause is chained as ``__cause__``."""


class ForwardTimeoutError(ServerBrokenError):
    """A forward ran longer than ``forward_timeout``; the server is broken from then on."""


class BadRequestError(BatchServeError, ValueError):
    """A request that cannot be served: it names the key, the rule and the value."""


class QueueFullError(BatchServeError):
    """``max_queue_size`` rows are already queued; retry later or raise the bound."""


class PolicyError(BatchServeError):
    """The policy's output breaks its contract: it names the key, what was expected and what came."""


class WeightSyncError(BatchServeError):
    """A weight update was rejected; the server keeps serving the previous version."""


class SearchError(BatchServeError):
    """A tree search stopped because an evaluation or an env step failed; the failure is chained as ``__cause__``."""


def portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (to another process), else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def raisable(error: Exception) -> Exception:
    """``error`` as a caller may be given it: a ``StopIteration`` from user code as a ``RuntimeError`` caused by it.

    An asyncio future refuses a ``StopIteration`` (its caller would wait forever), and a generator or a
    coroutine that it leaves turns it into a ``RuntimeError`` anyway (PEP 479).
    """
    if not isinstance(error, StopIteration):
        return error
    wrapped = RuntimeError(f"the policy or the collate raised {error!r}")
    wrapped.__cause__ = error
    return wrapped


def own_copy(error: BaseException) -> BaseException:
    """A copy of ``error`` for one more caller, with the traceback, cause and context it has now.

    Each ``raise`` of an exception adds the raising frames to its traceback:
    one instance raised by every caller of a failed batch would show each
    caller the other callers' frames, and keep their frames (and what they
    hold) alive. An exception that cannot be rebuilt from its ``args`` is
    shared as it is.
    """
    try:
        copied = copy.copy(error)
    except Exception:
        return error
    if type(copied) is not type(error):
        return error
    copied.__cause__, copied.__context__ = error.__cause__, error.__context__
    copied.__suppress_context__ = error.__suppress_context__
    return copied.with_traceback(error.__traceback__)
