"""A raw sequential read of files: the storage ceiling the loaders' figures are set against.

Each file is read front to back with ``readinto`` into one reused, page-aligned buffer (``read_buffer``): one copy
out of the page cache, no allocation per read, nothing decoded or checked. A loader that reads the same bytes from
the same filesystem cannot go faster. Used by the peer harness (``measures.sequential_read``, figure 1) and by
``read_throughput.raw_read`` (cachefeed's own segments on tmpfs), so both mean the same read.

Why page-aligned, not a ``bytearray``: a large ``bytearray`` starts 16 bytes into a page (glibc's chunk header),
and the kernel's copy into a destination that is not 64-byte aligned can be several times slower on some CPUs. A
one-off (2026-11-24, 2 shared CPUs, AMD EPYC, kernel 6.18, 256 MiB file on /dev/shm, 1 MiB reads, best of 4):
2.2 GB/s into a ``bytearray`` or into an anonymous map at offset 16, 8.2-8.5 GB/s at offset 0 or 64. The
ceiling is what a careful reader gets, so the buffer is an anonymous map (page-aligned). Earlier committed
results used a ``bytearray``; on the hosts they ran on, the penalty was smaller (their raw reads: 5-12 GB/s).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from pathlib import Path

DEFAULT_BUFFER_BYTES = 1 << 20


def read_buffer(nbytes: int = DEFAULT_BUFFER_BYTES) -> memoryview:
    """A writable, page-aligned buffer of ``nbytes`` for ``read_files`` (an anonymous map)."""
    return memoryview(mmap.mmap(-1, nbytes))


def read_files(paths: Iterable[Path], buffer: memoryview) -> int:
    """Read every file of ``paths``, in order, into ``buffer`` (its size is the read size); return the bytes read."""
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while count := handle.readinto(buffer):
                total += count
    return total
