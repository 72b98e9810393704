"""A daemon restarted on a cache that already holds every object the remote lists.

It adopts what the recovered segments hold and fetches nothing again, so its first pass draws nothing: that pass
was never counted. ``remote.passes_completed`` stayed 0 (``cachefeed status``: "0 passes done") while ``plan.pass``
climbed, and a trainer's first, growing, epoch, which ends when the daemon has fetched everything the remote lists
(``passes_completed >= 1``), got every batch and then waited ``wait_timeout_s`` for more, to fail with "did not
grow". Now the first pass over a wholly cached catalog is counted like any other (and the idle passes after it are
paced, not counted). The restarted daemon here begins a pass it knows nothing of: the first one's pass file is
removed, as on a cache written before pass files (a daemon that finds it goes on with the pass and its count:
``tests/daemon/test_pass_file.py``). The witnesses: the restarted daemon's status document, its own ingest counters
and segment files (nothing fetched again), and a training loop's first epoch that ends with every sample once.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cachefeed._testing.daemon import DaemonProcess, start_daemon
from cachefeed._trainer import EpochLoaderFactory
from tests.support.file_remote import file_daemon_config, npy_remote

OBJECTS = 50


@pytest.fixture
def remote(tmp_path: Path) -> Path:
    """A file:// remote of ``OBJECTS`` small .npy files; object ``i`` holds the value ``i``."""
    return npy_remote(tmp_path / "remote", OBJECTS)


@pytest.fixture
def config(tmp_path: Path, remote: Path) -> Path:
    """A daemon whose budget holds the whole remote many times over, in several 4 KiB segments (what a restart
    recovers and adopts)."""
    return file_daemon_config(tmp_path / "daemon.toml", remote, tmp_path / "cache", {"sampler": {"concurrency": 4}})


@pytest.fixture
def restarted(tmp_path: Path, config: Path) -> Iterator[tuple[DaemonProcess, set[str]]]:
    """A daemon that cached the whole remote and was stopped, then a new one on the same cache; yields the new one
    and the segment files the first left."""
    cache_dir = tmp_path / "cache"
    first = start_daemon(config, cache_dir, tmp_path / "first.err")
    try:
        first.wait_status(
            lambda d: d["remote"]["passes_completed"] >= 1 and d["cache"]["samples"] == OBJECTS,
            timeout_s=60,
            what="the first daemon to cache the whole remote",
        )
    finally:
        assert first.stop() == 0
    segments = {path.name for path in (cache_dir / "segments").iterdir()}
    assert len(segments) > 1
    for path in cache_dir.glob("pass-*.cfpass"):
        path.unlink()
    second = start_daemon(config, cache_dir, tmp_path / "second.err")
    try:
        yield second, segments
    finally:
        second.stop()


def test_the_first_pass_over_a_cache_that_holds_everything_is_counted_and_fetches_nothing(
    restarted: tuple[DaemonProcess, set[str]],
) -> None:
    daemon, segments = restarted
    doc = daemon.wait_status(
        lambda d: d["remote"]["passes_completed"] >= 1,
        timeout_s=20,
        what=f"a pass completed after the restart (log: {daemon.stderr_path})",
    )
    # another whole pass: whatever it would fetch again, it has drawn by then
    doc = daemon.wait_status(lambda d: d["plan"]["pass"] >= 2, timeout_s=20, what="a second pass after the restart")
    log = daemon.stderr()
    assert "recovered in" in log and f"{OBJECTS} samples" in log, log
    assert re.search(r"pass \d+ completed: 0 objects drawn, 0 done", log), log  # pass 1 where the listing came late
    assert doc["plan"]["skipped_cached_total"] >= 2 * OBJECTS  # every object skipped as cached, in both passes
    assert doc["remote"]["passes_completed"] == 1, "idle passes that repeat the first are not counted"
    ingest = doc["ingest"]
    assert (ingest["objects_total"], ingest["samples_total"], ingest["segments_total"]) == (0, 0, 0), ingest
    assert doc["cache"]["samples"] == OBJECTS
    assert {path.name for path in (daemon.cache_dir / "segments").iterdir()} == segments, "nothing cached again"
    shown = subprocess.run(
        [sys.executable, "-m", "cachefeed", "status", "--cache-dir", str(daemon.cache_dir)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "1 pass done" in " ".join(shown.stdout.split()), shown.stdout + shown.stderr


def test_a_growing_first_epoch_after_the_restart_ends_with_every_sample_once(
    restarted: tuple[DaemonProcess, set[str]],
) -> None:
    daemon, _ = restarted
    daemon.wait_status(lambda d: d["remote"]["passes_completed"] >= 1, timeout_s=20, what="the restarted daemon's pass")
    values: list[int] = []
    with EpochLoaderFactory(
        daemon.cache_dir, batch_size=8, num_workers=2, wait_timeout_s=30, run_id="growing", progress=None
    ) as factory:
        loader = factory.loader(0)
        planned = len(loader)  # before the first batch: what a progress bar or a scheduler is told
        for batch in loader:
            values += [int(row[0]) for row in np.asarray(batch["data"])]
    assert sorted(values) == list(range(OBJECTS))
    # everything the remote lists is cached: no more than that (it said the epoch room's worth, many times more)
    assert planned == -(-OBJECTS // 8), planned
    daemon.check_running()


def test_a_fill_level_after_the_restart_is_reached_with_everything_the_remote_lists(
    restarted: tuple[DaemonProcess, set[str]],
) -> None:
    """The cache is far from 75% full: the wait ends because the daemon holds everything the remote lists."""
    daemon, _ = restarted
    daemon.wait_status(lambda d: d["state"] == "running", timeout_s=20, what="the restarted daemon ready")
    values: list[int] = []
    with EpochLoaderFactory(
        daemon.cache_dir, batch_size=8, min_samples="75%", wait_timeout_s=30, run_id="fill", progress=None
    ) as factory:
        for batch in factory.loader(0):
            values += [int(row[0]) for row in np.asarray(batch["data"])]
    assert sorted(values) == list(range(OBJECTS))
