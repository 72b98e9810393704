"""Room for segments, between a sampler's segment writer and the supervisor's store: messages, client, server.

NOTE [ Grant protocol ]
-----------------------
The store (``_cache/store.py``) is the single owner of the budget, and it lives in the supervisor. A sampler's
writer thread fills segments through ``CacheWriter`` (``_cache/writer.py``), which asks a ``GrantProvider``
(``_cache/grant.py``) for room; in a sampler that provider is ``RpcGrantProvider``, which sends the calls over the
sampler's channel, and ``GrantServer`` in the supervisor runs them on the store:

* ``Reserve(req, nbytes)`` -> ``GrantReply``: a grant (``seq``, tmp path, bytes) the writer may fill, or ``wait``
  (the cache is full of data trainers have not read or still pin: ask again later), or an ``error`` (a segment of
  that size can never fit: the object is quarantined as ``too_large``).
* ``Publish(req, seq, done, spanning)`` -> ``PublishReply``: the finished file of grant ``seq`` is verified and
  renamed into ``segments/``; ``done`` lists the objects whose last sample it holds (the supervisor marks them
  done), ``spanning`` the object (at most one) some of whose samples it holds while the rest are still being
  written, as ``[oid, cut]``: its first ``cut`` samples are in this segment and earlier ones. The plan counts
  both as cached in it (``plan.py``, "Cached objects"). An ``error`` means the file did
  not verify and was deleted; the supervisor re-queued ``done``.
* ``Abort(seq)``: the writer gives the grant back (no reply); its tmp file is deleted.

Invariants:

* Every ``Reserve`` and ``Publish`` gets exactly one reply, in order; the writer thread has at most one request
  outstanding (it blocks on the reply), so replies carry the request id only as a check.
* The server remembers each sampler's outstanding grants; when the sampler dies they are aborted (``abort_all``),
  so no tmp file outlives its writer and no room stays reserved. A grant is consumed by exactly one ``Publish``
  or abort.
* The writer waits for ``wait`` answers without blocking the supervisor: it polls (``CacheWriter``'s ``poll_s``).

Referenced from: ``sink.py`` (the client, in the writer thread), ``supervisor.py`` (the server), ``protocol.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from cachefeed._cache.grant import Grant
from cachefeed._daemon.wire import Channel, Message, message
from cachefeed._errors import ChannelClosed, CorruptRecordError, GrantTooLarge
from cachefeed._logs import get_logger

if TYPE_CHECKING:  # the server's side only: a sampler imports this module for the client, never the store
    from cachefeed._cache.store import CacheStore, PublishedSegment

__all__ = ["Abort", "GrantReply", "GrantServer", "Publish", "PublishReply", "Reserve", "RpcGrantProvider"]

log = get_logger(__name__)

_REPLY_TIMEOUT_S = 60.0


# -- messages: sampler -> supervisor ---------------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class Reserve(Message):
    TAG: ClassVar[str] = "reserve"
    req: int
    nbytes: int


@message
@dataclass(frozen=True, slots=True)
class Publish(Message):
    TAG: ClassVar[str] = "publish"
    req: int
    seq: int
    done: list[int]
    spanning: list[list[int]]  # [[oid, cut]]


@message
@dataclass(frozen=True, slots=True)
class Abort(Message):
    TAG: ClassVar[str] = "abort"
    seq: int


# -- messages: supervisor -> sampler ---------------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class GrantReply(Message):
    TAG: ClassVar[str] = "grant"
    req: int
    seq: int = -1
    path: str = ""
    nbytes: int = 0
    wait: bool = False
    error: str = ""


@message
@dataclass(frozen=True, slots=True)
class PublishReply(Message):
    TAG: ClassVar[str] = "published"
    req: int
    error: str = ""


# -- the client: a GrantProvider in the sampler's writer thread -------------------------------------------------


class RpcGrantProvider:
    """``GrantProvider`` over the protocol channel. Called from the writer thread; replies arrive on the loop.

    ``completed`` lists the objects whose samples have all been added to the writer, ``spanning`` the object whose
    samples are being added once one of them is in the open segment; ``publish`` sends both with the segment and
    clears them (the completed are done once it is published; the spanning one has samples in it).
    """

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self._pending: dict[int, Future[Message]] = {}
        self._next_req = 0
        self._closed: BaseException | None = None
        self.completed: list[int] = []
        self.spanning: list[list[int]] = []  # [[oid, cut]]

    def _call(self, message_for: Callable[[int], Message]) -> Message:
        future: Future[Message] = Future()
        with self._lock:
            if self._closed is not None:
                raise ChannelClosed(str(self._closed))
            req = self._next_req
            self._next_req += 1
            self._pending[req] = future
        self._channel.send(message_for(req))
        return future.result(timeout=_REPLY_TIMEOUT_S)

    def on_reply(self, reply: GrantReply | PublishReply) -> None:
        """Route a reply to the waiting call (loop thread)."""
        with self._lock:
            future = self._pending.pop(reply.req, None)
        if future is None:
            log.warning("reply to unknown request %d", reply.req)
        else:
            future.set_result(reply)

    def close(self, reason: BaseException) -> None:
        """Fail every waiting call and every later one (the supervisor is gone)."""
        with self._lock:
            self._closed = reason
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(ChannelClosed(str(reason)))

    def reserve(self, nbytes: int) -> Grant | None:
        reply = self._call(lambda req: Reserve(req, nbytes))
        if not isinstance(reply, GrantReply):
            raise TypeError(f"expected a grant reply, got {reply!r}")
        if reply.error:
            raise GrantTooLarge(reply.error)
        if reply.wait:
            return None
        return Grant(reply.seq, Path(reply.path), reply.nbytes)

    def publish(self, grant: Grant) -> object:
        done, self.completed = self.completed, []
        spanning, self.spanning = self.spanning, []
        reply = self._call(lambda req: Publish(req, grant.seq, done, spanning))
        if not isinstance(reply, PublishReply):
            raise TypeError(f"expected a publish reply, got {reply!r}")
        if reply.error:
            raise CorruptRecordError(reply.error)  # the supervisor re-queued ``done``
        return grant.seq

    def abort(self, grant: Grant) -> None:
        grant.path.unlink(missing_ok=True)
        try:
            self._channel.send(Abort(grant.seq))
        except ChannelClosed:
            pass  # the supervisor is gone; its successor's recovery removes tmp/ anyway


# -- the server: the supervisor's side, on the store ------------------------------------------------------------


class GrantServer:
    """Runs each sampler's grant requests on the store and builds the replies (see the NOTE). Main loop only.

    Samplers are named by their index; the server keeps the grants each one holds until they are published or
    aborted (``abort_all`` when the sampler is gone).
    """

    def __init__(self, store: CacheStore) -> None:
        self._store = store
        self._held: dict[int, dict[int, Grant]] = {}

    def holds(self, sampler: int) -> bool:
        """Whether ``sampler`` holds a grant now (it is writing a segment)."""
        return bool(self._held.get(sampler))

    def reserve(self, sampler: int, request: Reserve) -> GrantReply:
        try:
            grant = self._store.reserve(request.nbytes)
        except ValueError as exc:
            return GrantReply(request.req, error=str(exc))
        if grant is None:
            return GrantReply(request.req, wait=True)
        self._held.setdefault(sampler, {})[grant.seq] = grant
        return GrantReply(request.req, grant.seq, str(grant.path), grant.nbytes)

    def publish(self, sampler: int, request: Publish) -> tuple[PublishReply, PublishedSegment | None]:
        """Publish the segment of ``request``; the reply, and the published segment (None: nothing published)."""
        grant = self._held.get(sampler, {}).pop(request.seq, None)
        if grant is None:
            return PublishReply(request.req, error=f"unknown grant {request.seq}"), None
        try:
            segment = self._store.publish(grant)
        except (CorruptRecordError, OSError, ValueError) as exc:
            log.error("sampler %d: segment %d not published: %s", sampler, request.seq, exc)
            return PublishReply(request.req, error=str(exc)), None
        return PublishReply(request.req), segment

    def abort(self, sampler: int, request: Abort) -> None:
        grant = self._held.get(sampler, {}).pop(request.seq, None)
        if grant is not None:
            self._store.abort(grant)

    def abort_all(self, sampler: int) -> None:
        """``sampler`` is gone: every grant it held is given back and its file deleted."""
        for grant in self._held.pop(sampler, {}).values():
            self._store.abort(grant)
