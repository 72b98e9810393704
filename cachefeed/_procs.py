"""What this host says about a process: whether it runs, is stopped, or is gone (``/proc``).

Used where a pid named in a file (the cache's lock file, the status document) is checked on its own host: the
daemon's start (``_cache/store.py``: a lock held for a daemon that is gone) and ``cachefeed status``
(``_status/report.py``). A zombie (killed, not yet reaped by its parent) counts as gone: it holds nothing and runs
nothing.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["GONE", "process_state"]

GONE = (None, "Z", "X")  # process_state's answers for a process that does not run any more


def process_state(pid: int) -> str | None:
    """``pid``'s state letter from ``/proc`` (``R`` running, ``S`` sleeping, ``T`` stopped, ``Z`` zombie...);
    None if no such process exists here, "" if it cannot be told (no ``/proc``, no permission, a pid <= 0)."""
    if pid <= 0:
        return ""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0] if fields else ""
