"""The snapshot dataset: numpy index, zero-copy tensors, lazy readers, corrupt records skipped and counted."""

from __future__ import annotations

import ctypes
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cachefeed._cache.records import SegmentReader
from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._errors import CorruptRecordError, SnapshotError
from cachefeed._testing.samples import check_sample, make_sample
from cachefeed._trainer.dataset import SnapshotDataset
from tests.support.cache_helpers import cache_config


def build_cache(root: Path, count: int, *, nbytes: int = 256, segment_bytes: int = 32 << 10, **options) -> Path:
    """A static cache of ``count`` self-verifying samples keyed ``k<i>``, built in-process; the store is closed."""
    store = CacheStore(cache_config(root, segment_bytes=segment_bytes, **options))
    with CacheWriter(store, segment_bytes=segment_bytes, fsync=False, **options) as writer:
        for i in range(count):
            writer.add(make_sample(f"k{i}", nbytes))
    store.close()
    return root


def as_sample(item: dict) -> dict:
    return {"__key__": item["__key__"], "data": item["data"].numpy(), "n": int(item["n"])}


def test_every_sample_is_read_back_intact_through_the_numpy_index(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 300)
    with Snapshot.create(root, "t-e000000") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot)
        assert len(dataset) == snapshot.samples == 300
        assert dataset.segments > 2, "the test needs several segments"
        keys = []
        for i in range(len(dataset)):
            item = dataset[i]
            check_sample(as_sample(item))
            keys.append(item["__key__"])
        assert sorted(keys) == sorted(f"k{i}" for i in range(300))
        segment, record = dataset.locate([0, 299])
        assert segment.dtype == np.int64 and record[0] == 0
        with pytest.raises(IndexError):
            dataset[300]
        with pytest.raises(IndexError):
            dataset.__getitems__([5, -1])
        dataset.close()


def test_tensors_are_contiguous_zero_copy_views_of_the_map_without_warnings(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 20, nbytes=4096)
    with Snapshot.create(root, "t-e000000") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns on non-writable arrays: none may be served
            batch = dataset.__getitems__([3, 7, 11])
        reader = dataset._readers[int(dataset.locate([3])[0][0])]
        start = ctypes.addressof(ctypes.c_char.from_buffer(reader._map))
        tensor = batch[0]["data"]
        assert isinstance(tensor, torch.Tensor) and tensor.is_contiguous()
        assert start <= tensor.data_ptr() < start + reader.size, "the tensor must point into the mapping"
        tensor[0] = (int(tensor[0]) + 1) % 256  # copy-on-write: the cache file is untouched
        with SegmentReader(reader.path) as fresh:
            check_sample(fresh.read(int(dataset.locate([3])[1][0])))
        dataset.close()


def test_compressed_records_are_served_as_writable_tensors(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 30, compression="zlib")
    with Snapshot.create(root, "t-e000000") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for item in dataset.__getitems__(list(range(30))):
                assert item["data"].is_contiguous()
                check_sample(as_sample(item))
        dataset.close()


def test_pickling_carries_the_index_never_open_maps(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 100)
    with Snapshot.create(root, "t-e000000") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot)
        dataset[5]
        assert dataset._readers
        copy = pickle.loads(pickle.dumps(dataset))
        assert copy._readers == {}
        assert copy[5]["__key__"] == dataset[5]["__key__"]
        copy.skip_counter.add(3)  # what a spawned worker does: the owner sees it
        assert dataset.skipped == 1
        copy.close()
        dataset.close()
        assert dataset.skipped == 1, "the total survives close"


def test_arrays_torch_has_no_tensor_for_are_handed_out_as_numpy_arrays(tmp_path: Path) -> None:
    """Strings and a non-native byte order: the sample still reads, with those fields as the numpy arrays stored."""
    root = tmp_path / "c"
    store = CacheStore(cache_config(root, segment_bytes=32 << 10))
    big_endian = np.arange(3, dtype=">i4")
    names = np.array(["cat", "dog"])
    with CacheWriter(store, segment_bytes=32 << 10, fsync=False) as writer:
        writer.add({"__key__": "k0", "data": np.arange(8, dtype=np.uint8), "big": big_endian, "names": names})
    store.close()
    with Snapshot.create(root, "t-e000000") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot)
        sample = dataset[0]
        assert isinstance(sample["data"], torch.Tensor)
        assert type(sample["big"]) is np.ndarray and sample["big"].dtype == big_endian.dtype
        assert np.array_equal(sample["big"], big_endian) and np.array_equal(sample["names"], names)
        dataset.close()


def test_the_transform_runs_per_sample(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 10)
    with Snapshot.create(root, "t-e000000") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot, transform=_double_n)
        assert dataset[0]["n"] == 512
        dataset.close()


def _double_n(sample: dict) -> dict:
    return {**sample, "n": sample["n"] * 2}


def corrupt_record(path: Path, record: int) -> None:
    """Flip one payload byte of a record in place (all hard links to the segment see it)."""
    with SegmentReader(path) as reader:
        offset = int(reader.offsets[record]) + int(reader.lengths[record]) - 100
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_the_records_of_a_segment_that_fails_at_open_are_skipped_and_counted(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 200)
    with Snapshot.create(root, "t-e000000") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot)
        lost = int(np.diff(dataset._starts)[1])
        damaged = snapshot.paths[1]
        raw = bytearray(damaged.read_bytes())
        raw[-20] ^= 0xFF  # the trailer: the segment is refused at open
        damaged.write_bytes(bytes(raw))
        with pytest.raises(CorruptRecordError):
            dataset[int(dataset._starts[1])]
        batch = dataset.__getitems__(list(range(len(dataset))))
        assert len(batch) == 200 - lost and dataset.skipped == lost  # __getitem__ raises, counts nothing
        assert len({item["__key__"] for item in batch}) == len(batch)
        dataset.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_corrupt_record_is_skipped_and_counted_across_worker_processes(tmp_path: Path, context: str) -> None:
    root = build_cache(tmp_path / "c", 200)
    with Snapshot.create(root, "t-e000000") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot)
        bad = {int(dataset.locate([i])[0][0]): int(dataset.locate([i])[1][0]) for i in (10, 150)}
        for segment, record in bad.items():
            corrupt_record(snapshot.paths[segment], record)
        bad_keys = set()
        for segment, record in bad.items():
            with SegmentReader(snapshot.paths[segment]) as reader:
                bad_keys.add(reader.key(record, verify=False))
        with pytest.raises(CorruptRecordError):
            dataset[10]
        loader = DataLoader(dataset, batch_size=16, num_workers=2, multiprocessing_context=context)
        served: list[str] = []
        for batch in loader:
            served += batch["__key__"]
            for row in range(len(batch["__key__"])):
                check_sample({"__key__": batch["__key__"][row], "data": batch["data"][row], "n": batch["n"][row]})
        assert len(served) == 198 and len(set(served)) == 198
        assert not bad_keys & set(served), "a corrupt sample must never reach the trainer"
        assert dataset.skipped == 2, "counted by the workers, read by the parent"
        dataset.close()


def test_a_released_snapshot_gives_a_clear_error_to_new_readers(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 50)
    snapshot = Snapshot.create(root, "t-e000000")
    dataset = SnapshotDataset.from_snapshot(snapshot)
    opened = dataset[0]
    snapshot.release()
    assert opened["__key__"]  # maps already open keep their data
    last = len(dataset) - 1
    if dataset.locate([last])[0][0] != dataset.locate([0])[0][0]:
        with pytest.raises(SnapshotError, match="released"):
            dataset[last]
    dataset.close()


def test_mismatched_index_is_refused() -> None:
    with pytest.raises(ValueError, match="counts"):
        SnapshotDataset("/nowhere", ["a.seg"], [])
