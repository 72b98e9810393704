"""An open (growing) snapshot: generations appended as segments are published, and a grower killed part way."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachefeed._cache import room, snapshots
from cachefeed._cache.layout import CacheLayout, segment_name
from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._daemon.status_doc import write_status
from cachefeed._testing.samples import check_sample, make_sample
from cachefeed._trainer import growing
from cachefeed._trainer.dataset import SnapshotDataset
from cachefeed._trainer.growing import Grower, GrowingEpoch, GrowingShare
from cachefeed._trainer.wait import PublishWatch
from tests.support.cache_helpers import cache_config


def add_segments(root: Path, start: int, count: int) -> None:
    """``count`` samples keyed ``k<start..>``, in segments of about 8 samples; the store is closed."""
    store = CacheStore(cache_config(root, segment_bytes=4096))
    with CacheWriter(store, segment_bytes=4096, fsync=False) as writer:
        for i in range(start, start + count):
            writer.add(make_sample(f"k{i}", 400))
    store.close()


def test_a_growing_snapshot_links_on_over_the_link_a_killed_grower_left(tmp_path: Path) -> None:
    root = tmp_path / "c"
    add_segments(root, 0, 40)
    snapshot = Snapshot.create(root, "e0", growing=True)
    try:
        first = set(snapshot.names)
        add_segments(root, 40, 40)
        new = sorted(name for name in os.listdir(root / "segments") if name not in first)
        assert len(new) >= 2
        # The grower was SIGKILLed between linking a segment and writing the MANIFEST that names it.
        os.link(root / "segments" / new[0], snapshot.directory / new[0])
        assert snapshot.grow() == len(new), "the segments published since, the one already linked included"
        snapshot.grow(close=True)
        assert not snapshot.is_open and set(new) <= set(snapshot.names)
        dataset = SnapshotDataset.from_snapshot(snapshot)
        keys = []
        for index in range(len(dataset)):
            sample = dataset[index]
            check_sample({k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in sample.items()})
            keys.append(sample["__key__"])
        dataset.close()
        assert sorted(keys) == sorted(f"k{i}" for i in range(80)), "every sample once"
    finally:
        snapshot.release()


def test_a_grower_that_cannot_link_closes_the_snapshot_as_it_is_so_readers_end_the_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    add_segments(root, 0, 40)
    snapshot = Snapshot.create(root, "e0", growing=True)
    try:
        held = list(snapshot.names)

        def failing_grow(self: Snapshot, *, close: bool = False) -> int:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(Snapshot, "grow", failing_grow)
        grower = Grower(snapshot, lambda samples: False, every_s=0.01)
        grower.stop()
        assert not snapshot.is_open and list(snapshot.names) == held
        reader = Snapshot.join(root, "e0", timeout_s=5)
        assert not reader.is_open, "a reading rank sees the growth ended"
        reader.release()
    finally:
        snapshot.release()


def test_a_grower_given_a_running_watch_grows_at_a_publish_and_stops_the_watch_with_the_growth(tmp_path: Path) -> None:
    """A cold first epoch starts its observer of the daemon (``PublishWatch``) before it waits for its first
    segments, and its grower takes it over instead of starting one at the rank's first wait. Witnesses: the
    process's observer threads (one, the watch's, never a second), the snapshot grown at a publish while the
    grower's tick is 10 s away, and no observer left once the growth stopped."""
    from watchdog.observers.api import BaseObserver

    others = {thread for thread in threading.enumerate() if isinstance(thread, BaseObserver)}  # other tests'

    def observers() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate() if isinstance(thread, BaseObserver) and thread not in others]

    root = tmp_path / "c"
    add_segments(root, 0, 4)
    watch = PublishWatch(CacheLayout(root))
    assert watch.is_running and len(observers()) == 1
    snapshot = Snapshot.create(root, "e0", growing=True)
    grower = Grower(snapshot, lambda samples: False, every_s=10.0, watch=watch)
    try:
        with grower.lock:
            seen, before = grower.changes, snapshot.samples
        grower.want()  # the rank read every batch: the grower looks once, then waits for a publish
        with grower.lock:
            seen = grower.changes
        add_segments(root, 4, 4)
        started = time.monotonic()
        grower.wait_for_change(seen, 5.0)
        with grower.lock:
            grown = snapshot.samples
        assert grown > before and time.monotonic() - started < 5.0, "the publish did not wake the grower"
        assert len(observers()) == 1, "the grower started an observer of its own"
    finally:
        grower.stop()
        snapshot.release()
    deadline = time.monotonic() + 10.0
    while observers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not observers(), "the watch outlived the growth"


def test_a_waiting_grower_is_woken_by_publishes_not_by_reads_of_the_cache(tmp_path: Path) -> None:
    """The observer hears what the daemon publishes (a segment renamed into ``segments/``, its status document
    replaced), not the opens and reads of the cache's files: the grower's own read of the status document (its rule
    asks the daemon's fill) and its look at the segments used to wake it again at once, a loop of looks that took a
    core from the daemon its rank waits for. Witness: the process's CPU time while its rank waits with nothing
    published, then a publish that still wakes it."""
    root = tmp_path / "c"
    add_segments(root, 0, 4)
    layout = CacheLayout(root)
    write_status(layout.status_file, {"state": "running"})

    def is_done(samples: int) -> bool:  # as the factory's rule: it reads the daemon's status document
        layout.status_file.read_bytes()
        return False

    snapshot = Snapshot.create(root, "e0", growing=True)
    grower = Grower(snapshot, is_done, every_s=10.0, watch=PublishWatch(layout))
    try:
        with grower.lock:
            seen = grower.changes
        grower.want()
        time.sleep(0.2)  # its look at the want, then nothing to look for
        used = time.process_time()
        time.sleep(1.0)
        used = time.process_time() - used
        assert used < 0.3, f"the waiting grower took {used:.2f} s of CPU in 1 s with nothing published"
        add_segments(root, 4, 4)
        grower.wait_for_change(seen, 5.0)
        with grower.lock:
            assert grower.changes != seen, "a publish did not wake the grower"
    finally:
        grower.stop()
        snapshot.release()


def test_a_grower_reports_the_end_of_growth_by_its_rule_or_a_full_room_but_not_a_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``on_closed`` lets the factory prepare the next epoch as soon as growth ends (a loop that caught up with
    ingest ends its epoch a batch later); a grower whose snapshot a full room closed used to look on until its epoch
    was released, and never said so."""
    root = tmp_path / "c"
    add_segments(root, 0, 40)

    def grow_and_report(snapshot: Snapshot, is_done: Any) -> threading.Event:
        closed = threading.Event()
        grower = Grower(snapshot, is_done, every_s=0.01, on_closed=closed.set)
        try:
            assert closed.wait(10), "growth ended without on_closed"
            assert not snapshot.is_open
        finally:
            grower.stop()
        return closed

    by_rule = Snapshot.create(root, "e0", growing=True)
    try:
        add_segments(root, 40, 40)
        grow_and_report(by_rule, lambda samples: samples >= 80)
        assert by_rule.samples == 80
    finally:
        by_rule.release()

    full_room = Snapshot.create(root, "e1", growing=True)
    try:
        original = Snapshot.grow
        monkeypatch.setattr(Snapshot, "grow", lambda self, *, close=False: original(self, close=True))  # room full
        grow_and_report(full_room, lambda samples: False)
    finally:
        monkeypatch.undo()
        full_room.release()

    stopped = Snapshot.create(root, "e2", growing=True)
    try:
        closed = threading.Event()
        Grower(stopped, lambda samples: False, every_s=0.01, on_closed=closed.set).stop()
        assert not stopped.is_open and not closed.is_set(), "a stopped grower's epoch is being released"
    finally:
        stopped.release()


def test_an_unread_first_snapshot_takes_only_unread_segments_and_is_topped_up_with_read_ones_when_closed_short(
    tmp_path: Path,
) -> None:
    root = tmp_path / "c"
    add_segments(root, 0, 40)
    with Snapshot.create(root, "e0", job="j") as previous:  # being read: its segments have a read on its way
        add_segments(root, 40, 16)
        fresh = sorted(set(os.listdir(root / "segments")) - set(previous.names))
        with Snapshot.create(root, "e1", job="j", reading=previous.names, wants=40) as later:
            assert list(later.names) == fresh and later.is_open, "only what no epoch read nor reads; short: open"
            add_segments(root, 56, 16)
            grown = sorted(set(os.listdir(root / "segments")) - set(previous.names) - set(fresh))
            assert later.grow() == len(grown) and list(later.names) == fresh + grown, "grows by unread segments"
            unread = later.samples
            assert unread < 40 and later.topup_from is None
            later.grow(close=True)
            assert not later.is_open and later.topup_from == len(later.generations or ()) - 1
            topping = later.names[(later.generations or ())[-2] :]
            assert set(topping) <= set(previous.names), "topped up from the read segments"
            assert later.samples >= 40 > later.samples - later.counts[-1], "as many samples as it lacked, no more"
            reader = Snapshot.join(root, "e1", timeout_s=5)
            assert reader.topup_from == later.topup_from and reader.wants == 40, "every rank sees the top-up"
            reader.release()


def test_an_unread_first_snapshot_with_enough_unread_samples_is_created_closed(tmp_path: Path) -> None:
    root = tmp_path / "c"
    add_segments(root, 0, 40)
    with Snapshot.create(root, "e0", wants=20) as snapshot:
        assert not snapshot.is_open and snapshot.generations == (len(snapshot.names),)
        assert snapshot.samples == 40 and snapshot.topup_from is None


def test_a_top_up_whose_chosen_segments_are_evicted_before_their_link_takes_others_to_its_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The top-up takes read segments, which the daemon may evict at any moment, and the ones it prefers go first:
    here they are gone by the time it links them (evicted between its listing and its links). It must still pin as
    many samples as the epoch lacks, from the others: an epoch of a set size short of them serves samples twice."""
    root = tmp_path / "c"
    store = CacheStore(cache_config(root, segment_bytes=4096, evict_after_reads=1))  # the daemon: receipts count
    try:
        with CacheWriter(store, segment_bytes=4096, fsync=False) as writer:
            for i in range(80):
                writer.add(make_sample(f"k{i}", 400))
            writer.flush()
            with Snapshot.create(root, "e0", job="j") as previous:
                previous.record_served(np.arange(previous.samples))  # its receipt: every sample read once
            store.collect_reads()
            for i in range(80, 88):
                writer.add(make_sample(f"k{i}", 400))
        evicted: list[str] = []
        real_candidates = snapshots._candidates

        def evicted_after_listing(*args: Any, **kwargs: Any) -> list[Any]:
            candidates = real_candidates(*args, **kwargs)
            for seq in room.top_up(candidates, 40, None):  # the daemon evicts the top-up's first choices meanwhile
                name = segment_name(seq)
                os.unlink(root / "segments" / name)
                evicted.append(name)
            return candidates

        with Snapshot.create(root, "e1", job="j", wants=48) as later:
            assert later.is_open and later.samples == 8, "the unread segment only"
            monkeypatch.setattr(snapshots, "_candidates", evicted_after_listing)
            later.grow(close=True)
            assert evicted, "the test evicted nothing"
            assert not set(evicted) & set(later.names), "an evicted segment in the MANIFEST"
            assert later.samples >= 48, f"topped up to {later.samples} samples of 48"
            dataset = SnapshotDataset.from_snapshot(later)  # the witness: the samples the linked files hold
            keys = [dataset[index]["__key__"] for index in range(len(dataset))]
            dataset.close()
            assert len(keys) >= 48 and len(set(keys)) == len(keys), "as many distinct samples as the epoch lacks"
    finally:
        store.close()


def test_a_snapshot_whose_chosen_segments_are_evicted_before_their_link_fills_its_room_with_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race at a snapshot's creation, once the cache is at its fill level: the least-read segments it
    chooses may be evicted before it links them. It pins others in their place, up to its room, not less."""
    root = tmp_path / "c"
    config = cache_config(root, max_bytes=3 << 20, turnover_bytes=1 << 20, segment_bytes=16 << 10, evict_after_reads=1)
    store = CacheStore(config)  # the daemon: its room (1 MiB) is less than what is cached
    try:
        with CacheWriter(store, segment_bytes=16 << 10, fsync=False) as writer:
            for i in range(700):
                writer.add(make_sample(f"k{i}", 2000))
        for earlier in ("e0", "e1"):  # two epochs of a room each: every sample read once, so evictable
            with Snapshot.create(root, earlier, job="j") as previous:
                previous.record_served(np.arange(previous.samples))
            store.collect_reads()
        assert store.usage().unread_samples == 0, "every sample read once"
        evicted: list[str] = []
        real_choose = snapshots.choose

        def evicted_after_listing(*args: Any, **kwargs: Any) -> list[int]:
            chosen = real_choose(*args, **kwargs)
            if not evicted:  # the daemon evicts half of the first choice meanwhile
                for seq in chosen[::2]:
                    os.unlink(root / "segments" / segment_name(seq))
                    evicted.append(segment_name(seq))
            return chosen

        monkeypatch.setattr(snapshots, "choose", evicted_after_listing)
        room_bytes = store.epoch_room
        with Snapshot.create(root, "e2", job="j") as later:
            pinned = sum(os.lstat(path).st_blocks * 512 for path in later.paths)
            assert evicted and not set(evicted) & set(later.names)
            assert room_bytes - 2 * (16 << 10) < pinned <= room_bytes, f"pinned {pinned} of a room of {room_bytes}"
            assert list(later.names) == sorted(later.names) and len(set(later.names)) == len(later.names)
    finally:
        store.close()


class _WatchedEpoch(GrowingEpoch):
    """A growing epoch that says when its rank first waits for growth."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.waiting = threading.Event()
        super().__init__(*args, **kwargs)

    def pause(self) -> None:
        self.waiting.set()
        super().pause()


def read_growing_epoch(
    root: Path, is_done: Any, *, every_s: float, publish: Any, deadline_s: float = 15.0
) -> tuple[list[str], float]:
    """The keys the creator's rank reads from a growing epoch over ``root``, and the seconds from its first wait
    for growth to its end; ``publish()`` runs on another thread 0.3 s after the rank began to wait (it read every
    batch cut). Use with ``slow_ticks``: then only a wake by the publish itself ends the epoch in seconds."""
    snapshot = Snapshot.create(root, "e0", growing=True)
    grower = Grower(snapshot, is_done, every_s=every_s)
    dataset = SnapshotDataset.from_snapshot(snapshot)
    share = GrowingShare(seed=0, epoch=0, shuffle=False, local_rank=0, local_world_size=1, quota=None)
    epoch = _WatchedEpoch(
        snapshot, dataset, share, batch_size=8, drop_last=False, estimate=8, timeout_s=60, grower=grower
    )
    waited_at: list[float] = []

    def publish_once_waiting() -> None:
        if epoch.waiting.wait(deadline_s):
            waited_at.append(time.monotonic())
            time.sleep(0.3)  # the grower has looked since the rank began to wait: it is back to its tick
            publish()

    publisher = threading.Thread(target=publish_once_waiting)
    publisher.start()
    keys: list[str] = []
    try:
        for batch in epoch.iter_batches():
            keys.extend(str(dataset[int(i)]["__key__"]) for i in batch)
        assert waited_at, "the rank never waited for growth"
        return keys, time.monotonic() - waited_at[0]
    finally:
        grower.stop()
        epoch.waiting.set()
        publisher.join()
        dataset.close()
        snapshot.release()


@pytest.fixture
def slow_ticks(monkeypatch: pytest.MonkeyPatch) -> float:
    """Ticks of a minute: the grower's (passed as ``every_s``) and a waiting rank's (``GROW_EVERY_S``)."""
    monkeypatch.setattr(growing, "GROW_EVERY_S", 60.0)
    return 60.0


def test_a_rank_waiting_for_growth_sees_each_publish_without_waiting_for_the_growers_tick(
    tmp_path: Path, slow_ticks: float
) -> None:
    """A cold job's first batch and a growing epoch's end come within milliseconds of the publish they wait for:
    the grower of a rank that waits looks at each segment published (inotify), not only every ``every_s``."""
    root = tmp_path / "c"
    add_segments(root, 0, 16)
    keys, took = read_growing_epoch(
        root, lambda samples: samples >= 48, every_s=slow_ticks, publish=lambda: add_segments(root, 16, 32)
    )
    assert sorted(keys) == sorted(f"k{i}" for i in range(48)), "every sample once"
    assert took < 15.0, "the rank waited for a tick of a minute"


def test_a_growth_that_ends_by_the_daemons_status_document_ends_at_its_write_not_at_the_tick(
    tmp_path: Path, slow_ticks: float
) -> None:
    """The first epoch ends once the daemon says it can fill no further (its status document): the grower of a
    waiting rank looks when the document is written."""
    root = tmp_path / "c"
    add_segments(root, 0, 16)
    layout = CacheLayout(root)
    keys, took = read_growing_epoch(
        root,
        lambda samples: layout.status_file.exists(),
        every_s=slow_ticks,
        publish=lambda: write_status(layout.status_file, {"state": "the fill level is reached"}),
    )
    assert sorted(keys) == sorted(f"k{i}" for i in range(16))
    assert took < 15.0, "the rank waited for a tick of a minute"


def _no_observer(*args: Any, **kwargs: Any) -> None:
    return None  # inotify instances exhausted: watch_publishes says so and returns None


def _failing_observer(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("an observer that fails in a way nobody foresaw")


@pytest.mark.parametrize("watch", [_no_observer, _failing_observer])
def test_where_no_observer_starts_a_waiting_rank_is_served_by_the_tick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watch: Any
) -> None:
    """A faster wake is never worth the epoch: without an observer the growth goes on by the tick, to its end."""
    monkeypatch.setattr(growing, "watch_publishes", watch)
    root = tmp_path / "c"
    add_segments(root, 0, 16)
    keys, _took = read_growing_epoch(
        root, lambda samples: samples >= 48, every_s=0.02, publish=lambda: add_segments(root, 16, 32)
    )
    assert sorted(keys) == sorted(f"k{i}" for i in range(48))


def test_a_grow_that_fails_after_linking_leaves_its_segments_to_the_next_grow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MANIFEST write of a grow fails (a full filesystem) after its segments were linked; the grower then
    closes the snapshot (``Grower._close``). That closing grow took the linked segments for the same objects fetched
    again (the failed grow had noted them as held) and left their samples out of the epoch."""
    root = tmp_path / "cache"
    _add_object(root, 0)
    snapshot = Snapshot.create(root, "e0", growing=True)
    try:
        assert snapshot.samples == 8
        _add_object(root, 1)
        real = snapshots.atomic_write
        failed: list[Path] = []

        def full_once(path: Path, data: bytes, **options: Any) -> None:
            if path.name == snapshots.MANIFEST and not failed:
                failed.append(path)
                raise OSError(errno.ENOSPC, "No space left on device")
            real(path, data, **options)

        monkeypatch.setattr(snapshots, "atomic_write", full_once)
        with pytest.raises(OSError):
            snapshot.grow()
        snapshot.grow(close=True)
        assert snapshot.samples == 16, "the closing grow took what the failed one had linked"
    finally:
        snapshot.release()


def _add_object(root: Path, obj: int) -> None:
    """Eight samples of remote object ``obj`` in a segment of their own, named in its source list."""
    store = CacheStore(cache_config(root, segment_bytes=64 << 10))
    with CacheWriter(store, segment_bytes=64 << 10, fsync=False) as writer:
        for i in range(8):
            writer.add(make_sample(f"o{obj}#{i}", 400))
        writer.add_source(f"remote/o{obj}", "v1")
    store.close()
