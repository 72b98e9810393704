"""Remote faults injected by the fault proxy between the daemon (or ``Remote``) and moto.

* ``test_mixed_faults_*``: random 503/500/resets/truncations/latency on every GET, plus per-key faults: bodies
  corrupted with the right length (objects uploaded with a checksum), an object replaced while its body streams,
  an object replaced between a truncated attempt and its retry, bodies that stall past the read timeout, 404 and
  403 for ever. Every cached sample must be its key's exact bytes (one whole version for the replaced keys);
  404/403 keys get one GET over several passes; the proxy sees no more GETs than the daemon reports (plus
  aiohttp's single re-send after a reset); stalls do not hold up the other fetches.
* ``test_outage_*``: 100% 503 for a while (and failing listings): cached data is neither evicted nor touched,
  the daemon degrades and bounds its load (retry budget), then recovers and caches the new objects.
* ``test_corruption_in_transit_*``: a flipped byte with the right length, with and without an upload checksum,
  at the ``Remote`` level (what the daemon would cache).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config as BotoConfig

from cachefeed._config import RemoteConfig
from cachefeed._errors import RemoteError
from cachefeed._remote import Remote
from cachefeed._testing.daemon import BUCKET, StartDaemon, wait_while_running
from cachefeed._testing.local_s3 import LocalS3
from cachefeed._testing.proxy import FaultProxy, RequestInfo, Rule
from tests.reliability.common import check_cache, report, sv_body, sv_key, upload_sv

OBJECT_BYTES = 8 << 10
MAX_ATTEMPTS = 8
# A healthy GET on a loaded machine (moto, the proxy and the daemon sharing two busy cores) can take more than a
# second: a 1 s read timeout cut those too, and their retries used up objects' attempts. The stall stays far longer
# than the read timeouts it takes to get past it (two stalled attempts per key).
READ_TIMEOUT_S = 5.0
STALL_S = 60.0


def mixed_rules(bucket: Any, special: dict[str, list[str]], scale: float) -> list[Rule]:
    """Per-key faults first (the first matching rule wins), then random faults on every GET."""

    def replace(info: RequestInfo) -> None:
        path = f"{info.bucket}/{info.key}"
        bucket.put_object(Bucket=info.bucket, Key=info.key, Body=sv_body(path, OBJECT_BYTES, "#v2"))

    rules = []
    for key in special["missing"]:
        rules.append(Rule("status", op="GetObject", key=key, status=404))
    for key in special["forbidden"]:
        rules.append(Rule("status", op="GetObject", key=key, status=403))
    for key in special["stalled"]:
        rules.append(Rule("stall", op="GetObject", key=key, delay_s=STALL_S, body_fraction=0.5, max_count=2))
    for key in special["corrupt"]:
        rules.append(Rule("corrupt", op="GetObject", key=key, body_fraction=0.9, max_count=2))
    for key in special["replaced_midway"]:
        rules.append(Rule("replace_midway", op="GetObject", key=key, max_count=1, callback=replace))
    for key in special["replaced_after_cut"]:
        rules.append(Rule("truncate", op="GetObject", key=key, max_count=1, callback=replace))
    rules += [
        Rule("slowdown", op="GetObject", probability=0.08 * scale),
        Rule("error500", op="GetObject", probability=0.05 * scale),
        Rule("reset", op="GetObject", probability=0.04 * scale),
        Rule("truncate", op="GetObject", probability=0.04 * scale),
        Rule("latency", op="GetObject", probability=0.10, delay_s=0.03),
    ]
    return rules


def mixed_faults(bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon, objects: int, scale: float) -> None:
    paths = upload_sv(bucket, BUCKET, objects, OBJECT_BYTES)
    keys = [path.split("/", 1)[1] for path in paths]
    special = {
        "missing": keys[0:2],
        "forbidden": keys[2:4],
        "stalled": keys[4:6],
        "corrupt": keys[6:12],
        "replaced_midway": keys[12:13],
        "replaced_after_cut": keys[13:14],
    }
    lost = {f"{BUCKET}/{k}" for k in special["missing"] + special["forbidden"]}
    replaced = {f"{BUCKET}/{k}" for k in special["replaced_midway"] + special["replaced_after_cut"]}
    stalled = {f"{BUCKET}/{k}" for k in special["stalled"]}
    healthy = [p for p in paths if p not in lost]
    fault_proxy.reset_counts()
    fault_proxy.set_rules(mixed_rules(bucket, special, scale))
    started = time.monotonic()
    proc = daemon(
        endpoint=fault_proxy.endpoint,
        sections={
            "remote": {
                "max_attempts": MAX_ATTEMPTS,
                "retry_budget": 1.0,
                "read_timeout": f"{READ_TIMEOUT_S}s",
                "refresh_interval": "1s",
            },
            "cache": {"max_bytes": "32MiB"},
        },
    )
    proc.wait_status(
        lambda d: d["ingest"]["objects_total"] >= len(healthy) - len(stalled), timeout_s=120, what="all but stalls"
    )
    others_done_s = time.monotonic() - started

    def all_cached() -> bool:
        found = check_cache(proc.cache_dir, ("", "#v2"))
        return set(healthy) <= set(found.keys)

    wait_while_running(proc, all_cached, timeout_s=120, interval_s=0.5, what="every healthy object cached")
    all_done_s = time.monotonic() - started

    def new_versions_cached() -> bool:
        found = check_cache(proc.cache_dir, ("", "#v2"))
        return all("#v2" in found.versions.get(path, []) for path in replaced)

    wait_while_running(
        proc, new_versions_cached, timeout_s=60, interval_s=0.5, what="the new version of each replaced object"
    )
    proc.wait_status(lambda d: d["plan"]["pass"] >= 3, timeout_s=60, what="two more passes")
    # Samplers send their counters once a second (later on a loaded machine): wait until the status counts every GET
    # the proxy saw but a reset's re-send (asserted below; a count that never catches up fails here).
    doc = proc.wait_status(
        lambda d: (
            d["remote"]["requests_total"] + fault_proxy.counts().fault("reset")
            >= fault_proxy.counts().ops.get("GetObject", 0)
        ),
        timeout_s=30,
        what="the samplers' counters to reach the proxy's GETs",
    )
    counts = fault_proxy.counts()
    assert proc.stop() == 0

    found = check_cache(proc.cache_dir, ("", "#v2"))
    wrong = [p for p in found.problems if not any(r in p for r in replaced)]
    spliced = [p for p in found.problems if any(r in p for r in replaced)]
    gets = {path: counts.request("GET", path.split("/", 1)[1]) for path in paths}
    injected = sum(counts.faults.values()) - counts.fault("latency")
    remote = doc["remote"]
    proxy_gets = counts.ops.get("GetObject", 0)
    violations = len(found.problems) + len(set(healthy) - set(found.keys)) + sum(1 for p in lost if p in found.keys)
    report(
        "remote-mixed-faults",
        objects=objects,
        faults_injected=injected,
        by_fault=dict(sorted(counts.faults.items())),
        samples_verified=found.samples - len(found.problems),
        violations=violations,
        wrong=len(wrong),
        spliced=len(spliced),
        proxy_gets=proxy_gets,
        daemon_requests=remote["requests_total"],
        daemon_retries=remote["retries_total"],
        daemon_errors=dict(sorted(remote["errors_by_kind"].items())),
        gets_per_404_key=max(gets[p] for p in lost if p.split("/", 1)[1] in special["missing"]),
        gets_per_403_key=max(gets[p] for p in lost if p.split("/", 1)[1] in special["forbidden"]),
        others_cached_during_stall_s=others_done_s,
        stall_s=STALL_S,
        all_cached_s=all_done_s,
        passes=doc["plan"]["pass"],
        replaced_versions_cached={p.split("/")[-1]: found.versions.get(p) for p in sorted(replaced)},
    )
    assert not found.problems, found.problems[:5]
    assert set(healthy) <= set(found.keys)
    assert not lost & set(found.keys)
    for path in lost:
        assert gets[path] == 1, (path, gets[path])  # 404/403: one GET over every pass, never retried
    assert remote["errors_by_kind"].get("not_found", 0) >= 2
    assert remote["errors_by_kind"].get("forbidden", 0) >= 2
    for path in healthy:
        limit = MAX_ATTEMPTS + 1 if path not in replaced else 2 * (MAX_ATTEMPTS + 1)
        assert 1 <= gets[path] <= limit, (path, gets[path])  # + aiohttp's one re-send after a reset
    assert remote["requests_total"] <= proxy_gets <= remote["requests_total"] + counts.fault("reset")
    assert counts.fault("corrupt") == 2 * len(special["corrupt"])
    assert counts.fault("stall") == 2 * len(special["stalled"])
    assert counts.fault("replace_midway") == 1
    assert others_done_s < STALL_S  # the stalled bodies did not hold the other fetches
    assert all_done_s < STALL_S  # nor themselves: the read timeout cut them
    assert counts.ops.get("HeadObject", 0) == 0
    assert not list((proc.cache_dir / "tmp").iterdir())


def test_mixed_faults_never_serve_a_wrong_or_spliced_sample(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    mixed_faults(bucket, fault_proxy, daemon, objects=100, scale=1.0)


@pytest.mark.slow
def test_mixed_faults_full_count(bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon) -> None:
    mixed_faults(bucket, fault_proxy, daemon, objects=1500, scale=2.0)


# ------------------------------------------------------------------------------------------------ the outage


def segment_identity(cache_dir: Path) -> dict[str, tuple[int, int, int]]:
    found = {}
    for path in (cache_dir / "segments").glob("*.seg"):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        found[path.name] = (info.st_ino, info.st_size, info.st_mtime_ns)
    return found


def test_outage_of_the_remote_keeps_the_cache_then_recovers(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    """Every GET answers 503 (and listings too, at first) until the daemon reports itself degraded; then healthy."""
    first = upload_sv(bucket, BUCKET, 40, OBJECT_BYTES)
    proc = daemon(
        endpoint=fault_proxy.endpoint,
        sections={"remote": {"max_attempts": 4, "retry_budget": 0.2}, "cache": {"max_bytes": "32MiB"}},
    )
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= len(first), timeout_s=60, what="the first set")
    wait_while_running(
        proc, lambda: set(first) <= set(check_cache(proc.cache_dir).keys), timeout_s=30, what="published"
    )
    before = segment_identity(proc.cache_dir)
    baseline = proc.status() or {}
    base_requests = baseline["remote"]["requests_total"]
    base_retries = baseline["remote"]["retries_total"]
    fault_proxy.reset_counts()
    began = time.monotonic()
    # The next listing fails every one of its attempts (max_attempts = 4), then listings are healthy: counted, not
    # timed (a window of seconds could close before a loaded machine's daemon got to list).
    fault_proxy.set_rules([Rule("slowdown", op="GetObject"), Rule("slowdown", op="ListObjectsV2", max_count=4)])
    second = upload_sv(bucket, BUCKET, 40, OBJECT_BYTES, start=1000)
    proc.signal(signal.SIGHUP)  # list now: the listing fails first, then the new objects meet the failing GETs
    reasons: set[str] = set()
    polls = changed = 0
    list_errors = 0
    degraded_at: float | None = None
    new_keys = {path.split("/", 1)[1] for path in second}
    tried = 0
    # Until the daemon says it is degraded and every new object met at least one failing GET (the listing must
    # recover first), and a second more.
    while degraded_at is None or tried < len(new_keys) or time.monotonic() < degraded_at + 1.0:
        if time.monotonic() - began > 60:
            raise TimeoutError(f"after 60s: degraded={degraded_at is not None}, objects tried={tried}")
        proc.check_running()
        doc = proc.status() or {}
        if doc.get("state") == "degraded":
            degraded_at = degraded_at or time.monotonic()
            reasons.update(reason.split(":")[0] for reason in doc["degraded_reasons"])
        list_errors = max(list_errors, doc.get("remote", {}).get("list_errors_total", 0))
        changed += segment_identity(proc.cache_dir) != before
        seen = fault_proxy.counts().requests
        tried = sum(1 for (method, key) in seen if method == "GET" and key in new_keys)
        polls += 1
        time.sleep(0.2)
    outage_s = time.monotonic() - began
    fault_proxy.clear()
    gets_in_outage = fault_proxy.counts().ops.get("GetObject", 0)
    healed = time.monotonic()
    doc = proc.wait_status(
        lambda d: d["ingest"]["objects_total"] >= len(first) + len(second) and d["state"] == "running",
        timeout_s=90,
        what="recovered and caught up",
    )
    recovery_s = time.monotonic() - healed
    time.sleep(1.5)  # samplers send their counters once a second
    doc = proc.status() or doc
    list_errors = max(list_errors, doc["remote"]["list_errors_total"])  # the loop's last look may predate it
    assert proc.stop() == 0
    found = check_cache(proc.cache_dir)
    after = segment_identity(proc.cache_dir)
    requests = doc["remote"]["requests_total"] - base_requests
    retries = doc["remote"]["retries_total"] - base_retries
    counts = fault_proxy.counts()
    report(
        "remote-outage",
        outage_s=outage_s,
        faults_injected=counts.fault("slowdown"),
        gets_during_outage=gets_in_outage,
        get_rate_during_outage=gets_in_outage / outage_s,
        list_errors=list_errors,
        degraded_after_s=(degraded_at or 0.0) - began,
        degraded_reasons=sorted(reasons),
        cached_segments_changed_polls=f"{changed}/{polls}",
        recovery_s=recovery_s,
        samples_verified=found.samples - len(found.problems),
        violations=len(found.problems) + changed + len(set(before) - set(after)),
        requests=requests,
        retries=retries,
    )
    assert changed == 0, "transient errors must not evict or rewrite cached segments"
    assert all(after.get(name) == identity for name, identity in before.items())
    assert list_errors >= 1
    assert gets_in_outage > 0
    # The retry budget: each sampler's retries <= 0.2 x first attempts + a burst of max(10, concurrency 8).
    assert retries <= 0.2 * (requests - retries) + 2 * 10
    # Passes that fetch nothing back off (0.5s, doubling): a handful of passes at most, each <= max_attempts.
    assert gets_in_outage <= 4 * len(second) * 6
    assert not found.problems, found.problems[:5]
    assert set(first) | set(second) <= set(found.keys)
    assert recovery_s < 45


# ------------------------------------------------------------------------------------------------ corruption


def corruption_in_transit(s3: LocalS3, fault_proxy: FaultProxy, *, with_checksum: bool) -> None:
    calculation = "when_supported" if with_checksum else "when_required"
    client = boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
        config=BotoConfig(request_checksum_calculation=calculation),
    )
    client.create_bucket(Bucket=BUCKET)
    objects = 20
    bodies = {}
    for i in range(objects):
        key = sv_key(i, OBJECT_BYTES)
        bodies[key] = sv_body(f"{BUCKET}/{key}", OBJECT_BYTES)
        client.put_object(Bucket=BUCKET, Key=key, Body=bodies[key])
    fault_proxy.set_rules([Rule("corrupt", op="GetObject", key=key, body_fraction=0.9, max_count=1) for key in bodies])
    remote = Remote(
        RemoteConfig(
            url=f"s3://{BUCKET}/",
            storage_options=fault_proxy.storage_options(),
            max_attempts=3,
            retry_budget=1.0,
            backoff_base_s=0.001,
            backoff_max_s=0.01,
        )
    )
    listed = remote.list_objects()
    etag_is_md5 = sum(
        (obj.etag or "").strip('"') == hashlib.md5(bodies[obj.path.split("/", 1)[1]]).hexdigest()  # what S3 uses
        for obj in listed
    )
    outcomes: dict[str, bytes | RemoteError] = {}

    async def fetch_all() -> None:
        try:
            for obj in listed:
                try:
                    outcomes[obj.path] = await remote.fetch(obj)
                except RemoteError as exc:
                    outcomes[obj.path] = exc
        finally:
            await remote.aclose()

    asyncio.run(fetch_all())
    counts = fault_proxy.counts()
    served_wrong = verified = detected = 0
    for path, outcome in outcomes.items():
        key = path.split("/", 1)[1]
        if isinstance(outcome, RemoteError):
            detected += 1
        elif outcome == bodies[key]:
            verified += 1
            detected += counts.request("GET", key) > 1  # caught, then retried
        else:
            served_wrong += 1
    report(
        f"remote-corruption-{'with' if with_checksum else 'without'}-checksum",
        faults_injected=counts.fault("corrupt"),
        detected=detected,
        samples_verified=verified,
        violations=served_wrong,
        etag_is_md5=f"{etag_is_md5}/{objects}",
    )
    assert counts.fault("corrupt") == objects
    assert served_wrong == 0, f"{served_wrong} of {objects} bodies corrupted in transit were returned as good"
    assert detected == objects


def test_corruption_in_transit_with_an_upload_checksum_is_detected(s3: LocalS3, fault_proxy: FaultProxy) -> None:
    corruption_in_transit(s3, fault_proxy, with_checksum=True)


def test_corruption_in_transit_without_an_upload_checksum_is_detected(s3: LocalS3, fault_proxy: FaultProxy) -> None:
    corruption_in_transit(s3, fault_proxy, with_checksum=False)


def test_a_remote_that_refuses_every_object_is_named_degraded_and_a_sighup_after_the_fix_caches_it(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    """Every GET answered 403 (a bucket policy, wrong credentials): each object was dropped once, the failures left
    the error window, and status said running while nothing could be cached; fixing the policy changed nothing, as
    a drop lasted until the object itself changed. Now status stays degraded, naming the refusals, and SIGHUP tries
    the refused objects again. The witness is the cache's content: every object's exact bytes."""
    paths = upload_sv(bucket, BUCKET, 10, OBJECT_BYTES)
    fault_proxy.set_rules([Rule("status", op="GetObject", status=403)])
    proc = daemon(endpoint=fault_proxy.endpoint, sections={"cache": {"max_bytes": "32MiB"}})
    proc.wait_status(
        lambda d: d["remote"]["not_cached"].get("forbidden", 0) == len(paths), timeout_s=60, what="every object refused"
    )
    time.sleep(11)  # the failed requests leave the 10 s error window
    doc = proc.status() or {}
    assert doc["state"] == "degraded", doc.get("degraded_reasons")
    assert any(
        reason.startswith(f"none of the {len(paths)} listed objects can be cached (forbidden: {len(paths)})")
        for reason in doc["degraded_reasons"]
    ), doc["degraded_reasons"]
    fault_proxy.clear()  # the policy is fixed
    proc.signal(signal.SIGHUP)
    wait_while_running(
        proc, lambda: set(paths) <= set(check_cache(proc.cache_dir).keys), timeout_s=60, what="every object cached"
    )
    proc.wait_status(lambda d: d["state"] == "running", timeout_s=20, what="running again")
