"""The record and segment format: self-verifying, zero-copy, only an array's own bytes."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from cachefeed.cache.records import SegmentReader, SegmentWriter
from cachefeed.errors import CorruptRecordError


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


@pytest.mark.parametrize("where", ["payload", "meta", "header", "index", "trailer"])
def test_any_flipped_byte_is_detected(tmp_path: Path, where: str) -> None:
    path = tmp_path / "s.seg"
    write_segment(path, [{"__key__": f"k{i}", "data": np.arange(1000, dtype=np.int32)} for i in range(4)])
    with SegmentReader(path) as reader:
        offset, length = int(reader.offsets[2]), int(reader.lengths[2])
        index_at = int(reader.offsets[-1] + reader.lengths[-1])
    position = {
        "payload": offset + length - 200,
        "meta": offset + 70,
        "header": offset + 20,
        "index": index_at + 3,
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
    """Swap two same-length records: checksums pass, but the key check catches the misdirection."""
    path = tmp_path / "s.seg"
    write_segment(path, [{"__key__": f"key-{i}", "data": np.full(64, i, np.uint8)} for i in range(2)])
    with SegmentReader(path) as reader:
        (a, b), length = (int(x) for x in reader.offsets), int(reader.lengths[0])
    raw = bytearray(path.read_bytes())
    raw[a : a + length], raw[b : b + length] = raw[b : b + length], raw[a : a + length]
    path.write_bytes(bytes(raw))
    with SegmentReader(path) as reader, pytest.raises(CorruptRecordError, match="another key"):
        reader.read(0)


def test_capacity_is_never_exceeded_except_by_a_lone_oversized_record(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path / "s.seg", capacity=64 << 10)
    accepted = 0
    while writer.append(writer.encode({"__key__": f"k{accepted}", "data": np.zeros(1000, np.uint8)})):
        accepted += 1
    assert writer.finish(fsync=False) <= 64 << 10 and accepted > 10
    big = SegmentWriter(tmp_path / "big.seg", capacity=4096)
    record = big.encode({"__key__": "big", "data": np.zeros(100_000, np.uint8)})
    assert big.append(record)  # the first record is always accepted
    assert big.finish(fsync=False) == SegmentWriter.size_for(record.nbytes)


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
    sources = [("bucket/a.npy", '"etag-1"'), ("bucket/\u00e9 \u0000 odd", None), ("bucket/z", "")]
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
    bytes per record (64-byte headers and alignment for everything); format 3 takes 1,128: 10% over the vector,
    index included. Small arrays are 16-byte aligned, arrays of 4 KiB or more 64-byte aligned."""
    samples = [
        {"__key__": f"train/shard-{i // 1000:04d}.msgpack#{i % 1000}", "x": np.ones(256, np.float32), "label": i % 10,
         "id": i}
        for i in range(1000)
    ]  # fmt: skip
    size = write_segment(tmp_path / "s.seg", samples)
    assert size / len(samples) <= 1130, f"{size / len(samples):.0f} bytes per record"
    with SegmentReader(tmp_path / "s.seg") as reader:
        got = reader.read(7)
        assert got["x"].ctypes.data % 16 == 0 and got["label"] == 7 and got["id"] == 7
    write_segment(tmp_path / "big.seg", [{"__key__": f"k{i}", "a": np.ones(3, np.uint8), "b": np.ones(4096, np.uint8)}
                                         for i in range(3)])  # fmt: skip
    with SegmentReader(tmp_path / "big.seg") as reader:
        assert all(reader.read(i)["b"].ctypes.data % 64 == 0 for i in range(3))
