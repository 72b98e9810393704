"""Eviction policies: which published segment goes first when room is needed.

A policy only *orders* candidates; the store decides how many to evict and does the unlinking. Pinned segments
are candidates like any other: evicting one removes its name from ``segments/`` while its bytes live on (and
keep counting) inside the snapshots that link it, until those are released.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

__all__ = ["POLICIES", "EvictionPolicy", "FifoEviction", "MostReadEviction", "RandomEviction", "make_policy"]

_NO_READS: Mapping[int, int] = {}


class EvictionPolicy(Protocol):
    """Chooses the next victim among published segments, given oldest first (by sequence number)."""

    name: str

    def choose(self, candidates: Sequence[int], reads: Mapping[int, int] = _NO_READS) -> int:
        """Return one element of the non-empty ``candidates`` (segment sequence numbers, ascending).

        ``reads``: each segment's reads, its least-read sample's (absent: none; NOTE [ Read receipts ] in
        ``reads.py``).
        """
        ...


class FifoEviction:
    """Oldest published first: what a rolling cache wants (every cached sample lives about as long)."""

    name = "fifo"

    def choose(self, candidates: Sequence[int], reads: Mapping[int, int] = _NO_READS) -> int:
        return candidates[0]


class RandomEviction:
    """A uniformly random segment: sample lifetimes become geometric instead of fixed."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[int], reads: Mapping[int, int] = _NO_READS) -> int:
        return candidates[self._rng.randrange(len(candidates))]


class MostReadEviction:
    """The segment with the most reads first (its least-read sample's), the oldest among equals; unread go last.

    For a small cache in front of a slow remote: every download is trained on before it is evicted (as long as
    epochs keep up), and the samples that have served most make room. Without trainers it is FIFO.
    """

    name = "most-read"

    def choose(self, candidates: Sequence[int], reads: Mapping[int, int] = _NO_READS) -> int:
        return max(candidates, key=lambda seq: (reads.get(seq, 0), -seq))


POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {  # the registry: config validates names against it
    FifoEviction.name: lambda seed: FifoEviction(),
    RandomEviction.name: RandomEviction,
    MostReadEviction.name: lambda seed: MostReadEviction(),
}


def make_policy(name: str, *, seed: int = 0) -> EvictionPolicy:
    try:
        return POLICIES[name](seed)
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}: expected one of {', '.join(POLICIES)}") from None
