"""Epoch snapshots: a pinned, immutable set of segments that eviction cannot take away.

NOTE [ Snapshot pinning protocol ]
----------------------------------
Processes: trainer ranks on a node (any number) pin; the daemon evicts and sweeps. No process trusts another to
clean up after itself: every pin is a ``flock`` that the kernel drops when its holder dies.

A snapshot ``<id>`` is two entries in ``snapshots/``:

* ``<id>.lock``: a lock file. Every process using the snapshot holds ``flock(LOCK_SH)`` on it. It is *born
  locked*: the creator makes ``.<id>.<pid>.<rand>.partial``, locks it, then hard-links it to ``<id>.lock``
  (``link`` fails if the name exists, so two creators cannot both win) and unlinks the partial name. Nobody
  ever sees an unlocked ``<id>.lock`` while its creator lives.
* ``<id>/``: hard links to the segments, then ``MANIFEST`` (written atomically, last). A snapshot is complete
  when ``MANIFEST`` exists. Hard links make the kernel count references: when the daemon evicts (unlinks) a
  segment from ``segments/``, a snapshot's link keeps the data readable, and the bytes still count against the
  budget (the daemon finds them by scanning ``snapshots/*/``) until the snapshot goes.

Joining (another rank, same epoch): wait for ``MANIFEST``, open ``<id>.lock``, take ``LOCK_SH``, then check
that the path still names the inode we locked (a remover may have unlinked it between our open and our lock).
A lock held exclusively is not a missing snapshot: the holder is a remover or the daemon's sweep probing a kept
one, so a joiner waits until it lets go (``BUSY_WAIT_S``, or its own timeout if longer), then joins or finds the
snapshot gone. A creator that finds the name taken joins too, but where the lock goes away while it waits (the last
holder removed the snapshot) it makes the snapshot anew under that name (``create``): a trainer going back to an
epoch whose snapshot its own teardown was removing waited out its timeout for a snapshot nobody would make again.

Removal: whoever gets ``flock(LOCK_EX | LOCK_NB)`` on ``<id>.lock`` knows nobody else holds the snapshot: it
hands the epoch's read receipt to the daemon if a rank recorded what it served (NOTE [ Read receipts ] in
``reads.py``), then removes ``<id>/``, then ``<id>.lock``, while holding the lock. The last releaser does this;
the daemon's ``sweep_stale`` does it for holders that died. Removing the directory before the lock means a
directory without a lock is always garbage; a ``.partial`` lock older than ``PARTIAL_GRACE_S`` whose lock is free
is garbage too. A releaser's conversion from shared to exclusive is not atomic (the kernel drops the shared lock
first): a sweep probing in that instant makes it fail, so a releaser that finds the lock held exclusively looks
again a few milliseconds later (``Snapshot._remove_if_last``), or the sweep would keep the snapshot for a resume
and its receipt would wait.

Leaving for a resume: a rank stopped mid-epoch (Ctrl-C) drops its pin without removing the snapshot, as a rank
that dies does, so that a restart from its checkpoint joins this very snapshot (``Snapshot.leave_for_resume``). It
first creates ``<id>/LEFT``: a releaser that finds itself the last holder and sees ``LEFT`` does not remove the
snapshot (another rank of the job, done with its share, must not take away the epoch a stopped rank will resume);
it leaves it to the daemon's sweep, which keeps an unheld snapshot for ``cache.snapshot_grace``. A resume's join
(``join`` with the checkpoint's ``nonce``) removes ``LEFT``: from then on the resumed job's last releaser removes
the snapshot as usual. ``LEFT`` is written before the pin is dropped, and a releaser reads it only once it holds the
lock exclusively, so it cannot miss the mark of a rank that left before it.

Begun epochs: a checkpoint names an epoch's snapshot only once its training loop received a batch of it
(``_trainer/lifecycle.py``: ``on_progress``). The factory's creator marks each snapshot it pins ``<id>/AHEAD`` (empty:
an inode, charged as a claim's) while it holds the pin (``Snapshot.mark_ahead``), and a loop removes the mark before
its first batch of the epoch is counted (``Snapshot.mark_started``). A snapshot still marked, its trainer gone, is an
epoch a dead trainer pinned ahead and never began: no resume can ever join it, so the sweeps keep it for no grace
(``was_started``): else it pinned its room, the daemon's turnover with it, for ``cache.snapshot_grace`` after every
kill (the audit: 4.7 MiB pinned by 5 snapshots, the daemon back-pressured, while the resumed jobs read fresh ones).
A snapshot without the mark (another loader on ``Snapshot``, a trainer of an older cachefeed) is kept as before.

Rank claims: the local ranks sharing a snapshot split it (MANIFEST ``ranks``), each reading its own share, so two
processes given the same rank (a launcher that set no ``RANK``/``LOCAL_RANK``: both default to 0) would read the
same share twice and another share never. A trainer claims its local rank ``k`` as it pins (``create``/``join``
with ``rank=k``): ``<id>/RANK.<k>``, opened (created if need be) and locked ``flock(LOCK_EX | LOCK_NB)``. The file
stays empty: an inode and a directory entry, no data block, so the snapshot's disk charge (``layout.py``,
``SNAPSHOT_FIXED_BYTES``) holds however many local ranks claim; who holds a claim is asked of the kernel's lock
table (``/proc/locks``: each flock's pid and inode), for messages. A claim another process holds is tried again
for up to ``CLAIM_WAIT_S`` (a rank restarted while its predecessor is still exiting, in CUDA or NCCL teardown,
holding it; a true duplicate keeps it, so the wait costs that one only time), then refuses the pin
(``RankClaimedError``, naming the holder and the wait); the creator claims before it writes ``MANIFEST``, so a
joiner given its rank is the one refused. A claim belongs to a process, not to a pin: its pins of one snapshot
share one locked descriptor (``_take_claim``: a factory that goes back to an epoch before its earlier build of it is
released). The kernel drops a claim with its holder, as a pin: a restarted or resumed rank (a new process) takes a
dead one's claim over. A rank that read its share and released its pin (``release``) keeps the claim, pinless,
while it lives and the snapshot exists (``_drop_claim(keep=True)``, closed by ``_prune_kept_claims`` once the claim
file is removed with its snapshot): else a second process given that rank, waiting on a short epoch's claim, took it
over as soon as the first moved on, and read the share again. A rank that leaves its epoch for a resume
(``leave_for_resume``) drops its claim before its pin: the resumed rank, in this process or another, claims it
again. A forked child closes its copies at the fork, so they do not outlive the parent's release: a claim's
descriptor is opened, locked and recorded, and closed, under the one lock the at-fork hooks take, so no fork copies
one the child does not know of. Claim files live in ``<id>/`` and go with it; a process that may not write there
reads unclaimed.

Forks: a pin belongs to the process that took it. A process forked while its parent pins snapshots (a worker the
trainer's pool starts in place of a dead one, mid-training; a user's own fork) would share the parent's locked
descriptions through its inherited descriptors: after the parent let a pin go (left it for a resume, say), the
child's copy held it on, so the daemon's sweep (or the other ranks' last release) found the snapshot held and kept
it, its segments pinned, for as long as the child lived. So pin descriptors are opened and recorded under the one
lock the at-fork hooks take (``_open_pin``), and a forked child closes its copies at the fork, as it does its
claims. A ``Snapshot`` it inherited touches, releases and leaves nothing: its descriptor's number may be another
file's by now, even a pin the child took itself.

Ownership: the MANIFEST names the *job* that created the snapshot (``job``, a nonce the job's ranks agree on,
``_trainer/partition.py``) and carries a nonce of the snapshot's own (``nonce``). ``join`` refuses a snapshot of
another job, and a resumed epoch joins only the snapshot whose nonce its checkpoint names: two jobs never read
each other's snapshots, whatever their run ids.

Why one long module: it is both sides of the pinning protocol (trainers pin and release, the daemon sweeps and
counts pins), which must agree on every file name and lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

import msgpack
import numpy as np
import numpy.typing as npt

from cachefeed._cache.layout import (
    DAEMON_RESTART_WINDOW_S,
    SEGMENT_NAME,
    SNAPSHOT_ID,
    CacheLayout,
    allocated_bytes,
    list_regular,
    segment_name,
    segment_seq,
)
from cachefeed._cache.reads import (
    RECEIPT_SUFFIX,
    SERVED_PREFIX,
    Counts,
    decode_reads,
    emit_receipt,
    encode_reads,
    read_counts,
    reads_with_receipts,
    write_served,
)
from cachefeed._cache.records import SegmentReader, Source, segment_trailer
from cachefeed._cache.room import Candidate, choose, room_now, top_up, unread_first
from cachefeed._cache.sources import read_sources
from cachefeed._errors import CorruptRecordError, SnapshotError
from cachefeed._fsutil import atomic_write, file_version, open_regular_for_write, remove_tree
from cachefeed._logs import get_logger

__all__ = [
    "CLAIM_WAIT_S",
    "RankClaimedError",
    "Snapshot",
    "SnapshotInfo",
    "live_snapshots",
    "pinned_inodes",
    "sweep_stale",
    "sweep_unwatched",
    "was_started",
]

MANIFEST = "MANIFEST"
LEFT = "LEFT"  # in ``<id>/``: a rank left this snapshot for a resume (NOTE, "Leaving for a resume")
AHEAD = "AHEAD"  # in ``<id>/``: pinned ahead, no training loop took a batch of it yet (NOTE, "Begun epochs")
RANK_CLAIM = "RANK."  # in ``<id>/``, + the local rank: a process reads that rank's share (NOTE, "Rank claims")

Pick = Callable[[list[Candidate], int | None, int], list[int]]
"""A snapshot's choice of segments: ``pick(candidates, room, linked)`` gives the sequence numbers it takes of
``candidates`` within ``room`` bytes (None: no limit), ``linked`` samples being linked already (``_link_picks``)."""
PARTIAL_GRACE_S = 60.0
BUSY_WAIT_S = 30.0  # how long ``Snapshot.join`` waits on a snapshot whose lock another process holds exclusively
CREATE_JOIN_S = 60.0  # how long ``Snapshot.create`` waits for a snapshot of its name that another process makes
CLAIM_WAIT_S = 10.0  # how long a pin tries again a rank claim another process holds (NOTE, "Rank claims")
_CLAIM_POLL_S = 0.05  # how often it tries

log = get_logger(__name__)


class RankClaimedError(SnapshotError):
    """Another live process reads local rank ``rank`` of snapshot ``snap_id`` (NOTE, "Rank claims"); ``holder``
    says who (``"pid N on HOST"``, or ``"another process"`` where the kernel does not say), ``waited_s`` how long
    it held the claim while this process tried again (``held_for``). The pin taken to claim it is dropped."""

    def __init__(self, snap_id: str, rank: int, ranks: int, holder: str, waited_s: float = 0.0) -> None:
        self.snap_id, self.rank, self.ranks, self.holder, self.waited_s = snap_id, rank, ranks, holder, waited_s
        of = f" of {ranks}" if ranks else ""
        super().__init__(
            f"local rank {rank}{of} of snapshot {snap_id!r} is read by {holder} already{self.held_for}: two "
            "processes given the same rank read the same share, and another share never. Give each process its "
            "own rank"
        )

    @property
    def held_for(self) -> str:
        """How long the holder kept the claim while this process waited, for messages (empty: it did not wait)."""
        if self.waited_s < _CLAIM_POLL_S:  # one try
            return ""
        waited = f"{self.waited_s:.0f}" if self.waited_s >= 1 else f"{self.waited_s:.1g}"
        return f", held by it for the last {waited} s (not a predecessor still exiting)"

    def __reduce__(self) -> tuple[type[RankClaimedError], tuple[str, int, int, str, float]]:
        return type(self), (self.snap_id, self.rank, self.ranks, self.holder, self.waited_s)


class _Busy:
    """``_try_pin``'s answer for a snapshot that is there but locked exclusively by another process."""


_BUSY = _Busy()


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """What status shows about one live snapshot."""

    snap_id: str
    samples: int
    segments: int
    owner: str
    created: float
    names: tuple[str, ...] = ()  # its segment file names
    active_at: float = 0.0  # when a holder last showed progress (``Snapshot.touch``: the lock file's mtime)
    fresh: int | None = None  # samples no epoch had read (nor was reading) when it was made; None: not recorded
    is_open: bool = False  # still growing (NOTE [ Growing snapshots ]): its samples and fresh ones may change
    ranks: int = 0  # how many local ranks split it (its MANIFEST's ``ranks``; 0: not said)
    served_records: int = 0  # ranks' records of what they served in its directory (``live_snapshots``' count_records)


class Snapshot:
    """One pinned epoch snapshot held by this process. Use ``create``/``join``/``open``; ``release`` when done.

    Attributes:
        snap_id: the snapshot's name (validated: letters, digits, ``_.-``).
        directory: ``snapshots/<id>/``; segment ``names[i]`` is ``directory / names[i]``.
        names: segment file names, oldest first.
        counts: samples in each segment.
        reads: each segment's reads when the snapshot was made (its least-read sample's, from the daemon's ledger;
            0 if unknown; NOTE [ Read receipts ] in ``reads.py``). ``sample_reads()`` has them per sample, so that
            every rank sharing the snapshot draws the same least-read-first order.
        job: the job that created it (a nonce its ranks agree on; "" for a snapshot made outside a factory).
        nonce: the snapshot's own, random at creation: a checkpoint names it, so a resume joins this very
            snapshot and no other of the same name.
        tags: each segment's source tag (0: the one unnamed remote; ``_cache/sources.py``).
        sources: ``{tag: (name, weight)}`` of the daemon's named sources when the snapshot was made (empty for
            the single ``[remote]`` form): every rank, and a resumed job, weighs the epoch the same way.
        left_out: the named sources with samples cached that the snapshot did not pin (segments published when it
            was made or last grown, and not linked: the epoch room full, or read ones an unread-first snapshot
            passes over); a source not in it is pinned whole. The epoch's partition has these repeat no samples
            while another source has pinned samples to spare (``_trainer/partition.py``, ``source_shares``). None
            where not recorded (no named sources, or a MANIFEST older than the field): shares as before it.
    """

    def __init__(self, layout: CacheLayout, snap_id: str, lock_fd: int, manifest: dict[str, object]) -> None:
        self.layout = layout
        self.snap_id = snap_id
        self.directory = layout.snapshots / snap_id
        self._lock_fd: int | None = lock_fd
        self._owner_pid = os.getpid()
        self._claim: _ClaimKey | None = None  # this process's rank claim, if it made one (NOTE, "Rank claims")
        self.names: tuple[str, ...] = ()
        self.counts: tuple[int, ...] = ()
        self.reads: tuple[int, ...] = ()
        self.tags: tuple[int, ...] = ()
        self.left_out: frozenset[int] | None = None
        self._above: tuple[bytes, ...] = ()
        self.generations: tuple[int, ...] | None = None  # a growing snapshot's segments at each generation's end
        self.is_open = False
        self._manifest: dict[str, object] = {}
        self._manifest_stat: tuple[int, int, int] | None = None
        self._grown_bytes: int | None = None  # the creator's running total of pinned bytes while it grows
        self.wants: int | None = None  # an unread-first snapshot: the samples its epoch needs (``create``)
        self.topup_from: int | None = None  # its first generation of least-read samples, if growth stopped short
        self._passed: set[str] = set()  # published segments its growth does not take (read, or being read)
        self._versions: dict[str, Linked] | None = None  # the objects its growth linked (``_linked_versions``)
        self._load(manifest)
        self.job = str(manifest.get("job", ""))
        self.ranks = int(manifest.get("ranks", 0))  # type: ignore[call-overload]  # how many local ranks split it
        self.nonce = str(manifest.get("nonce", ""))
        named = manifest.get("sources", [])
        self.sources: dict[int, tuple[str, float]] = {
            int(tag): (str(name), float(weight)) for tag, name, weight in (named if isinstance(named, list) else [])
        }
        self.created = float(manifest.get("created", 0.0))  # type: ignore[arg-type]

    @property
    def samples(self) -> int:
        return sum(self.counts)

    @property
    def paths(self) -> list[Path]:
        return [self.directory / name for name in self.names]

    def sample_reads(self, first: int = 0, last: int | None = None) -> npt.NDArray[np.int64]:
        """Each sample's reads when the snapshot was made (for the least-read-first order; samples in dataset
        order): its segment's reads, plus one where the sample was read more than its segment's least-read one.
        ``first``/``last``: of segments ``first .. last - 1`` only."""
        segments = slice(first, last)
        entries = zip(self.counts[segments], self.reads[segments], self._above[segments], strict=True)
        parts = [decode_reads(c, r, a) for c, r, a in entries]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    # -- creation and joining -------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        root: str | os.PathLike[str],
        snap_id: str,
        *,
        job: str = "",
        ranks: int = 0,
        rank: int | None = None,
        reading: Collection[str] = (),
        growing: bool = False,
        wants: int | None = None,
        claim_wait_s: float = CLAIM_WAIT_S,
    ) -> Snapshot:
        """Pin the segments published right now, at most the daemon's epoch room of them, least-read first
        (``room.py``: the segments of every live snapshot, and those ``reading`` names, count one pending read each;
        receipts the daemon has not applied yet count as applied), for ``job``. If another process of that job
        created ``snap_id`` first, join it (``SnapshotError`` if another job did); if that snapshot is being removed
        (its last holder releasing it), make it anew once it is gone (NOTE, "Joining"). ``ranks``: how many local
        ranks split it (0: not said), which every joiner must say alike (``join``). ``rank``: claim this local rank
        of it (NOTE, "Rank claims"), before its MANIFEST is written: a joiner given the same rank is refused. A
        snapshot of that name joined claims as ``join`` does, waiting up to ``claim_wait_s`` for a claim held.

        ``growing``: the snapshot stays open and its creator adds segments published later, up to the room
        (``grow``; NOTE [ Growing snapshots ]).

        ``wants`` (a later epoch of a set size while the cache fills; implies ``growing``): pin only unread segments
        (``room.unread_first``); the snapshot is created closed if they hold ``wants`` samples, else open, and
        ``grow`` then takes only unread segments and, closing short of ``wants``, tops the snapshot up with the
        least-read ones in a last generation (``topup_from``)."""
        layout = _checked_layout(root, snap_id)
        deadline = time.monotonic() + CREATE_JOIN_S
        while (fd := _new_lock(layout, snap_id)) is None:
            left = max(0.0, deadline - time.monotonic())
            joined = cls._join(
                layout,
                snap_id,
                timeout_s=left,
                job=job,
                ranks=ranks,
                rank=rank,
                claim_wait_s=claim_wait_s,
                creating=True,
            )
            if joined is not None:
                return joined
        claim: _ClaimKey | None = None
        try:
            directory = layout.snapshots / snap_id
            remove_tree(directory)  # a directory without its lock is garbage (see the NOTE)
            directory.mkdir(mode=0o750)
            if rank is not None:
                claimed = _take_claim(directory, rank)
                if isinstance(claimed, _Held):  # nobody can have claimed a directory just made: not ours after all
                    raise RankClaimedError(snap_id, rank, ranks, _claim_holder(claimed.key))
                claim = claimed
            pending = _pending_reads(layout, reading)  # before the receipts: see _pending_reads
            reads = reads_with_receipts(layout.root, layout.snapshots)
            named_sources = read_sources(layout.sources_file)
            listed = layout.list_segments()
            room = room_now(layout)
            if wants is None:
                weights = {e.tag: e.weight for e in named_sources}
                candidates = _room_candidates(layout, listed, reads, pending, weights if room is not None else {})
                pick: Pick = lambda rest, left, _linked: choose(rest, left, weights)  # noqa: E731
            else:
                candidates = _candidates(layout, listed, reads, pending)
                pick = lambda rest, left, _linked: unread_first(rest, left)  # noqa: E731
            entries, fresh = _link_picks(layout, directory, candidates, pick, room=room, reads=reads, reading=pending)
            chosen = [str(entry[0]) for entry in entries]
            named = [[e.tag, e.name, e.weight] for e in named_sources]
            manifest = {
                "id": snap_id,
                "created": time.time(),
                "segments": entries,
                "sources": named,
                "job": job,
                "ranks": ranks,
                "nonce": secrets.token_hex(8),
                "fresh": fresh,
            }
            if named_sources:
                manifest["left_out"] = _left_out(layout, listed, chosen)
            if growing or wants is not None:
                manifest["generations"] = [len(entries)]
                manifest["open"] = True
            if wants is not None:
                manifest["wants"] = wants
                manifest["open"] = sum(int(entry[1]) for entry in entries) < wants  # type: ignore[call-overload]
            atomic_write(directory / MANIFEST, msgpack.packb(manifest), mode=0o640)
            snapshot = cls(layout, snap_id, fd, manifest)
            snapshot._claim, claim = claim, None
            if wants is not None:  # what it did not take now, its growth never takes
                snapshot._passed = {name for name, _info in listed}.difference(chosen)
            fd = -1
            return snapshot
        finally:
            if claim is not None:
                _drop_claim(claim)
            if fd >= 0:
                _close_pin(fd)

    @classmethod
    def join(
        cls,
        root: str | os.PathLike[str],
        snap_id: str,
        *,
        timeout_s: float = 60.0,
        job: str | None = None,
        nonce: str | None = None,
        ranks: int = 0,
        rank: int | None = None,
        stop: threading.Event | None = None,
        claim_wait_s: float = CLAIM_WAIT_S,
    ) -> Snapshot:
        """Pin the existing snapshot ``snap_id`` (created by another rank), waiting for it up to ``timeout_s``, or
        until ``stop`` is set (then ``SnapshotError`` at once: a factory closing does not wait out the join of an
        epoch prepared ahead that its creator will never make).

        A snapshot that is there but whose lock another process holds exclusively is waited for up to
        ``BUSY_WAIT_S``, or ``timeout_s`` if longer: the daemon's sweep takes that lock for a moment to learn that
        nobody holds a dead trainer's snapshot it keeps for a resume (``sweep_stale``), and a remover holds it while
        it removes. The snapshot is then joined, or found gone, once the other process lets go; a resume that gave
        up at such a moment would run on a fresh snapshot and serve part of its epoch twice. One found gone is
        looked for again until ``timeout_s`` (a creator may make it anew), then reported as removed.

        ``job``/``nonce``, when given, must match the MANIFEST's: a snapshot of another job, or another snapshot
        of the same name, is never joined (``SnapshotError``; the pin taken to check is dropped). A join with the
        ``nonce`` is a resume's: it takes the snapshot back from the daemon's keeping (removes ``LEFT``, see the
        NOTE), so that the resumed job's last releaser removes it. ``ranks``, when given, must match the number of
        local ranks its creator split it among: a rank given another ``world_size`` would read a split of its own,
        serving some samples twice and others never (``SnapshotError``, naming both). ``rank``: claim this local
        rank of it (NOTE, "Rank claims"); a claim another live process holds is tried again for up to
        ``claim_wait_s`` (its holder may be a predecessor still exiting), then ``RankClaimedError``."""
        layout = _checked_layout(root, snap_id)
        joined = cls._join(
            layout,
            snap_id,
            timeout_s=timeout_s,
            job=job,
            nonce=nonce,
            ranks=ranks,
            rank=rank,
            stop=stop,
            claim_wait_s=claim_wait_s,
        )
        if joined is None:  # only a creator's join gives up on a free name
            raise SnapshotError(f"snapshot {snap_id!r} is not in {layout.snapshots}")
        return joined

    @classmethod
    def _join(
        cls,
        layout: CacheLayout,
        snap_id: str,
        *,
        timeout_s: float,
        job: str | None = None,
        nonce: str | None = None,
        ranks: int = 0,
        rank: int | None = None,
        stop: threading.Event | None = None,
        claim_wait_s: float = CLAIM_WAIT_S,
        creating: bool = False,
    ) -> Snapshot | None:
        """``join``'s wait and pin. ``creating``: a creator's, which found the name taken: None as soon as the name
        is free (no ``<id>.lock``: its last holder removed it), so that the creator makes it anew."""
        lock_path = layout.snapshots / f"{snap_id}.lock"
        manifest_path = layout.snapshots / snap_id / MANIFEST
        started = time.monotonic()
        deadline, busy_deadline = started + timeout_s, started + max(timeout_s, BUSY_WAIT_S)
        was_busy = False
        while True:
            pinned = _try_pin(lock_path, manifest_path)
            was_busy = was_busy or pinned is _BUSY
            if isinstance(pinned, tuple):
                claiming = _Claiming(rank, claim_wait_s, stop)
                return cls._pinned(layout, snap_id, pinned, job=job, nonce=nonce, ranks=ranks, claiming=claiming)
            if creating and pinned is None and not os.path.lexists(lock_path):
                return None
            now = time.monotonic()
            if stop is not None and stop.is_set():
                raise SnapshotError(f"stopped waiting for snapshot {snap_id!r}: the trainer is closing")
            if pinned is _BUSY and now > busy_deadline:
                raise SnapshotError(
                    f"snapshot {snap_id!r} in {layout.snapshots} stayed locked by another process for "
                    f"{now - started:.0f}s: is a process that removes snapshots stopped or hung?"
                )
            if pinned is None and was_busy and now > deadline:
                raise SnapshotError(
                    f"snapshot {snap_id!r} was removed from {layout.snapshots} while another process held its lock"
                )
            if pinned is None and now > deadline:
                raise SnapshotError(
                    f"snapshot {snap_id!r} did not appear in {layout.snapshots} within {timeout_s:g}s: "
                    "is the rank that creates it (local rank 0) running, and reading the same epoch as this one? "
                    "(a rank an epoch behind the others finds that epoch released)"
                )
            if stop is not None:
                stop.wait(0.02)
            else:
                time.sleep(0.02)

    @classmethod
    def _pinned(
        cls,
        layout: CacheLayout,
        snap_id: str,
        pinned: tuple[int, dict[str, object]],
        *,
        job: str | None,
        nonce: str | None,
        ranks: int,
        claiming: _Claiming,
    ) -> Snapshot:
        """The joined snapshot, once ``job``, ``nonce`` and ``ranks`` match and ``claiming`` claimed its rank
        (``join``); else the pin is dropped and ``SnapshotError`` (``RankClaimedError``) says why."""
        fd, manifest = pinned
        snapshot = cls(layout, snap_id, fd, manifest)
        for what, mine, theirs in (("job", job, snapshot.job), ("nonce", nonce, snapshot.nonce)):
            if mine is not None and mine != theirs:
                snapshot.release()
                raise SnapshotError(
                    f"snapshot {snap_id!r} belongs to {what} {theirs!r}, not {mine!r}: "
                    "it is not this job's snapshot, so it is not joined"
                )
        if ranks and snapshot.ranks and ranks != snapshot.ranks:
            snapshot.release()
            raise SnapshotError(
                f"snapshot {snap_id!r} is split among {snapshot.ranks} local ranks by the rank that created "
                f"it, and this rank counts {ranks}: give every rank of the job the same world_size"
            )
        try:  # before LEFT goes: a refused resume does not take the snapshot back
            snapshot._claim = claiming.claim(snapshot.directory, snap_id, ranks or snapshot.ranks)
        except SnapshotError:
            snapshot.release()
            raise
        if nonce is not None:
            with contextlib.suppress(OSError):  # not there, or not ours to remove: its releaser decides
                (snapshot.directory / LEFT).unlink(missing_ok=True)
        return snapshot

    # -- growing (NOTE [ Growing snapshots ]) ------------------------------------------------------------------

    def grow(self, *, close: bool = False) -> int:
        """Creator only: pin the segments published since the last generation as a new one, in publication order
        and within the daemon's epoch room (``room.py``; a full room closes the snapshot); with ``close``, end the
        growth. Returns the number of segments added. A no-op on a closed snapshot.

        An unread-first snapshot (``wants``) takes only segments no epoch has read nor is reading, and one closed
        with fewer than ``wants`` samples gets a last generation of the least-read others (``room.top_up``), its
        index in ``topup_from``."""
        if self._lock_fd is None or os.getpid() != self._owner_pid:
            raise SnapshotError(f"snapshot {self.snap_id}: only its holding creator grows it")
        if not self.is_open:
            return 0
        have = set(self.names)
        room = room_now(self.layout)
        if room and self._grown_bytes is None:  # once: later looks add what they link
            self._grown_bytes = sum(allocated_bytes(os.lstat(self.directory / name)) for name in self.names)
        pinned = self._grown_bytes or 0
        listed = self.layout.list_segments()
        unseen = [(name, info) for name, info in listed if name not in have and name not in self._passed]
        reads: Mapping[str, Counts] = {}
        if self.wants is None:
            reads = read_counts(self.layout.root)
        elif unseen or close:  # nothing new to look at: no ledger to read (every 50 ms while nothing is published)
            reads = reads_with_receipts(self.layout.root, self.layout.snapshots)
            unseen = self._unread(unseen, reads)
        new: dict[str, int] = {}  # name: allocated bytes
        for name, info in unseen:
            if room is not None and pinned + allocated_bytes(info) > room:
                close = True  # the epoch's room is full (``room.py``): the rest is for the next epoch
                break
            new[name] = allocated_bytes(info)
            pinned += new[name]
        # a copy, kept once the MANIFEST names what it adds: a grow that fails after linking leaves the links, which
        # the next grow links again (a copy updated then would take them for the same part fetched again)
        versions = dict(self._linked_versions()) if new or close else None
        entries, fresh = _link_entries(self.layout, self.directory, list(new), reads, versions=versions)
        for name in set(new).difference(str(entry[0]) for entry in entries):  # gone, or holding what it holds
            self._passed.add(name)
            pinned -= new[name]
        segments: list[object] = [*self._manifest.get("segments", []), *entries]  # type: ignore[misc]
        generations = list(self.generations or ())
        if entries or not generations:
            generations.append(len(segments))
        added = len(entries)
        samples = self.samples + sum(int(entry[1]) for entry in entries)  # type: ignore[call-overload]
        topup_from = None
        if close and self.wants is not None and samples < self.wants:
            pending = _pending_reads(self.layout, ())
            taken = have.union(new)
            candidates = _candidates(self.layout, [(n, i) for n, i in listed if n not in taken], reads, pending)
            need, left = self.wants - samples, None if room is None else room - pinned
            pick = lambda rest, room_left, linked: top_up(rest, need - linked, room_left)  # noqa: E731
            topping, _fresh = _link_picks(
                self.layout, self.directory, candidates, pick, room=left, reads=reads, versions=versions
            )
            if topping:
                topup_from = len(generations)
                segments += topping
                generations.append(len(segments))
                added += len(topping)
                pinned += sum(allocated_bytes(os.lstat(self.directory / str(entry[0]))) for entry in topping)
        if self._grown_bytes is not None:
            self._grown_bytes = pinned
        if not added and not close:
            return 0
        manifest = dict(self._manifest)
        manifest["fresh"] = int(manifest.get("fresh", 0)) + fresh  # type: ignore[call-overload]
        manifest["segments"] = segments
        manifest["generations"] = generations
        manifest["open"] = not close
        if "left_out" in manifest:  # named sources: what this growth saw listed and did not pin
            pinned_names = [str(entry[0]) for entry in segments]  # type: ignore[index]
            manifest["left_out"] = _left_out(self.layout, listed, pinned_names)
        if topup_from is not None:
            manifest["topup_from"] = topup_from
        atomic_write(self.directory / MANIFEST, msgpack.packb(manifest), mode=0o640)
        self._load(manifest)
        if versions is not None:
            self._versions = versions
        return added

    def _linked_versions(self) -> dict[str, Linked]:
        """The objects whose samples the snapshot's segments hold (their source lists): each one's version and the
        cuts of its linked segments, read once from the segments linked so far; ``_link_entries`` adds what growth
        links after.

        Why: while an epoch grows, the daemon may publish samples of an object the snapshot holds already. The remote
        overwrote it (the daemon retires the segments of its old samples and fetches the new version), or it shared
        a retired segment (fetched again whole, same version). A growing snapshot that took those samples as well
        would serve the object's keys twice in one epoch, with two contents where it changed. So growth passes over
        a segment holding another version of an object it holds, or the same part of one (a segment of the same cut:
        the one holding its last sample, where it is fetched again); the segment's other samples wait for the next
        epoch. Not seen: an object fetched again and cut across segments elsewhere than before (its first part may be
        served twice), and an object a segment had no room to name (source lists are best effort)."""
        if self._versions is None:
            self._versions = {}
            for name in self.names:
                _add_versions(self._versions, _segment_sources(self.directory / name))
        return self._versions

    def _unread(
        self, unseen: list[tuple[str, os.stat_result]], reads: Mapping[str, Counts]
    ) -> list[tuple[str, os.stat_result]]:
        """Of ``unseen`` (published, not linked, not looked at before), those no epoch has read nor is reading; the
        others are passed over for good (this process's growth does not look at them again)."""
        if not unseen:
            return unseen
        pending = _pending_reads(self.layout, ())
        kept = []
        for name, info in unseen:
            counts = reads.get(name)
            if name in pending or (counts is not None and bool(counts.any())):
                self._passed.add(name)
            else:
                kept.append((name, info))
        return kept

    def seal(self) -> None:
        """Creator only: end the growth with the segments the snapshot has (no new ones linked): the way out when
        ``grow(close=True)`` fails. A no-op on a closed snapshot."""
        if self._lock_fd is None or os.getpid() != self._owner_pid:
            raise SnapshotError(f"snapshot {self.snap_id}: only its holding creator seals it")
        if not self.is_open:
            return
        manifest = dict(self._manifest)
        generations = list(self.generations or ())
        if not generations or generations[-1] != len(self.names):
            generations.append(len(self.names))
        manifest["generations"] = generations
        manifest["open"] = False
        atomic_write(self.directory / MANIFEST, msgpack.packb(manifest), mode=0o640)
        self._load(manifest)

    def refresh(self) -> bool:
        """Joiners: read the MANIFEST again if its creator grew or closed it since; True if anything changed."""
        if not self.is_open:
            return False
        path = self.directory / MANIFEST
        try:
            seen = file_version(path)
            if seen is not None and seen == self._manifest_stat:
                return False
            manifest = msgpack.unpackb(path.read_bytes(), raw=False)
        except (OSError, ValueError) as exc:
            raise SnapshotError(f"snapshot {self.snap_id}: its MANIFEST could not be read again: {exc}") from None
        before = (len(self.names), self.is_open)
        self._load(manifest)
        self._manifest_stat = seen
        return (len(self.names), self.is_open) != before

    def _load(self, manifest: dict[str, object]) -> None:
        """Take a grown MANIFEST's segments and state (same id, job and nonce)."""
        entries = manifest.get("segments", [])
        if not isinstance(entries, list):
            raise SnapshotError(f"snapshot {self.snap_id}: malformed MANIFEST")
        self.names = tuple(str(entry[0]) for entry in entries)
        self.counts = tuple(int(entry[1]) for entry in entries)
        self.reads = tuple(int(entry[2]) if len(entry) > 2 else 0 for entry in entries)
        self.tags = tuple(int(entry[3]) if len(entry) > 3 else 0 for entry in entries)
        left_out = manifest.get("left_out")
        self.left_out = frozenset(int(tag) for tag in left_out) if isinstance(left_out, list) else None
        self._above = tuple(bytes(entry[4]) if len(entry) > 4 else b"" for entry in entries)
        generations = manifest.get("generations")
        self.generations = tuple(int(g) for g in generations) if isinstance(generations, list) else None
        self.is_open = bool(manifest.get("open", False))
        wants, topup_from = manifest.get("wants"), manifest.get("topup_from")
        self.wants = int(wants) if isinstance(wants, int) else None
        self.topup_from = int(topup_from) if isinstance(topup_from, int) else None
        self._manifest = manifest

    # -- reads and release ----------------------------------------------------------------------------------

    def touch(self) -> None:
        """Show that an epoch is reading this snapshot: sets its lock file's mtime to now, which the daemon reads
        to tell a trainer that is slow but reading (paced: normal) from one that stopped (a stuck reader, a
        fault). Trainers call it every few seconds while batches flow; best effort (a rank that may not write the
        creator's lock file is silently skipped: another rank's touch counts for the snapshot)."""
        if self._lock_fd is not None and os.getpid() == self._owner_pid:
            try:
                os.utime(self._lock_fd)
            except OSError:
                pass

    def mark_ahead(self) -> None:
        """Mark this snapshot as pinned ahead of its epoch, not begun (NOTE, "Begun epochs"); its creator calls it
        while it holds the pin. Best effort: unmarked, it is kept for a resume as any snapshot of a dead trainer."""
        if self._lock_fd is None:
            return
        try:
            os.close(open_regular_for_write(self.directory / AHEAD, 0o640))
        except OSError:
            pass

    def mark_started(self) -> None:
        """Say that a training loop took a batch of this epoch, so a checkpoint may name it (NOTE, "Begun epochs"):
        the ``AHEAD`` mark goes. Where it cannot be removed, the snapshot of a trainer that dies is removed without a
        grace, and its resume takes the fresh-snapshot path (its warning says so)."""
        with contextlib.suppress(OSError):
            os.unlink(self.directory / AHEAD)

    def record_served(self, served: npt.NDArray[np.int64]) -> None:
        """Record that this process served the samples ``served`` (indices in dataset order) of this epoch: they
        count one more read once the snapshot is removed by its last holder (NOTE [ Read receipts ] in
        ``reads.py``). Any rank may call it, more than once; the epoch's union counts, once per sample."""
        if self._lock_fd is None:
            raise SnapshotError(f"snapshot {self.snap_id} was released: record what it served before releasing it")
        write_served(self.directory, served, self.samples)

    def release(self) -> None:
        """Drop this process's pin; its rank claim stays held, pinless, while this process lives and the snapshot
        exists (NOTE, "Rank claims": a rank done with its share is no predecessor to take it over). The last holder
        removes the snapshot (idempotent)."""
        claim, self._claim = self._claim, None
        if claim is not None:
            _drop_claim(claim, keep=True)
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        if os.getpid() != self._owner_pid:
            # A forked child shares the parent's open lock: touching it would drop or convert the parent's pin. Its
            # copy was closed at the fork (NOTE, "Forks"): the number may be another file's, even a pin of its own.
            return
        try:
            self._remove_if_last(fd)
        finally:
            _close_pin(fd)
            _prune_kept_claims()  # this release may have removed the snapshot, its claim files with it

    def leave_for_resume(self) -> None:
        """Drop this process's pin without removing the snapshot, as a process that dies does: the daemon keeps an
        unheld snapshot for ``cache.snapshot_grace`` (a restarted job resumes on it exactly), then removes it,
        turning what was recorded as served into its receipt. Only where a daemon holds the cache: nothing else
        would ever remove it. Idempotent, as ``release``.

        Other ranks holding the snapshot release it as usual, but the last of them does not remove it: ``LEFT``
        marks it (NOTE, "Leaving for a resume"). Where the mark cannot be written, the pin is dropped all the same
        (the snapshot then goes with its last holder, and a resume reads a fresh one: its warning says so). The rank
        claim goes first: the resumed rank, in this process or another, claims it again."""
        if os.getpid() != self._owner_pid:  # inherited across a fork: not this process's pin (NOTE, "Forks")
            self._claim, self._lock_fd = None, None
            return
        self._unclaim()
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        try:
            os.close(open_regular_for_write(self.directory / LEFT, 0o640))
        except OSError:
            pass
        finally:
            _close_pin(fd)

    def _unclaim(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            _drop_claim(claim)

    def _remove_if_last(self, fd: int) -> None:
        """Remove the snapshot if this holder is the last and no rank left it for a resume (module docstring,
        "Removal" and "Leaving for a resume").

        Converting our shared lock to exclusive drops it first (flock(2)). Where that fails, the lock is held by
        other ranks still reading (shared: the last of them removes it) or, for an instant, exclusively by the
        daemon's sweep probing it, which would find it unheld and keep it for a resume, so that the epoch's
        receipt and pin would wait out ``snapshot_grace``. Taking it shared tells the two apart: where that fails
        too, the holder is exclusive, and this releaser looks again a few milliseconds later.
        """
        lock_path = self.layout.snapshots / f"{self.snap_id}.lock"
        left = self.directory / LEFT

        def keep(_snap_id: str) -> bool:  # a rank left it for a resume: the daemon's sweep keeps it for the grace
            return left.exists()

        for delay in (*_RELEASE_RETRIES_S, None):
            if _remove_if_unheld(fd, lock_path, self.directory, keep=keep) is not None:
                return  # removed, or not ours to remove any more
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held exclusively: a sweep's probe, or a remover
                if delay is not None:
                    time.sleep(delay)
                continue
            _remove_if_unheld(fd, lock_path, self.directory, keep=keep)  # shared by other ranks, or nobody
            return

    @property
    def is_held(self) -> bool:
        return self._lock_fd is not None

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __del__(self) -> None:
        if getattr(self, "_lock_fd", None) is not None:
            self.release()

    def __reduce__(self) -> str:
        raise TypeError("a Snapshot holds a lock and cannot be pickled; pass snap_id and names instead")


def _pending_reads(layout: CacheLayout, reading: Collection[str]) -> frozenset[str]:
    """The segments a read is on its way for: ``reading`` and those of every live snapshot (an epoch reading it, or
    one being released whose receipt is not written yet). Looked at *before* the receipts: a snapshot released
    meanwhile has renamed its receipt into place before its directory goes (NOTE [ Read receipts ], step 2), so
    its read is seen here, in a receipt or in the ledger, never missed."""
    return frozenset(reading).union(*(info.names for info in live_snapshots(layout)))


def _room_candidates(
    layout: CacheLayout,
    listed: list[tuple[str, os.stat_result]],
    reads: Mapping[str, Counts],
    pending: Collection[str],
    weights: Mapping[int, float],
) -> list[Candidate]:
    """The published segments (``listed``) as candidates of ``room.choose``: reads level, pending read and, where
    sources are weighed, source tag and samples (read from the segment's trailer only then)."""
    candidates = []
    for name, info in listed:
        counts = reads.get(name)
        level = int(counts.min()) if counts is not None and len(counts) else 0
        samples, tag = segment_trailer(layout.segments / name) if weights else (0, 0)
        candidates.append(
            Candidate(segment_seq(name), allocated_bytes(info), level, tag, name in pending, max(samples, 0))
        )
    return candidates


def _left_out(layout: CacheLayout, listed: list[tuple[str, os.stat_result]], pinned: Collection[str]) -> list[int]:
    """The source tags (ascending) of the ``listed`` segments not ``pinned`` that still hold samples (MANIFEST
    ``left_out``, ``Snapshot.left_out``). A segment evicted since the listing is no longer cached: not counted. One
    trailer read per segment left out."""
    taken = set(pinned)
    tags = set()
    for name, _info in listed:
        if name not in taken:
            count, tag = segment_trailer(layout.segments / name)
            if count > 0:
                tags.add(tag)
    return sorted(tags)


def _link_picks(
    layout: CacheLayout,
    directory: Path,
    candidates: list[Candidate],
    pick: Pick,
    *,
    room: int | None,
    reads: Mapping[str, Counts],
    reading: Collection[str] = (),
    versions: dict[str, Linked] | None = None,
) -> tuple[list[list[object]], int]:
    """Link the segments ``pick`` chooses of ``candidates`` within ``room`` into ``directory``: their MANIFEST
    entries, oldest first, and their fresh samples (``_link_entries``, with ``versions``).

    A segment may be evicted between the listing and its link: any read segment may go at any moment, and the
    least-read read ones, which a snapshot short of unread samples takes, are the very ones the daemon evicts next.
    So ``pick`` is asked again with the candidates not tried yet, the room left and the samples linked so far,
    until all it picks are linked or it picks nothing. Without this a snapshot took fewer samples than its choice
    counted on, and an epoch of a set size served some samples twice to make up its size.
    """
    nbytes = {c.seq: c.nbytes for c in candidates}
    entries: list[list[object]] = []
    fresh, samples = 0, 0
    while candidates:
        picked = pick(candidates, room, samples)
        if not picked:
            break
        taken = set(picked)
        candidates = [c for c in candidates if c.seq not in taken]
        linked, linked_fresh = _link_entries(
            layout, directory, [segment_name(seq) for seq in picked], reads, reading, versions=versions
        )
        entries += linked
        fresh += linked_fresh
        samples += sum(int(entry[1]) for entry in linked)  # type: ignore[call-overload]
        if room is not None:
            room -= sum(nbytes[segment_seq(str(entry[0]))] for entry in linked)
        if len(linked) == len(picked):
            break
    entries.sort(key=lambda entry: str(entry[0]))  # names are zero-padded sequence numbers: oldest first
    return entries, fresh


def _candidates(
    layout: CacheLayout, listed: list[tuple[str, os.stat_result]], reads: Mapping[str, Counts], pending: Collection[str]
) -> list[Candidate]:
    """``listed`` segments as candidates with their samples and whether any was read (``unread_first``, ``top_up``);
    a segment that vanished or is empty is left out. Samples from the reads where known (one count per sample),
    else from the segment's trailer."""
    candidates = []
    for name, info in listed:
        counts = reads.get(name)
        samples = len(counts) if counts is not None and len(counts) else segment_trailer(layout.segments / name)[0]
        if samples <= 0:
            continue
        level = int(counts.min()) if counts is not None and len(counts) else 0
        untouched = counts is None or not bool(counts.any())
        candidates.append(
            Candidate(segment_seq(name), allocated_bytes(info), level, 0, name in pending, samples, untouched)
        )
    return candidates


def _new_lock(layout: CacheLayout, snap_id: str) -> int | None:
    """A born-locked ``<id>.lock`` (NOTE: made as a partial, locked shared, then linked), owned by this process: its
    descriptor, or None where a live snapshot has that name (join it)."""
    lock_path = layout.snapshots / f"{snap_id}.lock"
    partial = layout.snapshots / f".{snap_id}.{os.getpid()}.{secrets.token_hex(4)}.partial"
    fd = _open_pin(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "created": time.time()}
        os.write(fd, json.dumps(owner).encode())
        if not _link_lock(partial, lock_path, layout.snapshots / snap_id):
            return None
        linked, fd = fd, -1
        return linked
    finally:
        os.unlink(partial)
        if fd >= 0:
            _close_pin(fd)


def _link_lock(partial: Path, lock_path: Path, directory: Path) -> bool:
    """Give the born-locked ``partial`` its public name. False if a live snapshot of that id exists (join it).

    A lock of that name that nobody holds is a leftover (say, of a restarted job reusing its run id): remove it
    (see the NOTE: whoever gets the exclusive lock may) and take the name.
    """
    for _attempt in range(2):
        try:
            os.link(partial, lock_path)
            return True
        except FileExistsError:
            try:
                fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                continue
            try:
                if not _remove_if_unheld(fd, lock_path, directory):
                    return False
            finally:
                os.close(fd)
    return False


def _link_entries(
    layout: CacheLayout,
    directory: Path,
    names: list[str],
    reads: Mapping[str, Counts],
    reading: Collection[str] = (),
    *,
    versions: dict[str, Linked] | None = None,
) -> tuple[list[list[object]], int]:
    """Hard-link the published segments ``names`` into ``directory``; their MANIFEST entries (name, samples, reads
    level, source tag, reads above the level) and how many of their samples are fresh (no epoch has read them nor
    is reading them: ``room.py``). A segment evicted meanwhile, or empty, is left out. A link already there to the
    same file is kept: a grower killed between linking and writing its MANIFEST left it (the resumed one links on).

    With ``versions`` (a growing snapshot's, ``Snapshot._linked_versions``), a segment holding samples the
    snapshot holds already (another version of an object, or the same part of one) is left out too, and what is
    linked is added."""
    entries: list[list[object]] = []
    fresh = 0
    for name in names:
        try:
            os.link(layout.segments / name, directory / name, follow_symlinks=False)
        except FileNotFoundError:
            continue  # evicted between the listing and the link
        except FileExistsError:
            if not _same_file(layout.segments / name, directory / name):
                os.unlink(directory / name)  # not the published segment of that name: never read, replaced
                try:
                    os.link(layout.segments / name, directory / name, follow_symlinks=False)
                except FileNotFoundError:
                    continue
        count, tag = segment_trailer(directory / name)
        if count > 0 and versions is not None:
            sources = _segment_sources(directory / name)
            again = [source.path for source in sources if _holds_already(versions, source)]
            if again:
                log.info(
                    "a growing epoch passes over segment %s: it holds samples of %s (another version, or again),"
                    " which the epoch serves from an earlier segment; its other samples wait for the next epoch",
                    name,
                    again[0] if len(again) == 1 else f"{again[0]} and {len(again) - 1} more objects",
                )
                count = 0
            else:
                _add_versions(versions, sources)
        if count > 0:
            counts = reads.get(name)
            level, above = encode_reads(counts) if counts is not None and len(counts) == count else (0, b"")
            entries.append([name, count, level, tag, above])
            if (counts is None or not counts.any()) and name not in reading:
                fresh += count
        else:
            os.unlink(directory / name)
    return entries, fresh


def _segment_sources(path: Path) -> list[Source]:
    """The remote objects a segment names (its source list); none where it cannot be read (gone, or damaged:
    a reader of it refuses it anyway). Best effort as the list is: a segment that had no room to name an object
    does not name it."""
    try:
        reader = SegmentReader(path)
    except (OSError, CorruptRecordError):
        return []
    try:
        return reader.sources()
    except CorruptRecordError:
        return []
    finally:
        reader.close()


class Linked(NamedTuple):
    """An object a growing snapshot holds samples of (``Snapshot._linked_versions``): its version, and the cut of
    each linked segment holding some of them (None: the one holding its last sample)."""

    version: str | None
    cuts: frozenset[int | None]


def _holds_already(versions: Mapping[str, Linked], source: Source) -> bool:
    """Whether a segment naming ``source`` holds samples the snapshot of ``versions`` holds already: another
    version of the object, or the same part of it (the same cut) fetched again."""
    linked = versions.get(source.path)
    return linked is not None and (linked.version != source.version or source.cut in linked.cuts)


def _add_versions(versions: dict[str, Linked], sources: list[Source]) -> None:
    for path, version, cut in sources:
        linked = versions.get(path)
        versions[path] = Linked(version, frozenset({cut}) if linked is None else linked.cuts | {cut})


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samestat(os.stat(a, follow_symlinks=False), os.stat(b, follow_symlinks=False))
    except FileNotFoundError:
        return False


def _checked_layout(root: str | os.PathLike[str], snap_id: str) -> CacheLayout:
    if not SNAPSHOT_ID.match(snap_id):
        raise SnapshotError(f"snapshot id {snap_id!r}: expected letters, digits, '_', '.', '-' (at most 128)")
    layout = CacheLayout(Path(root))
    layout.check()
    return layout


def _try_pin(lock_path: Path, manifest_path: Path) -> tuple[int, dict[str, object]] | _Busy | None:
    """One attempt to join: a held lock on the inode the path still names, and a complete manifest; ``_BUSY`` if the
    snapshot is there but another process holds its lock exclusively (a sweep's probe, a removal); None if it is
    not there (yet, or any more)."""
    if not manifest_path.exists():
        return None
    try:
        fd = _open_pin(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        _close_pin(fd)
        return _BUSY
    try:
        if os.fstat(fd).st_ino != os.lstat(lock_path).st_ino:
            raise FileNotFoundError
        manifest = msgpack.unpackb(manifest_path.read_bytes(), raw=False)
    except (OSError, ValueError):  # gone, unreadable (another job's, say) or not msgpack: no pin kept either way
        _close_pin(fd)
        return None
    return fd, manifest


# How long a releaser waits before each look again while the lock is held exclusively: a sweep's probe holds it
# for microseconds, longer where the supervisor's thread loses the GIL or the core in between (the switch interval
# is 5 ms).
_RELEASE_RETRIES_S = (0.005, 0.02, 0.08)


def _remove_if_unheld(
    fd: int, lock_path: Path, directory: Path, *, keep: Callable[[str], bool] | None = None, snap_id: str = ""
) -> bool | None:
    """If nobody else holds the lock on ``fd`` (and ``keep`` does not keep it), remove the snapshot (directory
    first, then lock). True: removed; None: someone else holds the lock; False: not removed for another reason
    (kept, already removed by another, or not ours to remove)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return None
    if keep is not None and keep(snap_id):
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    try:
        if os.fstat(fd).st_ino != os.lstat(lock_path).st_ino:
            return False  # someone else already removed it
    except FileNotFoundError:
        return False
    try:
        _leave_receipt(directory)
        remove_tree(directory)
        lock_path.unlink(missing_ok=True)
    except PermissionError:
        return False  # another user's snapshot in a sticky directory: the daemon's sweep removes it
    return True


def _leave_receipt(directory: Path) -> None:
    """Hand what the epoch of the snapshot in ``directory`` served to the daemon as one receipt (NOTE [ Read
    receipts ], step 2): where a daemon holds the cache, or held it within ``DAEMON_RESTART_WINDOW_S`` (restarting: the
    next one collects it). Without a daemon for longer (a static cache) there is nobody to collect it: none."""
    if not CacheLayout(directory.parent.parent).had_writer_within(DAEMON_RESTART_WINDOW_S):
        return
    try:
        manifest = msgpack.unpackb((directory / MANIFEST).read_bytes(), raw=False)
        segments = [(str(entry[0]), int(entry[1])) for entry in manifest.get("segments", [])]
        nonce = str(manifest.get("nonce", "")) or secrets.token_hex(8)
    except (OSError, ValueError, TypeError, AttributeError, IndexError):
        return  # an incomplete snapshot was never read
    emit_receipt(directory, segments, nonce)


# -- rank claims (NOTE, "Rank claims") -----------------------------------------------------------------------------

_ClaimKey = tuple[int, int]  # a claim file's (st_dev, st_ino): one per claim while anyone holds it open
_claims: dict[_ClaimKey, list[int]] = {}  # this process's claims: [the locked descriptor, its pins that share it]
# Held while a claim's descriptor is opened, locked and recorded, or closed, and by the at-fork hooks: a fork never
# copies a claim's descriptor that ``_claims`` does not name. Reentrant: a Snapshot collected while this thread
# holds it drops its claim.
_claims_lock = threading.RLock()


@dataclass(frozen=True, slots=True)
class _Held:
    """``_take_claim``'s answer for a claim another live process holds: its file's key, for ``_claim_holder``."""

    key: _ClaimKey


@dataclass(frozen=True, slots=True)
class _Claiming:
    """What a pin claims (NOTE, "Rank claims"): local rank ``rank`` (None: none), tried again for up to ``wait_s``
    while another process holds it, or until ``stop`` is set."""

    rank: int | None
    wait_s: float = CLAIM_WAIT_S
    stop: threading.Event | None = None

    def claim(self, directory: Path, snap_id: str, ranks: int) -> _ClaimKey | None:
        """Claim ``rank`` of snapshot ``snap_id`` in ``directory`` (split among ``ranks``, for messages): the
        claim's key, or None where nothing is claimed (no rank; a directory this process may not write). While
        another process holds it, the wait is logged once and the claim tried every ``_CLAIM_POLL_S``; once
        ``wait_s`` passed, ``RankClaimedError`` names the holder and the wait. ``stop`` set: ``SnapshotError``."""
        if self.rank is None:
            return None
        started, said = time.monotonic(), False
        while True:
            claimed = _take_claim(directory, self.rank)
            if not isinstance(claimed, _Held):
                return claimed
            waited = time.monotonic() - started
            if waited >= self.wait_s:
                raise RankClaimedError(snap_id, self.rank, ranks, _claim_holder(claimed.key), waited)
            if not said:
                said = True
                log.warning(
                    "local rank %d of snapshot %r is held by %s: waiting up to %.0f s for it to let go (a rank "
                    "restarted while its predecessor exits), else this process is refused as a second one given "
                    "that rank",
                    self.rank,
                    snap_id,
                    _claim_holder(claimed.key),
                    self.wait_s,
                )
            self._pause(min(_CLAIM_POLL_S, self.wait_s - waited), snap_id)

    def _pause(self, seconds: float, snap_id: str) -> None:
        """Sleep ``seconds`` between two tries; ``SnapshotError`` at once where ``stop`` is set meanwhile."""
        if self.stop is None:
            time.sleep(seconds)
        elif self.stop.wait(seconds):
            raise SnapshotError(
                f"stopped waiting for local rank {self.rank} of snapshot {snap_id!r}: the trainer is closing"
            )


def _take_claim(directory: Path, rank: int) -> _ClaimKey | _Held | None:
    """Claim local rank ``rank`` of the snapshot in ``directory`` for this process, once: the claim's key (this
    process may hold it already: another of its pins shares it), ``_Held`` where another live process holds it, or
    None where this process may not claim there (it reads unclaimed). All under ``_claims_lock``: no fork happens
    between the open and the record (NOTE, "Rank claims")."""
    with _claims_lock:
        _prune_kept_claims()
        opened = _open_claim(directory / f"{RANK_CLAIM}{rank}")
        if opened is None:
            return None
        fd, key = opened
        held = _claims.get(key)
        if held is not None:
            held[1] += 1
            os.close(fd)
            return key
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return _Held(key)
        _claims[key] = [fd, 1]
        return key


def _open_claim(path: Path) -> tuple[int, _ClaimKey] | None:
    """The claim file at ``path``, made (empty) if need be, and its key; read-only where it is another user's; None
    where it cannot be opened or is not a regular file (planted)."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o640)
    except PermissionError:
        try:
            fd = os.open(path, os.O_RDONLY | flags)
        except OSError:
            return None
    except OSError:
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        return None
    return fd, (info.st_dev, info.st_ino)


def _claim_holder(key: _ClaimKey) -> str:
    """Who holds the claim whose file is ``key``, as the kernel's lock table says (``/proc/locks``): ``"pid N on
    HOST"``; ``"another process"`` where it does not say (no procfs, a holder outside this pid namespace, a lock of
    another host on a network filesystem)."""
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as table:
            pids = _exclusive_flockers(table.read().splitlines(), key)
    except OSError:
        return "another process"
    if len(pids) != 1 or 0 in pids:
        return "another process"
    return f"pid {pids.pop()} on {socket.gethostname()}"


def _exclusive_flockers(lines: list[str], key: _ClaimKey) -> set[int]:
    """The pids that ``/proc/locks`` ``lines`` say hold ``flock(LOCK_EX)`` on the file ``key`` (``1: FLOCK ADVISORY
    WRITE <pid> <major>:<minor>:<inode> 0 EOF``; waiters, ``->``, are not holders). A filesystem whose ``st_dev``
    is not the device the table names (a btrfs subvolume's) is matched on the inode alone."""
    same_device: set[int] = set()
    same_inode: set[int] = set()
    device = f"{os.major(key[0]):02x}:{os.minor(key[0]):02x}"
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1:4] != ["FLOCK", "ADVISORY", "WRITE"] or not fields[4].isdigit():
            continue
        where, _, inode = fields[5].rpartition(":")
        if inode == str(key[1]):
            same_inode.add(int(fields[4]))
            if where == device:
                same_device.add(int(fields[4]))
    return same_device or same_inode


def _drop_claim(key: _ClaimKey, *, keep: bool = False) -> None:
    """One pin of this process no longer needs its claim: the last one closes the claim's descriptor (the kernel
    drops the lock with it), under ``_claims_lock`` as it was opened; with ``keep`` (a rank done with its share)
    the descriptor stays open and locked, with no pin, until the claim file is removed (``_prune_kept_claims``)
    or this process ends. A forked child's claims were closed at the fork: nothing to do."""
    with _claims_lock:
        held = _claims.get(key)
        if held is None:
            return
        held[1] = max(0, held[1] - 1)
        if held[1] > 0 or keep:
            return
        del _claims[key]
        os.close(held[0])


def _prune_kept_claims() -> None:
    """Close the kept claims (no pin) whose file is gone: its snapshot was removed, and nobody can claim it."""
    with _claims_lock:
        for key, (fd, pins) in list(_claims.items()):
            if pins:
                continue
            try:
                gone = os.fstat(fd).st_nlink == 0
            except OSError:
                gone = True  # not a descriptor we can ask: nothing to keep
            if gone:
                del _claims[key]
                with contextlib.suppress(OSError):
                    os.close(fd)


# -- pins across a fork (NOTE, "Forks") ------------------------------------------------------------------------------

_pin_fds: set[int] = set()  # this process's pin descriptors: opened and recorded under ``_claims_lock``


def _open_pin(path: Path, flags: int, mode: int = 0o777) -> int:
    """``os.open`` for a pin's lock: recorded under the lock the at-fork hooks take, so that no fork copies a
    descriptor the child does not know of (NOTE, "Forks")."""
    with _claims_lock:
        fd = os.open(path, flags, mode)
        _pin_fds.add(fd)
    return fd


def _close_pin(fd: int) -> None:
    """Close a pin's descriptor this process opened; nothing for one a forked child inherited: the child closed
    its copy at the fork, and the number may be another file's by now."""
    with _claims_lock:
        if fd in _pin_fds:
            _pin_fds.discard(fd)
            os.close(fd)


def _claims_before_fork() -> None:
    _claims_lock.acquire()


def _claims_in_parent() -> None:
    _claims_lock.release()


def _claims_in_child() -> None:
    """A forked child closes its copies of the parent's claims and pins: a copy would hold the claim after the parent
    let it go (a rank that goes back to an epoch, or restarts, would find its own rank taken), or the pin (NOTE,
    "Forks")."""
    global _claims_lock
    for fd, _pins in _claims.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _claims.clear()
    _claims_lock = threading.RLock()  # the parent's is held by the forking thread
    fds = list(_pin_fds)
    _pin_fds.clear()  # first: a Snapshot collected in the loop finds nothing to close
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


os.register_at_fork(before=_claims_before_fork, after_in_parent=_claims_in_parent, after_in_child=_claims_in_child)


# -- the daemon's side ------------------------------------------------------------------------------------------


def sweep_stale(
    layout: CacheLayout, *, now: float | None = None, keep: Callable[[str], bool] | None = None
) -> list[str]:
    """Remove snapshots whose holders are all gone, orphan directories and stale partial locks.

    ``keep(snap_id)`` is asked about each snapshot nobody holds; True leaves it for now (a dead trainer's epoch,
    kept for its job to resume). Safe to run at any time, concurrently with trainers (see the NOTE). Returns the
    removed snapshot ids.
    """
    removed: list[str] = []
    now = time.time() if now is None else now
    locks: set[str] = set()
    try:
        entries = list(os.scandir(layout.snapshots))
    except FileNotFoundError:
        return removed
    for entry in entries:
        name = entry.name
        if name.endswith(".lock") and SNAPSHOT_ID.match(name[:-5]):
            snap_id = name[:-5]
            locks.add(snap_id)
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):  # a planted FIFO or device: never a lock of ours
                    Path(entry.path).unlink(missing_ok=True)
                    continue
                if _remove_if_unheld(fd, Path(entry.path), layout.snapshots / snap_id, keep=keep, snap_id=snap_id):
                    removed.append(snap_id)
            finally:
                os.close(fd)
        elif name.endswith(".partial"):
            try:
                info = entry.stat(follow_symlinks=False)
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                if now - info.st_mtime > PARTIAL_GRACE_S:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.unlink(entry.path)
            except (BlockingIOError, FileNotFoundError):
                pass
            finally:
                os.close(fd)
    for entry in entries:
        if entry.name.endswith((".lock", ".partial", RECEIPT_SUFFIX)) or entry.name in locks:
            continue  # receipts are the daemon's to consume (reads.py)
        if (layout.snapshots / f"{entry.name}.lock").exists():
            continue  # its creator linked the lock after our listing: live (the lock comes before the dir)
        # a foreign entry, or a directory whose lock is gone: garbage by the protocol
        remove_tree(entry.path)
    return removed


def was_started(layout: CacheLayout, snap_id: str) -> bool:
    """Whether the snapshot may be named by a checkpoint: not marked ``AHEAD`` (NOTE, "Begun epochs"), so a sweep
    keeps it for a resume. True where it cannot tell (keep it)."""
    try:
        os.lstat(layout.snapshots / snap_id / AHEAD)
    except OSError:  # not marked (or cannot tell)
        return True
    return False


def sweep_unwatched(layout: CacheLayout, *, grace_s: float, now: float | None = None) -> list[str]:
    """``sweep_stale`` for a cache no daemon holds (a static cache), run by a trainer as its factory starts: a
    snapshot nobody holds is kept while its lock was touched (created, or read from: ``Snapshot.touch``) within
    ``grace_s``, as the daemon keeps a dead trainer's for ``cache.snapshot_grace``, then removed. Without it a
    trainer that died left its snapshot directory on a static cache for good. A cache this process may not change
    (a read-only dataset directory) is left as it is. Returns the removed snapshot ids."""
    now = time.time() if now is None else now

    def touched_lately(snap_id: str) -> bool:
        if not was_started(layout, snap_id):
            return False  # an epoch prepared ahead and never read: no resume joins it
        try:
            return now - os.stat(layout.snapshots / f"{snap_id}.lock").st_mtime < grace_s
        except OSError:
            return True  # cannot tell: keep it

    try:
        return sweep_stale(layout, now=now, keep=touched_lately)
    except OSError:
        return []


def pinned_inodes(layout: CacheLayout) -> dict[int, int]:
    """Inode -> allocated bytes of every segment linked from any snapshot directory."""
    found: dict[int, int] = {}
    try:
        directories = [e for e in os.scandir(layout.snapshots) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return found
    for directory in directories:
        for _name, info in list_regular(Path(directory.path), SEGMENT_NAME):
            found[info.st_ino] = allocated_bytes(info)
    return found


def live_snapshots(layout: CacheLayout, *, count_records: bool = False) -> list[SnapshotInfo]:
    """Complete snapshots and their owners, for status and the daemon's pin scan (does not take any lock).

    ``count_records``: count each one's served records (``served.*``, NOTE [ Read receipts ] in ``reads.py``), for
    the budget's charge of those its ranks have yet to write (``store.py``): one listing of its directory, names
    only, no file read (the daemon's scan runs twice a second); else ``served_records`` is 0."""
    infos: list[SnapshotInfo] = []
    for lock_name, _info in list_regular(layout.snapshots, SNAPSHOT_ID):
        if not lock_name.endswith(".lock"):
            continue
        snap_id = lock_name[:-5]
        try:
            manifest = msgpack.unpackb((layout.snapshots / snap_id / MANIFEST).read_bytes(), raw=False)
            owner = json.loads((layout.snapshots / lock_name).read_text() or "{}")
            active_at = os.stat(layout.snapshots / lock_name).st_mtime
        except (OSError, ValueError):
            continue
        segments = manifest.get("segments", [])
        infos.append(
            SnapshotInfo(
                snap_id=snap_id,
                samples=sum(int(entry[1]) for entry in segments),
                segments=len(segments),
                owner=f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}",
                created=float(manifest.get("created", 0.0)),
                names=tuple(str(entry[0]) for entry in segments),
                active_at=active_at,
                fresh=int(manifest["fresh"]) if isinstance(manifest.get("fresh"), int) else None,
                is_open=bool(manifest.get("open", False)),
                ranks=int(manifest["ranks"]) if isinstance(manifest.get("ranks"), int) else 0,
                served_records=_served_records(layout.snapshots / snap_id) if count_records else 0,
            )
        )
    return infos


def _served_records(directory: Path) -> int:
    """The served records in a snapshot's ``directory``, by name (a record being written is a ``.partial`` still,
    not counted: the charge for it stands until it is in place and measured)."""
    try:
        with os.scandir(directory) as entries:
            return sum(1 for entry in entries if entry.name.startswith(SERVED_PREFIX))
    except (FileNotFoundError, NotADirectoryError):
        return 0  # removed since its MANIFEST was read
