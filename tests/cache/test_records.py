"""The record and segment format: self-verifying, zero-copy, only an array's own bytes."""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import xxhash

from cachefeed._cache import records
from cachefeed._cache.records import (
    MAX_DESCRIPTORS,
    MAX_PREFIXES,
    SegmentReader,
    SegmentWriter,
    Source,
    segment_count,
    segment_trailer,
    source_bytes,
)
from cachefeed._errors import CorruptRecordError
from tests.support.cache_helpers import FORMAT_3_SEGMENT


def write_segment(path: Path, samples: list[dict], **kwargs) -> int:
    writer = SegmentWriter(path, capacity=1 << 30, **kwargs)
    for sample in samples:
        assert writer.append(writer.encode(sample))
    return writer.finish(fsync=False)


def test_round_trip_of_every_field_kind(tmp_path: Path) -> None:
    sample = {
        "__key__": "a/b/0001.npy",
        "data": np.arange(12, dtype=np.float32).reshape(3, 4),
        "tensor": torch.arange(5, dtype=torch.bfloat16),
        "label": 7,
        "score": 0.5,
        "name": "x" * 1000,
        "short": "y",
        "blob": b"\x00\xff" * 300,
        "tiny": b"ab",
        "none": None,
        "meta": {"a": [1, 2]},
        "empty": np.zeros((0, 3), dtype=np.int64),
    }
    write_segment(tmp_path / "s.seg", [sample])
    with SegmentReader(tmp_path / "s.seg") as reader:
        got = reader.read(0)
    assert got["__key__"] == sample["__key__"]
    np.testing.assert_array_equal(got["data"], sample["data"])
    assert got["data"].dtype == np.float32 and got["data"].shape == (3, 4)
    assert torch.equal(got["tensor"], sample["tensor"]) and got["tensor"].dtype == torch.bfloat16
    for name in ("label", "score", "name", "short", "blob", "tiny", "none", "meta"):
        assert got[name] == sample[name], name
    assert got["empty"].shape == (0, 3)


def test_arrays_are_views_of_the_memory_map_not_copies(tmp_path: Path) -> None:
    write_segment(tmp_path / "s.seg", [{"__key__": f"k{i}", "data": np.full(100_000, i, np.uint8)} for i in range(3)])
    reader = SegmentReader(tmp_path / "s.seg")
    array = reader.read(1)["data"]
    start = ctypes.addressof(ctypes.c_char.from_buffer(reader._map))
    address = array.ctypes.data
    assert start <= address < start + reader.size, "the array must point into the mapping"
    assert address % 64 == 0, "arrays are 64-byte aligned"
    assert array.flags.writeable  # copy-on-write: writable without touching the file
    tensor = torch.from_numpy(array)
    assert tensor.data_ptr() == address
    array[0] = 99
    with SegmentReader(tmp_path / "s.seg") as fresh:
        assert fresh.read(1)["data"][0] == 1, "writes to a served array never reach the file"


def test_a_slice_of_a_large_array_stores_only_the_slice(tmp_path: Path) -> None:
    base = np.zeros((1000, 1000), dtype=np.float64)  # 8 MB
    size_slice = write_segment(tmp_path / "a.seg", [{"__key__": "s", "data": base[10:12, ::10]}])
    tensor_base = torch.zeros(1_000_000)
    size_tensor = write_segment(tmp_path / "b.seg", [{"__key__": "t", "data": tensor_base[5:105]}])
    assert size_slice < 4096 and size_tensor < 4096
    with SegmentReader(tmp_path / "a.seg") as reader:
        np.testing.assert_array_equal(reader.read(0)["data"], base[10:12, ::10])


def test_compressed_records_round_trip(tmp_path: Path) -> None:
    data = np.zeros(1 << 20, dtype=np.uint8)
    size = write_segment(tmp_path / "z.seg", [{"__key__": "z", "data": data}], compression="zlib")
    assert size < 64 << 10
    with SegmentReader(tmp_path / "z.seg") as reader:
        np.testing.assert_array_equal(reader.read(0)["data"], data)


@pytest.mark.parametrize("where", ["payload", "meta", "checksum", "length", "index", "tables", "trailer"])
def test_any_flipped_byte_is_detected(tmp_path: Path, where: str) -> None:
    path = tmp_path / "s.seg"
    write_segment(path, [{"__key__": f"k{i}", "data": np.arange(1000, dtype=np.int32)} for i in range(4)])
    with SegmentReader(path) as reader:
        offset, length = int(reader.offsets[2]), int(reader.lengths[2])
        index_at = reader.index_offset
    position = {
        "payload": offset + length - 200,
        "meta": offset + 18,
        "checksum": offset + 3,
        "length": offset + 9,
        "index": index_at + 9,  # record 2's start
        "tables": index_at + 16 + 5,  # a descriptor in the tables after the 4 starts
        "trailer": os.path.getsize(path) - 40,
    }[where]
    raw = bytearray(path.read_bytes())
    raw[position] ^= 0x41
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptRecordError):
        reader = SegmentReader(path)
        reader.read(2)


def test_a_truncated_or_partial_segment_is_rejected_at_open(tmp_path: Path) -> None:
    path = tmp_path / "s.seg"
    write_segment(path, [{"__key__": "k", "data": np.arange(1000)}])
    full = path.read_bytes()
    for cut in (10, 100, len(full) // 2, len(full) - 1):
        path.write_bytes(full[:cut])
        with pytest.raises(CorruptRecordError):
            SegmentReader(path)
    writer = SegmentWriter(tmp_path / "unfinished.seg", capacity=1 << 20)
    writer.append(writer.encode({"__key__": "k", "data": np.arange(10)}))
    writer._file.flush()
    with pytest.raises(CorruptRecordError):
        SegmentReader(tmp_path / "unfinished.seg")
    writer.abort()


def test_a_record_moved_under_another_index_entry_is_detected(tmp_path: Path) -> None:
    """Swap two same-length records, each intact: the checksum is seeded with the record's position, so neither
    reads at the other's (it would be another key's sample served for this index entry)."""
    path = tmp_path / "s.seg"
    write_segment(path, [{"__key__": f"key-{i}", "data": np.full(64, i, np.uint8)} for i in range(2)])
    with SegmentReader(path) as reader:
        (a, b), length = (int(x) for x in reader.offsets), int(reader.lengths[0])
        assert reader.key(0) == "key-0" and reader.key(1) == "key-1"
    raw = bytearray(path.read_bytes())
    raw[a : a + length], raw[b : b + length] = raw[b : b + length], raw[a : a + length]
    path.write_bytes(bytes(raw))
    with SegmentReader(path) as reader:
        for i in range(2):
            with pytest.raises(CorruptRecordError, match="not the record written there"):
                reader.read(i)
        with pytest.raises(CorruptRecordError):
            reader.verify_all()


def test_capacity_is_never_exceeded_except_by_a_lone_oversized_record(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path / "s.seg", capacity=64 << 10)
    accepted = 0
    while writer.append(writer.encode({"__key__": f"k{accepted}", "data": np.zeros(1000, np.uint8)})):
        accepted += 1
    assert writer.finish(fsync=False) <= 64 << 10 and accepted > 10
    big = SegmentWriter(tmp_path / "big.seg", capacity=4096)
    record = big.encode({"__key__": "big", "data": np.zeros(100_000, np.uint8)})
    assert big.append(record)  # the first record is always accepted
    bound = SegmentWriter.size_for(record.nbytes)
    assert bound - 256 <= big.finish(fsync=False) <= bound


def test_bad_samples_are_refused_with_a_clear_error(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path / "s.seg", capacity=1 << 20)
    with pytest.raises(TypeError, match="__key__"):
        writer.encode({"data": np.zeros(3)})
    with pytest.raises(TypeError, match="object arrays"):
        writer.encode({"__key__": "k", "data": np.array([object()])})
    with pytest.raises(TypeError, match="cannot cache a field of type"):
        writer.encode({"__key__": "k", "data": object()})
    writer.abort()
    assert not (tmp_path / "s.seg").exists()


def test_sources_round_trip_and_are_covered_by_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "s.seg"
    writer = SegmentWriter(path, capacity=1 << 20)
    assert writer.append(writer.encode({"__key__": "k", "x": np.arange(4)}))
    sources = [Source("bucket/a.npy", '"etag-1"'), Source("bucket/\u00e9 \u0000 odd", None), Source("bucket/z", "", 7)]
    for source in sources:
        assert writer.add_source(*source)
    expected = writer.nbytes
    assert writer.finish(fsync=False) == path.stat().st_size <= expected
    with SegmentReader(path) as reader:
        assert reader.sources() == sources
        assert reader.read(0)["__key__"] == "k"
    raw = bytearray(path.read_bytes())
    at = raw.index(b"etag-1")
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptRecordError, match="checksum"):
        SegmentReader(path)


def test_a_source_that_does_not_fit_is_left_out_and_capacity_holds(tmp_path: Path) -> None:
    path = tmp_path / "s.seg"
    record_writer = SegmentWriter(tmp_path / "probe.seg", capacity=1 << 20)
    record = record_writer.encode({"__key__": "k", "x": np.zeros(1000, np.uint8)})
    record_writer.abort()
    capacity = SegmentWriter.size_for(record.nbytes) + 200
    writer = SegmentWriter(path, capacity=capacity)
    assert writer.append(record)
    added = [writer.add_source(f"bucket/object-{i:04d}", "v") for i in range(20)]
    assert added[0] and not all(added)  # some fit, the rest are left out
    assert writer.nbytes <= capacity
    assert writer.finish(fsync=False) == path.stat().st_size <= capacity
    with SegmentReader(path) as reader:
        assert len(reader.sources()) == added.count(True)


def test_a_segment_without_sources_has_none(tmp_path: Path) -> None:
    write_segment(tmp_path / "s.seg", [{"__key__": "k"}])
    with SegmentReader(tmp_path / "s.seg") as reader:
        assert reader.sources() == []


def test_small_samples_cost_little_beyond_their_payload(tmp_path: Path) -> None:
    """A 1 KiB float32 feature vector, an int label and an int id under a 30-character key: format 2 took 1,240
    bytes per record (64-byte headers and alignment for everything), format 3 1,128 (the key and the field
    descriptors in every record, 24 bytes of index); format 4 takes 1,060: 3.5% over the vector, index and tables
    included, for ids of 1 to 5 bytes of msgpack alike. Small arrays are 16-byte aligned, arrays of 4 KiB or more
    64-byte aligned."""
    for first_id in (0, 10**6):
        samples = [
            {"__key__": f"train/shard-{i // 1000:04d}.msgpack#{i % 1000}", "x": np.ones(256, np.float32),
             "label": i % 10, "id": first_id + i}
            for i in range(1000)
        ]  # fmt: skip
        size = write_segment(tmp_path / "s.seg", samples)
        assert size / len(samples) <= 1075, f"{size / len(samples):.0f} bytes per record"
        with SegmentReader(tmp_path / "s.seg") as reader:
            got = reader.read(7)
            assert got["x"].ctypes.data % 16 == 0 and got["label"] == 7 and got["id"] == first_id + 7
        os.unlink(tmp_path / "s.seg")
    write_segment(tmp_path / "big.seg", [{"__key__": f"k{i}", "a": np.ones(3, np.uint8), "b": np.ones(4096, np.uint8)}
                                         for i in range(3)])  # fmt: skip
    with SegmentReader(tmp_path / "big.seg") as reader:
        assert all(reader.read(i)["b"].ctypes.data % 64 == 0 for i in range(3))


def test_arrays_read_are_writable_contiguous_and_keep_their_shape(tmp_path: Path) -> None:
    """What the dataset relies on without checking each sample: writable, C-contiguous arrays, 0-d kept 0-d."""
    sample = {"__key__": "k", "scalar": np.array(3.5), "grid": np.arange(6, dtype=">i2").reshape(2, 3).T,
              "bytes": np.arange(300, dtype=np.uint8), "t0": torch.tensor(7)}  # fmt: skip
    for compression in ("none", "zlib"):
        write_segment(tmp_path / f"{compression}.seg", [sample], compression=compression)
        with SegmentReader(tmp_path / f"{compression}.seg") as reader:
            got = reader.read(0)
        assert got["scalar"].shape == () and got["scalar"] == 3.5 and got["t0"].shape == () and int(got["t0"]) == 7
        np.testing.assert_array_equal(got["grid"], sample["grid"])
        assert got["grid"].dtype == np.dtype(">i2")
        for name in ("scalar", "grid", "bytes"):
            assert got[name].flags.writeable and got[name].flags.c_contiguous, (compression, name)


def rewrite_tables(path: Path, edit: Callable[[list[bytes], list[str]], None]) -> None:
    """Rewrite a segment's tables with ``edit(descriptors, prefixes)`` and make its index and trailer checksums
    agree again: what a bug, not a damaged disk, would leave (the index checksum cannot tell)."""
    raw = path.read_bytes()
    magic, version, flags, source, count, index_offset, _hash, _len, _own = records._TRAILER.unpack_from(
        raw, len(raw) - 64
    )
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(raw[index_offset + 4 * count : len(raw) - 64])
    descriptors, prefixes = unpacker.unpack()
    assert not raw[index_offset + 4 * count + unpacker.tell() : len(raw) - 64].strip(b"\x00"), "no sources here"
    edit(descriptors, prefixes)
    region = raw[index_offset : index_offset + 4 * count] + msgpack.packb([descriptors, prefixes], use_bin_type=True)
    region += bytes(-len(region) % 64)
    file_len = index_offset + len(region) + 64
    body = records._TRAILER.pack(
        magic, version, flags, source, count, index_offset, xxhash.xxh3_64_intdigest(region), file_len, 0
    )[:-8]
    trailer = body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    path.write_bytes(raw[:index_offset] + region + trailer + bytes(64 - len(trailer)))


def test_a_changed_descriptor_is_a_corrupt_record_never_a_wrong_sample(tmp_path: Path) -> None:
    path = tmp_path / "s.seg"
    write_segment(path, [{"__key__": f"k{i}", "x": np.full(256, i, np.float32), "label": i} for i in range(5)])

    def change(field: int, to: object) -> Callable[[list[bytes], list[str]], None]:
        def edit(descriptors: list[bytes], prefixes: list[str]) -> None:
            fields = msgpack.unpackb(descriptors[0])
            fields[0][field] = to
            descriptors[0] = msgpack.packb(fields)

        return edit

    rewrite_tables(path, change(2, "<i4"))  # another dtype of the same size: only the binding tells
    with SegmentReader(path) as reader:
        for i in range(5):
            with pytest.raises(CorruptRecordError, match="checksum"):
                reader.read(i)
    rewrite_tables(path, change(3, [255]))  # another shape: the record's size tells, verified or not
    with SegmentReader(path) as reader:
        for verify in (True, False):
            with pytest.raises(CorruptRecordError):
                reader.read(1, verify=verify)
    rewrite_tables(path, lambda descriptors, prefixes: descriptors.clear())
    with SegmentReader(path) as reader, pytest.raises(CorruptRecordError, match="metadata"):
        reader.read(0, verify=False)


def test_a_changed_key_prefix_is_a_corrupt_record_never_another_key(tmp_path: Path) -> None:
    path = tmp_path / "s.seg"
    keys = [f"train/shard-0000.msgpack#{i}" for i in range(5)]
    write_segment(path, [{"__key__": key, "x": np.full(8, i, np.uint8)} for i, key in enumerate(keys)])
    with SegmentReader(path) as reader:
        assert [reader.key(i) for i in range(5)] == keys
        assert reader._prefixes == ["", "train/shard-0000.msgpack#"]  # the first key is whole in its record
    rewrite_tables(path, lambda descriptors, prefixes: prefixes.__setitem__(1, "train/shard-0001.msgpack#"))
    with SegmentReader(path) as reader:
        assert reader.read(0)["__key__"] == keys[0]
        for i in range(1, 5):
            with pytest.raises(CorruptRecordError, match="checksum"):
                reader.read(i)
        # without verification the tables are trusted (the index checksum vouched for them at open)
        assert reader.key(1, verify=False) == "train/shard-0001.msgpack#1"


def test_records_whose_arrays_change_shape_share_one_loose_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "s.seg"
    samples = [
        {"__key__": f"doc-{i}", "tokens": np.arange(i % 7 + 1, dtype=np.int32), "mask": np.ones((2, 3), bool),
         "text": "é" * (300 + i), "n": i}
        for i in range(100)
    ]  # fmt: skip
    size = write_segment(path, samples)
    with SegmentReader(path) as reader:
        assert len(reader._descriptors) == 2  # the first record's exact one; the loose one from the second shape
        for i, sample in enumerate(samples):
            got = reader.read(i)
            np.testing.assert_array_equal(got["tokens"], sample["tokens"])
            np.testing.assert_array_equal(got["mask"], sample["mask"])
            assert got["text"] == sample["text"] and got["n"] == i and got["__key__"] == sample["__key__"]
    payload = sum(s["tokens"].nbytes + 6 + len(s["text"].encode()) for s in samples)
    assert size / payload < 1.15


def test_more_field_sets_than_the_descriptor_table_holds_still_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "s.seg"
    samples = [{"__key__": f"k{i}", f"field{i}": np.full(3, i, np.int16), "n": i} for i in range(MAX_DESCRIPTORS + 20)]
    write_segment(path, samples, compression="zlib")
    with SegmentReader(path) as reader:
        assert len(reader._descriptors) == MAX_DESCRIPTORS  # the rest carry their own
        for i in range(len(samples)):
            got = reader.read(i)
            np.testing.assert_array_equal(got[f"field{i}"], samples[i][f"field{i}"])
            assert list(got) == ["__key__", "n", f"field{i}"]
        reader.verify_all()


def test_keys_round_trip_whatever_they_share(tmp_path: Path) -> None:
    path = tmp_path / "s.seg"
    keys = ["", "a", "", "ab", "abc/def/0001", "abc/def/0002", "abc/deg", "abc", "\x00nul", "é/ü/\u4e2d/1",
            "é/ü/\u4e2d/2", "x" * 1000, "x" * 999 + "y"]  # fmt: skip
    keys += [f"{i:04d}-shard/{j}" for i in range(MAX_PREFIXES) for j in range(2)]  # a new prefix every 2 keys
    write_segment(path, [{"__key__": key} for key in keys])
    with SegmentReader(path) as reader:
        assert len(reader._prefixes) == MAX_PREFIXES
        assert [reader.key(i) for i in range(len(keys))] == keys
        assert [reader.read(i)["__key__"] for i in range(len(keys))] == keys
        reader.verify_all()


def test_the_writer_knows_the_size_of_the_file_it_will_finish(tmp_path: Path) -> None:
    """``nbytes`` and ``fits`` count the tables exactly: what the grant of a segment relies on."""
    writer = SegmentWriter(tmp_path / "s.seg", capacity=1 << 30)
    for i in range(3 * MAX_DESCRIPTORS):
        sample = {"__key__": f"{'ab'[i % 2]}/{i:05d}", "x": np.zeros(i % 5 + 1, np.float64), f"f{i % 80}": i}
        assert writer.append(writer.encode(sample))
    expected = writer.nbytes
    assert writer.finish(fsync=False) == expected == (tmp_path / "s.seg").stat().st_size


def test_a_segment_of_an_older_format_is_refused_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "old.seg"
    path.write_bytes(FORMAT_3_SEGMENT)
    with pytest.raises(CorruptRecordError, match="format 3"):
        SegmentReader(path)
    assert segment_trailer(path) == (-1, 0) and segment_count(path) == -1


def test_room_kept_for_a_source_always_fits_its_name_however_full_the_segment() -> None:
    """A segment is cut because the next record did not fit: what is left may be too small to name the object being
    written. With ``source_room``, its name (with a cut) always fits; without, some capacities leave it out."""
    import tempfile

    path_name, version = "bucket/shards/shard-000123.tar", '"0123456789abcdef0123456789abcdef"'
    fitted: dict[int, list[bool]] = {0: [], source_bytes(path_name, version): []}
    with tempfile.TemporaryDirectory() as tmp:
        probe = SegmentWriter(Path(tmp) / "probe.seg", capacity=1 << 20)
        record = probe.encode({"__key__": "k", "x": np.zeros(1000, np.uint8)})
        probe.abort()
        base = SegmentWriter.size_for(record.nbytes)
        for room, results in fitted.items():
            for extra in range(0, 1200, 7):
                writer = SegmentWriter(Path(tmp) / f"s-{room}-{extra}.seg", capacity=2 * base + extra)
                writer.source_room = room
                while writer.append(record):
                    pass
                results.append(writer.add_source(path_name, version, 2**40))
                writer.abort()
    assert all(fitted[source_bytes(path_name, version)]), "with room kept, the name always fits"
    assert not all(fitted[0]), "without it, some capacities leave the name out (the test would show nothing)"
