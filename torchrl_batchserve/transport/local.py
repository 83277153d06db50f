"""The in-process endpoint: actors are threads or asyncio tasks of the server's process."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tensordict import TensorDictBase

from torchrl_batchserve.errors import BatchServeError, ServerBrokenError
from torchrl_batchserve.intake import Intake
from torchrl_batchserve.request import AsyncRequest, BlockingRequest, FutureRequest
from torchrl_batchserve.serve import in_serve_loop

__all__ = ["LocalEndpoint"]


class LocalEndpoint:
    """Serves the requests of this process through the server's :class:`~torchrl_batchserve.intake.Intake`.

    Args:
        intake: validation, admission and queueing.
        is_alive: whether a serve loop can still answer (the watchdog of
            blocking callers).
        connect: starts the server's process hub (once) and returns
            ``(address, authkey, keys)`` for clients in other processes.
        serve_inline: runs the batch the queue hands a lone blocking caller
            (:meth:`~torchrl_batchserve.serve.Serving.serve_inline`).

    In a process forked from the server's, the endpoint becomes a client of
    the hub (started before the fork by the server) instead.
    """

    def __init__(
        self,
        intake: Intake,
        is_alive: Callable[[], bool],
        connect: Callable[[], tuple[str, bytes, list]],
        serve_inline: Callable[[Any], None],
    ) -> None:
        self._intake = intake
        self._serve_inline = serve_inline
        self._is_alive = is_alive
        self._connect = connect
        self._pid = os.getpid()
        self._address: tuple[str, bytes, list] | None = None
        self._forked: Any = None

    def process_address(self) -> tuple[str, bytes, list]:
        """Where clients in other processes connect (starts the hub once)."""
        if self._address is None:
            self._address = self._connect()
        return self._address

    def __reduce__(self) -> tuple:
        from torchrl_batchserve.transport.client import ProcessClient

        return ProcessClient, self.process_address()

    def _here(self) -> bool:
        return os.getpid() == self._pid

    def _other_process(self) -> Any:
        """The client to use in a process forked after this endpoint was made."""
        if self._forked is None or self._forked[0] != os.getpid():
            from torchrl_batchserve.transport.client import ProcessClient

            if self._address is None:
                raise ServerBrokenError("forked before the server could serve other processes (it was not running)")
            self._forked = (os.getpid(), ProcessClient(*self._address))
        return self._forked[1]

    def call(self, td: TensorDictBase) -> TensorDictBase:
        """Serve ``td`` and block until its outputs are written into it."""
        if not self._here():
            return self._other_process().call(td)
        if in_serve_loop():
            raise BatchServeError(
                "a blocking call from a serve loop's own thread (a submit's done-callback runs there) would wait "
                "for itself; call submit() or acall() there, or hand the call to another thread"
            )
        request: BlockingRequest = self._intake.request(BlockingRequest, td, threading.get_ident())
        taken = self._intake.put(request, may_serve=True)
        if taken is not None:  # a lone caller: it runs its own batch (see queue.py)
            self._serve_inline(taken)
        return request.wait(self._is_alive)

    def submit(self, td: TensorDictBase, caller: Any = None) -> Future[TensorDictBase]:
        """Enqueue ``td``; the Future resolves to ``td`` with its outputs written (``caller``: default, this thread)."""
        if not self._here():
            return self._other_process().submit(td)
        if caller is None:
            caller = threading.get_ident()
        request: FutureRequest = self._intake.request(FutureRequest, td, caller)
        self._intake.put(request)
        return request.future

    async def acall(self, td: TensorDictBase) -> TensorDictBase:
        """Serve ``td`` from a coroutine, batched with every other task and thread."""
        if not self._here():
            return await self._other_process().acall(td)
        loop = asyncio.get_running_loop()
        request: AsyncRequest = self._intake.request(AsyncRequest, td, asyncio.current_task(), loop=loop)
        self._intake.put(request)
        return await request.future
