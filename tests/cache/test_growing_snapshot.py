"""An open (growing) snapshot: generations appended as segments are published, and a grower killed part way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._testing.samples import check_sample, make_sample
from cachefeed._trainer.dataset import SnapshotDataset
from cachefeed._trainer.growing import Grower
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
