"""Self-verifying samples and the workloads made of them.

A sample is a ``uint8`` array of ``sample_bytes`` bytes (the workload's size, at least 32)::

    [0:8)    index            uint64 little-endian
    [8:16)   sample_bytes     uint64 little-endian
    [16:24)  checksum         uint64 little-endian: xxh3_64(payload, seed=index)
    [24:)    payload          pseudo-random bytes drawn from a generator seeded with the index

Any reader, in any process, can verify what it got without the dataset at hand: the index says which sample it
is, the checksum says the bytes are the ones written for that index. A sample delivered twice in one epoch, a
torn read, a sample of another workload or a shuffled payload all fail here.

Why not ``cachefeed._testing.samples`` (the tests' and the demo's self-verifying samples): those are cachefeed
samples, a dict whose ``__key__`` names the payload, checked by regenerating the payload from the key. The peer
harness needs a scheme that survives every system's format as bare bytes (an MDS column, a litdata chunk, a
file, one cachefeed record): the identity has to travel inside the bytes (the index, for duplicates and coverage
per epoch), and the check runs in the consumer inside the timed epoch, so it is a hash (xxh3, tens of GB/s), not a
regeneration of the payload (a random generator, about a GB/s, which would dominate the throughput figures).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

HEADER_BYTES = 24
_MIN_SAMPLE_BYTES = 32


class SampleError(ValueError):
    """A sample failed verification: wrong length, wrong size field, wrong index or wrong checksum."""


@dataclass(frozen=True, slots=True)
class Workload:
    """One dataset shape: ``count`` samples of ``sample_bytes`` each, read in batches of ``batch_size``."""

    name: str
    sample_bytes: int
    count: int
    batch_size: int

    def __post_init__(self) -> None:
        if self.sample_bytes < _MIN_SAMPLE_BYTES or self.count < 1 or self.batch_size < 1:
            raise ValueError(f"bad workload {self}: sample_bytes >= 32, count >= 1, batch_size >= 1")

    @property
    def total_bytes(self) -> int:
        return self.sample_bytes * self.count

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "sample_bytes": self.sample_bytes,
            "count": self.count,
            "batch_size": self.batch_size,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Workload:
        return cls(doc["name"], int(doc["sample_bytes"]), int(doc["count"]), int(doc["batch_size"]))


def make_sample(index: int, sample_bytes: int) -> np.ndarray:
    """The one valid sample for ``index`` at this size (deterministic: same bytes in every process)."""
    payload = np.random.default_rng(index).bytes(sample_bytes - HEADER_BYTES)
    header = np.array([index, sample_bytes, xxhash.xxh3_64_intdigest(payload, seed=index)], dtype="<u8").tobytes()
    return np.frombuffer(header + payload, dtype=np.uint8).copy()


def verify_sample(sample: Any, expected_index: int | None = None) -> int:
    """Check one sample (anything exposing the buffer protocol or a ``numpy()`` method); return its index.

    Raises:
        SampleError: if any field or the checksum disagrees.
    """
    buf = memoryview(_as_array(sample)).cast("B")
    if len(buf) < _MIN_SAMPLE_BYTES:
        raise SampleError(f"sample of {len(buf)} bytes is shorter than a header")
    index, size, checksum = np.frombuffer(buf[:HEADER_BYTES], dtype="<u8").tolist()
    if size != len(buf):
        raise SampleError(f"sample {index}: size field {size} but {len(buf)} bytes delivered")
    if expected_index is not None and index != expected_index:
        raise SampleError(f"expected sample {expected_index}, got {index}")
    if xxhash.xxh3_64_intdigest(buf[HEADER_BYTES:], seed=index) != checksum:
        raise SampleError(f"sample {index}: checksum mismatch")
    return int(index)


def verify_batch(batch: Any) -> list[int]:
    """Verify every sample of a batch (a 2-D uint8 tensor/array, or a sequence of samples); return the indices."""
    rows = _as_array(batch)
    if isinstance(rows, np.ndarray) and rows.ndim == 2:
        return [verify_sample(row) for row in rows]
    return [verify_sample(item) for item in batch]


def collate(items: list[Any]) -> Any:
    """The collate function every system's DataLoader uses: samples -> one ``[B, sample_bytes]`` uint8 tensor.

    Accepts numpy arrays, bytes, tensors, or dicts holding one of them under ``"x"`` (the column name the
    converters use), so that every system pays the same collation cost.
    """
    import torch

    arrays = [_as_array(item["x"] if isinstance(item, dict) else item) for item in items]
    return torch.from_numpy(np.stack(arrays))


def sample_path(samples_dir: Path, index: int) -> Path:
    return samples_dir / sample_name(index)


def sample_name(index: int) -> str:
    return f"{index:08d}.bin"


def write_samples(workload: Workload, samples_dir: Path) -> int:
    """Write each sample as its own file (the reference layout every converter reads); return bytes written.

    Idempotent: a directory that already holds every file at the right size is left as it is.
    """
    samples_dir.mkdir(parents=True, exist_ok=True)
    written = 0
    for index in range(workload.count):
        path = sample_path(samples_dir, index)
        if path.exists() and path.stat().st_size == workload.sample_bytes:
            continue
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(make_sample(index, workload.sample_bytes).tobytes())
        tmp.replace(path)
        written += workload.sample_bytes
    return written


def iter_sample_files(samples_dir: Path, count: int) -> Iterator[tuple[int, Path]]:
    for index in range(count):
        yield index, sample_path(samples_dir, index)


def read_sample_file(path: Path) -> np.ndarray:
    return np.frombuffer(path.read_bytes(), dtype=np.uint8)


def _as_array(item: Any) -> Any:
    if isinstance(item, np.ndarray):
        return item
    if isinstance(item, bytes | bytearray | memoryview):
        return np.frombuffer(item, dtype=np.uint8)
    numpy = getattr(item, "numpy", None)
    if callable(numpy):
        return numpy()
    return np.asarray(item, dtype=np.uint8)
