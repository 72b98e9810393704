"""The baselines: what a user gets without a streaming library, and the DataLoader's own ceiling.

- ``LocalFilesAdapter``: a map-style ``Dataset`` over one local file per sample (the reference layout).
- ``S3fsAdapter``: a map-style ``Dataset`` that GETs each sample from S3 through s3fs (one GET per sample per
  epoch, nothing cached): "a DataLoader over s3fs".
- ``MemoryAdapter``: a map-style ``Dataset`` over samples already in memory (built before the workers start):
  the ceiling of the DataLoader itself with the same batch size, workers, start method and collate.

All use ``torch.utils.data.DataLoader`` with a seeded shuffling generator and ``samples.collate``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.common.adapter import DataLocation, EpochSource, LoaderSettings
from benchmarks.common.loaders import DataLoaderSource
from benchmarks.common.machine import versions
from benchmarks.common.samples import Workload, collate, make_sample, sample_name, sample_path


class LocalFilesDataset(Dataset[np.ndarray]):
    def __init__(self, samples_dir: Path, count: int) -> None:
        self.samples_dir = samples_dir
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> np.ndarray:
        with sample_path(self.samples_dir, index).open("rb", buffering=0) as handle:
            return np.frombuffer(handle.read(), dtype=np.uint8)


class S3fsDataset(Dataset[np.ndarray]):
    """One ``cat_file`` per sample. The filesystem is created lazily in each process (s3fs is not fork-safe)."""

    def __init__(self, url: str, count: int, storage_options: dict[str, Any]) -> None:
        self.url = url.removeprefix("s3://").rstrip("/")
        self.count = count
        self.storage_options = storage_options
        self._fs: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> np.ndarray:
        if self._pid != os.getpid():
            import s3fs

            self._fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
            self._pid = os.getpid()
        data = self._fs.cat_file(f"{self.url}/{sample_name(index)}")
        return np.frombuffer(data, dtype=np.uint8)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"], state["_pid"] = None, -1
        return state


class MemoryDataset(Dataset[np.ndarray]):
    def __init__(self, samples: np.ndarray) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> np.ndarray:
        sample: np.ndarray = self.samples[index]
        return sample


def _loader(dataset: Dataset[Any], settings: LoaderSettings) -> DataLoader[Any]:
    generator = torch.Generator()
    generator.manual_seed(settings.seed)
    return DataLoader(
        dataset,
        shuffle=settings.shuffle,
        generator=generator,
        collate_fn=collate,
        **settings.dataloader_kwargs(),
    )


class LocalFilesAdapter:
    name = "local-files"
    supports_local = True
    supports_remote = False
    uses_sample_objects = True

    def describe(self) -> dict[str, Any]:
        return {"system": "map-style Dataset over one local file per sample", "torch": versions(("torch",))}

    def convert(self, workload: Workload, samples_dir: Path, out_dir: Path) -> dict[str, Any]:
        return {}

    def open(self, workload: Workload, data: DataLocation, settings: LoaderSettings) -> EpochSource:
        if data.local_dir is None:
            raise ValueError("local-files reads local files only")
        return DataLoaderSource(_loader(LocalFilesDataset(data.local_dir, workload.count), settings))


class S3fsAdapter:
    name = "s3fs"
    supports_local = False
    supports_remote = True
    uses_sample_objects = True

    def describe(self) -> dict[str, Any]:
        return {
            "system": "map-style Dataset over s3fs, one GET per sample, no cache",
            "versions": versions(("s3fs", "fsspec", "aiobotocore")),
        }

    def convert(self, workload: Workload, samples_dir: Path, out_dir: Path) -> dict[str, Any]:
        return {}

    def open(self, workload: Workload, data: DataLocation, settings: LoaderSettings) -> EpochSource:
        if data.remote_url is None:
            raise ValueError("s3fs reads from S3 only")
        dataset = S3fsDataset(data.remote_url, workload.count, data.storage_options())
        return DataLoaderSource(_loader(dataset, settings))


class MemoryAdapter:
    name = "memory"
    supports_local = True
    supports_remote = False
    uses_sample_objects = True

    def describe(self) -> dict[str, Any]:
        return {"system": "map-style Dataset over samples in memory: the DataLoader's own ceiling"}

    def convert(self, workload: Workload, samples_dir: Path, out_dir: Path) -> dict[str, Any]:
        return {}

    def open(self, workload: Workload, data: DataLocation, settings: LoaderSettings) -> EpochSource:
        samples = np.stack([make_sample(i, workload.sample_bytes) for i in range(workload.count)])
        return DataLoaderSource(_loader(MemoryDataset(samples), settings))
