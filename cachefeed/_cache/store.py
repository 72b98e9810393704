"""The writer side of one cache directory: exclusivity, recovery, the byte budget, publication and eviction.

Exactly one ``CacheStore`` exists per cache directory, in the daemon's supervisor (or in a test or benchmark
process). It owns every decision that changes what is published; segment *bytes* may be written by other processes
(the samplers) into ``tmp/`` under a ``Grant`` it handed out.

The budget (what ``tests/cache/test_bound.py`` checks by sampling the directory's real size with thousands of
segments and two live snapshots)::

    published + pinned_only + reserved + metadata + records + next_snapshot <= max_bytes - METADATA_RESERVE_BYTES

* ``published``: allocated bytes of ``segments/*.seg``;
* ``pinned_only``: segments already evicted from ``segments/`` but still linked by a live snapshot;
* ``reserved``: the sum of outstanding grants; a grant is page-rounded and the writer never lets its file grow
  past it, so ``tmp/`` never holds more than ``reserved``;
* ``metadata``: the allocated bytes of everything else (directories and their blocks, snapshot links'
  directories, MANIFESTs, locks, marks, receipts, the read ledger, status.json), measured at every pin scan
  (``layout.metadata_bytes``; twice a second and before any grant that would not fit);
* ``records``: the records of what they served (NOTE [ Read receipts ]) that live snapshots' ranks have yet to
  write: per snapshot, ``max(ranks, 1)`` (its MANIFEST's; 0, not said, counts as one rank) less the records in its
  directory, times ``served_record_bytes(its samples)`` (``reads.py``, the one owner of the rule: a bitmap over the
  whole snapshot, rounded up to the filesystem's block). Counted at every pin scan from the names in each
  snapshot's directory, no file read; the records present are in ``metadata``. A job's ranks end an epoch within
  the same moment, so their records land between two scans: 8 local ranks over a million samples write 1 MiB at
  once, which the reserve alone held only by chance. A rank that records twice (its epoch served more after its
  first record) before the others wrote theirs takes one record's bytes from the reserve until the next scan;
* ``next_snapshot = SNAPSHOT_FIXED_BYTES + SNAPSHOT_ENTRY_BYTES x published segments + published samples / 8 +
  R x served_record_bytes(published samples)``: the room one more snapshot takes (32 KiB + 128 B per segment, its
  MANIFEST's reads bitmap, the records of its ``R`` ranks), charged before a trainer creates it, so pinning the
  next epoch between two scans (the handover) cannot push the directory over. Its records are charged here, and
  not only from the first scan after it is made (``records``), because a cache that cannot evict by then (paced:
  nothing unpinned has been read enough, as through the epoch after a warm-up) could make no room for them before
  they land (until the epoch ends, only its release makes segments evictable), and a record written before that
  scan would fall in the reserve. The daemon cannot know how many ranks will split a snapshot not made yet; a
  job's next epoch is split as its last, so ``R`` is the most local ranks any snapshot this store has seen was
  split among (remembered since the start), and at least ``ASSUMED_LOCAL_RANKS`` (8, a node of 8 accelerators),
  so that a job's first epoch after the daemon starts is covered too. At 8 ranks that is one byte per published
  sample, nothing beside samples of a few KiB;
* ``METADATA_RESERVE_BYTES`` (1 MiB) covers what changes between two scans: status.json and ledger rewrites,
  a receipt, ``segments/`` growing by a block.

Hence the bound users can rely on: **the real size of the cache directory never exceeds ``max_bytes``**, as long as
trainers create at most one snapshot between two of the daemon's scans (a job's handover does). Snapshots beyond
that (several jobs on one node pinning within the same half second, or while writers already wait) each add their
metadata (32 KiB + 128 B per segment at most) on top of what was charged, inside the 1 MiB reserve: a few such
snapshots of a few thousand segments fit it; ``tests/cache/test_model.py`` pins at random and checks the real
size at every step. One more case leans on the reserve: a snapshot split among more ranks than ``R`` (more than
8, in a job's first epoch after the daemon starts) has its other ranks' records charged from the first scan only.
A cache that may evict makes room for them at once; one that may evict nothing (paced, nothing read: a job's first
epoch on a warmed cache) carries ``(ranks - R) x samples / 8`` bytes in the reserve until the epoch's release turns
the records into its receipt, and over a large snapshot that can outgrow the reserve (``tests/cache/test_bound.py``
covers the cases charged).
With small segments the metadata is a visible share of the budget (4 KiB segments: about 3% per live snapshot);
with the default 64 MiB segments it is negligible.

Epoch reads (the contract with trainers: reads, not time). Every epoch leaves a receipt of the samples it served
(NOTE [ Read receipts ] in ``reads.py``, which defines every term used here); each pin scan (at least once a
second, and before every decision that needs it) credits one read to each sample a receipt names and persists the
counts. A segment becomes *evictable* once every sample in it has been served by ``evict_after_reads`` epochs (0:
at once, the old free-running behaviour). Every rule
below evicts evictable segments only: when the published set must shrink and none may go, ingest waits for the
trainers to read (*paced*), which is the normal state of a daemon whose trainers are slower than its remote, and
a daemon without trainers fills its budget and then fetches nothing. When a segment is evicted its reads are
settled into ``Counters`` (sample-reads, and samples evicted unread: 0 at ``evict_after_reads >= 1``).

Two rules keep the cache turning over while trainers pin it:

* (A) hard: a grant is given only if the budget above still holds after it, and the filesystem keeps
  ``min_free_bytes`` free (for that floor alone the store evicts *unpinned*, evictable segments: evicting a pinned
  one frees nothing). Otherwise ``reserve`` returns None and the writer waits: back-pressure, never overshoot.
* (B) room for fresh samples: a snapshot pins at most the *epoch room*, ``max_bytes - turnover_bytes -
  METADATA_RESERVE_BYTES`` of segments, least-read first (``room.py``, written to ``budget.json`` at start), so
  the published set is never capped below the budget: while an epoch reads its snapshot, at least
  ``turnover_bytes`` of the budget holds samples it does not pin. Room for a grant is made by evicting evictable,
  *unpinned* segments (policy order, see "Weighted sources"); when none may go, ``reserve`` returns None: *paced*
  if what fills the cache still waits for reads (the normal state when the remote is faster than training: the
  next epoch reads the fresh samples, and its release lets the last one's go), *back-pressure* if snapshots pin
  everything that could go. A segment larger than the epoch room is refused (no snapshot could pin it).

Weighted sources (``source_weights``, from the daemon's ``[[source]]`` tables; segments carry a source tag): among
the evictable segments, a victim is taken from the source furthest *above* its share of the published samples, and
only then by the policy's order within that source. A source below its share (one smaller than its share of the
budget, or one that fell behind) keeps what it has even when it alone has evictable segments: ingest is then
paced until trainers read the others. Only the free-space floor of rule (A), a filesystem running out, takes
from such a source. With one source this changes nothing.

Why one long module: the budget is one concept. Every rule above (the hard bound, the room, read-gated eviction,
weighted sources, recovery) decides on the same counts, owned by one object on one thread; split, each
part would need the others' internals.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cachefeed._cache.eviction import EvictionPolicy, make_policy
from cachefeed._cache.grant import Grant
from cachefeed._cache.layout import (
    SEGMENT_NAME,
    SNAPSHOT_ENTRY_BYTES,
    SNAPSHOT_FIXED_BYTES,
    CacheLayout,
    allocated_bytes,
    metadata_bytes,
    read_holder,
    segment_name,
    segment_seq,
    write_holder,
)
from cachefeed._cache.reads import ReadLedger, SampleReads, served_record_bytes
from cachefeed._cache.records import SegmentReader, Source
from cachefeed._cache.room import epoch_room, read_room, write_room
from cachefeed._cache.settings import METADATA_RESERVE_BYTES, CacheConfig
from cachefeed._cache.snapshots import SnapshotInfo, live_snapshots, pinned_inodes, sweep_stale, was_started
from cachefeed._errors import CacheLockedError, CorruptRecordError, NoSuchCacheError
from cachefeed._fsutil import file_version, fsync_dir, remove_tree
from cachefeed._logs import get_logger
from cachefeed._procs import GONE, process_state
from cachefeed._units import format_bytes

__all__ = ["METADATA_RESERVE_BYTES", "CacheStore", "PublishedSegment", "Usage"]

log = get_logger(__name__)

PAGE_BYTES = 4096
_PIN_RESCAN_S = 0.5
_SWEEP_INTERVAL_S = 1.0
ECHO_WINDOW = 64  # evicted segments the echo factor is measured over
TOPPED_UP_SHARE = 0.25  # ingest is remote-bound when more than this share of the newest snapshot was read already
ASSUMED_LOCAL_RANKS = 8  # the records a snapshot not made yet is charged for, at least (see the budget above)
_HOLDER_WAIT_S = 1.0  # how long a refused daemon waits for the lock's holder to have written itself
_LOCK_WAIT_S = 5.0  # how long a starting daemon waits for readers, or a gone daemon's samplers, to let go of the lock
# After a write the filesystem refused for lack of space, grants wait this long, doubling with each further refusal
# until a segment is published, up to the most (``refused_write``).
_REFUSED_HOLD_S = 1.0
_REFUSED_HOLD_MAX_S = 60.0


def _lock_holder(fd: int) -> str:
    """Who holds the cache's lock, from the lock file: the holder writes itself there just after taking the lock,
    so a daemon that lost a race by microseconds may read it half written; it reads again for up to a second."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        who = read_holder(fd)
        if who is not None:
            return f"pid {who.pid} on host {who.host} (since {who.since})"
        if time.monotonic() > deadline:
            return "another process"
        time.sleep(0.01)


def _wait_for_lock(fd: int, path: Path) -> str | None:
    """Take the cache's lock (``fd``, open on ``path``) where nothing that keeps it holds it: None once taken, else
    why not and what to do (the refusal's words, after "cache dir X ").

    Two holders let go soon, and a starting daemon waits up to ``_LOCK_WAIT_S`` for them:

    * Readers, which hold the lock *shared*: ``CacheLayout.has_writer`` takes it so for a moment to learn whether a
      daemon runs (trainers' growers every few tens of milliseconds, snapshot removals, status). A daemon starting
      in that moment found the lock held and refused to start. A daemon and its samplers hold it exclusively, so a
      shared lock is only ever readers' (or another daemon's, during this same probe).
    * The samplers of a daemon that is gone: they inherit its lock (``CacheStore.lock_fd``) and follow it out
      (PR_SET_PDEATHSIG), but one forked a moment before may take a little longer; a daemon restarted at once
      (systemd's ``Restart=``) found the lock held for a process that no longer exists. Waited for where the lock
      file names a process of this host that has exited.

    A lock held exclusively for a live process, or for one of another host, is not waited for: that daemon runs.
    Each pass starts unlocked: the shared probe is let go at once."""
    deadline = time.monotonic() + _LOCK_WAIT_S
    said = ""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # granted: nobody holds it exclusively, only readers
            fcntl.flock(fd, fcntl.LOCK_UN)
            why = "processes asking whether a daemon runs (a shared lock)"
        except BlockingIOError:
            gone = _gone_holder(fd)
            if gone is None:
                return f"is in use by {_lock_holder(fd)}: stop that daemon first, or give this one another cache.dir"
            why = f"the samplers of pid {gone}, which has exited"
        if why != said:
            log.info("the cache's lock is held by %s: waiting up to %gs for them to let go", why, _LOCK_WAIT_S)
            said = why
        if time.monotonic() > deadline:
            return (
                f"is locked by {why}, for over {_LOCK_WAIT_S:g}s: `fuser -v {path}` names them (a stopped process holds"
                " it until it runs on or is killed); then start again"
            )
        time.sleep(0.01)


def _gone_holder(fd: int) -> int | None:
    """The pid the lock file names if it is a process of this host that has exited (or a zombie); else None."""
    who = read_holder(fd)
    if who is None or who.host != socket.gethostname() or who.pid <= 0 or process_state(who.pid) not in GONE:
        return None
    return who.pid


def _round_up(n: int, unit: int = PAGE_BYTES) -> int:
    return -(-n // unit) * unit


@dataclass(frozen=True, slots=True)
class PublishedSegment:
    seq: int
    name: str
    nbytes: int
    samples: int
    inode: int
    published_at: float
    source: int = 0  # the segment's source tag (its trailer; see records.py): which [[source]] it came from


@dataclass(frozen=True, slots=True)
class Usage:
    """A consistent picture of the budget at one instant. All sizes are allocated bytes."""

    bytes: int
    max_bytes: int
    published_bytes: int
    pinned_only_bytes: int
    pinned_bytes: int
    reserved_bytes: int
    samples: int
    segments: int
    snapshots: int
    free_bytes: int
    min_free_bytes: int
    is_backpressured: bool
    unread_samples: int = 0  # published samples no epoch has read yet
    is_paced: bool = False  # ingest waits for trainers to read (see "Epoch reads"): the normal state, not a fault
    is_out_of_space: bool = False  # ingest waits for free space on the cache's filesystem (a fault: status says)
    waiting_for_reads_samples: int = 0  # while paced: published samples read fewer than evict_after_reads times
    max_reads: int = 0  # the most reads of any published segment (a segment's reads: its least-read sample's)
    sample_reads: int = 0  # sum over published samples of the epochs that served them
    oldest_published_at: float | None = None  # unix time of the oldest published segment (None: empty cache)
    newest_published_at: float | None = None
    fill: float = 0.0  # published bytes / what the daemon fills to without readers (max_bytes less metadata)
    echo_factor: float | None = None  # reads per sample of the samples of the last ECHO_WINDOW evicted segments
    ingest_bound: str | None = None  # "remote", "trainer" or None: see ``CacheStore.ingest_bound``


@dataclass(slots=True)
class Counters:
    published_segments: int = 0
    published_samples: int = 0
    published_bytes: int = 0
    evicted_segments: int = 0
    evicted_samples: int = 0
    evicted_bytes: int = 0
    dropped_corrupt: int = 0
    removed_foreign: int = 0
    removed_temp: int = 0
    stale_snapshots: int = 0
    backpressure_events: int = 0
    first_eviction_at: float = 0.0
    evicted_published_at: list[float] = field(default_factory=list)
    evicted_unread_samples: int = 0  # evicted before any epoch served them
    evicted_sample_reads: int = 0  # sum over evicted samples of the epochs that served them
    evicted_max_reads: int = 0  # the most reads of an evicted segment (its least-read sample's)
    epochs_seen: int = 0  # read receipts applied (every epoch read, since the ledger began)
    recent_evicted: list[tuple[int, int]] = field(default_factory=list)  # (samples, their reads), last ECHO_WINDOW
    # ``retire``: evicted because the remote no longer lists what they hold (not in the evicted_* counts above)
    retired_segments: int = 0
    retired_samples: int = 0
    retired_bytes: int = 0


class CacheStore:
    """The single writer of a cache directory (see the module docstring for the budget it keeps).

    Not thread-safe: the daemon calls it from its main loop only.
    """

    def __init__(self, config: CacheConfig, *, policy: EvictionPolicy | None = None) -> None:
        self.config = config
        self.layout = CacheLayout(config.dir)
        self.layout.create(dir_mode=config.dir_mode, file_mode=config.file_mode)
        self.policy = policy or make_policy(config.eviction)
        self.limit_bytes = config.max_bytes - METADATA_RESERVE_BYTES
        self.counters = Counters()
        self._published: dict[int, PublishedSegment] = {}
        self._published_bytes = 0  # sum of their nbytes, kept as they come and go (the budget is checked per grant)
        # seq -> (path, version) of the remote objects each recovered segment ends; the daemon's plan takes it
        self.recovered_sources: dict[int, list[Source]] = {}
        self.evicted_unread_at_start: dict[int, list[Source]] = {}  # tag -> sources (``shrink_to_budget``)
        self._grants: dict[int, Grant] = {}
        self._pinned_only: dict[int, int] = {}
        self._pinned_published: set[int] = set()
        self._reads: dict[int, SampleReads] = {}  # seq -> its samples' reads (absent: none; see "Epoch reads")
        self._levels: dict[int, int] = {}  # seq -> the segment's reads (its least-read sample's), where > 0
        self._evicted_pinned: dict[str, tuple[int, SampleReads]] = {}  # name -> (inode, reads), evicted but pinned
        self.source_weights: dict[int, float] = {}  # source tag -> share (see "Weighted sources"); {}: unweighted
        self._samples_by_tag: dict[int, int] = {}  # published samples per source tag, kept as segments come and go
        self._ledger = ReadLedger(self.layout.root, self.layout.snapshots, file_mode=config.file_mode)
        self._said_paced = False  # "fetching waits for reads" logged at info already (then at debug)
        self._live_ids: list[str] = []  # the live snapshots at the last pin scan
        self._metadata_bytes = 0  # measured at the last pin scan (see the budget above)
        self._records_bytes = 0  # served records live snapshots' ranks have yet to write, at the last pin scan
        self._ranks_seen = ASSUMED_LOCAL_RANKS  # the most local ranks a snapshot was split among, this one at least
        self._block_bytes = max(1, os.statvfs(self.layout.root).f_frsize)  # the filesystem's allocation unit
        self._free_since: dict[str, float] = {}  # snap_id -> when a sweep first found nobody holding it
        self._free_seen_now: set[str] = set()
        self._pins_scanned_at = 0.0
        self._swept_at = 0.0
        self._next_seq = 0
        self._is_backpressured = False
        self._is_paced = False
        self._is_out_of_space = False
        self._is_refused = False  # a writer's write was refused for lack of space, and there is no room yet
        self._refusals = 0  # refusals since the last segment published (``refused_write``)
        self._refused_until = 0.0  # grants wait until then (monotonic)
        self._newest_pin: tuple[float, int, int] | None = None  # (created, samples, fresh) of the newest snapshot
        self.write_problems: dict[str, str] = {}  # what could not be written to the cache, and why (status says)
        self._room_written = False
        self._room_identity: tuple[int, int, int] | None = None  # budget.json as this store last wrote it
        self._lock_fd = self._take_lock()
        try:
            self._warn_if_room_lost()
            self._recover()  # its pin scan writes budget.json
            if not self._room_written:
                self._write_room()
        except BaseException:
            self.close()
            raise

    # -- exclusivity ----------------------------------------------------------------------------------------

    def _take_lock(self) -> int:
        path = self.layout.lock_file
        try:
            fd = os.open(
                path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, self.config.file_mode
            )
        except OSError as exc:
            raise NoSuchCacheError(f"{path}: cannot open the cache's lock file ({exc.strerror}): remove it") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NoSuchCacheError(f"{path} is not a regular file (a FIFO or device was planted there): remove it")
        refused = _wait_for_lock(fd, path)
        if refused is not None:
            os.close(fd)
            raise CacheLockedError(f"cache dir {self.layout.root} {refused}")
        write_holder(fd)
        return fd

    @property
    def lock_fd(self) -> int:
        """The writer lock's descriptor. Children that inherit it keep the cache locked until they exit too."""
        return self._lock_fd

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- recovery -------------------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Bring the directory to a consistent state after any crash. Cost: one small read per segment."""
        started = time.monotonic()
        for entry in os.scandir(self.layout.tmp):
            remove_tree(entry.path)
            self.counters.removed_temp += 1
        for entry in os.scandir(self.layout.root):  # an ``atomic_write`` (ledger, catalog, status) killed midway
            if entry.name.startswith(".") and entry.name.endswith(".partial") and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                self.counters.removed_temp += 1
        self.counters.stale_snapshots += len(sweep_stale(self.layout, keep=self._keep_for_resume))
        highest = -1
        for entry in os.scandir(self.layout.segments):
            path = Path(entry.path)
            if not SEGMENT_NAME.match(entry.name) or not entry.is_file(follow_symlinks=False):
                log.warning("removing foreign entry %s from the cache", path)
                remove_tree(path)
                self.counters.removed_foreign += 1
                continue
            try:
                with SegmentReader(path) as reader:
                    count = reader.count
                    sources = reader.sources()
                    tag = reader.source
            except CorruptRecordError as exc:
                log.warning("dropping invalid segment at recovery: %s", exc)
                path.unlink()
                self.counters.dropped_corrupt += 1
                continue
            info = os.lstat(path)
            seq = segment_seq(entry.name)
            if sources:
                self.recovered_sources[seq] = sources
            self._add_published(
                PublishedSegment(seq, entry.name, allocated_bytes(info), count, info.st_ino, info.st_mtime, tag)
            )
            highest = max(highest, seq)
        for name in self._snapshot_segment_names():
            highest = max(highest, segment_seq(name))
        self._next_seq = highest + 1
        by_name = {segment.name: seq for seq, segment in self._published.items()}
        for name, counts in self._ledger.load().items():
            known = by_name.get(name)
            if known is not None and len(counts) == self._published[known].samples:
                self._set_reads(known, SampleReads(counts))
        self.counters.epochs_seen = self._ledger.epochs_total
        self._rescan_pins()
        log.info(
            "cache %s recovered in %.3fs: %d segments, %d samples, %d temp files removed, %d stale snapshots",
            self.layout.root,
            time.monotonic() - started,
            len(self._published),
            sum(s.samples for s in self._published.values()),
            self.counters.removed_temp,
            self.counters.stale_snapshots,
        )
        self._warn_if_the_filesystem_is_smaller()

    def _warn_if_the_filesystem_is_smaller(self) -> None:
        """Say so at the start where ``max_bytes`` is more than the filesystem can give the cache (its free space
        and what the cache holds, less ``min_free_bytes``): the free-space floor then stops the cache first, with
        less turnover room than ``max_bytes`` was sized for (``room.py`` computes it from ``max_bytes``)."""
        free = self._free_bytes()
        can_hold = free + self._used() - self.config.min_free_bytes
        if can_hold <= 0 and self.config.min_free_bytes > 0:  # no max_bytes can help: the floor is above the room
            log.warning(
                "cache.min_free_bytes = %s is more than the filesystem of %s has free (%s): the cache can hold "
                "nothing; lower cache.min_free_bytes (the space it keeps free for others) below %s, or free space "
                "there",
                format_bytes(self.config.min_free_bytes),
                self.layout.root,
                format_bytes(free),
                format_bytes(free + self._used()),
            )
        elif self.config.max_bytes > can_hold:
            log.warning(
                "cache.max_bytes = %s is more than the filesystem of %s can give the cache (%s free, %s cached, "
                "min_free_bytes %s): the cache will stop at the free-space floor with less turnover room than "
                "max_bytes is sized for; set cache.max_bytes to at most %s (or free space there)",
                format_bytes(self.config.max_bytes),
                self.layout.root,
                format_bytes(free),
                format_bytes(self._used()),
                format_bytes(self.config.min_free_bytes),
                format_bytes(max(0, can_hold)),
            )

    def _snapshot_segment_names(self) -> set[str]:
        names: set[str] = set()
        for directory in self.layout.snapshots.iterdir():
            if directory.is_dir() and not directory.is_symlink():
                try:
                    names.update(n for n in os.listdir(directory) if SEGMENT_NAME.match(n))
                except FileNotFoundError:
                    continue  # a trainer released it while we listed
        return names

    # -- pins -----------------------------------------------------------------------------------------------

    def _rescan_pins(self) -> None:
        """Recompute which bytes snapshots hold. Authoritative at the instant of the scan (see snapshots NOTE)."""
        found = pinned_inodes(self.layout)
        by_inode = {segment.inode: seq for seq, segment in self._published.items()}
        self._pinned_published = {by_inode[ino] for ino in found if ino in by_inode}
        self._pinned_only = {ino: size for ino, size in found.items() if ino not in by_inode}
        live = live_snapshots(self.layout, count_records=True)
        self._live_ids = [info.snap_id for info in live]
        self._records_bytes = sum(self._records_to_come(info) for info in live)
        self._ranks_seen = max([self._ranks_seen, *(info.ranks for info in live)])
        for info in live:
            if (  # judged once a snapshot is closed: a growing one may still be topped up with read samples
                info.fresh is not None
                and info.samples
                and not info.is_open
                and (self._newest_pin is None or info.created > self._newest_pin[0])
            ):
                self._newest_pin = (info.created, info.samples, info.fresh)
        self._collect_receipts()
        # A segment evicted while pinned may still be served by the epoch pinning it; once no snapshot holds it
        # (its receipt, written before its snapshot went, was collected just above), its reads are final.
        self._evicted_pinned = {n: e for n, e in self._evicted_pinned.items() if e[0] in self._pinned_only}
        self._metadata_bytes = metadata_bytes(self.layout)
        self._pins_scanned_at = time.monotonic()

    def _records_to_come(self, info: SnapshotInfo) -> int:
        """The bytes of the served records live snapshot ``info``'s ranks have yet to write (``records`` in the
        budget above): one per rank (at least one) less those in its directory, which are measured already."""
        missing = max(info.ranks, 1) - info.served_records
        return max(0, missing) * served_record_bytes(info.samples, self._block_bytes)

    def _write_room(self) -> None:
        """``budget.json`` for trainers (``room.py``); where the filesystem refuses (full, say), a warning, status
        says so, and the next pin scan tries again (trainers meanwhile read the file a previous start wrote, or
        pin without a room)."""
        try:
            write_room(self.layout.root, self.config.max_bytes, self.config.turnover_bytes, mode=self.config.file_mode)
        except OSError as exc:
            self._room_written = False
            self._cannot_write("budget.json", exc, "trainers size their epochs without it")
            return
        self._room_written = True
        self._room_identity = file_version(self.layout.budget_file)
        self.write_problems.pop("budget.json", None)

    def _keep_room(self) -> None:
        """At each sweep: ``budget.json`` changed since this store wrote it (damaged, removed or replaced behind the
        daemon's back) is written again, with a warning where trainers could not read it (``_warn_if_room_lost``)."""
        if not self._room_written or file_version(self.layout.budget_file) == self._room_identity:
            return
        self._warn_if_room_lost()
        self._write_room()

    def _warn_if_room_lost(self) -> None:
        """Warn where trainers cannot read ``budget.json`` (at start, and when ``_keep_room`` finds it changed): a
        damaged file, or one gone after this store wrote it. Why it matters: a trainer without the room pins every
        segment (``room.read_room``), which leaves fresh samples no turnover room (rule B), so ingest stalls behind
        the epoch's pins. The file is the config's (``max_bytes``, ``turnover``): writing it again loses nothing. A
        readable file of other values is a previous config's (written again at start), not a fault; no file at
        start is a new cache's."""
        path = self.layout.budget_file
        if read_room(self.layout.root) is not None:
            return
        if not os.path.lexists(path) and self._room_identity is None:
            return
        log.warning(
            "%s is %s: trainers would pin every cached segment, leaving fresh samples no turnover room; it is "
            "written again from the config (cache.max_bytes, cache.turnover)",
            path,
            "damaged" if os.path.lexists(path) else "gone",
        )

    def _cannot_write(self, what: str, exc: OSError, meanwhile: str) -> None:
        """Record that ``what`` could not be written (logged once per reason: a full disk is met at every scan)."""
        problem = f"cannot write {what} in {self.layout.root}: {exc.strerror or exc}; {meanwhile} (retried)"
        if self.write_problems.get(what) != problem:
            log.warning("%s", problem)
        self.write_problems[what] = problem

    def _collect_receipts(self) -> None:
        """Credit the epochs trainers have read since the last scan, and persist the counts (NOTE in reads.py)."""
        if not self._room_written:
            self._write_room()
        receipts = self._ledger.pending()
        if not receipts and not self._ledger.has_unsaved:
            return
        for receipt in receipts:
            for name, count, served in receipt.segments:
                seq = segment_seq(name) if SEGMENT_NAME.match(name) else -1
                segment = self._published.get(seq)
                if segment is not None and segment.name == name and segment.samples == count:
                    self._set_reads(seq, self._sample_reads(seq).served(served))
                elif name in self._evicted_pinned:
                    self._settle_late(name, served)
        try:
            self._ledger.commit(
                receipts, {self._published[seq].name: reads.counts for seq, reads in self._reads.items()}
            )
        except OSError as exc:  # the reads are credited here already; their receipts wait for the next commit
            self._cannot_write("the read ledger", exc, "what epochs read counts in memory and is kept in receipts")
        else:
            self.write_problems.pop("the read ledger", None)
        self.counters.epochs_seen = self._ledger.epochs_total

    def _settle_late(self, name: str, served: bytes) -> None:
        """Reads of a segment evicted while an epoch still pinned it (possible at ``evict_after_reads = 0``, or by
        the free-space floor): the counters settled at its eviction take them in, so "evicted unread" counts only
        samples no epoch ever served."""
        inode, before = self._evicted_pinned[name]
        after = before.served(served)
        self._evicted_pinned[name] = (inode, after)
        counters = self.counters
        counters.evicted_sample_reads += after.total - before.total
        counters.evicted_unread_samples -= before.unread - after.unread
        counters.evicted_max_reads = max(counters.evicted_max_reads, after.level)

    def _samples_below(self, k: int) -> int:
        """Published samples served fewer than ``k`` times (a segment without reads: all of its samples)."""
        reads = self._reads
        return sum(reads[seq].below(k) if seq in reads else s.samples for seq, s in self._published.items() if k)

    def _sample_reads(self, seq: int) -> SampleReads:
        return self._reads.get(seq) or SampleReads.none(self._published[seq].samples)

    def _set_reads(self, seq: int, reads: SampleReads) -> None:
        self._reads[seq] = reads
        if reads.level:
            self._levels[seq] = reads.level
        else:
            self._levels.pop(seq, None)

    def _is_evictable(self, seq: int) -> bool:
        return self._levels.get(seq, 0) >= self.config.evict_after_reads

    def _evictable(self, *, unpinned: bool = False) -> list[int]:
        """Published segments the read contract lets go (oldest first), optionally only those no snapshot pins.

        O(segments) per call (a caller evicting several computes it once): cheap enough per grant with thousands.
        """
        order = sorted(self._published)  # nearly sorted already: publication follows grant order
        reads, enough = self._levels, self.config.evict_after_reads
        if enough:
            order = [seq for seq in order if reads.get(seq, 0) >= enough]
        if unpinned:
            pinned = self._pinned_published
            order = [seq for seq in order if seq not in pinned]
        return order

    def _maybe_rescan_pins(self, *, force: bool = False) -> None:
        if force or time.monotonic() - self._pins_scanned_at > _PIN_RESCAN_S:
            self._rescan_pins()

    def _keep_for_resume(self, snap_id: str) -> bool:
        """Keep a snapshot nobody holds for ``snapshot_grace_s`` after the sweep first found it so (its trainer
        died; a restarted job may resume the epoch on it, see ``EpochLoaderFactory.load_state_dict``); one whose
        epoch no loop began (prepared ahead), not at all: no checkpoint names it (snapshots.py, "Begun epochs")."""
        if not was_started(self.layout, snap_id):
            return False
        now = time.monotonic()
        first = self._free_since.setdefault(snap_id, now)
        self._free_seen_now.add(snap_id)
        return now - first < self.config.snapshot_grace_s

    @property
    def orphaned_snapshots(self) -> list[str]:
        """Snapshots kept for resume whose trainers are gone (they still count against the budget)."""
        return sorted(self._free_since)

    def collect_reads(self) -> None:
        """Apply the trainers' read receipts now (``enforce`` and ``reserve`` do it at least twice a second)."""
        self._rescan_pins()

    def sweep(self) -> list[str]:
        """Remove snapshots whose holders died, and write ``budget.json`` again if it changed behind the store's back
        (``_keep_room``); at most once a second. Returns removed ids."""
        if time.monotonic() - self._swept_at < _SWEEP_INTERVAL_S:
            return []
        self._swept_at = time.monotonic()
        self._keep_room()
        seen_free = set(self._free_since)
        self._free_seen_now = set()
        removed = sweep_stale(self.layout, keep=self._keep_for_resume)
        for snap_id in seen_free - self._free_seen_now:  # held again (a job resumed it) or gone: forget
            self._free_since.pop(snap_id, None)
        if removed:
            self.counters.stale_snapshots += len(removed)
            log.info("released %d stale snapshots: %s", len(removed), ", ".join(removed))
            self._rescan_pins()
        return removed

    # -- the budget -----------------------------------------------------------------------------------------

    @property
    def published_bytes(self) -> int:
        return self._published_bytes

    @property
    def is_paced(self) -> bool:
        """The last grant waited for trainers to read (``evict_after_reads``): the normal state of a full cache."""
        return self._is_paced

    @property
    def is_backpressured(self) -> bool:
        """The last grant waited for pinned segments to be released."""
        return self._is_backpressured

    @property
    def is_out_of_space(self) -> bool:
        """The last grant waited for free space on the cache's filesystem: it is at ``min_free_bytes`` (or full)
        and the cache holds nothing it may evict to make room (what it holds is pinned, or it holds nothing); or
        a writer's write was refused for lack of space since the filesystem last had room (``refused_write``)."""
        return self._is_out_of_space or self._is_refused

    def refused_write(self, reason: str) -> None:
        """A writer's write into its grant was refused for lack of space (ENOSPC or EDQUOT: ``reason``): the
        filesystem filled after the grant, with files that are not the cache's. Its segment is gone (aborted, its
        objects fetched again). Like a grant that finds no room: ``is_out_of_space`` (status says the filesystem
        is full) until the filesystem has room for a segment above ``min_free_bytes`` (``enforce``), whatever
        else ingest waits for (a paced cache too: the free-space check comes after the budget's). Grants wait
        meanwhile, for a hold that doubles with each refusal until a segment is published: where the filesystem
        shows room but refuses writes (a quota, no inodes left), the objects of a refused segment are fetched
        again at that pace rather than in a loop."""
        if not self.is_out_of_space:
            log.warning("%s (a write was refused: %s)", self.out_of_space_reason(), reason)
        hold = min(_REFUSED_HOLD_MAX_S, _REFUSED_HOLD_S * 2**self._refusals)
        self._is_refused = True
        self._refusals += 1
        self._refused_until = time.monotonic() + hold

    def _recheck_refused(self) -> None:
        """A refused write's ``is_out_of_space`` ends once its hold is over and the filesystem has room for a
        segment above ``min_free_bytes`` (outstanding grants counted as unwritten, as for a grant) and an inode
        for its file."""
        if not self._is_refused or time.monotonic() < self._refused_until:
            return
        if self._has_free_space(self.config.segment_bytes) and not self._is_out_of_inodes():
            self._is_refused = False
            log.info(
                "the cache's filesystem has room again (%s free): fetching resumes", format_bytes(self._free_bytes())
            )

    @property
    def reserved_bytes(self) -> int:
        return sum(grant.nbytes for grant in self._grants.values())

    @property
    def metadata_bytes(self) -> int:
        """What the budget charges for everything but segment data: measured, plus the records live snapshots' ranks
        have yet to write, plus the next snapshot's room (``records`` and ``next_snapshot`` in the budget above)."""
        samples = self.samples
        records = self._ranks_seen * served_record_bytes(samples, self._block_bytes)
        room = SNAPSHOT_FIXED_BYTES + SNAPSHOT_ENTRY_BYTES * len(self._published) + (samples + 7) // 8 + records
        return self._metadata_bytes + self._records_bytes + room

    def _data_bytes(self) -> int:
        return self.published_bytes + sum(self._pinned_only.values()) + self.reserved_bytes

    def _used(self) -> int:
        """What the cache directory holds by the store's accounting (measured metadata, no room charged ahead)."""
        return self._data_bytes() + self._metadata_bytes

    def _total(self) -> int:
        """What decisions charge: ``_used`` plus what is charged ahead, the records live snapshots' ranks have yet to
        write and the room of the next snapshot (see the budget above)."""
        return self._data_bytes() + self.metadata_bytes

    def _free_bytes(self) -> int:
        stats = os.statvfs(self.layout.root)
        return int(stats.f_bavail * stats.f_frsize)

    @property
    def epoch_room(self) -> int:
        """The most segment bytes one snapshot pins (``room.py``), hence the largest segment a grant may hold."""
        return epoch_room(self.config.max_bytes, self.config.turnover_bytes)

    def reserve(self, nbytes: int) -> Grant | None:
        """Grant room for one segment of up to ``nbytes``, evicting as the rules allow; None means wait.

        Raises ValueError if ``nbytes`` could never fit (larger than the epoch room a snapshot may pin).
        """
        need = _round_up(nbytes)
        if need > self.epoch_room:
            raise ValueError(
                f"a segment of {need} bytes cannot fit a cache of {self.config.max_bytes} bytes "
                f"(turnover {self.config.turnover_bytes}): the sample is too large for this cache"
            )
        if time.monotonic() < self._refused_until:
            return None  # a write was refused for lack of space a moment ago (``refused_write``)
        self._maybe_rescan_pins()
        why = self._make_room(need)
        if why:
            self._maybe_rescan_pins(force=True)
            why = self._make_room(need)
        if why == "reads":
            if not self._is_paced:  # the normal state of a cache a trainer reads: at info once, then at debug
                log.log(
                    logging.DEBUG if self._said_paced else logging.INFO,
                    "cache full of samples trainers have not read yet (or of sources below their share): "
                    "fetching waits for reads (cache.evict_after_reads = %d)%s",
                    self.config.evict_after_reads,
                    ""
                    if self._said_paced
                    else "; normal while training reads slower than the remote delivers "
                    "(said once: `cachefeed status` shows when it is paced)",
                )
                self._said_paced = True
            self._is_paced, self._is_backpressured, self._is_out_of_space = True, False, False
            return None
        if why == "free":
            if not self.is_out_of_space:
                log.warning("%s", self.out_of_space_reason())
            self._is_paced, self._is_backpressured, self._is_out_of_space = False, False, True
            return None
        if why:
            if not self._is_backpressured:
                self.counters.backpressure_events += 1
                log.info("cache full of pinned segments: writers wait until a snapshot is released")
            self._is_paced, self._is_backpressured, self._is_out_of_space = False, True, False
            return None
        self._is_backpressured = self._is_paced = self._is_out_of_space = False
        seq = self._next_seq
        self._next_seq += 1
        grant = Grant(seq, self.layout.tmp / f"{seq:016x}.tmp", need)
        self._grants[seq] = grant
        return grant

    def out_of_space_reason(self) -> str:
        """What ``is_out_of_space`` means, in words for the log and status, with what to do."""
        inodes = ", no inode left for a file" if self._is_out_of_inodes() else ""
        free, floor = self._free_bytes(), self.config.min_free_bytes
        if not inodes and free > floor // 2 and floor > 0:  # the floor stops it, not a full filesystem
            return (
                f"the cache's filesystem is at its free-space floor: {format_bytes(free)} free at {self.layout.root}, "
                f"and cache.min_free_bytes = {format_bytes(floor)} keeps that much free for others; the cache holds "
                "nothing it may evict: fetching waits for space; lower cache.min_free_bytes, free space on that "
                "filesystem, or lower cache.max_bytes to what it can hold"
            )
        return (
            f"the cache's filesystem is full: {format_bytes(free)} free{inodes} at {self.layout.root} "
            f"(cache.min_free_bytes = {format_bytes(floor)}), and the cache holds nothing it may "
            "evict: fetching waits for space; free space on that filesystem, or lower cache.max_bytes to what it "
            "can hold"
        )

    def _is_out_of_inodes(self) -> bool:
        """Whether the filesystem has a limit on files (a tmpfs's ``nr_inodes``) and none is left."""
        stats = os.statvfs(self.layout.root)
        return stats.f_files > 0 and stats.f_favail == 0

    def _has_free_space(self, need: int) -> bool:
        unwritten = self.reserved_bytes  # conservative: counts grants as if none of their bytes were written yet
        return self._free_bytes() - unwritten - need >= self.config.min_free_bytes

    def _make_room(self, need: int) -> str:
        """Rules (A) and (B): evict what the rules let go until ``need`` fits the budget and the free-space floor.

        Returns "" when it fits, else why the writer waits: "reads" (paced: what could make room has not been
        read enough, or belongs to a source below its share), "pins" (back-pressure: snapshots pin what could
        go) or "free" (the filesystem's floor, with nothing unpinned left to evict).
        """
        if not self._evict_to_fit(need):
            return "reads" if self._waits_for_reads() else "pins"
        candidates: list[int] | None = None
        while not self._has_free_space(need):
            if candidates is None:
                candidates = self._evictable(unpinned=True)
            if not candidates:
                return "free"
            victim = self._choose(candidates, spare_below_share=False)
            if victim is None:  # never with spare_below_share=False; for the type checker
                return "free"
            candidates.remove(victim)
            if self._is_pinned_now(victim):
                self._pinned_published.add(victim)  # pinned since the last scan: evicting it frees nothing
                continue
            self._evict(victim)
        return ""

    def _evict_to_fit(self, need: int) -> bool:
        """Rule (B): evict evictable, unpinned segments (weighted-source and policy order) until ``need`` fits the
        budget. False if that is not enough."""
        candidates: list[int] | None = None
        while self._total() + need > self.limit_bytes:
            if candidates is None:
                candidates = self._evictable(unpinned=True)
            victim = self._choose(candidates) if candidates else None
            if victim is None:
                return False
            candidates.remove(victim)
            if self._is_pinned_now(victim):
                self._pinned_published.add(victim)  # pinned since the last scan: evicting it frees nothing
                continue
            self._evict(victim)
        return True

    def shrink_to_budget(self) -> int:
        """At start, once the sources' weights are set and the segments of dropped sources gone (the daemon's
        order): a cache that holds more than its budget allows (``cache.max_bytes`` lowered since it was filled) is
        brought under it at once, unpinned segments in policy order within the source furthest above its share, read
        or not (counted as evicted unread). The budget is a bound; waiting for trainers to read them, as a full cache
        does, held it broken for as long as they took. What the directory holds is judged (``_used``), not what
        decisions charge ahead for snapshots to come: those wait for reads, as in a running daemon (a restart with
        the same budget evicted an unread segment for that room). The recovered sources of segments evicted with
        unread samples are kept per source tag in ``evicted_unread_at_start``: the daemon fetches those objects
        again in the pass it resumes. Returns the number of segments evicted."""
        if self._used() <= self.limit_bytes:
            return 0
        held, evicted = self._used(), 0
        candidates = [seq for seq in self._published if seq not in self._pinned_published]
        while self._used() > self.limit_bytes and candidates:
            victim = self._choose(candidates, spare_below_share=False)
            if victim is None:
                break
            candidates.remove(victim)
            if not self._is_pinned_now(victim):
                tag, unread = self._published[victim].source, self._sample_reads(victim).unread
                self._evict(victim)
                sources = self.recovered_sources.pop(victim, [])  # not cached any more: its objects are fetched again
                if unread:
                    self.evicted_unread_at_start.setdefault(tag, []).extend(sources)
                evicted += 1
        log.warning(
            "the cache held %s, more than the %s that cache.max_bytes = %s leaves beside the %s kept for metadata "
            "(lowered since it was filled?): evicted %d segments, read or not, to bring it to %s%s",
            format_bytes(held),
            format_bytes(self.limit_bytes),
            format_bytes(self.config.max_bytes),
            format_bytes(METADATA_RESERVE_BYTES),
            evicted,
            format_bytes(self._used()),
            "" if self._used() <= self.limit_bytes else " (the rest is pinned by epochs: it goes as they end)",
        )
        return evicted

    def _waits_for_reads(self) -> bool:
        """Whether a full cache waits for trainers to read (paced) rather than for snapshots to go: some published
        segment is still below ``evict_after_reads``, or an evictable unpinned one is spared for its source."""
        enough = self.config.evict_after_reads
        if enough and any(self._levels.get(seq, 0) < enough for seq in self._published):
            return True
        return bool(self._evictable(unpinned=True))

    def _is_pinned_now(self, seq: int) -> bool:
        try:
            return os.lstat(self.layout.segments / self._published[seq].name).st_nlink > 1
        except FileNotFoundError:
            return False

    def _choose(self, candidates: list[int], *, spare_below_share: bool = True) -> int | None:
        """The next victim among ``candidates`` (not empty): the policy's, within the source most above its share.

        None when every candidate's source is below its share and ``spare_below_share`` (see "Weighted sources"):
        the caller waits rather than take from a source that is short already."""
        weights = self.source_weights
        if weights:
            by_tag = self._samples_by_tag
            total = sum(by_tag.values())
            excess = {
                tag: by_tag.get(tag, 0) - weights.get(tag, 0.0) * total
                for tag in {self._published[seq].source for seq in candidates}
            }
            worst = max(sorted(excess), key=excess.__getitem__)
            if spare_below_share and excess[worst] < -1e-9 * total:  # below, not at (one source is always at)
                return None
            candidates = [seq for seq in candidates if self._published[seq].source == worst]
        return self.policy.choose(candidates, self._levels)

    def _add_published(self, segment: PublishedSegment) -> None:
        self._published[segment.seq] = segment
        self._published_bytes += segment.nbytes
        self._samples_by_tag[segment.source] = self._samples_by_tag.get(segment.source, 0) + segment.samples

    def _evict(self, seq: int, *, retired: bool = False) -> None:
        """Remove published segment ``seq`` (a snapshot's link keeps it for its epoch). ``retired``: by ``retire``,
        counted apart from the budget's evictions (their reads and turnover say how training read the cache)."""
        segment = self._published.pop(seq)
        self._published_bytes -= segment.nbytes
        self._samples_by_tag[segment.source] -= segment.samples
        reads = self._reads.pop(seq, None) or SampleReads.none(segment.samples)
        self._levels.pop(seq, None)
        path = self.layout.segments / segment.name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            log.warning("segment %s vanished from the cache behind the daemon's back", segment.name)
            return
        try:
            path.unlink()
            links_left = os.fstat(fd).st_nlink
        finally:
            os.close(fd)
        if links_left > 0:
            self._pinned_only[segment.inode] = segment.nbytes  # lives on in a snapshot (see the NOTE there)
            self._evicted_pinned[segment.name] = (segment.inode, reads)  # its epoch may still serve it
        self._pinned_published.discard(seq)
        counters = self.counters
        if retired:
            counters.retired_segments += 1
            counters.retired_samples += segment.samples
            counters.retired_bytes += segment.nbytes
            log.debug("retired %s (%d samples, pinned=%s)", segment.name, segment.samples, links_left > 0)
            return
        counters.evicted_segments += 1
        counters.evicted_samples += segment.samples
        counters.evicted_bytes += segment.nbytes
        counters.evicted_sample_reads += reads.total
        counters.evicted_max_reads = max(counters.evicted_max_reads, reads.level)
        counters.evicted_unread_samples += reads.unread
        counters.first_eviction_at = counters.first_eviction_at or time.time()
        counters.evicted_published_at.append(segment.published_at)
        del counters.evicted_published_at[:-64]
        counters.recent_evicted.append((segment.samples, reads.total))
        del counters.recent_evicted[:-ECHO_WINDOW]
        log.debug("evicted %s (%d samples, pinned=%s)", segment.name, segment.samples, links_left > 0)

    def retire(self, seqs: Iterable[int]) -> tuple[int, int]:
        """Evict the published segments among ``seqs`` now, whatever their reads: they hold samples of versions the
        remote no longer lists (``plan.py``, "Retired samples"). An epoch that pinned one still reads it; no later
        snapshot takes it. Returns the segments and samples retired."""
        gone = [seq for seq in seqs if seq in self._published]
        samples = sum(self._published[seq].samples for seq in gone)
        for seq in gone:
            self._evict(seq, retired=True)
        return len(gone), samples

    def drop_sources(self, keep: set[int]) -> int:
        """Evict every published segment whose source tag is not in ``keep`` (at start, when the config no longer
        names that source: epochs would never read its samples, so read-gated eviction would keep them forever).
        Returns the number of segments dropped; snapshots that pin them keep them until released."""
        return self.drop_tags({s.source for s in self._published.values()} - keep)

    def drop_tags(self, tags: set[int]) -> int:
        """Evict every published segment of a source tag in ``tags`` (at start: ``drop_sources``, and a source whose
        samples were made under other settings, ``sources.py``); they are forgotten by the restart's recovery too
        (``recovered_sources``), so that nothing of them counts as cached. Returns the number of segments dropped."""
        gone = [seq for seq, segment in self._published.items() if segment.source in tags]
        for seq in gone:
            self._evict(seq)
            self.recovered_sources.pop(seq, None)
        return len(gone)

    def enforce(self) -> None:
        """Periodic upkeep: sweep stale snapshots, refresh pins, keep the budget as metadata grows, and see whether
        a filesystem that refused a write has room again."""
        self.sweep()
        self._maybe_rescan_pins()
        self._evict_to_fit(0)
        self._recheck_refused()

    # -- publication ----------------------------------------------------------------------------------------

    def publish(self, grant: Grant) -> PublishedSegment:
        """Verify the finished file of ``grant`` and publish it by an atomic rename. The grant is consumed.

        Raises CorruptRecordError (and deletes the file) if the file is not a complete, valid segment or is
        larger than its grant.
        """
        if self._grants.pop(grant.seq, None) is None:
            raise ValueError(f"unknown or already used grant {grant.seq}")
        try:
            info = os.lstat(grant.path)
            if info.st_size > grant.nbytes:
                raise CorruptRecordError(f"segment {grant.seq} outgrew its grant ({info.st_size} > {grant.nbytes})")
            with SegmentReader(grant.path) as reader:
                samples, tag = reader.count, reader.source
            name = segment_name(grant.seq)
            os.rename(grant.path, self.layout.segments / name)
        except BaseException:
            grant.path.unlink(missing_ok=True)
            raise
        if self.config.fsync:
            fsync_dir(self.layout.segments)
        segment = PublishedSegment(grant.seq, name, allocated_bytes(info), samples, info.st_ino, time.time(), tag)
        self._add_published(segment)
        self._refusals = 0  # the filesystem takes whole segments again: a later refusal holds briefly
        self.counters.published_segments += 1
        self.counters.published_samples += samples
        self.counters.published_bytes += segment.nbytes
        return segment

    def abort(self, grant: Grant) -> None:
        """Give a grant back and delete whatever was written under it (idempotent)."""
        self._grants.pop(grant.seq, None)
        grant.path.unlink(missing_ok=True)

    # -- views ----------------------------------------------------------------------------------------------

    @property
    def samples(self) -> int:
        return sum(self._samples_by_tag.values())

    def samples_by_source(self) -> dict[int, int]:
        """Published samples per source tag."""
        return {tag: n for tag, n in self._samples_by_tag.items() if n}

    @property
    def segments(self) -> list[PublishedSegment]:
        return [self._published[seq] for seq in sorted(self._published)]

    @property
    def echo_factor(self) -> float | None:
        """Reads per sample of the samples of the last ``ECHO_WINDOW`` evicted segments (their reads are final):
        about ``evict_after_reads`` when the remote keeps up, more when epochs re-read what is cached because fresh
        samples arrive slower than training reads. None before the first eviction."""
        window = self.counters.recent_evicted
        samples = sum(n for n, _reads in window)
        return sum(reads for _n, reads in window) / samples if samples else None

    @property
    def ingest_bound(self) -> str | None:
        """What limits fresh samples now: "remote" (slower than training), "trainer" (ingest waits for training), or
        None where nothing compares the two. The contract, state by state:

        * no live snapshot a trainer holds (no trainer reads the cache: none ran yet, or all have gone; a dead
          trainer's snapshot kept for its job to resume, ``orphaned_snapshots``, is read by nobody): None, whatever
          an earlier trainer's epochs showed; an idle daemon fills its budget and is then paced, bound by nobody's
          reads.
        * otherwise judged on the newest closed snapshot a trainer made (``room.py``: unread segments first, then
          the least-read): "remote" when more than ``TOPPED_UP_SHARE`` of it had been read already (fresh samples
          did not fill the epoch's room, so it was topped up and samples are read again), "trainer" otherwise (the
          epoch read mostly fresh samples: a daemon paced by a slow trainer); None before the first such snapshot.

        Not whether ingest is paced at this moment: a remote-bound daemon is paced for a moment at each handover
        (two snapshots pin the budget), and the verdict, its metric and the alerts built on them would flap."""
        if all(snap_id in self._free_since for snap_id in self._live_ids):  # none, or only dead trainers' kept
            return None
        if self._newest_pin is None:
            return None
        _created, samples, fresh = self._newest_pin
        return "remote" if samples - fresh > TOPPED_UP_SHARE * samples else "trainer"

    def usage(self) -> Usage:
        self._maybe_rescan_pins()
        pinned_only = sum(self._pinned_only.values())
        pinned_published = sum(self._published[s].nbytes for s in self._pinned_published if s in self._published)
        return Usage(
            bytes=self._used(),
            max_bytes=self.config.max_bytes,
            published_bytes=self.published_bytes,
            pinned_only_bytes=pinned_only,
            pinned_bytes=pinned_only + pinned_published,
            reserved_bytes=self.reserved_bytes,
            samples=self.samples,
            segments=len(self._published),
            snapshots=len(self._live_ids),
            free_bytes=self._free_bytes(),
            min_free_bytes=self.config.min_free_bytes,
            is_backpressured=self._is_backpressured,
            unread_samples=self._samples_below(1),
            is_paced=self._is_paced,
            is_out_of_space=self.is_out_of_space,
            waiting_for_reads_samples=(self._samples_below(self.config.evict_after_reads) if self._is_paced else 0),
            max_reads=max(self._levels.values(), default=0),
            sample_reads=sum(reads.total for reads in self._reads.values()),
            oldest_published_at=min((s.published_at for s in self._published.values()), default=None),
            newest_published_at=max((s.published_at for s in self._published.values()), default=None),
            fill=min(1.0, self.published_bytes / max(1, self.limit_bytes - self.metadata_bytes)),
            echo_factor=self.echo_factor,
            ingest_bound=self.ingest_bound,
        )
