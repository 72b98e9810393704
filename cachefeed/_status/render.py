"""The two renderings of a ``StatusReport``: ``to_json`` (``cachefeed status --json``) and ``render_human``.

Human output fits ``WIDTH`` (80) columns. Strings from the document (URL, errors, snapshot owners) are shown with
control characters replaced, so a hostile remote key in an error message cannot send terminal escapes.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cachefeed._errors import EX_USAGE, CachefeedError, ConfigError, NoSuchCacheError
from cachefeed._status.directory import DirectorySummary
from cachefeed._status.report import StatusReport
from cachefeed._status.schema import STATUS_VERSION
from cachefeed._status.verdict import Health
from cachefeed._units import format_bytes, format_duration

__all__ = ["WIDTH", "error_json", "render_human", "to_json"]


def to_json(report: StatusReport) -> dict[str, Any]:
    """The ``--json`` document: the daemon's document, plus ``heartbeat_age_s`` and ``health``.

    Without a usable document: ``state`` and ``heartbeat_age_s`` are null and ``cache`` holds what the directory
    shows (``DirectorySummary``).
    """
    health = {"status": report.health.name.lower(), "exit_status": int(report.health), "reasons": list(report.reasons)}
    if report.document is not None:
        return {**report.document, "heartbeat_age_s": round(report.heartbeat_age_s or 0.0, 3), "health": health}
    directory = report.directory.as_dict() if report.directory is not None else {"dir": str(report.cache_dir)}
    return {"version": STATUS_VERSION, "state": None, "heartbeat_age_s": None, "health": health, "cache": directory}


# What ``health.status`` says where ``cachefeed status`` has no report to give, by exit code: a verdict's name, or
# the error's (``_errors``; the table is in ``_status/verdict.py``)
_ERROR_STATUSES = {
    **{int(health): health.name.lower() for health in Health},
    NoSuchCacheError.exit_code: "no_such_cache", ConfigError.exit_code: "bad_config", EX_USAGE: "usage_error",
}  # fmt: skip


def error_json(cache_dir: Path | None, error: CachefeedError) -> dict[str, Any]:
    """The ``--json`` document where there is no report: ``error`` stopped the command (no cache at ``cache_dir``,
    a directory this user cannot read, a bad ``--config``, whose cache dir is then unknown: ``cache_dir`` None).

    The shape of ``to_json`` without a document (``state`` and ``heartbeat_age_s`` null, ``health`` with the exit
    status and the error as its one reason, ``cache.dir``), plus ``error``: the line printed on stderr too."""
    code = error.exit_code
    health = {"status": _ERROR_STATUSES.get(code, "error"), "exit_status": code, "reasons": [str(error)]}
    where = None if cache_dir is None else str(cache_dir)
    return {
        "version": STATUS_VERSION, "state": None, "heartbeat_age_s": None, "health": health, "cache": {"dir": where},
        "error": str(error),
    }  # fmt: skip


# -- the human rendering (80 columns) ---------------------------------------------------------------------------

WIDTH = 80
_LABEL = 10
_MAX_LISTED = 8  # snapshots or samplers shown one per line; beyond that, only a count (and unhealthy samplers)


_REASON_CHARS = 600  # a reason names a path (the cache's can be long) before saying what is wrong: keep it whole


def _clean(text: object, limit: int = 160) -> str:
    """A document string made safe for a terminal: no control characters, bounded length."""
    shown = "".join(ch if ch.isprintable() else "?" for ch in str(text))
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _count(value: float) -> str:
    return f"{int(value):,}"


def _plural(value: float, noun: str) -> str:
    return f"{int(value):,} {noun}" + ("" if int(value) == 1 else "s")


def _passes(value: float) -> str:
    return f"{int(value):,} pass" + ("" if int(value) == 1 else "es")


def _rate(value: float) -> str:
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


class _Text:
    """Lines of ``label`` + text, the text wrapped to ``WIDTH`` under a ``_LABEL``-wide label column."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, label: str, text: str, *, indent: int = 0) -> None:
        pad = " " * (_LABEL + indent)
        wrapped = textwrap.wrap(
            text, width=WIDTH, initial_indent=f"{label:<{_LABEL}}" + " " * indent, subsequent_indent=pad + "  ",
            break_long_words=True, break_on_hyphens=False,
        )  # fmt: skip
        self.lines.extend(wrapped or [label])

    def render(self) -> str:
        return "".join(line.rstrip() + "\n" for line in self.lines)


def render_human(report: StatusReport, *, now: float | None = None) -> str:
    """The compact summary ``cachefeed status`` prints (every line at most ``WIDTH`` columns)."""
    now = report.read_at if now is None else now
    out = _Text()
    out.add("cachefeed", f"status of {_clean(report.cache_dir)}")
    verdict = report.health.name.replace("_", " ")
    out.add("health", verdict if report.health == Health.RUNNING else f"{verdict} (exit {int(report.health)})")
    for reason in report.reasons:
        out.add("", f"- {_clean(reason, _REASON_CHARS)}")
    if report.document is not None:
        _render_document(
            out, report.document, report.heartbeat_age_s or 0.0, now, is_gone=report.health == Health.NOT_RUNNING
        )
    elif report.directory is not None:
        _render_directory(out, report.directory)
    return out.render()


def _freshness(cache: Mapping[str, Any]) -> str:
    newest, oldest = cache["newest_age_s"], cache["oldest_age_s"]
    if newest is None or oldest is None:
        return "nothing cached yet"
    return f"newest segment {format_duration(newest)} old, oldest {format_duration(oldest)}"


def _epoch_reads(cache: Mapping[str, Any], evicted: Mapping[str, Any]) -> str:
    """How training on "whatever is cached" plays out: epochs read, samples no epoch served, reads per sample."""
    text = (
        f"{_plural(cache['epochs_total'], 'epoch')} read; {_count(cache['unread_samples'])} cached samples never served"
    )
    per_sample = evicted["epochs_per_sample"]
    if per_sample is not None:
        notes = []
        if cache.get("echo_factor") is not None:
            notes.append(f"{cache['echo_factor']:.2f} lately")
        if evicted.get("max_reads"):
            notes.append(f"up to {evicted['max_reads']}")  # an evicted segment's least-read sample's, at most
        text += (
            f"; evicted samples read {per_sample:.2f} times each"
            + (f" ({', '.join(notes)})" if notes else "")
            + f", {_count(evicted['unread_samples_total'])} evicted unread"
        )
    return text


def _no_trainer(cache: Mapping[str, Any]) -> bool:
    """Whether no trainer reads the cache: no snapshot is pinned but those of dead trainers kept for a resume (the
    daemon's rule: ``CacheStore.ingest_bound`` judges nothing then)."""
    return all(snap.get("kept_for_resume") for snap in cache["snapshots"])


def _bound(cache: Mapping[str, Any], *, is_gone: bool) -> str:
    """What bounds ingest, for the ingest line: the document's ``ingest_bound``, or that no trainer reads ("" when
    a document predates it, nothing is known yet, or the daemon that wrote it is gone: nothing is ingesting)."""
    if is_gone:
        return ""
    bound = cache.get("ingest_bound")
    if bound is None and "ingest_bound" in cache and _no_trainer(cache):
        return "; no trainer reading"
    return {"remote": "; remote-bound", "trainer": "; trainer-bound"}.get(str(bound), "")


def _paced(cache: Mapping[str, Any]) -> str:
    """The paced line: what ingest waits for. With a trainer, normal; without one, what an idle daemon does."""
    waiting = _count(cache["waiting_for_reads_samples"])
    each = f"each segment goes after {_plural(cache['evict_after_reads'], 'epoch read')}"
    if _no_trainer(cache):
        return (
            f"paced: no trainer is reading (no snapshot): fetching waits until training reads {waiting} cached "
            f"samples ({each}); normal for a daemon with no trainer"
        )
    return (
        f"paced: waiting for trainers to read {waiting} samples ({each}); normal while training reads slower than "
        "the remote delivers"
    )


def _render_document(out: _Text, doc: Mapping[str, Any], age_s: float, now: float, *, is_gone: bool) -> None:
    """The document's figures. ``is_gone``: the daemon that wrote it is not running (the figures are its last)."""
    cache, ingest, evicted, remote = doc["cache"], doc["ingest"], doc["evicted"], doc["remote"]
    up = format_duration(max(0.0, now - doc["started_at"]))
    if is_gone:
        out.add(
            "daemon",
            f"gone (pid {doc['pid']} on {_clean(doc['host'], 40)}, last said {_clean(doc['state'])} "
            f"{format_duration(age_s)} ago); the figures below are its last",
        )
    else:
        out.add(
            "daemon",
            f"{_clean(doc['state'])}, pid {doc['pid']} on {_clean(doc['host'], 40)}, up {up}, "
            f"heartbeat {format_duration(age_s)} ago",
        )
    max_bytes = cache["max_bytes"]
    fill = f"{format_bytes(cache['bytes'])} of {format_bytes(max_bytes)}"
    if max_bytes > 0:
        share = cache["bytes"] / max_bytes
        full = cache.get("fill") is not None and cache["fill"] >= 0.99 and share < 0.95
        # ``cache.fill`` is against what the daemon fills to: max_bytes less its reserve for metadata (small caches
        # show the difference: a 3 MiB cache is full at 65%)
        fill += f" ({100 * share:.0f}%{': full, the rest is kept for metadata' if full else ''})"
    samples = _count(cache["samples"])
    per_sample = f" of {format_bytes(cache['bytes'] // cache['samples'])}" if cache["samples"] else ""
    out.add("fill", f"{fill}, {samples} samples{per_sample}, {_plural(cache['segments'], 'segment')}")
    if cache["is_paced"]:
        out.add("", _paced(cache), indent=2)
    if cache["is_backpressured"]:
        out.add("", "BACK-PRESSURE: the cache is full of pinned data, fetching waits", indent=2)
    if cache.get("is_out_of_space"):
        out.add("", "OUT OF SPACE: the cache's filesystem is full, fetching waits (see degraded)", indent=2)
    floor_note = ": BELOW THE FLOOR" if cache["free_bytes"] < cache["min_free_bytes"] else ""
    out.add(
        "free",
        f"{format_bytes(cache['free_bytes'])} on the filesystem, floor {format_bytes(cache['min_free_bytes'])}"
        + floor_note,
    )
    out.add(
        "ingest",
        f"{format_bytes(ingest['bytes_per_s'])}/s, {_rate(ingest['samples_per_s'])} samples/s, "
        f"{_rate(ingest['objects_per_s'])} objects/s{_bound(cache, is_gone=is_gone)}",
    )
    out.add(
        "",
        f"total {format_bytes(ingest['bytes_total'])}, {_count(ingest['samples_total'])} samples, "
        f"{_count(ingest['objects_total'])} objects",
        indent=2,
    )
    retired = evicted.get("retired_samples_total", 0)  # (a status document of an older daemon has none)
    out.add(
        "evicted",
        f"{format_bytes(evicted['bytes_total'])}, {_count(evicted['samples_total'])} samples, "
        f"{_plural(evicted['segments_total'], 'segment')}"
        + (f"; {_count(retired)} more retired: the remote overwrote or deleted their objects" if retired else ""),
    )
    turnover_s = evicted["turnover_s"]
    room = f"; {format_bytes(cache['turnover_bytes'])} kept for fresh samples" if cache["turnover_bytes"] else ""
    if evicted["segments_total"] and turnover_s is not None:
        out.add("turnover", f"a segment stays about {format_duration(turnover_s)}{room}")
    else:
        out.add("turnover", f"nothing evicted yet{room}")
    out.add("freshness", _freshness(cache))
    out.add("epochs", _epoch_reads(cache, evicted))
    per_read = remote["bytes_per_sample_read"]
    if per_read is not None:
        out.add("egress", f"{format_bytes(per_read)} downloaded per sample read by an epoch")
    snapshots = cache["snapshots"]
    pinned = f"{format_bytes(cache['pinned_bytes'])} by {_plural(len(snapshots), 'snapshot')}"
    if cache["pinned_only_bytes"]:
        pinned += f" ({format_bytes(cache['pinned_only_bytes'])} already evicted)"
    out.add("pinned", pinned)
    _render_snapshots(out, snapshots)
    _render_samplers(out, doc["samplers"])
    out.add("remote", _clean(remote["url"]))
    listed_at = remote["last_listed_at"]
    when = f"listed {format_duration(max(0.0, now - listed_at))} ago" if listed_at else "not listed yet"
    out.add(
        "listing",
        f"{_count(remote['objects_listed'])} objects, {when}, {_passes(remote['passes_completed'])} done, "
        f"{_count(remote['list_errors_total'])} failed",
    )
    if "list_requests_total" in remote:
        out.add(
            "LIST",
            f"{_count(remote['list_requests_total'])} requests, {remote['list_requests_per_hour']:.0f} per hour "
            f"(refresh every {format_duration(remote['refresh_interval_s'])})",
        )
    # Failed requests on the requests line, not a line of their own: "errors 0" beside quarantined objects read
    # as "nothing went wrong" (a decode failure is the data's, counted on the lines below).
    kinds = ", ".join(f"{_clean(kind, 24)} {_count(n)}" for kind, n in sorted(remote["errors_by_kind"].items()))
    out.add(
        "requests",
        f"{_count(remote['requests_total'])} requests, {_count(remote['retries_total'])} retries, "
        f"{_count(remote['errors_total'])} failed{f' ({kinds})' if kinds else ''}, "
        f"{format_bytes(remote['bytes_total'])} downloaded",
    )
    not_cached = remote["not_cached"]
    reasons = ", ".join(f"{_clean(reason, 24)} {_count(n)}" for reason, n in sorted(not_cached.items()))
    total = _count(sum(not_cached.values()))
    out.add("uncached", f"{total} listed objects not cached" + (f" ({reasons})" if reasons else ""))
    _render_quarantined(out, remote, doc.get("quarantined"))
    _render_sources(out, doc.get("sources"))


def _render_quarantined(out: _Text, remote: Mapping[str, Any], recent: object) -> None:
    """The counts of objects and samples left out, and the most recent ones (object URL, sample key, reason)."""
    entries = [entry for entry in recent if isinstance(entry, Mapping)] if isinstance(recent, list) else []
    objects, samples = remote.get("quarantined_total", 0), remote.get("quarantined_samples_total", 0)
    if not entries and not samples:  # quarantined objects alone are counted on the "uncached" line already
        return
    out.add("left out", f"{_plural(objects, 'object')} quarantined, {_plural(samples, 'sample')} of cached objects")
    for entry in entries[:_MAX_LISTED]:
        key = entry.get("key")
        what = _clean(entry.get("url"), 120) + (f" {_clean(key, 60)}" if key is not None else "")
        out.add("", f"- {what}: {_clean(entry.get('reason'), 200)}", indent=2)
    if len(entries) > _MAX_LISTED:
        out.add("", f"... and {len(entries) - _MAX_LISTED} more (cachefeed status --json lists them)", indent=2)


def _render_sources(out: _Text, sources: object) -> None:
    """Named sources ([[source]]): each one's share of the cache next to its weight, its ingest and its errors."""
    rows = [row for row in sources if isinstance(row, Mapping)] if isinstance(sources, list) else []
    if not rows:
        return
    out.add("sources", f"{len(rows)} named; cached share / weight, listed, ingested, failed, passes")
    for row in rows[:_MAX_LISTED]:
        share = row.get("cached_share")
        shown = "-" if share is None else f"{share:.0%}"
        uncached = sum(int(n) for n in dict(row.get("not_cached") or {}).values())
        listed, passes = row.get("objects_listed", 0), row.get("passes_completed")
        out.add(
            "",
            f"{_clean(row.get('name'), 40)}: {shown} / {row.get('weight', 0):.0%} "
            f"({_count(row.get('cached_samples', 0))} samples), {_count(listed)} listed, "
            f"{_count(row.get('objects_total', 0))} objects in, {_count(row.get('objects_failed_total', 0))} failed"
            + (f", {_count(uncached)} not cached" if uncached else "")
            + (f", {_passes(passes)} done" if isinstance(passes, int) else "")
            + (_whole(share, row.get("weight", 0)) if row.get("cached_whole") else ""),
            indent=2,
        )
    if len(rows) > _MAX_LISTED:
        out.add("", f"... and {len(rows) - _MAX_LISTED} more", indent=2)


def _whole(share: object, weight: object) -> str:
    """What a source cached whole (``cached_whole``: every object of this node's share it can cache) says: below its
    weight, that share is all it has, and epochs reuse its samples (a small source is upsampled; the README's
    weighted sources)."""
    if isinstance(share, int | float) and isinstance(weight, int | float) and share < weight - 0.005:
        return "; cached whole, below its weight: epochs reuse its samples to make up its share"
    return "; cached whole"


def _render_snapshots(out: _Text, snapshots: list[dict[str, Any]]) -> None:
    for snap in snapshots[:_MAX_LISTED]:
        out.add(
            "",
            f"{_clean(snap['id'], 40)}: {_count(snap['samples'])} samples, {_clean(snap['owner'], 40)}, "
            f"{format_duration(snap['age_s'])} old, idle {format_duration(snap['idle_s'])}"
            + (" (its trainer is gone: kept for a resume)" if snap.get("kept_for_resume") else ""),
            indent=2,
        )
    if len(snapshots) > _MAX_LISTED:
        out.add("", f"... and {len(snapshots) - _MAX_LISTED} more", indent=2)


def _render_samplers(out: _Text, samplers: list[dict[str, Any]]) -> None:
    running = sum(1 for s in samplers if s["state"] == "running")
    restarts = sum(int(s["restarts"]) for s in samplers)
    out.add("samplers", f"{running} of {len(samplers)} running, {_plural(restarts, 'restart')} in all")
    shown = samplers if len(samplers) <= _MAX_LISTED else [s for s in samplers if s["state"] != "running"]
    for sampler in shown:
        pid = f"pid {sampler['pid']}" if sampler["pid"] else "no process"
        text = (
            f"#{sampler['index']} {_clean(sampler['state'], 12)}, {pid}, {_count(sampler['objects_total'])} objects,"
            f" {_plural(sampler['restarts'], 'restart')}"
        )
        if sampler["last_error"]:
            text += f"; last error: {_clean(sampler['last_error'], 120)}"
        out.add("", text, indent=2)


def _render_directory(out: _Text, directory: DirectorySummary) -> None:
    invalid = f" ({directory.invalid_segments} invalid)" if directory.invalid_segments else ""
    out.add(
        "fill",
        f"{format_bytes(directory.bytes)}, {_count(directory.samples)} samples, "
        f"{_plural(directory.segments, 'segment')}{invalid}",
    )
    out.add("free", f"{format_bytes(directory.free_bytes)} on the filesystem")
    pinned = f"{format_bytes(directory.pinned_bytes)} by {_plural(len(directory.snapshots), 'snapshot')}"
    if directory.pinned_only_bytes:
        pinned += f" ({format_bytes(directory.pinned_only_bytes)} already evicted)"
    out.add("pinned", pinned)
    _render_snapshots(out, directory.snapshots)
