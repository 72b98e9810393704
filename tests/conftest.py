"""Shared fixtures: a real S3 API on loopback (moto's server) reset between tests, the proxy in front of it, a
bucket, and the real daemon as a subprocess.

Property tests run without hypothesis's per-example deadline: CI runs three test processes on two cores, where
a 200 ms budget for one example measures the machine's load, not the code.

The components themselves are in ``cachefeed._testing`` (shared with the benchmarks and the demo); only the pytest
fixtures built on them live here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from cachefeed._testing.daemon import BUCKET, DaemonProcess, StartDaemon, start_daemon, write_config
from cachefeed._testing.local_s3 import DUMMY_ENV, LocalS3
from cachefeed._testing.proxy import FaultProxy
from tests.support.stalls import StallWatch, StallWindow

settings.register_profile("cachefeed", deadline=None)
settings.load_profile("cachefeed")


@pytest.fixture(scope="session", autouse=True)
def _dummy_aws_credentials() -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in DUMMY_ENV}
    os.environ.update(DUMMY_ENV)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def _stall_watch() -> Iterator[StallWatch]:
    watch = StallWatch()
    yield watch
    watch.close()


@pytest.fixture
def stalls(_stall_watch: StallWatch) -> StallWindow:
    """Machine stalls during a test's handovers, for its timing assertions (``tests/support/stalls.py``)."""
    return StallWindow(_stall_watch)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[LocalS3]:
    server = LocalS3.start()
    yield server
    server.stop()


@pytest.fixture
def s3(moto_server: LocalS3) -> Iterator[LocalS3]:
    """The moto server, emptied before the test."""
    moto_server.reset()
    yield moto_server


@pytest.fixture
def fault_proxy(s3: LocalS3) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of the (freshly reset) moto server, with no rules."""
    with FaultProxy(s3.endpoint) as proxy:
        yield proxy


@pytest.fixture
def bucket(s3: LocalS3) -> Any:
    """A boto3 client of the moto server, with the empty bucket ``BUCKET`` created."""
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture
def daemon(tmp_path: Path, s3: LocalS3) -> Iterator[StartDaemon]:
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
