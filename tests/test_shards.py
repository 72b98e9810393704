"""Webdataset shards as a user has them, read by the daemon and by the ``webdataset`` package side by side.

Five shards of twelve samples (a JPEG, a class, a ``seg.png`` mask), two corrupt JPEGs among them, a sixth
"shard" that is not a tar at all, and the same member names in two shards (keys are unique per shard, not across
shards). The daemon must cache what ``webdataset`` yields with ``handler=warn_and_continue``: every sample but the
two with a bad member (never a whole shard for one bad image), under the same ``__key__``, with the shard's URL in
``__url__``; leave the mask alone (``sampler.image_fields``' default); and name what it left out in
``cachefeed status`` and ``--json``.
"""

from __future__ import annotations

import gc
import io
import json
import posixpath
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from cachefeed._codecs import get_decoder
from cachefeed._config import parse_config, toml_text
from cachefeed._errors import ConfigError
from cachefeed._testing.daemon import start_daemon
from cachefeed._trainer import EpochLoaderFactory

wds = pytest.importorskip("webdataset")  # the test extra installs it

SHARDS = 5
PER_SHARD = 12
BAD = {("shard-00001.tar", "part1/000004"), ("shard-00003.tar", "part1/000009")}  # (shard, key): a broken JPEG
IMAGE = (24, 32)  # (height, width) the daemon resizes to


def jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def mask(seed: int) -> bytes:
    values = np.random.default_rng(seed).integers(0, 4, (30, 40), dtype=np.uint8)  # class ids, not colours
    buffer = io.BytesIO()
    Image.fromarray(values, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def write_shards(root: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The shards under ``root``; returns (shard name, key) -> the sample's label and mask bytes."""
    root.mkdir()
    written: dict[tuple[str, str], dict[str, Any]] = {}
    for shard in range(SHARDS):
        name = f"shard-{shard:05d}.tar"
        with tarfile.open(root / name, "w") as archive:
            for n in range(PER_SHARD):
                key = f"part{shard % 2}/{n:06d}"  # shards 0, 2 and 4 hold the same keys, as do 1 and 3
                seed = shard * 100 + n
                image = jpeg(seed)
                if (name, key) in BAD:  # truncated, or no image at all (Pillow names its BytesIO): refused either way
                    image = image[: len(image) // 2] if shard == 1 else b"not an image"
                members = {f"{key}.jpg": image, f"{key}.cls": str(seed % 7).encode(), f"{key}.seg.png": mask(seed)}
                for member, payload in members.items():
                    info = tarfile.TarInfo(member)
                    info.size = len(payload)
                    archive.addfile(info, io.BytesIO(payload))
                written[(name, key)] = {"cls": seed % 7, "seg.png": members[f"{key}.seg.png"]}
    (root / "shard-99999.tar").write_bytes(b"not a tar archive at all " * 40)  # a whole object to quarantine
    return written


def webdataset_samples(root: Path) -> dict[tuple[str, str], int]:
    """(shard name, __key__) -> cls, as the ``webdataset`` package reads the same shards."""
    urls = [str(path) for path in sorted(root.glob("*.tar"))]
    dataset = (
        wds.WebDataset(urls, shardshuffle=False, handler=wds.warn_and_continue, empty_check=False)
        .decode("rgb8", handler=wds.warn_and_continue)
        .to_tuple("__url__", "__key__", "cls", handler=wds.warn_and_continue)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = {(posixpath.basename(url), key): int(label) for url, key, label in dataset}
        del dataset
        gc.collect()  # webdataset leaves its shard files to the garbage collector: their ResourceWarning here
    assert any(issubclass(w.category, UserWarning) for w in caught), "warn_and_continue warns about what it drops"
    return found


def test_one_bad_image_costs_its_sample_only_and_keys_match_webdataset(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    written = write_shards(shards)
    expected = webdataset_samples(shards)
    assert len(expected) == SHARDS * PER_SHARD - len(BAD), "webdataset drops the two samples, keeps their shards"

    cache_dir = tmp_path / "cache"
    config = tmp_path / "shards.toml"
    config.write_text(
        toml_text(
            {
                "remote": {"url": f"file://{shards}", "pattern": "*.tar", "refresh_interval": "2s"},
                "cache": {"dir": str(cache_dir), "max_bytes": "64MiB", "segment_bytes": "64KiB", "fsync": False},
                "sampler": {
                    "processes": 1,
                    "concurrency": 4,
                    "decode": "tar",
                    "decode_images": True,
                    "image_size": list(IMAGE),
                },
                "status": {"interval": "200ms"},
            }
        )
    )
    daemon = start_daemon(config, cache_dir, tmp_path / "daemon.err")
    try:
        doc = daemon.wait_status(
            lambda d: (
                d["cache"]["samples"] == len(expected)
                and d["remote"]["quarantined_samples_total"] == len(BAD)
                and d["remote"]["quarantined_total"] == 1
            ),
            timeout_s=90,
            what="every good sample cached, the bad ones and the broken shard left out",
        )
        cached: dict[tuple[str, str], int] = {}
        with EpochLoaderFactory(cache_dir, batch_size=1, run_id="wds", progress=None) as factory:
            for batch in factory.loader(0):
                url, key = batch["__url__"][0], batch["__key__"][0]
                assert url.startswith(f"file://{shards}/"), url
                shard = posixpath.basename(url)
                assert (shard, key) not in cached, f"{shard} {key} served twice"
                cached[(shard, key)] = int(batch["cls"][0])
                image = batch["jpg"]
                assert tuple(image.shape) == (1, 3, *IMAGE), "the jpg member is decoded and resized"
                seg = batch["seg.png"][0]
                assert seg == written[(shard, key)]["seg.png"], "the mask keeps its bytes (image_fields' default)"
        assert cached == expected, "the same (shard, __key__) and labels as webdataset"

        entries = {(entry["url"], entry["key"]): entry for entry in doc["quarantined"]}
        for shard, key in BAD:
            entry = entries[(f"file://{shards}/{shard}", key)]
            assert entry["kind"] == "sample" and f"{key}.jpg" in entry["reason"], entry
            assert " at 0x" not in entry["reason"], f"a reason names no memory address: {entry}"
        broken = entries[(f"file://{shards}/shard-99999.tar", None)]
        assert broken["kind"] == "decode" and "tar" in broken["reason"], broken

        human = " ".join(run_status("--cache-dir", str(cache_dir)).split())  # lines wrapped at 80 columns
        assert "left out 1 object quarantined, 2 samples of cached objects" in human, human
        for _shard, key in BAD:
            assert f" {key}: {key}.jpg: not a readable image" in human, f"status names {key}:\n{human}"
        listed = json.loads(run_status("--cache-dir", str(cache_dir), "--json"))
        assert {(e["url"], e["key"]) for e in listed["quarantined"]} >= set(entries)
    finally:
        assert daemon.stop() == 0


def run_status(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "cachefeed", "status", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode in (0, 2), result.stderr
    return result.stdout


def test_image_fields_names_the_members_to_decode_and_is_checked() -> None:
    body = io.BytesIO()
    with tarfile.open(fileobj=body, mode="w") as archive:
        for member, payload in {"a.jpg": jpeg(1), "a.seg.png": mask(1), "a.left.jpg": jpeg(2)}.items():
            info = tarfile.TarInfo(member)
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    by_default = get_decoder("tar", decode_images=True)("s.tar", body.getvalue())[0]
    assert by_default["jpg"].shape == (3, 30, 40), "a field named as an image format is decoded"
    assert isinstance(by_default["seg.png"], bytes) and isinstance(by_default["left.jpg"], bytes)
    named = get_decoder("tar", decode_images=True, image_fields=["left.jpg", "seg.png"])("s.tar", body.getvalue())[0]
    assert isinstance(named["jpg"], bytes) and named["left.jpg"].shape == named["seg.png"].shape == (3, 30, 40)

    base = {"remote": {"url": "file:///data"}, "cache": {"dir": "/dev/shm/x", "max_bytes": "1GiB"}}
    tar = {"decode": "tar", "decode_images": True}
    config = parse_config({**base, "sampler": {**tar, "image_fields": ["jpg", "left.jpg"]}}, env={})
    assert config.sampler.image_fields == ("jpg", "left.jpg")
    with pytest.raises(ConfigError, match=r"sampler.image_fields = \['cls'\].*last extension must be one of"):
        parse_config({**base, "sampler": {**tar, "image_fields": ["cls"]}}, env={})
    with pytest.raises(ConfigError, match=r"sampler.image_fields = .*expected a list"):
        parse_config({**base, "sampler": {**tar, "image_fields": "jpg"}}, env={})
    with pytest.raises(ConfigError, match=r"sampler.image_fields = .*but sampler.decode_images is not true"):
        parse_config({**base, "sampler": {"decode": "tar", "image_fields": ["jpg"]}}, env={})


def test_status_keeps_only_the_20_most_recent_left_out_newest_first() -> None:
    from cachefeed._daemon.quarantine import RECENT_LIMIT, QuarantineLog

    log = QuarantineLog()
    for n in range(25):
        log.add(f"s3://b/shard-{n}.tar", f"{n:06d}" if n % 5 else None, "sample" if n % 5 else "decode", "bad", at=n)
    recent = log.recent()
    assert RECENT_LIMIT == 20 and len(recent) == 20, "bounded"
    assert [entry["at"] for entry in recent] == list(range(24, 4, -1)), "newest first"
    assert log.samples_total == 20, "every left-out sample is counted, listed or not (objects are counted by the plan)"
