"""Machine stalls, seen from outside the processes under test: a witness for handover-time assertions.

This VM at times stops every process for 5-12 s under load (CONTRIBUTING.md: the bullet on the VM stopping every
process); CLOCK_MONOTONIC runs on through a stall, so a handover timed across one looks seconds long although
nothing in cachefeed waited. A test that asserts a handover under a limit cannot tell that from a regression alone.

``StallWatch`` runs a small process that sleeps ``_TICK_S`` at a time and reports every wake-up that came more than
``threshold_s`` late, with its monotonic time (the clock is the machine's, shared by every process). Being a process
of its own, it is not held up by the GIL or a busy loop of the test's process, and a sleeper that woke a quarter of
a second late was not run at all for that long: no ordinary load on two cores delays a waking process that much,
a stall does (the seconds-long ones are what the tests meet). ``StallWindow`` is a test's view: ``batches`` notes
when each epoch's first batch reached the loop (the end of the handover into it), and ``assert_handover`` holds a
handover's wait to its limit unless a stall that overlapped that handover was at least as long as the excess; the
test then prints that it excused it. A stall elsewhere in the test excuses nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StallWatch", "StallWindow"]

_TICK_S = 0.01
_STEP_SLACK_S = 0.5  # a handover's window reaches this far before its wait: the test's own code between two epochs
_WATCHER = """
import os, sys, time
parent, tick, threshold = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
time.sleep(tick)
print("ready", flush=True)
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

    def __init__(self, threshold_s: float = 0.25, start_timeout_s: float = 60.0) -> None:
        self.threshold_s = threshold_s
        self._stalls: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._process = subprocess.Popen(
            [sys.executable, "-c", _WATCHER, str(os.getpid()), str(_TICK_S), str(threshold_s)],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, name="stall-watch", daemon=True)
        self._reader.start()
        if not self._ready.wait(start_timeout_s):
            self.close()
            raise RuntimeError(f"the stall watcher did not start within {start_timeout_s:g}s")

    @property
    def pid(self) -> int:
        return self._process.pid

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line == "ready\n":
                self._ready.set()
                continue
            began, seconds = (float(field) for field in line.split())
            with self._lock:
                self._stalls.append((began, seconds))

    def longest_within(self, start: float, end: float) -> float:
        """The longest stall that overlapped monotonic times ``[start, end]`` (0.0 if none). A stall is reported
        when the watcher wakes after it: the report of one that just ended is waited for (a few ticks)."""
        time.sleep(max(0.0, end + 3 * _TICK_S + self.threshold_s - time.monotonic()))
        time.sleep(3 * _TICK_S)  # the reader thread's turn
        with self._lock:
            return max(
                (seconds for began, seconds in self._stalls if began < end and began + seconds > start), default=0.0
            )

    def close(self) -> None:
        self._process.kill()
        self._process.wait()
        self._reader.join(timeout=5)
        if self._process.stdout is not None:
            self._process.stdout.close()


@dataclass
class StallWindow:
    """A test's view of the watch (the ``stalls`` fixture, ``tests/conftest.py``; module docstring)."""

    watch: StallWatch
    first_batch_at: dict[int, float] = field(default_factory=dict)  # epoch -> when its first batch reached the loop

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """``loader``'s batches (an ``EpochLoader``), noting when the first one came."""
        epoch = int(loader.epoch)  # type: ignore[attr-defined]
        for batch in loader:
            self.first_batch_at.setdefault(epoch, time.monotonic())
            yield batch

    def assert_handover(
        self, wait_s: float | None, limit_s: float, *, epoch: int | None = None, ended_at: float | None = None
    ) -> None:
        """Assert a handover's ``wait_s`` (None: there was none) is under ``limit_s``, unless a machine stall that
        overlapped it was at least the excess. The handover ended at ``ended_at`` (monotonic), or at epoch
        ``epoch``'s first batch as ``batches`` noted it."""
        if ended_at is not None:
            end = ended_at
        elif epoch is None:
            raise ValueError("assert_handover needs the epoch whose first batch ended the handover, or ended_at")
        elif epoch in self.first_batch_at:
            end = self.first_batch_at[epoch]
        else:
            raise ValueError(f"epoch {epoch}'s first batch was not noted: read its loader through stalls.batches")
        if wait_s is None or wait_s < limit_s:
            return
        longest = self.watch.longest_within(end - wait_s - _STEP_SLACK_S, end)
        what = f"epoch {epoch}: " if epoch is not None else ""
        assert longest >= wait_s - limit_s, (
            f"{what}handover waited {wait_s:.3f}s, limit {limit_s}s; the machine stalled at most {longest:.2f}s "
            "during it"
        )
        print(f"\n{what}handover waited {wait_s:.3f}s (limit {limit_s}s) across a machine stall of {longest:.2f}s")
