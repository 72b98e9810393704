"""Ingest paced by what training reads (``cache.evict_after_reads``), end to end: the real daemon against moto's S3
server behind a counting proxy, a real trainer through ``EpochLoaderFactory``.

* With no trainer the daemon fills its budget and then makes no GET at all.
* With a trainer slower than the remote, nothing is evicted unread and egress follows what epochs read.
* With a trainer faster than the remote, epochs re-read what is cached and ingest runs at its cap.
* A trainer that holds a pin and stops reading is reported as a fault; paced waiting is not.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import pytest

from cachefeed._cache.room import epoch_room
from cachefeed._cache.settings import default_turnover
from cachefeed._cache.snapshots import Snapshot
from cachefeed._status.report import read_report
from cachefeed._status.verdict import Health
from cachefeed._testing.daemon import BUCKET, StartDaemon
from cachefeed._testing.proxy import FaultProxy
from cachefeed._testing.samples import upload_arrays
from cachefeed._testing.witness import SegmentWitness, Served, check_promises, final_status, sample_keys
from cachefeed._trainer import EpochLoaderFactory
from tests.support.stalls import StallWindow

OBJECTS = 300
OBJECT_BYTES = 64 << 10  # one uint8 array per object: a 19 MiB dataset
MAX_BYTES = 8 << 20
IN_FLIGHT_OBJECTS = 2 * 8  # sampler processes x concurrency (the harness's config): fetched before a grant


def quiet_after_fill(fault_proxy: FaultProxy, daemon: StartDaemon, quiet_s: float) -> None:
    proc = daemon(endpoint=fault_proxy.endpoint, sections={"cache": {"max_bytes": MAX_BYTES}})
    doc = proc.wait_status(lambda d: d["cache"]["is_paced"], timeout_s=60, what="the cache full and paced")
    gets_at_fill = fault_proxy.counts().ops.get("GetObject", 0)
    assert OBJECTS > gets_at_fill > 0, "the budget holds part of the dataset"
    deadline = time.monotonic() + quiet_s
    while time.monotonic() < deadline:
        proc.check_running()
        doc = proc.status()
        assert doc is not None and doc["cache"]["is_paced"]
        time.sleep(0.5)
    gets = fault_proxy.counts().ops.get("GetObject", 0)
    assert gets - gets_at_fill <= IN_FLIGHT_OBJECTS, "at most the requests already in flight at the fill"
    time.sleep(1.0)
    assert fault_proxy.counts().ops.get("GetObject", 0) == gets, "then no GET at all"
    assert doc["evicted"]["segments_total"] == 0
    assert doc["cache"]["waiting_for_reads_samples"] == doc["cache"]["samples"] > 0
    assert read_report(proc.cache_dir).health is Health.RUNNING, "waiting for readers is normal, not a fault"
    assert proc.stop() == 0


def test_without_a_trainer_the_daemon_fills_its_budget_then_makes_no_request(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    upload_arrays(bucket, BUCKET, OBJECTS, OBJECT_BYTES)
    fault_proxy.reset_counts()
    quiet_after_fill(fault_proxy, daemon, quiet_s=8)


@pytest.mark.slow
def test_without_a_trainer_no_request_for_a_minute(bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon) -> None:
    upload_arrays(bucket, BUCKET, OBJECTS, OBJECT_BYTES)
    fault_proxy.reset_counts()
    quiet_after_fill(fault_proxy, daemon, quiet_s=60)


def test_a_slow_trainer_reads_everything_the_daemon_downloads(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    """Witnessed, not counted: the segment files' keys (``cachefeed/_testing/witness.py``), the keys the loop received
    and the objects the S3 server was asked for."""
    upload_arrays(bucket, BUCKET, OBJECTS, OBJECT_BYTES)
    fault_proxy.reset_counts()
    proc = daemon(endpoint=fault_proxy.endpoint, sections={"cache": {"max_bytes": MAX_BYTES}})
    served = Served()
    epochs = 4  # some 180 samples served (an epoch pins its room, ~45): fewer than the remote's 300, so no object
    # is fetched twice
    with SegmentWitness(proc.cache_dir) as witness:
        with EpochLoaderFactory(
            proc.cache_dir, batch_size=16, run_id="slow", epochs=epochs, min_samples=32, progress=None
        ) as factory:
            for epoch in range(epochs):
                keys: list[str] = []
                for batch in factory.loader(epoch):
                    assert batch["data"].shape[1:] == (OBJECT_BYTES,)
                    keys += sample_keys(batch)
                    time.sleep(0.3)  # a training step: slower than the remote here (a few dozen objects/s)
                served.epoch(keys)
        doc = final_status(proc, epochs)
    assert check_promises(witness, served, doc)["evicted"] > 0, "the read segments turned over"
    downloaded = fault_proxy.counts().ops.get("GetObject", 0) * OBJECT_BYTES  # what the S3 server was asked for
    read_bytes = sum(len(keys) for keys in served.epochs) * OBJECT_BYTES
    allowance = MAX_BYTES + IN_FLIGHT_OBJECTS * (OBJECT_BYTES + 4096)
    assert downloaded <= read_bytes + allowance, (downloaded, read_bytes)
    paced = [line for line in proc.stderr().splitlines() if "fetching waits for reads" in line]
    assert len(paced) <= 1, f"being paced is the normal state: said once at info, not per epoch: {paced}"


def test_a_trainer_faster_than_the_remote_rereads_and_never_waits_while_ingest_runs_at_its_cap(
    bucket: Any, daemon: StartDaemon, stalls: StallWindow
) -> None:
    """Data echoing, made explicit: the remote is capped at 1 MiB/s (16 samples/s) and the trainer reads 64-sample
    epochs far faster (a 10 ms step per batch of 16: 100 times the remote's rate). Epochs re-read what is cached
    (reads per sample > 1), every handover finds its epoch ready, and the daemon downloads at its cap the whole
    time (reading faster than ingest never paces it).

    The step is a sleep, not a loop that spins: in one-off runs here (2026-11-26), copies of a spinning loop side
    by side on this 2-core machine (as the suite's other tests can be beside one) starved each other's S3 servers,
    whose answers then took seconds (a LIST took 4 s), and the first epoch waited 5-8 s for a growth the remote
    could not deliver; with the sleep 6 of 6 such runs passed (4 of 18 spinning)."""
    upload_arrays(bucket, BUCKET, OBJECTS, OBJECT_BYTES)
    cap = 1 << 20
    proc = daemon(sections={"cache": {"max_bytes": MAX_BYTES}, "remote": {"max_bytes_per_s": cap}})
    started = proc.wait_status(lambda d: d["ingest"]["samples_total"] >= 16, timeout_s=60, what="a first batch")
    bytes_at_start, t0 = started["remote"]["bytes_total"], time.monotonic()
    stats = []
    with EpochLoaderFactory(
        proc.cache_dir, batch_size=16, samples_per_epoch=64, run_id="fast", progress=None, num_workers=1
    ) as factory:
        epoch = 0
        while time.monotonic() - t0 < 5.0:
            assert len(factory.loader(epoch)) == 4, "the epoch's size is set, however little is cached"
            for batch in stalls.batches(factory.loader(epoch)):
                assert batch["data"].shape == (16, OBJECT_BYTES)
                time.sleep(0.01)  # the training step
            if epoch:
                stats.append(factory.stats(epoch))
            epoch += 1
        during = proc.wait_status(  # while the trainer still holds its last epoch: a trainer reads
            lambda d: d["cache"]["ingest_bound"] is not None, timeout_s=30, what="a judgment of what bounds ingest"
        )
    doc = proc.wait_status(lambda d: d["cache"]["epochs_total"] >= epoch, timeout_s=30, what="every receipt")
    elapsed = time.monotonic() - t0
    rate = (doc["remote"]["bytes_total"] - bytes_at_start) / elapsed
    assert epoch >= 12, "the trainer ran many epochs in the time the remote delivered a few hundred samples"
    for st in stats:
        stalls.assert_handover(st.handover_wait_s, 0.5, epoch=st.epoch)
    assert doc["cache"]["max_reads"] > 1 or doc["evicted"]["max_reads"] > 1, "samples were read more than once"
    assert doc["cache"]["sample_reads_total"] > doc["ingest"]["samples_total"], "reads per sample above 1"
    assert rate >= 0.6 * cap, f"ingest ran at {rate / cap:.2f} of its cap while the trainer was ahead of it"
    assert not doc["cache"]["is_paced"], "a trainer ahead of ingest never paces it"
    assert during["cache"]["ingest_bound"] == "remote" and during["cache"]["is_remote_bound"] is True
    assert doc["cache"]["ingest_bound"] is None, "once the trainer has gone, no trainer bounds ingest"
    assert doc["cache"]["echo_factor"] is None or doc["cache"]["echo_factor"] > 1
    assert proc.stop() == 0


def test_a_trainer_that_stops_reading_is_a_fault_and_one_that_reads_is_not(bucket: Any, daemon: StartDaemon) -> None:
    """Paced waiting is normal; a pin held with no progress while fetching waits on it makes the daemon degraded,
    naming the snapshot and its owner, and progress (``Snapshot.touch``, which trainers call as batches flow)
    clears it."""
    upload_arrays(bucket, BUCKET, OBJECTS, OBJECT_BYTES)
    proc = daemon(sections={"cache": {"max_bytes": MAX_BYTES}, "status": {"stuck_after": "2s"}})
    proc.wait_status(lambda d: d["cache"]["is_paced"], timeout_s=60, what="the cache full and paced")
    with Snapshot.create(proc.cache_dir, "stuck-e000000") as snapshot:
        doc = proc.wait_status(lambda d: d["state"] == "degraded", timeout_s=20, what="the stuck reader reported")
        (reason,) = doc["degraded_reasons"]
        assert "stuck trainer" in reason and "stuck-e000000" in reason and f"pid {os.getpid()}" in reason
        assert read_report(proc.cache_dir).health is Health.DEGRADED
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:  # now it reads: progress every half second
            proc.check_running()
            snapshot.touch()
            time.sleep(0.5)
        doc = proc.wait_status(lambda d: d["state"] == "running", timeout_s=10, what="progress clears it")
        assert doc["cache"]["snapshots"][0]["idle_s"] < 2
    assert proc.stop() == 0


def test_the_first_epoch_waits_for_a_fill_level_when_asked(bucket: Any, daemon: StartDaemon) -> None:
    """``min_samples="75%"`` (the default before growing first epochs): the trainer starts when the daemon reports its
    cache 75% full (of what it keeps: the budget less metadata), here with a remote slow enough to watch it fill; the
    epoch pins its room."""
    upload_arrays(bucket, BUCKET, OBJECTS, OBJECT_BYTES)
    proc = daemon(sections={"cache": {"max_bytes": MAX_BYTES}, "remote": {"max_bytes_per_s": 2 << 20}})
    progress = io.StringIO()
    with EpochLoaderFactory(
        proc.cache_dir, batch_size=16, run_id="fill", progress=progress, epochs=1, min_samples="75%"
    ) as factory:
        loader = factory.loader(0)
        doc = proc.status()
        room = epoch_room(MAX_BYTES, default_turnover(MAX_BYTES, 256 << 10))
        assert factory.stats(0).samples * OBJECT_BYTES >= 0.85 * room, factory.stats(0)
        assert doc is not None and doc["cache"]["fill"] >= 0.75
        assert factory.stats(0).wait_for_samples_s > 1.0, "it did wait for the slow remote"
        assert "to fill" in progress.getvalue() and "of 75%" in progress.getvalue()
        assert sum(1 for _ in loader) == len(loader) > 1
    assert proc.stop() == 0


def test_a_fill_level_is_checked_when_the_factory_is_made(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    for bad in ("75", "0%", "150%", "most"):
        with pytest.raises(ValueError, match="min_samples"):
            EpochLoaderFactory(tmp_path / "c", batch_size=4, min_samples=bad, wait_timeout_s=0.1, progress=None)
