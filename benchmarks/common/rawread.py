"""A raw sequential read of files: the storage ceiling the loaders' figures are set against.

Each file is read front to back with ``readinto`` into one reused buffer: one copy out of the page cache, no
allocation per read, nothing decoded or checked. A loader that reads the same bytes from the same filesystem
cannot go faster. Used by the peer harness (``measures.sequential_read``, figure 1) and by
``read_throughput.raw_read`` (cachefeed's own segments on tmpfs), so both mean the same read.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

DEFAULT_BUFFER_BYTES = 1 << 20


def read_files(paths: Iterable[Path], buffer: bytearray) -> int:
    """Read every file of ``paths``, in order, into ``buffer`` (its size is the read size); return the bytes read."""
    view = memoryview(buffer)
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while count := handle.readinto(view):
                total += count
    return total
