"""What a system under test provides to the harness: a small Protocol, so adding one is ~100 lines.

Lifecycle, as the harness drives it (each step in a fresh subprocess with a timeout, see ``runner.py``)::

    adapter = SomeAdapter()                              # cheap, no I/O; importable by "module:Class"
    adapter.convert(workload, samples_dir, out_dir)      # timed; out_dir is then uploaded as it is
    source = adapter.open(workload, data, settings)      # build dataset + DataLoader (timed as setup)
    for epoch in range(n):
        for batch in source.epoch(epoch): ...            # batches: [B, sample_bytes] uint8 tensors
    source.close()                                       # stop workers/daemons, release pins

Contracts the harness relies on:

- ``convert`` reads the reference per-sample files (``samples.sample_path``) and writes the system's own
  format into ``out_dir`` (initially empty). A system that reads the reference layout directly writes nothing
  and sets ``uses_sample_objects``: it is then pointed at the shared per-sample objects instead.
- ``open`` keeps every byte it caches under ``settings.cache_dir`` (that tree is what the disk sampler
  measures against ``settings.cache_budget_bytes``) and honours batch size, workers, start method and
  persistent workers as far as the system can; what it cannot honour it says in ``describe()``.
- ``epoch(e)`` yields batches built by ``samples.collate`` (or anything ``samples.verify_batch`` accepts).
  An epoch may deliver fewer samples than the dataset (a rolling cache trains on what is cached): the harness
  reports coverage and duplicates instead of failing. Missing samples make a measurement ``misbehaved`` unless
  the adapter sets ``rolling = True`` and the measurement has a budget (a rolling cache covers what fits).
- Adapters are never pickled: the harness never sends one to a worker; what the workers need, ``open`` builds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from benchmarks.common.samples import Workload
from cachefeed._testing.local_s3 import DUMMY_ENV, storage_options

StartMethod = Literal["fork", "spawn", "forkserver"]


@dataclass(frozen=True, slots=True)
class DataLocation:
    """Where a system's data lies: its converted files on local disk, and the same files on S3.

    Attributes:
        local_dir: the converted files (or the per-sample files) on local disk; ``None`` to force remote reads.
        remote_url: ``s3://bucket/prefix`` holding the same files, or ``None`` for local-only runs.
        endpoint_url: the S3 endpoint (the counting moto server).
    """

    local_dir: Path | None
    remote_url: str | None
    endpoint_url: str

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for the endpoint (dummy credentials)."""
        return storage_options(self.endpoint_url)

    def boto_options(self) -> dict[str, Any]:
        """boto3 ``client("s3", **options)`` keyword arguments for the endpoint (dummy credentials)."""
        return {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": DUMMY_ENV["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": DUMMY_ENV["AWS_SECRET_ACCESS_KEY"],
            "region_name": DUMMY_ENV["AWS_DEFAULT_REGION"],
        }


@dataclass(frozen=True, slots=True)
class LoaderSettings:
    """How to read: the same for every system in one measurement.

    Attributes:
        batch_size: samples per batch.
        num_workers: DataLoader worker processes (0: read in the main process).
        start_method: multiprocessing start method for the workers.
        persistent_workers: keep workers alive across epochs.
        cache_dir: where the system may cache; everything it caches must stay under it. ``None``: no cache.
        cache_budget_bytes: the cache limit to configure; ``None`` for unbounded.
        shuffle: shuffle each epoch (seeded).
        seed: the shuffle seed.
        prefetch_factor: batches prefetched per worker (DataLoader's own knob).
    """

    batch_size: int
    num_workers: int = 2
    start_method: StartMethod = "fork"
    persistent_workers: bool = False
    cache_dir: Path | None = None
    cache_budget_bytes: int | None = None
    shuffle: bool = True
    seed: int = 1234
    prefetch_factor: int = 2
    extra: dict[str, Any] = field(default_factory=dict)

    def dataloader_kwargs(self) -> dict[str, Any]:
        """The ``torch.utils.data.DataLoader`` keyword arguments these settings mean."""
        kwargs: dict[str, Any] = {"batch_size": self.batch_size, "num_workers": self.num_workers}
        if self.num_workers > 0:
            kwargs.update(
                multiprocessing_context=self.start_method,
                persistent_workers=self.persistent_workers,
                prefetch_factor=self.prefetch_factor,
            )
        return kwargs


@runtime_checkable
class EpochSource(Protocol):
    """An opened reader: one iterable of batches per epoch."""

    def epoch(self, epoch: int) -> Iterable[Any]:
        """The batches of ``epoch`` (epochs are asked for in order 0, 1, 2, ...)."""
        ...

    def close(self) -> None:
        """Stop everything ``open`` started. Idempotent."""
        ...


@runtime_checkable
class SystemAdapter(Protocol):
    """A system under test. See the module docstring for the lifecycle and contracts.

    Attributes:
        name: short id, used in object prefixes, directory names and reports.
        supports_local: can read ``DataLocation.local_dir`` without S3 (figure 1).
        supports_remote: can read from S3 (figures 2-3).
        uses_sample_objects: reads the shared per-sample objects instead of converted files.
    """

    name: str
    supports_local: bool
    supports_remote: bool
    uses_sample_objects: bool

    def describe(self) -> dict[str, Any]:
        """Versions and fixed settings (format, shard size, what it cannot honour), for the report."""
        ...

    def convert(self, workload: Workload, samples_dir: Path, out_dir: Path) -> dict[str, Any]:
        """Write the system's format of the workload into ``out_dir``; return details (shards, bytes)."""
        ...

    def open(self, workload: Workload, data: DataLocation, settings: LoaderSettings) -> EpochSource:
        """Build the dataset and its DataLoader (or the system's equivalent)."""
        ...


def shard_bytes_for(workload: Workload, budget_fraction: float = 0.3) -> int:
    """The shard size every sharded system uses for a workload, so formats are compared at equal shard size.

    mosaicml-streaming refuses a cache limit below 4x its largest shard; with a budget of 30% of the dataset
    the shard must stay under ~1/13 of it (1/16 here, for margin). Capped at 16 MiB, floored at 4 samples.
    """
    limit = int(workload.total_bytes * budget_fraction / 5)
    return max(min(16 << 20, limit), 4 * workload.sample_bytes)
