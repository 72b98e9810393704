"""Epochs over a growing set: an epoch starts on what is cached and takes segments as they are published.

A cold job used to wait until the cache held ``min_samples`` (75% of what the daemon keeps) before its first batch.
Now, by default, its first epoch starts as soon as every worker has a segment to read and keeps taking segments
as the daemon publishes them, until the epoch has its samples (``samples_per_epoch``) or the daemon can fill no
further (its fill level reached, it waits for trainers, it holds everything the remote lists, or no daemon runs:
none has held the cache's lock for ``lifecycle.RESTART_GRACE_S``, so a restarted daemon fills on).
A later epoch of a set size grows too while the cache fills ("Later epochs" in the NOTE).

NOTE [ Growing snapshots ]
--------------------------
Threads and processes: the snapshot's *creator* (local rank 0's factory) runs one ``Grower`` thread; every local
rank (the creator included) reads the snapshot through a ``GrowingEpoch`` on its training thread (and, with
workers, its pool's workers read the segments).

* The snapshot is created open (``Snapshot.create(growing=True)``): its MANIFEST carries ``generations`` (the
  number of segments at the end of each generation) and ``open``. The grower links the segments published since
  the last generation (``Snapshot.grow``) every ``GROW_EVERY_S`` and rewrites the MANIFEST atomically; entries are
  only appended, so a sample's index in the snapshot never changes. The grower closes the snapshot (a last
  generation, ``open`` false) once the epoch has its samples or the daemon can fill no further, and when its epoch
  is released.
* A rank's share is computed **per generation**, never from when the rank looked: generation ``g``'s samples are
  shuffled with a generator seeded by ``(seed, epoch, g)``, appended to the carry of the previous generations,
  and split equally among the local ranks; what does not divide (fewer than ``local_world_size`` samples) is
  carried to the next generation, and dropped when the snapshot closes. So every rank computes the same split from
  the same MANIFEST: disjoint, equal in size, each sample once, and a resumed epoch recomputes the same order.
* A rank needing more batches re-reads the MANIFEST (``Snapshot.refresh``) and waits for growth; batches are cut
  only when full, the last partial one only once the snapshot is closed. The creator's own rank waits on its
  grower (``Grower.want``): from then on the grower looks at each segment the daemon publishes and at each status
  document it writes (inotify, ``wait.watch_publishes``), not only every ``GROW_EVERY_S``, and the rank wakes at
  the grower's next change. So a rank that waits for the daemon sees a segment within milliseconds of its publish
  (a cold job's first batch, and the end of its first epoch); a rank with batches left to read leaves the grower
  to its tick, which costs the training process less (a publish then only marks itself seen; the observer hears
  publishes, never the reads of the cache's files). Other local ranks re-read the MANIFEST every
  ``GROW_EVERY_S / 2`` while they wait.
* An object is served in one version, once: growth passes over a segment holding samples of an object the
  snapshot holds already in another version, or the same part of one (the remote overwrote it, or it shared a
  retired segment, and the daemon fetched it again: ``Snapshot._linked_versions``).
* ``len(loader)`` of a growing epoch is an estimate until the snapshot closes (``samples_per_epoch``: exact from
  the start); the factory prepares the next epoch only once the growing one is closed.

Later epochs (``samples_per_epoch`` set, built while the daemon has not filled the cache to its level:
``fill_reached``; the first epoch's other conditions, ``min_samples`` unset included). Without growth such an
epoch read a snapshot of what was cached: where fewer unread samples were cached than it needs, it re-read samples
earlier epochs had served while the remote was delivering fresh ones. Instead:

* Its snapshot is *unread-first* (``Snapshot.create(wants=...)``, MANIFEST ``wants``): it pins only segments no
  epoch has read nor is reading (``room.unread_first``: the previous epoch, still being read, counts as reading),
  and grows by unread segments only. It is created closed when those hold ``wants`` samples (``samples_per_epoch
  + local_world_size - 1``: every rank's quota, the carry included): then nothing waits and nothing grows. So a
  later epoch grows only while the cache holds fewer unread samples than the epoch needs.
* Its growth ends when the epoch has its samples, when the daemon can fill no further (as the first epoch's), or
  when the creator's loop caught up with ingest (``GrowingEpoch.pause``: it would wait for the remote; another
  local rank that caught up waits for the creator's, a step away at most in lockstep training). Closed
  short of ``wants``, the snapshot gets a last generation of the least-read other segments (``room.top_up``, as
  many samples as it lacks; MANIFEST ``topup_from``). Those are read segments the daemon may evict at any moment:
  one evicted before its link is replaced by the next choice (``snapshots._link_picks``), so the top-up holds what
  the epoch lacks whenever the cache does. The ranks draw what they lack from it and the carry as a
  set-size epoch draws (``partition.fixed_size_order``: least-read first; seeded by ``(seed, epoch)``, so every
  rank and a resumed run draw the same) and each takes its slice: exactly ``samples_per_epoch`` samples, each once,
  ranks disjoint (reused in seeded passes only if the whole cache holds fewer).
* What it served is recorded per sample as for any epoch (NOTE [ Read receipts ]); a resumed run joins the
  snapshot and its creator grows it on (``Snapshot.grow`` looks again at what it has not linked).

The trade: the first epoch is ordered by arrival within a generation (a window of about ``GROW_EVERY_S`` of
ingest, or one segment while a rank waits for the daemon), not shuffled over the whole cache. ``min_samples`` (a
count or a fill level) keeps the former behaviour: wait, then shuffle over everything cached (and later epochs
then read snapshots of what is cached, as before). A later epoch reads fresh samples as fast as the remote
delivers them and never waits for the remote: where training is faster, the rest of the epoch is re-read
samples (the remote sets the echo), at the cost of one short stall (the top-up, tens of milliseconds) where its
loop caught up; it is likewise ordered by arrival, its top-up last.
The rule looks at the moment, not at rates: an epoch that starts at the ingest frontier (its predecessor read
every sample as it arrived) and finds less than a batch unread is topped up at once, even if the remote is faster
on average; behind a loop slower than the remote, unread samples pile up and the epoch is topped up only if the
daemon can fill no further. Once the cache is at its fill level, epochs read snapshots of what is cached,
least-read first.

Scope: a growing epoch needs no agreement across nodes only when its size is set (``samples_per_epoch``): with
several nodes and no set size, and with weighted sources, the first epoch waits for the fill as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt
from watchdog.observers.api import BaseObserver

from cachefeed._cache.snapshots import Snapshot
from cachefeed._errors import SnapshotError
from cachefeed._logs import get_logger
from cachefeed._trainer.dataset import SnapshotDataset
from cachefeed._trainer.partition import fixed_size_order, warn_reuse
from cachefeed._trainer.wait import PublishWatch, stop_watch, watch_publishes

__all__ = ["GROW_EVERY_S", "Grower", "GrowingEpoch", "GrowingShare"]

log = get_logger(__name__)

GROW_EVERY_S = 0.05  # how often the creator looks for new segments at least (more often while a rank waits)
_GROWTH_SEED = 0x6772_6F77  # "grow": keeps a generation's permutation apart from the epoch order's
_TOPUP = 0x746F_7075  # "topu": the top-up's draws, apart from a set-size epoch's (``fixed_size_order``'s stream)


class GrowingShare:
    """This rank's indices into a growing snapshot, generation by generation (the NOTE above).

    ``quota``: this rank's samples in the epoch (``samples_per_epoch // local_world_size``), or None for "what the
    snapshot holds when it closes". With a quota and a snapshot that closed short of it: the generations from
    ``topup_from`` on (an unread-first snapshot's least-read segments) and the carry are drawn from as a set-size
    epoch draws (``partition.fixed_size_order``: least-read first, in seeded passes if they are too few) and split
    equally among the ranks; what is still missing is filled by seeded passes over this rank's share (samples
    reused, as a set-size epoch does over a small cache).
    """

    def __init__(
        self, *, seed: int, epoch: int, shuffle: bool, local_rank: int, local_world_size: int, quota: int | None
    ) -> None:
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.quota = quota
        self.indices: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)
        self.is_complete = False
        self._generations = 0
        self._carry: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)
        self._reserve: list[npt.NDArray[np.int64]] = []  # the top-up generations' samples, drawn from at the close

    def update(
        self,
        counts: tuple[int, ...],
        generations: tuple[int, ...],
        is_open: bool,
        reads: Callable[[int, int], npt.NDArray[np.int64]] | None = None,
        topup_from: int | None = None,
    ) -> int:
        """Take the generations not seen yet; returns how many indices this rank gained. ``reads(first, last)``:
        the per-sample reads of segments ``first .. last - 1``: within a generation the least-read go first.
        ``topup_from``: the first generation that only tops a closed snapshot up (class docstring)."""
        if self.is_complete:
            return 0
        before = len(self.indices)
        starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(np.asarray(counts, dtype=np.int64), out=starts[1:])
        parts = [self.indices]
        ranks, rank = self.local_world_size, self.local_rank
        for g in range(self._generations, len(generations)):
            first = generations[g - 1] if g else 0
            new = np.arange(starts[first], starts[generations[g]], dtype=np.int64)
            if topup_from is not None and g >= topup_from:
                self._reserve.append(new)
                continue
            if self.shuffle and len(new) > 1:
                new = np.random.default_rng((self.seed, self.epoch, _GROWTH_SEED, g)).permutation(new)
            if reads is not None and len(new) > 1:
                got = reads(first, generations[g])
                if len(got) == len(new) and got.any():
                    new = new[np.argsort(got[new - starts[first]], kind="stable")]
            pool = np.concatenate((self._carry, new))
            each = len(pool) // ranks
            parts.append(pool[rank * each : (rank + 1) * each])
            self._carry = pool[ranks * each :]
        self._generations = len(generations)
        self.indices = np.concatenate(parts) if len(parts) > 1 else self.indices
        if self.quota is not None and len(self.indices) >= self.quota:
            self.indices = self.indices[: self.quota]
            self.is_complete = True
        elif not is_open:
            if self.quota is not None:
                if topup_from is not None:
                    self.indices = self._top_up(self.indices, self.quota, starts, reads)
                self.indices = self._reuse(self.indices, self.quota)
            self.is_complete = True
        return len(self.indices) - before

    def _top_up(
        self,
        mine: npt.NDArray[np.int64],
        quota: int,
        starts: npt.NDArray[np.int64],
        reads: Callable[[int, int], npt.NDArray[np.int64]] | None,
    ) -> npt.NDArray[np.int64]:
        """``mine`` and this rank's part of the top-up (class docstring): every rank lacks as many samples (the
        generations were split equally), so the node draws ``missing x ranks`` from the carry and the reserve and
        each rank takes its slice of the draw."""
        pool = np.concatenate((self._carry, *self._reserve))
        missing = quota - len(mine)
        if missing <= 0 or not len(pool):
            return mine
        every = reads(0, len(starts) - 1) if reads is not None else np.zeros(0, dtype=np.int64)
        pool_reads = every[pool] if len(every) == starts[-1] else np.zeros(len(pool), dtype=np.int64)
        ranks = self.local_world_size
        drawn = pool[
            fixed_size_order(
                pool_reads, missing * ranks, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle, stream=_TOPUP
            )
        ]
        self._carry = self._carry[:0]
        return np.concatenate((mine, drawn[self.local_rank * missing : (self.local_rank + 1) * missing]))

    def _reuse(self, mine: npt.NDArray[np.int64], quota: int) -> npt.NDArray[np.int64]:
        """``mine`` followed by seeded passes over it up to ``quota`` (nothing to reuse: ``mine`` as it is)."""
        if not len(mine):
            return mine
        if len(mine) < quota:
            warn_reuse(self.epoch, len(mine) * self.local_world_size, quota * self.local_world_size)
        parts, have, turn = [mine], len(mine), 0
        while have < quota:
            turn += 1
            rng = np.random.default_rng((self.seed, self.epoch, _GROWTH_SEED + 1, turn))
            again = rng.permutation(mine)[: quota - have]
            parts.append(again)
            have += len(again)
        return np.concatenate(parts)


class Grower:
    """The creator's thread that grows an open snapshot (NOTE above) until ``is_done(samples)`` or ``stop``.

    ``is_done`` is asked after every look with the snapshot's samples; it is the factory's rule (the epoch has its
    samples, or the daemon can fill no further). ``finish`` ends the growth at once (a later epoch whose loop caught
    up with ingest). ``on_closed`` is called (on this thread) once the growth ended by that rule, by ``finish`` or by
    a full room (``Snapshot.grow``), not after ``stop``. The thread never raises: a failure closes
    the snapshot as it is and is logged (the epoch then ends with what it has).

    Looks happen every ``every_s``, and, once a rank ``want``s growth, also at each publish and status document of
    the daemon until the next look that changes the snapshot (NOTE above). ``changes`` counts the looks that
    changed it (segments added, or the snapshot closed), under ``lock``; ``wait_for_change`` waits for the next.
    The observer of the cache is started at the first ``want`` (an epoch whose rank never waits never starts one),
    or is given (``watch``: a cold first epoch's, started before it waited for its first segments, so that the
    rank's first wait for growth does not also wait for an observer to start), and stopped with the growth; where
    none can start, the looks keep to the tick."""

    def __init__(
        self,
        snapshot: Snapshot,
        is_done: Callable[[int], bool],
        *,
        every_s: float = GROW_EVERY_S,
        on_closed: Callable[[], None] | None = None,
        watch: PublishWatch | None = None,
    ) -> None:
        self.snapshot = snapshot
        self._is_done = is_done
        self._on_closed = on_closed
        self._every_s = every_s
        self._stop = threading.Event()
        self._abandoned = False  # ``abandon``: the snapshot stays open
        self._finish = threading.Event()
        self._wake = threading.Event()  # set by ``stop``, ``finish`` and, while wanted, a publish: look now
        self.closed = threading.Event()  # set once the thread closed the snapshot (its last generation is there)
        self.lock = threading.Lock()  # held while the snapshot changes: readers take it to see one generation whole
        self._changed = threading.Condition(self.lock)
        self.changes = 0
        # Flags written by several threads (single assignments; a lost race costs one tick of ``every_s``):
        self._wanted = False  # a rank waits: a publish wakes the thread
        self._missed = False  # a publish came while not wanted (since the last look)
        self._watching = False  # the observer was asked for (by the first ``want``), or given running
        self._given = watch  # stopped with the growth, like one this thread starts
        if watch is not None and watch.is_running:
            watch.listen(self._published)
            self._watching = True
        self._thread = threading.Thread(target=self._run, name="cachefeed-grow", daemon=True)
        self._thread.start()

    def want(self) -> None:
        """A rank read every batch cut so far and waits for growth: look at each publish until the next change,
        and now if one came unseen since the last look (or the observer is not started yet)."""
        self._wanted = True
        if self._missed or not self._watching:
            self._wake.set()

    def wait_for_change(self, seen: int, timeout_s: float) -> None:
        """Return once ``changes`` differs from ``seen`` (what the caller saw under ``lock``), or after
        ``timeout_s``."""
        with self._changed:
            self._changed.wait_for(lambda: self.changes != seen, timeout_s)

    def _published(self) -> None:  # the observer's thread: a segment or a status document was published
        if self._wanted:
            self._wake.set()
        else:
            self._missed = True

    def _run(self) -> None:
        observer = None
        try:
            while not self._stop.is_set() and not self._finish.is_set():  # closing looks once more
                with self.lock:
                    self._missed = False
                    added = self.snapshot.grow()  # closes the snapshot itself once the epoch's room is full
                    samples, is_open = self.snapshot.samples, self.snapshot.is_open
                    if added or not is_open:
                        self._note_change()
                if not is_open or self._finish.is_set() or self._is_done(samples):
                    break
                if self._wanted and not self._watching:  # after the look: starting takes milliseconds
                    self._watching = True
                    observer = self._watch()
                    continue  # look again: what was published while it started was not seen
                if self._wake.wait(self._every_s):
                    self._wake.clear()  # after ``stop`` or ``finish``: their flags end the loop above
        except Exception:
            log.warning("growing snapshot %s failed: closing it as it is", self.snapshot.snap_id, exc_info=True)
        try:
            if not self._abandoned:  # left open for a resume, whose creator grows it on, as after a kill
                self._close()
            self.closed.set()
            if self._on_closed is not None and not self._stop.is_set():
                try:
                    self._on_closed()
                except Exception:
                    log.warning("after closing growing snapshot %s", self.snapshot.snap_id, exc_info=True)
        finally:  # last: their threads take milliseconds to end; ``closed`` and ``on_closed`` need not wait
            stop_watch(observer)
            if self._given is not None:
                self._given.stop()

    def _watch(self) -> BaseObserver | None:
        """The observer of the daemon's publishes; None (the tick serves) where it cannot start, whatever the
        reason: a faster wake is never worth ending the growth for."""
        try:
            return watch_publishes(self.snapshot.layout, self._published, status=True)
        except Exception:
            log.warning("cannot watch %s: growing by the tick alone", self.snapshot.layout.segments, exc_info=True)
            return None

    def _note_change(self) -> None:
        """Under ``lock``: the snapshot changed; wake the waiting rank, and wait for a want before reacting again."""
        self.changes += 1
        self._wanted = False
        self._changed.notify_all()

    def _close(self) -> None:
        with self.lock:
            if self.snapshot.is_held and self.snapshot.is_open:
                self._note_change()  # the rank's next poll finds the snapshot closed (or sealed) whatever happens
                try:
                    added = self.snapshot.grow(close=True)
                except (OSError, SnapshotError):
                    log.warning(
                        "could not link the last segments of growing snapshot %s: closing it as it is",
                        self.snapshot.snap_id,
                        exc_info=True,
                    )
                    try:
                        self.snapshot.seal()  # the ranks reading it end the epoch with what it has
                    except (OSError, SnapshotError):
                        log.exception("could not close growing snapshot %s", self.snapshot.snap_id)
                    return
                log.info(
                    "snapshot %s closed: %d segments, %d samples (%d in its last generation)",
                    self.snapshot.snap_id,
                    len(self.snapshot.names),
                    self.snapshot.samples,
                    added,
                )

    def finish(self) -> None:
        """End the growth at its next look (within milliseconds), as its rule would; does not wait."""
        self._finish.set()
        self._wake.set()

    def abandon(self) -> None:
        """End the growth now and leave the snapshot open, as a creator that dies does: a resumed run joins it and
        its creator grows it on (the epoch is left for a resume: ``Epochs.close``)."""
        self._abandoned = True
        self.stop()

    def stop(self) -> None:
        """End the growth now (the epoch is released or the factory closes); the snapshot is closed as it is."""
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


class GrowingEpoch:
    """One rank's reading of a growing snapshot: new batches as generations arrive, the dataset kept in step.

    ``batches`` is the list of this rank's batches cut so far (full ones; the last partial one once the share is
    complete); ``poll`` appends what became available. The dataset (``SnapshotDataset``) is extended with each
    generation's segments before any batch reads them; ``take_deltas`` gives each extension ``(names, counts)``
    once, for whoever feeds worker processes (they hold copies of the dataset) to forward in order, before the
    batches that need them. One thread reads it (the training thread, or the pool under its lock).
    """

    def __init__(
        self,
        snapshot: Snapshot,
        dataset: SnapshotDataset,
        share: GrowingShare,
        *,
        batch_size: int,
        drop_last: bool,
        estimate: int,
        timeout_s: float,
        grower: Grower | None,
        skip_batches: int = 0,
    ) -> None:
        self.snapshot = snapshot
        self.dataset = dataset
        self.share = share
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._estimate = estimate  # this rank's samples if the epoch grows as far as the daemon fills
        self._timeout_s = timeout_s
        self.grower = grower
        self.batches: list[npt.NDArray[np.int64]] = []
        self._deltas: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
        self._cut = 0  # indices already cut into batches
        self._to_skip = skip_batches  # an exact resume: batches the interrupted run served (never in ``batches``)
        self.skipped_samples = 0
        self._grown_at = time.monotonic()
        self._changes_seen = 0  # the grower's ``changes`` at the last poll
        self.waited_s = 0.0  # time spent in ``pause`` (waiting for the daemon)
        self.poll()

    @property
    def is_complete(self) -> bool:
        """The share is final and cut into ``batches`` whole."""
        return self.share.is_complete and self._cut == len(self.share.indices)

    def planned_batches(self) -> int:
        """This rank's batches: exact once complete (or with a set size), else an estimate (at least those cut)."""
        samples = len(self.share.indices)
        if not self.share.is_complete:
            samples = max(samples, self.share.quota if self.share.quota is not None else self._estimate)
        full, rest = divmod(samples, self.batch_size)
        planned = (
            full + (1 if rest and not self.drop_last else 0) - self._to_skip - self.skipped_samples // self.batch_size
        )
        return max(len(self.batches), planned)

    def poll(self) -> int:
        """Take what the snapshot gained; returns the number of batches added to ``batches``."""
        if not self.share.is_complete:
            if self.grower is not None:
                with self.grower.lock:
                    self._changes_seen = self.grower.changes
                    self._absorb()
            else:
                self.snapshot.refresh()
                self._absorb()
        return self._cut_batches()

    def pause(self) -> None:
        """Wait a little for growth (a rank that has read every batch cut so far). Raises SnapshotError once the
        snapshot did not grow for ``timeout_s``.

        An unread-first snapshot's creator (a later epoch: ``Snapshot.wants``) does not wait for the remote: its
        growth ends now and the snapshot is topped up with the least-read samples (NOTE above, "later epochs")."""
        if self.is_complete:  # the last poll closed the share without a batch to add: nothing to wait for
            return
        started = time.perf_counter()
        if self.grower is not None and self.snapshot.wants is not None:
            self.grower.finish()
            self.grower.closed.wait(GROW_EVERY_S)  # milliseconds: the top-up is cut as soon as it is linked
            self.waited_s += time.perf_counter() - started
            return
        if time.monotonic() - self._grown_at > self._timeout_s:
            raise SnapshotError(
                f"snapshot {self.snapshot.snap_id} did not grow for {self._timeout_s:g}s while its epoch waited for "
                "samples: check that the daemon runs and fetches (cachefeed status), or raise wait_timeout_s"
            )
        if self.grower is not None:  # the creator's rank: woken by the grower's next change (NOTE above)
            self.grower.want()
            self.grower.wait_for_change(self._changes_seen, GROW_EVERY_S)
        else:
            time.sleep(GROW_EVERY_S / 2)
        self.waited_s += time.perf_counter() - started

    def take_deltas(self) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
        """The dataset extensions since the last call, oldest first."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def iter_batches(self) -> Iterator[npt.NDArray[np.int64]]:
        """Every batch of the epoch, waiting for growth as needed (the sampler of an in-process DataLoader)."""
        position = 0
        while True:
            if position < len(self.batches):
                position += 1
                yield self.batches[position - 1]
            elif self.is_complete:
                return
            elif not self.poll():
                self.pause()

    def _absorb(self) -> None:
        snapshot = self.snapshot
        generations = snapshot.generations or (len(snapshot.names),)
        have = self.dataset.segments
        if generations[-1] > have:
            names, counts = snapshot.names[have : generations[-1]], snapshot.counts[have : generations[-1]]
            self.dataset.extend(names, counts)
            self._deltas.append((names, counts))
        counts, is_open = snapshot.counts[: generations[-1]], snapshot.is_open
        if self.share.update(counts, generations, is_open, snapshot.sample_reads, snapshot.topup_from):
            self._grown_at = time.monotonic()

    def _cut_batches(self) -> int:
        indices, size = self.share.indices, self.batch_size
        end = self._cut + (len(indices) - self._cut) // size * size
        if self.share.is_complete and not self.drop_last:
            end = len(indices)
        added = [indices[i : min(i + size, end)] for i in range(self._cut, end, size)]
        if self.share.is_complete:
            self._cut = len(indices)  # drop_last: the partial tail is dropped
        else:
            self._cut = end
        while added and self._to_skip:
            self._to_skip -= 1
            self.skipped_samples += len(added.pop(0))
        self.batches.extend(added)
        return len(added)
