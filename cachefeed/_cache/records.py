"""The on-disk format: records inside segment files. Write, verify, and read zero-copy from a memory map.

A **segment** is one file holding many records, written once into ``tmp/`` and published by an atomic rename.
A **record** is one sample: a dict of fields (numpy arrays, torch tensors, bytes, str and small scalars); what its
fields become (payloads, inline values, descriptors) is ``descriptors.py``'s part.

Layout (format 4; all integers little-endian)::

    segment  := SegmentHeader(64) (pad Record)* Index Trailer(64)
    Record   := RecordHeader(16) meta(msgpack) pad payload*
    Index    := starts u32[n] Tables(msgpack) Sources(msgpack, absent when the writer named none) pad
    Tables   := [descriptors (bin each), key prefixes (str each)]
    Trailer  := magic "CFSEGEND", version, flags, source tag, count, index offset, xxh3 of the Index,
                file length, trailer xxh3

``starts[i]`` is record ``i``'s offset in 16-byte units (records start 16-aligned; a segment holds at most 64 GiB
of records, and the writer refuses a record that would start beyond). ``RecordHeader``: the record's checksum
(u64, below), its length in bytes (u32: a record holds at most 4 GiB), and the meta's length (u24) with the flags
(u8; bit 0: zlib-compressed payload area, bit 1: the payload area starts 64-aligned). The meta is msgpack
``[descriptor, prefix, key suffix, *values]``: the descriptor's number in the segment's table (or, when the table
is full, the descriptor itself as bin), the key as a prefix's number in the table plus the rest of the key, and
the values ``descriptors.py`` describes.

**What verifies what.** The trailer is written last and checks itself, the file length and the whole Index (so the
tables with it): a file without a valid trailer is partial, and a damaged index or table fails at open. Each record
carries an xxh3-64 of its bytes after the checksum, seeded with its *binding*: the xxh3 of its descriptor, of its
key prefix, and its position in the segment. A record therefore verifies itself (``verify=True``: every byte) and
proves what the index and tables say of it: read at another position (records swapped or moved), with another
descriptor, or under another key prefix than it was written with, it fails its checksum. Its suffix and its
descriptor number are in its own checksummed bytes. Read with ``verify=False`` nothing about a record's bytes is
checked: only that its header, meta and sizes are consistent with the segment (so a read never strays outside its
record), not that they are the ones written. (Format 3 also compared the key with a hash in the index there, for
8 bytes of index a record; what only that check caught, a record in another's place, takes a damaged file, and
``verify=True``, the dataset's default, catches it.)

**Why tables.** Format 3 repeated in every record what most records of a segment share: the key (30 bytes for a
typical ``train/shard-0001.msgpack#123``), every field's name, kind, dtype and shape (about 10 bytes a field), and
24 bytes of index (offset, length, key hash). Format 4 writes the descriptors and the keys' shared prefixes once per
segment, keeps each record's length in its header and replaces the key hash by the binding above: 4 bytes of index
a record. ``SegmentWriter`` picks a key's prefix from the previous key (a new prefix where the two share at least 4
more characters than the current prefix spares), and a record's descriptor as ``descriptors.py`` says (the loose
one once an array changed shape); a segment holds at most ``MAX_PREFIXES`` (256) prefixes and ``MAX_DESCRIPTORS``
(64) descriptors, after which keys keep the last prefix (or none) and records carry their descriptor: a segment of
ever-changing keys or field sets costs about what format 3 did. Readers gain too: a descriptor is decoded once per
segment into a read plan (``descriptors.Plan``), not once per record.

**Alignment** (since format 3): a payload of ``LARGE_PAYLOAD`` (4 KiB) or more starts on a 64-byte boundary
(cache lines, AVX-512 loads, and the DMA engines that copy pinned batches like it); smaller ones on 16 bytes (any
numpy or torch dtype's own alignment). A record starts on the largest boundary its payloads need (the writer pads
before it), and its payload area on that same boundary, so an array read from the page-aligned memory map has its
alignment in memory too.

**What a record costs** beyond its payload: 16 bytes of header, the meta (descriptor number, prefix number and key
suffix: about 6 bytes for keys that share their prefixes, plus the inline values), padding to 16 (64 before a large
payload) and 4 bytes of index. A 1 KiB float32 vector with an int label and an int id under a 30-character key:
1,060 bytes in the segment (3.5% over the payload, index, tables, segment header and trailer included, for ids of 1
to 5 bytes of msgpack alike; format 3 took 1,128, format 2 1,240; ``tests/cache/test_records.py`` pins it at 1,075
at most, ``python -m benchmarks.record_cost`` prints it).

The trailer's **source tag** (u32) says which configured source (``[[source]]``, see ``_cache/sources.py``) every
record of the segment came from; 0 when the daemon reads one unnamed remote. A segment never mixes sources.

**Sources** name the remote objects the segment holds samples of (``Source``: path and version): the objects
whose last sample it holds, and the one being written when the segment was cut (``_daemon/sink.py``), with
``cut``, how many of its first samples this segment and earlier ones hold. They let a restarted daemon know what
its recovered cache already holds, and fetch only the rest of an object a crash cut short. A writer keeps room for
the name of the object it is writing (``SegmentWriter.source_room``, ``source_bytes``), so that name always fits
where its samples are; beyond that, sources are best effort by design: one that does not fit the segment's
capacity is left out (that object is fetched again after a restart), never a reason to fail a segment.

A segment of another format version (an older cachefeed's) is refused at open like a foreign file
(``CorruptRecordError``): the store drops it at recovery and a snapshot leaves it out; its samples are fetched
again.

Reading is zero-copy for uncompressed arrays: ``SegmentReader.read(i)`` returns numpy arrays that are views of
a private (copy-on-write) memory map: the pages are the page cache's until someone writes to an array, and a write
changes only that process's copy, never the file. A compressed record is decompressed into one fresh buffer.

Part of the cache layer (``cachefeed/_cache/``): the store, the writer and the snapshots use it, and the trainer and
the daemon read segments through it. It imports nothing of the config, the daemon or the trainer, and torch only
through ``descriptors.py``, when a sample holds a tensor.

Why one long module: it is the segment format, both sides of it (``SegmentWriter`` and ``SegmentReader`` must agree
byte for byte, and are read together); what a record's fields become is ``descriptors.py``'s part.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import numpy as np
import numpy.typing as npt
import xxhash

from cachefeed._cache.descriptors import ALIGN, SLICE, SMALL_ALIGN, VIEW, Fields, Plan, classify, loosen, payload
from cachefeed._errors import CorruptRecordError

__all__ = [
    "COMPRESSIONS",
    "FORMAT_VERSION",
    "EncodedRecord",
    "RecordEncoder",
    "SegmentReader",
    "SegmentWriter",
    "Source",
    "read_records",
    "segment_count",
    "segment_trailer",
    "source_bytes",
]

# 2: the Sources section; 3: 16-byte record headers, 64-byte alignment for large payloads only; 4: descriptor and
# key-prefix tables, u32 starts as the whole index, checksums seeded with the binding
FORMAT_VERSION = 4
_SEGMENT_MAGIC = b"CFSEG\x00\x00\x01"
_TRAILER_MAGIC = b"CFSEGEND"
_SEGMENT_HEADER = struct.Struct("<8sHH4xQ40x")  # magic, version, flags, created_ns
# magic, version, flags, source tag, count, index_off, index_hash, file_len, own_hash
_TRAILER = struct.Struct("<8sHHIQQQQQ")
_RECORD_HEADER = struct.Struct("<QII")  # checksum, length, meta length | flags << 24
_RECORD_TAIL = struct.Struct("<II")  # the header after the checksum: the first bytes the checksum covers
_CHECKSUM = struct.Struct("<Q")
_FLAG_ZLIB = 1
_FLAG_ALIGN64 = 2  # the payload area starts 64-aligned (a payload of LARGE_PAYLOAD or more); else 16
_META_MASK = (1 << 24) - 1
_MAX_RECORD = (1 << 32) - 1
_MAX_START = ((1 << 32) - 1) * 16  # starts are u32 in 16-byte units
COMPRESSIONS = ("none", "zlib")  # per-record payload compression; the registry config validates against
MAX_DESCRIPTORS = 64  # a segment's descriptor table; then records carry their descriptor
MAX_PREFIXES = 256  # a segment's key prefixes; then keys use the last one (or none)
_PREFIX_GAIN = 4  # a new prefix must spare at least this many more characters of the key than the current one
_WRITE_BUFFER = 64 << 10  # larger writes (most payloads of large samples) bypass the buffer: no extra copy
_TABLE_SLACK = 128  # what a lone record's table entries may take beyond its ``nbytes`` (``size_for``)
_PACKED_DESCRIPTORS = 1024  # descriptors an encoder keeps packed
_GOLDEN = 0x9E3779B97F4A7C15  # spreads record positions over the 64 bits of a seed
_MASK = (1 << 64) - 1
TRAILER_BYTES = 64
HEADER_BYTES = 64

if _SEGMENT_HEADER.size != HEADER_BYTES or _TRAILER.size > TRAILER_BYTES or _RECORD_HEADER.size != SMALL_ALIGN:
    raise RuntimeError("record format constants are inconsistent")  # pragma: no cover


def _pad(n: int, align: int = ALIGN) -> int:
    """The padding after ``n`` bytes to the next multiple of ``align``. The per-record paths (``encode``,
    ``SegmentWriter._bind``, ``_fits``, ``append``, ``_finished_size``) write it as ``-n % align`` in place: about a
    dozen calls a record otherwise."""
    return -n % align


def _text_seed(text: str) -> int:
    return int(xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass")))


def _finished_size(end: int, index: int) -> int:
    """The size of a segment finished with its records ending at ``end`` and an index of ``index`` bytes (starts,
    tables, sources), padding and trailer included."""
    return end + (-end % ALIGN) + index + (-index % ALIGN) + TRAILER_BYTES


def _seed(descriptor_seed: int, prefix_seed: int, position: int) -> int:
    """The seed of record ``position``'s checksum (its binding, module docstring)."""
    return descriptor_seed ^ prefix_seed ^ ((position + 1) * _GOLDEN & _MASK)


def _packed_len(value: Any) -> int:
    return len(msgpack.packb(value, use_bin_type=True))


def _array_header(count: int) -> int:
    return 1 if count < 16 else 3 if count < 1 << 16 else 5


@dataclass(slots=True)
class EncodedRecord:
    """A sample encoded for any segment: its descriptor and key are bound to a segment's tables when a writer
    appends it (``SegmentWriter``). Read-only by contract: not ``frozen`` only because one is made per sample
    written, and a frozen dataclass's ``__init__`` (``object.__setattr__`` per field) costs about 1.5 us more.

    ``payloads`` are the payload area as written (compressed: one zlib stream), ``area_len`` bytes. ``nbytes``
    bounds what the record takes in any segment: its size with its descriptor and its whole key in its meta (a
    few bytes over), which is what it takes where the segment's tables are full; elsewhere it takes less in the
    record and a table entry in the index (``SegmentWriter.size_for`` allows for that).
    """

    key: str
    fields: Fields
    descriptor: bytes  # the exact descriptor, msgpack
    payloads: list[memoryview | bytes]
    area_len: int
    flags: int
    align: int
    nbytes: int


class RecordEncoder:
    """Turns a sample dict into an ``EncodedRecord``. Stateless apart from the compression choice.

    ``encode`` is ``compressed(uncompressed(sample))``: the first step checks that the sample can be stored and
    holds views of its payloads only; the second copies them into a zlib stream where the encoder compresses. A
    caller that checks a whole object's samples before writing any (the daemon's sink) takes the first step for
    each and the second as it appends each, so the object is never held compressed all at once.
    """

    def __init__(self, *, compression: str = "none") -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, not {compression!r}")
        self._compress = compression == "zlib"
        self._packed: dict[tuple[tuple[Any, ...], ...], bytes] = {}  # descriptors seen: most samples share one

    def encode(self, sample: Mapping[str, Any]) -> EncodedRecord:
        return self.compressed(self.uncompressed(sample))

    def uncompressed(self, sample: Mapping[str, Any]) -> EncodedRecord:
        """The sample's record without compression; raises on a sample no record can hold."""
        key, fields = classify(sample)
        descriptor = self._packed.get(fields.exact)
        if descriptor is None:
            descriptor = msgpack.packb(fields.exact, use_bin_type=True)
            if len(self._packed) >= _PACKED_DESCRIPTORS:  # samples of ever new shapes: keep the recent ones
                self._packed.clear()
            self._packed[fields.exact] = descriptor
        flags = _FLAG_ALIGN64 if fields.align == ALIGN else 0
        return _record(
            key, fields, descriptor, payloads=fields.payloads, area_len=fields.area_len, flags=flags, align=fields.align
        )

    def compressed(self, record: EncodedRecord) -> EncodedRecord:
        """``record`` with its payload area as one zlib stream, where this encoder compresses (else ``record``)."""
        if not self._compress or not record.area_len:
            return record
        stream = zlib.compress(b"".join(record.payloads), 1)  # decompressed into a fresh (aligned) buffer
        return _record(
            record.key,
            record.fields,
            record.descriptor,
            payloads=[stream],
            area_len=len(stream),
            flags=_FLAG_ZLIB,
            align=SMALL_ALIGN,
        )


def _record(
    key: str,
    fields: Fields,
    descriptor: bytes,
    *,
    payloads: list[memoryview | bytes],
    area_len: int,
    flags: int,
    align: int,
) -> EncodedRecord:
    """The record, with its size bound (``EncodedRecord.nbytes``); ValueError where it is too large to store."""
    # the meta with the descriptor and the whole key in it, at most (ValueError for a key that is no UTF-8)
    meta_len = 5 + len(descriptor) + 5 + 9 + len(key.encode("utf-8")) + 5 + fields.values_bytes
    nbytes = _RECORD_HEADER.size + meta_len + (-(_RECORD_HEADER.size + meta_len) % align) + area_len
    if meta_len > _META_MASK or nbytes > _MAX_RECORD:
        raise ValueError(
            f"sample {key!r} takes {nbytes} bytes ({meta_len} of them inline values): a record holds at most "
            "4 GiB and 16 MiB of inline values; split it, or store large values as arrays or bytes"
        )
    return EncodedRecord(key, fields, descriptor, payloads, area_len, flags, align, nbytes)


@dataclass(slots=True)
class _Binding:
    """An encoded record bound to a segment's tables (``SegmentWriter._bind``), with the entries it would add.
    A slots dataclass: made once per record appended, and cheaper to make than a NamedTuple."""

    meta: bytes
    length: int
    descriptor: int | bytes  # a table number, or the descriptor itself (table full)
    prefix: int
    new_descriptor: bytes | None
    loose: bytes | None  # the exact descriptor's loose twin, remembered when a new exact one enters the table
    new_prefix: str | None
    table_growth: int


def source_bytes(path: str, version: str | None) -> int:
    """The most bytes naming ``(path, version)`` adds to a segment's source list, with a ``cut`` and the list's
    header: what a writer keeps free (``SegmentWriter.source_room``) so that the object it is writing can always
    be named in the segment its samples are in."""
    return len(msgpack.packb((path, version, 2**63 - 1))) + 5


class Source(NamedTuple):
    """A remote object a segment holds samples of. ``cut`` is None where the segment holds its last sample; else
    the segment was cut inside its samples, and it and earlier segments hold its first ``cut``."""

    path: str
    version: str | None
    cut: int | None = None


class SegmentWriter:
    """Appends records to one new segment file. Not thread-safe; one writer per file.

    Contract: the file is created exclusively (``O_EXCL``) with ``file_mode``; ``append`` returns False when the
    record would push the finished file past ``capacity`` bytes (index and trailer included), except for the first
    record, which is always accepted so that an oversized sample still gets a segment of its own (callers size the
    capacity for it with ``size_for``). ``finish`` writes the index and trailer and optionally fsyncs; only a
    finished file is a valid segment. ``abort`` removes the file.

    Appending binds a record to this segment's tables (module docstring, "Why tables"): its descriptor becomes a
    table entry (the exact one; the loose one once an array field has changed shape; the descriptor itself in the
    record once the table holds ``MAX_DESCRIPTORS``), its key a prefix number and a suffix. The checksum is
    computed then, seeded with the binding.

    An append runs once per sample the daemon writes, so its Python is kept short (``append``'s docstring);
    ``python -m benchmarks.record_cost`` prints what an encode and append of a 4 KiB sample cost. Whatever the
    code, the bytes written are the format's, byte for byte (``tests/cache/test_record_bytes.py``).
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
        self._pack = msgpack.Packer(use_bin_type=True).pack  # ``msgpack.packb`` makes a Packer per call
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, file_mode)
        os.fchmod(fd, file_mode)  # umask must not weaken or strengthen the configured mode
        # Buffered: a small record's header and payload cost one copy, not two system calls; an unfinished file
        # is partial whatever reached it (no trailer), and ``finish`` flushes before its fsync.
        self._file = io.BufferedWriter(io.FileIO(fd, "wb", closefd=True), buffer_size=_WRITE_BUFFER)
        self._starts: list[int] = []  # in 16-byte units
        self._descriptors: dict[bytes, int] = {}  # descriptor -> its number in the table
        self._descriptor_seeds: list[int] = []
        self._varying: set[bytes] = set()  # the loose twins of the exact descriptors in the table
        self._prefixes: list[str] = [""]
        self._prefix_seeds: list[int] = [_text_seed("")]
        self._prefix = 0  # the previous key's prefix
        self._previous_key = ""
        self._tables_bytes = _packed_len([[], [""]])
        self._sources: list[tuple[object, ...]] = []
        self._sources_bytes = 0  # msgpack size of self._sources
        self.source_room = 0  # bytes a record must leave free for a source its caller will name (``source_bytes``)
        self._position = 0
        self._write([_SEGMENT_HEADER.pack(_SEGMENT_MAGIC, FORMAT_VERSION, 0, 0)])
        self._file_write = self._file.write  # ``append``'s writes (``_write``, which see, for the rest)

    @property
    def count(self) -> int:
        return len(self._starts)

    @property
    def nbytes(self) -> int:
        """Size the file would have if finished now (exact, or a few bytes over with sources)."""
        return _finished_size(self._position, 4 * len(self._starts) + self._tables_bytes + self._sources_bytes)

    @staticmethod
    def size_for(record_nbytes: int) -> int:
        """A capacity that holds one record of ``EncodedRecord.nbytes`` bytes (its table entries included)."""
        tables = record_nbytes + _TABLE_SLACK + 4
        return HEADER_BYTES + tables + _pad(tables) + ALIGN + TRAILER_BYTES

    def _write(self, parts: list[memoryview | bytes]) -> None:
        for part in parts:
            view = memoryview(part)
            total = size = view.nbytes
            written = self._file.write(view)  # all of it (a blocking file); else the rest, again
            while written != size:
                if written is None or written <= 0:
                    raise OSError("short write to segment file")
                view, size = view[written:], size - written
                written = self._file.write(view)
            self._position += total

    def encode(self, sample: Mapping[str, Any]) -> EncodedRecord:
        return self._encoder.encode(sample)

    def fits(self, record: EncodedRecord) -> bool:
        """Whether ``append`` would accept the record now (the first record aside: that one always fits)."""
        return self._fits(record, self._bind(record))

    def _fits(self, record: EncodedRecord, binding: _Binding) -> bool:
        """Whether the segment, finished with this record, its table entries and ``source_room``, would fit its
        capacity."""
        start = self._position + (-self._position % record.align)
        if start > _MAX_START:
            return False
        tables = self._tables_bytes + binding.table_growth
        index = 4 * (len(self._starts) + 1) + tables + self._sources_bytes + self.source_room
        return _finished_size(start + binding.length, index) <= self.capacity

    def _bind(self, record: EncodedRecord) -> _Binding:
        """The record's meta and length in this segment, and the table entries it would add (not added yet)."""
        values = record.fields.values
        descriptor: int | bytes | None = self._descriptors.get(record.descriptor)
        new_descriptor = loose = None
        if descriptor is None:
            loosened = loosen(record.fields)
            loose = None if loosened is None else msgpack.packb(loosened[0], use_bin_type=True)
            if loosened is not None and loose in self._descriptors:
                descriptor, values = self._descriptors[loose], loosened[1]
            elif len(self._descriptor_seeds) >= MAX_DESCRIPTORS:
                descriptor = record.descriptor  # carried by the record
            elif loosened is not None and loose in self._varying:  # a second shape: records give their shapes
                descriptor, values, new_descriptor = len(self._descriptor_seeds), loosened[1], loose
            else:
                descriptor, new_descriptor = len(self._descriptor_seeds), record.descriptor
        prefix, suffix, new_prefix = self._prefix_of(record.key)
        meta = self._pack([descriptor, prefix, suffix, *values])
        head = _RECORD_HEADER.size + len(meta)
        length = head + (-head % record.align) + record.area_len
        growth = 0
        if new_descriptor is not None:
            count = len(self._descriptor_seeds)
            growth += _packed_len(new_descriptor) + _array_header(count + 1) - _array_header(count)
        if new_prefix is not None:
            count = len(self._prefixes)
            growth += _packed_len(new_prefix) + _array_header(count + 1) - _array_header(count)
        return _Binding(meta, length, descriptor, prefix, new_descriptor, loose, new_prefix, growth)

    def _prefix_of(self, key: str) -> tuple[int, str, str | None]:
        """``(prefix number, suffix, new prefix or None)``: the key as a prefix in the table and the rest."""
        current = self._prefixes[self._prefix]
        usable = len(current) if key.startswith(current) else 0
        probe = usable + _PREFIX_GAIN
        previous = self._previous_key
        if len(self._prefixes) < MAX_PREFIXES and key[:probe] == previous[:probe]:  # cheap first: rarely true
            shared = len(os.path.commonprefix([key, previous]))  # noqa: RUF071 (characters, not paths)
            if shared >= probe:
                return len(self._prefixes), key[shared:], key[:shared]
        return (self._prefix if usable else 0), key[usable:], None

    def add_source(self, path: str, version: str | None, cut: int | None = None) -> bool:
        """Name a remote object this segment holds samples of (``Source``); False (left out) if it does not fit."""
        entry: tuple[object, ...] = (path, version) if cut is None else (path, version, cut)
        grown = self._sources_bytes + len(msgpack.packb(entry)) + (5 if not self._sources else 0)  # + array header
        if _finished_size(self._position, 4 * len(self._starts) + self._tables_bytes + grown) > self.capacity:
            return False
        self._sources.append(entry)
        self._sources_bytes = grown
        return True

    def append(self, record: EncodedRecord) -> bool:
        """Write one encoded record if it fits (see the class contract). Returns whether it was written.

        Runs once per sample the daemon writes: the bytes are assembled with two small concatenations, the
        checksum is one xxh3 over the header and the payloads (in place, no copy of them), and the payloads go to
        the buffered file as they are (a small one is copied into its buffer, a large one bypasses it).
        """
        binding = self._bind(record)
        count = len(self._starts)
        if count and not self._fits(record, binding):
            return False
        if binding.new_descriptor is not None:
            self._descriptors[binding.new_descriptor] = len(self._descriptor_seeds)
            self._descriptor_seeds.append(xxhash.xxh3_64_intdigest(binding.new_descriptor))
            if binding.new_descriptor == record.descriptor and binding.loose is not None:
                self._varying.add(binding.loose)
        if binding.new_prefix is not None:
            self._prefixes.append(binding.new_prefix)
            self._prefix_seeds.append(_text_seed(binding.new_prefix))
        self._tables_bytes += binding.table_growth
        self._prefix, self._previous_key = binding.prefix, record.key
        descriptor = binding.descriptor
        descriptor_seed = (
            self._descriptor_seeds[descriptor] if isinstance(descriptor, int) else xxhash.xxh3_64_intdigest(descriptor)
        )
        align, meta, payloads = record.align, binding.meta, record.payloads
        position = self._position
        pad = -position % align
        # the header after the checksum, the meta and the padding to the payload area
        head = _RECORD_TAIL.pack(binding.length, len(meta) | record.flags << 24) + meta
        head += bytes(-(8 + len(head)) % align)
        hasher = xxhash.xxh3_64(head, seed=_seed(descriptor_seed, self._prefix_seeds[binding.prefix], count))
        for part in payloads:
            hasher.update(part)
        self._starts.append((position + pad) >> 4)
        # a BufferedWriter on a blocking file writes all it is given or raises (``_write`` for the general case)
        write = self._file_write
        write(bytes(pad) + _CHECKSUM.pack(hasher.intdigest()) + head)
        for part in payloads:
            write(part)
        self._position = position + pad + binding.length
        return True

    def finish(self, *, fsync: bool = True) -> int:
        """Write index and trailer, close the file, and return its size in bytes."""
        if _pad(self._position):
            self._write([bytes(_pad(self._position))])  # the index is 64-aligned: starts read in place as u32
        index_offset = self._position
        descriptors = sorted(self._descriptors, key=self._descriptors.__getitem__)
        region = np.array(self._starts, dtype="<u4").tobytes()
        region += msgpack.packb([descriptors, self._prefixes], use_bin_type=True)
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
            try:
                self._file.close()
            except OSError:
                pass  # flushing what was buffered failed (a full disk, say): the file goes anyway
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def segment_count(path: str | os.PathLike[str]) -> int:
    """Number of records in a segment, from its trailer alone (one small read). -1 if the trailer is invalid."""
    return segment_trailer(path)[0]


def segment_trailer(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(records, source tag)`` of a segment from its trailer alone (one small read); ``(-1, 0)`` if invalid
    (another format version included).

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


_UNREADABLE = (ValueError, TypeError, IndexError, KeyError, OverflowError, msgpack.UnpackException)


class SegmentReader:
    """Read access to one published segment through a read-only memory map.

    Opening checks the segment header and trailer (bounded cost: two small reads and the index checksum, which
    covers the tables), so a partial or foreign file, or one of another format version, is rejected before any
    record is read. ``read(i)`` checks record ``i``'s header and meta against the segment, its checksum
    (``verify=True``, the default; xxh3 runs near memory bandwidth) with its binding (module docstring), then
    decodes it through its descriptor's read plan (built on first use, once per descriptor). Returned numpy
    arrays are C-contiguous, writable, copy-on-write views of the map: they stay valid after the file is
    unlinked, and keep the map alive for as long as they live.

    Caveat: truncating a mapped file in place makes later access to the lost pages raise SIGBUS; cachefeed never
    truncates published segments, and a file already short when opened is rejected here. Threads may share a
    reader (a plan built twice by two threads at once is the only duplicated work).

    What a read costs in Python (a one-off measurement, 2026-11-23, 2 shared CPUs, Python 3.11.7, numpy 2.4.6:
    ``python -m benchmarks.record_cost`` from the repository root, median of 20 passes over a 64 MiB tmpfs cache):
    ``read(i, verify=False)`` of a record of one 128 KiB uint8 array took 14.3-15.0 us with format 3 (at
    1023a54: the meta's msgpack with its field list, a dtype and a key hash per record) and 5.1 us with format 4
    and its read plans. ``verify=True`` adds the xxh3 pass over the record's bytes.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._name = self.path.name  # for messages: a Path's name is not free
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES + TRAILER_BYTES:
                raise CorruptRecordError(f"{self._name}: too short to be a segment ({size} bytes)")
            self._map = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        self._buffer = memoryview(self._map)
        # Arrays are views of this one: numpy's ndarray(buffer=the map) would keep no export of the map and let
        # close() unmap memory an array still points to; through this array, every view holds an export.
        self._bytes: npt.NDArray[np.uint8] = np.frombuffer(self._map, dtype=np.uint8)
        self.size = size
        magic, version, _flags, _created = _SEGMENT_HEADER.unpack_from(self._buffer, 0)
        if magic != _SEGMENT_MAGIC or version != FORMAT_VERSION:
            raise CorruptRecordError(
                f"{self._name}: not a cachefeed segment of format {FORMAT_VERSION} (magic {magic!r}, format {version})"
            )
        trailer = bytes(self._buffer[size - TRAILER_BYTES : size])
        fields = _TRAILER.unpack_from(trailer, 0)
        t_magic, t_version, _tf, source, count, index_offset, index_hash, file_len, own_hash = fields
        if t_magic != _TRAILER_MAGIC or t_version != FORMAT_VERSION:
            raise CorruptRecordError(f"{self._name}: no valid trailer (partial or foreign segment)")
        if xxhash.xxh3_64_intdigest(trailer[: _TRAILER.size - 8]) != own_hash or file_len != size:
            raise CorruptRecordError(f"{self._name}: trailer checksum or length mismatch")
        starts_len = 4 * count
        if not HEADER_BYTES <= index_offset <= size - TRAILER_BYTES - starts_len:
            raise CorruptRecordError(f"{self._name}: index out of bounds")
        region = self._buffer[index_offset : size - TRAILER_BYTES]
        if xxhash.xxh3_64_intdigest(region) != index_hash:
            raise CorruptRecordError(f"{self._name}: index checksum mismatch")
        try:
            unpacker = msgpack.Unpacker(raw=False)
            unpacker.feed(region[starts_len:])
            descriptors, prefixes = unpacker.unpack()
            tables_end = starts_len + unpacker.tell()
            if not all(isinstance(d, bytes) for d in descriptors) or not all(isinstance(p, str) for p in prefixes):
                raise TypeError("table entries of the wrong type")
        except (*_UNREADABLE, msgpack.OutOfData) as exc:
            raise CorruptRecordError(f"{self._name}: malformed tables: {exc}") from exc
        self._sources_raw = bytes(region[tables_end:])  # small; a copy keeps no view of the map alive
        region.release()
        self._descriptors: list[bytes] = descriptors
        self._plans: list[Plan | None] = [None] * len(descriptors)
        self._prefixes: list[str] = prefixes
        self._prefix_seeds = [_text_seed(prefix) for prefix in prefixes]
        starts = self._buffer[index_offset : index_offset + starts_len]
        if sys.byteorder == "little":
            self._starts = starts.cast("I")  # Python ints straight from the map, the cheapest lookup
        else:  # pragma: no cover - big-endian hosts: a native copy
            self._starts = memoryview(np.frombuffer(starts, dtype="<u4").astype("=u4").tobytes()).cast("I")
            starts.release()
        self.index_offset = int(index_offset)
        self.count = int(count)
        self.source = int(source)  # the source tag (module docstring); 0: one unnamed remote
        self._state: tuple[Any, ...] | None = (  # what ``read_records`` reads with, in its order
            self.count,
            self.index_offset,
            self._starts,
            self._map,
            self._buffer,
            self._bytes,
            self._plans,
            self._prefixes,
            self._prefix_seeds,
        )

    def __len__(self) -> int:
        return self.count

    @property
    def offsets(self) -> npt.NDArray[np.int64]:
        """Every record's offset in the file (computed on each access: for tools and tests)."""
        return np.frombuffer(self._map, dtype="<u4", count=self.count, offset=self.index_offset).astype(np.int64) << 4

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        """Every record's length, from the headers (unverified; computed on each access: for tools and tests)."""
        return np.array([_RECORD_HEADER.unpack_from(self._map, int(at))[1] for at in self.offsets], dtype=np.int64)

    def sources(self) -> list[Source]:
        """The remote objects this segment holds samples of (see module doc)."""
        raw = self._sources_raw
        if not raw.strip(b"\x00"):
            return []
        try:
            unpacker = msgpack.Unpacker(use_list=True)
            unpacker.feed(raw)  # one array, then padding
            entries = unpacker.unpack()
            found = [
                Source(str(path), None if version is None else str(version), int(cut[0]) if cut else None)
                for path, version, *cut in entries
            ]
        except (ValueError, TypeError, msgpack.UnpackException, msgpack.OutOfData) as exc:
            raise CorruptRecordError(f"{self._name}: malformed source list: {exc}") from exc
        return found

    def close(self) -> None:
        """Release the map if no array still views it; otherwise it is released when they die."""
        self._state = None
        self._starts.release()
        self._buffer.release()
        self._bytes = np.empty(0, dtype=np.uint8)  # arrays still alive keep the map's export (and so the map)
        try:
            self._map.close()
        except BufferError:
            pass

    def __enter__(self) -> SegmentReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _plan(self, descriptor: Any) -> Plan:
        """The read plan of a descriptor number (cached) or of a descriptor carried by the record."""
        if type(descriptor) is int:
            if descriptor < 0:
                raise IndexError(descriptor)
            plan = self._plans[descriptor]
            if plan is None:
                plan = self._plans[descriptor] = Plan(self._descriptors[descriptor])
            return plan
        if isinstance(descriptor, bytes):
            return Plan(descriptor)
        raise TypeError(f"a descriptor is a number or bytes, not {descriptor!r}")

    def key(self, i: int, *, verify: bool = True) -> str:
        """The key of record ``i`` (the record is read, and checked, as ``read`` reads it: for tools and tests)."""
        return str(self.read(i, verify=verify)["__key__"])

    def read(self, i: int, *, verify: bool = True) -> dict[str, Any]:
        """Check record ``i`` (module docstring, "What verifies what") and decode it into a sample dict (class
        docstring: the zero-copy contract). Raises IndexError out of range, CorruptRecordError for a record that
        fails.

        The one path every record is read by, paid per sample by every DataLoader worker: kept to one struct
        unpack, one msgpack call and the plan's views, with no Path, dtype or descriptor work per record.
        """
        if not 0 <= i < self.count:
            raise IndexError(f"record {i} out of range for a segment of {self.count}")
        starts = self._starts
        start = starts[i] << 4
        end = starts[i + 1] << 4 if i + 1 < self.count else self.index_offset
        if start + 16 > end:
            raise CorruptRecordError(f"{self._name}: record {i} out of bounds")
        checksum, length, word = _RECORD_HEADER.unpack_from(self._map, start)
        meta_end = start + 16 + (word & _META_MASK)
        record_end = start + length
        if record_end > end or meta_end > record_end:
            raise CorruptRecordError(f"{self._name}: record {i} has a bad header")
        try:
            descriptor, prefix, suffix, *values = msgpack.unpackb(self._map[start + 16 : meta_end], raw=False)
            plan = self._plans[descriptor] if type(descriptor) is int and descriptor >= 0 else None
            if plan is None:
                plan = self._plan(descriptor)
            if prefix < 0:
                raise IndexError(prefix)
            sample: dict[str, Any] = {"__key__": self._prefixes[prefix] + suffix}
        except _UNREADABLE as exc:
            raise CorruptRecordError(f"{self._name}: record {i} has unreadable metadata ({exc!r})") from exc
        if verify:
            seed = _seed(plan.seed, self._prefix_seeds[prefix], i)
            if xxhash.xxh3_64_intdigest(self._buffer[start + 8 : record_end], seed) != checksum:
                raise CorruptRecordError(
                    f"{self._name}: record {i} failed its checksum (damaged, or not the record written there)"
                )
        flags = word >> 24
        area = meta_end + (-(meta_end - start) % (ALIGN if flags & _FLAG_ALIGN64 else SMALL_ALIGN))
        try:
            if flags & _FLAG_ZLIB:
                raw = self._decompress(i, self._buffer[area:record_end], plan.area_of(values))
                plan.fill(sample, values, raw, 0, len(raw))
            else:
                plan.fill(sample, values, self._bytes, area, record_end - area)
        except _UNREADABLE as exc:
            raise CorruptRecordError(f"{self._name}: record {i} has a malformed field: {exc}") from exc
        return sample

    def length(self, i: int) -> int:
        """Record ``i``'s length in bytes as its header says (unchecked: a hint, such as whether its sample is large);
        0 out of range or past the segment's end."""
        if not 0 <= i < self.count or (self._starts[i] << 4) + 16 > self.index_offset:
            return 0
        return int(_RECORD_HEADER.unpack_from(self._map, self._starts[i] << 4)[1])

    def _decompress(self, i: int, data: memoryview, expected: int) -> npt.NDArray[np.uint8]:
        """A compressed payload area, decompressed into a fresh writable buffer of exactly ``expected`` bytes."""
        try:
            inflater = zlib.decompressobj()
            raw = bytearray(inflater.decompress(data, expected + 1))
        except zlib.error as exc:
            raise CorruptRecordError(f"{self._name}: record {i} does not decompress: {exc}") from exc
        if len(raw) != expected or not inflater.eof:
            raise CorruptRecordError(f"{self._name}: record {i} decompressed to a wrong length")
        return np.frombuffer(raw, dtype=np.uint8)  # an export: the bytearray can never be resized under a view

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.count):
            yield self.read(i)

    def verify_all(self) -> None:
        """Read every record with its checksum and binding checked (``read``, the arrays dropped at once).
        Raises CorruptRecordError on the first failure."""
        for i in range(self.count):
            self.read(i, verify=True)


def read_records(
    readers: Sequence[SegmentReader | None],
    records: Sequence[int],
    position: int,
    out: list[dict[str, Any]],
    *,
    verify: bool = True,
    wrap: Callable[[Any], Any] | None = None,
) -> int:
    """Read record ``records[k]`` of ``readers[k]`` for ``k`` from ``position`` on, appending each sample to ``out``,
    up to the first record this fast path leaves to ``SegmentReader.read``; returns that record's position
    (``len(records)`` once every one was read).

    Why: a batch of small samples costs more in per-record Python than in bytes; here the lookups ``read`` makes per
    call are one tuple per record, and an array becomes ``wrap(array)`` as it is made (``Plan.run_arrays``: with
    ``torch.from_numpy``, what ``dataset.as_tensors`` does), without a second pass over the sample. The path takes
    the common record (uncompressed, its descriptor from the table and fixing every size), checks exactly what
    ``read`` checks and stops, reading nothing of it, at any other record: out of range, compressed, of another
    kind, failing a check, or whose reader is None or closed. The caller reads that one with ``read``, so what it
    returns or raises (``CorruptRecordError``) is the one answer for every record.
    """
    append, total, digest, ndarray = out.append, len(records), xxhash.xxh3_64_intdigest, np.ndarray
    unpack_header, unpack = _RECORD_HEADER.unpack_from, msgpack.unpackb
    try:
        while position < total:
            reader = readers[position]
            state = None if reader is None else reader._state
            if state is None:
                return position
            count, index_offset, starts, records_map, buffer, source, plans, prefixes, prefix_seeds = state
            i = records[position]
            if not 0 <= i < count:
                return position
            start = starts[i] << 4
            end = starts[i + 1] << 4 if i + 1 < count else index_offset
            checksum, length, word = unpack_header(records_map, start)
            meta_end = start + 16 + (word & _META_MASK)
            record_end = start + length
            if start + 16 > end or record_end > end or meta_end > record_end or word >> 24 & _FLAG_ZLIB:
                return position
            meta = unpack(records_map[start + 16 : meta_end], raw=False)
            descriptor, prefix = meta[0], meta[1]
            if type(descriptor) is not int or descriptor < 0 or type(prefix) is not int or prefix < 0:
                return position
            plan = plans[descriptor]
            if plan is None:
                plan = reader._plan(descriptor)  # type: ignore[union-attr]  # state is not None: reader is not
            arrays = plan.run_arrays(wrap)
            names = plan.inline_names
            if arrays is None or names is None or len(meta) != 3 + len(names):
                return position
            key = prefixes[prefix] + meta[2]
            if verify:
                seed = plan.seed ^ prefix_seeds[prefix] ^ ((i + 1) * _GOLDEN & _MASK)  # ``_seed``
                if digest(buffer[start + 8 : record_end], seed) != checksum:
                    return position
            area = meta_end + (-(meta_end - start) % (ALIGN if word >> 24 & _FLAG_ALIGN64 else SMALL_ALIGN))
            if record_end - area != plan.area_len:
                return position
            sample: dict[str, Any] = {"__key__": key}
            if names:
                sample.update(zip(names, meta[3:]))  # noqa: B905 (lengths checked above)
            for name, offset, nbytes, shape, dtype, mode, wrapped, step in arrays:
                at = area + offset
                if mode == SLICE:
                    value = source[at : at + nbytes]
                elif mode == VIEW:
                    value = ndarray(shape, dtype, source, at)
                else:
                    value = payload(step, source, at, shape, nbytes)
                sample[name] = wrap(value) if wrapped else value  # type: ignore[misc]  # wrapped: wrap is set
            append(sample)
            position += 1
    except _UNREADABLE:
        pass  # ``read`` says what is wrong with this record
    return position
