"""cachefeed over webdataset tar shards (system ``cachefeed-tar``): the same daemon and loader as ``cachefeed``, a
sharded remote instead of one object per sample.

``convert`` packs the workload's reference samples, in index order, into tar shards of the peers' shard size
(``shard_bytes_for``: what litdata's chunks and mosaicml-streaming's shards get), members named as webdataset names
them (``00000042.bin``: one sample per basename, field ``bin``); the harness times it and uploads the shards to the
same counting moto server as the peers' converted files. The daemon reads them with its built-in ``tar`` decoder
(``cachefeed/_codecs.py``: webdataset's grouping), through ``benchmarks.decoders.decode_tar_sample``, which hands
on the ``bin`` member as the sample's ``x`` array, as ``cachefeed`` stores a per-sample object. Every sample is
verified by the harness as for every system. Everything else (budget, segment size, workers, epochs) is
``CachefeedAdapter``'s.

Why both systems: reading the objects as they are ("no conversion") is a feature of its own, and a sharded remote
is what the peers read and what most large datasets already are; a GET per sample is paced by the object store's
request rate, a GET per shard by its bandwidth.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

from benchmarks.cachefeed_adapter import CachefeedAdapter
from benchmarks.common.adapter import shard_bytes_for
from benchmarks.common.samples import Workload, sample_name, sample_path

_TAR_MEMBER_OVERHEAD = tarfile.BLOCKSIZE  # a member's header; its data is padded to the block size


def write_shards(workload: Workload, samples_dir: Path, out_dir: Path) -> list[Path]:
    """Pack the reference samples, in index order, into ``shard-NNNNN.tar`` files of at most
    ``shard_bytes_for(workload)`` bytes each (at least one sample per shard); returns the shards written."""
    limit = shard_bytes_for(workload)
    per_member = _TAR_MEMBER_OVERHEAD + -(-workload.sample_bytes // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    per_shard = max(1, (limit - 2 * tarfile.RECORDSIZE) // per_member)
    shards: list[Path] = []
    for first in range(0, workload.count, per_shard):
        path = out_dir / f"shard-{len(shards):05d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as archive:
            for index in range(first, min(first + per_shard, workload.count)):
                payload = sample_path(samples_dir, index).read_bytes()
                info = tarfile.TarInfo(sample_name(index))
                info.size = len(payload)
                archive.addfile(info, io.BytesIO(payload))
        shards.append(path)
    return shards


class CachefeedTarAdapter(CachefeedAdapter):
    """``CachefeedAdapter`` reading webdataset tar shards (module docstring)."""

    name = "cachefeed-tar"
    uses_sample_objects = False  # the harness points it at its converted files: the shards
    decoder = "benchmarks.decoders:decode_tar_sample"

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "convert": "webdataset tar shards of the peers' shard size (shard_bytes_for), one member per sample",
            "decode": "the daemon's tar decoder (webdataset grouping), member 'bin' -> the sample's array",
        }

    def convert(self, workload: Workload, samples_dir: Path, out_dir: Path) -> dict[str, Any]:
        shards = write_shards(workload, samples_dir, out_dir)
        return {"shard_bytes": shard_bytes_for(workload), "shards": len(shards)}
