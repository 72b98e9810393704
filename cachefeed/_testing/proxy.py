"""The S3 reverse proxy on loopback, in front of the local S3 server: it counts requests and injects faults.

moto's server neither counts what it serves per request nor misbehaves the way a real object store does, and
kernel netem is not available where the tests run, so this proxy is how the tests and the benchmarks count S3
requests and make the network misbehave.

It is a real HTTP server on ``127.0.0.1`` (a free port): the test process, the daemon and its sampler
subprocesses all reach it at :attr:`FaultProxy.endpoint` as they would reach S3.

Every request is forwarded to the upstream (moto) unless a rule says otherwise. Rules are checked in order; the
first rule whose filters match (method, S3 operation, key substring or regex, query substring), whose deadline
(``until``) has not passed, whose ``max_count`` is not used up *and* whose probability roll succeeds injects its
fault. A rule that loses its roll lets the later rules try. The faults:

=================  ==========================================================================================
``latency``        wait ``delay_s``, then forward normally.
``slowdown``       503 with S3's ``SlowDown`` XML error body; never forwarded.
``error500``       500 ``InternalError``; never forwarded.
``status``         any ``status`` with an S3 XML error (404 ``NoSuchKey``, 403 ``AccessDenied``,
                   412 ``PreconditionFailed``, 429 ...; ``code`` overrides the default code).
``reset``          a TCP reset (``SO_LINGER`` 0). With no body position: before any response (the request is
                   not forwarded). With ``body_fraction``/``body_bytes``: after that much of the body.
``truncate``       the upstream's headers (its full ``Content-Length``), part of the body, then a clean close.
``stall``          headers and part of the body (none by default), then nothing for ``delay_s``, then the rest.
``corrupt``        the same length, with ``flip_bytes`` bytes inverted at the body position (the middle).
``replace_midway`` part of the body, then ``callback`` runs (in a worker thread, so it may call moto directly
                   to replace the object), then the rest of the *old* body: S3 answers one GET from one version.
=================  ==========================================================================================

Body positions: ``body_bytes`` (absolute) wins over ``body_fraction`` (of the upstream's ``Content-Length``).
Any rule's ``callback`` runs when the rule fires (``replace_midway``: at the body position), in a worker thread.

Counting: every request is counted per ``(method, key)`` and per S3 operation, every injection per fault name;
:meth:`FaultProxy.counts` returns a snapshot (:class:`ProxyCounts`), :meth:`FaultProxy.reset_counts` zeroes it.
``key`` is the object key without the bucket (path-style addressing, which botocore uses for an IP endpoint);
bucket-level requests (listings) count under key ``""``.

Why a thread and not a subprocess: rules carry Python callables (``callback``) and tests read counts
synchronously, with no IPC to write. The proxy's event loop runs in a daemon thread; every public method is
thread-safe (one lock guards rules and counters). Bodies are streamed chunk by chunk in both directions.

Use ``with FaultProxy(upstream) as proxy:``; the tests' ``fault_proxy`` fixture (``tests/conftest.py``) is one in
front of their moto server.

Why one long module: it is one fake server (rules, counts and the HTTP relay share its state and its lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import struct
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args
from urllib.parse import unquote
from xml.sax.saxutils import escape

import aiohttp
import yarl
from aiohttp import web

from cachefeed._logs import get_logger
from cachefeed._testing.local_s3 import DUMMY_ENV, storage_options

__all__ = ["FAULTS", "FaultProxy", "ProxyCounts", "RequestInfo", "Rule", "classify"]

logger = get_logger(__name__)

Fault = Literal["latency", "slowdown", "error500", "status", "reset", "truncate", "stall", "corrupt", "replace_midway"]
FAULTS: frozenset[str] = frozenset(get_args(Fault))

_ERROR_FAULTS = frozenset({"slowdown", "error500", "status"})
_DEFAULT_FRACTION = {"truncate": 0.5, "stall": 0.0, "corrupt": 0.5, "replace_midway": 0.5}
_DEFAULT_CODES = {
    400: "InvalidRequest",
    403: "AccessDenied",
    404: "NoSuchKey",
    409: "OperationAborted",
    412: "PreconditionFailed",
    416: "InvalidRange",
    500: "InternalError",
    503: "SlowDown",
}
_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "NoSuchKey": "The specified key does not exist.",
    "AccessDenied": "Access Denied",
    "PreconditionFailed": "At least one of the pre-conditions you specified did not hold",
}
# RFC 9110 hop-by-hop headers, plus Expect: aiohttp answers "100 Continue" itself.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)
_CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """One request as the rules see it (and as a ``callback`` receives it)."""

    method: str
    op: str
    bucket: str
    key: str
    query: str


@dataclass(frozen=True, slots=True)
class Rule:
    """When and how to misbehave. See the module docstring for the faults and the matching order.

    Args:
        fault: one of :data:`FAULTS`.
        method: HTTP method to match (``"GET"``); ``None`` matches any.
        op: S3 operation to match (``"GetObject"``, ``"HeadObject"``, ``"PutObject"``, ``"ListObjectsV2"``...).
        key: substring of the object key to match.
        key_regex: ``re.search`` pattern on the object key.
        query: substring of the raw query string to match (``"list-type=2"``).
        probability: chance that a matching request gets the fault, in ``[0, 1]``.
        max_count: injections after which the rule stops matching (counted since :meth:`FaultProxy.set_rules`).
        until: ``time.monotonic()`` deadline after which the rule stops matching ("503 for 2 s, then healthy").
        delay_s: ``latency``: added delay; ``stall``: how long the body stops.
        status: ``status``: the HTTP status to answer.
        code: the S3 error code for error faults (default from the status: 404 ``NoSuchKey`` ...).
        echo_auth: error faults copy the request's ``Authorization`` header and session token into the error
            body, as S3's ``SignatureDoesNotMatch`` echoes the key id, and into its ``Message`` too (what a
            client most likely prints), to prove that a client never repeats them.
        body_fraction: body position as a fraction of ``Content-Length``.
        body_bytes: body position in bytes (wins over ``body_fraction``).
        flip_bytes: ``corrupt``: how many bytes to invert.
        callback: called with the :class:`RequestInfo` when the rule fires, in a worker thread.

    Raises:
        ValueError: an unknown fault, or a parameter out of range for it.
    """

    fault: Fault
    method: str | None = None
    op: str | None = None
    key: str | None = None
    key_regex: str | None = None
    query: str | None = None
    probability: float = 1.0
    max_count: int | None = None
    until: float | None = None
    delay_s: float = 0.0
    status: int | None = None
    code: str | None = None
    echo_auth: bool = False
    body_fraction: float | None = None
    body_bytes: int | None = None
    flip_bytes: int = 1
    callback: Callable[[RequestInfo], object] | None = None

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; use one of {sorted(FAULTS)}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {self.probability}")
        if self.max_count is not None and self.max_count < 0:
            raise ValueError(f"max_count must be >= 0, got {self.max_count}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")
        if self.fault == "status" and (self.status is None or not 300 <= self.status <= 599):
            raise ValueError(f"the status fault needs status= in 300..599, got {self.status}")
        if self.body_fraction is not None and not 0.0 <= self.body_fraction <= 1.0:
            raise ValueError(f"body_fraction must be in [0, 1], got {self.body_fraction}")
        if self.body_bytes is not None and self.body_bytes < 0:
            raise ValueError(f"body_bytes must be >= 0, got {self.body_bytes}")
        if self.flip_bytes < 1:
            raise ValueError(f"flip_bytes must be >= 1, got {self.flip_bytes}")
        if self.key_regex is not None:
            re.compile(self.key_regex)

    def matches(self, info: RequestInfo) -> bool:
        """Whether the filters (not the budget, deadline or probability) select this request."""
        return (
            (self.method is None or self.method == info.method)
            and (self.op is None or self.op == info.op)
            and (self.key is None or self.key in info.key)
            and (self.key_regex is None or re.search(self.key_regex, info.key) is not None)
            and (self.query is None or self.query in info.query)
        )

    def body_position(self, content_length: int | None) -> int | None:
        """Byte offset in the body where the fault strikes; ``None`` for "before any response"."""
        if self.body_bytes is not None:
            position = self.body_bytes
        else:
            fraction = self.body_fraction if self.body_fraction is not None else _DEFAULT_FRACTION.get(self.fault)
            if fraction is None:
                return None
            position = int((content_length or 0) * fraction)
        return position if content_length is None else min(position, content_length)


@dataclass(frozen=True, slots=True)
class ProxyCounts:
    """A snapshot of the proxy's counters.

    Attributes:
        requests: requests received per ``(method, key)``; bucket-level requests under key ``""``.
        ops: requests received per S3 operation name.
        faults: injections per fault name.
    """

    requests: dict[tuple[str, str], int]
    ops: dict[str, int]
    faults: dict[str, int]

    @property
    def total(self) -> int:
        """All requests received."""
        return sum(self.requests.values())

    @property
    def objects(self) -> int:
        """Requests received for objects (not bucket-level ones such as listings)."""
        return sum(count for (_, key), count in self.requests.items() if key)

    def request(self, method: str, key: str) -> int:
        """Requests received for ``(method, key)`` (0 if none)."""
        return self.requests.get((method, key), 0)

    def method(self, method: str) -> int:
        """Requests received with HTTP ``method``, whatever the key (0 if none)."""
        return sum(count for (name, _), count in self.requests.items() if name == method)

    def fault(self, name: str) -> int:
        """Injections of fault ``name`` (0 if none)."""
        return self.faults.get(name, 0)


def classify(method: str, path: str, query: str) -> RequestInfo:
    """Name the S3 operation of a path-style request (``/bucket/key?query``)."""
    bucket, _, key = path.lstrip("/").partition("/")
    params = {part.split("=", 1)[0] for part in query.split("&") if part}
    if not bucket:
        op = "ListBuckets"
    elif not key:
        if method == "GET":
            op = "ListObjectsV2" if "list-type" in params else ("ListObjects" if not params else "GetBucket")
        else:
            op = {"HEAD": "HeadBucket", "PUT": "CreateBucket", "DELETE": "DeleteBucket"}.get(method, method)
            if method == "POST" and "delete" in params:
                op = "DeleteObjects"
    elif "uploadId" in params or "uploads" in params:
        op = "UploadPart" if method == "PUT" else f"Multipart{method.title()}"
    else:
        op = {"GET": "GetObject", "HEAD": "HeadObject", "PUT": "PutObject", "DELETE": "DeleteObject"}.get(
            method, method
        )
        if method == "PUT" and "tagging" in params:
            op = "PutObjectTagging"
    return RequestInfo(method=method, op=op, bucket=bucket, key=key, query=query)


class FaultProxy:
    """Forward to ``upstream``; count requests; inject faults by rule. See the module docstring.

    Invariant: rules, per-rule injection counters, the random generator and all counts change only under
    ``self._lock``, so a request sees one consistent rule list even while a test calls :meth:`set_rules`.
    """

    def __init__(self, upstream: str, *, seed: int = 0) -> None:
        self.upstream = upstream.rstrip("/")
        self.endpoint = ""
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._used: list[int] = []
        self._random = random.Random(seed)
        self._requests: Counter[tuple[str, str]] = Counter()
        self._ops: Counter[str] = Counter()
        self._faults: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._closing: asyncio.Event | None = None
        self._accepted: weakref.WeakSet[asyncio.Transport] = weakref.WeakSet()  # closed at ``stop``

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> FaultProxy:
        """Bind a free loopback port and serve from a daemon thread. Returns ``self``."""
        if self._thread is not None:
            raise RuntimeError("FaultProxy already started")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="faultproxy", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(sock), self._loop).result(timeout=10)
        except BaseException:
            sock.close()
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop serving: stalls and delays end at once, open connections close. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), loop).result(timeout=10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()
            self._loop = self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _start(self, sock: socket.socket) -> None:
        self._closing = asyncio.Event()
        self._session = aiohttp.ClientSession(
            auto_decompress=False,
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        )
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    async def _stop(self) -> None:
        if self._closing is not None:
            self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        for transport in list(self._accepted):  # a connection cleanup left open (a client killed mid-request, say)
            transport.abort()  # would be closed by the garbage collector, a ResourceWarning in whatever test runs then

    # ------------------------------------------------------------------------------------------ test API

    def set_rules(self, rules: Iterable[Rule]) -> None:
        """Replace the rule list; each rule's ``max_count`` budget starts afresh. Counts are kept."""
        new_rules = list(rules)
        for rule in new_rules:
            if not isinstance(rule, Rule):
                raise TypeError(f"expected a Rule, got {rule!r}")
        with self._lock:
            self._rules = new_rules
            self._used = [0] * len(new_rules)

    def clear(self) -> None:
        """No rules: every request is forwarded untouched. Counts are kept (see :meth:`reset_counts`)."""
        self.set_rules([])

    def counts(self) -> ProxyCounts:
        """A snapshot of the counters."""
        with self._lock:
            return ProxyCounts(dict(self._requests), dict(self._ops), dict(self._faults))

    def reset_counts(self) -> None:
        """Zero every counter (not the rules' ``max_count`` budgets)."""
        with self._lock:
            self._requests.clear()
            self._ops.clear()
            self._faults.clear()

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach moto through this proxy."""
        return storage_options(self.endpoint)

    def client(self, *, max_attempts: int = 1, **config: Any) -> Any:
        """A boto3 S3 client through the proxy that makes ``max_attempts`` attempts in all (1: no retry).

        Mind botocore's ``retries={"max_attempts": n}``: it counts *retries* (n + 1 attempts). This sets
        ``total_max_attempts``, so a test sees every injected fault. ``config`` goes to
        ``botocore.config.Config`` (``read_timeout=0.5``, ``response_checksum_validation="when_required"``...).
        """
        import boto3
        from botocore.config import Config

        retries = {"total_max_attempts": max_attempts, "mode": "standard"}
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=DUMMY_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=DUMMY_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=DUMMY_ENV["AWS_DEFAULT_REGION"],
            config=Config(retries=retries, **config),
        )

    # ------------------------------------------------------------------------------------------ serving

    def _pick(self, info: RequestInfo) -> Rule | None:
        now = time.monotonic()
        with self._lock:
            self._requests[(info.method, info.key)] += 1
            self._ops[info.op] += 1
            for index, rule in enumerate(self._rules):
                if rule.until is not None and now >= rule.until:
                    continue
                if rule.max_count is not None and self._used[index] >= rule.max_count:
                    continue
                if not rule.matches(info):
                    continue
                if rule.probability < 1.0 and self._random.random() >= rule.probability:
                    continue
                self._used[index] += 1
                self._faults[rule.fault] += 1
                return rule
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if isinstance(request.transport, asyncio.Transport):
            self._accepted.add(request.transport)
        info = classify(request.method, unquote(request.rel_url.raw_path), request.rel_url.raw_query_string)
        rule = self._pick(info)
        if rule is not None and rule.fault != "replace_midway":
            await self._run_callback(rule, info)
        if rule is None or rule.fault == "latency":
            if rule is not None:
                await self._sleep(rule.delay_s)
            return await self._forward(request, info, None)
        if rule.fault in _ERROR_FAULTS:
            await _drain(request)
            return _error_response(request, info, rule)
        if rule.fault == "reset" and rule.body_position(None) is None:
            _reset(request)
            return web.Response()  # its write fails; aiohttp drops a ConnectionError quietly
        return await self._forward(request, info, rule)

    async def _forward(self, request: web.Request, info: RequestInfo, rule: Rule | None) -> web.StreamResponse:
        if self._session is None:
            raise RuntimeError("FaultProxy not started")
        url = yarl.URL(self.upstream + request.rel_url.raw_path_qs, encoded=True)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        data = request.content if request.body_exists else None
        response: web.StreamResponse | None = None
        try:
            async with self._session.request(
                request.method, url, headers=headers, data=data, allow_redirects=False
            ) as upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for name, value in upstream.headers.items():
                    if name.lower() not in _HOP_BY_HOP:
                        response.headers.add(name, value)
                await response.prepare(request)
                await self._stream_body(request, response, upstream, info, rule)
                return response
        except ConnectionError:
            # The client went away, or a fault closed the connection: nothing more to answer. A response
            # returned here fails to finish with a ConnectionError, which aiohttp drops quietly.
            return response if response is not None else web.Response()
        except aiohttp.ClientError as exc:
            logger.warning("faultproxy: upstream %s failed: %s", self.upstream, exc)
            if response is not None:  # headers already sent: the client must see a broken response
                _reset(request)
                return response
            return web.Response(status=502, text=f"faultproxy: upstream failed: {exc}")

    async def _stream_body(
        self,
        request: web.Request,
        response: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        info: RequestInfo,
        rule: Rule | None,
    ) -> None:
        position = None if rule is None else rule.body_position(upstream.content_length)
        if rule is None or position is None:
            async for chunk in upstream.content.iter_chunked(_CHUNK_BYTES):
                await response.write(chunk)
            return
        if rule.fault == "corrupt":
            await self._stream_corrupted(response, upstream, position, rule.flip_bytes)
            return
        sent, remainder = 0, b""
        if position > 0:
            async for chunk in upstream.content.iter_chunked(_CHUNK_BYTES):
                room = position - sent
                await response.write(chunk[:room])
                sent += min(room, len(chunk))
                if len(chunk) >= room:
                    remainder = chunk[room:]
                    break
        await _flush(request)
        if rule.fault == "truncate":
            if request.transport is not None:
                request.transport.close()  # flushes, then FIN: a clean close, short of Content-Length
            return
        if rule.fault == "reset":
            _reset(request)
            return
        if rule.fault == "stall":
            await self._sleep(rule.delay_s)
        elif rule.fault == "replace_midway":
            await self._run_callback(rule, info)
        if remainder:
            await response.write(remainder)
        async for chunk in upstream.content.iter_chunked(_CHUNK_BYTES):
            await response.write(chunk)

    @staticmethod
    async def _stream_corrupted(
        response: web.StreamResponse, upstream: aiohttp.ClientResponse, position: int, flip_bytes: int
    ) -> None:
        offset = 0
        async for chunk in upstream.content.iter_chunked(_CHUNK_BYTES):
            start, stop = max(position - offset, 0), min(position + flip_bytes - offset, len(chunk))
            out = chunk
            if start < stop:
                mutable = bytearray(chunk)
                for index in range(start, stop):
                    mutable[index] ^= 0xFF
                out = bytes(mutable)
            await response.write(out)
            offset += len(chunk)

    async def _sleep(self, delay_s: float) -> None:
        """Sleep, but wake at once when the proxy stops (so stop() never waits out a stall)."""
        if self._closing is None or delay_s <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), timeout=delay_s)

    @staticmethod
    async def _run_callback(rule: Rule, info: RequestInfo) -> None:
        if rule.callback is not None:
            await asyncio.get_running_loop().run_in_executor(None, rule.callback, info)


async def _drain(request: web.Request) -> None:
    """Read and drop a request body, so the client is not cut off mid-upload by an error answer."""
    if request.body_exists:
        async for _ in request.content.iter_any():
            pass


async def _flush(request: web.Request, timeout_s: float = 2.0) -> None:
    """Wait until what was written has left the process (so a following reset does not discard it)."""
    transport = request.transport
    deadline = time.monotonic() + timeout_s
    while transport is not None and transport.get_write_buffer_size() > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.001)


def _reset(request: web.Request) -> None:
    """Abort the client connection with a TCP RST (``SO_LINGER`` 0), not a FIN."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _error_response(request: web.Request, info: RequestInfo, rule: Rule) -> web.Response:
    status = {"slowdown": 503, "error500": 500}.get(rule.fault) or rule.status or 500
    code = rule.code or _DEFAULT_CODES.get(status, "InternalError")
    message = _MESSAGES.get(code, "injected by faultproxy")
    extra = ""
    if rule.echo_auth:
        auth = request.headers.get("Authorization", "")
        token = request.headers.get("X-Amz-Security-Token", "")
        message += f" Authorization={auth}; token={token}"
        extra = f"<AWSAccessKeyId>{escape(auth)}</AWSAccessKeyId><StringToSign>{escape(token)}</StringToSign>"
    resource = "/" + "/".join(part for part in (info.bucket, info.key) if part)
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(resource)}</Resource>{extra}<RequestId>faultproxy</RequestId></Error>"
    ).encode()
    headers = {"x-amz-request-id": "faultproxy"}
    return web.Response(status=status, body=body, content_type="application/xml", headers=headers)
