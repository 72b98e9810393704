"""What the supervisor tells the world: the status document, its health verdict, the metrics, a one-line summary.

``StatusReporter`` gathers one consistent picture from the store, the sampler pool, the catalog and the plan,
decides whether the daemon is ``degraded`` (and why), writes ``status.json`` through ``status_doc`` and feeds the
Prometheus exporter the same document. Called from the supervisor's main loop only.

Degraded reasons:

* a sampler is restarting (it died; its backoff has not elapsed), writes one object for longer than
  ``status.stuck_after`` (``Supervisor._watch_writers``), has sent nothing for that long (``pool.py``,
  "Silence"), or holds objects that long while ingest waits for them (``Supervisor._watch_held``);
* the latest listing attempt failed (the previous listing stays in force);
* nearly every remote request of the last ``RATE_WINDOW_S`` seconds failed (at least a few requests).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from cachefeed._cache.snapshots import SnapshotInfo, live_snapshots
from cachefeed._cache.store import CacheStore
from cachefeed._config import Config
from cachefeed._daemon.pool import SamplerPool, SamplerState
from cachefeed._daemon.quarantine import QuarantineLog
from cachefeed._daemon.sources import Inputs
from cachefeed._daemon.status_doc import RateMeter, RemoteTotals, build_status, write_status
from cachefeed._logs import get_logger
from cachefeed._scrub import safe_url
from cachefeed._units import format_bytes

if TYPE_CHECKING:  # loaded only where metrics are configured (Supervisor.run): prometheus_client is not light
    from cachefeed._status.metrics import MetricsExporter

__all__ = ["RATE_WINDOW_S", "StatusReporter"]

log = get_logger(__name__)

RATE_WINDOW_S = 10.0
_FAILING_MIN_REQUESTS = 3
_FAILING_RATIO = 0.9


class StatusReporter:
    """Builds and publishes the status document (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        *,
        store: CacheStore,
        pool: SamplerPool,
        inputs: Inputs,
        metrics: MetricsExporter | None,
        started_at: float,
        quarantine: QuarantineLog | None = None,
    ) -> None:
        self._config = config
        self._quarantine = quarantine or QuarantineLog()
        self._store = store
        self._pool = pool
        self._inputs = inputs
        self._metrics = metrics
        self._started_at = started_at
        # the cached samples' reads when this daemon began reporting (the ledger keeps earlier runs' reads): what
        # ``bytes_per_sample_read`` divides by is the reads since, as the bytes are this process's downloads
        self._reads_at_start = store.usage().sample_reads
        self._rates = RateMeter(RATE_WINDOW_S)
        self._remote_window = RateMeter(RATE_WINDOW_S)
        self.last: dict[str, Any] | None = None
        self._write_failing = ""  # the cause of the last status write's failure ("" while writes succeed)

    def publish(self, state: str, *, turnover_s: float | None) -> str:
        """Write the document for ``state`` ("running" becomes "degraded" when reasons exist, and back).

        Returns the state written. A failing write is logged, never raised: the daemon keeps serving.
        """
        document = self.document(state, turnover_s=turnover_s)
        self.last = document
        try:
            write_status(self._store.layout.status_file, document)
        except OSError as exc:
            try:  # the file's time still says the daemon lives (no free block needed): _status/report.py reads it
                os.utime(self._store.layout.status_file)
            except OSError:
                pass
            cause = exc.strerror or str(exc)  # not the message: it may name a temporary file
            if cause != self._write_failing:  # once per cause, not at every interval
                log.warning("cannot write the status file (cachefeed status shows the last one written): %s", exc)
            self._write_failing = cause
        else:
            if self._write_failing:
                log.info("the status file is written again")
            self._write_failing = ""
        if self._metrics is not None:
            self._metrics.update(document)
        return str(document["state"])

    def document(self, state: str, *, turnover_s: float | None) -> dict[str, Any]:
        store, plan = self._store, self._inputs
        counters = store.counters
        remote = self._remote_totals()
        snapshots = live_snapshots(store.layout)
        reasons = self._degraded_reasons(remote) + self._stuck_readers(snapshots)
        if state in ("running", "degraded"):
            state = "degraded" if reasons else "running"
        objects_total = plan.counters.done_total
        rates = self._rates.add(time.monotonic(), (counters.published_bytes, counters.published_samples, objects_total))
        samplers = [
            {
                "index": h.index,
                "pid": h.pid if h.is_alive else None,
                "state": "silent" if h.silent else h.state.value,  # running, but nothing heard (pool.py)
                "restarts": h.restarts,
                "objects_total": h.base_objects_total + h.objects_total,
                "last_error": h.last_error or None,
            }
            for h in self._pool.handles
        ]
        return build_status(
            state=state,
            started_at=self._started_at,
            interval_s=self._config.status.interval_s,
            degraded_reasons=reasons,
            cache_dir=str(self._config.cache.dir),
            usage=store.usage(),
            reads_at_start=self._reads_at_start,
            turnover_bytes=self._config.cache.turnover_bytes,
            snapshots=snapshots,
            kept_for_resume=frozenset(store.orphaned_snapshots),
            evict_after_reads=self._config.cache.evict_after_reads,
            counters=counters,
            turnover_s=turnover_s,
            rates=(rates[0], rates[1], rates[2]),
            objects_total=objects_total,
            remote=remote,
            samplers=samplers,
            sources=self._inputs.table(store.samples_by_source()) if self._inputs.is_named else None,
            quarantined=self._quarantine.recent(),
            plan={
                "pass": plan.pass_index,
                "owned": plan.owned,
                "in_flight": plan.in_flight,
                "requeued_total": plan.counters.requeued_total,
                "skipped_cached_total": plan.counters.skipped_cached_total,
                "node_rank": self._config.node.rank,
                "node_count": self._config.node.count,
            },
        )

    def line(self) -> str:
        """One line for ``systemctl status`` (sd_notify ``STATUS=``)."""
        document = self.last
        if document is None:
            return "starting"
        cache, ingest = document["cache"], document["ingest"]
        live = sum(1 for s in document["samplers"] if s["state"] == "running")
        return (
            f"{document['state']}: {format_bytes(cache['bytes'])} of {format_bytes(cache['max_bytes'])}, "
            f"{cache['samples']} samples, {format_bytes(ingest['bytes_per_s'])}/s in, "
            f"{live}/{len(document['samplers'])} samplers"
        )

    def _remote_totals(self) -> RemoteTotals:
        catalog = self._inputs.catalog_state()
        stats: list[dict[str, Any]] = [*self._pool.retired_stats, *(h.stats for h in self._pool.handles if h.stats)]
        errors: dict[str, int] = {}
        for entry in stats:
            for kind, n in dict(entry.get("errors_total") or {}).items():
                errors[kind] = errors.get(kind, 0) + int(n)
        return RemoteTotals(
            url=", ".join(safe_url(entry.config.url) for entry in self._inputs.inputs),
            objects_listed=catalog.objects_listed,
            last_listed_at=catalog.last_listed_at,
            list_errors_total=catalog.list_errors_total,
            passes_completed=self._inputs.counters.passes_completed,
            requests_total=sum(int(entry.get("requests_total", 0)) for entry in stats),
            retries_total=sum(int(entry.get("retries_total", 0)) for entry in stats),
            errors_by_kind=errors,
            quarantined_total=self._inputs.counters.quarantined_total,
            quarantined_samples_total=self._quarantine.samples_total,
            bytes_total=sum(int(entry.get("bytes_total", 0)) for entry in stats),
            objects_failed_total=self._inputs.counters.failed_total,
            objects_dropped=self._inputs.dropped,
            not_cached=self._inputs.not_cached,
            list_requests_total=catalog.list_requests_total,
            list_requests_per_hour=catalog.list_requests_per_hour,
            refresh_interval_s=catalog.refresh_interval_s,
        )

    def _stuck_readers(self, snapshots: list[SnapshotInfo]) -> list[str]:
        """A trainer that holds a pin but stopped reading while fetching waits on it is a fault; one that reads
        slowly is the normal paced state. Progress is the snapshot's last ``touch`` (every few seconds while an
        epoch reads it); snapshots of dead trainers kept for resume (``cache.snapshot_grace``) are not stuck."""
        usage = self._store.usage()
        if not (usage.is_paced or usage.is_backpressured):
            return []
        now, limit = time.time(), self._config.status.stuck_after_s
        orphaned = set(self._store.orphaned_snapshots)
        reasons = []
        for snap in snapshots:
            idle = now - max(snap.created, snap.active_at)
            if snap.snap_id not in orphaned and idle > limit:
                reasons.append(
                    f"stuck trainer: {snap.owner} has read nothing from snapshot {snap.snap_id} for {idle:.0f}s "
                    f"(status.stuck_after = {limit:g}s) while fetching waits for it: check that trainer"
                )
        return reasons

    def _degraded_reasons(self, remote: RemoteTotals) -> list[str]:
        reasons = [
            f"sampler {h.index} restarting ({h.last_error or 'exited'})"
            for h in self._pool.handles
            if h.state is SamplerState.RESTARTING
        ]
        reasons += [h.hung for h in self._pool.handles if h.hung]
        reasons += [h.silent or h.holding_up for h in self._pool.handles if h.silent or h.holding_up]
        catalog = self._inputs.catalog_state()
        if catalog.is_failing:
            reasons.append(f"listing the remote fails: {catalog.last_error}")
        reasons += self._inputs.empty_listings()
        reasons += self._inputs.uncacheable()
        reasons += self._store.write_problems.values()
        if self._store.is_out_of_space:
            reasons.append(self._store.out_of_space_reason())
        requests_per_s, errors_per_s = self._remote_window.add(
            time.monotonic(), (remote.requests_total, sum(remote.errors_by_kind.values()))
        )
        if requests_per_s * RATE_WINDOW_S >= _FAILING_MIN_REQUESTS and errors_per_s >= _FAILING_RATIO * requests_per_s:
            reasons.append("the remote fails: nearly every recent request failed")
        return reasons
