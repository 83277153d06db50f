"""One device's copy of the served policy.

A :class:`Replica` owns a deep copy of the policy on its device, the version
of the weights that copy holds, and (on CUDA) the stream its batches run on.
It changes its weights only in :meth:`Replica.refresh`, which the serve loop
calls between two batches, so a batch is computed with exactly one version.

On CUDA, a batch's host-to-device copies, its forward, the copies of its
outputs (those that make results their callers' own, the version stamp, the
move to the output device) and weight applies are all queued on the
replica's own stream, ordered with events: the stream waits for the stream
a batch of device inputs was stacked on (the current stream of the thread that
runs the batch: the serve thread's default stream, or a lone caller's own
stream; a batch of CPU inputs waits for no other stream) and for the
snapshot's event before it reads them (a CPU replica of such a server waits
for that event on the host), and the serve loop waits for the stream alone
(never ``torch.cuda.synchronize()``, which would also wait for a trainer's
kernels on the same GPU) before it hands results out. Results left on the
device are marked as used on the callers' stream (``record_stream``): a
later batch cannot reuse their memory while a caller's kernels read them.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch.nn.parameter import is_lazy

from torchrl_batchserve.errors import PolicyError
from torchrl_batchserve.layout import holds_tensors
from torchrl_batchserve.weights import ShadowWeights

__all__ = ["Replica", "host_copies", "served_copy", "tensors", "to_host"]


def served_copy(policy: TensorDictModuleBase, device: torch.device | None) -> TensorDictModuleBase:
    """A deep copy of ``policy`` on ``device``, that nothing outside the server holds.

    Parameters, buffers and submodules are copied; a plain attribute that
    cannot be copied (a lock, an event, a handle) is shared with ``policy``,
    and one computed from the weights (a pruned module's ``weight``, which
    its hook computes again at every call) is copied detached.
    """
    weights = [*policy.named_parameters(), *policy.named_buffers()]
    lazy = [name for name, t in weights if is_lazy(t)]
    if lazy:
        raise ValueError(
            f"the policy's {lazy} are not initialized (lazy modules): call the policy once on a sample request "
            "(e.g. policy(env.reset())) before serving it, so that the served copy has the weights it has"
        )
    meta = [name for name, t in weights if t.is_meta]
    if meta:
        raise ValueError(
            f"the policy's {meta} are on the meta device: they hold no values to serve. Give it real weights "
            "first (policy.to_empty(device=...), then load_state_dict)"
        )
    memo: dict[int, Any] = {}
    for module in policy.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and not value.is_leaf:  # deepcopy refuses a tensor autograd computed
                memo[id(value)] = value.detach().clone()
                continue
            if isinstance(value, (torch.Tensor, torch.nn.Module, dict, list, tuple, str, int, float)):
                continue
            try:
                copy.deepcopy(value)
            except Exception:
                memo[id(value)] = value
    try:
        with torch.no_grad():  # a ScriptModule's copy clones its parameters, as non-leaves under autograd
            served = copy.deepcopy(policy, memo)
    except Exception as err:
        raise TypeError(
            f"the server serves its own copy of the policy (copy.deepcopy), and {type(policy).__name__} cannot be "
            f"copied: {err}. Give it a __deepcopy__ that copies its parameters and shares what cannot be copied."
        ) from err
    for param in served.parameters():
        param.requires_grad_(False)  # served weights change only through versioned updates
    return served.to(device) if device is not None else served


class Replica:
    """The served copy of the policy on one device, and its weight version.

    Args:
        module: the served copy (from :func:`served_copy`).
        device: where its batches run; ``None``: on the requests' device.
        weights: the server's staging area, read at every batch boundary.
        index: the replica's position in the server's ``device`` list.
    """

    def __init__(self, module: TensorDictModuleBase, device: torch.device | None, weights: ShadowWeights, index: int):
        self.module = module
        self.device = device
        self.index = index
        self.version = 0
        self.batches = 0
        self.rows = 0
        self.mode: bool | None = None  # the training mode set on ``module`` (server.train()); None: as copied
        self._weights = weights
        self._params = TensorDict.from_module(module)
        self._stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None
        self.foreign = self._storages()

    def _storages(self) -> frozenset[int]:
        """Where the served parameters and buffers live: no result may share that memory."""
        return frozenset(t.untyped_storage().data_ptr() for t in self._params.values(True, True))

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Queue the work of the block on the replica's stream (nothing to do on CPU)."""
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield

    @property
    def serving(self) -> tuple[int, bool | None]:
        """What its batches compute with: its version and mode (the cache's tag, as ``ShadowWeights.serving``)."""
        return self.version, self.mode

    @property
    def lag(self) -> int:
        """How many versions its weights trail the newest staged (0 from its next batch on)."""
        return self._weights.latest_version - self.version

    def refresh(self) -> None:
        """Serve the newest staged weights and training mode from this batch on (called between two batches)."""
        mode = self._weights.mode
        if mode is not None and mode is not self.mode:
            self.module.train(mode)
            self.mode = mode
        snapshot = self._weights.latest()
        if snapshot.version == self.version or snapshot.tensors is None:
            return
        with self.on_stream(), torch.no_grad():
            if snapshot.ready is not None:  # staged on CUDA: its copies are done first
                if self._stream is None:
                    snapshot.ready.synchronize()  # a CPU replica waits on the host
                else:
                    self._stream.wait_event(snapshot.ready)
            if self._stream is not None:
                for value in snapshot.tensors.values(True, True):
                    if value.is_cuda:
                        value.record_stream(self._stream)  # not reused while this stream copies from it
            self._params.update_(snapshot.tensors, non_blocking=self._stream is not None)
        self.version = snapshot.version

    def forward(
        self, batch: TensorDictBase, rows: int, max_rows: int, static_rows: int | None = None
    ) -> TensorDictBase:
        """Run the policy on ``batch`` (on this replica's device and stream); its output TensorDict.

        ``static_rows``: each forward is padded to that many rows, and its
        output cut back to the batch's.
        """
        if self._stream is not None:
            # Device inputs were stacked on this thread's stream of their device (a lone caller's may be its
            # own): read after it. A batch of CPU inputs waits for nothing queued there, a trainer's kernels on
            # the default stream included.
            for device in {t.device for t in tensors(batch.values()) if t.is_cuda}:
                self._stream.wait_stream(torch.cuda.current_stream(device))
        with self.on_stream():
            batch = _on(batch, self.device)
            if not batch.batch_dims:  # packed: no rows to slice or pad
                output = self.module(batch)
                return batch if output is None else output
            if rows <= max_rows:
                return self._call(batch, static_rows)
            # one request larger than a batch: run it in slices
            return torch.cat([self._call(batch[i : i + max_rows], static_rows) for i in range(0, rows, max_rows)])

    def _call(self, batch: TensorDictBase, static_rows: int | None) -> TensorDictBase:
        rows = batch.batch_size[0]
        if static_rows is None or rows == static_rows:
            output = self.module(batch)
            return batch if output is None else _batched(output, rows)
        padded = torch.cat([batch, batch[-1:].expand(static_rows - rows)])  # the last row again
        output = self.module(padded)
        output = padded if output is None else _batched(output, static_rows)
        if not isinstance(output, TensorDictBase) or output.batch_size[:1] != (static_rows,):
            got = list(output.batch_size) if isinstance(output, TensorDictBase) else type(output).__name__
            raise PolicyError(f"static_batch_size={static_rows}: the policy must return {static_rows} rows, got {got}")
        return output[:rows]

    def fetch(self, output: TensorDictBase, keys: Sequence[Any], device: torch.device | None) -> TensorDictBase:
        """``output``'s ``keys`` on ``device`` (``None``: where they are), complete and safe to read on return.

        Only those keys move: a ``TensorDictModule`` returns the batch's
        inputs with its outputs, and they need not come back from the device.
        """
        with self.on_stream():
            if not _on_device(output, keys, device):
                output = output.select(*keys).to(device, non_blocking=True)
        self.hand_out(tensors(output.get(key) for key in keys))
        return output

    def hand_out(self, results: Iterable[torch.Tensor]) -> None:
        """Wait for the work queued on this stream (on CUDA; this stream only), then mark ``results`` as read.

        Results made on this stream are read on the callers' (the current stream here: the default one, or
        a lone caller's own). Marked so, the caching allocator gives none of their memory to a later batch
        of this stream until the kernels queued on the callers' stream before they were freed have run.
        """
        if self._stream is None:
            return
        self._stream.synchronize()  # this stream only: its forward and copies are done
        for value in results:
            if value.is_cuda:
                value.record_stream(torch.cuda.current_stream(value.device))


def _batched(output: Any, rows: int) -> Any:
    """``output`` with a batch dim of its ``rows``, when every entry has them.

    A ``TensorDictModule(..., inplace=False)`` returns its outputs in a new
    TensorDict of batch size ``[]``, which can be neither cut nor concatenated
    by rows.
    """
    if not isinstance(output, TensorDictBase) or output.batch_dims:
        return output
    batched = output.copy()
    try:
        batched.batch_size = torch.Size([rows])
    except RuntimeError:
        return output  # not every entry has the rows: the output checks say which
    return batched


def tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors among ``values``, and those in their TensorDicts (nested ones included)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif holds_tensors(value):
            yield from tensors(value.values(True, True))


_COPY_STREAMS: dict[torch.device, Any] = {}


def host_copies(values: Iterable[Any]) -> Any:
    """Run the block's copies of ``values`` to the host on a stream of their device kept for that.

    Not on the current stream (the default one), where a trainer's kernels may
    be queued: a reply to a worker or a gateway would wait for them, and the
    serve loop with it. The values are complete by then (:meth:`Replica.fetch`),
    and a copy to the host returns once it is done. A no-op for CPU values.
    """
    device = next((t.device for t in tensors(values) if t.is_cuda), None) if torch.cuda.is_initialized() else None
    if device is None:
        return contextlib.nullcontext()
    stream = _COPY_STREAMS.get(device) or _COPY_STREAMS.setdefault(device, torch.cuda.Stream(device))
    return torch.cuda.stream(stream)


def to_host(value: Any) -> Any:
    """``value`` on the CPU, copied there under :func:`host_copies` (non-tensor data as it is)."""
    if not holds_tensors(value):
        return value
    with host_copies((value,)):
        return value.cpu()


def _on_device(td: TensorDictBase, keys: Sequence[Any] | None, device: torch.device | None) -> bool:
    """Whether the tensors of ``td`` (of its ``keys``) are on ``device`` already (``None``: wherever they are)."""
    if device is None or td.device == device:
        return True
    return all(v.device == device for v in tensors(td.values() if keys is None else (td.get(k) for k in keys)))


def _on(td: TensorDictBase, device: torch.device | None) -> TensorDictBase:
    """``td`` with every tensor on ``device`` (``None``: as it is); moved only if one is elsewhere.

    A batch TensorDict has no device of its own; ``td.to`` costs far more
    than looking at its few leaves, and most batches are already there.
    """
    return td if _on_device(td, None, device) else td.to(device, non_blocking=True)
