"""Tests of the shared harness (no peer library needed): part of the default test run (pyproject's ``testpaths``)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch  # noqa: F401  (imported here, so that the adapters' children import it before their timeouts run)

from benchmarks.common.adapter import DataLocation, EpochSource, LoaderSettings
from benchmarks.common.epochs import StopEpochs, run_epochs
from benchmarks.common.measures import Context
from benchmarks.common.runner import MeasureSpec, run_measures
from benchmarks.common.s3server import S3Server, classify, fetch_stats, stats_delta
from benchmarks.common.samplers import tree_bytes
from benchmarks.common.samples import SampleError, Workload, collate, make_sample, verify_batch, verify_sample

WORKLOAD = Workload("tiny", 64, 10, 4)


def test_a_sample_verifies_and_any_change_is_caught() -> None:
    sample = make_sample(7, 64)
    assert verify_sample(sample) == 7
    assert verify_sample(sample.tobytes(), expected_index=7) == 7
    flipped = sample.copy()
    flipped[40] ^= 1
    with pytest.raises(SampleError, match="checksum"):
        verify_sample(flipped)
    with pytest.raises(SampleError, match="expected sample 8"):
        verify_sample(sample, expected_index=8)
    with pytest.raises(SampleError, match="size field"):
        verify_sample(sample[:48])


def test_collate_gives_rows_that_verify() -> None:
    batch = collate([make_sample(i, 64) for i in range(3)] + [{"x": make_sample(3, 64)}])
    assert tuple(batch.shape) == (4, 64)
    assert verify_batch(batch) == [0, 1, 2, 3]


def test_classify_names_s3_requests() -> None:
    assert classify({"REQUEST_METHOD": "GET", "PATH_INFO": "/bench/a/b"}) == "get"
    assert classify({"REQUEST_METHOD": "GET", "PATH_INFO": "/bench/a", "HTTP_RANGE": "bytes=0-1"}) == "get_range"
    assert classify({"REQUEST_METHOD": "GET", "PATH_INFO": "/bench"}) == "list"
    assert classify({"REQUEST_METHOD": "HEAD", "PATH_INFO": "/bench/a"}) == "head"


def test_the_server_counts_the_bytes_it_sends() -> None:
    server = S3Server.start()
    try:
        client = server.client()
        client.create_bucket(Bucket="bench")
        client.put_object(Bucket="bench", Key="k/one", Body=b"x" * 100_000)
        before = fetch_stats(server.endpoint)
        for _ in range(3):
            client.get_object(Bucket="bench", Key="k/one")["Body"].read()
        client.get_object(Bucket="bench", Key="k/one", Range="bytes=0-9")["Body"].read()
        delta = stats_delta(before, fetch_stats(server.endpoint))
    finally:
        server.stop()
    assert delta["requests"] == {"get": 3, "get_range": 1}
    assert delta["data_bytes_out"] == 300_010


def test_tree_bytes_counts_allocated_blocks_and_hard_links_once(tmp_path: Path) -> None:
    data = tmp_path / "a"
    data.write_bytes(b"x" * 100_000)
    os.link(data, tmp_path / "b")
    sparse = tmp_path / "sparse"
    with sparse.open("wb") as handle:
        handle.truncate(50_000_000)
    assert 100_000 <= tree_bytes([tmp_path]) < 200_000


class _ListSource:
    """Epochs given as lists of batches; a batch may be a callable run when it is due (to sleep, to fail)."""

    def __init__(self, epochs: list[list[Any]]) -> None:
        self.epochs = epochs

    def epoch(self, epoch: int) -> Iterable[Any]:
        def batches() -> Iterator[Any]:
            for batch in self.epochs[epoch]:
                yield batch() if callable(batch) else batch

        return batches()

    def close(self) -> None:
        pass


def _batch(indices: list[int]) -> Any:
    return collate([make_sample(i, 64) for i in indices])


def test_run_epochs_counts_duplicates_corruption_and_the_handover() -> None:
    corrupt = make_sample(5, 64)
    corrupt[30] ^= 1

    def slow_first_batch() -> Any:
        time.sleep(0.2)
        return _batch([0, 1])

    source = _ListSource(
        [
            [_batch([0, 1, 2]), _batch([2, 3]), collate([corrupt])],
            [slow_first_batch, _batch(list(range(2, 10)))],
        ]
    )
    first, second = run_epochs(source, 2, dataset_count=10, sample_bytes=64)
    assert (first["samples"], first["unique_samples"], first["duplicate_samples"]) == (5, 4, 1)
    assert first["corrupt_samples"] == 1
    assert first["missing_samples"] == 6
    assert second["missing_samples"] == 0
    assert second["handover_wait_s"] >= 0.2


def test_a_check_stops_the_run_and_keeps_the_partial_epoch() -> None:
    source = _ListSource([[_batch([0]), _batch([1]), _batch([2])]])
    with pytest.raises(StopEpochs) as info:
        run_epochs(
            source, 1, 10, 64, check=lambda partial: "enough" if partial["samples"] >= 2 else None, check_interval_s=0
        )
    assert info.value.reason == "enough"
    assert info.value.results[-1]["partial"] is True
    assert info.value.results[-1]["distinct_so_far"] == 2


def test_equal_work_runs_epochs_until_the_samples_and_counts_distinct_ones_over_all_of_them() -> None:
    """``until_samples`` (run_all's budget30: three passes' worth): a system with small epochs runs more of them;
    coverage and bytes per byte trained are over the whole measurement (``report.trained``)."""
    from benchmarks.common.report import trained

    source = _ListSource([[_batch([0, 1, 2])], [_batch([2, 3])], [_batch([4, 5])], [_batch([6])]])
    results = run_epochs(source, 10, dataset_count=10, sample_bytes=64, until_samples=6, step_s=0.01)
    assert [r["samples"] for r in results] == [3, 2, 2], "stops after the epoch that reaches 6 samples"
    assert [r["distinct_so_far"] for r in results] == [3, 4, 6]
    assert results[0]["wall_s"] >= 0.01, "a training step per batch"
    for r, nbytes in zip(results, (640, 0, 256), strict=True):
        r["remote_bytes"] = nbytes
    whole = trained(results, 10, 64)
    assert (whole["samples_trained"], whole["distinct_samples"], whole["coverage"]) == (7, 6, 0.6)
    assert whole["server_bytes_per_byte_trained"] == round(896 / (7 * 64), 4)


class HangingAdapter:
    """Serves one batch, then never the next: what a hang at an epoch boundary looks like to the harness."""

    name = "hanging"
    supports_local = True
    supports_remote = False
    uses_sample_objects = True

    def describe(self) -> dict[str, Any]:
        return {}

    def convert(self, workload: Workload, samples_dir: Path, out_dir: Path) -> dict[str, Any]:
        return {}

    def open(self, workload: Workload, data: DataLocation, settings: LoaderSettings) -> EpochSource:
        def hang() -> Any:
            time.sleep(3600)

        return _ListSource([[_batch(list(range(10)))], [hang]])


def test_a_hang_is_recorded_with_what_was_measured_before_it(tmp_path: Path) -> None:
    ctx = Context(WORKLOAD, "http://127.0.0.1:9", "bench", tmp_path, "s3://bench/s", tmp_path, "s3://bench/c", tmp_path)
    specs = [
        MeasureSpec("local", "local", {"epochs": 2, "sequential_read": False}, timeout_s=5.0),
        MeasureSpec("describe", "describe", {}, timeout_s=30.0),
    ]
    results = run_measures("benchmarks.common.test_common:HangingAdapter", ctx.to_json(), specs, tmp_path / "logs")
    assert results["local"]["status"] == "timeout"
    assert "no progress for 5s" in results["local"]["error"]
    assert results["local"]["partial"][0]["epoch_result"]["unique_samples"] == 10
    assert results["describe"]["status"] == "ok"  # a fresh child ran what remained
    assert len(results["_children"]) == 2


class LeakingAdapter(HangingAdapter):
    """Creates a shared-memory block in ``open`` and never unlinks it (and keeps it mapped while it runs)."""

    def open(self, workload: Workload, data: DataLocation, settings: LoaderSettings) -> EpochSource:
        from multiprocessing import resource_tracker, shared_memory

        block = shared_memory.SharedMemory(name=f"bench-test-leak-{os.getpid()}", create=True, size=4096)
        resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]  # leak on purpose
        self.block = block

        def slow() -> Any:
            time.sleep(1.5)  # long enough for the runner's /proc scan to see the mapping
            return _batch(list(range(10)))

        return _ListSource([[slow]])


def test_only_the_childs_own_shared_memory_is_reported_and_removed(tmp_path: Path) -> None:
    ctx = Context(WORKLOAD, "http://127.0.0.1:9", "bench", tmp_path, "s3://bench/s", tmp_path, "s3://bench/c", tmp_path)
    foreign = Path(f"/dev/shm/bench-test-foreign-{os.getpid()}")
    foreign.write_bytes(b"not the child's")
    try:
        specs = [MeasureSpec("local", "local", {"epochs": 1, "sequential_read": False}, timeout_s=30.0)]
        results = run_measures("benchmarks.common.test_common:LeakingAdapter", ctx.to_json(), specs, tmp_path / "l")
        assert foreign.exists()
    finally:
        foreign.unlink()
    child = results["_children"][0]
    assert [name for name in child["shm_left"] if name.startswith("bench-test-")] == [
        name for name in child["shm_left"] if name.startswith("bench-test-leak-")
    ]
    assert len(child["shm_left"]) == 1
    assert not Path("/dev/shm", child["shm_left"][0]).exists()
