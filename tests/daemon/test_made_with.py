"""A daemon restarted over its cache with settings that change what a sample is (another remote, pattern, decoder,
image size, label, preprocess or node share): the cache kept the old samples, unread, so the least-read-first
order served them first, without a word (a trainer met a tensor of the old shape, or trained on the old data). Now
the old source's samples are evicted at start, with one warning naming what changed; an unchanged restart keeps
everything. The witness is what the training loop receives."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from cachefeed._cache.room import epoch_room, read_room
from cachefeed._config import toml_text
from cachefeed._testing.daemon import DaemonProcess, start_daemon, wait_for
from cachefeed._testing.samples import npy_bytes
from cachefeed._trainer import EpochLoaderFactory

OBJECTS = 20


def write_remote(directory: Path, value: int) -> None:
    directory.mkdir()
    for i in range(OBJECTS):
        (directory / f"{value}-{i:03d}.npy").write_bytes(npy_bytes(np.full(64, value, np.int32)))


def start(tmp_path: Path, name: str, remote: Path) -> DaemonProcess:
    """A daemon over ``remote`` on ``tmp_path/cache``, its config and log named ``name``."""
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
    return start_daemon(config, cache_dir, tmp_path / f"{name}.err")


def run_daemon(tmp_path: Path, name: str, remote: Path, expected_samples: int) -> str:
    """Run a daemon over ``remote`` until its cache holds ``expected_samples`` (none: until it listed the remote,
    which is empty); stop it; return its log."""
    daemon = start(tmp_path, name, remote)
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


# -- the cache's own records found damaged (a disk error, a stray write) -------------------------------------------
# They were ignored without a word.
#
# * ``made_with.json`` (the settings the cached samples were made with, ``_cache/sources.py``): a damaged one read as
#   "nothing recorded", so a settings change made meanwhile evicted nothing and trainers were served samples of the
#   old settings. Now a damaged record means the settings are unknown: the cached samples are evicted, with a warning
#   naming the file, and the record is written again.
# * ``budget.json`` (the epoch room trainers pin, ``_cache/room.py``): a trainer that cannot read it pins every
#   segment. The daemon wrote it again at start without a word, and never again while it ran. Now a damaged one is
#   named in a warning, at start and at the daemon's next sweep, and written again from the config.
#
# Witnesses: what the training loop receives, and the files themselves.

GARBAGE = b"\x8b\x00{not json"


def test_a_damaged_made_with_record_evicts_what_it_described_and_a_change_made_meanwhile_is_kept_to(
    tmp_path: Path,
) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    write_remote(old, 1)
    write_remote(new, 2)
    run_daemon(tmp_path, "first", old, OBJECTS)
    record = tmp_path / "cache" / "made_with.json"
    record.write_bytes(GARBAGE)
    log = run_daemon(tmp_path, "moved", new, OBJECTS)  # the remote changed while the record was damaged
    assert (
        f"{record} is damaged (not the record the daemon writes): the settings the cache's samples were made with "
        "are unknown, so its " in log
    ), log[-3000:]
    assert sorted(values_served(tmp_path / "cache")) == [2] * OBJECTS, "only the new remote's samples, each once"
    settings = json.loads(record.read_text())["sources"]
    assert [entry["url"] for entry in settings.values()] == [new.as_uri()], "the record is written again"


def test_a_damaged_budget_file_is_named_and_written_again_at_start_and_while_the_daemon_runs(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    write_remote(remote, 1)
    run_daemon(tmp_path, "first", remote, OBJECTS)
    budget = tmp_path / "cache" / "budget.json"
    room = read_room(tmp_path / "cache")
    assert room is not None and room == epoch_room(64 << 20, json.loads(budget.read_text())["turnover_bytes"])
    budget.write_bytes(GARBAGE)
    daemon = start(tmp_path, "again", remote)
    try:
        daemon.wait_status(lambda d: d["state"] == "running", timeout_s=60, what="the daemon running")
        assert read_room(tmp_path / "cache") == room, "written again at start"
        assert f"{budget} is damaged: trainers would pin every cached segment" in daemon.stderr()
        budget.write_bytes(GARBAGE)  # while it runs
        wait_for(lambda: read_room(tmp_path / "cache") == room, timeout_s=10, what="budget.json written again")
        time.sleep(0.5)
        served = values_served(tmp_path / "cache")
    finally:
        daemon.stop()
    assert daemon.stderr().count(f"{budget} is damaged") == 2, daemon.stderr()[-3000:]
    assert sorted(served) == [1] * OBJECTS
