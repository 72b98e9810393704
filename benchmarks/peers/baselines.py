"""The baselines: what a user gets without a streaming library, and the DataLoader's own ceilings.

- ``LocalFilesAdapter``: a map-style ``Dataset`` over one local file per sample (the reference layout).
- ``S3fsAdapter``: a map-style ``Dataset`` that GETs each sample from S3 through s3fs (one GET per sample per
  epoch, nothing cached): "a DataLoader over s3fs".
- ``BatchedMemoryAdapter`` (``memory-batched``): the DataLoader's ceiling for batched reads from RAM. The
  workload's samples lie in one ``[count, sample_bytes]`` uint8 tensor, filled before the workers start; the
  dataset's ``__getitems__`` gathers a batch's rows in one copy (in a worker, straight into shared memory, as
  ``default_collate`` does: the batch then reaches the main process without another copy); the collate function
  passes that tensor on; workers persist across epochs. One copy per byte, no per-sample Python, nothing to read
  or decode: what is left is what the DataLoader itself costs.
- ``MemoryAdapter`` (``memory``): a per-sample map-style ``Dataset`` over the same array in RAM, collated by
  ``samples.collate`` like the readers of files. Kept next to the batched ceiling because it says two other
  things: how fast the per-sample path (what ``local-files`` and mosaicml-streaming go through) can be with
  free I/O, and, in figure 4, the handover of a new DataLoader (it honours ``persistent_workers``, so fork and
  fork + persistent differ; the batched ceiling always persists and takes no part in figure 4).

All use ``torch.utils.data.DataLoader`` with a seeded shuffling generator and the harness's batch size, workers,
start method and prefetch factor; the harness verifies every sample of every batch (each carries its index and
checksum).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from benchmarks.common.adapter import DataLocation, EpochSource, LoaderSettings
from benchmarks.common.loaders import DataLoaderSource
from benchmarks.common.machine import versions
from benchmarks.common.samples import Workload, collate, sample_name, sample_path


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


class BatchedMemoryDataset(Dataset[torch.Tensor]):
    """The samples as one ``[count, sample_bytes]`` tensor; a batch is one gather of its rows (module docstring)."""

    def __init__(self, samples: torch.Tensor) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.samples[index]

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        """The batch's rows in one new tensor: ``DataLoader`` calls this with a batch's indices.

        In the main process, numpy's fancy indexing (single-threaded: torch's ``index_select`` runs on every
        intra-op thread and was slower on 2 shared cores); in a worker (one thread), ``index_select`` straight into
        shared memory. Either is one copy of the batch's bytes.
        """
        if get_worker_info() is None:
            return torch.from_numpy(self.samples.numpy()[indices])
        rows = torch.as_tensor(indices, dtype=torch.long)
        return torch.index_select(self.samples, 0, rows, out=_shared_rows(self.samples, len(indices)))


def _shared_rows(like: torch.Tensor, count: int) -> torch.Tensor:
    """An empty ``[count, row]`` tensor in shared memory, allocated as ``default_collate`` does in a worker.

    A worker's batch travels to the main process as a shared-memory handle; a batch built anywhere else would be
    copied into shared memory on the way.
    """
    width = like.shape[1]
    storage = like._typed_storage()._new_shared(count * width, device=like.device)
    return like.new(storage).view(count, width)


def _batch_as_is(batch: torch.Tensor) -> torch.Tensor:
    """The collate function of the batched ceiling: ``__getitems__`` already returned the batch tensor."""
    return batch


def _samples_in_ram(workload: Workload, data: DataLocation) -> np.ndarray:
    """The workload's samples, read from its local per-sample files into one ``[count, sample_bytes]`` array."""
    if data.local_dir is None:
        raise ValueError("the in-memory baselines load the local per-sample files")
    samples = np.empty((workload.count, workload.sample_bytes), dtype=np.uint8)
    for index in range(workload.count):
        with sample_path(data.local_dir, index).open("rb", buffering=0) as handle:
            if handle.readinto(memoryview(samples[index])) != workload.sample_bytes:
                raise ValueError(f"sample file {index} is not {workload.sample_bytes} bytes long")
    return samples


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
        return {
            "system": "per-sample map-style Dataset over the samples in RAM (one array), samples.collate",
            "torch": versions(("torch",)),
        }

    def convert(self, workload: Workload, samples_dir: Path, out_dir: Path) -> dict[str, Any]:
        return {}

    def open(self, workload: Workload, data: DataLocation, settings: LoaderSettings) -> EpochSource:
        return DataLoaderSource(_loader(MemoryDataset(_samples_in_ram(workload, data)), settings))


class BatchedMemoryAdapter:
    """The DataLoader's ceiling for batched reads from RAM (module docstring)."""

    name = "memory-batched"
    supports_local = True
    supports_remote = False
    uses_sample_objects = True

    def describe(self) -> dict[str, Any]:
        return {
            "system": "the DataLoader's ceiling: the samples in one uint8 tensor in RAM, __getitems__ gathers a"
            " batch in one index_select (into shared memory in a worker), collate passes it on",
            "persistent_workers": "always, with workers (the ceiling pays no worker start per epoch)",
            "torch": versions(("torch",)),
        }

    def convert(self, workload: Workload, samples_dir: Path, out_dir: Path) -> dict[str, Any]:
        return {}

    def open(self, workload: Workload, data: DataLocation, settings: LoaderSettings) -> EpochSource:
        samples = torch.from_numpy(_samples_in_ram(workload, data))
        generator = torch.Generator()
        generator.manual_seed(settings.seed)
        kwargs = settings.dataloader_kwargs()
        if settings.num_workers > 0:
            kwargs["persistent_workers"] = True
        loader = DataLoader(
            BatchedMemoryDataset(samples),
            shuffle=settings.shuffle,
            generator=generator,
            collate_fn=_batch_as_is,
            **kwargs,
        )
        return DataLoaderSource(loader)
