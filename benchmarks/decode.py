"""Image decoding: where to decode (in the daemon once, or in the workers every epoch), what it costs, what it stores.

    python -m benchmarks.decode [--images 512] [--workers 2] [--size 224] [--dir /dev/shm]

Generates ``--images`` JPEGs of 500 x 375 (ImageNet's typical size; smooth content plus noise, about 40-60 KB
each) and measures, on this machine:

* **decode rate per core** (one process): ``cachefeed._images.decode_image`` to ``--size`` (Pillow with
  ``draft``: the JPEG decodes at a reduced scale when the target is at most half as large), next to the plain
  Pillow transform people write (``open``, ``convert("RGB")``, ``resize``, ``crop``: full-size decode);
* **the decoder choice**: a full-size decode to RGB alone with Pillow and, when it is installed
  (``pip install simplejpeg``: a libjpeg-turbo binding with wheels), with simplejpeg, and simplejpeg's decode
  followed by the same resize and crop; a decoder not installed is reported as such, not skipped silently;
* **bytes per cached sample** for each placement: pixels (daemon-decoded, ``3 x size x size``) or the JPEG's bytes
  (decoded in the workers), record overhead included (measured in the segments written);
* **images per second through a 2-worker loader**, every epoch from a warm tmpfs cache: the daemon-decoded cache
  through ``EpochLoaderFactory`` (workers copy pixels), the compressed cache through ``EpochLoaderFactory`` with
  ``DecodeImages`` (workers decode), and a plain ``DataLoader`` over the JPEG files with the Pillow transform.

Writes ``benchmarks/results/decode.json`` (``--no-save`` to skip).
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from benchmarks.common.results import provenance_line, save
from benchmarks.common.static_cache import write_static_cache
from cachefeed._images import DecodeImages, decode_image
from cachefeed._trainer import EpochLoaderFactory


def make_jpegs(count: int, folder: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    y, x = np.mgrid[0:375, 0:500]
    paths = []
    for i in range(count):
        base = np.stack([(x * (i % 7 + 1)) % 256, (y * (i % 5 + 1)) % 256, (x + y + 17 * i) % 256], axis=-1)
        noisy = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        path = folder / f"{i:05d}.jpg"
        Image.fromarray(noisy).save(path, format="JPEG", quality=90)
        paths.append(path)
    return paths


def plain_pillow(body: bytes, size: int) -> np.ndarray[Any, Any]:
    """What a user's transform usually does: a full-size decode, then resize and crop."""
    with Image.open(io.BytesIO(body)) as image:
        rgb = image.convert("RGB")
    scale = size / min(rgb.size)
    width, height = max(size, round(rgb.width * scale)), max(size, round(rgb.height * scale))
    rgb = rgb.resize((width, height), Image.Resampling.BILINEAR)
    left, top = (width - size) // 2, (height - size) // 2
    return np.asarray(rgb.crop((left, top, left + size, top + size))).transpose(2, 0, 1)


def pillow_rgb(body: bytes) -> np.ndarray[Any, Any]:
    with Image.open(io.BytesIO(body)) as image:
        return np.asarray(image.convert("RGB"))


def decoder_choices(bodies: list[bytes], size: int) -> dict[str, float | str]:
    """Full-size decodes to RGB per decoder (and simplejpeg + the same resize/crop), images/s on one core."""
    choices: dict[str, float | str] = {"Pillow: full decode to RGB": rate(bodies, pillow_rgb)}
    try:
        simplejpeg: Any = importlib.import_module("simplejpeg")  # optional: only this comparison uses it
    except ImportError:
        choices["simplejpeg: full decode to RGB"] = "not installed (pip install simplejpeg)"
        return choices

    def simplejpeg_resized(body: bytes) -> np.ndarray[Any, Any]:
        rgb = Image.fromarray(simplejpeg.decode_jpeg(body, colorspace="RGB"))
        scale = size / min(rgb.size)
        width, height = max(size, round(rgb.width * scale)), max(size, round(rgb.height * scale))
        rgb = rgb.resize((width, height), Image.Resampling.BILINEAR)
        left, top = (width - size) // 2, (height - size) // 2
        return np.asarray(rgb.crop((left, top, left + size, top + size))).transpose(2, 0, 1)

    version = getattr(simplejpeg, "__version__", "?")
    choices[f"simplejpeg {version}: full decode to RGB"] = rate(
        bodies, lambda b: simplejpeg.decode_jpeg(b, colorspace="RGB")
    )
    choices[f"simplejpeg {version}: decode + resize + crop"] = rate(bodies, simplejpeg_resized)
    same = np.array_equal(simplejpeg.decode_jpeg(bodies[0], colorspace="RGB"), pillow_rgb(bodies[0]))
    choices["simplejpeg and Pillow give identical pixels"] = "yes" if same else "no"
    return choices


def rate(bodies: list[bytes], decode: Any) -> float:
    started = time.perf_counter()
    for body in bodies:
        decode(body)
    return len(bodies) / (time.perf_counter() - started)


def loader_rate(root: Path, workers: int, epochs: int, transform: Any = None) -> float:
    with EpochLoaderFactory(
        root, batch_size=32, num_workers=workers, transform=transform, run_id="decode", progress=None
    ) as factory:
        for _batch in factory.loader(0):  # warm-up epoch: workers start, pages fault in
            pass
        started = time.perf_counter()
        count = 0
        for epoch in range(1, epochs + 1):
            for batch in factory.loader(epoch):
                count += len(batch["__key__"])
        return count / (time.perf_counter() - started)


class JpegFolder(Dataset[dict[str, Any]]):
    def __init__(self, paths: list[Path], size: int) -> None:
        self.paths, self.size = paths, size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": torch.from_numpy(plain_pillow(self.paths[index].read_bytes(), self.size).copy())}


def plain_rate(paths: list[Path], size: int, workers: int, epochs: int) -> float:
    dataset = JpegFolder(paths, size)
    loader = DataLoader(dataset, batch_size=32, shuffle=True, num_workers=workers, persistent_workers=True)
    for _batch in loader:
        pass
    started = time.perf_counter()
    count = 0
    for _ in range(epochs):
        for batch in loader:
            count += len(batch["image"])
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="cachefeed-decode-", dir=args.dir))
    try:
        paths = make_jpegs(args.images, work / "jpegs")
        bodies = [path.read_bytes() for path in paths]
        size = (args.size, args.size)
        per_core = {
            "cachefeed decode_image (draft + resize + crop)": rate(bodies, lambda b: decode_image(b, "k", size=size)),
            "plain Pillow (full decode + resize + crop)": rate(bodies, lambda b: plain_pillow(b, args.size)),
        }
        choices = decoder_choices(bodies, args.size)
        named = list(zip([p.name for p in paths], bodies, strict=True))
        pixels = [{"__key__": name, "image": decode_image(body, name, size=size)} for name, body in named]
        stored = [{"__key__": name, "data": body} for name, body in named]
        decoded_bytes = write_static_cache(work / "pixels", pixels)
        raw_bytes = write_static_cache(work / "bytes", stored)
        per_sample = {
            "decoded in the daemon (pixels)": round(decoded_bytes / args.images),
            "decoded in the workers (JPEG bytes)": round(raw_bytes / args.images),
        }
        loaders = {
            "daemon-decoded cache, EpochLoaderFactory": loader_rate(work / "pixels", args.workers, args.epochs),
            "JPEG cache, EpochLoaderFactory + DecodeImages": loader_rate(
                work / "bytes", args.workers, args.epochs, DecodeImages(("data",), size=args.size)
            ),
            "JPEG files, plain DataLoader + Pillow transform": plain_rate(paths, args.size, args.workers, args.epochs),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = {
        "images": args.images,
        "size": args.size,
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "per_core_images_per_s": {k: round(v, 1) for k, v in per_core.items()},
        "decoder_choices": {k: round(v, 1) if isinstance(v, float) else v for k, v in choices.items()},
        "bytes_per_cached_sample": per_sample,
        "loader_images_per_s": {k: round(v, 1) for k, v in loaders.items()},
    }
    for group in ("per_core_images_per_s", "decoder_choices", "bytes_per_cached_sample", "loader_images_per_s"):
        print(group)
        for name, value in figures[group].items():
            print(f"  {name:<52} {value:>12,}" if not isinstance(value, str) else f"  {name:<52} {value}")
    if not args.no_save:
        print(f"wrote {save('decode', figures, work_dir=args.dir)}")


def readme_table(doc: dict[str, Any]) -> str:
    """The README's image-decoding table, from a committed result document."""
    figures = doc["figures"]
    lines = [
        f"{figures['images']} JPEGs of 500 x 375 to {figures['size']} x {figures['size']}, "
        f"{figures['workers']} workers for the loaders, {figures['cpus']} CPUs:",
        "",
        "| what | figure |",
        "|---|---|",
    ]
    lines += [f"| decode, one core: {k} | {v:,.0f} images/s |" for k, v in figures["per_core_images_per_s"].items()]
    for k, v in figures.get("decoder_choices", {}).items():
        lines.append(f"| decoder, one core: {k} | {v if isinstance(v, str) else f'{v:,.0f} images/s'} |")
    lines += [f"| cache bytes per sample: {k} | {v:,} |" for k, v in figures["bytes_per_cached_sample"].items()]
    lines += [f"| loader: {k} | {v:,.0f} images/s |" for k, v in figures["loader_images_per_s"].items()]
    lines += ["", "Measured with " + provenance_line(doc) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
