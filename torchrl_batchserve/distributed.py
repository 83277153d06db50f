"""Weights over torch.distributed: a trainer broadcasts, servers receive beside serving.

The trainer and the servers form a dedicated process group, built from its
own ``TCPStore`` (hosted by the trainer) and a standalone gloo group
(``ProcessGroupGloo``; weights travel as CPU buffers and each server copies
them to its policy's device when it applies them; an NCCL group for
device-to-device transfer is not implemented). The default process
group is never initialised, used or destroyed, so this coexists with a
DDP/FSDP trainer. Rendezvous: every member is given the trainer's address and
a free port, the world size (1 trainer + N servers), and its rank (the
trainer is 0, servers 1..N).

One push, all steps with finite timeouts:

1. the trainer reads its weights out into the buffers step 4 sends (a push
   that fails here fails before any server hears of it), then bumps
   ``push/count`` in the store (receivers wait on it, so an idle trainer
   never trips a collective timeout);
2. it broadcasts a header and the metadata (version, names, shapes, dtypes);
3. every server checks the metadata against its served policy and all ranks
   ``all_reduce`` a status: one mismatch fails the push on the trainer with
   :class:`~torchrl_batchserve.errors.WeightSyncError` (the reasons are left
   in the store), before any tensor moves, and every server keeps its weights;
4. otherwise the trainer broadcasts its flat buffers, one per dtype, as bytes
   (gloo refuses some dtypes, float8 among them); each server
   stages it as a shadow copy (``ShadowWeights.stage``) that its serve loop
   swaps in at the next batch boundary. Serving never waits for a transfer.

Leaving: the trainer's ``close()`` (run at the interpreter's exit if not
before) tells the servers, waits until each has read it, then releases the
group and the store, as a server's receiver does when it stops; left to the
interpreter's teardown, they can abort the process.

A trainer that dies mid-transfer breaks the collective: the receiver logs it,
drops the partial copy, stops receiving and the server keeps serving the last
complete version. A server that dies fails the trainer's push with a
``WeightSyncError`` after the timeout. A push a server fails to stage (out of
memory for the copy) is dropped there with a warning; the group stays in step
and the next push is received.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import pickle
import threading
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase

from torchrl_batchserve.checks import check_int, check_seconds, is_int
from torchrl_batchserve.errors import WeightSyncError
from torchrl_batchserve.weights import ShadowWeights, as_weights, castable, check_version, stampable

__all__ = ["WeightBroadcaster", "WeightReceiver", "check_group"]

_log = logging.getLogger(__name__)
_PUSH, _STOP = 1, 2  # header kinds
MAX_TIMEOUT = 1e9  # seconds; torch.distributed's store hung at 9e9 and failed at 1e10 (torch 2.13)
_MEMBERS: weakref.WeakSet[Any] = weakref.WeakSet()  # this process's open weight-group members


@atexit.register
def _close_members() -> None:
    """Leave every weight group before the interpreter's exit, which destroying a group or a store during aborts."""
    for member in list(_MEMBERS):
        member.close()


os.register_at_fork(after_in_child=_MEMBERS.clear)  # a forked child's copies are its parent's members, not its own


def check_group(address: Any, port: Any, world_size: Any, timeout: Any) -> None:
    """Raise a ``ValueError`` naming the first argument of a weight group that cannot be."""
    if not isinstance(address, str) or not address:
        raise ValueError(f"address must be a host name or an IP address (got {address!r})")
    if not is_int(port) or not 0 < port < 65536:
        raise ValueError(f"port must be an int in 1..65535 (got {port!r})")
    check_int("world_size", world_size, 2, ": the trainer and at least one server")
    check_seconds("timeout", timeout, positive=True)
    if timeout > MAX_TIMEOUT:
        raise ValueError(
            f"timeout must be at most {MAX_TIMEOUT:g} seconds (about 31 years): torch.distributed's deadlines "
            f"overflow on much longer ones, and its store then hangs or fails (got {timeout!r})"
        )


def _group(address: str, port: int, rank: int, world_size: int, timeout: float) -> tuple[Any, Any]:
    """Join the weight group as ``rank``; a ``WeightSyncError`` saying who was waited for when it cannot."""
    td = timedelta(seconds=timeout)
    try:
        store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=td, wait_for_workers=False)
        group = dist.ProcessGroupGloo(dist.PrefixStore("torchrl_batchserve/weights", store), rank, world_size, td)
    except Exception as err:  # torch.distributed's own errors name a store key or a socket, not the group
        store = None  # not kept by the error's traceback until the interpreter's exit, which it may abort
        member = (
            f"the trainer (rank 0) waits for servers 1..{world_size - 1} to join (server.receive_weights)"
            if rank == 0
            else f"server rank {rank} waits for the trainer's WeightBroadcaster (rank 0) and the other servers"
        )
        raise WeightSyncError(
            f"the weight group at {address}:{port} (world_size={world_size}, timeout={timeout:g} s) could not form: "
            f"{member}. {type(err).__name__}: {err}"
        ) from err
    return store, group


def _layout(weights: TensorDictBase) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(_name(k), tuple(v.shape), v.dtype) for k, v in _leaves(weights)]


def _fits(served: Any, pushed: Any) -> bool:
    """Whether a pushed ``(shape, dtype)`` can be staged as a served one (``weights.castable``)."""
    return served is not None and pushed is not None and served[0] == pushed[0] and castable(pushed[1], served[1])


def _name(key: Any) -> str:
    """A weight's key as one dotted name."""
    return ".".join(key) if isinstance(key, tuple) else key


def _leaves(weights: TensorDictBase) -> list[tuple[Any, torch.Tensor]]:
    return sorted(weights.items(include_nested=True, leaves_only=True), key=lambda kv: str(kv[0]))


def _flat(weights: TensorDictBase) -> dict[torch.dtype, torch.Tensor]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for _, value in _leaves(weights):
        groups.setdefault(value.dtype, []).append(value.detach().reshape(-1).cpu())
    return {dtype: torch.cat(parts) for dtype, parts in groups.items()}


class WeightBroadcaster:
    """The trainer's side (rank 0): pushes weights to every server of the group.

    Args:
        address: the host the store binds to (the trainer's address).
        port: a free port for the store.
        world_size: 1 + the number of servers.

    Keyword Args:
        timeout: seconds any step of a push may take (and that servers may
            take to join: past it, :class:`WeightSyncError`).
    """

    def __init__(self, address: str, port: int, world_size: int, *, timeout: float = 60.0) -> None:
        check_group(address, port, world_size, timeout)
        self.address, self.port, self.world_size, self.timeout = address, port, world_size, timeout
        self._store, self._group = _group(address, port, 0, world_size, timeout)
        self._lock = threading.Lock()
        self._pushes = 0
        self.version = 0
        _MEMBERS.add(self)

    def push(self, weights: Any, version: int | None = None) -> int:
        """Send ``weights`` (TensorDict, state_dict or module) to every server; return their version.

        Raises :class:`WeightSyncError` when a server rejects the metadata (no
        server changes its weights then), or when the transfer fails.
        """
        version = check_version(version)
        weights = as_weights(weights)
        with self._lock:
            if self._group is None:
                raise WeightSyncError("this WeightBroadcaster is closed: it pushes no more")
            version = stampable(self.version + 1) if version is None else version
            meta = pickle.dumps({"version": version, "layout": _layout(weights)})
            try:
                # Read out before the servers hear of the push: one left waiting mid-push for buffers that
                # never come would take the next push's messages for them, a mismatch that aborts gloo.
                buffers = list(_flat(weights).values())
                self._announce()
                header = torch.tensor([_PUSH, len(meta)], dtype=torch.long)
                self._group.broadcast(header, 0).wait()
                self._group.broadcast(torch.frombuffer(bytearray(meta), dtype=torch.uint8), 0).wait()
                status = torch.zeros(1, dtype=torch.long)
                self._group.allreduce([status], dist.AllreduceOptions()).wait()
                if int(status) != 0:
                    reasons = []
                    for rank in range(1, self.world_size):
                        key = f"error/{version}/{rank}"
                        if self._store.check([key]):
                            reasons.append(f"server rank {rank}: {self._store.get(key).decode()}")
                    raise WeightSyncError(f"version {version} rejected, no server changed: {'; '.join(reasons)}")
                for buffer in buffers:
                    self._group.broadcast(buffer.view(torch.uint8), 0).wait()
            except WeightSyncError:
                raise
            except Exception as err:
                raise WeightSyncError(f"pushing version {version} failed: {err}") from err
            self.version = version
            return version

    def _announce(self) -> None:
        self._pushes += 1
        self._store.set(f"push/{self._pushes}", "1")

    def close(self) -> None:
        """Tell the servers to stop receiving (best effort) and leave the group (once; at exit if not before)."""
        with self._lock:
            if self._group is None:
                return
            try:
                self._announce()
                self._group.broadcast(torch.tensor([_STOP, 0], dtype=torch.long), 0).wait()
                # Until each server has read it: the servers wait for pushes on this process's store.
                self._store.wait([f"stopped/{r}" for r in range(1, self.world_size)], timedelta(seconds=self.timeout))
            except Exception:
                pass
            self._store = self._group = None  # released now: left to the interpreter's exit, they may abort it


class WeightReceiver:
    """A server's side: receives pushes in a thread and stages them for its serve loop.

    Made by :meth:`BatchedPolicyServer.receive_weights`; closed with the server.
    """

    def __init__(
        self,
        shadow: ShadowWeights,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        timeout: float = 60.0,
    ) -> None:
        check_group(address, port, world_size, timeout)
        if not is_int(rank) or not 1 <= rank < world_size:
            raise ValueError(f"a server's rank must be an int in 1..{world_size - 1} (got {rank!r})")
        self._shadow = shadow
        self.rank, self.timeout = rank, timeout
        self._store, self._group = _group(address, port, rank, world_size, timeout)
        self._closed = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._receive_forever, name="batchserve-weights", daemon=True)
        self._thread.start()
        _MEMBERS.add(self)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _receive_forever(self) -> None:
        seen = 0
        try:
            while not self._closed.is_set():
                key = f"push/{seen + 1}"
                try:  # wait for the next push without holding a collective open
                    self._store.wait([key], timedelta(seconds=1.0))
                except Exception:
                    if not self._store.check([key]):  # raises when the trainer's store is gone
                        continue
                seen += 1
                if not self._receive_one():
                    return
        except Exception as err:  # the trainer died or the group broke: keep serving what we have
            self.error = err
            if not self._closed.is_set():
                _log.warning("weight receiver (rank %d) stopped: %r; serving the last complete version", self.rank, err)

    def _receive_one(self) -> bool:
        header = torch.zeros(2, dtype=torch.long)
        self._group.broadcast(header, 0).wait()
        kind, size = int(header[0]), int(header[1])
        if kind == _STOP:
            self._store.set(f"stopped/{self.rank}", "1")  # the trainer's store may go now
            return False
        meta_bytes = torch.zeros(size, dtype=torch.uint8)
        self._group.broadcast(meta_bytes, 0).wait()
        meta = pickle.loads(meta_bytes.numpy().tobytes())
        version, layout = meta["version"], self._served_names(meta["layout"])
        problem = self._check(version, layout)
        if problem is not None:
            self._store.set(f"error/{version}/{self.rank}", problem)
        status = torch.tensor([0 if problem is None else 1], dtype=torch.long)
        self._group.allreduce([status], dist.AllreduceOptions()).wait()
        if int(status) != 0:
            return True  # rejected by someone: nothing moves, keep serving
        buffers: dict[torch.dtype, torch.Tensor] = {}
        for _, shape, dtype in layout:
            n = math.prod(shape)
            buffers[dtype] = torch.empty(buffers[dtype].numel() + n if dtype in buffers else n, dtype=dtype)
        for buffer in buffers.values():
            self._group.broadcast(buffer.view(torch.uint8), 0).wait()
        try:
            self._shadow.stage(self._unflatten(layout, buffers), version)
        except Exception as err:  # a push in this process staged a newer version meanwhile; out of memory
            _log.warning("weight receiver (rank %d) dropped version %d: %r", self.rank, version, err)
        return True  # receive the next push either way: the group is in step

    def _served_names(self, layout: list) -> list:
        """The pushed layout named as served (:meth:`ShadowWeights.renaming`); ``None``: a weight left out."""
        renamed = self._shadow.renaming({tuple(n.split(".")) for n, _, _ in layout})
        if renamed is None:
            return layout
        served = (renamed.get(tuple(n.split("."))) for n, _, _ in layout)
        return [(s and ".".join(s), shape, dtype) for s, (_, shape, dtype) in zip(served, layout)]

    def _check(self, version: int, layout: list) -> str | None:
        mine = {n: (s, d) for n, s, d in _layout(self._shadow.served)}
        theirs = {n: (s, d) for n, s, d in layout if n is not None}
        optional = {_name(k) for k in self._shadow.optional}  # may be left out
        diff = [
            f"{n}: served {mine.get(n)}, pushed {theirs.get(n)}"
            for n in sorted(set(mine) | set(theirs))
            if not _fits(mine.get(n), theirs.get(n)) and not (n in optional and n not in theirs)
        ]
        if diff:
            return "metadata mismatch: " + "; ".join(diff[:5])
        if version <= self._shadow.latest_version:
            return f"version must increase: staged {self._shadow.latest_version}, pushed {version}"
        return None

    def _unflatten(self, layout: list, buffers: dict[torch.dtype, torch.Tensor]) -> TensorDictBase:
        offsets = dict.fromkeys(buffers, 0)
        out = TensorDict()
        for name, shape, dtype in layout:
            n = math.prod(shape)
            start = offsets[dtype]
            if name is not None:
                out.set(tuple(name.split(".")), buffers[dtype][start : start + n].view(shape))
            offsets[dtype] = start + n
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Stop receiving; once the thread has ended, leave the group (at exit if not before)."""
        self._closed.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._store = self._group = None
