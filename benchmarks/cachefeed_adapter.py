"""cachefeed as a system under the peer harness (``benchmarks/common/adapter.py``): daemon + ``EpochLoaderFactory``.

What it does, per measurement (``open``):

* writes a daemon config whose remote is the harness's per-sample objects (``s3://bench/samples/<workload>``, the
  same counting moto server as every peer; or ``file://`` of the same files for the local figure), whose cache is
  ``settings.cache_dir`` with ``max_bytes = settings.cache_budget_bytes`` (the same budget as the peers), and starts
  ``python -m cachefeed daemon --config FILE`` *in the measuring process's group* (so the harness kills it on a
  timeout, and counts it if it outlives ``close``); it returns at once (the local figure: once the daemon has cached
  the whole dataset), and the trainer starts beside the starting daemon, as in a job that launches both: the
  factory waits for the cache the daemon creates (``wait_for_cache``). Through 5674ba2 it waited for the daemon's
  status to say ``running``, polled every 50 ms: a wait no job has, which the cold figures counted;
* returns an :class:`EpochSource` whose ``epoch(e)`` is ``factory.loader(e)`` of one ``EpochLoaderFactory`` built
  with the harness's batch size, workers, start method, persistent workers and prefetch factor, and
  ``collate_fn=samples.collate``; every sample is verified by the harness.

No conversion: the daemon reads the reference per-sample objects as they are (``uses_sample_objects``), so the
conversion time is 0 (the harness reports ``n/a``). Samples are decoded by ``benchmarks.decoders.decode_sample``
(the object's bytes as one ``uint8`` array, stored raw and aligned in the segment: read back zero-copy).

Epoch 0 is the factory's default (inside the epoch's timing, so the cold figure includes it): it starts as soon as
each worker has a segment and grows as the daemon publishes (``cachefeed/_trainer/growing.py``), until the daemon
can fill no further (no budget: the whole dataset, as the peers' first epoch) or the epoch's room is full (under a
budget: at most the budget less turnover and the reserve; a rolling cache trains on what is cached, the harness
reports the coverage). Under a budget the daemon's default turnover (67%: an epoch pins at most a third of the
budget) is kept unless the budget is too small for two segments of epoch room, then the largest turnover that
leaves them; without a budget the turnover is 10%, so that the room holds the whole dataset.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from benchmarks.common.adapter import DataLocation, LoaderSettings
from benchmarks.common.results import REPO_ROOT
from benchmarks.common.samples import Workload, collate
from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.settings import DEFAULT_TURNOVER_PERCENT, METADATA_RESERVE_BYTES
from cachefeed._config import toml_text
from cachefeed._errors import NoSuchCacheError
from cachefeed._testing.daemon import DaemonProcess, daemon_argv, wait_while_running
from cachefeed._testing.env import checkout_env

# Per-sample overhead of a segment record, only used to size an unbounded cache (``_cache/records.py``, format 4):
# 64 bytes of header, meta and padding before these payloads of 4 KiB or more (128 where a key of more than about
# 40 characters shares no prefix with the previous one), and 4 bytes of index.
_RECORD_OVERHEAD = 132
_UNBOUNDED_FLOOR = 64 << 20


def sample_payload(sample: dict[str, Any]) -> Any:
    """Trainer transform (runs in the DataLoader workers): the sample's array, a zero-copy view of the segment."""
    return sample["x"]


def segment_bytes_for(workload: Workload) -> int:
    """The segment size: 1/20 of a 30% budget, at most the peers' shard size, at least one sample.

    Not the peers' shard size: a segment is cachefeed's unit of eviction and of reservation (each of the two
    samplers holds one open segment's worth of the budget), so a 30% budget must hold many of them for the cache
    to roll smoothly; shards 1/5 of the budget (what mosaicml-streaming needs) leave it room for one or two. The
    same size is used with and without a budget, so that every figure reads the same segments.
    """
    from benchmarks.common.adapter import shard_bytes_for

    return max(min(shard_bytes_for(workload), int(workload.total_bytes * 0.3 / 20)), workload.sample_bytes + 4096)


class CachefeedAdapter:
    """The cachefeed daemon and its trainer-side loader factory (module docstring)."""

    name = "cachefeed"
    supports_local = True  # the daemon caches the local files (file:// remote) first; epochs read the cache
    supports_remote = True
    uses_sample_objects = True
    rolling = True  # under a budget, an epoch covers what is cached (coverage reported, not a failure)
    decoder = "benchmarks.decoders:decode_sample"  # the daemon's ``sampler.decode`` (a module of its own: see there)

    def describe(self) -> dict[str, Any]:
        import cachefeed

        return {
            "version": getattr(cachefeed, "__version__", "0.1.0"),
            "format": "cachefeed segments (records stored raw, 64-byte aligned, xxh3-verified on read)",
            "loader": "cachefeed.EpochLoaderFactory (one worker pool for every epoch, each epoch queued ahead)",
            "daemon": "python -m cachefeed daemon: 2 sampler processes x 16 requests in flight, fsync off",
            "segment_bytes": "1/20 of a 30% budget, at most the peers' shard size (segment_bytes_for)",
            "convert": "none: reads the reference per-sample objects as they are (conversion time 0)",
            "persistent_workers": "no effect: the factory's workers always live across epochs (_trainer/pool.py)",
            "first_epoch_waits_for": "the whole dataset without a budget; with one, half of (75% of it - 1 MiB)",
        }

    def convert(self, workload: Workload, samples_dir: Path, out_dir: Path) -> dict[str, Any]:
        return {}

    def open(self, workload: Workload, data: DataLocation, settings: LoaderSettings) -> CachefeedSource:
        config_path, cache_dir, work_dir, scratch = self.daemon_config(workload, data, settings)
        daemon = launch_daemon(config_path, cache_dir)
        source = CachefeedSource(daemon, scratch or work_dir, workload, settings)
        try:
            if settings.cache_dir is None:
                # Local figure: the whole dataset cached before the first epoch (warm reads only).
                count = workload.count
                daemon.wait_status(lambda d: d["cache"]["samples"] >= count, timeout_s=600.0, what=f"{count} samples")
            # Otherwise the trainer starts beside the starting daemon (module docstring, ``CachefeedSource``).
        except BaseException:
            source.close()
            raise
        return source

    def daemon_config(
        self, workload: Workload, data: DataLocation, settings: LoaderSettings
    ) -> tuple[Path, Path, Path, Path | None]:
        """The daemon's config file for this workload and these settings: ``(config file, cache dir, work dir,
        scratch dir or None)``; the work dir (and the scratch dir, where there is one) is the caller's to remove."""
        scratch: Path | None = None
        if settings.cache_dir is None:
            # The local figure: no cache dir from the harness; the cache lives next to the local files, removed on
            # close (the harness measures no disk for it).
            if data.local_dir is None:
                raise ValueError("cachefeed needs a cache dir or local files")
            scratch = Path(tempfile.mkdtemp(prefix="cachefeed-local-", dir=data.local_dir.parent))
            cache_dir = scratch / "cache"
            work_dir = scratch
        else:
            cache_dir = settings.cache_dir / "cache"
            work_dir = Path(tempfile.mkdtemp(prefix="cachefeed-daemon-", dir=settings.cache_dir.parent))
        budget = settings.cache_budget_bytes
        seg = segment_bytes_for(workload)
        cache_extra: dict[str, Any] = {}
        if budget is None:
            max_bytes = max(2 * workload.count * (workload.sample_bytes + _RECORD_OVERHEAD), _UNBOUNDED_FLOOR, 8 * seg)
            cache_extra["turnover"] = "10%"  # the room (the budget less turnover) holds the whole dataset
        else:
            max_bytes = budget
            # An epoch pins at most the budget less turnover and the metadata reserve (cachefeed/_cache/room.py):
            # the default turnover, or less where that would leave fewer than two segments of room.
            turnover = min(budget * DEFAULT_TURNOVER_PERCENT // 100, budget - METADATA_RESERVE_BYTES - 2 * seg)
            if turnover < 0:
                raise ValueError(
                    f"a budget of {budget} bytes leaves less than two segments of {seg} bytes once the 1 MiB"
                    " metadata reserve is taken out: cachefeed cannot run with it"
                )
            cache_extra["turnover"] = int(turnover)
        if data.local_dir is not None and settings.cache_dir is None:
            remote: dict[str, Any] = {"url": data.local_dir.resolve().as_uri()}
        else:
            if data.remote_url is None:
                raise ValueError("no remote URL for the remote measurement")
            remote = {"url": data.remote_url, "storage_options": data.storage_options()}
        config = {
            "remote": {**remote, "refresh_interval": "1h", "backoff_base": "20ms", "backoff_max": "500ms"},
            "cache": {
                "dir": str(cache_dir),
                "max_bytes": int(max_bytes),
                "min_free_bytes": 0,
                "segment_bytes": int(seg),
                "fsync": False,
                **cache_extra,
            },
            "sampler": {"processes": 2, "concurrency": 16, "decode": self.decoder},
            "status": {"interval": "500ms"},
            "log": {"level": "info"},
        }
        config_path = work_dir / "daemon.toml"
        config_path.write_text(toml_text(config))
        return config_path, cache_dir, work_dir, scratch


def launch_daemon(config_path: Path, cache_dir: Path, env: Mapping[str, str] | None = None) -> DaemonProcess:
    """``python -m cachefeed daemon`` with ``config_path``, its stderr beside the config, in ``env`` (this process's
    by default) with the checkout on ``PYTHONPATH``; returns at once (``stop_launched`` stops it).

    Not ``start_daemon``: that one gives the daemon a session of its own, and here it stays in the measuring
    process's group (module docstring)."""
    stderr_path = config_path.parent / "daemon.stderr"
    env = checkout_env(REPO_ROOT, env)
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen(
            daemon_argv(config_path),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
            cwd=REPO_ROOT,
        )
    return DaemonProcess(process, config_path, cache_dir, stderr_path)


def stop_launched(process: subprocess.Popen[bytes]) -> None:
    """Stop a daemon from ``launch_daemon``: SIGTERM, then SIGKILL after 30 s (the process alone: it shares the
    measuring process's group)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def make_factory(cache_dir: Path, settings: LoaderSettings) -> Any:
    """The trainer side: ``EpochLoaderFactory`` over ``cache_dir`` with the harness's settings, transform and
    collate."""
    from cachefeed._trainer import EpochLoaderFactory

    options: dict[str, Any] = {}
    if settings.num_workers > 0:
        options = {
            "multiprocessing_context": settings.start_method,
            "persistent_workers": settings.persistent_workers,
            "prefetch_factor": settings.prefetch_factor,
        }
    epochs = settings.extra.get("epochs")
    return EpochLoaderFactory(
        cache_dir,
        batch_size=settings.batch_size,
        num_workers=settings.num_workers,
        shuffle=settings.shuffle,
        seed=settings.seed,
        transform=sample_payload,
        collate_fn=collate,
        wait_timeout_s=600.0,
        epochs=None if epochs is None else int(epochs),
        run_id=f"bench{os.getpid()}",
        rank=0,
        world_size=1,
        progress=None,
        **options,
    )


class CachefeedSource:
    """A running daemon and the factory reading its cache; ``close`` stops both (idempotent)."""

    def __init__(self, daemon: DaemonProcess, work_dir: Path, workload: Workload, settings: LoaderSettings) -> None:
        self.daemon = daemon
        self.cache_dir = daemon.cache_dir
        self.work_dir = work_dir
        self.workload = workload
        self.settings = settings
        self.factory: Any = None
        self.own_files_read: dict[str, Any] | None = None  # figure 1's reference: a read of the segment files
        self._closed = False

    def _check_alive(self) -> None:
        process = self.daemon.process
        if process.poll() is not None:
            raise RuntimeError(f"cachefeed daemon exited with {process.returncode}:\n{self.daemon.stderr()[-3000:]}")

    def _factory(self) -> Any:
        if self.factory is None:
            # The factory waits for the daemon to create its cache (``wait_for_cache``, a look every 20 ms) but
            # cannot see the daemon: the same wait here fails at once, with the daemon's stderr, where it exits
            # before (a config it refuses), rather than at the harness's hang timeout.
            wait_while_running(
                self.daemon, lambda: _is_cache(self.cache_dir), timeout_s=600.0, interval_s=0.02, what="its cache"
            )
            self.factory = make_factory(self.cache_dir, self.settings)
        return self.factory

    def epoch(self, epoch: int) -> Iterable[Any]:
        self._check_alive()
        loader: Iterable[Any] = self._factory().loader(epoch)
        return loader

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.factory is not None:
                self.factory.close()
        finally:
            stop_launched(self.daemon.process)
            if self.settings.cache_dir is None:  # the local figure: its cache is removed here, read it first
                from benchmarks.common.measures import sequential_read

                self.own_files_read = sequential_read(self.cache_dir / "segments")
            shutil.rmtree(self.work_dir, ignore_errors=True)


def _is_cache(cache_dir: Path) -> bool:
    try:
        CacheLayout(cache_dir).check()
    except NoSuchCacheError:
        return False
    return True
