"""Epochs of a few batches each, back to back: one trainer with the default factory, no ``samples_per_epoch``, a
cache of 30% of the remote. Each epoch reads the little its epoch room holds (11 samples here).

An epoch's reads reach the daemon when the epoch is released, on the factory's teardown thread, which waited for
each handover before a release: with epochs shorter than that, hundreds of retired epochs piled up unreleased. The
daemon, hundreds of epochs behind, counted the cached samples as unread and fetched nothing (the pass never ended),
and the piled-up snapshots' metadata pushed the cache directory past ``max_bytes`` (a one-off audit: 96 of 300
objects received in 20 s and 1,000 epochs, the directory 3.2 MB against 2.96 MB). Witnesses: the keys the loop
received, and the directory's allocated bytes while it ran.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cachefeed._testing.daemon import start_daemon
from cachefeed._trainer import EpochLoaderFactory
from tests.support.cache_helpers import PeakSize
from tests.support.file_remote import file_daemon_config, npy_remote

OBJECTS = 300


@pytest.mark.parametrize("workers", [1, 2])
def test_epochs_of_a_few_batches_back_to_back_read_the_whole_remote_within_the_budget(
    tmp_path: Path, workers: int
) -> None:
    remote = npy_remote(tmp_path / "remote", OBJECTS, values=8192)  # 32 KiB objects
    budget = int(0.3 * sum(path.stat().st_size for path in remote.iterdir()))
    config = file_daemon_config(
        tmp_path / "daemon.toml",
        remote,
        tmp_path / "cache",
        {"cache": {"max_bytes": budget, "segment_bytes": "64KiB"}},
    )
    daemon = start_daemon(config, tmp_path / "cache", tmp_path / "daemon.err")
    seen: set[int] = set()
    epochs = 0
    try:
        with (
            PeakSize(tmp_path / "cache") as size,
            EpochLoaderFactory(daemon.cache_dir, batch_size=8, num_workers=workers, progress=None) as factory,
        ):
            deadline = time.monotonic() + 60
            while len(seen) < OBJECTS and time.monotonic() < deadline:
                for batch in factory.loader(epochs):
                    seen.update(int(row[0]) for row in batch["data"])
                epochs += 1
    finally:
        daemon.stop()
    assert len(seen) == OBJECTS, f"{len(seen)} of the {OBJECTS} objects received in {epochs} epochs"
    assert size.peak <= budget, f"the cache directory reached {size.peak} bytes against max_bytes = {budget}"
