"""An epoch's room (``cachefeed/_cache/room.py``): a snapshot pins at most the daemon's epoch room, least-read
first, counting every live snapshot as read once more and the receipts the daemon has not collected as read; a
static cache (no daemon now nor within the restart window) is pinned whole."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from cachefeed._cache.layout import DAEMON_RESTART_WINDOW_S, CacheLayout
from cachefeed._cache.room import Candidate, choose, read_room
from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import CacheStore
from tests.status.test_status import make_document
from tests.support.cache_helpers import cache_config, write_until_full

SEGMENT = 64 << 10


def _store(root: Path) -> CacheStore:
    config = cache_config(root, max_bytes=6 << 20, segment_bytes=SEGMENT, turnover_bytes=3 << 20, evict_after_reads=1)
    return CacheStore(config)


def _pinned_bytes(snapshot: Snapshot) -> int:
    return sum((snapshot.directory / name).stat().st_blocks * 512 for name in snapshot.names)


def test_a_snapshot_pins_at_most_the_epoch_room_unread_segments_first(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = _store(root)
    try:
        write_until_full(store, 0, nbytes=20_000)
        room = read_room(root)
        assert room == store.epoch_room == (6 << 20) - (3 << 20) - (1 << 20)
        assert store.published_bytes > room, "the cache holds more than one epoch's room"
        with Snapshot.create(root, "e0") as first:
            assert _pinned_bytes(first) <= room
            oldest = [name for name, _ in CacheLayout(root).list_segments()][: len(first.names)]
            assert list(first.names) == oldest, "all unread: oldest first"
            first.record_served(np.arange(first.samples))
        store.collect_reads()
        with Snapshot.create(root, "e1") as second:
            assert not set(second.names) & set(first.names), "the unread segments come before those read once"
            assert _pinned_bytes(second) <= room
    finally:
        store.close()


def test_the_previous_epochs_segments_count_one_pending_read(tmp_path: Path) -> None:
    """The job's live previous snapshot has not sent its receipt yet: its segments come after the unread ones."""
    root = tmp_path / "c"
    store = _store(root)
    try:
        write_until_full(store, 0, nbytes=20_000)
        with Snapshot.create(root, "e0", job="j") as first:
            with Snapshot.create(root, "e1", job="j", reading=first.names) as second:
                assert not set(second.names) & set(first.names)
    finally:
        store.close()


def test_an_epoch_released_before_the_daemon_collected_its_receipt_counts_as_read(tmp_path: Path) -> None:
    """The next epoch is pinned right after the last one's release: its receipt is still waiting for the daemon's
    collection, yet its segments are not taken for unread ones (they would be read twice in a row)."""
    root = tmp_path / "c"
    store = _store(root)
    try:
        write_until_full(store, 0, nbytes=20_000)
        with Snapshot.create(root, "e0", job="j") as first:
            first.record_served(np.arange(first.samples))
        assert list((root / "snapshots").glob("*.receipt")), "the receipt waits for the daemon"
        with Snapshot.create(root, "e1", job="j") as second:
            assert not set(second.names) & set(first.names)
    finally:
        store.close()


def test_every_live_snapshot_counts_one_pending_read_without_being_named(tmp_path: Path) -> None:
    """A snapshot being read (by this job or another) holds segments whose read is on its way, whether or not the
    creator names them (``reading``)."""
    root = tmp_path / "c"
    store = _store(root)
    try:
        write_until_full(store, 0, nbytes=20_000)
        with Snapshot.create(root, "e0", job="j") as first:
            with Snapshot.create(root, "other-e0", job="k") as second:
                assert not set(second.names) & set(first.names)
    finally:
        store.close()


def test_a_static_cache_is_pinned_whole(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = _store(root)
    write_until_full(store, 0, nbytes=20_000)
    published = len(store.segments)
    store.close()  # no daemon holds the cache: nobody keeps a room, so nothing is left out
    with Snapshot.create(root, "static") as snapshot:
        assert len(snapshot.names) == published


def test_a_daemon_restarting_keeps_its_room_and_one_stopped_or_gone_for_longer_leaves_a_static_cache(
    tmp_path: Path,
) -> None:
    """Between a daemon's crash and its restart (systemd's restart delay, a crash loop) nobody holds the writer lock.
    An epoch begun then still pins at most the room: pinned whole, the cache would have nothing to turn over when
    the daemon is back, until that epoch ended. A daemon that stopped on purpose, or whose last status is older than
    the restart window, leaves a static cache, read whole. Judged by the document's own ``state`` and
    ``updated_at``: a copy of the cache (a fresh mtime) is not a daemon restarting."""
    root = tmp_path / "c"
    store = _store(root)
    write_until_full(store, 0, nbytes=20_000)
    published = len(store.segments)
    room = read_room(root)
    assert room is not None and store.published_bytes > room
    store.close()
    status = CacheLayout(root).status_file
    status.write_text(json.dumps(make_document(root)))  # a running daemon's last status: it was killed a moment ago
    with Snapshot.create(root, "restarting") as snapshot:
        assert _pinned_bytes(snapshot) <= room < store.published_bytes
        assert len(snapshot.names) < published
    status.write_text(json.dumps(make_document(root, state="stopped")))
    with Snapshot.create(root, "stopped") as snapshot:
        assert len(snapshot.names) == published, "a daemon stopped on purpose: a static cache, read whole"
    status.write_text(json.dumps(make_document(root, updated_at=time.time() - DAEMON_RESTART_WINDOW_S - 60)))
    with Snapshot.create(root, "gone") as snapshot:  # the file is new (a copy), its document is old
        assert len(snapshot.names) == published, "no daemon for longer than the window: a static cache, read whole"


def test_weighted_sources_each_get_their_share_of_the_room() -> None:
    fast = [Candidate(seq, 10, 0, tag=1) for seq in range(20)]
    slow = [Candidate(100 + seq, 10, 3, tag=2) for seq in range(20)]
    chosen = choose(fast + slow, 100, {1: 0.5, 2: 0.5})
    assert len([s for s in chosen if s < 100]) == 5 and len([s for s in chosen if s >= 100]) == 5
    assert choose(fast + slow, 100) == list(range(10)), "unweighted: least-read first"
    assert choose(fast, None) == list(range(20)), "no room: everything"
    # samples known only of segments that take no block yet (inline data): shares by bytes, no division by zero
    blockless = [Candidate(seq, 0, 0, tag=1, samples=5) for seq in range(2)]
    chosen = choose([*blockless, *slow], 50, {1: 0.5, 2: 0.5})
    assert chosen[:2] == [0, 1] and 10 * len(chosen[2:]) <= 50, chosen
