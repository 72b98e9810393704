"""Which objects to fetch next: passes without replacement, a disjoint share per node, re-queues and skips.

The plan lives in the supervisor and is driven by its main loop (not thread-safe).

Contract:

* **Node partition.** Node ``rank`` of ``count`` owns the objects whose ``xxh3_64(path) % count == rank``:
  disjoint across nodes, deterministic, and stable when the catalog grows (an object never changes owner).
  The plan keeps only the objects it owns, as columns (``columns.py``); the others are counted, not kept.
* **Listings arrive as pages.** ``update_page`` folds one page in (objects join the current pass at once, so the
  first fetch follows the first page); ``end_listing`` closes a listing: owned objects it did not show are no
  longer drawn (until listed again). Until then, what the last complete listing showed stays drawable.
  ``update_catalog`` is a whole listing as one page.
* **Passes.** Each pass visits every owned object at most once, in a seeded order: objects sorted by
  ``pass_order_key`` (a bijective mix of the path's hash and ``h(seed, pass)``; ``columns.pass_order`` sorts by
  its top bits, ties, a few hundred pairs at 10⁷ objects, by row). The same (seed, pass, catalog listed in the
  same order) gives the same order on every run. Objects that a page adds, and new versions (another ETag) of
  known ones, join the current pass, appended in that same seeded order; a pass over a catalog that grows while
  it is listed is still a pass without replacement.
* **Pass boundary.** A pass is completed when all its objects were drawn *and* resolved (done, failed or
  skipped); only then does the next pass start, so an object is never in two passes at once. A pass that drew
  nothing (everything is already cached) or cached nothing (every object failed) is followed by a wait
  (``idle_backoff``) instead of spinning; an eviction ends the wait early (objects a listing adds need no new
  pass: they join the current one and are drawn at once, wait or not).
* **Counted passes.** ``passes_completed`` counts the passes that drew something, and the first pass over a
  complete listing of the remote even if it drew nothing: a daemon restarted on a cache that already holds every
  listed object (``adopt``) has visited everything the remote lists once its first pass ends, and trainers wait
  for that (``passes_completed >= 1``: the first, growing, epoch ends). Later passes that draw nothing repeat
  what is known and are not counted. A pass that draws nothing and ends before the first listing of the remote is
  complete (over the restart catalog alone) is not counted; the end of that listing ends the wait of an idle pass
  early. A pass that draws something is counted whenever it ends: on a cold start whose fetches outrun a listing of
  many pages, that can be before the listing's last page (its objects join the next pass). With several sources
  the status reports the passes every source completed (``Inputs.counters``).
* **Skips.** An object is not drawn while it is in flight, while any of its samples is still cached (some
  segment holding one is published and not yet evicted: the cache never holds the same sample twice), after a
  404/403 (dropped until the listing shows a new version; a 401/403 also until SIGHUP, ``retry_forbidden``),
  after a decode failure or a second sampler death while decoding it (``crash``; quarantined for that version:
  decoding the same bytes again would fail again), or after any other failure in the same pass (retried next
  pass).
* **Versions.** An outcome (done or failed) counts for the version that was drawn. If the listing shows a new
  version while the old one is in flight, the old outcome is recorded as such (the segments holding its samples
  are stale: "Retired samples") and the new version is queued again in the current pass; it is never mistaken for
  cached.
* **Re-queues.** Objects of a dead sampler go to the front and are drawn before anything else (but one it died
  decoding for the second time: quarantined, NOTE [ Supervisor-sampler protocol ] in ``protocol.py``).
* **Cached objects.** An object's samples may span several segments (a tar shard larger than a segment), and
  read-gated eviction removes segments in any order. So the plan counts, per object, the cached segments that
  hold samples of its current version (``_live``, 1 byte a row until a count passes 255): ``done`` counts the
  segment of the last sample, ``spanning`` each earlier one, published while the object was still being written.
  ``evicted`` counts them down; the object is drawn again only at zero. A new version starts at zero: the old
  version's samples are another sample.
* **Cut objects.** An object whose sampler died after a segment holding its first samples was published (or
  whose daemon restarted then) is *cut*: ``spanning`` said how many of its first samples are cached (``cut``).
  It is drawn again at once, despite its cached segments, with ``cut(oid)`` samples to skip: only the rest are
  fetched into the cache, so nothing is cached twice and nothing is missing. When the last of its segments is
  evicted first, it is whole again: drawn as any other object.
* **Resumed passes.** ``resume_pass`` continues the pass an earlier run of the daemon was in (``pass_file.py``):
  its index, the passes completed before it, the objects it had resolved, which are not drawn again in it, and
  whether it had drawn any (then it is counted when it ends, as if drawn in this run). ``take_resolved`` hands out,
  for that file, the objects resolved since the last call: drawn (done or failed), and skipped (cached, dropped,
  no longer listed) in the current pass; not those in flight; and those queued again in the pass (a new version,
  the other objects of a retired segment), which the resumed pass draws again.
* **Retired samples.** The cache holds samples of the listed version of each object only: a sample is named by its
  object's key, and an epoch serves each sample once. So the segments holding samples of a version the remote no
  longer lists are *stale* (``take_stale`` hands them to the supervisor, which evicts them at once,
  ``CacheStore.retire``): an old version once a page lists another (overwritten), an object a complete listing of the
  remote no longer shows (deleted), and recovered segments of versions the first complete listing does not show. Their
  other samples go with them: those objects are queued again in the current pass once their segments are gone
  (``evicted``), read or not: they left for the remote's changes, not because epochs had read them, as a budget
  eviction waits for. Not covered: an object cut across a stale segment and another one (at most two per segment: the
  one whose samples begin before it and the one whose samples go on after it). Its samples in the stale segment are
  missing until its other segments are evicted too and it is drawn again (its next pass). Retiring those as well would
  only move the cut: each segment's first and last samples are of objects cut across it and its neighbour, along all
  that a sampler wrote; fetching only some of an object's samples is what it would take. A listing that shows no
  object at all changes nothing (``listed_nothing``): more likely a mount missing or a wrong prefix than a dataset
  deleted (status says so). It retires nothing and forgets neither what recovered segments hold (``adopt``) nor the
  objects refused: all kept for when the remote lists again. An object a complete listing no longer shows while it is
  in flight has its segments stale as they are published.
* **Restarts.** ``adopt`` tells the plan which objects the segments recovered at start hold (path and version,
  from each segment's source list, which names every object with a sample in it); an object listed at the same
  version is skipped as cached until all those segments are evicted, so a restarted daemon does not download
  what it already holds.
"""

from __future__ import annotations

import math
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from cachefeed._cache.records import Source
from cachefeed._daemon.columns import Column, FoldedPage, ObjectTable, fold_page, key_hash, mix, pass_order
from cachefeed._logs import get_logger
from cachefeed._remote import RemoteObject

__all__ = ["PlanCounters", "SamplingPlan", "owner_of", "pass_order_key"]

log = get_logger(__name__)

_IDLE_BACKOFF_MIN_S = 0.5
_IDLE_BACKOFF_MAX_S = 30.0
_DROP_KINDS = frozenset({"not_found", "forbidden", "too_large"})
_CACHED_COST_FACTOR = 100.0  # ``cached_objects`` scans at most 1% of the time
_KEY_CHUNK = 1 << 16  # resolved keys kept as Python ints before they move to a numpy chunk
_QUARANTINE_KINDS = frozenset({"decode", "crash"})  # until the object changes: its content is at fault


def owner_of(path: str, count: int) -> int:
    """The node (0..count-1) that owns ``path``."""
    return key_hash(path) % count


def _pass_seed(seed: int, pass_index: int) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", seed & (2**64 - 1), pass_index))


def pass_order_key(path: str, seed: int, pass_index: int) -> int:
    """The sort key of ``path`` in pass ``pass_index``: a seeded permutation, stable under catalog growth."""
    return mix(key_hash(path), _pass_seed(seed, pass_index))


@dataclass(slots=True)
class PlanCounters:
    passes_completed: int = 0
    drawn_total: int = 0
    done_total: int = 0
    requeued_total: int = 0
    failed_total: int = 0
    dropped_total: int = 0
    quarantined_total: int = 0
    skipped_cached_total: int = 0


class _KeyLog:
    """Key hashes added one at a time: a pass that skips a million cached objects in one ``next`` keeps them as
    uint64 chunks (8 bytes each), not as a million Python ints."""

    def __init__(self) -> None:
        self._chunks: list[npt.NDArray[np.uint64]] = []
        self._pending: list[int] = []

    def add(self, key: int) -> None:
        self._pending.append(key)
        if len(self._pending) >= _KEY_CHUNK:
            self._chunks.append(np.array(self._pending, np.uint64))
            self._pending = []

    def take(self) -> npt.NDArray[np.uint64]:
        """Every key added since the last call, in order."""
        parts = self._chunks + ([np.array(self._pending, np.uint64)] if self._pending else [])
        self._chunks, self._pending = [], []
        return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


class SamplingPlan:
    """The sampling plan of one node. See the module docstring for the contract."""

    def __init__(
        self,
        *,
        seed: int = 0,
        rank: int = 0,
        count: int = 1,
        clock: Callable[[], float] = time.monotonic,
        name: str = "",
    ) -> None:
        """``name``: the source's, where sources are named (its log lines say whose pass ended)."""
        if not 0 <= rank < count:
            raise ValueError(f"rank {rank} must be in [0, {count})")
        self.seed = seed
        self._of = f" of source {name!r}" if name else ""
        self.rank = rank
        self.count = count
        self.counters = PlanCounters()
        self._now = clock
        self.table = ObjectTable()
        self._seen = Column(np.uint32)  # oid -> the last listing generation that showed it
        # oid -> cached segments holding samples of its current version ("Cached objects")
        self._live = Column(np.uint8, wide=np.uint32)
        self._generation = 0  # the listing being folded in, or the last one
        self._complete = 0  # the last complete listing: an object is listed if seen >= this
        self._is_listing = False
        self._owned = 0
        self._pass = 0
        self._queue: deque[npt.NDArray[np.uint32]] = deque()
        self._head = 0  # position in self._queue[0]
        self._front: deque[int] = deque()
        self._in_flight: dict[int, str | None] = {}  # oid -> the version (ETag) drawn
        self._failed_this_pass: set[int] = set()
        self._dropped: dict[int, str | None] = {}  # oid -> etag it was dropped at
        self._quarantined: dict[int, str | None] = {}
        self._reason: dict[int, str] = {}  # oid -> why it is dropped or quarantined (the failure kind)
        self._objects_in: dict[int, list[npt.NDArray[np.uint32]]] = {}  # seq -> oids with samples in it
        # path -> version -> (seqs, cut or None where a segment holds its last sample), from recovered segments
        self._adopted: dict[str, dict[str | None, tuple[list[int], int | None]]] = {}
        self._cut: dict[int, int] = {}  # oid -> its first samples cached while the rest are not ("Cut objects")
        self._stale: set[int] = set()  # segments holding samples of versions no longer listed ("Retired samples")
        self._retiring: set[int] = set()  # stale segments handed out, until ``evicted`` says they are gone
        self._listing_shows = 0  # objects (owned or not) the listing being folded in has shown so far
        self.listed_nothing = False  # the last complete listing of the remote showed no object ("Retired samples")
        self._drawn_this_pass = 0
        self._done_this_pass = 0
        self._not_before = 0.0
        self._is_waiting = False
        self._idle_backoff_s = _IDLE_BACKOFF_MIN_S
        self._is_changed = False
        self._skipped_this_pass = 0  # objects of this pass skipped because they are cached
        self._is_remote_listed = False  # a listing of the remote (not the restart catalog) is complete
        self.revision = 0  # changes whenever the owned catalog does (what the restart catalog keeps)
        self._cached_count = (-math.inf, 0, 0.0)  # ``cached_objects``: when counted, the count, how long it took
        self._resumed: npt.NDArray[np.uint64] = np.zeros(0, np.uint64)  # key hashes resolved before a restart
        self._resumed_this_pass = 0  # listed objects of this pass resolved before the restart (not drawn)
        self._resumed_drew = False  # this pass drew objects before the restart
        self._resolved = (_KeyLog(), _KeyLog(), _KeyLog())  # since ``take_resolved``: drawn, skipped, again

    # -- the catalog ----------------------------------------------------------------------------------------

    @property
    def pass_index(self) -> int:
        return self._pass

    @property
    def owned(self) -> int:
        """Objects of this node in the latest listing."""
        return self._owned

    @property
    def nbytes(self) -> int:
        """The memory of the plan's per-object columns (the table's included)."""
        queued = sum(int(chunk.nbytes) for chunk in self._queue)
        return self.table.nbytes + self._seen.nbytes + self._live.nbytes + queued

    def object(self, oid: int) -> RemoteObject:
        return self.table.get(oid)

    def _etag(self, oid: int) -> str | None:
        return self.table.version(oid)

    def _is_listed(self, oid: int) -> bool:
        return int(self._seen.data[oid]) >= self._complete

    def fold(self, listing: Iterable[RemoteObject], *, label: str = "") -> FoldedPage:
        """A page of objects as this node keeps it (``columns.fold_page``)."""
        return fold_page(list(listing), self.rank, self.count, label=label)

    def update_catalog(self, listing: Iterable[RemoteObject]) -> int:
        """Apply a whole fresh listing; returns how many owned objects joined the current pass."""
        added = self.update_page(self.fold(listing))
        self.end_listing()
        return added

    def update_page(self, page: FoldedPage) -> int:
        """Fold one listing page in; returns how many owned objects joined the current pass (new or new
        versions, or listed again after they vanished)."""
        if not self._is_listing:
            self._is_listing = True
            self._generation += 1
            self._listing_shows = 0
        self._listing_shows += page.listed
        generation = self._generation
        found = self.table.lookup(page.paths, page.hashes)
        known_rows = np.flatnonzero(found >= 0)
        known = found[known_rows]
        joined: list[int] = []
        if len(known):
            was_listed = self._seen.data[known] >= self._complete
            changed = self.table.changed(known, page, known_rows)
            self._forget_cached(known[changed])
            for i in np.flatnonzero(changed):
                # A new version is a new object: it joins the current pass, whatever happened to the old one.
                oid = int(known[i])
                self.table.set_version_from(oid, page, int(known_rows[i]))
                if self._adopted:
                    self._adopt_listed(oid)  # recovered segments may hold this version (the restart catalog's older)
                self._dropped.pop(oid, None)
                self._quarantined.pop(oid, None)
                self._failed_this_pass.discard(oid)
            back = ~was_listed & ~changed  # listed again after it vanished
            joined.extend(int(oid) for oid in known[changed | back])
            self._owned += int(np.count_nonzero(~was_listed))
            self._seen.data[known] = generation
        new_rows = np.flatnonzero(found < 0)
        oids = self.table.add(page, new_rows)
        if len(oids):
            self._seen.grow_to(len(self.table))
            self._live.grow_to(len(self.table))
            self._seen.data[oids.start : oids.stop] = generation
            self._owned += len(oids)
            if self._adopted:
                for oid in oids:
                    self._adopt_listed(oid)
        hashes, new_oids = page.hashes[new_rows], np.arange(oids.start, oids.stop, dtype=np.uint32)
        if len(self._resumed) and len(hashes):  # resolved in this pass before a restart: not drawn again in it
            at = np.minimum(np.searchsorted(self._resumed, hashes), len(self._resumed) - 1)
            resumed = self._resumed[at] == hashes
            self._resumed_this_pass += int(np.count_nonzero(resumed))
            hashes, new_oids = hashes[~resumed], new_oids[~resumed]
        rejoined = known[:0]
        if joined:  # else no np.isin: on an empty list it loads numpy.ma (23 ms), on a cold start's first listing
            back_in = np.isin(known, joined)
            hashes = np.concatenate([hashes, page.hashes[known_rows[back_in]]])
            rejoined = known[back_in]
        joined_oids = np.concatenate([new_oids, rejoined.astype(np.uint32)])
        if len(joined_oids):
            # No ``_is_changed``: they join the current pass and are drawn at once, wait or not. Ending an idle
            # wait for them would only start another pass when they are cached already (adopted at a restart):
            # one more pass of skips per page of a listing.
            self.revision += 1
            self._queue.extend(pass_order([(hashes, joined_oids)], _pass_seed(self.seed, self._pass)))
            self._note_again(rejoined)  # resolved in this pass before, maybe: drawn again after a restart too
        return len(joined_oids)

    def listed_oids(self) -> npt.NDArray[np.intp]:
        """The owned objects the last complete listing showed."""
        return np.flatnonzero(self.listed())

    def listed(self) -> npt.NDArray[np.bool_]:
        """Per oid, whether the last complete listing showed it (what a restart catalog keeps): 1 byte per row."""
        listed: npt.NDArray[np.bool_] = self._seen.view >= self._complete
        return listed

    def end_listing(self, *, is_restored: bool = False) -> None:
        """The listing being folded in is complete: what it did not show is no longer drawn.

        ``is_restored``: it was the restart catalog, not the remote: recovered segments whose objects it did not
        hold stay adoptable until the first real listing completes."""
        if not self._is_listing:
            self._is_listing = True
            self._generation += 1  # an empty listing: everything vanished
            self._listing_shows = 0
        self._is_listing = False
        before = self._owned
        self._complete = self._generation
        self._owned = int(np.count_nonzero(self._seen.view >= self._complete))
        if not is_restored:
            # A listing that shows nothing changes nothing ("Retired samples"): the cache, what it holds of a
            # restart's recovered segments, and the objects refused, are kept for when the remote lists again.
            self.listed_nothing = not self._listing_shows
        if not is_restored and not self.listed_nothing:
            self._retire_unlisted()  # "Retired samples": what the remote no longer lists
            for refused in (self._dropped, self._quarantined):  # no reason why a deleted object is not cached
                for oid in [oid for oid in refused if not self._is_listed(oid)]:
                    del refused[oid]
                    self._reason.pop(oid, None)
            self._adopted.clear()  # what the first listing did not show is gone from the remote
            if not self._is_remote_listed and not self.counters.passes_completed:
                self._is_changed = True  # an idle pass over it ends now, counted ("Counted passes")
            self._is_remote_listed = True
        self.table.trim()
        self._seen.trim()
        self._live.trim()
        if before > self._owned:
            self.revision += 1
            log.info("%d objects vanished from the remote listing", before - self._owned)

    # -- drawing --------------------------------------------------------------------------------------------

    def _is_skipped(self, oid: int) -> bool:
        if not self._is_listed(oid) or oid in self._in_flight or oid in self._failed_this_pass:
            return True
        if oid in self._dropped or oid in self._quarantined:
            etag = self._etag(oid)
            if oid in self._dropped and self._dropped[oid] == etag:
                return True
            if oid in self._quarantined and self._quarantined[oid] == etag:
                return True
        if self._live.data[oid] and oid not in self._cut:
            self.counters.skipped_cached_total += 1
            self._skipped_this_pass += 1
            return True
        return False

    def cut(self, oid: int) -> int:
        """How many of the first samples of ``oid``, drawn now, are cached already ("Cut objects")."""
        return self._cut.get(oid, 0)

    def _pop_queue(self) -> int | None:
        while self._queue:
            head = self._queue[0]
            if self._head < len(head):
                oid = int(head[self._head])
                self._head += 1
                return oid
            self._queue.popleft()
            self._head = 0
        return None

    def next(self, n: int) -> list[tuple[int, RemoteObject]]:
        """Draw up to ``n`` objects and mark them in flight (maybe none: nothing to do right now)."""
        out: list[tuple[int, RemoteObject]] = []
        while len(out) < n:
            if self._front:
                oid: int | None = self._front.popleft()
            else:
                oid = self._pop_queue()
                if oid is None:
                    if self._start_next_pass():
                        continue
                    break
            assert oid is not None
            if self._is_skipped(oid):
                if oid not in self._in_flight:  # (a new version queued while the old one is in flight: not yet)
                    self._note_resolved(oid, drawn=False)
                continue
            obj = self.table.get(oid)
            self._in_flight[oid] = obj.etag
            self._drawn_this_pass += 1
            self.counters.drawn_total += 1
            out.append((oid, obj))
        return out

    def _start_next_pass(self) -> bool:
        if self._in_flight or not self._owned:
            return False  # a pass ends when its last object is resolved
        now: float = self._now()
        resumed, drew = self._resumed_this_pass, self._drawn_this_pass > 0 or self._resumed_drew
        is_productive = (self._drawn_this_pass > 0 and self._done_this_pass > 0) or self._resumed_drew
        if is_productive:
            self._idle_backoff_s = _IDLE_BACKOFF_MIN_S
        elif not self._is_changed:
            if not self._is_waiting:  # the first look at an idle pass end: wait before the next one
                self._is_waiting = True
                self._not_before = now + self._idle_backoff_s
                self._idle_backoff_s = min(_IDLE_BACKOFF_MAX_S, self._idle_backoff_s * 2)
            if now < self._not_before:
                return False
        # "Counted passes": one that drew something, or the first over a complete listing (all cached: a restart)
        if drew or (self._is_remote_listed and not self.counters.passes_completed):
            self.counters.passes_completed += 1
            log.info(
                "pass %d%s completed: %d objects drawn, %d done, %d cached already%s",
                self._pass,
                self._of,
                self._drawn_this_pass,
                self._done_this_pass,
                self._skipped_this_pass,
                f", {resumed} resolved before the restart" if resumed else "",
            )
        self._pass += 1
        self._is_changed = self._is_waiting = False
        self._failed_this_pass.clear()
        self._drawn_this_pass = self._done_this_pass = self._skipped_this_pass = self._resumed_this_pass = 0
        self._resumed, self._resumed_drew = self._resumed[:0], False
        self._resolved = (_KeyLog(), _KeyLog(), _KeyLog())
        self._queue, self._head = deque(), 0  # (empty by now) freed before the next pass is laid out
        seen, complete = self._seen.data, self._complete
        runs, seed = self.table.runs(), _pass_seed(self.seed, self._pass)
        self._queue.extend(pass_order(runs, seed, lambda o: seen[o] >= complete))
        return True

    # -- outcomes -------------------------------------------------------------------------------------------

    def requeue(self, oids: Iterable[int]) -> None:
        """Objects of a sampler that died before they were done: drawn again first."""
        back = [oid for oid in oids if oid in self._in_flight]
        for oid in back:
            del self._in_flight[oid]
        self._front.extendleft(reversed(back))
        self.counters.requeued_total += len(back)

    def _resolve(self, oid: int) -> bool:
        """Take ``oid`` out of flight; False if the listing moved to another version meanwhile (queued again)."""
        drawn = self._in_flight.pop(oid, None)
        if drawn == self._etag(oid):
            return True
        self._queue.append(np.array([oid], dtype=np.uint32))  # the new version, in this pass
        self._is_changed = True
        return False

    def done(self, oids: Sequence[int], seq: int | None) -> None:
        """Objects whose samples are all published, the last one in segment ``seq`` (None: no samples)."""
        current = []
        for oid in oids:
            self._done_this_pass += 1
            self.counters.done_total += 1
            if oid not in self._in_flight or self._resolve(oid):
                current.append(oid)
            elif seq is not None:
                self._stale.add(seq)  # it holds samples of the version drawn, which the listing no longer shows
        for oid in current:
            self._cut.pop(oid, None)
            self._note_resolved(oid, drawn=True)
        if seq is not None:
            self._hold(current, seq)
            if self._deleted_in_flight(current):
                self._stale.add(seq)  # "Retired samples": the listing that ended meanwhile no longer shows it

    def spanning(self, cuts: Sequence[tuple[int, int]], seq: int) -> None:
        """Segment ``seq`` was published while these objects, still in flight, were being written: it holds some
        of their samples (not their last); ``(oid, cut)``: it and earlier segments hold the first ``cut``. Counted
        for the version drawn, if the listing still shows it."""
        current = [
            (oid, cut) for oid, cut in cuts if oid in self._in_flight and self._in_flight[oid] == self._etag(oid)
        ]
        if any(oid in self._in_flight and self._in_flight[oid] != self._etag(oid) for oid, _ in cuts):
            self._stale.add(seq)  # it holds samples of a version the listing no longer shows
        self._hold([oid for oid, _ in current], seq)
        for oid, cut in current:
            self._cut[oid] = cut
        if self._deleted_in_flight([oid for oid, _ in current]):
            self._stale.add(seq)  # as in ``done``

    def _deleted_in_flight(self, oids: Sequence[int]) -> bool:
        """Whether a complete listing that ended while these objects were in flight no longer shows one of them
        (deleted from the remote): its samples just published are stale ("Retired samples")."""
        return self._is_remote_listed and not self.listed_nothing and not all(self._is_listed(oid) for oid in oids)

    def _hold(self, oids: Sequence[int], seq: int) -> None:
        """Segment ``seq`` holds samples of the current version of each of ``oids`` (distinct)."""
        if not oids:
            return
        held = np.array(oids, dtype=np.uint32)
        self._live.put(held, self._live.data[held].astype(np.int64) + 1)
        self._objects_in.setdefault(seq, []).append(held)

    def _forget_cached(self, oids: npt.NDArray[np.integer]) -> None:
        """New versions of ``oids`` were listed: the cached samples of the old ones no longer hold them back, and
        their segments are stale ("Retired samples")."""
        if not len(oids):
            return
        self._live.data[oids] = 0
        for oid in oids.tolist():
            self._cut.pop(oid, None)
        for seq, held in list(self._objects_in.items()):
            if any(bool(np.isin(part, oids).any()) for part in held):
                self._stale.add(seq)  # it holds samples of an old version ("Retired samples")
            kept = [part[~np.isin(part, oids)] for part in held]
            kept = [part for part in kept if len(part)]
            if kept:
                self._objects_in[seq] = kept
            else:
                del self._objects_in[seq]

    def failed(self, oid: int, kind: str) -> None:
        """An object could not be cached; see the module docstring for what each ``kind`` implies."""
        self.counters.failed_total += 1
        if oid in self._in_flight and not self._resolve(oid):
            return  # the failure concerned an old version; the new one is queued
        self._note_resolved(oid, drawn=True)
        etag = self._etag(oid)
        if kind in _DROP_KINDS or kind in _QUARANTINE_KINDS:
            self._reason[oid] = kind
        if kind in _DROP_KINDS:
            self._dropped[oid] = etag
            self.counters.dropped_total += 1
        elif kind in _QUARANTINE_KINDS:
            self._quarantined[oid] = etag
            self.counters.quarantined_total += 1
        else:
            self._failed_this_pass.add(oid)

    def retry_forbidden(self) -> int:
        """Objects dropped for a 401/403 are drawn again from the next pass on (SIGHUP: an operator fixed the
        bucket's policy or the credentials; until then a drop lasted until the object changed). Returns how many."""
        refused = [oid for oid in self._dropped if self._reason.get(oid) == "forbidden"]
        for oid in refused:
            del self._dropped[oid]
            del self._reason[oid]
        return len(refused)

    # -- the pass across restarts (``pass_file.py``) ------------------------------------------------------------

    def resume_pass(
        self, pass_index: int, passes_completed: int, resolved: npt.NDArray[np.uint64], *, drew: bool
    ) -> None:
        """Continue pass ``pass_index`` of an earlier run, after ``passes_completed`` passes: the objects of
        ``resolved`` (key hashes, sorted) are not drawn in it; ``drew``: it had drawn some. Call before the first
        page."""
        if len(self.table):
            raise RuntimeError("resume_pass must come before the first listing page")
        self._pass = pass_index
        self.counters.passes_completed = passes_completed
        self._resumed, self._resumed_drew = resolved, drew

    def take_resolved(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """The key hashes of the objects resolved in the current pass since the last call: those drawn, and those
        skipped; and those queued again in it since (a new version listed, or what a retired segment held), which
        a restart draws again however they were resolved before (see "Resumed passes")."""
        drawn, skipped, again = self._resolved
        return drawn.take(), skipped.take(), again.take()

    def _note_resolved(self, oid: int, *, drawn: bool) -> None:
        self._resolved[0 if drawn else 1].add(self.table.key_hash(oid))

    def _note_again(self, oids: Iterable[int]) -> None:
        for oid in oids:
            self._resolved[2].add(self.table.key_hash(int(oid)))

    def adopt(self, seq: int, sources: Iterable[Source]) -> None:
        """Segment ``seq``, recovered at start, holds samples of each ``(path, version[, cut])`` in ``sources``
        (``records.Source``: ``cut`` where the segment was cut inside the object's samples).

        Call before the first ``update_catalog``; objects listed later at the same version count as cached until
        every recovered segment that holds samples of that version is evicted.
        """
        for path, version, cut in sources:
            versions = self._adopted.setdefault(path, {})
            seqs, known = versions.get(version, ([], 0))
            if seq not in seqs:
                seqs.append(seq)
            # whole once any segment holds its last sample; else cut at the most its segments hold
            versions[version] = (seqs, None if cut is None or known is None else max(cut, known))

    def _adopt_listed(self, oid: int) -> None:
        """Hold the recovered segments of the listed version of ``oid``; those of its other versions stay adopted
        until a later page lists their version, or the first listing of the remote ends (then they are stale)."""
        path = self.table.path(oid)
        versions = self._adopted.get(path)
        if versions is None:
            return
        seqs, cut = versions.pop(self._etag(oid), ([], None))
        if not versions:
            del self._adopted[path]
        for seq in seqs:
            self._hold([oid], seq)
        if seqs and cut is not None:
            self._cut[oid] = cut

    def _retire_unlisted(self) -> None:
        """A complete listing of the remote ended: the segments holding samples of objects it did not show, and the
        recovered segments of versions it did not show, are stale ("Retired samples")."""
        self._stale.update(seq for versions in self._adopted.values() for seqs, _ in versions.values() for seq in seqs)
        seen, complete = self._seen.data, self._complete
        for seq, held in self._objects_in.items():
            if any(bool((seen[part] < complete).any()) for part in held):
                self._stale.add(seq)

    def take_stale(self) -> set[int]:
        """The segments found stale since the last call ("Retired samples")."""
        stale, self._stale = self._stale, set()
        self._retiring |= {seq for seq in stale if seq in self._objects_in}
        return stale

    def evicted(self, seqs: Iterable[int]) -> None:
        """Segments left the cache: their objects may be drawn again."""
        gone = set(seqs)
        if self._adopted:
            self._adopted = {path: entry for path, entry in self._adopted.items() if self._still_cached(entry, gone)}
        for seq in gone:
            held = self._objects_in.pop(seq, None)
            if not held:
                continue
            oids = np.concatenate(held)
            live = self._live.data[oids].astype(np.int64) - 1
            self._live.put(oids, np.maximum(live, 0))
            whole = oids[live <= 0]
            if len(whole):
                self._is_changed = True
                if self._cut:
                    for oid in whole.tolist():
                        self._cut.pop(oid, None)  # none of its samples is cached: fetched whole
                if seq in self._retiring:  # "Retired samples": the others, listed, are drawn again in this pass
                    again = [oid for oid in whole.tolist() if self._is_listed(oid) and oid not in self._in_flight]
                    if again:
                        self._queue.append(np.array(again, dtype=np.uint32))
                        self._note_again(again)
        self._retiring -= gone

    @staticmethod
    def _still_cached(versions: dict[str | None, tuple[list[int], int | None]], gone: set[int]) -> bool:
        """Drop the evicted segments from an adopted path's entry; whether any remain."""
        for version in list(versions):
            seqs, cut = versions[version]
            kept = [seq for seq in seqs if seq not in gone]
            if kept:
                versions[version] = (kept, cut)
            else:
                del versions[version]
        return bool(versions)

    def cached_segments(self) -> set[int]:
        """The segments the plan believes hold samples of some object."""
        adopted = {seq for versions in self._adopted.values() for seqs, _ in versions.values() for seq in seqs}
        return set(self._objects_in) | adopted

    @property
    def cached_objects(self) -> int:
        """Owned listed objects every sample of which (of the listed version) is in a published segment: ``owned``
        of them means the source is cached whole (status: a share below its weight that ingest cannot raise). A
        scan of the plan's columns, so counted again only once ``_CACHED_COST_FACTOR`` times its last duration has
        passed (milliseconds for a million objects: every status write; 10⁸: about once a minute)."""
        now = time.monotonic()
        counted_at, value, took = self._cached_count
        if now - counted_at < _CACHED_COST_FACTOR * took:
            return value
        live = self._live.view
        listed = self.listed()[: len(live)]
        whole = listed & (live[: len(listed)] > 0)
        cut = sum(1 for oid in self._cut if oid < len(whole) and whole[oid])
        value = int(np.count_nonzero(whole)) - cut
        self._cached_count = (now, value, time.monotonic() - now)
        return value

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def dropped(self) -> int:
        return len(self._dropped)

    @property
    def not_cached(self) -> dict[str, int]:
        """Objects listed now that are not cached for a reason (dropped or quarantined), by reason."""
        counts: dict[str, int] = {}
        for oid in (*self._dropped, *self._quarantined):
            if not self._is_listed(oid):  # vanished from the listing since: not a reason anything listed is missing
                continue
            reason = self._reason.get(oid, "other")
            counts[reason] = counts.get(reason, 0) + 1
        return counts
