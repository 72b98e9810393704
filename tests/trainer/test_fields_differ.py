"""Samples of one batch with different fields (a webdataset shard with a stray member, shards of ``.jpg`` beside
shards of ``.png``) fail every time, with the samples and their fields named.

``default_collate`` keys a batch by its first sample's fields: with the odd sample first, the others lacked its
field and the worker died with a bare ``KeyError``; anywhere else, its extra field was dropped without a word. The
same data failed or not by where the shuffle put one sample (a new user's audit: seed 4 failed, others did not).
A real cache, real DataLoader workers; the witness is what the training loop gets, for every shuffle tried.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import default_collate

from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._trainer import EpochLoaderFactory
from tests.support.cache_helpers import cache_config

SAMPLES = 16


def build(root: Path) -> Path:
    store = CacheStore(cache_config(root, segment_bytes=64 << 10))
    with CacheWriter(store, segment_bytes=64 << 10, fsync=False) as writer:
        for i in range(SAMPLES):
            sample = {"__key__": f"s0/{i:06d}", "jpg": np.full((4, 4, 3), i, np.uint8), "cls": i % 3}
            if i == 7:
                sample["xyz"] = b"a member of an unexpected extension"
            writer.add(sample)
    store.close()
    return root


@pytest.mark.parametrize(("workers", "collate_fn"), [(0, None), (1, None), (0, default_collate)])
def test_a_batch_of_samples_with_different_fields_fails_naming_them_wherever_the_odd_one_lies(
    tmp_path: Path, workers: int, collate_fn: Any
) -> None:
    cache_dir = build(tmp_path / "cache")
    with EpochLoaderFactory(
        cache_dir,
        batch_size=SAMPLES,
        num_workers=workers,
        collate_fn=collate_fn,
        seed=0,
        run_id="fields",
        progress=None,
    ) as factory:
        for epoch in range(6):  # six shuffles: the odd sample first in none or some, inside the batch in all
            with pytest.raises(ValueError, match="the samples of one batch have different fields") as raised:
                next(iter(factory.loader(epoch)))
            message = str(raised.value)
            assert "sample 's0/000007' has ['__key__', 'cls', 'jpg', 'xyz']" in message or (
                "['__key__', 'cls', 'jpg', 'xyz']" in message and "'s0/000007'" in message
            ), message
            assert "transform=" in message and "collate_fn=" in message, message


def test_a_nested_field_that_differs_fails_alike_in_process() -> None:
    """In-process, the check reaches nested dicts as the workers' collate does."""
    from cachefeed._trainer.collate import collate_samples

    samples = [{"__key__": f"k{i}", "meta": {"a": i} if i else {"a": i, "b": 1}} for i in range(3)]
    with pytest.raises(ValueError, match="the samples of one batch have different fields"):
        collate_samples(samples)


@pytest.mark.parametrize("workers", [0, 1])
def test_images_of_different_sizes_fail_naming_the_field_and_sampler_image_size(tmp_path: Path, workers: int) -> None:
    """``decode = "image"`` without ``image_size`` on images of their own sizes: torch.stack's "stack expects each
    tensor to be equal size" came from deep in a worker, naming neither the field nor the setting."""
    store = CacheStore(cache_config(tmp_path / "cache", segment_bytes=64 << 10))
    with CacheWriter(store, segment_bytes=64 << 10, fsync=False) as writer:
        for i in range(SAMPLES):
            writer.add({"__key__": f"{i:06d}", "image": np.zeros((3, 28 + i % 2, 28), np.uint8), "label": i % 3})
    store.close()
    with EpochLoaderFactory(
        tmp_path / "cache", batch_size=SAMPLES, num_workers=workers, run_id="sizes", progress=None
    ) as factory:
        with pytest.raises(ValueError, match="field 'image' has different shapes in one batch") as raised:
            next(iter(factory.loader(0)))
    assert "sampler.image_size" in str(raised.value)
