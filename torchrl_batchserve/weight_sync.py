"""TorchRL's weight-update API, both generations, pointed at the served weights.

A collector whose policy is a :class:`~torchrl_batchserve.RemotePolicy` holds
no weights: they live in the server. ``collector.update_policy_weights_(trainer_policy)``
must therefore reach the server, in-process (``server.update_weights``) or
over the dedicated process group (:mod:`torchrl_batchserve.distributed`).

* :class:`BatchServeWeightSyncScheme`: a ``torchrl.weight_update.WeightSyncScheme``
  (TorchRL 0.14's API) for ``weight_sync_schemes={"policy": scheme}``. Its
  sender side pushes to the server(s); its receiver side, in collector
  workers, gives the modules around the RemotePolicy (an exploration module)
  the collector's own parameters and buffers, shared.
* :func:`weight_updater`: the legacy ``weight_updater=`` adapter. TorchRL
  deprecates ``WeightUpdaterBase`` and warns whenever it is subclassed, so
  the subclass is made on first use, never at import.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.weight_update import WeightSyncScheme

from torchrl_batchserve.distributed import WeightBroadcaster, check_group
from torchrl_batchserve.remote import RemotePolicy
from torchrl_batchserve.weights import as_weights

__all__ = ["BatchServeWeightSyncScheme", "weight_updater"]


class _ServerTransport:
    """The scheme's transport: ``send_weights`` lands in a server (directly or through the group)."""

    def __init__(self, push: Any) -> None:
        self._push = push

    def send_weights(self, weights: Any) -> int:
        return self._push(weights)

    def receive_weights(self, *args: Any, **kwargs: Any) -> None:
        return None  # collector workers hold no weights: the server does


class BatchServeWeightSyncScheme(WeightSyncScheme):
    """Sends a trainer's weights to a :class:`~torchrl_batchserve.BatchedPolicyServer`.

    Give either ``server`` (a server in this process; what
    :meth:`BatchedPolicyServer.weight_sync_scheme` returns) or the rendezvous
    of a weight group whose servers called
    :meth:`BatchedPolicyServer.receive_weights` with the same ``address``,
    ``port`` and ``world_size`` (this side is rank 0; it joins the group when
    the collector connects the scheme, or else at its first send).

    Keyword Args:
        server: a server in this process.
        address: the weight group's rendezvous address.
        port: its port.
        world_size: the processes in the group (this trainer and the servers).
        timeout: seconds each step of a distributed push may take.
        module: with a weight group, the trainer's policy: ``send()`` with no
            weights pushes its current ones (a server in this process
            pushes the module it was built with).

    ``send(weights)`` takes a policy module, a TensorDict
    (``TensorDict.from_module(policy)``) or a state_dict, and returns the new
    version. ``send()`` with no weights (e.g. ``update_policy_weights_()`` with
    no argument) serves the current weights of the module the server was
    built with, the one a trainer trains in place, or over a weight group
    those of ``module``.

    As a collector's ``"policy"`` scheme it needs a collector whose policy
    holds a :class:`~torchrl_batchserve.RemotePolicy`: any other policy would
    never run the pushed weights, and the collector raises ``TypeError`` at
    construction (``ValueError`` when it holds only RemotePolicies of other
    servers in this process). Under another name it updates a server beside the
    collector's own policy.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl_batchserve import BatchedPolicyServer
        >>> policy = TensorDictModule(torch.nn.Linear(2, 2), in_keys=["obs"], out_keys=["act"])
        >>> trainer = TensorDictModule(torch.nn.Linear(2, 2), in_keys=["obs"], out_keys=["act"])
        >>> with BatchedPolicyServer(policy) as server:
        ...     scheme = server.weight_sync_scheme()
        ...     scheme.init_on_sender(model_id="policy", context=None)
        ...     scheme.connect()
        ...     version = scheme.send(trainer)
        ...     out = server.remote_policy()(TensorDict(obs=torch.ones(2)))
        >>> version, int(out["policy_version"]), torch.allclose(out["act"], trainer.module(torch.ones(2)))
        (1, 1, True)
    """

    def __init__(
        self,
        server: Any = None,
        *,
        address: str | None = None,
        port: int | None = None,
        world_size: int | None = None,
        timeout: float = 60.0,
        module: Any = None,
    ) -> None:
        super().__init__(strategy="tensordict")
        distributed = (address, port, world_size)
        if (server is None) == (None in distributed):
            raise ValueError(
                "give either server= (a server in this process) or address=, port= and world_size= "
                f"(a weight group); got server={server!r}, address={address!r}, port={port!r}, "
                f"world_size={world_size!r}"
            )
        if server is not None and module is not None:
            raise ValueError("module= is for a weight group: a server in this process pushes the module it serves")
        if server is not None and not callable(getattr(server, "update_weights", None)):
            raise TypeError(f"server must be a BatchedPolicyServer or a Ray server handle, got {type(server).__name__}")
        if module is not None and not isinstance(module, (nn.Module, TensorDictBase, Mapping)):
            raise TypeError(
                "module must be the trainer's policy (an nn.Module, its TensorDict.from_module or its state_dict), "
                f"got {type(module).__name__}"
            )
        self._server = server
        self._module = module
        self._warned = False
        self._rendezvous: tuple[Any, Any, Any, Any] | None = None  # (address, port, world_size, timeout), checked
        if server is None:
            check_group(address, port, world_size, timeout)  # here, not at the collector's first push
            self._rendezvous = (address, port, world_size, timeout)
        self._broadcaster: WeightBroadcaster | None = None
        self._around: TensorDictBase | None = None  # the state around the RemotePolicy, shared with the workers

    # -- sender side (the trainer / the collector's main process) -------------------

    def _init_on_sender_impl(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        self._model_id = model_id
        if context is not None:
            self.context = context
            if model_id == "policy":  # the collector's own policy (under another id it is one more model to push)
                policy = getattr(context, "policy", None)
                _check_served(policy, type(context).__name__, self._server)
                self._around = _state_around(policy, context)

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any = None
    ) -> None:
        if self._rendezvous is not None and self._broadcaster is None:
            address, port, world_size, timeout = self._rendezvous
            self._broadcaster = WeightBroadcaster(address, port, world_size, timeout=timeout)
        if weights is not None:
            self.send(weights)

    def send(self, weights: Any = None, worker_ids: Any = None) -> int | None:  # type: ignore[override]
        """Serve ``weights`` from the next batch on; return their version (``None``: nothing sent).

        No weights (``update_policy_weights_()`` with no argument, or a
        RemotePolicy's empty ones): a server in this process serves the
        current weights of the module it was built with (the trainer's); a
        weight group those of ``module``, or nothing (it warns, once).
        ``worker_ids`` must be ``None``: every worker reaches one set of
        served weights, so a push cannot leave some of them out.
        """
        if worker_ids is not None:
            raise ValueError(
                f"worker_ids={worker_ids!r}: the collector's workers share the served weights, so a push reaches "
                "all of them; call update_policy_weights_() without worker_ids"
            )
        if weights is not None:
            weights = as_weights(weights)
            if isinstance(weights, TensorDictBase) and weights.is_empty():
                weights = None
        if weights is None:
            if self._server is not None:
                return self._server.update_weights()
            if self._module is None:
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        "a weight group's scheme was given no weights and has no module= to take them from: "
                        "nothing was sent. Pass update_policy_weights_(policy), or module=policy to the scheme",
                        UserWarning,
                        stacklevel=2,
                    )
                return None
            weights = as_weights(self._module)
        return self.create_transport().send_weights(weights)

    def create_transport(self, **kwargs: Any) -> _ServerTransport:
        """The transport that ``send`` uses (the server's staging, or the weight group)."""
        if self._server is not None:
            return _ServerTransport(self._server.update_weights)
        if self._broadcaster is None:  # not connected by a collector (a direct send, the legacy adapter): now
            self._setup_connection_and_weights_on_sender_impl()
        return _ServerTransport(self._broadcaster.push)  # type: ignore[union-attr]

    # -- receiver side (collector workers: they run a RemotePolicy and what is around it) -----

    def _init_on_receiver_impl(self, model_id: str, context: Any = None, **kwargs: Any) -> None:
        self._model_id = model_id
        if kwargs.get("model") is not None:
            self.model = kwargs["model"]

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx: int | None = None) -> None:
        # A multi-process collector sends its policy to the workers on the meta device, for the scheme to fill:
        # the server holds the served weights, and the modules around the RemotePolicy get theirs from here.
        if self._around is not None and self.model is not None:
            self.apply_weights(self._around, inplace=False)

    def receive(self, timeout: float | None = None) -> None:  # type: ignore[override]
        return None

    # -- lifecycle -----------------------------------------------------------------------

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_server"] = None  # workers get the receiver side only
        state["_module"] = None
        state["_broadcaster"] = None
        return state

    def shutdown(self) -> None:
        broadcaster, self._broadcaster = getattr(self, "_broadcaster", None), None
        if broadcaster is not None:
            broadcaster.close()
        super().shutdown()

    def __del__(self) -> None:
        # TorchRL's shuts the scheme down. No goodbye to the servers from a finalizer, though: a collective inside a
        # garbage collection can abort the process. (At exit the broadcaster said it already, from an atexit hook;
        # dropped earlier, it leaves the servers to see the trainer gone.)
        self._broadcaster = None
        super().__del__()

    def __repr__(self) -> str:
        where = self._rendezvous
        target = "server in this process" if where is None else f"weight group {where[0]}:{where[1]} of {where[2]}"
        return f"{type(self).__name__}({target})"


def _check_served(policy: Any, collector: str, server: Any) -> None:
    """Refuse a collector policy that the scheme's pushes never reach.

    That is one that holds no RemotePolicy, or, for a scheme of a server in
    this process, only RemotePolicies of other servers in this process. (A
    policy made in the workers by a ``policy_factory`` is not here to check;
    a RemotePolicy reaching a server elsewhere cannot be told apart.)
    """
    if not isinstance(policy, nn.Module):
        return
    remotes = [m for m in policy.modules() if isinstance(m, RemotePolicy)]
    if not remotes:
        raise TypeError(
            f"weight_sync_schemes['policy'] pushes to a BatchedPolicyServer, but the {collector}'s policy "
            f"({type(policy).__name__}) holds no RemotePolicy: it would run its own weights and never the pushed "
            "ones. Give the collector server.remote_policy() (or, to update a server beside the collector's own "
            "policy, register the scheme under another name)"
        )
    owners = [getattr(r._endpoint, "owner", None) for r in remotes]  # None: served from elsewhere
    if server is not None and None not in owners and not any(o is server for o in owners):
        raise ValueError(
            f"weight_sync_schemes['policy'] pushes to {server!r}, but the {collector}'s RemotePolicy is served by "
            f"another server, {owners[0]!r}: the collector would never run the pushed weights. Give the scheme of "
            "the server that serves the collector (its weight_sync_scheme()), or register this one under another name"
        )


def _state_around(policy: Any, collector: Any) -> TensorDictBase | None:
    """For a multi-process collector's workers: the parameters and buffers of its policy, in shared memory.

    A RemotePolicy holds none; the modules around it may (an exploration
    module, a local head). TorchRL sends the workers the policy on the meta
    device for the scheme to fill, and this fills it with the collector's own
    tensors, moved into shared memory as TorchRL's legacy multi-process
    weights are: what the trainer changes in place (an exploration module's
    ``step()``, an optimizer step) reaches the workers at once.
    """
    from torchrl.collectors import MultiCollector  # imported by the collector given (at import, it warns)

    if not isinstance(collector, MultiCollector) or not isinstance(policy, nn.Module):
        return None
    state = TensorDict.from_module(policy).data
    return None if state.is_empty() else state.share_memory_()


_UPDATER: type | None = None


def weight_updater(target: Any) -> Any:
    """A legacy ``WeightUpdaterBase`` for ``Collector(..., weight_updater=...)``.

    ``target`` is a :class:`BatchedPolicyServer` in this process or a
    :class:`BatchServeWeightSyncScheme`; ``update_policy_weights_()`` with no
    argument pushes what the scheme's ``send()`` does (the current weights of
    the module the server was built with). The class is created on first call
    (``WeightUpdaterBase`` warns when subclassed; TorchRL deprecates it in
    favour of :class:`BatchServeWeightSyncScheme`, which new code should use).
    """
    global _UPDATER
    if not (isinstance(target, BatchServeWeightSyncScheme) or callable(getattr(target, "weight_sync_scheme", None))):
        raise TypeError(
            f"target must be a BatchedPolicyServer or a BatchServeWeightSyncScheme, got {type(target).__name__}"
        )
    if _UPDATER is None:
        from torchrl.collectors import WeightUpdaterBase

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)

            class BatchServeWeightUpdater(WeightUpdaterBase):  # type: ignore[misc, valid-type]
                """Pushes a collector's ``update_policy_weights_`` to a server."""

                def __init__(self, target: Any) -> None:
                    scheme = getattr(target, "weight_sync_scheme", None)  # a server, or a scheme already
                    self._scheme = target if scheme is None else scheme()

                def _sync_weights_with_worker(self, *, worker_id: Any = None, server_weights: Any) -> None:
                    # None: the module the server serves, as trained now; a worker_id (asked for): refused
                    self._scheme.send(server_weights, worker_ids=worker_id)

                def _get_server_weights(self) -> Any:
                    return None

                def _maybe_map_weights(self, server_weights: Any) -> Any:
                    return server_weights

                def all_worker_ids(self) -> None:
                    return None

        _UPDATER = BatchServeWeightUpdater
    return _UPDATER(target)
