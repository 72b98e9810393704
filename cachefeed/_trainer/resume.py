"""Checkpoints of the training loop's place: ``EpochLoaderFactory.state_dict`` / ``load_state_dict``.

The state is a plain, picklable dict (store it in a torch checkpoint next to the model)::

    {"version": 1, "epoch": 3, "batches_consumed": 120, "seed": 0, "snapshot_id": "run-e3", "batch_size": 256,
     "samples_per_epoch": None}

Resuming epoch ``e`` after ``k`` batches: if the daemon still keeps the epoch's snapshot (it keeps a dead trainer's
snapshot for ``cache.snapshot_grace``), the factory joins it and reads exactly the samples the epoch had not handed
out yet (the epoch's order is a pure function of the snapshot, the seed and the epoch: ``partition.py``); otherwise
the epoch runs on a fresh snapshot, skipping its first ``k`` batches so step counts stay right, and one log line
says that the samples differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachefeed._cache.snapshots import Snapshot
from cachefeed._errors import SnapshotError
from cachefeed._logs import get_logger

__all__ = ["ResumePoint", "checkpoint", "resume_point", "resumed_snapshot"]

log = get_logger(__name__)

VERSION = 1
_REQUIRED = ("version", "epoch", "batches_consumed", "seed", "snapshot_id")


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a checkpointed run stopped."""

    epoch: int
    snapshot_id: str
    batches_consumed: int


def checkpoint(
    *,
    epoch: int,
    batches_consumed: int,
    seed: int,
    snapshot_id: str | None,
    batch_size: int,
    samples_per_epoch: int | None,
) -> dict[str, Any]:
    """The state dict (module docstring); ``snapshot_id`` None before the first epoch."""
    if snapshot_id is None:
        return {"version": VERSION, "epoch": 0, "batches_consumed": 0, "seed": seed, "snapshot_id": None}
    return {
        "version": VERSION,
        "epoch": epoch,
        "batches_consumed": batches_consumed,
        "seed": seed,
        "snapshot_id": snapshot_id,
        "batch_size": batch_size,
        "samples_per_epoch": samples_per_epoch,
    }


def resume_point(state: Mapping[str, Any], *, seed: int, batch_size: int) -> tuple[int, ResumePoint | None]:
    """Check a state dict against the factory's settings: the epoch to continue with, and where in it (None: at
    its start, nothing to resume). Raises ValueError naming what does not match."""
    for key in _REQUIRED:
        if key not in state:
            raise ValueError(f"load_state_dict: {key!r} is missing: pass what state_dict() returned")
    if state["version"] != VERSION:
        raise ValueError(f"load_state_dict: version {state['version']!r}, this cachefeed reads version {VERSION}")
    for key, mine in (("seed", seed), ("batch_size", batch_size)):
        if key in state and state[key] != mine:
            raise ValueError(
                f"load_state_dict: the checkpoint's {key} is {state[key]!r}, this factory's {mine!r}: "
                "build the factory with the same settings to resume exactly"
            )
    epoch, consumed = int(state["epoch"]), int(state["batches_consumed"])
    if state["snapshot_id"] is None:
        return epoch, None
    return epoch, ResumePoint(epoch, str(state["snapshot_id"]), consumed)


def resumed_snapshot(root: Path, resume: ResumePoint) -> Snapshot | None:
    """The interrupted epoch's snapshot, if the daemon still keeps it; else None (and the log line)."""
    try:
        snapshot = Snapshot.join(root, resume.snapshot_id, timeout_s=0.5)
    except SnapshotError:
        log.warning(
            "resuming epoch %d on a fresh snapshot: %s is gone (a dead trainer's snapshot is kept for "
            "cache.snapshot_grace); the epoch skips its first %d batches but reads other samples than before",
            resume.epoch,
            resume.snapshot_id,
            resume.batches_consumed,
        )
        return None
    log.info(
        "resuming epoch %d on snapshot %s after %d batches", resume.epoch, snapshot.snap_id, resume.batches_consumed
    )
    return snapshot
