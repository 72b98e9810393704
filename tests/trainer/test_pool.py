"""The worker pool that feeds every epoch (cachefeed/_trainer/pool.py, arena.py, collate.py): what it promises.

Workers live as long as the factory; batches are collated into shared memory the training process mapped once
and are never overwritten while the caller can read them; a worker that dies or fails is reported, not waited for;
an epoch's segments are unmapped by every worker before its pin is dropped.
"""

from __future__ import annotations

import gc
import mmap
import os
import resource
import signal
import subprocess
import sys
import time
from collections import namedtuple
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cachefeed._cache.snapshots import Snapshot
from cachefeed._trainer import EpochLoaderFactory
from cachefeed._trainer.arena import Allocator, aligned, grown_end
from cachefeed._trainer.collate import Nest, RowCollator, Slot, collate_into, place
from cachefeed._trainer.dataset import SnapshotDataset
from cachefeed._trainer.pool import WorkerPool
from tests.support.child_env import REPO, child_env
from tests.support.stalls import StallWindow
from tests.trainer.test_loader import build_cache, check_batch, wait_until

Pair = namedtuple("Pair", ["image", "label"])
EIGHTS = [np.arange(i, i + 8) for i in range(0, 64, 8)]  # 64 samples in batches of 8, in order


def whole_pages(nbytes: int) -> int:
    """A grown span's size: whole pages, so that each span is page-locked on its own."""
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


@contextmanager
def pool_over(root: Path, workers: int, **options: Any) -> Iterator[tuple[Snapshot, SnapshotDataset, WorkerPool]]:
    """A pool of ``workers`` (started by the first pass) and the dataset of a snapshot of the cache at ``root``."""
    with Snapshot.create(root, "s") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot)
        pool = WorkerPool(workers, collate_fn=None, **options)
        try:
            yield snapshot, dataset, pool
        finally:
            pool.close()
            dataset.close()


def with_pid(sample: dict[str, Any]) -> dict[str, Any]:
    sample["pid"] = os.getpid()
    return sample


def tensors_only(sample: dict[str, Any]) -> dict[str, Any]:
    assert isinstance(sample["data"], torch.Tensor), type(sample["data"])
    return sample


def fail_on_k7(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["__key__"] == "k7":
        raise ValueError("the user's transform failed on k7")
    return sample


def test_workers_live_across_epochs_and_serve_every_sample_once(tmp_path: Path, stalls: StallWindow) -> None:
    root = build_cache(tmp_path / "c", 300)
    with EpochLoaderFactory(root, batch_size=16, num_workers=2, transform=with_pid, run_id="t", progress=None) as f:
        pids: set[int] = set()
        for epoch in range(4):
            keys: list[str] = []
            for batch in stalls.batches(f.loader(epoch)):
                keys += check_batch(batch)
                pids.update(batch["pid"].tolist())
            assert sorted(keys) == sorted(f"k{i}" for i in range(300)), f"epoch {epoch}: every sample once"
            stalls.assert_handover(f.stats(epoch).handover_wait_s, 0.5, epoch=epoch)
        assert len(pids) == 2, f"two workers served all four epochs, not new ones per epoch: {pids}"
        assert os.getpid() not in pids


def test_workers_never_preempt_the_training_thread_when_woken(tmp_path: Path) -> None:
    """Workers run under SCHED_BATCH (a woken worker waits for its slice instead of interrupting a training step);
    the training process keeps its own policy."""
    root = build_cache(tmp_path / "c", 40)
    with EpochLoaderFactory(root, batch_size=8, num_workers=2, transform=with_pid, run_id="t", progress=None) as f:
        pids = {pid for batch in f.loader(0) for pid in batch["pid"].tolist()}
        assert pids and all(os.sched_getscheduler(pid) == os.SCHED_BATCH for pid in pids)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER


def pages_a_full_collection_copies(sample: dict[str, Any]) -> dict[str, Any]:
    """In a worker: the pages (page faults) a full collection copies, and then, as a control, what one copies once
    the worker unfreezes what it inherited."""
    if not hasattr(pages_a_full_collection_copies, "control"):
        pages_a_full_collection_copies.control = 0  # type: ignore[attr-defined]  # once per worker

        def faults() -> int:
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        before = faults()
        gc.collect()
        frozen = faults() - before
        gc.unfreeze()
        before = faults()
        gc.collect()
        pages_a_full_collection_copies.control = faults() - before  # type: ignore[attr-defined]
        pages_a_full_collection_copies.frozen = frozen  # type: ignore[attr-defined]
    sample["frozen"] = pages_a_full_collection_copies.frozen  # type: ignore[attr-defined]
    sample["control"] = pages_a_full_collection_copies.control  # type: ignore[attr-defined]
    return sample


def test_a_workers_full_collection_leaves_the_training_processs_objects_and_pages_alone(tmp_path: Path) -> None:
    """NOTE [ A worker's collector skips what it inherited ]: the training process holds 300,000 more objects
    (thousands of pages) when the worker forks. A full collection in the worker copies a few pages of its own; the
    control in the same worker, a full collection once it unfreezes what it inherited, walks them all and copies
    their pages (one page fault each), as every worker's first full collection did before."""
    root = build_cache(tmp_path / "c", 8)
    ballast = [[i] for i in range(300_000)]  # the training process's objects, on pages the worker shares
    gc.collect()  # the free lists empty at the fork: a worker's full collection frees none of their entries
    with EpochLoaderFactory(
        root, batch_size=4, num_workers=1, transform=pages_a_full_collection_copies, run_id="t", progress=None
    ) as f:
        batches = list(f.loader(0))
    frozen, control = int(batches[0]["frozen"][0]), int(batches[0]["control"][0])
    assert len(ballast) == 300_000
    assert frozen < 1_000, f"a worker's full collection copied {frozen} pages of the training process"
    assert control > 5_000, f"the control copied only {control} pages: the test shows nothing"


def test_an_epoch_left_early_does_not_leak_its_batches_into_the_next(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 300)
    with EpochLoaderFactory(root, batch_size=10, num_workers=2, run_id="t", progress=None) as f:
        for epoch in range(3):
            loader = iter(f.loader(epoch))
            for _ in range(3):  # leave each epoch after three batches: its in-flight batches are dropped
                check_batch(next(loader))
        second = iter(f.loader(3))
        keys = [key for batch in second for key in check_batch(batch)]
        assert sorted(keys) == sorted(f"k{i}" for i in range(300)), "after abandoned epochs: each sample once"


def test_batch_memory_is_reused_in_steady_state_and_never_while_the_caller_holds_it(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 400, nbytes=4096)
    with EpochLoaderFactory(root, batch_size=8, num_workers=2, run_id="t", progress=None) as f:
        addresses: set[int] = set()
        for epoch in range(3):
            for batch in f.loader(epoch):
                check_batch(batch)
                addresses.add(batch["data"].data_ptr())
        # 150 batches through a handful of regions: the pages are reused, not allocated (and faulted) per batch
        assert len(addresses) <= 16, len(addresses)
        held = []
        for batch in f.loader(3):  # the caller keeps every batch of an epoch: none may be overwritten
            held.append(batch)
        for epoch in (4, 5):
            for batch in f.loader(epoch):
                check_batch(batch)
        keys = [key for batch in held for key in check_batch(batch)]
        assert sorted(keys) == sorted(f"k{i}" for i in range(400))


def test_a_failing_transform_raises_in_the_training_loop_with_the_workers_traceback(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 40)
    with EpochLoaderFactory(
        root, batch_size=4, num_workers=2, transform=fail_on_k7, shuffle=False, run_id="t", progress=None
    ) as f:
        with pytest.raises(ValueError, match="the user's transform failed on k7") as raised:
            for _batch in f.loader(0):
                pass
        assert "in cachefeed worker" in str(raised.value)


def test_a_worker_that_dies_is_reported_not_waited_for_and_replaced_for_the_next_epoch(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 200)
    with EpochLoaderFactory(root, batch_size=4, num_workers=2, run_id="t", progress=None) as f:
        loader = iter(f.loader(0))
        next(loader)
        assert f._pool is not None
        victim = f._pool._workers[1].process
        os.kill(victim.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"pid {victim.pid}\) exited unexpectedly with exit code -9"):
            for _batch in loader:
                pass
        assert time.monotonic() - started < 5
        keys = [key for batch in f.loader(1) for key in check_batch(batch)]  # a new worker takes its place
        assert sorted(keys) == sorted(f"k{i}" for i in range(200))
        assert f._pool._workers[1].process.pid != victim.pid


def test_a_factory_dropped_without_close_stops_its_workers_and_releases_its_pins(tmp_path: Path) -> None:
    """A factory made in a function and dropped without ``close`` (no ``with``) kept its workers and its pins for
    the life of the process. The witnesses are the worker processes and the snapshot files."""
    root = build_cache(tmp_path / "c", 200)
    factory = EpochLoaderFactory(root, batch_size=10, num_workers=2, run_id="dropped", progress=None)
    loader = factory.loader(0)
    assert len([key for batch in loader for key in check_batch(batch)]) == 200
    assert factory._pool is not None
    pids = [worker.process.pid for worker in factory._pool._workers]
    assert len(pids) == 2 and all(Path(f"/proc/{pid}").exists() for pid in pids)
    assert any(p.name.endswith(".lock") for p in (root / "snapshots").iterdir()), "the epoch is pinned"
    del loader, factory  # the last references: no gc.collect() needed
    # The close runs on a thread of its own, which reaps the workers: watched through /proc, not by joining them
    # here too (two threads reaping one child race, and the loser's Process never learns it exited).
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), 20, "the workers stopped")
    wait_until(lambda: list((root / "snapshots").iterdir()) == [], 20, "the pins gone, and with them the snapshots")


def test_a_pass_dealt_before_a_worker_died_is_read_whole_from_its_replacement(tmp_path: Path) -> None:
    """The factory queues the next epoch's pass before the current one ends, so batches of a pass not yet read can
    be dealt to a worker that then dies: that pass is read whole all the same, its dead worker's share dealt again
    to the worker that replaces it."""
    with pool_over(build_cache(tmp_path / "c", 64), 2, prefetch_factor=2) as (_snapshot, dataset, pool):
        current = pool.open_pass(pool.new_key(), dataset, EIGHTS[:2])
        queued = pool.open_pass(pool.new_key(), dataset, EIGHTS)  # dealt at once: each worker has room
        victim = pool._workers[1].process
        next(current)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        try:
            next(current)  # worker 1's batch: read if it was written before the kill, else an error
        except RuntimeError as died:
            assert f"pid {victim.pid}) exited unexpectedly" in str(died)
        keys = [k for batch in queued for k in batch["__key__"]]
        assert sorted(keys) == sorted(f"k{i}" for i in range(64))
        assert pool._workers[1].process.pid != victim.pid


def test_a_released_epoch_is_unmapped_by_every_worker_before_its_pin_goes(tmp_path: Path) -> None:
    """Workers keep a segment mapped from one epoch to the next while both snapshots hold it, but a segment that only
    the released epoch held (evicted meanwhile) is unmapped by every worker before that epoch's pin goes."""
    root = build_cache(tmp_path / "c", 200)
    with EpochLoaderFactory(root, batch_size=10, num_workers=2, run_id="t", progress=None) as f:
        loader = f.loader(0)  # epoch 0 pinned: every segment
        evicted = sorted((root / "segments").iterdir())[0]
        inode = evicted.stat().st_ino
        evicted.unlink()  # what eviction does: epoch 0's pin keeps it readable, epoch 1 will not have it
        for _batch in loader:
            pass
        assert f._pool is not None
        workers = [w.process.pid for w in f._pool._workers]
        assert any(inode in mapped_inodes(pid) for pid in workers), "the workers read the evicted segment"
        for _batch in f.loader(1):
            pass
        wait_until(lambda: not (root / "snapshots" / f.snapshot_id(0)).exists(), what="epoch 0's pin released")
        for pid in workers:
            assert inode not in mapped_inodes(pid), f"worker {pid} still maps the evicted segment"
        live = {p.stat().st_ino for p in (root / "snapshots" / f.snapshot_id(1)).iterdir()}
        assert any(mapped_inodes(pid) & live for pid in workers), "shared segments stay mapped across epochs"


def mapped_inodes(pid: int) -> set[int]:
    return {int(line.split()[4]) for line in maps(pid) if line.endswith((".seg", ".seg (deleted)"))}


def maps(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/maps").read_text().splitlines()


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_other_start_methods_feed_the_same_batches(tmp_path: Path, context: str) -> None:
    root = build_cache(tmp_path / "c", 120)
    with EpochLoaderFactory(
        root, batch_size=10, num_workers=2, multiprocessing_context=context, run_id="t", progress=None, epochs=2
    ) as f:
        for epoch in range(2):
            keys = [key for batch in f.loader(epoch) for key in check_batch(batch)]
            assert sorted(keys) == sorted(f"k{i}" for i in range(120))


def test_a_collate_function_of_the_callers_gets_the_samples_and_its_batch_arrives_whole(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 60)

    with EpochLoaderFactory(
        root, batch_size=6, num_workers=2, collate_fn=pairs, shuffle=False, run_id="t", progress=None
    ) as f:
        batches = list(f.loader(0))
    assert all(isinstance(b, Pair) and b.image.shape == (6, 256) for b in batches)
    assert sorted(int(n) for b in batches for n in b.label) == list(range(60))


def pairs(samples: list[dict[str, Any]]) -> Pair:
    return Pair(torch.stack([s["data"] for s in samples]), torch.tensor([int(s["__key__"][1:]) for s in samples]))


def test_a_pool_whose_memory_is_full_sends_batches_whole_instead(tmp_path: Path) -> None:
    """A caller that keeps more batches than the workers' shared memory holds still gets every one, intact; the
    arena grows once to hold ``prefetch_factor + 2`` batches, not without end as the caller keeps more."""
    root = build_cache(tmp_path / "c", 64, nbytes=4096)
    with pool_over(root, 1, arena_bytes=48 << 10) as (_snapshot, dataset, pool):  # room for 1 batch of 8 x 4 KiB
        held = list(pool.open_pass(pool.new_key(), dataset, EIGHTS))
        held += list(pool.open_pass(pool.new_key(), dataset, EIGHTS))
        assert len(held) == 16
        for batch in held:
            check_batch(batch)
        assert sum(in_arena(pool, batch) for batch in held) < len(held), "some travelled whole"
        assert pool._arena_end <= (48 << 10) + whole_pages(4 * aligned(region_bytes(held[0])))


def in_arena(pool: WorkerPool, batch: dict[str, Any]) -> bool:
    """Whether ``batch``'s data lies in a worker's arena (not sent whole through the pipe)."""
    address = batch["data"].data_ptr()
    for worker in pool._workers:
        start = np.frombuffer(worker.arena.map, dtype=np.uint8).ctypes.data
        if start <= address < start + worker.arena.size:
            return True
    return False


def region_bytes(batch: dict[str, Any]) -> int:
    return sum(aligned(value.numel() * value.element_size()) for value in batch.values() if torch.is_tensor(value))


def test_batches_larger_than_the_arena_keep_arriving_through_it_after_the_first_ones(tmp_path: Path) -> None:
    """A batch that does not fit ``prefetch_factor + 2`` times makes every worker's arena grow by room for that
    many: only the batches placed before the workers heard of it (at most ``prefetch_factor + 1`` per worker)
    travel whole through the pipe; every later one lies in the arena."""
    root = build_cache(tmp_path / "c", 64, nbytes=16 << 10)  # batches of 8 x 16 KiB: larger than the arena
    with pool_over(root, 2, arena_bytes=64 << 10) as (_snapshot, dataset, pool):
        placed = []
        for _ in range(4):
            for batch in pool.open_pass(pool.new_key(), dataset, EIGHTS):
                check_batch(batch)
                placed.append(in_arena(pool, batch))
        whole = [i for i, inside in enumerate(placed) if not inside]
        assert whole and max(whole) < 2 * 3, f"batches {whole} of {len(placed)} travelled through the pipe"
        assert pool._arena_end == (64 << 10) + whole_pages(4 * aligned(region_bytes(batch))), "grew once, by 4 batches"


def big_image(sample: dict[str, Any]) -> dict[str, Any]:
    """A decoded 3 x 224 x 224 float32 image (602 KB), its value the sample's number."""
    sample["image"] = torch.full((3, 224, 224), float(sample["__key__"][1:]))
    return sample


@pytest.mark.slow  # 30 s on 2 cores: 12 batches of 154 MB
def test_batches_of_256_float_images_of_224x224_travel_through_the_arena(tmp_path: Path) -> None:
    """Issue 26's case: batches of 256 x 3 x 224 x 224 float32 (154 MB) with the default arena (256 MiB, one
    such batch). After the first few, every batch lies in a worker's arena, none is pickled through the pipe."""
    root = build_cache(tmp_path / "c", 1536, nbytes=16)
    with EpochLoaderFactory(
        root, batch_size=256, num_workers=2, shuffle=False, transform=big_image, run_id="t", progress=None, epochs=2
    ) as factory:
        pool = factory._pool
        assert pool is not None
        placed = []
        for epoch in range(2):
            for batch in factory.loader(epoch):
                assert batch["image"].shape == (256, 3, 224, 224)
                assert batch["image"][:, 0, 0, 0].tolist() == [float(key[1:]) for key in batch["__key__"]]
                address = batch["image"].data_ptr()
                placed.append(
                    any(
                        0 <= address - np.frombuffer(w.arena.map, dtype=np.uint8).ctypes.data < w.arena.size
                        for w in pool._workers
                    )
                )
                del batch
    whole = [i for i, inside in enumerate(placed) if not inside]
    print(f"\nbatches sent whole through the pipe: {whole} of {len(placed)}")
    assert len(placed) == 12 and max(whole, default=-1) < 2 * 3, f"batches {whole} travelled through the pipe"
    assert placed[-6:] == [True] * 6


def test_a_batch_shape_first_seen_in_a_dropped_batch_is_still_known_to_later_batches(tmp_path: Path) -> None:
    """A worker sends each batch layout's skeleton once, with the first batch of that shape; when that batch belongs
    to a pass that was abandoned (and is dropped unread), later batches naming the skeleton still build."""
    with pool_over(build_cache(tmp_path / "c", 64), 2, prefetch_factor=2) as (_snapshot, dataset, pool):
        key = pool.new_key()
        abandoned = pool.open_pass(key, dataset, EIGHTS)
        next(abandoned)  # worker 0's first batch; worker 1's first (its skeleton) is in flight
        keys = [k for batch in pool.open_pass(key, dataset, EIGHTS) for k in batch["__key__"]]
        assert sorted(keys) == sorted(f"k{i}" for i in range(64))


def test_default_collation_in_place_matches_default_collate() -> None:
    from torch.utils.data import default_collate

    samples = [
        {"x": torch.full((3, 2), i, dtype=torch.float32), "y": i, "k": f"s{i}", "t": (torch.tensor(i), 2.5 * i)}
        for i in range(4)
    ]
    arena = np.zeros(1 << 16, dtype=np.uint8)
    allocator = Allocator(0, len(arena))

    def allocate(nbytes: int) -> tuple[int, Any]:
        offset = allocator.allocate(nbytes)
        assert offset is not None
        return offset, arena[offset : offset + nbytes]

    offset, nbytes, layout = collate_into(samples, None, allocate)
    assert isinstance(layout, Nest) and layout.keys == ("x", "y", "k", "t")
    assert isinstance(layout.items[0], Slot) and layout.items[2] == [f"s{i}" for i in range(4)], "keys travel as is"
    batch = place(layout, arena[offset : offset + nbytes])
    expected = default_collate(samples)
    assert batch["k"] == expected["k"]
    for name in ("x", "y"):
        assert torch.equal(batch[name], expected[name]) and batch[name].dtype == expected[name].dtype
    assert all(torch.equal(a, b) for a, b in zip(batch["t"], expected["t"], strict=True))


def _arena_allocator(size: int) -> tuple[np.ndarray, Allocator, Any]:
    arena = np.zeros(size, dtype=np.uint8)
    allocator = Allocator(0, size)

    def allocate(nbytes: int) -> tuple[int, Any]:
        offset = allocator.allocate(nbytes)
        return (-1, None) if offset is None else (offset, arena[offset : offset + nbytes])

    return arena, allocator, allocate


def test_samples_copied_one_by_one_as_they_are_read_make_default_collates_batch() -> None:
    """Large samples are copied into the batch as each is read (RowCollator); the batch is default_collate's,
    with as many rows as samples were added."""
    from torch.utils.data import default_collate

    samples = [
        {
            "image": torch.full((4, 64, 64), i, dtype=torch.uint8),
            "scale": torch.tensor(0.5 * i),
            "label": i,
            "weight": 0.25 * i,
            "flag": i % 2 == 0,
            "__key__": f"s{i}",
        }
        for i in range(5)
    ]
    arena, _allocator, allocate = _arena_allocator(1 << 20)
    collator = RowCollator.start(samples[0], 8, allocate)  # room for 8, 5 come (3 records skipped, say)
    assert collator is not None
    assert all(collator.add(sample) for sample in samples[1:])
    batch = place(collator.finish(), arena[collator.offset : collator.offset + collator.nbytes])
    expected = default_collate(samples)
    assert batch["__key__"] == expected["__key__"]
    for name in ("image", "scale", "label", "weight", "flag"):
        assert batch[name].dtype == expected[name].dtype and torch.equal(batch[name], expected[name]), name


def test_a_readers_numpy_arrays_are_copied_into_rows_as_the_tensors_torch_would_make_of_them() -> None:
    """Samples read with their numpy arrays (``iter_items(tensors=False)``) make the batch that default_collate
    makes of the same samples as tensors; an array torch has no tensor for sends the batch down the usual path."""
    from torch.utils.data import default_collate

    from cachefeed._trainer.dataset import as_tensors

    def sample(i: int) -> dict[str, Any]:
        return {
            "image": np.full((4, 64, 64), i, dtype=np.uint8),
            "box": np.arange(4, dtype=np.float32) * i,
            "label": i,
            "__key__": f"s{i}",
        }

    arena, _allocator, allocate = _arena_allocator(1 << 20)
    collator = RowCollator.start(sample(0), 4, allocate)
    assert collator is not None
    assert all(collator.add(sample(i)) for i in range(1, 4))
    batch = place(collator.finish(), arena[collator.offset : collator.offset + collator.nbytes])
    expected = default_collate([as_tensors(sample(i)) for i in range(4)])
    assert batch["__key__"] == expected["__key__"]
    for name in ("image", "box", "label"):
        assert batch[name].dtype == expected[name].dtype and torch.equal(batch[name], expected[name]), name

    collator = RowCollator.start(sample(0), 4, allocate)
    assert collator is not None
    for unlike in (
        {**sample(1), "image": torch.from_numpy(sample(1)["image"])},  # a tensor where the first had an array
        {**sample(1), "box": np.arange(4, dtype=np.float64)},  # another dtype
        {**sample(1), "image": np.zeros((4, 64, 63), dtype=np.uint8)},  # another shape
    ):
        assert not collator.add(unlike) and collator.count == 1
    foreign = {**sample(0), "box": np.arange(4, dtype=">f4")}  # a byte order torch.from_numpy refuses
    assert RowCollator.start(foreign, 4, allocate) is None


def test_large_samples_reach_a_transform_as_tensors_and_the_batch_as_default_collates(tmp_path: Path) -> None:
    """The worker copies large samples' arrays without making tensors of them only where nothing else sees the
    sample: a transform still gets tensors, and the batch is the one default_collate makes of the dataset's samples.
    """
    from torch.utils.data import default_collate

    root = build_cache(tmp_path / "c", 64, nbytes=32 << 10, segment_bytes=512 << 10)
    with pool_over(root, 2) as (_snapshot, dataset, pool):
        batches = list(pool.open_pass(pool.new_key(), dataset, EIGHTS))
        for indices, batch in zip(EIGHTS, batches, strict=True):
            expected = default_collate(dataset.__getitems__(indices))
            assert batch.keys() == expected.keys() and batch["__key__"] == expected["__key__"]
            for name in ("data", "n"):
                assert batch[name].dtype == expected[name].dtype and torch.equal(batch[name], expected[name])

    with EpochLoaderFactory(
        root, batch_size=8, num_workers=2, transform=tensors_only, run_id="t", progress=None
    ) as factory:
        keys = [key for batch in factory.loader(0) for key in check_batch(batch)]
    assert sorted(keys) == sorted(f"k{i}" for i in range(64))


def test_a_sample_unlike_the_first_sends_the_batch_down_the_usual_path() -> None:
    first = {"image": torch.zeros(32 << 10, dtype=torch.uint8), "label": 1}
    _arena, _allocator, allocate = _arena_allocator(1 << 20)
    for unlike in (
        {"image": torch.zeros(16 << 10, dtype=torch.uint8), "label": 2},  # another shape
        {"image": torch.zeros(32 << 10, dtype=torch.uint8), "label": 2.0},  # another type
        {"image": torch.zeros(32 << 10, dtype=torch.uint8)},  # a field missing
        {"image": torch.zeros(32 << 10, dtype=torch.uint8), "label": 1 << 70},  # an int default_collate refuses
    ):
        collator = RowCollator.start(first, 4, allocate)
        assert collator is not None and not collator.add(unlike) and collator.count == 1
    assert RowCollator.start({"image": torch.zeros(8, dtype=torch.uint8)}, 4, allocate) is None, "small: stack"
    assert RowCollator.start({"t": (torch.zeros(32 << 10),)}, 4, allocate) is None, "nested: the usual path"


def test_a_corrupt_record_among_large_samples_is_skipped_and_the_batch_is_one_row_shorter(tmp_path: Path) -> None:
    from tests.trainer.test_dataset import corrupt_record

    root = build_cache(tmp_path / "c", 64, nbytes=32 << 10, segment_bytes=512 << 10)
    with pool_over(root, 2) as (snapshot, dataset, pool):
        segment, record = (int(x[0]) for x in dataset.locate([21]))
        corrupt_record(snapshot.paths[segment], record)
        batches = list(pool.open_pass(pool.new_key(), dataset, EIGHTS))
        assert [len(batch["__key__"]) for batch in batches] == [8, 8, 7, 8, 8, 8, 8, 8]
        keys = [key for batch in batches for key in check_batch(batch)]
        assert sorted(keys) == sorted(f"k{i}" for i in range(64) if i != 21)
        assert dataset.skipped == 1


def test_regions_go_back_and_merge() -> None:
    allocator = Allocator(64, 64 + 4 * 128)
    regions = [allocator.allocate(100) for _ in range(4)]
    assert regions == [64, 192, 320, 448] and allocator.allocate(1) is None
    allocator.release(192, 100)
    allocator.release(448, 100)
    allocator.release(320, 100)
    assert allocator.allocate(300) == 192, "three neighbours merged into one region"


def test_a_grown_arena_never_cuts_a_region_across_two_spans() -> None:
    """Each span is registered with CUDA on its own: a region across two would be half pinned."""
    allocator = Allocator(64, 64 + 2 * 128)
    first, second = allocator.allocate(100), allocator.allocate(100)
    allocator.grow(64 + 2 * 128 + 256)
    allocator.release(second, 100)  # free: the end of the first span, and the whole new one, side by side
    assert allocator.allocate(300) is None, "not merged across the boundary"
    assert allocator.allocate(256) == 64 + 2 * 128
    allocator.release(first, 100)
    assert allocator.allocate(256) == 64, "the first span's regions still merge"


def test_an_arena_grows_by_room_for_that_many_batches_only_when_its_widest_span_lacks_it() -> None:
    assert grown_end(1 << 20, (1 << 20) - 64, 100 << 10, 4, 1 << 30) is None, "4 fit: the caller holds batches"
    assert grown_end(1 << 20, (1 << 20) - 64, 300 << 10, 4, 1 << 30) == (1 << 20) + 4 * (300 << 10)
    assert grown_end(1 << 20, (1 << 20) - 64, 300 << 10, 4, 2 << 20) is None, "not beyond the reserve"


def test_arena_bytes_takes_a_size_and_refuses_one_that_cannot_hold_batches(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 40, nbytes=4096)
    for bad, says in (("tiny", "arena_bytes: expected a size"), (1000, "at least 1MiB"), (-5, ">= 0")):
        with pytest.raises(ValueError, match=says):
            EpochLoaderFactory(root, batch_size=8, num_workers=1, arena_bytes=bad, progress=None)
    with EpochLoaderFactory(
        root, batch_size=8, num_workers=1, arena_bytes="2MiB", run_id="t", progress=None, epochs=1
    ) as factory:
        keys = [key for batch in factory.loader(0) for key in check_batch(batch)]
        assert factory._pool is not None and factory._pool._arena_end == 2 << 20
    assert sorted(keys) == sorted(f"k{i}" for i in range(40))


_TRAINER = """
import sys, time
from pathlib import Path
from cachefeed._cache.snapshots import Snapshot
from cachefeed._trainer.dataset import SnapshotDataset
from cachefeed._trainer.pool import WorkerPool
from tests.trainer.test_pool import EIGHTS

if __name__ == "__main__":
    with Snapshot.create(Path(sys.argv[1]), "s") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot)
        pool = WorkerPool(2, collate_fn=None, context="forkserver")
        assert len(list(pool.open_pass(pool.new_key(), dataset, EIGHTS))) == 8
        before = [worker.process.pid for worker in pool._workers]
        time.sleep(1.5)  # idle workers: they must not take the fork server's survival for the trainer's
        assert all(worker.process.is_alive() for worker in pool._workers), "a worker exited during the pause"
        assert len(list(pool.open_pass(pool.new_key(), dataset, EIGHTS))) == 8
        assert [worker.process.pid for worker in pool._workers] == before, "the same workers, none replaced"
        print(*before, flush=True)
        time.sleep(600)
"""


def test_forkserver_workers_outlive_a_pause_and_exit_when_the_trainer_dies(tmp_path: Path) -> None:
    """Under forkserver a worker's parent is the fork server: an idle worker once took that for its trainer's death
    after 0.5 s, and the next batch failed. It must wait through a pause and still exit once the trainer is gone."""
    root = build_cache(tmp_path / "c", 64)
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(root)],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None
        line = trainer.stdout.readline()
        assert line.strip(), trainer.stderr.read() if trainer.stderr else ""
        pids = [int(pid) for pid in line.split()]
    finally:
        trainer.kill()
        trainer.wait()
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), what="the orphaned workers exit")
    if trainer.stdout is not None:
        trainer.stdout.close()
    if trainer.stderr is not None:
        trainer.stderr.close()
