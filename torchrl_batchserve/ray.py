"""Serving actors on every node of a Ray cluster (the only module that imports Ray).

::

    actor on node B --shared memory--> gateway of node B --TCP, one round trip per batch--> server actor (A)
    actor on node A --shared memory-------------------------------------------------------> server actor

:func:`serve_on_ray` starts a :class:`~torchrl_batchserve.BatchedPolicyServer`
inside a Ray actor. Its :meth:`RayServer.remote_policy` is a
:class:`~torchrl_batchserve.RemotePolicy` that pickles into any Ray task,
actor or driver. On first use there it asks the server actor for a policy of
its own node: on the server's node, the server's own process hub; on any
other node, the hub of that node's gateway. (A process that a Ray process
spawns, such as a collector's worker, gets that hub's client when the policy
is pickled into it, and needs no Ray.) A gateway is a Ray actor pinned to
its node (made by the server actor on first demand, so it dies with it) that
runs a ``BatchedPolicyServer`` of its own, whose "policy" sends each of its
batches over one TCP connection to the server actor, where it is served as
one request of its rows (or, for a server whose collate varies feature dims,
as the requests it holds); the rows' outputs and version stamps come back the
same way (:mod:`torchrl_batchserve.gateway`). No request pays a Ray call or
a round trip of its own: a node's actors reach their gateway through shared
memory, and a gateway batch costs one round trip however many rows it
carries (``gateway_depth`` batches of a gateway are in flight at once). Ray
carries the control plane only: placement, finding the server, weights,
statistics.

Weights travel through Ray's object store: :meth:`RayServer.update_weights`
(one server) and :func:`push_weights` (several) check the push against each
served layout in the pushing process (a mismatch raises
:class:`~torchrl_batchserve.errors.WeightSyncError` before anything moves)
and stage it in every server with one version.

Faults: a gateway's node may die (the server serves the others); a server
actor that dies ends its gateways with it, so every waiting actor gets
:class:`~torchrl_batchserve.errors.ServerBrokenError` from its socket at once;
so does one that Ray ends gracefully (a SIGTERM, say): it ends as if killed.
A server that is closed closes its gateways first, so that each serves its
node's queue and tells its actors
:class:`~torchrl_batchserve.errors.ServerClosedError`.
With ``max_restarts``, Ray restarts the server actor from ``policy_factory``:
it refuses clients until the trainer pushes weights again (the factory's
weights are not the trainer's), then serves with versions that go on from
the pushing handle's last one; clients connect again on their next call.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler
from typing import Any

import ray
import torch
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tensordict import TensorDict, TensorDictBase

from torchrl_batchserve.checks import check_int, check_seconds
from torchrl_batchserve.errors import ServerBrokenError, ServerClosedError, WeightSyncError, own_copy
from torchrl_batchserve.gateway import Gateway, LinkListener, Unstacked, exit_as_killed_unless
from torchrl_batchserve.remote import RemotePolicy
from torchrl_batchserve.server import BatchedPolicyServer
from torchrl_batchserve.stats import ServerStatistics, check_since
from torchrl_batchserve.transport.wire import dumps
from torchrl_batchserve.weights import ShadowWeights, as_weights, check_version

__all__ = ["RayServer", "push_weights", "serve_on_ray"]

_log = logging.getLogger(__name__)

MAX_CONCURRENCY = 32  # the server actor's threads for Ray calls: connects (each may start a gateway), pushes
CONNECT_TIMEOUT = 120.0  # seconds a client waits for the server actor (a restart included) to give it a policy


def serve_on_ray(
    policy_factory: Callable[[], Any],
    *,
    num_gpus: float = 0,
    resources: dict[str, float] | None = None,
    num_cpus: float = 1,
    max_restarts: int = 0,
    gateway_depth: int = 2,
    start_timeout: float = CONNECT_TIMEOUT,
    **server_kwargs: Any,
) -> RayServer:
    """Start a :class:`~torchrl_batchserve.BatchedPolicyServer` as a Ray actor; return its handle.

    Args:
        policy_factory: builds the policy in the server actor (a picklable
            callable: the policy itself is never shipped).

    Keyword Args:
        num_gpus: GPUs the server actor reserves (``1`` puts it on a GPU node;
            pass ``device="cuda"`` among ``server_kwargs`` to serve there).
        resources: custom Ray resources the server actor needs, e.g.
            ``{"server_node": 1}`` to choose a node.
        num_cpus: CPUs the server actor reserves.
        max_restarts: how often Ray may restart a dead server actor (see the
            module docstring: a restarted server serves after the next push).
        gateway_depth: batches each node's gateway keeps in flight to the server.
        start_timeout: seconds the server actor may take to start, its
            ``policy_factory`` included (raise it for a factory that loads a
            large checkpoint); past it, the actor is killed and
            ``TimeoutError`` raised.
        server_kwargs: the ``BatchedPolicyServer`` keywords (``max_batch_size``,
            ``timeout``, ``device``, ...). Gateways batch with the same
            ``max_batch_size`` and ``timeout``.

    Needs a connected Ray (``ray.init``) in the calling process.
    """
    if not ray.is_initialized():
        raise RuntimeError("serve_on_ray needs a connected Ray: call ray.init(...) first")
    check_int("gateway_depth", gateway_depth, 1)
    start_timeout = check_seconds("start_timeout", start_timeout, positive=True)
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": max_restarts}
    if resources:
        options["resources"] = dict(resources)
    actor: Any = (
        ray.remote(_ServerActor)
        .options(max_concurrency=MAX_CONCURRENCY, **options)
        .remote(policy_factory, server_kwargs, gateway_depth)
    )
    try:
        described: dict[str, Any] = ray.get(actor.describe.remote(), timeout=start_timeout)
    except BaseException as err:  # no server actor is left starting, or serving, with no handle to it
        ray.kill(actor, no_restart=True)
        if isinstance(err, RayTaskError):
            raise _cause(err) from None
        if isinstance(err, GetTimeoutError):
            raise TimeoutError(
                f"the server actor did not start within start_timeout={start_timeout:g} s (its policy_factory "
                "included), and was killed. Pass a larger start_timeout for a slow factory. Ray runs its workers "
                "at niceness 15, where busy processes of the node at niceness 0 starve them: RAY_worker_niceness=0 "
                "in the environment of `ray start` leaves them at 0"
            ) from None
        raise
    return RayServer(actor, **described)


class RayServer:
    """The handle of a server running as a Ray actor (:func:`serve_on_ray`); picklable.

    Every copy, on any node, reaches the same server.
    """

    def __init__(
        self,
        actor: Any,
        *,
        in_keys: list,
        out_keys: list,
        layout: TensorDictBase,
        optional: Any = (),
        primer: Any = None,
    ) -> None:
        self.actor = actor
        self.in_keys = list(in_keys)
        self.out_keys = list(out_keys)
        self._primer = primer  # the served policy's TensorDictPrimer transforms, for make_tensordict_primer()
        # the served names, shapes, dtypes (meta tensors) and what a push may leave out: pushes are checked here
        self._layout = ShadowWeights(layout, optional=optional)
        self._version = 0  # the newest version this handle pushed or saw
        self.closed = False  # whether close() was called on this handle
        self._stopped: bool | None = None  # what close() returned

    def __reduce__(self) -> tuple:
        layout = self._layout
        state = (self.in_keys, self.out_keys, layout.served, layout.optional, self._primer, self._version)
        return _handle, (self.actor, *state)

    def remote_policy(self) -> RemotePolicy:
        """A :class:`~torchrl_batchserve.RemotePolicy` that works in any Ray task, actor or driver."""
        return RemotePolicy(RayEndpoint(self.actor), self.in_keys, self.out_keys, self._primer)

    def update_weights(self, weights: Any = None, *, version: int | None = None) -> int:
        """Push ``weights`` (a module, a TensorDict or a state_dict); return the version they serve as.

        :func:`push_weights` to this server alone: checked here first, a
        mismatch raises :class:`~torchrl_batchserve.errors.WeightSyncError`,
        nothing is sent and the server keeps its weights. No weights (a
        collector's ``update_policy_weights_()``) is a ``WeightSyncError``
        too: this process holds no served module to take them from.
        ``version``: as :meth:`BatchedPolicyServer.update_weights
        <torchrl_batchserve.BatchedPolicyServer.update_weights>` takes it.
        """
        return push_weights([self], weights, version=version)

    # TorchRL's RayCollector(policy=...) takes a Ray-owned inference service: one that says
    # service_backend == "ray" and has client(), clients(n) and update_model_weights(weights).
    service_backend = "ray"

    def client(self) -> RemotePolicy:
        """:meth:`remote_policy`, by the name TorchRL's inference services give it."""
        return self.remote_policy()

    def clients(self, num_clients: int) -> list[RemotePolicy]:
        """A :meth:`remote_policy` for each of ``num_clients`` collectors (``RayCollector(policy=handle)``)."""
        return [self.remote_policy() for _ in range(num_clients)]

    def update_model_weights(self, weights: Any) -> int:
        """:meth:`update_weights`: what ``RayCollector.update_policy_weights_(module)`` calls."""
        return self.update_weights(weights)

    def weight_sync_scheme(self) -> Any:
        """A TorchRL ``WeightSyncScheme`` for collectors: ``update_policy_weights_(policy)`` pushes here."""
        from torchrl_batchserve.weight_sync import BatchServeWeightSyncScheme

        return BatchServeWeightSyncScheme(server=self)

    def statistics(self, since: ServerStatistics | None = None) -> ServerStatistics:
        """The server's :meth:`~torchrl_batchserve.BatchedPolicyServer.statistics` (a gateway batch: one request)."""
        check_since(since)
        self._check_open()
        return _ask(self.actor, "statistics", since)

    def gateway_statistics(self) -> dict[str, ServerStatistics]:
        """Each live gateway's statistics, by node id: how its node's requests batch before they travel.

        A gateway whose node died (or that no longer answers) is left out.
        """
        self._check_open()
        return _ask(self.actor, "gateway_statistics")

    def close(self, timeout: float = 30.0) -> bool:
        """Close the server and its gateways, then end its actor; True when the serve loops stopped.

        Idempotent: a second call returns what the first did. After it, this
        handle's pushes and statistics raise
        :class:`~torchrl_batchserve.errors.ServerClosedError` (the actor is gone).
        """
        timeout = check_seconds("timeout", timeout)
        if self._stopped is not None:
            return self._stopped
        self.closed = True
        try:
            stopped = ray.get(self.actor.close.remote(timeout), timeout=timeout + 10)
        except (RayActorError, GetTimeoutError):
            stopped = False
        ray.kill(self.actor, no_restart=True)
        self._stopped = stopped
        return stopped

    def _check_open(self) -> None:
        if self.closed:
            raise ServerClosedError("the server is closed (this handle closed it) and its actor is gone")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(in_keys={self.in_keys}, out_keys={self.out_keys})"


def push_weights(servers: Sequence[RayServer], weights: Any, *, version: int | None = None) -> int:
    """Push one set of weights to every server of ``servers`` as one version; return it.

    ``weights`` is a module, a TensorDict or a state_dict. It is checked
    against every server's layout before anything moves: a mismatch with any
    raises :class:`~torchrl_batchserve.errors.WeightSyncError` and every
    server keeps its weights. It then goes into Ray's object store once, and
    each server stages it between two of its batches. The version follows the
    newest any of them serves or any of these handles pushed (a restarted
    server included), so all serve it under one number; or it is
    ``version``, which must be newer than that
    (:class:`~torchrl_batchserve.errors.WeightSyncError` otherwise).
    """
    servers = list(servers)
    if not servers or not all(isinstance(s, RayServer) for s in servers):
        raise TypeError(f"servers must be a non-empty sequence of RayServer handles (serve_on_ray), got {servers!r}")
    for server in servers:
        server._check_open()
    if weights is None:
        raise WeightSyncError(
            "a Ray-served server has no trainer module in this process to take weights from: pass the weights "
            "(a module, a TensorDict or a state_dict)"
        )
    version = check_version(version)
    tensors = as_weights(weights)
    for server in servers:
        tensors = server._layout.fit(tensors)
    current = max(_ask(s.actor, "version") for s in servers)
    after = max([current, *(s._version for s in servers)])
    if version is not None:
        if version <= after:  # refused before the weights go into the object store
            raise WeightSyncError(f"version must increase: staged {after}, got {version}")
        after = version - 1  # each server stages the one after this
    stored = ray.put(dumps(tensors.detach().to("cpu")))  # torch's own pickling cannot restore every dtype
    versions = [_ask(s.actor, "update_weights", stored, after) for s in servers]
    for server, version in zip(servers, versions):
        server._version = version
    if len(set(versions)) > 1:
        raise WeightSyncError(f"the servers staged the push as versions {versions}: another trainer pushed meanwhile")
    return versions[0]


def _handle(
    actor: Any, in_keys: list, out_keys: list, layout: TensorDictBase, optional: Any, primer: Any, version: int
) -> RayServer:
    handle = RayServer(actor, in_keys=in_keys, out_keys=out_keys, layout=layout, optional=optional, primer=primer)
    handle._version = version
    return handle


def _ask(actor: Any, method: str, *args: Any) -> Any:
    """Call ``actor.method(*args)`` and wait for it; while Ray restarts the actor, ask again.

    What the method raised is raised as it is; an actor that is gone, or that does not answer within
    ``CONNECT_TIMEOUT`` seconds, is a :class:`~torchrl_batchserve.errors.ServerBrokenError`.
    """
    deadline = time.monotonic() + CONNECT_TIMEOUT
    while True:
        try:
            return ray.get(getattr(actor, method).remote(*args), timeout=max(0.0, deadline - time.monotonic()))
        except ActorUnavailableError as err:
            if time.monotonic() > deadline:
                raise ServerBrokenError(f"the server actor was unavailable for {CONNECT_TIMEOUT:g} s: {err}") from err
            time.sleep(0.1)
        except RayTaskError as err:
            raise _cause(err) from None
        except RayActorError as err:
            raise ServerBrokenError(f"the server actor is gone: {err}") from err
        except GetTimeoutError as err:
            raise ServerBrokenError(f"the server actor did not answer {method} within {CONNECT_TIMEOUT:g} s") from err


def _cause(err: RayTaskError) -> BaseException:
    """The exception a Ray method raised, out of Ray's wrapper."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


class RayEndpoint:
    """A :class:`~torchrl_batchserve.RemotePolicy`'s endpoint in a Ray process: a client of its node's hub.

    The hub is asked of the server actor on first use in each process (so it
    pickles anywhere and connects where it is used). When the hub goes away
    (:class:`~torchrl_batchserve.errors.ServerBrokenError`), the next call
    asks again: a restarted server actor is found that way. A closed server
    stays closed: its hub's client raises
    :class:`~torchrl_batchserve.errors.ServerClosedError` for every later call.
    """

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._lock = threading.Lock()
        self._local: tuple[int, RemotePolicy] | None = None  # (pid, this node's policy)

    def __reduce__(self) -> tuple:
        return RayEndpoint, (self.actor,)

    def _policy(self) -> RemotePolicy:
        with self._lock:
            if self._local is None or self._local[0] != os.getpid():
                self._local = (os.getpid(), self._inherited() if _forked_from_ray else self._connect())
            return self._local[1]

    def _connect(self) -> RemotePolicy:
        """This node's policy, asked of the server actor."""
        return _ask(self.actor, "connect", ray.get_runtime_context().get_node_id())

    def _inherited(self) -> RemotePolicy:
        """In a fork of a Ray process, whose Ray connection does not work (asking would hang): the parent's policy.

        Its hub's client connects anew in this child.
        """
        if self._local is None:
            raise ServerBrokenError(
                "this process was forked from a Ray process that had not called the policy: call it once "
                "before forking, or spawn the process (a spawned one gets its node's hub client)"
            )
        return self._local[1]

    def _forget(self, policy: RemotePolicy) -> None:
        with self._lock:
            if self._local is not None and self._local[1] is policy:
                self._local = None

    def call(self, td: TensorDictBase) -> TensorDictBase:
        policy = self._policy()
        try:
            return policy(td)
        except ServerBrokenError:
            self._forget(policy)  # its hub is gone: the next call asks the server actor again
            raise

    def submit(self, td: TensorDictBase) -> Future[TensorDictBase]:
        policy = self._policy()
        future = policy.submit(td)
        future.add_done_callback(
            lambda f: (
                self._forget(policy) if not f.cancelled() and isinstance(f.exception(), ServerBrokenError) else None
            )
        )
        return future

    def _for_a_child(self) -> tuple:
        """How ``multiprocessing`` pickles it (a collector's worker processes, on this node, without Ray).

        A spawned child of a Ray process is no Ray process: it cannot
        unpickle the server actor's handle. It gets this node's hub client
        instead (asked of the server actor here, if this process has not yet),
        as a pickled ``RemotePolicy`` of a server in its own process would.
        Ray pickles it by ``__reduce__``, to reconnect on whichever node it lands.
        """
        return self._policy()._endpoint.__reduce__()

    async def acall(self, td: TensorDictBase) -> TensorDictBase:
        policy = await asyncio.to_thread(self._policy) if self._local is None else self._policy()
        try:
            return await policy.acall(td)
        except ServerBrokenError:
            self._forget(policy)
            raise


ForkingPickler.register(RayEndpoint, RayEndpoint._for_a_child)

_forked_from_ray = False  # this process is a fork of a Ray process: only what it inherited reaches a server


def _after_fork_in_child() -> None:
    global _forked_from_ray
    _forked_from_ray = _forked_from_ray or ray.is_initialized()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _ServerActor:
    """The Ray actor that holds the server (threaded: connects and pushes may overlap)."""

    def __init__(self, policy_factory: Callable[[], Any], server_kwargs: dict[str, Any], gateway_depth: int) -> None:
        context = ray.get_runtime_context()
        self._failure: BaseException | None = None
        try:
            self._server = BatchedPolicyServer(policy_factory(), **server_kwargs)
        except Exception as err:  # raised by describe(), so serve_on_ray raises it as it is
            self._failure = err
            return
        self._policy = self._server.remote_policy()
        self._node = context.get_node_id()
        self._gateway_depth = gateway_depth
        self._gateways: dict[str, tuple[Any, RemotePolicy]] = {}
        self._starting: dict[str, threading.Lock] = {}  # per node: held while its gateway is checked or started
        self._closed = False
        self._lock = threading.Lock()  # guards the three above
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Ray's own property calls a deprecated one of Ray's
            self._waiting_for_weights = bool(context.was_current_actor_reconstructed)
        self._returned = self._server._serving.delivered  # itself: the first batch fixes it (an out_key's tensorclass)
        self._request_keys = list(self._server._serving.layout.keys)  # in_keys but those the collate writes
        self._variable = dict(getattr(self._server.collate, "variable_dims", None) or {})
        self._links = LinkListener(self._server, self._returned, ray.util.get_node_ip_address())
        exit_as_killed_unless(lambda: self._closed)

    def describe(self) -> dict[str, Any]:
        if self._failure is not None:
            raise own_copy(self._failure)
        layout = TensorDict.from_module(self._server.policy).apply(lambda t: torch.empty_like(t, device="meta"))
        optional = self._server._weights.optional
        return {
            "in_keys": self._server.in_keys,
            "out_keys": self._server.out_keys,
            "layout": layout,
            "optional": optional,
            "primer": self._server._primer,
        }

    def connect(self, node: str) -> RemotePolicy:
        """The policy a client on ``node`` uses: this server's hub here, the node's gateway elsewhere."""
        if self._waiting_for_weights:
            raise ServerBrokenError("the server actor was restarted and serves again after the trainer's next push")
        if self._closed:  # set before the server closes (close())
            raise ServerClosedError("the server is closed and accepts no more requests")
        if node == self._node:
            return self._policy
        with self._lock:
            starting = self._starting.setdefault(node, threading.Lock())
        with starting:  # one gateway start per node at a time; other nodes' connects go on meanwhile
            with self._lock:
                entry = self._gateways.get(node)
            if entry is not None:
                if _healthy(entry[0]):
                    return entry[1]
                with self._lock:
                    self._gateways.pop(node, None)
                ray.kill(entry[0], no_restart=True)  # its link broke: a new one replaces it
            gateway, policy = self._start_gateway(node)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._gateways[node] = (gateway, policy)
            if closed:  # close() ran while it started: it has no gateway to stop but this one
                ray.kill(gateway, no_restart=True)
                raise ServerClosedError("the server is closed and accepts no more requests")
            return policy

    def _start_gateway(self, node: str) -> tuple[Any, RemotePolicy]:
        """A gateway actor on ``node``, started, and its policy."""
        kwargs: dict[str, Any] = {
            "max_batch_size": self._server.max_batch_size,
            "timeout": self._server.timeout,
            "cost_fn": self._server.cost_fn,  # a gateway batch fits max_batch_cost here too
            "max_batch_cost": self._server.max_batch_cost,
            "device": ["cpu"] * self._gateway_depth,  # one serve loop per batch in flight
            "policy_version_key": None,  # the server's stamps come through as outputs
        }
        if self._variable:  # rows of different shapes: each request goes on as it came
            kwargs["collate"] = Unstacked(self._variable, self._server.collate)
        link = (self._links.address, self._links.authkey)
        gateway: Any = (
            ray.remote(Gateway)
            .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(link, self._request_keys, self._returned, kwargs)
        )
        try:
            return gateway, ray.get(gateway.remote_policy.remote())
        except RayActorError as err:  # e.g. the node died before its gateway started
            raise ServerBrokenError(f"the gateway of node {node} could not start: {err}") from err

    def version(self) -> int:
        return self._server.policy_version

    def update_weights(self, weights: bytes, after: int) -> int:
        """Stage a push (pickled by ``dumps``); its version follows both this server's and ``after`` (the
        pushers' last one)."""
        staged = pickle.loads(weights)
        version = self._server.update_weights(staged, version=max(self._server.policy_version, after) + 1)
        self._waiting_for_weights = False
        return version

    def statistics(self, since: ServerStatistics | None) -> ServerStatistics:
        return self._server.statistics(since)

    def gateway_statistics(self) -> dict[str, ServerStatistics]:
        with self._lock:
            asked = {node: gateway.statistics.remote() for node, (gateway, _) in self._gateways.items()}
        out = {}
        for node, answer in asked.items():
            try:
                out[node] = ray.get(answer, timeout=CONNECT_TIMEOUT)
            except (RayActorError, GetTimeoutError):  # its node died (or it no longer answers): no statistics
                continue
        return out

    def close(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
            gateways, self._gateways = [gateway for gateway, _ in self._gateways.values()], {}
        # Each gateway serves what its node's actors queued and tells them the server closed, while the links
        # and this server still serve (killed at once, they would take it for a server that died); then it goes.
        if gateways:
            ray.wait([g.close.remote(timeout) for g in gateways], num_returns=len(gateways), timeout=timeout)
        for gateway in gateways:
            ray.kill(gateway, no_restart=True)
        self._links.close()
        return self._server.close(timeout=max(0.0, deadline - time.monotonic()))


def _healthy(gateway: Any) -> bool:
    try:
        return bool(ray.get(gateway.healthy.remote(), timeout=CONNECT_TIMEOUT))
    except (RayActorError, GetTimeoutError):
        return False
