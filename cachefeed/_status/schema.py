"""The status document's contract, declared once: its version, its shape, and which of its numbers are metrics.

The daemon writes ``<cache>/status.json`` (built in ``_daemon/status_doc.py``); ``cachefeed status`` validates and
renders it (``_status/document.py``, ``_status/render.py``), trainers read their fill level from it
(``_trainer/wait.py``), and the Prometheus exporter turns it into metric families (``_status/metrics.py``). All of
them read this declaration: a key is added here,
with its metric if it should be one, and the builder fills it (``tests/daemon/test_daemon.py`` checks a real daemon's
document against ``STATUS_SCHEMA``: every declared key present with its shape, no undeclared key).

Shapes: ``NUM`` any JSON number (bool excluded), ``INT`` an integer, ``OPT_*`` also null, a Python type or tuple
of types for ``isinstance``, ``[shape]`` a list of that shape, ``{str: shape}`` a map with free keys, a dict a
JSON object with exactly those keys (extra keys are tolerated by readers, for forward compatibility within a
version). ``Omittable(shape)`` is written by the daemon but not required by readers. ``Scalar(shape, metric)`` is
a number that is also exported as a Prometheus metric (name, ``gauge`` or ``counter``: the client adds ``_total``,
help); a null value is not exported (not known yet: absent, not 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "INT",
    "NUM",
    "OPT_INT",
    "OPT_NUM",
    "OPT_STR",
    "SOURCE_ROW",
    "STATUS_SCHEMA",
    "STATUS_VERSION",
    "Metric",
    "Omittable",
    "Scalar",
    "metric_scalars",
    "shape_error",
    "undeclared_keys",
]

STATUS_VERSION = 1


class _Number:
    """A JSON number (bool excluded); ``optional`` also admits null."""

    def __init__(self, *, optional: bool = False, integer: bool = False) -> None:
        self.optional = optional
        self.integer = integer

    def check(self, value: object) -> bool:
        if value is None:
            return self.optional
        kinds: tuple[type, ...] = (int,) if self.integer else (int, float)
        return isinstance(value, kinds) and not isinstance(value, bool)


NUM, OPT_NUM = _Number(), _Number(optional=True)
INT, OPT_INT = _Number(integer=True), _Number(integer=True, optional=True)
OPT_STR = (str, type(None))


@dataclass(frozen=True, slots=True)
class Metric:
    """How a scalar of the document is exported (see the module docstring)."""

    name: str
    kind: str  # "gauge" or "counter"
    help: str


@dataclass(frozen=True, slots=True)
class Scalar:
    """A field of the document that is also a metric."""

    shape: Any
    metric: Metric
    is_omittable: bool = False  # as ``Omittable``: documents from before it was added lack it


@dataclass(frozen=True, slots=True)
class Omittable:
    """A field the daemon writes but readers do not require (documents from before it was added lack it)."""

    shape: Any


def _gauge(shape: Any, name: str, help_text: str) -> Scalar:
    return Scalar(shape, Metric(name, "gauge", help_text))


def _counter(name: str, help_text: str) -> Scalar:
    return Scalar(NUM, Metric(name, "counter", help_text))


BOOL = (bool, int)

# One row of ``sources`` (named sources only). Its Scalars are exported with a ``source`` label (_status/metrics.py).
SOURCE_ROW: dict[str, Any] = {
    "name": str,
    "url": str,
    "weight": _gauge(NUM, "cachefeed_source_weight", "A source's share of the cache and of every epoch."),
    "cached_samples": _gauge(NUM, "cachefeed_source_cached_samples", "Cached samples of a source."),
    "cached_share": OPT_NUM,  # cached_samples over all sources' (null while the cache is empty)
    "objects_listed": _gauge(NUM, "cachefeed_source_objects_listed", "Objects in a source's last listing."),
    "objects_cached": Scalar(
        NUM,
        Metric("cachefeed_source_objects_cached", "gauge", "A source's objects (this node's) cached whole."),
        is_omittable=True,
    ),
    "list_errors_total": _counter("cachefeed_source_list_errors", "Failed listings of a source."),
    "objects_total": _counter("cachefeed_source_objects", "Objects of a source ingested."),
    "samples_total": _counter("cachefeed_source_samples", "Samples of a source written to the cache."),
    "bytes_total": _counter("cachefeed_source_bytes", "Segment bytes of a source published."),
    "objects_failed_total": _counter("cachefeed_source_objects_failed", "Objects of a source that failed."),
    "not_cached": {str: NUM},
    "pass": INT,
    "cached_whole": Omittable(bool),  # every object of this node's share it can cache is cached
    "passes_completed": Scalar(
        NUM,
        Metric("cachefeed_source_passes_completed", "counter", "Passes over a source's listing."),
        is_omittable=True,
    ),
}

STATUS_SCHEMA: dict[str, Any] = {
    "version": INT,
    "state": str,
    "pid": INT,
    "host": str,
    "started_at": _gauge(NUM, "cachefeed_start_timestamp_seconds", "When the daemon started (unix time)."),
    "updated_at": _gauge(NUM, "cachefeed_status_updated_timestamp_seconds", "When the status was last written."),
    "degraded_reasons": [str],
    "interval_s": Omittable(NUM),  # the daemon's status.interval: readers judge staleness by it
    "cache": {
        "bytes": _gauge(NUM, "cachefeed_cache_bytes", "Bytes counted against the budget (all of the cache dir)."),
        "max_bytes": _gauge(NUM, "cachefeed_cache_max_bytes", "The cache's byte budget."),
        "samples": _gauge(NUM, "cachefeed_cache_samples", "Samples in published segments."),
        "segments": _gauge(NUM, "cachefeed_cache_segments", "Published segments."),
        "pinned_bytes": _gauge(NUM, "cachefeed_cache_pinned_bytes", "Bytes held by live snapshots."),
        "fill": _gauge(NUM, "cachefeed_cache_fill_ratio", "Published bytes / what the daemon fills to unread."),
        "pinned_only_bytes": _gauge(
            NUM, "cachefeed_cache_pinned_only_bytes", "Bytes of evicted segments kept only by snapshots."
        ),
        "reserved_bytes": _gauge(NUM, "cachefeed_cache_reserved_bytes", "Bytes reserved for segments in writing."),
        "free_bytes": _gauge(NUM, "cachefeed_cache_free_bytes", "Free bytes on the cache's filesystem."),
        "min_free_bytes": _gauge(NUM, "cachefeed_cache_min_free_bytes", "The free-space floor."),
        "dir": str,
        "turnover_bytes": _gauge(NUM, "cachefeed_cache_turnover_bytes", "Room kept for fresh samples."),
        "is_backpressured": _gauge(BOOL, "cachefeed_cache_backpressured", "1 while fetching waits on pins."),
        "is_paced": _gauge(BOOL, "cachefeed_cache_paced", "1 while ingest waits for trainers to read (normal)."),
        "is_out_of_space": Scalar(
            BOOL,
            Metric("cachefeed_cache_out_of_space", "gauge", "1 while ingest waits for room on the cache's filesystem."),
            is_omittable=True,
        ),
        "waiting_for_reads_samples": _gauge(
            NUM,
            "cachefeed_cache_waiting_for_reads_samples",
            "While paced: cached samples read fewer than evict_after_reads times.",
        ),
        "evict_after_reads": NUM,
        "echo_factor": Scalar(
            OPT_NUM,
            Metric("cachefeed_echo_factor", "gauge", "Reads per sample of the last 64 evicted segments."),
            is_omittable=True,
        ),
        # "remote", "trainer" (always while paced with a trainer), or null: no trainer reads (no snapshot), or none
        # of its epochs judged yet (CacheStore.ingest_bound states the rule)
        "ingest_bound": Omittable(OPT_STR),
        "is_remote_bound": Scalar(
            (bool, int, type(None)),
            Metric(
                "cachefeed_ingest_remote_bound",
                "gauge",
                "1 when fresh samples arrive slower than training reads (epochs re-read the least-read), 0 when "
                "ingest waits for training; absent while no trainer reads.",
            ),
            is_omittable=True,
        ),
        "unread_samples": _gauge(NUM, "cachefeed_cache_unread_samples", "Cached samples no epoch has served yet."),
        "max_reads": _gauge(NUM, "cachefeed_cache_max_reads", "Most reads of a cached segment (least-read sample)."),
        "epochs_total": _counter("cachefeed_cache_epochs", "Epoch reads reported by trainers."),
        "sample_reads_total": _counter("cachefeed_cache_sample_reads", "Per sample, epochs that served it, summed."),
        "newest_age_s": _gauge(OPT_NUM, "cachefeed_cache_newest_age_seconds", "Age of the newest published segment."),
        "oldest_age_s": _gauge(OPT_NUM, "cachefeed_cache_oldest_age_seconds", "Age of the oldest published segment."),
        "snapshots": [
            {
                "id": str,
                "samples": NUM,
                "segments": NUM,
                "owner": str,
                "age_s": NUM,
                "idle_s": NUM,
                "kept_for_resume": Omittable(bool),
            }
        ],
    },
    "ingest": {
        **{k: NUM for k in ("bytes_per_s", "samples_per_s", "objects_per_s")},
        "objects_total": _counter("cachefeed_ingest_objects", "Remote objects ingested."),
        "samples_total": _counter("cachefeed_ingest_samples", "Samples written to the cache."),
        "bytes_total": _counter("cachefeed_ingest_bytes", "Segment bytes published."),
        "segments_total": _counter("cachefeed_ingest_segments", "Segments published."),
    },
    "evicted": {
        "samples_total": _counter("cachefeed_evicted_samples", "Samples evicted."),
        "bytes_total": _counter("cachefeed_evicted_bytes", "Bytes evicted."),
        "segments_total": _counter("cachefeed_evicted_segments", "Segments evicted."),
        "unread_samples_total": _counter(
            "cachefeed_evicted_unread_samples", "Samples evicted before any epoch served them."
        ),
        "turnover_s": _gauge(
            OPT_NUM, "cachefeed_cache_turnover_seconds", "How long the last evicted segment stayed in the cache."
        ),
        "epochs_per_sample": _gauge(
            OPT_NUM, "cachefeed_evicted_epochs_per_sample", "Epochs that served an evicted sample, on average."
        ),
        "max_reads": _gauge(NUM, "cachefeed_evicted_max_reads", "Most reads of an evicted segment."),
        "retired_samples_total": Scalar(
            NUM,
            Metric(
                "cachefeed_retired_samples",
                "counter",
                "Samples evicted because the remote overwrote or deleted their objects, with their segments' others.",
            ),
            is_omittable=True,
        ),
        "retired_segments_total": Scalar(
            NUM,
            Metric(
                "cachefeed_retired_segments",
                "counter",
                "Segments evicted because the remote overwrote or deleted objects in them.",
            ),
            is_omittable=True,
        ),
    },
    "remote": {
        "url": str,
        "objects_listed": _gauge(NUM, "cachefeed_remote_objects_listed", "Objects in the last listing."),
        "last_listed_at": _gauge(
            OPT_NUM,
            "cachefeed_remote_last_listed_timestamp_seconds",
            "When the remote was last listed (absent before the first listing).",
        ),
        "list_errors_total": _counter("cachefeed_remote_list_errors", "Failed listings."),
        "list_requests_total": Scalar(
            NUM,
            Metric(
                "cachefeed_remote_list_requests",
                "counter",
                "LIST requests this node sent (0 with a manifest or shared catalog).",
            ),
            is_omittable=True,
        ),
        "list_requests_per_hour": Scalar(
            NUM,
            Metric(
                "cachefeed_remote_list_requests_per_hour",
                "gauge",
                "LIST requests per hour at the current refresh interval (the last listing's, steady state).",
            ),
            is_omittable=True,
        ),
        "refresh_interval_s": Scalar(
            NUM,
            Metric("cachefeed_remote_refresh_interval_seconds", "gauge", "The refresh interval in force (adapted)."),
            is_omittable=True,
        ),
        "passes_completed": _counter("cachefeed_remote_passes_completed", "Passes over the catalog."),
        "requests_total": _counter("cachefeed_remote_requests", "Requests sent to the remote."),
        "retries_total": _counter("cachefeed_remote_retries", "Requests that were retries."),
        "errors_total": NUM,  # exported by kind (_status/metrics.py), with the remainder as "other"
        "errors_by_kind": {str: NUM},
        "quarantined_total": _counter("cachefeed_remote_quarantined_objects", "Objects quarantined."),
        "quarantined_samples_total": Scalar(
            NUM,
            Metric(
                "cachefeed_remote_quarantined_samples",
                "counter",
                "Samples left out of objects whose other samples are cached (a tar member that failed to decode).",
            ),
            is_omittable=True,
        ),
        "not_cached": {str: NUM},
        "objects_failed_total": Omittable(NUM),  # objects that failed once or more (retried in later passes)
        "objects_dropped": Omittable(NUM),  # dropped from the plan now: 404, 403, too large
        "bytes_total": _counter("cachefeed_remote_bytes", "Bytes downloaded."),
        "bytes_per_sample_read": _gauge(
            OPT_NUM,
            "cachefeed_remote_sample_read_cost_bytes",
            "Bytes downloaded per sample read by an epoch (absent before the first read).",
        ),
    },
    "samplers": [
        {"index": INT, "pid": OPT_INT, "state": str, "restarts": NUM, "objects_total": NUM, "last_error": OPT_STR}
    ],
    # the most recent quarantined objects (key null) and left-out samples, newest first, at most 20
    "quarantined": Omittable([{"url": str, "key": OPT_STR, "kind": str, "reason": str, "at": NUM}]),
    "sources": Omittable([SOURCE_ROW]),  # only with [[source]] tables: the cache, ingest and errors per source
    "plan": Omittable(  # the sampling plan: its pass over the remote, this node's share
        {
            "pass": INT,
            "owned": NUM,
            "in_flight": NUM,
            "requeued_total": NUM,
            "skipped_cached_total": NUM,
            "node_rank": INT,
            "node_count": INT,
        }
    ),
}


def metric_scalars() -> Iterator[tuple[str, str, Metric]]:
    """``(section, key, metric)`` for every scalar exported as a metric (section "" for the document's top)."""
    for key, spec in STATUS_SCHEMA.items():
        if isinstance(spec, Scalar):
            yield "", key, spec.metric
        elif isinstance(spec, dict):
            for inner, inner_spec in spec.items():
                if isinstance(inner_spec, Scalar):
                    yield key, inner, inner_spec.metric


def undeclared_keys(value: object, spec: object = None, where: str = "") -> list[str]:
    """Keys of ``value`` (a document) that ``spec`` (default ``STATUS_SCHEMA``) does not declare, as dotted paths.

    Readers tolerate them; the daemon's builder must not produce them (a test holds it to that)."""
    spec = STATUS_SCHEMA if spec is None else spec
    if isinstance(spec, Scalar | Omittable):
        spec = spec.shape
    found: list[str] = []
    if isinstance(spec, list) and isinstance(value, list):
        for i, item in enumerate(value):
            found += undeclared_keys(item, spec[0], f"{where}[{i}]")
    elif isinstance(spec, dict) and isinstance(value, dict):
        for key, item in value.items():
            if str in spec:
                found += undeclared_keys(item, spec[str], f"{where}.{key}")
            elif key not in spec:
                found.append(f"{where}.{key}".lstrip("."))
            else:
                found += undeclared_keys(item, spec[key], f"{where}.{key}")
    return found


def shape_error(value: object, spec: object, where: str = "") -> str | None:
    """None if ``value`` matches ``spec``, else a short description of the first mismatch."""
    if isinstance(spec, Scalar | Omittable):
        spec = spec.shape
    if isinstance(spec, _Number):
        return None if spec.check(value) else f"{where}: expected a number, got {type(value).__name__}"
    if isinstance(spec, type | tuple):
        return None if isinstance(value, spec) else f"{where}: unexpected {type(value).__name__}"
    if isinstance(spec, list):
        if not isinstance(value, list):
            return f"{where}: expected a list"
        for i, item in enumerate(value):
            if problem := shape_error(item, spec[0], f"{where}[{i}]"):
                return problem
        return None
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{where}: expected an object"
        if str in spec:  # a map with free keys
            for key, item in value.items():
                if problem := shape_error(item, spec[str], f"{where}.{key}"):
                    return problem
            return None
        for key, item_spec in spec.items():
            if key not in value:
                if isinstance(item_spec, Omittable) or (isinstance(item_spec, Scalar) and item_spec.is_omittable):
                    continue
                return f"{where}.{key} is missing".lstrip(".")
            if problem := shape_error(value[key], item_spec, f"{where}.{key}".lstrip(".")):
                return problem
        return None
    raise TypeError(f"bad schema entry {spec!r}")  # pragma: no cover - a programming error
