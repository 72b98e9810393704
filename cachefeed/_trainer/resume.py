"""Checkpoints of the training loop's place: ``EpochLoaderFactory.state_dict`` / ``load_state_dict``.

The state is a plain, picklable dict (store it in a torch checkpoint next to the model)::

    {"version": 2, "epoch": 3, "batches_consumed": 120, "snapshot_id": "run-1a2b3c4d5e6f-e000003",
     "snapshot_nonce": "9f...", "settings": {"seed": 0, "batch_size": 256, "samples_per_epoch": None, ...}}

``batches_consumed`` counts the batches of the epoch the training loop *received* (a batch a look-ahead such as
``DevicePrefetcher`` holds but has not yielded is not consumed), in every run of it: a resumed epoch counts on from
its checkpoint's, so a run resumed twice in one epoch skips what both earlier runs consumed. After
``load_state_dict``, until the loop starts iterating an epoch, the state is the loaded one's place
(``pending_checkpoint``). ``settings`` holds everything that decides an epoch's order and this rank's share of it
(``SETTINGS``): the seed, the batch size, ``samples_per_epoch``, ``shuffle``, ``drop_last``, the ranks (global and
local world sizes, and this rank), the daemon's sources with their weights, and ``data``: what the cache holds
samples of (each source's URL and pattern, ``sources.cached_data``), so that a resume pointed at another cache is
refused rather than told the epoch's snapshot is gone (compared only where both the checkpoint and the cache say).

Resuming epoch ``e`` after ``k`` batches, with the same settings: if the daemon still keeps the epoch's snapshot (it
keeps a dead trainer's snapshot for ``cache.snapshot_grace``), the factory joins that very snapshot (its nonce must
match: a snapshot of the same name made by another job is never joined) and reads exactly the samples the epoch had
not handed out yet (the epoch's order is a pure function of the snapshot and the settings: ``partition.py``), and
the ``k`` batches count as served by the epoch (NOTE [ Read receipts ]). Otherwise the epoch runs on a fresh
snapshot, skipping its first ``k`` batches so step counts stay right, and one warning says the samples differ. A
state taken once the loop has received every batch of epoch ``e`` names epoch ``e + 1`` at its start (no snapshot):
a checkpoint saved at the end of an epoch resumes with the next one.

A setting that changed makes ``load_state_dict`` raise ``ValueError`` naming it and both values: the resumed epoch
could not be the rest of the interrupted one (a state at an epoch's start resumes nothing inside an epoch: it is
accepted whatever changed, an elastic restart's new world size included, but for ``data``: a checkpoint resumed on
another dataset's cache is refused wherever it stands). ``strict=False`` accepts the change and
takes the fresh-snapshot path (one warning), skipping as many of the job's samples as the interrupted run consumed
(``batches_consumed`` batches of the checkpoint's batch size and world size, counted in this factory's, rounded
down): a job resumed with twice the batch size skips half as many batches, not twice the samples. Any rank may load
any rank's state: ranks of one job consume batches in
lockstep, so the state only differs in ``rank``, which is not compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.snapshots import CLAIM_WAIT_S, RankClaimedError, Snapshot
from cachefeed._errors import SnapshotError
from cachefeed._logs import get_logger

__all__ = ["SETTINGS", "ResumePoint", "checkpoint", "pending_checkpoint", "resume_point", "resumed_snapshot"]

log = get_logger(__name__)

VERSION = 2
# What decides an epoch's order and a rank's share; compared on resume (``rank`` is stored, not compared).
SETTINGS = (
    "seed",
    "batch_size",
    "samples_per_epoch",
    "shuffle",
    "drop_last",
    "world_size",
    "local_world_size",
    "sources",
    "data",  # compared only where both sides know it: unknown before the cache's daemon wrote ``made_with.json``,
    # absent from a checkpoint of an older cachefeed
)
_REQUIRED = ("version", "epoch", "batches_consumed", "snapshot_id", "snapshot_nonce", "settings")


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a checkpointed run stopped. ``is_exact``: the settings match, so the epoch's own snapshot may be
    joined; False (``strict=False`` over changed settings) always takes a fresh snapshot. ``settings``: the
    checkpoint's own; ``batches_consumed`` counts batches of those. ``skip_batches``: the batches of the resuming
    factory's settings the epoch skips (module docstring)."""

    epoch: int
    snapshot_id: str
    snapshot_nonce: str
    batches_consumed: int
    is_exact: bool = True
    settings: Mapping[str, Any] = field(default_factory=dict)
    skip_batches: int | None = None  # None: ``batches_consumed`` (the same settings)

    @property
    def batches_to_skip(self) -> int:
        return self.batches_consumed if self.skip_batches is None else self.skip_batches


def _in_batches_of(consumed: int, saved: Mapping[str, Any], settings: Mapping[str, Any]) -> int:
    """``consumed`` batches of the ``saved`` settings as batches of ``settings``: as many of the job's samples
    (every rank's batch), rounded down. Unknown or odd sizes: ``consumed`` as it is."""
    try:
        before = int(saved["batch_size"]) * int(saved.get("world_size") or 1)
        now = int(settings["batch_size"]) * int(settings.get("world_size") or 1)
    except (KeyError, TypeError, ValueError):
        return consumed
    return consumed * before // now if before > 0 and now > 0 else consumed


def checkpoint(
    *, epoch: int, batches_consumed: int, snapshot: Snapshot | None, settings: Mapping[str, Any]
) -> dict[str, Any]:
    """The state dict (module docstring); ``snapshot`` None at an epoch's start (before the first epoch, or after
    one the loop read to its end): nothing to resume inside it."""
    return {
        "version": VERSION,
        "epoch": epoch,
        "batches_consumed": batches_consumed if snapshot is not None else 0,
        "snapshot_id": snapshot.snap_id if snapshot is not None else None,
        "snapshot_nonce": snapshot.nonce if snapshot is not None else None,
        "settings": dict(settings),
    }


def pending_checkpoint(epoch: int, point: ResumePoint | None, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict of a resume the training loop has not moved past yet (``load_state_dict`` returned ``epoch``,
    and the loop has started iterating no epoch since): the place it resumes, so that a checkpoint saved now
    resumes there again, not at epoch 0. ``settings``: the factory's; a point taken with ``strict=False`` keeps
    the checkpoint's (this rank's aside), so that loading it again takes the fresh-snapshot path again rather than
    joining the interrupted snapshot under settings that order it otherwise."""
    if point is None:
        return checkpoint(epoch=epoch, batches_consumed=0, snapshot=None, settings=settings)
    return {
        "version": VERSION,
        "epoch": point.epoch,
        "batches_consumed": point.batches_consumed,
        "snapshot_id": point.snapshot_id,
        "snapshot_nonce": point.snapshot_nonce,
        "settings": dict(settings) if point.is_exact else {**point.settings, "rank": settings.get("rank")},
    }


def resume_point(
    state: Mapping[str, Any], settings: Mapping[str, Any], *, strict: bool = True
) -> tuple[int, ResumePoint | None]:
    """Check a state dict against the factory's ``settings``: the epoch to continue with, and where in it (None: at
    its start, nothing to resume). Raises ValueError naming what is missing or malformed or, with ``strict``, what
    changed."""
    if not isinstance(state, Mapping):
        raise ValueError(f"load_state_dict: expected the dict state_dict() returned, got {type(state).__name__}")
    for key in _REQUIRED:
        if key not in state:
            raise ValueError(
                f"load_state_dict: {key!r} is missing: pass what state_dict() returned (a checkpoint of an older "
                "cachefeed cannot be resumed exactly; start the epoch again)"
            )
    if state["version"] != VERSION:
        raise ValueError(f"load_state_dict: version {state['version']!r}, this cachefeed reads version {VERSION}")
    saved = state["settings"]
    if not isinstance(saved, Mapping):
        raise ValueError(f"load_state_dict: 'settings' is {type(saved).__name__}, expected the dict state_dict() gave")
    for key in ("epoch", "batches_consumed"):  # a corrupted one would resume somewhere else (-5: the last 5 batches)
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"load_state_dict: {key!r} is {value!r}, expected an integer >= 0 as state_dict() gives")
    changed = [
        key
        for key in SETTINGS
        if _normal(saved.get(key)) != _normal(settings.get(key))
        and not (key == "data" and (saved.get(key) is None or settings.get(key) is None))
    ]
    if state["snapshot_id"] is None:  # at an epoch's start: nothing inside an epoch to resume, whatever changed ...
        changed = [key for key in changed if key == "data"]  # ... but the data: a job pointed at the wrong cache
        if not changed or not strict:
            return int(state["epoch"]), None
    if "data" in changed and strict:
        raise ValueError(
            f"load_state_dict: the checkpoint was taken on a cache of {saved.get('data')!r}, this factory's cache "
            f"holds samples of {settings.get('data')!r}: another dataset. Point the factory at the cache the "
            "checkpoint was taken on, or pass strict=False to go on with this one"
        )
    if changed and strict:
        key = changed[0]
        raise ValueError(
            f"load_state_dict: the checkpoint's {key} is {saved.get(key)!r}, this factory's is {settings.get(key)!r}"
            f"{' (and ' + ', '.join(changed[1:]) + ' changed too)' if changed[1:] else ''}: the resumed epoch could "
            "not be the rest of the interrupted one. Build the factory with the checkpoint's settings, or pass "
            "strict=False to continue on a fresh snapshot (skipping the batches already consumed)"
        )
    epoch, consumed = int(state["epoch"]), int(state["batches_consumed"])
    skip = _in_batches_of(consumed, saved, settings) if changed else consumed
    if changed:
        log.warning(
            "resuming epoch %d with changed settings (%s; strict=False): it runs on a fresh snapshot, skips its "
            "first %d batches%s and reads other samples than the interrupted epoch would have",
            epoch,
            ", ".join(f"{key} {saved.get(key)!r} -> {settings.get(key)!r}" for key in changed),
            skip,
            f" (as many samples as the checkpoint's {consumed})" if skip != consumed else "",
        )
    snapshot = str(state["snapshot_id"]), str(state["snapshot_nonce"])
    return epoch, ResumePoint(epoch, *snapshot, consumed, not changed, dict(saved), skip)


def _normal(value: Any) -> Any:
    """Settings as compared: a checkpoint that went through JSON or YAML has lists for tuples, str keys."""
    if isinstance(value, Mapping):
        return {str(k): _normal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normal(v) for v in value]
    return value


def resumed_snapshot(
    root: Path, resume: ResumePoint, *, rank: int | None = None, claim_wait_s: float = CLAIM_WAIT_S
) -> Snapshot | None:
    """The interrupted epoch's own snapshot, if the settings match and the daemon still keeps it; else None (and
    the log line). ``rank``: the local rank it claims (NOTE [ Snapshot pinning protocol ], "Rank claims"), waiting
    up to ``claim_wait_s`` for a predecessor still exiting to let go of it; one that another live process still
    reads then is ``RankClaimedError``, never a fresh snapshot: that process would read the same share of it."""
    if not resume.is_exact:
        return None
    layout = CacheLayout(root)
    # Who removes a stopped trainer's snapshot: the daemon, after its grace; without one, the trainer itself as it
    # stops by an exception (Ctrl-C), as it would on a normal close (``Epochs.close``)
    removed = (
        "or removed after cache.snapshot_grace"
        if layout.has_writer()
        else "or stopped by an exception (Ctrl-C): no daemon runs on this cache to keep it"
    )
    try:
        if not (layout.snapshots / resume.snapshot_id).exists():  # no rank is creating it: do not wait
            raise SnapshotError(
                f"its snapshot {resume.snapshot_id!r} is gone (released by a trainer that closed its factory, "
                f"{removed})"
            )
        snapshot = Snapshot.join(
            root, resume.snapshot_id, timeout_s=0.5, nonce=resume.snapshot_nonce, rank=rank, claim_wait_s=claim_wait_s
        )
    except RankClaimedError:
        raise
    except SnapshotError as exc:
        log.warning(
            "resuming epoch %d on a fresh snapshot: %s; the epoch skips its first %d batches but reads other samples "
            "than before",
            resume.epoch,
            exc,
            resume.batches_consumed,
        )
        return None
    log.info(
        "resuming epoch %d on snapshot %s after %d batches: the rest of the interrupted epoch, exactly",
        resume.epoch,
        snapshot.snap_id,
        resume.batches_consumed,
    )
    return snapshot
