"""EpochLoaderFactory in one process: exact-once epochs, background preparation, the first wait, errors."""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.records import SegmentReader
from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._errors import NoSuchCacheError, SnapshotError
from cachefeed._testing.samples import check_sample, make_sample
from cachefeed._trainer import EpochLoaderFactory, partition
from cachefeed._trainer.partition import RankInfo, job_id, snapshot_name
from cachefeed._trainer.wait import wait_for_samples
from tests.support.cache_helpers import cache_config
from tests.support.stalls import StallWindow

# Ranks given explicitly (no torch.distributed) name their job from the launcher's environment: the same for both.
RANKS_JOB = job_id(RankInfo(1, 2, 1, 2), broadcast=None)


def rank_snapshot(run_id: str, epoch: int) -> str:
    return snapshot_name(run_id, RANKS_JOB, epoch)


def build_cache(root: Path, count: int, *, start: int = 0, nbytes: int = 256, segment_bytes: int = 16 << 10) -> Path:
    """Add ``count`` samples keyed ``k<start..>`` to the cache at ``root`` (created if needed); store closed."""
    store = CacheStore(cache_config(root, segment_bytes=segment_bytes))
    with CacheWriter(store, segment_bytes=segment_bytes, fsync=False) as writer:
        for i in range(start, start + count):
            writer.add(make_sample(f"k{i}", nbytes))
    store.close()
    return root


def check_batch(batch: dict) -> list[str]:
    for row, key in enumerate(batch["__key__"]):
        check_sample({"__key__": key, "data": batch["data"][row], "n": batch["n"][row]})
    return list(batch["__key__"])


def live_snapshot_locks(root: Path) -> list[str]:
    return sorted(p.name for p in CacheLayout(root).snapshots.glob("*.lock"))


def wait_until(predicate, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_epochs_serve_every_sample_once_and_the_next_is_ready_at_the_boundary(
    tmp_path: Path, stalls: StallWindow
) -> None:
    root = build_cache(tmp_path / "c", 600)
    with EpochLoaderFactory(
        root, batch_size=20, num_workers=2, multiprocessing_context="fork", prepare_at=0.0, run_id="t", epochs=3
    ) as factory:
        orders = []
        for epoch in range(3):
            loader = factory.loader(epoch)
            assert len(loader) == 30
            keys: list[str] = []
            for batch in stalls.batches(loader):
                keys += check_batch(batch)
                time.sleep(0.02)  # a training step: gives the background build time to finish
            assert sorted(keys) == sorted(f"k{i}" for i in range(600)), f"epoch {epoch}: exactly once"
            orders.append(keys)
            stats = factory.stats(epoch)
            assert (stats.samples, stats.rank_samples, stats.batches_served) == (600, 600, 30)
            assert stats.snapshot_id == factory.snapshot_id(epoch) and stats.snapshot_id.startswith("t-")
        assert orders[0] != orders[1], "shuffled per epoch"
        for epoch in (1, 2):
            stats = factory.stats(epoch)
            assert stats.prepared_in_background
            assert stats.handover_wait_s is not None, stats
            stalls.assert_handover(stats.handover_wait_s, 0.5, epoch=epoch)
            assert stats.new_samples == 0 and stats.new_segments == 0
        assert factory.stats(0).handover_wait_s is None and factory.stats(0).new_samples == 600
        assert factory._epochs._prepared is None, "epochs=3: no fourth epoch is prepared"
    assert live_snapshot_locks(root) == [], "closing releases every pin"
    assert multiprocessing.active_children() == [], "no worker left behind"


def test_in_process_epochs_map_each_segment_once_while_consecutive_epochs_share_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``num_workers=0``: the next epoch, built while this one is read, takes over its open readers (a map and its
    faulted pages), so the training thread does not map the same segment files again every epoch."""
    root = build_cache(tmp_path / "c", 600)
    segments = len(list((root / "segments").iterdir()))
    opened: list[str] = []
    original = SegmentReader.__init__

    def counting_init(self: SegmentReader, path: Path, *args: object, **kwargs: object) -> None:
        opened.append(Path(path).name)
        original(self, path, *args, **kwargs)

    monkeypatch.setattr(SegmentReader, "__init__", counting_init)
    with EpochLoaderFactory(root, batch_size=20, num_workers=0, prepare_at=0.5, run_id="t", epochs=4) as factory:
        for epoch in range(4):
            keys = []
            for batch in factory.loader(epoch):
                keys += check_batch(batch)
                time.sleep(0.01)  # a training step: the previous epoch is released meanwhile
            assert sorted(keys) == sorted(f"k{i}" for i in range(600))
    assert segments > 5
    assert sorted(opened) == sorted(set(opened)) and len(opened) == segments, (
        f"{len(opened)} maps of {segments} segments in 4 epochs"
    )


def test_moving_on_releases_the_previous_pin_off_the_training_thread(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 100)
    with EpochLoaderFactory(root, batch_size=10, run_id="t", prepare_at=1.0) as factory:
        old = factory.loader(0)
        next(iter(old))  # leave epoch 0 unfinished
        assert live_snapshot_locks(root) == [f"{factory.snapshot_id(0)}.lock"]
        factory.loader(1)
        wait_until(lambda: live_snapshot_locks(root) == [f"{factory.snapshot_id(1)}.lock"], what="epoch 0's pin to go")
        with pytest.raises(SnapshotError, match="released"):
            iter(old)


def test_a_factory_keeps_no_more_than_its_recent_epochs_however_many_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every released epoch's state (its snapshot's entries, events, about 11 KB) was kept for its statistics: a
    soak of a hundred thousand short epochs grew the training process by 1.1 MB a second. The witness: the epoch
    states alive in the process (the garbage collector's view), after 60 epochs with statistics kept for 8."""
    import gc

    from cachefeed._trainer import lifecycle
    from cachefeed._trainer.epoch import EpochState

    monkeypatch.setattr(lifecycle, "_STATS_KEPT", 8, raising=False)
    root = build_cache(tmp_path / "c", 20)
    with EpochLoaderFactory(root, batch_size=10, run_id="t") as factory:
        for epoch in range(60):
            for _batch in factory.loader(epoch):
                pass
        # released in order on the teardown thread: once 58 is, only 59 (current) and 60 (prepared) are left
        wait_until(lambda: 58 in factory._epochs._released_stats, what="epoch 58 released")
        gc.collect()
        alive = [o for o in gc.get_objects() if type(o) is EpochState]
        assert len(alive) <= 3, f"{len(alive)} epoch states alive after 60 epochs"
        assert factory.stats(59).samples == 20 and factory.stats(52).samples == 20
        with pytest.raises(KeyError, match="more than 8 ago"):
            factory.stats(10)


def test_new_samples_are_counted_against_the_previous_snapshot(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 200)
    with EpochLoaderFactory(root, batch_size=50, run_id="t", prepare_at=1.0) as factory:
        next(iter(factory.loader(0)))  # prepare_at=1.0: epoch 1 is not prepared before it is asked for
        build_cache(root, 120, start=200)
        keys = [k for batch in factory.loader(1) for k in check_batch(batch)]
        stats = factory.stats(1)
        assert stats.samples == 320 and len(keys) == 320
        assert stats.new_samples == 120 and stats.new_segments >= 1


def test_dataset_and_share_serve_people_who_build_their_own_loader(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 90)
    rank0 = Snapshot.create(root, rank_snapshot("t", 0), job=RANKS_JOB)  # what local rank 0 would do; rank 1 joins
    with EpochLoaderFactory(root, batch_size=8, run_id="t", rank=1, world_size=2, join_timeout_s=10) as factory:
        dataset, share = factory.dataset(0), factory.share(0)
        assert len(dataset) == 90 and len(share) == 45
        loader = DataLoader(dataset, batch_size=8, sampler=share.tolist())
        keys = [k for batch in loader for k in check_batch(batch)]
        assert len(set(keys)) == 45
    rank0.release()
    assert live_snapshot_locks(root) == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_of_corrupt_records_only_is_dropped_and_counted(tmp_path: Path, workers: int) -> None:
    root = build_cache(tmp_path / "c", 40)
    first = CacheLayout(root).segments / CacheLayout(root).list_segments()[0][0]
    with SegmentReader(first) as reader:
        offset = int(reader.offsets[0]) + int(reader.lengths[0]) - 100
        bad_key = reader.read(0)["__key__"]
    with open(first, "r+b") as handle:
        handle.seek(offset)
        handle.write(b"\xff\xfe")
    with EpochLoaderFactory(root, batch_size=1, num_workers=workers, run_id="t", epochs=1) as factory:
        loader = factory.loader(0)
        keys = [k for batch in loader for k in check_batch(batch)]
        assert len(loader) == 40 and len(keys) == 39 and bad_key not in keys
        assert factory.stats(0).skipped_corrupt == 1 and factory.stats(0).batches_served == 39


def test_the_first_epoch_waits_for_min_samples_and_shows_progress(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = CacheStore(cache_config(root, segment_bytes=8 << 10))

    def fill_later() -> None:
        # Once the loader says it waits (its clock runs from then), not half a second after the thread started:
        # a loaded machine may start the loader later than that.
        wait_until(lambda: "waiting for samples" in progress.getvalue(), timeout_s=60, what="the loader waiting")
        time.sleep(0.5)
        with CacheWriter(store, segment_bytes=8 << 10, fsync=False) as writer:
            for i in range(100):
                writer.add(make_sample(f"k{i}", 256))

    progress = io.StringIO()
    filler = threading.Thread(target=fill_later)
    filler.start()
    try:
        with EpochLoaderFactory(root, batch_size=10, min_samples=60, run_id="t", progress=progress) as factory:
            loader = factory.loader(0)
            stats = factory.stats(0)
            assert stats.samples >= 60 and stats.wait_for_samples_s >= 0.4
            assert "waiting for samples" in progress.getvalue()
            assert sum(len(b["__key__"]) for b in loader) == stats.samples
    finally:
        filler.join()
        store.close()


def test_new_segments_wake_the_wait_through_inotify_not_polling(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = CacheStore(cache_config(root, segment_bytes=8 << 10))
    published_at: list[float] = []

    def publish_later() -> None:
        time.sleep(0.3)
        with CacheWriter(store, segment_bytes=8 << 10, fsync=False) as writer:
            writer.add(make_sample("k0", 256))
        published_at.append(time.monotonic())

    filler = threading.Thread(target=publish_later)
    filler.start()
    try:
        have = wait_for_samples(CacheLayout(root), 1, timeout_s=30, progress=None, poll_s=30.0)
        woke = time.monotonic()
    finally:
        filler.join()
        store.close()
    assert have == 1
    assert woke - published_at[0] < 2.0, "woken by the new segment, not by the 30 s poll"


def test_a_cache_dir_with_a_tilde_or_relative_is_taken_as_the_shell_would_and_kept_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = build_cache(tmp_path / "home" / "cache", 20)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with EpochLoaderFactory("~/cache", batch_size=10, wait_timeout_s=5, progress=None) as factory:
        assert factory.layout.root == root
    monkeypatch.chdir(tmp_path / "home")
    with EpochLoaderFactory("cache", batch_size=10, progress=None) as factory:
        monkeypatch.chdir(tmp_path)  # the loop changes directory: the next epoch still finds its cache
        assert len([key for batch in factory.loader(0) for key in check_batch(batch)]) == 20


def test_a_loader_iterated_again_after_its_end_serves_its_epoch_again_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One loader kept for every epoch (a framework that builds its DataLoader once) serves epoch 0 again and
    again: allowed (a DataLoader does the same), but no longer silent."""
    root = build_cache(tmp_path / "c", 30)
    with EpochLoaderFactory(root, batch_size=10, progress=None) as factory:
        loader = factory.loader(0)
        with caplog.at_level(logging.WARNING, logger="cachefeed"):
            first = [key for batch in loader for key in check_batch(batch)]
            assert "iterated again" not in caplog.text
            again = [key for batch in loader for key in check_batch(batch)]
            third = [key for batch in loader for key in check_batch(batch)]
    assert first == again == third
    (warning,) = [r.getMessage() for r in caplog.records if "iterated again" in r.getMessage()]
    assert "serves epoch 0 again" in warning and "factory.loader(epoch)" in warning


def test_an_epoch_that_drop_last_leaves_without_a_batch_is_said_to_be_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = build_cache(tmp_path / "c", 30)
    with (
        caplog.at_level(logging.WARNING, logger="cachefeed"),
        EpochLoaderFactory(root, batch_size=50, drop_last=True, progress=None) as factory,
    ):
        assert list(factory.loader(0)) == []
    assert "this rank's share is 30 samples, less than one batch of 50, and drop_last=True drops it" in caplog.text
    with pytest.raises(ValueError, match="samples_per_epoch = 1 is fewer than the 2 ranks"):
        EpochLoaderFactory(root, batch_size=1, samples_per_epoch=1, rank=0, world_size=2, run_id="r", progress=None)


def test_a_samples_per_epoch_the_ranks_do_not_divide_is_said_to_lose_its_remainder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The audit: ``samples_per_epoch=41`` over 2 ranks served 40, without a word, where the README said "exactly N"."""
    root = build_cache(tmp_path / "c", 60)
    with (
        caplog.at_level(logging.WARNING, logger="cachefeed"),
        EpochLoaderFactory(
            root, batch_size=4, samples_per_epoch=41, rank=0, world_size=2, run_id="r", progress=None
        ) as factory,
    ):
        keys = [key for batch in factory.loader(0) for key in batch["__key__"]]
    assert len(keys) == len(set(keys)) == 20  # this rank's share of 40
    assert "samples_per_epoch = 41 is not a multiple of the 2 ranks" in caplog.text
    assert "each epoch serves 40 (20 per rank) and leaves out the 1 left over" in caplog.text


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_of_an_epoch_the_factory_moved_on_from_refuses_to_serve(tmp_path: Path, workers: int) -> None:
    """It served its epoch again until its release ran (up to a second later), and state_dict() then named it."""
    root = build_cache(tmp_path / "c", 30)
    with EpochLoaderFactory(root, batch_size=10, num_workers=workers, progress=None) as factory:
        old = factory.loader(0)
        assert len([batch for batch in old]) == 3
        factory.loader(1)
        with pytest.raises(SnapshotError, match="epoch 0 was released"):
            iter(old)
        assert factory.state_dict()["epoch"] == 1


def test_waiting_too_long_fails_with_a_clear_error(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 5)
    daemon = CacheStore(cache_config(root, segment_bytes=16 << 10))  # holds the cache as a daemon does, fetches nothing
    try:
        with EpochLoaderFactory(root, batch_size=10, min_samples=50, wait_timeout_s=0.3, progress=None) as factory:
            assert factory.run_id.startswith("pid"), "one process, no launcher: a pid-based run id"
            with pytest.raises(SnapshotError, match=r"only 5 of min_samples=50 .*after 0.3s.*cachefeed status"):
                factory.loader(0)
    finally:
        daemon.close()


def test_on_a_static_cache_an_epoch_larger_than_the_cache_starts_at_once_and_reuses_samples(tmp_path: Path) -> None:
    """No daemon holds the cache: what is cached is all there will be. The first epoch (min_samples defaults to
    samples_per_epoch here) used to wait out wait_timeout_s (600 s by default) and fail naming min_samples."""
    root = build_cache(tmp_path / "c", 50)
    started = time.monotonic()
    with EpochLoaderFactory(root, batch_size=10, samples_per_epoch=80, wait_timeout_s=60, progress=None) as factory:
        keys = [key for batch in factory.loader(0) for key in check_batch(batch)]
    assert time.monotonic() - started < 30
    assert len(keys) == 80 and len(set(keys)) == 50, "every cached sample, some twice to make up the epoch"


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(NoSuchCacheError, match=str(tmp_path / "missing") + r".*waited 0.2s"):
        EpochLoaderFactory(tmp_path / "missing", batch_size=4, wait_timeout_s=0.2, progress=None)
    root = build_cache(tmp_path / "c", 5)
    # the directory above the cache: told at once, the cache named, rather than a wait of wait_timeout_s
    started = time.monotonic()
    with pytest.raises(NoSuchCacheError, match=f"{tmp_path} is not a cachefeed cache, but {root} is"):
        EpochLoaderFactory(tmp_path, batch_size=4, wait_timeout_s=60, progress=None)
    assert time.monotonic() - started < 5
    shown = io.StringIO()
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoSuchCacheError, match=r"waited 0\.2s"):
        EpochLoaderFactory(tmp_path / "empty", batch_size=4, wait_timeout_s=0.2, progress=shown)
    assert "the directory exists but is not a cachefeed cache yet: is it the daemon's cache.dir?" in shown.getvalue()
    with pytest.raises(TypeError, match="sampler"):
        EpochLoaderFactory(root, batch_size=4, sampler=None)
    with pytest.raises(ValueError, match="prefetch_factor"):
        EpochLoaderFactory(root, batch_size=4, num_workers=0, prefetch_factor=2)
    with pytest.raises(ValueError, match="prefetch_factor must be an integer >= 1, got 0"):
        EpochLoaderFactory(root, batch_size=4, num_workers=2, prefetch_factor=0)  # was taken as 2, silently
    with pytest.raises(ValueError, match="run_id"):
        EpochLoaderFactory(root, batch_size=4, rank=0, world_size=2)
    # failed later, deep inside numpy or a format string ("Unknown format code 'd'")
    for name, value in (("batch_size", 32.5), ("seed", None), ("num_workers", "2"), ("samples_per_epoch", 100.0)):
        with pytest.raises(ValueError, match=f"{name} must be an integer >= ., got {value!r}"):
            EpochLoaderFactory(root, **{"batch_size": 4, name: value})  # type: ignore[arg-type]
    # rank="1" (from os.environ) failed in a comparison naming no argument; world_size=2.0 deep in a slice; the
    # rest were accepted: "False" shuffled, transform=3 failed at the first batch, a timeout of 0 named no key
    for options, error, message in (
        ({"rank": "1", "world_size": 2}, ValueError, "rank must be an integer >= 0, got '1' (str)"),
        ({"rank": True, "world_size": 2}, ValueError, "rank must be an integer >= 0, got True (bool)"),
        ({"rank": 0, "world_size": 2.0}, ValueError, "world_size must be an integer >= 1, got 2.0 (float)"),
        ({"rank": 2, "world_size": 2}, ValueError, "rank must be below world_size .* got rank=2, world_size=2"),
        ({"shuffle": "False"}, TypeError, "shuffle must be True or False, got 'False' (str)"),
        ({"drop_last": "yes"}, TypeError, "drop_last must be True or False, got 'yes' (str)"),
        ({"transform": 3}, TypeError, "transform must be a function (or None), got 3 (int)"),
        ({"collate_fn": "x"}, TypeError, "collate_fn must be a function (or None), got 'x' (str)"),
        ({"wait_timeout_s": 0}, ValueError, "wait_timeout_s must be a number of seconds > 0, got 0"),
        ({"join_timeout_s": "5"}, ValueError, "join_timeout_s must be a number of seconds > 0, got '5'"),
    ):
        with pytest.raises(error, match=re.escape(message) if "*" not in message else message):
            EpochLoaderFactory(root, batch_size=4, run_id="t", progress=None, **options)  # type: ignore[arg-type]
    with EpochLoaderFactory(root, batch_size=4, progress=None) as factory:
        for epoch in (-1, 1.0, "3"):
            with pytest.raises(ValueError, match=f"epoch must be an integer >= 0, got {epoch!r}"):
                factory.loader(epoch)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"transform = <function .*<lambda> .* cannot be pickled .* module level"):
        EpochLoaderFactory(root, batch_size=4, num_workers=2, transform=lambda sample: sample, progress=None)
    # 0.75 used to be int(0.75): a first epoch that waited for nothing
    with pytest.raises(ValueError, match=r"got 0.75: for a fill level of 75%, write '75%'"):
        EpochLoaderFactory(root, batch_size=4, min_samples=0.75)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="count of samples"):
        EpochLoaderFactory(root, batch_size=4, min_samples=True)


def test_forkserver_with_preload_works(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 120)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "cachefeed._trainer.dataset"])
    with EpochLoaderFactory(
        root, batch_size=10, num_workers=2, multiprocessing_context=context, run_id="t", epochs=1
    ) as factory:
        keys = [k for batch in factory.loader(0) for k in check_batch(batch)]
    assert sorted(keys) == sorted(f"k{i}" for i in range(120))


def test_a_failed_background_build_is_raised_by_the_next_loader_call(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 40)
    rank0 = Snapshot.create(root, rank_snapshot("t", 0), job=RANKS_JOB)  # local rank 0 pins epoch 0, never epoch 1
    try:
        with EpochLoaderFactory(root, batch_size=4, run_id="t", rank=1, world_size=2, join_timeout_s=0.5) as factory:
            for _ in factory.loader(0):
                pass
            assert factory._epochs._prepared is not None, "epoch 1 was being prepared in the background"
            with pytest.raises(SnapshotError, match="local rank 0"):
                factory.loader(1)
    finally:
        rank0.release()


def test_closing_a_rank_does_not_wait_out_the_join_of_an_epoch_its_creator_will_never_make(tmp_path: Path) -> None:
    """DDP without ``epochs=``: rank 1 prepares epoch 1 ahead and waits for local rank 0's snapshot of it, but rank 0
    stops after epoch 0 (the loop ends, early stopping, a time limit). Closing rank 1's factory gave up that wait
    only after ``join_timeout_s`` (300 s by default): the job hung at exit."""
    root = build_cache(tmp_path / "c", 40)
    rank0 = Snapshot.create(root, rank_snapshot("t", 0), job=RANKS_JOB)  # local rank 0 pins epoch 0, never epoch 1
    try:
        factory = EpochLoaderFactory(root, batch_size=4, run_id="t", rank=1, world_size=2, join_timeout_s=120)
        try:
            keys = [k for batch in factory.loader(0) for k in check_batch(batch)]
            assert len(keys) == 20
            assert factory._epochs._prepared is not None, "epoch 1 is being prepared in the background"
        finally:
            started = time.monotonic()
            factory.close()
        assert time.monotonic() - started < 10.0
    finally:
        rank0.release()
    assert live_snapshot_locks(root) == []


def test_a_rank_given_another_world_size_is_refused_instead_of_reading_a_split_of_its_own(tmp_path: Path) -> None:
    """Rank 0 with world_size=2 and rank 1 with world_size=3 (a typo, a launcher's variable read wrongly): rank 1
    read a third of the epoch where rank 0 read a half: some samples twice, others never, and nothing said so."""
    root = build_cache(tmp_path / "c", 40)
    with EpochLoaderFactory(root, batch_size=4, run_id="t", rank=0, world_size=2, progress=None) as rank0:
        next(iter(rank0.loader(0)))  # local rank 0, of two, made epoch 0's snapshot
        with EpochLoaderFactory(root, batch_size=4, run_id="t", rank=1, world_size=3, join_timeout_s=10) as factory:
            with pytest.raises(SnapshotError, match=r"split among 2 local ranks .* this rank counts 3: give every"):
                factory.loader(0)
    assert live_snapshot_locks(root) == []


def test_a_trainer_started_with_the_daemon_waits_for_the_cache_to_appear(tmp_path: Path) -> None:
    root = tmp_path / "c"
    progress = io.StringIO()
    creator = threading.Timer(0.5, build_cache, args=(root, 40))
    creator.start()
    try:
        with EpochLoaderFactory(root, batch_size=10, run_id="t", progress=progress, wait_timeout_s=30) as factory:
            assert sum(1 for _ in factory.loader(0)) == 4
    finally:
        creator.join()
    assert "waiting for the cache at" in progress.getvalue()


def test_epochs_of_a_set_size_are_known_before_training_and_never_repeat_a_sample(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 300)
    with EpochLoaderFactory(root, batch_size=16, run_id="t", samples_per_epoch=200, progress=None) as factory:
        assert factory.batches_per_epoch == 13, "200 samples in batches of 16, known before the first epoch"
        for epoch in range(3):
            loader = factory.loader(epoch)
            assert len(loader) == 13
            keys = [key for batch in loader for key in check_batch(batch)]
            assert len(keys) == 200 and len(set(keys)) == 200, "no sample twice while the snapshot holds enough"


def test_a_small_cache_is_reused_to_fill_an_epoch_of_a_set_size_and_the_user_is_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(partition, "_reuse_warned", False)  # once per process: another test may have said it
    root = build_cache(tmp_path / "c", 50)
    with (
        caplog.at_level(logging.WARNING),
        EpochLoaderFactory(
            root, batch_size=10, run_id="t", samples_per_epoch=120, min_samples=50, progress=None
        ) as factory,
    ):
        keys = [key for batch in factory.loader(0) for key in check_batch(batch)]
    assert len(keys) == 120
    assert set(keys) == {f"k{i}" for i in range(50)}, "every cached sample is used before any is reused"
    (warning,) = [r.getMessage() for r in caplog.records if "serves some of them twice" in r.getMessage()]
    assert "epoch 0 has 50 samples for its 120 (samples_per_epoch)" in warning and "cache.max_bytes" in warning


def test_an_epoch_of_a_set_size_reads_the_least_read_samples_first(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = CacheStore(cache_config(root, segment_bytes=16 << 10))
    with CacheWriter(store, segment_bytes=16 << 10, fsync=False) as writer:
        for i in range(200):
            writer.add(make_sample(f"old{i}", 256))
    read = Snapshot.create(root, "earlier-epoch")  # an earlier epoch read all of these
    read.record_served(np.arange(read.samples))
    read.release()
    store.collect_reads()
    with CacheWriter(store, segment_bytes=16 << 10, fsync=False) as writer:
        for i in range(100):
            writer.add(make_sample(f"new{i}", 256))
    store.close()
    with EpochLoaderFactory(root, batch_size=20, run_id="t", samples_per_epoch=100, progress=None) as factory:
        keys = {key for batch in factory.loader(0) for key in check_batch(batch)}
    assert keys == {f"new{i}" for i in range(100)}, "the unread samples go first"


def test_ranks_split_an_epoch_of_a_set_size_equally_and_disjointly() -> None:
    from cachefeed._trainer.partition import fixed_size_order

    reads = np.repeat([1, 0, 0], [40, 40, 20])
    order = fixed_size_order(reads, 60, seed=3, epoch=2, shuffle=True)
    rank0, rank1 = order[:30], order[30:]
    assert len(set(rank0.tolist()) | set(rank1.tolist())) == 60, "disjoint shares of distinct samples"
    assert set(order.tolist()) == set(range(40, 100)), "the never-read segments first"
    again = fixed_size_order(reads, 60, seed=3, epoch=2, shuffle=True)
    assert (order == again).all(), "every rank computes the same order"


def test_a_0d_label_from_npz_batches_as_one_label_per_sample(tmp_path: Path) -> None:
    import io as _io

    import numpy as np
    import torch

    from cachefeed._codecs import get_decoder

    decode = get_decoder("npz")
    root = tmp_path / "c"
    store = CacheStore(cache_config(root, segment_bytes=16 << 10))
    with CacheWriter(store, segment_bytes=16 << 10, fsync=False) as writer:
        for i in range(40):
            body = _io.BytesIO()
            np.savez(body, x=np.full(8, i, dtype=np.float32), y=np.int64(i % 3))
            for sample in decode(f"s{i}.npz", body.getvalue()):
                assert sample["y"].shape == (), "the decoder keeps the 0-d label"
                writer.add(sample)
    store.close()
    with EpochLoaderFactory(root, batch_size=8, run_id="t", progress=None) as factory:
        for batch in factory.loader(0):
            assert batch["y"].shape == (8,), "labels batch as [B], not [B, 1]"
            loss = torch.nn.functional.cross_entropy(torch.zeros(8, 3), batch["y"])
            assert torch.isfinite(loss)


def test_reading_an_epoch_shows_progress_on_its_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What tells the daemon a slow trainer from a stuck one: batches flowing touch the snapshot's lock file."""
    import cachefeed._trainer.lifecycle as lifecycle_module

    monkeypatch.setattr(lifecycle_module, "_TOUCH_EVERY_S", 0.0)
    root = build_cache(tmp_path / "c", 100)
    with EpochLoaderFactory(root, batch_size=10, run_id="t", epochs=1, progress=None) as factory:
        lock = root / "snapshots" / f"{factory.snapshot_id(0)}.lock"
        batches = iter(factory.loader(0))
        next(batches)
        os.utime(lock, (1.0, 1.0))  # as if nobody had read for decades
        next(batches)
        assert lock.stat().st_mtime > time.time() - 60


def test_an_epoch_waits_for_room_to_pin_its_snapshot_when_the_cache_filesystem_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The audit: a filesystem filled by something else made the trainer die with a raw ENOSPC from the snapshot's
    lock file (the README says trainers go on with what is cached). The pin now waits for room, saying so, and
    gives up after ``wait_timeout_s`` with a message naming the cause. (A full filesystem is injected: ENOSPC
    from ``Snapshot.create``, as the kernel raised it there.)"""
    import errno

    from cachefeed._trainer import lifecycle

    root = build_cache(tmp_path / "c", 30)
    create = lifecycle.Snapshot.create
    full = {"left": 3}

    def create_on_a_full_filesystem(*args: Any, **kwargs: Any) -> Snapshot:
        if full["left"]:
            full["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return create(*args, **kwargs)

    monkeypatch.setattr(lifecycle.Snapshot, "create", create_on_a_full_filesystem)
    with (
        caplog.at_level(logging.INFO, logger="cachefeed"),
        EpochLoaderFactory(root, batch_size=10, progress=None) as factory,
    ):
        keys = [key for batch in factory.loader(0) for key in batch["__key__"]]
    assert len(keys) == len(set(keys)) == 30, "the epoch read what is cached once there was room"
    assert "epoch 0 waits to pin its snapshot: the cache's filesystem is full (No space left on device)" in caplog.text
    assert "epoch 0 pinned its snapshot: the cache's filesystem has room again" in caplog.text
    full["left"] = 10**6
    with EpochLoaderFactory(root, batch_size=10, progress=None, wait_timeout_s=1.0) as factory:
        with pytest.raises(SnapshotError, match=r"filesystem has been full for 1s .*Free space on it"):
            factory.loader(0)
