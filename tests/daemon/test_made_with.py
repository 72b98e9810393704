"""A daemon restarted over its cache with settings that change what a sample is (another remote, pattern, decoder,
image size, label, preprocess or node share): the cache kept the old samples, unread, so the least-read-first
order served them first, without a word (a trainer met a tensor of the old shape, or trained on the old data). Now
the old source's samples are evicted at start, with one warning naming what changed; an unchanged restart keeps
everything. The witness is what the training loop receives."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from cachefeed._config import toml_text
from cachefeed._testing.daemon import start_daemon
from cachefeed._trainer import EpochLoaderFactory

OBJECTS = 20


def write_remote(directory: Path, value: int) -> None:
    directory.mkdir()
    for i in range(OBJECTS):
        buffer = io.BytesIO()
        np.save(buffer, np.full(64, value, np.int32))
        (directory / f"{value}-{i:03d}.npy").write_bytes(buffer.getvalue())


def run_daemon(tmp_path: Path, name: str, remote: Path, expected_samples: int) -> str:
    """Run a daemon over ``remote`` until its cache holds ``expected_samples`` (none: until it listed the remote,
    which is empty); stop it; return its log."""
    cache_dir = tmp_path / "cache"
    config = tmp_path / f"{name}.toml"
    config.write_text(
        toml_text(
            {
                "remote": {"url": remote.as_uri(), "refresh_interval": "1h"},
                "cache": {"dir": str(cache_dir), "max_bytes": "64MiB", "segment_bytes": "64KiB", "fsync": False},
                "sampler": {"processes": 1, "concurrency": 4, "decode": "npy"},
                "status": {"interval": "200ms"},
            }
        )
    )
    daemon = start_daemon(config, cache_dir, tmp_path / f"{name}.err")
    try:
        daemon.wait_status(
            lambda d: (
                d["cache"]["samples"] == expected_samples
                and (d["state"] == "running" or (expected_samples == 0 and bool(d["remote"]["last_listed_at"])))
            ),
            timeout_s=60,
            what=f"{expected_samples} samples cached",
        )
    finally:
        daemon.stop()
    return daemon.stderr()


def values_served(cache_dir: Path) -> list[int]:
    with EpochLoaderFactory(cache_dir, batch_size=1, run_id="made-with", progress=None) as factory:
        return [int(batch["data"][0][0]) for batch in factory.loader(0)]


def test_a_cache_kept_across_a_change_of_remote_serves_only_the_new_remotes_samples(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    write_remote(old, 1)
    write_remote(new, 2)
    run_daemon(tmp_path, "first", old, OBJECTS)
    log = run_daemon(tmp_path, "again", old, OBJECTS)
    assert "made with other settings" not in log, "an unchanged restart keeps its samples"
    log = run_daemon(tmp_path, "moved", new, OBJECTS)
    assert (
        f"the cache's samples were made with other settings (url = {old.as_uri()!r} -> {new.as_uri()!r}): "
        "evicted those " in log
    ), log[-2000:]
    served = values_served(tmp_path / "cache")
    assert sorted(served) == [2] * OBJECTS, "only the new remote's samples, each once"


def test_a_change_over_a_cache_that_holds_nothing_evicts_nothing_and_says_so_quietly(tmp_path: Path) -> None:
    """A first start, then a config edit before anything was cached: the log warned that it "evicted those 0
    cached segments". Now the change is an info line saying nothing was cached under the old settings."""
    empty, full = tmp_path / "empty", tmp_path / "full"
    empty.mkdir()
    write_remote(full, 7)
    first = run_daemon(tmp_path, "first", empty, 0)
    assert "made with other settings" not in first, "a new cache has nothing to compare"
    second = run_daemon(tmp_path, "second", full, OBJECTS)
    assert "made with other settings" not in second, second
    assert "changed (url = " in second and "nothing was cached under the old ones" in second, second
