"""The stall witness the handover tests lean on (``tests/support/stalls.py``): it sees a process that was not run,
and excuses a handover only by a stall during it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.stalls import StallWatch, StallWindow


def test_a_watcher_not_run_for_a_while_excuses_only_the_handover_it_overlapped_and_only_that_much() -> None:
    watch = StallWatch()  # returns once the watcher ticks
    try:
        window = StallWindow(watch)
        before = time.monotonic()
        window.assert_handover(0.4, 0.5, ended_at=before)  # under the limit: nothing to excuse
        with pytest.raises(AssertionError, match=r"stalled at most 0\.00s during it"):
            window.assert_handover(0.9, 0.5, ended_at=before)
        os.kill(watch.pid, signal.SIGSTOP)  # as the machine does to every process, here to the watcher only
        time.sleep(0.8)
        os.kill(watch.pid, signal.SIGCONT)
        during = time.monotonic()
        assert watch.longest_within(during - 1.0, during) >= 0.7
        window.assert_handover(0.9, 0.5, ended_at=during)  # 0.4 s over the limit, across a 0.8 s stall
        with pytest.raises(AssertionError, match=r"handover waited 2\.000s"):
            window.assert_handover(2.0, 0.5, ended_at=during)  # more than the stall explains
        with pytest.raises(AssertionError, match=r"stalled at most 0\.00s"):
            window.assert_handover(0.9, 0.5, ended_at=before)  # a handover before the stall is not excused by it
        with pytest.raises(AssertionError, match=r"stalled at most 0\.00s"):
            window.assert_handover(0.9, 0.5, ended_at=during + 1.5)  # nor one that began after it
        with pytest.raises(ValueError, match="needs the epoch"):
            window.assert_handover(0.1, 0.5)
        with pytest.raises(ValueError, match=r"read its loader through stalls\.batches"):
            window.assert_handover(0.1, 0.5, epoch=3)  # even a wait under the limit: the test is wrong either way
    finally:
        watch.close()
