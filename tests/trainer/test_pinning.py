"""NOTE [ Pinned arenas ] (cachefeed/_trainer/pinning.py) on a fake GPU: a region of a worker's arena is written
again only after every copy from it ran, whichever device and stream it was queued on; no context is made on a
device nobody uses; where the pool cannot fence, batches are copied into torch's pinned memory instead.

The fake (``tests/support/fake_cuda.py``) runs its streams' copies only when a test says so, and a copy that runs
after its source was overwritten is *torn*: every test below fails if a region is reused too early. Each lets the
GPU lag a few copies behind the loop, so regions are reused too (not merely never given back).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cachefeed._trainer.dataset import SnapshotDataset
from cachefeed._trainer.device import InFlightCopies
from cachefeed._trainer.pinning import PinnedArenas
from cachefeed._trainer.pool import WorkerPool
from tests.support.child_env import REPO, child_env
from tests.support.fake_cuda import FakeCuda, FakeStream
from tests.trainer.test_loader import build_cache, check_batch
from tests.trainer.test_pool import EIGHTS, pool_over

LAG = 3  # copies a lagging stream keeps queued


@dataclass
class Fed:
    """What a loop over the pool saw: batches, and those that lay in an arena (by offset)."""

    batches: int = 0
    offsets: list[int] = field(default_factory=list)
    pinned: int = 0

    @property
    def reused(self) -> int:
        return len(self.offsets) - len(set(self.offsets))


def feed(
    pool: WorkerPool,
    dataset: SnapshotDataset,
    gpu: FakeCuda,
    route: Callable[[int], FakeStream],
    *,
    passes: int = 3,
    keep: Callable[[Any, FakeStream], None] | None = None,
    lagging: tuple[FakeStream, ...] = (),
) -> Fed:
    """``passes`` over ``EIGHTS``; batch ``i``'s data is copied on stream ``route(i)`` and dropped at once (or given
    to ``keep``), as after ``x = batch["data"].cuda(non_blocking=True)``; the ``lagging`` streams keep up to ``LAG``
    copies queued, every other stream runs its copies at once."""
    fed = Fed()
    for _ in range(passes):
        for batch in pool.open_pass(pool.new_key(), dataset, EIGHTS):
            check_batch(batch)
            data = batch["data"]
            stream = route(fed.batches)
            gpu.copy(data, stream.device, stream)
            fed.batches += 1
            fed.pinned += gpu.is_pinned(data.data_ptr(), data.numel())
            for worker in pool._workers:
                offset = data.data_ptr() - np.frombuffer(worker.arena.map, dtype=np.uint8).ctypes.data
                if 0 <= offset < worker.arena.size:
                    fed.offsets.append(offset)
            if keep is not None:
                keep(batch, stream)
            del batch, data
            for each in gpu.streams:
                while each.pending > (LAG if each in lagging else 0):
                    gpu.step(each)
    gpu.run_all()  # the pool is still open: the arenas are mapped
    return fed


def test_copies_to_cuda1_while_the_current_device_is_0_run_before_their_regions_are_reused(tmp_path: Path) -> None:
    """DDP without ``torch.cuda.set_device`` (``model.to(rank)``): the current device is 0, the copies go to 1. The
    fence must be on cuda:1's stream, and nothing may touch cuda:0 (no context for every rank on GPU 0)."""
    gpu = FakeCuda(devices=2, current=0, in_use=(1,))
    root = build_cache(tmp_path / "c", 64, nbytes=4096)
    with pool_over(root, 1, arena_bytes=160 << 10, pinned=PinnedArenas(gpu)) as (_snapshot, dataset, pool):
        fed = feed(pool, dataset, gpu, lambda i: gpu.streams[1], lagging=(gpu.streams[1],))
    assert gpu.torn == [], "a region was rewritten before its copy to cuda:1 ran"
    assert gpu.dma_copies > 0 and fed.reused > 0, "copies ran from pinned memory and regions were reused after"
    assert gpu.created == [], "no context was made on cuda:0"
    assert {device for device, _address, _nbytes in gpu.registrations} == {1}


def test_copies_to_two_devices_all_run_before_their_regions_are_reused(tmp_path: Path) -> None:
    """A batch split over two GPUs (or two models): cuda:0 keeps up, cuda:1 lags; a region waits for both."""
    gpu = FakeCuda(devices=2, current=0, in_use=(0, 1))
    root = build_cache(tmp_path / "c", 64, nbytes=4096)
    with pool_over(root, 1, arena_bytes=160 << 10, pinned=PinnedArenas(gpu)) as (_snapshot, dataset, pool):
        fed = feed(pool, dataset, gpu, lambda i: gpu.streams[i % 2], lagging=(gpu.streams[1],))
    assert gpu.torn == [], "a region was rewritten before its copy to cuda:1 ran"
    assert gpu.dma_copies > 0 and fed.reused > 0


def test_a_side_stream_queue_two_deep_keeps_each_host_batch_until_its_copy_ran(tmp_path: Path) -> None:
    """A prefetcher two batches deep copying on a side stream of its own (as ``DevicePrefetcher``, deeper): it holds
    each host batch in ``InFlightCopies`` until the side stream ran its copy, and no region is rewritten before."""
    gpu = FakeCuda(devices=1, in_use=(0,))
    side = gpu.stream(0)
    in_flight = InFlightCopies(gpu)
    ready: deque[Any] = deque()

    def keep(host: Any, stream: FakeStream) -> None:
        in_flight.release_done()
        in_flight.add(host, stream)
        ready.append(object())  # the batch on the device, handed out two batches later
        if len(ready) > 2:
            ready.popleft()

    root = build_cache(tmp_path / "c", 64, nbytes=4096)
    with pool_over(root, 1, arena_bytes=160 << 10, pinned=PinnedArenas(gpu)) as (_snapshot, dataset, pool):
        fed = feed(pool, dataset, gpu, lambda i: side, keep=keep, lagging=(side,))
        in_flight.wait()
    assert gpu.torn == [], "a region was rewritten before its copy on the side stream ran"
    assert gpu.dma_copies > 0 and fed.reused > 0


def test_a_side_stream_copy_whose_host_batch_is_dropped_at_once_is_not_covered_by_the_pool(tmp_path: Path) -> None:
    """Why the README tells a prefetcher of your own to keep its host batches: the pool fences the current streams,
    and a copy on a side stream is not ordered before those fences. (The fake sees it: the check above is real.)"""
    gpu = FakeCuda(devices=1, in_use=(0,))
    side = gpu.stream(0)
    root = build_cache(tmp_path / "c", 64, nbytes=4096)
    with pool_over(root, 1, arena_bytes=160 << 10, pinned=PinnedArenas(gpu)) as (_snapshot, dataset, pool):
        feed(pool, dataset, gpu, lambda i: side, lagging=(side,))
    assert gpu.torn, "with nothing holding the host batches, regions are rewritten under queued side-stream copies"


def test_a_loop_run_under_a_stream_of_its_own_is_fenced_on_that_stream(tmp_path: Path) -> None:
    """``with torch.cuda.stream(s):`` around the whole loop: ``s`` is the current stream when the pool fences."""
    gpu = FakeCuda(devices=1, in_use=(0,))
    own = gpu.stream(0)
    gpu.set_current_stream(0, own)
    root = build_cache(tmp_path / "c", 64, nbytes=4096)
    with pool_over(root, 1, arena_bytes=160 << 10, pinned=PinnedArenas(gpu)) as (_snapshot, dataset, pool):
        fed = feed(pool, dataset, gpu, lambda i: own, lagging=(own,))
    assert gpu.torn == [] and gpu.dma_copies > 0 and fed.reused > 0


def test_arenas_wait_unregistered_until_a_device_is_in_use_and_then_register_from_it(tmp_path: Path) -> None:
    """A loader started before the model went to its GPU: nothing makes a context; the first batches are pageable
    (their copies synchronous), the arena is registered from the device the loop's first copy made, then pinned."""
    gpu = FakeCuda(devices=2, current=0)
    root = build_cache(tmp_path / "c", 64, nbytes=4096)
    with pool_over(root, 1, arena_bytes=160 << 10, pinned=PinnedArenas(gpu)) as (_snapshot, dataset, pool):
        fed = feed(pool, dataset, gpu, lambda i: gpu.streams[1], lagging=(gpu.streams[1],))
    assert gpu.created == [1], "the only context is the one the loop's copy made"
    assert [device for device, _address, _nbytes in gpu.registrations] == [1]
    assert 0 < fed.pinned < fed.batches, "the first batch was pageable, later ones pinned"
    assert gpu.torn == [] and fed.reused > 0


@pytest.mark.parametrize("cause", ["registration fails", "contexts cannot be told"])
def test_where_the_pool_cannot_fence_batches_are_copied_into_torchs_pinned_memory(
    tmp_path: Path, cause: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Never a weaker guard: every batch is handed out as torch's own pinned copy (which torch guards), with one
    log line saying so."""
    if cause == "registration fails":
        gpu = FakeCuda(devices=1, in_use=(0,), register_error=2)
    else:
        gpu = FakeCuda(devices=1, in_use=(0,), tracks_contexts=False)
    root = build_cache(tmp_path / "c", 64, nbytes=4096)
    with (
        caplog.at_level(logging.WARNING, logger="cachefeed"),
        pool_over(root, 1, arena_bytes=160 << 10, pinned=PinnedArenas(gpu)) as (_snapshot, dataset, pool),
    ):
        fed = feed(pool, dataset, gpu, lambda i: gpu.streams[0], lagging=(gpu.streams[0],))
    assert gpu.pinned_by_torch == fed.batches and fed.offsets == [], "every batch is torch's copy, none a view"
    assert gpu.torn == []
    pinned_lines = [r for r in caplog.records if "torch's pinned memory" in r.getMessage()]
    assert len(pinned_lines) == 1, [r.getMessage() for r in caplog.records]


def test_each_arena_is_registered_once_and_released_when_its_worker_goes(tmp_path: Path) -> None:
    gpu = FakeCuda(devices=1, in_use=(0,))
    with pool_over(build_cache(tmp_path / "c", 64), 2, pinned=PinnedArenas(gpu)) as (_snapshot, dataset, pool):
        list(pool.open_pass(pool.new_key(), dataset, EIGHTS))
        first = [np.frombuffer(worker.arena.map, dtype=np.uint8).ctypes.data for worker in pool._workers]
        assert [address for _device, address, _nbytes in gpu.registrations] == first and gpu.unregistrations == []
        os.kill(pool._workers[0].process.pid, signal.SIGKILL)
        pool._workers[0].process.join(10)
        assert len(list(pool.open_pass(pool.new_key(), dataset, EIGHTS))) == 8  # a new worker in its place
        assert gpu.unregistrations == [first[0]] and len(gpu.registrations) == 3
    assert gpu.registered == {}, "closing released the rest"


@pytest.mark.parametrize("arena_bytes", [64 << 10, (64 << 10) + 100])  # a size of whole pages, and one not
def test_a_grown_arena_registers_its_new_span_before_any_batch_lands_there(tmp_path: Path, arena_bytes: int) -> None:
    """Batches larger than the arena: it grows (``arena.py``), and every batch placed in the new span is pinned
    (the fake refuses a page registered twice, as CUDA does: spans must not share a page)."""
    gpu = FakeCuda(devices=1, in_use=(0,))
    root = build_cache(tmp_path / "c", 64, nbytes=16 << 10)  # batches of 8 x 16 KiB
    with pool_over(root, 1, arena_bytes=arena_bytes, pinned=PinnedArenas(gpu)) as (_snapshot, dataset, pool):
        fed = feed(pool, dataset, gpu, lambda i: gpu.streams[0])
    assert len(gpu.registrations) == 2, "the first span, then the grown one"
    assert len(fed.offsets) >= fed.batches - 3, "after the first batches, every batch lies in the arena"
    assert fed.pinned == len(fed.offsets), "every batch in the arena is pinned"
    assert gpu.torn == []


def pinned_run(root: Path, device: int) -> dict[str, Any]:
    """``tests/support/pinned_contexts.py`` in a fresh process (contexts are per process), its report."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.pinned_contexts", str(root), str(device)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_arenas_wait_for_the_loops_device_and_make_no_context_of_their_own(tmp_path: Path) -> None:
    """What the fake cannot show: registration and fences make no context (the first batch is read before anything
    used CUDA), the arenas are registered once the loop used its GPU, and copies dropped at once arrive intact."""
    report = pinned_run(build_cache(tmp_path / "c", 512, nbytes=16 << 10), 0)
    assert report["contexts_before_use"] == [] and report["first_pinned"] is False
    assert report["later_pinned"] and all(report["later_pinned"]), "registered once cuda:0 was in use"
    assert report["intact"] is True and report["contexts_after"] == [0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_on_cuda_copies_to_cuda1_while_the_current_device_is_0_arrive_intact_and_cuda0_stays_unused(
    tmp_path: Path,
) -> None:
    """DDP without ``torch.cuda.set_device`` on real GPUs: copies to cuda:1 behind busy work there, host batches
    dropped at once, all intact; no context on cuda:0."""
    report = pinned_run(build_cache(tmp_path / "c", 512, nbytes=16 << 10), 1)
    assert all(report["later_pinned"]) and report["intact"] is True
    assert report["contexts_after"] == [1], "nothing made a context on cuda:0"
