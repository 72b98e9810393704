"""Reading ``<cache>/status.json``: the one reader of the daemon's status document, which it validates.

The daemon replaces the file atomically at least once per ``status.interval`` (the contract: ``STATUS_SCHEMA`` in
``_status/schema.py``). Reading it never writes into the cache and never takes a lock. A symlink is never followed,
and a file larger than ``MAX_STATUS_BYTES`` is not read whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cachefeed._errors import StatusUnreadable
from cachefeed._status.schema import STATUS_SCHEMA, STATUS_VERSION, shape_error

__all__ = ["MAX_STATUS_BYTES", "load_document"]

MAX_STATUS_BYTES = 16 << 20


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
