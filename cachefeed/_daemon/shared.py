"""The shared catalog: one lister publishes catalog generations to the object store; every node reads the newest.

``cachefeed catalog build URL [--out DIR]`` (``publish_listing``) lists the remote once and writes a catalog file
(``catalog_file.py``, every object, node 0 of 1) as a new generation under ``DIR`` (default ``<URL>.cfcatalog``,
next to the data). Daemons with ``remote.catalog = DIR`` (``SharedCatalog``) read the newest generation instead
of listing, keeping the objects their node owns. The object store is the only coordination point: no service,
no node-to-node traffic, and **no LIST request from any reader**: across a job, LIST requests per refresh are
one listing's (the publisher's), whatever the node count.

Layout of ``DIR``::

    gen-<UTC time>-<random>.cfcat   one generation each (written whole, then named in LATEST)
    LATEST                          text: the newest generation's name first, then up to KEEP - 1 older ones

Protocol (who writes what, and what a crash leaves):

1. The publisher writes a new generation object under a fresh name. A crash here leaves an unnamed object that
   no reader opens (it is not in LATEST).
2. It replaces ``LATEST`` (one PUT: readers see the old text or the new one), naming the new generation first.
3. It deletes the generations LATEST no longer names (the KEEP newest stay, so a reader that read LATEST just
   before step 2 can still open the generation it found there). A crash here leaves extra objects, harmless.

With ``remote.catalog_publish = true``, node 0's daemon is the publisher (``Publisher``): it lists, plans from its
own listing, and publishes each listing that differs from the last one it published (steps 1-3; a listing equal
to it leaves LATEST as it is, so readers read nothing); every other node reads.

The header names the listed remote by a digest (``catalog_file.url_digest``: the URL may hold credentials, and
every node reads the generation); a reader checks it against its own ``remote.url``. The catalog holds what the
build's ``--pattern`` selected; a reader whose ``remote.pattern`` is not the default
``"**"`` must name the same pattern (else the refresh fails with a message saying so).

A reader GETs ``LATEST`` on every refresh (one small request); when it names the generation already read, that
is all (the listing in force stays). Otherwise it streams the generation block by block, each read resumed where a
transient failure cut it (``listing.ResumingReader``: a reset or a 5xx mid-stream costs what was not read yet, not
the whole generation); a damaged or truncated generation is an error naming it (the listing in force stays, nothing
vanishes, and the refresh is retried).
"""

from __future__ import annotations

import datetime
import secrets
import time
from collections.abc import Callable
from typing import Any

from cachefeed._daemon.catalog_file import CatalogFileError, CatalogHeader, CatalogWriter, read_pages, url_digest
from cachefeed._daemon.columns import FoldedPage
from cachefeed._errors import ConfigError, RemoteNotFoundError
from cachefeed._logs import get_logger
from cachefeed._remote import Remote, RemoteObject
from cachefeed._remote.listing import Pager
from cachefeed._scrub import safe_url

__all__ = ["KEEP", "Publisher", "SharedCatalog", "default_out", "publish_listing"]

log = get_logger(__name__)

KEEP = 3
LATEST = "LATEST"


def default_out(url: str) -> str:
    """Where ``catalog build`` writes by default: next to the data, ``<url>.cfcatalog``."""
    scheme, sep, rest = url.partition("://")
    path = (rest if sep else url).strip("/")
    if sep and scheme != "file" and "/" not in path:  # s3://bucket
        raise ConfigError(f"{url}: the data is a whole bucket: name where the catalog goes with --out")
    if not path:  # a plain path or file:// at a filesystem's root
        raise ConfigError(f"{url}: the data is a filesystem's root: name where the catalog goes with --out")
    return f"{url.rstrip('/')}.cfcatalog"


def _generations(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("gen-")]


def publish_listing(
    remote: Remote,
    out: str,
    *,
    on_progress: Callable[[int], None] | None = None,
    on_page: Callable[[list[RemoteObject]], None] | None = None,
    unless: str = "",
    allow_empty: bool = True,
) -> tuple[str, int, str]:
    """List ``remote`` once and publish the listing as a new generation under ``out`` (the module docstring says
    the protocol), handing each listed page to ``on_page`` too; returns (the generation's name, its objects, its
    digest). When the digest is ``unless`` (the listing is the one published last), or the listing holds no
    object and not ``allow_empty`` (``catalog build``: a typo'd URL would empty every reader's listing), the new
    generation is deleted and LATEST is left as it is: the name returned is ""."""
    fs = remote.listing_fs()
    root = fs._strip_protocol(out).rstrip("/")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    name = f"gen-{stamp}-{secrets.token_hex(4)}.cfcat"
    header = CatalogHeader(url_digest(remote.root.rstrip("/")), remote.config.pattern, 0, 1, name)
    if not remote.is_s3:  # object stores have no directories to make (and s3fs would probe the bucket)
        fs.makedirs(root, exist_ok=True)
    try:
        with fs.open(f"{root}/{name}", "wb") as handle:
            writer = CatalogWriter(handle, header)

            def write(objects: list[RemoteObject]) -> None:
                writer.write_objects(objects)
                if on_page is not None:
                    on_page(objects)
                if on_progress is not None:
                    on_progress(writer.objects)

            remote.list_pages(write)
            writer.close()
    except BaseException:
        _remove_quietly(fs, f"{root}/{name}")  # closing the file may have stored what was written: never named
        raise
    if (unless and writer.digest == unless) or (not allow_empty and writer.objects == 0):
        _remove(fs, f"{root}/{name}")
        return "", writer.objects, writer.digest
    try:
        previous = _generations(remote.read_small(f"{root}/{LATEST}").decode())
    except Exception as exc:
        error = remote.translate(exc, safe_url(out))
        if error.kind != "not_found":
            raise error from None
        previous = []  # the first generation
    kept = [name, *[g for g in previous if g != name]][:KEEP]
    fs.pipe_file(f"{root}/{LATEST}", ("\n".join(kept) + "\n").encode())
    for old in previous:
        if old not in kept:
            _remove(fs, f"{root}/{old}")
    return name, writer.objects, writer.digest


def _remove(fs: Any, path: str) -> None:
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


def _remove_quietly(fs: Any, path: str) -> None:
    """Remove what a failed publication left, if anything; its own failure is only logged (the first one is
    the error to report)."""
    try:
        _remove(fs, path)
    except Exception as exc:
        log.warning("could not remove the unfinished catalog generation %s: %s", safe_url(path), type(exc).__name__)


class Publisher:
    """The ``ListingSource`` of node 0 with ``remote.catalog_publish``: it lists the remote (its pages reach its
    own plan as any listing's) and publishes each complete listing as a generation under ``url`` for the other
    nodes (``SharedCatalog``), unless it lists exactly what it published last (then nothing changes for them).
    A listing that fails publishes nothing: the generation it was writing is never named in LATEST."""

    def __init__(self, remote: Remote, url: str) -> None:
        self._remote = remote
        self.url = url
        self._where = safe_url(url)
        self._digest = ""  # of the generation published last (by this process)

    def __call__(self, on_page: Callable[[Any], None]) -> int:
        name, objects, self._digest = publish_listing(self._remote, self.url, on_page=on_page, unless=self._digest)
        if name:
            log.info("published catalog generation %s (%d objects) under %s", name, objects, self._where)
        else:
            log.debug("the listing is the one published last: no new generation under %s", self._where)
        return objects


class SharedCatalog:
    """A ``ListingSource`` (``catalog.py``) reading the newest generation under ``url`` for node ``rank`` of
    ``count``; returns None when LATEST names the generation already read."""

    def __init__(self, remote: Remote, url: str, *, rank: int, count: int, label: str = "") -> None:
        self._remote = remote
        self.url = url
        self._where = safe_url(url)  # what messages name: credentials in the URL never reach a log
        self._rank, self._count, self._label = rank, count, label
        self._last = ""

    def __call__(self, on_page: Callable[[Any], None]) -> int | None:
        fs = self._remote.listing_fs()
        root = fs._strip_protocol(self.url).rstrip("/")
        pager = Pager(self._remote, on_page)
        fs.invalidate_cache()
        try:
            text = pager.request(lambda: self._remote.read_small(f"{root}/{LATEST}"), is_list=False)
        except RemoteNotFoundError:
            text = b""
        latest = _generations(text.decode())
        if not latest:
            raise CatalogFileError(
                f"no catalog generation under {self._where} yet: publish one (cachefeed catalog build, or node 0 "
                "with remote.catalog_publish = true); retrying"
            )
        name = latest[0]
        if name == self._last:
            return None
        started = time.monotonic()
        listed = 0
        try:
            with pager.open(fs, f"{root}/{name}", block_size=8 << 20) as handle:
                pages = read_pages(handle.read, self._rank, self._count, label=self._label)
                header = next(pages)
                if isinstance(header, CatalogHeader) and header.url != url_digest(self._remote.root.rstrip("/")):
                    raise _WrongCatalog(
                        f"the catalog {self._where} lists another remote than remote.url ({self._remote.where}): "
                        "point remote.catalog at the catalog built for this URL"
                    )
                pattern = self._remote.config.pattern
                if isinstance(header, CatalogHeader) and pattern not in ("**", header.pattern):
                    raise _WrongCatalog(
                        f"the catalog {self._where} was built with pattern {header.pattern!r}, remote.pattern is "
                        f"{pattern!r}: build it with --pattern {pattern!r}, or leave remote.pattern at its default"
                    )
                for page in pages:
                    if isinstance(page, FoldedPage):
                        listed += page.listed
                        on_page(page)
        except _WrongCatalog:
            raise
        except CatalogFileError as exc:
            raise CatalogFileError(
                f"catalog generation {name} under {self._where} is not usable ({exc}): the catalog in force stays; "
                "publish a new generation (cachefeed catalog build)"
            ) from None
        self._last = name
        log.info("read catalog generation %s: %d objects in %.2fs", name, listed, time.monotonic() - started)
        return listed


class _WrongCatalog(CatalogFileError):
    """A readable generation of another remote or pattern (said as it is, not as a damaged file)."""
