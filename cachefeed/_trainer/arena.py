"""Batches in shared memory: a worker's arena, the regions it cuts from it, and a batch's layout inside a region.

Each worker of the pool (``pool.py``) collates its batches straight into its own *arena*: one anonymous memory file
(``memfd_create``: on no filesystem, so nothing outlives the processes that map it, whatever kills them) that the
training process maps once, when the pool starts. What crosses the pipe for a batch is then only its *layout*: the
batch's structure (dicts, lists, tuples, strings, numbers) with every tensor replaced by a ``Slot`` (offset, size,
dtype, shape inside the region) and every container that holds one by a ``Nest``. The training process turns a
layout back into tensors with a few views over its map (``place``: microseconds, no copy, no file descriptor
passed, no page faults: the pages are reused).

Regions are cut first-fit from the arena by the worker (``Allocator``) and given back by the training process once
every tensor over them is gone (``weakref.finalize`` on the region's array, which each tensor's storage holds): a
batch is never overwritten while anyone can read it, however long the caller keeps it. When the arena is full (a
caller that keeps hundreds of batches), the worker sends the batch itself through the pipe instead: slower, never
wrong.

Layout of the arena: the first ``HEADER_BYTES`` are the worker's control words (``ACK_WORD``: the last ``forget``
ticket the worker has handled, NOTE [ Feed protocol ] in ``pool.py``); regions follow, ``ALIGN``-aligned.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing import reduction
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import default_collate

__all__ = [
    "ALIGN",
    "LEAF",
    "Allocator",
    "Arena",
    "Builder",
    "Leaf",
    "Nest",
    "RowCollator",
    "Slot",
    "collate_into",
    "compile_skeleton",
    "place",
    "split",
]

ALIGN = 64  # every tensor in a region starts on a cache line (and on any dtype's alignment)
HEADER_BYTES = 64
ACK_WORD = 0


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """One worker's shared memory: ``size`` bytes of a memfd, mapped ``MAP_SHARED`` by its creator.

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


class Allocator:
    """First-fit regions of ``[start, size)``, ``ALIGN``-aligned; ``release`` merges neighbours back."""

    def __init__(self, start: int, size: int) -> None:
        self._free: list[tuple[int, int]] = [(start, size - start)]  # (offset, length), sorted by offset

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a free region of ``nbytes`` (rounded up to ``ALIGN``), or None when none is large enough."""
        need = _aligned(max(nbytes, 1))
        for i, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, length - need)
                return offset
        return None

    def release(self, offset: int, nbytes: int) -> None:
        length = _aligned(max(nbytes, 1))
        free = self._free
        lo, hi = 0, len(free)
        while lo < hi:
            mid = (lo + hi) // 2
            if free[mid][0] < offset:
                lo = mid + 1
            else:
                hi = mid
        free.insert(lo, (offset, length))
        if lo + 1 < len(free) and free[lo][0] + free[lo][1] == free[lo + 1][0]:
            free[lo] = (offset, length + free[lo + 1][1])
            del free[lo + 1]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == free[lo][0]:
            free[lo - 1] = (free[lo - 1][0], free[lo - 1][1] + free[lo][1])
            del free[lo]

    @property
    def free_bytes(self) -> int:
        return sum(length for _offset, length in self._free)


class Slot(NamedTuple):
    """Where one tensor of a batch lies in its region (a tuple: it unpickles fast)."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class Nest(NamedTuple):
    """A container of the batch that holds tensors: rebuilt around their views. Containers without tensors travel
    as they are and are handed out untouched (a list of 256 keys costs nothing to place)."""

    kind: Any  # dict, list, tuple or a named tuple class
    keys: tuple[Any, ...] | None  # a dict's keys, in order
    items: tuple[Any, ...]


class _Stack:
    """A batch field to be stacked from equal-shaped tensors straight into the region (one copy)."""

    __slots__ = ("dtype", "shape", "values")

    def __init__(self, values: list[torch.Tensor]) -> None:
        self.values = values
        self.dtype = values[0].dtype
        self.shape = (len(values), *values[0].shape)


def _plan(values: list[Any]) -> Any:
    """``default_collate(values)``, except that equal-shaped tensors become a ``_Stack`` (stacked later, in place)."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if first.layout == torch.strided and all(
            isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype and v.is_contiguous()
            for v in values
        ):
            return _Stack(values)
    elif isinstance(first, Mapping) and type(first) is dict:
        return {key: _plan([value[key] for value in values]) for key in first}
    elif isinstance(first, str | bytes):
        return list(values)
    elif isinstance(first, list | tuple) and not hasattr(first, "_fields") and type(first) in (list, tuple):
        size = len(first)
        if all(isinstance(v, list | tuple) and len(v) == size for v in values):
            transposed = [_plan(list(column)) for column in zip(*values, strict=True)]
            return transposed if type(first) is list else tuple(transposed)
    return default_collate(values)


def _sizes(tree: Any, out: list[int]) -> None:
    if isinstance(tree, _Stack):
        out.append(_aligned(int(np.prod(tree.shape)) * tree.dtype.itemsize))
    elif isinstance(tree, torch.Tensor):
        out.append(_aligned(tree.numel() * tree.element_size()))
    elif isinstance(tree, dict):
        for value in tree.values():
            _sizes(value, out)
    elif isinstance(tree, list | tuple):
        for value in tree:
            _sizes(value, out)


def _tensor_view(
    region: npt.NDArray[np.uint8], offset: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    count = int(np.prod(shape)) * dtype.itemsize
    return torch.from_numpy(region[offset : offset + count]).view(dtype).view(shape)


def _fill(tree: Any, region: npt.NDArray[np.uint8], cursor: list[int]) -> Any:
    """Write ``tree``'s tensors into ``region`` in ``_sizes`` order; return the layout (tensors replaced by Slots)."""
    if isinstance(tree, _Stack | torch.Tensor):
        offset = cursor[0]
        shape = tuple(tree.shape)
        target = _tensor_view(region, offset, tree.dtype, shape)
        if isinstance(tree, _Stack):
            torch.stack(tree.values, out=target)
        else:
            target.copy_(tree)
        nbytes = target.numel() * tree.dtype.itemsize
        cursor[0] += _aligned(nbytes)
        return Slot(offset, nbytes, tree.dtype, shape)
    if isinstance(tree, dict | list | tuple):
        keys = tuple(tree) if isinstance(tree, dict) else None
        values = tree.values() if isinstance(tree, dict) else tree
        items = tuple(_fill(value, region, cursor) for value in values)
        if not any(isinstance(item, Slot | Nest) for item in items):
            return tree  # no tensor inside: handed out as it is
        kind = dict if isinstance(tree, dict) else type(tree)
        return Nest(kind, keys, items)
    return tree


def collate_into(
    samples: Sequence[Any], collate: Callable[[list[Any]], Any] | None, allocate: Callable[[int], tuple[int, Any]]
) -> tuple[int, int, Any]:
    """Collate ``samples`` into a region: ``(offset, nbytes, layout)``; ``(-1, 0, batch)`` when there was no room.

    ``collate`` None means ``default_collate``, done in place: equal-shaped tensors are stacked straight into the
    region (one copy). With a collate function of the caller's, its batch is copied into the region (two copies).
    ``allocate(nbytes)`` returns ``(offset, region array)`` or ``(-1, None)``.
    """
    tree = _plan(list(samples)) if collate is None else collate(list(samples))
    sizes: list[int] = []
    _sizes(tree, sizes)
    nbytes = sum(sizes)
    offset, region = allocate(nbytes)
    if region is None:
        return -1, 0, _materialize(tree)
    return offset, nbytes, _fill(tree, region, [0])


# A field's rows are copied one sample at a time only from this size up: smaller samples stay in the cache anyway,
# and one ``torch.stack`` per field is cheaper than a copy per row.
ROW_COPY_BYTES = 16 << 10
_SCALARS = {int: torch.int64, float: torch.float64, bool: torch.bool}  # what default_collate makes of a list of each


class RowCollator:
    """``collate_into(samples, None, ...)`` for samples that arrive one by one: each sample is copied into the
    region as soon as it is read, while its bytes are still in the CPU's cache.

    Why: a worker verifies a record (xxh3 reads every byte) and then stacks it into the batch. Read whole first,
    a batch of 32 x 128 KiB has left the core's cache before the copy starts, so the copy reads memory again;
    copied right after its checksum, a record is read from memory once (one-off, 2,048 records of 128 KiB on
    tmpfs, one core: 3.5-4.2 GB/s checksum-all-then-copy-all, 5.3-5.5 GB/s checksum-and-copy each).

    For the batches this helps, and only those (``start`` returns None otherwise, and the caller collates the
    usual way): every sample a flat dict with the same keys, a tensor field of at least ``ROW_COPY_BYTES``, every
    other field a contiguous tensor, a Python number or a string. ``add`` returns False for a sample that breaks
    the pattern of the first (the caller then releases the region and collates every sample the usual way, with
    the usual errors). The batch is ``default_collate``'s, as ``collate_into`` builds it: tensors stacked, numbers
    as int64/float64/bool tensors, strings as lists; with fewer samples than ``rows`` (corrupt records skipped) the
    tensors have as many rows as samples were added.
    """

    def __init__(self, fields: list[_Field], offset: int, nbytes: int) -> None:
        self._fields = fields
        self._keys = tuple(field.key for field in fields)
        self.offset = offset
        self.nbytes = nbytes
        self.count = 0

    @classmethod
    def start(cls, first: Any, rows: int, allocate: Callable[[int], tuple[int, Any]]) -> RowCollator | None:
        """A collator for up to ``rows`` samples like ``first`` (added already), its region allocated; or None."""
        if type(first) is not dict:
            return None
        specs: list[tuple[Any, str, torch.dtype | None, tuple[int, ...], int]] = []
        large = False
        for key, value in first.items():
            if isinstance(value, torch.Tensor):
                if value.layout != torch.strided or not value.is_contiguous() or value.dtype not in _NUMPY:
                    return None
                row_bytes = value.numel() * value.element_size()
                large = large or row_bytes >= ROW_COPY_BYTES
                specs.append((key, "tensor", value.dtype, tuple(value.shape), _aligned(rows * row_bytes)))
            elif type(value) in _SCALARS:
                dtype = _SCALARS[type(value)]
                specs.append((key, "number", dtype, (), _aligned(rows * dtype.itemsize)))
            elif type(value) in (str, bytes):
                specs.append((key, "text", None, (), 0))
            else:
                return None
        total = sum(spec[4] for spec in specs)
        if not large:
            return None
        offset, region = allocate(total)
        if region is None:
            return None
        fields: list[_Field] = []
        cursor = 0
        for key, kind, field_dtype, shape, size in specs:
            rows_of: Any = (
                [] if field_dtype is None else np.ndarray((rows, *shape), _NUMPY[field_dtype], region, cursor)
            )
            fields.append(_Field(key, kind, field_dtype, shape, rows_of, cursor))
            cursor += size
        collator = cls(fields, offset, total)
        collator.add(first)
        return collator

    def add(self, sample: Any) -> bool:
        """Copy ``sample`` into the next row; False when it does not match the first sample (nothing is counted)."""
        if type(sample) is not dict or tuple(sample) != self._keys:
            return False
        for field in self._fields:
            value = sample[field.key]
            if field.kind == "tensor":
                if not (
                    isinstance(value, torch.Tensor)
                    and value.dtype == field.dtype
                    and tuple(value.shape) == field.shape
                    and value.is_contiguous()
                ):
                    return False
            elif field.kind == "number":
                if _SCALARS.get(type(value)) != field.dtype:
                    return False
            elif type(value) not in (str, bytes):
                return False
        row = self.count
        try:
            for field in self._fields:
                value = sample[field.key]
                if field.kind == "tensor":
                    field.rows[row] = value.numpy()
                elif field.kind == "number":
                    field.rows[row] = value
        except (OverflowError, RuntimeError, TypeError, ValueError):  # what default_collate refuses too: it says so
            return False
        for field in self._fields:
            if field.kind == "text":
                field.rows.append(sample[field.key])
        self.count += 1
        return True

    def finish(self) -> Any:
        """The batch's layout (``collate_into``'s third value) over the samples added."""
        items: list[Any] = []
        for field in self._fields:
            if field.dtype is None:
                items.append(field.rows)
            else:
                shape = (self.count, *field.shape)
                items.append(Slot(field.offset, int(np.prod(shape)) * field.dtype.itemsize, field.dtype, shape))
        return Nest(dict, self._keys, tuple(items))


class _Field(NamedTuple):
    """One field of a ``RowCollator``'s batch: its rows in the region (a list for strings) from ``offset``."""

    key: Any
    kind: str  # "tensor", "number" or "text"
    dtype: torch.dtype | None
    shape: tuple[int, ...]  # one row's
    rows: Any
    offset: int


def _numpy_dtypes() -> dict[torch.dtype, np.dtype[Any]]:
    found = {}
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
                  torch.float64, torch.bool, torch.complex64, torch.complex128):  # fmt: skip
        found[dtype] = torch.empty((), dtype=dtype).numpy().dtype
    return found


_NUMPY = _numpy_dtypes()  # torch dtypes with a numpy twin (rows are copied through numpy: less per-call overhead)


def _materialize(tree: Any) -> Any:
    """The batch a plan stands for, in ordinary memory (when the arena has no room)."""
    if isinstance(tree, _Stack):
        return torch.stack(tree.values)
    if isinstance(tree, dict):
        return {key: _materialize(value) for key, value in tree.items()}
    if type(tree) is list:
        return [_materialize(value) for value in tree]
    if type(tree) is tuple:
        return tuple(_materialize(value) for value in tree)
    return tree


class Leaf(NamedTuple):
    """In a skeleton, where a value without tensors goes (the values travel with each batch, in order)."""


LEAF = Leaf()


def split(layout: Any, leaves: list[Any]) -> Any:
    """A layout's *skeleton* (hashable: its Nests and Slots, ``LEAF`` for every value without tensors), appending
    those values to ``leaves`` in order. Batches of one shape share a skeleton, so only the leaves vary per batch."""
    if type(layout) is Slot:
        return layout
    if type(layout) is Nest:
        return Nest(layout.kind, layout.keys, tuple(split(item, leaves) for item in layout.items))
    leaves.append(layout)
    return LEAF


Builder = Callable[[npt.NDArray[np.uint8], Iterator[Any]], Any]


def compile_skeleton(skeleton: Any) -> Builder:
    """A function that turns ``(region, leaves)`` into the batch ``skeleton`` describes, its tensors views of
    ``region`` (a uint8 array over the region's bytes). Compiled once per skeleton, so a batch costs a numpy array
    and ``torch.from_numpy`` per tensor (no pickled dtypes, no slicing and reshaping through torch's dispatcher)."""
    if type(skeleton) is Slot:
        return _slot_builder(skeleton)
    if type(skeleton) is Nest:
        parts = tuple(compile_skeleton(item) for item in skeleton.items)
        kind, keys = skeleton.kind, skeleton.keys or ()
        if kind is dict:
            return lambda region, leaves: {key: part(region, leaves) for key, part in zip(keys, parts, strict=True)}
        if kind is list:
            return lambda region, leaves: [part(region, leaves) for part in parts]
        if kind is tuple:
            return lambda region, leaves: tuple(part(region, leaves) for part in parts)
        return lambda region, leaves: kind(*(part(region, leaves) for part in parts))  # a named tuple
    return lambda _region, leaves: next(leaves)


def _slot_builder(slot: Slot) -> Builder:
    offset, nbytes, dtype, shape = slot
    try:
        np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:  # a dtype numpy has no equivalent for (bfloat16, ...): view the bytes through torch
        return lambda region, _leaves: torch.from_numpy(region[offset : offset + nbytes]).view(dtype).view(shape)
    return lambda region, _leaves: torch.from_numpy(np.ndarray(shape, np_dtype, region, offset))


def place(layout: Any, region: npt.NDArray[np.uint8]) -> Any:
    """The batch a layout describes, its tensors views of ``region`` (uncompiled: for one-off use and tests)."""
    leaves: list[Any] = []
    return compile_skeleton(split(layout, leaves))(region, iter(leaves))
