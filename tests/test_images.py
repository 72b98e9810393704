"""Image datasets as users have them: a folder of class directories (JPEG and PNG, mixed sizes) and webdataset
shards, decoded in the daemon or in the workers, labelled by directory with the full class list."""

from __future__ import annotations

import io
import posixpath
import struct
import tarfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from cachefeed._codecs import get_decoder
from cachefeed._config import toml_text
from cachefeed._errors import ConfigError, DecodeError
from cachefeed._images import DecodeImages, decode_image
from cachefeed._labels import ClassIndex, read_classes
from cachefeed._testing.daemon import DaemonProcess, start_daemon
from cachefeed._testing.samples import npy_bytes
from cachefeed._trainer import EpochLoaderFactory

CLASSES = [f"class_{c:02d}" for c in range(12)]
PER_CLASS = 10
SIZES = [(40, 30), (64, 48), (33, 57), (80, 80), (50, 70)]  # (width, height): mixed, as real folders are


def class_color(label_name: str) -> tuple[int, int, int]:
    c = int(label_name.rsplit("_", 1)[1])
    return (20 * c + 10, 250 - 20 * c, 128)


def encode(color: tuple[int, int, int], size: tuple[int, int], fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format=fmt, quality=95)
    return buffer.getvalue()


def image_folder(root: Path) -> Path:
    """``root/train/<class>/<n>.jpg|png``: 12 classes x 10 images, half JPEG, half PNG, five sizes."""
    for name in CLASSES:
        directory = root / "train" / name
        directory.mkdir(parents=True)
        for n in range(PER_CLASS):
            fmt, ext = ("JPEG", "jpg") if n % 2 else ("PNG", "png")
            (directory / f"{n}.{ext}").write_bytes(encode(class_color(name), SIZES[n % len(SIZES)], fmt))
    return root / "train"


def check_labelled_batch(batch: dict[str, Any], classes: list[str], shape: tuple[int, ...]) -> int:
    """Every sample's label names its directory, and its pixels are that class's colour. Returns the batch size."""
    images, labels = batch["image"], batch["label"]
    assert images.dtype == torch.uint8 and tuple(images.shape[1:]) == shape
    for key, image, label in zip(batch["__key__"], images, labels.tolist(), strict=True):
        directory = posixpath.basename(posixpath.dirname(key))
        assert classes[label] == directory, f"{key}: label {label} is {classes[label]}"
        mean = image.float().mean(dim=(1, 2))
        assert torch.allclose(mean, torch.tensor(class_color(directory), dtype=torch.float32), atol=6), (key, mean)
    return len(labels)


def daemon_on(
    tmp_path: Path,
    folder: Path,
    sampler: dict[str, Any],
    max_bytes: str = "64MiB",
    node: tuple[int, int] = (0, 1),
    turnover: str = "50%",
) -> DaemonProcess:
    cache_dir = tmp_path / f"cache{node[0]}"
    config = tmp_path / f"images{node[0]}.toml"
    document = {
        "remote": {"url": f"file://{folder}", "pattern": "**/*", "refresh_interval": "2s"},
        "cache": {
            "dir": str(cache_dir),
            "max_bytes": max_bytes,
            "segment_bytes": "32KiB",
            "fsync": False,
            "turnover": turnover,
        },
        "sampler": {"processes": 1, "concurrency": 4, **sampler},
        "node": {"rank": node[0], "count": node[1]},
        "status": {"interval": "200ms"},
    }
    config.write_text(toml_text(document))
    return start_daemon(config, cache_dir, tmp_path / f"daemon{node[0]}.err")


def test_a_folder_of_images_trains_decoded_in_the_daemon_with_labels_from_every_class(tmp_path: Path) -> None:
    folder = image_folder(tmp_path / "data")
    daemon = daemon_on(
        tmp_path, folder, {"decode": "image", "image_size": 64, "label": "parent"}, max_bytes="2MiB", turnover="25%"
    )
    try:
        daemon.wait_status(lambda d: d["cache"]["samples"] >= 16, timeout_s=60, what="images cached")
        with EpochLoaderFactory(
            daemon.cache_dir, batch_size=8, num_workers=2, min_samples=16, run_id="img", progress=None
        ) as factory:
            classes = factory.classes
            assert classes == CLASSES, "every class, from the listing, while the cache holds a part of the data"
            seen = 0
            for epoch in range(3):
                for batch in factory.loader(epoch):
                    seen += check_labelled_batch(batch, classes, (3, 64, 64))
            assert seen >= 3 * 16
        doc = daemon.status()
        assert doc is not None
        cached = doc["cache"]["samples"]
        assert cached < len(CLASSES) * PER_CLASS, f"the budget holds a part of the dataset, not {cached}"
        assert doc["cache"]["bytes"] // cached >= 3 * 64 * 64, "decoded pixels are what the cache holds"
    finally:
        assert daemon.stop() == 0


def decoded_in_workers(tmp_path: Path, folder: Path, run: str) -> tuple[list[str], Any]:
    """Epoch 0 of ``folder`` cached as compressed bytes (``decode = "raw"``) and decoded by ``DecodeImages`` in 2
    workers: the keys the loop received (each batch checked: labels, pixels, shape) and the epoch's statistics."""
    files = sum(1 for path in folder.rglob("*") if path.is_file())
    daemon = daemon_on(tmp_path, folder, {"decode": "raw", "label": "parent"})
    try:
        daemon.wait_status(lambda d: d["cache"]["samples"] == files, timeout_s=60, what="every file cached")
        decode = DecodeImages(fields=("data",), size=(48, 40))
        with EpochLoaderFactory(
            daemon.cache_dir, batch_size=10, num_workers=2, transform=decode, run_id=run, progress=None
        ) as factory:
            keys = []
            for batch in factory.loader(0):
                batch["image"] = batch.pop("data")
                check_labelled_batch(batch, factory.classes, (3, 48, 40))
                keys += batch["__key__"]
            return keys, factory.stats(0)
    finally:
        assert daemon.stop() == 0


def test_the_same_folder_decoded_in_the_workers_from_compressed_bytes(tmp_path: Path) -> None:
    keys, _stats = decoded_in_workers(tmp_path, image_folder(tmp_path / "data"), "raw")
    total = len(CLASSES) * PER_CLASS
    assert len(keys) == total and len(set(keys)) == total


def test_an_image_that_does_not_decode_in_the_workers_is_skipped_not_the_end_of_the_epoch(tmp_path: Path) -> None:
    """``decode = "raw"`` and ``DecodeImages`` in the workers, one file of the folder not an image: its
    ``DecodeError`` ended the epoch with a worker's traceback (the daemon's own decoding quarantines it). Now it
    is skipped and counted, as a corrupt record is; the witness is the keys the loop received."""
    folder = image_folder(tmp_path / "data")
    (folder / CLASSES[0] / "0.png").write_bytes(b"not an image at all")
    keys, stats = decoded_in_workers(tmp_path, folder, "bad")
    assert len(keys) == len(set(keys)) == len(CLASSES) * PER_CLASS - 1
    bad = [key for key in keys if key.endswith(f"{CLASSES[0]}/0.png")]  # keys are paths: train/<class>/<file>
    assert not bad and any(posixpath.basename(posixpath.dirname(key)) == CLASSES[0] for key in keys), keys[:5]
    assert stats.skipped_corrupt == 1


def test_two_nodes_build_the_same_class_index_and_label_their_own_share_by_it(tmp_path: Path) -> None:
    """Each node caches a disjoint half of the folder, and both number the classes the same way (from the whole
    listing, not from what each caches), so a label means the same class on every node."""
    from cachefeed._testing.samples import cache_samples

    folder = image_folder(tmp_path / "data")
    daemons = [daemon_on(tmp_path, folder, {"decode": "raw", "label": "parent"}, node=(r, 2)) for r in range(2)]
    try:
        for daemon in daemons:
            daemon.wait_status(
                lambda d: d["plan"]["owned"] > 0 and d["cache"]["samples"] == d["plan"]["owned"],
                timeout_s=60,
                what="each node's share cached",
            )
        indexes = [read_classes(daemon.cache_dir / "classes.json") for daemon in daemons]
        assert indexes[0] == indexes[1] == CLASSES, "the same complete index on both nodes"
        keys: list[set[str]] = []
        for daemon in daemons:
            held = set()
            for _segment, sample in cache_samples(daemon.cache_dir):
                key = str(sample["__key__"])
                assert CLASSES[int(sample["label"])] == posixpath.basename(posixpath.dirname(key)), key
                held.add(key)
            keys.append(held)
        assert not keys[0] & keys[1], "the nodes hold disjoint objects"
        assert len(keys[0] | keys[1]) == len(CLASSES) * PER_CLASS and keys[0] and keys[1]
    finally:
        for daemon in daemons:
            assert daemon.stop() == 0


def test_webdataset_shards_decode_their_images_in_the_daemon_and_a_one_class_label_is_warned_of(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    for shard in range(2):
        with tarfile.open(shards / f"shard-{shard}.tar", "w") as archive:
            for n in range(6):
                label = (shard * 6 + n) % len(CLASSES)
                members = {
                    f"s{shard}_{n}.jpg" if n % 2 else f"s{shard}_{n}.png": encode(
                        class_color(CLASSES[label]), SIZES[n % len(SIZES)], "JPEG" if n % 2 else "PNG"
                    ),
                    f"s{shard}_{n}.cls": str(label).encode(),
                }
                for name, payload in members.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    archive.addfile(info, io.BytesIO(payload))
    daemon = daemon_on(
        tmp_path, shards, {"decode": "tar", "decode_images": True, "image_size": [24, 32], "label": "parent"}
    )
    try:
        daemon.wait_status(lambda d: d["cache"]["samples"] == 12, timeout_s=60, what="both shards cached")
        # label = "parent" over shards in one directory: one class, every label 0; valid, but not what was meant
        (said,) = [line for line in daemon.stderr().splitlines() if "found one class" in line]
        assert "sampler.label = 'parent' found one class in the whole listing, 'shards'" in said, said
        assert "every sample gets label 0" in said and "(.cls)" in said, said
        with EpochLoaderFactory(daemon.cache_dir, batch_size=1, run_id="wds", progress=None) as factory:
            seen = 0
            for batch in factory.loader(0):  # one sample a batch: members are "jpg" in some samples, "png" in others
                seen += 1
                image = batch.get("jpg", batch.get("png"))
                assert image is not None and image.dtype == torch.uint8 and tuple(image.shape) == (1, 3, 24, 32)
                color = class_color(CLASSES[int(batch["cls"][0])])
                mean = image.float().mean(dim=(0, 2, 3))
                assert torch.allclose(mean, torch.tensor(color, dtype=torch.float32), atol=6)
            assert seen == 12
    finally:
        assert daemon.stop() == 0


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A valid-looking PNG of a few dozen bytes that declares ``width x height`` pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def test_bad_images_are_quarantined_with_a_reason_and_counted(tmp_path: Path) -> None:
    folder = image_folder(tmp_path / "data")
    good = (folder / CLASSES[0] / "1.jpg").read_bytes()
    (folder / CLASSES[0] / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (folder / CLASSES[0] / "notes.txt").write_text("not an image at all")
    (folder / CLASSES[0] / "bomb.png").write_bytes(bomb_png())
    daemon = daemon_on(tmp_path, folder, {"decode": "image", "image_size": 32, "label": "parent"})
    try:
        total = len(CLASSES) * PER_CLASS
        doc = daemon.wait_status(
            lambda d: d["cache"]["samples"] == total and sum(d["remote"]["not_cached"].values()) == 3,
            timeout_s=60,
            what="the good images cached, the three bad files quarantined",
        )
        assert doc["remote"]["not_cached"] == {"decode": 3}, doc["remote"]["not_cached"]
        err = daemon.stderr()
        assert "truncated.jpg" in err and "notes.txt" in err and "decompression bomb" in err
    finally:
        assert daemon.stop() == 0


def test_a_decompression_bomb_is_refused_before_any_pixel_is_allocated() -> None:
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match="decompression bomb"):
            decode_image(bomb_png(), "bomb.png", size=(32, 32))
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated for a 10-gigapixel declaration"


def jpeg_bytes(width: int, height: int, mode: str = "RGB", seed: int = 0) -> bytes:
    """A noisy gradient (real JPEG content, not a flat colour) in ``mode``."""
    y, x = np.mgrid[0:height, 0:width]
    noise = np.random.default_rng(seed).normal(0, 12, (height, width, 3))
    pixels = np.clip(np.stack([(x * 3) % 256, (y * 5) % 256, (x + y) % 256], -1) + noise, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def test_a_jpeg_declaring_a_huge_size_is_refused() -> None:
    body = bytearray(jpeg_bytes(64, 48))
    sof = body.index(b"\xff\xc0")  # baseline frame header: length, precision, then height and width
    body[sof + 5 : sof + 9] = struct.pack(">HH", 60_000, 60_000)
    with pytest.raises(DecodeError, match="decompression bomb"):
        decode_image(bytes(body), "huge.jpg", size=(32, 32))


def test_decode_images_takes_one_name_as_one_field_and_names_a_field_the_sample_lacks() -> None:
    """``fields="jpg"`` was ("j", "p", "g"), and a field the samples do not have was skipped: nothing decoded."""
    body = jpeg_bytes(64, 48)
    decoded = DecodeImages(fields="jpg", size=32)({"__key__": "s1", "jpg": body, "cls": 3})
    assert isinstance(decoded["jpg"], torch.Tensor) and tuple(decoded["jpg"].shape) == (3, 32, 32)
    with pytest.raises(DecodeError, match=r"s2: none of the fields 'jpg', 'png' to decode \(the sample has data\)"):
        DecodeImages(fields=("jpg", "png"))({"__key__": "s2", "data": body})
    either = DecodeImages(fields=("jpg", "png"), size=32)({"__key__": "s3", "png": body})  # one of them: fine
    assert tuple(either["png"].shape) == (3, 32, 32)
    with pytest.raises(ValueError, match="fields must name the fields to decode"):
        DecodeImages(fields=())


def test_resize_and_crop_are_deterministic_and_keep_the_centre() -> None:
    half = Image.new("RGB", (100, 50), (255, 0, 0))
    half.paste((0, 0, 255), (50, 0, 100, 50))  # left red, right blue
    buffer = io.BytesIO()
    half.save(buffer, format="PNG")
    first = decode_image(buffer.getvalue(), "k", size=(20, 20))
    second = decode_image(buffer.getvalue(), "k", size=(20, 20))
    assert first.shape == (3, 20, 20) and first.flags.c_contiguous and np.array_equal(first, second)
    assert first[0, :, 2].min() > 200 and first[2, :, 17].min() > 200, "the centre 50 x 50 of 100 x 50, scaled"


def test_the_class_index_is_stable_and_new_classes_get_new_indices(tmp_path: Path) -> None:
    path = tmp_path / "classes.json"
    index = ClassIndex(path, "parent")
    assert index.update(["/d/dog/1.jpg", "/d/cat/2.jpg"]) == ["cat", "dog"]
    assert index.label("/d/dog/9.jpg") == 1
    restarted = ClassIndex(path, "parent")
    assert restarted.update(["/d/ant/1.jpg", "/d/dog/1.jpg", "/d/cat/1.jpg"]) == ["ant"]
    assert read_classes(path) == ["cat", "dog", "ant"], "a new class is appended, the old indices stay"


def test_image_settings_that_cannot_work_are_refused_naming_the_key(tmp_path: Path) -> None:
    from cachefeed._config import parse_config

    base = {"remote": {"url": "file:///data"}, "cache": {"dir": "/dev/shm/x", "max_bytes": "1GiB"}}
    with pytest.raises(ConfigError, match=r"sampler.decode_images = true .* decode = \"tar\""):
        parse_config({**base, "sampler": {"decode": "npy", "decode_images": True}})
    with pytest.raises(ConfigError, match=r"sampler.image_size = \[1, 2, 3\]: expected an integer or \[height"):
        parse_config({**base, "sampler": {"decode": "image", "image_size": [1, 2, 3]}})
    with pytest.raises(ConfigError, match=r"sampler.label = 'folder'"):
        parse_config({**base, "sampler": {"label": "folder"}})


def test_decoders_hand_out_uint8_channels_first() -> None:
    png = encode((1, 2, 3), (7, 5), "PNG")
    (sample,) = get_decoder("image")("k.png", png)
    assert sample["image"].shape == (3, 5, 7) and sample["image"].dtype == np.uint8
    assert tuple(sample["image"][:, 0, 0]) == (1, 2, 3)


def test_sources_one_per_class_are_one_listing_of_two_classes_not_a_single_class(tmp_path: Path) -> None:
    """``label = "parent"`` with a source per class directory: the class index is the whole listing's, every
    source's; the one-class warning waits for all of them (the first source's listing alone holds one class)."""
    for name in ("cats", "dogs"):
        (tmp_path / "data" / name).mkdir(parents=True)
        for i in range(4):
            (tmp_path / "data" / name / f"{i}.npy").write_bytes(npy_bytes(np.full(8, i, np.int32)))
    cache_dir = tmp_path / "cache"
    config = tmp_path / "d.toml"
    config.write_text(
        toml_text(
            {
                "remote": {"refresh_interval": "1h"},
                "cache": {"dir": str(cache_dir), "max_bytes": "64MiB", "segment_bytes": "64KiB", "fsync": False},
                "sampler": {"processes": 1, "decode": "npy", "label": "parent"},
                "status": {"interval": "200ms"},
                "source": [{"name": n, "url": (tmp_path / "data" / n).as_uri()} for n in ("cats", "dogs")],
            }
        )
    )
    daemon = start_daemon(config, cache_dir, tmp_path / "d.err")
    try:
        daemon.wait_status(lambda d: d["cache"]["samples"] == 8, timeout_s=60, what="both sources cached")
        assert read_classes(cache_dir / "classes.json") == ["cats", "dogs"]
    finally:
        assert daemon.stop() == 0
    assert "found one class" not in daemon.stderr(), daemon.stderr()[-2000:]
