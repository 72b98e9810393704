"""A real S3 HTTP API on loopback: moto's server as a subprocess (faster than in-process under load).

Credentials are dummies; ``BOTO_CONFIG=/dev/null`` keeps the host's boto config out of the tests.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "BOTO_CONFIG": "/dev/null",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}


def s3_client(endpoint: str) -> Any:
    """A boto3 S3 client of the server at ``endpoint`` (dummy credentials)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def storage_options(endpoint: str) -> dict[str, Any]:
    """What a config's ``remote.storage_options`` (fsspec/s3fs options) needs to reach the server at ``endpoint``."""
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class MotoServer:
    """A running ``moto_server`` subprocess."""

    endpoint: str
    process: subprocess.Popen[bytes]

    @classmethod
    def start(cls, timeout_s: float = 30.0) -> MotoServer:
        port = free_port()
        env = {**os.environ, **DUMMY_ENV}
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(endpoint + "/moto-api/", timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    raise RuntimeError(f"moto_server did not start on {endpoint}") from None
                time.sleep(0.05)
        return cls(endpoint, process)

    def reset(self) -> None:
        request = urllib.request.Request(self.endpoint + "/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10):
            pass

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def client(self) -> Any:
        return s3_client(self.endpoint)

    def storage_options(self) -> dict[str, Any]:
        """What a config's ``remote.storage_options`` needs to reach this server."""
        return storage_options(self.endpoint)
