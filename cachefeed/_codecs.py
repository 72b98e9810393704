"""Decoders: one remote object's bytes -> samples, plus the user's decode and preprocess callables.

A sample is a ``dict[str, Any]`` of fields. Single-array formats put the array in ``"data"``. A decoder is called
as ``decode(key, body)`` with ``key`` the object's path relative to its source's URL (``train/cat/1.jpg`` under
``s3://bucket/imagenet/``; the file name when the URL names the object itself), and every sample carries
``"__key__"``: that key, with ``#i`` appended where one object holds several samples, or for a tar member the
member's basename group (``s3/000180``, as webdataset names it). The daemon adds ``"__url__"``, the object's URL
(``s3://bucket/imagenet/train/cat/1.jpg``), after decoding. So ``__key__`` is unique within one object, not across
objects (two shards may both hold ``000001``): ``(__url__, __key__)`` names a sample. Nothing in the cache relies on
keys being unique: records are addressed by segment and position.

Built-in formats (``get_decoder(name)``):

- ``npy``: one array (``allow_pickle=False``) -> ``{"data": array}``.
- ``npz``: one sample, one field per array (``allow_pickle=False``).
- ``pt``: ``torch.load(weights_only=True, map_location="cpu")``; a tensor -> ``{"data": tensor}``; a dict ->
  its fields; a list of tensors or dicts -> one sample each.
- ``msgpack``: a map -> its fields; a list of maps -> one sample each; any other value -> ``{"data": value}``.
  Arrays are encoded either as the ext type ``MSGPACK_NDARRAY_EXT`` (78, "N") whose payload is the msgpack
  array ``[dtype.str, shape, raw C-order bytes]`` (``msgpack.packb(obj, default=msgpack_default)`` writes it), or
  as msgpack-numpy's map ``{"nd": true, "type": dtype.str, "shape": [...], "data": bytes}`` (read only). An ext
  type is unambiguous, unlike a map with ``dtype``/``shape``/``data`` keys, which could be a user's own fields.
- ``raw``: ``{"data": body}`` (bytes), e.g. encoded images to decode in the workers (``images.DecodeImages``).
- ``image``: ``{"image": uint8 array (3, H, W)}``, decoded once in the daemon (``_images.py``: Pillow; resized and
  centre-cropped to ``sampler.image_size`` if set).
- ``tar``: webdataset layout. Regular members are grouped by directory + basename (the file name up to its first
  dot); one sample per group, in order of first appearance; the field name is the rest of the file name
  (``"jpg"``, ``"seg.png"``). Fields whose last extension is ``npy`` become arrays, ``cls`` an int, ``txt`` a
  str, ``json`` the parsed value; with ``sampler.decode_images`` the image fields become uint8 ``(3, H, W)``
  arrays: those named in ``sampler.image_fields``, or by default those whose whole name is an image format
  (``jpg``, ``png``, ...: not ``seg.png``, a mask that must keep its values); others stay bytes. ``__key__`` is
  ``dir/basename``. A member that fails to decode (a corrupt JPEG, a ``cls`` that is not an integer) costs its
  sample only: the sample is left out and named in ``Decoded.skipped``, its neighbours are kept. Members with
  absolute or ``..`` names, non-regular members (links, devices, directories) and names without an extension
  are skipped; nothing is ever extracted to disk. Compressed tars (gz, bz2, xz) are read transparently. An
  archive cut short (no end-of-archive zero block after the last member) is a ``DecodeError``, not fewer samples.
  A plain archive (uncompressed ustar or GNU headers, no pax or long-name headers) is read straight from its
  headers, the same members ``tarfile`` gives at a fraction of its cost; anything else goes through ``tarfile``.

What a decoder may return (the segment writer's contract, checked by ``check_sample`` for every decoder, user
ones included): field names are ``str`` and may not start with ``__`` (except ``__key__``); values are numpy
arrays (not of object dtype; numpy scalars become 0-d arrays), strided CPU torch tensors, bytes, str, int,
float, bool, None, or lists/dicts (string keys) of those scalars, nested at most ``MAX_NESTING`` deep. Arrays
are not allowed inside lists/dicts.

Every other failure raises ``DecodeError`` naming the key and the reason; the caller quarantines the object.

Why one long module: it is the registry of decoders (``BUILTIN_DECODERS``: the config validates names against it)
and the formats it names; each decoder is a few lines, and the one-object-many-samples rules are shared.
"""

from __future__ import annotations

import functools
import importlib
import io
import json
import math
import posixpath
import struct
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from cachefeed._errors import ConfigError, DecodeError
from cachefeed._images import IMAGE_EXTENSIONS, decode_image
from cachefeed._images import image_size as image_size_of

__all__ = [
    "MAX_NESTING",
    "MSGPACK_NDARRAY_EXT",
    "Decoded",
    "Decoder",
    "Sample",
    "check_sample",
    "get_decoder",
    "get_preprocess",
    "load_callable",
    "msgpack_default",
]

Sample = dict[str, Any]


class Decoded(list[Sample]):
    """What a checked decoder returns: the samples of one object, and ``skipped``, the ``(__key__, reason)`` of each
    sample left out because one of its parts failed to decode (tar members; the other samples are kept)."""

    def __init__(self, samples: Iterable[Sample] = (), skipped: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(samples)
        self.skipped = list(skipped)


Decoder = Callable[[str, bytes], Iterable[Sample]]

MSGPACK_NDARRAY_EXT = 78
MAX_NESTING = 16
_SCALARS = (bytes, str, int, float, bool, type(None))


# ------------------------------------------------------------------------------------------------ the formats


def _load_npy(payload: bytes) -> np.ndarray[Any, Any]:
    """A read-only view of the array in an ``.npy`` body: the body's bytes are not copied (the segment writer
    copies them once, into the cache). Object arrays (pickles) are refused."""
    stream = io.BytesIO(payload)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version in ((2, 0), (3, 0)):
        shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        raise ValueError(f"unsupported .npy format version {version}")
    if dtype.hasobject:
        raise ValueError("an .npy of Python objects needs pickle, which is refused")
    count = int(np.prod(shape, dtype=np.int64))
    needed = count * dtype.itemsize
    offset = stream.tell()
    if len(payload) - offset < needed:
        raise ValueError(f".npy body too short: {len(payload) - offset} bytes of data, the header says {needed}")
    flat = np.frombuffer(payload, dtype=dtype, count=count, offset=offset) if count else np.empty(0, dtype)
    return flat.reshape(shape, order="F" if fortran_order else "C")


def decode_npy(key: str, body: bytes) -> list[Sample]:
    return [{"data": _load_npy(body), "__key__": key}]


def decode_npz(key: str, body: bytes) -> list[Sample]:
    archive = np.load(io.BytesIO(body), allow_pickle=False)
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"expected an .npz archive, found {type(archive).__name__}")
    with archive:
        sample: Sample = {name: _collatable(archive[name]) for name in archive.files}
    return [{**sample, "__key__": key}]


def _collatable(array: np.ndarray[Any, Any]) -> Any:
    """A text array (``<U5``) as ``str`` (0-d) or a list of ``str``, which default_collate batches; arrays of any
    other dtype as they are."""
    if array.dtype.kind == "U":
        return array.item() if array.ndim == 0 else array.tolist()
    return array


def decode_pt(key: str, body: bytes) -> list[Sample]:
    import torch

    value = torch.load(io.BytesIO(body), weights_only=True, map_location="cpu")
    if isinstance(value, tuple) and not all(isinstance(item, dict) for item in value):
        # torch.save((image, label)): one sample, fields named by position ("0", "1", ...)
        return [{**{str(i): item for i, item in enumerate(value)}, "__key__": key}]
    items = value if isinstance(value, list | tuple) else [value]
    samples = []
    for index, item in enumerate(items):
        sample = dict(item) if isinstance(item, dict) else {"data": item}
        sample["__key__"] = key if items is not value else f"{key}#{index}"
        samples.append(sample)
    return samples


def msgpack_default(value: Any) -> Any:
    """``default=`` hook for ``msgpack.packb``: numpy arrays and scalars -> the ndarray ext type."""
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if isinstance(value, np.ndarray) and value.dtype != object:
        payload = msgpack.packb([value.dtype.str, list(value.shape), np.ascontiguousarray(value).tobytes()])
        return msgpack.ExtType(MSGPACK_NDARRAY_EXT, payload)
    raise TypeError(f"cannot msgpack-encode {type(value).__name__}")


def _array(dtype: Any, shape: Any, data: Any) -> np.ndarray[Any, Any]:
    if not isinstance(dtype, str | bytes) or not isinstance(data, bytes):
        raise ValueError("array dtype must be a string and data bytes")
    if not isinstance(shape, list | tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError("array shape must be a list of integers >= 0")
    kind = np.dtype(dtype.decode() if isinstance(dtype, bytes) else dtype)
    if kind.hasobject:
        raise ValueError("object arrays are not allowed")
    if len(data) != math.prod(shape) * kind.itemsize:
        raise ValueError(f"array data is {len(data)} bytes, shape {list(shape)} of {kind} needs more or less")
    return np.frombuffer(data, dtype=kind).reshape(shape)


def _ext_hook(code: int, payload: bytes) -> Any:
    if code != MSGPACK_NDARRAY_EXT:
        raise ValueError(f"unknown msgpack ext type {code}")
    fields = msgpack.unpackb(payload, raw=False)
    if not isinstance(fields, list) or len(fields) != 3:
        raise ValueError("ndarray ext payload must be [dtype, shape, data]")
    return _array(*fields)


def _object_hook(mapping: dict[Any, Any]) -> Any:
    get = mapping.get
    if (get("nd") is True or get(b"nd") is True) and ("type" in mapping or b"type" in mapping):
        dtype = get("type", get(b"type"))
        shape = get("shape", get(b"shape"))
        return _array(dtype, shape, get("data", get(b"data")))
    return mapping


def decode_msgpack(key: str, body: bytes) -> list[Sample]:
    unpacker = msgpack.Unpacker(
        raw=False,
        ext_hook=_ext_hook,
        object_hook=_object_hook,
        strict_map_key=False,
        max_buffer_size=max(1, len(body)),
    )
    unpacker.feed(body)
    values = list(unpacker)
    if not values or unpacker.tell() != len(body):
        raise ValueError("truncated msgpack data")
    if len(values) > 1:  # a stream of concatenated records: one sample per record
        return [
            {**(_str_keys(item) if isinstance(item, dict) else {"data": item}), "__key__": f"{key}#{index}"}
            for index, item in enumerate(values)
        ]
    value = values[0]
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return [{**_str_keys(item), "__key__": f"{key}#{index}"} for index, item in enumerate(value)]
    if isinstance(value, dict):
        return [{**_str_keys(value), "__key__": key}]
    return [{"data": value, "__key__": key}]


def _str_keys(mapping: dict[Any, Any]) -> Sample:
    out: Sample = {}
    for name, value in mapping.items():
        out[name.decode() if isinstance(name, bytes) else name] = value
    return out


def decode_raw(key: str, body: bytes) -> list[Sample]:
    return [{"data": bytes(body), "__key__": key}]


def decode_image_object(key: str, body: bytes, *, size: tuple[int, int] | None = None) -> list[Sample]:
    return [{"image": decode_image(body, key, size=size), "__key__": key}]


def _tar_field(extension: str, payload: bytes, images: _Images | None = None, key: str = "") -> Any:
    last = extension.rsplit(".", 1)[-1].lower()
    if images is not None and images.decodes(extension):
        return decode_image(payload, key, size=images.size)
    if last == "npy":
        return _load_npy(payload)
    if last == "cls":
        return int(payload.decode().strip())
    if last == "txt":
        return payload.decode()
    if last == "json":
        return json.loads(payload)
    return payload


def _tar_group(name: str) -> tuple[str, str] | None:
    """(group, field) of a member name, or None when the member must be skipped."""
    if "/" not in name:  # most shards: no directory, nothing to normalize ("", "." and ".." have no basename)
        basename, dot, extension = name.partition(".")
        return (basename, extension) if basename and dot and extension else None
    if name.startswith("/") or ".." in name.split("/"):
        return None
    directory, filename = posixpath.split(posixpath.normpath(name))
    basename, dot, extension = filename.partition(".")
    if not basename or not dot or not extension:
        return None
    return posixpath.join(directory, basename), extension


@dataclass(frozen=True, slots=True)
class _Images:
    """Decode the image fields of tar shards (``sampler.decode_images``), to ``size`` if given: the fields named in
    ``fields`` (``sampler.image_fields``), or when it is empty those whose whole name is an image format."""

    size: tuple[int, int] | None
    fields: frozenset[str] = frozenset()

    def decodes(self, field: str) -> bool:
        return field in self.fields if self.fields else field.lower() in IMAGE_EXTENSIONS


def decode_tar(key: str, body: bytes, *, images: _Images | None = None) -> Decoded:
    """The samples of a webdataset shard (module docstring); a member that fails to decode leaves its sample out
    (``Decoded.skipped``), a malformed archive raises."""
    groups: dict[str, Sample] = {}
    failed: dict[str, str] = {}  # group -> why its sample is left out (the first member that failed)
    members = _plain_tar_members(body)
    for name, payload in members if members is not None else _tarfile_members(body):
        where = _tar_group(name)
        if where is None:
            continue
        group, extension = where
        sample = groups.setdefault(group, {"__key__": group})
        if extension in sample:
            raise ValueError(f"member {name!r}: field {extension!r} appears twice in {group!r}")
        if group in failed:
            sample[extension] = None  # the sample is left out: only its fields' names are kept
            continue
        try:
            sample[extension] = _tar_field(extension, payload, images, name)
        except (ValueError, DecodeError) as exc:  # bad data in this member: costs its sample, not the shard
            sample[extension] = None
            reason = str(exc) if isinstance(exc, DecodeError) else f"{type(exc).__name__}: {exc}"
            failed[group] = reason if reason.startswith(name) else f"member {name!r}: {reason}"
    return Decoded(
        (sample for group, sample in groups.items() if group not in failed),
        ((group, why) for group, why in failed.items()),
    )


def _tarfile_members(body: bytes) -> Iterator[tuple[str, bytes]]:
    """(name, payload) of each regular member, read by ``tarfile`` (any archive it reads: compressed, pax, GNU
    long names); raises on a malformed or truncated one."""
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as archive:
        for member in archive:
            if not member.isreg() or _tar_group(member.name) is None:
                continue
            handle = archive.extractfile(member)
            if handle is not None:  # tarfile decodes a name that is no UTF-8 with surrogateescape: escaped as below
                yield member.name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"), handle.read()
        _check_end_of_archive(archive)


_POSIX_MAGIC = b"ustar\x0000"
_GNU_MAGIC = b"ustar  \x00"
_MAGICS = (_POSIX_MAGIC, _GNU_MAGIC)
_REGULAR = (b"0", b"\x00", b"7")  # what tarfile's isreg() accepts
_NOT_REGULAR = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, FIFOs: skipped
_KINDS = frozenset(_REGULAR + _NOT_REGULAR)
# The header fields read, in one unpack: name (0-100), size (124-136), chksum (148-156), typeflag (156), magic and
# version (257-265), prefix (345-500); the rest (mode, ids, mtime, link name, owner names, devices) is skipped.
_HEADER = struct.Struct("100s24x12s12x8sc100x8s80x155s")


def _plain_tar_members(body: bytes) -> list[tuple[str, bytes]] | None:
    """(name, payload) of each regular member of a plain archive (uncompressed ustar or GNU headers, no pax or long
    names, every checksum right, ending in a zero block), read straight from the headers: what ``tarfile`` gives
    for it at a fraction of the cost (its header parsing is most of a small-sample shard's decode; here a header
    is one ``struct`` unpack). None for anything else: ``_tarfile_members`` then reads it, and raises what it
    raises."""
    members: list[tuple[str, bytes]] = []
    offset, end = 0, len(body)
    headers: list[int] = []  # their offsets, and the checksums they state: all checked at once (_checksums_hold)
    stated: list[int] = []
    unpack = _HEADER.unpack_from
    while offset + tarfile.BLOCKSIZE <= end:
        name, size_field, checksum, kind, magic, prefix = unpack(body, offset)
        if magic not in _MAGICS:
            if body[offset : offset + tarfile.BLOCKSIZE] == _ZERO_BLOCK:  # the end-of-archive block
                return members if _checksums_hold(memoryview(body), headers, stated) else None
            return None
        if size_field[0] & 0x80 or kind not in _KINDS:  # a base-256 size (GNU), or a kind tarfile reads otherwise
            return None
        try:
            stated.append(int(checksum.strip(b"\x00 ") or b"x", 8))
            size = int(size_field.strip(b"\x00 ") or b"0", 8)
        except ValueError:
            return None
        headers.append(offset)
        name = name.split(b"\x00", 1)[0]
        if magic == _POSIX_MAGIC and prefix[0]:
            name = prefix.split(b"\x00", 1)[0] + b"/" + name
        start = offset + tarfile.BLOCKSIZE
        if start + size > end:
            return None
        text = name.decode("utf-8", "backslashreplace")  # a name that is no UTF-8: its bytes escaped, not dropped
        is_directory = kind == b"\x00" and text.endswith("/")  # tarfile's old-style directory
        if kind in _REGULAR and not is_directory and _tar_group(text) is not None:
            members.append((text, body[start : start + size]))
        offset = start + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    return None  # no end-of-archive block: cut short


_ZERO_BLOCK = bytes(tarfile.BLOCKSIZE)
_CHKSUM = slice(148, 156)  # a header's checksum field, counted as spaces in the checksum


def _checksums_hold(view: memoryview, headers: list[int], stated: list[int]) -> bool:
    """Whether each header at ``headers`` (offsets, multiples of the block size) sums to the checksum it states:
    every byte of the header, its checksum field as eight spaces. One numpy sum for the whole archive: summing
    each 512-byte header in Python was most of a small-sample shard's decode."""
    if not headers:
        return True
    blocks = np.frombuffer(view, dtype=np.uint8, count=len(view) // tarfile.BLOCKSIZE * tarfile.BLOCKSIZE)
    rows = blocks.reshape(-1, tarfile.BLOCKSIZE)[np.asarray(headers) // tarfile.BLOCKSIZE]
    sums = rows.sum(axis=1, dtype=np.int64) - rows[:, _CHKSUM].sum(axis=1, dtype=np.int64) + 8 * 32
    return bool(np.array_equal(sums, np.asarray(stated, dtype=np.int64)))


def _check_end_of_archive(archive: tarfile.TarFile) -> None:
    """tarfile stops quietly at a truncated header; a complete archive ends with a zero block there instead."""
    stream = archive.fileobj
    stream.seek(archive.offset)
    if stream.read(tarfile.BLOCKSIZE) != tarfile.NUL * tarfile.BLOCKSIZE:
        raise ValueError("truncated tar archive: no end-of-archive block after the last member")


_BUILTINS: dict[str, Callable[[str, bytes], list[Sample]]] = {  # the registry: config validates names against it
    "npy": decode_npy,
    "npz": decode_npz,
    "pt": decode_pt,
    "msgpack": decode_msgpack,
    "raw": decode_raw,
    "tar": decode_tar,
    "image": decode_image_object,
}
BUILTIN_DECODERS = tuple(_BUILTINS)


# ------------------------------------------------------------------------------------------------ the contract


def _check_value(value: Any, depth: int) -> str | None:
    """None if ``value`` can be written, else why not."""
    if isinstance(value, _SCALARS):
        return None
    if depth == 0 and isinstance(value, np.ndarray):
        return "object arrays are not allowed" if value.dtype.hasobject else None
    if depth == 0 and type(value).__module__.startswith("torch"):
        import torch

        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.device.type != "cpu":
                return f"tensors must be dense CPU tensors, not {value.layout} on {value.device}"
            return None
    if depth >= MAX_NESTING:
        return f"nested deeper than {MAX_NESTING} levels"
    if isinstance(value, list | tuple):
        for item in value:
            if (reason := _check_value(item, depth + 1)) is not None:
                return reason
        return None
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                return f"dict keys must be strings, not {type(name).__name__}"
            if (reason := _check_value(item, depth + 1)) is not None:
                return reason
        return None
    where = "inside a list or dict" if depth else "as a field"
    return f"{type(value).__module__}.{type(value).__name__} cannot be stored {where}"


def printable(text: str) -> str:
    """``text`` with what UTF-8 cannot hold (lone surrogates: a name decoded with ``surrogateescape``) written as
    backslash escapes: valid text for a record, a message or the log, and still telling the characters apart."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_sample(key: str, sample: Any) -> Sample:
    """Return ``sample`` with ``__key__`` set (defaulting to ``key``), or raise ``DecodeError``. ``__url__`` (a str,
    set by the daemon) is the other reserved name allowed."""
    if not isinstance(sample, dict):
        raise DecodeError(f"{key}: a decoder must yield dicts of fields, got {type(sample).__name__}")
    sample.setdefault("__key__", key)
    if not isinstance(sample["__key__"], str):
        raise DecodeError(f"{key}: __key__ must be a str, got {type(sample['__key__']).__name__}")
    for name, value in list(sample.items()):
        if not isinstance(name, str):
            raise DecodeError(f"{key}: field names must be strings, got {name!r}")
        if name == "__key__":
            continue
        if name == "__url__" and isinstance(value, str):
            continue
        if name.startswith("__"):
            raise DecodeError(f"{key}: field {name!r}: names starting with '__' are reserved")
        if isinstance(value, np.generic):
            sample[name] = np.asarray(value)  # numpy scalars are stored as 0-d arrays
        if (reason := _check_value(sample[name], 0)) is not None:
            raise DecodeError(f"{key}: field {name!r}: {reason}")
    return sample


def _checked(name: str, decode: Callable[[str, bytes], Iterable[Any]]) -> Callable[[str, bytes], Decoded]:
    def checked_decoder(key: str, body: bytes) -> Decoded:
        try:
            result = decode(key, body)
            samples = list(result)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"{key}: not valid {name} data: {type(exc).__name__}: {exc}") from exc
        skipped = result.skipped if isinstance(result, Decoded) else ()
        return Decoded((check_sample(key, sample) for sample in samples), skipped)

    checked_decoder.__name__ = f"decode_{name}"
    return checked_decoder


def get_decoder(
    name: str, *, decode_images: bool = False, image_size: Any = None, image_fields: Iterable[str] = ()
) -> Callable[[str, bytes], Decoded]:
    """The decoder for a built-in format name or a ``"package.module:function"`` spec (wrapped and checked).

    ``image`` decodes each object as an image (``_images.py``); ``decode_images`` does the same for the image fields
    of ``tar`` shards (``image_fields``, or by default the fields named as an image format); both resize and crop
    to ``image_size`` (``images.image_size`` forms) when given.
    """
    size = image_size_of(image_size)
    if name == "image":
        return _checked(name, functools.partial(decode_image_object, size=size))
    if name == "tar" and decode_images:
        return _checked(name, functools.partial(decode_tar, images=_Images(size, frozenset(image_fields))))
    builtin = _BUILTINS.get(name)
    if builtin is not None:
        return _checked(name, builtin)
    return _checked(name, load_callable(name))


def get_preprocess(spec: str) -> Callable[[Sample], Sample] | None:
    """The user's deterministic preprocess callable (checked like a decoder's output), or None for ""."""
    if not spec:
        return None
    function = load_callable(spec)

    def preprocess(sample: Sample) -> Sample:
        key = str(sample.get("__key__", "?"))
        try:
            result = function(sample)
        except Exception as exc:
            raise DecodeError(f"{key}: preprocess {spec} failed: {type(exc).__name__}: {exc}") from exc
        if isinstance(result, dict):
            result.setdefault("__key__", key)
        return check_sample(key, result)

    return preprocess


def load_callable(spec: str) -> Callable[..., Any]:
    """Import ``"package.module:attr.path"`` and return it; ``ConfigError`` naming the spec if that fails."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigError(f'{spec!r}: expected "package.module:function"')
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"{spec!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"{spec!r}: {module_name!r} has no attribute {attribute!r}") from None
    if not callable(target):
        raise ConfigError(f"{spec!r}: {attribute!r} is a {type(target).__name__}, not a callable")
    return target  # type: ignore[no-any-return]
