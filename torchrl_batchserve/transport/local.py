"""The in-process endpoint: actors are threads or asyncio tasks of the server's process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tensordict import TensorDictBase
from tensordict.nn.probabilistic import interaction_type

from torchrl_batchserve.errors import BadRequestError
from torchrl_batchserve.layout import Layout
from torchrl_batchserve.queue import RequestQueue
from torchrl_batchserve.request import AsyncRequest, BlockingRequest, FutureRequest, Request

__all__ = ["LocalEndpoint"]


class LocalEndpoint:
    """Validates and enqueues requests of this process.

    Args:
        queue: the server's request queue.
        layout: the request validator.
        ensure_started: called before each request; starts the serve loop once.
        is_alive: whether the serve loop can still answer (for the watchdog of
            blocking callers).
        on_reject: called for each request refused as bad input (statistics).
        serve: runs a batch in the caller's thread, when the queue hands a
            blocking caller the batch its request completed.
        admit: with an evaluation cache, ``admit(request) -> bool``: False
            when the request was answered (a hit) or joined an identical one
            already queued, so it must not be queued itself.
        abandon: ``abandon(request, error)`` for an admitted request the queue
            then refused (its coalesced followers fail with it).
    """

    def __init__(
        self,
        queue: RequestQueue,
        layout: Layout,
        ensure_started: Callable[[], None],
        is_alive: Callable[[], bool],
        on_reject: Callable[[], None],
        serve: Callable[..., None],
        admit: Callable[[Request], bool] | None = None,
        abandon: Callable[[Request, BaseException], None] | None = None,
    ) -> None:
        self.queue = queue
        self.layout = layout
        self._ensure_started = ensure_started
        self._is_alive = is_alive
        self._on_reject = on_reject
        self._serve = serve
        self._admit = admit
        self._abandon = abandon

    def _request(self, cls: type[Request], td: TensorDictBase, caller: Any, **kwargs: Any) -> Any:
        self._ensure_started()
        try:
            v = self.layout.check(td)
        except BadRequestError:
            self._on_reject()
            raise
        return cls(td, v.inputs, v.rows, v.batch_shape, caller, interaction_type(), v.device, v.cost, **kwargs)

    def _put(self, request: Request, may_serve: bool = False) -> Any:
        if self._admit is None:
            return self.queue.put(request, may_serve)
        if not self._admit(request):
            return None
        try:
            return self.queue.put(request, may_serve)
        except BaseException as err:
            self._abandon(request, err)  # type: ignore[misc]
            raise

    def call(self, td: TensorDictBase) -> TensorDictBase:
        """Serve ``td`` and block until its outputs are written into it."""
        request: BlockingRequest = self._request(BlockingRequest, td, threading.get_ident())
        batch = self._put(request, may_serve=True)
        if batch is not None:
            self._serve(*batch)
        return request.wait(self._is_alive)

    def submit(self, td: TensorDictBase) -> Future[TensorDictBase]:
        """Enqueue ``td``; the Future resolves to ``td`` with its outputs written."""
        request: FutureRequest = self._request(FutureRequest, td, threading.get_ident())
        self._put(request)
        return request.future

    async def acall(self, td: TensorDictBase) -> TensorDictBase:
        """Serve ``td`` from a coroutine, batched with every other task and thread."""
        loop = asyncio.get_running_loop()
        request: AsyncRequest = self._request(AsyncRequest, td, asyncio.current_task(), loop=loop)
        # The coroutine whose request completes a batch runs it on the loop
        # thread: no hand-off to the worker, whose forward would otherwise
        # fight this thread for the GIL. The loop runs nothing else meanwhile.
        batch = self._put(request, may_serve=True)
        if batch is not None:
            self._serve(*batch)
        return await request.future
