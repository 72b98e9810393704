"""A batch read at once (``SnapshotDataset.read_items``, ``records.read_records``, the workers' small-sample collation)
returns exactly what the general path returns: the same samples, bytes, types, order, skips and transform calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from cachefeed._cache.records import SegmentReader, read_records
from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._testing.samples import make_sample
from cachefeed._trainer.collate import collate_into, compile_skeleton, place
from cachefeed._trainer.dataset import SnapshotDataset
from cachefeed._trainer.pool import _read_batch
from tests.support.cache_helpers import cache_config
from tests.trainer.test_dataset import corrupt_record


def odd_sample(i: int) -> dict[str, Any]:
    """Records the fast path leaves to ``read`` (or reads in another mode): changing shapes, a big-endian array
    torch has no tensor for, a long bytes payload, an empty array, a 2-D float array, long text."""
    kind = i % 6
    key = f"odd/{i}"
    if kind == 0:
        return {"__key__": key, "data": np.arange(i % 7 + 1, dtype=np.int16), "n": i}
    if kind == 1:
        return {"__key__": key, "data": np.arange(4, dtype=">i4"), "label": "cat"}
    if kind == 2:
        return {"__key__": key, "blob": bytes(range(256)) * 2, "n": i}
    if kind == 3:
        return {"__key__": key, "data": np.zeros(0, dtype=np.float32), "n": i}
    if kind == 4:
        return {"__key__": key, "data": np.full((3, 5), i, dtype=np.float32), "t": torch.arange(3)}
    return {"__key__": key, "text": "x" * 300, "n": float(i)}


def build(root: Path) -> Path:
    """Plain small samples, odd ones, and compressed ones, over many segments."""
    segment_bytes = 8 << 10
    store = CacheStore(cache_config(root, segment_bytes=segment_bytes))
    with CacheWriter(store, segment_bytes=segment_bytes, fsync=False) as writer:
        for i in range(150):
            writer.add(make_sample(f"k{i}", 256 + 64 * (i >= 90 and i % 3 == 0)))  # fixed, then changing shapes
        for i in range(60):
            writer.add(odd_sample(i))
    with CacheWriter(store, segment_bytes=segment_bytes, fsync=False, compression="zlib") as writer:
        for i in range(40):
            writer.add(make_sample(f"z{i}", 512))
    store.close()
    return root


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types, byte for byte."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[key], b[key]) for key in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    return bool(a == b)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("tensors", [True, False])
def test_a_batch_read_at_once_returns_what_reading_each_sample_returns(
    tmp_path: Path, verify: bool, tensors: bool
) -> None:
    root = build(tmp_path / "c")
    with Snapshot.create(root, "t-e000000") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot, verify=verify)
        other = SnapshotDataset.from_snapshot(snapshot, verify=verify)
        assert dataset.segments > 5, "the test needs many segments"
        order = np.random.default_rng(3).permutation(len(dataset))
        for start in range(0, len(order), 37):  # the last batch is partial
            batch = order[start : start + 37]
            fast = dataset.read_items(batch, tensors=tensors)
            general = list(other.iter_items(batch, tensors=tensors))
            assert same(fast, general)
        assert len(set(order.tolist())) == len(dataset)
        dataset.close()
        other.close()


def test_corrupt_records_and_a_segment_that_fails_at_open_are_skipped_alike(tmp_path: Path) -> None:
    root = build(tmp_path / "c")
    with Snapshot.create(root, "t-e000000") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot)
        corrupted = [i for i in (3, 77, 151, len(dataset) - 1) if int(dataset.locate([i])[0][0]) != 2]
        assert len(corrupted) >= 3
        for index in corrupted:
            segment, record = dataset.locate([index])
            corrupt_record(snapshot.paths[int(segment[0])], int(record[0]))
        damaged = snapshot.paths[2]
        raw = bytearray(damaged.read_bytes())
        raw[-20] ^= 0xFF  # the trailer: the segment is refused at open
        damaged.write_bytes(bytes(raw))
        other = SnapshotDataset.from_snapshot(snapshot)
        order = np.random.default_rng(5).permutation(len(dataset))
        fast = [item for start in range(0, len(order), 50) for item in dataset.read_items(order[start : start + 50])]
        general = [item for start in range(0, len(order), 50) for item in other.iter_items(order[start : start + 50])]
        assert same(fast, general)
        lost = int(np.diff(dataset._starts)[2])
        assert dataset.skipped == other.skipped == lost + len(corrupted)
        assert len(fast) == len(dataset) - lost - len(corrupted)
        dataset.close()
        other.close()


def test_the_transform_sees_each_sample_in_the_batch_order(tmp_path: Path) -> None:
    root = build(tmp_path / "c")
    seen: list[list[str]] = [[], []]

    def remember(which: int) -> Any:
        def transform(sample: dict[str, Any]) -> Any:
            seen[which].append(sample["__key__"])
            return {"key": sample["__key__"], "types": sorted(type(v).__name__ for v in sample.values())}

        return transform

    with Snapshot.create(root, "t-e000000") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot, transform=remember(0))
        other = SnapshotDataset.from_snapshot(snapshot, transform=remember(1))
        batch = np.random.default_rng(7).permutation(len(dataset))[:120]
        assert same(dataset.__getitems__(batch), list(other.iter_items(batch)))
        assert seen[0] == seen[1] and len(seen[0]) == 120
        dataset.close()
        other.close()


def test_a_worker_collates_small_samples_as_default_collate_does(tmp_path: Path) -> None:
    """Default collation of a batch of small samples (``RowCollator`` over the reader's arrays), of a batch that
    breaks the pattern halfway (mixed sizes: collated the usual way), and a partial batch."""
    root = build(tmp_path / "c")
    region = np.zeros(8 << 20, dtype=np.uint8)

    def allocate(nbytes: int) -> tuple[int, Any]:
        return 0, region[:nbytes]

    with Snapshot.create(root, "t-e000000") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot)
        other = SnapshotDataset.from_snapshot(snapshot)
        plain = [i for i in range(len(dataset)) if dataset[i]["__key__"].startswith("k") and dataset[i]["n"] == 256]
        for batch in (np.array(plain[:64]), np.array(plain[64:75])):  # a full batch and a partial one
            reply = _read_batch(0, dataset, batch, None, allocate, release=lambda _o, _n: None, skeletons={})
            assert reply[0] == "region"
            _kind, offset, nbytes, _id, leaves, skeleton = reply
            built = compile_skeleton(skeleton)(region[offset : offset + nbytes], iter(leaves))
            assert same(built, default_collate(other.__getitems__(batch)))
        mixed = np.arange(0, 150, 7)  # data of 256 and 320 bytes: default_collate refuses, and so does the worker
        reply = _read_batch(0, dataset, mixed, None, allocate, release=lambda _o, _n: None, skeletons={})
        assert reply[0] == "error"
        with pytest.raises(RuntimeError):
            default_collate(other.__getitems__(mixed))
        odd = np.array([i for i in range(len(dataset)) if dataset[i]["__key__"].startswith("odd/") and i % 6 == 4])
        reply = _read_batch(0, dataset, odd, None, allocate, release=lambda _o, _n: None, skeletons={})
        _kind, offset, nbytes, _id, leaves, skeleton = reply
        built = compile_skeleton(skeleton)(region[offset : offset + nbytes], iter(leaves))
        assert same(built, default_collate(other.__getitems__(odd)))  # a tensor field: collated the usual way
        _offset, _nbytes, layout = collate_into(other.__getitems__(np.array(plain[:5])), None, allocate)
        assert same(place(layout, region), default_collate(other.__getitems__(np.array(plain[:5]))))
        dataset.close()
        other.close()


def test_the_fast_path_reads_plain_records_and_leaves_the_others_to_read(tmp_path: Path) -> None:
    root = build(tmp_path / "c")
    with Snapshot.create(root, "t-e000000") as snapshot:
        first, last = SegmentReader(snapshot.paths[0]), SegmentReader(snapshot.paths[-1])  # plain; compressed
        out: list[dict[str, Any]] = []
        assert read_records([first] * first.count, list(range(first.count)), 0, out) == first.count
        assert same(out, [first.read(i) for i in range(first.count)])
        assert read_records([last, first], [0, 0], 0, out) == 0, "a compressed record is read by read()"
        assert read_records([None], [0], 0, out) == 0, "a segment that did not open: read() says why"
        first.close()
        assert read_records([first], [0], 0, out) == 0, "a closed reader: read() says why"
        last.close()


def test_each_sample_names_its_source_with_corrupt_records_skipped(tmp_path: Path) -> None:
    root = build(tmp_path / "c")
    with Snapshot.create(root, "t-e000000") as snapshot:
        names = ["even" if i % 2 == 0 else "odd" for i in range(len(snapshot.names))]

        def open_dataset() -> SnapshotDataset:
            return SnapshotDataset(snapshot.directory, snapshot.names, snapshot.counts, sources=names)

        dataset, other = open_dataset(), open_dataset()
        for index in (5, 60):
            segment, record = dataset.locate([index])
            corrupt_record(snapshot.paths[int(segment[0])], int(record[0]))
        shuffled = [i for i in np.random.default_rng(11).permutation(len(dataset)).tolist() if i not in (5, 60)]
        batch = np.array([5, *shuffled[:98], 60])
        fast = dataset.read_items(batch)
        assert len(fast) == 98 and dataset.skipped == 2
        assert same(fast, list(other.iter_items(batch)))
        assert {item["__source__"] for item in fast} == {"even", "odd"}
        dataset.close()
        other.close()
