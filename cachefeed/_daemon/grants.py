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
* ``Publish(req, seq, done, spanning, reserve)`` -> ``PublishReply``: the finished file of grant ``seq`` is
  verified and renamed into ``segments/``; ``done`` lists the objects whose last sample it holds (the supervisor
  marks them done), ``spanning`` the object (at most one) some of whose samples it holds while the rest are still
  being written, as ``[oid, cut]``: its first ``cut`` samples are in this segment and earlier ones. The plan counts
  both as cached in it (``plan.py``, "Cached objects"). An ``error`` means the file did not verify and was
  deleted; the supervisor re-queued ``done`` and reserved nothing. ``reserve > 0`` asks, once the segment is
  published, for the next segment's room in the same round trip ("publish this and reserve the next"): the reply
  carries that grant (``seq``, ``path``, ``nbytes``, as a ``GrantReply``'s) or ``seq = -1`` when the store said
  wait or never (the writer then asks with ``Reserve`` as usual, which gives it the wait or the error). A writer
  that knows more samples are coming asks so; the round trips per segment halve (two: one).
* ``Abort(seq)``: the writer gives the grant back (no reply); its tmp file is deleted.

Invariants:

* Every ``Reserve`` and ``Publish`` gets exactly one reply, in order; the writer thread has at most one request
  outstanding (it blocks on the reply), so replies carry the request id only as a check.
* A sampler holds at most one grant at a time, so the bound (``max_bytes + samplers x segment_bytes``) is kept: a
  ``Publish`` with ``reserve`` is served in that order, publish first (the published grant is consumed), then the
  reservation; a grant reserved that way is held like any other (``abort_all``, ``Abort``) until the writer
  opens its next segment in it, or gives it back (``Abort``) when no sample came to fill it.
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
    reserve: int = 0  # > 0: then reserve the next segment's room of this size (see the NOTE)


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
    seq: int = -1  # the next segment's grant, when ``Publish.reserve`` asked for one and the store gave it
    path: str = ""
    nbytes: int = 0


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
        return self.publish_and_reserve(grant, 0)[0]

    def publish_and_reserve(self, grant: Grant, nbytes: int) -> tuple[object, Grant | None]:
        """Publish ``grant``'s segment, then (``nbytes > 0``) reserve the next one's room, in one round trip.

        Returns the published grant's ``seq`` and the new grant, or None where the store gave none (wait, or too
        large: ``reserve`` tells which). Raises ``CorruptRecordError`` when the segment did not verify (nothing is
        reserved then).
        """
        done, self.completed = self.completed, []
        spanning, self.spanning = self.spanning, []
        reply = self._call(lambda req: Publish(req, grant.seq, done, spanning, nbytes))
        if not isinstance(reply, PublishReply):
            raise TypeError(f"expected a publish reply, got {reply!r}")
        if reply.error:
            raise CorruptRecordError(reply.error)  # the supervisor re-queued ``done``
        following = None if reply.seq < 0 else Grant(reply.seq, Path(reply.path), reply.nbytes)
        return grant.seq, following

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

    def _reserve(self, sampler: int, nbytes: int) -> Grant | None:
        """A grant of ``nbytes`` held for ``sampler``; None: wait. ValueError: it can never fit."""
        grant = self._store.reserve(nbytes)
        if grant is not None:
            self._held.setdefault(sampler, {})[grant.seq] = grant
        return grant

    def reserve(self, sampler: int, request: Reserve) -> GrantReply:
        try:
            grant = self._reserve(sampler, request.nbytes)
        except ValueError as exc:
            return GrantReply(request.req, error=str(exc))
        if grant is None:
            return GrantReply(request.req, wait=True)
        return GrantReply(request.req, grant.seq, str(grant.path), grant.nbytes)

    def publish(self, sampler: int, request: Publish) -> tuple[PublishReply, PublishedSegment | None]:
        """Publish the segment of ``request``, then reserve what it asks (``reserve``); the reply, and the
        published segment (None: nothing published, nothing reserved)."""
        grant = self._held.get(sampler, {}).pop(request.seq, None)
        if grant is None:
            return PublishReply(request.req, error=f"unknown grant {request.seq}"), None
        try:
            segment = self._store.publish(grant)
        except (CorruptRecordError, OSError, ValueError) as exc:
            log.error("sampler %d: segment %d not published: %s", sampler, request.seq, exc)
            return PublishReply(request.req, error=str(exc)), None
        following = None
        if request.reserve > 0:
            try:
                following = self._reserve(sampler, request.reserve)
            except ValueError:
                pass  # the writer's own Reserve gets the error, where it can quarantine the object
        if following is None:
            return PublishReply(request.req), segment
        return PublishReply(request.req, "", following.seq, str(following.path), following.nbytes), segment

    def abort(self, sampler: int, request: Abort) -> None:
        grant = self._held.get(sampler, {}).pop(request.seq, None)
        if grant is not None:
            self._store.abort(grant)

    def abort_all(self, sampler: int) -> None:
        """``sampler`` is gone: every grant it held is given back and its file deleted."""
        for grant in self._held.pop(sampler, {}).values():
            self._store.abort(grant)
