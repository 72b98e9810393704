"""Self-verifying samples, and the ``.npy`` objects the tests and benchmarks upload.

A self-verifying sample's payload is a pure function of its key (:func:`payload`), so any reader, in any process,
checks what it got with :func:`check_sample` without the writer at hand: a torn read, a sample of another key or
stale bytes all fail.

The peer benchmarks carry their own scheme (``benchmarks/common/samples.py``: bare bytes with the index and an xxh3
checksum inside, for formats that keep no key and checks inside a timed loop); its docstring says why.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from cachefeed._cache.records import SegmentReader

__all__ = ["cache_samples", "check_sample", "make_sample", "npy_bytes", "payload", "upload_arrays"]


def payload(key: str, nbytes: int) -> npt.NDArray[np.uint8]:
    """The ``nbytes`` bytes that belong to ``key``: drawn from a generator seeded with the key's xxh3."""
    seed = xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass"))
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def make_sample(key: str, nbytes: int = 256) -> dict[str, Any]:
    """A sample ``{"__key__", "data", "n"}`` whose ``data`` is :func:`payload` of its key."""
    return {"__key__": key, "data": payload(key, nbytes), "n": nbytes}


def check_sample(sample: dict[str, Any]) -> None:
    """Raise AssertionError unless the sample's bytes are exactly those its key implies."""
    data = np.asarray(sample["data"])
    expected = payload(sample["__key__"], int(sample["n"]))
    if data.shape != expected.shape or not np.array_equal(data, expected):
        raise AssertionError(f"sample {sample['__key__']!r} has wrong or partial content")


def npy_bytes(array: npt.NDArray[Any]) -> bytes:
    """``array`` as the bytes of a ``.npy`` file (no pickle)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def upload_arrays(
    client: Any, bucket: str, count: int, nbytes: int, *, prefix: str = "", start: int = 0, seed: int = 0
) -> dict[str, npt.NDArray[np.uint8]]:
    """Put ``count`` .npy objects of ``nbytes`` uint8 each; returns ``{key: array}``: the samples' ``__key__`` when
    the daemon reads ``s3://bucket/`` (keys are relative to the source's URL)."""
    rng = np.random.default_rng(seed + start)
    uploaded = {}
    for i in range(start, start + count):
        array = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
        key = f"{prefix}obj-{i:05d}.npy"
        client.put_object(Bucket=bucket, Key=key, Body=npy_bytes(array))
        uploaded[key] = array
    return uploaded


def cache_samples(cache_dir: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (segment name, sample) in the published segments, each segment verified first."""
    for path in sorted((cache_dir / "segments").glob("*.seg")):
        try:
            reader = SegmentReader(path)
        except FileNotFoundError:
            continue  # evicted while we looked
        with reader:
            reader.verify_all()
            for i in range(reader.count):
                sample = reader.read(i)
                yield path.name, {k: (np.array(v) if isinstance(v, np.ndarray) else v) for k, v in sample.items()}
