"""The daemon's image preprocess is a pure function of the bytes and the settings, whatever is installed.

``tests/data/reference.jpg`` (400 x 300, 4:2:0) is committed with the SHA-256 of its decoded pixels at three sizes
(``tests/data/reference.json``): full size, 96 x 96 (decoded at 1/2 scale first) and 50 x 40 (at 1/4). The tests
decode it with simplejpeg importable and with its import blocked, in this process and in a real daemon: the pixels
must be the committed ones in every case. A change of decoder or of the reduced-scale rule fails here; so does a
Pillow build that decodes differently (re-pin the hashes deliberately then, and say so in the change).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cachefeed import DecodeImages
from cachefeed._config import toml_text
from cachefeed._images import decode_image
from cachefeed._testing.daemon import start_daemon
from cachefeed._trainer import EpochLoaderFactory

DATA = Path(__file__).parent / "data"
REFERENCE = json.loads((DATA / "reference.json").read_text())
SIZES = {name: (tuple(entry["size"]) if entry["size"] else None) for name, entry in REFERENCE["decoded"].items()}


def reference_body() -> bytes:
    body = (DATA / "reference.jpg").read_bytes()
    assert hashlib.sha256(body).hexdigest() == REFERENCE["file_sha256"], "the committed reference image changed"
    return body


def fingerprint(pixels: Any) -> tuple[list[int], str]:
    array = np.ascontiguousarray(np.asarray(pixels, dtype=np.uint8))
    return list(array.shape), hashlib.sha256(array.tobytes()).hexdigest()


def expected(name: str) -> tuple[list[int], str]:
    entry = REFERENCE["decoded"][name]
    return entry["shape"], entry["sha256"]


@pytest.fixture(params=["simplejpeg importable", "simplejpeg blocked"])
def install(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The two installs: with simplejpeg present (the test extra installs it), and with its import failing."""
    if request.param == "simplejpeg importable":
        pytest.importorskip("simplejpeg")
    else:
        monkeypatch.setitem(sys.modules, "simplejpeg", None)  # import simplejpeg raises ImportError
    return str(request.param)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_the_reference_image_decodes_to_the_committed_pixels_on_either_install(install: str, name: str) -> None:
    pixels = decode_image(reference_body(), "reference.jpg", size=SIZES[name])
    assert fingerprint(pixels) == expected(name), f"{name} with {install}: the decoded pixels changed"
    transformed = DecodeImages(fields=("data",), size=SIZES[name])({"__key__": "r", "data": reference_body()})
    assert fingerprint(transformed["data"].numpy()) == expected(name), "the workers' transform decodes the same way"


def daemon_pixels(tmp_path: Path, *, block_simplejpeg: bool) -> tuple[list[int], str]:
    """Cache the reference image with a real daemon (``decode = "image"``, ``image_size = 96``) and read it back
    through ``EpochLoaderFactory``; the daemon's environment blocks simplejpeg's import when asked."""
    name = "blocked" if block_simplejpeg else "present"
    folder = tmp_path / f"data-{name}" / "train" / "refs"
    folder.mkdir(parents=True)
    (folder / "reference.jpg").write_bytes(reference_body())
    env = dict(os.environ)
    if block_simplejpeg:
        blocker = tmp_path / "blocker"
        blocker.mkdir(exist_ok=True)
        (blocker / "simplejpeg.py").write_text('raise ImportError("simplejpeg is blocked by the test")\n')
        env["PYTHONPATH"] = os.pathsep.join([str(blocker), *filter(None, [env.get("PYTHONPATH")])])
    cache_dir = tmp_path / f"cache-{name}"
    config = tmp_path / f"{name}.toml"
    document = {
        "remote": {"url": f"file://{folder.parent.parent}", "pattern": "**/*.jpg", "refresh_interval": "2s"},
        "cache": {"dir": str(cache_dir), "max_bytes": "16MiB", "segment_bytes": "256KiB", "fsync": False},
        "sampler": {"processes": 1, "concurrency": 2, "decode": "image", "image_size": 96},
        "status": {"interval": "200ms"},
    }
    config.write_text(toml_text(document))
    daemon = start_daemon(config, cache_dir, tmp_path / f"{name}.err", env=env)
    try:
        daemon.wait_status(lambda d: d["cache"]["samples"] == 1, timeout_s=60, what="the reference image cached")
        with EpochLoaderFactory(cache_dir, batch_size=1, run_id=name, progress=None) as factory:
            (batch,) = list(factory.loader(0))
        image = batch["image"][0]
        assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8
        return fingerprint(image.numpy())
    finally:
        assert daemon.stop() == 0


def test_daemons_with_and_without_simplejpeg_cache_the_committed_pixels(tmp_path: Path) -> None:
    pytest.importorskip("simplejpeg")
    present = daemon_pixels(tmp_path, block_simplejpeg=False)
    blocked = daemon_pixels(tmp_path, block_simplejpeg=True)
    assert present == blocked == expected("96"), "two installs cached different pixels for the same object"
