"""The daemon through a misbehaving network: every object ends cached or counted failed, never half-cached.

The fault proxy sits between the daemon and moto. Faults are per key and bounded, so the outcome of each object
is known in advance: keys with a few transient faults (503 SlowDown, 500, resets, truncated bodies, stalls past
the read timeout) are cached after retries within ``max_attempts``; one key answers 404 (dropped after one GET);
one key always answers 503 (given up after ``max_attempts``, counted, retried only in a later pass).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cachefeed._testing.daemon import BUCKET, StartDaemon
from cachefeed._testing.proxy import FaultProxy, Rule
from cachefeed._testing.samples import cache_samples, upload_arrays

MAX_ATTEMPTS = 6
N = 120
MISSING = 7  # 404 for ever
BROKEN = 13  # 503 for ever
# A healthy GET can take more than a second on a loaded machine (32 requests in flight to moto on two busy cores):
# a 1.5 s read timeout cut those too, and their retries used up objects' attempts (9 GETs of a key seen in a loaded
# run). The stall stays well past the read timeout it must trip.
READ_TIMEOUT = "5s"
STALL_S = 15.0


def key(i: int) -> str:
    return f"obj-{i:05d}.npy"


def fault_rules() -> list[Rule]:
    rules = [
        Rule("status", op="GetObject", key=key(MISSING), status=404),
        Rule("slowdown", op="GetObject", key=key(BROKEN)),
    ]
    for i in range(N):
        if i in (MISSING, BROKEN):
            continue
        kind = i % 7
        if kind == 0:
            rules.append(Rule("slowdown", op="GetObject", key=key(i), max_count=2))
        elif kind == 1:
            rules.append(Rule("error500", op="GetObject", key=key(i), max_count=1))
        elif kind == 2:
            rules.append(Rule("reset", op="GetObject", key=key(i), max_count=1))
        elif kind == 3:
            rules.append(Rule("truncate", op="GetObject", key=key(i), max_count=2))
        elif kind == 4:
            rules.append(Rule("latency", op="GetObject", key=key(i), max_count=1, delay_s=0.3))
        elif kind == 5 and i < 20:
            rules.append(Rule("stall", op="GetObject", key=key(i), max_count=1, delay_s=STALL_S, body_fraction=0.5))
    return rules


def test_faults_never_leave_partial_or_wrong_samples(bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon) -> None:
    uploaded = upload_arrays(bucket, BUCKET, N, 32 << 10)
    fault_proxy.reset_counts()
    fault_proxy.set_rules(fault_rules())
    proc = daemon(
        endpoint=fault_proxy.endpoint,
        sections={
            "remote": {"max_attempts": MAX_ATTEMPTS, "retry_budget": 1.0, "read_timeout": READ_TIMEOUT},
            "sampler": {"concurrency": 16},
        },
    )
    doc = proc.wait_status(
        lambda d: (
            d["ingest"]["objects_total"] >= N - 2
            and d["remote"]["errors_by_kind"].get("not_found", 0) >= 1
            and d["remote"]["objects_failed_total"] >= 2
        ),
        timeout_s=90,
        what="every healthy object cached and the two bad ones counted",
    )
    assert proc.stop() == 0

    counts = fault_proxy.counts()
    remote = doc["remote"]
    assert remote["retries_total"] > 0
    assert remote["errors_by_kind"]["transient"] > 0
    assert remote["objects_dropped"] == 1  # the 404
    assert counts.request("GET", key(MISSING)) == 1  # a 404 is never retried, nor drawn again
    assert counts.request("GET", key(BROKEN)) >= MAX_ATTEMPTS  # retried up to the limit, then given up
    for i in range(N):
        if i not in (MISSING, BROKEN):
            # injected faults + an aiohttp resend after a reset, all within max_attempts: no layer multiplies
            assert 1 <= counts.request("GET", key(i)) <= MAX_ATTEMPTS, key(i)
    assert counts.ops.get("HeadObject", 0) == 0
    for fault in ("slowdown", "error500", "reset", "truncate", "latency", "stall", "status"):
        assert counts.fault(fault) > 0, fault

    keys = []
    for _, sample in cache_samples(proc.cache_dir):  # verify_all on every segment
        np.testing.assert_array_equal(sample["data"], uploaded[sample["__key__"]])  # no wrong sample
        keys.append(sample["__key__"])
    expected = {k for i, k in enumerate(uploaded) if i not in (MISSING, BROKEN)}
    assert sorted(keys) == sorted(expected)  # each healthy object exactly once, the bad ones not at all
    assert not list((proc.cache_dir / "tmp").iterdir())


def test_an_undecodable_object_is_quarantined_and_not_fetched_again(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 10, 1024)
    bucket.put_object(Bucket=BUCKET, Key="obj-bad.npy", Body=b"this is not an npy file")
    fault_proxy.reset_counts()
    proc = daemon(endpoint=fault_proxy.endpoint)
    doc = proc.wait_status(
        lambda d: d["ingest"]["objects_total"] >= 10 and d["remote"]["quarantined_total"] == 1,
        timeout_s=30,
        what="10 objects cached, 1 quarantined",
    )
    assert doc["state"] == "running"  # a bad object is the data's problem, not the daemon's health
    proc.wait_status(lambda d: d["plan"]["pass"] >= 2, timeout_s=10, what="later passes")
    assert fault_proxy.counts().request("GET", "obj-bad.npy") == 1
    assert sorted(s["__key__"] for _, s in cache_samples(proc.cache_dir)) == sorted(uploaded)
    assert "quarantined (decode)" in proc.stderr()


def test_a_failing_remote_degrades_then_recovers(bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 30, 1024)
    fault_proxy.set_rules([Rule("slowdown", op="GetObject")])
    proc = daemon(endpoint=fault_proxy.endpoint, sections={"remote": {"max_attempts": 2}})
    doc = proc.wait_status(lambda d: d["state"] == "degraded", timeout_s=30, what="degraded while GETs fail")
    assert any("remote fails" in reason for reason in doc["degraded_reasons"])
    assert doc["ingest"]["objects_total"] == 0
    fault_proxy.clear()
    proc.wait_status(
        lambda d: d["ingest"]["objects_total"] >= 30 and d["state"] == "running",
        timeout_s=40,
        what="every object cached once the remote recovers",
    )
    assert sorted(s["__key__"] for _, s in cache_samples(proc.cache_dir)) == sorted(uploaded)


def test_a_decoder_that_fails_on_every_object_logs_a_few_lines_and_a_count(bucket: Any, daemon: StartDaemon) -> None:
    """A wrong decoder (or a bucket of another format) fails on each object: the log names the first few per
    sampler, then counts the rest, and the lines and the counts add up to the objects on the server."""
    upload_arrays(bucket, BUCKET, 4, 1024)
    bad = 24
    for i in range(bad):
        bucket.put_object(Bucket=BUCKET, Key=f"obj-bad-{i:03d}.npy", Body=b"this is not an npy file")
    proc = daemon(sections={"sampler": {"processes": 2}})
    proc.wait_status(lambda d: d["remote"]["quarantined_total"] == bad, timeout_s=60, what=f"{bad} quarantined")
    assert proc.stop() == 0
    lines = [line for line in proc.stderr().splitlines() if " WARNING " in line]
    named = [line for line in lines if "object quarantined (decode)" in line and "warnings in" not in line]
    counted = [int(line.split("]: ", 1)[1].split()[0]) for line in lines if "'decode' warnings in" in line]
    assert len(named) <= 2 * 5, named  # five per sampler at most
    assert len(named) + sum(counted) == bad, lines
