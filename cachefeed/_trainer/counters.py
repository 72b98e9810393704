"""Counters that DataLoader worker processes add to and the training process reads: one small shared memory area.

Workers cannot return side information with their batches without changing what the user's collate function
sees, and ``multiprocessing.Value`` objects only travel to workers created by the same context. Instead the owner
creates an anonymous memory file (``memfd_create``: nothing on disk, so nothing is left behind even if the
process is SIGKILLed) of ``int64`` slots and maps it ``MAP_SHARED``. A forked worker inherits the mapping; a
spawned or forkserver worker receives only ``(owner pid, fd number)`` and opens ``/proc/<pid>/fd/<fd>``, which
works while the owner lives (always the case for its DataLoader workers). If it cannot be opened, counts are kept
in that process only (``add`` never fails: counting must not stop a reader).

Invariant: each slot has exactly one writer (slot 0: the process that owns the counters, i.e. a DataLoader with
``num_workers=0``; slot ``1 + worker_id``: that worker), so increments need no lock; an aligned 8-byte store is
atomic on the platforms torch supports, so a reader sees each slot's old or new value, never a torn one.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["SlotCounters"]

_SLOT_BYTES = 8


class SlotCounters:
    """``slots`` shared ``int64`` counters owned by the creating process (see the module docstring).

    Picklable: the owner's pid and the descriptor number travel, never the map.
    """

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self._owner = os.getpid()
        self._fd: int | None = os.memfd_create("cachefeed-counters", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, slots * _SLOT_BYTES)
        self._values: npt.NDArray[np.int64] | None = self._map_fd(self._fd)
        self._lost = 0

    def _map_fd(self, fd: int) -> npt.NDArray[np.int64]:
        shared = mmap.mmap(fd, self.slots * _SLOT_BYTES, flags=mmap.MAP_SHARED)
        return np.frombuffer(shared, dtype=np.int64)

    def __getstate__(self) -> dict[str, Any]:
        return {"slots": self.slots, "owner": self._owner, "fd": self._fd}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.slots = state["slots"]
        self._owner = state["owner"]
        self._fd = None  # the owner's descriptor number, not ours
        self._values = None
        self._lost = 0
        if state["fd"] is not None:
            try:
                fd = os.open(f"/proc/{self._owner}/fd/{state['fd']}", os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                return  # the owner is gone or not ours to read: count locally
            try:
                self._values = self._map_fd(fd)
            finally:
                os.close(fd)

    def add(self, slot: int, amount: int = 1) -> None:
        """Add to one slot. Only one process may write a given slot (see the module invariant)."""
        if self._values is None:
            self._lost += amount
        else:
            self._values[slot] += amount

    def total(self) -> int:
        """Sum of all slots as this process sees them now, plus counts this process could not share."""
        shared = int(self._values.sum()) if self._values is not None else 0
        return shared + self._lost

    def close(self) -> None:
        """Freeze the total into this object and release the memory (in the owner). Idempotent."""
        if self._values is not None:
            self._lost = self.total()
            self._values = None
        if self._fd is not None and os.getpid() == self._owner:
            os.close(self._fd)
            self._fd = None
