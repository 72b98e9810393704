"""The daemon end to end against moto's S3 server: fill to the budget, keep sampling, pick up new objects, one GET.

Each test runs the real ``cachefeed daemon`` (supervisor + sampler subprocesses) and judges it from outside: the
status document, the bytes in the cache directory, and the requests the S3 server saw.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachefeed._cli.daemon import ONE_THREAD_POOLS
from cachefeed._status.document import load_document
from cachefeed._status.schema import undeclared_keys
from cachefeed._testing.daemon import BUCKET, StartDaemon, wait_while_running
from cachefeed._testing.proxy import FaultProxy
from cachefeed._testing.samples import cache_samples, upload_arrays
from tests.support.cache_helpers import tree_bytes


def test_free_running_fill_to_budget_then_keep_sampling_with_eviction(bucket: Any, daemon: StartDaemon) -> None:
    """``evict_after_reads = 0``: without readers the daemon keeps sampling, evicting the oldest (the opt-in
    free-running mode; the paced default is tested in tests/daemon/test_pacing.py)."""
    uploaded = upload_arrays(bucket, BUCKET, 300, 64 << 10)
    max_bytes = 8 << 20  # about a third of the 19 MiB dataset
    proc = daemon(sections={"cache": {"max_bytes": max_bytes, "evict_after_reads": 0}})
    sizes = []

    def progressed(doc: dict[str, Any]) -> bool:
        sizes.append(tree_bytes(proc.cache_dir))
        return doc["remote"]["passes_completed"] >= 2 and doc["evicted"]["segments_total"] > 0

    # Two passes: 38 MiB through the daemon, a few seconds on a quiet machine; the wait is not what is checked.
    doc = proc.wait_status(progressed, timeout_s=120, what="two passes with eviction")
    assert max(sizes) <= max_bytes  # the real size of the directory, sampled while filling and evicting
    assert doc["cache"]["bytes"] <= max_bytes
    assert doc["ingest"]["objects_total"] > 300  # more than one pass' worth was ingested
    assert doc["remote"]["errors_total"] == 0
    assert load_document(proc.cache_dir / "status.json") is not None  # the documented shape
    assert undeclared_keys(doc) == [], "every key the daemon writes is declared in _status/schema.py"

    assert proc.stop() == 0
    final = load_document(proc.cache_dir / "status.json")
    assert final is not None and final["state"] == "stopped"
    assert not list((proc.cache_dir / "tmp").iterdir())
    keys = []
    for _segment, sample in cache_samples(proc.cache_dir):  # verify_all on every segment
        key = sample["__key__"]
        np.testing.assert_array_equal(sample["data"], uploaded[key])
        keys.append(key)
    assert len(keys) == final["cache"]["samples"] > 0
    assert len(set(keys)) == len(keys)  # the cache never holds the same sample twice


def test_objects_added_mid_run_are_cached_after_the_next_refresh(bucket: Any, daemon: StartDaemon) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 40, 16 << 10)
    proc = daemon(sections={"remote": {"refresh_interval": "1s"}})
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 40, timeout_s=30, what="first 40 objects")
    uploaded |= upload_arrays(bucket, BUCKET, 20, 16 << 10, start=40)
    added = time.monotonic()

    def cached_keys() -> set[str]:
        return {sample["__key__"] for _, sample in cache_samples(proc.cache_dir)}

    # The next refresh comes after max(1 s, ten listing durations), and a loaded machine lists slowly: 30 s ran out.
    wait_while_running(
        proc, lambda: cached_keys() == set(uploaded), timeout_s=120, what="the 20 new objects in the cache"
    )
    print(f"\nthe 20 new objects were cached {time.monotonic() - added:.1f} s after their upload")
    for _, sample in cache_samples(proc.cache_dir):
        np.testing.assert_array_equal(sample["data"], uploaded[sample["__key__"]])
    # The status document is written once a second: it may still show the listing before the last one.
    proc.wait_status(lambda d: d["remote"]["objects_listed"] == 60, timeout_s=30, what="60 objects listed")


def test_one_get_per_object_and_no_head(bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 120, 8 << 10)
    fault_proxy.reset_counts()
    proc = daemon(endpoint=fault_proxy.endpoint)
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 120, timeout_s=30, what="all objects cached")
    proc.wait_status(lambda d: d["remote"]["passes_completed"] >= 1, timeout_s=30, what="the first pass over")
    assert proc.stop() == 0
    counts = fault_proxy.counts()
    keys = list(uploaded)
    assert {key: counts.request("GET", key) for key in keys} == dict.fromkeys(keys, 1)
    assert counts.ops.get("HeadObject", 0) == 0
    assert counts.ops.get("GetObject", 0) == 120
    assert sum(1 for _ in cache_samples(proc.cache_dir)) == 120


def test_sighup_lists_the_remote_at_once(bucket: Any, daemon: StartDaemon) -> None:
    upload_arrays(bucket, BUCKET, 5, 1024)
    proc = daemon(sections={"remote": {"refresh_interval": "1h"}})
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 5, timeout_s=30, what="first objects")
    upload_arrays(bucket, BUCKET, 5, 1024, start=5)
    proc.signal(signal.SIGHUP)
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 10, timeout_s=20, what="objects listed on SIGHUP")


def add_one_in_place(sample: dict[str, Any]) -> dict[str, Any]:
    """A preprocess that changes its array in place (the daemon must hand it a writable one)."""
    sample["data"] += 1
    sample["preprocessed"] = True
    return sample


def test_preprocess_runs_once_per_sample_in_the_daemon(bucket: Any, daemon: StartDaemon) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 20, 4 << 10)
    proc = daemon(sections={"sampler": {"preprocess": "tests.daemon.test_daemon:add_one_in_place"}})
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 20, timeout_s=30, what="20 objects")
    assert proc.stop() == 0
    found = {sample["__key__"]: sample for _, sample in cache_samples(proc.cache_dir)}
    assert set(found) == set(uploaded)
    for key, sample in found.items():
        assert sample["preprocessed"] is True
        np.testing.assert_array_equal(sample["data"], uploaded[key] + np.uint8(1))


def note_thread_pools(sample: dict[str, Any]) -> dict[str, Any]:
    """A preprocess that records, in the sample, what the sampler's environment says of the math thread pools."""
    for name in ONE_THREAD_POOLS:
        sample[name] = os.environ.get(name, "unset")
    return sample


def test_the_daemons_processes_run_one_math_thread_unless_the_environment_names_a_number(
    bucket: Any, daemon: StartDaemon
) -> None:
    """NOTE [ One math thread per daemon process ]: what a user's preprocess sees in a sampler (a forked one, as
    by default): 1 for every pool, except the one the daemon's environment sets."""
    upload_arrays(bucket, BUCKET, 4, 1024)
    env = {k: v for k, v in os.environ.items() if k not in ONE_THREAD_POOLS}
    proc = daemon(
        sections={"sampler": {"preprocess": "tests.daemon.test_daemon:note_thread_pools"}},
        env={**env, "OMP_NUM_THREADS": "3"},
    )
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 4, timeout_s=30, what="4 objects")
    assert proc.stop() == 0
    seen = {tuple(sample[name] for name in ONE_THREAD_POOLS) for _, sample in cache_samples(proc.cache_dir)}
    assert seen == {("1", "3", "1")}, dict(zip(ONE_THREAD_POOLS, seen.pop(), strict=True))


def test_numpy_imported_after_one_math_thread_starts_no_pool() -> None:
    """The mechanism the NOTE relies on: numpy's OpenBLAS reads the variable when numpy is imported, and nothing on
    the way from ``python -m cachefeed daemon`` to ``run`` imports numpy first. A fresh interpreter builds the
    daemon's command line (the CLI and the daemon module imported), calls it, imports numpy and counts its threads;
    without the call, the same count shows that this numpy starts a pool at all."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("OpenBLAS starts no pool on one CPU")
    env = {k: v for k, v in os.environ.items() if k not in ONE_THREAD_POOLS}
    count = "import numpy, os; print(len(os.listdir('/proc/self/task')))"
    call = (
        "from cachefeed._cli import build_parser; build_parser(['daemon']); "
        "from cachefeed._cli.daemon import one_math_thread; one_math_thread(); "
    )

    def threads(code: str) -> int:
        return int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True).stdout)

    if threads(count) == 1:
        pytest.skip("this numpy starts no thread pool here: the call has nothing to show")
    assert threads(call + count) == 1


def test_sigterm_to_the_whole_group_is_a_clean_stop_not_a_death(bucket: Any, daemon: StartDaemon) -> None:
    upload_arrays(bucket, BUCKET, 20, 8 << 10)
    proc = daemon()
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 20, timeout_s=30, what="the objects cached")
    os.killpg(proc.pid, signal.SIGTERM)  # what Ctrl-C or `kill -TERM -PGID` does: samplers get it too
    assert proc.process.wait(timeout=30) == 0
    stderr = proc.stderr()
    assert "died" not in stderr, stderr[-2000:]


@pytest.mark.parametrize("url_suffix", ["no/such/dir", ""])
def test_a_remote_that_lists_nothing_makes_the_daemon_degraded_naming_url_and_pattern(
    tmp_path: Path, url_suffix: str
) -> None:
    from cachefeed._status.report import read_report
    from cachefeed._status.verdict import Health
    from cachefeed._testing.daemon import start_daemon

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.gif").write_bytes(b"GIF89a")
    url = (data / url_suffix).as_uri() if url_suffix else data.as_uri()
    config = tmp_path / "d.toml"
    cache_dir = tmp_path / "cache"
    config.write_text(
        f'[remote]\nurl = "{url}"\npattern = "**/*.{{jpg,png}}"\n[cache]\ndir = "{cache_dir}"\n'
        'max_bytes = "64MiB"\nsegment_bytes = "1MiB"\nmin_free_bytes = 0\n[status]\ninterval = "200ms"\n'
    )
    proc = start_daemon(config, cache_dir, tmp_path / "d.stderr")
    try:
        doc = proc.wait_status(lambda d: d["degraded_reasons"], timeout_s=30, what="a degraded reason")
        [reason] = doc["degraded_reasons"]
        assert "lists 0 objects" in reason and "'**/*.{jpg,png}'" in reason and "file://" in reason
        # a directory that does not exist says so (a typo in the URL read the same as an empty directory)
        assert (f"({data / url_suffix} does not exist)" in reason) == bool(url_suffix), reason
        assert read_report(cache_dir).health is Health.DEGRADED
    finally:
        assert proc.stop() == 0
    [warning] = [line for line in proc.stderr().splitlines() if "listed 0 objects" in line]
    assert " WARNING " in warning and "'**/*.{jpg,png}'" in warning and "file://" in warning, warning
    assert ("does not exist" in warning) == bool(url_suffix), warning


def test_brace_lists_in_the_pattern_select_each_alternative(tmp_path: Path) -> None:
    from cachefeed._patterns import compile_pattern

    matcher = compile_pattern("**/*.{jpg,png}")
    assert [name for name in ("a.jpg", "x/b.png", "c.gif", "d.jpeg") if matcher.match(name)] == ["a.jpg", "x/b.png"]


def test_an_object_too_large_for_the_cache_is_counted_in_status_json_and_metrics(
    bucket: Any, daemon: StartDaemon
) -> None:
    from cachefeed._status.metrics import render_metrics
    from cachefeed._status.render import render_human
    from cachefeed._status.report import read_report

    upload_arrays(bucket, BUCKET, 5, 8 << 10)
    upload_arrays(bucket, BUCKET, 1, 3 << 20, start=5)  # larger than the cache's room for segments
    proc = daemon(sections={"cache": {"max_bytes": "4MiB", "segment_bytes": "256KiB"}})
    doc = proc.wait_status(
        lambda d: d["remote"]["not_cached"].get("too_large") == 1 and d["ingest"]["objects_total"] >= 5,
        timeout_s=30,
        what="the large object counted, the small ones cached",
    )
    human = render_human(read_report(proc.cache_dir))
    assert "1 listed objects not cached (too_large 1)" in human
    assert 'cachefeed_remote_objects_not_cached{reason="too_large"} 1.0' in render_metrics(doc).decode()
    assert proc.stop() == 0
