"""Going back to an epoch: ``loader(0)``, ``loader(1)``, then ``loader(0)`` again in the same process.

The re-opened epoch raced the teardown thread's release of its earlier build: where that release was removing the
snapshot, the new build took the name for a live snapshot, waited for it, and failed a minute later saying the
snapshot "was removed while another process held its lock" (it was this process's own teardown). An epoch asked
for again is read anew, as any epoch (``lifecycle.py``, "build again"): every sample of it once, at once.

The same race between processes: a creator that finds its snapshot's name taken by a snapshot its last holder is
removing makes the snapshot anew once it is gone (NOTE [ Snapshot pinning protocol ], "Joining").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefeed._cache import snapshots
from cachefeed._cache.snapshots import Snapshot
from cachefeed._trainer import EpochLoaderFactory, lifecycle
from tests.trainer.test_loader import build_cache, check_batch

SAMPLES = 200
REMOVAL_S = 0.5  # how long removing a snapshot directory takes here: a slow file system, a busy machine
# "At once" on a loaded machine: half the timeout the races waited out before (``CREATE_JOIN_S``)
AT_ONCE_S = snapshots.CREATE_JOIN_S / 2


@pytest.fixture
def slow_removal(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Removing a snapshot's directory takes ``REMOVAL_S``; the event is set when one starts."""
    started = threading.Event()
    remove_tree = snapshots.remove_tree

    def slowly(path: str | Path) -> None:
        if Path(path).is_dir():
            started.set()
            time.sleep(REMOVAL_S)
        remove_tree(path)

    monkeypatch.setattr(snapshots, "remove_tree", slowly)
    yield started


def keys(loader: object) -> list[str]:
    return [key for batch in loader for key in check_batch(batch)]  # type: ignore[attr-defined]


@pytest.mark.parametrize("workers", [0, 2])  # in the training process, and through the factory's worker pool
def test_an_epoch_asked_for_again_while_its_earlier_build_is_removed_is_read_anew_at_once(
    tmp_path: Path, slow_removal: threading.Event, workers: int
) -> None:
    root = build_cache(tmp_path / "c", SAMPLES)
    with EpochLoaderFactory(root, batch_size=10, num_workers=workers, progress=None) as factory:
        first = keys(factory.loader(0))
        next(iter(factory.loader(1)))  # its first batch ends the handover: the teardown thread releases epoch 0
        assert slow_removal.wait(10), "epoch 0's release removes its snapshot"
        started = time.monotonic()
        again = keys(factory.loader(0))
        took = time.monotonic() - started
    everything = sorted(f"k{i}" for i in range(SAMPLES))
    assert sorted(first) == everything
    assert sorted(again) == everything, "the epoch again: every sample once"
    assert took < AT_ONCE_S, f"at once, not after a timeout ({took:.1f}s)"


def test_a_creator_that_finds_its_snapshot_being_removed_makes_it_anew(
    tmp_path: Path, slow_removal: threading.Event
) -> None:
    root = build_cache(tmp_path / "c", SAMPLES)
    earlier = Snapshot.create(root, "run-e000000")
    releasing = threading.Thread(target=earlier.release)  # the last holder: it removes the snapshot
    releasing.start()
    try:
        assert slow_removal.wait(10)
        started = time.monotonic()
        anew = Snapshot.create(root, "run-e000000")
        took = time.monotonic() - started
    finally:
        releasing.join()
    try:
        assert anew.nonce != earlier.nonce, "a snapshot of its own, not the one removed"
        assert anew.samples == SAMPLES and all(path.exists() for path in anew.paths)
        assert took < AT_ONCE_S, f"once the name was free, not after a timeout ({took:.1f}s)"
    finally:
        anew.release()


def test_an_epoch_asked_for_again_before_its_earlier_build_is_released_is_read_on_a_fresh_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its earlier build is released a moment later (after the handover): the epoch read again joined that build's
    snapshot or made a fresh one, depending on the moment, and a pass on the joined one served samples whose reads
    were on record already (NOTE [ Read receipts ]: one receipt per snapshot). Now it is always a fresh one. The
    teardown's hold is made long, so that the earlier build is still held when the epoch is asked for again, however
    slow the machine."""
    monkeypatch.setattr(lifecycle, "_TEARDOWN_HOLD_S", 600.0)
    root = build_cache(tmp_path / "c", SAMPLES)
    with EpochLoaderFactory(root, batch_size=10, progress=None) as factory:
        first, first_nonce = read_noting_the_snapshot(factory, 0)
        factory.loader(1)  # no batch of it taken: epoch 0's release waits for the handover
        again, again_nonce = read_noting_the_snapshot(factory, 0)
    assert sorted(again) == sorted(first) == sorted(f"k{i}" for i in range(SAMPLES)), "every sample once"
    assert again_nonce != first_nonce, "a fresh snapshot, not the earlier build's"


def read_noting_the_snapshot(factory: EpochLoaderFactory, epoch: int) -> tuple[list[str], str]:
    """Read ``epoch`` through: the keys received, and the nonce of the snapshot it read (its checkpoint's)."""
    batches = iter(factory.loader(epoch))
    received = check_batch(next(batches))
    nonce = factory.state_dict()["snapshot_nonce"]
    return received + [key for batch in batches for key in check_batch(batch)], nonce
