"""Shared fixtures: a real S3 API on loopback (moto's server), reset between tests, and the proxy in front of it.

The components themselves are in ``cachefeed.testing`` (shared with the benchmarks and the demo); only the pytest
fixtures built on them live here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from cachefeed.testing.local_s3 import DUMMY_ENV, LocalS3
from cachefeed.testing.proxy import FaultProxy


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
