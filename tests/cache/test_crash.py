"""A writer SIGKILLed at random moments: after each recovery, nothing partial is visible and everything verifies."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.records import SegmentReader
from cachefeed._cache.store import CacheStore
from cachefeed._testing.samples import check_sample
from tests.support.cache_helpers import cache_config


def start_writer(root: Path, start_key: int) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.writer_proc",
            str(root),
            str(6 << 20),
            str(128 << 10),
            "3000",
            str(start_key),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    return process


def verify_recovered(root: Path) -> set[str]:
    """Recover like a daemon start would, then check the promises. Returns the keys of the verified samples."""
    store = CacheStore(cache_config(root, max_bytes=6 << 20, segment_bytes=128 << 10, turnover_bytes=128 << 10))
    try:
        layout = CacheLayout(root)
        assert os.listdir(layout.tmp) == [], "no temporary file survives recovery"
        names = sorted(os.listdir(layout.segments))
        assert names == [name for name, _ in layout.list_segments()], "only valid segment names are visible"
        verified: list[str] = []
        for name in names:
            with SegmentReader(layout.segments / name) as reader:
                reader.verify_all()
                for sample in reader:
                    check_sample(sample)
                    verified.append(sample["__key__"])
        assert len(verified) == len(set(verified)), "no sample is published twice"
        return set(verified)
    finally:
        store.close()


def crash_loop(tmp_path: Path, kills: int) -> None:
    root = tmp_path / "cache"
    rng = random.Random(1234)
    distinct: set[str] = set()
    rounds_with_new_samples = 0
    for round_ in range(kills):
        writer = start_writer(root, start_key=round_ * 1_000_000)
        try:
            time.sleep(rng.uniform(0.0, 0.25))
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.wait()
            assert writer.stdout is not None
            writer.stdout.close()
        keys = verify_recovered(root)
        rounds_with_new_samples += bool(keys - distinct)
        distinct |= keys
    print(f"\n{kills} SIGKILLs, {len(distinct)} distinct samples verified after the recoveries, 0 violations")
    # Each round writes under its own keys: most kills must land after some segment was published, or the loop
    # tests nothing but an empty cache.
    assert rounds_with_new_samples >= kills // 2, (rounds_with_new_samples, kills)


def test_writer_killed_16_times_leaves_no_partial_state(tmp_path: Path) -> None:
    crash_loop(tmp_path, 16)  # the slow run below kills 500 times


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_writer_killed_500_times_leaves_no_partial_state(tmp_path: Path) -> None:
    crash_loop(tmp_path, 500)


def test_a_file_write_killed_midway_leaves_nothing_in_the_budget_after_recovery(tmp_path: Path) -> None:
    """The ledger, the restart catalog and status.json are replaced through a temp file beside them. A kill -9 during
    the write (the catalog's can be 5% of the budget) left it in the cache's root for good, counted against the
    budget at every restart. Recovery now removes it, as it removes ``tmp/``."""
    root = tmp_path / "c"
    CacheStore(cache_config(root)).close()
    leftover = root / ".catalog-00000000.cfcat.k2j3h4.partial"
    leftover.write_bytes(bytes(1 << 20))
    store = CacheStore(cache_config(root))
    try:
        assert not leftover.exists()
        assert store.usage().bytes < 1 << 20, "and nothing of it is charged"
    finally:
        store.close()
