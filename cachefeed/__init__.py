"""cachefeed: a rolling local sample cache daemon for PyTorch training on object storage.

The public API. The trainer-side names (which import torch) are loaded on first use, so that the daemon and the
``cachefeed status`` command start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cachefeed.config import Config, load_config
from cachefeed.errors import (
    CachefeedError,
    CacheLockedError,
    CacheUnusableError,
    ConfigError,
    CorruptRecordError,
    NoSuchCacheError,
    SnapshotError,
)

if TYPE_CHECKING:
    from cachefeed.cache.snapshots import Snapshot
    from cachefeed.codecs import msgpack_default
    from cachefeed.images import DecodeImages
    from cachefeed.trainer import DevicePrefetcher, EpochLoader, EpochLoaderFactory, EpochStats, SnapshotDataset

__all__ = [
    "CacheLockedError",
    "CacheUnusableError",
    "CachefeedError",
    "Config",
    "ConfigError",
    "CorruptRecordError",
    "DecodeImages",
    "DevicePrefetcher",
    "EpochLoader",
    "EpochLoaderFactory",
    "EpochStats",
    "NoSuchCacheError",
    "Snapshot",
    "SnapshotDataset",
    "SnapshotError",
    "load_config",
    "msgpack_default",
]
__version__ = "0.1.0"

_LAZY = {"DevicePrefetcher", "EpochLoader", "EpochLoaderFactory", "EpochStats", "SnapshotDataset"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("cachefeed.trainer"), name)
    if name == "Snapshot":  # an epoch pin, for loaders of your own (see cachefeed/cache/snapshots.py)
        return importlib.import_module("cachefeed.cache.snapshots").Snapshot
    if name == "DecodeImages":  # a transform that decodes image bytes in the DataLoader workers (Pillow)
        return importlib.import_module("cachefeed.images").DecodeImages
    if name == "msgpack_default":  # the writer's side of the msgpack array encoding the daemon decodes
        return importlib.import_module("cachefeed.codecs").msgpack_default
    raise AttributeError(f"module 'cachefeed' has no attribute {name!r}")
