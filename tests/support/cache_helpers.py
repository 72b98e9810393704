"""Helpers for the cache-store tests: a small cache config, the real size of a cache tree, writing until full, and a
segment of an older format.

The self-verifying samples these write are ``cachefeed._testing.samples``.
"""

from __future__ import annotations

import base64
import os
import subprocess
import threading
import zlib
from pathlib import Path
from typing import Any

from cachefeed._cache.settings import CacheConfig
from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._testing.samples import make_sample

# A real segment of format 3 (cachefeed at 1023a54, before the descriptor tables), 320 bytes: one record
# {"__key__": "old/0001", "x": np.arange(4, dtype=np.int32), "label": 3}. What an upgraded daemon finds in a cache.
FORMAT_3_SEGMENT = zlib.decompress(
    base64.b64decode(
        "eNpzdgt2dWdgYGRmIA84BzEzKAHpyR6L26w+9HtMWZGfk6JvYGBgOHHawopFeSkMAottMk0msjQuzUlMSs3BZg8jEDMBMTlucIDSAVBafMamNdvm"
        "T6wl2v0g/7v6uTAjuQUEDkDp31Ln3FsD9TsdoBL6Jx+//vlI+CZMPwDCCyQk"
    )
)


def cache_config(root: Path, **overrides: Any) -> CacheConfig:
    """A small cache for tests. ``evict_after_reads`` is 0 (evict by age, without trainers) because most store
    tests write more than the budget with no reader; the read contract has its own tests (tests/cache/test_reads.py).
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


def tree_bytes(root: Path) -> int:
    """The real size of a cache directory as the budget promises it: allocated bytes of every inode under
    ``root`` (``root`` itself, directories, files, lock files, manifests), each inode once however many hard
    links name it; what ``du -s --block-size=1`` prints. The one helper every test of the size bound uses."""
    seen: dict[tuple[int, int], int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for path in [dirpath, *(os.path.join(dirpath, name) for name in filenames)]:
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue  # removed while we walked
            seen[(info.st_dev, info.st_ino)] = info.st_blocks * 512
        del dirnames  # os.walk lists each directory again as a dirpath: counted there
    return sum(seen.values())


class PeakSize:
    """The largest ``tree_bytes`` of a cache directory seen while the block runs, looked at every ``every_s`` from
    another thread: a witness of the size bound taken from the directory itself while a real daemon churns it."""

    def __init__(self, root: Path, *, every_s: float = 0.02) -> None:
        self.root, self.every_s = root, every_s
        self.peak = 0
        self.looks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-size", daemon=True)

    def __enter__(self) -> PeakSize:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, tree_bytes(self.root))
            self.looks += 1


def du(root: Path) -> int:
    out = subprocess.run(["du", "-s", "--block-size=1", str(root)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


class _Full(Exception):
    """The store asked the writer to wait: the scenario's "writers wait"."""


class _UntilFull:
    """A grant provider that turns the store's "wait" into an exception, so a test can write until it."""

    def __init__(self, store: CacheStore) -> None:
        self.store = store

    def reserve(self, nbytes: int) -> object:
        grant = self.store.reserve(nbytes)
        if grant is None:
            raise _Full
        return grant

    def publish(self, grant: object) -> object:
        return self.store.publish(grant)  # type: ignore[arg-type]

    def abort(self, grant: object) -> None:
        self.store.abort(grant)  # type: ignore[arg-type]


def write_until_full(store: CacheStore, first_key: int, limit: int = 40_000, nbytes: int = 2000) -> int:
    """Write one-sample segments (keys ``k<first_key>``...) until the store refuses a grant; returns the next key."""
    writer = CacheWriter(_UntilFull(store), segment_bytes=store.config.segment_bytes, fsync=False)  # type: ignore[arg-type]
    key = first_key
    try:
        while key < first_key + limit:
            writer.add(make_sample(f"k{key}", nbytes))
            writer.flush()
            key += 1
    except _Full:
        writer.abort()
        return key
    raise AssertionError(f"the store never made writers wait in {limit} segments")
