"""``EpochLoaderFactory``: each epoch's loader over a pinned snapshot, ready before the previous epoch ends.

NOTE [ Epoch handover ]
-----------------------
Threads: the *training thread* (the caller's loop), one *build thread* and one *teardown thread* per factory.
Processes: with ``num_workers > 0``, one worker pool for the factory's whole life (``pool.py``): workers are
started once, with the first epoch, and every epoch's batches are queued on them; without workers, each epoch reads
in-process through a DataLoader of its own.

* While epoch ``e`` runs, the training thread reports progress after each batch (``Epochs.on_progress`` in
  ``lifecycle.py``, the owner of every epoch's states and transitions). When the time left in ``e`` (remaining
  batches x the recent batch interval) falls under twice the longest of the last four background builds (before
  the first one, the first epoch's build) plus 0.1 s, or fewer than two prefetch windows (``num_workers x
  prefetch_factor`` batches) are left, but never before half of ``e``'s batches were taken (the daemon fetches
  the next epoch's fresh samples during ``e``: pinned earlier, the next epoch would re-read what ``e - 1`` just
  read), or at the fraction ``prepare_at`` if given, the build thread starts on ``e + 1``: pin its snapshot
  (local rank 0 creates, the node's other ranks join), compute this rank's share, build the dataset and queue its
  pass on the pool (without workers: build its DataLoader and fetch the first batch). The pool deals ``e + 1``'s
  batches to the workers as soon as ``e``'s are all dealt, so its first batches are read while ``e``'s last ones
  are consumed.
  Pinning late keeps the snapshot fresh (it holds what was cached a moment before the boundary; at most the
  daemon's epoch room of it, least-read first, counting the segments of ``e`` and of ``e - 1``, if its release
  or its receipt is still on the way, as read: ``_cache/room.py``)
  and keeps two snapshots from sharing the budget for long (epochs only a little longer than the lead are fine);
  starting early enough keeps the boundary free of waits. No process is forked at a boundary, so the lead is small.
  A training loop busy in Python holds the GIL: the build runs with prompt GIL hand-offs (``gil.py``), or its
  system calls would each wait up to 5 ms for the GIL and the build would outlast the lead.
* ``_EpochIterator`` stops after exactly ``len(loader)`` batches without asking the inner iterator again (a
  DataLoader's own end would join its workers on the training thread); the exhausted iterator goes to the teardown
  thread, which closes it.
* ``loader(e + 1)`` takes the prepared epoch (waiting for the build only if it is late) and retires every other
  epoch: the teardown thread closes its passes, waits until every worker has closed its readers of the epoch's
  segments, closes its dataset and releases its pin. The training thread never joins a process or unlinks a file
  at the boundary, and the teardown thread starts only once the boundary is over (the new epoch's first batch
  handed out, or after 1 s): its Python would otherwise hold the GIL while the training thread waits for it.
* The handover wait (``EpochStats.handover_wait_s``) is the time the training thread spends inside cachefeed
  between the last batch of ``e`` and the first of ``e + 1``: the ``next()`` that ends ``e``, ``loader(e + 1)``,
  ``iter()`` and the first ``next()``. The training step itself is not counted.

Failures of a background build are re-raised by ``loader(e + 1)`` on the training thread, with their traceback.
With several nodes, every rank's build thread joins one all-reduce per epoch on a dedicated gloo group (created
by the constructor, which every rank calls), in epoch order, so the training thread's collectives are never
interleaved with ours.

This module is the public face (arguments, checkpoints, the cache's classes and sources); the epochs themselves
are ``lifecycle.py``'s, which the others serve: ``partition.py`` (who reads what), ``resume.py`` (checkpoints),
``epoch.py`` (one epoch's resources and loader), ``growing.py`` (an epoch over a growing set),
``pool.py``/``arena.py``/``collate.py`` (the feed), ``wait.py`` (the first fill).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import numbers
import os
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO, cast

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from cachefeed._cache.layout import DAEMON_RESTART_WINDOW_S, CacheLayout
from cachefeed._cache.settings import DEFAULT_SNAPSHOT_GRACE_S
from cachefeed._cache.snapshots import Snapshot, sweep_unwatched
from cachefeed._cache.sources import cached_data, read_sources
from cachefeed._labels import read_classes
from cachefeed._logs import get_logger
from cachefeed._trainer.collate import collate_samples
from cachefeed._trainer.compat import LoaderSettings, pin_memory_in_effect
from cachefeed._trainer.dataset import SnapshotDataset, Transform
from cachefeed._trainer.epoch import EpochLoader, EpochStats
from cachefeed._trainer.lifecycle import EpochPlan, Epochs
from cachefeed._trainer.partition import (
    EpochBatchSampler,
    RankInfo,
    detect_ranks,
    job_id,
    launcher_run_id,
    sanitize_run_id,
    snapshot_name,
)
from cachefeed._trainer.pool import ARENA_BYTES, WorkerPool
from cachefeed._trainer.resume import ResumePoint, checkpoint, pending_checkpoint, resume_point
from cachefeed._trainer.wait import (
    parse_fill,
    wait_for_cache,
)
from cachefeed._units import parse_size

__all__ = ["EpochLoaderFactory"]

log = get_logger(__name__)


_RESERVED_OPTIONS = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "num_workers")
DEFAULT_MIN_FILL = "75%"  # what the first epoch waits for by default (see min_samples)
_MIN_ARENA_BYTES = 1 << 20


class EpochLoaderFactory:
    """Per-epoch DataLoaders over pinned snapshots of a cachefeed cache, prepared ahead (NOTE above).

    Use it as a context manager (or call ``close``); a factory dropped without either is closed when it is
    garbage-collected (its workers stop and its pins go, as ``close`` does), though not at the interpreter's exit,
    where its process's end drops its pins as a killed trainer's (resumable for ``cache.snapshot_grace``)::

        with EpochLoaderFactory("/dev/shm/cachefeed/example", batch_size=256, num_workers=4) as factory:
            for epoch in range(epochs):
                for batch in factory.loader(epoch):
                    train_step(batch["data"])

    Args:
        cache_dir: the cache directory (the daemon's ``cache.dir``). A trainer started with its daemon waits up to
            ``wait_timeout_s`` for the daemon to create it (``NoSuchCacheError`` after that, or at once where the
            path is a file, or a directory that holds a cache rather than being one, or other files and no cache:
            an empty directory is waited for).
        batch_size: samples per batch.
        num_workers: DataLoader worker processes, started once and kept for every epoch (``pool.py``).
        shuffle: shuffle each epoch with a permutation seeded by ``(seed, epoch)`` (identical on every rank).
        seed: see ``shuffle``.
        drop_last: drop this rank's last partial batch.
        transform: per-sample function run in the workers; with workers it must pickle (each epoch's dataset goes
            to the workers pickled, whatever the start method): a module-level function or a ``functools.partial``
            of one, not a lambda or a local function (refused here, naming it).
        collate_fn: batches samples (default ``torch.utils.data.default_collate``; a batch whose samples have
            different fields is refused with a ValueError naming them, where torch would key it by the first).
        verify: check every record's checksum when reading (a failing record is skipped, never served); False
            checks nothing of a record's bytes, not even which key it holds.
        samples_per_epoch: every epoch is exactly this many samples of the node's snapshot (split equally among
            the node's ranks; a remainder the ranks do not divide is left out, with a warning), least-read first,
            reusing samples when fewer are cached: ``len(loader)`` and the
            number of steps are known before training starts (``batches_per_epoch``). While the daemon fills the
            cache, a later epoch reads what no epoch has read first and takes segments as they are published, and
            where the remote is slower than training its rest is the least-read cached samples (it never waits
            for the remote: ``growing.py``, "Later epochs"). None: each epoch is one pass over its snapshot.
        min_samples: None (the default): the first epoch starts on a *growing set* as soon as every worker has a
            segment to read, and keeps taking segments as the daemon publishes them until it has its samples
            (``samples_per_epoch``) or the daemon can fill no further (``growing.py``): the first batch comes
            seconds after a cold start, and the first epoch is ordered by arrival (shuffled within each ~50 ms of
            ingest) rather than over the whole cache. Set it to wait instead, then shuffle over everything cached
            (the behaviour before growing epochs; later epochs then read snapshots of what is cached, least-read
            first): a number of cached samples, or a fill level such as ``"75%"`` of
            what the daemon keeps (its budget less metadata), reached also when the daemon
            cannot fill further (it waits for trainers, or holds everything the remote lists) or when no daemon
            runs (a static cache). With several nodes and no ``samples_per_epoch``, or with weighted sources, the
            first epoch cannot grow (its length needs agreeing up front) and waits for ``samples_per_epoch`` or
            ``"75%"``.
        wait_timeout_s: how long that wait may take before ``SnapshotError``; also how long the constructor waits
            for the cache directory to appear (a trainer started together with the daemon) before
            ``NoSuchCacheError``.
        join_timeout_s: how long a non-zero local rank waits for local rank 0's snapshot of an epoch.
        prepare_at: fraction of an epoch's batches after which the next epoch is prepared; None = automatic.
        epochs: the number of epochs, if known: epoch ``epochs`` is then never prepared (no workers started for
            an epoch that will not run).
        run_id: names the snapshots (``<run_id>-<job>-e<epoch>``, where ``job`` is a nonce the job's ranks agree on,
            so two jobs never share a snapshot: ``partition.job_id``); default from torchrun, needed with several
            ranks otherwise.
        rank, world_size: the ranks sharing this cache, if torch.distributed / torchrun do not say.
        progress: where the first wait writes its progress (None: silent).
        arena_bytes: with ``num_workers > 0``, each worker's shared memory for its batches at start: bytes or a
            size such as ``"1GiB"``, at least 1 MiB (default 256 MiB, sparse: pages cost memory once written; with
            ``pin_memory`` all of it is page-locked). A batch that does not fit ``prefetch_factor + 2`` times
            makes every worker's grow by room for that many (up to a quarter of RAM for all workers); the few
            batches placed before the workers heard travel whole through a pipe. Size it for ``prefetch_factor
            + 2`` batches to avoid that.
        **loader_options: passed to every ``DataLoader`` (pin_memory, prefetch_factor, multiprocessing_context,
            persistent_workers, worker_init_fn, timeout, generator, in_order, pin_memory_device).
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        *,
        batch_size: int,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        transform: Transform | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        verify: bool = True,
        samples_per_epoch: int | None = None,
        min_samples: int | str | None = None,
        wait_timeout_s: float = 600.0,
        join_timeout_s: float = 300.0,
        prepare_at: float | None = None,
        epochs: int | None = None,
        run_id: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        progress: TextIO | None = sys.stderr,
        arena_bytes: int | str | None = None,
        **loader_options: Any,
    ) -> None:
        batch_size = _integer("batch_size", batch_size, 1)
        num_workers = _integer("num_workers", num_workers, 0)
        seed = _integer("seed", seed, 0)
        samples_per_epoch = None if samples_per_epoch is None else _integer("samples_per_epoch", samples_per_epoch, 1)
        epochs = None if epochs is None else _integer("epochs", epochs, 0)
        rank = None if rank is None else _integer("rank", rank, 0)  # "1" straight from os.environ: told here
        world_size = None if world_size is None else _integer("world_size", world_size, 1)
        if rank is not None and world_size is not None and rank >= world_size:  # RankInfo's rule, before the wait
            raise ValueError(
                f"rank must be below world_size (ranks count from 0), got rank={rank}, world_size={world_size}"
            )
        for flag, given in (("shuffle", shuffle), ("drop_last", drop_last), ("verify", verify)):
            if not isinstance(given, bool | np.bool_):  # "False" is true: it shuffled
                raise TypeError(f"{flag} must be True or False, got {given!r} ({type(given).__name__})")
        for hook, function in (("transform", transform), ("collate_fn", collate_fn)):
            if function is not None and not callable(function):  # else it failed at the first batch
                raise TypeError(f"{hook} must be a function (or None), got {function!r} ({type(function).__name__})")
        grows_first = min_samples is None  # the first epoch starts on a growing set (``growing.py``)
        if min_samples is None:  # what the first epoch waits for where it cannot grow (several nodes, sources)
            min_samples = samples_per_epoch or DEFAULT_MIN_FILL
        min_samples = _min_samples(min_samples)
        self.min_fill = parse_fill(min_samples) if isinstance(min_samples, str) else None
        if isinstance(min_samples, int) and min_samples < 0:
            raise ValueError(f"min_samples must be >= 0 or a fill level such as '75%', got {min_samples}")
        timeouts: tuple[tuple[str, object], ...] = (
            ("wait_timeout_s", wait_timeout_s),
            ("join_timeout_s", join_timeout_s),
        )
        for timeout, seconds in timeouts:
            if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not float(seconds) > 0:
                raise ValueError(f"{timeout} must be a number of seconds > 0, got {seconds!r}")
        if prepare_at is not None and not 0.0 <= prepare_at <= 1.0:
            raise ValueError(f"prepare_at must be a fraction between 0 and 1 (or None), got {prepare_at}")
        if num_workers and transform is not None:
            _check_pickles("transform", transform)
        self.arena_bytes = _arena_bytes(arena_bytes)
        if num_workers and loader_options.get("prefetch_factor") is not None:  # 0 was taken as the default, 2
            loader_options["prefetch_factor"] = _integer("prefetch_factor", loader_options["prefetch_factor"], 1)
        reserved = sorted(set(loader_options) & set(_RESERVED_OPTIONS))
        if reserved:
            raise TypeError(f"EpochLoaderFactory sets {', '.join(reserved)} itself; use its own arguments")
        _check_loader_options(loader_options)  # before the wait for the cache: a typo is told at once
        # absolute now: a later os.chdir must not move it; "~" as a shell would (the daemon's cache.dir is absolute)
        self.layout = CacheLayout(Path(cache_dir).expanduser().absolute())
        self._data_read: tuple[tuple[int, int], list[str] | None] | None = None  # (made_with.json's stamp, data)
        wait_for_cache(self.layout, timeout_s=wait_timeout_s, progress=progress)  # a daemon may be starting
        if not self.layout.had_writer_within(DAEMON_RESTART_WINDOW_S):  # static: nobody else removes what dead
            # trainers left (a daemon restarting keeps them for its own grace)
            removed = sweep_unwatched(self.layout, grace_s=DEFAULT_SNAPSHOT_GRACE_S)
            if removed:
                log.info(
                    "removed %d snapshots of trainers gone for %gs: %s", len(removed), DEFAULT_SNAPSHOT_GRACE_S, removed
                )
        self.ranks: RankInfo = detect_ranks(rank, world_size)
        if samples_per_epoch is not None and samples_per_epoch < self.ranks.local_world_size:
            raise ValueError(
                f"samples_per_epoch = {samples_per_epoch} is fewer than the {self.ranks.local_world_size} ranks "
                "that share it on this node: each rank's epoch would be empty"
            )
        if samples_per_epoch is not None and samples_per_epoch % self.ranks.local_world_size:
            ranks = self.ranks.local_world_size
            log.warning(
                "samples_per_epoch = %d is not a multiple of the %d ranks that share it on this node: each epoch "
                "serves %d (%d per rank) and leaves out the %d left over; pass a multiple of %d to "
                "serve exactly what you ask",
                samples_per_epoch,
                ranks,
                samples_per_epoch - samples_per_epoch % ranks,
                samples_per_epoch // ranks,
                samples_per_epoch % ranks,
                ranks,
            )
        env_run_id = launcher_run_id()
        if run_id is None and env_run_id is None and self.ranks.local_world_size > 1:
            raise ValueError(
                "several ranks share this cache but nothing names the run: pass run_id= (the same on every rank), "
                "or launch with torchrun"
            )
        self.run_id = sanitize_run_id(run_id) if run_id is not None else (env_run_id or f"pid{os.getpid()}")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.transform = transform
        # default_collate, the fields checked as the workers check them (``_plan``)
        self.collate_fn = collate_samples if collate_fn in (None, default_collate) else collate_fn
        self.verify = verify
        self.samples_per_epoch = samples_per_epoch
        self.min_samples = min_samples
        self.wait_timeout_s = wait_timeout_s
        self.join_timeout_s = join_timeout_s
        self.prepare_at = prepare_at
        self.epochs = epochs
        self.progress = progress
        self.loader_options = pin_memory_in_effect(loader_options)  # one log line where nothing can pin
        # Fail here, on the caller's thread, on options DataLoader refuses (e.g. prefetch_factor without workers).
        DataLoader(
            cast(Dataset[Any], []),
            batch_sampler=cast(Sampler[list[int]], EpochBatchSampler(np.empty(0, np.int64), 1)),
            num_workers=num_workers,
            **self.loader_options,
        )
        self._pool = self._new_pool(None if collate_fn is default_collate else collate_fn) if num_workers else None
        self._agree_group = self._new_agree_group()
        self.job = job_id(self.ranks, broadcast=self._broadcast if self._agree_group is not None else None)
        self._epochs = Epochs(
            EpochPlan(
                layout=self.layout,
                ranks=self.ranks,
                job=self.job,
                run_id=self.run_id,
                batch_size=batch_size,
                drop_last=drop_last,
                shuffle=shuffle,
                seed=seed,
                samples_per_epoch=samples_per_epoch,
                transform=transform,
                verify=verify,
                num_workers=num_workers,
                collate_fn=self.collate_fn,
                loader_options=self.loader_options,
                window=max(1, num_workers) * int(loader_options.get("prefetch_factor") or 2),
                grows_first=grows_first,
                min_fill=self.min_fill,
                min_samples=min_samples,
                wait_timeout_s=wait_timeout_s,
                join_timeout_s=join_timeout_s,
                prepare_at=prepare_at,
                epochs=epochs,
                progress=progress,
                agree_min=functools.partial(_agree_min, self._agree_group if self.ranks.nodes_differ else None),
            ),
            self._pool,
        )
        self._loaded: tuple[int, ResumePoint | None] | None = None  # ``load_state_dict``'s place (``state_dict``)
        # Nothing the epochs or the pool hold refers back to this factory, so dropping it collects it: then its
        # workers stop and its pins go. Not at exit: a process that ends drops its pins as a killed one's.
        self._finalizer = weakref.finalize(self, _close_dropped, self._epochs, self._pool)
        self._finalizer.atexit = False

    # -- public API ----------------------------------------------------------------------------------------

    def loader(self, epoch: int) -> EpochLoader:
        """The loader of ``epoch`` (prepared in the background if the previous epoch ran through this factory).

        Moving to an epoch retires every other one (its workers stop and its pin is released, off this thread).
        Asking for an epoch again after moving on from it (going back) reads it anew, as any epoch: on a fresh
        snapshot of what is cached, or on the one another rank of the job still holds (``lifecycle.py``).
        """
        epoch = _integer("epoch", epoch, 0)
        started = time.perf_counter()
        state = self._epochs.activate(epoch, with_loader=True)
        self._epochs.on_wait(time.perf_counter() - started, first_batch=None)
        settings = LoaderSettings(
            self.batch_size, self.drop_last, self.num_workers, self.collate_fn, self.loader_options
        )
        return EpochLoader(state, self._epochs, lambda: self.stats(epoch), settings)

    def dataset(self, epoch: int) -> SnapshotDataset:
        """The snapshot dataset of ``epoch``, for your own DataLoader. Pinned until the factory moves on or closes.

        Note that the dataset holds *all* samples of the node's snapshot; ``share(epoch)`` gives this rank's part.
        """
        return self._epochs.activate(_integer("epoch", epoch, 0), with_loader=False).dataset

    def share(self, epoch: int) -> npt.NDArray[np.int64]:
        """This rank's indices into ``dataset(epoch)``, in this epoch's order (disjoint, equal-sized across ranks)."""
        return self._epochs.activate(_integer("epoch", epoch, 0), with_loader=False).indices

    def snapshot_id(self, epoch: int) -> str:
        """The name of the snapshot this factory pins for ``epoch`` (``<run_id>-<job>-e<epoch>``; a resumed epoch
        keeps its checkpoint's snapshot when it joins it)."""
        return snapshot_name(self.run_id, self.job, epoch)

    def stats(self, epoch: int) -> EpochStats:
        """Statistics of an epoch this factory built (KeyError for one it never built, or released more than 1,024
        epochs ago)."""
        return self._epochs.stats(epoch)

    def close(self) -> None:
        """Stop all workers and release all pins. Idempotent."""
        self._close(interrupted=False)

    def _close(self, *, interrupted: bool) -> None:
        self._finalizer.detach()
        self._epochs.close(interrupted=interrupted)
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> EpochLoaderFactory:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Closes the factory; left by an exception (Ctrl-C included; not ``sys.exit(0)``), the epoch being read
        stays resumable for ``cache.snapshot_grace`` where a daemon runs (``Epochs.close``)."""
        clean = exc_type is None or isinstance(exc, GeneratorExit) or (isinstance(exc, SystemExit) and not exc.code)
        self._close(interrupted=not clean)

    # -- building ------------------------------------------------------------------------------------------

    def _new_pool(self, collate_fn: Callable[[list[Any]], Any] | None) -> WorkerPool:
        """The worker processes every epoch shares (started with the first epoch; see pool.py).

        DataLoader options map onto it: ``prefetch_factor``, ``multiprocessing_context``, ``worker_init_fn`` (run
        once per worker: workers persist, as with ``persistent_workers=True``), ``timeout``, ``generator`` (draws
        the workers' base seed) and ``pin_memory`` (the workers' shared memory is registered with CUDA).
        ``persistent_workers`` and ``in_order`` change nothing: workers always persist, batches always come in
        order.
        """
        options = self.loader_options
        generator = options.get("generator")
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
        return WorkerPool(
            self.num_workers,
            collate_fn=collate_fn,
            context=options.get("multiprocessing_context"),
            prefetch_factor=int(options.get("prefetch_factor") or 2),
            worker_init_fn=options.get("worker_init_fn"),
            timeout_s=float(options.get("timeout") or 0.0),
            seed=seed,
            arena_bytes=self.arena_bytes,
            pin_memory=bool(options.get("pin_memory")),
        )

    def _new_agree_group(self) -> Any:
        """A gloo group of every rank, for the job's id and the cross-node share (one per factory, made by the
        constructor, which every rank calls)."""
        if not self.ranks.is_distributed or self.ranks.world_size == 1:
            return None
        return torch.distributed.new_group(backend="gloo")

    def _broadcast(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        torch.distributed.broadcast(tensor, src=0, group=self._agree_group)
        return int(tensor.item())

    # -- checkpoints --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the training loop is: a plain dict to store in a checkpoint (``load_state_dict`` resumes it).

        Holds the epoch, the batches of it the loop has received (not those a ``DevicePrefetcher`` holds ahead),
        the snapshot the epoch reads (its name and nonce) and every setting that decides the epoch's order and
        this rank's share (``resume.py``). Save it together with the model, after the step on the last batch.
        Once the loop has received every batch of the epoch, it names the next epoch, at its start: a checkpoint
        saved at the end of an epoch resumes with the next one, not with an empty rerun of the finished one. A
        resumed epoch counts the batches its checkpoint says were consumed plus those received since; after
        ``load_state_dict``, until the loop starts iterating an epoch, the state is the loaded one's place.
        """
        state = self._epochs.current
        if state is None and self._loaded is not None:
            return pending_checkpoint(*self._loaded, self._settings(None))
        if state is None:
            return checkpoint(epoch=0, batches_consumed=0, snapshot=None, settings=self._settings(None))
        if state.is_complete:
            return checkpoint(epoch=state.epoch + 1, batches_consumed=0, snapshot=None, settings=self._settings(None))
        return checkpoint(
            epoch=state.epoch,
            batches_consumed=state.position,
            snapshot=state.snapshot,
            settings=self._settings(state.snapshot),
        )

    def _settings(self, snapshot: Snapshot | None) -> dict[str, Any]:
        """What decides an epoch's order and this rank's share (``resume.SETTINGS``, plus ``rank``)."""
        sources = {name: weight for name, weight in snapshot.sources.values()} if snapshot is not None else self.sources
        return {
            "seed": self.seed,
            "batch_size": self.batch_size,
            "samples_per_epoch": self.samples_per_epoch,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "world_size": self.ranks.world_size,
            "local_world_size": self.ranks.local_world_size,
            "rank": self.ranks.rank,
            "sources": sources,
            "data": self._data(),
        }

    def _data(self) -> list[str] | None:
        """What the cache holds samples of (``sources.cached_data``), read again only when ``made_with.json``
        changed: ``state_dict`` is called as often as every batch."""
        path = self.layout.made_with_file
        try:
            info = os.stat(path)
            stamp: tuple[int, int] | None = (info.st_mtime_ns, info.st_size)
        except OSError:
            stamp = None
        if stamp is None:
            return None
        if self._data_read is None or self._data_read[0] != stamp:
            self._data_read = (stamp, cached_data(path))
        return self._data_read[1]

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> int:
        """Resume from ``state_dict()``: returns the epoch to continue with (call ``loader(epoch)`` for it).

        That epoch reads exactly the samples it had not handed out yet, from the same snapshot, if the snapshot is
        still there (the daemon keeps a dead trainer's snapshot for ``cache.snapshot_grace``). Otherwise it runs on
        a fresh snapshot, skipping as many batches as were consumed (so step counts stay right), and one warning
        says so. Call before the first ``loader()``.

        Raises ValueError if a setting that decides the epoch's order or this rank's share changed (the seed, the
        batch size, ``samples_per_epoch``, ``shuffle``, ``drop_last``, the world sizes, the daemon's sources and
        weights, what the cache holds samples of), naming it and both values; ``strict=False`` accepts the change
        and takes the fresh-snapshot path.
        """
        epoch, resume = resume_point(state, self._settings(None), strict=strict)
        if self._epochs.has_built:
            raise RuntimeError("load_state_dict must be called before the first loader()")
        if resume is not None:
            self._epochs.resume_at(resume)
        self._loaded = (epoch, resume)  # what state_dict() says until the loop starts iterating an epoch
        return epoch

    @property
    def classes(self) -> list[str]:
        """The class names of a daemon that labels samples by their directory (``sampler.label = "parent"``):
        sample field ``label`` = i means ``classes[i]``. Built by the daemon from the whole remote listing, so it is
        complete however little is cached; read from the cache each time (classes that appear later are appended,
        indices never change). ``[]`` when the daemon does not label."""
        return read_classes(self.layout.classes_file)

    @property
    def sources(self) -> dict[str, float]:
        """The daemon's named sources (``[[source]]`` tables) and their weights (summing to 1): every epoch gives
        each source its weight's share of its samples, and each sample names its source in ``"__source__"``.
        ``{}`` for a daemon that reads one ``[remote]``."""
        return {entry.name: entry.weight for entry in read_sources(self.layout.sources_file)}

    @property
    def batches_per_epoch(self) -> int | None:
        """This rank's batches in every epoch with ``samples_per_epoch`` (None without: it depends on the cache)."""
        if self.samples_per_epoch is None:
            return None
        per_rank = self.samples_per_epoch // self.ranks.local_world_size
        return len(EpochBatchSampler(np.empty(per_rank, np.int64), self.batch_size, drop_last=self.drop_last))


def _agree_min(group: Any, value: int) -> int:
    """The least of every rank's ``value`` over ``group`` (None: this node alone decides, ``value``). A function of
    the group, not a method: the epochs hold it, and must not keep the factory alive (``weakref.finalize``)."""
    if group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=group)
    return int(tensor.item())


def _close_dropped(epochs: Epochs, pool: WorkerPool | None) -> None:
    """Close a factory that was garbage-collected unclosed: ``close``, from what it held, on a thread of its own.
    The collector may run this on any thread (one of the factory's own, holding the lock ``close`` takes, if the
    factory sat in a reference cycle), and closing waits for workers: neither may block that thread."""
    log.info("an EpochLoaderFactory was dropped without close(): closing it (use it in a with block)")

    def close() -> None:
        epochs.close()
        if pool is not None:
            pool.close()

    threading.Thread(target=close, name="cachefeed-close-dropped", daemon=True).start()


def _arena_bytes(value: int | str | None) -> int:
    """``arena_bytes`` as bytes (``ARENA_BYTES`` for None); ValueError naming what is expected."""
    if value is None:
        return ARENA_BYTES
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise ValueError(f"arena_bytes: {exc}, got {value!r}") from None
    if size < _MIN_ARENA_BYTES:
        raise ValueError(f"arena_bytes must be at least 1MiB (it holds whole batches), got {value!r}")
    return size


def _check_loader_options(options: Mapping[str, Any]) -> None:
    """Refuse a keyword neither the factory nor ``DataLoader`` takes, as Python refuses one of the factory's own,
    with the closest of either's parameters: passed on, DataLoader refused it in its own name (a class the caller
    never called), and only after the wait for the cache."""
    accepted = inspect.signature(DataLoader.__init__).parameters
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in accepted.values()):
        return  # a DataLoader that takes any keyword judges them itself
    unknown = next((name for name in options if name not in accepted), None)
    if unknown is None:
        return
    own = inspect.signature(EpochLoaderFactory.__init__).parameters
    names = [name for name in dict.fromkeys([*own, *accepted]) if name not in ("self", "dataset", "loader_options")]
    close = difflib.get_close_matches(unknown, names, n=1)
    hint = f": did you mean {close[0]!r}?" if close else " (neither its own nor a DataLoader option)"
    raise TypeError(f"EpochLoaderFactory() got an unexpected keyword argument {unknown!r}{hint}")


def _check_pickles(name: str, value: object) -> None:
    """The workers receive each epoch's dataset pickled, ``name`` with it: one that cannot pickle failed at the
    first epoch, with a bare ``KeyError`` in every worker."""
    try:
        pickle.dumps(value)
    except Exception as exc:
        raise ValueError(
            f"{name} = {value!r} cannot be pickled ({type(exc).__name__}: {exc}): the workers receive it pickled "
            "with each epoch's dataset; use a function defined at module level (or a functools.partial of one)"
        ) from None


def _integer(name: str, value: object, low: int) -> int:
    """``value`` as an int (numpy's integers too) of at least ``low``; ValueError naming ``name`` otherwise. A float
    or a str used to fail later, deep inside numpy or a format string (``loader(1.0)``: "Unknown format code")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")
    return int(value)


def _min_samples(value: object) -> int | str:
    """``min_samples`` as an int (numpy's integers too) or a fill level's text; ValueError for anything else: a
    float such as 0.75 used to be read as ``int(0.75)``, a first epoch that waited for nothing."""
    if isinstance(value, str):
        return value
    if not isinstance(value, bool) and isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float) and value.is_integer() and value >= 1:  # 1e4: a count written as a float
        return int(value)
    hint = (
        f": for a fill level of {value:.0%}, write '{value:.0%}'"
        if isinstance(value, float) and _is_fraction(value)
        else ""
    )
    raise ValueError(f"min_samples must be a count of samples (int) or a fill level such as '75%', got {value!r}{hint}")


def _is_fraction(value: object) -> bool:
    """A float between 0 and 1: what a user who means a fill level writes for ``min_samples`` (0.75 for 75%)."""
    return isinstance(value, float) and 0.0 < value <= 1.0
