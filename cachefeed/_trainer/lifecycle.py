"""The epochs of one factory: their states, transitions and threads (the one owner of an epoch's lifecycle).

``EpochLoaderFactory`` (``loader.py``) is the public face: it checks arguments, holds checkpoints and asks this
module for epochs. What an epoch *is* lives beside it: ``epoch.py`` (its resources and the loader the training loop
iterates), ``pool.py`` (the feed), ``growing.py`` (an epoch over a growing set), ``partition.py`` (who reads what).
They serve this module; none of them moves an epoch from one state to another.

States of epoch ``e`` (``EpochState.phase``)::

    building --build--> built --feed--> fed --activate--> current --retire--> retired --release--> released
        (dataset()/share() stop at built; activate feeds a built epoch first)

Transitions, who runs them and on which thread:

* **prepare** (training thread, from ``on_progress``; NOTE [ Epoch handover ] in ``loader.py`` says when; or the
  grower thread once a growing epoch stopped growing, ``_growth_closed``): queues build + feed of ``e + 1`` on the
  *build thread*, which pins its snapshot (local rank 0 creates, the node's other ranks join), computes this rank's
  share, opens the dataset and queues its pass on the pool (without workers: builds its DataLoader and fetches the
  first batch, if one is cut), with prompt GIL hand-offs (``gil.py``). Never while ``e + 1`` is being activated.
  Which snapshot (NOTE [ Growing snapshots ] in ``growing.py``): the first epoch waits for the cache, or starts on
  a growing set (``_can_grow``); a later epoch of a set size built while the cache fills is *unread-first*
  (``_later_wants``: growing while fewer unread samples are cached than it needs, then topped up); any other epoch
  is a snapshot of what is cached, least-read first.
* **activate** (training thread: ``loader(e)``, ``dataset(e)``, ``share(e)``): takes the prepared epoch, waiting
  only if its build is late (or builds it now), makes it *current* and retires every other epoch.
* **build again** (a loop that goes back to an epoch it retired: ``loader(0)``, ``loader(1)``, ``loader(0)``): the
  earlier build's release is finished first, on the building thread (or waited for, where the teardown thread
  runs it), so that its pin is gone (its rank claim stays this process's: NOTE [ Snapshot pinning protocol ],
  "Rank claims"); the epoch is then read anew like any epoch: on a fresh
  snapshot of what is cached (its order from ``(seed, epoch)``, its reads counted by a receipt of its own), or on
  the same one where another rank of the job still holds it (``_settle``). A resumed epoch too, whole: its first
  build spent the resume (``_resumed``).
* **retire** (training thread): hands the epoch to the *teardown thread*; the training thread never joins a
  process or unlinks a file.
* **grow** (the creator's *grower thread*, while a growing epoch is built, fed or current): links published
  segments into its snapshot (``growing.Grower``) until the epoch has its samples, the daemon can fill no further,
  or (a later epoch) its loop caught up with ingest; then closes it (a later epoch's topped up) and calls
  ``_growth_closed``. The epoch's batches follow its generations (``GrowingEpoch.poll``); the next epoch is
  prepared only once it stopped growing.
* **release** (teardown thread, once the handover is over: the current epoch's first batch was handed out, or
  ``_TEARDOWN_HOLD_S`` passed; or ``close``): stops a growing snapshot's grower, closes the epoch's iterators and
  passes, waits until every worker has closed its readers of the epoch's segments, closes the dataset, records what
  the epoch served (NOTE [ Read receipts ] in ``_cache/reads.py``) and drops the pin. Idempotent.
  Releases keep up with the loop: with more than ``_RELEASE_BACKLOG`` epochs retired and not released, teardown steps
  no longer wait for the handover, and with more than ``_RELEASE_BOUND``, ``activate`` waits (up to
  ``_RELEASE_WAIT_S``) until they are released: a bound met only where a release takes longer than an epoch even
  unhurried (a wait there is a handover's; with the wait at the hurry's threshold, a paced test's epochs of 40 ms had
  one of 1.5 s). Epochs shorter than a release (a few batches each) used to retire faster than the teardown thread,
  which waited for each handover, released them: hundreds stayed pinned, their reads reached the daemon hundreds of
  epochs late (it kept counting the cached samples as unread, so it fetched nothing), and their snapshots' metadata
  pushed the cache past ``max_bytes``.

While an epoch is current, its iterator reports each batch here (``on_progress``, ``on_wait``, ``on_exhausted``):
this module learns the pace, decides when to prepare the next epoch and accounts the handover wait.

Failures of a background build are re-raised by ``activate`` on the training thread, with their traceback. With
several nodes, every rank's build thread joins one all-reduce per epoch (``plan.agree_min``) in epoch order.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TextIO, cast

import numpy as np
import numpy.typing as npt
from torch.utils.data import DataLoader, Sampler

from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.room import room_now
from cachefeed._cache.snapshots import CLAIM_WAIT_S, RankClaimedError, Snapshot
from cachefeed._cache.sources import read_sources
from cachefeed._errors import SnapshotError
from cachefeed._logs import get_logger
from cachefeed._status.report import read_report  # the reader of the daemon's document
from cachefeed._trainer.background import SerialWorker
from cachefeed._trainer.dataset import SnapshotDataset, Transform
from cachefeed._trainer.epoch import EpochState, EpochStats, GrowingBatchSampler, SkipEmptyCollate, shutdown_iterator
from cachefeed._trainer.gil import prompt_handoffs
from cachefeed._trainer.growing import Grower, GrowingEpoch, GrowingShare
from cachefeed._trainer.partition import EpochBatchSampler, RankInfo, rank_share, snapshot_name, warn_reuse
from cachefeed._trainer.pool import WorkerPool
from cachefeed._trainer.resume import ResumePoint, resumed_snapshot
from cachefeed._trainer.wait import (
    DaemonAbsence,
    PublishWatch,
    fill_reached,
    wait_for_fill,
    wait_for_samples,
    wait_for_segments,
)

__all__ = ["EpochPlan", "Epochs"]

log = get_logger(__name__)

_LEAD_FACTOR = 2.0
_LEAD_MARGIN_S = 0.1
_PACE_WEIGHT = 0.2
_RECENT_BUILDS = 4  # background builds the lead's estimate is the longest of
_TOUCH_EVERY_S = 5.0  # how often a reading epoch shows progress on its snapshot (a utime: microseconds)
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})  # the cache's filesystem has no room to pin a snapshot
_FULL_RETRY_S = 0.5  # how often a pin tries again then (the daemon's eviction, or the user, frees room)
_TEARDOWN_HOLD_S = 1.0  # how long teardown steps wait for the handover to end (the new epoch's first batch)
_STATS_KEPT = 1024  # released epochs whose statistics ``stats`` still gives
_RELEASE_BACKLOG = 2  # epochs retired and not yet released beyond which releases hurry (no wait for handovers)
_RELEASE_BOUND = 8  # ... and beyond which ``activate`` waits for them: a bound, met only where releases are slow
# The longest ``activate`` waits for them: a release waits for each worker to close its readers, and a worker may
# first have to hand the training thread a batch too large for its shared memory (through a pipe, which blocks
# until the training thread reads it): the training thread goes on after this wait, reads, and the release ends.
_RELEASE_WAIT_S = 1.0
# A growing epoch's (and a fill wait's) wait for a daemon that went away: systemd's RestartSec (5 s), the new
# daemon's start (about a second) and a margin for a machine that stalls
RESTART_GRACE_S = 15.0


@dataclass(frozen=True, slots=True)
class EpochPlan:
    """What decides every epoch of a factory, fixed when it is made (``EpochLoaderFactory``'s arguments)."""

    layout: CacheLayout
    ranks: RankInfo
    job: str
    run_id: str
    batch_size: int
    drop_last: bool
    shuffle: bool
    seed: int
    samples_per_epoch: int | None
    transform: Transform | None
    verify: bool
    num_workers: int
    collate_fn: Callable[[list[Any]], Any]
    loader_options: dict[str, Any]
    window: int  # batches the feed holds ahead: num_workers x prefetch_factor
    grows_first: bool  # the first epoch may start on a growing set (min_samples left unset)
    min_fill: float | None  # otherwise what the first epoch waits for: a fill level,
    min_samples: int | str  # ... or a number of samples
    wait_timeout_s: float
    join_timeout_s: float
    prepare_at: float | None
    epochs: int | None
    progress: TextIO | None
    agree_min: Callable[[int], int]  # the minimum over nodes (identity on one node)


class Epochs:
    """Every epoch of one factory, through the states and transitions of the module docstring."""

    def __init__(self, plan: EpochPlan, pool: WorkerPool | None) -> None:
        self.plan = plan
        self.pool = pool
        self._lock = threading.Lock()
        self._builder = SerialWorker("cachefeed-build")  # not a ThreadPoolExecutor: see background.py
        self._teardown = SerialWorker("cachefeed-teardown")
        self._states: dict[int, EpochState] = {}  # built, fed or current (at most one current)
        self._retired: dict[int, EpochState] = {}  # retired, until released
        self._released_stats: OrderedDict[int, EpochStats] = OrderedDict()  # the last ``_STATS_KEPT`` released
        self._unreleased = 0  # retired epochs not released yet (``_RELEASE_BACKLOG``)
        self._released = threading.Condition()  # guards ``_unreleased``, notified at each release
        self._prepared: tuple[int, Future[EpochState]] | None = None  # the epoch on the build thread
        self._taking: set[int] = set()  # epochs being activated: taken from ``_prepared``, not in ``_states`` yet
        self._resume: ResumePoint | None = None
        self.current: EpochState | None = None  # the epoch the training loop last took a batch of
        self._last_built: EpochState | None = None  # its segments: the epoch being read while the next is built
        self.has_built = False
        self._build_estimate_s = 0.0
        self._recent_builds: deque[float] = deque(maxlen=_RECENT_BUILDS)  # background builds' seconds
        self._waited_s = 0.0
        self._pace_s: float | None = None
        self._last_batch_at = 0.0
        self._absence = DaemonAbsence(  # the grower's look at a daemon gone (``_growth_done``)
            plan.layout, RESTART_GRACE_S, waiter="the growing epoch waits", then="it ends on the %d samples it has"
        )
        self._closed = False
        # Set while no handover is under way: teardown steps wait for it (``_after_handover``).
        self._handover_over = threading.Event()
        self._handover_over.set()
        self._closing = threading.Event()  # set by ``close``: a join waiting for another rank's snapshot gives up

    # -- what the factory asks --------------------------------------------------------------------------------

    def resume_at(self, point: ResumePoint) -> None:
        """The next build of ``point.epoch`` resumes it (``resume.py``); before the first build only."""
        with self._lock:
            if self.has_built:
                raise RuntimeError("load_state_dict must be called before the first loader()")
            self._resume = point

    def stats(self, epoch: int) -> EpochStats:
        """Statistics of an epoch built here (KeyError for one never built)."""
        with self._lock:
            state = self._states.get(epoch) or self._retired.get(epoch)
            kept = self._released_stats.get(epoch)
        if state is not None:
            return state.stats(handover=True)
        if kept is not None:
            return kept
        raise KeyError(f"epoch {epoch} was not built by this factory (or is one of more than {_STATS_KEPT} ago)")

    def close(self, *, interrupted: bool = False) -> None:
        """Release every epoch (prepared ones included) and stop both threads. Idempotent.

        ``interrupted``: the loop left by an exception (Ctrl-C included). The epoch it was reading, if a checkpoint
        taken now names a place inside it (the loop took a batch of it, or resumed it after some: ``position``), is
        left to the daemon as a dead trainer's is (``Snapshot.leave_for_resume``; a growing one stays open,
        ``Grower.abandon``): a restart from the loop's last ``state_dict()`` resumes it exactly within
        ``cache.snapshot_grace``, during which it holds its room.
        What it served is recorded first, so its reads count even if nothing resumes it. Without a daemon (a
        static cache) it is released as usual."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closing.set()  # an epoch prepared ahead may wait for a snapshot its creator will never make
            self._handover_over.set()
            reading = self.current
            keep = (
                reading
                if interrupted
                and reading is not None
                and reading.position > 0  # a checkpoint inside it may name it
                and not reading.is_complete
                and self.plan.layout.has_writer()
                else None
            )
            prepared, self._prepared = self._prepared, None
            states = list(self._states.values())
            self._retired.update(self._states)
            self._states.clear()
        if prepared is not None:
            try:
                states.append(prepared[1].result())
            except BaseException:  # it is being discarded: its error does not matter now
                log.debug("discarded epoch %d failed to build", prepared[0], exc_info=True)
        self._teardown.shutdown(wait=True)
        self._builder.shutdown(wait=True)
        for state in states:
            self._release(state, leave_for_resume=state is keep)

    # -- transitions ----------------------------------------------------------------------------------------------

    def _feed(self, state: EpochState) -> None:
        """built -> fed: queue the epoch's batches on the worker pool (its workers start on them once dealt), or
        without workers build its DataLoader, start it and fetch the first batch."""
        plan, growing = self.plan, state.growing
        state.batch_size = plan.batch_size
        if growing is None and plan.drop_last and not len(state.credited) and 0 < len(state.indices) < plan.batch_size:
            log.warning(
                "epoch %d: this rank's share is %d samples, less than one batch of %d, and drop_last=True drops it: "
                "the epoch has no batch (lower batch_size, or raise samples_per_epoch)",
                state.epoch,
                len(state.indices),
                plan.batch_size,
            )
        if self.pool is not None:
            state.pool, state.pool_key = self.pool, self.pool.new_key()
            if growing is None:
                state.batch_list = list(EpochBatchSampler(state.indices, plan.batch_size, drop_last=plan.drop_last))
            inner = self.pool.open_pass(state.pool_key, state.dataset, state.batch_list, growing)
            state.feed(inner, [], len(state.batch_list))
            return
        sampler: Sampler[npt.NDArray[np.int64]] = (
            EpochBatchSampler(state.indices, plan.batch_size, drop_last=plan.drop_last)
            if growing is None
            else GrowingBatchSampler(growing)
        )
        state.dataloader = self._make_loader(state.dataset, sampler)
        batches = len(sampler)  # type: ignore[arg-type]
        loader = iter(state.dataloader)
        head: list[Any] = []
        if batches and (growing is None or growing.batches):  # a growing one's first batch is read when asked for
            try:
                head.append(next(loader))
            except StopIteration:  # a growing epoch that closed empty
                pass
        state.feed(loader, head, batches)

    def _release(self, state: EpochState, *, leave_for_resume: bool = False) -> None:
        """-> released (idempotent; teardown thread, or ``close``): stop a growing snapshot's grower, shut the
        epoch's iterators and passes down, let every worker close its readers, close the dataset, record what the
        epoch served and drop the pin (``leave_for_resume``: without removing the snapshot, see ``close``)."""
        inners = state.mark_released()
        if inners is None:
            return
        try:
            self._tear_down(state, inners, leave_for_resume=leave_for_resume)
        finally:
            state.unpinned.set()
            if state.was_retired:
                with self._released:
                    self._unreleased -= 1
                    self._released.notify_all()
            self._keep_stats(state)

    def _keep_stats(self, state: EpochState) -> None:
        """A released epoch leaves ``_retired`` for its statistics alone (``_STATS_KEPT`` epochs are kept): the
        state holds its snapshot's entries and more, about 11 KB, and a job of a hundred thousand short epochs kept
        every one (a one-off soak: the training process grew by 1.1 MB a second)."""
        stats = None
        if state.was_retired or state.batches_served:  # not an epoch prepared ahead and never read (``close``)
            try:
                stats = state.stats(handover=True)
            except Exception:  # its snapshot gone under it, say: no statistics is better than a failed release
                log.debug("epoch %d: no statistics kept", state.epoch, exc_info=True)
        with self._lock:
            if self._retired.get(state.epoch) is state:
                del self._retired[state.epoch]
            if stats is not None:
                self._released_stats[state.epoch] = stats
                self._released_stats.move_to_end(state.epoch)
                while len(self._released_stats) > _STATS_KEPT:
                    self._released_stats.popitem(last=False)

    def _tear_down(self, state: EpochState, inners: list[Iterator[Any]], *, leave_for_resume: bool) -> None:
        """``_release``'s steps, for an epoch just marked released."""
        growing = state.growing
        if growing is not None:
            if growing.grower is not None and leave_for_resume:
                growing.grower.abandon()  # open, as a dead creator leaves it: the resumed creator grows it on
            elif growing.grower is not None:
                growing.grower.stop()  # closes the snapshot as it is: nothing joins it after this epoch
            try:
                state.snapshot.refresh()  # what it served is recorded against the snapshot's final size
            except SnapshotError as exc:
                log.warning("epoch %d: %s", state.epoch, exc)
        served = state.served()
        try:
            for inner in inners:
                shutdown_iterator(inner)
            if state.pool is not None:
                state.pool.forget(state.pool_key)  # the workers unmap its segments before the pin goes
        finally:
            state.forget_resources()
            state.dataset.close()
            try:
                if len(served) != state.recorded_samples:  # not all on record when its pass ended (``on_complete``)
                    state.snapshot.record_served(served)  # NOTE [ Read receipts ] in _cache/reads.py
            except OSError as exc:
                log.warning("epoch %d: could not record what %s served: %s", state.epoch, state.snapshot.snap_id, exc)
            if leave_for_resume:
                state.snapshot.leave_for_resume()
                log.info(
                    "epoch %d was interrupted: its snapshot %s is left for a resume (cache.snapshot_grace)",
                    state.epoch,
                    state.snapshot.snap_id,
                )
            else:
                state.snapshot.release()

    def _make_loader(self, dataset: SnapshotDataset, sampler: Sampler[npt.NDArray[np.int64]]) -> DataLoader[Any]:
        return DataLoader(
            dataset,
            batch_sampler=cast(Sampler[list[int]], sampler),  # yields int64 arrays: cheaper than lists
            num_workers=self.plan.num_workers,
            collate_fn=SkipEmptyCollate(self.plan.collate_fn),
            **self.plan.loader_options,
        )

    def _share(self, snapshot: Snapshot, epoch: int) -> npt.NDArray[np.int64]:
        """This rank's indices into ``snapshot`` for ``epoch`` (see partition.py)."""
        return rank_share(
            snapshot.counts,
            snapshot.sample_reads,
            snapshot.tags,
            {tag: weight for tag, (_name, weight) in snapshot.sources.items()},
            epoch=epoch,
            seed=self.plan.seed,
            shuffle=self.plan.shuffle,
            ranks=self.plan.ranks,
            samples_per_epoch=self.plan.samples_per_epoch,
            agree_min=self.plan.agree_min,
            left_out=snapshot.left_out,
        )

    def _last_names(self) -> frozenset[str]:
        """The segments of the epoch built last, as they are now (a growing epoch's, grown): the epoch the training
        loop reads while the next one is built (under the lock)."""
        last = self._last_built
        return frozenset(last.snapshot.names) if last is not None else frozenset()

    def _can_grow(self) -> bool:
        """Whether the first epoch may start on a growing set (NOTE [ Growing snapshots ]'s scope; a later one
        also needs ``_later_wants``): the user did not ask to wait (``min_samples``), and its length needs no
        agreement across nodes, and no sources are weighed."""
        if not self.plan.grows_first or read_sources(self.plan.layout.sources_file):
            return False
        if not self.plan.layout.has_writer():
            return False  # no daemon: a static cache does not grow, its first epoch is all of it
        return self.plan.samples_per_epoch is not None or not self.plan.ranks.nodes_differ

    def _later_wants(self) -> int | None:
        """The samples a later epoch of a set size needs, if it reads what no epoch has read first and grows while the
        cache fills (NOTE [ Growing snapshots ], "later epochs"): the first epoch's conditions (``_can_grow``) hold
        and the daemon has not filled the cache to its level (``fill_reached``); else None (a snapshot of what is
        cached, least-read first). ``samples_per_epoch + local_world_size - 1``: the carry of a split is less than
        the local ranks, so every rank gets its quota from that many."""
        spe = self.plan.samples_per_epoch
        if spe is None or not self._can_grow() or fill_reached(self.plan.layout, 1.0, 1).ready:
            return None
        return spe + self.plan.ranks.local_world_size - 1

    def _growing(
        self,
        snapshot: Snapshot,
        dataset: SnapshotDataset,
        epoch: int,
        skip_batches: int,
        watch: PublishWatch | None = None,
    ) -> GrowingEpoch:
        """This rank's reading of a growing snapshot; its creator (alive in this process) keeps growing it, with
        ``watch`` where one was started for it (its grower stops it)."""
        plan = self.plan
        ranks = plan.ranks
        spe = plan.samples_per_epoch
        quota = spe // ranks.local_world_size if spe is not None else None
        share = GrowingShare(
            seed=plan.seed,
            epoch=epoch,
            shuffle=plan.shuffle,
            local_rank=ranks.local_rank,
            local_world_size=ranks.local_world_size,
            quota=quota,
        )
        estimate = quota if quota is not None else self._estimated_share(snapshot)  # before a grower starts
        grower = (
            Grower(snapshot, self._growth_done, on_closed=lambda: self._growth_closed(epoch), watch=watch)
            if snapshot.is_open and ranks.is_creator
            else None
        )
        try:
            return GrowingEpoch(
                snapshot,
                dataset,
                share,
                batch_size=plan.batch_size,
                drop_last=plan.drop_last,
                estimate=estimate,
                timeout_s=plan.wait_timeout_s,
                grower=grower,
                skip_batches=skip_batches,
            )
        except BaseException:
            if grower is not None:
                grower.stop()  # and the watch it took over: nobody would read what it grows
            raise

    def _growth_done(self, samples: int) -> bool:
        """The grower's rule (grower thread): the epoch has its samples, or the daemon can fill no further
        (``fill_reached``). A daemon gone counts only after ``RESTART_GRACE_S`` without one: a daemon restarted
        (``systemctl restart``, or ``Restart=on-failure`` after a crash) comes back on the same cache and fills on,
        and an epoch that ended on what was cached at that moment served those samples over again to its size."""
        spe = self.plan.samples_per_epoch
        if spe is not None and samples >= spe + self.plan.ranks.local_world_size - 1:  # the carry is < local ranks
            return True
        reached = fill_reached(self.plan.layout, 1.0, samples)
        if not reached.daemon_gone:
            self._absence.back()
            return reached.ready
        return self._absence.waited_out(samples) and reached.ready  # ready: something is cached

    def _estimated_share(self, snapshot: Snapshot) -> int:
        """This rank's samples if the first epoch grows until it fills the epoch's room (``room.py``) or, without a
        room, the daemon's fill level: what ``len()`` says until the snapshot closes."""
        total = snapshot.samples
        room = room_now(self.plan.layout)
        pinned = sum(os.lstat(path).st_blocks * 512 for path in snapshot.paths)
        document = read_report(self.plan.layout.root).document
        if room is not None and pinned and snapshot.samples:
            total = max(total, room * snapshot.samples // pinned)
        elif document is not None:
            cache = document["cache"]
            fill, samples = float(cache.get("fill", 0.0)), int(cache.get("samples", 0))
            if fill > 0.01:
                total = max(total, round(samples / min(1.0, fill)))
        if document is not None and document["remote"]["passes_completed"] >= 1:
            # The daemon fetched everything the remote lists: the epoch grows to what is cached at most (for a
            # dataset smaller than the room, len() said the room's worth of batches, many times the epoch's).
            total = max(snapshot.samples, min(total, int(document["cache"].get("samples", total))))
        return total // self.plan.ranks.local_world_size

    def _settle(self, epoch: int) -> None:
        """Finish the release of an earlier build of ``epoch`` that was retired (module docstring, "build again"),
        here or by waiting for the teardown thread's under way. A build that found that build's pin joined it
        (a second pass over samples whose reads were on record already) or, where its release was removing the
        snapshot, waited for it: what it got depended on the moment."""
        with self._lock:
            earlier = self._retired.get(epoch)
        if earlier is not None:
            self._release(earlier)  # a no-op where the teardown thread took it first
            earlier.unpinned.wait()

    @contextlib.contextmanager
    def _claiming(self, epoch: int) -> Iterator[None]:
        """Pins of ``epoch`` inside claim this rank (NOTE [ Snapshot pinning protocol ], "Rank claims"): one another
        live process still holds after ``_claim_wait_s`` is refused, saying which rank this process was given, how
        long it waited and what to check."""
        try:
            yield
        except RankClaimedError as exc:
            ranks = self.plan.ranks
            raise SnapshotError(
                f"epoch {epoch}: another process ({exc.holder}) already reads the share of rank={ranks.rank} "
                f"(local rank {ranks.local_rank} of {ranks.local_world_size} on this node, world_size="
                f"{ranks.world_size}){exc.held_for}: two processes were given the same rank, and both would read "
                "that share while another is never read. Give each process its own rank: pass rank= (0 to "
                "world_size - 1, different in every process), or check that the launcher sets RANK and LOCAL_RANK "
                "for each process (torchrun does; without them every process defaults to rank 0)"
            ) from None

    def _build(self, epoch: int, *, with_loader: bool, background: bool) -> EpochState:
        """Pin ``epoch``'s snapshot and build its state (and loader). Runs on the build or the training thread."""
        self._settle(epoch)
        started = time.perf_counter()
        plan = self.plan
        with self._lock:
            is_first, self.has_built = not self.has_built, True
        waited = 0.0
        join_timeout = plan.join_timeout_s
        if is_first and self.pool is not None:
            self.pool.start()  # forked while the cache fills, not after
        resume = self._resume if self._resume is not None and self._resume.epoch == epoch else None
        skip_batches = resume.batches_to_skip if resume is not None else 0
        # An exact resume pins the interrupted epoch's own snapshot: its samples are fixed and cached, so nothing
        # below waits for the cache (a restart after a crash early in training waited for the first fill, and
        # failed where that took longer than wait_timeout_s).
        snapshot = None
        if resume is not None:
            with self._claiming(epoch):
                snapshot = resumed_snapshot(
                    plan.layout.root, resume, rank=plan.ranks.local_rank, claim_wait_s=self._claim_wait_s()
                )
        is_exact_resume = snapshot is not None
        grows = is_first and self._resume is None and self._can_grow()
        watch: PublishWatch | None = None  # a cold first epoch's observer of the daemon: its grower takes it over
        wants = self._later_wants() if not is_first and plan.ranks.is_creator and not is_exact_resume else None
        if is_exact_resume:
            pass  # its samples are fixed and cached: nothing to wait for
        elif grows and plan.ranks.is_creator:
            need = max(1, plan.num_workers) * plan.ranks.local_world_size  # a segment for every worker to read
            watch = PublishWatch(plan.layout)  # started while nothing waits on it (``PublishWatch``)
            try:
                wait_for_segments(
                    plan.layout, need, timeout_s=plan.wait_timeout_s, progress=plan.progress, wake=watch.event
                )
            except BaseException:
                watch.stop()
                raise
            waited = time.perf_counter() - started
        elif is_first and plan.ranks.is_creator and plan.min_fill is not None:
            wait_for_fill(
                plan.layout,
                plan.min_fill,
                timeout_s=plan.wait_timeout_s,
                progress=plan.progress,
                restart_grace_s=RESTART_GRACE_S,
                is_default=plan.grows_first,  # min_samples unset: the default's level (messages name it so)
            )
            waited = time.perf_counter() - started
        elif is_first and plan.ranks.is_creator:
            wait_for_samples(
                plan.layout,
                int(plan.min_samples),
                timeout_s=plan.wait_timeout_s,
                progress=plan.progress,
                is_default=plan.grows_first,  # min_samples unset: samples_per_epoch (messages name it so)
            )
            waited = time.perf_counter() - started
        elif is_first:
            join_timeout += plan.wait_timeout_s
        snap_id = snapshot_name(plan.run_id, plan.job, epoch)
        if snapshot is not None:
            snap_id = snapshot.snap_id
        else:
            try:
                snapshot = self._pin(epoch, snap_id, growing=grows, wants=wants, join_timeout=join_timeout)
            except BaseException:
                _stopped(watch)
                raise
        dataset: SnapshotDataset | None = None
        growing: GrowingEpoch | None = None
        pid = os.getpid()
        try:
            dataset = SnapshotDataset.from_snapshot(snapshot, transform=plan.transform, verify=plan.verify)
            if self.pool is None:  # read in this process: keep the segments the epoch being read has mapped
                dataset.share_open_readers()
            growing = (
                self._growing(snapshot, dataset, epoch, skip_batches, watch)
                if snapshot.generations is not None
                else None
            )
            if growing is None or growing.grower is None:
                _stopped(watch)  # nobody grows this snapshot here: nothing to listen
                watch = None
            share = self._share(snapshot, epoch) if growing is None else growing.share.indices
            if growing is None and plan.samples_per_epoch is not None and snapshot.samples < plan.samples_per_epoch:
                warn_reuse(epoch, snapshot.samples, plan.samples_per_epoch)
            indices = share[skip_batches * plan.batch_size :]
            # An exact resume: the skipped batches were served by the interrupted run (its checkpoint says so).
            credited = share[: skip_batches * plan.batch_size] if is_exact_resume else share[:0]
            with self._lock:
                previous = self._last_names() if self._last_built is not None else None
            fresh = [
                (n, c)
                for n, c in zip(snapshot.names, snapshot.counts, strict=True)
                if previous is None or n not in previous
            ]
            state = EpochState(
                epoch,
                snapshot,
                dataset,
                indices,
                credited=credited,
                resumed_batches=skip_batches,
                new_samples=sum(c for _n, c in fresh),
                new_segments=len(fresh),
                wait_for_samples_s=waited,
                growing=growing,
            )
            state.is_first_epoch = is_first
            state.prepared_in_background = background
            state.previous = previous or frozenset()
            with self._lock:
                self._last_built = state
            if with_loader:
                self._feed(state)
        except BaseException:
            if os.getpid() != pid:  # unwinding in a forked worker that failed to start: the pin is the parent's
                raise
            if growing is not None and growing.grower is not None:
                growing.grower.stop()  # and the watch it took over
            _stopped(watch)
            if dataset is not None:
                dataset.close()
            snapshot.release()
            raise
        state.build_s = time.perf_counter() - started - waited
        if resume is not None:
            self._resumed(resume)
        self._learn_build(state.build_s, background=background)
        log.info(
            "epoch %d: snapshot %s, %d samples (%d new), %d for this rank, built in %.3fs%s",
            epoch,
            snap_id,
            snapshot.samples,
            state.new_samples,
            len(indices),
            state.build_s,
            " in the background" if background else "",
        )
        return state

    def _resumed(self, point: ResumePoint) -> None:
        """``point``'s epoch was built resuming it: the resume is spent. A later build of that epoch (a loop that goes
        back to it, module docstring's "build again") reads it anew, whole, rather than resuming it again."""
        with self._lock:
            if self._resume is point:
                self._resume = None

    def _pin(self, epoch: int, snap_id: str, *, growing: bool, wants: int | None, join_timeout: float) -> Snapshot:
        """Pin ``epoch``'s snapshot ``snap_id`` and claim this rank in it: local rank 0 creates it, the others join."""
        plan = self.plan
        with self._claiming(epoch):
            if not plan.ranks.is_creator:
                return Snapshot.join(
                    plan.layout.root,
                    snap_id,
                    timeout_s=join_timeout,
                    job=plan.job,
                    ranks=plan.ranks.local_world_size,
                    rank=plan.ranks.local_rank,
                    stop=self._closing,
                    claim_wait_s=self._claim_wait_s(),
                )
            with self._lock:
                reading = self._last_names()  # the epoch being read now: its receipt is pending
            snapshot = self._create_when_room(
                epoch,
                lambda: Snapshot.create(
                    plan.layout.root,
                    snap_id,
                    job=plan.job,
                    ranks=plan.ranks.local_world_size,
                    rank=plan.ranks.local_rank,
                    reading=reading,
                    growing=growing,
                    wants=wants,
                    claim_wait_s=self._claim_wait_s(),
                ),
            )
            snapshot.mark_ahead()  # until a loop takes a batch of it (``on_progress``): no checkpoint names it
            return snapshot

    def _create_when_room(self, epoch: int, create: Callable[[], Snapshot]) -> Snapshot:
        """``create()``, tried again every ``_FULL_RETRY_S`` while the cache's filesystem has no room for a snapshot's
        inodes and blocks (others' files fill it: the daemon keeps the cache itself within its budget), said once;
        after ``wait_timeout_s``, or once the factory closes, ``SnapshotError`` names the cause."""
        started, said = time.monotonic(), False
        while True:
            try:
                snapshot = create()
                break
            except OSError as exc:
                if exc.errno not in _FULL_ERRNOS:
                    raise
                waited = time.monotonic() - started
                if waited >= self.plan.wait_timeout_s:
                    raise SnapshotError(
                        f"epoch {epoch}: the cache's filesystem has been full for {waited:.0f}s ({exc.strerror}): "
                        "a snapshot needs a few inodes and blocks. Free space on it (cachefeed status says what "
                        "fills it: the cache, or files of others), or raise wait_timeout_s"
                    ) from None
                if not said:
                    said = True
                    log.warning(
                        "epoch %d waits to pin its snapshot: the cache's filesystem is full (%s); trying again "
                        "for up to %.0fs (wait_timeout_s): free space on it",
                        epoch,
                        exc.strerror,
                        self.plan.wait_timeout_s,
                    )
                if self._closing.wait(_FULL_RETRY_S):
                    raise SnapshotError(f"epoch {epoch}: not pinned, the factory is closing") from None
        if said:
            log.info("epoch %d pinned its snapshot: the cache's filesystem has room again", epoch)
        return snapshot

    def _claim_wait_s(self) -> float:
        """How long a pin waits for this rank's claim while another process holds it (a predecessor still exiting,
        NOTE [ Snapshot pinning protocol ], "Rank claims"): ``CLAIM_WAIT_S``, or ``join_timeout_s`` if shorter."""
        return min(CLAIM_WAIT_S, self.plan.join_timeout_s)

    def _build_in_background(self, epoch: int) -> EpochState:
        """The build thread's build of the next epoch, with prompt GIL hand-offs (``gil.py``): beside a training
        loop busy in Python, each of the build's system calls would otherwise wait up to 5 ms for the GIL."""
        with prompt_handoffs():
            return self._build(epoch, with_loader=True, background=True)

    def activate(self, epoch: int, *, with_loader: bool) -> EpochState:
        """Make ``epoch`` the current epoch: take or build its state, retire every other one."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this EpochLoaderFactory is closed")
            if with_loader:  # a loader's first batch ends the handover (``on_wait``); dataset()/share() have none
                self._handover_over.clear()
        self._wait_for_releases(epoch)
        with self._lock:
            state = self._states.get(epoch)
            prepared = None
            if state is None and self._prepared is not None:
                prepared, self._prepared = self._prepared, None
            self._taking.add(epoch)  # until it is in ``_states``: ``_prepare`` must not build it again meanwhile
        try:
            state = self._take(epoch, state, prepared, with_loader=with_loader)
        except BaseException:
            with self._lock:
                self._taking.discard(epoch)
            raise
        with self._lock:
            self._taking.discard(epoch)
            self._states[epoch] = state
            if state.fed:
                state.phase = "current"
            others = [s for e, s in self._states.items() if e != epoch]
            for other in others:
                del self._states[other.epoch]
        for other in others:
            self._retire(other)
        return state

    def _take(
        self,
        epoch: int,
        state: EpochState | None,
        prepared: tuple[int, Future[EpochState]] | None,
        *,
        with_loader: bool,
    ) -> EpochState:
        """``activate``'s part outside the lock: the prepared state, or a build now; fed if asked."""
        if state is None:
            if prepared is not None and prepared[0] == epoch:
                return prepared[1].result()
            if prepared is not None:
                prepared[1].add_done_callback(self._retire_future)
            return self._build(epoch, with_loader=with_loader, background=False)
        if with_loader and not state.fed:
            started = time.perf_counter()
            self._feed(state)
            state.build_s += time.perf_counter() - started
        return state

    def _wait_for_releases(self, epoch: int) -> None:
        """Before ``epoch`` is made current: wait until at most ``_RELEASE_BOUND`` retired epochs are unreleased
        (module docstring, "release"), up to ``_RELEASE_WAIT_S``. Only epochs shorter than a release ever wait."""
        with self._released:
            if self._unreleased <= _RELEASE_BOUND:
                return
            if not self._released.wait_for(lambda: self._unreleased <= _RELEASE_BOUND, _RELEASE_WAIT_S):
                log.debug("epoch %d starts with %d earlier epochs not released yet", epoch, self._unreleased)

    def _retire(self, state: EpochState) -> None:
        with self._released:
            self._unreleased += 1
        state.was_retired = True
        with self._lock:
            state.phase = "retired"
            self._retired[state.epoch] = state
            if not self._closed:  # close() shuts the teardown thread down only after setting _closed
                self._teardown.submit(self._after_handover, self._release, f"releasing epoch {state.epoch}", state)
                return
        self._release(state)

    def _retire_future(self, future: Future[EpochState]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        self._retire(future.result())

    # -- hooks called by the epoch iterator (training thread) ----------------------------------------------

    # -- the iterator's reports (training thread): the EpochHooks of epoch.py ----------------------------------

    def on_progress(self, state: EpochState, consumed: int) -> None:
        """After ``consumed`` batches of ``state``'s epoch: learn the pace, start the next epoch when due."""
        now = time.perf_counter()
        if consumed > 1:
            interval = now - self._last_batch_at
            self._pace_s = (
                interval if self._pace_s is None else (1 - _PACE_WEIGHT) * self._pace_s + (_PACE_WEIGHT * interval)
            )
        self._last_batch_at = now
        if self.current is not state:  # its first batch: a checkpoint may name this epoch from now on
            state.snapshot.mark_started()
        self.current = state
        if now - state.touched_at >= _TOUCH_EVERY_S:
            state.touched_at = now
            state.snapshot.touch()  # progress the daemon sees: a reading trainer is not a stuck one
        if self._is_due(state, consumed):
            self._prepare(state.epoch + 1)

    def _learn_build(self, seconds: float, *, background: bool) -> None:
        """The build estimate the lead is made of (NOTE [ Epoch handover ]): the longest of the last few background
        builds. A build on the training thread (the first epoch's: it also starts the worker pool, and a growing
        one opens a snapshot still filling) counts only until the first background build is known: one slow
        build must not pin every later epoch early, which would let the next epoch pin what the previous one just
        read instead of what the remote delivered during the current one (``_cache/room.py``)."""
        if background:
            self._recent_builds.append(seconds)
            self._build_estimate_s = max(self._recent_builds)
        elif not self._recent_builds:
            self._build_estimate_s = max(self._build_estimate_s, seconds)

    def _is_due(self, state: EpochState, consumed: int) -> bool:
        if state.growing is not None and not state.growing.is_complete:
            total = self._closed_total(state)
            # its end is not known yet: the next epoch is pinned once it stopped growing; the total counts the
            # batches earlier runs of a resumed epoch consumed, as ``position`` does (``consumed`` is this run's)
            return total is not None and self._due(state.position, total)
        return self._due(consumed, state.batches)

    def _closed_total(self, state: EpochState) -> int | None:
        """A growing epoch's batches for this rank once its creator's grower closed the snapshot (None before, and
        on a rank that did not create it: it learns the end from its own polls). The loop learns that the epoch is
        complete only as it reads past the batches cut so far, so the rule of ``_due`` is applied to this count
        instead: a snapshot closed before its epoch became current (a cache full when the epoch began, whose
        ``_growth_closed`` found it not current yet) had its next epoch built only at its last batch."""
        growing = state.growing
        if growing is None or growing.grower is None or not growing.grower.closed.is_set():
            return None
        quota = growing.share.quota  # a set size: exact; else what the closed snapshot holds
        samples = quota if quota is not None else state.snapshot.samples // self.plan.ranks.local_world_size
        full, rest = divmod(samples, self.plan.batch_size)
        return full + (1 if rest and not self.plan.drop_last else 0)

    def _growth_closed(self, epoch: int) -> None:
        """The grower closed ``epoch``'s growing snapshot (grower thread). A loop that caught up with ingest is
        waiting in ``next()`` for the last generation and ends the epoch a batch or two later; the training thread
        would learn that the epoch is complete only at its last batch, and the next epoch's build would make the
        boundary wait. So the next epoch is prepared now, if due by the usual rule at this rank's final count."""
        with self._lock:
            state = self._states.get(epoch)
        if state is None or state.phase != "current" or state.growing is None:
            return
        total = self._closed_total(state)
        if total is not None and self._due(state.position, total):  # a resumed epoch's total counts earlier runs'
            self._prepare(epoch + 1)

    def _due(self, consumed: int, total: int) -> bool:
        """NOTE [ Epoch handover ]'s rule: after ``consumed`` of ``total`` batches, is it time to build the next?"""
        if self.plan.prepare_at is not None:
            return consumed >= math.ceil(self.plan.prepare_at * total)
        remaining = total - consumed
        if remaining > total / 2:
            return False  # never in the first half: the next epoch's fresh samples are delivered during this one
        if remaining <= 2 * self.plan.window:
            return True
        if self._pace_s is None:
            return False
        return remaining * self._pace_s <= _LEAD_FACTOR * self._build_estimate_s + _LEAD_MARGIN_S

    def _prepare(self, epoch: int) -> None:
        if self.plan.epochs is not None and epoch >= self.plan.epochs:
            return
        with self._lock:
            if self._closed or epoch in self._states or epoch in self._taking:
                return
            discarded = self._prepared
            if discarded is not None and discarded[0] == epoch:
                return
            future = self._builder.submit(self._build_in_background, epoch)
            self._prepared = (epoch, future)
        if discarded is not None:  # outside the lock: a done future runs the callback right here
            discarded[1].add_done_callback(self._retire_future)

    def on_wait(self, seconds: float, *, first_batch: EpochState | None) -> None:
        """Account the training thread's time in cachefeed at a handover (NOTE above)."""
        self._waited_s += seconds
        if first_batch is not None:
            first_batch.first_batch_wait_s, self._waited_s = self._waited_s, 0.0
            self._handover_over.set()

    def on_exhausted(self, inner: Iterator[Any]) -> None:
        """An epoch's last batch was taken: its iterator is stopped on the teardown thread, after the handover."""
        with self._lock:
            if not self._closed:
                self._handover_over.clear()  # until the next epoch's first batch (``on_wait``)
                self._teardown.submit(self._after_handover, shutdown_iterator, "stopping DataLoader workers", inner)
                return
        shutdown_iterator(inner)

    def on_complete(self, state: EpochState) -> None:
        """An iteration of ``state``'s epoch ran to its end: what it served is recorded now (teardown thread, after
        the handover), not only at its release. A checkpoint taken now names the next epoch at its start
        (``EpochState.is_complete``), so a run killed before the release (during an evaluation, say) would
        otherwise leave the epoch's reads unrecorded: nothing would resume it to record them."""
        with self._lock:
            if not self._closed:
                self._teardown.submit(self._after_handover, self._record_served, "recording what it served", state)

    def _record_served(self, state: EpochState) -> None:
        if state.phase == "released":
            return  # its release recorded it
        try:
            served = state.served()
            state.snapshot.record_served(served)  # a union: a release that served more adds to it
            state.recorded_samples = len(served)  # only grows: as many again at the release is the same set
        except (OSError, SnapshotError) as exc:
            log.debug("epoch %d: recording what it served at its end: %s", state.epoch, exc)

    def _after_handover(self, fn: Callable[..., object], what: str, *args: object) -> None:
        """Run a teardown step once the handover under way is over (the next epoch's first batch was handed out, or
        ``_TEARDOWN_HOLD_S`` passed: a loop that stops between epochs), not during it: the teardown thread's Python
        would hold the GIL whenever the training thread makes a system call at the boundary, for up to the switch
        interval (5 ms) each time. Releasing a pin or stopping a pass a moment later costs nothing."""
        if self._unreleased <= _RELEASE_BACKLOG:  # else epochs retire faster than this thread releases them
            self._handover_over.wait(_TEARDOWN_HOLD_S)
        _logged(fn, what, *args)


def _logged(fn: Callable[..., object], what: str, *args: object) -> None:
    """Run a teardown step on the teardown thread, where nobody waits for its outcome: log a failure."""
    try:
        fn(*args)
    except Exception:
        log.warning("%s failed", what, exc_info=True)


def _stopped(watch: PublishWatch | None) -> None:
    """Stop ``watch`` (None: nothing to stop)."""
    if watch is not None:
        watch.stop()
