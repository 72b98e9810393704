"""One epoch's resources (snapshot, dataset, its loader or pass, a started iterator) and the loader handed to the
training loop.

An ``EpochState`` holds what an epoch owns and counts what it served; it does not move itself from one state to the
next: ``lifecycle.py`` owns the states (``phase``: built, fed, current, retired, released) and the transitions, on
which thread each runs. A released state cannot be iterated again (its snapshot may be gone); what it served
(``served``: the samples of the batches the training loop received, plus those a checkpoint says an earlier run of
this epoch consumed) is recorded before its pin is dropped (NOTE [ Read receipts ] in ``_cache/reads.py``).

Consumption is what the loop received: a look-ahead wrapper (``DevicePrefetcher``, or the caller's own) that takes
batches from an ``EpochLoader``'s iterator before it yields them calls ``hold(+1)`` on that iterator for each batch
it takes and ``hold(-1)`` as it yields one, so ``state_dict()`` never counts a batch the loop has not seen. An epoch
resumed from a checkpoint counts on from it (``position``): the batches the checkpoint says earlier runs consumed
(``resumed_batches``, whichever snapshot the epoch resumed on) plus those this run's loop received, so that a run
resumed twice in one epoch skips what all earlier runs served.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from torch.utils.data import DataLoader, Sampler

from cachefeed._cache.snapshots import Snapshot
from cachefeed._errors import SnapshotError
from cachefeed._logs import get_logger
from cachefeed._trainer.compat import DataLoaderAttributes, LoaderSettings
from cachefeed._trainer.dataset import SnapshotDataset
from cachefeed._trainer.growing import GrowingEpoch
from cachefeed._trainer.pool import EmptyBatch, Pass, WorkerPool

__all__ = ["EmptyBatch", "EpochLoader", "EpochState", "EpochStats", "SkipEmptyCollate"]

log = get_logger(__name__)


class SkipEmptyCollate:
    """Wraps the user's collate function: an empty list of samples becomes ``EmptyBatch()`` (picklable)."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: list[Any]) -> Any:
        return EmptyBatch() if not samples else self.collate(samples)


@dataclass(frozen=True, slots=True)
class EpochStats:
    """What one epoch looked like, for the caller's logs.

    Attributes:
        epoch, snapshot_id: which epoch, over which snapshot.
        samples, segments: in the snapshot (the whole node's view).
        new_samples, new_segments: in segments that the previous epoch's snapshot did not have: all, for the first
            epoch this factory builds (a resumed run's too: it does not know the snapshot the killed run read before).
        rank_samples, batches: this rank's share and its planned number of batches.
        batches_served: batches handed to the training loop so far.
        skipped_corrupt: records that failed verification and were left out of their batch.
        wait_for_samples_s: the first epoch's wait for ``min_samples`` (0 afterwards).
        build_s: pinning, dataset, DataLoader, worker start and the first batch (the wait above excluded).
        prepared_in_background: built while the previous epoch ran (False: built when asked for).
        handover_wait_s: time the training loop spent inside cachefeed between the last batch of the previous
            epoch and the first batch of this one; None for the first epoch or before the first batch.
        first_batch_wait_s: the same measure for every epoch (for the first: from ``loader()`` to its first batch).
    """

    epoch: int
    snapshot_id: str
    samples: int
    segments: int
    new_samples: int
    new_segments: int
    rank_samples: int
    batches: int
    batches_served: int
    skipped_corrupt: int
    wait_for_samples_s: float
    build_s: float
    prepared_in_background: bool
    handover_wait_s: float | None
    first_batch_wait_s: float | None


class EpochHooks(Protocol):
    """What the factory does when the training loop moves through an epoch (implemented in loader.py)."""

    def on_progress(self, state: EpochState, consumed: int) -> None: ...

    def on_wait(self, seconds: float, *, first_batch: EpochState | None) -> None: ...

    def on_exhausted(self, inner: Iterator[Any]) -> None: ...

    def on_complete(self, state: EpochState) -> None: ...


class EpochState:
    """The resources of one epoch (see the module docstring for the lifecycle)."""

    def __init__(
        self,
        epoch: int,
        snapshot: Snapshot,
        dataset: SnapshotDataset,
        indices: npt.NDArray[np.int64],
        *,
        credited: npt.NDArray[np.int64] | None = None,
        resumed_batches: int = 0,
        new_samples: int,
        new_segments: int,
        wait_for_samples_s: float,
        growing: GrowingEpoch | None = None,
    ) -> None:
        self.epoch = epoch
        self.growing = growing  # an epoch over a growing snapshot (``growing.py``): its batches come as it grows
        self.snapshot = snapshot
        self.dataset = dataset
        self.indices = indices
        self.credited = credited if credited is not None else indices[:0]  # served by an earlier run of the epoch
        self.resumed_batches = resumed_batches  # consumed by earlier runs of the epoch, as its checkpoint says
        self.rank_samples = len(indices)
        self.new_samples = new_samples
        self.previous: frozenset[str] = frozenset()  # the previous epoch's segments (a growing epoch counts its new)
        self.new_segments = new_segments
        self.wait_for_samples_s = wait_for_samples_s
        self.build_s = 0.0
        self.prepared_in_background = False
        self.dataloader: DataLoader[Any] | None = None  # without workers (num_workers=0) only
        self.pool: WorkerPool | None = None  # with workers: the factory's pool, and this epoch's key in it
        self.pool_key = -1
        self.batch_list: list[npt.NDArray[np.int64]] = []
        self.phase = "built"  # built -> fed -> current -> retired -> released (lifecycle.py sets it)
        self.fed = False  # a loader (pool pass or DataLoader) was set up: the factory reads it, not the caller
        self._batches = 0
        self.batches_served = 0
        self.batches_consumed = 0  # batches the training loop received (empty ones included), this iteration
        self.batches_received = 0  # the most any iteration of this epoch received: what it served
        self.pass_batches: int | None = None  # batches of the last iteration that ran to its end (None: none did)
        self.warned_again = False  # the loader was iterated again after a complete pass, and a warning said so
        self.recorded_samples = -1  # how many served samples ``on_complete`` put on record (-1: none yet)
        self.batch_size = 1  # set when fed
        self.touched_at = 0.0  # perf_counter of the last ``snapshot.touch()`` (progress the daemon sees)
        self.first_batch_wait_s: float | None = None
        self.is_first_epoch = False
        self._started: tuple[Iterator[Any], list[Any]] | None = None  # iterator + its fetched first item
        self._live: set[int] = set()
        self._inners: dict[int, Iterator[Any]] = {}
        self._lock = threading.Lock()
        self._released = False
        self.unpinned = threading.Event()  # set once its release is done: its pin dropped
        self.was_retired = False  # handed to the teardown thread (``Epochs._retire``): counted until released
        self._final_skipped: int | None = None

    @property
    def batches(self) -> int:
        """This rank's batches in the epoch (an estimate while a growing epoch grows: ``growing.py``)."""
        return self.growing.planned_batches() if self.growing is not None else self._batches

    def feed(self, inner: Iterator[Any], head: list[Any], batches: int) -> None:
        """The epoch's loader is set up (``lifecycle.py``): ``inner`` iterates it, ``head`` holds batches it
        fetched ahead, ``batches`` is the planned count (a growing epoch: ``growing.planned_batches`` instead)."""
        self._batches = batches
        self.fed = True
        self.phase = "fed"
        with self._lock:
            self._started = (inner, head)
            self._inners[id(inner)] = inner

    def take_iterator(self) -> tuple[Iterator[Any], list[Any]]:
        """The prepared iterator (first use) or a fresh one. Raises SnapshotError once retired (the factory moved
        to another epoch: its release is under way) or released."""
        with self._lock:
            if self._released or self.phase == "retired":  # retired: served until the release, timing-dependent
                raise SnapshotError(
                    f"epoch {self.epoch} was released (the factory moved to another epoch or closed): "
                    "ask the factory for the epoch's loader again"
                )
            if self._started is not None:
                started, self._started = self._started, None
                return started
            inner: Iterator[Any]
            if self.pool is not None:
                inner = self.pool.open_pass(self.pool_key, self.dataset, self.batch_list, self.growing)
            elif self.dataloader is not None:
                inner = iter(self.dataloader)
            else:
                raise SnapshotError(f"epoch {self.epoch} has no loader (it was built with dataset() only)")
            self._inners[id(inner)] = inner
            return inner, []

    def forget_iterator(self, inner: Iterator[Any]) -> None:
        with self._lock:
            self._inners.pop(id(inner), None)

    def stats(self, *, handover: bool) -> EpochStats:
        skipped = self._final_skipped if self._final_skipped is not None else self.dataset.skipped
        new_samples, new_segments = self.new_samples, self.new_segments
        if self.growing is not None:  # what it holds now, grown, against the previous epoch's segments
            fresh = [
                c for n, c in zip(self.snapshot.names, self.snapshot.counts, strict=True) if n not in self.previous
            ]
            new_samples, new_segments = sum(fresh), len(fresh)
        return EpochStats(
            epoch=self.epoch,
            snapshot_id=self.snapshot.snap_id,
            samples=self.snapshot.samples,
            segments=len(self.snapshot.names),
            new_samples=new_samples,
            new_segments=new_segments,
            rank_samples=len(self.growing.share.indices) if self.growing is not None else self.rank_samples,
            batches=self.batches,
            batches_served=self.batches_served,
            skipped_corrupt=skipped,
            wait_for_samples_s=self.wait_for_samples_s,
            build_s=self.build_s,
            prepared_in_background=self.prepared_in_background,
            handover_wait_s=None if self.is_first_epoch or not handover else self.first_batch_wait_s,
            first_batch_wait_s=self.first_batch_wait_s,
        )

    def mark_released(self) -> list[Iterator[Any]] | None:
        """Mark the epoch released (``lifecycle.py`` then tears it down); its live iterators, or None if it already
        was."""
        with self._lock:
            if self._released:
                return None
            self._released = True
            self.phase = "released"
            inners = list(self._inners.values())
            self._inners.clear()
            self._started = None
        return inners

    def forget_resources(self) -> None:
        """A released epoch: drop what scales with it (the share's index array, also held by the DataLoader's batch
        sampler); its statistics stay right (the factory keeps them, ``Epochs._keep_stats``)."""
        self._final_skipped = self.dataset.skipped
        self.indices = self.indices[:0]
        self.batch_list = []
        self.dataloader = None

    def served(self) -> npt.NDArray[np.int64]:
        """The samples this process served (module docstring); with ``dataset()`` only, its whole share."""
        if self.growing is not None:  # an exact resume's skipped batches were served by the interrupted run
            every, start = self.growing.share.indices, self.growing.skipped_samples
            mine = every[start : start + self.batches_received * self.batch_size] if self.fed else every[start:]
            return np.concatenate((every[:start], mine))
        mine = self.indices[: self.batches_received * self.batch_size] if self.fed else self.indices
        return np.concatenate((self.credited, mine)) if len(self.credited) else mine

    def received(self, batches: int) -> None:
        """The training loop has received ``batches`` batches of this iteration (training thread)."""
        self.batches_consumed = batches
        self.batches_received = max(self.batches_received, batches)

    @property
    def position(self) -> int:
        """Where the training loop is in the epoch, in batches, as ``state_dict()`` counts it (module docstring):
        those earlier runs consumed (``resumed_batches``) plus those this iteration received."""
        return self.resumed_batches + self.batches_consumed

    @property
    def is_complete(self) -> bool:
        """The loop has received every batch of an iteration that ran to its end (a look-ahead wrapper's held
        batches included), or every batch of an epoch of a known size (a loop that stops at ``len(loader)``): a
        checkpoint taken now continues with the next epoch (``loader.state_dict``)."""
        if self.pass_batches is not None:
            return self.batches_consumed >= self.pass_batches
        return self.fed and self.growing is None and 0 < self._batches <= self.batches_consumed


class GrowingBatchSampler(Sampler[npt.NDArray[np.int64]]):
    """The batch sampler of an in-process DataLoader over a growing epoch: waits for growth as it goes."""

    def __init__(self, growing: GrowingEpoch) -> None:
        self.growing = growing

    def __len__(self) -> int:
        return self.growing.planned_batches()

    def __iter__(self) -> Iterator[npt.NDArray[np.int64]]:
        return self.growing.iter_batches()


def shutdown_iterator(inner: Iterator[Any]) -> None:
    """Stop a pool pass (deal no more) or a DataLoader iterator's workers (what its destructor would do, now)."""
    if isinstance(inner, Pass):
        inner.close()
        return
    shutdown = getattr(inner, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


class EpochLoader(DataLoaderAttributes):
    """The loader of one epoch, as ``factory.loader(epoch)`` returns it. It answers what code written for a
    DataLoader reads (``batch_size``, ``sampler``, ``num_workers``, ``drop_last``, ...: ``compat.py``).

    Iterate it once per epoch (a second ``iter()`` starts a fresh DataLoader iterator, without the head start).
    ``len()`` is the number of batches planned for this rank; batches left empty by corrupt records are dropped,
    so a loop may see fewer (``stats.skipped_corrupt`` says how many samples were skipped).

    Attributes:
        epoch: the epoch number.
        dataset: the ``SnapshotDataset`` (all samples of the snapshot; this rank reads its share).
        dataloader: the underlying ``torch.utils.data.DataLoader`` without workers; None with workers, whose
            batches come from the factory's worker pool (``pool.py``).
    """

    def __init__(
        self, state: EpochState, hooks: EpochHooks, stats: Callable[[], EpochStats], settings: LoaderSettings
    ) -> None:
        self._loader_settings = settings
        self._state = state
        self._hooks = hooks
        self._stats = stats
        self.epoch = state.epoch
        self.dataset = state.dataset
        if not state.fed:
            raise SnapshotError(f"epoch {state.epoch} has no loader")
        self.dataloader: DataLoader[Any] | None = state.dataloader

    @property
    def _epoch_indices(self) -> npt.NDArray[np.int64]:  # read from the state: a released epoch drops its indices
        return self._state.indices

    def __len__(self) -> int:
        return self._state.batches

    @property
    def snapshot_id(self) -> str:
        return self._state.snapshot.snap_id

    @property
    def stats(self) -> EpochStats:
        return self._stats()

    def __iter__(self) -> Iterator[Any]:
        started = time.perf_counter()
        again = self._state.pass_batches is not None
        inner, head = self._state.take_iterator()  # raises for an epoch the factory moved on from
        if again and not self._state.warned_again:
            self._state.warned_again = True  # once per epoch: a loop that means it is not told at every pass
            log.warning(
                "epoch %d's loader is iterated again after it was read to its end: it serves epoch %d again (the "
                "same samples, in the same order). Ask the factory for each epoch's loader: factory.loader(epoch) "
                "(with Lightning, Trainer(reload_dataloaders_every_n_epochs=1))",
                self.epoch,
                self.epoch,
            )
        self._state.pass_batches = None
        self._state.received(0)
        self._hooks.on_progress(self._state, 0)
        self._hooks.on_wait(time.perf_counter() - started, first_batch=None)  # the whole call is the handover's
        return _EpochIterator(self._state, self._hooks, inner, head)


class _EpochIterator(Iterator[Any]):
    """Hands out the batches of one pass; stops after exactly ``batches`` items without asking the inner
    iterator again, so the DataLoader's own end-of-epoch shutdown (joining workers) never runs on the training
    thread: the inner iterator goes to the factory's teardown thread instead."""

    def __init__(self, state: EpochState, hooks: EpochHooks, inner: Iterator[Any], head: list[Any]) -> None:
        self._state = state
        self._hooks = hooks
        self._inner: Iterator[Any] | None = inner
        self._head = head
        self._consumed = 0
        self._held = 0

    def hold(self, batches: int) -> None:
        """A look-ahead wrapper took (+1) or yielded (-1) a batch of this iterator (module docstring)."""
        self._held += batches
        self._state.received(self._consumed - self._held)

    def __next__(self) -> Any:
        started = time.perf_counter()
        state = self._state
        growing = state.growing is not None  # its end is the inner iterator's (the batch count is an estimate)
        try:
            while self._inner is not None and (growing or self._consumed < state.batches):
                try:
                    item = self._head.pop() if self._head else next(self._inner)
                except StopIteration:
                    if not growing:
                        raise
                    break
                self._consumed += 1
                state.received(self._consumed - self._held)
                self._hooks.on_progress(state, self._consumed)
                if isinstance(item, EmptyBatch):
                    continue
                state.batches_served += 1
                if state.batches_served == 1:  # only the handover's waits are accounted (see loader.py)
                    self._hooks.on_wait(time.perf_counter() - started, first_batch=state)
                return item
        except BaseException:
            self._finish()
            raise
        self._finish()
        state.pass_batches = self._consumed  # ran to its end: complete once the loop has them all
        self._hooks.on_complete(state)
        self._hooks.on_wait(time.perf_counter() - started, first_batch=None)
        raise StopIteration

    def _finish(self) -> None:
        inner, self._inner = self._inner, None
        if inner is not None:
            self._state.forget_iterator(inner)
            self._hooks.on_exhausted(inner)
