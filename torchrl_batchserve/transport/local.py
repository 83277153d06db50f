"""The in-process endpoint: actors are threads or asyncio tasks of the server's process."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future
from typing import Any

import torch
from tensordict import TensorDictBase

from torchrl_batchserve.errors import BatchServeError, ServerBrokenError, ServerClosedError
from torchrl_batchserve.intake import CURRENT, Intake
from torchrl_batchserve.request import AsyncRequest, BlockingRequest, FutureRequest
from torchrl_batchserve.serve import Serving, serving_here
from torchrl_batchserve.transport.hub import ProcessHub

__all__ = ["LazyHub", "LocalEndpoint"]


class LazyHub:
    """The server's :class:`~torchrl_batchserve.transport.hub.ProcessHub`, started on first demand, closed once.

    An object of its own, apart from the endpoint (which keeps the server
    alive), so that the server's finalizer can close the hub without
    holding the server.
    """

    def __init__(self, intake: Intake) -> None:
        self._intake = intake
        self._lock = threading.Lock()
        self.hub: ProcessHub | None = None
        self.address: tuple[str, bytes, list] | None = None

    def open(self) -> tuple[str, bytes, list]:
        """Where clients in other processes connect: ``(address, authkey, keys)``; starts the hub once."""
        if self.address is None:  # once set, read without the lock (a forked child may inherit it held)
            with self._lock:
                if self.address is None:
                    if self._intake.queue.closed:
                        raise ServerClosedError("a closed server cannot serve other processes")
                    keys = list(self._intake.layout.keys)
                    self.hub = ProcessHub(keys, self._intake)
                    self.address = self.hub.address, self.hub.authkey, keys
        return self.address

    def close(self, timeout: float | None) -> None:
        """Close the hub, if one was started (once the queue is closed, none starts again)."""
        with self._lock:
            hub, self.hub = self.hub, None
        if hub is not None:
            hub.close(timeout)


def _serves_as_a_serve_thread() -> bool:
    """Whether this thread's default device is a serve thread's, the CPU, so that it may run its own batch.

    ``torch.set_default_device`` and ``torch.device`` blocks are per thread:
    run here, a batch would have the policy's new tensors made there.
    """
    return torch.empty(()).device.type == "cpu"


class LocalEndpoint:
    """Serves the requests of this process, and opens the server to other processes.

    Args:
        intake: validation, admission and queueing.
        serving: the serve loops (whether one still runs; the batch a lone
            blocking caller runs itself).
        owner: the server, kept alive by the endpoint: a ``RemotePolicy``
            keeps its server serving after the last other reference to it
            is gone (``Collector(env, BatchedPolicyServer(p).remote_policy())``),
            and says which server serves it (a weight sync scheme checks it).

    Other processes reach the server through its hub (:class:`LazyHub`),
    started on first demand: a ``RemotePolicy`` pickled, or a fork. In a
    process forked from the server's, the endpoint becomes a client of that
    hub instead.
    """

    def __init__(self, intake: Intake, serving: Serving, owner: Any) -> None:
        self._intake = intake
        self._serving = serving
        self.owner = owner
        self.lazy_hub = LazyHub(intake)
        self._pid = os.getpid()
        self._forked: Any = None

    def process_address(self) -> tuple[str, bytes, list]:
        """Where clients in other processes connect: ``(address, authkey, keys)``; starts the hub once."""
        return self.lazy_hub.open()

    def __reduce__(self) -> tuple:
        from torchrl_batchserve.transport.client import ProcessClient

        return ProcessClient, self.process_address()

    def __deepcopy__(self, memo: dict) -> LocalEndpoint:
        return self  # a copy in this process is served in-process too, not through the hub as a pickle is

    def _here(self) -> bool:
        return os.getpid() == self._pid

    def _other_process(self) -> Any:
        """The client to use in a process forked after this endpoint was made."""
        if self._forked is None or self._forked[0] != os.getpid():
            from torchrl_batchserve.transport.client import ProcessClient

            address = self.lazy_hub.address  # the server starts its hub before any fork, if it is running
            if address is None:
                raise ServerBrokenError("forked before the server could serve other processes (it was not running)")
            self._forked = (os.getpid(), ProcessClient(*address))
        return self._forked[1]

    def _refuse_waiting(self, what: str, instead: str) -> None:
        if serving_here(self._serving):
            raise BatchServeError(
                f"{what} from a serve loop's own thread (a submit's done-callback runs there), or from inside a "
                f"batch of this server (its policy's forward), would wait for itself; {instead}"
            )

    def call(self, td: TensorDictBase) -> TensorDictBase:
        """Serve ``td`` and block until its outputs are written into it."""
        if not self._here():
            return self._other_process().call(td)
        self._refuse_waiting("a blocking call", "call submit() there, or hand the call to another thread")
        request: BlockingRequest = self._intake.request(BlockingRequest, td, threading.get_ident())
        taken = self._intake.put(request, may_serve=_serves_as_a_serve_thread)
        if taken is not None:  # a lone caller: it runs its own batch (see queue.py)
            self._serving.serve_inline(taken)
        return request.wait(self._serving.alive)

    def submit(self, td: TensorDictBase, caller: Any = None, interaction: Any = CURRENT) -> Future[TensorDictBase]:
        """Enqueue ``td``; the Future resolves to ``td`` with its outputs written (``caller``: default, this thread)."""
        if not self._here():
            return self._other_process().submit(td, interaction)
        if caller is None:
            caller = threading.get_ident()
        else:
            try:
                hash(caller)  # the queue counts each caller's requests by it: else its serve loop died on it
            except TypeError:
                raise TypeError(
                    f"caller must be hashable: it names who waits (a str, an int, a tuple), got {caller!r}"
                ) from None
        request: FutureRequest = self._intake.request(FutureRequest, td, caller, interaction)
        self._intake.put(request)
        return request.future

    async def acall(self, td: TensorDictBase) -> TensorDictBase:
        """Serve ``td`` from a coroutine, batched with every other task and thread."""
        if not self._here():
            return await self._other_process().acall(td)
        self._refuse_waiting("an acall", "await it in an event loop of another thread")
        loop = asyncio.get_running_loop()
        # The task's id, not the task: the queue remembers the callers it served until a batch fires on its
        # timeout, and a finished task holds its result (the caller's TensorDict) for as long as it is held.
        caller = id(asyncio.current_task())
        request: AsyncRequest = self._intake.request(AsyncRequest, td, caller, loop=loop)
        self._intake.put(request)
        return await request.future
