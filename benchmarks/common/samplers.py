"""Background samplers: on-disk size of a directory tree, and the memory of DataLoader worker processes.

Both run as daemon threads that wake every ``interval_s``, keep a peak and a short timeline, and stop with
``stop()`` (which joins the thread and returns the summary). They only read: ``lstat`` on a tree, ``/proc``
through psutil.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

try:  # only RssSampler needs it (the main .venv's smoke test runs without it)
    import psutil
except ImportError:  # pragma: no cover
    psutil = None


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


class _Periodic:
    """A daemon thread calling ``self.sample()`` every ``interval_s`` until ``stop()``."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self.errors = 0

    def start(self) -> None:
        self._thread.start()

    def stop_thread(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # a sampler must never take the measured run down
                self.errors += 1
            self._stop.wait(self.interval_s)
        self.sample()

    def sample(self) -> None:
        raise NotImplementedError


class DiskSampler(_Periodic):
    """Samples :func:`tree_bytes` of some directories; ``stop()`` returns peak, last and a coarse timeline."""

    def __init__(self, roots: list[Path], interval_s: float = 0.1) -> None:
        super().__init__(interval_s)
        self.roots = roots
        self.peak_bytes = 0
        self.window_peak_bytes = 0
        self.last_bytes = 0
        self.samples = 0
        self._t0 = time.monotonic()
        self.timeline: list[tuple[float, int]] = []
        self._lock = threading.Lock()  # the thread samples while the main thread takes window peaks

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
        self.stop_thread()
        return {
            "peak_bytes": self.peak_bytes,
            "last_bytes": self.last_bytes,
            "samples": self.samples,
            "interval_s": self.interval_s,
            "timeline_1s": self.timeline,
        }


# Processes (with their descendants) that are not DataLoader workers: e.g. a cache daemon the system under test
# started. Their memory is reported apart (``peak_excluded_rss_sum_bytes``), not as a worker's.
EXCLUDED_PIDS: set[int] = set()


class RssSampler(_Periodic):
    """Samples the memory of this process's descendants (DataLoader workers and their helpers).

    Records the peak RSS of each worker, the peak of their sum, and, when ``with_pss`` is set, the peak sum of
    PSS (proportional set size: shared pages split among sharers, so forked workers are not counted N times).
    """

    def __init__(self, interval_s: float = 0.1, with_pss: bool = True) -> None:
        super().__init__(interval_s)
        if psutil is None:
            raise RuntimeError("RssSampler needs psutil (installed in .bench-venv)")
        self.with_pss = with_pss
        self._me = psutil.Process(os.getpid())
        self.peak_by_pid: dict[int, int] = {}
        self.peak_sum_rss = 0
        self.peak_sum_pss = 0
        self.peak_parent_rss = 0
        self.max_children = 0
        self.peak_excluded_rss = 0

    def sample(self) -> None:
        self.peak_parent_rss = max(self.peak_parent_rss, self._me.memory_info().rss)
        total_rss = 0
        total_pss = 0
        children = self._me.children(recursive=True)
        excluded = self._excluded(children)
        if excluded:
            children = [c for c in children if c.pid not in excluded]
        self.max_children = max(self.max_children, len(children))
        for child in children:
            try:
                if self.with_pss:
                    info = child.memory_full_info()
                    total_pss += info.pss
                else:
                    info = child.memory_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            total_rss += info.rss
            self.peak_by_pid[child.pid] = max(self.peak_by_pid.get(child.pid, 0), info.rss)
        self.peak_sum_rss = max(self.peak_sum_rss, total_rss)
        self.peak_sum_pss = max(self.peak_sum_pss, total_pss)

    def _excluded(self, children: list[Any]) -> set[int]:
        """Pids of ``EXCLUDED_PIDS`` and their descendants among ``children``; their RSS sum feeds its own peak."""
        roots = EXCLUDED_PIDS & {c.pid for c in children}
        if not roots:
            return set()
        pids = set(roots)
        for child in children:
            if child.pid in roots:
                try:
                    pids |= {d.pid for d in child.children(recursive=True)}
                except psutil.Error:
                    continue
        total = 0
        for child in children:
            if child.pid in pids:
                try:
                    total += child.memory_info().rss
                except psutil.Error:
                    continue
        self.peak_excluded_rss = max(self.peak_excluded_rss, total)
        return pids

    def stop(self) -> dict[str, Any]:
        self.stop_thread()
        peaks = sorted(self.peak_by_pid.values(), reverse=True)
        return {
            "peak_worker_rss_bytes": peaks[0] if peaks else 0,
            "peak_workers_rss_sum_bytes": self.peak_sum_rss,
            "peak_workers_pss_sum_bytes": self.peak_sum_pss if self.with_pss else None,
            "peak_parent_rss_bytes": self.peak_parent_rss,
            "processes_seen": len(peaks),
            "max_concurrent_children": self.max_children,
            "peak_excluded_rss_sum_bytes": self.peak_excluded_rss,
        }
