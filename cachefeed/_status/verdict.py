"""The health verdict on a daemon's status document, whose value is the exit status of ``cachefeed status``.

Exit statuses of ``cachefeed status`` (one invocation, without ``--watch``), declared here once: the verdicts are
``Health``'s values; 64, 66, 78 and 1 are the exit codes of ``cachefeed._errors`` (``EX_USAGE``,
``NoSuchCacheError``, ``ConfigError``, ``CachefeedError``):

====  ==========================================================================================================
0     running: the daemon is alive, its heartbeat is fresh, state "running", no degraded reasons
2     degraded: alive, but state "degraded" or degraded reasons listed (the reasons are printed); or alive (it
      holds the lock and touches the file) with a stale document on a filesystem too full to write it
3     not running: no status file (no daemon ever ran here: the cache's content is read from the directory),
      state "stopped", a stale heartbeat (but for the full filesystem above), or the daemon's pid is gone (same
      host only)
4     status unreadable: status.json is corrupt, half-written, of another version or shape, or not readable
5     not ready: alive, but "starting" (not ready yet) or "stopping"
64    usage error: the command line could not be parsed (e.g. neither ``--cache-dir`` nor ``--config``), or a
      value in it was refused
66    no such cache: the directory does not exist or is not a cachefeed cache
78    bad ``--config`` file
1     any other error
====  ==========================================================================================================

With ``--json`` each of them but 64 comes with one JSON document on stdout: the report (``render.to_json``), or
where there is none the error's (``render.error_json``), whose ``health.exit_status`` is the exit status.

Staleness: the heartbeat (``updated_at``) is stale when older than ``max(5 s, 5 x status.interval)``; the interval
is read from ``--config`` when given, else from the document's optional ``interval_s``, else 1 s. On the daemon's
host (``host`` equals this host name) a pid that is gone or a zombie also means "not running", unless the document
keeps advancing (a daemon in another pid namespace under the same host name): that case costs one status interval
of waiting, only when the pid looks gone while the heartbeat is fresh. ``judge`` gives the verdict on the document
alone; ``_status/report.py`` adds the pid check, and says why a heartbeat is stale where it can see the daemon: its
pid gone, or alive and still holding the cache's lock (hung, or stopped by a signal or a debugger).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_INTERVAL_S", "Health", "judge", "stale_after_s", "stale_reason"]

DEFAULT_INTERVAL_S = 1.0


class Health(enum.IntEnum):
    """The verdict, whose value is the exit status (see the module docstring)."""

    RUNNING = 0
    DEGRADED = 2
    NOT_RUNNING = 3
    UNREADABLE = 4
    NOT_READY = 5


def stale_after_s(interval_s: float) -> float:
    """Age beyond which a heartbeat means the daemon is hung or dead."""
    return max(5.0, 5.0 * interval_s)


def stale_reason(age_s: float, interval_s: float, why: str = "the daemon is dead or hung") -> str:
    """What a stale heartbeat says; ``why``: what is known of the daemon (``_status/report.py`` looks on its host)."""
    return f"stale heartbeat: last status {age_s:.1f}s ago (limit {stale_after_s(interval_s):.0f}s): {why}"


def judge(document: Mapping[str, Any], age_s: float, interval_s: float) -> tuple[Health, tuple[str, ...]]:
    """The verdict on a validated document whose heartbeat is ``age_s`` old (pid check not included)."""
    state = document["state"]
    limit = stale_after_s(interval_s)
    if state == "stopped":
        return Health.NOT_RUNNING, ("the daemon stopped",)
    if age_s > limit:
        return Health.NOT_RUNNING, (stale_reason(age_s, interval_s),)
    reasons = tuple(str(reason) for reason in document["degraded_reasons"])
    if state in ("starting", "stopping"):
        return Health.NOT_READY, (f"the daemon is {state}", *reasons)
    if state == "degraded" or (state == "running" and reasons):
        return Health.DEGRADED, reasons or ("the daemon reports degraded",)
    if state == "running":
        return Health.RUNNING, ()
    return Health.UNREADABLE, (f"unknown state {state!r} (a newer daemon?)",)
