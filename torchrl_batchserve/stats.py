"""Serving statistics: recorded by the serve loop, read as a frozen snapshot."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["ReplicaStatistics", "ServerStatistics", "StatisticsRecorder", "log_statistics"]

logger = logging.getLogger("torchrl_batchserve")

# Tuning advice: looked at every ADVICE_BATCHES batches, logged at most once per ADVICE_INTERVAL seconds.
ADVICE_BATCHES = 1024
ADVICE_INTERVAL = 300.0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class ReplicaStatistics:
    """What one replica has served: its device, its batches and rows, and the weight version it holds."""

    device: str
    batches: int
    rows: int
    version: int


_NOT_FLAT = ("batch_size_histogram", "fired", "replicas", "policy_lag_histogram", "sample_counts", "origin")


@dataclass(frozen=True)
class ServerStatistics:
    """A snapshot of what a server has done since it was built.

    Times are in seconds. Percentiles cover the most recent samples (4,096 of
    each kind), or with ``server.statistics(since=earlier)`` those recorded
    after ``earlier`` was taken, whose counters are then differences too (a
    training loop's last iteration, warm-up left out), and ``uptime`` the
    seconds since then (``requests / uptime`` is the rate over that span; with
    a cache, of the requests computed: hits answered at submit are
    ``cache_hits``).
    ``uptime`` stops when the server has closed. ``policy_version`` is the
    latest version pushed; ``weight_updates`` counts the versions swapped in
    (by the first replica, at a batch): one pushed while a newer one waits is
    never served, nor counted. ``policy_lag_histogram`` counts the rows
    computed by how many versions their weights trailed the newest pushed
    when their batch ended (a push during a forward makes its rows 1 behind);
    ``stale_rows`` and ``max_policy_lag`` sum it up. ``as_dict()`` is flat,
    for loggers (:func:`log_statistics`); ``dataclasses.asdict`` works too.
    ``rejected_requests`` counts the requests the server refused at submit:
    bad input (:class:`~torchrl_batchserve.errors.BadRequestError`) and a
    full queue (:class:`~torchrl_batchserve.errors.QueueFullError`), which
    ``requests`` (those a batch ran) never counts.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl_batchserve import BatchedPolicyServer
        >>> policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["obs"], out_keys=["act"])
        >>> with BatchedPolicyServer(policy) as server:
        ...     _ = server.remote_policy()(TensorDict(obs=torch.ones(3)))
        ...     stats = server.statistics()
        >>> stats.requests, stats.rows, stats.batches
        (1, 1, 1)
    """

    requests: int
    rows: int
    batches: int
    failed_batches: int
    rejected_requests: int
    batch_size_histogram: Mapping[int, int]
    fired: Mapping[str, int]
    queue_wait_p50: float
    queue_wait_p99: float
    forward_p50: float
    forward_p99: float
    policy_version: int
    weight_updates: int
    weight_apply_p99: float
    cache_hits: int = 0
    cache_misses: int = 0
    cache_coalesced: int = 0
    uptime: float = 0.0
    replicas: tuple[ReplicaStatistics, ...] = ()
    policy_lag_histogram: Mapping[int, int] = field(default_factory=dict)
    sample_counts: tuple[int, int, int] = (0, 0, 0)  # waits, forwards, applies recorded so far: for since=
    origin: int = field(default=0, repr=False)  # the recorder that took it (0: a difference): for since=

    def as_dict(self) -> dict[str, float]:
        """The statistics as flat ``name: number`` pairs (``fired/<reason>``, ``replica<i>/<field>``)."""
        out: dict[str, float] = {
            name: getattr(self, name) for name in self.__dataclass_fields__ if name not in _NOT_FLAT
        }
        out.update(mean_batch_size=self.mean_batch_size, cache_hit_rate=self.cache_hit_rate)
        out.update(stale_rows=self.stale_rows, max_policy_lag=self.max_policy_lag)
        out.update({f"fired/{reason}": n for reason, n in self.fired.items()})
        for i, replica in enumerate(self.replicas):
            out.update({f"replica{i}/batches": replica.batches, f"replica{i}/rows": replica.rows})
            out[f"replica{i}/version"] = replica.version
        return out

    @property
    def mean_batch_size(self) -> float:
        """Rows per batch, on average."""
        return self.rows / self.batches if self.batches else 0.0

    @property
    def stale_rows(self) -> int:
        """Rows computed with weights older than the newest pushed when their batch ended."""
        return sum(rows for lag, rows in self.policy_lag_histogram.items() if lag)

    @property
    def max_policy_lag(self) -> int:
        """The most versions that the weights of any row computed trailed the newest pushed."""
        return max(self.policy_lag_histogram, default=0)

    @property
    def cache_hit_rate(self) -> float:
        looked_up = self.cache_hits + self.cache_misses + self.cache_coalesced
        return (self.cache_hits + self.cache_coalesced) / looked_up if looked_up else 0.0

    def summary(self) -> str:
        """A few lines for humans."""
        fired = ", ".join(f"{k}={v}" for k, v in sorted(self.fired.items()))
        return (
            f"requests={self.requests} rows={self.rows} batches={self.batches} "
            f"mean_batch={self.mean_batch_size:.1f} failed={self.failed_batches} "
            f"rejected={self.rejected_requests}\n"
            f"fired: {fired}\n"
            f"queue wait p50/p99: {self.queue_wait_p50 * 1e3:.3f}/{self.queue_wait_p99 * 1e3:.3f} ms, "
            f"forward p50/p99: {self.forward_p50 * 1e3:.3f}/{self.forward_p99 * 1e3:.3f} ms\n"
            f"policy_version={self.policy_version} weight_updates={self.weight_updates} "
            f"stale_rows={self.stale_rows} max_policy_lag={self.max_policy_lag}"
            + (
                f"\ncache: hits={self.cache_hits} misses={self.cache_misses} "
                f"coalesced={self.cache_coalesced} hit_rate={self.cache_hit_rate:.1%}"
                if self.cache_hits or self.cache_misses
                else ""
            )
        )


def check_since(since: Any) -> None:
    """``TypeError`` unless ``since`` is ``None`` or a :class:`ServerStatistics` (a ``statistics(since=...)``)."""
    if since is not None and not isinstance(since, ServerStatistics):
        raise TypeError(f"since must be a ServerStatistics (an earlier statistics()), got {type(since).__name__}")


def log_statistics(logger: Any, statistics: ServerStatistics, step: int | None = None, prefix: str = "server/") -> None:
    """Log ``statistics.as_dict()`` to a TorchRL ``Logger`` (anything with ``log_scalar(name, value, step)``).

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.record.loggers import CSVLogger
        >>> from torchrl_batchserve import BatchedPolicyServer, log_statistics
        >>> policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["obs"], out_keys=["act"])
        >>> csv = CSVLogger("run", log_dir=tempfile.mkdtemp())
        >>> with BatchedPolicyServer(policy) as server:
        ...     start = server.statistics()
        ...     _ = server.remote_policy()(TensorDict(obs=torch.ones(3)))
        ...     log_statistics(csv, server.statistics(since=start), step=1)   # this iteration only
        >>> sorted(csv.experiment.scalars)[:3]
        ['server/batches', 'server/cache_coalesced', 'server/cache_hit_rate']
    """
    if not isinstance(statistics, ServerStatistics):
        raise TypeError(f"statistics must be a ServerStatistics (server.statistics()), got {type(statistics).__name__}")
    if not callable(getattr(logger, "log_scalar", None)):
        raise TypeError(
            f"logger must be a TorchRL Logger (anything with log_scalar(name, value, step)), got "
            f"{type(logger).__name__}; for a logging.Logger, log statistics.summary()"
        )
    for name, value in statistics.as_dict().items():
        logger.log_scalar(prefix + name, float(value), step=step)


class StatisticsRecorder:
    """Counters and bounded sample windows, written by the serve loop.

    It also watches for batches that mostly fire on the timeout far below
    ``max_batch_size`` and then logs, at most every few minutes, what to change.
    """

    def __init__(self, max_batch_size: int = 0, timeout: float = 0.0, window: int = 4096) -> None:
        self._max_batch_size, self._timeout = max_batch_size, timeout
        self._looked_batches = self._looked_timeouts = self._looked_rows = 0  # since the last look
        self._advised_at = -ADVICE_INTERVAL
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._ended: float | None = None  # when the server closed: its uptime stops there
        self._requests = 0
        self._rows = 0
        self._batches = 0
        self._failed = 0
        self._rejected = 0
        self._sizes: Counter[int] = Counter()
        self._lags: Counter[int] = Counter()  # rows by versions behind the newest pushed
        self._fired: Counter[str] = Counter()
        self._waits: deque[float] = deque(maxlen=window)
        self._forwards: deque[float] = deque(maxlen=window)
        self._applies: deque[float] = deque(maxlen=window)
        self._samples = [0, 0, 0]  # ever appended to waits, forwards, applies
        self._origin = random.SystemRandom().getrandbits(63) | 1  # this server's, in its snapshots (pickled too)
        self._weight_updates = 0

    def batch(
        self, requests: int, rows: int, reason: str, waits: Iterable[float], forward: float, ok: bool, lag: int = 0
    ) -> None:
        with self._lock:
            self._requests += requests
            self._rows += rows
            self._batches += 1
            self._sizes[rows] += 1
            self._lags[lag] += rows
            self._fired[reason] += 1
            waits = list(waits)
            self._waits.extend(waits)
            self._samples[0] += len(waits)
            self._forwards.append(forward)
            self._samples[1] += 1
            if not ok:
                self._failed += 1
            advice = self._look(rows, reason)
        if advice:
            logger.warning(advice)

    def _look(self, rows: int, reason: str) -> str | None:
        """Count this batch for the tuning advice; the advice when it is due (under the lock)."""
        self._looked_batches += 1
        self._looked_timeouts += reason == "timeout"
        self._looked_rows += rows
        if self._looked_batches < ADVICE_BATCHES:
            return None
        batches, on_timeout = self._looked_batches, self._looked_timeouts
        mean = self._looked_rows / batches
        self._looked_batches = self._looked_timeouts = self._looked_rows = 0
        now = time.monotonic()
        if on_timeout < 0.9 * batches or mean > self._max_batch_size / 4 or now - self._advised_at < ADVICE_INTERVAL:
            return None
        if not self._timeout:  # timeout=0: no batch waited, and there is nothing to lower
            return None
        self._advised_at = now
        return (
            f"most batches fire on the timeout far below max_batch_size: of the last {batches}, "
            f"{on_timeout / batches:.0%} waited the full timeout={self._timeout * 1e3:g} ms and carried "
            f"{mean:.1f} rows on average (max_batch_size={self._max_batch_size}). Fewer rows arrive within a "
            "timeout than a batch holds: lower timeout (the wait buys little batching), or lower max_batch_size "
            "to about the rows that arrive; more actors per server fill batches (docs/guide.md, the batching rule)"
        )

    def stop(self) -> None:
        """The server closed: ``uptime`` counts no further."""
        with self._lock:
            if self._ended is None:
                self._ended = time.monotonic()

    def rejected(self) -> None:
        with self._lock:
            self._rejected += 1

    def weight_update(self, apply_seconds: float) -> None:
        with self._lock:
            self._weight_updates += 1
            self._applies.append(apply_seconds)
            self._samples[2] += 1

    def snapshot(
        self,
        policy_version: int,
        cache: Any = None,
        replicas: tuple[ReplicaStatistics, ...] = (),
        since: ServerStatistics | None = None,
    ) -> ServerStatistics:
        """The statistics now (``cache``: its hits, misses, coalesced counters), or since ``since`` was taken."""
        if since is not None and since.origin != self._origin:
            raise ValueError(
                "since must be an earlier statistics() of this server, taken without since= (got "
                + ("the difference a statistics(since=...) returns" if not since.origin else "another server's")
                + "): the counters would be taken off the wrong ones"
            )
        with self._lock:
            samples = tuple(self._samples)
            new = [n - (since.sample_counts[i] if since is not None else 0) for i, n in enumerate(samples)]
            waits, forwards, applies = (
                list(d)[len(d) - min(len(d), n) :] for d, n in zip((self._waits, self._forwards, self._applies), new)
            )
            now = ServerStatistics(
                requests=self._requests,
                rows=self._rows,
                batches=self._batches,
                failed_batches=self._failed,
                rejected_requests=self._rejected,
                batch_size_histogram=dict(sorted(self._sizes.items())),
                fired=dict(self._fired),
                queue_wait_p50=_percentile(waits, 0.5),
                queue_wait_p99=_percentile(waits, 0.99),
                forward_p50=_percentile(forwards, 0.5),
                forward_p99=_percentile(forwards, 0.99),
                policy_version=policy_version,
                weight_updates=self._weight_updates,
                weight_apply_p99=_percentile(applies, 0.99),
                cache_hits=cache.hits if cache is not None else 0,
                cache_misses=cache.misses if cache is not None else 0,
                cache_coalesced=cache.coalesced if cache is not None else 0,
                uptime=(time.monotonic() if self._ended is None else self._ended) - self._started,
                replicas=replicas,
                policy_lag_histogram=dict(sorted(self._lags.items())),
                sample_counts=samples,  # type: ignore[arg-type]
                origin=self._origin,
            )
        return now if since is None else _difference(now, since)


_COUNTERS = (
    "requests",
    "rows",
    "batches",
    "failed_batches",
    "rejected_requests",
    "weight_updates",
    "cache_hits",
    "cache_misses",
    "cache_coalesced",
    "uptime",
)


def _difference(now: ServerStatistics, since: ServerStatistics) -> ServerStatistics:
    """``now``'s counters less ``since``'s (its percentiles already cover the newer samples only)."""

    def less(a: Mapping, b: Mapping) -> dict:
        return {k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0) > 0}

    before = {(r.device, i): r for i, r in enumerate(since.replicas)}
    replicas = tuple(
        replace(r, batches=r.batches - p.batches, rows=r.rows - p.rows) if (p := before.get((r.device, i))) else r
        for i, r in enumerate(now.replicas)
    )
    return replace(
        now,
        **{name: getattr(now, name) - getattr(since, name) for name in _COUNTERS},
        batch_size_histogram=less(now.batch_size_histogram, since.batch_size_histogram),
        fired=less(now.fired, since.fired),
        replicas=replicas,
        policy_lag_histogram=less(now.policy_lag_histogram, since.policy_lag_histogram),
        origin=0,
    )
