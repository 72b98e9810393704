"""``remote.manifest``: the dataset's listing read from a file or an object, with no LIST request at all.

Two formats, told apart by the name:

* **An S3 Inventory report** (a URL ending in ``manifest.json``): the manifest AWS writes, naming its data files
  (``files[].key`` in the destination bucket) and their format (``fileFormat``: ``CSV``, gzipped, with columns
  in ``fileSchema`` order and keys URL-encoded; or ``Parquet``, read with pyarrow, the ``parquet`` extra).
  Each row gives ``Bucket``, ``Key``, and where the report has them ``Size`` and ``ETag`` (a bare ETag is quoted,
  as a LIST gives it). Delete markers and non-latest versions are skipped.
* **A key list** (any other name; ``.gz`` is gunzipped, ``.zst`` needs the ``zstandard`` package): one object per
  line, ``key[<TAB>size[<TAB>version]]``, the key relative to ``remote.url``. Blank lines and lines starting
  with ``#`` are skipped. An object without a size is fetched without the length check.

Either way, objects outside ``remote.url`` or not matching ``remote.pattern`` are left out, and objects are handed
out in pages of ``PAGE_OBJECTS`` as the file is read (the plan starts after the first page).

**Refreshes cost one small read.** Before reading, the manifest's version (its ETag, or mtime and size) is
compared with the last one read; when it is the same, nothing else is read and ``read`` returns None (the listing
in force stays). An S3 Inventory report is re-read when a new report replaces ``manifest.json``.

Every request goes through the remote's filesystem and credentials (``remote.storage_options``); errors are the
remote's ``RemoteError`` kinds, translated and scrubbed once (``Remote.translate``). Files are read as streams
that resume where a transient failure cut them (``listing.ResumingReader``, retried per ``remote.max_attempts``).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections.abc import Callable
from typing import IO, Any
from urllib.parse import unquote_plus

from cachefeed._errors import ConfigError
from cachefeed._logs import get_logger
from cachefeed._remote.integrity import version_of
from cachefeed._remote.listing import Pager
from cachefeed._remote.objects import RemoteObject

__all__ = ["PAGE_OBJECTS", "Manifest"]

log = get_logger(__name__)

PAGE_OBJECTS = 10_000


def _quoted(etag: str) -> str:
    """An Inventory ETag as a LIST shows it: ``"hex"`` (a bare ETag in a GET's If-Match is not what S3 sent)."""
    etag = etag.strip()
    if not etag or etag.startswith('"'):
        return etag
    return f'"{etag}"'


class Manifest:
    """Reads ``url`` through ``fs`` for ``pager``'s remote (see the module docstring)."""

    def __init__(self, url: str, fs_for: Callable[[], Any], pager_for: Callable[[], Pager]) -> None:
        self.url = url
        self._fs_for = fs_for
        self._pager_for = pager_for
        self._last_version: str | None = None
        self.is_inventory = url.rstrip("/").endswith("manifest.json")

    def read(self, on_page: Callable[[list[RemoteObject]], None]) -> int | None:
        """Hand the manifest's objects to ``on_page`` in pages; returns how many, or None if it is unchanged."""
        fs = self._fs_for()
        path = fs._strip_protocol(self.url)
        pager = self._pager_for()
        fs.invalidate_cache()
        info = pager.request(lambda: fs.info(path), is_list=False)
        version = version_of(info)
        if version is not None and version == self._last_version:
            return None
        pager.on_page = on_page
        if self.is_inventory:
            self._read_inventory(fs, path, pager)
        else:
            with pager.open(fs, path) as raw:
                self._read_lines(_decompressed(raw, path), pager)
        self._last_version = version
        return pager.total

    # -- key lists ------------------------------------------------------------------------------------------

    def _read_lines(self, stream: IO[bytes], pager: Pager) -> None:
        root = pager.root
        page: list[tuple[str, dict[str, Any]]] = []
        for number, raw_line in enumerate(io.TextIOWrapper(stream, encoding="utf-8", newline=None), 1):
            line = raw_line.rstrip("\n")
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.split("\t")
            if len(parts) > 3 or (len(parts) > 1 and not parts[1].strip().isdigit()):
                raise ConfigError(
                    f"remote.manifest line {number}: expected key[<TAB>size[<TAB>version]], got {line[:80]!r}"
                )
            key = parts[0].lstrip("/")
            info: dict[str, Any] = {"size": int(parts[1]) if len(parts) > 1 else -1}
            if len(parts) > 2 and parts[2]:
                info["ETag"] = parts[2]
            page.append((f"{root}/{key}" if root else key, info))
            if len(page) >= PAGE_OBJECTS:
                pager.emit(page)
                page = []
        if page:
            pager.emit(page)

    # -- S3 Inventory ---------------------------------------------------------------------------------------

    def _read_inventory(self, fs: Any, path: str, pager: Pager) -> None:
        body = pager.request(lambda: fs.cat_file(path), is_list=False)
        try:
            manifest = json.loads(body)
            file_format = str(manifest["fileFormat"])
            files = [str(entry["key"]) for entry in manifest["files"]]
            destination = str(manifest["destinationBucket"]).rsplit(":", 1)[-1]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"remote.manifest: not an S3 Inventory manifest.json ({type(exc).__name__}: {exc})"
            ) from None
        schema = [name.strip() for name in str(manifest.get("fileSchema", "")).split(",")]
        if file_format.upper() == "CSV":
            if "Bucket" not in schema or "Key" not in schema:
                raise ConfigError(f"remote.manifest: the inventory's fileSchema has no Bucket and Key: {schema}")
            for key in files:
                with pager.open(fs, f"{destination}/{key}") as raw:
                    self._read_csv(_decompressed(raw, key), schema, pager)
        elif file_format.upper() == "PARQUET":
            for key in files:
                self._read_parquet(fs, f"{destination}/{key}", pager)
        else:
            raise ConfigError(f"remote.manifest: inventory format {file_format!r} is not supported (CSV, Parquet)")

    def _read_csv(self, stream: IO[bytes], schema: list[str], pager: Pager) -> None:
        column = {name: i for i, name in enumerate(schema)}
        page: list[tuple[str, dict[str, Any]]] = []
        for row in csv.reader(io.TextIOWrapper(stream, encoding="utf-8", newline="")):
            if len(row) != len(schema):
                continue
            entry = _inventory_entry({name: row[i] for name, i in column.items()}, is_csv=True)
            if entry is not None:
                page.append(entry)
            if len(page) >= PAGE_OBJECTS:
                pager.emit(page)
                page = []
        if page:
            pager.emit(page)

    def _read_parquet(self, fs: Any, path: str, pager: Pager) -> None:
        try:
            import pyarrow.parquet as pq  # type: ignore[import-untyped]
        except ImportError:
            raise ConfigError(
                "remote.manifest: this S3 Inventory is in Parquet: install pyarrow (pip install 'cachefeed[parquet]')"
            ) from None
        with pager.open(fs, path) as raw:
            parquet = pq.ParquetFile(raw)
            for batch in parquet.iter_batches(batch_size=PAGE_OBJECTS):
                rows = batch.to_pylist()
                pager.emit([e for e in (_inventory_entry(row, is_csv=False) for row in rows) if e is not None])


# The column names of a CSV report (its fileSchema) and of a Parquet report (snake case), by meaning.
_COLUMNS = {
    "bucket": ("Bucket", "bucket"),
    "key": ("Key", "key"),
    "size": ("Size", "size"),
    "etag": ("ETag", "e_tag"),
    "is_latest": ("IsLatest", "is_latest"),
    "is_delete_marker": ("IsDeleteMarker", "is_delete_marker"),
}


def _column(row: dict[str, Any], meaning: str) -> Any:
    for name in _COLUMNS[meaning]:
        if name in row:
            return row[name]
    return None


def _inventory_entry(row: dict[str, Any], *, is_csv: bool) -> tuple[str, dict[str, Any]] | None:
    if str(_column(row, "is_delete_marker")).lower() == "true" or str(_column(row, "is_latest")).lower() == "false":
        return None
    key = str(_column(row, "key"))
    if is_csv:
        key = unquote_plus(key)  # CSV reports URL-encode keys
    size = _column(row, "size")
    info: dict[str, Any] = {"size": int(size) if size not in (None, "") else -1}
    etag = _column(row, "etag")
    if etag:
        info["ETag"] = _quoted(str(etag))
    return f"{_column(row, 'bucket')}/{key}", info


def _decompressed(raw: IO[bytes], name: str) -> IO[bytes]:
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)  # type: ignore[return-value]  # a binary file object
    if name.endswith(".zst"):
        try:
            import zstandard  # type: ignore[import-not-found]
        except ImportError:
            raise ConfigError(f"remote.manifest: {name} is zstd-compressed: install zstandard, or use gzip") from None
        reader: IO[bytes] = zstandard.ZstdDecompressor().stream_reader(raw)
        return reader
    return raw
