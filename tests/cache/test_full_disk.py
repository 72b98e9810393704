"""A cache whose filesystem fills up (a shared ``/dev/shm``, another user's files): the daemon's own small writes,
the read ledger and ``budget.json``, met ENOSPC and crashed it with a traceback, and it could not start again
while the disk stayed full. Now the reads an epoch served are kept (in memory and in their receipts, credited once)
and written when room comes back; status names the problem; a start on a full disk works.

The filesystem is a real 4 MiB tmpfs (``tests/support/tmpfs.py``) filled by a ballast file; the witnesses are the
receipt and ledger files and what a restarted store reads back from them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cachefeed._cache.reads import RECEIPT_SUFFIX, ReadLedger
from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._testing.samples import make_sample
from tests.support.cache_helpers import cache_config
from tests.support.tmpfs import small_tmpfs


def fill_up(path: Path) -> None:
    """Everything the filesystem has left, in one ballast file."""
    with path.open("wb") as out:
        try:
            while True:
                out.write(bytes(64 << 10))
                out.flush()
        except OSError:
            pass


def test_a_full_cache_filesystem_keeps_the_reads_and_the_daemon_running() -> None:
    with small_tmpfs(4 << 20) as mount:
        root = mount / "c"
        config = cache_config(root, max_bytes=3 << 20, segment_bytes=64 << 10, turnover_bytes=512 << 10)
        store = CacheStore(config)
        with CacheWriter(store, segment_bytes=64 << 10, fsync=False) as writer:
            for i in range(100):
                writer.add(make_sample(f"k{i}", 256))
        snapshot = Snapshot.create(root, "run-e000000")
        snapshot.record_served(np.arange(snapshot.samples))
        snapshot.release()  # the epoch's receipt, for the daemon to credit

        def receipts() -> list[str]:
            return sorted(p.name for p in (root / "snapshots").iterdir() if p.name.endswith(RECEIPT_SUFFIX))

        (receipt,) = receipts()
        fill_up(mount / "ballast")
        store._rescan_pins()  # crashed here: ENOSPC writing the ledger
        assert sorted(store.write_problems) == ["the read ledger"], "named in status, no crash"
        assert receipts() == [receipt], "the receipt is kept until the ledger holds it"
        store.close()
        store = CacheStore(config)  # a restart on the full disk: it crashed in write_room, and in the ledger again
        assert sorted(store.write_problems) == ["budget.json", "the read ledger"], "it runs, and says what it lacks"
        (mount / "ballast").unlink()  # room again
        store._rescan_pins()
        assert store.write_problems == {}, "both written once there is room"
        assert receipts() == [], "the ledger holds the epoch now"
        store.close()
        counts = ReadLedger(root, root / "snapshots").load()
    assert sum(len(c) for c in counts.values()) == 100
    assert {int(c) for v in counts.values() for c in v} == {1}, "every sample read once: credited once"
