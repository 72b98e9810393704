"""A real S3 HTTP API on loopback: moto's server as a subprocess, for the demo, the tests and the benchmarks.

One launcher for all three (``cachefeed demo`` ships in the package, so it lives here): a free loopback port, dummy
credentials (``DUMMY_ENV``: also ``BOTO_CONFIG=/dev/null`` and empty AWS config files, so the host's own AWS setup
never leaks in), a readiness wait that fails with the server's log named, and a clean stop. moto comes with the
``demo`` and ``test`` extras; without it ``start`` raises ``CachefeedError`` saying how to install it.

``LocalS3.start(command=...)`` runs another front of moto (the benchmarks' request-counting server) with the same
port choice, environment, readiness wait and stop.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cachefeed._errors import CachefeedError

__all__ = ["DUMMY_ENV", "LocalS3", "free_port", "s3_client", "storage_options"]

DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "BOTO_CONFIG": "/dev/null",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def s3_client(endpoint: str) -> Any:
    """A boto3 S3 client of the server at ``endpoint`` (dummy credentials)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=DUMMY_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=DUMMY_ENV["AWS_SECRET_ACCESS_KEY"],
        region_name=DUMMY_ENV["AWS_DEFAULT_REGION"],
    )


def storage_options(endpoint: str) -> dict[str, Any]:
    """What a config's ``remote.storage_options`` (fsspec/s3fs options) needs to reach the server at ``endpoint``."""
    key, secret = DUMMY_ENV["AWS_ACCESS_KEY_ID"], DUMMY_ENV["AWS_SECRET_ACCESS_KEY"]
    return {"endpoint_url": endpoint, "key": key, "secret": secret}


@dataclass
class LocalS3:
    """A running local S3 server (see the module docstring)."""

    endpoint: str
    process: subprocess.Popen[bytes]
    _log: IO[bytes] | None = field(default=None, repr=False)

    @classmethod
    def start(
        cls,
        *,
        timeout_s: float = 60.0,
        log_path: Path | None = None,
        command: Sequence[str] | None = None,
        ready_path: str = "/moto-api/",
        cwd: str | None = None,
    ) -> LocalS3:
        """Start the server and wait until ``ready_path`` answers. ``command`` (its ``{port}`` replaced by the port)
        replaces ``python -m moto.server -H 127.0.0.1 -p {port}``; ``log_path`` keeps its output (else discarded)."""
        if command is None:
            try:
                import moto.server  # noqa: F401
            except ImportError:
                raise CachefeedError(
                    "a local S3 server needs moto: pip install -c constraints.txt -e '.[demo]' "
                    "(or use a local directory or your own bucket as the remote)"
                ) from None
            command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "{port}"]
        port = free_port()
        log = log_path.open("wb") if log_path is not None else None
        process = subprocess.Popen(
            [arg.replace("{port}", str(port)) for arg in command],
            env={**os.environ, **DUMMY_ENV},
            stdout=log if log is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
            cwd=cwd,
        )
        server = cls(f"http://127.0.0.1:{port}", process, log)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(server.endpoint + ready_path, timeout=1):  # noqa: S310 (http, ours)
                    return server
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    server.stop()
                    where = f"; see {log_path}" if log_path is not None else ""
                    raise CachefeedError(f"the local S3 server did not start on {server.endpoint}{where}") from None
                time.sleep(0.05)

    def reset(self) -> None:
        """Forget every bucket and object (moto's reset endpoint)."""
        request = urllib.request.Request(self.endpoint + "/moto-api/reset", method="POST")  # noqa: S310 (http, ours)
        with urllib.request.urlopen(request, timeout=10):  # noqa: S310 (http, ours)
            pass

    def stop(self) -> None:
        """Terminate the server (kill it after 10 s). Idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def client(self) -> Any:
        return s3_client(self.endpoint)

    def storage_options(self) -> dict[str, Any]:
        """What a config's ``remote.storage_options`` needs to reach this server."""
        return storage_options(self.endpoint)
