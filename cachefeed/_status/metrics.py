"""Prometheus metrics, generated from the status document so that metrics and ``cachefeed status`` always agree.

The daemon builds one ``MetricsExporter(config.status)`` at start-up and calls ``update(document)`` each time it
publishes ``status.json`` (same document, same instant), and ``close()`` on the way out (after publishing the
final "stopped" document). The exporter keeps only the latest document; a collector on a private
``CollectorRegistry`` turns it into metric families when scraped, so no value is ever copied twice.

Outputs, both optional (``[status]`` in the config):

- ``metrics_port``: an HTTP endpoint on ``<metrics_address>:<port>/metrics`` (127.0.0.1 unless configured; "0.0.0.0"
  for a scrape from another pod, as in ``deploy/kubernetes``; the standard client's server, in a daemon thread). A
  port that cannot be bound raises ``ConfigError`` at construction (exit 78: systemd must not loop).
- ``metrics_textfile``: a file for node-exporter's textfile collector (name it ``*.prom``), rewritten atomically
  (temp file in the same directory, then rename; the temp name does not end in ``.prom``) with mode 0644 at each
  ``update``. Its parent directory must exist. A failing write is logged once per distinct error and retried at
  the next update; it never stops the daemon.

Metric names follow the Prometheus conventions (base units, ``_bytes``/``_seconds``/``_total`` suffixes,
``_timestamp_seconds`` for unix times). Rates are not exported: use ``rate()`` on the counters. Labels are bounded:
``state``, ``sampler`` (index), ``kind`` (remote error kind), ``reason``, ``source`` (a ``[[source]]`` name: at most
32). Snapshot ids are not labels (one per epoch: unbounded), only their count is exported.
``cachefeed_status_updated_timestamp_seconds`` lets alerts catch a stale textfile (``time() - ... > 30``) after the
daemon died.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cachefeed._config import StatusConfig
from cachefeed._errors import ConfigError
from cachefeed._fsutil import atomic_write
from cachefeed._logs import get_logger
from cachefeed._status.schema import SOURCE_ROW, Scalar, metric_scalars

__all__ = ["STATES", "MetricsExporter", "StatusCollector", "render_metrics"]

logger = get_logger(__name__)

STATES = ("starting", "running", "degraded", "stopping", "stopped")
SAMPLER_STATES = ("starting", "running", "silent", "restarting", "stopped")
TEXTFILE_MODE = 0o644  # node-exporter runs as its own user

# (section, key, metric name, kind, help): declared with the document's fields in _status/schema.py.
_SCALARS: tuple[tuple[str, str, str, str, str], ...] = tuple(
    (section, key, metric.name, metric.kind, metric.help) for section, key, metric in metric_scalars()
)


def _number(value: object) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return 0.0


def _section(document: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    if not name:
        return document
    value = document.get(name)
    return value if isinstance(value, Mapping) else {}


class StatusCollector:
    """A custom collector over the latest status document (thread-safe: the HTTP thread scrapes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._document: Mapping[str, Any] | None = None

    def set(self, document: Mapping[str, Any]) -> None:
        with self._lock:
            self._document = document

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            document = self._document
        if document is None:
            return
        state = str(document.get("state", ""))
        states = GaugeMetricFamily("cachefeed_state", "The daemon's state (1 for the current one).", labels=["state"])
        for name in (*STATES, *([state] if state not in STATES else [])):
            states.add_metric([name], 1.0 if name == state else 0.0)
        yield states
        yield GaugeMetricFamily(
            "cachefeed_degraded",
            "1 while the daemon reports degraded reasons.",
            value=1.0 if document.get("degraded_reasons") or state == "degraded" else 0.0,
        )
        for section, key, name, kind, help_text in _SCALARS:
            raw = _section(document, section).get(key)
            if raw is None:
                continue  # not known yet (no eviction, no listing): absent, not a misleading 0
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family_type(name, help_text, value=_number(raw))
        snapshots = _section(document, "cache").get("snapshots")
        yield GaugeMetricFamily(
            "cachefeed_cache_snapshots",
            "Live epoch snapshots.",
            value=float(len(snapshots)) if isinstance(snapshots, list) else 0.0,
        )
        yield from self._remote_errors(_section(document, "remote"))
        yield from self._samplers(document.get("samplers"))
        yield from self._sources(document.get("sources"))

    @staticmethod
    def _remote_errors(remote: Mapping[str, Any]) -> Iterator[Metric]:
        errors = CounterMetricFamily(
            "cachefeed_remote_errors", "Failed remote requests by error kind.", labels=["kind"]
        )
        by_kind = remote.get("errors_by_kind")
        counted = 0.0
        if isinstance(by_kind, Mapping):
            for kind, count in sorted(by_kind.items()):
                errors.add_metric([str(kind)], _number(count))
                counted += _number(count)
        rest = _number(remote.get("errors_total")) - counted
        if rest > 0:
            errors.add_metric(["other"], rest)
        yield errors
        not_cached = GaugeMetricFamily(
            "cachefeed_remote_objects_not_cached",
            "Listed objects not cached for a reason, by reason.",
            labels=["reason"],
        )
        reasons = remote.get("not_cached")
        if isinstance(reasons, Mapping):
            for reason, count in sorted(reasons.items()):
                not_cached.add_metric([str(reason)], _number(count))
        yield not_cached

    @staticmethod
    def _sources(sources: object) -> Iterator[Metric]:
        """Each named source's numbers, labelled by its name (declared in ``_status/schema.py``'s ``SOURCE_ROW``)."""
        rows = [row for row in sources if isinstance(row, Mapping)] if isinstance(sources, list) else []
        if not rows:
            return
        for key, spec in SOURCE_ROW.items():
            if not isinstance(spec, Scalar):
                continue
            metric = spec.metric
            family_type = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
            family = family_type(metric.name, metric.help, labels=["source"])
            for row in rows:
                if row.get(key) is not None:
                    family.add_metric([str(row.get("name", "?"))], _number(row.get(key)))
            yield family
        not_cached = GaugeMetricFamily(
            "cachefeed_source_objects_not_cached",
            "Listed objects of a source not cached for a reason, by reason.",
            labels=["source", "reason"],
        )
        for row in rows:
            reasons = row.get("not_cached")
            for reason, count in sorted(reasons.items()) if isinstance(reasons, Mapping) else []:
                not_cached.add_metric([str(row.get("name", "?")), str(reason)], _number(count))
        yield not_cached

    @staticmethod
    def _samplers(samplers: object) -> Iterator[Metric]:
        restarts = CounterMetricFamily(
            "cachefeed_sampler_restarts", "Restarts of each sampler process.", labels=["sampler"]
        )
        objects = CounterMetricFamily(
            "cachefeed_sampler_objects", "Remote objects ingested by each sampler slot.", labels=["sampler"]
        )
        states = GaugeMetricFamily(
            "cachefeed_sampler_state", "Each sampler's state (1 for the current one).", labels=["sampler", "state"]
        )
        for sampler in samplers if isinstance(samplers, list) else []:
            if not isinstance(sampler, Mapping):
                continue
            index = str(sampler.get("index", "?"))
            restarts.add_metric([index], _number(sampler.get("restarts")))
            objects.add_metric([index], _number(sampler.get("objects_total")))
            current = str(sampler.get("state", ""))
            for name in (*SAMPLER_STATES, *([current] if current not in SAMPLER_STATES else [])):
                states.add_metric([index, name], 1.0 if name == current else 0.0)
        yield restarts
        yield objects
        yield states


def render_metrics(document: Mapping[str, Any]) -> bytes:
    """The Prometheus text exposition of one status document."""
    registry = CollectorRegistry(auto_describe=False)
    collector = StatusCollector()
    collector.set(document)
    registry.register(collector)
    return bytes(generate_latest(registry))


class MetricsExporter:
    """Serves and/or writes the metrics of the latest status document (see the module docstring).

    Lifecycle: construct (binds the port, checks the textfile's directory), ``update`` many times from one
    thread, ``close`` once (stops the server; the textfile is left with the last document, whose
    ``cachefeed_state`` and timestamp tell what happened).
    """

    def __init__(self, config: StatusConfig) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = StatusCollector()
        self.registry.register(self._collector)
        self._textfile = Path(config.metrics_textfile) if config.metrics_textfile else None
        self._last_error = ""
        self._server: Any = None
        self._thread: threading.Thread | None = None
        if self._textfile is not None and not self._textfile.parent.is_dir():
            raise ConfigError(
                f"status.metrics_textfile = {config.metrics_textfile!r}: directory {self._textfile.parent} "
                "does not exist (create it, or leave metrics_textfile empty)"
            )
        self.port = 0
        if config.metrics_port:
            try:
                self._server, self._thread = start_http_server(
                    config.metrics_port, addr=config.metrics_address, registry=self.registry
                )
            except OSError as exc:
                raise ConfigError(
                    f"status.metrics_port = {config.metrics_port}: cannot listen on "
                    f"{config.metrics_address}:{config.metrics_port} ({exc.strerror or exc}): choose a free port "
                    "(or another status.metrics_address), or 0 to turn the endpoint off"
                ) from None
            self.port = int(self._server.server_port)
            logger.info("Prometheus metrics on http://%s:%d/metrics", config.metrics_address, self.port)

    def update(self, document: Mapping[str, Any]) -> None:
        """Publish ``document`` (the one just written to status.json) to both outputs."""
        self._collector.set(document)
        if self._textfile is None:
            return
        try:
            atomic_write(self._textfile, generate_latest(self.registry), mode=TEXTFILE_MODE)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc.strerror or exc}"
            if error != self._last_error:
                logger.warning("cannot write the metrics textfile %s (%s); will retry", self._textfile, error)
                self._last_error = error
        else:
            self._last_error = ""

    def close(self) -> None:
        """Stop the HTTP endpoint (idempotent). The textfile stays."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
