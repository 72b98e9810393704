"""What a cache directory itself says, without a daemon: ``DirectorySummary``.

``cachefeed status`` shows it when there is no usable status document (no daemon ever ran here, or status.json is
unreadable): the segments and their samples, the snapshots and what they pin, the filesystem's free space. It only
lists and reads; it never writes into the cache and never takes a lock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from cachefeed._cache.layout import CacheLayout, allocated_bytes
from cachefeed._cache.records import segment_count
from cachefeed._cache.snapshots import live_snapshots, pinned_inodes

__all__ = ["DirectorySummary"]


@dataclass(frozen=True, slots=True)
class DirectorySummary:
    """The cache content read from disk, for a cache without a usable status document."""

    dir: str
    bytes: int
    samples: int
    segments: int
    invalid_segments: int
    pinned_bytes: int
    pinned_only_bytes: int
    free_bytes: int
    snapshots: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def scan(cls, layout: CacheLayout, *, now: float) -> DirectorySummary:
        total = samples = invalid = 0
        inodes = set()
        segments = layout.list_segments()
        for name, info in segments:
            total += allocated_bytes(info)
            inodes.add(info.st_ino)
            count = segment_count(layout.segments / name)
            if count < 0:
                invalid += 1
            else:
                samples += count
        pinned = pinned_inodes(layout)
        try:
            stats = os.statvfs(layout.root)
            free = stats.f_bavail * stats.f_frsize
        except OSError:
            free = 0
        snapshots = [
            {"id": s.snap_id, "samples": s.samples, "segments": s.segments, "owner": s.owner,
             "age_s": max(0.0, now - s.created), "idle_s": max(0.0, now - max(s.created, s.active_at))}
            for s in live_snapshots(layout)
        ]  # fmt: skip
        return cls(
            dir=str(layout.root),
            bytes=total,
            samples=samples,
            segments=len(segments),
            invalid_segments=invalid,
            pinned_bytes=sum(pinned.values()),
            pinned_only_bytes=sum(size for ino, size in pinned.items() if ino not in inodes),
            free_bytes=free,
            snapshots=snapshots,
        )

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}
