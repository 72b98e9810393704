"""The trainer side: per-epoch DataLoaders over pinned snapshots of the node's cache, and a device prefetcher."""

from __future__ import annotations

from cachefeed._trainer.dataset import SnapshotDataset
from cachefeed._trainer.device import DevicePrefetcher
from cachefeed._trainer.epoch import EpochLoader, EpochStats
from cachefeed._trainer.loader import EpochLoaderFactory

__all__ = ["DevicePrefetcher", "EpochLoader", "EpochLoaderFactory", "EpochStats", "SnapshotDataset"]
