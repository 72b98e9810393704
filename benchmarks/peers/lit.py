"""litdata: chunks written with ``litdata.optimize``, read with ``StreamingDataset`` + ``StreamingDataLoader``.

Recommended use, as its docs show it: ``optimize(fn, inputs, output_dir, chunk_bytes=...)`` once, then
``StreamingDataset(input_dir="s3://...", cache_dir=..., max_cache_size=...)`` under a ``StreamingDataLoader``
iterated once per epoch. The S3 endpoint goes in ``storage_options`` (boto3 client arguments); its chunk
downloader (obstore) also needs ``allow_http`` for the loopback endpoint, set by ``compat.patch_litdata_http``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

# isort: off
from benchmarks.peers import compat  # first: the shims must be in place before the import below
import litdata
# isort: on

from benchmarks.common.adapter import DataLocation, EpochSource, LoaderSettings, shard_bytes_for
from benchmarks.common.loaders import DataLoaderSource
from benchmarks.common.machine import versions
from benchmarks.common.samples import Workload, collate, read_sample_file, sample_path

compat.patch_litdata_http()


class LitDataset(litdata.StreamingDataset):  # type: ignore[misc]
    """litdata's ``StreamingDataset``, defined here so spawned workers import ``compat`` (and its patch) first."""


def _read(samples_dir: str, index: int) -> Any:
    return read_sample_file(sample_path(Path(samples_dir), index))


class LitAdapter:
    name = "litdata"
    supports_local = True
    supports_remote = True
    uses_sample_objects = False

    def describe(self) -> dict[str, Any]:
        return {
            "system": "litdata",
            "version": versions(("litdata",))["litdata"],
            "format": "litdata chunks from optimize(); item = uint8 ndarray; no compression",
            "reader": "LitDataset(StreamingDataset) + StreamingDataLoader",
            "convert_workers": os.cpu_count(),
            "compat": compat.report(),
        }

    def convert(self, workload: Workload, samples_dir: Path, out_dir: Path) -> dict[str, Any]:
        shard_bytes = shard_bytes_for(workload)
        litdata.optimize(
            fn=functools.partial(_read, str(samples_dir)),
            inputs=list(range(workload.count)),
            output_dir=str(out_dir),
            chunk_bytes=shard_bytes,
            num_workers=os.cpu_count() or 1,
        )
        return {"chunk_bytes": shard_bytes, "num_workers": os.cpu_count()}

    def open(self, workload: Workload, data: DataLocation, settings: LoaderSettings) -> EpochSource:
        common: dict[str, Any] = {"shuffle": settings.shuffle, "seed": settings.seed}
        if data.local_dir is not None:
            dataset = LitDataset(input_dir=str(data.local_dir), **common)
        else:
            if settings.cache_dir is None:
                raise ValueError("litdata needs a local cache dir to read from S3")
            if settings.cache_budget_bytes is not None:
                common["max_cache_size"] = settings.cache_budget_bytes
            dataset = LitDataset(
                input_dir=data.remote_url,
                cache_dir=str(settings.cache_dir / "litdata"),
                storage_options=data.boto_options(),
                **common,
            )
        kwargs = settings.dataloader_kwargs()
        loader = litdata.StreamingDataLoader(dataset, collate_fn=collate, **kwargs)
        return DataLoaderSource(loader)
