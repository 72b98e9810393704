"""A training loop busy in Python holds the GIL: the handover must not depend on our threads getting it.

Beside such a loop, the build thread got the GIL back only every 5 ms (``sys.getswitchinterval()``) after each of its
system calls, so a build outlasted its lead, and the teardown thread's Python held the GIL while the training
thread made its own calls at the boundary (``benchmarks.echo`` committed at b178e98: handovers of up to 15.5 ms).
Builds now run with prompt hand-offs (``_trainer/gil.py``) and teardown waits for the handover to be over.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cachefeed._trainer import EpochLoaderFactory, lifecycle
from cachefeed._trainer.gil import HANDOFF_INTERVAL_S, prompt_handoffs
from tests.trainer.test_loader import build_cache, check_batch, wait_until


def test_prompt_handoffs_lowers_the_switch_interval_and_gives_the_programs_value_back() -> None:
    before = sys.getswitchinterval()
    assert before > HANDOFF_INTERVAL_S  # the interpreter's default, 5 ms
    with prompt_handoffs():
        assert sys.getswitchinterval() == pytest.approx(HANDOFF_INTERVAL_S)
        with prompt_handoffs():  # a second factory's build at the same time
            pass
        assert sys.getswitchinterval() == pytest.approx(HANDOFF_INTERVAL_S), "restored before the last user left"
    assert sys.getswitchinterval() == before


def test_prompt_handoffs_leaves_a_value_the_program_set_meanwhile() -> None:
    before = sys.getswitchinterval()
    try:
        with prompt_handoffs():
            sys.setswitchinterval(0.002)  # the program's own choice, made while a build ran
        assert sys.getswitchinterval() == pytest.approx(0.002)
        sys.setswitchinterval(0.0001)
        lower = sys.getswitchinterval()  # as the interpreter stores it (whole microseconds)
        with prompt_handoffs():
            assert sys.getswitchinterval() == lower, "a lower interval of the program's is kept"
        assert sys.getswitchinterval() == lower
    finally:
        sys.setswitchinterval(before)


class _IntervalSeen:
    """A transform that notes the switch interval whenever it runs off the training (main) thread: in-process, a
    background build fetches its epoch's first batch on the build thread."""

    def __init__(self) -> None:
        self.off_main: list[float] = []

    def __call__(self, sample: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            self.off_main.append(sys.getswitchinterval())
        return sample


def test_a_background_build_runs_with_prompt_gil_handoffs(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 200)
    seen = _IntervalSeen()
    before = sys.getswitchinterval()
    with EpochLoaderFactory(
        root, batch_size=20, num_workers=0, run_id="t", epochs=3, transform=seen, progress=None
    ) as factory:
        for epoch in range(3):
            for batch in factory.loader(epoch):
                check_batch(batch)
                time.sleep(0.01)
            assert sys.getswitchinterval() == before, "the program's interval is back once no build runs"
        assert factory.stats(2).prepared_in_background
    assert seen.off_main, "no batch was fetched on the build thread"
    assert max(seen.off_main) <= HANDOFF_INTERVAL_S + 1e-9, seen.off_main


def test_the_previous_epoch_is_released_after_the_next_epochs_first_batch_not_during_the_handover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle, "_TEARDOWN_HOLD_S", 60.0)  # only the first batch lets the teardown go
    root = build_cache(tmp_path / "c", 200)
    with EpochLoaderFactory(root, batch_size=20, num_workers=0, run_id="t", epochs=2, progress=None) as factory:
        for batch in factory.loader(0):
            check_batch(batch)
        first_lock = root / "snapshots" / f"{factory.snapshot_id(0)}.lock"
        loader = factory.loader(1)  # retires epoch 0: its release is queued on the teardown thread
        time.sleep(0.5)  # without the hold, the release (a few ms) is done by now
        assert first_lock.exists(), "epoch 0 was released during the handover"
        batches = iter(loader)
        check_batch(next(batches))
        wait_until(lambda: not first_lock.exists(), what="epoch 0 released after epoch 1's first batch")
        for batch in batches:
            check_batch(batch)
