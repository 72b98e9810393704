"""The bytes a writer produces are the format itself: a faster writer must write every segment byte for byte as
the writer did when these digests were taken (at 296dd76, before the write path was made cheaper).

The samples cover every branch of the write path: dtypes (datetime64 and structured ones among them) and shapes, an
array that changes shape mid-segment (the loose descriptor), keys with and without shared prefixes, long keys,
inline values, bytes and str on both sides of ``INLINE_LIMIT``, 0-d, empty and non-contiguous arrays, torch tensors,
more field sets than ``MAX_DESCRIPTORS`` and more key prefixes than ``MAX_PREFIXES``, records that do not fit and
start the next segment, and zlib compression. Every record is also read back and compared with its sample.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from cachefeed._cache.descriptors import INLINE_LIMIT
from cachefeed._cache.records import (
    MAX_DESCRIPTORS,
    MAX_PREFIXES,
    RecordEncoder,
    SegmentReader,
    SegmentWriter,
    source_bytes,
)


def _data(n: int, dtype: Any, salt: int) -> np.ndarray:
    """Deterministic bytes whatever the numpy version (no random generator)."""
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + salt) % 251).astype(dtype)


def varied_samples() -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    # a run of tar-like samples: one exact descriptor, keys sharing a prefix, the url as an inline str
    for i in range(40):
        samples.append(
            {"x": _data(4096, np.uint8, i), "__key__": f"{i:08d}", "__url__": "s3://bench/tar/shard-00003.tar"}
        )
    # several dtypes and shapes, inline values of every kind, blobs on both sides of the inline limit
    for i in range(30):
        samples.append(
            {
                "__key__": f"train/shard-{i // 7:04d}.msgpack#{i}",
                "image": _data(3 * 8 * 8, np.float32, i).reshape(3, 8, 8),
                "label": i % 10,
                "score": i / 7,
                "flag": i % 2 == 0,
                "none": None,
                "meta": {"id": i, "tags": ["a", "b"][: i % 3]},
                "small_bytes": bytes(range(i % 50)),
                "big_bytes": bytes(_data(INLINE_LIMIT + 1 + i, np.uint8, i)),
                "edge_str": "s" * INLINE_LIMIT,
                "big_str": "é" * (INLINE_LIMIT + i),
                "scalar": _data(1, np.int64, i).reshape(()),  # 0-d
                "np_scalar": np.float64(i) / 3,
                "empty": np.zeros((0, 3), np.int16),
                "strided": _data(64, np.int32, i).reshape(8, 8)[:, ::2],  # not contiguous
                "be": _data(5, ">u4", i),
                "when": _data(3, np.int64, i).astype("M8[s]"),  # no buffer protocol export: numpy's view
                "pair": _data(4, np.int32, i).view([("a", "<i2"), ("b", "<i2")]),
                "half": _data(6, np.float16, i),
                "mask": _data(7, np.uint8, i) > 100,
            }
        )
    # a shape change mid-segment: from here the loose descriptor
    for i in range(12):
        samples.append({"__key__": f"var/{i}", "v": _data(10 + i % 3, np.float64, i), "id": i})
    # torch tensors, bfloat16 among them
    for i in range(6):
        samples.append(
            {
                "__key__": f"pt/{i}",
                "t": torch.arange(12 + i, dtype=torch.float32),
                "h": torch.arange(8, dtype=torch.bfloat16).reshape(2, 4) * i,
            }
        )
    # long keys, and keys sharing nothing
    for i in range(30):
        key = f"{'p' * (i % 5)}{i:05d}/{'long' * (i % 40)}/item" if i % 3 else f"{i * 7919 % 1000:03d}"
        samples.append({"__key__": key, "a": _data(16, np.uint16, i)})
    # pairs of keys with a prefix of their own: the second of each adds one, past MAX_PREFIXES
    for i in range(MAX_PREFIXES + 10):
        for j in range(2):
            samples.append({"__key__": f"{chr(65 + i % 26)}{i:04d}-group/{j}", "n": i})
    # more field sets than the descriptor table holds
    for i in range(MAX_DESCRIPTORS + 10):
        samples.append({"__key__": f"d/{i}", f"f{i}": _data(4, np.int8, i), "n": i})
    # a large sample (64-aligned payloads) between small ones
    samples.append({"__key__": "large/0", "big": _data(100_000, np.uint8, 5), "tail": _data(3, np.uint8, 1)})
    return samples


def write_all(directory: Path, samples: list[dict[str, Any]], *, capacity: int, compression: str) -> list[Path]:
    """Write ``samples`` as ``CacheWriter`` does: a sample that does not fit finishes the segment and starts the
    next; a source is named after every 50th sample, with room kept for it."""
    encoder = RecordEncoder(compression=compression)
    paths: list[Path] = []
    writer = None
    for i, sample in enumerate(samples):
        record = encoder.encode(sample)
        if writer is None or not writer.append(record):
            if writer is not None:
                writer.finish(fsync=False)
            paths.append(directory / f"{len(paths):03d}.seg")
            size = max(capacity, SegmentWriter.size_for(record.nbytes))
            writer = SegmentWriter(paths[-1], capacity=size, source=7, compression=compression)
            writer.source_room = source_bytes("s3://bench/object", "v1")
            assert writer.append(record)
        if i % 50 == 49:
            writer.add_source("s3://bench/object", "v1", i)
    assert writer is not None
    writer.finish(fsync=False)
    return paths


def assert_same(got: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and torch.equal(got, expected)
    elif isinstance(expected, np.ndarray) and expected.dtype.names:  # the format keeps a dtype's str: void records
        assert got.dtype == np.dtype(expected.dtype.str) and got.tobytes() == expected.tobytes()
    elif isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
    elif isinstance(expected, bytes | str | int | float | bool | type(None) | dict | np.generic):
        assert got == expected
    else:  # pragma: no cover - a sample kind this test does not know
        raise AssertionError(type(expected))


# xxh3-64 and size of every segment file, taken from the writer at 296dd76. To change the samples, take them again
# with that writer, never with the code under test: ``git archive 296dd76 cachefeed | tar -x -C /tmp/old``, then run
# ``write_all`` with /tmp/old ahead of this checkout on sys.path (a change of format takes new digests on purpose).
EXPECTED_PLAIN = [
    (15261911360926865521, 96000),
    (10300836797883755335, 97664),
    (5941426929353854993, 79104),
    (3536390608129985363, 100288),
]
EXPECTED_ZLIB = [(15228476901677289390, 91584)]
ZLIB_VERSION = "1.2.13"  # the zlib the compressed digests were taken with (another zlib may compress differently)


@pytest.mark.parametrize("compression", ["none", "zlib"])
def test_segments_written_are_byte_for_byte_the_format_of_record(tmp_path: Path, compression: str) -> None:
    samples = varied_samples()
    paths = write_all(tmp_path, samples, capacity=96 << 10, compression=compression)
    digests = [(xxhash.xxh3_64_intdigest(path.read_bytes()), path.stat().st_size) for path in paths]
    got = iter(samples)
    tables = []
    for path in paths:
        with SegmentReader(path) as reader:
            reader.verify_all()
            tables.append((len(reader._descriptors), len(reader._prefixes)))
            for i in range(reader.count):
                record, sample = reader.read(i), next(got)
                assert record.keys() == sample.keys()
                for name, value in sample.items():
                    assert_same(record[name], value)
    assert next(got, None) is None
    # the samples reach what they are meant to: full tables, and (uncompressed) segments cut by a record
    assert (MAX_DESCRIPTORS, MAX_PREFIXES) in tables and (compression == "zlib" or len(paths) > 1)
    if compression == "none":
        assert digests == EXPECTED_PLAIN
    elif zlib.ZLIB_RUNTIME_VERSION == ZLIB_VERSION:
        assert digests == EXPECTED_ZLIB
    else:  # pragma: no cover - the records read back above; only the compressed bytes may differ
        pytest.skip(f"compressed digests were taken with zlib {ZLIB_VERSION}, this is {zlib.ZLIB_RUNTIME_VERSION}")
