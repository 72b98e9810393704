"""Eviction policies: which published segment goes first when room is needed.

A policy only *orders* candidates; the store decides how many to evict and does the unlinking. Pinned segments
are candidates like any other: evicting one removes its name from ``segments/`` while its bytes live on (and
keep counting) inside the snapshots that link it, until those are released.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

__all__ = ["EvictionPolicy", "FifoEviction", "RandomEviction", "make_policy"]


class EvictionPolicy(Protocol):
    """Chooses the next victim among published segments, given oldest first (by sequence number)."""

    name: str

    def choose(self, candidates: Sequence[int]) -> int:
        """Return one element of the non-empty ``candidates`` (segment sequence numbers, ascending)."""
        ...


class FifoEviction:
    """Oldest published first: what a rolling cache wants (every cached sample lives about as long)."""

    name = "fifo"

    def choose(self, candidates: Sequence[int]) -> int:
        return candidates[0]


class RandomEviction:
    """A uniformly random segment: sample lifetimes become geometric instead of fixed."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[int]) -> int:
        return candidates[self._rng.randrange(len(candidates))]


def make_policy(name: str, *, seed: int = 0) -> EvictionPolicy:
    if name == "fifo":
        return FifoEviction()
    if name == "random":
        return RandomEviction(seed)
    raise ValueError(f"unknown eviction policy {name!r}: expected 'fifo' or 'random'")
