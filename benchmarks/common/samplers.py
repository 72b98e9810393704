"""A background sampler of the on-disk size of a directory tree (figure 3: the peak against the budget).

A daemon thread wakes every ``interval_s``, keeps a peak and a short timeline, and stops with ``stop()`` (which
joins the thread and returns the summary). It only reads: ``lstat`` on the tree.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any


def tree_bytes(roots: list[Path]) -> int:
    """Bytes the trees really occupy on disk: ``st_blocks * 512`` of every entry, hard links counted once.

    Symlinks are not followed; entries that vanish while walking (eviction, temp files) are skipped.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [str(root) for root in roots]
    while stack:
        path = stack.pop()
        try:
            entries = list(os.scandir(path))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            total += st.st_blocks * 512
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return total


class DiskSampler:
    """Samples :func:`tree_bytes` of some directories; ``stop()`` returns peak, last and a coarse timeline."""

    def __init__(self, roots: list[Path], interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="DiskSampler", daemon=True)
        self.errors = 0
        self.roots = roots
        self.peak_bytes = 0
        self.window_peak_bytes = 0
        self.last_bytes = 0
        self.samples = 0
        self._t0 = time.monotonic()
        self.timeline: list[tuple[float, int]] = []
        self._lock = threading.Lock()  # the thread samples while the main thread takes window peaks

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # a sampler must never take the measured run down
                self.errors += 1
            self._stop.wait(self.interval_s)
        self.sample()

    def sample(self) -> None:
        size = tree_bytes(self.roots)
        with self._lock:
            self.samples += 1
            self.last_bytes = size
            self.peak_bytes = max(self.peak_bytes, size)
            self.window_peak_bytes = max(self.window_peak_bytes, size)
            if self.samples % 10 == 1:
                self.timeline.append((round(time.monotonic() - self._t0, 2), size))

    def take_window_peak(self) -> int:
        """The peak since the previous call (or the start), then start a new window (e.g. one per epoch)."""
        self.sample()
        with self._lock:
            peak, self.window_peak_bytes = self.window_peak_bytes, self.last_bytes
        return peak

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        return {
            "peak_bytes": self.peak_bytes,
            "last_bytes": self.last_bytes,
            "samples": self.samples,
            "interval_s": self.interval_s,
            "timeline_1s": self.timeline,
        }
