"""The remote client: list objects under an fsspec URL and fetch each one whole, through one retry layer.

``Remote`` is created inside the process that uses it (the supervisor to list, each sampler to fetch) and is never
pickled. ``list_objects`` is synchronous; ``fetch`` is a coroutine run on the sampler's event loop, many at a time.

Contract of ``fetch(obj)``:

- Normal case: exactly one request, a GET, per object. On S3 the GET is sent straight to the aiobotocore client
  (s3fs's ``cat_file`` would HEAD first to learn the size, which the listing already gave us).
- Pinned to the listed version, and the body whole: see ``integrity.py`` (``IfMatch``, ETag and length checks,
  checksums and MD5, local file versions).
- Errors are translated once, by ``errors.translate_error`` (status codes, S3 error codes and exception types,
  never message text), scrubbed here of every credential found in ``storage_options`` (``cachefeed._scrub``, the
  same scrubber as the logs') and raised ``from None``. ``RemoteNotFoundError``, ``RemoteForbiddenError`` and
  ``RemoteChangedError`` are not retried; ``RemoteTransientError`` is.

NOTE [ One retry layer ]
    Retries happen here and only here: full-jitter exponential backoff before each retry, at most
    ``max_attempts`` attempts per object, and a retry budget (the arithmetic is in ``limits.py``), so a failing
    remote sees at most ``(1 + retry_budget)`` times the load plus a small burst. The layers below are turned off
    on purpose: s3fs (``fs.retries = 1``; its wrapper is bypassed for GETs anyway) and botocore
    (``retries={"total_max_attempts": 1}``; botocore's ``max_attempts`` counts *retries*, so ``max_attempts: 1``
    would still retry once). One layer remains that we cannot turn off through a public API: aiohttp re-sends an
    idempotent request once when the server drops the connection before answering (meant for stale keep-alive
    connections). It is bounded (one extra request) and never fires on an HTTP error status.

Each attempt first waits on the rate caps (``limits.py``), scaled by ``share``, this process's fraction of the node.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
from typing import Any

import fsspec
from fsspec.utils import get_protocol

from cachefeed._config import RemoteConfig
from cachefeed._errors import ConfigError, RemoteError, RemoteTransientError
from cachefeed._logs import get_logger
from cachefeed._patterns import compile_pattern
from cachefeed._remote.errors import translate_error
from cachefeed._remote.integrity import check_local, check_md5, check_s3_response
from cachefeed._remote.limits import RetryBudget, backoff_delay, rate_bucket
from cachefeed._remote.listing import OnPage, Pager, list_pages
from cachefeed._remote.manifest import Manifest
from cachefeed._remote.objects import RemoteObject, RemoteStats
from cachefeed._scrub import Scrubber, safe_url, secrets_from_options

__all__ = ["Remote"]

logger = get_logger(__name__)

_S3_NO_RETRIES = {"total_max_attempts": 1, "mode": "standard"}  # NOTE [ One retry layer ]


# NOTE [ Warmed session ]
# Making an S3 client loads botocore's models and endpoint data into its session: about 0.15 s of CPU per session,
# 0.015 s for a further client of a session that has done it once. The supervisor warms one session per set of
# options (``Remote.warm_session``, in ``preflight``, before it forks the samplers and starts any thread), so its
# listing client and every forked sampler's fetching client (each its own client, HTTP pool and event loop) reuse
# the loaded models instead of loading them three times on the cores the first listing needs. It builds the TLS
# context of its clients' first request then too (NOTE [ One TLS context ] in ``tls.py``). A session holds no
# connection and no event loop; clients are never shared between processes. A sampler started as a fresh
# interpreter has no warmed session and builds its own, as before. A user's own ``storage_options["session"]``
# is always used as given.
_WARM_SESSIONS: dict[str, Any] = {}


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
            # What the URL itself says (an FTP or SFTP host, port and user), under the user's storage_options, as
            # fsspec's own url_to_fs merges them
            self._url_options: dict[str, Any] = dict(self._fs_class._get_kwargs_from_urls(config.url))
        except (ValueError, ImportError) as exc:
            raise ConfigError(self._scrub(f"remote.url = {safe_url(config.url)!r}: {exc}")) from None
        self._scrub = self._scrub.with_values(secrets_from_options(self._url_options))  # a password in the URL
        self._is_s3 = any(c.__name__ == "S3FileSystem" for c in self._fs_class.__mro__)
        self._is_local = any(c.__name__ == "LocalFileSystem" for c in self._fs_class.__mro__)
        self._options = self._fs_options(max_connections)
        root = self._fs_class._strip_protocol(config.url)
        self._root: str = root.rstrip("/") or root
        self._protocol = get_protocol(config.url)
        self._where = safe_url(config.url)
        self._matcher = compile_pattern(config.pattern)
        self._budget = RetryBudget(config.retry_budget, retry_budget_burst)
        self._requests = rate_bucket(config.max_requests_per_s * share, minimum=1.0)
        self._bytes = rate_bucket(config.max_bytes_per_s * share, minimum=1.0)
        self._sync_fs: Any = None
        self._async_fs: Any = None
        self._async_loop: asyncio.AbstractEventLoop | None = None
        self._closing: asyncio.Task[None] | None = None
        self._manifest: Manifest | None = None

    def __reduce__(self) -> Any:
        raise TypeError("a Remote is not picklable: create it inside the process that uses it")

    def _fs_options(self, max_connections: int) -> dict[str, Any]:
        options = {**self._url_options, **self.config.storage_options}
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
            from cachefeed._remote.tls import session_class  # imports aiobotocore: S3 only

            shared_tls = session_class()  # NOTE [ One TLS context ] (tls.py)
            if shared_tls is not None:
                config_kwargs.setdefault("http_session_cls", shared_tls)
            options["config_kwargs"] = config_kwargs
            options["use_listings_cache"] = False
        return options

    def _rejected(self, exc: BaseException) -> str:
        """The one line for storage options the filesystem refuses (an unknown keyword: a typo), secrets removed."""
        return self._scrub(
            f"remote.storage_options = {{{', '.join(sorted(self.config.storage_options))}}} rejected by "
            f"{self._fs_class.__name__}: {type(exc).__name__}: {exc}: check each option's name and value against "
            f"the {self._protocol}:// filesystem's documentation"
        )

    def _error(self, exc: BaseException, path: str) -> RemoteError:
        error = translate_error(exc, path)
        if error is not exc:
            error = type(error)(self._scrub(str(error)))
        return error

    def _session_key(self) -> str | None:
        """What a warmed botocore session is shared under (NOTE [ Warmed session ]); None: nothing to share."""
        if not self._is_s3 or "session" in self._options:
            return None
        return repr(sorted((k, repr(v)) for k, v in self._options.items() if k != "config_kwargs"))

    def _make_fs(self, **extra: Any) -> Any:
        key = self._session_key()
        if key is not None and key in _WARM_SESSIONS:
            extra = {**extra, "session": _WARM_SESSIONS[key]}
        try:
            fs = self._fs_class(**self._options, **extra)
        except OSError as exc:  # a filesystem that connects when it is made (FTP, SFTP): the server's answer
            raise self._error(exc, self._where) from None
        except Exception as exc:
            raise ConfigError(self._rejected(exc)) from None
        if self._is_s3:
            fs.retries = 1  # NOTE [ One retry layer ]
        return fs

    # -------------------------------------------------------------------------------------------------- listing

    @property
    def root(self) -> str:
        """The URL's path without protocol (what listed paths start with)."""
        return self._root

    @property
    def where(self) -> str:
        return self._where

    @property
    def is_s3(self) -> bool:
        return self._is_s3

    @property
    def matcher(self) -> re.Pattern[str]:
        return self._matcher

    @property
    def rng(self) -> random.Random:
        return self._rng

    def translate(self, exc: BaseException, path: str) -> RemoteError:
        """``exc`` as a scrubbed ``RemoteError``, counted by kind."""
        error = self._error(exc, path)
        self._count(error)
        return error

    def list_pages(self, on_page: OnPage) -> int | None:
        """Hand every object under the URL matching the pattern to ``on_page``, one LIST page at a time (see
        ``listing.py``), or read from ``remote.manifest`` (``manifest.py``: no LIST at all); returns how many
        were listed, or None when the manifest is unchanged since the last read. No HEAD per object: sizes and
        versions come from the listing. Transient failures are retried per request; the last error is raised as
        a ``RemoteError``."""
        fs = self.listing_fs()
        fs.invalidate_cache()  # a refresh must see new objects
        self.stats.listings_total += 1
        if self.config.manifest:
            if self._manifest is None:
                self._manifest = Manifest(self.config.manifest, self.listing_fs, lambda: Pager(self, on_page))
            return self._manifest.read(on_page)
        return list_pages(self, fs, on_page)

    def read_small(self, path: str) -> bytes:
        """The whole body of the object at ``path`` (no protocol) with one GET and nothing else (s3fs's
        ``cat_file`` would HEAD first, and LIST when the object is missing). For small control objects; errors
        are raised untranslated (the caller's ``Pager.request`` translates and retries them)."""
        fs = self.listing_fs()
        if not self._is_s3:
            data: bytes = fs.cat_file(path)
            return data
        from fsspec.asyn import sync

        async def get() -> bytes:
            if getattr(fs, "_s3", None) is None:
                await fs.set_session()
            bucket, key, _ = fs.split_path(path)
            client = await fs.get_s3(bucket)
            kwargs = fs._get_s3_method_kwargs(client.get_object, Bucket=bucket, Key=key)
            response = await client.get_object(**kwargs)
            async with response["Body"] as stream:
                body: bytes = await stream.read()
            return body

        result: bytes = sync(fs.loop, get)
        return result

    def listing_fs(self) -> Any:
        """The synchronous filesystem this process lists and reads manifests through (made on first use)."""
        if self._sync_fs is None:
            self._sync_fs = self._make_fs()
        return self._sync_fs

    def list_objects(self) -> list[RemoteObject]:
        """Every file under the URL whose path relative to it matches the pattern, sorted by path (all pages of
        ``list_pages`` at once)."""
        objects: list[RemoteObject] = []
        self.list_pages(objects.extend)  # (a manifest unchanged since the last call lists nothing)
        objects.sort(key=lambda obj: obj.path)
        return objects

    def key_of(self, path: str) -> str:
        """A listed object's path relative to the URL (what ``pattern`` matches, and the key its samples get as
        ``__key__``); the file name when the URL names the object itself."""
        relative = path[len(self._root) :].lstrip("/") if path.startswith(self._root) else path
        return relative or path.rsplit("/", 1)[-1]

    def why_empty(self) -> str:
        """Why a listing matched nothing, where it can be told without a request: " (PATH does not exist)" for a
        local directory that is not there (a typo reads the same as an empty directory otherwise), else ""."""
        if not self._is_local or os.path.exists(self._root):
            return ""
        return f" ({self._root} does not exist)"

    def url_of(self, path: str) -> str:
        """A listed object's URL (``s3://bucket/key``, ``file:///dir/name``): its samples' ``__url__``."""
        return f"{self._protocol}://{path}"

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
                self.stats.throttled_s += await self._bytes.acquire(max(obj.size, 0))
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
        if obj.size >= 0 and len(body) != obj.size:  # -1: a manifest that gives no size
            raise RemoteTransientError(f"short body for {obj.path}: {len(body)} of {obj.size} bytes")
        return bytes(body)

    @property
    def has_warm_session(self) -> bool:
        """Whether this process holds a warmed session this remote's clients reuse (NOTE [ Warmed session ])."""
        key = self._session_key()
        return key is not None and key in _WARM_SESSIONS

    def warm_session(self) -> bool:
        """Build this remote's botocore session now, in this process, and keep it for every client this process
        (and every process forked from it later) makes for the same options: NOTE [ Warmed session ]. Runs a
        short event loop of its own on the calling thread and leaves no thread behind; True if a session is
        kept (S3 only). ``ConfigError`` where botocore refuses the options (a misspelt keyword, an endpoint that is no
        URL); other errors are not raised: the first listing or fetch meets and reports them."""
        key = self._session_key()
        if key is None:
            return False
        if key in _WARM_SESSIONS:
            return True

        from cachefeed._remote.models import session
        from cachefeed._remote.tls import prepare_tls

        async def build() -> Any:
            fs = self._fs_class(**self._options, asynchronous=True, loop=asyncio.get_running_loop())
            made_by_s3fs = getattr(fs, "kwargs", None)  # what s3fs would give the AioSession it makes
            if getattr(fs, "session", None) is None and isinstance(made_by_s3fs, dict):
                fs.session = session(**made_by_s3fs)  # NOTE [ botocore's models, loaded once and plainly ]
            await fs.set_session()
            try:
                await prepare_tls(fs.s3)  # NOTE [ One TLS context ]: the samplers forked next inherit it
            except Exception as exc:  # a bad verify path: the first request meets and reports it
                logger.debug("building the TLS context failed: %s", type(exc).__name__)
            creator = getattr(fs, "_s3creator", None)
            if creator is not None:
                await creator.__aexit__(None, None, None)
            return fs.session

        try:
            _WARM_SESSIONS[key] = asyncio.run(build())
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:  # what botocore refuses to build a client with: the config's fault
            raise ConfigError(self._rejected(exc)) from None
        except Exception as exc:
            logger.debug("warming the S3 session failed: %s", type(exc).__name__)
            return False
        return True

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
        check_s3_response(obj, response)
        if self.config.verify_md5:
            await check_md5(obj, response, body)
        return body

    def _read_sync(self, obj: RemoteObject) -> bytes:
        if not self._is_local:
            if self._sync_fs is None:
                self._sync_fs = self._make_fs()
            data: bytes = self._sync_fs.cat_file(obj.path)
            return data
        with open(obj.path, "rb") as handle:
            check_local(obj, os.fstat(handle.fileno()))
            data = handle.read()
            check_local(obj, os.fstat(handle.fileno()))
        return data

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
