"""BatchedPolicyServer: the lifecycle and the one serve loop.

::

    take_batch -> apply pending weights -> collate -> to(device) -> policy
               -> to(output device) -> stamp version -> split -> resolve

Each step is a call into the module named for it; this file only sequences
them and owns the worker thread.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase, dispatch
from tensordict.nn.probabilistic import set_interaction_type
from tensordict.utils import NestedKey, unravel_key_list
from torch import nn

from torchrl_batchserve.cache import HIT, JOINED, EvaluationCache
from torchrl_batchserve.collate import StackCollate, as_collate, split_values
from torchrl_batchserve.direct import direct_call, usable
from torchrl_batchserve.distributed import WeightReceiver
from torchrl_batchserve.errors import ServerBrokenError, ServerClosedError
from torchrl_batchserve.layout import Layout, layout_of
from torchrl_batchserve.queue import FireReason, RequestQueue
from torchrl_batchserve.remote import RemotePolicy
from torchrl_batchserve.request import Relay, Request, fail_all, resolve
from torchrl_batchserve.stats import ServerStatistics, StatisticsRecorder
from torchrl_batchserve.transport.hub import ProcessHub
from torchrl_batchserve.transport.local import LocalEndpoint
from torchrl_batchserve.weights import ShadowWeights

__all__ = ["BatchedPolicyServer"]

_log = logging.getLogger(__name__)


def _as_policy(policy: Any, in_keys: Any, out_keys: Any) -> TensorDictModuleBase:
    if isinstance(policy, TensorDictModuleBase):
        if in_keys is not None or out_keys is not None:
            raise TypeError("in_keys/out_keys are taken from a TensorDictModuleBase policy; do not pass them")
        return policy
    if isinstance(policy, nn.Module):
        in_keys = in_keys if in_keys is not None else getattr(policy, "in_keys", None)
        out_keys = out_keys if out_keys is not None else getattr(policy, "out_keys", None)
        if in_keys is None or out_keys is None:
            raise TypeError(
                f"policy {type(policy).__name__} is a plain nn.Module: pass in_keys= and out_keys= "
                "(or give the module in_keys/out_keys attributes)"
            )
        return TensorDictModule(policy, in_keys=in_keys, out_keys=out_keys)
    raise TypeError(f"policy must be a TensorDictModuleBase or an nn.Module, got {type(policy).__name__}")


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} (got {value!r})")
    return value


def _device(name: str, value: Any) -> torch.device | None:
    if value is None:
        return None
    try:
        return torch.device(value)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{name} must be a torch.device or a device string (got {value!r})") from err


class BatchedPolicyServer(TensorDictModule):
    """Serve one policy to many actors, one batched forward at a time.

    Actors call a :class:`~torchrl_batchserve.RemotePolicy` (from
    :meth:`remote_policy`) with single TensorDicts; a worker thread gathers
    them into batches by the rule of :mod:`torchrl_batchserve.queue`, runs the
    policy once per batch under ``torch.no_grad`` and routes every actor its
    own rows. The server is itself a ``TensorDictModule``: its ``in_keys``,
    ``out_keys`` and parameters are the policy's, and calling it on a batch
    runs the policy directly, so a trainer can treat it as the module whose
    weights it updates.

    Args:
        policy: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with
            ``in_keys``/``out_keys`` (attributes or the keywords below).

    Keyword Args:
        max_batch_size: rows that make a batch full (default 64).
        timeout: seconds the oldest queued request waits for a fuller batch
            (default 0.002). A batch also fires at once when every caller the
            server knows of is already waiting.
        collate: a :class:`~torchrl_batchserve.collate.Collate` or a
            TorchRL-style ``collate_fn(list[TensorDict])``; default: stack.
        device: where the policy runs; the policy is moved there. Default: it
            stays where it is and batches run on the requests' device.
        output_device: where results go; default: each request's own device.
        max_queue_size: most rows that may wait; more raise
            :class:`~torchrl_batchserve.errors.QueueFullError`. Default: no bound.
        cost_fn: ``cost_fn(td) -> int``, what a request costs (e.g.
            :class:`~torchrl_batchserve.LengthCost`: its tokens); with
            ``max_batch_cost``, a batch also stops growing at that total, and a
            request costing more alone is refused at submit.
        max_batch_cost: the bound on a batch's total cost (needs ``cost_fn``).
        cache: an :class:`~torchrl_batchserve.EvaluationCache`: repeated rows
            are answered at submit from the outputs of the current weight
            version, identical rows in flight share one computed row.
        policy_version_key: key under which each result carries the version of
            the weights that computed it; ``None`` disables the stamp.
        input_spec: the layout requests must have (dtype, feature shape and
            device of each entry the policy reads), given up front: a TorchRL
            ``Composite`` such as ``env.observation_spec`` (its shape is the
            batch dims) or a sample request such as ``env.reset()``. Default:
            the first request that runs fixes it. Requests that do not fit get
            :class:`~torchrl_batchserve.errors.BadRequestError`, from the
            first one on; feature dims the collate varies stay free.
        in_keys, out_keys: for a plain ``nn.Module`` policy.

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
        device: torch.device | str | None = None,
        output_device: torch.device | str | None = None,
        max_queue_size: int | None = None,
        cost_fn: Callable[[TensorDictBase], int] | None = None,
        max_batch_cost: int | None = None,
        cache: EvaluationCache | None = None,
        policy_version_key: NestedKey | None = "policy_version",
        input_spec: Any = None,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
    ) -> None:
        policy = _as_policy(policy, in_keys, out_keys)
        _check_int("max_batch_size", max_batch_size, 1)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (math.isfinite(timeout) and timeout >= 0)
        ):
            raise ValueError(f"timeout must be a finite number of seconds >= 0 (got {timeout!r})")
        if max_queue_size is not None:
            _check_int("max_queue_size", max_queue_size, 1)
        if (cost_fn is None) != (max_batch_cost is None):
            raise ValueError(
                f"cost_fn and max_batch_cost go together (got cost_fn={cost_fn!r}, max_batch_cost={max_batch_cost!r})"
            )
        if max_batch_cost is not None:
            _check_int("max_batch_cost", max_batch_cost, 1)
            if not callable(cost_fn):
                raise ValueError(f"cost_fn must be callable as cost_fn(td) -> int (got {cost_fn!r})")
        if cache is not None and not isinstance(cache, EvaluationCache):
            raise TypeError(f"cache must be an EvaluationCache or None, got {type(cache).__name__}")
        device = _device("device", device)
        output_device = _device("output_device", output_device)
        if collate is None and device is not None and device.type == "cuda":
            collate = StackCollate(pin_memory=True)
        collate = as_collate(collate)

        super().__init__(policy, in_keys=list(policy.in_keys), out_keys=list(policy.out_keys))
        provided = set(unravel_key_list(list(getattr(collate, "provided_keys", ()))))
        self.max_batch_size = max_batch_size
        self.timeout = float(timeout)
        self.max_queue_size = max_queue_size
        self.policy_version_key = policy_version_key
        self._collate = collate
        # The tensor-level path needs the stacking collate and a plain TensorDictModule.
        self._direct = direct_call(policy) if type(collate) is StackCollate else None
        self._stamp_row: tuple[int | None, torch.Tensor | None] = (None, None)  # (version, its one-row stamp)
        self._policy_device = device
        self._output_device = output_device
        self._delivered = list(self.out_keys) + ([policy_version_key] if policy_version_key is not None else [])
        keys = [k for k in self.in_keys if k not in provided]
        variable = getattr(collate, "variable_dims", None) or {}
        unread = [k for k in variable if k not in keys]
        if unread:
            raise ValueError(f"collate {collate!r} varies {unread}; the policy reads {keys} from requests")
        self.max_batch_cost = max_batch_cost
        self.cost_fn = cost_fn
        check = getattr(collate, "check", None)
        specs = None if input_spec is None else layout_of(input_spec, keys, variable)
        self._layout = Layout(keys, variable, specs, check=check, cost_fn=cost_fn, max_cost=max_batch_cost)
        if device is not None:  # once every argument is checked: a refused server moves nothing
            policy.to(device)
        self._queue = RequestQueue(max_batch_size, self.timeout, max_queue_size, max_batch_cost)
        self._stats = StatisticsRecorder()
        self._relay = Relay()  # one wake-up chain for all blocking callers of this server
        self._weights = ShadowWeights(policy)
        self._lifecycle = threading.Lock()
        self._thread: threading.Thread | None = None
        self.cache = cache
        self._endpoint = LocalEndpoint(
            self._queue,
            self._layout,
            self._ensure_started,
            self._worker_alive,
            self._stats.rejected,
            self._serve_inline,
            self._admit if cache is not None else None,
            self._abandon if cache is not None else None,
            self._start_hub,
        )
        self._hub: ProcessHub | None = None
        self._receivers: list[WeightReceiver] = []
        _serve_forks(self)

    # -- the module face -------------------------------------------------------

    @property
    def policy(self) -> TensorDictModuleBase:
        """The served policy."""
        return self.module

    @property
    def collate(self) -> Any:
        return self._collate

    @dispatch(auto_batch_size=False)
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Run the policy on ``tensordict`` directly, in the calling thread."""
        return self.module(tensordict)

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> BatchedPolicyServer:
        """Start the serve loop (idempotent). Raises if the server was closed."""
        with self._lifecycle:
            if self._queue.closed:
                raise ServerClosedError("a closed server cannot be started again")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve_forever, name=f"{type(self).__name__}-worker", daemon=True
                )
                self._thread.start()
        return self

    def close(self, wait: bool = True, cancel_pending: bool = False, timeout: float | None = None) -> bool:
        """Stop serving; return True when the serve loop has stopped.

        New requests fail at once with
        :class:`~torchrl_batchserve.errors.ServerClosedError`. Queued requests
        are served first, unless ``cancel_pending`` fails them with that error.
        Idempotent; never blocks longer than ``timeout`` when ``wait``.
        """
        with self._lifecycle:
            thread = self._thread
            pending = self._queue.close(cancel_pending or thread is None)
            hub, self._hub = self._hub, None
            receivers, self._receivers = self._receivers, []
        for receiver in receivers:
            receiver.close(timeout if wait and timeout is not None else 2.0)
        fail_all(self._with_followers(pending), ServerClosedError("the server was closed before this request ran"))
        if thread is not None and wait and thread is not threading.current_thread():
            thread.join(timeout)
        if hub is not None:
            hub.close(timeout if wait else 0.0)
        return thread is None or not thread.is_alive()

    @property
    def closed(self) -> bool:
        return self._queue.closed

    def __enter__(self) -> BatchedPolicyServer:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _start_hub(self) -> tuple[str, bytes, list]:
        """Serve worker processes from now on; ``(address, authkey, keys)`` for their clients."""
        with self._lifecycle:
            if self._queue.closed:
                raise ServerClosedError("a closed server cannot serve other processes")
            if self._hub is None:
                trusted = (
                    type(self._collate) is StackCollate
                    and self.cost_fn is None
                    and (self.cache is None or self.cache.key_fn is None)
                )
                self._hub = ProcessHub(
                    self._layout.keys,
                    self._endpoint.make_request,
                    self._endpoint.enqueue,
                    self._serve_inline,
                    self._queue.take_due,
                    trusted,
                )
            return self._hub.address, self._hub.authkey, list(self._layout.keys)

    def _before_fork(self) -> None:
        if self._thread is not None and not self._queue.closed:
            self._endpoint.process_address()

    def _ensure_started(self) -> None:
        if self._thread is None:
            self.start()

    def _worker_alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    # -- actors --------------------------------------------------------------------

    def remote_policy(self) -> RemotePolicy:
        """A :class:`~torchrl_batchserve.RemotePolicy` served by this server."""
        return RemotePolicy(self._endpoint, self.in_keys, self.out_keys)

    def submit(self, tensordict: TensorDictBase) -> Future[TensorDictBase]:
        """Shortcut for ``server.remote_policy().submit(tensordict)``."""
        return self._endpoint.submit(tensordict)

    # -- weights and statistics ----------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The version of the weights the next batch will be computed with at the earliest."""
        return self._weights.version

    def update_weights(self, weights: Any) -> int:
        """Stage new weights; they serve from the next batch on. Returns their version.

        ``weights`` is a TensorDict (``TensorDict.from_module(policy)``), a
        state_dict or a module of the served policy's structure; a mismatch
        raises :class:`~torchrl_batchserve.errors.WeightSyncError` and the
        current weights keep serving. The copy happens here, in the caller's
        thread; the serve loop only swaps it in between two batches.
        """
        version = self._weights.stage(weights)
        self._staged(version)
        return version

    def receive_weights(
        self, address: str, port: int, rank: int, world_size: int, *, timeout: float = 60.0
    ) -> WeightReceiver:
        """Join a trainer's weight group as server ``rank`` and serve what it pushes.

        The trainer runs a :class:`~torchrl_batchserve.WeightBroadcaster` (or a
        :class:`~torchrl_batchserve.BatchServeWeightSyncScheme` with an address)
        on ``address:port`` with the same ``world_size``. Pushes are received in
        a thread into a shadow copy and served from the next batch on; the
        default process group is never touched. Stops with the server.
        """
        receiver = WeightReceiver(self._weights, self._staged, address, port, rank, world_size, timeout=timeout)
        with self._lifecycle:
            self._receivers.append(receiver)
        return receiver

    def weight_sync_scheme(self) -> Any:
        """A TorchRL ``WeightSyncScheme`` that updates this server's weights.

        For ``Collector(..., policy=server.remote_policy(),
        weight_sync_schemes={"policy": server.weight_sync_scheme()})``:
        ``collector.update_policy_weights_(trainer_policy)`` then serves the
        trainer's weights from the next batch on.
        """
        from torchrl_batchserve.weight_sync import BatchServeWeightSyncScheme

        return BatchServeWeightSyncScheme(server=self)

    def _staged(self, version: int) -> None:
        if not self._worker_alive():
            self._apply_weights()  # nobody else will, until the loop runs

    def statistics(self) -> ServerStatistics:
        """A frozen snapshot of the serving statistics."""
        return self._stats.snapshot(self._weights.version, self.cache)

    # -- the evaluation cache ------------------------------------------------------

    def _admit(self, request: Request) -> bool:
        outcome, values = self.cache.admit(request, self._weights.latest_version)  # type: ignore[union-attr]
        if outcome == HIT:
            request.finish(self._delivered, values)  # type: ignore[arg-type]
            return False
        if outcome == JOINED:
            self._queue.waiting(request.caller)
            return False
        return True

    def _abandon(self, request: Request, error: BaseException) -> None:
        fail_all(self.cache.release([request]), error)  # type: ignore[union-attr]

    def _with_followers(self, requests: list[Request]) -> list[Request]:
        """``requests`` and the coalesced requests waiting on them (which fail with them)."""
        if self.cache is None or not requests:
            return requests
        return requests + self.cache.release(requests)

    def _claim(self, requests: list[Request]) -> list[Request]:
        """The requests to compute: cancelled ones dropped, unless others wait on their row."""
        live = []
        for request in requests:
            current: Request | None = request
            while current is not None and not current.claim():
                current = self.cache.promote(current) if self.cache is not None else None
            if current is not None:
                live.append(current)
        return live

    # -- the serve loop --------------------------------------------------------------

    def _serve_forever(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread
        try:
            while True:
                taken = self._queue.take_batch()
                if taken is None:
                    return
                started = time.perf_counter()
                self._serve(*taken)
                took, served = time.perf_counter() - started, len(taken[0])
                taken = None  # do not keep the last batch (and the memory its inputs view) alive while idle
                # A batch shorter than waking its callers waits for them to
                # wake first: run together, the forward and the callers
                # fight over the GIL at every torch op (request.Relay).
                if took < served * self._relay.seconds_per_wake():
                    self._relay.wait_idle(self.timeout)
        except Exception:
            # _serve already failed every request with ServerBrokenError.
            _log.exception("the serve loop of %s died", type(self).__name__)

    def _serve_inline(self, requests: list[Request], reason: FireReason) -> None:
        # A caller whose request made the rule fire runs the batch itself (a
        # blocking caller that runs by itself, an event loop's coroutine, the
        # hub's reader); its own request is in it, so it learns every outcome
        # from that request (a loop failure too, as ServerBrokenError).
        try:
            with torch.no_grad():
                self._serve(requests, reason)
        except Exception:
            _log.exception("serving a batch inline broke %s", type(self).__name__)

    def _apply_weights(self) -> None:
        if self._weights.apply_pending() is not None:
            self._stats.weight_update(self._weights.last_apply_seconds)

    def _serve(self, requests: list[Request], reason: FireReason) -> None:
        """Run one taken batch; the caller holds the serving token."""
        # Batches run in whichever thread holds the token (worker, caller,
        # event loop, hub reader). torch applies set_num_threads to a thread
        # only once that thread asks for it; until then MKL runs its GEMMs on
        # an OpenMP team of one thread per core, whose wake-ups made forwards
        # several times slower. Asking costs ~35 ns.
        torch.get_num_threads()
        outcomes: list[tuple[list[Request], Any, BaseException | None]] = []
        try:
            live = self._claim(requests)
            self._apply_weights()
            for group in self._groups(live):
                rows = sum(r.rows for r in group)
                now, start = time.monotonic(), time.perf_counter()
                try:
                    columns = self._run(group, rows)
                except Exception as err:  # the policy's or the collate's: this batch only
                    self._layout.forget_unconfirmed()
                    outcomes.append((group, None, err))
                else:
                    self._layout.confirm()
                    outcomes.append((group, columns, None))
                waits = [now - r.enqueued_at for r in group]
                self._stats.batch(
                    len(group), rows, reason.value, waits, time.perf_counter() - start, not outcomes[-1][2]
                )
            followers = self._followers(outcomes)
        except BaseException as err:
            broken = ServerBrokenError(f"the serve loop died: {err!r}")
            broken.__cause__ = err
            self._queue.done_serving(())
            fail_all(self._with_followers(requests + self._queue.break_(err)), broken)
            raise
        # Mark the callers idle before waking them (the rule counts on it).
        callers = [r.caller for r in requests]
        for group, _, _ in followers:
            callers.extend(r.caller for r in group)
        self._queue.done_serving(callers)
        for group, columns, error in outcomes + followers:
            if error is None:
                resolve(group, self._delivered, columns, self._relay)
            else:
                fail_all(group, error)

    def _followers(self, outcomes: list) -> list[tuple[list[Request], Any, BaseException | None]]:
        """Store computed rows in the cache; the coalesced requests and their outcomes."""
        if self.cache is None:
            return []
        out: list[tuple[list[Request], Any, BaseException | None]] = []
        for group, columns, error in outcomes:
            if error is None:
                waiting, rows = self.cache.complete(group, columns, self._weights.version)
                if waiting:
                    out.append((waiting, list(zip(*rows)), None))
            else:
                waiting = self.cache.release(group)
                if waiting:
                    out.append((waiting, None, error))
        return out

    @staticmethod
    def _groups(live: list[Request]) -> list[list[Request]]:
        if not live:
            return []
        interaction = live[0].interaction
        if all(r.interaction is interaction for r in live):
            return [live]
        # tensordict's interaction type is process-global: one forward per type
        by_type: dict[Any, list[Request]] = {}
        for r in live:
            by_type.setdefault(r.interaction, []).append(r)
        return list(by_type.values())

    def _run(self, group: list[Request], rows: int) -> Sequence[Sequence[Any]]:
        source = group[0].device
        run_on = self._policy_device or source
        target = self._output_device or source
        version = self._weights.version
        move_to = target if target is not None and target != run_on else None
        stamped = self.policy_version_key is not None
        if self._direct is not None and usable(self.module):
            values = self._run_direct(group, rows, run_on)
            if move_to is not None:
                values = _to_device(values, move_to)
            if self.cache is None and _by_row(group, values):
                return self._row_pairs(values, rows, version)
            if stamped:
                values.append(_stamp(rows, version, move_to or run_on))
            return split_values(values, group, self._delivered)
        output = self._run_module(group, rows, run_on)
        if move_to is not None:
            output = _to_device(output, move_to)
        if stamped:
            output.set(self.policy_version_key, _stamp(rows, version, move_to or run_on))
        return self._collate.split(output, group, self._delivered)

    def _row_pairs(self, values: list[torch.Tensor], rows: int, version: int) -> list[list[tuple[torch.Tensor, int]]]:
        """Each request's outputs as ``(batch tensor, row)`` pairs (``Request.takes_rows``)."""
        columns = [[(v, i) for i in range(rows)] for v in values]
        if self.policy_version_key is not None:
            stamped, stamp = self._stamp_row
            if stamp is None or stamped != version:  # one row, made once per version, that every request copies
                stamp = torch.tensor([version], dtype=torch.long)
                self._stamp_row = (version, stamp)
            columns.append([(stamp, 0)] * rows)
        return columns

    def _run_direct(self, group: list[Request], rows: int, run_on: torch.device | None) -> list[Any]:
        tensors = self._collate.stack(group, rows)
        source = group[0].device
        if run_on is not None and run_on != source:
            tensors = [t.to(run_on, non_blocking=True) for t in tensors]
        call = self._direct
        assert call is not None
        with set_interaction_type(group[0].interaction):
            if rows <= self.max_batch_size:
                return list(call(tensors))
            chunks = [
                call([t[i : i + self.max_batch_size] for t in tensors]) for i in range(0, rows, self.max_batch_size)
            ]
        return [torch.cat(parts) for parts in zip(*chunks)]

    def _run_module(self, group: list[Request], rows: int, run_on: torch.device | None) -> TensorDictBase:
        batch = self._collate.collate(group, self._layout.keys)
        if run_on is not None and run_on != group[0].device:
            batch = batch.to(run_on, non_blocking=True)
        with set_interaction_type(group[0].interaction):
            if rows <= self.max_batch_size or not batch.batch_dims:
                output = self.module(batch)
            else:  # one request larger than a batch: run it in slices
                output = torch.cat(
                    [self.module(batch[i : i + self.max_batch_size]) for i in range(0, rows, self.max_batch_size)]
                )
        if output is None:
            output = batch
        missing = [key for key in self.out_keys if key not in output.keys(include_nested=True)]
        if missing:
            raise KeyError(f"the policy output has no entries {missing} (its out_keys promise them)")
        return output


# A RemotePolicy inherited by fork (not pickled) must find its server's hub in
# the child: before any fork, every running server starts its hub. One hook
# for the process, over the servers alive now.
_SERVERS: weakref.WeakSet[BatchedPolicyServer] = weakref.WeakSet()


def _serve_forks(server: BatchedPolicyServer) -> None:
    _SERVERS.add(server)


def _before_fork() -> None:
    for server in list(_SERVERS):
        try:
            server._before_fork()
        except Exception:
            _log.exception("could not start the process hub of a %s before fork", type(server).__name__)


os.register_at_fork(before=_before_fork)


def _stamp(rows: int, version: int, device: torch.device | None) -> torch.Tensor:
    """The version of a batch's weights, one entry per row."""
    return torch.full((rows,), version, dtype=torch.long, device=device)


def _by_row(group: list[Request], values: list[Any]) -> bool:
    """Whether ``group`` may take its outputs as ``(batch tensor, row)`` pairs (see ``Request.takes_rows``)."""
    for r in group:
        if not r.takes_rows or r.batch_shape:
            return False
    for v in values:
        if type(v) is not torch.Tensor or not v.is_cpu or not v.is_contiguous() or v.is_neg() or v.is_conj():
            return False
    return True


def _to_device(values: Any, device: torch.device) -> Any:
    """``values`` (a TensorDict, or a list of values) on ``device``, safe to read once this returns."""
    if isinstance(values, TensorDictBase):
        moved = values.to(device, non_blocking=True)
    else:
        moved = [v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for v in values]
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()  # non-blocking device-to-host copies must land before callers read
    return moved
