"""Intake: how every transport turns a caller's TensorDict into a queued request.

One object, one order, for every path (threads, asyncio tasks, worker
processes)::

    validate (Layout.check) -> Request -> admit (EvaluationCache) -> RequestQueue.put

so every path gets the same checks and the same error types. A bad request
fails its caller here, before anything is queued; a request that is admitted
is either answered at once (a cache hit), joined to an identical one in
flight, or queued, and then completed exactly once by a serve loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensordict import TensorDictBase
from tensordict.nn import InteractionType

from torchrl_batchserve.cache import HIT, JOINED, EvaluationCache
from torchrl_batchserve.errors import BadRequestError, QueueFullError
from torchrl_batchserve.gate import GATE
from torchrl_batchserve.layout import Layout
from torchrl_batchserve.queue import RequestQueue
from torchrl_batchserve.request import Request, fail_all
from torchrl_batchserve.stats import StatisticsRecorder
from torchrl_batchserve.weights import ShadowWeights

__all__ = ["CURRENT", "Intake"]


class _Current:
    def __repr__(self) -> str:
        return "CURRENT"


CURRENT: Any = _Current()  # for ``interaction``: the interaction type in effect when the request is made


class Intake:
    """Validates, admits and queues requests for one server.

    Args:
        layout: the request validator.
        queue: the server's queue.
        stats: counts the requests refused: bad input, too many rows, a full queue.
        weights: the staging area (its newest version keys the cache).
        cache: the evaluation cache, if any.
        delivered: the keys a result carries (a cache hit's too).
        sampling: the interaction types under which the policy samples
            (:func:`~torchrl_batchserve.cache.sampling_modes`): the cache
            answers none of their requests.
    """

    def __init__(
        self,
        layout: Layout,
        queue: RequestQueue,
        stats: StatisticsRecorder,
        weights: ShadowWeights,
        cache: EvaluationCache | None,
        delivered: list[Any],
        sampling: frozenset,
    ) -> None:
        self.layout = layout
        self.queue = queue
        self._stats = stats
        self._weights = weights
        self._cache = cache
        self._delivered = delivered
        self._sampling = sampling

    def request(
        self, cls: type[Request], td: TensorDictBase, caller: Any, interaction: Any = CURRENT, **kwargs: Any
    ) -> Any:
        """Validate ``td`` and wrap it in a ``cls`` request (``interaction``: default, the one in effect now)."""
        try:
            v = self.layout.check(td)
        except BadRequestError:
            self._stats.rejected()
            raise
        if interaction is CURRENT:
            interaction = GATE.callers_mode()
        elif interaction is not None and not isinstance(interaction, InteractionType):
            raise TypeError(f"interaction must be an InteractionType or None (got {interaction!r})")
        request = cls(td, v.inputs, v.rows, v.batch_shape, caller, interaction, v.device, v.cost, v.layout, **kwargs)
        request.nested = GATE.inside()
        return request

    def put(self, request: Request, may_serve: Callable[[], bool] | None = None) -> Any:
        """Answer ``request`` from the cache, join it to an identical one in flight, or queue it.

        A request that samples is always queued: an earlier sample is no
        answer to it.

        Raises at once (and the request is not accepted) when the queue
        refuses it: closed, broken, full, or too large to ever fit. With
        ``may_serve``: the batch the caller is to run itself, if the queue
        hands it one (:meth:`RequestQueue.put <torchrl_batchserve.queue.RequestQueue.put>`).
        """
        cache = self._cache
        if request.interaction in self._sampling:  # a sample is drawn anew each call
            cache = None
        if cache is not None:
            outcome, values = cache.admit(request, self._weights.serving)
            if outcome == HIT:
                request.finish(self._delivered, values)  # type: ignore[arg-type]
                return None
            if outcome == JOINED:
                self.queue.waiting(request.caller)
                return None
        try:
            return self.queue.put(request, may_serve)
        except BaseException as err:
            if isinstance(err, (BadRequestError, QueueFullError)):
                self._stats.rejected()
            if cache is not None:
                fail_all(cache.release([request]), err)  # the rows that joined it fail with it
            raise
