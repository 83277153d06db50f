"""The in-process endpoint: actors are threads or asyncio tasks of the server's process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tensordict import TensorDictBase

from torchrl_batchserve.errors import BadRequestError, ServerBrokenError
from torchrl_batchserve.layout import Layout
from torchrl_batchserve.queue import RequestQueue
from torchrl_batchserve.request import AsyncRequest, BlockingRequest, FutureRequest, Request
from torchrl_batchserve.transport.caller import current_interaction, forks

__all__ = ["LocalEndpoint"]

_HERE = object()  # the interaction type of the calling thread


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
        process_address: starts the server's process hub; returns
            ``(address, authkey, keys)`` for clients in other processes.

    In a process forked from the server's, the endpoint becomes a client of
    the hub (started before the fork by the server) instead.
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
        process_address: Callable[[], tuple[str, bytes, list]] | None = None,
    ) -> None:
        self.queue = queue
        self.layout = layout
        self._ensure_started = ensure_started
        self._is_alive = is_alive
        self._on_reject = on_reject
        self._serve = serve
        self._admit = admit
        self._abandon = abandon
        self._process_address = process_address
        self._forks = forks()
        self._address: tuple[str, bytes, list] | None = None
        self._forked: Any = None

    def process_address(self) -> tuple[str, bytes, list]:
        """Where clients in other processes connect (starts the hub once)."""
        if self._address is None:
            if self._process_address is None:
                raise TypeError("this endpoint cannot serve other processes")
            self._address = self._process_address()
        return self._address

    def _other_process(self) -> Any:
        """The client to use in a process forked after this endpoint was made."""
        if self._forked is None or self._forked[0] != forks():
            from torchrl_batchserve.transport.client import ProcessClient

            if self._address is None:
                raise ServerBrokenError("forked before the server could serve other processes (it was not running)")
            self._forked = (forks(), ProcessClient(*self._address))
        return self._forked[1]

    def make_request(
        self, cls: type[Request], td: TensorDictBase, caller: Any, interaction: Any = _HERE, **kwargs: Any
    ) -> Any:
        """Validate ``td`` and wrap it in a ``cls`` request (``interaction``: default, this thread's)."""
        self._ensure_started()
        try:
            v = self.layout.check(td)
        except BadRequestError:
            self._on_reject()
            raise
        if interaction is _HERE:
            interaction = current_interaction()
        return cls(td, v.inputs, v.rows, v.batch_shape, caller, interaction, v.device, v.cost, **kwargs)

    def enqueue(
        self, request: Request, may_serve: bool = False, solo_only: bool = False, keeps_time: bool = False
    ) -> Any:
        """Admit (cache) and queue ``request``; a batch to run when ``may_serve`` and it fired.

        ``solo_only``, ``keeps_time``: see :meth:`RequestQueue.put`.
        """
        if self._admit is None:
            return self.queue.put(request, may_serve, solo_only, keeps_time)
        if not self._admit(request):
            return None
        try:
            return self.queue.put(request, may_serve, solo_only, keeps_time)
        except BaseException as err:
            self._abandon(request, err)  # type: ignore[misc]
            raise

    def call(self, td: TensorDictBase) -> TensorDictBase:
        """Serve ``td`` and block until its outputs are written into it."""
        if forks() != self._forks:
            return self._other_process().call(td)
        request: BlockingRequest = self.make_request(BlockingRequest, td, threading.get_ident())
        # A caller that runs by itself serves its own batch (no wake-up at
        # all); with other callers around the worker runs it (see queue.py).
        batch = self.enqueue(request, may_serve=True, solo_only=True)
        if batch is not None:
            self._serve(*batch)
        return request.wait(self._is_alive)

    def submit(self, td: TensorDictBase) -> Future[TensorDictBase]:
        """Enqueue ``td``; the Future resolves to ``td`` with its outputs written."""
        if forks() != self._forks:
            return self._other_process().submit(td)
        request: FutureRequest = self.make_request(FutureRequest, td, threading.get_ident())
        self.enqueue(request)
        return request.future

    async def acall(self, td: TensorDictBase) -> TensorDictBase:
        """Serve ``td`` from a coroutine, batched with every other task and thread."""
        if forks() != self._forks:
            return await self._other_process().acall(td)
        loop = asyncio.get_running_loop()
        request: AsyncRequest = self.make_request(AsyncRequest, td, asyncio.current_task(), loop=loop)
        # The coroutine whose request completes a batch runs it on the loop
        # thread: no hand-off to the worker, whose forward would otherwise
        # fight this thread for the GIL. The loop runs nothing else meanwhile.
        batch = self.enqueue(request, may_serve=True)
        if batch is not None:
            self._serve(*batch)
        return await request.future
