"""The trainer side: per-epoch DataLoaders over pinned snapshots of the node's cache, and a device prefetcher."""

from __future__ import annotations

from cachefeed.trainer.dataset import SnapshotDataset
from cachefeed.trainer.device import DevicePrefetcher
from cachefeed.trainer.epoch import EpochLoader, EpochStats
from cachefeed.trainer.loader import EpochLoaderFactory

__all__ = ["DevicePrefetcher", "EpochLoader", "EpochLoaderFactory", "EpochStats", "SnapshotDataset"]
