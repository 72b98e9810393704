"""The on-disk format: records inside segment files. Write, verify, and read zero-copy from a memory map.

A **segment** is one file holding many records, written once into ``tmp/`` and published by an atomic rename.
A **record** is one sample: a dict of fields (numpy arrays, torch tensors, bytes, str and small scalars).

Layout (all integers little-endian)::

    segment  := SegmentHeader(64) (pad Record)* Index Sources Trailer(64)
    Record   := RecordHeader(16) meta(msgpack) pad payload*
    Index    := offsets u64[n] lengths u64[n] key_hashes u64[n] pad
    Sources  := msgpack [[path, version], ...] pad    (empty when the writer named no sources)
    Trailer  := magic "CFSEGEND", version, flags, source tag, count, index offset, xxh3 of Index+Sources,
                file length, trailer xxh3

``RecordHeader``: magic ``CR``, format version, flags (bit 0: zlib-compressed payload area), meta length, xxh3-64
of the body (everything after the header, up to the record's length in the index). The meta is msgpack
``[key, fields, inline values, uncompressed payload length]``; each field is ``[name, kind, offset, nbytes,
...]`` with its offset in the payload area. A record verifies itself: its checksum, and (against the index, which
holds its length and its key's hash) which key it holds. A segment verifies itself through its trailer (magic,
index checksum, file length), which is written last: a file without a valid trailer is partial.

**Alignment** (format 3): a payload of ``LARGE_PAYLOAD`` (4 KiB) or more starts on a 64-byte boundary (cache
lines, AVX-512 loads, and the DMA engines that copy pinned batches like it); smaller ones on 16 bytes (any numpy
or torch dtype's own alignment). A record starts on the largest boundary its payloads need (the writer pads before
it), and its payload area on that same boundary, so an array read from the page-aligned memory map has its
alignment in memory too. What a record costs beyond its payload: 16 bytes of header, the meta (the key, about 10
bytes per array field, the inline values), padding to 16 (64 before a large payload) and 24 bytes of index. A 1 KiB
float32 vector with an int label and an int id under a 30-character key: 1,128 bytes in the segment (10% over the
payload; format 2 took 1,240, with 64-byte headers and alignment for everything; ``tests/cache/test_records.py``
pins it).

The trailer's **source tag** (u32) says which configured source (``[[source]]``, see ``cache/sources.py``) every
record of the segment came from; 0 when the daemon reads one unnamed remote. A segment never mixes sources.
(The field was padding before, always 0: segments written before it read as untagged.)

**Sources** name the remote objects whose last sample the segment holds (path and version). They let a restarted
daemon know what its recovered cache already holds. Best effort by design: a source that does not fit the
segment's capacity is left out (that object is fetched again after a restart), never a reason to fail a segment.

Only an array's own bytes are stored: a slice of a large array stores the slice (made contiguous), never its base.

Reading is zero-copy for uncompressed arrays: ``SegmentReader.read(i)`` returns numpy arrays that are views of
a private (copy-on-write) memory map: the pages are the page cache's until someone writes to an array, and a write
changes only that process's copy, never the file. A compressed record is decompressed into one fresh buffer.

Part of the cache layer (``cachefeed/cache/``): the store, the writer and the snapshots use it, and the trainer and
the daemon read segments through it. It imports nothing of the config, the daemon or the trainer; torch only inside
the two functions that encode and decode a tensor field, when a sample holds one. One module over 400 lines because
it is one concept: the writer and the reader of one format, whose offsets, padding and checksums must agree.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import xxhash

from cachefeed.errors import CorruptRecordError

__all__ = [
    "COMPRESSIONS",
    "FORMAT_VERSION",
    "RecordEncoder",
    "SegmentReader",
    "SegmentWriter",
    "key_hash",
    "segment_count",
    "segment_trailer",
]

FORMAT_VERSION = 3  # 2: the Sources section; 3: 16-byte record headers, 64-byte alignment for large payloads only
ALIGN = 64  # sections of the segment, and payloads of LARGE_PAYLOAD bytes or more
SMALL_ALIGN = 16  # smaller payloads: every numpy/torch dtype's own alignment
LARGE_PAYLOAD = 4096
_SEGMENT_MAGIC = b"CFSEG\x00\x00\x01"
_TRAILER_MAGIC = b"CFSEGEND"
_RECORD_MAGIC = b"CR"
_SEGMENT_HEADER = struct.Struct("<8sHH4xQ40x")  # magic, version, flags, created_ns
# magic, version, flags, source tag, count, index_off, index_hash, file_len, own_hash
_TRAILER = struct.Struct("<8sHHIQQQQQ")
_RECORD_HEADER = struct.Struct("<2sBBIQ")  # magic, version, flags, meta_len, body_hash (length, key: in the index)
_FLAG_ZLIB = 1
_FLAG_ALIGN64 = 2  # the payload area starts 64-aligned (a payload of LARGE_PAYLOAD or more); else 16
COMPRESSIONS = ("none", "zlib")  # per-record payload compression; the registry config validates against
_INLINE_LIMIT = 256  # str/bytes up to this size live in the metadata; larger ones get a payload
TRAILER_BYTES = 64
HEADER_BYTES = 64

if _SEGMENT_HEADER.size != HEADER_BYTES or _TRAILER.size > TRAILER_BYTES or _RECORD_HEADER.size != SMALL_ALIGN:
    raise RuntimeError("record format constants are inconsistent")  # pragma: no cover


def _pad(n: int, align: int = ALIGN) -> int:
    return -n % align


def _payload_align(nbytes: int) -> int:
    return ALIGN if nbytes >= LARGE_PAYLOAD else SMALL_ALIGN


def key_hash(key: str) -> int:
    """The 64-bit hash of a sample key stored in the record header and the segment index."""
    return int(xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass")))


@dataclass(frozen=True, slots=True)
class EncodedRecord:
    """A record ready to be written at an offset that is a multiple of ``align``: header, meta, padding, then the
    payload buffers (already placed)."""

    key_hash: int
    parts: list[memoryview | bytes]
    nbytes: int
    align: int = SMALL_ALIGN


class RecordEncoder:
    """Turns a sample dict into an ``EncodedRecord``. Stateless apart from the compression choice."""

    def __init__(self, *, compression: str = "none") -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, not {compression!r}")
        self._compress = compression == "zlib"

    def encode(self, sample: Mapping[str, Any]) -> EncodedRecord:
        key = sample.get("__key__")
        if not isinstance(key, str):
            raise TypeError("a sample needs a string '__key__' field")
        fields: list[list[Any]] = []
        inline: dict[str, Any] = {}
        payloads: list[memoryview | bytes] = []
        offset = 0  # offset of the next payload within the payload area
        align = SMALL_ALIGN  # the record's: the largest its payloads need
        for name, value in sample.items():
            if name == "__key__":
                continue
            if not isinstance(name, str):
                raise TypeError(f"sample field names must be strings, got {name!r}")
            kind, view, extra = _to_payload(value)
            if kind == "inline":
                inline[name] = extra
                continue
            field_align = _payload_align(view.nbytes)
            pad = _pad(offset, field_align)
            if pad:
                payloads.append(bytes(pad))
                offset += pad
            align = max(align, field_align)
            fields.append([name, kind, offset, view.nbytes, *extra])
            payloads.append(view)
            offset += view.nbytes
        flags = 0
        raw_len = 0
        if self._compress and payloads:
            raw_len = offset
            payloads = [zlib.compress(b"".join(payloads), 1)]  # decompressed into a fresh (aligned) buffer
            flags |= _FLAG_ZLIB
            align = SMALL_ALIGN
        if align == ALIGN:
            flags |= _FLAG_ALIGN64
        meta = msgpack.packb([key, fields, inline, raw_len], use_bin_type=True)
        body: list[memoryview | bytes] = [meta, bytes(_pad(_RECORD_HEADER.size + len(meta), align)), *payloads]
        hasher = xxhash.xxh3_64()
        for part in body:
            hasher.update(part)
        header = _RECORD_HEADER.pack(_RECORD_MAGIC, FORMAT_VERSION, flags, len(meta), hasher.intdigest())
        total = _RECORD_HEADER.size + sum(memoryview(p).nbytes for p in body)
        return EncodedRecord(key_hash(key), [header, *body], total, align)


def _to_payload(value: Any) -> tuple[str, memoryview, Any]:
    """Classify one field. Arrays and large blobs become payloads; small scalars stay inline in the meta."""
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError("object arrays cannot be cached; convert them to a numeric dtype")
        array = np.ascontiguousarray(value).reshape(value.shape)  # ascontiguousarray makes a 0-d array 1-d
        view = memoryview(array.reshape(-1).view(np.uint8).data) if array.size else memoryview(b"")
        return "nd", view, [array.dtype.str, list(array.shape)]
    if _is_tensor(value):
        import torch

        tensor = value.detach().cpu().contiguous()
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
        return "pt", view, [str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        if len(data) <= _INLINE_LIMIT:
            return "inline", memoryview(b""), data
        return "by", memoryview(data), []
    if isinstance(value, str):
        if len(value) <= _INLINE_LIMIT:
            return "inline", memoryview(b""), value
        return "st", memoryview(value.encode("utf-8", "surrogatepass")), []
    if value is None or isinstance(value, bool | int | float | list | tuple | dict):
        try:
            msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"field value {type(value).__name__} cannot be cached: {exc}") from None
        return "inline", memoryview(b""), value
    if isinstance(value, np.generic):
        return "inline", memoryview(b""), value.item()
    raise TypeError(
        f"cannot cache a field of type {type(value).__name__}: use numpy arrays, tensors, bytes, str or scalars"
    )


def _is_tensor(value: Any) -> bool:
    module = type(value).__module__
    return module.startswith("torch") and hasattr(value, "detach") and hasattr(value, "numel")


class SegmentWriter:
    """Appends records to one new segment file. Not thread-safe; one writer per file.

    Contract: the file is created exclusively (``O_EXCL``) with ``file_mode``; ``append`` returns False when the
    record would push the finished file past ``capacity`` bytes (index and trailer included), except for the first
    record, which is always accepted so that an oversized sample still gets a segment of its own (callers size the
    capacity for it). ``finish`` writes the index and trailer and optionally fsyncs; only a finished file is a
    valid segment. ``abort`` removes the file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity: int,
        compression: str = "none",
        file_mode: int = 0o640,
        source: int = 0,
    ) -> None:
        if not 0 <= source < 2**32:
            raise ValueError(f"source tag {source} is not a u32")
        self.path = Path(path)
        self.capacity = capacity
        self.source = source
        self._encoder = RecordEncoder(compression=compression)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, file_mode)
        os.fchmod(fd, file_mode)  # umask must not weaken or strengthen the configured mode
        self._file = io.FileIO(fd, "wb", closefd=True)
        self._offsets: list[int] = []
        self._lengths: list[int] = []
        self._hashes: list[int] = []
        self._sources: list[tuple[str, str | None]] = []
        self._sources_bytes = 0  # msgpack size of self._sources
        self._position = 0
        self._write([_SEGMENT_HEADER.pack(_SEGMENT_MAGIC, FORMAT_VERSION, 0, 0)])

    @property
    def count(self) -> int:
        return len(self._offsets)

    @property
    def nbytes(self) -> int:
        """Size the file would have if finished now (exact, or a few bytes over with sources)."""
        return self._finished_size(self.count, self._sources_bytes)

    def _finished_size(self, count: int, sources_bytes: int, position: int | None = None) -> int:
        """The file's size if finished with ``count`` records and sources ending at ``position``."""
        end = self._position if position is None else position
        with_sources = self._index_bytes(count) + sources_bytes
        return end + _pad(end) + with_sources + _pad(with_sources) + TRAILER_BYTES

    @staticmethod
    def _index_bytes(count: int) -> int:
        raw = 24 * count
        return raw + _pad(raw)

    @staticmethod
    def size_for(record_nbytes: int) -> int:
        """Smallest capacity that holds one record of this size."""
        end = HEADER_BYTES + record_nbytes  # the first record starts right after the 64-byte header: aligned
        return end + _pad(end) + SegmentWriter._index_bytes(1) + TRAILER_BYTES

    def _write(self, parts: list[memoryview | bytes]) -> None:
        for part in parts:
            view = memoryview(part)
            while view.nbytes:
                written = self._file.write(view)
                if written is None or written <= 0:
                    raise OSError("short write to segment file")
                view = view[written:]
        self._position += sum(memoryview(p).nbytes for p in parts)

    def encode(self, sample: Mapping[str, Any]) -> EncodedRecord:
        return self._encoder.encode(sample)

    def fits(self, record: EncodedRecord) -> bool:
        end = self._position + _pad(self._position, record.align) + record.nbytes
        return self._finished_size(self.count + 1, self._sources_bytes, end) <= self.capacity

    def add_source(self, path: str, version: str | None) -> bool:
        """Name a remote object whose last sample this segment holds; False (left out) if it does not fit."""
        entry = (path, version)
        grown = self._sources_bytes + len(msgpack.packb(entry)) + (5 if not self._sources else 0)  # + array header
        if self._finished_size(self.count, grown) > self.capacity:
            return False
        self._sources.append(entry)
        self._sources_bytes = grown
        return True

    def append(self, record: EncodedRecord) -> bool:
        """Write one encoded record if it fits (see the class contract). Returns whether it was written."""
        if self.count and not self.fits(record):
            return False
        pad = _pad(self._position, record.align)
        if pad:
            self._write([bytes(pad)])
        self._offsets.append(self._position)
        self._lengths.append(record.nbytes)
        self._hashes.append(record.key_hash)
        self._write(record.parts)
        return True

    def finish(self, *, fsync: bool = True) -> int:
        """Write index and trailer, close the file, and return its size in bytes."""
        if _pad(self._position):
            self._write([bytes(_pad(self._position))])  # the index is 64-aligned: read in place as u64
        index_offset = self._position
        index = np.array([self._offsets, self._lengths, self._hashes], dtype="<u8").reshape(-1)
        region = index.tobytes() + bytes(_pad(index.nbytes))
        if self._sources:
            region += msgpack.packb(self._sources)
        region += bytes(_pad(len(region)))
        self._write([region])
        file_len = self._position + TRAILER_BYTES
        body = _TRAILER.pack(
            _TRAILER_MAGIC,
            FORMAT_VERSION,
            0,
            self.source,
            self.count,
            index_offset,
            xxhash.xxh3_64_intdigest(region),
            file_len,
            0,
        )[:-8]
        trailer = body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
        self._write([trailer + bytes(TRAILER_BYTES - len(trailer))])
        self._file.flush()
        if fsync:
            os.fsync(self._file.fileno())
        self._file.close()
        return file_len

    def abort(self) -> None:
        """Close and delete the unfinished file (idempotent)."""
        if not self._file.closed:
            self._file.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def segment_count(path: str | os.PathLike[str]) -> int:
    """Number of records in a segment, from its trailer alone (one small read). -1 if the trailer is invalid."""
    return segment_trailer(path)[0]


def segment_trailer(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(records, source tag)`` of a segment from its trailer alone (one small read); ``(-1, 0)`` if invalid.

    Cheaper than ``SegmentReader`` (no map, no index checksum): for counting what a directory holds, never for
    trusting a segment's contents.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return -1, 0
    try:
        size = os.fstat(fd).st_size
        if size < TRAILER_BYTES:
            return -1, 0
        raw = os.pread(fd, _TRAILER.size, size - TRAILER_BYTES)
    finally:
        os.close(fd)
    if len(raw) < _TRAILER.size:
        return -1, 0
    magic, version, _flags, source, count, *_rest = _TRAILER.unpack(raw)
    return (int(count), int(source)) if magic == _TRAILER_MAGIC and version == FORMAT_VERSION else (-1, 0)


class SegmentReader:
    """Read access to one published segment through a read-only memory map.

    Opening checks the segment header and trailer (bounded cost: two small reads and the index checksum), so a
    partial or foreign file is rejected before any record is read. ``read(i)`` checks record ``i``'s header, its
    checksum (``verify=True``, the default; xxh3 runs near memory bandwidth) and that it holds the key the index
    promises, then decodes it. Returned numpy arrays are copy-on-write views of the map: they stay valid after the
    file is unlinked, and keep the map alive for as long as they live.

    Caveat: truncating a mapped file in place makes later access to the lost pages raise SIGBUS; cachefeed never
    truncates published segments, and a file already short when opened is rejected here.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES + TRAILER_BYTES:
                raise CorruptRecordError(f"{self.path.name}: too short to be a segment ({size} bytes)")
            self._map = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        self._buffer = memoryview(self._map)
        self.size = size
        magic, version, _flags, _created = _SEGMENT_HEADER.unpack_from(self._buffer, 0)
        if magic != _SEGMENT_MAGIC or version != FORMAT_VERSION:
            raise CorruptRecordError(f"{self.path.name}: not a cachefeed segment (format {version})")
        trailer = bytes(self._buffer[size - TRAILER_BYTES : size])
        fields = _TRAILER.unpack_from(trailer, 0)
        t_magic, t_version, _tf, source, count, index_offset, index_hash, file_len, own_hash = fields
        if t_magic != _TRAILER_MAGIC or t_version != FORMAT_VERSION:
            raise CorruptRecordError(f"{self.path.name}: no valid trailer (partial or foreign segment)")
        if xxhash.xxh3_64_intdigest(trailer[: _TRAILER.size - 8]) != own_hash or file_len != size:
            raise CorruptRecordError(f"{self.path.name}: trailer checksum or length mismatch")
        index_len = 24 * count + _pad(24 * count)
        if not HEADER_BYTES <= index_offset <= size - TRAILER_BYTES - index_len:
            raise CorruptRecordError(f"{self.path.name}: index out of bounds")
        region = self._buffer[index_offset : size - TRAILER_BYTES]
        if xxhash.xxh3_64_intdigest(region) != index_hash:
            raise CorruptRecordError(f"{self.path.name}: index checksum mismatch")
        self._sources_raw = bytes(region[index_len:])  # small; a copy keeps no view of the map alive
        region.release()
        table = np.frombuffer(self._map, dtype="<u8", count=3 * count, offset=index_offset).reshape(3, count)
        self.offsets, self.lengths, self.key_hashes = table[0], table[1], table[2]
        self.count = int(count)
        self.source = int(source)  # the source tag (module docstring); 0: one unnamed remote

    def __len__(self) -> int:
        return self.count

    def sources(self) -> list[tuple[str, str | None]]:
        """The ``(path, version)`` of each remote object whose last sample this segment holds (see module doc)."""
        raw = self._sources_raw
        if not raw.strip(b"\x00"):
            return []
        try:
            unpacker = msgpack.Unpacker(use_list=True)
            unpacker.feed(raw)  # one array, then padding
            entries = unpacker.unpack()
            found = [(str(path), None if version is None else str(version)) for path, version in entries]
        except (ValueError, TypeError, msgpack.UnpackException, msgpack.OutOfData) as exc:
            raise CorruptRecordError(f"{self.path.name}: malformed source list: {exc}") from exc
        return found

    def close(self) -> None:
        """Release the map if no array still views it; otherwise it is released when they die."""
        self._buffer.release()
        try:
            self._map.close()
        except BufferError:
            pass

    def __enter__(self) -> SegmentReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def record_view(self, i: int, *, verify: bool = True) -> tuple[dict[str, Any], memoryview, int]:
        """Check record ``i`` and return (meta, payload area, flags)."""
        if not 0 <= i < self.count:
            raise IndexError(f"record {i} out of range for a segment of {self.count}")
        offset, length = int(self.offsets[i]), int(self.lengths[i])
        name = self.path.name
        header = _RECORD_HEADER.size
        if offset + length > self.size - TRAILER_BYTES or length < header:
            raise CorruptRecordError(f"{name}: record {i} out of bounds")
        magic, version, flags, meta_len, body_hash = _RECORD_HEADER.unpack_from(self._buffer, offset)
        area_start = header + meta_len + _pad(header + meta_len, ALIGN if flags & _FLAG_ALIGN64 else SMALL_ALIGN)
        if magic != _RECORD_MAGIC or version != FORMAT_VERSION or area_start > length:
            raise CorruptRecordError(f"{name}: record {i} has a bad header")
        body = self._buffer[offset + header : offset + length]
        if verify and xxhash.xxh3_64_intdigest(body) != body_hash:
            raise CorruptRecordError(f"{name}: record {i} failed its checksum")
        try:
            key, fields, inline, raw_len = msgpack.unpackb(body[:meta_len], raw=False)
        except (ValueError, TypeError, msgpack.UnpackException, msgpack.OutOfData) as exc:
            raise CorruptRecordError(f"{name}: record {i} has unreadable metadata") from exc
        if not isinstance(key, str) or key_hash(key) != int(self.key_hashes[i]):
            raise CorruptRecordError(f"{name}: record {i} holds another key than the index says")
        meta = {"k": key, "f": fields, "v": inline, "r": raw_len}
        return meta, self._buffer[offset + area_start : offset + length], flags

    def read(self, i: int, *, verify: bool = True) -> dict[str, Any]:
        """Decode record ``i`` into a sample dict (see the class docstring for the zero-copy contract)."""
        meta, area, flags = self.record_view(i, verify=verify)
        if flags & _FLAG_ZLIB:
            raw = np.frombuffer(bytearray(zlib.decompress(area)), dtype=np.uint8)  # writable, like the map
            if raw.nbytes != int(meta.get("r", -1)):
                raise CorruptRecordError(f"{self.path.name}: record {i} decompressed to a wrong length")
            source: Any = raw
        else:
            source = area
        sample: dict[str, Any] = {"__key__": meta["k"]}
        sample.update(meta.get("v", {}))
        try:
            for name, kind, offset, nbytes, *extra in meta["f"]:
                sample[name] = _decode_field(kind, source, offset, nbytes, extra)
        except (TypeError, ValueError, KeyError) as exc:
            raise CorruptRecordError(f"{self.path.name}: record {i} has a malformed field: {exc}") from exc
        return sample

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.count):
            yield self.read(i)

    def verify_all(self) -> None:
        """Check every record's checksum and key. Raises CorruptRecordError on the first failure."""
        for i in range(self.count):
            self.record_view(i, verify=True)


def _decode_field(kind: str, source: Any, offset: int, nbytes: int, extra: list[Any]) -> Any:
    if kind == "nd":
        dtype, shape = np.dtype(extra[0]), tuple(extra[1])
        count = nbytes // dtype.itemsize if dtype.itemsize else 0
        array = np.frombuffer(source, dtype=dtype, count=count, offset=offset) if count else np.empty(0, dtype)
        return array.reshape(shape)
    if kind == "pt":
        import torch

        dtype = getattr(torch, extra[0])
        shape = tuple(extra[1])
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        raw = np.frombuffer(source, dtype=np.uint8, count=nbytes, offset=offset)
        return torch.from_numpy(raw).view(dtype).reshape(shape)
    if kind == "by":
        return bytes(memoryview(source)[offset : offset + nbytes])
    if kind == "st":
        return bytes(memoryview(source)[offset : offset + nbytes]).decode("utf-8", "surrogatepass")
    raise ValueError(f"unknown field kind {kind!r}")
