"""A daemon restarted with two named sources: one all cached already, the other still to fetch.

The cached source completes its first pass at once (it draws nothing: ``plan.py``), the other only once its
objects have come through the rate cap. A trainer that waits for the cache to fill, or whose first epoch grows
until the daemon has everything, must wait for both: ``passes_completed`` is the passes *every* source completed
(``Inputs.passes_completed``). Summed, one source's pass ended the wait early and the epoch missed the other's
samples. The witness: what the training loop received, every object of both sources once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachefeed._config import toml_text
from cachefeed._testing.daemon import DaemonProcess, start_daemon
from cachefeed._testing.samples import npy_bytes
from cachefeed._trainer import EpochLoaderFactory

OBJECTS = 24  # per source
VALUES = 16 * 1024  # int32 values per object: 64 KiB, so that the rate cap spreads the second source over seconds
CAP = "384KiB"  # the second source's 1.5 MiB take about 4 s


def write_remote(directory: Path, first_value: int) -> Path:
    """A file:// remote of ``OBJECTS`` .npy files; object ``i`` holds the value ``first_value + i``."""
    directory.mkdir()
    for i in range(OBJECTS):
        (directory / f"{i:03d}.npy").write_bytes(npy_bytes(np.full(VALUES, first_value + i, np.int32)))
    return directory


def config(path: Path, cache_dir: Path, sources: dict[str, Path], remote: dict[str, Any]) -> Path:
    path.write_text(
        toml_text(
            {
                "remote": {"refresh_interval": "1h", **remote},
                "cache": {"dir": str(cache_dir), "max_bytes": "64MiB", "segment_bytes": "256KiB", "fsync": False},
                "sampler": {"processes": 1, "concurrency": 4, "decode": "npy"},
                "status": {"interval": "200ms"},
                "source": [{"name": name, "url": url.as_uri()} for name, url in sources.items()],
            }
        )
    )
    return path


@pytest.fixture
def restarted(tmp_path: Path) -> Iterator[DaemonProcess]:
    """A daemon that cached source ``cached`` whole and stopped; then one on the same cache that also has source
    ``fresh``, fetched through a rate cap."""
    cache_dir = tmp_path / "cache"
    cached = write_remote(tmp_path / "cached", 0)
    fresh = write_remote(tmp_path / "fresh", 1000)
    first = start_daemon(
        config(tmp_path / "first.toml", cache_dir, {"cached": cached}, {}), cache_dir, tmp_path / "1.err"
    )
    try:
        first.wait_status(
            lambda d: d["remote"]["passes_completed"] >= 1 and d["cache"]["samples"] == OBJECTS,
            timeout_s=60,
            what="the first daemon to cache the first source whole",
        )
    finally:
        assert first.stop() == 0
    assert "pass 0 of source 'cached' completed: " in first.stderr(), "a named source's pass says whose it is"
    both = config(tmp_path / "both.toml", cache_dir, {"cached": cached, "fresh": fresh}, {"max_bytes_per_s": CAP})
    second = start_daemon(both, cache_dir, tmp_path / "2.err")
    try:
        yield second
    finally:
        second.stop()


EVERY_VALUE = list(range(OBJECTS)) + list(range(1000, 1000 + OBJECTS))


def read_epoch(daemon: DaemonProcess, **settings: Any) -> list[int]:
    values: list[int] = []
    with EpochLoaderFactory(daemon.cache_dir, batch_size=4, wait_timeout_s=60, progress=None, **settings) as factory:
        for batch in factory.loader(0):
            values += [int(row[0]) for row in np.asarray(batch["data"])]
    return values


def test_a_fill_wait_ends_when_every_source_has_completed_its_pass(restarted: DaemonProcess) -> None:
    restarted.wait_status(lambda d: d["state"] == "running", timeout_s=20, what="the restarted daemon ready")
    values = read_epoch(restarted, min_samples="75%", run_id="fill")
    assert sorted(values) == EVERY_VALUE, f"{len(values)} of {len(EVERY_VALUE)} samples (log: {restarted.stderr_path})"


def test_a_growing_first_epoch_ends_when_every_source_has_completed_its_pass(restarted: DaemonProcess) -> None:
    restarted.wait_status(lambda d: d["state"] == "running", timeout_s=20, what="the restarted daemon ready")
    values = read_epoch(restarted, num_workers=2, run_id="growing")
    assert sorted(values) == EVERY_VALUE, f"{len(values)} of {len(EVERY_VALUE)} samples (log: {restarted.stderr_path})"


def test_a_restart_with_new_weights_says_so_and_keeps_the_cached_samples(tmp_path: Path) -> None:
    """Weights do not change what a sample is: the cache is kept. What changes is the mix the cache moves toward,
    which status shows only as it turns over; the log says at the start which weights changed (it said nothing,
    and status showed the old shares as if the new weights were ignored)."""
    cache_dir = tmp_path / "cache"
    sources = {"cached": write_remote(tmp_path / "cached", 0), "fresh": write_remote(tmp_path / "fresh", 1000)}

    def weighted(path: Path, weights: tuple[float, float]) -> Path:
        document = {
            "remote": {"refresh_interval": "1h"},
            "cache": {"dir": str(cache_dir), "max_bytes": "64MiB", "segment_bytes": "256KiB", "fsync": False},
            "sampler": {"processes": 1, "concurrency": 4, "decode": "npy"},
            "status": {"interval": "200ms"},
            "source": [
                {"name": name, "url": url.as_uri(), "weight": weight}
                for (name, url), weight in zip(sources.items(), weights, strict=True)
            ],
        }
        path.write_text(toml_text(document))
        return path

    first = start_daemon(weighted(tmp_path / "a.toml", (0.7, 0.3)), cache_dir, tmp_path / "a.err")
    try:
        first.wait_status(lambda d: d["cache"]["samples"] == 2 * OBJECTS, timeout_s=60, what="both sources cached")
    finally:
        assert first.stop() == 0
    second = start_daemon(weighted(tmp_path / "b.toml", (0.2, 0.8)), cache_dir, tmp_path / "b.err")
    try:
        doc = second.wait_status(lambda d: d["state"] == "running", timeout_s=30, what="the restarted daemon")
        assert doc["cache"]["samples"] == 2 * OBJECTS, "the cached samples are kept"
    finally:
        assert second.stop() == 0
    (said,) = [line for line in second.stderr().splitlines() if "source weights changed" in line]
    assert "'cached' 70% -> 20%, 'fresh' 30% -> 80%" in said, said
    assert "source weights changed" not in first.stderr()
