"""Grants: the room the store hands a writer for one segment, and the interface of whoever hands them out.

The contract between ``CacheStore`` (which keeps the budget) and ``CacheWriter`` (which fills segments), whether
they share a process or a sampler asks the supervisor over its socket (``cachefeed/_daemon/grants.py`` carries
these same fields). A writer imports this module alone, not the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = ["Grant", "GrantProvider"]


@dataclass(frozen=True, slots=True)
class Grant:
    """Permission to write one segment of at most ``nbytes`` (file size) at ``path``."""

    seq: int
    path: Path
    nbytes: int


class GrantProvider(Protocol):
    """Hands out room for segments and publishes them. ``CacheStore`` is one."""

    def reserve(self, nbytes: int) -> Grant | None:
        """A grant for a segment of up to ``nbytes``, or None if the cache is full right now (try again)."""
        ...

    def publish(self, grant: Grant) -> object:
        """Publish the finished segment written under ``grant``."""
        ...

    def abort(self, grant: Grant) -> None:
        """Give ``grant`` back; its file is deleted."""
        ...
