"""Machine stalls, seen from outside the processes under test: a witness for timing assertions.

This VM at times stops every process for 5-12 s (CONTRIBUTING.md, "Machine stalls"); CLOCK_MONOTONIC runs on
through a stall, so a handover timed across one looks seconds long although nothing in cachefeed waited. A test
that asserts a handover under a limit cannot tell that from a regression by itself.

``StallWatch`` runs a small process that sleeps ``_TICK_S`` at a time and reports every wake-up that came more than
``threshold_s`` late, with its monotonic time (the clock is the machine's, shared by every process). Being a process
of its own, it is not held up by the GIL or a busy loop of the test's process: a late wake-up means the machine did
not run it, which on this scale (a tenth of a second and more) is a stall, not a busy core (the scheduler wakes a
sleeper within milliseconds). ``StallWindow.assert_handover`` turns that into the assertion the tests share: a wait
under its limit, or, if not, a stall at least as long as the excess seen while the test ran, and the test says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

__all__ = ["StallWatch", "StallWindow"]

_TICK_S = 0.01
_WATCHER = """
import os, sys, time
parent, tick, threshold = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
last = time.monotonic()
while os.getppid() == parent:
    time.sleep(tick)
    now = time.monotonic()
    if now - last > tick + threshold:
        print(f"{last} {now - last - tick}", flush=True)
    last = now
"""


class StallWatch:
    """A watcher process and what it reported: ``(began_at, seconds)`` of each stall (module docstring)."""

    def __init__(self, threshold_s: float = 0.1) -> None:
        self.threshold_s = threshold_s
        self._stalls: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._process = subprocess.Popen(
            [sys.executable, "-c", _WATCHER, str(os.getpid()), str(_TICK_S), str(threshold_s)],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, name="stall-watch", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            began, seconds = (float(field) for field in line.split())
            with self._lock:
                self._stalls.append((began, seconds))

    def longest_since(self, since: float) -> float:
        """The longest stall that ended after monotonic time ``since`` (0.0 if none); waits a tick for a report
        of the moment just passed."""
        time.sleep(3 * _TICK_S)
        with self._lock:
            return max((seconds for began, seconds in self._stalls if began + seconds > since), default=0.0)

    def close(self) -> None:
        self._process.kill()
        self._process.wait()
        self._reader.join(timeout=5)
        if self._process.stdout is not None:
            self._process.stdout.close()


@dataclass(frozen=True)
class StallWindow:
    """A test's view of the watch: stalls since the test began (the ``stalls`` fixture, ``tests/conftest.py``)."""

    watch: StallWatch
    since: float

    def assert_handover(self, wait_s: float | None, limit_s: float, what: str = "") -> None:
        """Assert ``wait_s`` (a handover's wait; None: none) is under ``limit_s``, unless the machine stalled at
        least the excess while the test ran (then the wait measured the machine, and the test prints so)."""
        if wait_s is None or wait_s < limit_s:
            return
        longest = self.watch.longest_since(self.since)
        assert longest >= wait_s - limit_s, (
            f"{what}handover waited {wait_s:.3f}s, limit {limit_s}s; the machine stalled at most {longest:.2f}s "
            "meanwhile"
        )
        print(f"\n{what}handover waited {wait_s:.3f}s (limit {limit_s}s) across a machine stall of {longest:.2f}s")
