"""A cache's filesystem that fills up (another user's files in a shared ``/dev/shm``) while the cache is full and
paced: the writer that held a grant met ENOSPC inside its open segment, and its sampler died with a traceback
(counted as a restart); and since a full, paced cache waits for reads before it ever looks at free space, status
then said ``running``, exit 0, ``is_out_of_space`` false. Now the refused segment is dropped (its objects fetched
again), the sampler lives, and status says what it says when a grant finds no room: degraded, "the cache's
filesystem is full", until the filesystem has room again; then ingest goes on by itself.

The filesystem is a real tmpfs (``tests/support/tmpfs.py``), filled from the sampler's preprocess at the first
sample after the test says so, so that the fill comes while a segment is open under a grant. Witnesses:
``cachefeed status`` and what the training loop receives."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from cachefeed._config import toml_text
from cachefeed._testing.daemon import DaemonProcess, start_daemon
from cachefeed._trainer import EpochLoaderFactory
from tests.cache.test_full_disk import fill_up
from tests.support.child_env import child_env
from tests.support.cli import run_cli
from tests.support.tmpfs import small_tmpfs

OBJECTS = 300
VALUES = 8192  # int32: 32 KiB a sample


def fill_the_disk_once_told(sample: dict[str, Any]) -> dict[str, Any]:
    """``sampler.preprocess``: once the test created the go file, fill the cache's filesystem (once)."""
    go, done = Path(os.environ["CACHEFEED_TEST_GO"]), Path(os.environ["CACHEFEED_TEST_FILLED"])
    if go.exists() and not done.exists():
        done.touch()
        fill_up(Path(os.environ["CACHEFEED_TEST_BALLAST"]))
    return sample


def npy(value: int) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.full(VALUES, value, np.int32))
    return buffer.getvalue()


def read_epoch(cache_dir: Path, run_id: str) -> list[tuple[str, int]]:
    """``(key, value)`` of every sample an epoch served."""
    with EpochLoaderFactory(cache_dir, batch_size=1, run_id=run_id, progress=None) as factory:
        return [(batch["__key__"][0], int(batch["data"][0][0])) for batch in factory.loader(0)]


def restarts(daemon: DaemonProcess) -> int:
    return sum(sampler["restarts"] for sampler in (daemon.status() or {}).get("samplers", []))


def test_a_filesystem_that_fills_while_the_cache_is_paced_is_named_and_ingest_resumes_without_a_crash(
    tmp_path: Path,
) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    for i in range(OBJECTS):
        (remote / f"{i:03d}.npy").write_bytes(npy(i))
    go, filled = tmp_path / "go", tmp_path / "filled"
    with small_tmpfs(16 << 20) as mount:
        cache_dir, ballast = mount / "cache", mount / "ballast"
        config = tmp_path / "paced.toml"
        config.write_text(
            toml_text(
                {
                    "remote": {"url": remote.as_uri(), "refresh_interval": "1h"},
                    "cache": {
                        "dir": str(cache_dir),
                        "max_bytes": "4MiB",
                        "segment_bytes": "256KiB",
                        "min_free_bytes": 0,
                        "fsync": False,
                    },
                    "sampler": {
                        "processes": 1,
                        "concurrency": 2,
                        "decode": "npy",
                        "preprocess": "tests.daemon.test_full_filesystem_paced:fill_the_disk_once_told",
                    },
                    "status": {"interval": "200ms"},
                }
            )
        )
        env = child_env(
            CACHEFEED_TEST_GO=str(go), CACHEFEED_TEST_FILLED=str(filled), CACHEFEED_TEST_BALLAST=str(ballast)
        )
        daemon = start_daemon(config, cache_dir, tmp_path / "daemon.err", env=env)
        try:
            daemon.wait_status(lambda d: d["cache"]["is_paced"], timeout_s=60, what="the cache full and paced")
            go.touch()
            first = read_epoch(cache_dir, "before")  # its reads let segments go: a grant, then the fill
            doc = daemon.wait_status(
                lambda d: d["cache"]["is_out_of_space"], timeout_s=30, what="the full filesystem in status"
            )
            assert filled.exists(), "the fill came from the preprocess"
            assert any("the cache's filesystem is full" in reason for reason in doc["degraded_reasons"]), doc
            shown = run_cli("status", "--cache-dir", str(cache_dir))
            assert shown.returncode == 2 and "OUT OF SPACE" in shown.stdout, shown.stdout
            assert restarts(daemon) == 0, daemon.stderr()[-3000:]
            ingested = doc["ingest"]["samples_total"]

            ballast.unlink()  # room again
            doc = daemon.wait_status(
                lambda d: (
                    not d["cache"]["is_out_of_space"]
                    and d["state"] == "running"
                    and d["ingest"]["samples_total"] > ingested
                ),
                timeout_s=30,
                what="ingest going on once there is room",
            )
            second = read_epoch(cache_dir, "after")
            report = json.loads(run_cli("status", "--cache-dir", str(cache_dir), "--json").stdout)
        finally:
            daemon.stop()
    for served in (first, second):
        assert all(key == f"{value:03d}.npy" for key, value in served), "every sample is its object's"
        assert len({key for key, _ in served}) == len(served), "no sample twice in an epoch"
    assert {key for key, _ in second} - {key for key, _ in first}, "samples fetched since the first epoch"
    assert not report["cache"]["is_out_of_space"] and report["health"]["exit_status"] == 0, report
    assert [s["restarts"] for s in report["samplers"]] == [0] and report["samplers"][0]["last_error"] is None
    stderr = daemon.stderr()
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "the cache's filesystem refused a segment (No space left on device)" in stderr, stderr[-3000:]
