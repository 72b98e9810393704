"""Run the real daemon (``python -m cachefeed daemon``) as a subprocess against the moto server, and look at it.

Used by ``tests/test_daemon*.py`` and ``benchmarks/ingest.py``. The daemon runs in its own session (process
group), so a test can SIGKILL the whole group the way a crash or ``systemctl kill`` would.

Fixtures ``bucket`` and ``daemon``: import ``bucket_fixture`` and ``daemon_fixture`` into a test module.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachefeed.config import toml_text
from cachefeed.records import SegmentReader
from cachefeed.testing.local_s3 import LocalS3

__all__ = [
    "BUCKET",
    "DaemonProcess",
    "StartDaemon",
    "bucket_fixture",
    "cache_samples",
    "daemon_argv",
    "daemon_fixture",
    "npy_bytes",
    "start_daemon",
    "toml_text",
    "upload_arrays",
    "wait_for",
    "write_config",
]


BUCKET = "data"


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
            "storage_options": {"endpoint_url": endpoint, "key": "testing", "secret": "testing"},
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


def npy_bytes(array: np.ndarray[Any, Any]) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def upload_arrays(
    client: Any, bucket: str, count: int, nbytes: int, *, prefix: str = "", start: int = 0, seed: int = 0
) -> dict[str, np.ndarray[Any, Any]]:
    """Put ``count`` .npy objects of ``nbytes`` uint8 each; returns ``{"bucket/key": array}``."""
    rng = np.random.default_rng(seed + start)
    uploaded = {}
    for i in range(start, start + count):
        array = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
        key = f"{prefix}obj-{i:05d}.npy"
        client.put_object(Bucket=bucket, Key=key, Body=npy_bytes(array))
        uploaded[f"{bucket}/{key}"] = array
    return uploaded


def cache_samples(cache_dir: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (segment name, sample) in the published segments, each segment verified first."""
    for path in sorted((cache_dir / "segments").glob("*.seg")):
        try:
            reader = SegmentReader(path)
        except FileNotFoundError:
            continue  # evicted while we looked
        with reader:
            reader.verify_all()
            for i in range(reader.count):
                sample = reader.read(i)
                yield path.name, {k: (np.array(v) if isinstance(v, np.ndarray) else v) for k, v in sample.items()}


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

    def wait_status(
        self, predicate: Callable[[dict[str, Any]], bool], *, timeout_s: float, what: str = ""
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.process.returncode}:\n{self.stderr()[-4000:]}")
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

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.process.poll() is None:
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


# ``python -m cachefeed`` imports every subcommand's module; while one of them is still missing in the working tree,
# run the same ``cli.main`` with the daemon subcommand only (same error handling, same exit statuses).
_CLI = (
    "import sys, cachefeed.cli as cli; "
    "cli.COMMANDS = {'daemon': cli.COMMANDS['daemon']}; "
    "sys.exit(cli.main(sys.argv[1:]))"
)


def daemon_argv(config_path: Path, *extra_args: str) -> list[str]:
    """The command line that starts the daemon (``python -m cachefeed daemon --config FILE``)."""
    import importlib.util

    if all(importlib.util.find_spec(m) for m in ("cachefeed.demo", "cachefeed.status")):
        head = [sys.executable, "-m", "cachefeed"]
    else:
        head = [sys.executable, "-c", _CLI]
    return [*head, "daemon", "--config", str(config_path), *extra_args]


def start_daemon(
    config_path: Path,
    cache_dir: Path,
    stderr_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
) -> DaemonProcess:
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


@pytest.fixture(name="bucket")
def bucket_fixture(s3: LocalS3) -> Any:
    """A boto3 client of the moto server, with the empty bucket ``BUCKET`` created."""
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture(name="daemon")
def daemon_fixture(tmp_path: Path, s3: LocalS3) -> Iterator[StartDaemon]:
    """``daemon(sections=..., endpoint=..., env=...)`` starts a daemon on ``tmp_path/cache`` (killed at teardown)."""
    started: list[DaemonProcess] = []

    def start(
        *,
        endpoint: str | None = None,
        sections: Mapping[str, Mapping[str, Any]] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> DaemonProcess:
        cache_dir = tmp_path / "cache"
        n = len(started)
        config = write_config(
            tmp_path / f"daemon-{n}.toml",
            endpoint=endpoint or s3.endpoint,
            bucket=BUCKET,
            cache_dir=cache_dir,
            sections=sections,
        )
        process = start_daemon(config, cache_dir, tmp_path / f"daemon-{n}.stderr", env=env)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.process.poll() is None:
            process.kill_group()
