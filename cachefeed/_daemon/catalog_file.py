"""The catalog file: a compact catalog written once and read page by page (restarts, shared catalogs).

One format serves two uses:

* **The restart catalog** (``<cache.dir>/catalog-<tag>.cfcat``): after each complete listing the daemon writes the
  objects its node owns; a restarted daemon folds it into its plan before READY, so it fetches at once and lists
  in the background. Written atomically (``_fsutil.atomic_write``): a crash leaves the old file or the new one.
  It lies in the cache directory, so the store counts it as metadata in the budget (``layout.metadata_bytes``);
  a catalog larger than ``MAX_SHARE`` of ``cache.max_bytes`` (shared equally by the sources' catalogs) is not
  kept (one warning says so).
* **The shared catalog** (``cachefeed catalog build URL``, ``remote.catalog``): every object of a remote, written
  as generations next to the data (or where the user says); nodes read the newest instead of listing.

Layout (little-endian)::

    b"CFCAT\\x00\\x01\\n"  u32 n  header JSON (n bytes)
    per block:  u32 n  block JSON {"rows", "blob", "other", "classes", "xxh3"}  then the block's columns:
                keys blob | ends int64[rows] (relative to the block) | sizes int64[rows] | vkind u8[rows]
                | vraw u8[16 * rows] | hashes u64[rows]
    trailer:    u32 n  {"rows": -1, "objects": total}

The header names the remote (``url_digest``: a digest, not the URL), the pattern, and the node (``rank``, ``count``)
whose objects the file holds (0 of 1: every object). Blocks are read in order, each one a listing page
(``columns.FoldedPage``): a reader keeps the rows its node owns (``hash % count == rank``) without hashing a key
again, and needs memory for one block only. A file without its trailer is truncated, and a block whose bytes differ
from its ``xxh3`` (of the columns, blob included; absent in files of older writers) is damaged: the reader raises
``CatalogFileError`` after the pages it could read (the caller treats the listing as failed, so nothing vanishes).
"""

from __future__ import annotations

import json
import posixpath
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
import xxhash

from cachefeed._daemon.columns import KIND_OTHER, FoldedPage, ObjectTable, encode_version
from cachefeed._errors import CachefeedError
from cachefeed._fsutil import atomic_write
from cachefeed._remote import RemoteObject

__all__ = [
    "BLOCK_ROWS",
    "MAX_SHARE",
    "CatalogFileError",
    "CatalogHeader",
    "CatalogWriter",
    "load_restart",
    "read_pages",
    "restart_header",
    "save_restart",
    "url_digest",
]

MAGIC = b"CFCAT\x00\x01\n"
FORMAT_VERSION = 1
BLOCK_ROWS = 65_536
MAX_SHARE = 0.05  # a restart catalog above this share of cache.max_bytes is not kept
_U32 = struct.Struct("<I")


class CatalogFileError(CachefeedError):
    """A catalog file that cannot be read (truncated, another format, another version)."""


@dataclass(frozen=True, slots=True)
class CatalogHeader:
    url: str
    pattern: str
    rank: int = 0
    count: int = 1
    generation: str = ""


def _parent(path: str) -> str:
    return posixpath.basename(posixpath.dirname(path.rstrip("/")))


class CatalogWriter:
    """Writes a catalog file to a binary stream: the header, then one block per ``write_*`` call."""

    def __init__(self, out: IO[bytes], header: CatalogHeader) -> None:
        self._out = out
        self.objects = 0
        self._json(_header_doc(header), magic=True)
        self._digest = xxhash.xxh3_128()  # of every block (not the header): equal for equal listings

    @property
    def digest(self) -> str:
        """A digest of the blocks written so far: two listings of the same objects, paged alike, have the same."""
        return self._digest.hexdigest()

    def _json(self, doc: dict[str, Any], *, magic: bool = False) -> None:
        data = json.dumps(doc, separators=(",", ":")).encode()
        self._out.write((MAGIC if magic else b"") + _U32.pack(len(data)) + data)

    def write_objects(self, objects: Iterable[RemoteObject]) -> None:
        """One block of objects (a listing page), hashed and encoded here."""
        objects = list(objects)
        if not objects:
            return
        keys = [obj.path.encode() for obj in objects]
        kinds = np.empty(len(objects), np.uint8)
        raws = np.zeros((len(objects), 16), np.uint8)
        other: dict[str, str] = {}
        for i, obj in enumerate(objects):
            kind, raw = encode_version(obj.etag)
            kinds[i] = kind
            if kind == KIND_OTHER:
                other[str(i)] = str(obj.etag)
            else:
                raws[i] = np.frombuffer(raw, np.uint8)
        self._block(
            b"".join(keys),
            ends=np.cumsum([len(k) for k in keys], dtype=np.int64),
            sizes=np.array([obj.size for obj in objects], np.int64),
            kinds=kinds,
            raws=raws,
            hashes=np.array([xxhash.xxh3_64_intdigest(k) for k in keys], np.uint64),
            other=other,
            classes=sorted({_parent(obj.path) for obj in objects}),
        )

    def write_table(self, table: ObjectTable, listed: npt.NDArray[np.bool_]) -> None:
        """The table's rows where ``listed[oid]`` (what a node owns and its last listing showed), in blocks of
        ``BLOCK_ROWS``, straight from the live table (``ObjectTable.blocks``: one block in memory at a time)."""
        for block in table.blocks(listed, BLOCK_ROWS):
            self._block(
                block.keys,
                ends=block.ends,
                sizes=block.sizes,
                kinds=block.vkinds,
                raws=block.vraw,
                hashes=block.hashes,
                other={str(i): version for i, version in block.other.items()},
                classes=[],  # the daemon keeps its class index in classes.json
            )

    def _block(
        self,
        blob: bytes,
        *,
        ends: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        kinds: npt.NDArray[np.uint8],
        raws: npt.NDArray[np.uint8],
        hashes: npt.NDArray[np.uint64],
        other: dict[str, str],
        classes: list[str],
    ) -> None:
        rows = len(ends)
        parts = [
            part if isinstance(part, bytes) else part.tobytes() for part in (blob, ends, sizes, kinds, raws, hashes)
        ]
        digest = xxhash.xxh3_64_hexdigest(b"".join(parts))
        self._digest.update(json.dumps([rows, other, classes, digest]).encode())
        self._json({"rows": rows, "blob": len(blob), "other": other, "classes": classes, "xxh3": digest})
        for part in parts:
            self._out.write(part)
        self.objects += rows

    def close(self) -> None:
        """Write the trailer (a file without it reads as truncated)."""
        self._json({"rows": -1, "objects": self.objects})


def _header_doc(header: CatalogHeader) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "url": header.url,
        "pattern": header.pattern,
        "rank": header.rank,
        "count": header.count,
        "generation": header.generation,
    }


def _read_exact(read: Callable[[int], bytes], n: int, what: str) -> bytes:
    data = read(n)
    if len(data) != n:
        raise CatalogFileError(f"the catalog file is truncated (in {what})")
    return data


def _read_json(read: Callable[[int], bytes], what: str) -> dict[str, Any]:
    (n,) = _U32.unpack(_read_exact(read, 4, what))
    doc = json.loads(_read_exact(read, n, what))
    if not isinstance(doc, dict):
        raise CatalogFileError(f"the catalog file is damaged (in {what})")
    return doc


def read_header(read: Callable[[int], bytes]) -> CatalogHeader:
    magic = read(len(MAGIC))
    if magic != MAGIC:
        raise CatalogFileError("not a cachefeed catalog file (or another format version)")
    doc = _read_json(read, "the header")
    if doc.get("format") != FORMAT_VERSION:
        raise CatalogFileError(f"catalog format {doc.get('format')!r}, expected {FORMAT_VERSION}")
    return CatalogHeader(
        str(doc["url"]), str(doc["pattern"]), int(doc["rank"]), int(doc["count"]), str(doc.get("generation", ""))
    )


def read_pages(
    read: Callable[[int], bytes], rank: int, count: int, *, label: str = ""
) -> Iterator[FoldedPage | CatalogHeader]:
    """The header, then one ``FoldedPage`` per block, keeping what node ``rank`` of ``count`` owns.

    The file must hold every object that node owns: one written for all nodes (count 1), or for this very node.
    Raises ``CatalogFileError`` on a damaged or truncated file (after the pages read so far)."""
    try:
        yield from _pages(read, rank, count, label)
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:  # JSON, fields or columns
        raise CatalogFileError(f"the catalog file is damaged ({type(exc).__name__}: {exc})") from None


def _pages(read: Callable[[int], bytes], rank: int, count: int, label: str) -> Iterator[FoldedPage | CatalogHeader]:
    header = read_header(read)
    if header.count != 1 and (header.rank, header.count) != (rank, count):
        raise CatalogFileError(f"the catalog file holds node {header.rank} of {header.count}'s objects only")
    yield header
    while True:
        doc = _read_json(read, "a block")
        rows = int(doc["rows"])
        if rows < 0:
            return
        data = _read_exact(read, int(doc["blob"]) + 41 * rows, "a block")
        if "xxh3" in doc and xxhash.xxh3_64_hexdigest(data) != doc["xxh3"]:
            raise CatalogFileError("the catalog file is damaged (a block's checksum differs)")
        at = int(doc["blob"])
        blob = data[:at]
        ends, at = np.frombuffer(data, np.int64, rows, at), at + 8 * rows
        sizes, at = np.frombuffer(data, np.int64, rows, at), at + 8 * rows
        kinds, at = np.frombuffer(data, np.uint8, rows, at), at + rows
        raws, at = np.frombuffer(data, np.uint8, 16 * rows, at).reshape(rows, 16), at + 16 * rows
        hashes = np.frombuffer(data, np.uint64, rows, at)
        keep = np.flatnonzero(hashes % np.uint64(count) == np.uint64(rank)) if count > 1 else np.arange(rows)
        begins = np.concatenate([[0], ends[:-1]]) if rows else ends
        other = {int(i): str(v) for i, v in dict(doc.get("other") or {}).items()}
        paths = [blob[begins[i] : ends[i]].decode() for i in keep.tolist()]
        versions: list[str | None] = [other.get(i) for i in keep.tolist()]
        yield FoldedPage(
            paths,
            hashes[keep].copy(),
            sizes[keep].copy(),
            versions,
            kinds[keep].copy(),
            raws[keep].copy(),
            rows,
            set(doc.get("classes") or ()) if label else set(),
        )


def url_digest(url: str) -> str:
    """What a catalog file's header keeps of the remote it lists: a digest, never the URL (it may hold
    credentials, and a shared catalog is readable by every node)."""
    return xxhash.xxh3_128_hexdigest(url.encode())


def restart_header(url: str, pattern: str, rank: int, count: int) -> CatalogHeader:
    """What a restart catalog must match to be used: the remote (``url_digest``), the pattern and the node."""
    return CatalogHeader(url_digest(url), pattern, rank, count)


def save_restart(
    path: Path,
    table: ObjectTable,
    listed: npt.NDArray[np.bool_],
    header: CatalogHeader,
    *,
    mode: int,
    max_bytes: int,
) -> bool:
    """Keep the rows of ``table`` where ``listed[oid]`` as the restart catalog at ``path``, atomically; False (and
    no file) when it would exceed ``max_bytes``. Safe in a thread of its own while the supervisor's loop changes
    the table (``CatalogWriter.write_table``)."""
    estimate = table.key_bytes + 41 * len(listed) + 1024
    if estimate > max_bytes:
        path.unlink(missing_ok=True)
        return False

    def write(out: IO[bytes]) -> None:
        writer = CatalogWriter(out, header)
        writer.write_table(table, listed)
        writer.close()

    atomic_write(path, write, mode=mode)
    return True


def load_restart(path: Path, header: CatalogHeader) -> Iterator[FoldedPage]:
    """The pages of the restart catalog at ``path`` if it was written for ``header`` (else nothing).
    Raises ``CatalogFileError`` if it is damaged."""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return
    with handle:
        pages = read_pages(handle.read, header.rank, header.count)
        found = next(pages)
        if found != header:
            return
        for page in pages:
            assert isinstance(page, FoldedPage)
            yield page
