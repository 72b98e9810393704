"""Eviction racing readers, and the directory's real size under continuous fill and eviction."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.cache_helpers import tree_bytes

MAX_BYTES = 6 << 20
SEGMENT_BYTES = 128 << 10


def start_writer(root: Path, sample_bytes: int) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.writer_proc",
            str(root),
            str(MAX_BYTES),
            str(SEGMENT_BYTES),
            str(sample_bytes),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


def stop(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()
    if process.stdout:
        process.stdout.close()


def test_eviction_racing_readers_never_serves_a_wrong_or_short_record(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    writer = start_writer(root, sample_bytes=200)
    try:
        time.sleep(0.5)  # let a few segments exist
        readers = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.support.reader_proc", str(root), f"reader{i}", "35000"],
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(3)
        ]
        results = []
        for reader in readers:
            out, _ = reader.communicate(timeout=240)
            results.append(dict(part.split("=") for part in out.split()))
    finally:
        stop(writer)
    reads = sum(int(r["reads"]) for r in results)
    print(
        f"\n{reads} record reads by 3 readers racing eviction: "
        f"{sum(int(r['wrong']) for r in results)} wrong, {sum(int(r['errors']) for r in results)} errors"
    )
    assert reads >= 100_000
    assert all(r["wrong"] == "0" and r["errors"] == "0" for r in results)


def test_real_directory_size_never_exceeds_the_budget(tmp_path: Path) -> None:
    """Sample the real allocated size every 50 ms while a writer fills and evicts and readers pin snapshots."""
    root = tmp_path / "cache"
    writer = start_writer(root, sample_bytes=3000)
    peak = 0
    samples = 0
    stop_sampling = threading.Event()

    def sample_size() -> None:
        nonlocal peak, samples
        while not stop_sampling.is_set():
            peak = max(peak, tree_bytes(root))
            samples += 1
            stop_sampling.wait(0.05)

    sampler = threading.Thread(target=sample_size)
    sampler.start()
    reader = subprocess.Popen(
        [sys.executable, "-m", "tests.support.reader_proc", str(root), "pinner", "20000"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        reader.communicate(timeout=240)
        time.sleep(1.0)
    finally:
        stop_sampling.set()
        sampler.join()
        stop(writer)
    print(f"\npeak real size {peak} bytes over {samples} samples; bound max_bytes = {MAX_BYTES}")
    assert samples >= 20
    assert peak <= MAX_BYTES
