"""The device prefetcher: a pass-through on CPU, a side-stream copier on CUDA (the GPU test runs where one is)."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from pathlib import Path

import pytest
import torch

from cachefeed._trainer import DevicePrefetcher, EpochLoaderFactory
from cachefeed._trainer.device import move_to
from tests.trainer.test_loader import build_cache

Pair = namedtuple("Pair", ["x", "y"])


def test_on_cpu_batches_pass_through_untouched() -> None:
    batches = [{"x": torch.arange(4)}, {"x": torch.arange(4, 8)}]
    prefetcher = DevicePrefetcher(batches, "cpu")
    assert prefetcher.is_passthrough and len(prefetcher) == 2
    served = list(prefetcher)
    assert all(a is b for a, b in zip(served, batches, strict=True)), "no copy on CPU"
    assert list(prefetcher) == served, "each iter() is a new pass"


def test_on_a_device_other_than_cpu_or_cuda_each_batch_is_moved_there() -> None:
    """``accelerator.device`` may be ``mps`` or ``xpu``: their batches went through unmoved, left on the CPU. The
    meta device stands in for them here (what is checked is that the tensors land on the device asked for)."""
    batches = [{"x": torch.arange(4), "name": "a"}, Pair(torch.ones(2), [torch.zeros(1)])]
    prefetcher = DevicePrefetcher(batches, "meta")
    assert not prefetcher.is_passthrough
    first, second = list(prefetcher)
    assert first["x"].device.type == "meta" and first["name"] == "a"
    assert second.x.device.type == "meta" and second.y[0].device.type == "meta"


def test_the_default_device_is_cpu_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert DevicePrefetcher([]).device == torch.device("cpu")


def test_move_to_copies_every_tensor_of_a_nest_and_keeps_the_rest() -> None:
    batch = {
        "x": torch.ones(2, 3),
        "keys": ["a", "b"],
        "nest": OrderedDict(p=Pair(torch.zeros(1), 7), t=(torch.ones(1), "s")),
        "raw": b"bytes",
    }
    moved = move_to(batch, torch.device("meta"), non_blocking=True)
    assert moved["x"].device.type == "meta" and moved["x"].shape == (2, 3)
    assert moved["keys"] == ["a", "b"] and moved["raw"] == b"bytes"
    assert isinstance(moved["nest"], OrderedDict)
    assert isinstance(moved["nest"]["p"], Pair) and moved["nest"]["p"].x.device.type == "meta"
    assert moved["nest"]["p"].y == 7
    assert isinstance(moved["nest"]["t"], tuple) and moved["nest"]["t"][0].device.type == "meta"
    assert batch["x"].device.type == "cpu", "the source is not modified"


def test_it_wraps_an_epoch_loader(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 64)
    with EpochLoaderFactory(root, batch_size=16, run_id="t", epochs=1) as factory:
        loader = factory.loader(0)
        prefetcher = DevicePrefetcher(loader, "cpu")
        assert len(prefetcher) == 4
        keys = [key for batch in prefetcher for key in batch["__key__"]]
    assert sorted(keys) == sorted(f"k{i}" for i in range(64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_batches_arrive_complete_on_the_device_while_the_step_runs() -> None:
    host = [{"x": torch.full((1 << 22,), i, dtype=torch.float32).pin_memory(), "i": i} for i in range(8)]
    prefetcher = DevicePrefetcher(host, "cuda")
    assert not prefetcher.is_passthrough
    seen = []
    for batch in prefetcher:
        assert batch["x"].is_cuda
        busy = torch.randn(2048, 2048, device="cuda")
        for _ in range(5):  # keep the current stream busy while the next copy runs on the side stream
            busy = busy @ busy
            busy = busy / busy.norm()
        seen.append((batch["i"], float(batch["x"].mean())))
        del batch
    torch.cuda.synchronize()
    assert seen == [(i, float(i)) for i in range(8)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_pinned_batches_copied_and_dropped_at_once_arrive_intact(tmp_path: Path) -> None:
    """``pin_memory=True``: the workers' shared memory is registered as pinned, and a batch dropped right after
    ``.cuda(non_blocking=True)`` (its copy still queued behind a busy stream) is not overwritten before the copy ran
    (NOTE [ Pinned arenas ] in ``cachefeed/_trainer/pinning.py``)."""
    root = build_cache(tmp_path / "c", 512, nbytes=16 << 10)
    expected = {}
    with EpochLoaderFactory(root, batch_size=32, num_workers=2, shuffle=False, run_id="t", epochs=1) as factory:
        for batch in factory.loader(0):
            expected.update(zip(batch["__key__"], batch["data"].clone(), strict=True))
    copies = []
    weights = torch.zeros(1, device="cuda")  # the model on its GPU: registration waits for a GPU in use
    with EpochLoaderFactory(
        root, batch_size=32, num_workers=2, shuffle=False, pin_memory=True, run_id="t", epochs=1
    ) as factory:
        for batch in factory.loader(0):
            assert batch["data"].is_pinned(), "the arena is registered: no pin-memory thread, no copy"
            busy = torch.randn(4096, 4096, device="cuda")
            for _ in range(4):  # the copy below waits behind this work on the current stream
                busy = busy @ busy
            copies.append((batch["__key__"], batch["data"].cuda(non_blocking=True)))
            del batch  # the host batch is gone while its copy is still queued
        torch.cuda.synchronize()
    del weights
    for keys, data in copies:
        for key, row in zip(keys, data.cpu(), strict=True):
            assert torch.equal(row, expected[key]), key
