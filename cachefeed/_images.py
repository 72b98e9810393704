"""Images: encoded bytes -> contiguous ``uint8`` arrays ``(3, H, W)`` (RGB, channels first), with Pillow.

Two places to decode, the same code in both:

* **in the daemon, once** (``sampler.decode = "image"``, or ``sampler.decode_images = true`` for the image
  members of tar shards): the cache holds pixels, ready to batch, and the DataLoader workers only copy them. A
  decoded 224 x 224 image takes 150,528 bytes of pixels in the cache, more than its JPEG (how much more depends on
  the JPEGs: ``benchmarks/results/decode.json`` has both for its images), so the same budget holds fewer samples;
  ``cachefeed status`` shows the bytes per cached sample.
* **in the workers, every epoch** (``decode = "raw"`` or tar members kept as bytes, and ``DecodeImages`` as the
  factory's ``transform``): the cache holds the compressed bytes (more samples per budget), the workers pay the
  decode each time a sample is read.

``size`` (``sampler.image_size`` in the daemon) makes every image the same shape, which batching needs when the
images differ: the shorter side is resized to fit (bilinear, with Pillow's antialiasing) and the centre is cropped.
It is deterministic: the same bytes give the same pixels on every node and every restart (the decoder is pinned:
see below). Random augmentation belongs in the workers' ``transform``, on the decoded tensor.

Safety: Pillow reads the header first; an image declaring more than ``MAX_PIXELS`` pixels (a decompression bomb,
e.g. a tiny PNG claiming 100,000 x 100,000) is refused before anything is allocated. Truncated or corrupt files and
non-images raise ``DecodeError`` naming the key (the daemon quarantines the object; in a tar shard, that sample).

One decoder, pinned: **Pillow decodes every image, whatever else is installed.** The pixels a node caches are a
pure function of the bytes, the settings (``size``) and the Pillow build: two nodes of one job never cache
different pixels for the same object because one of them has an optional package the other lacks. A JPEG is
decoded at a reduced scale (1/2, 1/4, 1/8: libjpeg-turbo's DCT scaling, through Pillow's ``draft``) when the
resize target is at most that large: the largest of 8, 4, 2 that still leaves at least the size the resize produces
(``draft``'s rule); from 500 x 375 to 224 no reduced scale fits.

Why not simplejpeg, which earlier versions used for JPEGs when it was installed: it is a second libjpeg-turbo
build with its own version and its own choice among the scaling factors, and its reduced-scale output was not
pixel-identical to Pillow's draft on every image (a user measured 60 of 300 images differ, mean 2.8 levels), so the
cached pixels depended on the install. What it saved is small where it matters here: decoding *and* resizing the
benchmark's 500 x 375 JPEGs to 224 x 224 ran at 226 images/s with simplejpeg and 215 with Pillow alone
(``benchmarks/results/decode.json``), since the resize costs as much as the decode.

``tests/test_image_pixels.py`` holds a committed reference JPEG and the hash of its decoded and resized pixels,
checked with simplejpeg importable and with it blocked: a change of decoder, of the reduction rule, or a Pillow
build that decodes differently fails it (then re-pin the hash deliberately, and say so: caches written before
hold the old pixels).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from cachefeed._errors import ConfigError, DecodeError

__all__ = [
    "IMAGE_EXTENSIONS",
    "MAX_PIXELS",
    "DecodeImages",
    "decode_image",
    "image_size",
    "require_pillow",
]

# Tar member extensions (the last one, lower case) that are images.
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm"})
MAX_PIXELS = 89_478_485  # Pillow's own default (a 0.25 GB RGB image): larger declared sizes are refused


def require_pillow() -> Any:
    """The ``PIL.Image`` module, or ``ConfigError`` saying how to install it."""
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError(
            "decoding images needs Pillow, which is not installed: pip install 'cachefeed[images]' (or pillow)"
        ) from None
    return Image


def image_size(value: int | Sequence[int] | None) -> tuple[int, int] | None:
    """``(height, width)`` from ``224``, ``[224, 224]``, ``0`` or None (keep each image's own size)."""
    if value is None or value == 0:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        sizes = [value, value]
    elif isinstance(value, list | tuple) and len(value) == 2:
        sizes = list(value)
    else:
        raise ValueError("expected an integer or [height, width]")
    if not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 16384 for n in sizes):
        raise ValueError("expected sizes between 1 and 16384 pixels")
    return sizes[0], sizes[1]


def decode_image(body: bytes, key: str, *, size: tuple[int, int] | None = None) -> np.ndarray[Any, Any]:
    """The image in ``body`` as a ``uint8`` array ``(3, H, W)``, C-contiguous; resized and centre-cropped to
    ``size`` (height, width) when given. Raises ``DecodeError`` naming ``key``."""
    image_module = require_pillow()
    pixels = _decode_pillow(body, key, size, image_module)
    if size is not None:
        pixels = _resize_and_crop(pixels, size, image_module)
    return np.ascontiguousarray(np.asarray(pixels, dtype=np.uint8).transpose(2, 0, 1))


def _decode_pillow(body: bytes, key: str, size: tuple[int, int] | None, image_module: Any) -> Any:
    """Any format Pillow reads, as an RGB image (a JPEG at a reduced scale when ``size`` allows)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", image_module.DecompressionBombWarning)
            with image_module.open(io.BytesIO(body)) as image:
                width, height = image.size
                if width * height > MAX_PIXELS:
                    raise DecodeError(
                        f"{key}: the image declares {width} x {height} pixels, more than {MAX_PIXELS:,} "
                        "(a decompression bomb?): refused"
                    )
                if size is not None:
                    image.draft("RGB", _scaled(width, height, size))  # JPEG: decode at a reduced scale if it fits
                pixels = image.convert("RGB")
    except DecodeError:
        raise
    except (image_module.DecompressionBombError, image_module.DecompressionBombWarning) as exc:
        raise DecodeError(f"{key}: refused as a decompression bomb: {exc}") from exc
    except Exception as exc:  # Pillow raises OSError, ValueError, SyntaxError, struct.error... for bad data
        if isinstance(exc, image_module.UnidentifiedImageError):  # its text names our BytesIO: "<... at 0x7f...>"
            raise DecodeError(f"{key}: not a readable image: no image format Pillow reads") from exc
        raise DecodeError(f"{key}: not a readable image: {type(exc).__name__}: {exc}") from exc
    return pixels


def _scaled(width: int, height: int, size: tuple[int, int]) -> tuple[int, int]:
    """The (width, height) the shorter side's resize will produce: what ``draft`` may not go below."""
    scale = max(size[0] / height, size[1] / width)
    return max(1, round(width * scale)), max(1, round(height * scale))


def _resize_and_crop(image: Any, size: tuple[int, int], image_module: Any) -> Any:
    width, height = _scaled(image.width, image.height, size)
    if (width, height) != image.size:
        image = image.resize((width, height), image_module.Resampling.BILINEAR, reducing_gap=None)
    left = (width - size[1]) // 2
    top = (height - size[0]) // 2
    return image.crop((left, top, left + size[1], top + size[0]))


class DecodeImages:
    """A ``transform`` for ``EpochLoaderFactory`` that decodes image bytes in the DataLoader workers.

    Each named field holding ``bytes`` becomes a ``uint8`` tensor ``(3, H, W)`` (resized and centre-cropped to
    ``size`` when given; without it, images of different sizes cannot be batched by the default collate).
    Picklable, so it works with every start method. A sample that cannot be decoded, or that has none of the named
    fields, raises ``DecodeError`` (a field already decoded, not bytes, is left as it is): in a factory's epoch the
    sample is skipped, logged and counted as a corrupt record is (its batch holds one sample fewer).

    Args:
        fields: the fields to decode, e.g. ``("data",)`` for ``decode = "raw"`` or ``("jpg",)`` for tar shards; one
            name alone (``"jpg"``) is one field.
        size: ``224`` or ``(height, width)``; None keeps each image's size.
    """

    def __init__(self, fields: Iterable[str] | str = ("data",), size: int | Sequence[int] | None = None) -> None:
        self.fields = (fields,) if isinstance(fields, str) else tuple(fields)  # "data" was ("d", "a", "t", "a")
        if not self.fields or not all(isinstance(name, str) and name for name in self.fields):
            raise ValueError(f"DecodeImages: fields must name the fields to decode, got {fields!r}")
        self.size = image_size(size)
        require_pillow()

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        import torch

        key = str(sample.get("__key__", "?"))
        if not any(name in sample for name in self.fields):  # fields=("jpg", "png"): each sample has one of them
            fields = ", ".join(sorted(k for k in sample if not k.startswith("__")))
            raise DecodeError(
                f"{key}: none of the fields {', '.join(map(repr, self.fields))} to decode (the sample has "
                f"{fields or 'no fields'}): name the image field in DecodeImages(fields=...)"
            )
        for name in self.fields:
            value = sample.get(name)
            if isinstance(value, bytes | bytearray | memoryview | np.ndarray):
                raw = value.tobytes() if isinstance(value, np.ndarray) else bytes(value)
                sample[name] = torch.from_numpy(decode_image(raw, key, size=self.size))
        return sample
