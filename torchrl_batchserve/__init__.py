"""torchrl_batchserve: an auto-batching policy server for TorchRL.

Many actors (threads, asyncio tasks, worker processes) each ask a policy for one TensorDict at a
time; one :class:`BatchedPolicyServer` gathers their requests into batches,
runs one forward on the policy's device and hands every actor its own rows.
"""

from torchrl_batchserve.cache import EvaluationCache
from torchrl_batchserve.collate import Collate, FunctionCollate, StackCollate
from torchrl_batchserve.distributed import WeightBroadcaster, WeightReceiver
from torchrl_batchserve.errors import (
    BadRequestError,
    BatchServeError,
    ForwardTimeoutError,
    PolicyError,
    QueueFullError,
    SearchError,
    ServerBrokenError,
    ServerClosedError,
    WeightSyncError,
)
from torchrl_batchserve.queue import FireReason
from torchrl_batchserve.remote import RemotePolicy
from torchrl_batchserve.server import BatchedPolicyServer
from torchrl_batchserve.stats import ReplicaStatistics, ServerStatistics, log_statistics
from torchrl_batchserve.varlen import LengthCost, PackCollate, PadCollate
from torchrl_batchserve.weight_sync import BatchServeWeightSyncScheme, weight_updater

__version__ = "0.1.0"

__all__ = [
    "BadRequestError",
    "BatchServeError",
    "BatchServeWeightSyncScheme",
    "BatchedPolicyServer",
    "Collate",
    "EvaluationCache",
    "FireReason",
    "ForwardTimeoutError",
    "FunctionCollate",
    "LengthCost",
    "PackCollate",
    "PadCollate",
    "PolicyError",
    "QueueFullError",
    "RemotePolicy",
    "ReplicaStatistics",
    "SearchError",
    "ServerBrokenError",
    "ServerClosedError",
    "ServerStatistics",
    "StackCollate",
    "WeightBroadcaster",
    "WeightReceiver",
    "WeightSyncError",
    "log_statistics",
    "weight_updater",
]
