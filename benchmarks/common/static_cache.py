"""Static caches for the benchmarks: samples written straight into a cache directory, no daemon, no remote."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.settings import CacheConfig
from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter

__all__ = ["write_static_cache"]


def write_static_cache(
    root: Path, samples: Iterable[dict[str, Any]], *, segment_bytes: int = 16 << 20, max_bytes: int = 8 << 30
) -> int:
    """Write ``samples`` into a new cache at ``root`` (no turnover room: nothing arrives later) and close it.
    Returns the bytes its segment files take."""
    config = CacheConfig(
        dir=root,
        max_bytes=max_bytes,
        min_free_bytes=0,
        segment_bytes=segment_bytes,
        fsync=False,
        turnover_bytes=0,
    )
    store = CacheStore(config)
    with CacheWriter(store, segment_bytes=segment_bytes, fsync=False) as writer:
        for sample in samples:
            writer.add(sample)
    store.close()
    layout = CacheLayout(root)
    return sum((layout.segments / name).stat().st_size for name, _info in layout.list_segments())
