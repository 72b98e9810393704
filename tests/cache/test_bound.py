"""The hard size bound with thousands of segments: the real directory (every inode, directory blocks, snapshot
links and manifests included) stays within ``cache.max_bytes`` through a normal handover (two live snapshots), each
snapshot claimed by every local rank of a node (its ``RANK.<k>`` files, NOTE [ Snapshot pinning protocol ]), and
when every local rank records what it served (a bitmap over the whole snapshot each, NOTE [ Read receipts ])."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachefeed._cache import reads
from cachefeed._cache.layout import SNAPSHOT_ENTRY_BYTES, SNAPSHOT_FIXED_BYTES, allocated_bytes, metadata_bytes
from cachefeed._cache.reads import SERVED_PREFIX, served_record_bytes, write_served
from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter, WriterStopped
from cachefeed._testing.samples import make_sample
from tests.support.cache_helpers import cache_config, tree_bytes, write_until_full
from tests.support.tmpfs import small_tmpfs

LOCAL_RANKS = 8  # a node of 8 GPUs: each local rank claims its share of every epoch's snapshot


@contextlib.contextmanager
def every_local_rank(root: Path, snap_id: str, ranks: int = LOCAL_RANKS) -> Iterator[Snapshot]:
    """Snapshot ``snap_id`` made by local rank 0 and joined by ranks 1 .. ``ranks`` - 1, each claiming its rank, as
    a node's ranks pin an epoch; the creator's pin is yielded and every pin released at the end."""
    with pins_of_every_local_rank(root, snap_id, ranks) as pins:
        yield pins[0]


@contextlib.contextmanager
def pins_of_every_local_rank(root: Path, snap_id: str, ranks: int = LOCAL_RANKS) -> Iterator[list[Snapshot]]:
    """``every_local_rank``, yielding every rank's pin (rank ``k``'s at index ``k``)."""
    with contextlib.ExitStack() as stack:
        pins = [stack.enter_context(Snapshot.create(root, snap_id, ranks=ranks, rank=0))]
        for rank in range(1, ranks):
            pins.append(stack.enter_context(Snapshot.join(root, snap_id, ranks=ranks, rank=rank)))
        yield pins


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


def test_a_restart_with_the_same_budget_evicts_nothing_unread_for_the_room_snapshots_to_come(tmp_path: Path) -> None:
    """A full cache charges ahead for snapshots to come (their records, the next one's room), and a running daemon
    waits for reads to free that room. The start judged the same charge as a cache over its budget, and evicted
    unread samples, read or not, naming a lowered ``max_bytes`` that had not changed. Now it judges what the
    directory holds."""
    root = tmp_path / "c"
    config = cache_config(root, max_bytes=8 << 20, evict_after_reads=1, turnover_bytes=5 << 20)
    store = CacheStore(config)
    write_until_full(store, 0)
    # a job of 64 local ranks pins an epoch (part of the cache), and lives on over the restart: the records its
    # ranks have yet to write are charged ahead
    pins = [Snapshot.create(root, "epoch-0", ranks=64, rank=0)]
    store.close()
    again = CacheStore(config)
    try:
        assert again.shrink_to_budget() == 0
        assert again.counters.evicted_unread_samples == 0
        assert tree_bytes(root) <= 8 << 20
    finally:
        again.close()
        for pin in pins:
            pin.release()


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


# -- served records (NOTE [ Read receipts ]) -------------------------------------------------------------------------

TINY_SAMPLE = {"__key__": "k", "b": b"x"}  # a 36-byte record: each rank's bitmap is large against the data it covers
TINY_SEGMENT_BYTES = 4 << 20  # ~116,000 tiny samples a segment
FILL_BYTES = 64 << 10  # the fill's segments: the cache is full to within one of them


TINY_MAX_BYTES = 112 << 20  # 28 tiny segments: snapshots of millions of samples, bitmaps of a few hundred KiB


def tiny_store(root: Path, **overrides: Any) -> CacheStore:
    """A store for ``TINY_SAMPLE`` segments: ``TINY_MAX_BYTES``, a turnover of 12 MiB."""
    settings: dict[str, Any] = {"segment_bytes": TINY_SEGMENT_BYTES, "turnover_bytes": 12 << 20, **overrides}
    return CacheStore(cache_config(root, max_bytes=TINY_MAX_BYTES, **settings))


def publish_tiny_segments(store: CacheStore, segments: int) -> None:
    """Publish up to ``segments`` segments of ``TINY_SAMPLE`` records (fewer where the store refuses room): one
    written record by record, the others copies of its file written into their grants, as a sampler writes them
    (appending a million records one by one would take seconds)."""
    with CacheWriter(store, segment_bytes=TINY_SEGMENT_BYTES, fsync=False) as writer:
        record = writer.encode(TINY_SAMPLE)
        writer.add_record(record)
        while not writer.is_full:
            writer.add_record(record)
    template = store.layout.segments / store.segments[-1].name
    for _ in range(segments - 1):
        grant = store.reserve(template.stat().st_size)
        if grant is None:
            return
        shutil.copyfile(template, grant.path)
        store.publish(grant)


def fill(store: CacheStore, key: int) -> int:
    """Write one-sample segments of ``FILL_BYTES`` until the cache is full to within one of them: the store refuses
    room for one (paced: nothing it holds may go unread) or evicts to make room for one (free-running: it turned
    over). Returns the next key."""
    full = threading.Event()
    evicted = store.counters.evicted_segments
    with (
        contextlib.suppress(WriterStopped),
        CacheWriter(store, segment_bytes=FILL_BYTES, fsync=False, stop=full) as writer,
    ):
        full.set()  # a refusal ends the fill at once rather than waiting for room
        while store.counters.evicted_segments == evicted:
            writer.add(make_sample(f"k{key}", FILL_BYTES - 8192))
            writer.flush()
            key += 1
    return key


def measured_after(write: Any, root: Path, sizes: list[int]) -> Any:
    """``reads.atomic_write`` that appends the cache directory's real size to ``sizes`` once it has written a
    snapshot's staged receipt: the moment the receipt lies beside every rank's record (NOTE [ Read receipts ] in
    ``reads.py``, step 2), before the records are unlinked."""

    def write_and_measure(path: Path, data: bytes, **options: Any) -> None:
        write(path, data, **options)
        if path.name == reads.STAGED_RECEIPT:
            sizes.append(tree_bytes(root))

    return write_and_measure


def record_every_share(pins: list[Snapshot]) -> None:
    """Each rank records what it served, its share of the snapshot (every ``len(pins)``-th sample), as the ranks of
    a job do at the end of an epoch, all within the same moment."""
    for rank, pin in enumerate(pins):
        pin.record_served(np.arange(rank, pin.samples, len(pins), dtype=np.int64))


def test_every_local_rank_recording_what_it_served_stays_within_max_bytes(tmp_path: Path) -> None:
    """Each rank's record of what it served is a bitmap over the whole snapshot, so 8 local ranks ending an epoch
    write 8 bits per sample between two of the daemon's scans. Only one rank's record was charged ahead (the next
    snapshot's room); the rest fell in the 1 MiB reserve, which ~2.8 million samples' records outgrow. The store
    now charges, at each pin scan, the records a live snapshot's ranks have yet to write. The witness is the
    directory's real size once every rank has written its record."""
    root, max_bytes = tmp_path / "c", TINY_MAX_BYTES
    store = tiny_store(root)
    try:
        publish_tiny_segments(store, 24)
        with pins_of_every_local_rank(root, "epoch-0") as pins:
            assert pins[0].samples > 2_500_000, "the scenario needs bitmaps of a few hundred KiB each"
            store.collect_reads()  # the daemon scans snapshots twice a second
            fill(store, 0)  # the daemon fetches on: the cache is full, every snapshot's segment pinned
            assert len(list(pins[0].directory.glob("*.seg"))) == len(pins[0].names), "its segments are all pinned"
            store.collect_reads()
            store.enforce()
            record_every_share(pins)
            records = sorted(pins[0].directory.glob(f"{SERVED_PREFIX}*"))
            assert len(records) == LOCAL_RANKS
            real = tree_bytes(root)
    finally:
        store.close()
    assert real <= max_bytes, f"real size {real:,} is {real - max_bytes:,} bytes over once {LOCAL_RANKS} ranks recorded"


def test_two_jobs_recording_at_once_stay_within_max_bytes(tmp_path: Path) -> None:
    """Two jobs on a node, 8 local ranks each, whose epochs end together: 16 records land between two scans, more
    than the next snapshot's room charges for. Each live snapshot's records to come are charged from the scan that
    finds it; the witness is the directory's real size once every rank of both jobs has recorded."""
    root, max_bytes = tmp_path / "c", TINY_MAX_BYTES
    store = tiny_store(root)
    try:
        publish_tiny_segments(store, 24)
        with pins_of_every_local_rank(root, "job-a") as first:
            store.collect_reads()
            with pins_of_every_local_rank(root, "job-b") as second:
                assert min(first[0].samples, second[0].samples) > 2_500_000, "bitmaps of a few hundred KiB each"
                store.collect_reads()
                fill(store, 0)
                store.collect_reads()
                store.enforce()
                record_every_share(first)
                record_every_share(second)
                real = tree_bytes(root)
    finally:
        store.close()
    assert real <= max_bytes, f"real size {real:,} is {real - max_bytes:,} bytes over once both jobs recorded"


@pytest.mark.parametrize("epoch", ["a later epoch", "the first epoch after the daemon's start"])
def test_an_epoch_of_8_ranks_recording_in_a_paced_cache_stays_within_max_bytes(
    tmp_path: Path, epoch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paced cache (nothing read may go) cannot make room for a snapshot's records once the snapshot is made: the
    next snapshot's room must have held them. The daemon does not know how many ranks will split a snapshot not made
    yet, but a job's next epoch is split as its last: the room charges the records of as many ranks as the most any
    snapshot was split among, and of 8 (``ASSUMED_LOCAL_RANKS``) at least, so that a job's first epoch is covered
    too. The witness is the directory's real size once every rank of the epoch has recorded, and at its release,
    when the epoch's receipt is written beside the records (the reserve holds it)."""
    root, max_bytes = tmp_path / "c", TINY_MAX_BYTES
    store = tiny_store(root, evict_after_reads=1)
    try:
        key = _write_one(store, 0)
        if epoch == "a later epoch":
            with every_local_rank(root, "epoch-0"):  # the job's first epoch, on a cache still filling
                store.collect_reads()
            store.collect_reads()
        publish_tiny_segments(store, 28)
        fill(store, key)
        assert store.is_paced, "the cache is full of samples no epoch has read"
        sizes: list[int] = []  # at the release, once the receipt is written beside the 8 records
        monkeypatch.setattr(reads, "atomic_write", measured_after(reads.atomic_write, root, sizes))
        with pins_of_every_local_rank(root, "epoch-1") as pins:
            assert pins[0].samples > 2_500_000, "the scenario needs bitmaps of a few hundred KiB each"
            store.collect_reads()
            store.enforce()
            record_every_share(pins)
            real = tree_bytes(root)
    finally:
        store.close()
    assert real <= max_bytes, f"real size {real:,} is {real - max_bytes:,} bytes over once {LOCAL_RANKS} ranks recorded"
    assert sizes, "the last rank's release wrote the epoch's receipt"
    assert max(sizes) <= max_bytes, f"{max(sizes) - max_bytes:,} bytes over with the receipt beside the records"


@pytest.mark.parametrize("samples", [1, 8 * 255, 8 * 256 + 1, 8 * 65_535, 8 * 65_536 + 1])
def test_a_served_record_takes_no_more_than_the_store_charges_for_it(tmp_path: Path, samples: int) -> None:
    """``served_record_bytes`` is what the store charges ahead for each rank's record; the witness is the allocated
    size of the file ``write_served`` writes, at the sizes where msgpack's headers grow."""
    write_served(tmp_path, np.arange(0, samples, 2, dtype=np.int64), samples)
    (record,) = tmp_path.glob(f"{SERVED_PREFIX}*")
    info = os.lstat(record)
    assert info.st_size <= served_record_bytes(samples)
    assert allocated_bytes(info) <= served_record_bytes(samples, os.statvfs(tmp_path).f_frsize)
