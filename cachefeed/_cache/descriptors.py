"""A sample's fields inside a record: how they are split and described when written, and read back through plans.

``records.py`` owns the record and the segment around them; this module owns what a record's meta and payload
area mean.

**Fields.** An array (numpy: kind ``nd``; torch: ``pt``) and a str or bytes over ``INLINE_LIMIT`` bytes (``st``,
``by``) become *payloads*: their raw bytes in the record's payload area, in the sample's order, each aligned as
``payload_align`` says (only an array's own bytes: a slice stores the slice, made contiguous). Everything else
(short str and bytes, numbers, None, lists and dicts of them, numpy scalars as Python ones) is an *inline value*
(kind ``v``), msgpack in the record's meta.

**Descriptors.** What most records of a segment share (field names and kinds, dtypes, shapes) is written once per
segment, in its descriptor table, as a *descriptor*: a msgpack array of ``[name, kind]`` (``v``, ``by``, ``st``) and
``[name, kind, dtype, shape]`` (``nd``, ``pt``; a shape of nil: each record gives it). A record names its
descriptor and carries its *values*: one per field the descriptor does not fix, in the descriptor's order (an
inline value, a blob's length, an array's shape where the descriptor has none). The writer (``records.py``) picks
the exact descriptor, or the *loose* one (shapes left to the records) once a segment has seen an array field
change shape, so that records of varying shapes share one entry.

**Plans.** A reader turns a descriptor into a ``Plan`` once per segment and descriptor: dtypes resolved,
torch dtypes mapped, and, for a descriptor that fixes every size (the common case), every payload's offset and the
area's length computed in advance; reading a record is then one msgpack call for its meta and one array
constructor per array. Arrays are views of the uint8 array they are read from (over the segment's copy-on-write
map, or a decompressed buffer; never the map itself: ``np.ndarray(buffer=mmap)`` keeps no export of the map, so the
map could be closed under the view): writable, C-contiguous, 0-d where the sample's was. A descriptor that does not
describe the record it is read with (wrong sizes, values or kinds) raises ``ValueError``, which the reader turns
into ``CorruptRecordError``.

torch is imported only to encode or read a ``pt`` field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import xxhash

__all__ = [
    "INLINE_LIMIT",
    "LARGE_PAYLOAD",
    "SLICE",
    "VIEW",
    "Fields",
    "Plan",
    "classify",
    "loosen",
    "payload",
    "payload_align",
]

INLINE_LIMIT = 256  # str/bytes up to this size are inline values; larger ones are payloads
LARGE_PAYLOAD = 4096  # payloads of this size or more start 64-aligned; smaller ones 16-aligned
ALIGN = 64
SMALL_ALIGN = 16

# kinds of a plan's steps
_INLINE, _ND, _PT, _PT_VIEW, _BYTES, _STR = range(6)
SLICE, VIEW, _CALL = range(3)  # how a plan with fixed offsets reads a payload (``_mode``)


def payload_align(nbytes: int) -> int:
    """The alignment of a payload of ``nbytes`` within the file and in memory (``records.py``: Alignment)."""
    return ALIGN if nbytes >= LARGE_PAYLOAD else SMALL_ALIGN


@dataclass(slots=True)
class Fields:
    """One sample's fields, split as the module docstring says. Read-only by contract; a slots dataclass, not a
    frozen one nor a NamedTuple, because one is made per sample written and this is the cheapest to make.

    ``exact`` is the descriptor that fixes every array's shape (hashable: tuples) and ``values`` go with it
    (``loosen`` gives the loose descriptor and its values). ``payloads`` are the payload area's parts, padding
    included, ``area_len`` bytes in all; ``align`` the largest alignment they need. ``values_bytes`` bounds the
    msgpack size of the values, whichever descriptor they go with (the loose values' shapes are counted in the
    descriptor's size).
    """

    exact: tuple[tuple[Any, ...], ...]
    values: tuple[Any, ...]
    payloads: list[memoryview | bytes]
    area_len: int
    align: int
    values_bytes: int


def classify(sample: Mapping[str, Any]) -> tuple[str, Fields]:
    """Split a sample dict into its key and its ``Fields``. Raises TypeError for what cannot be cached."""
    key = sample.get("__key__")
    if not isinstance(key, str):
        raise TypeError("a sample needs a string '__key__' field")
    exact: list[tuple[Any, ...]] = []
    values: list[Any] = []
    payloads: list[memoryview | bytes] = []
    offset = 0  # of the next payload within the payload area
    align = SMALL_ALIGN
    values_bytes = 0
    extra: Any  # an array's (dtype, shape), an inline value, or None (by, st)
    for name, value in sample.items():
        if name == "__key__":
            continue
        if not isinstance(name, str):
            raise TypeError(f"sample field names must be strings, got {name!r}")
        # The two fields of most samples, without ``_to_payload``'s call and tuple (this runs once per sample the
        # daemon writes): a short str, and a C-contiguous array, classified exactly as ``_to_payload`` would.
        if type(value) is str and len(value) <= INLINE_LIMIT:
            exact.append((name, "v"))
            values.append(value)
            values_bytes += len(value.encode("utf-8")) + 3
            continue
        if type(value) is np.ndarray and value.size and value.flags.c_contiguous and not value.dtype.hasobject:
            kind, view, extra = "nd", _bytes_of(value), (_dtype_name(value.dtype), value.shape)
        else:
            kind, view, extra, packed_len = _to_payload(value)
            values_bytes += packed_len
            if kind == "v":
                exact.append((name, kind))
                values.append(extra)
                continue
        nbytes = view.nbytes
        field_align = ALIGN if nbytes >= LARGE_PAYLOAD else SMALL_ALIGN
        pad = -offset % field_align
        if pad:
            payloads.append(bytes(pad))
            offset += pad
        align = max(align, field_align)
        payloads.append(view)
        offset += nbytes
        if extra is None:  # by, st
            exact.append((name, kind))
            values.append(nbytes)
        else:
            exact.append((name, kind, *extra))
    return key, Fields(tuple(exact), tuple(values), payloads, offset, align, values_bytes)


def loosen(fields: Fields) -> tuple[tuple[tuple[Any, ...], ...], tuple[Any, ...]] | None:
    """The loose descriptor of ``fields`` (array shapes left to the records) and the values that go with it;
    None when there is no array field."""
    loose: list[tuple[Any, ...]] = []
    values: list[Any] = []
    given = iter(fields.values)
    for field in fields.exact:
        if len(field) == 4:
            loose.append((*field[:3], None))
            values.append(list(field[3]))
        else:
            loose.append(field)
            values.append(next(given))
    return (tuple(loose), tuple(values)) if len(values) > len(fields.values) else None


def _to_payload(value: Any) -> tuple[str, memoryview, Any, int]:
    """Classify one field: ``(kind, payload bytes, extra, bytes its value takes in the meta at most)``; extra is
    ``(dtype, shape)`` or the inline value. Whatever msgpack would refuse in the meta is refused here."""
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError("object arrays cannot be cached; convert them to a numeric dtype")
        if value.flags.c_contiguous and value.size:  # most arrays: their bytes as they are, fewer numpy calls
            return "nd", _bytes_of(value), (_dtype_name(value.dtype), value.shape), 0
        array = np.ascontiguousarray(value).reshape(value.shape)  # ascontiguousarray makes a 0-d array 1-d
        view = memoryview(array.reshape(-1).view(np.uint8).data) if array.size else memoryview(b"")
        return "nd", view, (array.dtype.str, tuple(array.shape)), 0
    if _is_tensor(value):
        import torch

        tensor = value.detach().cpu().contiguous()
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
        return "pt", view, (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)), 0
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        if len(data) <= INLINE_LIMIT:
            return "v", memoryview(b""), data, len(data) + 3
        return "by", memoryview(data), None, 9  # its length in the values
    if isinstance(value, str):
        if len(value) <= INLINE_LIMIT:
            return "v", memoryview(b""), value, len(value.encode("utf-8")) + 3  # no UTF-8, no msgpack str
        return "st", memoryview(value.encode("utf-8", "surrogatepass")), None, 9
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, bool | int | float | list | tuple | dict):
        try:
            packed = msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"field value {type(value).__name__} cannot be cached: {exc}") from None
        return "v", memoryview(b""), value, len(packed)
    raise TypeError(
        f"cannot cache a field of type {type(value).__name__}: use numpy arrays, tensors, bytes, str or scalars"
    )


_DTYPE_NAMES: dict[np.dtype[Any], str] = {}


def _dtype_name(dtype: np.dtype[Any]) -> str:
    """``dtype.str`` (what a descriptor names an array's dtype by), remembered: numpy builds the string anew on
    every access, several times the cost of this lookup. Equal dtypes have equal ``str`` (byte order, kind and
    item size are all part of a dtype's equality), so an equal dtype's entry is this one's."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        if len(_DTYPE_NAMES) >= 256:  # samples of ever new dtypes (structured ones): keep the table small
            _DTYPE_NAMES.clear()
        name = _DTYPE_NAMES[dtype] = dtype.str
    return name


def _bytes_of(array: np.ndarray[Any, Any]) -> memoryview:
    """The bytes of a C-contiguous, non-empty array, as a flat memoryview of it (no copy)."""
    try:  # the buffer protocol: a third of numpy's reshape, view and data
        return array.data.cast("B")
    except (ValueError, TypeError, BufferError):  # a dtype the buffer protocol does not export (datetime64, ...)
        return array.reshape(-1).view(np.uint8).data


def _is_tensor(value: Any) -> bool:
    module = type(value).__module__
    return module.startswith("torch") and hasattr(value, "detach") and hasattr(value, "numel")


class Plan:
    """How to read the fields of a record written with one descriptor (see the module docstring).

    ``seed`` is the descriptor's xxh3: ``records.py`` mixes it into each record's checksum, so a record read
    through another descriptor than the one it was written with fails its checksum.
    """

    __slots__ = ("area_len", "arrays", "inline_names", "runs", "seed", "steps", "values")

    def __init__(self, blob: bytes) -> None:
        self.seed = xxhash.xxh3_64_intdigest(blob)
        try:
            descriptor = msgpack.unpackb(blob, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ValueError(f"unreadable field descriptor: {exc}") from None
        if not isinstance(descriptor, list):
            raise ValueError("a field descriptor must be an array")
        steps = tuple(_step(field) for field in descriptor)
        if len({step.name for step in steps}) != len(steps) or any(step.name == "__key__" for step in steps):
            raise ValueError("a field descriptor names a field twice")
        self.steps = steps
        self.values = sum(1 for step in steps if step.kind in (_INLINE, _BYTES, _STR) or step.shape is None)
        self.inline_names: tuple[str, ...] | None = None  # set when every size is fixed (then: the values)
        self.arrays: tuple[tuple[Any, ...], ...] = ()
        self.area_len = -1
        if all(step.kind not in (_BYTES, _STR) and step.shape is not None for step in steps):
            arrays = []
            offset = 0
            for step in steps:
                if step.kind != _INLINE:
                    offset += -offset % payload_align(step.nbytes)
                    arrays.append((step.name, _mode(step), offset, step.nbytes, step.dtype, step.shape, step))
                    offset += step.nbytes
            self.inline_names = tuple(step.name for step in steps if step.kind == _INLINE)
            self.arrays = tuple(arrays)
            self.area_len = offset
        self.runs: dict[Any, tuple[tuple[Any, ...], ...] | None] = {}  # ``run_arrays`` by ``wrap``

    def run_arrays(self, wrap: Any) -> tuple[tuple[Any, ...], ...] | None:
        """How ``SegmentReader.read_run`` reads this plan's payloads: ``(name, offset, nbytes, shape, dtype, slice,
        wrapped, step)`` per payload, ``wrapped`` where ``wrap`` (``torch.from_numpy``, say) takes the numpy array
        made for it (an ``nd`` field whose dtype ``wrap`` accepts: it raises TypeError or ValueError for the others,
        which stay numpy arrays). None for a plan whose sizes are not all fixed (each record is read by ``fill``).
        Worked out once per ``wrap``."""
        if self.inline_names is None:
            return None
        if wrap in self.runs:
            return self.runs[wrap]
        found = []
        for name, mode, offset, nbytes, dtype, shape, step in self.arrays:
            wrapped = False
            if wrap is not None and step.kind == _ND:
                try:
                    wrap(np.empty(0, dtype))
                    wrapped = True
                except (TypeError, ValueError):  # ValueError: the byte order
                    pass
            found.append((name, offset, nbytes, shape, dtype, mode, wrapped, step))
        self.runs[wrap] = runs = tuple(found)
        return runs

    def fill(
        self, sample: dict[str, Any], values: list[Any], source: npt.NDArray[np.uint8], base: int, area_len: int
    ) -> None:
        """Add the fields of one record to ``sample``: its values, and payloads read from ``source`` at ``base``
        (views of it); ``area_len`` is the payload area's length. ValueError if they do not fit this plan."""
        names = self.inline_names
        if names is None:
            self._walk(sample, values, source, base, area_len)
            return
        if len(values) != len(names) or area_len != self.area_len:
            raise ValueError("the record does not match its field descriptor")
        if names:
            sample.update(zip(names, values))  # noqa: B905 (lengths checked above)
        for name, mode, offset, nbytes, dtype, shape, step in self.arrays:
            at = base + offset
            if mode == SLICE:  # the cheapest view there is: a byte array is a slice of the source
                sample[name] = source[at : at + nbytes]
            elif mode == VIEW:
                sample[name] = np.ndarray(shape, dtype, source, at)
            else:
                sample[name] = payload(step, source, at, shape, nbytes)

    def area_of(self, values: list[Any]) -> int:
        """The payload area's length for a record with these values (to check a decompressed area)."""
        if self.inline_names is not None:
            return self.area_len
        offset = 0
        for step, _value, nbytes in self._layout(values):
            if step.kind != _INLINE:
                offset += -offset % payload_align(nbytes) + nbytes
        return offset

    def _layout(self, values: list[Any]) -> list[tuple[_Step, Any, int]]:
        """``(step, inline value or shape, nbytes)`` per field, sizes taken from the record's values."""
        if len(values) != self.values:
            raise ValueError("the record does not match its field descriptor")
        found: list[tuple[_Step, Any, int]] = []
        position = 0
        for step in self.steps:
            if step.kind != _INLINE and step.shape is not None and step.kind not in (_BYTES, _STR):
                found.append((step, step.shape, step.nbytes))
                continue
            value = values[position]
            position += 1
            if step.kind == _INLINE:
                found.append((step, value, 0))
            elif step.kind in (_BYTES, _STR):
                if not isinstance(value, int) or value < 0:
                    raise ValueError(f"field {step.name!r}: bad length {value!r}")
                found.append((step, None, value))
            else:
                if not isinstance(value, list) or not all(isinstance(d, int) and d >= 0 for d in value):
                    raise ValueError(f"field {step.name!r}: bad shape {value!r}")
                found.append((step, tuple(value), math.prod(value) * step.dtype.itemsize))
        return found

    def _walk(self, sample: dict[str, Any], values: list[Any], source: Any, base: int, area_len: int) -> None:
        payloads = []
        offset = 0
        for step, value, nbytes in self._layout(values):
            if step.kind == _INLINE:
                sample[step.name] = value
                continue
            offset += -offset % payload_align(nbytes)
            if offset + nbytes > area_len:
                raise ValueError("the record does not match its field descriptor")
            payloads.append((step.name, payload(step, source, base + offset, value, nbytes)))
            offset += nbytes
        if offset != area_len:
            raise ValueError("the record does not match its field descriptor")
        sample.update(payloads)


@dataclass(frozen=True, slots=True)
class _Step:
    """One descriptor entry, resolved: ``shape`` None when each record gives it (then ``nbytes`` is -1)."""

    name: str
    kind: int
    dtype: Any = None
    shape: tuple[int, ...] | None = ()
    nbytes: int = 0
    extra: Any = None  # pt: (torch dtype, torch.from_numpy, torch.empty): torch imported once, by ``_tensor_step``


def _mode(step: _Step) -> int:
    """How a plan with fixed offsets reads one payload: a slice, an array view, or ``payload``."""
    if step.kind != _ND or not step.nbytes:
        return _CALL
    return SLICE if step.dtype == np.uint8 and len(step.shape or ()) == 1 else VIEW


def payload(step: _Step, source: Any, offset: int, shape: Any, nbytes: int) -> Any:
    """One payload field of ``nbytes`` read from ``source`` at ``offset`` (zero-copy for arrays)."""
    kind = step.kind
    if kind == _ND:
        return np.ndarray(shape, step.dtype, source, offset) if nbytes else np.empty(shape, step.dtype)
    if kind in (_PT, _PT_VIEW):
        torch_dtype, from_numpy, empty = step.extra
        if nbytes == 0:
            return empty(shape, dtype=torch_dtype)
        if kind == _PT:
            return from_numpy(np.ndarray(shape, step.dtype, source, offset))
        return from_numpy(np.ndarray((nbytes,), np.uint8, source, offset)).view(torch_dtype).reshape(shape)
    data = bytes(memoryview(source)[offset : offset + nbytes])
    return data if kind == _BYTES else data.decode("utf-8", "surrogatepass")


def _step(field: Any) -> _Step:
    """One descriptor entry (``[name, kind]`` or ``[name, kind, dtype, shape]``), checked and resolved."""
    if not isinstance(field, list) or len(field) < 2 or not isinstance(field[0], str):
        raise ValueError(f"bad field descriptor {field!r}")
    name, kind = field[0], field[1]
    if kind in ("v", "by", "st"):
        if len(field) != 2:
            raise ValueError(f"bad field descriptor {field!r}")
        return _Step(name, {"v": _INLINE, "by": _BYTES, "st": _STR}[kind])
    if kind not in ("nd", "pt") or len(field) != 4 or not isinstance(field[2], str):
        raise ValueError(f"bad field descriptor {field!r}")
    shape = field[3]
    if shape is not None and (
        not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ValueError(f"field {name!r}: bad shape {shape!r}")
    dims = None if shape is None else tuple(shape)
    if kind == "pt":
        return _tensor_step(name, field[2], dims)
    try:
        dtype = np.dtype(field[2])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"field {name!r}: bad dtype {field[2]!r}") from exc
    if dtype.hasobject:
        raise ValueError(f"field {name!r}: object dtype")
    nbytes = -1 if dims is None else math.prod(dims) * dtype.itemsize
    return _Step(name, _ND, dtype, dims, nbytes)


def _tensor_step(name: str, dtype_name: str, dims: tuple[int, ...] | None) -> _Step:
    import torch

    torch_dtype = getattr(torch, dtype_name, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"field {name!r}: bad torch dtype {dtype_name!r}")
    nbytes = -1 if dims is None else math.prod(dims) * torch_dtype.itemsize
    try:  # read as the numpy dtype torch maps to; one numpy lacks (bfloat16, float8, ...) as bytes viewed in torch
        dtype, kind = torch.empty(0, dtype=torch_dtype).numpy().dtype, _PT
    except (TypeError, RuntimeError):
        dtype, kind = np.dtype(f"V{torch_dtype.itemsize}"), _PT_VIEW
    return _Step(name, kind, dtype, dims, nbytes, (torch_dtype, torch.from_numpy, torch.empty))
