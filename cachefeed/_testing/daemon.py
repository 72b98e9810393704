"""The real daemon (``python -m cachefeed daemon``) as a subprocess on a test config, and a look at it.

:func:`write_config` writes the config the tests and benchmarks start a daemon on (fast intervals, small segments,
no fsync; sections override keys); :func:`start_daemon` starts the daemon on it in its own session (process
group), so a test can SIGKILL the whole group the way a crash or ``systemctl kill`` would; :class:`DaemonProcess`
reads its status document and stderr and stops it. :func:`wait_for` polls with a deadline; :func:`wait_while_running`
polls while daemons run, failing at once with a daemon's stderr when one has exited (not after the timeout).

The tests' ``bucket`` and ``daemon`` fixtures (``tests/conftest.py``) are built on these.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachefeed._cache.layout import CacheLayout
from cachefeed._config import toml_text
from cachefeed._status.document import load_document
from cachefeed._testing.local_s3 import storage_options

__all__ = [
    "BUCKET",
    "DaemonProcess",
    "StartDaemon",
    "daemon_argv",
    "start_daemon",
    "wait_for",
    "wait_while_running",
    "write_config",
]

BUCKET = "data"
"""The bucket the tests' daemons read (the ``bucket`` fixture creates it)."""


def wait_for(predicate: Callable[[], Any], *, timeout_s: float, interval_s: float = 0.05, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        time.sleep(interval_s)


def stay_behind_ingest(cache_dir: Path, samples: int, *, timeout_s: float = 60.0) -> None:
    """Wait until the daemon's status document says it caches ``samples`` or has fetched everything the remote
    lists, then a tick of a growing epoch's grower (50 ms) more: a training loop that calls this before each step,
    with what it has read and a margin, stays slower than the remote whatever the machine's load. A fixed step at
    half the remote's rate did not: with other daemons beside it on 2 cores, the remote fell behind it."""

    def ahead() -> bool:
        document = load_document(CacheLayout(cache_dir).status_file)  # the one reader of the daemon's document
        return document is not None and (
            document["cache"]["samples"] >= samples or document["remote"]["passes_completed"] >= 1
        )

    wait_for(ahead, timeout_s=timeout_s, what=f"the daemon to cache {samples} samples")
    time.sleep(0.1)


def wait_while_running(
    daemons: DaemonProcess | Iterable[DaemonProcess],
    predicate: Callable[[], Any],
    *,
    timeout_s: float,
    interval_s: float = 0.05,
    what: str = "",
) -> Any:
    """:func:`wait_for` on something the daemons bring about; fails at once with a daemon's stderr if one exits."""
    watched = [daemons] if isinstance(daemons, DaemonProcess) else list(daemons)

    def check() -> Any:
        for daemon in watched:
            daemon.check_running()
        return predicate()

    return wait_for(check, timeout_s=timeout_s, interval_s=interval_s, what=what)


def write_config(
    path: Path,
    *,
    endpoint: str,
    bucket: str,
    cache_dir: Path,
    prefix: str = "",
    sections: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """A daemon config for a test: fast intervals, small segments, no fsync; ``sections`` override keys."""
    document: dict[str, dict[str, Any]] = {
        "remote": {
            "url": f"s3://{bucket}/{prefix}",
            "storage_options": storage_options(endpoint),
            "refresh_interval": "2s",
            "backoff_base": "20ms",
            "backoff_max": "200ms",
        },
        "cache": {
            "dir": str(cache_dir),
            "max_bytes": "64MiB",
            "min_free_bytes": 0,
            "segment_bytes": "256KiB",
            "fsync": False,
            "snapshot_grace": "0s",  # dead trainers' snapshots go at once; the resume grace has its own tests
        },
        "sampler": {"processes": 2, "concurrency": 8, "restart_backoff": "200ms", "restart_backoff_max": "2s"},
        "status": {"interval": "200ms"},
        "log": {"level": "info"},
    }
    for section, body in (sections or {}).items():
        document.setdefault(section, {}).update(body)
    path.write_text(toml_text(document))
    return path


@dataclass
class DaemonProcess:
    """A running ``cachefeed daemon``; stderr goes to a file the test can read."""

    process: subprocess.Popen[bytes]
    config_path: Path
    cache_dir: Path
    stderr_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def status(self) -> dict[str, Any] | None:
        try:
            document: dict[str, Any] = json.loads((self.cache_dir / "status.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return document if document.get("pid") == self.pid else None

    def check_running(self) -> None:
        """Raise ``RuntimeError`` with the exit status and the end of stderr if the daemon has exited."""
        if self.process.poll() is not None:
            raise RuntimeError(f"daemon exited with {self.process.returncode}:\n{self.stderr()[-4000:]}")

    def wait_status(
        self, predicate: Callable[[dict[str, Any]], bool], *, timeout_s: float, what: str = ""
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            self.check_running()
            document = self.status()
            return document if document is not None and predicate(document) else None

        result: dict[str, Any] = wait_for(check, timeout_s=timeout_s, what=what)
        return result

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)

    def stall(self, seconds: float) -> threading.Thread:
        """Stop the daemon and its samplers (SIGSTOP to its process group) and let them go on after ``seconds``, on
        a thread (returned; join it): what a machine that gives them no CPU for a while does. The daemon keeps its
        locks and its heartbeat ages meanwhile."""
        os.killpg(self.process.pid, signal.SIGSTOP)

        def resume() -> None:
            time.sleep(seconds)
            self._continue()

        thread = threading.Thread(target=resume, name="daemon-stall", daemon=True)
        thread.start()
        return thread

    def _continue(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.process.poll() is None:
            self._continue()  # a stalled daemon handles SIGTERM only once it runs
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill_group()
        return self.process.returncode

    def sampler_pids(self) -> list[int]:
        """Live children of the daemon (its samplers), from /proc."""
        children = Path(f"/proc/{self.pid}/task/{self.pid}/children")
        try:
            return [int(pid) for pid in children.read_text().split()]
        except FileNotFoundError:
            return []


def daemon_argv(config_path: Path, *extra_args: str) -> list[str]:
    """The command line that starts the daemon (``python -m cachefeed daemon --config FILE``)."""
    return [sys.executable, "-m", "cachefeed", "daemon", "--config", str(config_path), *extra_args]


def start_daemon(
    config_path: Path,
    cache_dir: Path,
    stderr_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
) -> DaemonProcess:
    """Start ``cachefeed daemon --config config_path`` in a new session; its stderr goes to ``stderr_path``."""
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen(
            daemon_argv(config_path, *extra_args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=dict(os.environ if env is None else env),
            start_new_session=True,
        )
    return DaemonProcess(process, config_path, cache_dir, stderr_path)


StartDaemon = Callable[..., DaemonProcess]
"""The type of the tests' ``daemon`` fixture: ``daemon(endpoint=..., sections=..., env=...)``."""
