"""``cache.dir`` must be a directory of the daemon's own: any file it did not write is refused, whatever its size.

The audit pointed ``cache.dir`` at a small dataset's root (a few hundred bytes of ``.npy`` files and a CSV, under
the 1 MiB of foreign files then allowed): the daemon took it, wrote its cache among the user's files, and a trainer
given that directory with no daemon waited its whole ``wait_timeout_s`` for a cache to appear. Now the daemon exits
73 with one line naming the path and a file that is not its own, and writes nothing there; a trainer given the
directory fails at once, saying it is not a cache and cannot become one. An empty directory is still taken.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from cachefeed import EpochLoaderFactory, NoSuchCacheError
from cachefeed._config import toml_text
from cachefeed._testing.daemon import daemon_argv, start_daemon
from cachefeed._testing.samples import npy_bytes

WAIT_TIMEOUT_S = 30.0


def small_dataset(root: Path) -> Path:
    """A dataset's root whose files are a few hundred bytes in all: four ``.npy`` samples and their labels."""
    root.mkdir()
    for index in range(4):
        (root / f"{index:03d}.npy").write_bytes(npy_bytes(np.full(8, index, dtype=np.float32)))
    (root / "labels.csv").write_text("file,label\n000.npy,cat\n")
    return root


def config_for(tmp_path: Path, remote: Path, cache_dir: Path) -> Path:
    config = tmp_path / "cachefeed.toml"
    document = {
        "remote": {"url": remote.as_uri()},
        "cache": {"dir": str(cache_dir), "max_bytes": "64MiB", "segment_bytes": "1MiB", "min_free_bytes": 0},
        "status": {"interval": "100ms"},
    }
    config.write_text(toml_text(document))
    return config


def test_a_small_dataset_root_as_cache_dir_is_refused_with_exit_73_and_left_untouched(tmp_path: Path) -> None:
    dataset = small_dataset(tmp_path / "dataset")
    before = {path.name: path.read_bytes() for path in dataset.iterdir()}
    assert sum(len(data) for data in before.values()) < 1024
    config = config_for(tmp_path, dataset, dataset)  # the dataset's root as the remote and as the cache
    result = subprocess.run(daemon_argv(config), capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 73, result.stderr
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]  # after the log's "starting" line
    assert f"cache.dir {dataset}: holds files that are not a cachefeed cache (000.npy, 001.npy, 002.npy" in line
    assert "choose an empty or new cache.dir" in line, line
    assert {path.name: path.read_bytes() for path in dataset.iterdir()} == before, "nothing written among them"


def test_a_trainer_given_a_dataset_root_fails_at_once_instead_of_waiting_for_a_cache(tmp_path: Path) -> None:
    dataset = small_dataset(tmp_path / "dataset")
    started = time.monotonic()
    with pytest.raises(NoSuchCacheError) as raised:
        EpochLoaderFactory(dataset, batch_size=2, wait_timeout_s=WAIT_TIMEOUT_S, progress=None)
    waited = time.monotonic() - started
    assert waited < WAIT_TIMEOUT_S / 3, f"waited {waited:.1f}s for a cache that no daemon will make there"
    message = str(raised.value)
    assert f"{dataset} is not a cachefeed cache and cannot become one" in message, message
    assert "holds files that are not a cachefeed cache (000.npy, " in message, message


def test_an_empty_directory_becomes_the_cache(tmp_path: Path) -> None:
    remote = small_dataset(tmp_path / "dataset")
    cache_dir = tmp_path / "empty"
    cache_dir.mkdir()
    daemon = start_daemon(config_for(tmp_path, remote, cache_dir), cache_dir, tmp_path / "daemon.stderr")
    try:
        daemon.wait_status(lambda d: d["ingest"]["samples_total"] >= 4, timeout_s=30, what="the dataset cached")
        assert (cache_dir / "CACHEDIR.TAG").is_file()
    finally:
        assert daemon.stop() == 0, daemon.stderr()[-4000:]
