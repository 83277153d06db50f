"""EvaluationCache: answer repeated rows without a forward (tree search).

MCTS evaluates the same positions again and again: transpositions, re-visited
leaves, the same opening in many games. The cache keys each row (a user
``key_fn``, e.g. a board hash the env already writes, or by default a digest
of the bytes of the policy's inputs) and keeps the outputs the policy computed
for it, tagged with what computed them: the weight version and the training
mode (``server.train()``):

* a hit is answered at submit, without entering a batch, and only when its
  tag is the newest version in the mode served now: a weight update or a
  mode switch never serves a stale evaluation and needs no flush;
* identical single rows already queued or in flight share one computed row
  (coalescing): the first is the *leader*, the others wait on it; a row
  joins a leader only if no weights (nor mode) were staged since the leader
  was admitted, so a request never gets a version older than the newest one
  staged before it was submitted;
* memory is bounded: least recently used entries go first;
* a request that samples bypasses the cache: it is never answered with,
  nor joined to, another call's sample (:func:`sampling_modes`).

The server calls :meth:`admit` at submit and :meth:`complete` /
:meth:`release` when a leader's batch ends; all three hold one lock.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase, is_non_tensor
from tensordict.nn import InteractionType
from torch import nn

from torchrl_batchserve.checks import check_int
from torchrl_batchserve.errors import BadRequestError
from torchrl_batchserve.layout import call_user_fn, flat_rows, holds_tensors, shaped_rows
from torchrl_batchserve.replica import tensors
from torchrl_batchserve.request import Request

__all__ = ["EvaluationCache", "sampling_modes"]

HIT, JOINED, LEAD = "hit", "joined", "lead"


def _clone(value: Any) -> Any:
    return value.clone() if holds_tensors(value) else value


def sampling_modes(policy: nn.Module) -> frozenset[InteractionType | None]:
    """The interaction types under which ``policy`` samples: the cache answers no request of these.

    ``InteractionType.RANDOM`` always. ``None`` (no type set) too when a
    module of ``policy`` samples unless told otherwise: a probabilistic
    module whose ``default_interaction_type`` is ``RANDOM``, or a TorchRL
    exploration module (they explore when no type is set).
    """
    exploring: tuple[type, ...] = ()
    if "torchrl.modules" in sys.modules:  # else no module of it exists here, and importing it costs 50 MB
        from torchrl.modules import AdditiveGaussianModule, EGreedyModule

        exploring = (AdditiveGaussianModule, EGreedyModule)  # (an OrnsteinUhlenbeckProcessModule is not served)
    unless_told = any(
        isinstance(m, exploring) or getattr(m, "default_interaction_type", None) == InteractionType.RANDOM
        for m in policy.modules()
    )
    return frozenset({InteractionType.RANDOM, None}) if unless_told else frozenset({InteractionType.RANDOM})


def digest(inputs: Sequence[Any]) -> bytes:
    """A 128-bit digest of the content of each input.

    A tensor by its dtype, shape and bytes; a nested TensorDict by each
    entry's name and content; non-tensor data by its pickled value (never its
    ``repr``, which may leave the content out). Raises
    :class:`BadRequestError` for a value that has no content to key by.
    """
    h = hashlib.blake2b(digest_size=16)
    for value in inputs:
        _feed(h, value)
    return h.digest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_conj() or t.is_neg():  # a lazy view: its memory holds other values
            t = t.resolve_conj().resolve_neg()
        h.update(f"tensor{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif is_non_tensor(value):
        _feed(h, value.tolist())
    elif holds_tensors(value):  # a TensorDict or a tensorclass
        h.update(f"{type(value).__qualname__}{tuple(value.batch_size)}".encode())
        for key in sorted(value.keys(), key=repr):
            h.update(f"{key!r}:".encode())
            _feed(h, value.get(key))
    else:
        try:
            h.update(b"data" + pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as err:
            raise BadRequestError(
                f"the evaluation cache keys rows by content, and a {type(value).__name__} input does not pickle "
                f"({err}); give EvaluationCache a key_fn"
            ) from None


def _by_content(key: Any) -> Any:
    """``key`` with each tensor or TensorDict in it, alone or in (nested) tuples, replaced by its digest."""
    if isinstance(key, (torch.Tensor, TensorDictBase)):
        return digest([key])
    if isinstance(key, tuple):
        return tuple(_by_content(k) for k in key)
    return key


class EvaluationCache:
    """A bounded, version-aware cache of policy outputs, keyed per row.

    Args:
        capacity: the most rows kept (least recently used go first).
        key_fn: ``key_fn(td) -> hashable`` for a single-row request ``td``
            (a tensor it returns, alone or in a tuple, is keyed by its
            content); default: a 128-bit digest of the bytes of the policy's
            in_keys. It should read only those: from worker processes and
            other nodes nothing else travels.
            Two rows with one key must be the same input: the cache returns
            the outputs of either for both.

    Requests with several rows are looked up row by row (``key_fn`` gets each
    row): when every row hits they are answered at submit; otherwise the whole
    request is computed and its rows are stored. Only single rows coalesce.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl_batchserve import BatchedPolicyServer, EvaluationCache
        >>> policy = TensorDictModule(torch.nn.Linear(4, 2), in_keys=["observation"], out_keys=["logits"])
        >>> with BatchedPolicyServer(policy, cache=EvaluationCache(capacity=1000)) as server:
        ...     remote = server.remote_policy()
        ...     first = remote(TensorDict(observation=torch.ones(4)))
        ...     again = remote(TensorDict(observation=torch.ones(4)))  # answered from the cache
        ...     stats = server.statistics()
        >>> torch.equal(first["logits"], again["logits"]), stats.cache_hits, stats.cache_misses
        (True, 1, 1)
    """

    def __init__(self, capacity: int = 100_000, key_fn: Callable[[TensorDictBase], Hashable] | None = None) -> None:
        check_int("capacity", capacity, 1)
        if key_fn is not None and not callable(key_fn):
            raise ValueError(f"key_fn must be callable as key_fn(td) -> hashable (got {key_fn!r})")
        self.capacity = capacity
        self.key_fn = key_fn
        self._lock = threading.Lock()
        # key -> (tag: version and mode, the row's outputs, on CUDA an event after their copies)
        self._entries: OrderedDict[Hashable, tuple[Hashable, tuple[Any, ...], torch.cuda.Event | None]] = OrderedDict()
        self._leaders: dict[Hashable, tuple[Request, Hashable]] = {}  # key -> (leader, tag at its admission)
        self._followers: dict[int, list[Request]] = {}  # id(leader) -> followers
        self.hits = self.misses = self.coalesced = 0
        self._served = False

    def serve(self) -> None:
        """Taken by a server: its entries are that server's outputs at its versions, so no other may take it."""
        with self._lock:
            if self._served:
                raise ValueError(
                    "this EvaluationCache belongs to another server: its entries are that server's outputs, "
                    "numbered by that server's versions. Give each server a cache of its own"
                )
            self._served = True

    def __len__(self) -> int:
        return len(self._entries)

    def __reduce__(self) -> tuple:
        # Pickled (e.g. among serve_on_ray's server keywords): a new empty cache of the same settings,
        # for the server on the other side; entries are only ever its own server's.
        return EvaluationCache, (self.capacity, self.key_fn)

    def keys_of(self, request: Request) -> list[Hashable]:
        """The key of each row of ``request`` (with its interaction type: a
        deterministic and a sampled evaluation of one row are not the same)."""
        mode = request.interaction
        if not request.batch_shape:
            key = self._user_key(request.td) if self.key_fn is not None else digest(request.inputs)
            return [(mode, key)]
        if self.key_fn is not None:
            return [(mode, self._user_key(row)) for row in request.td.reshape(-1).unbind(0)]
        rows = [[v[i] for v in request.inputs] for i in range(request.rows)]  # tensors, TensorDicts, non-tensor
        return [(mode, digest(row)) for row in rows]

    def _user_key(self, row: TensorDictBase) -> Hashable:
        """``key_fn(row)``; a tensor it returns (e.g. ``td["board"]``, which hashes by identity), alone or in
        a tuple, keyed by content."""
        key = _by_content(call_user_fn("key_fn", self.key_fn, row))
        try:
            hash(key)
        except TypeError:
            raise BadRequestError(f"key_fn must return a hashable key, got {type(key).__name__}: {key!r}") from None
        return key

    def admit(self, request: Request, served: Hashable) -> tuple[str, Sequence[Any] | None]:
        """At submit: ``(HIT, values)``, ``(JOINED, None)`` or ``(LEAD, None)``.

        On ``HIT`` the values are this request's outputs (its rows stacked);
        on ``JOINED`` the request waits for an identical one already queued or
        in flight; on ``LEAD`` it must be computed (and is now the row others
        with its key join). ``served``: the tag of what serves now
        (``ShadowWeights.serving``).
        """
        if torch.is_inference_mode_enabled():  # a hit's copies are normal tensors, as a computed result is
            with torch.inference_mode(False):
                return self.admit(request, served)
        keys = self.keys_of(request)
        request.cache_keys = keys
        with self._lock:
            found = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry[0] != served:
                    break
                found.append(entry)
            if len(found) == len(keys):
                for key in keys:
                    self._entries.move_to_end(key)
                self.hits += 1
                _read_after(found)
                if not request.batch_shape:
                    return HIT, [_clone(v) for v in found[0][1]]
                return HIT, [_stack(column, request.batch_shape) for column in zip(*(e[1] for e in found))]
            if not request.batch_shape:
                lead = self._leaders.get(keys[0])
                if lead is not None and lead[1] == served:
                    self._followers.setdefault(id(lead[0]), []).append(request)
                    self.coalesced += 1
                    return JOINED, None
                self._leaders[keys[0]] = (request, served)
            self.misses += 1
            return LEAD, None

    def complete(
        self, requests: Sequence[Request], columns: Sequence[Sequence[Any]], served: Hashable
    ) -> tuple[list[Request], list[Sequence[Any]]]:
        """After a batch: store each request's rows, tagged ``served``; return the followers and their values.

        The copies are queued on the current stream; on CUDA, the entries
        keep an event after them, which a hit's stream waits for.
        """
        followers: list[Request] = []
        values: list[Sequence[Any]] = []
        stored: list[tuple[Hashable, tuple[Any, ...]]] = []
        rows_of = list(zip(*columns)) if columns else [()] * len(requests)
        with self._lock:
            for request, row in zip(requests, rows_of):
                keys = request.cache_keys
                if keys is None:
                    continue
                if not request.batch_shape:
                    stored.append((keys[0], tuple(_clone(v) for v in row)))
                    waiting = self._detach(request)
                    followers.extend(waiting)
                    values.extend(tuple(_clone(v) for v in row) for _ in waiting)
                else:
                    flat = [flat_rows(v, len(request.batch_shape)) for v in row]
                    stored.extend((key, tuple(_clone(f[i]) for f in flat)) for i, key in enumerate(keys))
            ready = _made(stored)  # before any hit can find them
            for key, kept in stored:
                self._store(key, (served, kept, ready))
        return followers, values

    def promote(self, leader: Request) -> Request | None:
        """``leader`` was cancelled: its first follower leads the others instead."""
        if leader.cache_keys is None:  # it bypassed the cache: nobody follows it
            return None
        with self._lock:
            lead = self._leaders.get(leader.cache_keys[0])  # type: ignore[index]
            followers = self._detach(leader)
            if not followers:
                return None
            head, rest = followers[0], followers[1:]
            if lead is not None and lead[0] is leader:
                self._leaders[head.cache_keys[0]] = (head, lead[1])  # type: ignore[index]
            if rest:
                self._followers[id(head)] = rest
            return head

    def release(self, requests: Sequence[Request]) -> list[Request]:
        """Requests that will not be computed (their batch failed, the server closed): their followers."""
        followers: list[Request] = []
        with self._lock:
            for request in requests:
                if request.cache_keys is not None and not request.batch_shape:
                    followers.extend(self._detach(request))
        return followers

    def _detach(self, leader: Request) -> list[Request]:
        key = leader.cache_keys[0]  # type: ignore[index]
        lead = self._leaders.get(key)
        if lead is not None and lead[0] is leader:
            del self._leaders[key]
        return self._followers.pop(id(leader), [])

    def _store(self, key: Hashable, entry: tuple[Hashable, tuple[Any, ...], torch.cuda.Event | None]) -> None:
        entries = self._entries
        entries[key] = entry
        entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, key_fn={self.key_fn!r}, size={len(self)})"


def _made(stored: list[tuple[Hashable, tuple[Any, ...]]]) -> torch.cuda.Event | None:
    """An event after the copies of ``stored`` queued on the current stream; ``None`` off CUDA.

    A batch's outputs are all on one device: the first tensor says which.
    """
    first = next(tensors(v for _, kept in stored for v in kept), None)
    if first is None or not first.is_cuda:
        return None
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(first.device))
    return ready


def _read_after(entries: list[tuple[Hashable, tuple[Any, ...], torch.cuda.Event | None]]) -> None:
    """Queue the current stream after the copies of ``entries``, which a hit copies on it (CUDA only).

    Their memory is marked as read there, so that an entry dropped
    meanwhile is not given to other work before those copies have run.
    """
    for _, kept, ready in entries:
        if ready is None:
            continue
        for value in tensors(kept):
            stream = torch.cuda.current_stream(value.device)
            stream.wait_event(ready)
            value.record_stream(stream)


def _stack(column: Sequence[Any], batch_shape: torch.Size) -> Any:
    """A request's rows (each as stored) back into its batch shape."""
    first = column[0]
    if holds_tensors(first):
        stacked = torch.stack(list(column))
        return stacked.reshape(*batch_shape, *stacked.shape[1:])
    return shaped_rows(list(column), batch_shape)
