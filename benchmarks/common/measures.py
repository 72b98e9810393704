"""The measurements, each a function of (adapter, context, params) returning a JSON-able dict.

They run inside a runner subprocess (``runner.py``), one system at a time, so a hang or crash costs one
measurement, not the run. Figures (numbered as in issue 7):

- ``convert`` (7): time to write the system's format, then upload it to S3 (timed apart).
- ``local`` (1, and the DataLoader's ceilings with the in-memory systems): warm local epochs, next to a raw
  sequential read of the same files from the same filesystem (``rawread``); with ``num_workers=0`` in the
  params, the same read in the training process (the plans' ``inprocess`` label).
- ``remote`` (2, 3, 4): epochs from S3 into an empty cache with a budget (or none): per epoch, time,
  server-counted bytes and requests, peak on-disk size; handover waits; over all its epochs (``trained``): samples
  trained, distinct samples (coverage) and server bytes per byte trained. With ``passes`` in the params, the
  epochs run until that many passes' worth of samples was trained (equal work, ``budget30``); with
  ``train_mb_per_s``, the consumer trains at that rate (a sleep per batch) instead of as fast as batches come;
  with ``train_pass_s``, at a pass's worth of samples per that many seconds (``budget30-paced``).
- ``s3_ceiling``: plain concurrent GETs of the same objects (no adapter).
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.adapter import DataLocation, LoaderSettings, SystemAdapter
from benchmarks.common.epochs import StopEpochs, run_epochs
from benchmarks.common.rawread import DEFAULT_BUFFER_BYTES, read_buffer, read_files
from benchmarks.common.report import trained
from benchmarks.common.s3server import fetch_stats, list_keys, split_url, stats_delta, upload_dir
from benchmarks.common.samplers import DiskSampler, tree_bytes
from benchmarks.common.samples import Workload
from cachefeed._testing.local_s3 import s3_client

Progress = Callable[[dict[str, Any]], None]
# A peak on disk within 1% over the budget is reported (``peak_disk_over_budget``) but not called an overshoot:
# index and lock files that a system does not count against its limit are of that order.
BUDGET_TOLERANCE = 0.01
_MAX_EPOCHS = 200  # the bound on epochs of a ``passes`` measurement (a rolling cache's epochs are a room each)


@dataclass(frozen=True, slots=True)
class Context:
    """Where things are for one (system, workload): paths on disk and on S3.

    Attributes:
        workload: the dataset shape.
        endpoint_url: the counting S3 server.
        bucket: the bucket everything lives in.
        samples_dir: the reference per-sample files of the workload.
        samples_url: ``s3://bucket/samples/<workload>``: the same files as objects.
        converted_dir: the system's converted files (written by ``convert``).
        converted_url: ``s3://bucket/<system>/<workload>``: the same files as objects.
        scratch_dir: a directory this system may fill (caches); emptied between measurements.
    """

    workload: Workload
    endpoint_url: str
    bucket: str
    samples_dir: Path
    samples_url: str
    converted_dir: Path
    converted_url: str
    scratch_dir: Path

    def data(self, adapter: SystemAdapter, local: bool) -> DataLocation:
        if adapter.uses_sample_objects:
            return DataLocation(self.samples_dir if local else None, self.samples_url, self.endpoint_url)
        return DataLocation(self.converted_dir if local else None, self.converted_url, self.endpoint_url)

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload.to_json(),
            "endpoint_url": self.endpoint_url,
            "bucket": self.bucket,
            "samples_dir": str(self.samples_dir),
            "samples_url": self.samples_url,
            "converted_dir": str(self.converted_dir),
            "converted_url": self.converted_url,
            "scratch_dir": str(self.scratch_dir),
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Context:
        return cls(
            Workload.from_json(doc["workload"]),
            doc["endpoint_url"],
            doc["bucket"],
            Path(doc["samples_dir"]),
            doc["samples_url"],
            Path(doc["converted_dir"]),
            doc["converted_url"],
            Path(doc["scratch_dir"]),
        )


def measure_convert(adapter: SystemAdapter, ctx: Context, params: dict[str, Any], progress: Progress) -> dict[str, Any]:
    if adapter.uses_sample_objects:
        return {"status": "n/a", "reason": "reads the reference per-sample objects as they are"}
    if ctx.converted_dir.exists():
        shutil.rmtree(ctx.converted_dir)
    ctx.converted_dir.mkdir(parents=True)
    started = time.perf_counter()
    details = adapter.convert(ctx.workload, ctx.samples_dir, ctx.converted_dir)
    convert_s = time.perf_counter() - started
    files = sorted(p for p in ctx.converted_dir.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    progress({"converted": True, "convert_s": convert_s})
    started = time.perf_counter()
    upload_dir(ctx.endpoint_url, ctx.converted_dir, ctx.converted_url)
    upload_s = time.perf_counter() - started
    return {
        "status": "ok",
        "convert_s": round(convert_s, 3),
        "convert_mb_per_s": round(ctx.workload.total_bytes / convert_s / 1e6, 2),
        "upload_s": round(upload_s, 3),
        "files": len(files),
        "bytes": size,
        "overhead_ratio": round(size / ctx.workload.total_bytes, 4),
        "largest_file_bytes": max((p.stat().st_size for p in files), default=0),
        "details": details,
    }


def measure_local(adapter: SystemAdapter, ctx: Context, params: dict[str, Any], progress: Progress) -> dict[str, Any]:
    if not adapter.supports_local:
        return {"status": "n/a", "reason": "the system has no local-only mode"}
    settings = _settings(ctx, params, cache=False)
    data = ctx.data(adapter, local=True)
    epochs = int(params.get("epochs", 2))
    started = time.perf_counter()
    source = None
    try:
        source = adapter.open(ctx.workload, data, settings)
        open_s = time.perf_counter() - started
        results = run_epochs(
            source,
            epochs,
            ctx.workload.count,
            ctx.workload.sample_bytes,
            report=_epoch_reporter(progress),
            check=_Watch(progress, ctx),
        )
    finally:
        if source is not None:
            source.close()
    warm = results[1:] or results  # epoch 0 warms the page cache (and the system's own caches)
    out: dict[str, Any] = {
        "status": _status(results, ctx.workload.count),
        "settings": _settings_json(settings),
        "open_s": round(open_s, 3),
        "epochs": results,
        "warm_samples_per_s": _median(e["samples_per_s"] for e in warm),
        "warm_mb_per_s": _median(e["mb_per_s"] for e in warm),
        "warm_steady_samples_per_s": _median(e["steady_samples_per_s"] for e in warm),
        "warm_steady_mb_per_s": _mb_per_s(_median(e["steady_samples_per_s"] for e in warm), ctx.workload.sample_bytes),
    }
    if data.local_dir is not None and params.get("sequential_read", True):
        out["sequential_read"] = sequential_read(data.local_dir)
    # A system that reads its own copy of the data (a cache filled from the local files) may leave a sequential
    # read of *those* files (``source.own_files_read``, taken before ``close`` removed them): the ratio of figure 1
    # is then against the bytes the loader really read.
    own = getattr(source, "own_files_read", None)
    if own is not None:
        out["sequential_read_own_files"] = own
    return out


def measure_remote(adapter: SystemAdapter, ctx: Context, params: dict[str, Any], progress: Progress) -> dict[str, Any]:
    # ``local_fallback``: a local-only system still gets its epochs measured (handover), from local files.
    can_fall_back = adapter.supports_local and bool(params.get("local_fallback", False))
    if not adapter.supports_remote and not can_fall_back:
        return {"status": "n/a", "reason": "the system cannot read from S3"}
    fraction = params.get("budget_fraction")
    budget = None if fraction is None else int(ctx.workload.total_bytes * float(fraction))
    settings = _settings(ctx, params, cache=True, budget=budget)
    data = ctx.data(adapter, local=not adapter.supports_remote)
    # ``passes``: equal work, whatever a system's epoch is: epochs until this many passes' worth of samples was
    # trained (at most ``max_epochs``); otherwise ``epochs`` epochs.
    passes = params.get("passes")
    until = None if passes is None else math.ceil(float(passes) * ctx.workload.count)
    epochs = int(params.get("max_epochs", _MAX_EPOCHS)) if until is not None else int(params.get("epochs", 1))
    # ``train_mb_per_s``: the consumer trains at this rate (a step per batch, ``run_epochs``); none: at once
    # ``train_pass_s``: a pass's worth of samples per that many seconds
    rate, pass_s = params.get("train_mb_per_s"), params.get("train_pass_s")
    step_s = 0.0 if not rate else ctx.workload.batch_size * ctx.workload.sample_bytes / (float(rate) * 1e6)
    if pass_s:
        step_s = float(pass_s) * ctx.workload.batch_size / ctx.workload.count
    cache_dir = settings.cache_dir
    if cache_dir is None:
        raise ValueError("remote measurement without a cache dir")
    disk = DiskSampler([cache_dir], interval_s=0.1)
    before = [fetch_stats(ctx.endpoint_url)]

    def on_epoch_end(epoch: int) -> dict[str, Any]:
        after = fetch_stats(ctx.endpoint_url)
        delta = stats_delta(before[0], after)
        before[0] = after
        peak = disk.take_window_peak()
        return {
            "remote_bytes": delta["data_bytes_out"],
            "remote_requests": delta["total_requests"],
            "remote_requests_by_kind": delta["requests"],
            "peak_disk_bytes": peak,
            "peak_disk_over_budget": None if budget is None else round(peak / budget, 3),
        }

    factor = params.get("max_remote_factor")
    watch = _Watch(progress, ctx, None if factor is None else float(factor))
    stopped: str | None = None

    disk.start()
    started = time.perf_counter()
    source = None
    try:
        source = adapter.open(ctx.workload, data, settings)
        open_s = time.perf_counter() - started
        try:
            results = run_epochs(
                source,
                epochs,
                ctx.workload.count,
                ctx.workload.sample_bytes,
                on_epoch_end,
                report=_epoch_reporter(progress),
                check=watch,
                until_samples=until,
                step_s=step_s,
            )
        except StopEpochs as exc:
            stopped, results = exc.reason, exc.results
            results[-1].update(on_epoch_end(results[-1]["epoch"]))
    finally:
        if source is not None:
            source.close()
        disk_summary = disk.stop()
    cache_left = tree_bytes([cache_dir])
    shutil.rmtree(cache_dir, ignore_errors=True)
    # A rolling cache (``adapter.rolling``) trains each epoch on what is cached: under a budget smaller than the
    # dataset an epoch covers part of it by design; the coverage is in each epoch's ``unique_samples``.
    partial_ok = bool(getattr(adapter, "rolling", False)) and budget is not None
    status = _status(
        results, ctx.workload.count, budget=budget, peak=disk_summary["peak_bytes"], allow_missing=partial_ok
    )
    if stopped is not None:
        status = f"misbehaved: {stopped}" + ("" if status == "ok" else "; " + status.removeprefix("misbehaved: "))
    return {
        "status": status,
        "settings": _settings_json(settings),
        "dataset_bytes": ctx.workload.total_bytes,
        "budget_bytes": budget,
        "open_s": round(open_s, 3),
        "epochs": results,
        **trained(results, ctx.workload.count, ctx.workload.sample_bytes),
        "disk": disk_summary,
        "peak_disk_over_budget": None if budget is None else round(disk_summary["peak_bytes"] / budget, 3),
        "cache_left_bytes": cache_left,
    }


def measure_s3_ceiling(ctx: Context, params: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Concurrent plain GETs (boto3, ``threads`` threads) of the objects under each prefix, once each.

    At most ``max_objects`` per prefix (evenly spread over the sorted keys): small objects cost a request each.
    """
    threads = int(params.get("threads", 8))
    max_objects = int(params.get("max_objects", 2048))
    client = s3_client(ctx.endpoint_url)
    out: dict[str, Any] = {"status": "ok", "threads": threads, "prefixes": {}}
    for url in params["urls"]:
        bucket, prefix = split_url(url)
        listed = list_keys(client, bucket, prefix)
        keys = listed[:: max(1, -(-len(listed) // max_objects))]
        before = fetch_stats(ctx.endpoint_url)
        started = time.perf_counter()

        def get(key: str, bucket: str = bucket) -> int:
            return len(client.get_object(Bucket=bucket, Key=key)["Body"].read())

        with ThreadPoolExecutor(threads) as pool:
            got = sum(pool.map(get, keys))
        wall_s = time.perf_counter() - started
        delta = stats_delta(before, fetch_stats(ctx.endpoint_url))
        out["prefixes"][url] = {
            "objects": len(keys),
            "objects_under_prefix": len(listed),
            "bytes": got,
            "wall_s": round(wall_s, 3),
            "requests_per_s": round(len(keys) / wall_s, 1),
            "mb_per_s": round(got / wall_s / 1e6, 2),
            "server_bytes": delta["data_bytes_out"],
            "server_requests": delta["total_requests"],
        }
        progress({"url": url, **out["prefixes"][url]})
    return out


MEASURES: dict[str, Callable[[SystemAdapter, Context, dict[str, Any], Progress], dict[str, Any]]] = {
    "convert": measure_convert,
    "local": measure_local,
    "remote": measure_remote,
}


def sequential_read(root: Path, chunk_bytes: int = DEFAULT_BUFFER_BYTES) -> dict[str, Any]:
    """Read every file under ``root`` front to back, twice (the first warms the page cache); time the second.

    The read is ``rawread.read_files``: ``readinto`` one reused, page-aligned ``chunk_bytes`` buffer (the storage
    ceiling).
    """
    files = sorted(p for p in root.rglob("*") if p.is_file())
    buffer = read_buffer(chunk_bytes)
    result: dict[str, Any] = {}
    for label in ("cold_or_partly_cached", "warm"):
        started = time.perf_counter()
        total = read_files(files, buffer)
        wall_s = time.perf_counter() - started
        result[label] = {"bytes": total, "wall_s": round(wall_s, 4), "mb_per_s": round(total / wall_s / 1e6, 1)}
    result["files"] = len(files)
    return result


def _settings(ctx: Context, params: dict[str, Any], cache: bool, budget: int | None = None) -> LoaderSettings:
    cache_dir = None
    if cache:
        # A fresh directory per measurement: some systems refuse (or misread) a cache dir reused in-process.
        ctx.scratch_dir.mkdir(parents=True, exist_ok=True)
        cache_dir = Path(tempfile.mkdtemp(prefix="cache-", dir=ctx.scratch_dir))
    return LoaderSettings(  # shuffle, seed and prefetch factor: LoaderSettings' defaults, the same for every system
        batch_size=ctx.workload.batch_size,
        num_workers=int(params.get("num_workers", 2)),
        start_method=params.get("start_method", "fork"),
        persistent_workers=bool(params.get("persistent_workers", False)),
        cache_dir=cache_dir,
        cache_budget_bytes=budget,
        extra={"epochs": None if params.get("passes") is not None else int(params.get("epochs", 1))},
    )


def _settings_json(settings: LoaderSettings) -> dict[str, Any]:
    return {
        "batch_size": settings.batch_size,
        "num_workers": settings.num_workers,
        "start_method": settings.start_method,
        "persistent_workers": settings.persistent_workers,
        "cache_budget_bytes": settings.cache_budget_bytes,
        "shuffle": settings.shuffle,
        "prefetch_factor": settings.prefetch_factor,
    }


def _status(
    results: list[dict[str, Any]], count: int, budget: int | None = None, peak: int = 0, allow_missing: bool = False
) -> str:
    """``ok``, or what went wrong in words a reader of the report understands."""
    problems = []
    if any(r["corrupt_samples"] for r in results):
        problems.append("corrupt samples")
    if any(r["duplicate_samples"] for r in results):
        problems.append("duplicate samples within an epoch")
    if not allow_missing and any(r["missing_samples"] for r in results if not r.get("partial")):
        problems.append("epochs missing samples")
    if budget is not None and peak > budget * (1 + BUDGET_TOLERANCE):
        problems.append(f"exceeded its cache budget (peak on disk {peak / budget:.2f}x)")
    return "ok" if not problems else "misbehaved: " + ", ".join(problems)


class _Watch:
    """The ``check`` of :func:`run_epochs`: a heartbeat every ``heartbeat_s`` (which also tells the runner the
    system is alive), and, with ``max_remote_factor``, a stop when the server has sent more than that many
    times the dataset per epoch begun: a thrashing cache would otherwise spend the whole run's time."""

    def __init__(
        self, progress: Progress, ctx: Context, max_remote_factor: float | None = None, heartbeat_s: float = 5.0
    ) -> None:
        self.progress = progress
        self.ctx = ctx
        self.max_remote_factor = max_remote_factor
        self.heartbeat_s = heartbeat_s
        self.start = fetch_stats(ctx.endpoint_url) if max_remote_factor is not None else None
        self.last_beat = time.monotonic()

    def __call__(self, partial: dict[str, Any]) -> str | None:
        remote = None
        dataset = self.ctx.workload.total_bytes
        if self.start is not None and self.max_remote_factor is not None:
            remote = stats_delta(self.start, fetch_stats(self.ctx.endpoint_url))["data_bytes_out"]
            epoch = partial["epoch"]
            if remote > self.max_remote_factor * dataset * (epoch + 1):
                return (
                    f"stopped by the harness after {remote / dataset:.1f}x the dataset was downloaded by epoch"
                    f" {epoch} ({partial['samples']} samples into it; guard: {self.max_remote_factor:g}x per epoch)"
                )
        now = time.monotonic()
        if now - self.last_beat >= self.heartbeat_s:
            self.last_beat = now
            beat = {k: partial[k] for k in ("epoch", "samples", "wall_s")}
            self.progress({"heartbeat": {**beat, "remote_bytes_so_far": remote}})
        return None


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def _mb_per_s(samples_per_s: float | None, sample_bytes: int) -> float | None:
    return None if samples_per_s is None else round(samples_per_s * sample_bytes / 1e6, 2)


def _epoch_reporter(progress: Progress) -> Callable[[dict[str, Any]], None]:
    def report(result: dict[str, Any]) -> None:
        progress({"epoch_result": result})

    return report
