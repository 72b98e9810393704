"""What one cache directory is configured with: ``CacheConfig`` and the budget numbers it implies.

The ``[cache]`` table of a config file parses into a ``CacheConfig`` (``cachefeed/_config/``, whose ``SCHEMA`` names
each key and its unit); a test or a benchmark that builds a ``CacheStore`` without a config file builds one here.
The budget the store keeps (``store.py``'s docstring) is ``max_bytes - METADATA_RESERVE_BYTES``; the config's
cross-field checks hold it to at least ``MIN_SEGMENTS_IN_BUDGET`` segments.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_TURNOVER_PERCENT",
    "METADATA_RESERVE_BYTES",
    "MIN_SEGMENTS_IN_BUDGET",
    "SMALL_CACHE_TURNOVER_PERCENT",
    "CacheConfig",
    "default_turnover",
]

DEFAULT_SEGMENT_BYTES = 64 << 20
DEFAULT_TURNOVER_PERCENT = 67  # cache.turnover's default: room kept for fresh samples (why 67: ``room.py``)
SMALL_CACHE_TURNOVER_PERCENT = 50  # the least the default becomes in a cache too small for 67%: ``default_turnover``
METADATA_RESERVE_BYTES = 1 << 20  # lock, tag, status.json, snapshot dirs: part of max_bytes (see store.py)
MIN_SEGMENTS_IN_BUDGET = 4
DEFAULT_SNAPSHOT_GRACE_S = 300.0  # cache.snapshot_grace's default; also what trainers keep on a static cache


@dataclass(frozen=True, slots=True)
class CacheConfig:
    dir: Path
    max_bytes: int
    min_free_bytes: int = 1 << 30
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    eviction: str = "fifo"
    evict_after_reads: int = 1
    snapshot_grace_s: float = DEFAULT_SNAPSHOT_GRACE_S
    turnover_bytes: int = -1  # -1: DEFAULT_TURNOVER_PERCENT of max_bytes, as in a config file
    compression: str = "none"
    fsync: bool = True
    file_mode: int = 0o640
    dir_mode: int = 0o750

    def __post_init__(self) -> None:
        if self.turnover_bytes < 0:  # the one default, whether the config comes from TOML or from code
            object.__setattr__(self, "turnover_bytes", default_turnover(self.max_bytes, self.segment_bytes))


def default_turnover(max_bytes: int, segment_bytes: int) -> int:
    """``cache.turnover``'s default in bytes: ``DEFAULT_TURNOVER_PERCENT`` of ``max_bytes`` (why: ``room.py``).

    In a small cache (under about 13 MiB, where the 1 MiB metadata reserve is a large part) 67% would leave the epoch
    room (``max_bytes - turnover - reserve``) almost nothing: the default is then the turnover that leaves the room a
    quarter of ``max_bytes`` and at least two segments, but never less than ``SMALL_CACHE_TURNOVER_PERCENT`` (the
    default before). So a budget the earlier default accepted is still accepted, with at least the turnover it had.
    """
    high = max_bytes * DEFAULT_TURNOVER_PERCENT // 100
    low = max_bytes * SMALL_CACHE_TURNOVER_PERCENT // 100
    return max(low, min(high, max_bytes - METADATA_RESERVE_BYTES - max(2 * segment_bytes, max_bytes // 4)))
