"""Serving statistics: recorded by the serve loop, read as a frozen snapshot."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["ReplicaStatistics", "ServerStatistics", "StatisticsRecorder"]


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


@dataclass(frozen=True)
class ServerStatistics:
    """A snapshot of what a server has done since it was built.

    Times are in seconds. Percentiles cover the most recent ``window`` samples.

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
    extra: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def mean_batch_size(self) -> float:
        """Rows per batch, on average."""
        return self.rows / self.batches if self.batches else 0.0

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
            f"policy_version={self.policy_version} weight_updates={self.weight_updates}"
            + (
                f"\ncache: hits={self.cache_hits} misses={self.cache_misses} "
                f"coalesced={self.cache_coalesced} hit_rate={self.cache_hit_rate:.1%}"
                if self.cache_hits or self.cache_misses
                else ""
            )
        )


class StatisticsRecorder:
    """Counters and bounded sample windows, written by the serve loop."""

    def __init__(self, window: int = 4096) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._requests = 0
        self._rows = 0
        self._batches = 0
        self._failed = 0
        self._rejected = 0
        self._sizes: Counter[int] = Counter()
        self._fired: Counter[str] = Counter()
        self._waits: deque[float] = deque(maxlen=window)
        self._forwards: deque[float] = deque(maxlen=window)
        self._applies: deque[float] = deque(maxlen=window)
        self._weight_updates = 0

    def batch(self, requests: int, rows: int, reason: str, waits: Iterable[float], forward: float, ok: bool) -> None:
        with self._lock:
            self._requests += requests
            self._rows += rows
            self._batches += 1
            self._sizes[rows] += 1
            self._fired[reason] += 1
            self._waits.extend(waits)
            self._forwards.append(forward)
            if not ok:
                self._failed += 1

    def rejected(self) -> None:
        with self._lock:
            self._rejected += 1

    def weight_update(self, apply_seconds: float) -> None:
        with self._lock:
            self._weight_updates += 1
            self._applies.append(apply_seconds)

    def snapshot(
        self, policy_version: int, cache: Any = None, replicas: tuple[ReplicaStatistics, ...] = ()
    ) -> ServerStatistics:
        """The statistics now; ``cache`` (hits, misses, coalesced counters) when there is one."""
        with self._lock:
            waits, forwards = list(self._waits), list(self._forwards)
            return ServerStatistics(
                requests=self._requests,
                rows=self._rows,
                batches=self._batches,
                failed_batches=self._failed,
                rejected_requests=self._rejected,
                batch_size_histogram=MappingProxyType(dict(sorted(self._sizes.items()))),
                fired=MappingProxyType(dict(self._fired)),
                queue_wait_p50=_percentile(waits, 0.5),
                queue_wait_p99=_percentile(waits, 0.99),
                forward_p50=_percentile(forwards, 0.5),
                forward_p99=_percentile(forwards, 0.99),
                policy_version=policy_version,
                weight_updates=self._weight_updates,
                weight_apply_p99=_percentile(list(self._applies), 0.99),
                cache_hits=cache.hits if cache is not None else 0,
                cache_misses=cache.misses if cache is not None else 0,
                cache_coalesced=cache.coalesced if cache is not None else 0,
                uptime=time.monotonic() - self._started,
                replicas=replicas,
            )
