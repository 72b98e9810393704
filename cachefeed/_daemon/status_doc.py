"""Building and writing the daemon's status document (the contract is ``STATUS_SCHEMA`` in ``_status/schema.py``).

``build_status`` is a pure function of what the supervisor knows at one instant, so tests and other writers can
reuse it; ``write_status`` replaces ``<cache>/status.json`` atomically (mode 0640: group-readable). No secrets go
in: the remote URL loses any ``user:password@`` part, and storage options never appear.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachefeed._cache.snapshots import SnapshotInfo
from cachefeed._cache.store import Counters, Usage
from cachefeed._fsutil import atomic_write
from cachefeed._status.schema import STATUS_VERSION  # the contract's owner

__all__ = ["STATUS_VERSION", "RateMeter", "RemoteTotals", "build_status", "write_status"]

STATUS_MODE = 0o640
_RATE_WINDOW_S = 10.0


class RateMeter:
    """Per-second rates of monotonic counters over a sliding window (about ``window_s``)."""

    def __init__(self, window_s: float = _RATE_WINDOW_S) -> None:
        self._window_s = window_s
        self._points: deque[tuple[float, tuple[float, ...]]] = deque()

    def add(self, now: float, values: Sequence[float]) -> tuple[float, ...]:
        """Record the counters' values at ``now``; return their rates over the window."""
        self._points.append((now, tuple(values)))
        while len(self._points) > 2 and now - self._points[1][0] >= self._window_s:
            self._points.popleft()
        first_t, first = self._points[0]
        span = now - first_t
        if span <= 0:
            return tuple(0.0 for _ in values)
        return tuple(max(0.0, (v - f) / span) for v, f in zip(values, first, strict=True))


@dataclass(frozen=True, slots=True)
class RemoteTotals:
    """The remote section's inputs, summed over the samplers (dead incarnations included) and the catalog."""

    url: str
    objects_listed: int
    last_listed_at: float
    list_errors_total: int
    passes_completed: int
    requests_total: int
    retries_total: int
    errors_by_kind: Mapping[str, int]
    quarantined_total: int
    bytes_total: int
    objects_failed_total: int = 0
    objects_dropped: int = 0
    quarantined_samples_total: int = 0
    not_cached: Mapping[str, int] = field(default_factory=dict)
    list_requests_total: int = 0
    list_requests_per_hour: float = 0.0
    refresh_interval_s: float = 0.0


def build_status(
    *,
    state: str,
    started_at: float,
    interval_s: float,
    degraded_reasons: Sequence[str],
    cache_dir: str,
    usage: Usage,
    reads_at_start: int = 0,
    turnover_bytes: int,
    snapshots: Sequence[SnapshotInfo],
    kept_for_resume: frozenset[str] = frozenset(),
    evict_after_reads: int = 1,
    counters: Counters,
    turnover_s: float | None,
    rates: tuple[float, float, float],
    objects_total: int,
    remote: RemoteTotals,
    samplers: Sequence[Mapping[str, Any]],
    plan: Mapping[str, Any] | None = None,
    sources: Sequence[Mapping[str, Any]] | None = None,
    quarantined: Sequence[Mapping[str, Any]] = (),
    now: float | None = None,
) -> dict[str, Any]:
    """The status document (see ``cachefeed._status.schema.STATUS_SCHEMA``).

    ``rates``: ingest bytes, samples and objects per second. ``turnover_s``: how long the last evicted segment
    stayed in the cache (None before the first eviction). Freshness and epoch reads (see "Epoch reads" in
    ``cachefeed/_cache/store.py``): ``cache.newest_age_s``/``oldest_age_s`` (ages of the newest and oldest published
    segments, None when empty), ``cache.unread_samples`` (cached samples no epoch has served yet),
    ``cache.fill`` (published bytes as a fraction of what the daemon fills to without readers:
    ``max_bytes`` less metadata; trainers' ``min_samples="75%"`` waits on it), ``cache.echo_factor`` (reads per
    sample of the samples of the last 64 evicted segments: the echo the two speeds set, ``CacheStore.echo_factor``),
    ``cache.ingest_bound``/``cache.is_remote_bound`` ("remote" when fresh samples did not fill the newest epoch,
    so epochs re-read the least-read samples; "trainer" when ingest waits for reads; null while no trainer reads
    and before a trainer's first epoch: ``CacheStore.ingest_bound`` states the rule; a snapshot whose trainer died,
    kept for a resume, is ``kept_for_resume`` in ``cache.snapshots`` and reads nothing), ``cache.epochs_total``
    (epoch snapshots seen), ``evicted.unread_samples_total`` (evicted before any epoch served
    them) and ``evicted.epochs_per_sample`` (epochs that served an evicted sample, on average; None before the first
    eviction). The read contract (NOTE [ Read receipts ] in ``_cache/reads.py``): ``cache.is_paced`` (ingest waits
    for trainers to read: normal, not a fault), ``cache.waiting_for_reads_samples`` (samples read fewer than
    ``cache.evict_after_reads`` times, while paced), ``cache.max_reads``/``evicted.max_reads`` (the most reads of a
    cached/evicted segment: its least-read sample's), ``cache.sample_reads_total`` (per sample, the epochs that
    served it, summed; evicted included) and ``remote.bytes_per_sample_read`` (bytes downloaded per sample read by an
    epoch, both since this daemon started: ``reads_at_start`` is the cached samples' reads then, from the ledger).
    Beyond the contract, ``remote`` also carries ``objects_failed_total`` (objects that could not be cached,
    any reason, counted per attempt at the object) and ``objects_dropped`` (objects dropped from the plan now: 404,
    403, too large); ``remote.not_cached`` (in the contract) counts the listed objects not cached for a reason, by
    reason (``not_found``, ``forbidden``, ``too_large``, ``decode``), ``remote.quarantined_samples_total`` the
    samples left out of objects whose other samples are cached, ``quarantined`` the most recent quarantined objects
    and samples (``_daemon/quarantine.py``), and ``plan`` (optional) describes the sampling plan (pass, in flight,
    owned objects...). ``sources`` (only with ``[[source]]`` tables) breaks the cache, ingest and errors down per
    named source: its weight, cached samples and their share of the cache, objects listed, objects/samples/bytes
    ingested, objects failed and not cached by reason.
    """
    now = time.time() if now is None else now
    sample_reads = counters.evicted_sample_reads + usage.sample_reads
    reads_since_start = sample_reads - reads_at_start  # this process's window, as ``remote.bytes_total``'s
    return {
        "version": STATUS_VERSION,
        "state": state,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started_at": started_at,
        "updated_at": now,
        "interval_s": interval_s,
        "degraded_reasons": list(degraded_reasons),
        "cache": {
            "dir": cache_dir,
            "bytes": usage.bytes,
            "max_bytes": usage.max_bytes,
            "samples": usage.samples,
            "fill": usage.fill,
            "echo_factor": usage.echo_factor,
            "ingest_bound": usage.ingest_bound,
            "is_remote_bound": None if usage.ingest_bound is None else usage.ingest_bound == "remote",
            "segments": usage.segments,
            "pinned_bytes": usage.pinned_bytes,
            "pinned_only_bytes": usage.pinned_only_bytes,
            "reserved_bytes": usage.reserved_bytes,
            "free_bytes": usage.free_bytes,
            "min_free_bytes": usage.min_free_bytes,
            "turnover_bytes": turnover_bytes,
            "is_backpressured": usage.is_backpressured,
            "is_paced": usage.is_paced,
            "is_out_of_space": usage.is_out_of_space,
            "waiting_for_reads_samples": usage.waiting_for_reads_samples,
            "evict_after_reads": evict_after_reads,
            "unread_samples": usage.unread_samples,
            "max_reads": usage.max_reads,
            "epochs_total": counters.epochs_seen,
            "sample_reads_total": sample_reads,
            "newest_age_s": _age(now, usage.newest_published_at),
            "oldest_age_s": _age(now, usage.oldest_published_at),
            "snapshots": [
                {
                    "id": snap.snap_id,
                    "samples": snap.samples,
                    "segments": snap.segments,
                    "owner": snap.owner,
                    "age_s": max(0.0, now - snap.created) if snap.created else 0.0,
                    "idle_s": max(0.0, now - max(snap.created, snap.active_at)),
                    "kept_for_resume": snap.snap_id in kept_for_resume,
                }
                for snap in snapshots
            ],
        },
        "ingest": {
            "bytes_per_s": rates[0],
            "samples_per_s": rates[1],
            "objects_per_s": rates[2],
            "objects_total": objects_total,
            "samples_total": counters.published_samples,
            "bytes_total": counters.published_bytes,
            "segments_total": counters.published_segments,
        },
        "evicted": {
            "samples_total": counters.evicted_samples,
            "bytes_total": counters.evicted_bytes,
            "segments_total": counters.evicted_segments,
            "turnover_s": turnover_s,
            "unread_samples_total": counters.evicted_unread_samples,
            "epochs_per_sample": (
                counters.evicted_sample_reads / counters.evicted_samples if counters.evicted_samples else None
            ),
            "max_reads": counters.evicted_max_reads,
            "retired_samples_total": counters.retired_samples,
            "retired_segments_total": counters.retired_segments,
        },
        "remote": {
            "url": remote.url,
            "objects_listed": remote.objects_listed,
            "last_listed_at": remote.last_listed_at or None,
            "list_errors_total": remote.list_errors_total,
            "list_requests_total": remote.list_requests_total,
            "list_requests_per_hour": remote.list_requests_per_hour,
            "refresh_interval_s": remote.refresh_interval_s,
            "passes_completed": remote.passes_completed,
            "requests_total": remote.requests_total,
            "retries_total": remote.retries_total,
            "errors_total": sum(remote.errors_by_kind.values()),
            "errors_by_kind": dict(remote.errors_by_kind),
            "quarantined_total": remote.quarantined_total,
            "quarantined_samples_total": remote.quarantined_samples_total,
            "bytes_total": remote.bytes_total,
            "bytes_per_sample_read": remote.bytes_total / reads_since_start if reads_since_start > 0 else None,
            "objects_failed_total": remote.objects_failed_total,
            "objects_dropped": remote.objects_dropped,
            "not_cached": dict(remote.not_cached),
        },
        "samplers": [dict(sampler) for sampler in samplers],
        "quarantined": [dict(entry) for entry in quarantined],
        "plan": dict(plan or {}),
        **({"sources": [dict(row) for row in sources]} if sources is not None else {}),
    }


def _age(now: float, at: float | None) -> float | None:
    return None if at is None else max(0.0, now - at)


def write_status(path: str | os.PathLike[str], document: Mapping[str, Any]) -> None:
    """Replace the status file atomically (readers see the old or the new document, never a mix)."""
    atomic_write(path, json.dumps(document, separators=(",", ":")).encode(), mode=STATUS_MODE)
