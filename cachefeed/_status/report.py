"""Reading a cache's status: ``read_report`` turns a cache directory into a ``StatusReport`` (verdict and figures).

The report is judged from the daemon's status document (``_status/document.py``, verdict in ``_status/verdict.py``),
with more checks on the daemon's host: a daemon whose pid is gone is not running, even with a fresh heartbeat; and a
stale heartbeat says what the cache's lock and the process show: the daemon gone, or still holding the lock (hung,
or stopped), or another daemon holding it; or the cache's filesystem full, so that a live daemon cannot write its
status (then the verdict is degraded, not "not running"). Without a usable document, the report carries what the
directory shows (``_status/directory.py``). A bad status file is a verdict (``Health.UNREADABLE``), never an
exception. Nothing here writes into the cache; the one lock taken is ``CacheLayout.writer_state``'s moment of a
shared lock, for a stale heartbeat only (a daemon starting then waits it out). Its readers: ``cachefeed status``
(``_cli/status.py``), the trainer's wait for a full cache (``_trainer/wait.py``), the demo and the tests.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachefeed._cache.layout import CacheLayout
from cachefeed._errors import StatusUnreadable
from cachefeed._procs import GONE, process_state
from cachefeed._status.directory import DirectorySummary
from cachefeed._status.document import load_document
from cachefeed._status.verdict import DEFAULT_INTERVAL_S, Health, judge, stale_after_s, stale_reason
from cachefeed._units import format_bytes

__all__ = ["StatusReport", "read_report"]


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


def _pid_is_gone(pid: int) -> bool:
    """True if ``pid`` does not exist here or is a zombie (a killed daemon its parent has not reaped yet)."""
    return process_state(pid) in GONE


def _why_stale(layout: CacheLayout, pid: int, *, check_pid: bool) -> str | None:
    """Why the heartbeat of daemon ``pid``, of this host, is stale, as the cache's lock and the process show (the
    lock first: whether a daemon runs is its lock); None where they cannot tell."""
    held = layout.writer_state()
    state = process_state(pid) if check_pid else ""
    if held is None:  # the lock file cannot be opened here: what the process shows
        if state in GONE:
            return f"the daemon (pid {pid}) is gone: killed or crashed"
        return f"the daemon (pid {pid}) is stopped by a signal or a debugger" if state in ("T", "t") else None
    if held:
        holder = layout.lock_holder_pid()
        if holder is not None and holder != pid:
            return f"another daemon (pid {holder}) holds the cache's lock and has not written its status yet"
        if state in GONE:
            return f"the daemon (pid {pid}) is gone, but its samplers still hold the cache's lock: exiting, or stuck"
        what = "stopped by a signal or a debugger" if state in ("T", "t") else "hung"
        return f"the daemon (pid {pid}) still holds the cache's lock but writes no status: it is {what}"
    if state in GONE:
        return f"the daemon (pid {pid}) is gone: killed or crashed"
    return f"the daemon (pid {pid}) no longer holds the cache's lock: it exited or is exiting"


# Less free space than this on the cache's filesystem, with a stale heartbeat from a daemon that holds the lock and
# lives: it cannot write its status file (a few KiB, written whole beside it, then renamed).
_STATUS_ROOM_BYTES = 256 << 10


def _filesystem_full(layout: CacheLayout, pid: int, interval_s: float) -> str | None:
    """Why a live daemon writes no status, where its filesystem is full: the reason, else None (``read_report``).

    Live: it holds the cache's lock and, though its document is stale, touched the file within the heartbeat's
    limit (a daemon whose write fails sets the file's time, which needs no free block: ``reporter.py``). A daemon
    that hangs touches nothing, and stays "not running" whatever the free space."""
    try:
        stats = os.statvfs(layout.root)
        touched = os.stat(layout.status_file).st_mtime
    except OSError:
        return None
    free = stats.f_bavail * stats.f_frsize
    if free >= _STATUS_ROOM_BYTES or time.time() - touched > stale_after_s(interval_s):
        return None
    if not layout.writer_state() or process_state(pid) in (*GONE, "T", "t"):
        return None
    return (
        f"the daemon (pid {pid}) runs but cannot write its status: the cache's filesystem is full "
        f"({format_bytes(free)} free): free space there"
    )


def read_report(
    cache_dir: Path, *, interval_s: float | None = None, now: float | None = None, check_pid: bool = True
) -> StatusReport:
    """Read and judge ``cache_dir``'s status. A bad status file is a verdict (UNREADABLE), never an exception.

    Args:
        cache_dir: the cache root.
        interval_s: the daemon's status interval (staleness); default: the document's hint, else 1 s.
        now: the reading instant (tests).
        check_pid: on the daemon's host, also check that its pid lives (the rule: ``_status/verdict.py``).

    Raises:
        NoSuchCacheError: ``cache_dir`` is not a cache (exit 66).
        StatusUnreadable: this user may not read the cache directory (exit 4).
    """
    layout = CacheLayout(Path(cache_dir))
    denied = StatusUnreadable(  # an unreadable directory cannot say whether it is a cache
        f"{layout.root}: permission denied: this user cannot read the directory (if it is a cachefeed cache, "
        "it is readable by its group: join that group)"
    )
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
    if is_here and document["state"] != "stopped" and age > stale_after_s(interval_s):
        full = _filesystem_full(layout, int(document["pid"]), interval_s)
        why = full or _why_stale(layout, int(document["pid"]), check_pid=check_pid)
        if why is not None:
            reasons = (stale_reason(age, interval_s, why),)
        if full is not None:
            health = Health.DEGRADED  # it runs, and says so as soon as it can write again
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
