"""The one serve loop, and the steps of one batch.

::

    take_batch -> claim -> refresh weights -> collate -> forward on the replica
               -> check the output -> own it -> stamp version -> split -> resolve

Every request, from any transport, goes this way. :class:`Serving` holds
what all replicas share (the queue, the layout, the collate, the cache,
the statistics) and runs :meth:`Serving.loop` once per replica, in a serve
thread of that replica's own. It holds no reference to the server, so a
server that is dropped without ``close()`` can be collected (the reaper its
finalizer hands it to closes the queue, and the loops end).

Results are owned by their callers: a value handed out never shares memory
with the served parameters, the batch's inputs or a buffer the policy keeps
(see :func:`owned`), and each caller gets its own rows.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass, unravel_key
from tensordict.utils import NestedKey

from torchrl_batchserve.cache import EvaluationCache
from torchrl_batchserve.errors import (
    BadRequestError,
    BatchServeError,
    ForwardTimeoutError,
    PolicyError,
    ServerBrokenError,
    ServerClosedError,
    raisable,
)
from torchrl_batchserve.gate import GATE
from torchrl_batchserve.layout import Layout, holds_tensors
from torchrl_batchserve.queue import FireReason, RequestQueue
from torchrl_batchserve.replica import Replica, tensors
from torchrl_batchserve.request import Relay, Request, fail_all, resolve
from torchrl_batchserve.stats import StatisticsRecorder

__all__ = ["Serving", "owned", "serving_here"]

_log = logging.getLogger(__name__)

Outcome = tuple[list[Request], Any, BaseException | None]  # (requests, their columns, or the error they get)


class _LoopThread(threading.local):
    # The Servings whose serve loop the thread runs, or whose batch it runs now: a lone caller's, or one a forward
    # of another server made (a class default: no exception).
    inside: tuple[Serving, ...] = ()


_LOOP_THREAD = _LoopThread()


def serving_here(serving: Serving) -> bool:
    """Whether the calling thread runs a serve loop of ``serving`` (a submit's done-callback, run there) or one
    of its batches (a policy's forward, run by a lone caller, perhaps inside another server's forward): nothing
    it waits for can be served until it returns.
    """
    return serving in _LOOP_THREAD.inside


def _refs(value: Any) -> int:
    return sys.getrefcount(value)


def _fresh_refs() -> int:
    td = TensorDict(x=torch.zeros(1))
    value = td.get("x")  # as owned() holds it
    return _refs(value)


_FRESH = _fresh_refs()  # references to a tensor held only by an output TensorDict, seen from _refs


def owned(output: TensorDictBase, key: NestedKey, foreign: frozenset[int], device: torch.device | None = None) -> None:
    """Replace ``output[key]`` by a copy if it may share memory with anything but ``output``.

    A copy is made when the value is a view of another tensor (a slice or an
    expansion of a parameter or of a buffer), lives in the storage of a
    served parameter, buffer or batch input (``foreign``), or is referenced
    from anywhere else (a buffer the policy writes again at every call, as a
    CUDA-graph replay does). A fresh output, the common case, is handed out
    as it is, and so is a tensor that is not on ``device`` (where the results
    go, if given): moving it there copies it. One a policy computed with grad
    turned back on (a planner's inner optimization) is detached: a result is
    data, and its rows would keep the batch's autograd graph alive.
    """
    value = output.get(key)
    if isinstance(value, torch.Tensor):
        if device is not None and value.device != device:
            return
        if _refs(value) > _FRESH or value._base is not None or value.untyped_storage().data_ptr() in foreign:
            output.set(key, value.clone())  # (under no_grad: a copy without grad)
        elif value.requires_grad:
            output.set(key, value.detach())
    elif holds_tensors(value):
        output.set(key, value.clone())


class _Watchdog:
    """Breaks the server when a forward runs past ``timeout`` seconds (the stuck thread cannot be killed)."""

    def __init__(self, timeout: float, expire: Any) -> None:
        self._timeout = timeout
        self._expire = expire
        self._cond = threading.Condition()
        self._running: dict[int, tuple[float, list[Request]]] = {}  # replica index -> (deadline, group)
        self._stopped = False
        threading.Thread(target=self._watch, name="batchserve-watchdog", daemon=True).start()

    def start(self, index: int, group: list[Request]) -> None:
        with self._cond:
            self._running[index] = (time.monotonic() + self._timeout, group)
            self._cond.notify()

    def stop(self, index: int) -> None:
        with self._cond:
            self._running.pop(index, None)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _watch(self) -> None:
        expired: list[Request] | None = None
        with self._cond:
            while not self._stopped:
                if not self._running:
                    self._cond.wait()
                    continue
                index, (deadline, group) = min(self._running.items(), key=lambda item: item[1][0])
                remaining = deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                del self._running[index]
                expired, self._stopped = group, True
        if expired is not None:
            self._expire(expired)


class Serving:
    """What the serve loops of one server share, and the steps of a batch.

    Args:
        queue: the server's request queue.
        layout: the request validator (confirmed by the first batch served).
        collate: the collate transform.
        stats: the statistics recorder.

    Keyword Args:
        cache: the evaluation cache, if any.
        out_keys: the policy's out_keys.
        version_key: where each result carries its version (``None``: not stamped).
        output_device: where results go (``None``: each request's own device).
        max_batch_size: a request larger than this runs in slices of it.
        forward_timeout: seconds after which a forward breaks the server (``None``: never).
        static_batch_size: the rows every forward is padded to (``None``: its own).
    """

    def __init__(
        self,
        queue: RequestQueue,
        layout: Layout,
        collate: Any,
        stats: StatisticsRecorder,
        *,
        cache: EvaluationCache | None,
        out_keys: Sequence[NestedKey],
        version_key: NestedKey | None,
        output_device: torch.device | None,
        max_batch_size: int,
        forward_timeout: float | None = None,
        static_batch_size: int | None = None,
    ) -> None:
        self.queue = queue
        self.layout = layout
        self.collate = collate
        self.stats = stats
        self.cache = cache
        self.out_keys = list(out_keys)
        self.version_key = version_key
        self.delivered = self.out_keys + ([version_key] if version_key is not None else [])  # as _keys finds them
        self._outputs: list[NestedKey] | None = None
        self._keys_lock = threading.Lock()
        self.output_device = output_device
        self.max_batch_size = max_batch_size
        self.static_batch_size = static_batch_size
        self.relay = Relay()  # wakes the callers of every batch of this server
        self.broken: BaseException | None = None  # set when a serve loop dies: the server serves no more
        self.replicas: list[Replica] = []
        self.threads: list[threading.Thread] = []
        self._watchdog = _Watchdog(forward_timeout, self._timed_out) if forward_timeout is not None else None

    # -- the serve threads ---------------------------------------------------------------

    def start(self, replicas: list[Replica]) -> None:
        """Serve on ``replicas``, one serve thread each."""
        self.replicas = replicas
        self.threads = [
            threading.Thread(target=self.loop, args=(r,), name=f"batchserve-replica-{r.index}", daemon=True)
            for r in replicas
        ]
        for thread in self.threads:
            thread.start()

    def alive(self) -> bool:
        """Whether a serve loop runs (and can still answer a queued request)."""
        return any(t.is_alive() for t in self.threads)

    def join(self, timeout: float | None) -> bool:
        """Wait at most ``timeout`` seconds in all for the serve loops to end; whether they did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self.threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self.alive()

    def loop(self, replica: Replica) -> None:
        """Serve batches on ``replica`` until the queue is closed and empty, or the server breaks."""
        # torch applies set_num_threads to a thread only once it asks; until
        # then MKL would run this thread's GEMMs on a team of one thread per core.
        torch.get_num_threads()
        _LOOP_THREAD.inside = (self,)
        while True:
            taken = self.queue.take_batch(replica.index)
            if taken is None:
                return
            requests, reason = taken
            try:
                started = time.perf_counter()
                self.serve(replica, requests, reason)
                # A batch shorter than waking its callers waits for them to
                # wake first: run together, the forward and the callers fight
                # over the GIL at every torch op (request.Relay).
                if time.perf_counter() - started < len(requests) * self.relay.seconds_per_wake():
                    self.relay.wait_idle(self.queue.timeout)
            except BaseException as err:  # a bug or a BaseException from the policy: fail all, serve no more
                self._break(err, requests)  # logged there; nothing above this thread would catch it
                return
            finally:
                del taken, requests  # do not keep the last batch (and what its inputs view) alive while idle

    def _break(self, cause: BaseException, requests: Sequence[Request], error: BaseException | None = None) -> None:
        _log.error("the serve loop died: %r", cause, exc_info=cause)
        if error is None:
            error = ServerBrokenError(f"the serve loop died: {cause!r}")
            error.__cause__ = cause
        fail_all(self._with_followers(list(requests)), error)
        fail_all(self._with_followers(self.queue.break_(cause)), error)
        self.broken = error
        GATE.release(self)

    def _timed_out(self, group: list[Request]) -> None:
        error = ForwardTimeoutError("a forward ran longer than forward_timeout; the server is broken")
        self._break(error, group, error)

    def serve_inline(self, taken: tuple[list[Request], FireReason, int]) -> None:
        """Run, in the calling thread, the batch the queue handed a lone blocking caller.

        The caller's own request is in it, so the caller learns every outcome
        from that request. It runs as in a serve thread: no grad, no inference
        mode, no autocast, whatever the caller's thread has on (the same
        request must give the same result, and the cache may hand it to
        others). An interruption (``KeyboardInterrupt``) fails that batch only
        and reaches the caller; the server serves on.
        """
        requests, reason, index = taken
        replica = self.replicas[index]
        torch.get_num_threads()  # see loop(): this thread's intra-op team
        try:
            # (serve turns grad off for the batch: torch.inference_mode(False) turns it back on)
            with torch.inference_mode(False), _no_autocast(replica.device):
                self.serve(replica, requests, reason)
        except Exception as err:  # a bug outside any one batch
            self._break(err, requests)
        except BaseException as err:
            interrupted = BatchServeError(f"the batch was interrupted in the thread that ran it ({err!r})")
            fail_all(self._with_followers(list(requests)), interrupted)
            raise

    def fail_closed(self, requests: list[Request]) -> None:
        """Fail ``requests`` (taken from the queue by a close), and the rows coalesced on them."""
        fail_all(self._with_followers(requests), ServerClosedError("the server was closed before this request ran"))

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()

    # -- one batch ---------------------------------------------------------------------

    def serve(self, replica: Replica, requests: list[Request], reason: FireReason) -> None:
        """Run one batch taken from the queue on ``replica`` and complete every request in it."""
        outcomes: list[Outcome] = []
        followers: list[Outcome] = []
        inside = _LOOP_THREAD.inside
        _LOOP_THREAD.inside = inside + (self,)  # (a lone caller's thread: while it runs it)
        try:
            with torch.no_grad():  # the batch only: a submit's done-callbacks run below, in the thread's own mode
                live = self._claim(requests)
                self._refresh(replica)
                outcomes = [self._run_group(replica, group, reason) for group in _groups(live)]
                followers = self._followers(outcomes, replica)
        finally:
            _LOOP_THREAD.inside = inside
            callers = [r.caller for r in requests] + [r.caller for group, _, _ in followers for r in group]
            self.queue.done_serving(callers, replica.index)  # idle before they wake
        for group, columns, error in outcomes + followers:
            if error is None:
                resolve(group, self.delivered, columns, self.relay)
            else:
                fail_all(group, error)

    def _refresh(self, replica: Replica) -> None:
        version, start = replica.version, time.perf_counter()
        replica.refresh()
        if replica.version != version and replica.index == 0:  # counted once per version, by the first replica
            self.stats.weight_update(time.perf_counter() - start)

    def _run_group(self, replica: Replica, group: list[Request], reason: FireReason) -> Outcome:
        layout = group[0].layout
        if layout is not None and self.layout.specs not in (None, layout):
            return group, None, _misfit(self.layout, group)  # another layout was served first
        rows = sum(r.rows for r in group)
        now, start = time.monotonic(), time.perf_counter()
        try:
            columns, start = self._run(replica, group, rows, start)
        except Exception as err:  # the policy's or the collate's: this batch only
            outcome: Outcome = (group, None, raisable(err))
        else:
            outcome = (group, columns, None)
            if layout is not None and not self.layout.confirm(layout):
                outcome = (group, None, _misfit(self.layout, group))
        finally:
            if self._watchdog is not None:
                self._watchdog.stop(replica.index)
        replica.batches += 1
        replica.rows += rows
        waits = [now - r.enqueued_at for r in group]
        duration, lag = time.perf_counter() - start, replica.lag
        self.stats.batch(len(group), rows, reason.value, waits, duration, outcome[2] is None, lag)
        return outcome

    def _run(self, replica: Replica, group: list[Request], rows: int, start: float) -> tuple[Any, float]:
        """The columns of ``group``'s outputs, and ``start`` moved on by the time it waited at the gate."""
        batch = self.collate.collate(group, self.layout.keys)
        foreign = replica.foreign | {t.untyped_storage().data_ptr() for t in batch.values(True, True)}
        packed = not batch.batch_dims  # a packed batch has no rows: its collate checks its outputs
        gate = time.perf_counter()
        with GATE.under(group[0].interaction, self, any(r.nested for r in group)):
            start += time.perf_counter() - gate  # waiting for the gate is no part of a forward's time
            if self._watchdog is not None:
                self._watchdog.start(replica.index, group)
            output = replica.forward(batch, rows, self.max_batch_size, self.static_batch_size)
        if self.broken is not None:  # broke meanwhile: the gate let other forwards change the type under this one
            raise self.broken
        self._check(output, None if packed else rows)
        device = self.output_device or group[0].device
        # On the replica's stream, so that fetch hands them out done: queued on this thread's stream, they could
        # wait behind other work there (a trainer's) while a caller on a stream of its own reads them.
        with replica.on_stream():
            for key in self._keys(output):
                owned(output, key, foreign, device)
            if self.version_key is not None:
                stamp = torch.full((rows,), replica.version, dtype=torch.long, device=device or output.device)
                output.set(self.version_key, stamp)
        output = replica.fetch(output, self.delivered, device)  # those keys and the stamp
        return self.collate.split(output, group, self.delivered), start

    def _keys(self, output: TensorDictBase) -> list[NestedKey]:
        """The keys of the outputs that a result carries, fixed by the first batch served.

        An out_key inside a tensorclass (TorchRL's VLA policies write
        ``("vla_action", "chunk")`` in a ``VLAAction``) is delivered as that
        tensorclass, whole and of its class, as the policy's own call leaves
        it in its caller's TensorDict.
        """
        if self._outputs is not None:
            return self._outputs
        keys: list[NestedKey] = []
        for key in self.out_keys:
            if isinstance(key, tuple) and key not in getattr(self.collate, "cut_keys", ()):
                held = (unravel_key(key[:end]) for end in range(1, len(key)))
                key = next((k for k in held if is_tensorclass(output.get(k))), key)
            keys += [] if key in keys else [key]
        with self._keys_lock:  # several replicas may serve their first batches at once
            if self._outputs is None:
                self._outputs = keys
                self.delivered[: len(self.out_keys)] = keys  # in place: the intake hands it to a cache hit
        if keys != self._outputs:
            raise PolicyError(f"the policy wrote its outputs under {keys}, and under {self._outputs} before")
        return keys

    def _check(self, output: Any, rows: int | None) -> None:
        """Raise :class:`PolicyError` unless ``output`` holds every out_key with ``rows`` rows."""
        if not isinstance(output, TensorDictBase):
            raise PolicyError(f"the policy returned {type(output).__name__}; expected a TensorDict (or None)")
        have = output.keys(include_nested=True)
        for key in self.out_keys:
            if key not in have:
                raise PolicyError(
                    f"out_key {key!r}: missing from the policy's output (it has {sorted(map(str, output.keys(True)))})"
                )
            value = output.get(key)  # a tensor, a TensorDict or non-tensor data: it has a batch size
            shape = value.shape if isinstance(value, torch.Tensor) else value.batch_size
            if rows is not None and (not shape or shape[0] != rows):
                raise PolicyError(
                    f"out_key {key!r}: expected a leading dim of the batch's {rows} rows, got shape {tuple(shape)}"
                )

    # -- cancellation and the evaluation cache --------------------------------------

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

    def _followers(self, outcomes: list[Outcome], replica: Replica) -> list[Outcome]:
        """Store computed rows in the cache; the coalesced requests and their outcomes.

        The cache's copies are made on the replica's stream, and the
        followers' are done before they are handed out, as fetch's results are.
        """
        if self.cache is None:
            return []
        out: list[Outcome] = []
        for group, columns, error in outcomes:
            if error is None:
                with replica.on_stream():
                    waiting, rows = self.cache.complete(group, columns, replica.serving)
                if waiting:
                    replica.hand_out(tensors(v for row in rows for v in row))
                    out.append((waiting, list(zip(*rows)), None))
            else:
                waiting = self.cache.release(group)
                if waiting:
                    out.append((waiting, None, error))
        return out

    def _with_followers(self, requests: list[Request]) -> list[Request]:
        if self.cache is None or not requests:
            return requests
        return requests + self.cache.release(requests)


def _no_autocast(device: torch.device | None) -> contextlib.ExitStack:
    """Autocast off where the calling thread has it on (on the CPU, CUDA or ``device``), as in a serve thread."""
    stack = contextlib.ExitStack()
    for device_type in {"cpu", "cuda", device.type if device is not None else "cpu"}:
        if torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def _groups(live: list[Request]) -> list[list[Request]]:
    """One forward per interaction type (process-global in tensordict) and per unconfirmed layout."""
    if not live:
        return []
    first = live[0]
    if all(r.interaction is first.interaction and r.layout == first.layout for r in live):
        return [live]
    by: dict[Any, list[Request]] = {}
    for r in live:
        by.setdefault((r.interaction, r.layout), []).append(r)
    return list(by.values())


def _misfit(layout: Layout, group: list[Request]) -> BaseException:
    """The error of requests queued before ``layout`` was confirmed, that do not fit it."""
    try:
        layout.check(group[0].td)
    except BadRequestError as err:
        return err
    return BadRequestError("the request does not fit the layout the server has served since it was queued")
