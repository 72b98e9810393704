"""Decoders: each built-in format on good and malformed input, user callables, and the writer's contract."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis.extra import numpy as hnp

from cachefeed._codecs import (
    MSGPACK_NDARRAY_EXT,
    Sample,
    check_sample,
    get_decoder,
    get_preprocess,
    load_callable,
    msgpack_default,
)
from cachefeed._errors import ConfigError, DecodeError

KEY = "bucket/prefix/object-000"
NOT_CALLABLE = 42


def npy_bytes(array: np.ndarray[Any, Any], *, allow_pickle: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return buffer.getvalue()


def decode(name: str, body: bytes) -> list[Sample]:
    return list(get_decoder(name)(KEY, body))


# ---------------------------------------------------------------------------------------------------- npy, npz


def test_npy() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    (sample,) = decode("npy", npy_bytes(array))
    assert sample["__key__"] == KEY
    np.testing.assert_array_equal(sample["data"], array)
    assert sample["data"].dtype == np.float32


@pytest.mark.parametrize(
    "array",
    [
        np.asfortranarray(np.arange(24, dtype=">i4").reshape(2, 3, 4)),
        np.zeros((0, 5), np.float64),
        np.array(3.5),
        np.array([(1, 2.0)], dtype=[("a", "<i2"), ("b", "<f8")]),
    ],
    ids=["fortran-big-endian", "empty", "scalar", "structured"],
)
def test_npy_layouts_round_trip_without_copying_the_body(array: np.ndarray) -> None:
    body = npy_bytes(array)
    (sample,) = decode("npy", body)
    np.testing.assert_array_equal(sample["data"], array)
    assert sample["data"].dtype == array.dtype and sample["data"].shape == array.shape
    if array.size:
        assert np.shares_memory(sample["data"], np.frombuffer(body, np.uint8))  # a view of the body


@pytest.mark.parametrize(
    "body",
    [b"not an array", npy_bytes(np.arange(10))[:-8], npy_bytes(np.array([{"a": 1}], dtype=object), allow_pickle=True)],
    ids=["garbage", "truncated", "pickled-objects"],
)
def test_npy_malformed(body: bytes) -> None:
    with pytest.raises(DecodeError, match=KEY):
        decode("npy", body)


def test_npz() -> None:
    buffer = io.BytesIO()
    np.savez(buffer, image=np.ones((2, 2), np.uint8), label=np.int64(3))
    (sample,) = decode("npz", buffer.getvalue())
    assert sorted(sample) == ["__key__", "image", "label"]
    np.testing.assert_array_equal(sample["image"], np.ones((2, 2), np.uint8))
    assert int(sample["label"]) == 3


def test_npz_malformed() -> None:
    buffer = io.BytesIO()
    np.savez(buffer, a=np.arange(100))
    with pytest.raises(DecodeError, match=KEY):
        decode("npz", buffer.getvalue()[:50])
    with pytest.raises(DecodeError, match="npz"):
        decode("npz", npy_bytes(np.arange(3)))  # an .npy is not an .npz


# ---------------------------------------------------------------------------------------------------- pt


def pt_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_pt_tensor_dict_and_list() -> None:
    (single,) = decode("pt", pt_bytes(torch.arange(6).reshape(2, 3)))
    assert torch.equal(single["data"], torch.arange(6).reshape(2, 3))

    (fields,) = decode("pt", pt_bytes({"x": torch.ones(3), "label": 7, "name": "cat"}))
    assert fields["label"] == 7 and fields["name"] == "cat" and fields["__key__"] == KEY
    assert torch.equal(fields["x"], torch.ones(3))

    several = decode("pt", pt_bytes([{"x": torch.zeros(1)}, {"x": torch.ones(1)}]))
    assert [sample["__key__"] for sample in several] == [f"{KEY}#0", f"{KEY}#1"]


class Payload:
    """Not allowed by ``weights_only=True``: unpickling it would run arbitrary code."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.getcwd, ())


def test_pt_malformed_and_unsafe() -> None:
    with pytest.raises(DecodeError, match=KEY):
        decode("pt", b"\x00garbage")
    with pytest.raises(DecodeError, match=KEY):
        decode("pt", pt_bytes({"x": Payload()}))
    with pytest.raises(DecodeError, match=r"sparse|layout"):
        decode("pt", pt_bytes(torch.eye(3).to_sparse()))


# ---------------------------------------------------------------------------------------------------- msgpack


def test_msgpack_map_with_ext_arrays_and_list_of_maps() -> None:
    image = np.arange(24, dtype="<u2").reshape(2, 3, 4)
    body = msgpack.packb({"image": image, "label": 3, "tags": ["a", "b"], "meta": {"w": 4}}, default=msgpack_default)
    (sample,) = decode("msgpack", body)
    np.testing.assert_array_equal(sample["image"], image)
    assert sample["label"] == 3 and sample["tags"] == ["a", "b"] and sample["meta"] == {"w": 4}

    several = decode("msgpack", msgpack.packb([{"v": 1}, {"v": 2}]))
    assert [(s["v"], s["__key__"]) for s in several] == [(1, f"{KEY}#0"), (2, f"{KEY}#1")]


def test_msgpack_numpy_map_format_and_scalar_value() -> None:
    array = np.array([1.5, 2.5], dtype="<f8")
    legacy = {b"nd": True, b"type": "<f8", b"kind": b"", b"shape": [2], b"data": array.tobytes()}
    (sample,) = decode("msgpack", msgpack.packb({"x": legacy}))
    np.testing.assert_array_equal(sample["x"], array)
    (whole,) = decode("msgpack", msgpack.packb(legacy))
    np.testing.assert_array_equal(whole["data"], array)
    (scalar,) = decode("msgpack", msgpack.packb("just text"))
    assert scalar["data"] == "just text"


@given(hnp.arrays(dtype=hnp.scalar_dtypes(), shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4)))
@settings(max_examples=60, deadline=None)
def test_msgpack_ext_roundtrips_any_array(array: np.ndarray[Any, Any]) -> None:
    (sample,) = decode("msgpack", msgpack.packb({"a": array}, default=msgpack_default))
    assert sample["a"].dtype == array.dtype and sample["a"].shape == array.shape
    np.testing.assert_array_equal(sample["a"], array)


@pytest.mark.parametrize(
    "body",
    [
        msgpack.packb({"a": 1})[:-1],
        msgpack.packb({"a": msgpack.ExtType(MSGPACK_NDARRAY_EXT, msgpack.packb(["<f4", [4], b"\x00" * 3]))}),
        msgpack.packb({"a": msgpack.ExtType(MSGPACK_NDARRAY_EXT, msgpack.packb(["|O", [1], b"\x00" * 8]))}),
        msgpack.packb({"a": msgpack.ExtType(5, b"?")}),
        msgpack.packb({"nested": [msgpack.ExtType(MSGPACK_NDARRAY_EXT, msgpack.packb(["<f4", [1], b"\x00" * 4]))]}),
        msgpack.packb({1: "int key"}),
    ],
    ids=["truncated", "short-array-data", "object-dtype", "unknown-ext", "array-in-list", "int-field-name"],
)
def test_msgpack_malformed(body: bytes) -> None:
    with pytest.raises(DecodeError, match=KEY):
        decode("msgpack", body)


# ---------------------------------------------------------------------------------------------------- raw


def test_raw() -> None:
    (sample,) = decode("raw", b"\xff\xd8jpeg bytes")
    assert sample == {"data": b"\xff\xd8jpeg bytes", "__key__": KEY}
    (empty,) = decode("raw", b"")  # raw has no malformed input: any bytes are a sample
    assert empty["data"] == b""


# ---------------------------------------------------------------------------------------------------- tar


def add(archive: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.linkname = link
    archive.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def shard(members: list[tuple[str, bytes]], mode: str = "w", hostile: bool = False) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as archive:  # type: ignore[call-overload]
        for name, data in members:
            add(archive, name, data)
        if hostile:
            add(archive, "../escape.txt", b"up")
            add(archive, "/abs/root.txt", b"abs")
            add(archive, "a/s1.png", kind=tarfile.SYMTYPE, link="/etc/passwd")
            add(archive, "s2.lnk", kind=tarfile.LNKTYPE, link="s2.txt")
            add(archive, "dev.raw", kind=tarfile.CHRTYPE)
            add(archive, "fifo.raw", kind=tarfile.FIFOTYPE)
            add(archive, "subdir", kind=tarfile.DIRTYPE)
            add(archive, "README", b"no extension")
            add(archive, "a/.hidden", b"no basename")
    return buffer.getvalue()


GOOD_MEMBERS = [
    ("a/s1.jpg", b"\xff\xd8jpeg"),
    ("a/s1.cls", b" 3\n"),
    ("a/s1.json", json.dumps({"boxes": [[1, 2, 3, 4]], "ok": True}).encode()),
    ("s2.npy", npy_bytes(np.eye(2))),
    ("s2.txt", "caption é".encode()),
    ("s2.seg.npy", npy_bytes(np.zeros(3, np.int8))),
]


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    assert list(tmp_path.iterdir()) == []  # nothing was extracted to disk


@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_tar_groups_by_basename_and_skips_hostile_members(mode: str, empty_cwd: Path) -> None:
    samples = decode("tar", shard(GOOD_MEMBERS, mode, hostile=True))

    assert [s["__key__"] for s in samples] == ["a/s1", "s2"], "webdataset's keys: the member's basename group"
    first, second = samples
    assert sorted(first) == ["__key__", "cls", "jpg", "json"]
    assert first["jpg"] == b"\xff\xd8jpeg" and first["cls"] == 3
    assert first["json"] == {"boxes": [[1, 2, 3, 4]], "ok": True}
    assert sorted(second) == ["__key__", "npy", "seg.npy", "txt"]
    np.testing.assert_array_equal(second["npy"], np.eye(2))
    np.testing.assert_array_equal(second["seg.npy"], np.zeros(3, np.int8))
    assert second["txt"] == "caption é"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"definitely not a tar archive" * 30, "tar"),
        (shard([("s.jpg", b"1"), ("./s.jpg", b"2")]), "twice"),
        (shard(GOOD_MEMBERS)[:1500], "tar"),
    ],
    ids=["garbage", "duplicate-field", "truncated"],
)
def test_a_malformed_tar_archive_fails_the_whole_object(body: bytes, reason: str, empty_cwd: Path) -> None:
    with pytest.raises(DecodeError, match=KEY) as caught:
        decode("tar", body)
    assert reason in str(caught.value)


@pytest.mark.parametrize(
    ("member", "payload"),
    [("bad.cls", b"three"), ("bad.npy", b"not npy"), ("bad.json", b"{broken"), ("bad.txt", b"\xff\xfe")],
)
def test_a_tar_member_that_fails_to_decode_costs_its_sample_only(member: str, payload: bytes) -> None:
    body = shard([("a.cls", b"1"), ("bad.jpg", b"\xff\xd8jpeg"), (member, payload), ("c.cls", b"3")])
    samples = get_decoder("tar")(KEY, body)
    assert [(s["__key__"], s["cls"]) for s in samples] == [("a", 1), ("c", 3)], "the neighbours are kept"
    ((key, reason),) = samples.skipped
    assert key == "bad" and member in reason, (key, reason)


FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("long_names", [False, True])
def test_a_plain_tar_is_read_from_its_headers_exactly_as_tarfile_reads_it(fmt: int, long_names: bool) -> None:
    """The fast path (``_plain_tar_members``) gives what ``tarfile`` gives, or declines (None) and ``tarfile``
    reads the archive: pax headers, GNU long names (over 100 characters), compression."""
    from cachefeed._codecs import _plain_tar_members, _tarfile_members

    deep = "d" * 60 + "/" + "e" * 60 + "/" if long_names else "x/"  # a ustar name prefix, or a GNU long name
    members = [(deep + f"{i:04d}.bin", bytes([i]) * (i * 97 % 1500)) for i in range(12)] + GOOD_MEMBERS
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as archive:
        for name, data in members:
            add(archive, name, data)
        add(archive, "a/s1.png", kind=tarfile.SYMTYPE, link="/etc/passwd")  # skipped by both
        add(archive, "subdir", kind=tarfile.DIRTYPE)
        add(archive, "../escape.txt", b"up")
    body = buffer.getvalue()
    expected = list(_tarfile_members(body))
    assert [name for name, _ in expected] == [name for name, _ in members]
    found = _plain_tar_members(body)
    if long_names and fmt != tarfile.USTAR_FORMAT:  # a GNU long-name or a pax header: tarfile's path
        assert found is None
    else:  # pax with short names writes plain ustar headers
        assert found == expected

    def plain(samples: list[Sample]) -> list[dict[str, Any]]:
        return [{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in s.items()} for s in samples]

    assert plain(decode("tar", body)) == plain(decode("tar", gzip.compress(body)))  # compressed: tarfile's path
    content_end = len(body.rstrip(b"\0"))  # the last member's last byte (then padding, the end blocks)
    for cut in (content_end - 1, content_end + 10, 700):  # cut short: declined, then tarfile raises
        assert _plain_tar_members(body[:cut]) is None
        with pytest.raises(DecodeError):
            decode("tar", body[:cut])


@pytest.mark.parametrize("which", [0, 5, -1])
def test_a_plain_tar_with_one_wrong_header_checksum_is_left_to_tarfile(which: int) -> None:
    """The fast path checks every header's checksum (all at once, at the end): one wrong checksum, first, in the
    middle or last, and it declines the whole archive, which ``tarfile`` then reads as it would any other."""
    from cachefeed._codecs import _plain_tar_members, _tarfile_members

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for i in range(8):
            add(archive, f"{i:04d}.bin", bytes([i + 1]) * (i * 300))
    body = bytearray(buffer.getvalue())
    assert _plain_tar_members(bytes(body)) == list(_tarfile_members(bytes(body)))
    headers = [offset for offset, _ in _header_offsets(bytes(body))]
    body[headers[which] + 30] ^= 0x01  # inside the name field's padding: only the checksum can tell
    assert _plain_tar_members(bytes(body)) is None


def _header_offsets(body: bytes) -> list[tuple[int, int]]:
    """(offset, size) of each member header of a plain archive."""
    found, offset = [], 0
    while body[offset : offset + 512] != bytes(512):
        size = int(body[offset + 124 : offset + 136].strip(b"\x00 ") or b"0", 8)
        found.append((offset, size))
        offset += 512 + -(-size // 512) * 512
    return found


@pytest.mark.parametrize(
    "name, group",
    [
        ("0001.bin", ("0001", "bin")),
        ("0001.seg.npy", ("0001", "seg.npy")),
        ("a/b/0001.cls", ("a/b/0001", "cls")),
        ("./a//0001.cls", ("a/0001", "cls")),
        ("noext", None),
        (".hidden", None),
        ("0001.", None),
        ("..", None),
        ("", None),
        ("/abs/0001.bin", None),
        ("a/../0001.bin", None),
    ],
)
def test_a_member_name_gives_its_sample_and_field_as_webdataset_groups_them(name: str, group: Any) -> None:
    from cachefeed._codecs import _tar_group

    assert _tar_group(name) == group


# ---------------------------------------------------------------------------------------------------- user callables


def user_decoder(key: str, body: bytes) -> Iterator[dict[str, Any]]:
    for index, line in enumerate(body.decode().splitlines()):
        yield {"line": line, "index": index} if index else {"line": line}


def failing_decoder(key: str, body: bytes) -> list[Sample]:
    raise RuntimeError("cannot parse")


def unwritable_decoder(key: str, body: bytes) -> list[Sample]:
    return [{"handle": object()}]


def double(sample: Sample) -> Sample:
    return {"data": sample["data"] * 2}


def broken_preprocess(sample: Sample) -> Sample:
    raise KeyError("missing")


def test_user_decoder_is_loaded_and_checked() -> None:
    samples = list(get_decoder("tests.test_codecs:user_decoder")(KEY, b"a\nb"))
    assert samples == [{"line": "a", "__key__": KEY}, {"line": "b", "index": 1, "__key__": KEY}]
    with pytest.raises(DecodeError, match=f"{KEY}.*cannot parse"):
        list(get_decoder("tests.test_codecs:failing_decoder")(KEY, b""))
    with pytest.raises(DecodeError, match=f"{KEY}.*'handle'"):
        list(get_decoder("tests.test_codecs:unwritable_decoder")(KEY, b""))


@pytest.mark.parametrize(
    "spec",
    ["nope", "tests.no_such_module:f", "tests.test_codecs:missing", "tests.test_codecs:NOT_CALLABLE", ":f"],
)
def test_bad_callable_specs_are_config_errors_naming_the_spec(spec: str) -> None:
    with pytest.raises(ConfigError) as caught:
        get_decoder(spec)
    assert repr(spec) in str(caught.value)


def test_load_callable_follows_attribute_paths() -> None:
    assert load_callable("os.path:join") is os.path.join
    assert load_callable("pickle:Pickler.dump") is pickle.Pickler.dump


def test_preprocess() -> None:
    assert get_preprocess("") is None
    preprocess = get_preprocess("tests.test_codecs:double")
    assert preprocess is not None
    assert preprocess({"data": 2, "__key__": KEY}) == {"data": 4, "__key__": KEY}
    broken = get_preprocess("tests.test_codecs:broken_preprocess")
    assert broken is not None
    with pytest.raises(DecodeError, match=f"{KEY}.*preprocess"):
        broken({"data": 1, "__key__": KEY})


# ---------------------------------------------------------------------------------------------------- the contract


def test_check_sample_contract() -> None:
    ok = check_sample(KEY, {"a": np.float32(1.5), "b": [1, "x", None, {"c": b"d"}], "t": torch.ones(2)})
    assert isinstance(ok["a"], np.ndarray) and ok["a"].shape == () and ok["__key__"] == KEY
    for bad in [{"__reserved": 1}, {"a": [np.zeros(2)]}, {"a": np.array([object()])}, {"a": {1: 2}}, {"a": 1j}]:
        with pytest.raises(DecodeError, match=KEY):
            check_sample(KEY, bad)
    with pytest.raises(DecodeError, match="dicts"):
        check_sample(KEY, ["not", "a", "dict"])
    deep: Any = 1
    for _ in range(40):
        deep = [deep]
    with pytest.raises(DecodeError, match="nested"):
        check_sample(KEY, {"deep": deep})


@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_tar_cut_anywhere_fails_or_is_complete(mode: str) -> None:
    body = shard(GOOD_MEMBERS, mode)
    complete = [sorted(sample) for sample in decode("tar", body)]
    for cut in range(0, len(body), 61):
        try:
            samples = decode("tar", body[:cut])
        except DecodeError:
            continue
        assert [sorted(sample) for sample in samples] == complete, f"silently partial at {cut} of {len(body)}"


def test_npz_text_arrays_come_out_as_str_that_default_collate_batches() -> None:
    from torch.utils.data import default_collate

    buffer = io.BytesIO()
    np.savez(buffer, name=np.array("tabby"), tags=np.array(["cat", "pet"]), x=np.ones(2, np.float32))
    (sample,) = decode("npz", buffer.getvalue())
    assert sample["name"] == "tabby" and sample["tags"] == ["cat", "pet"]
    batch = default_collate([{"name": sample["name"]}, {"name": "rex"}])
    assert batch["name"] == ["tabby", "rex"]


def test_pt_a_saved_tuple_is_one_sample_with_positional_fields() -> None:
    (sample,) = decode("pt", pt_bytes((torch.zeros(3, 4, 4), 7)))
    assert torch.equal(sample["0"], torch.zeros(3, 4, 4)) and sample["1"] == 7 and sample["__key__"] == KEY
    several = decode("pt", pt_bytes([{"x": torch.zeros(1)}, {"x": torch.ones(1)}]))
    assert len(several) == 2, "a list of samples is still many"


def test_msgpack_a_stream_of_records_is_one_sample_per_record() -> None:
    from cachefeed import msgpack_default

    body = b"".join(msgpack.packb({"x": np.arange(3), "label": i}, default=msgpack_default) for i in range(4))
    samples = decode("msgpack", body)
    assert [s["label"] for s in samples] == [0, 1, 2, 3]
    assert [s["__key__"] for s in samples] == [f"{KEY}#{i}" for i in range(4)]
    assert all(np.array_equal(s["x"], np.arange(3)) for s in samples)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("compressed", [False, True])
def test_a_tar_member_whose_name_is_not_utf8_is_kept_under_an_escaped_key(fmt: int, compressed: bool) -> None:
    """An archive written with latin-1 names (``café.bin``): its sample was decoded under a key with a lone
    surrogate, which no record can hold, and writing it ended the daemon's writer thread for good. The key now
    escapes the byte, as both tar readers give it (the fast path and ``tarfile``, through gzip); a pax archive
    records such a name as UTF-8 and gives it back as written."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt, encoding="latin-1") as archive:
        for name in ("a.bin", "caf\xe9.bin", "b.bin"):
            add(archive, name, name.encode("latin-1"))
    body = buffer.getvalue()
    samples = get_decoder("tar")(KEY, gzip.compress(body) if compressed else body)
    assert [(s["__key__"], bytes(s["bin"])) for s in samples] == [
        ("a", b"a.bin"),
        ("caf\xe9" if fmt == tarfile.PAX_FORMAT else "caf\\xe9", b"caf\xe9.bin"),
        ("b", b"b.bin"),
    ]
    for sample in samples:
        sample["__key__"].encode("utf-8")  # valid text: a record can hold it
