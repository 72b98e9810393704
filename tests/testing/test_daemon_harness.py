"""The daemon harness's waits (``cachefeed._testing.daemon``): a daemon that exits fails a wait at once, with its
stderr, instead of the wait running out its timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachefeed._testing.daemon import DaemonProcess, wait_while_running


def exited_daemon(tmp_path: Path, name: str) -> DaemonProcess:
    """A process standing in for a daemon that failed: it writes a line to its stderr file and exits 3."""
    stderr_path = tmp_path / f"{name}.stderr"
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.stderr.write('{name}: the reason it stopped'); sys.exit(3)"],
            stderr=stderr,
        )
    process.wait(timeout=60)
    return DaemonProcess(process, tmp_path / "daemon.toml", tmp_path / "cache", stderr_path)


def sleeping_daemon(tmp_path: Path) -> DaemonProcess:
    """A process that stays up for a minute, as a running daemon does for these waits."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return DaemonProcess(process, tmp_path / "daemon.toml", tmp_path / "cache", tmp_path / "running.stderr")


def test_a_wait_on_daemons_fails_at_once_with_the_stderr_of_one_that_exited(tmp_path: Path) -> None:
    running = sleeping_daemon(tmp_path)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"daemon exited with 3:\nnode-1: the reason it stopped"):
            wait_while_running([running, exited_daemon(tmp_path, "node-1")], lambda: False, timeout_s=120, what="never")
        assert time.monotonic() - started < 60, "the wait did not run out its timeout"
        with pytest.raises(RuntimeError, match="node-2: the reason it stopped"):
            exited_daemon(tmp_path, "node-2").wait_status(lambda d: True, timeout_s=120)
    finally:
        running.process.kill()
        running.process.wait()


def test_a_wait_on_a_running_daemon_returns_what_the_predicate_returns(tmp_path: Path) -> None:
    running = sleeping_daemon(tmp_path)
    try:
        polls: list[int] = []
        found = wait_while_running(running, lambda: polls.append(1) or (len(polls) >= 3 and "ready"), timeout_s=60)
        assert found == "ready" and len(polls) == 3
        with pytest.raises(TimeoutError, match="never"):
            wait_while_running(running, lambda: False, timeout_s=0.2, what="never")
    finally:
        running.process.kill()
        running.process.wait()
