"""Local faults for real: a tmpfs smaller than the budget, ENOSPC by bytes and by inodes, corruption behind the back.

The tmpfs mounts are real (``tests/support/tmpfs.py``; root only, skipped elsewhere, never faked). Ballast files
in a sibling directory of the cache eat the filesystem's bytes or inodes while the daemon writes, then go away.

Pass criteria: the daemon does not crash, publishes nothing partial (every published segment verifies, every
sample is its key's bytes), keeps the free-space floor when the filesystem is smaller than the budget, and
resumes ingesting once space or inodes come back; corrupted or truncated segments are detected on read (skipped
and counted by the trainer side), never served, and dropped by the next recovery where their trailer is broken.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cachefeed._cache.records import SegmentReader
from cachefeed._testing.daemon import BUCKET, DaemonProcess, start_daemon, wait_while_running, write_config
from cachefeed._testing.local_s3 import LocalS3
from cachefeed._trainer import EpochLoaderFactory
from tests.reliability.common import DiskWatch, check_cache, report, sample_problem, upload_sv, wait_until
from tests.support.tmpfs import small_tmpfs

pytestmark = pytest.mark.root

OBJECT_BYTES = 16 << 10


def daemon_on(
    tmp_path: Path, s3: LocalS3, cache_dir: Path, name: str, cache: dict[str, Any], **sampler: Any
) -> DaemonProcess:
    config = write_config(
        tmp_path / f"{name}.toml",
        endpoint=s3.endpoint,
        bucket=BUCKET,
        cache_dir=cache_dir,
        # free-running (evict_after_reads = 0): these faults strike while the cache fills and evicts, no trainer
        sections={"cache": {"evict_after_reads": 0, **cache}, "sampler": sampler, "remote": {"refresh_interval": "1s"}},
    )
    return start_daemon(config, cache_dir, tmp_path / f"{name}.stderr")


class Ballast:
    """A thread that keeps every free byte (``kind="bytes"``) or inode (``"inodes"``) of the filesystem taken:
    whatever the daemon frees, it grabs at once, until the block ends (then the ballast is removed)."""

    def __init__(self, directory: Path, kind: str) -> None:
        directory.mkdir(exist_ok=True)
        self.directory = directory
        self.kind = kind
        self.taken = 0
        self.enospc = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ballast", daemon=True)

    def _take(self, handle: Any) -> None:
        if self.kind == "bytes":
            for chunk in (256 << 10, 4 << 10):
                try:
                    self.taken += handle.write(b"\xa5" * chunk) or 0
                    return
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
        else:
            try:
                (self.directory / f"i{self.taken}").touch()
                self.taken += 1
                return
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        self.enospc += 1
        self._stop.wait(0.002)

    def _run(self) -> None:
        with (self.directory / "bytes").open("ab", buffering=0) as handle:
            while not self._stop.is_set():
                self._take(handle)

    def __enter__(self) -> Ballast:
        self._thread.start()
        wait_until(lambda: self.enospc > 0, timeout_s=30, what=f"no {self.kind} left")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        shutil.rmtree(self.directory)


def segments_published(proc: DaemonProcess) -> int:
    doc = proc.status()
    return int(doc["ingest"]["segments_total"]) if doc else -1


def test_a_tmpfs_smaller_than_the_budget_keeps_the_free_space_floor(tmp_path: Path, s3: LocalS3, bucket: Any) -> None:
    upload_sv(bucket, BUCKET, 250, OBJECT_BYTES)  # ~4 MiB of samples, more than the filesystem holds
    min_free = 512 << 10
    with small_tmpfs(3 << 20) as mount:
        cache_dir = mount / "cache"
        proc = daemon_on(
            tmp_path,
            s3,
            cache_dir,
            "small",
            {"max_bytes": "8MiB", "min_free_bytes": min_free, "segment_bytes": "128KiB"},
        )
        try:
            with DiskWatch(cache_dir, interval_s=0.02) as disk:
                proc.wait_status(lambda d: d["evicted"]["segments_total"] >= 3, timeout_s=90, what="evicting")
                time.sleep(2.0)
                doc = proc.wait_status(lambda d: True, timeout_s=5)
            assert proc.process.poll() is None, proc.stderr()[-3000:]
            assert proc.stop() == 0
        finally:
            if proc.process.poll() is None:
                proc.kill_group()
        found = check_cache(cache_dir)
        leftovers = os.listdir(cache_dir / "tmp")
        enospc = proc.stderr().count("No space left")
    report(
        "local-tmpfs-smaller-than-budget",
        tmpfs_bytes=3 << 20,
        max_bytes=8 << 20,
        min_free_bytes=min_free,
        lowest_free_bytes=disk.min_free_bytes,
        peak_bytes=disk.peak_bytes,
        evicted_segments=doc["evicted"]["segments_total"],
        enospc_logged=enospc,
        samples_verified=found.samples - len(found.problems),
        violations=len(found.problems) + len(leftovers),
    )
    assert disk.min_free_bytes is not None and disk.min_free_bytes >= min_free - (64 << 10)
    assert enospc == 0, "the floor keeps the daemon from ever meeting ENOSPC"
    assert not found.problems, found.problems[:5]
    assert found.samples > 0
    assert leftovers == []
    assert "Traceback" not in proc.stderr()


def enospc_while_writing(tmp_path: Path, s3: LocalS3, bucket: Any, kind: str) -> None:
    upload_sv(bucket, BUCKET, 120, OBJECT_BYTES)  # more than the cache: fill and eviction never stop
    hold_s = 3.0
    with small_tmpfs(16 << 20, nr_inodes=400) as mount:
        cache_dir, ballast = mount / "cache", mount / "ballast"
        proc = daemon_on(
            tmp_path,
            s3,
            cache_dir,
            "enospc",
            # 25% turnover: the smallest budget that holds two segments of epoch room (67%, the default, needs 3.8 MiB)
            {"max_bytes": "2MiB", "segment_bytes": "128KiB", "min_free_bytes": 0, "turnover": "25%"},
        )
        try:
            proc.wait_status(lambda d: d["evicted"]["segments_total"] >= 2, timeout_s=90, what="fill and eviction")
            before = segments_published(proc)
            with Ballast(ballast, kind) as taker:
                time.sleep(hold_s)
                alive = proc.process.poll() is None
            freed = time.monotonic()
            during = segments_published(proc) - before
            published = segments_published(proc)
            try:
                proc.wait_status(
                    lambda d: d["ingest"]["segments_total"] > published + 2,
                    timeout_s=10,
                    what=f"publishing again after ENOSPC ({kind})",
                )
                resumed_s: float | None = time.monotonic() - freed
            except TimeoutError:
                resumed_s = None
            doc = proc.status() or {}
            assert proc.stop() == 0
        finally:
            if proc.process.poll() is None:
                proc.kill_group()
        found = check_cache(cache_dir)
        leftovers = os.listdir(cache_dir / "tmp")
    stderr = proc.stderr()
    writer_deaths = stderr.count("segment writer failed")
    report(
        f"local-enospc-{kind}",
        ballast_taken=taker.taken,
        hold_s=hold_s,
        enospc_logged=stderr.count("No space left"),
        segments_published_while_full=during,
        resumed_after_s=resumed_s,
        writer_threads_died=writer_deaths,
        sampler_restarts=sum(s["restarts"] for s in doc.get("samplers", [])),
        samples_verified=found.samples - len(found.problems),
        violations=len(found.problems) + len(leftovers) + (not alive) + (resumed_s is None),
    )
    assert alive, stderr[-3000:]
    assert not found.problems, found.problems[:5]
    assert leftovers == []
    assert resumed_s is not None, (
        f"no segment published within 10s after the space came back ({writer_deaths} writer deaths)"
    )


def test_enospc_while_writing_segments(tmp_path: Path, s3: LocalS3, bucket: Any) -> None:
    enospc_while_writing(tmp_path, s3, bucket, "bytes")


def test_inode_exhaustion_while_writing_segments(tmp_path: Path, s3: LocalS3, bucket: Any) -> None:
    enospc_while_writing(tmp_path, s3, bucket, "inodes")


# ------------------------------------------------------------------------------------------------ corruption


def flip_byte(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


def read_through_factory(cache_dir: Path, epoch: int) -> tuple[int, int, int]:
    """(verified, wrong, skipped) for one epoch of the whole snapshot, in this process."""
    verified = wrong = 0
    with EpochLoaderFactory(
        cache_dir, batch_size=8, collate_fn=lambda batch: batch, run_id=f"corrupt{epoch}", progress=None, epochs=1
    ) as factory:
        for batch in factory.loader(0):
            for sample in batch:
                if sample_problem(sample) is None:
                    verified += 1
                else:
                    wrong += 1
        skipped = factory.stats(0).skipped_corrupt
    return verified, wrong, skipped


def test_corruption_behind_the_daemons_back_is_detected_never_served(tmp_path: Path, s3: LocalS3, bucket: Any) -> None:
    paths = upload_sv(bucket, BUCKET, 60, OBJECT_BYTES)
    cache_dir = tmp_path / "cache"
    cache = {"max_bytes": "32MiB", "segment_bytes": "64KiB"}
    proc = daemon_on(tmp_path, s3, cache_dir, "corrupt", cache)
    try:
        proc.wait_status(lambda d: d["ingest"]["objects_total"] >= len(paths), timeout_s=60, what="all cached")
        wait_while_running(
            proc, lambda: len(check_cache(cache_dir).keys) >= len(paths), timeout_s=30, what="all published"
        )
        segments = sorted((cache_dir / "segments").glob("*.seg"))
        assert len(segments) >= 4
        flipped, truncated, trailer = segments[0], segments[1], segments[2]
        counts = {}
        for path in (flipped, truncated, trailer):
            with SegmentReader(path) as reader:
                counts[path] = reader.count
                if path == flipped:
                    offset = int(reader.offsets[0]) + int(reader.lengths[0]) - 100  # inside record 0's payload
        flip_byte(flipped, offset)
        os.truncate(truncated, truncated.stat().st_size // 2)
        flip_byte(trailer, trailer.stat().st_size - 20)
        verified, wrong, skipped = read_through_factory(cache_dir, 0)
        expected_skipped = 1 + counts[truncated] + counts[trailer]
        assert proc.process.poll() is None
        proc.signal(signal.SIGTERM)
        assert proc.process.wait(timeout=30) == 0
    finally:
        if proc.process.poll() is None:
            proc.kill_group()
    again = daemon_on(tmp_path, s3, cache_dir, "corrupt-again", cache)
    try:
        again.wait_status(lambda d: d["state"] == "running", timeout_s=30, what="recovered")
        after = {p.name for p in (cache_dir / "segments").glob("*.seg")}
        verified2, wrong2, skipped2 = read_through_factory(cache_dir, 1)
        assert again.stop() == 0
    finally:
        if again.process.poll() is None:
            again.kill_group()
    report(
        "local-corruption-behind-the-back",
        faults_injected=3,
        samples_verified=verified + verified2,
        violations=wrong + wrong2,
        skipped_corrupt_first_read=skipped,
        records_in_damaged_segments=expected_skipped,
        dropped_at_recovery=sorted({truncated.name, trailer.name} - after),
        skipped_after_recovery=skipped2,
    )
    assert wrong == 0 and wrong2 == 0
    assert verified >= len(paths) - expected_skipped
    assert 1 <= skipped <= expected_skipped
    assert truncated.name not in after and trailer.name not in after  # recovery dropped the broken segments
    assert flipped.name in after  # its trailer is intact: recovery keeps it, readers skip the bad record
    assert skipped2 == 1
