"""A batch's layout inside a region of a worker's arena: collated in place by the worker, rebuilt as views by the
training process.

A worker collates a batch straight into a region of its arena (``arena.py``). What crosses the pipe is the batch's
*layout*: its structure (dicts, lists, tuples, strings, numbers) with every tensor replaced by a ``Slot`` (offset,
size, dtype, shape inside the region) and every container that holds one by a ``Nest``. The layout travels split
(``split``) into a *skeleton*, sent once per batch shape, and its *leaves* (the values without tensors, such as
keys), sent with every batch; the training process compiles each skeleton once (``compile_skeleton``) and builds
a batch from its leaves with a numpy array and ``torch.from_numpy`` per tensor.

Two ways in: ``collate_into`` (the whole batch at once: ``default_collate`` with equal-shaped tensors stacked
straight into the region, or the caller's ``collate_fn`` then one copy) and ``RowCollator`` (each large sample
copied into the region as soon as it is read).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import default_collate

from cachefeed._trainer.arena import aligned

__all__ = [
    "LEAF",
    "ROW_COPY_BYTES",
    "Builder",
    "Leaf",
    "Nest",
    "RowCollator",
    "Slot",
    "collate_into",
    "collate_samples",
    "compile_skeleton",
    "place",
    "split",
]


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


def _plan(values: list[Any], field: Any = None) -> Any:
    """``default_collate(values)``, except that equal-shaped tensors become a ``_Stack`` (stacked later, in place).
    ``field``: the samples' field these values are (for the error on tensors of different shapes)."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if first.layout == torch.strided and all(
            isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype and v.is_contiguous()
            for v in values
        ):
            return _Stack(values)
        _check_same_shapes(values, field)
    elif isinstance(first, Mapping) and type(first) is dict:
        _check_same_fields(values)
        return {key: _plan([value[key] for value in values], key) for key in first}
    elif isinstance(first, str | bytes):
        return list(values)
    elif isinstance(first, list | tuple) and not hasattr(first, "_fields") and type(first) in (list, tuple):
        size = len(first)
        if all(isinstance(v, list | tuple) and len(v) == size for v in values):
            transposed = [_plan(list(column)) for column in zip(*values, strict=True)]
            return transposed if type(first) is list else tuple(transposed)
    return default_collate(values)


def _check_same_shapes(values: list[Any], field: Any) -> None:
    """Tensors (or arrays) of one field, of different shapes, are a ``ValueError`` naming the field and two shapes,
    not ``torch.stack``'s "stack expects each tensor to be equal size" from deep in a worker: most often images
    of their own sizes, which the daemon resizes where ``sampler.image_size`` is set."""
    shapes = [tuple(value.shape) for value in values if isinstance(value, torch.Tensor | np.ndarray)]
    other = next((shape for shape in shapes if shape != shapes[0]), None)
    if other is None or len(shapes) != len(values):
        return
    named = f"field {field!r}" if field is not None else "a field"
    raise ValueError(
        f"{named} has different shapes in one batch ({list(shapes[0])} and {list(other)}): samples are stacked "
        "into batches, so give them one shape: for images decoded by the daemon, set sampler.image_size (it "
        "resizes them); else a transform= that resizes or crops, or a collate_fn= that pads"
    )


def _check_same_fields(values: list[Any]) -> None:
    """Every sample of a batch has the first one's fields, or a ``ValueError`` that names two samples and what
    differs. ``default_collate`` keys the batch by the *first* sample's fields: a later sample with a field fewer
    failed with a bare ``KeyError``, one with a field more lost it without a word, so the same data failed or not by
    where the shuffle put a sample (a webdataset shard with a stray member, shards of ``.jpg`` beside shards of
    ``.png``)."""
    first = values[0]
    fields = first.keys()
    for value in values:
        if type(value) is dict and value.keys() == fields:
            continue
        other = value.keys() if isinstance(value, Mapping) else None
        raise ValueError(
            f"the samples of one batch have different fields: {_named(first)} has {sorted(map(str, fields))}, "
            + (f"{_named(value)} has {sorted(map(str, other))}" if other is not None else f"{_named(value)} is a "
               f"{type(value).__name__}")
            + ": give every sample the same fields (a transform= that renames or drops them; for webdataset shards, "
            "the same member extensions in every sample), or pass a collate_fn= that handles them"
        )  # fmt: skip


def collate_samples(samples: list[Any]) -> Any:
    """``default_collate``, with its samples' fields checked first, nested dicts too (``_check_same_fields``, as
    ``_plan`` checks them in the workers): the collate function of an in-process epoch (``num_workers=0``) where
    the caller gave none or ``default_collate``, so that it fails as a worker's does."""
    _check_nested_fields(samples)
    try:
        return default_collate(samples)
    except RuntimeError:  # torch.stack's, for tensors of different shapes: say which field, and what to do
        if samples and type(samples[0]) is dict:
            for key, value in samples[0].items():
                if isinstance(value, torch.Tensor | np.ndarray):
                    _check_same_shapes([sample[key] for sample in samples], key)
        raise


def _check_nested_fields(values: list[Any]) -> None:
    if values and type(values[0]) is dict:
        _check_same_fields(values)
        for key, value in values[0].items():
            if type(value) is dict:
                _check_nested_fields([sample[key] for sample in values])


def _named(sample: Any) -> str:
    key = sample.get("__key__") if isinstance(sample, Mapping) else None
    return f"sample {key!r}" if isinstance(key, str) else "one sample"


def _sizes(tree: Any, out: list[int]) -> None:
    if isinstance(tree, _Stack):
        out.append(aligned(int(np.prod(tree.shape)) * tree.dtype.itemsize))
    elif isinstance(tree, torch.Tensor):
        out.append(aligned(tree.numel() * tree.element_size()))
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
        cursor[0] += aligned(nbytes)
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
    other field a contiguous tensor, a Python number or a string. A numpy array counts as the tensor
    ``torch.from_numpy`` makes of it (``SnapshotDataset.iter_items(tensors=False)`` yields the reader's arrays: a
    worker copies them straight into their rows, without a tensor made per array only to be turned back into an
    array). ``add`` returns False for a sample that breaks the pattern of the first (the caller then releases the
    region and collates every sample the usual way, with the usual errors). The batch is ``default_collate``'s, as
    ``collate_into`` builds it: tensors stacked, numbers as int64/float64/bool tensors, strings as lists; with fewer
    samples than ``rows`` (corrupt records skipped) the tensors have as many rows as samples were added.
    """

    def __init__(self, fields: list[_Field], offset: int, nbytes: int) -> None:
        self._fields = fields
        self._keys = tuple(field.key for field in fields)
        # the fields by kind, as ``add`` reads them
        self._arrays = [(f.key, f.rows, f.shape) for f in fields if f.kind == "array"]
        self._tensors = [(f.key, f.rows, f.dtype, f.shape) for f in fields if f.kind == "tensor"]
        self._numbers = [(f.key, f.rows, f.dtype) for f in fields if f.kind == "number"]
        self._texts = [f.key for f in fields if f.kind == "text"]
        self._text_rows = [f.rows for f in fields if f.kind == "text"]
        self.offset = offset
        self.nbytes = nbytes
        self.count = 0

    @classmethod
    def start(
        cls, first: Any, rows: int, allocate: Callable[[int], tuple[int, Any]], *, small: bool = False
    ) -> RowCollator | None:
        """A collator for up to ``rows`` samples like ``first`` (added already), its region allocated; or None.

        ``small``: take a batch without a field of ``ROW_COPY_BYTES`` too (samples read whole, their arrays numpy
        arrays: a row copied by numpy costs less than a tensor made per array for ``torch.stack``)."""
        if type(first) is not dict:
            return None
        specs: list[tuple[Any, str, torch.dtype | None, tuple[int, ...], int]] = []
        large = False
        for key, value in first.items():
            if type(value) is np.ndarray:
                field_dtype = _torch_dtype(value.dtype)
                if field_dtype is None:
                    return None
                large = large or value.nbytes >= ROW_COPY_BYTES
                specs.append((key, "array", field_dtype, value.shape, aligned(rows * value.nbytes)))
            elif isinstance(value, torch.Tensor):
                if value.layout != torch.strided or not value.is_contiguous() or _numpy_dtype(value.dtype) is None:
                    return None
                row_bytes = value.numel() * value.element_size()
                large = large or row_bytes >= ROW_COPY_BYTES
                specs.append((key, "tensor", value.dtype, tuple(value.shape), aligned(rows * row_bytes)))
            elif type(value) in _SCALARS:
                dtype = _SCALARS[type(value)]
                specs.append((key, "number", dtype, (), aligned(rows * dtype.itemsize)))
            elif type(value) in (str, bytes):
                specs.append((key, "text", None, (), 0))
            else:
                return None
        total = sum(spec[4] for spec in specs)
        if not large and not small:
            return None
        offset, region = allocate(total)
        if region is None:
            return None
        fields: list[_Field] = []
        cursor = 0
        for key, kind, field_dtype, shape, size in specs:
            rows_of: Any = (
                [] if field_dtype is None else np.ndarray((rows, *shape), _numpy_dtype(field_dtype), region, cursor)
            )
            fields.append(_Field(key, kind, field_dtype, shape, rows_of, cursor))
            cursor += size
        collator = cls(fields, offset, total)
        collator.add(first)
        return collator

    def add(self, sample: Any) -> bool:
        """Copy ``sample`` into the next row; False when it does not match the first sample (nothing is counted).

        Paid once per sample by a worker, so one pass over the fields of each kind, each row written as soon as its
        value is checked: after a False the row may hold part of the refused sample, but it is not counted (the next
        ``add`` writes it again, and a caller given False collates the usual way and drops the collator)."""
        if type(sample) is not dict or tuple(sample) != self._keys:
            return False
        row = self.count
        try:
            for key, rows, shape in self._arrays:
                value = sample[key]
                if type(value) is not np.ndarray or value.dtype != rows.dtype or value.shape != shape:
                    return False
                rows[row] = value
            for key, rows, dtype, shape in self._tensors:
                value = sample[key]
                if not (
                    isinstance(value, torch.Tensor)
                    and value.dtype == dtype
                    and tuple(value.shape) == shape
                    and value.is_contiguous()
                ):
                    return False
                rows[row] = value.numpy()
            for key, rows, dtype in self._numbers:
                value = sample[key]
                if _SCALARS.get(type(value)) != dtype:
                    return False
                rows[row] = value
        except (OverflowError, RuntimeError, TypeError, ValueError):  # what default_collate refuses too: it says so
            return False
        texts = [sample[key] for key in self._texts]
        for text in texts:
            if type(text) is not str and type(text) is not bytes:
                return False
        for field, text in zip(self._text_rows, texts, strict=True):
            field.append(text)
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
                items.append(Slot(field.offset, math.prod(shape) * field.dtype.itemsize, field.dtype, shape))
        return Nest(dict, self._keys, tuple(items))


class _Field(NamedTuple):
    """One field of a ``RowCollator``'s batch: its rows in the region (a list for strings) from ``offset``."""

    key: Any
    kind: str  # "array" (numpy, as the reader hands it out), "tensor", "number" or "text"
    dtype: torch.dtype | None
    shape: tuple[int, ...]  # one row's
    rows: Any
    offset: int


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any] | None:
    """The numpy twin of a torch dtype, or None where numpy has none (bfloat16, ...): arrays over a region are
    built, and rows copied, through numpy (less per-call overhead than torch's dispatcher)."""
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:
        return None


@functools.cache
def _torch_dtype(dtype: np.dtype[Any]) -> torch.dtype | None:
    """The torch twin of a numpy dtype, or None where ``torch.from_numpy`` refuses it (strings, objects, a foreign
    byte order): such arrays stay numpy arrays in a sample (``dataset.as_tensors``), so not a row of a batch."""
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except (TypeError, ValueError):  # ValueError: the byte order
        return None


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
    np_dtype = _numpy_dtype(dtype)
    if np_dtype is None:  # a dtype numpy has no equivalent for (bfloat16, ...): view the bytes through torch
        return lambda region, _leaves: torch.from_numpy(region[offset : offset + nbytes]).view(dtype).view(shape)
    return lambda region, _leaves: torch.from_numpy(np.ndarray(shape, np_dtype, region, offset))


def place(layout: Any, region: npt.NDArray[np.uint8]) -> Any:
    """The batch a layout describes, its tensors views of ``region`` (uncompiled: for one-off use and tests)."""
    leaves: list[Any] = []
    return compile_skeleton(split(layout, leaves))(region, iter(leaves))
