"""``cachefeed status``: read the daemon's status document, judge the daemon's health, show it.

The daemon writes ``<cache>/status.json`` atomically at least once per ``status.interval`` (the contract and its
keys: ``STATUS_SCHEMA`` in ``status_schema.py``). This module only reads it; it never writes into the cache and
never takes a lock.

Usage::

    cachefeed status --config /etc/cachefeed/train.toml     # or --cache-dir /dev/shm/cachefeed/train
    cachefeed status --cache-dir DIR --json                 # the daemon's document + heartbeat_age_s + health
    cachefeed status --cache-dir DIR --watch [SECONDS]      # refresh in place until Ctrl-C (exits 0)

Exit statuses (one invocation, without ``--watch``):

====  ==========================================================================================================
0     running: the daemon is alive, its heartbeat is fresh, state "running", no degraded reasons
2     degraded: alive, but state "degraded" or degraded reasons listed (the reasons are printed)
3     not running: no status file (no daemon ever ran here: the cache's content is read from the directory),
      state "stopped", a stale heartbeat, or the daemon's pid is gone (same host only)
4     status unreadable: status.json is corrupt, half-written, of another version or shape, or not readable
5     not ready: alive, but "starting" (not ready yet) or "stopping"
64    usage error: the command line could not be parsed (e.g. neither ``--cache-dir`` nor ``--config``)
66    no such cache: the directory does not exist or is not a cachefeed cache
78    bad ``--config`` file
1     any other error
====  ==========================================================================================================

Staleness: the heartbeat (``updated_at``) is stale when older than ``max(5 s, 5 x status.interval)``; the interval
is read from ``--config`` when given, else from the document's optional ``interval_s``, else 1 s. On the daemon's
host (``host`` equals this host name) a pid that is gone or a zombie also means "not running", unless the document
keeps advancing (a daemon in another pid namespace under the same host name): that case costs one status interval
of waiting, only when the pid looks gone while the heartbeat is fresh.

``--watch`` re-reads the file every SECONDS (a poll: the heartbeat age changes every second anyway). On a terminal
each frame replaces the last (cursor home, clear); otherwise frames follow each other, and with ``--json`` each is
one line (NDJSON). A cache that does not exist yet is reported and watched for. Ctrl-C exits 0.

Strings from the document (URL, errors, snapshot owners) are shown with control characters replaced, so a hostile
remote key in an error message cannot send terminal escapes. Human output fits 80 columns.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import socket
import sys
import textwrap
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachefeed.cache.layout import CacheLayout, allocated_bytes
from cachefeed.cache.records import segment_count
from cachefeed.cache.snapshots import live_snapshots, pinned_inodes
from cachefeed.config import load_config
from cachefeed.errors import CachefeedError, StatusUnreadable
from cachefeed.status_schema import STATUS_SCHEMA, STATUS_VERSION, shape_error
from cachefeed.units import format_bytes, format_duration

__all__ = [
    "STATUS_SCHEMA",
    "STATUS_VERSION",
    "DirectorySummary",
    "Health",
    "StatusReport",
    "StatusUnreadable",
    "add_arguments",
    "judge",
    "load_document",
    "read_report",
    "render_human",
    "run",
    "stale_after_s",
    "to_json",
]

MAX_STATUS_BYTES = 16 << 20
DEFAULT_INTERVAL_S = 1.0


class Health(enum.IntEnum):
    """The verdict, whose value is the exit status (see the module docstring)."""

    RUNNING = 0
    DEGRADED = 2
    NOT_RUNNING = 3
    UNREADABLE = 4
    NOT_READY = 5


def load_document(path: Path) -> dict[str, Any] | None:
    """The validated status document at ``path``; None when there is no file. Raises StatusUnreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise StatusUnreadable(
            f"{path}: permission denied (the status file is group-readable: join the cache's group)"
        ) from None
    except OSError as exc:
        raise StatusUnreadable(f"{path}: cannot open ({exc.strerror}; a symlink is never followed)") from None
    try:
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(MAX_STATUS_BYTES + 1)
    except OSError as exc:
        raise StatusUnreadable(f"{path}: cannot read ({exc.strerror})") from None
    if len(raw) > MAX_STATUS_BYTES:
        raise StatusUnreadable(f"{path}: larger than {MAX_STATUS_BYTES} bytes, not a status document")
    if not raw.strip():
        raise StatusUnreadable(f"{path}: empty (a daemon that crashed while writing it, or a foreign file)")
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StatusUnreadable(f"{path}: not valid JSON ({exc}): corrupt or half-written") from None
    if not isinstance(document, dict):
        raise StatusUnreadable(f"{path}: expected a JSON object, got {type(document).__name__}")
    version = document.get("version")
    if version != STATUS_VERSION:
        raise StatusUnreadable(
            f"{path}: status version {version!r}, this cachefeed reads version {STATUS_VERSION}: "
            "use the cachefeed that runs the daemon"
        )
    if problem := shape_error(document, STATUS_SCHEMA):
        raise StatusUnreadable(f"{path}: {problem} (not the documented status shape)")
    return document


# -- what the directory itself says (no daemon) ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DirectorySummary:
    """The cache content read from disk, for a cache without a usable status document."""

    dir: str
    bytes: int
    samples: int
    segments: int
    invalid_segments: int
    pinned_bytes: int
    pinned_only_bytes: int
    free_bytes: int
    snapshots: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def scan(cls, layout: CacheLayout, *, now: float) -> DirectorySummary:
        total = samples = invalid = 0
        inodes = set()
        segments = layout.list_segments()
        for name, info in segments:
            total += allocated_bytes(info)
            inodes.add(info.st_ino)
            count = segment_count(layout.segments / name)
            if count < 0:
                invalid += 1
            else:
                samples += count
        pinned = pinned_inodes(layout)
        try:
            stats = os.statvfs(layout.root)
            free = stats.f_bavail * stats.f_frsize
        except OSError:
            free = 0
        snapshots = [
            {"id": s.snap_id, "samples": s.samples, "segments": s.segments, "owner": s.owner,
             "age_s": max(0.0, now - s.created), "idle_s": max(0.0, now - max(s.created, s.active_at))}
            for s in live_snapshots(layout)
        ]  # fmt: skip
        return cls(
            dir=str(layout.root),
            bytes=total,
            samples=samples,
            segments=len(segments),
            invalid_segments=invalid,
            pinned_bytes=sum(pinned.values()),
            pinned_only_bytes=sum(size for ino, size in pinned.items() if ino not in inodes),
            free_bytes=free,
            snapshots=snapshots,
        )

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


# -- the verdict -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StatusReport:
    """One reading of a cache's status: the verdict and what it was judged from.

    Invariants: ``document`` is a validated status document or None; ``heartbeat_age_s`` is None iff ``document``
    is; ``directory`` may be set only if ``document`` is None (no status file, or an unreadable one), and is
    None when the directory could not be listed either.
    """

    cache_dir: Path
    health: Health
    reasons: tuple[str, ...]
    document: dict[str, Any] | None = None
    heartbeat_age_s: float | None = None
    directory: DirectorySummary | None = None
    read_at: float = 0.0


def stale_after_s(interval_s: float) -> float:
    """Age beyond which a heartbeat means the daemon is hung or dead."""
    return max(5.0, 5.0 * interval_s)


def _pid_is_gone(pid: int) -> bool:
    """True if ``pid`` does not exist here or is a zombie (a killed daemon its parent has not reaped yet)."""
    if pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        return False  # cannot tell: trust the heartbeat
    fields = stat[stat.rfind(")") + 2 :].split()
    return bool(fields) and fields[0] in ("Z", "X")


def judge(document: Mapping[str, Any], age_s: float, interval_s: float) -> tuple[Health, tuple[str, ...]]:
    """The verdict on a validated document whose heartbeat is ``age_s`` old (pid check not included)."""
    state = document["state"]
    limit = stale_after_s(interval_s)
    if state == "stopped":
        return Health.NOT_RUNNING, ("the daemon stopped",)
    if age_s > limit:
        return Health.NOT_RUNNING, (
            f"stale heartbeat: last status {age_s:.1f}s ago (limit {limit:.0f}s): the daemon is dead or hung",
        )
    reasons = tuple(str(reason) for reason in document["degraded_reasons"])
    if state in ("starting", "stopping"):
        return Health.NOT_READY, (f"the daemon is {state}", *reasons)
    if state == "degraded" or (state == "running" and reasons):
        return Health.DEGRADED, reasons or ("the daemon reports degraded",)
    if state == "running":
        return Health.RUNNING, ()
    return Health.UNREADABLE, (f"unknown state {state!r} (a newer daemon?)",)


def read_report(
    cache_dir: Path, *, interval_s: float | None = None, now: float | None = None, check_pid: bool = True
) -> StatusReport:
    """Read and judge ``cache_dir``'s status. A bad status file is a verdict (UNREADABLE), never an exception.

    Args:
        cache_dir: the cache root.
        interval_s: the daemon's status interval (staleness); default: the document's hint, else 1 s.
        now: the reading instant (tests).
        check_pid: on the daemon's host, also check that its pid lives (see the module docstring).

    Raises:
        NoSuchCacheError: ``cache_dir`` is not a cache (exit 66).
        StatusUnreadable: this user may not read the cache directory (exit 4).
    """
    layout = CacheLayout(Path(cache_dir))
    denied = StatusUnreadable(f"{layout.root}: permission denied (the cache is group-readable: join its group)")
    try:
        if layout.root.is_dir() and not os.access(layout.root, os.R_OK | os.X_OK):
            raise denied
        layout.check()
    except PermissionError:
        raise denied from None
    now = time.time() if now is None else now
    try:
        document = load_document(layout.status_file)
    except StatusUnreadable as exc:
        directory = _scan_or_none(layout, now)
        return StatusReport(layout.root, Health.UNREADABLE, (str(exc),), directory=directory, read_at=now)
    if document is None:
        directory = _scan_or_none(layout, now)
        reason = "no status file: no daemon has run on this cache (content read from the directory)"
        return StatusReport(layout.root, Health.NOT_RUNNING, (reason,), directory=directory, read_at=now)
    if interval_s is None:
        hinted = document.get("interval_s")
        interval_s = DEFAULT_INTERVAL_S
        if isinstance(hinted, int | float) and not isinstance(hinted, bool) and hinted > 0:
            interval_s = float(hinted)
    age = max(0.0, now - float(document["updated_at"]))
    health, reasons = judge(document, age, interval_s)
    is_here = document["host"] == socket.gethostname()
    if check_pid and health != Health.NOT_RUNNING and is_here and _pid_is_gone(document["pid"]):
        if _advances(layout.status_file, document["updated_at"], interval_s):
            # someone keeps writing: a daemon in another pid namespace, or one that just restarted
            return read_report(cache_dir, interval_s=interval_s, check_pid=False)
        health, reasons = Health.NOT_RUNNING, (f"the daemon (pid {document['pid']}) is gone: killed or crashed",)
    return StatusReport(layout.root, health, reasons, document=document, heartbeat_age_s=age, read_at=now)


def _scan_or_none(layout: CacheLayout, now: float) -> DirectorySummary | None:
    try:
        return DirectorySummary.scan(layout, now=now)
    except OSError:  # e.g. permission denied on segments/: say what we can without it
        return None


def _advances(path: Path, updated_at: float, interval_s: float) -> bool:
    """Whether the document's ``updated_at`` moves within about one interval."""
    deadline = time.monotonic() + 1.5 * interval_s + 0.5
    while time.monotonic() < deadline:
        time.sleep(min(0.1, interval_s / 4))
        try:
            document = load_document(path)
        except StatusUnreadable:
            continue
        if document is not None and document["updated_at"] != updated_at:
            return True
    return False


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


# -- the human rendering (80 columns) ---------------------------------------------------------------------------

WIDTH = 80
_LABEL = 10
_MAX_LISTED = 8  # snapshots or samplers shown one per line; beyond that, only a count (and unhealthy samplers)


def _clean(text: object, limit: int = 160) -> str:
    """A document string made safe for a terminal: no control characters, bounded length."""
    shown = "".join(ch if ch.isprintable() else "?" for ch in str(text))
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _count(value: float) -> str:
    return f"{int(value):,}"


def _plural(value: float, noun: str) -> str:
    return f"{int(value):,} {noun}" + ("" if int(value) == 1 else "s")


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
        out.add("", f"- {_clean(reason)}")
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
    """How training on "whatever is cached" plays out: epochs read, samples no epoch read, reads per sample."""
    text = (
        f"{_plural(cache['epochs_total'], 'epoch')} read; {_count(cache['unread_samples'])} cached samples not read yet"
    )
    per_sample = evicted["epochs_per_sample"]
    if per_sample is not None:
        text += (
            f"; evicted samples were read {per_sample:.2f} times on average (at most {evicted['max_reads']}), "
            f"{_count(evicted['unread_samples_total'])} evicted unread"
        )
    return text


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
        fill += f" ({100 * cache['bytes'] / max_bytes:.0f}%)"
    samples = _count(cache["samples"])
    per_sample = f" of {format_bytes(cache['bytes'] // cache['samples'])}" if cache["samples"] else ""
    out.add("fill", f"{fill}, {samples} samples{per_sample}, {_plural(cache['segments'], 'segment')}")
    if cache["is_paced"]:
        out.add(
            "",
            f"paced: waiting for trainers to read {_count(cache['waiting_for_reads_samples'])} samples "
            f"(each segment goes after {_plural(cache['evict_after_reads'], 'epoch read')}); normal while "
            "training reads slower than the remote delivers",
            indent=2,
        )
    if cache["is_backpressured"]:
        out.add("", "BACK-PRESSURE: the cache is full of pinned data, fetching waits", indent=2)
    floor_note = ": BELOW THE FLOOR" if cache["free_bytes"] < cache["min_free_bytes"] else ""
    out.add(
        "free",
        f"{format_bytes(cache['free_bytes'])} on the filesystem, floor {format_bytes(cache['min_free_bytes'])}"
        + floor_note,
    )
    out.add(
        "ingest",
        f"{format_bytes(ingest['bytes_per_s'])}/s, {_rate(ingest['samples_per_s'])} samples/s, "
        f"{_rate(ingest['objects_per_s'])} objects/s",
    )
    out.add(
        "",
        f"total {format_bytes(ingest['bytes_total'])}, {_count(ingest['samples_total'])} samples, "
        f"{_count(ingest['objects_total'])} objects",
        indent=2,
    )
    out.add(
        "evicted",
        f"{format_bytes(evicted['bytes_total'])}, {_count(evicted['samples_total'])} samples, "
        f"{_plural(evicted['segments_total'], 'segment')}",
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
        f"{_count(remote['objects_listed'])} objects, {when}, {_count(remote['passes_completed'])} passes done, "
        f"{_count(remote['list_errors_total'])} failed",
    )
    out.add(
        "requests",
        f"{_count(remote['requests_total'])} requests, {_count(remote['retries_total'])} retries, "
        f"{format_bytes(remote['bytes_total'])} downloaded",
    )
    kinds = ", ".join(f"{_clean(kind, 24)} {_count(n)}" for kind, n in sorted(remote["errors_by_kind"].items()))
    errors = _count(remote["errors_total"]) + (f" ({kinds})" if kinds else "")
    out.add("errors", errors)
    not_cached = remote["not_cached"]
    reasons = ", ".join(f"{_clean(reason, 24)} {_count(n)}" for reason, n in sorted(not_cached.items()))
    total = _count(sum(not_cached.values()))
    out.add("uncached", f"{total} listed objects not cached" + (f" ({reasons})" if reasons else ""))
    _render_sources(out, doc.get("sources"))


def _render_sources(out: _Text, sources: object) -> None:
    """Named sources ([[source]]): each one's share of the cache next to its weight, its ingest and its errors."""
    rows = [row for row in sources if isinstance(row, Mapping)] if isinstance(sources, list) else []
    if not rows:
        return
    out.add("sources", f"{len(rows)} named; cached share / weight, listed, ingested, failed")
    for row in rows[:_MAX_LISTED]:
        share = row.get("cached_share")
        shown = "-" if share is None else f"{share:.0%}"
        uncached = sum(int(n) for n in dict(row.get("not_cached") or {}).values())
        out.add(
            "",
            f"{_clean(row.get('name'), 40)}: {shown} / {row.get('weight', 0):.0%} "
            f"({_count(row.get('cached_samples', 0))} samples), {_count(row.get('objects_listed', 0))} listed, "
            f"{_count(row.get('objects_total', 0))} objects in, {_count(row.get('objects_failed_total', 0))} failed"
            + (f", {_count(uncached)} not cached" if uncached else ""),
            indent=2,
        )
    if len(rows) > _MAX_LISTED:
        out.add("", f"... and {len(rows) - _MAX_LISTED} more", indent=2)


def _render_snapshots(out: _Text, snapshots: list[dict[str, Any]]) -> None:
    for snap in snapshots[:_MAX_LISTED]:
        out.add(
            "",
            f"{_clean(snap['id'], 40)}: {_count(snap['samples'])} samples, {_clean(snap['owner'], 40)}, "
            f"{format_duration(snap['age_s'])} old, idle {format_duration(snap['idle_s'])}",
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


# -- the command -------------------------------------------------------------------------------------------------


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds such as 2 or 0.5") from None
    if not 0.05 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: expected between 0.05 and 3600 seconds")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", metavar="FILE", help="the daemon's TOML config (gives the cache dir)")
    where.add_argument("--cache-dir", metavar="DIR", type=Path, help="the cache directory")
    parser.add_argument("--json", action="store_true", help="print one JSON document (with --watch: one per line)")
    parser.add_argument(
        "--watch",
        metavar="SECONDS",
        nargs="?",
        const=1.0,
        type=_positive_seconds,
        help="refresh every SECONDS (default 1) until Ctrl-C",
    )
    parser.epilog = "exit status: 0 running, 2 degraded, 3 not running, 4 status unreadable, 5 starting/stopping, "
    parser.epilog += "64 usage error, 66 no such cache, 78 bad config"


def run(args: argparse.Namespace) -> int:
    interval_s: float | None = None
    if args.config:
        config = load_config(args.config)
        cache_dir, interval_s = config.cache.dir, config.status.interval_s
    else:
        cache_dir = args.cache_dir
    if args.watch is not None:
        return _watch(cache_dir, interval_s, period_s=args.watch, as_json=args.json)
    report = read_report(cache_dir, interval_s=interval_s)
    if args.json:
        print(json.dumps(to_json(report), indent=2))
    else:
        print(render_human(report), end="")
    return int(report.health)


_HOME_CLEAR = "\x1b[H\x1b[2J"


def _watch(cache_dir: Path, interval_s: float | None, *, period_s: float, as_json: bool) -> int:
    """Redraw until interrupted. A missing cache is shown as such (the daemon may not have created it yet)."""
    is_tty = sys.stdout.isatty() and not as_json
    try:
        while True:
            try:
                report = read_report(cache_dir, interval_s=interval_s)
                text = json.dumps(to_json(report)) + "\n" if as_json else render_human(report)
            except CachefeedError as exc:
                text = json.dumps({"error": str(exc)}) + "\n" if as_json else f"cachefeed status: {exc}\n"
            if is_tty:
                sys.stdout.write(_HOME_CLEAR + text)
            else:
                sys.stdout.write(text if as_json else text + "\n")
            sys.stdout.flush()
            time.sleep(period_s)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # the reader went away (``| head``): stop quietly, and keep Python from complaining at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
