"""A counting, fault-injecting HTTP proxy in front of the moto server, on loopback.

moto's server does not count requests, and it cannot misbehave the way a real object store does. This proxy
forwards every request to an upstream endpoint (the moto server), records ``(method, path, query)`` for each one,
and answers with a fault instead where a rule says so:

- ``status``: an S3-style XML error (``<Error><Code>...``) with the given HTTP status, never forwarded;
  ``echo_auth=True`` copies the request's ``Authorization`` header into the error body, the way S3's
  ``SignatureDoesNotMatch`` echoes the access key id, so tests can prove the client never repeats it.
- ``truncate``: forwards, then sends the status line and the full ``Content-Length`` but only half the body,
  and drops the connection (a truncated body).
- ``reset``: drops the connection before any response (a connection reset).
- ``delay``: waits ``delay_s`` before forwarding (a slow server, to trip read timeouts).
- ``corrupt``: forwards, then answers with the upstream's headers and a body of the same length with one byte
  inverted in the middle (bit rot in transit).

The proxy runs its own event loop in a daemon thread, so it serves clients on any loop (or none). Every public
method is thread-safe. Use it as a context manager, or call ``start``/``stop``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

import aiohttp
from aiohttp import web

from cachefeed.testing.local_s3 import free_port

_HOP_HEADERS = {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


@dataclass(frozen=True, slots=True)
class Seen:
    """One request the proxy received."""

    method: str
    path: str
    query: str


@dataclass(slots=True)
class Fault:
    """A rule: requests matching ``method`` and ``path_contains`` get ``action`` instead, ``times`` times.

    ``times=-1`` applies for ever. ``query_contains`` narrows the match to requests whose query string holds it
    (listing requests carry ``list-type=2``; object GETs carry none).
    """

    action: str = "status"
    method: str | None = None
    path_contains: str | None = None
    query_contains: str | None = None
    times: int = 1
    status: int = 503
    code: str = "SlowDown"
    echo_auth: bool = False
    delay_s: float = 0.0
    hits: int = field(default=0)

    def matches(self, request: web.Request) -> bool:
        if self.times != -1 and self.hits >= self.times:
            return False
        if self.method is not None and request.method != self.method:
            return False
        if self.path_contains is not None and self.path_contains not in request.path:
            return False
        return self.query_contains is None or self.query_contains in request.query_string


class CountingProxy:
    """Forward to ``upstream``; count requests; inject faults. See the module docstring."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._seen: list[Seen] = []
        self._faults: list[Fault] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="counting-proxy", daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # ---------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> CountingProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> CountingProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ---------------------------------------------------------------------------------------------- test API

    def inject(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self._seen.clear()

    def seen(self) -> list[Seen]:
        with self._lock:
            return list(self._seen)

    def count(self, method: str | None = None, path_contains: str | None = None, *, objects_only: bool = False) -> int:
        """Requests seen; ``objects_only`` drops bucket-level requests (listings), whose path has no key."""
        total = 0
        for item in self.seen():
            if method is not None and item.method != method:
                continue
            if path_contains is not None and path_contains not in item.path:
                continue
            if objects_only and item.path.strip("/").count("/") == 0:
                continue
            total += 1
        return total

    # ---------------------------------------------------------------------------------------------- serving

    def _take_fault(self, request: web.Request) -> Fault | None:
        with self._lock:
            self._seen.append(Seen(request.method, request.path, request.query_string))
            for fault in self._faults:
                if fault.matches(request):
                    fault.hits += 1
                    return fault
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        fault = self._take_fault(request)
        if fault is not None and fault.action == "status":
            return self._error_response(request, fault)
        if fault is not None and fault.action == "reset":
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=599)
        if fault is not None and fault.action == "delay":
            await asyncio.sleep(fault.delay_s)
        status, headers, body = await self._forward(request)
        if fault is not None and fault.action == "truncate":
            response = web.StreamResponse(status=status, headers=headers)
            response.content_length = len(body)
            await response.prepare(request)
            await response.write(body[: len(body) // 2])
            if request.transport is not None:
                request.transport.abort()
            return response
        if fault is not None and fault.action == "corrupt" and body:
            middle = len(body) // 2
            body = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1 :]
        if request.method == "HEAD":
            return web.Response(status=status, headers=headers)
        return web.Response(status=status, headers=_without_length(headers), body=body)

    async def _forward(self, request: web.Request) -> tuple[int, dict[str, str], bytes]:
        if self._session is None:
            raise RuntimeError("proxy not started")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        data = await request.read()
        async with self._session.request(
            request.method, self.upstream + request.raw_path, headers=headers, data=data, allow_redirects=False
        ) as upstream:
            body = await upstream.read()
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS - {"content-length"}}
            return upstream.status, out, body

    @staticmethod
    def _error_response(request: web.Request, fault: Fault) -> web.Response:
        message = "injected by the counting proxy"
        extra = ""
        if fault.echo_auth:
            auth = request.headers.get("Authorization", "")
            token = request.headers.get("X-Amz-Security-Token", "")
            message += f"; Authorization={auth}; token={token}"
            extra = f"<AWSAccessKeyId>{escape(auth)}</AWSAccessKeyId><StringToSign>{escape(token)}</StringToSign>"
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{escape(fault.code)}</Code><Message>{escape(message)}</Message>{extra}"
            "<RequestId>proxy</RequestId></Error>"
        ).encode()
        if request.method == "HEAD":
            return web.Response(status=fault.status)
        return web.Response(status=fault.status, body=body, content_type="application/xml")


def _without_length(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() != "content-length"}


@contextmanager
def counting_proxy(upstream: str) -> Iterator[CountingProxy]:
    with CountingProxy(upstream) as proxy:
        yield proxy
