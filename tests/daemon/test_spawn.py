"""How samplers start and share the work: forked warm at the daemon's start, a fresh interpreter on a restart, and
large objects (tar shards) spread over the samplers instead of all going to the first one that asks.

Real daemons, real processes, the S3 proxy; every wait polls with a deadline.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from cachefeed._daemon.pool import SamplerHandle
from cachefeed._testing.daemon import BUCKET, StartDaemon, wait_for, wait_while_running
from cachefeed._testing.proxy import FaultProxy, Rule
from cachefeed._testing.samples import cache_samples, upload_arrays


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def test_samplers_start_forked_from_the_supervisor_and_a_restart_takes_a_fresh_interpreter(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 80, 4 << 10)
    fault_proxy.set_rules([Rule("latency", op="GetObject", delay_s=0.4)])  # the fill lasts a few seconds
    proc = daemon(endpoint=fault_proxy.endpoint, sections={"sampler": {"restart_backoff": "200ms"}})
    doc = proc.wait_status(lambda d: all(s["pid"] for s in d["samplers"]), timeout_s=30, what="samplers up")
    pids = [s["pid"] for s in doc["samplers"]]
    wait_while_running(
        proc, lambda: fault_proxy.counts().ops.get("GetObject", 0) >= 10, timeout_s=30, what="fill under way"
    )
    for pid in pids:
        # Forked: the supervisor's command line, not ``-m cachefeed._daemon.sampler``; its own process, which
        # left the supervisor's descriptors behind (stdin is /dev/null) and yields to training as a fresh one does.
        assert "cachefeed._daemon.sampler" not in _cmdline(pid)
        assert pid != proc.pid
        assert os.sched_getscheduler(pid) == os.SCHED_BATCH
        assert os.readlink(f"/proc/{pid}/fd/0") == os.devnull
    assert "forked" in proc.stderr()

    os.kill(pids[0], signal.SIGKILL)
    doc = proc.wait_status(
        lambda d: d["samplers"][0]["pid"] not in (None, pids[0]) and d["state"] == "running",
        timeout_s=30,
        what="sampler 0 back",
    )
    # The catalog thread runs by now: the restart must not fork a multi-threaded supervisor. (Seen once in a full
    # run on 2 loaded cores: an empty command line, the restarted sampler gone already; its stderr says why.)
    restarted = doc["samplers"][0]["pid"]
    assert "cachefeed._daemon.sampler" in _cmdline(restarted), f"sampler pid {restarted}:\n{proc.stderr()[-4000:]}"
    fault_proxy.clear()
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 80, timeout_s=60, what="every object cached")
    keys = [sample["__key__"] for _, sample in cache_samples(proc.cache_dir)]
    assert sorted(keys) == sorted(uploaded)  # every object exactly once
    assert proc.stop() == 0
    for pid in pids[1:]:
        wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists(), timeout_s=10, what=f"sampler {pid} gone")


def test_a_few_large_objects_are_spread_over_the_samplers(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    # 8 objects of 6 MiB and 2 MiB segments: a sampler holds at most 16 MiB of assigned objects (and one more
    # object), so the first sampler to ask gets three, not all eight (it has 20 credits).
    uploaded = upload_arrays(bucket, BUCKET, 8, 6 << 20)
    proc = daemon(
        endpoint=fault_proxy.endpoint,
        sections={"cache": {"segment_bytes": "2MiB", "max_bytes": "256MiB"}, "remote": {"max_bytes_per_s": "24MiB"}},
    )
    doc = proc.wait_status(  # samplers report their counts once a second
        lambda d: sum(s["objects_total"] for s in d["samplers"]) >= 8, timeout_s=60, what="every object cached"
    )
    per_sampler = [s["objects_total"] for s in doc["samplers"]]
    assert sum(per_sampler) == 8
    assert min(per_sampler) >= 2, f"objects per sampler: {per_sampler}"
    keys = [sample["__key__"] for _, sample in cache_samples(proc.cache_dir)]
    assert sorted(keys) == sorted(uploaded)
    assert proc.stop() == 0


def test_a_sampler_handle_counts_the_bytes_assigned_until_they_are_settled() -> None:
    handle = SamplerHandle(0)
    handle.assign([(1, 100), (2, 50), (3, -1)])  # -1: a manifest without sizes counts as 0
    assert set(handle.assigned) == {1, 2, 3} and handle.assigned_bytes == 150
    assert handle.settle([2, 9]) == [2]  # 9 was never this sampler's
    assert set(handle.assigned) == {1, 3} and handle.assigned_bytes == 100
    assert sorted(handle.settle(sorted(handle.assigned))) == [1, 3]
    assert not handle.assigned and handle.assigned_bytes == 0


def test_forked_samplers_build_their_s3_clients_on_the_supervisors_warmed_session(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    """NOTE [ Warmed session ]: botocore's models are loaded once, in the supervisor before it forks, not again in
    each sampler; the client each sampler builds is its own. Judged from the samplers' debug lines."""
    uploaded = upload_arrays(bucket, BUCKET, 8, 4 << 10)
    proc = daemon(endpoint=fault_proxy.endpoint, sections={"log": {"level": "debug"}})
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 8, timeout_s=60, what="every object cached")
    built = [line for line in proc.stderr().splitlines() if "remote client for" in line]
    assert len(built) == 2, built  # one per sampler (two by default)
    assert all("the supervisor's warmed session" in line for line in built), built
    keys = [sample["__key__"] for _, sample in cache_samples(proc.cache_dir)]
    assert sorted(keys) == sorted(uploaded)
    assert proc.stop() == 0
