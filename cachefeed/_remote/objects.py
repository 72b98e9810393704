"""What a ``Remote`` hands out: the objects it lists and the counters it keeps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RemoteObject", "RemoteStats"]


@dataclass(frozen=True, slots=True)
class RemoteObject:
    """One listed object. ``path`` is the fsspec path without protocol; ``etag`` pins the version read; ``size``
    is -1 where a manifest gave none (the body's length is then not checked)."""

    path: str
    size: int
    etag: str | None


@dataclass(slots=True)
class RemoteStats:
    """Counters of one ``Remote``, only ever increased. ``errors_total`` counts failed attempts by error kind."""

    requests_total: int = 0
    retries_total: int = 0
    bytes_total: int = 0
    listings_total: int = 0
    list_requests_total: int = 0  # LIST requests (pages) sent, retries included
    budget_exhausted_total: int = 0
    throttled_s: float = 0.0
    errors_total: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests_total": self.requests_total,
            "retries_total": self.retries_total,
            "bytes_total": self.bytes_total,
            "listings_total": self.listings_total,
            "list_requests_total": self.list_requests_total,
            "budget_exhausted_total": self.budget_exhausted_total,
            "throttled_s": self.throttled_s,
            "errors_total": dict(self.errors_total),
        }
