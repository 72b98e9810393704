"""Paged listing: the objects under a URL, handed out page by page as the store answers, each request counted.

A page is one LIST request's worth of objects: on S3, one ``ListObjectsV2`` call (up to 1,000 keys, sent straight
to the aiobotocore client, continuation token by token); elsewhere, one ``fs.ls`` of one directory (a depth-first
walk in name order, so pages come in path order as on S3). Pages are given to ``on_page`` as they arrive, so the
caller can plan from the first page while the rest is still being listed.

Contract of ``list_pages(remote, fs, on_page)``:

- Every request is counted in ``remote.stats.list_requests_total`` (retries included), before it is sent.
- A transient failure of one request is retried with the fetches' backoff, up to ``max_attempts`` attempts for
  that request; pages already handed out stay handed out (the caller folds pages idempotently). The last error is
  raised as a ``RemoteError``.
- Only files whose path relative to the URL matches ``remote.pattern`` are handed out; a URL that names one file
  lists that file. On S3 only the keys under ``<prefix>/`` are requested, never its siblings (``_s3_pages``).
  Names that are not valid UTF-8 are skipped (one warning per listing).
"""

from __future__ import annotations

import functools
import io
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cachefeed._errors import RemoteTransientError
from cachefeed._logs import get_logger
from cachefeed._remote.integrity import version_of
from cachefeed._remote.limits import backoff_delay
from cachefeed._remote.objects import RemoteObject

if TYPE_CHECKING:
    from cachefeed._remote.client import Remote

__all__ = ["OnPage", "Pager", "ResumingReader", "list_pages"]

logger = get_logger(__name__)

OnPage = Callable[[list[RemoteObject]], None]


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Pager:
    """Hands pages of one listing to ``on_page`` (pattern and root applied) and sends its requests."""

    def __init__(self, remote: Remote, on_page: OnPage) -> None:
        self.remote = remote
        self.on_page = on_page
        self.root = remote.root
        self.unusable: list[str] = []
        self.matches_all = remote.config.pattern == "**"
        self.total = 0

    def request(
        self, call: Callable[[], Any], *, is_list: bool = True, on_failure: Callable[[], None] | None = None
    ) -> Any:
        """One request (a LIST unless ``is_list`` is False: counted), retried on transient errors (``on_failure``
        runs after each failed attempt)."""
        config = self.remote.config
        for attempt in range(config.max_attempts):
            if is_list:
                self.remote.stats.list_requests_total += 1
            try:
                return call()
            except Exception as exc:
                if on_failure is not None:
                    on_failure()
                error = self.remote.translate(exc, self.remote.where)
                if not isinstance(error, RemoteTransientError) or attempt + 1 >= config.max_attempts:
                    raise error from None
                delay = backoff_delay(attempt, config.backoff_base_s, config.backoff_max_s, self.remote.rng)
                logger.debug("listing failed (%s); retrying in %.2fs", error, delay)  # the catalog warns if it gives up
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def open(self, fs: Any, path: str, **kwargs: Any) -> io.BufferedReader:
        """``path`` opened for reading through ``fs``, each read retried as a request (``ResumingReader``)."""
        return io.BufferedReader(ResumingReader(self, lambda: fs.open(path, "rb", **kwargs)), buffer_size=1 << 20)

    def emit(self, entries: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
        objects = []
        for name, info in entries:
            if not _is_utf8(name):
                self.unusable.append(ascii(name))  # a local file name of raw bytes: keys and messages need text
                continue
            if name == self.root:
                relative = name.rsplit("/", 1)[-1]  # the URL names one file
            elif name.startswith(self.root + "/") or not self.root:
                relative = name[len(self.root) :].lstrip("/")
            else:
                continue
            if not self.matches_all and not self.remote.matcher.match(relative):
                continue
            size = info.get("size", info.get("Size"))  # None where the listing does not say (an HTTP index page)
            objects.append(RemoteObject(name, int(size) if size is not None else -1, version_of(info)))
        objects.sort(key=lambda obj: obj.path)
        self.total += len(objects)
        self.on_page(objects)


class ResumingReader(io.RawIOBase):
    """A remote file (a manifest, a shared catalog's generation) read as a stream that survives the network: each
    read is one ``Pager.request``; a transient failure (a connection reset, a 5xx, a body cut short) drops the
    handle, waits the fetches' backoff and reopens the file at the position reached, up to ``max_attempts``
    attempts per read; then, or on any other failure, the error is raised as the remote's ``RemoteError``. What
    was read before a failure is never read again, so a reset at 90% of a large catalog costs 10% more."""

    def __init__(self, pager: Pager, open_file: Callable[[], Any]) -> None:
        super().__init__()
        self._pager = pager
        self._open = open_file
        self._handle: Any = None
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._pos = offset
            if self._handle is not None:
                self._handle.seek(offset)
        else:
            self._pos = int(self._pager.request(lambda: self._file().seek(offset, whence), is_list=False))
        return self._pos

    def _file(self) -> Any:
        if self._handle is None:
            self._handle = self._open()
            if self._pos:
                self._handle.seek(self._pos)
        return self._handle

    def _drop(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            try:
                handle.close()
            except Exception as exc:  # a broken connection may fail to close too: it is dropped all the same
                logger.debug("closing a failed stream: %s", type(exc).__name__)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data: bytes = self._pager.request(lambda: self._file().read(len(view)), is_list=False, on_failure=self._drop)
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def close(self) -> None:
        self._drop()
        super().close()


def list_pages(remote: Remote, fs: Any, on_page: OnPage) -> int:
    """List ``remote``'s URL through ``fs`` page by page (see the module docstring); returns the objects listed."""
    pager = Pager(remote, on_page)
    if remote.is_s3:
        _s3_pages(pager, fs)
    else:
        _walk_pages(pager, fs)
    if pager.unusable:
        logger.warning(
            "skipping %d objects whose names are not valid UTF-8 (rename them to cache them), e.g. %s",
            len(pager.unusable),
            pager.unusable[0],
        )
    return pager.total


def _s3_pages(pager: Pager, fs: Any) -> None:
    """The URL as a directory: ``Prefix`` ends with "/" (a bare ``data`` would also list ``data.cfcatalog/`` and
    ``data-v2/``, every key of them sent and dropped). Only when that lists nothing may the URL name one object:
    then one more LIST of at most one key, the URL's own key sorting first among the keys it begins."""
    bucket, prefix, _ = fs.split_path(pager.root)
    prefix = prefix.strip("/")
    if not prefix:
        _s3_listing(pager, fs, bucket, "")
    elif not _s3_listing(pager, fs, bucket, prefix + "/"):
        _s3_listing(pager, fs, bucket, prefix, max_keys=1)


def _s3_listing(pager: Pager, fs: Any, bucket: str, prefix: str, *, max_keys: int | None = None) -> int:
    """Every page of ``ListObjectsV2`` under ``prefix`` (or its first ``max_keys`` keys); returns the keys seen."""
    from fsspec.asyn import sync

    async def one_page(token: str | None) -> dict[str, Any]:
        if getattr(fs, "_s3", None) is None:
            await fs.set_session()
        client = await fs.get_s3(bucket)
        extra: dict[str, Any] = {"ContinuationToken": token} if token else {}
        if max_keys is not None:
            extra["MaxKeys"] = max_keys
        kwargs = fs._get_s3_method_kwargs(client.list_objects_v2, Bucket=bucket, Prefix=prefix, **extra)
        page: dict[str, Any] = await client.list_objects_v2(**kwargs)
        return page

    token: str | None = None
    seen = 0
    while True:
        page: dict[str, Any] = pager.request(functools.partial(sync, fs.loop, one_page, token))
        contents = page.get("Contents", ())
        seen += len(contents)
        pager.emit([(f"{bucket}/{item['Key']}", item) for item in contents])
        if max_keys is not None or not page.get("IsTruncated"):
            return seen
        token = page.get("NextContinuationToken")
        if not token:
            return seen


def _ls(fs: Any, directory: str) -> list[dict[str, Any]]:
    """One directory's entries; none where it is gone: the URL itself (nothing under it: an empty listing, the
    daemon says which keys to check), or a subdirectory removed while the walk went (its objects left with it)."""
    try:
        entries: list[dict[str, Any]] = fs.ls(directory, detail=True)
    except FileNotFoundError:
        return []
    return entries


def _walk_pages(pager: Pager, fs: Any) -> None:
    """Depth-first in name order: one ``ls`` (one page) per directory."""
    stack = [pager.root]
    while stack:
        directory = stack.pop()
        entries: list[dict[str, Any]] = pager.request(functools.partial(_ls, fs, directory))
        files = []
        subdirs = []
        for info in entries:
            name = str(info["name"]).rstrip("/")
            if info.get("type") == "directory":
                if name != directory:
                    subdirs.append(name)
            elif info.get("type") == "file":
                files.append((name, info))
        pager.emit(files)
        stack.extend(sorted(subdirs, reverse=True))
