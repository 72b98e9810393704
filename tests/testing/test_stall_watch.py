"""The stall witness the timing tests lean on (``tests/support/stalls.py``): it sees a process that was not run."""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.stalls import StallWatch, StallWindow


def test_a_watcher_not_run_for_a_while_reports_it_and_excuses_only_that_much() -> None:
    watch = StallWatch()
    try:
        window = StallWindow(watch, time.monotonic())
        time.sleep(0.2)  # the watcher's interpreter is up and ticking
        assert watch.longest_since(window.since) == 0.0
        window.assert_handover(0.4, 0.5)  # under the limit: nothing to excuse
        with pytest.raises(AssertionError, match=r"stalled at most 0\.00s"):
            window.assert_handover(0.9, 0.5)
        watch._process.send_signal(signal.SIGSTOP)  # as the machine does to every process, here to the watcher only
        time.sleep(0.6)
        watch._process.send_signal(signal.SIGCONT)
        assert watch.longest_since(window.since) >= 0.5
        window.assert_handover(0.9, 0.5)  # 0.4 s over the limit, across a 0.6 s stall
        with pytest.raises(AssertionError, match=r"handover waited 2\.000s"):
            window.assert_handover(2.0, 0.5)  # more than the stall explains
        assert watch.longest_since(time.monotonic()) == 0.0, "a stall before the window does not count"
    finally:
        watch.close()
