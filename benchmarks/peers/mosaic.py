"""mosaicml-streaming: MDS shards written with ``MDSWriter``, read with ``StreamingDataset`` + ``DataLoader``.

Recommended use, as its docs show it: one ``StreamingDataset(remote=..., local=...)`` whose ``batch_size``
matches the DataLoader's, the DataLoader iterated once per epoch. The cache limit is ``cache_limit`` (bytes);
the library refuses one below 4x its largest shard, hence ``adapter.shard_bytes_for``. The S3 endpoint comes
from ``S3_ENDPOINT_URL`` (read in each worker), so it is set in the environment before workers start.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# isort: off
from benchmarks.peers import compat  # first: the shims must be in place before the import below
import streaming
# isort: on

from benchmarks.common.adapter import DataLocation, EpochSource, LoaderSettings, shard_bytes_for
from benchmarks.common.loaders import DataLoaderSource
from benchmarks.common.machine import versions
from benchmarks.common.samples import Workload, collate, iter_sample_files, read_sample_file


class MdsDataset(streaming.StreamingDataset):  # type: ignore[misc]
    """``StreamingDataset`` yielding the sample array. Lives here so spawned workers import ``compat`` first."""

    def __getitem__(self, index: int) -> Any:
        return super().__getitem__(index)["x"]


class MosaicAdapter:
    name = "mosaic"
    supports_local = True
    supports_remote = True
    uses_sample_objects = False

    def describe(self) -> dict[str, Any]:
        return {
            "system": "mosaicml-streaming",
            "version": versions(("mosaicml-streaming",))["mosaicml-streaming"],
            "format": "MDS, column x: ndarray:uint8:<sample_bytes>, no compression, no hashes",
            "reader": "MdsDataset(StreamingDataset) + torch DataLoader, shuffle_algo py1e (default)",
            "compat": compat.report(),
        }

    def convert(self, workload: Workload, samples_dir: Path, out_dir: Path) -> dict[str, Any]:
        shard_bytes = shard_bytes_for(workload)
        columns = {"x": f"ndarray:uint8:{workload.sample_bytes}"}
        with streaming.MDSWriter(out=str(out_dir), columns=columns, size_limit=shard_bytes) as writer:
            for _, path in iter_sample_files(samples_dir, workload.count):
                writer.write({"x": read_sample_file(path)})
        return {"shard_size_limit_bytes": shard_bytes, "columns": columns}

    def open(self, workload: Workload, data: DataLocation, settings: LoaderSettings) -> EpochSource:
        from torch.utils.data import DataLoader

        os.environ["S3_ENDPOINT_URL"] = data.endpoint_url
        common = {
            "shuffle": settings.shuffle,
            "shuffle_seed": settings.seed,
            "batch_size": settings.batch_size,
        }
        if data.local_dir is not None:
            dataset = MdsDataset(local=str(data.local_dir), remote=None, **common)
        else:
            if settings.cache_dir is None:
                raise ValueError("mosaicml-streaming needs a local cache dir to read from S3")
            dataset = MdsDataset(
                remote=data.remote_url,
                local=str(settings.cache_dir / "mds"),
                cache_limit=settings.cache_budget_bytes,
                **common,
            )
        loader: DataLoader[Any] = DataLoader(dataset, collate_fn=collate, **settings.dataloader_kwargs())
        return DataLoaderSource(loader)
