"""What code written for a DataLoader reads off ``factory.loader(epoch)`` (``_trainer/compat.py``), the examples
that train with Lightning and Accelerate on it (real subprocesses, CPU), and ``pin_memory`` without CUDA."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from cachefeed import EpochLoaderFactory
from cachefeed._trainer.partition import EpochBatchSampler
from tests.trainer.test_loader import build_cache, check_batch

REPO = Path(__file__).resolve().parents[2]
# The snapshot's job id (``<run_id>-<job>-e<epoch>``) differs per run: the lines are compared without it.
# Greedy: a random job id may itself hold "e" and six digits ("e8729759753e"), where a lazy match stopped.
EPOCH_LINE = re.compile(r"rank \d+ epoch \d+: \d+ batches of \d+ samples, snapshot \S+-e\d{6}")
JOB_ID = re.compile(r"-[0-9a-f]{12}-e(\d{6})")


def epoch_lines(stdout: str) -> list[str]:
    return [JOB_ID.sub(r"-e\1", line) for line in EPOCH_LINE.findall(stdout)]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_loader_answers_what_code_written_for_a_dataloader_reads(tmp_path: Path, workers: int) -> None:
    root = build_cache(tmp_path / "c", 250)
    options = {"multiprocessing_context": "fork", "prefetch_factor": 3} if workers else {}
    with EpochLoaderFactory(
        root, batch_size=16, num_workers=workers, drop_last=True, run_id="t", epochs=2, progress=None, **options
    ) as factory:
        loader = factory.loader(0)
        assert (loader.batch_size, loader.drop_last, loader.num_workers) == (16, True, workers)
        assert loader.persistent_workers and loader.pin_memory is False and loader.timeout == 0
        assert loader.prefetch_factor == (3 if workers else None)
        assert loader.dataset is factory.dataset(0) and len(loader.sampler) == 250
        assert isinstance(loader.batch_sampler, EpochBatchSampler) and len(loader.batch_sampler) == len(loader) == 15
        assert not hasattr(loader.sampler, "set_epoch")  # the factory orders each epoch: nothing for Lightning
        # the sampler is the order served: the keys of its indices are the keys of the batches, in order
        planned = [loader.dataset[int(index)]["__key__"] for index in loader.sampler][: 15 * 16]
        served = [key for batch in loader for key in check_batch(batch)]
        assert served == planned


@pytest.mark.parametrize("workers", [0, 2])
def test_pin_memory_without_cuda_is_one_log_line_and_no_warning_whatever_the_workers(
    tmp_path: Path, workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    if torch.cuda.is_available():
        pytest.skip("with CUDA, pin_memory pins")
    root = build_cache(tmp_path / "c", 120)
    options = {"multiprocessing_context": "fork"} if workers else {}
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        with EpochLoaderFactory(
            root, batch_size=10, num_workers=workers, pin_memory=True, run_id="t", epochs=3, progress=None, **options
        ) as factory:
            for epoch in range(3):
                loader = factory.loader(epoch)
                assert loader.pin_memory is False  # as in effect
                assert sum(len(batch["__key__"]) for batch in loader) == 120
    assert [str(warning.message) for warning in caught] == []
    lines = [record.getMessage() for record in caplog.records if "pin_memory" in record.getMessage()]
    assert lines == ["pin_memory=True: no CUDA device (no accelerator) here, so batches stay in pageable memory"]


def run_example(name: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_the_lightning_example_trains_each_epoch_on_its_own_snapshot(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="pip install -c constraints.txt -e '.[examples]'")
    root = build_cache(tmp_path / "c", 300)
    done = run_example("lightning_datamodule.py", str(root), "--epochs", "3", "--batch", "64", "--workers", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    epochs = epoch_lines(done.stdout)
    expected = [f"rank 0 epoch {e}: 5 batches of 300 samples, snapshot lightning-e{e:06d}" for e in range(3)]
    assert epochs == expected, done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # two processes that each import Lightning: 15 s on an idle 2-core machine, minutes under load
def test_the_lightning_example_under_ddp_splits_each_epoch_once_between_the_ranks(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="pip install -c constraints.txt -e '.[examples]'")
    root = build_cache(tmp_path / "c", 300)
    # two processes on the CPU over gloo, also where one GPU is present (Lightning would ask for two)
    argv = ["--epochs", "2", "--batch", "64", "--workers", "0", "--devices", "2", "--accelerator", "cpu"]
    done = run_example("lightning_datamodule.py", str(root), *argv)
    assert done.returncode == 0, done.stderr[-3000:]
    epochs = sorted(epoch_lines(done.stdout))  # the ranks share stdout: their lines may interleave
    # Lightning left the loader alone (no DistributedSampler): cachefeed's own split, half the snapshot each
    assert epochs == [
        f"rank {rank} epoch {e}: 3 batches of 150 samples, snapshot lightning-e{e:06d}"
        for rank in range(2)
        for e in range(2)
    ], done.stdout


def test_the_accelerate_example_trains_each_epoch_on_its_own_snapshot(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="pip install -c constraints.txt -e '.[examples]'")
    root = build_cache(tmp_path / "c", 300)
    done = run_example("accelerate_loop.py", str(root), "--epochs", "3", "--batch", "64", "--workers", "2", "--cpu")
    assert done.returncode == 0, done.stderr[-3000:]
    epochs = [line for line in done.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split(", mean loss")[0].split(", snapshot")[0] for line in epochs] == [
        f"epoch {e}: 5 batches" for e in range(3)
    ], done.stdout
    losses = [float(line.rpartition(" ")[2]) for line in epochs]
    assert losses[-1] < losses[0], losses  # it trains
