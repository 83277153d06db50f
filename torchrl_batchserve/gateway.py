"""A node's gateway and its link to the server actor: the TCP half of :mod:`torchrl_batchserve.ray`.

::

    actors of node B --shared memory--> Gateway (a BatchedPolicyServer) --Link, TCP--> LinkListener (server actor)

A :class:`Gateway` serves a node's actors with a ``BatchedPolicyServer`` of
its own whose policy, :class:`LinkedPolicy`, sends each batch over one
:class:`Link` to the server actor, whose :class:`LinkListener` admits the
link once it proves the key, and where :func:`serve_link` submits it as
one request of its rows (or, for a server whose collate varies feature dims,
as the requests it holds: :class:`Unstacked`); outputs and version stamps
come back the same way, matched by a sequence number. Each message is a small
pickled head and a body pickled on its own by ``wire.dumps``, so a batch or
a reply that one side cannot read fails alone, not the link. Nothing here
imports Ray: :mod:`torchrl_batchserve.ray` places the gateways and the
server actor.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import pickle
import queue
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.nn.probabilistic import InteractionType, interaction_type

from torchrl_batchserve.errors import (
    BadRequestError,
    BatchServeError,
    PolicyError,
    ServerBrokenError,
    own_copy,
    portable,
)
from torchrl_batchserve.remote import RemotePolicy
from torchrl_batchserve.replica import to_host
from torchrl_batchserve.server import BatchedPolicyServer
from torchrl_batchserve.stats import ServerStatistics
from torchrl_batchserve.transport.wire import dumps

__all__ = [
    "HANDSHAKE_TIMEOUT",
    "Gateway",
    "Link",
    "LinkListener",
    "LinkedPolicy",
    "Unstacked",
    "exit_as_killed_unless",
    "outcome",
    "recv",
    "send",
    "serve_link",
]

_log = logging.getLogger(__name__)
_ROWS = "_batchserve_rows"  # an unstacked gateway batch: each request's rows (Unstacked)
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new link connection may stay silent while it proves the key; then it is hung up on."""


class Gateway:
    """One node's gateway: a server of the node's actors whose batches go on to the server actor.

    A Ray actor of its server actor's. Closed (:meth:`close`), it tells the
    node's actors the server closed; ended any other way, that it broke.
    """

    def __init__(self, link: tuple[Any, bytes], in_keys: list, out_keys: list, server_kwargs: dict[str, Any]) -> None:
        self._link = Link(*link)
        self._server = BatchedPolicyServer(LinkedPolicy(self._link, in_keys, out_keys), **server_kwargs)
        self._closed = False
        exit_as_killed_unless(lambda: self._closed)

    def remote_policy(self) -> RemotePolicy:
        return self._server.remote_policy()

    def statistics(self) -> ServerStatistics:
        return self._server.statistics()

    def healthy(self) -> bool:
        return self._link.broken is None

    def close(self, timeout: float) -> bool:
        """Serve what is queued, then tell the node's actors the server closed (see ``_ServerActor.close``)."""
        self._closed = True
        return self._server.close(timeout=timeout)


def exit_as_killed_unless(closed: Callable[[], bool]) -> None:
    """As the process exits, end it at once, as a kill would, unless ``closed()``.

    For a Ray actor that holds a server (the server actor, a gateway): Ray
    ends one gracefully at times (a SIGTERM, its owner's death, a dropped
    handle), and then the server's finalizer would tell its clients that it
    closed, which they take for good. Ended so, they hear that it broke, and
    ask again (a restarted server actor is found that way). Registered after
    the server's finalizer, so it runs first (``atexit`` runs the last
    registered first).
    """
    atexit.register(lambda: None if closed() else os._exit(1))


class LinkedPolicy(TensorDictModuleBase):
    """The gateway's policy: its batch to the server actor and back, over the gateway's link."""

    def __init__(self, link: Link, in_keys: list, out_keys: list) -> None:
        super().__init__()
        self.in_keys = list(in_keys)
        self.out_keys = list(out_keys)
        self.link = link

    def __deepcopy__(self, memo: dict) -> LinkedPolicy:
        return LinkedPolicy(self.link, self.in_keys, self.out_keys)  # no weights: every replica shares the link

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        mode = interaction_type()
        mode = None if mode is None else mode.value
        if tensordict.batch_dims:  # stacked: one request of its rows
            return tensordict.update(self.link.submit(tensordict.select(*self.in_keys), mode).result())
        requests = [  # unstacked (Unstacked): the requests as they came
            TensorDict({k: tensordict.get(k).get(str(i)) for k in self.in_keys}, batch_size=[n] if n else [])
            for i, n in enumerate(tensordict.get(_ROWS).tolist())
        ]
        outputs = self.link.submit(requests, mode).result()
        return TensorDict({k: TensorDict({str(i): o.get(k) for i, o in enumerate(outputs)}) for k in self.out_keys})


class Unstacked:
    """A gateway's collate when the server's varies feature dims: its requests go on one by one.

    The batch holds each key as ``{"0": request 0's value, "1": ...}`` and
    each request's rows under ``_ROWS`` (0: a single row); :class:`LinkedPolicy`
    submits every request as it came, so the server's own collate pads or
    packs them, and the outputs come back the same way.
    """

    provided_keys: frozenset = frozenset()

    def __init__(self, variable_dims: dict, server_collate: Any) -> None:
        self.variable_dims = variable_dims
        self.check = getattr(server_collate, "check", None)  # the server's per-request checks, at the gateway

    def collate(self, requests: Sequence[Any], keys: Sequence[Any]) -> TensorDictBase:
        batch = TensorDict({_ROWS: torch.tensor([r.rows if r.batch_shape else 0 for r in requests])})
        for j, key in enumerate(keys):
            batch.set(key, TensorDict({str(i): r.inputs[j] for i, r in enumerate(requests)}))
        return batch

    def split(self, output: TensorDictBase, requests: Sequence[Any], keys: Sequence[Any]) -> list[list[Any]]:
        columns = []
        for key in keys:
            values = output.get(key)
            column = [values.get(str(i)) for i in range(len(requests))]
            columns.append(
                [
                    v.reshape(*r.batch_shape, *v.shape[1:]) if len(r.batch_shape) > 1 else v
                    for v, r in zip(column, requests)
                ]
            )
        return columns


class Link:
    """A gateway's connection to the server actor: batches out, their outputs back, matched by ``seq``.

    A TCP connection of its own, not Ray calls, which cost more on both sides
    (docs/performance.md). When it ends (the server actor is gone), every
    batch in flight fails with
    :class:`~torchrl_batchserve.errors.ServerBrokenError`, and so does every
    later one.
    """

    def __init__(self, address: Any, authkey: bytes) -> None:
        try:  # each step bounded: a port its node cannot reach, or a server actor that never answers
            sock = socket.create_connection(address, timeout=HANDSHAKE_TIMEOUT)
            sock.settimeout(None)
            self._conn = Connection(sock.detach())
            try:
                _handshake(self._conn, authkey, answer_challenge, deliver_challenge)  # as Client(authkey=) does
            except BaseException:
                self._conn.close()
                raise
        except (OSError, EOFError) as err:  # EOFError: hung up on mid-handshake
            raise ServerBrokenError(
                f"the gateway cannot reach the server actor's link at {address} ({err!r}): its node must reach "
                "that port of the server actor's node"
            ) from err
        self._lock = threading.Lock()
        self._seq = 0
        self._waiting: dict[int, Future] = {}
        self.broken: BaseException | None = None
        threading.Thread(target=self._read, name="batchserve-ray-link", daemon=True).start()

    def __deepcopy__(self, memo: dict) -> Link:
        return self  # one connection, shared by the gateway's serve loops (a copy would close it when dropped)

    def submit(self, batch: TensorDictBase, interaction: str | None) -> Future:
        future: Future = Future()
        body = dumps(batch)  # before the lock, which the gateway's other serve loops and the reader take
        with self._lock:
            if self.broken is not None:
                raise own_copy(self.broken)
            self._seq += 1
            self._waiting[self._seq] = future
            try:
                send(self._conn, (self._seq, interaction, body))
            except OSError as err:
                self._waiting.pop(self._seq)
                raise ServerBrokenError(f"the connection to the server actor broke: {err}") from err
        return future

    def _read(self) -> None:
        try:
            while True:
                seq, answer = recv(self._conn)
                with self._lock:
                    future = self._waiting.pop(seq)  # a reply to no batch in flight is a broken link too
                try:
                    error, outputs = pickle.loads(answer)
                except Exception as err:  # an error or an output of a class this node cannot import
                    error = BatchServeError(f"the server's reply cannot be read on this node: {err!r}")
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(outputs)
        except Exception as err:  # the connection ended (EOF, reset), or a reply cannot be read or matched
            with contextlib.suppress(OSError):
                self._conn.close()
            with self._lock:
                self.broken = ServerBrokenError(f"the link to the server actor ended ({err!r})")
                waiting, self._waiting = list(self._waiting.values()), {}
            for future in waiting:  # nobody would read their replies
                future.set_exception(own_copy(self.broken))


class LinkListener:
    """The server actor's end of the gateways' links: each connection that proves the key is served.

    A connection proves the key (``multiprocessing``'s challenge, as
    :class:`Link` answers it) in a thread of its own, and is
    hung up on when it stays silent for :data:`HANDSHAKE_TIMEOUT` meanwhile:
    one that connects and says nothing holds up no other gateway, as it
    would in ``Listener.accept``.

    Args:
        server: the server the links' batches go to (:func:`serve_link`).
        returned: the keys a reply carries.
        host: the address to listen on (the server actor's node).
    """

    def __init__(self, server: BatchedPolicyServer, returned: list, host: str) -> None:
        self._server = server
        self._returned = returned
        self.authkey = secrets.token_bytes(16)
        # No key here: Listener.accept() would check each connection's before it accepts the next.
        self._listener = Listener((host, 0), backlog=128)
        self.address = self._listener.address
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="batchserve-link-accept", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:
                return  # closed
            if self._closed:  # close()'s knock
                conn.close()
                return
            try:
                threading.Thread(target=self._admit, args=(conn,), name="batchserve-link", daemon=True).start()
            except RuntimeError:  # no thread to be had (a container's process limit): this link fails, not later ones
                _log.warning("no thread to serve a gateway's link: hung up on it")
                conn.close()

    def _admit(self, conn: Connection) -> None:
        """Serve ``conn``'s batches once it proved the key in time; else hang up."""
        try:
            _handshake(conn, self.authkey, deliver_challenge, answer_challenge)
        except Exception:  # the wrong key, hung up, or silent past the timeout (a read ends with EAGAIN)
            conn.close()
            return
        serve_link(self._server, conn, self._returned)

    def close(self) -> None:
        """Accept no more connections (the links being served end with the server)."""
        self._closed = True
        with contextlib.suppress(OSError), socket.create_connection(self.address, timeout=5):
            pass  # ends the accept thread's accept(), which closing the listener does not (Linux)
        self._listener.close()
        self._acceptor.join(5)


def _handshake(conn: Connection, authkey: bytes, *steps: Callable[[Connection, bytes], None]) -> None:
    """Prove ``authkey`` on a new link connection by ``steps``, each read bounded by :data:`HANDSHAKE_TIMEOUT`.

    Then no read times out, and each write goes at once: a message is two
    writes (:func:`send`), and with Nagle's algorithm the second would wait
    for the peer's ACK of the first, which Linux delays by up to 40 ms.
    """
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the same connection, to set its options
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(HANDSHAKE_TIMEOUT))
        for step in steps:
            step(conn, authkey)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _timeval(seconds: float) -> bytes:
    """``seconds`` as the ``struct timeval`` of ``SO_RCVTIMEO`` (0: no limit)."""
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))


def serve_link(server: BatchedPolicyServer, conn: Connection, returned: list) -> None:
    """Serve one gateway's batches on ``server``, each as one request of its rows, until ``conn`` ends.

    Runs in the server actor, one thread per gateway, and one more that sends
    its replies: a serve loop only hands a finished batch over, and never
    waits on a gateway that reads slowly or not at all (its node cut off, say).
    ``returned``: the keys a reply carries (the out_keys and the version stamp).
    """
    caller = ("gateway", id(conn))
    replies: queue.SimpleQueue = queue.SimpleQueue()  # (seq, the batch's done future); None: the end

    def answer(done: Future) -> bytes:
        error = done.exception()
        # on the host: a CUDA tensor (output_device="cuda") would unpickle on the gateway's GPU, or fail there
        outputs = None if error is not None else _each(done.result(), lambda td: to_host(td.select(*returned)))
        try:
            return outcome(error, outputs)
        except Exception as err:  # outputs that do not pickle: this batch fails, not the link
            return outcome(PolicyError(f"the outputs do not pickle, so they cannot reach the gateway ({err!r})"), None)

    def send_replies() -> None:
        with contextlib.suppress(OSError):  # the gateway is gone: its replies have nobody to go to
            for seq, done in iter(replies.get, None):
                send(conn, (seq, answer(done)))

    sender = threading.Thread(target=send_replies, name="batchserve-link-replies", daemon=True)
    sender.start()
    try:
        while True:
            try:
                seq, interaction, payload = recv(conn)
            except (EOFError, OSError):
                return  # the gateway (or its node) is gone
            except Exception:  # a message that cannot be read: end the link, so the gateway fails what is in flight
                _log.exception("a gateway sent a message that cannot be read; its connection is closed")
                conn.close()
                return
            try:
                try:
                    batch = pickle.loads(payload)  # pickled on its own: one that cannot be read fails alone
                except Exception as err:  # an input of a class this process cannot import
                    unread = f"the gateway's batch cannot be read in the server's process: {err!r}"
                    raise BadRequestError(unread) from None
                mode = None if interaction is None else InteractionType(interaction)
                submit = functools.partial(server.submit, caller=caller, interaction=mode)
                future = _all(_each(batch, submit))
            except Exception as err:  # refused at once (closed, bad rows): this batch only
                future = Future()
                future.set_exception(err)
            future.add_done_callback(functools.partial(_put_with, replies, seq))  # at once if done
    finally:
        replies.put(None)


def _put_with(replies: queue.SimpleQueue, seq: int, done: Future) -> None:
    replies.put((seq, done))


def send(conn: Connection, message: tuple) -> None:
    """A link message, ``(*head, body)``: its small head pickled, then its body (bytes, a batch or a reply
    pickled on its own by ``wire.dumps``) as a frame of its own, so that the body is never pickled again.

    The caller holds the connection's send lock: the two frames go together.
    """
    *head, body = message
    conn.send_bytes(pickle.dumps(tuple(head), protocol=pickle.HIGHEST_PROTOCOL))
    conn.send_bytes(body)


def recv(conn: Connection) -> tuple:
    """A link message as :func:`send` sent it: ``(*head, body)``."""
    head = pickle.loads(conn.recv_bytes())
    return (*head, conn.recv_bytes())


def outcome(error: BaseException | None, outputs: Any) -> bytes:
    """A batch's reply pickled on its own: one that a gateway cannot unpickle fails that batch, not the link."""
    return dumps((None if error is None else portable(error), outputs))


def _each(items: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` of one item, or of each of a list of them (an unstacked gateway batch)."""
    return [fn(item) for item in items] if isinstance(items, list) else fn(items)


def _all(futures: Future | list[Future]) -> Future:
    """One future: the list of ``futures``' results once all are done, or the first failure; or the one given."""
    if not isinstance(futures, list):
        return futures
    done: Future = Future()
    left, lock = [len(futures)], threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            done.set_exception(failed[0])
        else:
            done.set_result([f.result() for f in futures])

    for future in futures:
        future.add_done_callback(one_done)
    return done
