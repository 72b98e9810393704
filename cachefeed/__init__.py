"""cachefeed: a rolling local sample cache daemon for PyTorch training on object storage."""

from __future__ import annotations

from cachefeed.config import Config, load_config
from cachefeed.errors import (
    CachefeedError,
    CacheLockedError,
    ConfigError,
    CorruptRecordError,
    NoSuchCacheError,
    SnapshotError,
)

__all__ = [
    "CacheLockedError",
    "CachefeedError",
    "Config",
    "ConfigError",
    "CorruptRecordError",
    "NoSuchCacheError",
    "SnapshotError",
    "load_config",
]
__version__ = "0.1.0"
