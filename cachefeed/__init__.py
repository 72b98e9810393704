"""cachefeed: a rolling local sample cache daemon for PyTorch training on object storage.

The public API. The trainer-side names (which import torch) are loaded on first use, so that the daemon and the
``cachefeed status`` command start without importing torch; so are ``Config`` and ``load_config`` (numpy, through
the record format), so that ``import cachefeed`` is only the error classes and the daemon's heavy imports all run
inside its start (NOTE [ A daemon's start without the cyclic GC ] in ``_cli/daemon.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cachefeed._errors import (
    CachefeedError,
    CacheLockedError,
    CacheUnusableError,
    ConfigError,
    CorruptRecordError,
    NoSuchCacheError,
    SnapshotError,
)

if TYPE_CHECKING:
    from cachefeed._cache.snapshots import Snapshot
    from cachefeed._codecs import msgpack_default
    from cachefeed._config import Config, load_config
    from cachefeed._images import DecodeImages
    from cachefeed._trainer import DevicePrefetcher, EpochLoader, EpochLoaderFactory, EpochStats, SnapshotDataset

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
    if name in ("Config", "load_config"):
        return getattr(importlib.import_module("cachefeed._config"), name)
    if name in _LAZY:
        return getattr(importlib.import_module("cachefeed._trainer"), name)
    if name == "Snapshot":  # an epoch pin, for loaders of your own (see cachefeed/_cache/snapshots.py)
        return importlib.import_module("cachefeed._cache.snapshots").Snapshot
    if name == "DecodeImages":  # a transform that decodes image bytes in the DataLoader workers (Pillow)
        return importlib.import_module("cachefeed._images").DecodeImages
    if name == "msgpack_default":  # the writer's side of the msgpack array encoding the daemon decodes
        return importlib.import_module("cachefeed._codecs").msgpack_default
    raise AttributeError(f"module 'cachefeed' has no attribute {name!r}")
