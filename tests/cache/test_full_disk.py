"""A cache whose filesystem fills up (a shared ``/dev/shm``, another user's files): the daemon's own small writes,
the read ledger and ``budget.json``, met ENOSPC and crashed it with a traceback, and it could not start again
while the disk stayed full. Now the reads an epoch served are kept (in memory and in their receipts, credited once)
and written when room comes back; status names the problem; a start on a full disk works.

The filesystem is a real 4 MiB tmpfs in a private mount namespace (``unshare -m``), filled by a ballast file; the
witnesses are the receipt and ledger files and what a restarted store reads back from them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.child_env import REPO, child_env

_ON_A_FULL_TMPFS = """
import json, subprocess, sys
from pathlib import Path
import numpy as np
from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.reads import RECEIPT_SUFFIX, ReadLedger
from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._testing.samples import make_sample
from tests.support.cache_helpers import cache_config

mnt = Path(sys.argv[1])
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
root = mnt / "c"
config = cache_config(root, max_bytes=3 << 20, segment_bytes=64 << 10, turnover_bytes=512 << 10)
store = CacheStore(config)
with CacheWriter(store, segment_bytes=64 << 10, fsync=False) as writer:
    for i in range(100):
        writer.add(make_sample(f"k{i}", 256))
snapshot = Snapshot.create(root, "run-e000000")
snapshot.record_served(np.arange(snapshot.samples))
snapshot.release()  # the epoch's receipt, for the daemon to credit
ballast = mnt / "ballast"
with ballast.open("wb") as out:  # everything else the filesystem has
    try:
        while True:
            out.write(bytes(64 << 10)); out.flush()
    except OSError:
        pass
receipts = lambda: sorted(p.name for p in (root / "snapshots").iterdir() if p.name.endswith(RECEIPT_SUFFIX))
report = {"receipts_before": receipts()}
store._rescan_pins()  # crashed here: ENOSPC writing the ledger
report["problems_while_full"] = sorted(store.write_problems)
report["receipts_while_full"] = receipts()
store.close()
store = CacheStore(config)  # a restart on the full disk: crashed in write_room, and in the ledger again
report["problems_at_restart"] = sorted(store.write_problems)
ballast.unlink()  # room again
store._rescan_pins()
report["problems_after"] = sorted(store.write_problems.values())
report["receipts_after"] = receipts()
store.close()
counts = ReadLedger(root, root / "snapshots").load()
report["reads"] = sorted({int(c) for counts in counts.values() for c in counts})
report["samples_counted"] = sum(len(c) for c in counts.values())
print(json.dumps(report))
"""


def test_a_full_cache_filesystem_keeps_the_reads_and_the_daemon_running(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs root, unshare and mount (a private mount namespace for a small tmpfs)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(
        ["unshare", "-m", sys.executable, "-c", _ON_A_FULL_TMPFS, str(mnt)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
        env=child_env(),
    )
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip(f"this container refuses mount namespaces: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert len(report["receipts_before"]) == 1
    assert report["problems_while_full"] == ["the read ledger"], "named in status, no crash"
    assert report["receipts_while_full"] == report["receipts_before"], "the receipt is kept until the ledger is"
    assert report["problems_at_restart"] == ["budget.json", "the read ledger"], "a start on a full disk runs"
    assert report["problems_after"] == [], "both written once there is room"
    assert report["receipts_after"] == [], "the ledger holds the epoch now"
    assert report["samples_counted"] == 100 and report["reads"] == [1], "every sample read once: credited once"
