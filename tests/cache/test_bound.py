"""The hard size bound with thousands of segments: the real directory (every inode, directory blocks, snapshot
links and manifests included) stays within ``cache.max_bytes`` through a normal handover (two live snapshots), each
snapshot claimed by every local rank of a node (its ``RANK.<k>`` files, NOTE [ Snapshot pinning protocol ])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefeed._cache.layout import SNAPSHOT_ENTRY_BYTES, SNAPSHOT_FIXED_BYTES, metadata_bytes
from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._testing.samples import make_sample
from tests.support.cache_helpers import cache_config, tree_bytes, write_until_full
from tests.support.tmpfs import small_tmpfs

LOCAL_RANKS = 8  # a node of 8 GPUs: each local rank claims its share of every epoch's snapshot


@contextlib.contextmanager
def every_local_rank(root: Path, snap_id: str, ranks: int = LOCAL_RANKS) -> Iterator[Snapshot]:
    """Snapshot ``snap_id`` made by local rank 0 and joined by ranks 1 .. ``ranks`` - 1, each claiming its rank, as
    a node's ranks pin an epoch; the creator's pin is yielded and every pin released at the end."""
    with contextlib.ExitStack() as pins:
        created = pins.enter_context(Snapshot.create(root, snap_id, ranks=ranks, rank=0))
        for rank in range(1, ranks):
            pins.enter_context(Snapshot.join(root, snap_id, ranks=ranks, rank=rank))
        yield created


def handover_peak(root: Path, max_bytes: int, **overrides: object) -> tuple[int, int]:
    """Fill, pin the epoch's snapshot, write until writers wait, pin the next epoch's snapshot (a handover);
    returns (real size with two live snapshots, segments in the cache)."""
    config = cache_config(root, max_bytes=max_bytes, segment_bytes=4096, turnover_bytes=max_bytes // 4, **overrides)
    store = CacheStore(config)
    try:
        key = write_until_full(store, 0) if config.evict_after_reads else _write_budget(store, 0, max_bytes)
        with every_local_rank(root, "epoch-0") as first:
            store.collect_reads()  # the daemon scans snapshots twice a second
            # free-running, writers never wait while the snapshot leaves unpinned room (it pins the epoch room at
            # most): a budget's worth of segments turns the unpinned part over and leaves the cache full
            key = write_until_full(store, key) if config.evict_after_reads else _write_budget(store, key, max_bytes)
            before, published = metadata_bytes(store.layout), len(store.segments)
            with every_local_rank(root, "epoch-1") as second:
                assert first.samples > 1000 and second.samples > 1000
                grew = metadata_bytes(store.layout) - before
                charged = SNAPSHOT_FIXED_BYTES + SNAPSHOT_ENTRY_BYTES * published
                assert grew <= charged, f"a snapshot of {published} segments took {grew:,} bytes, {charged:,} charged"
                segments = len(list((root / "segments").iterdir()))
                return tree_bytes(root), segments
    finally:
        store.close()


def _write_budget(store: CacheStore, key: int, max_bytes: int) -> int:
    for _ in range(max_bytes // 4096):
        key = _write_one(store, key)
    return key


def _write_one(store: CacheStore, key: int) -> int:
    with CacheWriter(store, segment_bytes=4096, fsync=False) as writer:
        writer.add(make_sample(f"k{key}", 2000))
    return key + 1


@pytest.mark.parametrize("max_mib", [32, pytest.param(48, marks=pytest.mark.slow)])
def test_two_live_snapshots_of_thousands_of_segments_stay_within_max_bytes(tmp_path: Path, max_mib: int) -> None:
    """The case the fixed 1 MiB reserve could not hold: 4 KiB segments (a config the validator accepts), the
    a 25% turnover, a handover pinning two snapshots of ~6,000 segments each (each the epoch room)."""
    max_bytes = max_mib << 20
    real, segments = handover_peak(tmp_path / "c", max_bytes)
    assert segments > 3000, "the scenario must hold thousands of segments"
    assert real <= max_bytes, f"real size {real:,} is {real - max_bytes:,} bytes over, {segments} segments"


@pytest.mark.slow
def test_the_bound_holds_with_pacing_on(tmp_path: Path) -> None:
    """The default read contract (segments wait for an epoch's read) changes when writers wait, not the bound."""
    max_bytes = 32 << 20
    real, _segments = handover_peak(tmp_path / "c", max_bytes, evict_after_reads=1)
    assert real <= max_bytes


@pytest.mark.slow
def test_the_bound_holds_on_tmpfs() -> None:
    """tmpfs charges no blocks to directories, but the segments' and manifests' pages are real."""
    with small_tmpfs(64 << 20) as mount:
        max_bytes = 32 << 20
        real, _segments = handover_peak(mount / "c", max_bytes)
        assert real <= max_bytes


def test_a_budget_lowered_over_a_full_cache_holds_from_the_restart_on(tmp_path: Path) -> None:
    """Unread samples wait for trainers before they are evicted (``evict_after_reads``), so a cache restarted with a
    lower ``max_bytes`` stayed over it for as long as no epoch read, and said nothing. The
    bound now holds at the start; the witness is the directory's real size."""
    root = tmp_path / "c"
    store = CacheStore(cache_config(root, max_bytes=8 << 20, evict_after_reads=1, turnover_bytes=2 << 20))
    write_until_full(store, 0)
    store.close()
    assert tree_bytes(root) > 6 << 20
    lowered = CacheStore(cache_config(root, max_bytes=4 << 20, evict_after_reads=1, turnover_bytes=1 << 20))
    try:
        assert lowered.shrink_to_budget() > 0  # the daemon's start calls it once sources are settled
        assert tree_bytes(root) <= 4 << 20
        assert lowered.counters.evicted_unread_samples > 0, "what it evicted was never read, and is counted so"
    finally:
        lowered.close()


@pytest.mark.parametrize("ranks", [LOCAL_RANKS, 64])
def test_a_snapshot_of_few_segments_claimed_by_every_local_rank_takes_no_more_than_its_charge(
    tmp_path: Path, ranks: int
) -> None:
    """The daemon charges one more snapshot before a trainer makes it (``store.py``), without knowing how many local
    ranks will claim it. With few segments that charge is mostly ``SNAPSHOT_FIXED_BYTES``, and a claim that took a
    data block per rank (a file holding its holder's pid) outgrew it at 8 ranks; the witness is the directory's
    real size."""
    root, segments = tmp_path / "c", 20
    store = CacheStore(cache_config(root, max_bytes=8 << 20, segment_bytes=4096))
    try:
        key = 0
        for _ in range(segments):
            key = _write_one(store, key)
        before = tree_bytes(root)
        with every_local_rank(root, "epoch-0", ranks) as snapshot:
            assert len(snapshot.names) == segments
            claims = sorted(path.name for path in snapshot.directory.glob("RANK.*"))
            assert len(claims) == ranks, claims
            grew = tree_bytes(root) - before
    finally:
        store.close()
    charged = SNAPSHOT_FIXED_BYTES + SNAPSHOT_ENTRY_BYTES * segments
    assert grew <= charged, (
        f"a snapshot of {segments} segments claimed by {ranks} ranks took {grew:,} bytes, {charged:,} charged"
    )
