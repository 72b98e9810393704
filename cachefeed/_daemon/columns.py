"""The compact catalog: a node's owned objects held as columns, and listing pages folded into that form.

A listing of 10⁸ keys cannot be held as one Python object per key (about 1,000 bytes each). ``ObjectTable`` holds
the objects *this node owns* as numpy columns; objects other nodes own are only counted (0 bytes each).

Invariants of ``ObjectTable`` (oid = the row number, ``0 <= oid < len(table)``):

* **Append-only rows.** A path gets one oid for the life of the table; a new version of it overwrites its size and
  version in place (the plan decides what that means). Nothing is ever deleted: a vanished object keeps its row
  (the plan stops drawing it), so oids held elsewhere (in flight, in segments) never dangle.
* **Keys.** The UTF-8 bytes of every path, back to back, in ``_blob``; row ``i`` is ``_blob[_ends[i-1]:_ends[i]]``.
* **Hash.** ``key_hash(path)`` (xxh3_64 of the UTF-8 path) decides everything derived from a path: the owner node
  (``hash % count``), the seeded pass order (``order_keys``: a bijective mix of hash and pass seed), and the index.
  It is computed once per listed key, in the listing thread (``fold_page``), never again.
* **Index.** path -> oid through sorted (hash, oid) runs, merged like a binary counter (a run is merged with the
  one before it while that one is at most twice as long): O(log n) runs, each probed with one vectorised
  ``searchsorted`` per page. A hit is confirmed by comparing the key bytes; two paths with the same 64-bit hash
  (about one pair in 10⁸ keys has a 3·10⁻⁴ chance) keep the second in a small dict.
* **Versions.** 16 bytes and a kind per row: a quoted or bare 32-hex ETag (S3's MD5 ETags) as its 16 raw bytes,
  a local ``"<mtime_ns>-<size>"`` as the int64 mtime, None as kind 0; anything else (multipart ETags, GCS
  generations) in an overflow dict. ``version(oid)`` gives back exactly the string the listing had.
* **Memory.** Per owned row: 8 (key end) + 8 (size) + 17 (version) + 12 (index) bytes plus the key's bytes;
  ``SamplingPlan`` adds 4 (generation seen) + 8 (segment) + 4 (pass queue). ``trim()`` (after a complete listing)
  gives back the columns' spare capacity, so a settled catalog costs about 61 bytes per owned object beyond its
  key (``tests/daemon/test_columns.py`` asserts ≤ 64).
"""

from __future__ import annotations

import posixpath
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from cachefeed._remote import RemoteObject

__all__ = [
    "KIND_OTHER",
    "Column",
    "FoldedPage",
    "ObjectTable",
    "encode_version",
    "fold_page",
    "key_hash",
    "mix",
    "order_keys",
]

U64 = npt.NDArray[np.uint64]
_MASK = (1 << 64) - 1
_HEX_ETAG = re.compile(r'"?([0-9a-fA-F]{32})"?')
_LOCAL_VERSION = re.compile(r"(-?\d{1,19})-(\d+)")
_NONE, _HEX_QUOTED, _HEX_BARE, _LOCAL, KIND_OTHER = 0, 1, 2, 3, 4


def key_hash(path: str) -> int:
    """The one hash of a path (see the module docstring)."""
    return xxhash.xxh3_64_intdigest(path.encode())


def mix(value: int, seed: int) -> int:
    """A bijective 64-bit mix of ``value`` under ``seed`` (splitmix64's finaliser); ``order_keys`` vectorised."""
    z = (value ^ seed) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def order_keys(hashes: U64, seed: int) -> U64:
    """``mix(h, seed)`` for every hash: the sort keys of a seeded pass order."""
    z = hashes ^ np.uint64(seed & _MASK)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: U64 = z ^ (z >> np.uint64(31))
    return out


class Column:
    """A growable numpy array (amortised O(1) appends; ``trim`` drops the spare capacity)."""

    def __init__(self, dtype: Any, width: int = 0, fill: int = 0) -> None:
        self._shape_tail = (width,) if width else ()
        self._fill = fill
        self.data: npt.NDArray[Any] = np.full((0, *self._shape_tail), fill, dtype=dtype)
        self.n = 0

    def extend(self, values: npt.ArrayLike) -> None:
        values = np.asarray(values, dtype=self.data.dtype)
        end = self.n + len(values)
        if end > len(self.data):
            grown = np.full((max(end, len(self.data) * 3 // 2, 1024), *self._shape_tail), self._fill, self.data.dtype)
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        self.data[self.n : end] = values
        self.n = end

    def grow_to(self, n: int) -> None:
        if n > self.n:
            self.extend(np.full((n - self.n, *self._shape_tail), self._fill, self.data.dtype))

    @property
    def view(self) -> npt.NDArray[Any]:
        return self.data[: self.n]

    def trim(self) -> None:
        if len(self.data) > self.n:
            self.data = self.data[: self.n].copy()

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def encode_version(version: str | None) -> tuple[int, bytes]:
    """(kind, 16 bytes) for a version string; kind ``KIND_OTHER`` keeps the string elsewhere."""
    if version is None:
        return _NONE, bytes(16)
    if len(version) == 34 and version[0] == version[-1] == '"':  # the common case, without a regex
        try:
            raw = bytes.fromhex(version[1:33])
        except ValueError:
            raw = b""
        if len(raw) == 16 and raw.hex() == version[1:33]:
            return _HEX_QUOTED, raw
    match = _HEX_ETAG.fullmatch(version)
    if match is not None and match.group(1) == match.group(1).lower():
        if len(version) == 34 and version[0] == version[-1] == '"':
            return _HEX_QUOTED, bytes.fromhex(match.group(1))
        if len(version) == 32:
            return _HEX_BARE, bytes.fromhex(match.group(1))
    local = _LOCAL_VERSION.fullmatch(version)
    if local is not None:
        mtime, size = int(local.group(1)), int(local.group(2))
        if f"{mtime}-{size}" == version and -(2**63) <= mtime < 2**63 and size < 2**63:
            return _LOCAL, struct.pack("<qq", mtime, size)
    return KIND_OTHER, bytes(16)


def _decode_version(kind: int, raw: bytes) -> str | None:
    if kind == _NONE:
        return None
    if kind == _HEX_QUOTED:
        return f'"{raw.hex()}"'
    if kind == _HEX_BARE:
        return raw.hex()
    mtime, size = struct.unpack("<qq", raw)
    return f"{mtime}-{size}"


@dataclass(slots=True)
class FoldedPage:
    """One listing page, reduced to what a node keeps: its owned objects, as arrays, and counts of the rest."""

    paths: list[str]  # owned objects only
    hashes: U64
    sizes: npt.NDArray[np.int64]
    versions: list[str | None]  # meaningful where vkinds is KIND_OTHER (a catalog file gives None elsewhere)
    vkinds: npt.NDArray[np.uint8]
    vraw: npt.NDArray[np.uint8]  # (n, 16)
    listed: int  # every object of the page that matched the pattern, owned or not
    classes: set[str] = field(default_factory=set)  # class names of every listed object (sampler.label)


def fold_page(objects: Sequence[RemoteObject], rank: int, count: int, *, label: str = "") -> FoldedPage:
    """Keep the objects node ``rank`` of ``count`` owns, each path once; hash each key and encode each version
    once. Runs in the listing thread, so the supervisor's loop only does vectorised work per page."""
    paths: list[str] = []
    hashes: list[int] = []
    sizes: list[int] = []
    versions: list[str | None] = []
    classes: set[str] = set()
    for obj in objects:
        h = xxhash.xxh3_64_intdigest(obj.path.encode())
        if label:
            classes.add(posixpath.basename(posixpath.dirname(obj.path.rstrip("/"))))
        if h % count != rank:
            continue
        paths.append(obj.path)
        hashes.append(h)
        sizes.append(obj.size)
        versions.append(obj.etag)
    if len(set(paths)) != len(paths):  # a manifest may name a key twice: the last entry wins
        last = {path: i for i, path in enumerate(paths)}
        keep = sorted(last.values())
        paths, hashes = [paths[i] for i in keep], [hashes[i] for i in keep]
        sizes, versions = [sizes[i] for i in keep], [versions[i] for i in keep]
    vkinds = np.empty(len(paths), np.uint8)
    vraw = np.zeros((len(paths), 16), np.uint8)
    for i, version in enumerate(versions):
        kind, raw = encode_version(version)
        vkinds[i] = kind
        if kind != KIND_OTHER:
            vraw[i] = np.frombuffer(raw, np.uint8)
    return FoldedPage(
        paths,
        np.array(hashes, dtype=np.uint64),
        np.array(sizes, dtype=np.int64),
        versions,
        vkinds,
        vraw,
        len(objects),
        classes,
    )


class ObjectTable:
    """The owned objects of one source, as columns. See the module docstring for the invariants."""

    def __init__(self) -> None:
        self._blob = bytearray()
        self._ends = Column(np.int64)
        self._sizes = Column(np.int64)
        self._vkind = Column(np.uint8)
        self._vraw = Column(np.uint8, width=16)
        self._other: dict[int, str] = {}  # oid -> a version that fits no fixed-width kind
        self._runs: list[tuple[U64, npt.NDArray[np.uint32]]] = []  # sorted (hash, oid) runs
        self._collided: dict[str, int] = {}  # path -> oid, for a path whose hash another path has

    def __len__(self) -> int:
        return self._ends.n

    # -- reading -----------------------------------------------------------------------------------------------

    def path(self, oid: int) -> str:
        ends = self._ends.data
        start = int(ends[oid - 1]) if oid else 0
        return self._blob[start : int(ends[oid])].decode()

    def size(self, oid: int) -> int:
        return int(self._sizes.data[oid])

    def version(self, oid: int) -> str | None:
        kind = int(self._vkind.data[oid])
        if kind == KIND_OTHER:
            return self._other[oid]
        return _decode_version(kind, self._vraw.data[oid].tobytes())

    def get(self, oid: int) -> RemoteObject:
        return RemoteObject(self.path(oid), self.size(oid), self.version(oid))

    def changed(
        self, oids: npt.NDArray[np.int64], page: FoldedPage, rows: npt.NDArray[np.intp]
    ) -> npt.NDArray[np.bool_]:
        """For each ``oids[i]``: whether ``page`` row ``rows[i]`` lists another size or version of it."""
        differs = (self._sizes.data[oids] != page.sizes[rows]) | (self._vkind.data[oids] != page.vkinds[rows])
        differs |= (self._vraw.data[oids] != page.vraw[rows]).any(axis=1)
        for i in np.flatnonzero(~differs & (page.vkinds[rows] == KIND_OTHER)):
            differs[i] = self._other.get(int(oids[i])) != page.versions[rows[i]]
        out: npt.NDArray[np.bool_] = differs
        return out

    def set_version_from(self, oid: int, page: FoldedPage, row: int) -> None:
        """Row ``oid`` takes the size and version of ``page`` row ``row``."""
        self._sizes.data[oid] = page.sizes[row]
        kind = int(page.vkinds[row])
        self._vkind.data[oid] = kind
        self._vraw.data[oid] = page.vraw[row]
        self._other.pop(oid, None)
        if kind == KIND_OTHER:
            self._other[oid] = str(page.versions[row])

    def hashes_and_oids(self) -> tuple[U64, npt.NDArray[np.uint32]]:
        """Every row's hash and oid (the indexed rows in hash order, then any whose hash collided)."""
        self._merge(everything=True)
        hashes, oids = self._runs[0] if self._runs else (np.zeros(0, np.uint64), np.zeros(0, np.uint32))
        if self._collided:
            extra = sorted(self._collided.values())
            hashes = np.concatenate([hashes, np.array([key_hash(self.path(o)) for o in extra], np.uint64)])
            oids = np.concatenate([oids, np.array(extra, np.uint32)])
        return hashes, oids

    @property
    def nbytes(self) -> int:
        """The memory the columns and the index hold (allocated capacity, keys included)."""
        runs = sum(int(h.nbytes + o.nbytes) for h, o in self._runs)
        columns = self._ends.nbytes + self._sizes.nbytes + self._vkind.nbytes + self._vraw.nbytes
        return len(self._blob) + columns + runs

    @property
    def key_bytes(self) -> int:
        return len(self._blob)

    # -- finding and adding --------------------------------------------------------------------------------------

    def lookup(self, paths: Sequence[str], hashes: U64) -> npt.NDArray[np.int64]:
        """The oid of each path, or -1 where it has none."""
        found = np.full(len(paths), -1, dtype=np.int64)
        for run_hashes, run_oids in self._runs:
            if not len(run_hashes):
                continue
            at = np.searchsorted(run_hashes, hashes)
            at_clipped = np.minimum(at, len(run_hashes) - 1)
            hit = (run_hashes[at_clipped] == hashes) & (found < 0)
            found[hit] = run_oids[at_clipped[hit]]
        for i in np.flatnonzero(found >= 0).tolist():
            if self.path(int(found[i])) != paths[i]:  # a hash collision: not this path
                found[i] = self._collided.get(paths[i], -1)
        if self._collided:
            for i in np.flatnonzero(found < 0).tolist():
                found[i] = self._collided.get(paths[i], -1)
        return found

    def add(self, page: FoldedPage, rows: npt.NDArray[np.intp]) -> range:
        """Append rows ``rows`` of ``page``, paths not in the table (the caller checked with ``lookup``);
        returns their oids."""
        first = len(self)
        if not len(rows):
            return range(first, first)
        paths = [page.paths[i] for i in rows]
        hashes = page.hashes[rows]
        encoded = [p.encode() for p in paths]
        ends = np.cumsum([len(e) for e in encoded], dtype=np.int64) + len(self._blob)
        self._blob += b"".join(encoded)
        self._ends.extend(ends)
        self._sizes.extend(page.sizes[rows])
        self._vkind.extend(page.vkinds[rows])
        self._vraw.extend(page.vraw[rows])
        for i in np.flatnonzero(page.vkinds[rows] == KIND_OTHER):
            self._other[first + int(i)] = str(page.versions[rows[i]])  # kind 0 is None: this one is a string
        oids = np.arange(first, first + len(paths), dtype=np.uint32)
        taken = self._hash_known(hashes)
        _, first_of = np.unique(hashes, return_index=True)
        repeated = np.ones(len(paths), dtype=bool)
        repeated[first_of] = False  # a hash seen earlier in this batch
        collided = taken | repeated
        for row in np.flatnonzero(collided).tolist():  # another path has this hash: found by path instead
            self._collided[paths[row]] = first + row
        fresh = ~collided
        order = np.argsort(hashes[fresh], kind="stable")
        self._runs.append((hashes[fresh][order], oids[fresh][order]))
        self._merge()
        return range(first, first + len(paths))

    def _hash_known(self, hashes: U64) -> npt.NDArray[np.bool_]:
        known = np.zeros(len(hashes), dtype=bool)
        for run_hashes, _ in self._runs:
            if len(run_hashes):
                at = np.minimum(np.searchsorted(run_hashes, hashes), len(run_hashes) - 1)
                known |= run_hashes[at] == hashes
        return known

    # -- saving and loading (``catalog_file.py``) ---------------------------------------------------------------

    def arrays(self) -> tuple[dict[str, npt.NDArray[Any]], dict[int, str]]:
        """The table's columns (trimmed and merged first) and its overflow versions, for ``catalog_file``."""
        self.trim()
        hashes, oids = self._runs[0] if self._runs else (np.zeros(0, np.uint64), np.zeros(0, np.uint32))
        return {
            "blob": np.frombuffer(bytes(self._blob), np.uint8),
            "ends": self._ends.view,
            "sizes": self._sizes.view,
            "vkind": self._vkind.view,
            "vraw": self._vraw.view,
            "hashes": hashes,
            "oids": oids,
        }, dict(self._other)

    @classmethod
    def from_arrays(
        cls, arrays: dict[str, npt.NDArray[Any]], other: dict[int, str], collided: dict[str, int] | None = None
    ) -> ObjectTable:
        """A table from ``arrays()``'s output (trusting it: ``catalog_file`` checks lengths)."""
        table = cls()
        table._blob = bytearray(arrays["blob"].tobytes())
        for column, name in ((table._ends, "ends"), (table._sizes, "sizes"), (table._vkind, "vkind")):
            column.data, column.n = arrays[name], len(arrays[name])
        table._vraw.data, table._vraw.n = arrays["vraw"].reshape(-1, 16), len(arrays["vraw"]) // 16
        table._other = dict(other)
        table._runs = [(arrays["hashes"], arrays["oids"])] if len(arrays["hashes"]) else []
        if len(arrays["hashes"]) != len(table):  # collided rows are indexed by path
            indexed = np.zeros(len(table), dtype=bool)
            indexed[arrays["oids"]] = True
            table._collided = {table.path(oid): oid for oid in np.flatnonzero(~indexed).tolist()}
        return table

    def trim(self) -> None:
        """Give back spare capacity (after a complete listing) and merge the index into one run."""
        for column in (self._ends, self._sizes, self._vkind, self._vraw):
            column.trim()
        self._merge(everything=True)

    def _merge(self, *, everything: bool = False) -> None:
        runs = self._runs
        while len(runs) > 1 and (everything or len(runs[-2][0]) <= 2 * len(runs[-1][0])):
            (h1, o1), (h2, o2) = runs[-2], runs[-1]
            hashes = np.concatenate([h1, h2])
            oids = np.concatenate([o1, o2])
            order = np.argsort(hashes, kind="stable")
            runs[-2:] = [(hashes[order], oids[order])]
