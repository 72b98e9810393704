"""Self-verifying samples: the payload is a pure function of the key, so any reader can check what it got."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from cachefeed.config import CacheConfig


def payload(key: str, nbytes: int) -> np.ndarray:
    seed = xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass"))
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def make_sample(key: str, nbytes: int = 256) -> dict[str, Any]:
    return {"__key__": key, "data": payload(key, nbytes), "n": nbytes}


def check_sample(sample: dict[str, Any]) -> None:
    """Raise AssertionError unless the sample's bytes are exactly those its key implies."""
    data = np.asarray(sample["data"])
    expected = payload(sample["__key__"], int(sample["n"]))
    if data.shape != expected.shape or not np.array_equal(data, expected):
        raise AssertionError(f"sample {sample['__key__']!r} has wrong or partial content")


def cache_config(root: Path, **overrides: Any) -> CacheConfig:
    """A small cache for tests. ``evict_after_reads`` is 0 (evict by age, without trainers) because most store
    tests write more than the budget with no reader; the read contract has its own tests (test_cache_reads.py).
    ``snapshot_grace_s`` is 0 (a dead trainer's snapshot goes at the next sweep): the resume grace has its own."""
    values: dict[str, Any] = {
        "evict_after_reads": 0,
        "snapshot_grace_s": 0.0,
        "dir": root,
        "max_bytes": 16 << 20,
        "min_free_bytes": 0,
        "segment_bytes": 256 << 10,
        "turnover_bytes": 4 << 20,
        "fsync": False,
    }
    values.update(overrides)
    return CacheConfig(**values)


def disk_usage(root: Path) -> int:
    """Real allocated bytes under root, hard links counted once, like `du -s --block-size=1`."""
    total = 0
    seen: set[int] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            try:
                info = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if info.st_ino not in seen:
                seen.add(info.st_ino)
                total += info.st_blocks * 512
    return total


def du(root: Path) -> int:
    out = subprocess.run(["du", "-s", "--block-size=1", str(root)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])
