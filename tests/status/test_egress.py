"""What status says was downloaded per sample read, against what was downloaded (the remote's files) and what the
training loop received, across a daemon restart: the bytes are the running daemon's downloads, so the reads they are
divided by are the reads since it started (the ledger keeps earlier runs' reads of the cached samples)."""

from __future__ import annotations

from pathlib import Path

from cachefeed._testing.daemon import DaemonProcess, start_daemon
from cachefeed._trainer import EpochLoaderFactory
from tests.support.file_remote import file_daemon_config, npy_remote

FIRST, LATER, VALUES = 40, 10, 4096


def start(tmp_path: Path, remote: Path, name: str) -> DaemonProcess:
    config = file_daemon_config(
        tmp_path / "daemon.toml",
        remote,
        tmp_path / "cache",
        {"remote": {"refresh_interval": "1s"}, "cache": {"segment_bytes": "64KiB"}},
    )
    return start_daemon(config, tmp_path / "cache", tmp_path / f"{name}.err")


def read_epochs(cache: Path, epochs: int) -> int:
    """Samples the loop received over ``epochs`` epochs (the factory closed: their reads handed to the daemon)."""
    received = 0
    with EpochLoaderFactory(cache, batch_size=10, progress=None, epochs=epochs, min_samples="100%") as factory:
        for epoch in range(epochs):
            received += sum(len(batch["__key__"]) for batch in factory.loader(epoch))
    return received


def test_bytes_downloaded_per_sample_read_counts_the_reads_since_the_daemon_started(tmp_path: Path) -> None:
    remote = npy_remote(tmp_path / "remote", FIRST, values=VALUES)
    daemon = start(tmp_path, remote, "first")
    daemon.wait_status(lambda d: d["cache"]["samples"] == FIRST, timeout_s=60, what="the remote cached")
    before = read_epochs(daemon.cache_dir, 3)
    daemon.wait_status(lambda d: d["cache"]["sample_reads_total"] == before, timeout_s=30, what="the reads counted")
    assert daemon.stop() == 0
    daemon = start(tmp_path, remote, "second")
    try:
        npy_remote(remote, LATER, values=VALUES, start=FIRST)  # what the restarted daemon downloads
        downloaded = sum(path.stat().st_size for path in remote.iterdir() if int(path.stem) >= FIRST)
        daemon.wait_status(lambda d: d["cache"]["samples"] == FIRST + LATER, timeout_s=60, what="the new cached")
        received = read_epochs(daemon.cache_dir, 2)
        assert received == 2 * (FIRST + LATER)
        document = daemon.wait_status(
            lambda d: (
                d["cache"]["sample_reads_total"] >= before + received and d["remote"]["bytes_total"] >= downloaded
            ),
            timeout_s=30,
            what="the new reads and the samplers' downloads counted",
        )
        assert document["remote"]["bytes_total"] == downloaded  # the files of the objects it fetched
        per_read = document["remote"]["bytes_per_sample_read"]
        assert per_read == downloaded / received, f"{per_read} B per sample read, {downloaded} B for {received} reads"
    finally:
        assert daemon.stop() == 0
