"""The read contract in the store: a segment is evicted only after ``evict_after_reads`` epochs have read it, reads
are reported by receipts (every epoch counted, once), and the counts survive a restart."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.reads import RECEIPT_SUFFIX, ReadLedger
from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter, WriterStopped
from cachefeed._testing.samples import make_sample
from cachefeed._trainer import EpochLoaderFactory
from tests.support.cache_helpers import cache_config

MAX_BYTES = 4 << 20
SEGMENT_BYTES = 64 << 10


def paced_store(root: Path, *, reads: int = 1) -> CacheStore:
    return CacheStore(
        cache_config(
            root, max_bytes=MAX_BYTES, segment_bytes=SEGMENT_BYTES, turnover_bytes=1 << 20, evict_after_reads=reads
        )
    )


def write_until_paced(store: CacheStore, start: int = 0, limit: int = 100_000) -> int:
    """Add samples until the store refuses room (or ``limit`` are added); returns the next key number."""
    stop = threading.Event()
    writer = CacheWriter(
        store, segment_bytes=SEGMENT_BYTES, fsync=False, poll_s=0.001, stop=stop, on_wait=lambda _s: stop.set()
    )
    n = start
    try:
        while n < start + limit:
            writer.add(make_sample(f"k{n}", 1024))
            n += 1
        writer.flush()
    except WriterStopped:
        pass
    writer.abort()
    return n


def receipts(root: Path) -> list[str]:
    return sorted(p.name for p in CacheLayout(root).snapshots.iterdir() if p.name.endswith(RECEIPT_SUFFIX))


def read_one_epoch(root: Path, snap_id: str) -> Snapshot:
    """An epoch that served every sample of its snapshot."""
    snapshot = Snapshot.create(root, snap_id)
    snapshot.record_served(np.arange(snapshot.samples))
    snapshot.release()
    return snapshot


def test_without_readers_the_store_fills_then_waits_and_evicts_nothing(tmp_path: Path) -> None:
    store = paced_store(tmp_path / "c")
    write_until_paced(store)
    usage = store.usage()
    assert store.reserve(SEGMENT_BYTES) is None, "no trainer has read anything: no room is made"
    assert store.counters.evicted_segments == 0
    assert usage.is_paced and not usage.is_backpressured, "waiting for reads is pacing, not pinned back-pressure"
    assert usage.waiting_for_reads_samples == usage.samples > 0


def test_an_epoch_read_makes_its_segments_evictable_and_nothing_unread_is_evicted(tmp_path: Path) -> None:
    """Checked on the files: the segments that go are the ones the epoch served, the later ones all stay."""
    root = tmp_path / "c"
    store = paced_store(root)
    n = write_until_paced(store)
    read = set(read_one_epoch(root, "run-e000000").names)
    assert len(receipts(root)) == 1, "the last holder of a read snapshot leaves one receipt"
    n = write_until_paced(store, n)
    assert receipts(root) == [], "the store consumed the receipt"
    present = {p.name for p in (root / "segments").iterdir()}
    assert read - present, "segments the epoch served were evicted"
    later = {name for name in present if name not in read}
    assert later, "fresh segments arrived"
    unread_ever_published = {segment.name for segment in store.segments} - read
    assert unread_ever_published <= present, "no segment the epoch did not serve was evicted"
    assert store.usage().is_paced, "the fresh samples are unread: the store waits again"


def test_a_snapshot_released_unread_leaves_no_receipt(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = paced_store(root)
    write_until_paced(store)
    Snapshot.create(root, "built-ahead").release()  # pinned for an epoch that never ran
    assert receipts(root) == []
    assert store.reserve(SEGMENT_BYTES) is None


def test_ranks_sharing_a_snapshot_leave_one_receipt(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = paced_store(root)
    write_until_paced(store)
    first = Snapshot.create(root, "run-e000001")
    second = Snapshot.join(root, "run-e000001")
    first.record_served(np.arange(0, first.samples, 2))
    second.record_served(np.arange(1, first.samples, 2))
    first.release()
    assert receipts(root) == [], "the snapshot is still held: no receipt yet"
    second.release()
    assert len(receipts(root)) == 1


def test_a_static_cache_read_for_many_epochs_collects_no_receipts(tmp_path: Path) -> None:
    """No daemon (the writer lock is free): nobody would consume receipts, so none are left to pile up."""
    root = tmp_path / "c"
    store = paced_store(root)
    write_until_paced(store)
    store.close()  # the cache stays, its writer is gone
    for epoch in range(20):
        read_one_epoch(root, f"static-e{epoch:06d}")
    assert receipts(root) == []
    assert not CacheLayout(root).has_writer()
    again = paced_store(root)
    assert CacheLayout(root).has_writer()
    read_one_epoch(root, "daemon-back")
    assert len(receipts(root)) == 1, "with a writer again, reads are reported"
    again.close()


@pytest.mark.parametrize("required", [2, 3])
def test_a_segment_waits_for_the_configured_number_of_reads(tmp_path: Path, required: int) -> None:
    root = tmp_path / "c"
    store = paced_store(root, reads=required)
    write_until_paced(store)
    for epoch in range(required - 1):
        read_one_epoch(root, f"run-e{epoch:06d}")
    assert store.reserve(SEGMENT_BYTES) is None, f"{required - 1} reads are not enough"
    read_one_epoch(root, "run-last")
    assert store.reserve(SEGMENT_BYTES) is not None
    assert store.counters.evicted_unread_samples == 0


def test_read_counts_survive_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = paced_store(root)
    write_until_paced(store)
    read_one_epoch(root, "run-e000000")
    store.collect_reads()  # the receipt is applied and the ledger written
    store.close()
    store = paced_store(root)
    assert store.counters.epochs_seen == 1
    assert store.reserve(SEGMENT_BYTES) is not None, "the restarted store still knows those segments were read"


def test_a_restart_forgets_nothing_and_counts_nothing_twice(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = paced_store(root, reads=2)
    write_until_paced(store)
    read_one_epoch(root, "run-e000000")
    [name] = receipts(root)
    saved = (root / "snapshots" / name).read_bytes()
    store.collect_reads()  # applied and removed
    store.close()
    (root / "snapshots" / name).write_bytes(saved)  # as if the daemon died between the ledger write and the unlink
    store = paced_store(root, reads=2)
    assert store.counters.epochs_seen == 1
    assert receipts(root) == [], "an applied receipt is removed, not counted again"
    assert store.reserve(SEGMENT_BYTES) is None, "one read is not two"


def test_a_lost_ledger_means_unread_never_early_eviction(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = paced_store(root)
    write_until_paced(store)
    read_one_epoch(root, "run-e000000")
    store.collect_reads()
    store.close()
    (root / "reads").write_bytes(b"\x00garbage")
    store = paced_store(root)
    assert store.reserve(SEGMENT_BYTES) is None
    assert ReadLedger(root, root / "snapshots").load() == {}


def test_every_epoch_is_counted_however_short(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = paced_store(root)
    write_until_paced(store, limit=64)  # a few segments, one batch an epoch
    epochs = 100
    with EpochLoaderFactory(root, batch_size=64, run_id="short", progress=None, epochs=epochs) as factory:
        for epoch in range(epochs):
            assert sum(1 for _batch in factory.loader(epoch)) == 1
    deadline = time.monotonic() + 20
    while store.counters.epochs_seen < epochs and time.monotonic() < deadline:
        store.collect_reads()
        time.sleep(0.01)
    assert store.counters.epochs_seen == epochs


def test_a_segment_counts_as_read_only_once_every_sample_in_it_was_served(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = paced_store(root)
    write_until_paced(store)
    snapshot = Snapshot.create(root, "all-but-one")
    oldest = root / "segments" / snapshot.names[0]
    missed = snapshot.counts[0] - 1  # the oldest segment's last sample
    snapshot.record_served(np.delete(np.arange(snapshot.samples), missed))
    snapshot.release()
    store.collect_reads()
    usage = store.usage()
    unpinned = store.samples - snapshot.samples  # a snapshot pins the epoch room at most (room.py)
    assert usage.unread_samples == 1 + unpinned and usage.max_reads == 1
    assert store.reserve(SEGMENT_BYTES) is not None, "the fully served segments make room"
    assert oldest.exists(), "FIFO would take the oldest first: a segment with a sample never served stays"
    again = Snapshot.create(root, "the-one")
    again.record_served(np.array([missed]))  # in this snapshot too, the oldest segment comes first
    assert again.names[0] == oldest.name
    again.release()
    write_until_paced(store, 10_000)
    assert not oldest.exists(), "once its last sample was served, it went"
    assert store.counters.evicted_unread_samples == 0
    store.close()


def _kill_while_removing(root: Path, where: str) -> None:
    """In a child process: pin, serve every sample, release, and die by SIGKILL at ``where`` in the removal."""
    import os
    import signal

    from cachefeed._cache import reads, snapshots

    def die(*_args: object, **_kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "after-staging":  # the union is written as RECEIPT, not yet handed to the daemon
        reads.os.rename = die  # type: ignore[attr-defined]
    else:  # "after-handing": the receipt is the daemon's, the directory still there
        leave = snapshots._leave_receipt

        def leave_then_die(directory: Path) -> None:
            leave(directory)
            die()

        snapshots._leave_receipt = leave_then_die  # type: ignore[assignment]
    snapshot = Snapshot.create(root, "killed")
    snapshot.record_served(np.arange(snapshot.samples))
    snapshot.release()


@pytest.mark.parametrize("where", ["after-staging", "after-handing"])
def test_a_receipt_is_counted_once_whatever_kills_its_writer(tmp_path: Path, where: str) -> None:
    import multiprocessing

    root = tmp_path / "c"
    store = paced_store(root, reads=2)
    write_until_paced(store)
    child = multiprocessing.get_context("fork").Process(target=_kill_while_removing, args=(root, where))
    child.start()
    child.join()
    assert child.exitcode == -9, "the writer died mid-removal"
    assert (root / "snapshots" / "killed.lock").exists(), "it left its snapshot behind"
    store._swept_at = 0.0
    store.sweep()  # the daemon removes the dead holder's snapshot, finishing what it had started
    store.collect_reads()
    assert not (root / "snapshots" / "killed").exists()
    assert receipts(root) == []
    assert store.counters.epochs_seen == 1, "one epoch, one receipt"
    assert store.reserve(SEGMENT_BYTES) is None, "counted once: one read is not the two required"
    store.close()


def test_samples_served_from_a_segment_evicted_under_its_epoch_are_not_counted_evicted_unread(tmp_path: Path) -> None:
    """A segment may go while an epoch still pins and reads it (free-running, or its source dropped from the
    config): what that epoch served is settled when its receipt arrives, so "evicted unread" counts samples no
    epoch ever served."""
    root = tmp_path / "c"
    store = paced_store(root, reads=0)
    write_until_paced(store, limit=600)
    snapshot = Snapshot.create(root, "reading")
    store.collect_reads()  # the daemon sees the pin
    write_until_paced(store, 600, limit=3_000)  # free-running: unpinned segments turn over
    store.drop_sources(keep=set())  # and the pinned ones are evicted under the epoch
    evicted = store.counters.evicted_samples
    assert evicted > 0 and store.counters.evicted_unread_samples == evicted
    snapshot.record_served(np.arange(snapshot.samples))  # the epoch goes on to serve all it pinned
    snapshot.release()
    store.collect_reads()
    gone = [name for name in snapshot.names if not (root / "segments" / name).exists()]
    served_then_evicted = sum(c for n, c in zip(snapshot.names, snapshot.counts, strict=True) if n in gone)
    assert served_then_evicted > 0
    assert store.counters.evicted_unread_samples == evicted - served_then_evicted
    store.close()
