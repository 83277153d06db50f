"""BatchedPolicyServer: the server's parts, its lifecycle and its public face.

The parts, each in the module named for it::

    RemotePolicy -> LocalEndpoint / ProcessHub      how a request arrives
                 -> Intake                          validate, admit (cache), queue
                 -> RequestQueue                    the batching rule
                 -> Serving.loop, one per Replica   the one serve loop
                 -> Request.finish / fail           how the result leaves

This file checks the arguments, builds the parts and closes them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase, dispatch
from tensordict.utils import NestedKey, unravel_key_list
from torch import nn

from torchrl_batchserve.cache import EvaluationCache, sampling_modes
from torchrl_batchserve.checks import check_device, check_devices, check_int, check_seconds
from torchrl_batchserve.collate import StackCollate, as_collate
from torchrl_batchserve.distributed import WeightReceiver
from torchrl_batchserve.errors import ServerClosedError
from torchrl_batchserve.intake import CURRENT, Intake
from torchrl_batchserve.layout import Layout, layout_of
from torchrl_batchserve.policy import as_policy, check_stamp_key, read_keys, refuse_hidden_state, warn_if_training
from torchrl_batchserve.queue import RequestQueue
from torchrl_batchserve.reaper import collected, start_reaper
from torchrl_batchserve.remote import RemotePolicy, primers_of
from torchrl_batchserve.replica import Replica, served_copy
from torchrl_batchserve.serve import Serving, serving_here
from torchrl_batchserve.stats import ReplicaStatistics, ServerStatistics, StatisticsRecorder, check_since
from torchrl_batchserve.transport.local import LocalEndpoint
from torchrl_batchserve.varlen import PackCollate
from torchrl_batchserve.weights import ShadowWeights, non_persistent

__all__ = ["BatchedPolicyServer"]

_log = logging.getLogger(__name__)


class BatchedPolicyServer(TensorDictModule):
    """Serve one policy to many actors, one batched forward at a time.

    Actors call a :class:`~torchrl_batchserve.RemotePolicy` (from
    :meth:`remote_policy`) with single TensorDicts; serve threads gather them
    into batches by the rule of :mod:`torchrl_batchserve.queue`, run the
    policy once per batch under ``torch.no_grad`` and route every actor its
    own rows, which nothing the server does later changes.

    The server serves its own copy of the policy's weights, one per device,
    changed only by a versioned update (:meth:`update_weights`) between two
    batches. It is itself a ``TensorDictModule`` around the policy it was
    given: its ``in_keys``, ``out_keys`` and parameters are that policy's,
    which a trainer may train in place while the server serves, then push
    with ``server.update_weights()`` (no argument: that module's current
    weights). Calling the server, ``server(td)``, serves ``td`` batched like
    a ``RemotePolicy``. It is no collector's policy, though: given the server,
    a TorchRL collector raises ``TypeError`` at construction (one in this
    process would copy the trainer's weights onto themselves at
    ``update_policy_weights_()`` and serve the old ones on; the server cannot
    be pickled into workers). Collectors take ``remote_policy()``. Moving or
    casting it (``server.to(...)``, ``.cuda()``, ``.double()``) raises
    ``TypeError``: that would change the trainer's module, not the served
    copies, which ``device=`` places.

    Args:
        policy: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with
            ``in_keys``/``out_keys`` (attributes or the keywords below). It
            must support ``copy.deepcopy``.

    Keyword Args:
        max_batch_size: rows that make a batch full (default 64).
        timeout: seconds the oldest queued request waits for a fuller batch
            (default 0.002). A batch also fires at once when every caller the
            server knows of is already waiting.
        collate: a :class:`~torchrl_batchserve.collate.Collate` or a
            TorchRL-style ``collate_fn(list[TensorDict])``; default: stack.
        device: where the policy runs: a device, or a sequence of devices
            (one replica each, fed from one queue; ``["cpu", "cpu"]`` works
            too). Default: the copy stays where the policy is and batches
            run on the requests' device.
        output_device: where results go; default: each request's own device.
        max_queue_size: most rows that may wait; more raise
            :class:`~torchrl_batchserve.errors.QueueFullError`. Default: no bound.
        cost_fn: ``cost_fn(td) -> int``, what a request costs (e.g.
            :class:`~torchrl_batchserve.LengthCost`: its tokens); with
            ``max_batch_cost``, a batch also stops growing at that total, and a
            request costing more alone is refused at submit.
        max_batch_cost: the bound on a batch's total cost (needs ``cost_fn``).
        cache: an :class:`~torchrl_batchserve.EvaluationCache`: repeated rows
            are answered at submit from the outputs of the newest weight
            version, identical rows in flight share one computed row;
            requests that sample (:func:`~torchrl_batchserve.cache.sampling_modes`)
            bypass it.
        policy_version_key: key under which each result carries the version of
            the weights that computed it; ``None`` disables the stamp.
        input_spec: the layout requests must have (dtype, feature shape and
            device of each entry the policy reads), given up front: a TorchRL
            ``Composite`` such as ``env.observation_spec`` (its shape is the
            batch dims) or a sample request such as ``env.reset()``. Default:
            the first batch served successfully fixes it. Requests that do
            not fit get :class:`~torchrl_batchserve.errors.BadRequestError`;
            feature dims the collate varies stay free.
        forward_timeout: seconds a forward may take; past it, that batch's
            callers get :class:`~torchrl_batchserve.errors.ForwardTimeoutError`
            and the server is broken (a stuck thread cannot be stopped).
            Default: no limit.
        static_batch_size: every forward gets exactly this many rows (at
            least ``max_batch_size``), for a policy that runs one shape only:
            a CUDA graph captured at that size, a module compiled without
            dynamic shapes. A smaller batch is padded by repeating its last
            row, and the padded rows' outputs are dropped (a packed batch,
            which has no rows, is refused). Default: batches run at their
            own size.
        in_keys: the input keys of a plain ``nn.Module`` policy.
        out_keys: the output keys of a plain ``nn.Module`` policy.

    Examples:
        >>> import torch
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl_batchserve import BatchedPolicyServer
        >>> net = torch.nn.Linear(4, 2)
        >>> policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
        >>> with BatchedPolicyServer(policy, max_batch_size=32, timeout=0.01) as server:
        ...     remote = server.remote_policy()
        ...     with ThreadPoolExecutor(8) as pool:
        ...         tds = list(pool.map(remote, [TensorDict(observation=torch.randn(4)) for _ in range(64)]))
        >>> all(torch.allclose(td["logits"], net(td["observation"])) for td in tds)
        True
        >>> server.statistics().requests
        64
    """

    def __init__(
        self,
        policy: TensorDictModuleBase | nn.Module,
        *,
        max_batch_size: int = 64,
        timeout: float = 0.002,
        collate: Any = None,
        device: Any = None,
        output_device: torch.device | str | None = None,
        max_queue_size: int | None = None,
        cost_fn: Callable[[TensorDictBase], int] | None = None,
        max_batch_cost: int | None = None,
        cache: EvaluationCache | None = None,
        policy_version_key: NestedKey | None = "policy_version",
        input_spec: Any = None,
        forward_timeout: float | None = None,
        static_batch_size: int | None = None,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
    ) -> None:
        if isinstance(policy, BatchedPolicyServer):
            raise TypeError(
                "policy is a BatchedPolicyServer; serve its policy, or pass server.remote_policy() to actors"
            )
        policy = as_policy(policy, in_keys, out_keys)
        warn_if_training(policy)
        refuse_hidden_state(policy)
        check_int("max_batch_size", max_batch_size, 1)
        timeout = check_seconds("timeout", timeout)
        if forward_timeout is not None:
            forward_timeout = check_seconds("forward_timeout", forward_timeout, positive=True)
        if max_queue_size is not None:
            check_int("max_queue_size", max_queue_size, 1)
        if static_batch_size is not None and check_int("static_batch_size", static_batch_size, 1) < max_batch_size:
            raise ValueError(
                f"static_batch_size must be >= max_batch_size={max_batch_size}: a full batch is padded to it, "
                f"never cut (got {static_batch_size})"
            )
        if (cost_fn is None) != (max_batch_cost is None):
            raise ValueError(
                f"cost_fn and max_batch_cost go together (got cost_fn={cost_fn!r}, max_batch_cost={max_batch_cost!r})"
            )
        if max_batch_cost is not None:
            check_int("max_batch_cost", max_batch_cost, 1)
            if not callable(cost_fn) or isinstance(cost_fn, type):  # a class would make an object, not a cost
                raise ValueError(f"cost_fn must be callable as cost_fn(td) -> int (got {cost_fn!r})")
        if policy_version_key is not None:
            check_stamp_key(policy_version_key, policy)
        if cache is not None and not isinstance(cache, EvaluationCache):
            raise TypeError(f"cache must be an EvaluationCache or None, got {type(cache).__name__}")
        devices = check_devices(device)
        output_device = check_device("output_device", output_device)
        if collate is None and any(d is not None and d.type == "cuda" for d in devices):
            collate = StackCollate(pin_memory=True)
        collate = as_collate(collate)
        provided = set(unravel_key_list(list(getattr(collate, "provided_keys", ()))))
        in_keys = read_keys(policy)
        keys = [k for k in in_keys if k not in provided]
        variable = getattr(collate, "variable_dims", None) or {}
        unread = [k for k in variable if k not in keys]
        if unread:
            raise ValueError(f"collate {collate!r} varies {unread}; the policy reads {keys} from requests")
        out_keys = [k for k in unravel_key_list(list(policy.out_keys)) if k != "_"]  # "_": an output it drops
        unwritten = [k for k in getattr(collate, "cut_keys", ()) if k not in out_keys]
        if unwritten:  # never cut: callers would get padded outputs
            raise ValueError(f"collate {collate!r} cuts {unwritten}; the policy writes {out_keys}")
        if static_batch_size is not None and isinstance(collate, PackCollate):  # it would be ignored
            raise ValueError(
                f"static_batch_size={static_batch_size} pads a batch's rows, and {collate!r} packs requests into a "
                "batch without rows: use PadCollate (with buckets) for a policy that runs fixed shapes"
            )
        specs = None if input_spec is None else layout_of(input_spec, keys, variable)
        check = getattr(collate, "check", None)
        layout = Layout(keys, variable, specs, check=check, cost_fn=cost_fn, max_cost=max_batch_cost)
        served = [served_copy(policy, d) for d in devices]  # last: a refused server copies nothing
        if cache is not None:
            cache.serve()  # and takes no cache

        super().__init__(policy, in_keys=in_keys, out_keys=out_keys)
        self.training = policy.training  # the mode served (``train()``), as the copies were made
        self.max_batch_size = max_batch_size
        self.timeout = timeout
        self.max_queue_size = max_queue_size
        self.max_batch_cost = max_batch_cost
        self.cost_fn = cost_fn
        self.policy_version_key = policy_version_key
        self.cache = cache
        self.collate = collate
        self._primer = primers_of(policy)  # a RemotePolicy's make_tensordict_primer()
        first = TensorDict.from_module(served[0])
        self._weights = ShadowWeights(first, devices[0], non_persistent(served[0]))
        self._replicas = [Replica(m, d, self._weights, i) for i, (m, d) in enumerate(zip(served, devices))]
        inline = forward_timeout is None  # a lone caller stuck in its own forward could not be told it timed out
        self._queue = RequestQueue(
            max_batch_size, timeout, max_queue_size, max_batch_cost, runners=len(devices), inline=inline
        )
        self._stats = StatisticsRecorder(max_batch_size, timeout)
        self._serving = Serving(
            self._queue,
            layout,
            collate,
            self._stats,
            cache=cache,
            out_keys=self.out_keys,
            version_key=policy_version_key,
            output_device=output_device,
            max_batch_size=max_batch_size,
            forward_timeout=forward_timeout,
            static_batch_size=static_batch_size,
        )
        sampling = sampling_modes(policy) if cache is not None else frozenset()
        self._intake = Intake(
            layout,
            self._queue,
            self._stats,
            self._weights,
            cache,
            self._serving.delivered,
            sampling,
        )
        self._endpoint = LocalEndpoint(self._intake, self._serving, self)
        self._lifecycle = threading.Lock()
        self._receivers: list[WeightReceiver] = []
        # Dropped without close() (and no RemotePolicy left in this process): the loops end, queued requests
        # fail, the hub goes (they never hold the server).
        self._finalizer = weakref.finalize(
            self, collected, os.getpid(), self._queue, self._serving, self._endpoint.lazy_hub, self._receivers
        )
        start_reaper()
        try:
            self._serving.start(self._replicas)
        except BaseException:  # a thread that cannot start (a container's process limit): none stays waiting
            self._queue.close()
            raise
        _SERVERS.add(self)

    # -- the module face -------------------------------------------------------

    @property
    def policy(self) -> TensorDictModuleBase:
        """The policy this server was built with (the trainer's module; the server serves copies of it)."""
        return self.module

    @dispatch(auto_batch_size=False)
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Serve ``tensordict`` batched, as ``server.remote_policy()(tensordict)`` does."""
        return self._endpoint.call(tensordict)

    def train(self, mode: bool = True) -> BatchedPolicyServer:
        """Serve in training mode, or in eval mode with ``mode=False`` (``eval()``), from each replica's next batch on.

        It sets the served copies' mode (dropout, batch norms, TorchRL's
        ``NoisyLinear``); the module the server was built with, the trainer's,
        keeps its own. A ``RemotePolicy``'s ``eval()`` changes nothing served.
        """
        if not isinstance(mode, bool):
            raise ValueError(f"mode must be a bool (got {mode!r})")
        self.training = self._weights.mode = mode
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> BatchedPolicyServer:
        """Refuse ``to``, ``cuda``, ``double`` and the like: they would change the trainer's module, not the served."""
        raise TypeError(
            "a BatchedPolicyServer serves copies of its policy placed when it is built: .to(), .cuda(), .double() and "
            "the like would change only the module it was given (the trainer's), not what it serves. Build the "
            "server with device=... (and a policy of the dtype to serve); change the trainer's module directly"
        )

    def register_collector(self, collector: Any) -> None:
        """Refuse to be a collector's policy (TorchRL's ``Collector`` calls this on the policy it is given)."""
        raise TypeError(
            f"{type(collector).__name__} was given the BatchedPolicyServer as its policy: give it "
            "server.remote_policy(), with weight_sync_schemes={'policy': server.weight_sync_scheme()} so that "
            "update_policy_weights_() serves the trained weights. Given the server itself, the collector would copy "
            "the weights onto themselves and the server would go on serving its old version"
        )

    def __reduce__(self) -> tuple:
        # A multi-process collector would pickle the server and sync its parameters into
        # the workers' copies: only its RemotePolicy travels, and holds no weights.
        # "cannot pickle" in the message: TorchRL's multi-process collectors re-raise a TypeError
        # that says so (chained), and silently drop any other one from a worker's start.
        raise TypeError(
            "cannot pickle or copy a BatchedPolicyServer; give worker processes (e.g. MultiSyncCollector) "
            "server.remote_policy() as their policy (policy=, not a policy_factory): it pickles, and reaches this "
            "server from there"
        )

    def __repr__(self) -> str:
        devices = [str(r.device) for r in self._replicas]
        return (
            f"{type(self).__name__}(policy={type(self.module).__name__}, max_batch_size={self.max_batch_size}, "
            f"timeout={self.timeout}, device={devices if len(devices) > 1 else devices[0]})"
        )

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> BatchedPolicyServer:
        """The serve loops start with the server; this only checks it is not closed."""
        if self._queue.closed:
            raise ServerClosedError("a closed server cannot be started again")
        return self

    def close(self, wait: bool = True, cancel_pending: bool = False, timeout: float | None = None) -> bool:
        """Stop serving; return True when every serve loop has stopped.

        New requests fail at once with
        :class:`~torchrl_batchserve.errors.ServerClosedError`. Queued requests
        are served first, unless ``cancel_pending`` fails them with that
        error. Idempotent. With ``wait``, blocks at most ``timeout`` seconds
        in all (``None``: until the loops stop); when it gives up, every
        request still queued fails with ``ServerClosedError``. Called from
        inside a batch of this server (its policy's forward, a submit's
        done-callback), it closes as with ``wait=False``: no serve loop can
        stop before that batch is done.
        """
        if timeout is not None:
            timeout = check_seconds("timeout", timeout)  # before anything closes: a bad call changes nothing
        wait = wait and not serving_here(self._serving)
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        with self._lifecycle:
            pending = self._queue.close(cancel_pending)
            receivers = list(self._receivers)
            self._receivers.clear()  # in place: the finalizer holds the list
        self._serving.fail_closed(pending)
        for receiver in receivers:
            receiver.close((2.0 if deadline is None else left() or 0.0) if wait else 0.0)
        stopped = self._serving.join(left()) if wait else not self._serving.alive()
        if wait and not stopped:
            self._serving.fail_closed(self._queue.close(cancel_pending=True))  # gave up waiting: nothing stays queued
        self._endpoint.lazy_hub.close(left() if wait else 0.0)
        self._serving.close()
        self._stats.stop()
        return stopped

    @property
    def closed(self) -> bool:
        """Whether the server takes no more requests: closed, or broken (a serve loop died)."""
        return self._queue.closed

    def __enter__(self) -> BatchedPolicyServer:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- actors --------------------------------------------------------------------

    def remote_policy(self) -> RemotePolicy:
        """A :class:`~torchrl_batchserve.RemotePolicy` served by this server."""
        return RemotePolicy(self._endpoint, self.in_keys, self.out_keys, self._primer)

    def submit(
        self, tensordict: TensorDictBase, *, caller: Any = None, interaction: Any = CURRENT
    ) -> Future[TensorDictBase]:
        """Shortcut for ``server.remote_policy().submit(tensordict)``.

        ``caller`` (hashable) names who waits on the result, for the batching rule's
        ``all_waiting`` (default: the calling thread). A relay that submits
        for others from a pool of threads (a node's gateway) passes its own
        name, so that its requests count as one caller's. ``interaction`` is
        the interaction type the request runs under (an ``InteractionType``
        or ``None``; default: the one in effect now). A relay passes its
        callers': tensordict's interaction type is one value for the whole
        process, which other threads may be changing.
        """
        return self._endpoint.submit(tensordict, caller, interaction)

    # -- weights and statistics ----------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The version of the newest weights staged: every batch from now on runs with it or a newer one."""
        return self._weights.latest_version

    def update_weights(self, weights: Any = None, *, version: int | None = None) -> int:
        """Stage new weights; every replica serves them from its next batch on. Returns their version.

        ``weights`` is a TensorDict (``TensorDict.from_module(policy)``), a
        state_dict or a module of the served policy's structure; ``None``
        takes the current weights of the module the server was built with
        (the trainer's). A mismatch raises
        :class:`~torchrl_batchserve.errors.WeightSyncError` and the current
        weights keep serving. The copy is made here, in the caller's thread,
        from tensors it only reads (a trainer's autograd is not disturbed);
        the serve loops only swap it in between two batches. ``version``
        numbers the push (it must exceed the current one and fit the int64 stamp; default: the next).
        A closed server serves nothing more: it raises
        :class:`~torchrl_batchserve.errors.ServerClosedError`.
        """
        self._refuse_if_closed("takes no more weights")
        return self._weights.stage(self.module if weights is None else weights, version)

    def _refuse_if_closed(self, what: str) -> None:
        if self._queue.closed:
            raise ServerClosedError(f"the server is closed and {what}")

    def receive_weights(
        self, address: str, port: int, rank: int, world_size: int, *, timeout: float = 60.0
    ) -> WeightReceiver:
        """Join a trainer's weight group as server ``rank`` and serve what it pushes.

        The trainer runs a :class:`~torchrl_batchserve.WeightBroadcaster` (or a
        :class:`~torchrl_batchserve.BatchServeWeightSyncScheme` with an address)
        on ``address:port`` with the same ``world_size``. Pushes are received in
        a thread into a shadow copy and served from the next batch on; the
        default process group is never touched. Stops with the server; a
        closed server raises :class:`~torchrl_batchserve.errors.ServerClosedError`.
        A group that does not form within ``timeout`` seconds raises
        :class:`~torchrl_batchserve.errors.WeightSyncError`.
        """
        self._refuse_if_closed("joins no weight group")
        receiver = WeightReceiver(self._weights, address, port, rank, world_size, timeout=timeout)
        with self._lifecycle:
            closed = self._queue.closed
            if not closed:
                self._receivers.append(receiver)
        if closed:  # closed while it joined: nobody else would stop it
            receiver.close(0.0)
            self._refuse_if_closed("joins no weight group")
        return receiver

    def weight_sync_scheme(self) -> Any:
        """A TorchRL ``WeightSyncScheme`` that updates this server's weights.

        For ``Collector(..., policy=server.remote_policy(),
        weight_sync_schemes={"policy": server.weight_sync_scheme()})``:
        ``collector.update_policy_weights_(trainer_policy)`` serves the
        trainer's weights from the next batch on, and
        ``collector.update_policy_weights_()`` the current weights of the
        module this server was built with.
        """
        from torchrl_batchserve.weight_sync import BatchServeWeightSyncScheme

        return BatchServeWeightSyncScheme(server=self)

    def statistics(self, since: ServerStatistics | None = None) -> ServerStatistics:
        """A frozen snapshot of the serving statistics.

        With ``since`` (an earlier snapshot of this server), what happened
        after it: counters are differences and percentiles cover the newer
        samples only, e.g. one training iteration with warm-up left out.
        """
        check_since(since)
        replicas = tuple(ReplicaStatistics(str(r.device), r.batches, r.rows, r.version) for r in self._replicas)
        return self._stats.snapshot(self._weights.latest_version, self.cache, replicas, since)


# A RemotePolicy inherited by fork (not pickled) must find its server's hub in
# the child: before any fork, every running server starts its hub. One hook
# for the process, over the servers alive now.
_SERVERS: weakref.WeakSet[BatchedPolicyServer] = weakref.WeakSet()


def _before_fork() -> None:
    for server in list(_SERVERS):
        try:
            if not server.closed:
                server._endpoint.process_address()
        except Exception:
            _log.exception("could not start the process hub of a %s before fork", type(server).__name__)


os.register_at_fork(before=_before_fork)
