"""The in-process endpoint: actors are threads or asyncio tasks of the server's process."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future
from typing import Any

from tensordict import TensorDictBase

from torchrl_batchserve.errors import BatchServeError, ServerBrokenError, ServerClosedError
from torchrl_batchserve.intake import Intake
from torchrl_batchserve.request import AsyncRequest, BlockingRequest, FutureRequest
from torchrl_batchserve.serve import Serving, in_serve_loop
from torchrl_batchserve.transport.hub import ProcessHub

__all__ = ["LocalEndpoint"]


class LocalEndpoint:
    """Serves the requests of this process, and opens the server to other processes.

    Args:
        intake: validation, admission and queueing.
        serving: the serve loops (whether one still runs; the batch a lone
            blocking caller runs itself).

    Other processes reach the server through its
    :class:`~torchrl_batchserve.transport.hub.ProcessHub`, started here on
    first demand (a ``RemotePolicy`` pickled, or a fork) and closed with the
    server. In a process forked from the server's, the endpoint becomes a
    client of that hub instead.
    """

    def __init__(self, intake: Intake, serving: Serving) -> None:
        self._intake = intake
        self._serving = serving
        self._lock = threading.Lock()
        self._hub: ProcessHub | None = None
        self._address: tuple[str, bytes, list] | None = None
        self._pid = os.getpid()
        self._forked: Any = None

    @property
    def hub(self) -> ProcessHub | None:
        """The hub, once other processes were offered the server."""
        return self._hub

    def process_address(self) -> tuple[str, bytes, list]:
        """Where clients in other processes connect: ``(address, authkey, keys)``; starts the hub once."""
        if self._address is None:  # once set, read without the lock (a forked child may inherit it held)
            with self._lock:
                if self._address is None:
                    if self._intake.queue.closed:
                        raise ServerClosedError("a closed server cannot serve other processes")
                    keys = list(self._intake.layout.keys)
                    self._hub = ProcessHub(keys, self._intake)
                    self._address = self._hub.address, self._hub.authkey, keys
        return self._address

    def close(self, timeout: float | None) -> None:
        """Close the hub, if one was started (after the queue was closed: none starts again)."""
        with self._lock:
            hub, self._hub = self._hub, None
        if hub is not None:
            hub.close(timeout)

    def __reduce__(self) -> tuple:
        from torchrl_batchserve.transport.client import ProcessClient

        return ProcessClient, self.process_address()

    def _here(self) -> bool:
        return os.getpid() == self._pid

    def _other_process(self) -> Any:
        """The client to use in a process forked after this endpoint was made."""
        if self._forked is None or self._forked[0] != os.getpid():
            from torchrl_batchserve.transport.client import ProcessClient

            if self._address is None:  # the server starts its hub before any fork, if it is running
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
            self._serving.serve_inline(taken)
        return request.wait(self._serving.alive)

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
