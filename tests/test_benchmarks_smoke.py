"""Smoke run of the benchmark scripts at tiny sizes, in the main .venv (no peers, no .bench-venv): seconds, not minutes.

* the issue-7 harness with the cachefeed adapter against the counting S3 server, through the same child-process
  runner as ``benchmarks/run_all.py``, then the report (``results.md``); one baseline (local files) through the
  same measurement in this process;
* the trainer benchmarks' own functions at tiny sizes: ``read_throughput``, ``handover``, and ``ingest`` (its CLI
  with its smallest counts);
* ``feed_gpu``'s whole path on the CPU (a tiny model, the daemon ingesting from a ``file://`` remote): CI has no
  GPU, so this is what keeps it working between GPU runs (``scripts/gpu_checks.sh``);
* ``cold_launch``'s cachefeed rows (a fresh training process per run, the daemon launched by the loader and beside
  the trainer; litdata lives in .bench-venv only).
"""

from __future__ import annotations

import argparse
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common.runner import MeasureSpec
from benchmarks.common.samples import Workload
from benchmarks.common.suite import Suite, System

# 8 MiB: the smallest dataset whose 30% budget leaves cachefeed room for a few segments (1 MiB metadata reserve).
WORKLOAD = Workload("small", 32 << 10, 256, 32)
CACHEFEED = System("cachefeed", "benchmarks.cachefeed_adapter:CachefeedAdapter")


def _plan(workload: Workload, key: str) -> list[MeasureSpec]:
    # No DataLoader workers here (seconds count); the handover test below runs the factory with a worker.
    def spec(label: str, kind: str, **params: Any) -> MeasureSpec:
        return MeasureSpec(label, kind, {"num_workers": 0, **params}, timeout_s=40.0, max_s=60.0)

    return [
        MeasureSpec("describe", "describe", {}, 30.0),
        spec("convert", "convert"),
        spec("local", "local", epochs=2),
        spec("cold", "remote", epochs=2),
        spec("budget30", "remote", epochs=2, passes=2, budget_fraction=0.3, max_remote_factor=10),
    ]


def _no_ceiling(workload: Workload, key: str) -> list[MeasureSpec]:
    return []  # the S3 ceiling is a child of its own: seconds this test does not have


def test_harness_runs_cachefeed_against_the_counting_server_and_writes_the_report(tmp_path: Path) -> None:
    from benchmarks.common.report import summary_rows
    from benchmarks.common.results_md import write_report

    doc = Suite("test", [CACHEFEED], [WORKLOAD], _plan, _no_ceiling, tmp_path / "run").run()
    entry = doc["workloads"]["small"]
    measures = entry["systems"]["cachefeed"]["measures"]
    for label in ("describe", "local", "cold", "budget30"):
        assert measures[label]["status"] == "ok", (label, measures[label])
    assert measures["convert"]["status"] == "n/a"  # no conversion: the per-sample objects as they are

    local = measures["local"]
    assert all(e["unique_samples"] == WORKLOAD.count and e["corrupt_samples"] == 0 for e in local["epochs"])
    assert local["sequential_read_own_files"]["warm"]["bytes"] >= WORKLOAD.total_bytes  # its segment files

    cold = measures["cold"]["epochs"]
    assert [e["unique_samples"] for e in cold] == [WORKLOAD.count, WORKLOAD.count]
    # Server-counted: the first epoch downloads the dataset once, the second nothing.
    assert WORKLOAD.total_bytes <= cold[0]["remote_bytes"] < 1.1 * WORKLOAD.total_bytes
    assert cold[1]["remote_bytes"] == 0
    assert all(e["duplicate_samples"] == 0 and e["corrupt_samples"] == 0 for e in cold)

    budget = measures["budget30"]
    assert budget["peak_disk_over_budget"] <= 1.01
    assert all(0 < e["unique_samples"] < WORKLOAD.count for e in budget["epochs"])  # a rolling cache: part of it
    assert all(e["duplicate_samples"] == 0 for e in budget["epochs"])
    # Equal work: epochs (a room each) until two passes' worth was trained; coverage and bytes over all of them.
    trained = sum(e["samples"] for e in budget["epochs"])
    assert budget["samples_trained"] == trained and 2 * WORKLOAD.count <= trained < 3 * WORKLOAD.count
    assert sum(e["samples"] for e in budget["epochs"][:-1]) < 2 * WORKLOAD.count  # it stopped once there
    assert budget["distinct_samples"] == budget["epochs"][-1]["distinct_so_far"] <= WORKLOAD.count
    assert budget["distinct_samples"] > max(e["unique_samples"] for e in budget["epochs"])
    assert budget["coverage"] == pytest.approx(budget["distinct_samples"] / WORKLOAD.count, abs=1e-4)
    server = sum(e["remote_bytes"] for e in budget["epochs"])
    assert budget["server_bytes_per_byte_trained"] == pytest.approx(
        server / (trained * WORKLOAD.sample_bytes), abs=1e-4
    )

    assert not any(c["processes_left_after_exit"] for c in entry["systems"]["cachefeed"]["children"])

    write_report(doc, tmp_path)
    report = (tmp_path / "results.md").read_text()
    for heading in ("## 1.", "## 2.", "## 3.", "## 4.", "## 7.", "## Cold start"):  # 5 and 6 were dropped
        assert heading in report
    assert "| cachefeed |" in report
    assert f"{budget['distinct_samples']:,} ({budget['coverage']:.0%})" in report  # figure 3: coverage
    # The cold start counts the daemon's start: its first batch after open_s, its first epoch after that.
    started = measures["cold"]["open_s"]
    row = next(r for r in summary_rows(doc) if r["system"] == "cachefeed")
    assert started < row["cold_first_batch_s"] <= row["cold_first_epoch_s"]
    assert row["cold_first_epoch_s"] == pytest.approx(started + cold[0]["wall_s"], abs=0.002)


def test_cachefeed_reads_the_workload_packed_into_tar_shards_one_get_per_shard(tmp_path: Path) -> None:
    """The ``cachefeed-tar`` system: its conversion packs the samples into tar shards of the peers' shard size,
    the harness uploads them, and the daemon caches every sample from them (each verified by the harness), fetching
    each shard once."""
    from benchmarks.common.adapter import shard_bytes_for

    system = System("cachefeed-tar", "benchmarks.cachefeed_tar_adapter:CachefeedTarAdapter")

    def plan(workload: Workload, key: str) -> list[MeasureSpec]:
        return [
            MeasureSpec("convert", "convert", {}, timeout_s=40.0),
            MeasureSpec("cold", "remote", {"num_workers": 0, "epochs": 2}, timeout_s=40.0, max_s=60.0),
        ]

    doc = Suite("test", [system], [WORKLOAD], plan, _no_ceiling, tmp_path / "run").run()
    measures = doc["workloads"]["small"]["systems"]["cachefeed-tar"]["measures"]
    convert = measures["convert"]
    assert convert["status"] == "ok", convert
    shard_bytes = shard_bytes_for(WORKLOAD)
    assert shard_bytes - WORKLOAD.sample_bytes - 2048 < convert["largest_file_bytes"] <= shard_bytes  # full shards
    assert convert["files"] == -(-convert["bytes"] // convert["largest_file_bytes"])  # all full but the last

    cold = measures["cold"]
    assert cold["status"] == "ok", cold
    epochs = cold["epochs"]
    assert [e["unique_samples"] for e in epochs] == [WORKLOAD.count, WORKLOAD.count]
    assert all(e["duplicate_samples"] == 0 and e["corrupt_samples"] == 0 for e in epochs)
    assert epochs[0]["remote_requests_by_kind"] == {"list": 1, "get": convert["files"]}  # one GET per shard
    assert epochs[0]["remote_bytes"] == convert["bytes"]  # each shard downloaded once
    assert epochs[1]["remote_bytes"] == 0


def test_a_baseline_measured_in_process(tmp_path: Path) -> None:
    """The local-files baseline through the same measurement (in this process: no child, no S3)."""
    from benchmarks.common.measures import Context, measure_local
    from benchmarks.common.samples import write_samples
    from benchmarks.peers.baselines import LocalFilesAdapter

    workload = Workload("tiny", 4 << 10, 128, 16)
    write_samples(workload, tmp_path / "samples")
    ctx = Context(
        workload, "http://unused", "bench", tmp_path / "samples", "s3://bench/samples/tiny", tmp_path / "conv",
        "s3://bench/local-files/tiny", tmp_path / "scratch",
    )  # fmt: skip
    result = measure_local(LocalFilesAdapter(), ctx, {"epochs": 2, "num_workers": 0}, lambda _data: None)
    assert result["status"] == "ok", result
    assert [e["unique_samples"] for e in result["epochs"]] == [128, 128]
    assert result["sequential_read"]["warm"]["bytes"] == workload.total_bytes


def test_the_in_memory_baselines_deliver_every_sample_in_process_and_through_a_worker(tmp_path: Path) -> None:
    """The batched ceiling (one tensor, ``__getitems__``) and the per-sample path over RAM, every sample verified."""
    from benchmarks.common.measures import Context, measure_local
    from benchmarks.common.samples import write_samples
    from benchmarks.peers.baselines import BatchedMemoryAdapter, MemoryAdapter

    workload = Workload("tiny", 4 << 10, 100, 16)  # the last batch is short
    write_samples(workload, tmp_path / "samples")
    ctx = Context(
        workload, "http://unused", "bench", tmp_path / "samples", "s3://bench/samples/tiny", tmp_path / "conv",
        "s3://bench/memory/tiny", tmp_path / "scratch",
    )  # fmt: skip
    for adapter in (BatchedMemoryAdapter(), MemoryAdapter()):
        for workers in (0, 1):
            params = {"epochs": 2, "num_workers": workers, "sequential_read": False}
            result = measure_local(adapter, ctx, params, lambda _data: None)
            assert result["status"] == "ok", (adapter.name, workers, result)
            assert [e["unique_samples"] for e in result["epochs"]] == [100, 100]
            assert [e["batches"] for e in result["epochs"]] == [7, 7]


def test_the_readme_table_renders_the_new_rows_and_dashes_for_a_run_without_them() -> None:
    from benchmarks.common.report import summary_rows
    from benchmarks.run_all import readme_table

    def local(samples_per_s: float, seq_mb_per_s: float | None = None) -> dict[str, Any]:
        seq = {"warm": {"mb_per_s": seq_mb_per_s}}
        return {"status": "ok", "epochs": [{}], "warm_samples_per_s": samples_per_s, "sequential_read": seq}

    systems = {
        "cachefeed": {"measures": {"local": local(100.0, 900.0), "inprocess": local(250.0)}},
        "litdata": {"measures": {"local": local(120.0, 800.0)}},  # a results file from before the in-process row
        "memory-batched": {"measures": {"local": local(300.0, 700.0), "inprocess": local(400.0)}},
    }
    doc: dict[str, Any] = {
        "workloads": {
            "small": {
                "workload": {"name": "small", "sample_bytes": 4096, "count": 8, "batch_size": 4},
                "systems": systems,
            }
        }
    }
    doc["summary"] = summary_rows(doc)
    cells = [line.strip("| ").split(" | ") for line in readme_table(doc).splitlines()]
    rows = {row[0]: row[1:] for row in cells}
    inprocess = next(cells for what, cells in rows.items() if "num_workers=0" in what)
    assert inprocess[:4] == ["250", "-", "-", "-"]
    assert "DataLoader ceiling, batched from RAM 400" in inprocess[4]
    assert "per-sample Dataset over RAM -" in inprocess[4]
    raw = next(cells for what, cells in rows.items() if "raw sequential read" in what)
    assert raw == ["900", "-", "-", "800", "per-sample files -"]
    warm = next(cells for what, cells in rows.items() if "(samples/s)" in what and "num_workers" not in what)
    assert "DataLoader ceiling, batched from RAM 300" in warm[4]


def test_the_cold_start_table_gives_the_median_of_each_systems_cold_starts_and_a_failed_run_by_its_status() -> None:
    from benchmarks.common.results_md import cold_start_table

    def start(open_s: float, first_batch_s: float, wall_s: float, **extra: Any) -> dict[str, Any]:
        epoch = {"first_batch_s": first_batch_s, "wall_s": wall_s, **extra}
        return {"status": "ok", "open_s": open_s, "epochs": [epoch]}

    systems = {
        "cachefeed": {"measures": {"cold": start(0.5, 1.0, 4.0)}},
        "cachefeed-tar": {
            "measures": {
                "cold": start(0.5, 1.0, 4.0),  # the first start is the slowest: the median is another's
                "cold-2": start(0.5, 0.2, 1.0),
                "cold-3": start(0.5, 0.4, 2.0),
                "cold-4": {"status": "timeout", "epochs": []},  # no first batch: not counted
                "cold_epoch_s": start(0.0, 0.0, 0.0),  # not a cold start's label
            }
        },
        "litdata": {"measures": {"cold": start(0.25, 0.5, 2.0, partial=True)}},  # stopped: no complete first epoch
        "mosaic": {"measures": {"cold": {"status": "timeout", "epochs": []}}},
    }
    doc = {
        "workloads": {
            "small": {
                "workload": {"name": "small", "sample_bytes": 4096, "count": 8, "batch_size": 4},
                "systems": systems,
            }
        },
        "provenance": {"commit": "0123456789abcdef", "dirty": False},
    }
    table = cold_start_table(doc)
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
    assert rows["cachefeed, one object per sample (one cold start)"] == (
        "| cachefeed, one object per sample (one cold start) | 1.5 / 4.5 |"
    )
    assert rows["cachefeed, webdataset tar shards (median of 3)"] == (
        "| cachefeed, webdataset tar shards (median of 3) | 0.9 / 2.5 |"
    )
    assert rows["litdata (one cold start)"] == "| litdata (one cold start) | 0.75 / - |"
    assert rows["mosaicml-streaming"] == "| mosaicml-streaming | timeout |"
    assert "s3fs (no cache)" not in rows  # not run at all: no row
    assert "8 x 4 KiB: first batch / first epoch (s)" in table
    assert "at 0123456789" in table


def test_the_plan_starts_each_fast_system_cold_several_times_and_the_slow_ones_once() -> None:
    from benchmarks.common.samples import Workload
    from benchmarks.peers.plan import COLD_STARTS, make_plan

    plan = make_plan("full")
    small = Workload("small", 4 << 10, 8192, 256)

    def cold_labels(system: str) -> list[str]:
        return [spec.label for spec in plan(small, system) if spec.label.startswith("cold")]

    assert COLD_STARTS >= 3
    assert cold_labels("cachefeed-tar") == ["cold", *(f"cold-{n}" for n in range(2, COLD_STARTS + 1))]
    assert cold_labels("litdata") == cold_labels("cachefeed-tar")
    assert cold_labels("s3fs") == cold_labels("cachefeed") == ["cold"]
    assert [s.label for s in make_plan("smoke")(small, "cachefeed-tar") if s.label.startswith("cold")] == ["cold"]


def test_read_throughput_functions_at_tiny_size(tmp_path: Path) -> None:
    from benchmarks import read_throughput as rt

    count = rt.build_cache(tmp_path, 4 << 10, 1 << 20)
    assert count == 256
    assert rt.raw_read(tmp_path, bytearray(1 << 20)) > 0
    assert rt.dataset_pass(tmp_path, 32, collate=True) > 0
    first, later = rt.loader_pass(tmp_path, 32, 1, 2)
    assert first > 0 and later > 0


def test_handover_functions_at_tiny_size(tmp_path: Path) -> None:
    from benchmarks import handover

    handover.build_cache(tmp_path, 64)
    args = argparse.Namespace(workers=1, step_ms=1.0, epochs=2, batch=16)
    context = multiprocessing.get_context("fork")
    for method in ("factory", "persistent"):
        waits, _note = handover.measure(method, tmp_path, context, args)
        assert len(waits) == 1 and waits[0] >= 0


def test_echo_runs_both_remotes_at_a_small_size_and_renders_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import echo

    assert echo.main(["--samples", "1200", "--rate", "400", "--capped-passes", "1", "--no-save"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| remote")]
    assert {row.split("|")[1].strip() for row in rows} == {"remote keeps up", "remote at a third"}
    document = {
        "command": "python -m benchmarks.echo",
        "provenance": {"machine": {}, "date_utc": "2026-11-25T18:00:00Z", "commit": "0" * 40},
        "figures": {"samples": 1200, "sample_kib": 16, "budget": 0.3, "rate": 400.0, "capped_passes": 1, "rows": []},
    }
    assert "training at 400 samples/s" in echo.readme_table(document)


def test_worker_collection_measures_the_frozen_collection_and_its_control(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import worker_collection

    assert worker_collection.main(["--objects", "100000", "--workers", "1", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "inherited objects frozen" in out and "the control, unfrozen" in out


def test_ingest_cli_smallest(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import ingest

    assert ingest.main(["--small", "8", "--large", "0", "--repeat", "1", "--md5-off", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "4KiB" in out and "ratio" in out
    assert "verify_md5 = false" in out


def test_feed_gpu_runs_every_system_on_a_cpu_with_a_tiny_model(tmp_path: Path) -> None:
    from benchmarks import feed_gpu

    argv = ["--device", "cpu", "--model", "tiny", "--samples", "128,256", "--batch", "16,8", "--workers", "2"]
    # 30 steps at each batch size: some seven epochs of the daemon rows together, so that receipts come back and the
    # daemon fetches while they run
    argv += ["--steps", "30", "--warmup", "2", "--repeats", "1", "--daemon", "--dir", str(tmp_path), "--no-save"]
    figures = feed_gpu.main(argv)
    rows = ["ceiling", "plain DataLoader", "cachefeed, 128 samples", "cachefeed, 256 samples", "cachefeed + daemon"]
    assert [(row["batch"], row["system"]) for row in figures["rows"]] == [(b, s) for b in (16, 8) for s in rows]
    assert all(row["images_per_s"] > 0 for row in figures["rows"])
    ceiling = {row["batch"]: row["runs"] for row in figures["rows"] if row["system"] == "ceiling"}
    for row in figures["rows"]:  # one repeat: the paired ratio is the run over the ceiling's run of that repeat
        assert row["of_ceiling_paired"] == round(row["runs"][0] / ceiling[row["batch"]][0], 3)
    provenance = {"machine": {}, "date_utc": "2026-11-26T00:00:00Z", "commit": "0" * 40}
    table = feed_gpu.readme_table(
        {"command": "python -m benchmarks.feed_gpu", "figures": figures, "provenance": provenance}
    )
    assert "| fed by | batch 16 | batch 8 |\n|---|---|---|\n" in table
    assert "the ceiling's run of the same repeat" in table
    assert figures["daemon"]["cached_samples"] > 0
    assert figures["daemon"]["ingested_samples"] > 0  # the daemon row's reads made it fetch, as in training
    # Nothing evicted unread is the witness suite's to show (tests/witness/), not status's own counter here.
    assert list(tmp_path.iterdir()) == []  # the caches, the remote and the daemon's files are gone


def test_feed_gpu_refuses_a_run_its_directory_cannot_hold_before_writing_anything(tmp_path: Path) -> None:
    from benchmarks import feed_gpu

    argv = ["--device", "cpu", "--model", "tiny", "--samples", "100000000", "--workers", "2", "--daemon"]
    with pytest.raises(SystemExit, match=r"--dir .*: this run writes about [0-9.]+ GB there but [0-9.]+ GB are free"):
        feed_gpu.main([*argv, "--dir", str(tmp_path), "--no-save"])
    assert list(tmp_path.iterdir()) == []
    disk, arenas = feed_gpu.footprint([8192, 16384], 8, daemon=True)  # the defaults, as the docstring says
    assert 10e9 < disk < 12e9 and arenas == 3 * 8 * (256 << 20)


def test_catalog_measures_a_tiny_dataset_and_renders_its_table(tmp_path: Path) -> None:
    from benchmarks import catalog

    one = catalog.measure_one(3000, 0, 1, tmp_path)
    assert one["owned"] == 3000 and one["list_requests"] == 4  # the root and three directories of 1,000
    assert one["plan_bytes_per_owned"] <= 64
    assert 0 < one["first_fetch_s"] <= one["listing_s"]
    row = {
        "size": 3000,
        "one_node": one,
        "node_of_100": one,
        "nodes": {
            "1": dict.fromkeys(
                (
                    "list_per_node_per_hour",
                    "list_job_per_hour",
                    "shared_list_per_node_per_hour",
                    "shared_list_job_per_hour",
                ),
                1.0,
            )
        },
    }
    assert "| 3,000 |" in catalog.readme_table({"figures": {"rows": [row]}})


def test_catalog_s3_bucket_run_reports_a_real_daemons_first_fetch_lists_and_restart(tmp_path: Path) -> None:
    from benchmarks import catalog

    s3 = catalog.measure_s3(1500, tmp_path)
    first, restart = s3["first_start"], s3["restart"]
    assert first["list_requests"] == 2  # 1,500 keys: two pages of at most 1,000, counted at the server
    assert 0 < first["first_list_s"] <= first["first_fetch_s"] and restart["first_fetch_s"] > 0
    assert 40 < first["supervisor_peak_rss_mb"] < 1000 and first["objects_fetched"] > 0
    text = catalog.readme_table({"figures": {"rows": [], "s3": s3}})
    assert "A bucket of 1,500 objects on the local S3 server" in text


def test_first_batch_cli_smallest(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import first_batch

    assert (
        first_batch.main(["--objects", "6", "--per-object", "10", "--sample-kib", "4", "--fill-s", "1", "--no-save"])
        == 0
    )
    out = capsys.readouterr().out
    assert "growing: first batch" in out and "75% fill: first batch" in out


def test_first_request_cli_smallest(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import first_request

    assert first_request.main(["--rounds", "1", "--object-kib", "64", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "shared" in out and "per client" in out and "first GET" in out


def test_record_cost_times_the_tar_decoder_beside_tarfile() -> None:
    from benchmarks import record_cost

    found = record_cost.decode_us(repeats=1, count=16)
    assert set(found) == {"decode_us", "decode_best_us", "tarfile_us", "tarfile_best_us"}
    assert all(value > 0 for value in found.values())


def test_outcome_cli_smallest(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import outcome

    assert outcome.main(["--samples", "800", "--steps", "12", "--rate", "4000", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "full data:" in out and "reads each" in out


def test_cold_launch_times_cachefeed_from_a_fresh_training_process_and_renders_its_table() -> None:
    from benchmarks import cold_launch

    systems = "cachefeed-tar,cachefeed-tar@job"  # the daemon launched by the loader, and at t0 beside the trainer
    argv = ["--systems", systems, "--workloads", "small", "--count", "1024", "--rounds", "1", "--no-save"]
    figures = cold_launch.main(argv)
    assert [row["system"] for row in figures["rows"]] == systems.split(",")
    for row in figures["rows"]:
        assert row["distinct"] == row["samples"] == 1024  # every sample of the epoch, each verified
        assert 0 < row["torch_imported"] <= row["imported"] < row["opened"] < row["first_batch"] < row["epoch_end"]
    provenance = {"machine": {}, "date_utc": "2026-11-26T00:00:00Z", "commit": "0" * 40}
    doc = {"command": "python -m benchmarks.cold_launch", "figures": figures, "provenance": provenance}
    table = cold_launch.readme_table(doc)
    assert "| 1,024 x 4 KiB | cachefeed (tar shards), the daemon launched with the job |" in table
