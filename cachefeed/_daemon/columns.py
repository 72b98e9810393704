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
  one before it while that one is at most twice as long, up to ``MAX_RUN`` entries, so a merge never needs more
  than about 34 MB): O(log n + n / MAX_RUN) runs, each probed with one vectorised ``searchsorted`` per page. A
  hit is confirmed by comparing the key bytes; two paths with the same 64-bit hash (about one pair in 10⁸ keys
  has a 3·10⁻⁴ chance) keep the second in a small dict.
* **Versions.** 16 bytes and a kind per row: a quoted or bare 32-hex ETag (S3's MD5 ETags) as its 16 raw bytes,
  a local ``"<mtime_ns>-<size>"`` as the int64 mtime, None as kind 0; anything else (multipart ETags, GCS
  generations) in an overflow dict. ``version(oid)`` gives back exactly the string the listing had.
* **Memory.** Per owned row: 4 (key end) + 4 (size) + 17 (version) + 12 (index) bytes plus the key's bytes;
  ``SamplingPlan`` adds 4 (generation seen) + 4 (segment) + 4 (pass queue). Key ends, sizes and segment numbers
  are 4 bytes while they fit (the key blob and every object under 4 GiB, segment numbers under 2³¹), then their
  column is widened to 8 once (``Column``). ``trim()`` (after a complete listing) gives back the columns' spare
  capacity, so a settled catalog costs about 49 bytes per owned object beyond its key (``tests/daemon/
  test_columns.py`` asserts ≤ 64). Above that, the peak: a column's growth (in place: ``realloc`` moves a large
  array's mapping, never copies it; 1/``GROWTH`` spare rows), one index merge (≤ ``MAX_RUN`` entries), a pass
  layout (the new queue's 4 bytes per row and about 1 more, ``pass_order``), one block of a restart catalog being
  written (from the live columns, ``blocks``), with large freed arrays given back to the system
  (``return_freed_memory``). ``benchmarks.catalog`` measures the peak RSS per object.
"""

from __future__ import annotations

import ctypes
import platform
import posixpath
import re
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from cachefeed._remote import RemoteObject

__all__ = [
    "KIND_OTHER",
    "Block",
    "Column",
    "FoldedPage",
    "ObjectTable",
    "encode_version",
    "fold_page",
    "key_hash",
    "merge_runs",
    "mix",
    "order_keys",
    "pass_order",
    "return_freed_memory",
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
    """``mix(h, seed)`` for every hash: the sort keys of a seeded pass order (one new array and one temporary)."""
    z = hashes ^ np.uint64(seed & _MASK)
    for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z ^= z >> np.uint64(shift)
        z *= np.uint64(factor)
    z ^= z >> np.uint64(31)
    return z


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 256 << 10


def return_freed_memory() -> bool:
    """Make every allocation of ``MMAP_THRESHOLD`` bytes or more a mapping of its own, given back to the system
    when freed (glibc only; False elsewhere). Call once, early, in the process that holds a catalog.

    glibc raises its threshold as large blocks are freed (up to 32 MiB), after which the columns' arrays of a
    growing catalog come from the heap and the copies a column leaves behind when it grows stay resident: at
    10⁶ objects that was about 60 MB above what the columns hold (``benchmarks.catalog``). A fixed threshold
    keeps the resident memory at what the columns hold."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


GROWTH = 32  # a column grows by 1/GROWTH of its rows at a time (``Column._grow``)
MIN_GROWTH = 1 << 14  # rows, at least


class Column:
    """A growable numpy array (amortised O(1) appends; ``trim`` drops the spare capacity).

    ``wide``: an integer column held narrow (``dtype``) until a value does not fit, then widened to ``wide`` once
    (a copy of the rows held): key ends and sizes are 4 bytes per row while the key blob and every object are
    under 4 GiB, segment numbers while under 2³¹."""

    def __init__(self, dtype: Any, width: int = 0, fill: int = 0, wide: Any = None) -> None:
        self._shape_tail = (width,) if width else ()
        self._fill = fill
        self._wide = np.dtype(wide) if wide is not None else None
        self.data: npt.NDArray[Any] = np.full((0, *self._shape_tail), fill, dtype=dtype)
        self.n = 0

    def _fit(self, values: npt.ArrayLike) -> npt.NDArray[Any]:
        """``values`` in this column's dtype, the column widened first if one does not fit."""
        array = np.asarray(values)
        dtype = self.data.dtype
        if self._wide is not None and dtype != self._wide and array.size and array.dtype != dtype:
            limits = np.iinfo(dtype)
            if int(array.min()) < limits.min or int(array.max()) > limits.max:
                wider = np.empty(self.data.shape, self._wide)
                wider[: self.n] = self.data[: self.n]
                self.data = wider
        return array.astype(self.data.dtype, copy=False)

    def extend(self, values: npt.ArrayLike) -> None:
        values = self._fit(values)
        end = self.n + len(values)
        if end > len(self.data):
            self._grow(max(end, len(self.data) + max(len(self.data) // GROWTH, MIN_GROWTH)))
        self.data[self.n : end] = values
        self.n = end

    def _grow(self, rows: int) -> None:
        """Capacity for ``rows`` rows, in place where nothing else refers to the array: ``realloc``, which moves a
        large array's mapping (``return_freed_memory``) instead of copying it, so growing a column never holds
        its old and new arrays at once (a copy did: 16 bytes per row for the versions, the peak at the end of a
        listing). The new rows are zeroed (written: that is why the column grows by 1/``GROWTH`` at a time)."""
        try:
            self.data.resize((rows, *self._shape_tail), refcheck=True)
        except ValueError:  # a view of it is held (the restart catalog's writer): copy
            grown = np.empty((rows, *self._shape_tail), self.data.dtype)
            grown[: self.n] = self.data[: self.n]
            self.data = grown

    def put(self, index: Any, values: npt.ArrayLike) -> None:
        """``data[index] = values``, the column widened first if a value does not fit."""
        self.data[index] = self._fit(values)

    def grow_to(self, n: int) -> None:
        """Rows up to ``n``, the new ones set to the fill value."""
        if n > self.n:
            self.extend(np.full((n - self.n, *self._shape_tail), self._fill, self.data.dtype))

    @property
    def view(self) -> npt.NDArray[Any]:
        return self.data[: self.n]

    def trim(self) -> None:
        """Drop the spare capacity: in place where nothing else refers to the array (no copy: a big array is its
        own mapping, shrunk), else by a copy."""
        if len(self.data) > self.n:
            try:
                self.data.resize((self.n, *self._shape_tail), refcheck=True)
            except ValueError:  # a view of it is held (the restart catalog's writer)
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


@dataclass(frozen=True, slots=True)
class Block:
    """Rows of a table as a catalog file stores them (``catalog_file.py``): keys back to back with their end
    offsets (relative to the block), sizes, versions, hashes, and the versions of kind ``KIND_OTHER`` by row."""

    keys: bytes
    ends: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    vkinds: npt.NDArray[np.uint8]
    vraw: npt.NDArray[np.uint8]
    hashes: U64
    other: dict[int, str]


class ObjectTable:
    """The owned objects of one source, as columns. See the module docstring for the invariants."""

    def __init__(self) -> None:
        self._blob = bytearray()
        self._ends = Column(np.uint32, wide=np.int64)  # 4 bytes a row while the blob is under 4 GiB
        self._sizes = Column(np.uint32, wide=np.int64)  # 4 bytes a row while every object is under 4 GiB
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

    def key_hash(self, oid: int) -> int:
        """``key_hash(self.path(oid))``, from the stored bytes (nothing decoded)."""
        ends = self._ends.data
        start = int(ends[oid - 1]) if oid else 0
        return xxhash.xxh3_64_intdigest(self._blob[start : int(ends[oid])])

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
        self._sizes.put(oid, page.sizes[row])
        kind = int(page.vkinds[row])
        self._vkind.data[oid] = kind
        self._vraw.data[oid] = page.vraw[row]
        self._other.pop(oid, None)
        if kind == KIND_OTHER:
            self._other[oid] = str(page.versions[row])

    def runs(self) -> list[tuple[U64, npt.NDArray[np.uint32]]]:
        """Every row's hash and oid, as sorted runs (the index's, then one of any rows whose hash collided)."""
        runs = list(self._runs)
        if self._collided:
            extra = sorted(self._collided.values())
            runs.append((np.array([key_hash(self.path(o)) for o in extra], np.uint64), np.array(extra, np.uint32)))
        return runs

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

    def blocks(self, listed: npt.NDArray[np.bool_], rows: int) -> Iterator[Block]:
        """The rows where ``listed[oid]``, in hash order, at most ``rows`` per block, read from the live columns:
        nothing is copied but one block at a time, so a thread may write them to disk while the supervisor's loop
        goes on changing the table (its rows only grow; ``listed`` is the caller's copy). A row whose version a
        new listing changes meanwhile may be written with its old size or version: the file then holds an older
        listing of that object (a fetch finds it changed), and the next complete listing writes the file again.
        """
        runs = self.runs()
        for run_hashes, run_oids in runs:
            for start in range(0, len(run_oids), rows):
                oids = run_oids[start : start + rows]
                hashes = run_hashes[start : start + rows]
                keep = oids < len(listed)  # rows added since ``listed`` was taken are not in this listing
                keep[keep] = listed[oids[keep]]
                if not keep.all():
                    oids, hashes = oids[keep], hashes[keep]
                if len(oids):
                    yield self._block(oids.astype(np.intp), hashes)

    def _block(self, oids: npt.NDArray[np.intp], hashes: U64) -> Block:
        ends = self._ends.data[oids]
        begins = np.where(oids > 0, self._ends.data[np.maximum(oids - 1, 0)], 0)
        blob = self._blob
        keys = b"".join([blob[b:e] for b, e in zip(begins.tolist(), ends.tolist(), strict=True)])
        other = self._other
        return Block(
            keys,
            np.cumsum(ends - begins, dtype=np.int64),
            self._sizes.data[oids].astype(np.int64),
            self._vkind.data[oids],
            self._vraw.data[oids],
            hashes,
            {i: other[oid] for i, oid in enumerate(oids.tolist()) if oid in other},
        )

    def trim(self) -> None:
        """Give back spare capacity (after a complete listing)."""
        for column in (self._ends, self._sizes, self._vkind, self._vraw):
            column.trim()

    def _merge(self) -> None:
        runs = self._runs
        while len(runs) > 1 and len(runs[-2][0]) <= 2 * len(runs[-1][0]):
            if len(runs[-2][0]) + len(runs[-1][0]) > MAX_RUN:
                return
            (h1, o1), (h2, o2) = runs.pop(), runs.pop()
            runs.append(merge_runs(h2, o2, h1, o1))
            del h1, o1, h2, o2  # the inputs go before the next merge: one merge's memory at a time


def merge_runs(
    h1: U64, o1: npt.NDArray[np.uint32], h2: U64, o2: npt.NDArray[np.uint32]
) -> tuple[U64, npt.NDArray[np.uint32]]:
    """Two sorted (hash, oid) runs as one sorted run, the first run's entries first among equal hashes. Beyond the
    output (12 bytes per entry) it needs 8 bytes per entry of the second run and 1 per entry (a sort of the
    concatenation would need 20 per entry)."""
    at = np.searchsorted(h1, h2, side="right")
    at += np.arange(len(h2), dtype=at.dtype)  # where each entry of the second run lands
    hashes = np.empty(len(h1) + len(h2), np.uint64)
    oids = np.empty(len(hashes), np.uint32)
    from_first = np.ones(len(hashes), dtype=bool)
    from_first[at] = False
    hashes[at], oids[at] = h2, o2
    del at
    hashes[from_first], oids[from_first] = h1, o1
    return hashes, oids


MAX_RUN = 1 << 21  # index entries past which runs are no longer merged (bounds a merge's memory: about 34 MB)
PASS_CHUNK = 1 << 20  # rows computed at a time when a pass is laid out (bounds the temporaries)


def pass_order(
    runs: Sequence[tuple[U64, npt.NDArray[np.uint32]]],
    seed: int,
    keep: Callable[[npt.NDArray[np.uint32]], npt.NDArray[np.bool_]] | None = None,
) -> list[npt.NDArray[np.uint32]]:
    """The oids of ``runs`` ((hash, oid) arrays; those ``keep`` selects, all by default) in the seeded order of a
    pass: sorted by ``order_keys(hash, seed)``, ties in its top bits broken by oid, as chunks of at most
    ``PASS_CHUNK``.

    Each entry is packed into one uint64 (the order key's top bits above the oid's bits) and sorted in place. The
    entries are laid out in up to 16 buckets of the key's top bits, one after the other (each bucket's keys all
    precede the next one's), so beyond the 4-byte output a pass needs about 1 byte per entry (8 bytes per entry of
    one bucket), where an ``argsort`` needs 8 for the keys, 8 for the permutation and more for the key's
    temporaries. Ties need two keys equal in their top ``64 - b`` bits (``b``: the bits of the largest oid, 27 at
    10⁸ rows): about 360 pairs at 10⁷ rows, each still ordered by a seeded key's bits and then by oid, so the
    order stays deterministic."""
    total = sum(len(oids) for _, oids in runs)
    if not total:
        return []
    shift = np.uint64(max(max(int(oids.max()) for _, oids in runs if len(oids)).bit_length(), 1))
    bucket_bits = min(4, (total // PASS_CHUNK).bit_length())  # 1 bucket under a chunk, 16 from 8 chunks
    out: list[npt.NDArray[np.uint32]] = []
    for bucket in range(1 << bucket_bits):
        parts = []
        for hashes, oids in runs:
            for start in range(0, len(oids), PASS_CHUNK):
                h, o = hashes[start : start + PASS_CHUNK], oids[start : start + PASS_CHUNK]
                if keep is not None:
                    mask = keep(o)
                    h, o = h[mask], o[mask]
                z = order_keys(h, seed)
                if bucket_bits:
                    chosen = (z >> np.uint64(64 - bucket_bits)) == np.uint64(bucket)
                    z, o = z[chosen], o[chosen]
                z >>= shift
                z <<= shift
                z |= o.astype(np.uint64)
                parts.append(z)
        packed = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
        del parts
        packed.sort()
        packed &= (np.uint64(1) << shift) - np.uint64(1)
        out.extend(packed[start : start + PASS_CHUNK].astype(np.uint32) for start in range(0, len(packed), PASS_CHUNK))
        del packed
    return out
