"""What the daemon left out, for ``cachefeed status``: the most recent quarantined objects and skipped samples.

The samplers report each one (``Quarantined`` in ``protocol.py``); the supervisor keeps the last ``RECENT_LIMIT``
here and the status document lists them newest first (``quarantined`` in ``_status/schema.py``), next to the
counters: ``remote.quarantined_total`` (objects) and ``remote.quarantined_samples_total`` (samples left out of
objects whose other samples are cached: a tar member that failed to decode). Counted per attempt: an object
fetched again in a later pass (evicted, then drawn again) that still holds the bad member counts it again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

__all__ = ["RECENT_LIMIT", "QuarantineEntry", "QuarantineLog"]

RECENT_LIMIT = 20


@dataclass(frozen=True, slots=True)
class QuarantineEntry:
    url: str  # the object's URL
    key: str | None  # the sample's __key__; None when the whole object was left out
    kind: str  # "decode" or "too_large" (an object), "sample" (one sample of an object)
    reason: str
    at: float  # wall-clock time it was reported

    def as_dict(self) -> dict[str, object]:
        return {"url": self.url, "key": self.key, "kind": self.kind, "reason": self.reason, "at": self.at}


class QuarantineLog:
    """The last ``limit`` entries, and how many samples were left out in all."""

    def __init__(self, limit: int = RECENT_LIMIT) -> None:
        self._recent: deque[QuarantineEntry] = deque(maxlen=limit)
        self.samples_total = 0

    def add(self, url: str, key: str | None, kind: str, reason: str, *, at: float | None = None) -> None:
        self._recent.append(QuarantineEntry(url, key, kind, reason, time.time() if at is None else at))
        if key is not None:
            self.samples_total += 1

    def recent(self) -> list[dict[str, object]]:
        """The entries kept, newest first."""
        return [entry.as_dict() for entry in reversed(self._recent)]
