"""A moto S3 server that counts what it serves, so remote traffic is measured at the server, not by the client; and
the few object operations the harness does on it (upload a tree, list and delete a prefix).

``python -m benchmarks.common.s3server --port N`` runs moto's own WSGI app (what ``moto_server`` runs) wrapped
in a counting middleware: every request is classified (object GET, ranged GET, HEAD, LIST, PUT, other) and the
response body bytes are added up as they leave. Counters are read and zeroed over HTTP on the same port:

    GET  /__bench__/stats   -> JSON counters (:func:`fetch_stats`)
    POST /__bench__/fill    -> creates many small objects in the server's own store (:func:`fill_bucket`)

:class:`S3Server` starts that subprocess for a benchmark run through the one local-S3 launcher
(``cachefeed._testing.local_s3``). Why not the tests' counting proxy (``cachefeed._testing.proxy``): the counters
are read by the measurement children (other processes) over HTTP, and the proxy is a thread of the process that
starts it, relaying every byte through one more hop on the same 2 cores; counting inside moto's own server costs
no hop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common.results import REPO_ROOT
from cachefeed._testing.local_s3 import LocalS3, s3_client

_STATS_PATH = "/__bench__/stats"
_FILL_PATH = "/__bench__/fill"


class _Counters:
    """Request and byte counts by request kind. Every update holds the lock (werkzeug serves in threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, int] = {}
        self._bytes_out: dict[str, int] = {}
        self._bytes_in = 0

    def add_request(self, kind: str, bytes_in: int) -> None:
        with self._lock:
            self._requests[kind] = self._requests.get(kind, 0) + 1
            self._bytes_out.setdefault(kind, 0)
            self._bytes_in += bytes_in

    def add_bytes_out(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self._bytes_out[kind] += nbytes

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": dict(self._requests),
                "bytes_out": dict(self._bytes_out),
                "bytes_in": self._bytes_in,
            }


def classify(environ: dict[str, Any]) -> str:
    """Name a request by what it does to S3 (path-style addressing: ``/bucket`` or ``/bucket/key``)."""
    method = environ.get("REQUEST_METHOD", "GET")
    path = environ.get("PATH_INFO", "/").strip("/")
    has_key = "/" in path
    if path.startswith("moto-api"):
        return "moto_api"
    if method == "GET" and has_key:
        return "get_range" if environ.get("HTTP_RANGE") else "get"
    if method == "GET":
        return "list"
    if method == "HEAD":
        return "head"
    if method in ("PUT", "POST"):
        return "put"
    return str(method).lower()


class CountingMiddleware:
    """WSGI middleware: counts each response's body bytes as they are sent, and serves the counters."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.counters = _Counters()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == _STATS_PATH:
            body = json.dumps(self.counters.snapshot()).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if path == _FILL_PATH and environ.get("REQUEST_METHOD") == "POST":
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = json.dumps({"created": _fill(json.loads(environ["wsgi.input"].read(length)))}).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        kind = classify(environ)
        bytes_in = int(environ.get("CONTENT_LENGTH") or 0)
        return self._count(kind, bytes_in, self.app(environ, start_response))

    def _count(self, kind: str, bytes_in: int, body: Iterable[bytes]) -> Iterator[bytes]:
        """Each request and each chunk is counted *before* it is sent: a client that has its response may read the
        counters at once, and finds it counted (counted after the send, it could be missing)."""
        self.counters.add_request(kind, bytes_in)
        try:
            for chunk in body:
                self.counters.add_bytes_out(kind, len(chunk))
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if callable(close):
                close()


def _fill(request: dict[str, Any]) -> int:
    """Objects ``<prefix>/class-<i // per_dir>/n<i>.npy`` for i < count, each holding ``body`` (hex), put into
    moto's S3 store directly (its ``put_object``, as a PUT request does after parsing it): not counted."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    body = bytes.fromhex(request["body"])
    prefix, per_dir, count = request["prefix"], int(request["per_dir"]), int(request["count"])
    for i in range(count):
        backend.put_object(request["bucket"], f"{prefix}/class-{i // per_dir:05d}/n{i:09d}.npy", body)
    return count


def fill_bucket(endpoint: str, bucket: str, prefix: str, count: int, body: bytes, per_dir: int = 1000) -> int:
    """Create ``count`` objects of ``body`` under ``prefix/`` of an existing bucket of the counting server at
    ``endpoint``, ``per_dir`` per directory (``class-NNNNN/nNNNNNNNNN.npy``), without one HTTP PUT each: a
    benchmark of listing needs 10⁵ objects, which moto takes minutes to accept as PUT requests."""
    payload = {"bucket": bucket, "prefix": prefix, "count": count, "per_dir": per_dir, "body": body.hex()}
    request = urllib.request.Request(endpoint + _FILL_PATH, data=json.dumps(payload).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=3600) as response:
        created: int = json.loads(response.read())["created"]
    return created


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))

    from moto.moto_server.threaded_moto_server import MotoRequestHandler  # type: ignore[attr-defined]
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    run_simple(args.host, args.port, CountingMiddleware(app), threaded=True, request_handler=MotoRequestHandler)


class S3Server(LocalS3):
    """A running counting moto server (a subprocess of this process), started by the one local-S3 launcher."""

    @classmethod
    def start(cls, timeout_s: float = 60.0, **_options: Any) -> S3Server:
        server = super().start(
            timeout_s=timeout_s,
            command=[sys.executable, "-m", "benchmarks.common.s3server", "--port", "{port}"],
            ready_path=_STATS_PATH,
            cwd=str(REPO_ROOT),
        )
        assert isinstance(server, S3Server)
        return server


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the server served between two :func:`fetch_stats` snapshots, with totals."""
    requests = {k: after["requests"].get(k, 0) - before["requests"].get(k, 0) for k in after["requests"]}
    bytes_out = {k: after["bytes_out"].get(k, 0) - before["bytes_out"].get(k, 0) for k in after["bytes_out"]}
    requests = {k: v for k, v in requests.items() if v}
    bytes_out = {k: v for k, v in bytes_out.items() if v}
    return {
        "requests": requests,
        "bytes_out": bytes_out,
        "total_requests": sum(requests.values()),
        "total_bytes_out": sum(bytes_out.values()),
        "data_bytes_out": bytes_out.get("get", 0) + bytes_out.get("get_range", 0),
    }


def fetch_stats(endpoint: str) -> dict[str, Any]:
    """The counters of the counting server at ``endpoint`` (any process may read them)."""
    with urllib.request.urlopen(endpoint + _STATS_PATH, timeout=5) as response:
        doc: dict[str, Any] = json.loads(response.read())
    return doc


def upload_dir(endpoint_url: str, local_dir: Path, url: str, threads: int = 8) -> int:
    """Upload every file under ``local_dir`` to ``url`` (keys keep the relative paths); return the count."""
    client = s3_client(endpoint_url)
    bucket, prefix = split_url(url)
    files = sorted(p for p in local_dir.rglob("*") if p.is_file())

    def put(path: Path) -> None:
        key = f"{prefix}/{path.relative_to(local_dir).as_posix()}" if prefix else path.name
        client.upload_file(str(path), bucket, key)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, files))
    return len(files)


def list_keys(client: Any, bucket: str, prefix: str) -> list[str]:
    """Every key under ``prefix/``."""
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix.rstrip("/") + "/"):
        keys.extend(item["Key"] for item in page.get("Contents", []))
    return keys


def split_url(url: str) -> tuple[str, str]:
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    return bucket, prefix.rstrip("/")


def delete_prefix(client: Any, bucket: str, prefix: str) -> None:
    """Delete every object under ``prefix/`` (1,000 a request)."""
    keys = list_keys(client, bucket, prefix)
    for start in range(0, len(keys), 1000):
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": key} for key in keys[start : start + 1000]]})


if __name__ == "__main__":
    main()
