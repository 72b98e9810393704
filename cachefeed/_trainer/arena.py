"""Batches in shared memory: a worker's arena and the regions it cuts from it.

Each worker of the pool (``pool.py``) collates its batches straight into its own *arena*: one anonymous memory file
(``memfd_create``: on no filesystem, so nothing outlives the processes that map it, whatever kills them) that the
training process maps once, when the pool starts. What crosses the pipe for a batch is then only its layout
(``collate.py``): the training process turns it back into tensors with a few views over its map (no copy, no file
descriptor passed, no page faults: the pages are reused).

Regions are cut first-fit from the arena by the worker (``Allocator``) and given back by the training process once
every tensor over them is gone (a ``weakref`` callback on the region's array, which each tensor's storage holds): a
batch is never overwritten while anyone can read it, however long the caller keeps it. When the arena is full (a
caller that keeps hundreds of batches), the worker sends the batch itself through the pipe instead: slower, never
wrong.

Size: the memfd and both maps are ``reserve`` bytes from the start (sparse: a page costs memory only once written),
and regions are cut only below the arena's *end*, which starts at ``arena_bytes`` and is moved up by the training
process when a batch is too large for the arena (``grown_end``: room for ``slots`` such batches, in a new *span*).
The maps never move, so tensors over the arena stay valid; a region never straddles two spans, because the pinned
memory of each span is registered with CUDA on its own (``pinning.py``).

Layout of the arena: the first ``HEADER_BYTES`` are the worker's control words (``ACK_WORD``: the last ``forget``
ticket the worker has handled, NOTE [ Feed protocol ] in ``pool.py``); regions follow, ``ALIGN``-aligned.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["ACK_WORD", "ALIGN", "HEADER_BYTES", "Allocator", "Arena", "aligned", "grown_end"]

ALIGN = 64  # every tensor in a region starts on a cache line (and on any dtype's alignment)
HEADER_BYTES = 64
ACK_WORD = 0


def aligned(n: int) -> int:
    """``n`` rounded up to ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """One worker's shared memory: ``size`` bytes of a memfd (its reserve: regions are cut only below the end the
    worker's ``Allocator`` was given), mapped ``MAP_SHARED`` by its creator.

    Created by the training process before the worker starts. A forked worker inherits the map; for spawn and
    forkserver the descriptor travels with the process arguments (``multiprocessing.reduction.DupFd``). The file
    is sparse: pages cost memory only once a batch was written to them.
    """

    def __init__(self, size: int, *, fd: int | None = None) -> None:
        self.size = size
        if fd is None:
            fd = os.memfd_create("cachefeed-batches", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd = fd
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        self.words: npt.NDArray[np.int64] = np.frombuffer(self.map, dtype=np.int64, count=HEADER_BYTES // 8)

    def __reduce__(self) -> tuple[Callable[..., Arena], tuple[Any, ...]]:
        return _attach, (reduction.DupFd(self.fd), self.size)

    def view(self, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """``nbytes`` of the arena from ``offset`` as a writable uint8 array (a view: no copy)."""
        return np.frombuffer(self.map, dtype=np.uint8, count=nbytes, offset=offset)

    def close(self) -> None:
        """Drop this process's descriptor (the map lives while arrays over it do)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _attach(dup: Any, size: int) -> Arena:
    return Arena(size, fd=dup.detach())


def grown_end(end: int, widest: int, need: int, slots: int, reserve: int) -> int | None:
    """The new end of an arena that could not place a batch of ``need`` bytes: a new span after ``end`` that holds
    ``slots`` such batches. None where the widest span (``widest`` bytes) already holds them (the arena is full of
    batches the caller keeps, and a larger one would fill up too) or where ``reserve`` does not allow it."""
    room = -(-slots * aligned(max(need, 1)) // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages: each span is
    # page-locked on its own (CUDA locks whole pages: two spans sharing one would refuse the second)
    if widest >= room or end + room > reserve:
        return None
    return end + room


class Allocator:
    """First-fit regions of ``[start, size)``, ``ALIGN``-aligned; ``release`` merges neighbours back, within a span.

    ``grow`` adds a span after the current end; no region is ever cut across the boundary between two spans.
    """

    def __init__(self, start: int, size: int) -> None:
        self._free: list[tuple[int, int]] = [(start, size - start)]  # (offset, length), sorted by offset
        self._bounds: set[int] = set()  # where spans after the first begin
        self.end = size

    def grow(self, end: int) -> None:
        """Add ``[self.end, end)`` as a span of its own (nothing when ``end`` is not beyond the current end)."""
        if end <= self.end:
            return
        self._bounds.add(self.end)
        self._free.append((self.end, end - self.end))  # after every other free region: the list stays sorted
        self.end = end

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a free region of ``nbytes`` (rounded up to ``ALIGN``), or None when none is large enough."""
        need = aligned(max(nbytes, 1))
        for i, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, length - need)
                return offset
        return None

    def release(self, offset: int, nbytes: int) -> None:
        length = aligned(max(nbytes, 1))
        free = self._free
        lo, hi = 0, len(free)
        while lo < hi:
            mid = (lo + hi) // 2
            if free[mid][0] < offset:
                lo = mid + 1
            else:
                hi = mid
        free.insert(lo, (offset, length))
        bounds = self._bounds
        if lo + 1 < len(free) and free[lo][0] + free[lo][1] == free[lo + 1][0] and free[lo + 1][0] not in bounds:
            free[lo] = (offset, length + free[lo + 1][1])
            del free[lo + 1]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == free[lo][0] and offset not in bounds:
            free[lo - 1] = (free[lo - 1][0], free[lo - 1][1] + free[lo][1])
            del free[lo]

    @property
    def free_bytes(self) -> int:
        return sum(length for _offset, length in self._free)
