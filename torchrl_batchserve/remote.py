"""RemotePolicy: the actor-side handle, a TensorDictModuleBase like any policy."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase, dispatch

__all__ = ["RemotePolicy", "primers_of"]


class RemotePolicy(TensorDictModuleBase):
    """A policy whose forward runs batched on a :class:`BatchedPolicyServer`.

    Calling it writes the policy's ``out_keys`` (and the policy version under
    the server's ``policy_version_key``) into the TensorDict passed and returns
    it, exactly as calling the served policy would. Any number of threads and
    asyncio tasks may share one instance. Get one with
    :meth:`BatchedPolicyServer.remote_policy`; it holds no parameters.

    A request may be a single row (batch size ``[]``) or several
    (``[k]``, or any batch shape: its rows are flattened for the batch and
    the outputs take its shape back).

    It survives pickling (spawn, forkserver, fork): each unpickled copy is a
    client of its own that reaches the server through shared-memory lanes,
    eventfds and a Unix socket (:mod:`torchrl_batchserve.transport.hub`), so one
    policy can be handed to any number of worker processes, e.g. as the
    policy of ``MultiSyncCollector``. A copy inherited by ``fork`` without
    pickling does the same; a ``copy.deepcopy`` in the server's process is
    served in-process, as the original is.

    Like the served policy's recurrent modules (``LSTMModule``,
    ``GRUModule``), it has :meth:`make_tensordict_primer`, so TorchRL
    finds the env transforms the served policy needs (a collector's
    ``auto_register_policy_transforms=True``, ``get_primers_from_module``).

    Examples:
        >>> import asyncio, torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl_batchserve import BatchedPolicyServer
        >>> policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["obs"], out_keys=["act"])
        >>> with BatchedPolicyServer(policy, max_batch_size=8) as server:
        ...     remote = server.remote_policy()
        ...     td = remote(TensorDict(obs=torch.ones(3)))             # blocking
        ...     fut = remote.submit(TensorDict(obs=torch.ones(4, 3), batch_size=[4]))
        ...     many = fut.result(timeout=10)
        ...     aio = asyncio.run(remote.acall(TensorDict(obs=torch.ones(3))))
        >>> td["act"].shape, many["act"].shape, int(aio["policy_version"])
        (torch.Size([2]), torch.Size([4, 2]), 0)
    """

    def __init__(self, endpoint: Any, in_keys: Sequence[Any], out_keys: Sequence[Any], primer: Any = None) -> None:
        super().__init__()
        self.in_keys = list(in_keys)
        self.out_keys = list(out_keys)
        self._endpoint = endpoint
        self._primer = primer

    @torch.compiler.disable  # a compiled policy around it (compile_policy=) leaves the server to run as it is
    @dispatch(auto_batch_size=False)
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Serve ``tensordict`` in a batch and return it with the outputs written."""
        return self._endpoint.call(tensordict)

    def submit(self, tensordict: TensorDictBase) -> Future[TensorDictBase]:
        """Enqueue ``tensordict``; the Future resolves to it with the outputs written.

        Raises at once (no Future) when the request is bad or the server closed.
        """
        return self._endpoint.submit(tensordict)

    async def acall(self, tensordict: TensorDictBase) -> TensorDictBase:
        """``await remote.acall(td)``: the asyncio form of ``remote(td)``."""
        return await self._endpoint.acall(tensordict)

    def make_tensordict_primer(self) -> Any:
        """The served policy's ``TensorDictPrimer`` transforms (its recurrent state), new at each call.

        An empty ``Compose`` when the served policy keeps no state.
        """
        from torchrl.envs.transforms import Compose

        return Compose() if self._primer is None else copy.deepcopy(self._primer)

    def __reduce__(self) -> tuple:
        # The endpoint pickles as what reaches the server from elsewhere (a process client, a Ray client).
        return RemotePolicy, (self._endpoint, self.in_keys, self.out_keys, self._primer)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(in_keys={self.in_keys}, out_keys={self.out_keys})"


def primers_of(policy: Any) -> Any:
    """``policy``'s ``TensorDictPrimer`` transforms (``get_primers_from_module``), or ``None``."""
    if not any(hasattr(m, "make_tensordict_primer") for m in policy.modules()):
        return None  # keeps no state: no need to import all of torchrl.modules (half a second, 50 MB) to say so
    from torchrl.modules.utils import get_primers_from_module

    return get_primers_from_module(policy, warn=False, strict=False)
