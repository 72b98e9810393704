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
    "CacheConfig",
]

DEFAULT_SEGMENT_BYTES = 64 << 20
DEFAULT_TURNOVER_PERCENT = 50  # cache.turnover's default: room kept for fresh samples while epochs pin the rest
METADATA_RESERVE_BYTES = 1 << 20  # lock, tag, status.json, snapshot dirs: part of max_bytes (see store.py)
MIN_SEGMENTS_IN_BUDGET = 4


@dataclass(frozen=True, slots=True)
class CacheConfig:
    dir: Path
    max_bytes: int
    min_free_bytes: int = 1 << 30
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    eviction: str = "fifo"
    evict_after_reads: int = 1
    snapshot_grace_s: float = 300.0
    turnover_bytes: int = -1  # -1: DEFAULT_TURNOVER_PERCENT of max_bytes, as in a config file
    compression: str = "none"
    fsync: bool = True
    file_mode: int = 0o640
    dir_mode: int = 0o750

    def __post_init__(self) -> None:
        if self.turnover_bytes < 0:  # the one default, whether the config comes from TOML or from code
            object.__setattr__(self, "turnover_bytes", self.max_bytes * DEFAULT_TURNOVER_PERCENT // 100)
