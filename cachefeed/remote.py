"""The remote transport: list objects under an fsspec URL and fetch each one whole, through one retry layer.

``Remote`` is created inside the process that uses it (the supervisor to list, each sampler to fetch) and is never
pickled. ``list_objects`` is synchronous; ``fetch`` is a coroutine run on the sampler's event loop, many at a time.

Contract of ``fetch(obj)``:

- Normal case: exactly one request, a GET, per object. On S3 the GET is sent straight to the aiobotocore client
  (s3fs's ``cat_file`` would HEAD first to learn the size, which the listing already gave us).
- Pinned to the listed version: the GET carries ``IfMatch=<listed ETag>`` (the store answers 412 if the object
  changed), the returned ETag and ``Content-Length`` must equal the listed ones (else ``RemoteChangedError``),
  and the body must be as long as the listed size (a short body is ``RemoteTransientError``, retried). Where
  the object was uploaded with a checksum, botocore verifies the body against it (bit rot: transient). On local
  files the version is ``"<mtime_ns>-<size>"``, checked on the open file before and after the read.
- Errors are translated once, by ``translate_error`` below, from status codes, S3 error codes and exception
  types (never message text): 404 -> ``RemoteNotFoundError``; 401/403 -> ``RemoteForbiddenError`` (neither
  retried); 412/ETag or length mismatch -> ``RemoteChangedError`` (not retried: the listing is stale);
  5xx, throttling, resets, timeouts, truncated bodies -> ``RemoteTransientError`` (retried). Messages are built
  from those structured fields and the object path only, then scrubbed of every credential found in
  ``storage_options`` (by ``cachefeed.scrub``, the scrubber the logs use too); the backend exception is not
  chained, so tracebacks cannot leak what its text held.

NOTE [ One retry layer ]
    Retries happen here and only here: full-jitter exponential backoff, ``sleep = uniform(0, min(backoff_max,
    base * 2**n))`` before retry ``n`` (0-based), at most ``max_attempts`` attempts per object, and a retry budget:
    a token bucket that earns ``retry_budget`` tokens per first attempt and spends one per retry, starting (and
    capped) at ``retry_budget_burst`` tokens, so a failing remote sees at most ``(1 + retry_budget)`` times the load
    plus a small burst. The layers below are turned off on purpose: s3fs (``fs.retries = 1``; its wrapper is
    bypassed for GETs anyway) and botocore (``retries={"total_max_attempts": 1}``; botocore's ``max_attempts``
    counts *retries*, so ``max_attempts: 1`` would still retry once). One layer remains that we cannot turn
    off through a public API: aiohttp re-sends an idempotent request once when the server drops the connection
    before answering (meant for stale keep-alive connections). It is bounded (one extra request) and never fires
    on an HTTP error status.

Rate caps (``max_requests_per_s``, ``max_bytes_per_s``, node-wide) are multiplied by ``share``, this process's
fraction of the node; each is a token bucket that lets a request go into debt and makes later callers wait it off,
so an object larger than the burst still goes through and the long-run rate holds.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import random
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.utils import get_protocol, glob_translate

from cachefeed.config import RemoteConfig
from cachefeed.errors import (
    ConfigError,
    RemoteChangedError,
    RemoteError,
    RemoteForbiddenError,
    RemoteNotFoundError,
    RemoteTransientError,
)
from cachefeed.scrub import Scrubber, safe_url, secrets_from_options

__all__ = [
    "Remote",
    "RemoteObject",
    "RemoteStats",
    "backoff_delay",
    "compile_pattern",
    "expand_braces",
    "translate_error",
]

logger = logging.getLogger(__name__)

_BURST_S = 0.1  # a rate cap's bucket holds this many seconds' worth of tokens (at least one request)
_S3_NO_RETRIES = {"total_max_attempts": 1, "mode": "standard"}


def expand_braces(pattern: str) -> list[str]:
    """``"**/*.{jpg,png}"`` -> ``["**/*.jpg", "**/*.png"]`` (nested lists too); fsspec's glob has no braces."""
    start = pattern.find("{")
    if start < 0:
        return [pattern]
    depth = 0
    for end in range(start, len(pattern)):
        depth += {"{": 1, "}": -1}.get(pattern[end], 0)
        if depth == 0:
            break
    else:
        return [pattern]  # an unbalanced brace is taken literally
    inner, parts, depth, begin = pattern[start + 1 : end], [], 0, 0
    for i, char in enumerate(inner):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(inner[begin:i])
            begin = i + 1
    parts.append(inner[begin:])
    return [expanded for part in parts for expanded in expand_braces(pattern[:start] + part + pattern[end + 1 :])]


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """The matcher of ``remote.pattern``: fsspec glob syntax (``*``, ``**``, ``?``, ``[...]``) plus brace lists."""
    return re.compile("|".join(f"(?:{glob_translate(p)})" for p in expand_braces(pattern)))


@dataclass(frozen=True, slots=True)
class RemoteObject:
    """One listed object. ``path`` is the fsspec path without protocol; ``etag`` pins the version read."""

    path: str
    size: int
    etag: str | None


@dataclass(slots=True)
class RemoteStats:
    """Counters of one ``Remote``, only ever increased. ``errors_total`` counts failed attempts by error kind."""

    requests_total: int = 0
    retries_total: int = 0
    bytes_total: int = 0
    listings_total: int = 0
    budget_exhausted_total: int = 0
    throttled_s: float = 0.0
    errors_total: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests_total": self.requests_total,
            "retries_total": self.retries_total,
            "bytes_total": self.bytes_total,
            "listings_total": self.listings_total,
            "budget_exhausted_total": self.budget_exhausted_total,
            "throttled_s": self.throttled_s,
            "errors_total": dict(self.errors_total),
        }


def backoff_delay(retry: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Full-jitter backoff before retry number ``retry`` (0-based): uniform in [0, min(max_s, base_s * 2**retry)]."""
    return rng.uniform(0.0, min(max_s, base_s * 2.0 ** min(retry, 62)))


class _RateBucket:
    """Token bucket that allows debt: ``acquire(n)`` takes n tokens now and sleeps until the balance is >= 0.

    Invariant: tokens <= burst. Single event loop only (no lock: the loop runs one coroutine at a time).
    """

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._stamp = time.monotonic()

    async def acquire(self, amount: float) -> float:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate) - amount
        self._stamp = now
        delay = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if delay > 0:
            await asyncio.sleep(delay)
        return delay


class _RetryBudget:
    """Each first attempt earns ``ratio`` tokens, each retry spends one; starts full at ``burst`` (the cap)."""

    def __init__(self, ratio: float, burst: float) -> None:
        self.ratio = ratio
        self.burst = burst
        self._tokens = burst

    def deposit(self) -> None:
        self._tokens = min(self.burst, self._tokens + self.ratio)

    def withdraw(self) -> bool:
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


# ------------------------------------------------------------------------------------------------------------
# The one translation table. Checked in this order: an S3 error code, then the HTTP status, then exception types.

_CODE_TABLE: dict[str, type[RemoteError]] = {
    "NoSuchKey": RemoteNotFoundError,
    "NoSuchBucket": RemoteNotFoundError,
    "NoSuchVersion": RemoteNotFoundError,
    "NotFound": RemoteNotFoundError,
    "AccessDenied": RemoteForbiddenError,
    "AccountProblem": RemoteForbiddenError,
    "AllAccessDisabled": RemoteForbiddenError,
    "ExpiredToken": RemoteForbiddenError,
    "InvalidAccessKeyId": RemoteForbiddenError,
    "InvalidObjectState": RemoteForbiddenError,
    "SignatureDoesNotMatch": RemoteForbiddenError,
    "PreconditionFailed": RemoteChangedError,
    "InternalError": RemoteTransientError,
    "OperationAborted": RemoteTransientError,
    "RequestLimitExceeded": RemoteTransientError,
    "RequestTimeout": RemoteTransientError,
    "ServiceUnavailable": RemoteTransientError,
    "SlowDown": RemoteTransientError,
    "Throttling": RemoteTransientError,
    "ThrottlingException": RemoteTransientError,
    "TooManyRequests": RemoteTransientError,
}
_STATUS_TABLE: dict[int, type[RemoteError]] = {
    401: RemoteForbiddenError,
    403: RemoteForbiddenError,
    404: RemoteNotFoundError,
    408: RemoteTransientError,
    410: RemoteNotFoundError,
    412: RemoteChangedError,
    429: RemoteTransientError,
}


@functools.cache
def _type_table() -> tuple[tuple[type[BaseException], type[RemoteError]], ...]:
    """Exception types -> errors, most specific first. Built lazily: botocore and aiohttp are heavy imports."""
    table: list[tuple[type[BaseException], type[RemoteError]]] = []
    try:
        from s3fs.utils import FileExpired  # raised by s3fs files whose ETag changed while open
    except ImportError:  # pragma: no cover - no s3fs installed
        pass
    else:
        table.append((FileExpired, RemoteChangedError))
    table += [
        (FileNotFoundError, RemoteNotFoundError),
        (IsADirectoryError, RemoteNotFoundError),
        (NotADirectoryError, RemoteNotFoundError),
        (PermissionError, RemoteForbiddenError),
    ]
    try:
        from botocore import exceptions as boto
        from botocore.parsers import ResponseParserError
    except ImportError:  # pragma: no cover - no botocore installed
        pass
    else:
        table += [
            (boto.NoCredentialsError, RemoteForbiddenError),
            (boto.PartialCredentialsError, RemoteForbiddenError),
            (boto.HTTPClientError, RemoteTransientError),  # read timeouts, closed connections, streaming errors
            (boto.ConnectionError, RemoteTransientError),  # connect timeouts, endpoint unreachable
            (boto.IncompleteReadError, RemoteTransientError),
            (boto.FlexibleChecksumError, RemoteTransientError),  # body corrupted in transit
            (boto.CredentialRetrievalError, RemoteTransientError),  # the credential endpoint hiccupped
            (ResponseParserError, RemoteTransientError),  # throttling replies with invalid XML (s3fs #484)
        ]
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - no aiohttp installed
        pass
    else:
        table.append((aiohttp.ClientError, RemoteTransientError))  # ClientPayloadError: truncated body
    table += [
        (TimeoutError, RemoteTransientError),
        (ConnectionError, RemoteTransientError),
        (EOFError, RemoteTransientError),
        (OSError, RemoteTransientError),
    ]
    return tuple(table)


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def translate_error(exc: BaseException, path: str) -> RemoteError:
    """Map a backend exception to a ``RemoteError`` whose message holds only the path and structured fields.

    The caller scrubs credentials and raises the result ``from None``.
    """
    if isinstance(exc, RemoteError):
        return exc
    for link in _chain(exc):
        response = getattr(link, "response", None)
        if isinstance(response, Mapping) and "Error" in response:
            code = str(response.get("Error", {}).get("Code", ""))
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            kind = _CODE_TABLE.get(code) or _STATUS_TABLE.get(status)
            if kind is None:
                kind = RemoteTransientError if status >= 500 else RemoteError
            return kind(f"{_describe(kind)} for {path}: HTTP {status or '?'} {code or type(link).__name__}")
    for link in _chain(exc):
        for exc_type, kind in _type_table():
            if isinstance(link, exc_type):
                reason = getattr(link, "strerror", None) if isinstance(link, OSError) else None
                detail = type(link).__name__ + (f" ({reason})" if reason else "")
                return kind(f"{_describe(kind)} for {path}: {detail}")
    return RemoteError(f"unexpected {type(exc).__module__}.{type(exc).__name__} for {path}")


def _describe(kind: type[RemoteError]) -> str:
    return {
        RemoteNotFoundError: "not found",
        RemoteForbiddenError: "access denied (check credentials and permissions)",
        RemoteChangedError: "object changed since it was listed",
        RemoteTransientError: "transient remote failure",
    }.get(kind, "remote failure")


def _version_of(info: Mapping[str, Any]) -> str | None:
    """A version string from a listing entry: its ETag where the backend has one, else mtime and size."""
    for name in ("ETag", "etag", "md5Hash", "generation"):
        if info.get(name):
            return str(info[name])
    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        stamp = info.get(name)
        if isinstance(stamp, int | float):
            return f"{int(stamp * 1e9)}-{info.get('size')}"
        if stamp is not None:
            return f"{stamp}-{info.get('size')}"
    return None


_MD5_ETAG = re.compile(r"[0-9a-fA-F]{32}")
_CHECKSUM_FIELDS = ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumCRC64NVME", "ChecksumSHA1", "ChecksumSHA256")
_MD5_INLINE_BYTES = 1 << 20  # hash smaller bodies on the event loop; larger ones in a thread (hashlib drops the GIL)


def _etag_is_md5(response: Mapping[str, Any]) -> bool:
    """Whether a GetObject response's ETag is the MD5 of its body and nothing stronger was verified already."""
    if any(response.get(name) for name in _CHECKSUM_FIELDS):
        return False  # botocore validated a flexible checksum
    if response.get("SSECustomerAlgorithm") or response.get("ServerSideEncryption") in ("aws:kms", "aws:kms:dsse"):
        return False  # the ETag of an SSE-C or SSE-KMS object is not its MD5
    return bool(_MD5_ETAG.fullmatch(_strip_quotes(str(response.get("ETag", "")))))


async def _md5_hex(body: bytes) -> str:
    if len(body) <= _MD5_INLINE_BYTES:
        return hashlib.md5(body, usedforsecurity=False).hexdigest()
    return await asyncio.to_thread(lambda: hashlib.md5(body, usedforsecurity=False).hexdigest())


def _is_utf8(name: str) -> bool:
    """False for a name holding lone surrogates (how Python decodes file name bytes that are not UTF-8)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _strip_quotes(etag: str) -> str:
    return etag.strip().removeprefix("W/").strip('"')


class Remote:
    """List and fetch the objects under ``config.url`` matching ``config.pattern``. See the module docstring.

    Args:
        config: the ``[remote]`` section.
        share: this process's fraction (0, 1] of the node's rate caps.
        max_connections: HTTP connection pool size; at least the number of fetches in flight.
        retry_budget_burst: initial and maximum retry-budget tokens (retries allowed before the budget bites).
        rng: jitter source (tests pass a seeded one).

    Lifecycle: construct in the process that uses it (it refuses pickling); ``list_objects`` from plain code,
    ``fetch`` from one event loop; ``await aclose()`` on that loop when done (or ``close()`` outside any loop).
    """

    def __init__(
        self,
        config: RemoteConfig,
        *,
        share: float = 1.0,
        max_connections: int = 64,
        retry_budget_burst: float = 10.0,
        rng: random.Random | None = None,
    ) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        self.config = config
        self.stats = RemoteStats()
        self._rng = rng or random.Random()
        self._scrub = Scrubber(secrets_from_options(config.storage_options))
        try:
            self._fs_class: type[Any] = fsspec.get_filesystem_class(get_protocol(config.url))
        except (ValueError, ImportError) as exc:
            raise ConfigError(self._scrub(f"remote.url = {safe_url(config.url)!r}: {exc}")) from None
        self._is_s3 = any(c.__name__ == "S3FileSystem" for c in self._fs_class.__mro__)
        self._is_local = any(c.__name__ == "LocalFileSystem" for c in self._fs_class.__mro__)
        self._options = self._fs_options(max_connections)
        root = self._fs_class._strip_protocol(config.url)
        self._root = root.rstrip("/") or root
        self._where = safe_url(config.url)
        self._matcher = compile_pattern(config.pattern)
        self._budget = _RetryBudget(config.retry_budget, retry_budget_burst)
        self._requests = self._bucket(config.max_requests_per_s * share, minimum=1.0)
        self._bytes = self._bucket(config.max_bytes_per_s * share, minimum=1.0)
        self._sync_fs: Any = None
        self._async_fs: Any = None
        self._async_loop: asyncio.AbstractEventLoop | None = None
        self._closing: asyncio.Task[None] | None = None

    def __reduce__(self) -> Any:
        raise TypeError("a Remote is not picklable: create it inside the process that uses it")

    @staticmethod
    def _bucket(rate: float, *, minimum: float) -> _RateBucket | None:
        return _RateBucket(rate, max(minimum, rate * _BURST_S)) if rate > 0 else None

    def _fs_options(self, max_connections: int) -> dict[str, Any]:
        options = dict(self.config.storage_options)
        options["skip_instance_cache"] = True
        if self._is_s3:
            config_kwargs = dict(options.get("config_kwargs") or {})
            config_kwargs["retries"] = dict(_S3_NO_RETRIES)
            config_kwargs["connect_timeout"] = self.config.connect_timeout_s
            config_kwargs["read_timeout"] = self.config.read_timeout_s
            config_kwargs.setdefault("max_pool_connections", max_connections)
            # Verify the body against the checksum S3 stored at upload, where there is one (a mismatch is
            # FlexibleChecksumError: transient, retried). Pinned here so an environment variable cannot drop it.
            config_kwargs.setdefault("response_checksum_validation", "when_supported")
            options["config_kwargs"] = config_kwargs
            options["use_listings_cache"] = False
        return options

    def _error(self, exc: BaseException, path: str) -> RemoteError:
        error = translate_error(exc, path)
        if error is not exc:
            error = type(error)(self._scrub(str(error)))
        return error

    def _make_fs(self, **extra: Any) -> Any:
        try:
            fs = self._fs_class(**self._options, **extra)
        except Exception as exc:
            raise ConfigError(
                self._scrub(f"remote.storage_options rejected by {self._fs_class.__name__}: {type(exc).__name__}")
            ) from None
        if self._is_s3:
            fs.retries = 1  # NOTE [ One retry layer ]
        return fs

    # -------------------------------------------------------------------------------------------------- listing

    def list_objects(self) -> list[RemoteObject]:
        """Every file under the URL whose path relative to it matches the pattern, sorted by path.

        One listing request per page, no HEAD per object; sizes and versions come from the listing. Transient
        failures are retried with the same backoff as fetches; the last error is raised as a ``RemoteError``.
        """
        if self._sync_fs is None:
            self._sync_fs = self._make_fs()
        fs = self._sync_fs
        found: dict[str, dict[str, Any]] = {}
        for attempt in range(self.config.max_attempts):
            fs.invalidate_cache()  # a refresh must see new objects
            self.stats.listings_total += 1
            try:
                found = fs.find(self._root, detail=True)
                break
            except Exception as exc:
                error = self._error(exc, self._where)
                self._count(error)
                if not isinstance(error, RemoteTransientError) or attempt + 1 >= self.config.max_attempts:
                    raise error from None
                delay = backoff_delay(attempt, self.config.backoff_base_s, self.config.backoff_max_s, self._rng)
                logger.warning("listing failed (%s); retrying in %.2fs", error, delay)
                time.sleep(delay)
        objects = []
        unusable: list[str] = []
        for name, info in found.items():
            if info.get("type") != "file":
                continue
            if not _is_utf8(name):
                unusable.append(ascii(name))  # a local file name of raw bytes: keys and messages need text
                continue
            relative = name[len(self._root) :].lstrip("/") if name.startswith(self._root) else None
            if relative == "":
                relative = name.rsplit("/", 1)[-1]  # the URL names one file
            if relative is None or not self._matcher.match(relative):
                continue
            objects.append(RemoteObject(name, int(info.get("size") or 0), _version_of(info)))
        if unusable:
            logger.warning(
                "skipping %d objects whose names are not valid UTF-8 (rename them to cache them), e.g. %s",
                len(unusable),
                unusable[0],
            )
        objects.sort(key=lambda obj: obj.path)
        return objects

    # -------------------------------------------------------------------------------------------------- fetching

    async def fetch(self, obj: RemoteObject) -> bytes:
        """The whole body of ``obj`` at its listed version; raises a ``RemoteError`` (see the module docstring)."""
        self._budget.deposit()
        last: RemoteError | None = None
        for attempt in range(self.config.max_attempts):
            if attempt > 0:
                if not self._budget.withdraw():
                    self.stats.budget_exhausted_total += 1
                    raise RemoteTransientError(f"{last} (retry budget exhausted, not retried)")
                self.stats.retries_total += 1
                retry = attempt - 1
                await asyncio.sleep(
                    backoff_delay(retry, self.config.backoff_base_s, self.config.backoff_max_s, self._rng)
                )
            if self._requests is not None:
                self.stats.throttled_s += await self._requests.acquire(1)
            if self._bytes is not None:
                self.stats.throttled_s += await self._bytes.acquire(obj.size)
            self.stats.requests_total += 1
            try:
                body = await self._fetch_once(obj)
            except Exception as exc:
                error = self._error(exc, obj.path)
                self._count(error)
                if not isinstance(error, RemoteTransientError):
                    raise error from None
                logger.debug("attempt %d of %s failed: %s", attempt + 1, obj.path, error)
                last = error
                continue
            self.stats.bytes_total += len(body)
            return body
        raise RemoteTransientError(f"{last} (gave up after {self.config.max_attempts} attempts)")

    def _count(self, error: RemoteError) -> None:
        self.stats.errors_total[error.kind] = self.stats.errors_total.get(error.kind, 0) + 1

    async def _fetch_once(self, obj: RemoteObject) -> bytes:
        if self._is_s3:
            body = await self._get_s3(obj)
        elif self._fs_class.async_impl:
            body = await (await self._get_async_fs())._cat_file(obj.path)
        else:
            body = await asyncio.to_thread(self._read_sync, obj)
        if len(body) != obj.size:
            raise RemoteTransientError(f"short body for {obj.path}: {len(body)} of {obj.size} bytes")
        return bytes(body)

    async def connect(self) -> None:
        """Build the fetching client now (botocore loads its models: a second or more) instead of at the first
        ``fetch``. Optional; errors surface again, translated, at the first fetch."""
        await self._get_async_fs()

    async def _get_async_fs(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._async_fs is None or self._async_loop is not loop:
            self._async_fs = self._make_fs(asynchronous=True, loop=loop)
            self._async_loop = loop
            if self._is_s3:
                await self._async_fs.set_session()
        return self._async_fs

    async def _get_s3(self, obj: RemoteObject) -> bytes:
        fs = await self._get_async_fs()
        bucket, key, version = fs.split_path(obj.path)
        client = await fs.get_s3(bucket)
        pins = {"IfMatch": obj.etag} if obj.etag else {}
        if version:
            pins["VersionId"] = version
        # One GET, no HEAD: s3fs's cat_file would HEAD first. _get_s3_method_kwargs adds the user's
        # s3_additional_kwargs (SSE-C keys, requester pays) that get_object accepts.
        kwargs = fs._get_s3_method_kwargs(client.get_object, Bucket=bucket, Key=key, **pins)
        response = await client.get_object(**kwargs)
        async with response["Body"] as stream:
            body: bytes = await stream.read()
        etag = response.get("ETag")
        length = response.get("ContentLength")
        if obj.etag and etag and _strip_quotes(etag) != _strip_quotes(obj.etag):
            raise RemoteChangedError(f"object changed since it was listed for {obj.path}: ETag differs")
        if length is not None and int(length) != obj.size:
            raise RemoteChangedError(
                f"object changed since it was listed for {obj.path}: {length} bytes, listed {obj.size}"
            )
        if self.config.verify_md5 and etag and _etag_is_md5(response):
            digest = await _md5_hex(body)
            if digest != _strip_quotes(etag).lower():
                raise RemoteTransientError(f"body of {obj.path} does not match its ETag (MD5): corrupted in transit")
        return body

    def _read_sync(self, obj: RemoteObject) -> bytes:
        if not self._is_local:
            if self._sync_fs is None:
                self._sync_fs = self._make_fs()
            data: bytes = self._sync_fs.cat_file(obj.path)
            return data
        with open(obj.path, "rb") as handle:
            before = os.fstat(handle.fileno())
            self._check_local(obj, before)
            data = handle.read()
            self._check_local(obj, os.fstat(handle.fileno()))
        return data

    @staticmethod
    def _check_local(obj: RemoteObject, stat: os.stat_result) -> None:
        version = f"{int(stat.st_mtime * 1e9)}-{stat.st_size}"
        if obj.etag is not None and version != obj.etag:
            raise RemoteChangedError(f"object changed since it was listed for {obj.path}: version differs")

    # -------------------------------------------------------------------------------------------------- closing

    async def aclose(self) -> None:
        """Close the HTTP sessions from inside the fetching event loop (preferred in samplers)."""
        fs, self._async_fs, self._async_loop = self._async_fs, None, None
        creator = getattr(fs, "_s3creator", None)
        if creator is not None:
            try:
                await creator.__aexit__(None, None, None)
            except Exception as exc:
                logger.debug("closing the S3 session failed: %s", type(exc).__name__)
        self._close_sync()

    def close(self) -> None:
        """Close what is open. Inside a running loop that fetched, prefer ``await aclose()``."""
        loop = self._async_loop
        if loop is not None and not loop.is_closed() and not loop.is_running():
            loop.run_until_complete(self.aclose())
            return
        if loop is not None and loop.is_running():
            self._closing = loop.create_task(self.aclose())  # keep a reference until it runs
            return
        if loop is not None:
            logger.warning("the event loop that fetched is closed: await Remote.aclose() on it before it ends")
        self._async_fs = self._async_loop = None
        self._close_sync()

    def _close_sync(self) -> None:
        fs, self._sync_fs = self._sync_fs, None
        creator = getattr(fs, "_s3creator", None)
        if creator is not None:
            fs.close_session(fs.loop, creator)
