"""Ingest serves a cold trainer first: a filling cache publishes small segments first, growing to segment_bytes.

Judged from outside a real daemon: the segment files as they appear in ``segments/`` and the GETs the S3 proxy
forwarded by then. The remote is capped (``remote.max_bytes_per_s``) so that bytes, not CPU load, set the pace.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from cachefeed._cache.writer import FIRST_SEGMENT_BYTES, SegmentRamp
from cachefeed._testing.daemon import BUCKET, StartDaemon
from cachefeed._testing.proxy import FaultProxy
from cachefeed._testing.samples import upload_arrays

SEGMENT_BYTES = 1 << 20
OBJECT_BYTES = 64 << 10
RECORD_SLACK = OBJECT_BYTES + (8 << 10)  # a segment is cut at the first record that does not fit


def _watch_segments(
    proc: Any, proxy: FaultProxy, *, until: int, timeout_s: float
) -> tuple[list[tuple[str, int, int, float]], float]:
    """Poll ``segments/`` until it holds ``until`` samples' worth of files: ``[(name, size, GETs seen, time)]`` in
    the order they appeared, and the time of the first GET."""
    seen: dict[str, tuple[str, int, int, float]] = {}
    first_get = 0.0
    deadline = time.monotonic() + timeout_s
    segments = Path(proc.cache_dir) / "segments"
    while time.monotonic() < deadline:
        gets = proxy.counts().method("GET")
        now = time.monotonic()
        if gets and not first_get:
            first_get = now
        names = list(segments.iterdir()) if segments.is_dir() else []
        for path in names:
            if path.name not in seen:
                seen[path.name] = (path.name, path.stat().st_size, gets, now)
        if proc.process.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.process.returncode}:\n{proc.stderr()[-3000:]}")
        status = proc.status()
        if status is not None and status["cache"]["samples"] >= until:
            return sorted(seen.values(), key=lambda s: s[3]), first_get
        time.sleep(0.01)
    raise TimeoutError(f"{until} samples not cached in {timeout_s}s; segments seen: {sorted(seen.values())}")


def test_a_cold_cache_publishes_a_small_segment_first_then_grows_to_segment_bytes(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    upload_arrays(bucket, BUCKET, 100, OBJECT_BYTES)  # 6.25 MiB: about 6 s at the capped rate
    proc = daemon(
        endpoint=fault_proxy.endpoint,
        # Two requests in flight per sampler: the GETs the proxy has seen are then the objects fetched plus at most
        # four, so they tell a ramp from a full first segment on a loaded machine too.
        sections={
            "cache": {"segment_bytes": SEGMENT_BYTES},
            "remote": {"max_bytes_per_s": "1MiB"},
            "sampler": {"concurrency": 2},
        },
    )
    fault_proxy.reset_counts()
    segments, first_get = _watch_segments(proc, fault_proxy, until=100, timeout_s=60)
    _name, size, gets, at = segments[0]
    print(f"first segment: {size} bytes after {gets} GETs, {at - first_get:.2f}s after the first GET")
    assert size <= FIRST_SEGMENT_BYTES + RECORD_SLACK
    # The ramp publishes after 4 objects per sampler (the 4th does not fit 256 KiB): about 8 fetched, 12 GETs seen.
    # Without it one sampler fills 1 MiB (16 objects) first while the other fetches as many: about 32 fetched.
    assert gets <= 20, f"the first segment waited for {gets} objects"
    sizes = [s[1] for s in segments]
    assert max(sizes) >= SEGMENT_BYTES - RECORD_SLACK, f"segments never reached segment_bytes: {sizes}"
    assert max(sizes) <= SEGMENT_BYTES
    assert proc.stop() == 0


def test_a_restarted_daemon_with_a_filled_cache_writes_full_size_segments(bucket: Any, daemon: StartDaemon) -> None:
    upload_arrays(bucket, BUCKET, 60, OBJECT_BYTES)
    sections = {"cache": {"segment_bytes": SEGMENT_BYTES}, "remote": {"refresh_interval": "500ms"}}
    first = daemon(sections=sections)
    first.wait_status(lambda d: d["cache"]["samples"] >= 60, timeout_s=60, what="the first 60 samples cached")
    assert first.stop() == 0
    before = {p.name for p in (first.cache_dir / "segments").iterdir()}

    upload_arrays(bucket, BUCKET, 60, OBJECT_BYTES, start=60)  # 3.75 MiB more: enough for full segments
    second = daemon(sections=sections)
    second.wait_status(lambda d: d["cache"]["samples"] >= 120, timeout_s=60, what="the new samples cached")
    assert second.stop() == 0
    # In publication order (segment names are sequence numbers).
    new = [p.stat().st_size for p in sorted((second.cache_dir / "segments").iterdir()) if p.name not in before]
    assert new, "the second daemon published nothing"
    # A ramp starts each of the 2 samplers at FIRST_SEGMENT_BYTES, then twice that: the first segment published is
    # that small and so are at least three more. Each sampler's tail of the pass may be small too, and so may a
    # segment an idle flush cut on a loaded machine, but not from the first segment on.
    ramp_sized = [size for size in new if size <= 2 * FIRST_SEGMENT_BYTES + RECORD_SLACK]
    ramped = new[0] <= FIRST_SEGMENT_BYTES + RECORD_SLACK and len(ramp_sized) > 2
    assert not ramped, f"a restarted daemon ramped again: {new}"
    assert max(new) >= SEGMENT_BYTES - RECORD_SLACK, f"no full-size segment: {new}"


def test_the_ramp_doubles_from_its_first_size_to_segment_bytes() -> None:
    ramp = SegmentRamp(64 << 20, published_bytes=0, writers=2)
    assert ramp.target() == FIRST_SEGMENT_BYTES
    sizes = []
    while ramp.target() < 64 << 20:
        sizes.append(ramp.target())
        ramp.published(ramp.target())
    assert sizes[:3] == [256 << 10, 512 << 10, 1536 << 10]  # two writers: each counts the other's share
    assert len(sizes) <= 8
    assert SegmentRamp(64 << 20, published_bytes=64 << 20).target() == 64 << 20  # a filled cache: full size
    assert SegmentRamp(128 << 10).target() == 128 << 10  # never above segment_bytes
    assert SegmentRamp(1 << 30).first == 4 << 20  # large segments start at 1/256 of their size
