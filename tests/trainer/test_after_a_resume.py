"""What a factory does after ``load_state_dict``, beyond the resumed epoch's rest (``tests/trainer/test_resume.py``).

* Going back to a resumed epoch (``loader(0)``, ``loader(1)``, ``loader(0)``): it was resumed a second time, the
  same batches skipped again on a fresh snapshot. An epoch asked for again is read anew, whole, as any epoch
  (``lifecycle.py``, "build again"): the build that resumed the epoch spent the resume.
* A state saved right after a ``strict=False`` resume names the loaded place with the checkpoint's settings: loading
  it again is refused, or continued on a fresh snapshot, as loading the checkpoint itself is; it is not taken for an
  exact resume of a snapshot that other settings order otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cachefeed._trainer import EpochLoaderFactory
from tests.trainer.test_loader import build_cache, check_batch

SAMPLES = 200
BATCH = 10
CONSUMED = 3  # batches of epoch 0 the interrupted run's loop received


def keys(loader: object) -> list[str]:
    return [key for batch in loader for key in check_batch(batch)]  # type: ignore[attr-defined]


def interrupted_state(root: Path, **settings: Any) -> tuple[list[str], dict[str, Any]]:
    """The keys of ``CONSUMED`` batches of epoch 0 and the state saved after them."""
    with EpochLoaderFactory(root, batch_size=BATCH, run_id="first", progress=None, **settings) as factory:
        batches = iter(factory.loader(0))
        received = [key for _ in range(CONSUMED) for key in check_batch(next(batches))]
        return received, factory.state_dict()


@pytest.mark.parametrize("workers", [0, 2])  # in the training process, and through the factory's worker pool
def test_a_resumed_epoch_asked_for_again_is_read_anew_whole(tmp_path: Path, workers: int) -> None:
    root = build_cache(tmp_path / "c", SAMPLES)
    interrupted, state = interrupted_state(root)
    with EpochLoaderFactory(root, batch_size=BATCH, num_workers=workers, run_id="again", progress=None) as factory:
        epoch = factory.load_state_dict(state)
        rest = keys(factory.loader(epoch))
        keys(factory.loader(epoch + 1))
        again = keys(factory.loader(epoch))
    assert len(interrupted) + len(rest) == SAMPLES, "the resume skipped the consumed batches"
    assert sorted(again) == sorted(f"k{i}" for i in range(SAMPLES)), "the epoch asked for again: every sample once"


def test_a_state_saved_right_after_a_resume_with_changed_settings_resumes_as_the_checkpoint_does(
    tmp_path: Path,
) -> None:
    root = build_cache(tmp_path / "c", SAMPLES)
    _interrupted, state = interrupted_state(root, samples_per_epoch=100)
    with EpochLoaderFactory(root, batch_size=BATCH, samples_per_epoch=120, run_id="b", progress=None) as factory:
        factory.load_state_dict(state, strict=False)
        saved = factory.state_dict()  # before the loop started: the loaded place
    with EpochLoaderFactory(root, batch_size=BATCH, samples_per_epoch=120, run_id="c", progress=None) as factory:
        with pytest.raises(ValueError, match="samples_per_epoch is 100, this factory's is 120"):
            factory.load_state_dict(saved)
        assert factory.load_state_dict(saved, strict=False) == 0
        rest = keys(factory.loader(0))
    assert len(rest) == 120 - CONSUMED * BATCH, "the consumed batches skipped: the step count stays right"


@pytest.mark.parametrize("batch_size", [5, 20, 7])
def test_a_resume_with_another_batch_size_skips_as_many_samples_as_were_consumed(
    tmp_path: Path, batch_size: int
) -> None:
    """``strict=False`` over a changed batch size: the consumed batches, counted in the new size (rounded down), are
    skipped, so the epoch reads as many samples as the interrupted one had left (not k batches of the new size)."""
    root = build_cache(tmp_path / "c", SAMPLES)
    interrupted, state = interrupted_state(root)
    with EpochLoaderFactory(root, batch_size=batch_size, run_id="resized", progress=None) as factory:
        assert factory.load_state_dict(state, strict=False) == 0
        rest = keys(factory.loader(0))
        position = factory.state_dict()
    skipped = CONSUMED * BATCH // batch_size
    assert len(rest) == SAMPLES - skipped * batch_size
    assert SAMPLES - len(interrupted) <= len(rest) < SAMPLES - len(interrupted) + batch_size
    assert position["epoch"] == 1 and position["settings"]["batch_size"] == batch_size
