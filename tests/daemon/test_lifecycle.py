"""The daemon's life: crashes of a sampler or of everything, SIGTERM, systemd notifications, bad starts.

Real processes and real signals throughout; every wait polls with a deadline.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from cachefeed._status.document import load_document
from cachefeed._testing.daemon import BUCKET, StartDaemon, wait_for, wait_while_running
from cachefeed._testing.proxy import FaultProxy, Rule
from cachefeed._testing.samples import cache_samples, upload_arrays

SLOW_GETS = [Rule("latency", op="GetObject", delay_s=0.15)]  # a fill that lasts a few seconds


def cached_keys(cache_dir: Path) -> list[str]:
    return [sample["__key__"] for _, sample in cache_samples(cache_dir)]


def test_a_killed_sampler_is_restarted_and_its_objects_requeued(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 120, 4 << 10)
    fault_proxy.set_rules([Rule("latency", op="GetObject", delay_s=0.5)])  # the fill takes about 4 s
    proc = daemon(endpoint=fault_proxy.endpoint, sections={"sampler": {"restart_backoff": "1s"}})
    wait_while_running(
        proc, lambda: fault_proxy.counts().ops.get("GetObject", 0) >= 20, timeout_s=30, what="fill under way"
    )
    doc = proc.status()
    assert doc is not None and doc["ingest"]["objects_total"] < 120
    victim = doc["samplers"][0]["pid"]
    assert os.sched_getscheduler(victim) == os.SCHED_BATCH, "a woken sampler never preempts a training thread"
    os.kill(victim, signal.SIGKILL)
    doc = proc.wait_status(
        lambda d: d["state"] == "degraded" and d["samplers"][0]["state"] == "restarting",
        timeout_s=10,
        what="degraded while sampler 0 restarts",
    )
    assert any("sampler 0" in reason for reason in doc["degraded_reasons"])
    doc = proc.wait_status(
        lambda d: d["samplers"][0]["pid"] not in (None, victim) and d["state"] == "running",
        timeout_s=10,
        what="sampler 0 back",
    )
    assert doc["samplers"][0]["restarts"] == 1
    fault_proxy.clear()
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 120, timeout_s=30, what="every object cached")
    keys = cached_keys(proc.cache_dir)
    assert sorted(keys) == sorted(uploaded)  # every object exactly once: re-queued, not duplicated
    assert "re-queueing" in proc.stderr()
    assert proc.stop() == 0


def test_crash_of_the_whole_daemon_then_restart_recovers(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 120, 16 << 10)
    fault_proxy.set_rules(SLOW_GETS)
    first = daemon(endpoint=fault_proxy.endpoint, sections={"cache": {"segment_bytes": "64KiB"}})
    first.wait_status(lambda d: d["cache"]["segments"] >= 3, timeout_s=30, what="some segments published")
    pids = first.sampler_pids()
    assert len(pids) == 2
    first.kill_group()  # SIGKILL to supervisor and samplers at once, mid-fill
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), timeout_s=10, what="samplers gone")
    fault_proxy.clear()

    leftovers = {name for name in os.listdir(first.cache_dir / "tmp") if name.endswith(".tmp")}  # partial segments
    published = {p.name for p in (first.cache_dir / "segments").iterdir()}
    second = daemon(endpoint=fault_proxy.endpoint, sections={"cache": {"segment_bytes": "64KiB"}})
    doc = second.wait_status(lambda d: d["state"] == "running", timeout_s=20, what="READY after recovery")
    assert doc["pid"] == second.pid
    assert not leftovers & set(os.listdir(second.cache_dir / "tmp"))  # a crash's partial segments are gone
    assert doc["cache"]["segments"] >= len(published) > 0  # what was published survived the crash
    second.wait_status(lambda d: d["ingest"]["objects_total"] > 0, timeout_s=30, what="ingesting again")
    assert second.stop() == 0
    assert not list((second.cache_dir / "tmp").iterdir())
    for key, sample in ((s["__key__"], s) for _, s in cache_samples(second.cache_dir)):  # verify_all
        np.testing.assert_array_equal(sample["data"], uploaded[key])


def test_sigterm_drains_and_exits_zero_quickly(bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon) -> None:
    upload_arrays(bucket, BUCKET, 120, 4 << 10)
    fault_proxy.set_rules(SLOW_GETS)
    proc = daemon(endpoint=fault_proxy.endpoint)
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 10, timeout_s=30, what="fill under way")
    started = time.monotonic()
    proc.signal(signal.SIGTERM)
    assert proc.process.wait(timeout=10) == 0
    assert time.monotonic() - started < 5.0
    assert not list((proc.cache_dir / "tmp").iterdir())
    final = load_document(proc.cache_dir / "status.json")
    assert final is not None and final["state"] == "stopped"
    assert all(s["state"] == "stopped" for s in final["samplers"])
    for _ in cache_samples(proc.cache_dir):  # every published segment verifies
        pass


def test_samplers_exit_when_the_supervisor_is_killed(bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon) -> None:
    upload_arrays(bucket, BUCKET, 60, 4 << 10)
    fault_proxy.set_rules(SLOW_GETS)
    first = daemon(endpoint=fault_proxy.endpoint)
    first.wait_status(lambda d: d["ingest"]["objects_total"] >= 5, timeout_s=30, what="fill under way")
    pids = first.sampler_pids()
    assert len(pids) == 2
    os.kill(first.pid, signal.SIGKILL)  # the supervisor alone: its samplers are orphans now
    first.process.wait(timeout=10)
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), timeout_s=10, what="orphans gone")
    second = daemon(endpoint=fault_proxy.endpoint)  # the lock the orphans held (inherited fd) is free again
    second.wait_status(lambda d: d["state"] == "running", timeout_s=20, what="a new daemon ready")
    assert second.stop() == 0
