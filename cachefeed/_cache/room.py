"""An epoch's room: how much one snapshot may pin, and which segments it takes (the one owner of that rule).

Why a room (issue 27, "echo only as much as the remote forces"): with read-gated eviction the next epoch's snapshot
is taken while the current epoch still reads its own (its receipt comes when it is released), so if a snapshot
pinned every published segment, the cache could never hold more than the current snapshot plus the fresh samples
that fit beside it, and each epoch would bring at most that room of new samples: an echo factor of about
``(1 - turnover) / turnover`` whatever the remote's speed. Instead:

* **A snapshot pins at most the epoch room** ``max_bytes - turnover_bytes - METADATA_RESERVE_BYTES`` (allocated
  bytes of its segments), so the rest of the budget, ``turnover_bytes``, is always free for samples no epoch has
  read while an epoch reads its snapshot. From a turnover of 50% on, the free part holds a whole epoch: when the
  remote fills it during an epoch, the next epoch reads only fresh samples (echo 1); when it fills a third of an
  epoch's worth, the next epoch is topped up with the least-read samples and each sample is read about three times
  (the remote sets the echo, not the room).
* **Why the default is 67%, not 50%.** At a handover two snapshots are pinned (the epoch ending and the next).
  At 50% they hold the whole budget, so the samples for epoch ``e + 1`` can only be fetched between the release of
  ``e - 1`` (just after ``e`` began) and the pin of ``e + 1`` (a build lead before ``e`` ends): no slack. Where
  that fill comes late, ``e + 1`` pins the read segments of ``e - 1`` still waiting for eviction, which stops the
  fill, and it re-reads them (compare ``python -m benchmarks.echo --runs "remote keeps up" --rate 1600 --turnover
  50% --no-save`` with ``--turnover 67%``, epochs of about a second, over several runs). At 67% a third of the
  budget is free beside both snapshots and the fill has a whole epoch. The cost: an epoch pins a third of the
  budget, not half (shorter epochs, a smaller shuffle window).
* **Least-read first** (``choose``): a segment's reads (its least-read sample's, from the daemon's ledger and the
  receipts it has not applied yet, NOTE [ Read receipts ] in ``reads.py``), plus one *pending* read if a live
  snapshot holds it (the epoch being read right now, or one being released: their receipts have not arrived).
  Without both, the segments of the epoch released a moment before, whose receipt the daemon has not collected,
  would look unread and be read again at once, in place of the fresh samples the remote delivered meanwhile.
  Ties: oldest first (segment sequence numbers).
  Unread segments therefore come first and the top-up is the least-read. With weighted sources (``sources.json``),
  each source first gets its weight's share of the room from its own least-read segments, then the rest of the room
  is filled from all sources in the same order: a fast source cannot crowd a slow one out of an epoch. The share is
  of the room's *samples*, as epochs and the store weigh sources (``_trainer/partition.py``; ``store.py``,
  "Weighted sources"): a source of larger samples gets more bytes (``_quotas``). Whole segments fill it, so a source
  may be pinned up to a segment short of its share; the snapshot records which sources it did not pin whole
  (``Snapshot.left_out``), and the epoch's partition serves those without replacement.
* **A later epoch of a set size while the cache fills** (NOTE [ Growing snapshots ] in ``_trainer/growing.py``)
  pins only what no epoch has read nor is reading (``unread_first``: segments none of whose samples was read, held
  by no live snapshot), oldest first within the room, and grows by what the daemon publishes; if its growth stops
  short of its samples, it is topped up with the least-read segments (``top_up``: only as many samples as it lacks,
  within what is left of the room). Ties there go newest first: every candidate has been read (the unread ones are
  in the snapshot already), so any may be evicted at any moment, and the default policy evicts the oldest first;
  taking the oldest, the top-up would race the eviction for each segment it links.
* A cache whose published set fits the room is pinned whole, as before; a static cache has no room: every segment
  is pinned. A cache is static when no daemon holds its writer lock and none is restarting (``room_now``: a status
  written within ``DAEMON_RESTART_WINDOW_S`` by a daemon that did not stop): a daemon restarting (systemd's restart
  delay, a crash loop) keeps its room, or an epoch begun meanwhile would pin the whole cache and the daemon, back,
  could turn nothing over until that epoch ended; a daemon stopped on purpose, or a copy of a cache, is read whole.

The daemon's store writes the room into ``budget.json`` at start (``write_room``, the only writer); trainers read it
when they create a snapshot (``room_now``). The store relies on the rule: since no snapshot pins more than the room,
it never caps the published set below the budget (``store.py``, rule B).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cachefeed._cache.layout import DAEMON_RESTART_WINDOW_S, CacheLayout
from cachefeed._cache.settings import METADATA_RESERVE_BYTES
from cachefeed._fsutil import atomic_write

__all__ = ["Candidate", "choose", "epoch_room", "read_room", "room_now", "top_up", "unread_first", "write_room"]

_VERSION = 1


def epoch_room(max_bytes: int, turnover_bytes: int) -> int:
    """The most segment bytes one snapshot pins: the budget less the turnover room and the metadata reserve."""
    return max(0, max_bytes - turnover_bytes - METADATA_RESERVE_BYTES)


def write_room(root: str | os.PathLike[str], max_bytes: int, turnover_bytes: int, *, mode: int = 0o640) -> None:
    """Replace ``budget.json`` atomically (the store, at start)."""
    document = {
        "version": _VERSION,
        "max_bytes": max_bytes,
        "turnover_bytes": turnover_bytes,
        "epoch_room_bytes": epoch_room(max_bytes, turnover_bytes),
    }
    atomic_write(CacheLayout(Path(root)).budget_file, json.dumps(document, indent=1).encode(), mode=mode)


def read_room(root: str | os.PathLike[str]) -> int | None:
    """The epoch room the cache's daemon keeps; None without the file or if unreadable (then: pin everything)."""
    try:
        document = json.loads((CacheLayout(Path(root)).budget_file).read_bytes())
        room = int(document["epoch_room_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return room if room > 0 else None


def room_now(layout: CacheLayout) -> int | None:
    """The room a snapshot taken now keeps: the daemon's (``read_room``) where a daemon holds the cache or is
    restarting (``_is_restarting``); None, pin everything, on a static cache."""
    return read_room(layout.root) if layout.has_writer() or _is_restarting(layout) else None


def _is_restarting(layout: CacheLayout) -> bool:
    """Whether the cache's daemon is gone for a moment only (killed or crashed, systemd restarting it): its status
    document was written within ``DAEMON_RESTART_WINDOW_S`` by its ``updated_at`` (a copy of the cache keeps that,
    where the file's mtime would be new) and does not say it stopped (a daemon stopped on purpose leaves a static
    cache, read whole at once)."""
    from cachefeed._errors import StatusUnreadable  # lazily: _status reads the cache's modules
    from cachefeed._status.document import load_document  # the one reader of status.json

    try:
        document = load_document(layout.status_file)
    except StatusUnreadable:
        return False
    if document is None or document["state"] in ("stopping", "stopped"):
        return False
    return time.time() - float(document["updated_at"]) < DAEMON_RESTART_WINDOW_S


@dataclass(frozen=True, slots=True)
class Candidate:
    """A published segment a snapshot may pin."""

    seq: int
    nbytes: int  # allocated bytes, as the store's budget counts them
    reads: int  # its least-read sample's reads (0: unread or unknown)
    tag: int = 0  # its source tag
    pending: bool = False  # a live snapshot holds it (an epoch reading it or being released): a read is on its way
    samples: int = 0  # its samples (where a choice counts them: ``top_up``, ``choose``'s weighted quotas)
    untouched: bool = False  # no epoch has read any of its samples (``unread_first``)


def choose(candidates: Sequence[Candidate], room: int | None, weights: Mapping[int, float] | None = None) -> list[int]:
    """The sequence numbers of the segments a snapshot pins (ascending), by the rule in the module docstring.

    ``room`` None pins everything; ``weights`` (source tag -> share, summing to 1) reserves each source its share
    (``_quotas``).
    """
    if room is None or sum(c.nbytes for c in candidates) <= room:
        return sorted(c.seq for c in candidates)
    order = sorted(candidates, key=lambda c: (c.reads + c.pending, c.seq))
    chosen: set[int] = set()
    left = room
    if weights and len(weights) > 1:
        for tag, reserved in sorted(_quotas(candidates, room, weights).items()):
            quota = reserved
            for candidate in order:
                if candidate.tag == tag and candidate.nbytes <= min(quota, left):
                    chosen.add(candidate.seq)
                    quota -= candidate.nbytes
                    left -= candidate.nbytes
    for candidate in order:
        if candidate.seq not in chosen and candidate.nbytes <= left:
            chosen.add(candidate.seq)
            left -= candidate.nbytes
    return sorted(chosen)


def _quotas(candidates: Sequence[Candidate], room: int, weights: Mapping[int, float]) -> dict[int, int]:
    """The bytes of ``room`` reserved to each weighted source: its weight's share of the room's samples, at its
    bytes per sample among ``candidates`` (those whose ``samples`` are known). A source whose samples are of the
    mix's mean size, or unknown (no candidate of it with samples), gets ``room x weight`` bytes, as where all
    samples are alike in size; the quotas add up to the room (weights summing to 1)."""
    nbytes: dict[int, int] = {}
    samples: dict[int, int] = {}
    for candidate in candidates:
        if candidate.samples > 0 and candidate.tag in weights:
            nbytes[candidate.tag] = nbytes.get(candidate.tag, 0) + candidate.nbytes
            samples[candidate.tag] = samples.get(candidate.tag, 0) + candidate.samples
    per_sample = {tag: nbytes[tag] / samples[tag] for tag in samples}
    known = sum(weights[tag] for tag in per_sample)
    mean = sum(weights[tag] * per_sample[tag] for tag in per_sample) / known if known > 0 else 0.0
    if mean <= 0:  # no sizes known (or only of segments that take no block yet): by bytes, as for alike samples
        return {tag: int(room * weight) for tag, weight in weights.items()}
    return {tag: int(room * weight * per_sample.get(tag, mean) / mean) for tag, weight in weights.items()}


def unread_first(candidates: Sequence[Candidate], room: int | None) -> list[int]:
    """The sequence numbers (ascending) a snapshot of unread samples pins (module docstring): the untouched segments
    no live snapshot holds, oldest first, within ``room``."""
    return choose([c for c in candidates if c.untouched and not c.pending], room)


def top_up(candidates: Sequence[Candidate], need: int, room: int | None) -> list[int]:
    """The sequence numbers (ascending) that top a snapshot up by ``need`` samples (module docstring): least-read
    first (reads plus a pending one, as ``choose``), then newest, until their ``samples`` reach ``need``, each
    within what is left of ``room`` (None: no limit)."""
    chosen: list[int] = []
    have, left = 0, room
    for candidate in sorted(candidates, key=lambda c: (c.reads + c.pending, -c.seq)):
        if have >= need:
            break
        if left is not None and candidate.nbytes > left:
            continue
        chosen.append(candidate.seq)
        have += candidate.samples
        if left is not None:
            left -= candidate.nbytes
    return sorted(chosen)
