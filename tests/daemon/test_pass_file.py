"""A restarted daemon goes on with the pass it was in (``cachefeed/_daemon/pass_file.py``).

Before the pass file, a daemon restarted mid-pass began pass 0 again, in the same seeded order: it fetched first the
objects its pass had fetched and training had read and evicted since, ahead of those it had never fetched, and
"passes done" went back to 0. The end-to-end witness is the S3 server's log of GETs, in order, and the keys the
training loop received: after a SIGKILL and a restart, no object the loop had received is fetched again before every
object of the remote has been fetched once.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachefeed._daemon.columns import key_hash
from cachefeed._daemon.pass_file import PassFileError, PassFileWriter, read_pass_file
from cachefeed._daemon.plan import SamplingPlan
from cachefeed._remote import RemoteObject
from cachefeed._testing.daemon import BUCKET, DaemonProcess, StartDaemon
from cachefeed._testing.proxy import FaultProxy, Rule
from cachefeed._testing.samples import cache_samples, upload_arrays
from cachefeed._trainer import EpochLoaderFactory

IDENTITY = {"seed": 7, "settings": {"url": "s3://b/", "node.rank": 0, "node.count": 1}}


# -- the file -----------------------------------------------------------------------------------------------------


def test_a_pass_file_reads_back_the_pass_its_count_and_what_was_resolved_in_it(tmp_path: Path) -> None:
    path = tmp_path / "pass-00000000.cfpass"
    writer = PassFileWriter(path, IDENTITY, mode=0o600, max_bytes=1 << 20)
    writer.save(3, 2, [], [5, 1])
    state = read_pass_file(path, IDENTITY)
    assert state is not None and not state.drew
    writer.save(3, 2, [2**64 - 1], [])
    state = read_pass_file(path, IDENTITY)
    assert state is not None and state.drew
    assert (state.pass_index, state.passes_completed, state.resolved.tolist()) == (3, 2, [1, 5, 2**64 - 1])
    writer.save(4, 3, [], [9])  # a new pass starts the file again
    writer.close()
    state = read_pass_file(path, IDENTITY)
    assert state is not None and (state.pass_index, state.passes_completed, state.resolved.tolist()) == (4, 3, [9])
    assert not state.drew
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    carried = PassFileWriter(path, IDENTITY, mode=0o600, max_bytes=1 << 20)
    carried.carry(state)  # a restarted daemon's file starts with what the last one kept
    carried.save(4, 3, [3], [])
    carried.close()
    state = read_pass_file(path, IDENTITY)
    assert state is not None and (state.pass_index, state.resolved.tolist(), state.drew) == (4, [3, 9], True)


def test_a_restarted_daemon_killed_as_it_carries_the_pass_on_leaves_the_whole_pass_in_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The carry replaced the file with its header, then appended the records: a kill between the two writes left a
    file of the pass with nothing resolved in it, and the next start fetched again all the pass had fetched."""
    path = tmp_path / "pass-00000000.cfpass"
    writer = PassFileWriter(path, IDENTITY, mode=0o600, max_bytes=1 << 20)
    writer.save(2, 1, [7, 8], [9])
    writer.close()
    state = read_pass_file(path, IDENTITY)
    assert state is not None

    def killed(self: PassFileWriter, records: Any) -> None:
        raise SystemExit("killed after the first write")

    monkeypatch.setattr(PassFileWriter, "_append", killed)
    carried = PassFileWriter(path, IDENTITY, mode=0o600, max_bytes=1 << 20)
    try:
        carried.carry(state)
    except SystemExit:
        pass
    finally:
        carried.close()
    found = read_pass_file(path, IDENTITY)
    assert found is not None and found.resolved.tolist() == [7, 8, 9] and found.drew


def test_a_pass_file_of_other_settings_is_not_used_and_a_damaged_one_says_so(tmp_path: Path) -> None:
    path = tmp_path / "pass-00000000.cfpass"
    writer = PassFileWriter(path, IDENTITY, mode=0o600, max_bytes=1 << 20)
    writer.save(1, 1, [1, 2, 3], [])
    writer.close()
    assert read_pass_file(path, {**IDENTITY, "seed": 8}) is None
    assert read_pass_file(path, {**IDENTITY, "settings": {"url": "s3://other/"}}) is None
    assert read_pass_file(tmp_path / "absent.cfpass", IDENTITY) is None
    with path.open("ab") as out:
        out.write(b"\x01\x02\x03")  # a record torn by a crash: ignored
    state = read_pass_file(path, IDENTITY)
    assert state is not None and state.resolved.tolist() == [1, 2, 3]
    path.write_bytes(path.read_bytes()[:12])
    with pytest.raises(PassFileError, match="damaged"):
        read_pass_file(path, IDENTITY)
    path.write_bytes(b"")
    with pytest.raises(PassFileError, match="empty"):
        read_pass_file(path, IDENTITY)
    path.write_bytes(b"something else")
    with pytest.raises(PassFileError, match="not a cachefeed pass file"):
        read_pass_file(path, IDENTITY)


def test_a_pass_file_stops_growing_at_its_share_of_the_budget(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "pass-00000000.cfpass"
    writer = PassFileWriter(path, IDENTITY, mode=0o600, max_bytes=9 * 4)
    writer.save(0, 0, [1, 2, 3], [])
    writer.save(0, 0, [4], [5, 6])
    writer.close()
    state = read_pass_file(path, IDENTITY)
    assert state is not None and state.resolved.tolist() == [1, 2, 3, 4]
    assert "fetched again in it if the daemon restarts" in caplog.text


def test_a_full_pass_file_still_records_the_objects_queued_again(tmp_path: Path) -> None:
    """At its share of the budget, the records of objects queued again were left out first: an earlier record said
    resolved, and a restart skipped them for the rest of the pass. They are kept before the others now, and where
    even they do not fit the file is removed (a restart begins the pass again)."""
    path = tmp_path / "pass-00000000.cfpass"
    writer = PassFileWriter(path, IDENTITY, mode=0o600, max_bytes=9 * 4)
    writer.save(0, 0, [1, 2, 3], [])
    writer.save(0, 0, [4, 5], [], [1])  # 1 queued again: room for one record
    state = read_pass_file(path, IDENTITY)
    assert state is not None and state.resolved.tolist() == [2, 3], "1 drawn again after a restart, 4 and 5 too"
    writer.save(0, 0, [], [], [2, 3])  # no room for both
    writer.close()
    assert not path.exists(), "a file that cannot say which objects were queued again is not kept"


# -- the plan -----------------------------------------------------------------------------------------------------


def listing(n: int) -> list[RemoteObject]:
    return [RemoteObject(f"data/k{i:04d}", 10, f'"{i}"') for i in range(n)]


def drain(plan: SamplingPlan) -> list[str]:
    """Draw and complete every object the plan hands out in its current pass."""
    paths, current = [], plan.pass_index
    while drawn := plan.next(1):
        if plan.pass_index != current:
            plan.requeue([oid for oid, _ in drawn])
            break
        plan.done([oid for oid, _ in drawn], None)
        paths += [obj.path for _, obj in drawn]
    return paths


def test_a_resumed_pass_draws_what_it_had_not_resolved_and_the_next_pass_draws_everything() -> None:
    first = SamplingPlan(seed=3)
    first.update_catalog(listing(40))
    visited = []
    for oid, obj in first.next(15):
        first.done([oid], None)
        visited.append(obj.path)
    resolved, skipped, _again = first.take_resolved()
    assert sorted(resolved.tolist()) == sorted(key_hash(path) for path in visited) and not len(skipped)
    assert [len(keys) for keys in first.take_resolved()] == [0, 0, 0]
    again = SamplingPlan(seed=3)
    keys = np.unique(resolved)
    again.resume_pass(first.pass_index, first.counters.passes_completed, keys, drew=True)
    again.update_catalog(listing(40))
    rest = drain(again)
    assert sorted(rest) == sorted({o.path for o in listing(40)} - set(visited))
    assert again.pass_index == 1 and again.counters.passes_completed == 1  # the pass ended with its last object...
    assert sorted(drain(again)) == sorted(o.path for o in listing(40))  # ...and the next one visits everything


def test_resolved_objects_are_handed_out_in_order_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cachefeed._daemon.plan._KEY_CHUNK", 4)  # (a million skips in one draw: chunks of 65,536)
    plan = SamplingPlan()
    plan.update_catalog(listing(10))
    drawn = plan.next(10)
    for oid, _ in drawn:
        plan.done([oid], None)
    resolved, skipped, _again = plan.take_resolved()
    assert resolved.dtype == np.uint64 and not len(skipped)
    assert resolved.tolist() == [key_hash(obj.path) for _, obj in drawn]


def test_a_resumed_pass_keeps_its_count_and_resolves_nothing_twice_in_the_file() -> None:
    plan = SamplingPlan()
    plan.resume_pass(5, 4, np.zeros(0, np.uint64), drew=False)
    plan.update_catalog(listing(3))
    plan.done([oid for oid, _ in plan.next(3)], None)
    assert plan.pass_index == 5 and plan.counters.passes_completed == 4
    assert len(plan.take_resolved()[0]) == 3
    assert plan.next(1) and (plan.pass_index, plan.counters.passes_completed) == (6, 5)
    with pytest.raises(RuntimeError, match="before the first listing page"):
        plan.resume_pass(1, 1, np.zeros(0, np.uint64), drew=False)


def test_objects_queued_again_in_a_pass_are_drawn_again_in_it_after_a_restart(tmp_path: Path) -> None:
    """An object overwritten after the pass fetched it, and the others of the segment that held it (retired), are
    queued again in the pass; a restart before they were fetched again used to skip them for the rest of the pass
    (the file said resolved), leaving them out of the cache for a whole pass."""
    listed = listing(6)
    plan = SamplingPlan()
    plan.update_catalog(listed)
    drawn = plan.next(3)
    plan.done([oid for oid, _ in drawn], 0)  # one segment holds the three
    path = tmp_path / "pass-00000000.cfpass"
    writer = PassFileWriter(path, IDENTITY, mode=0o600, max_bytes=1 << 20)
    writer.save(plan.pass_index, plan.counters.passes_completed, *plan.take_resolved())
    changed = RemoteObject(drawn[0][1].path, 1, "v2")
    plan.update_page(plan.fold([changed]))  # overwritten
    plan.evicted(plan.take_stale())  # the supervisor retired the segment
    writer.save(plan.pass_index, plan.counters.passes_completed, *plan.take_resolved())
    writer.close()
    state = read_pass_file(path, IDENTITY)
    assert state is not None
    resumed = SamplingPlan()
    resumed.resume_pass(state.pass_index, state.passes_completed, state.resolved, drew=state.drew)
    resumed.update_catalog([changed if obj.path == changed.path else obj for obj in listed])
    assert sorted(drain(resumed)) == sorted(obj.path for obj in listed), "those queued again are drawn again"


# -- a real daemon, killed and restarted --------------------------------------------------------------------------

OBJECTS = 160
OBJECT_BYTES = 32 << 10
SECTIONS = {
    "cache": {"max_bytes": "3MiB", "segment_bytes": "32KiB", "evict_after_reads": 1},
    "remote": {"refresh_interval": "1h"},
    "sampler": {"processes": 1, "concurrency": 4},
}


def read_some(daemon: DaemonProcess, samples: int, run: str) -> list[str]:
    """The keys of the first ``samples`` samples of an epoch over what is cached (the reads handed to the daemon
    when the factory closes: read once, their segments may go)."""
    keys: list[str] = []
    with EpochLoaderFactory(daemon.cache_dir, batch_size=8, progress=None, run_id=run, wait_timeout_s=60) as factory:
        for batch in factory.loader(0):
            keys += batch["__key__"]
            if len(keys) >= samples:
                break
    return keys


def paced(daemon: DaemonProcess) -> dict[str, Any]:
    """The daemon once its cache is full of samples waiting for their reads (what training freed is refilled)."""
    return daemon.wait_status(lambda d: d["cache"]["is_paced"], timeout_s=60, what="a full, paced cache")


def test_a_daemon_killed_mid_pass_goes_on_with_it_and_fetches_nothing_training_read_before_the_rest(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    upload_arrays(bucket, BUCKET, OBJECTS, OBJECT_BYTES)
    gets: list[str] = []  # every GetObject's key, in the order the S3 server was asked
    fault_proxy.set_rules([Rule("latency", op="GetObject", callback=lambda info: gets.append(info.key))])
    first = daemon(endpoint=fault_proxy.endpoint, sections=SECTIONS)
    paced(first)
    received = set(read_some(first, 40, "before") + read_some(first, 40, "before-2"))
    paced(first)
    time.sleep(1.5)  # the pass file is flushed every half second
    os.kill(first.process.pid, signal.SIGKILL)
    first.process.wait(timeout=10)
    at_restart = len(gets)
    fetched_before = set(gets[:at_restart])
    assert received <= fetched_before and len(fetched_before) < OBJECTS, "the kill comes in the first pass"
    second = daemon(endpoint=fault_proxy.endpoint, sections=SECTIONS)
    rounds = 0
    while len(set(gets)) < OBJECTS:
        rounds += 1
        assert rounds < 40, f"{len(set(gets))} of {OBJECTS} objects fetched after {rounds} rounds"
        read_some(second, 40, f"after-{rounds}")
        paced(second)
    after = gets[at_restart:]
    covered = len(after)
    while len(fetched_before | set(after[: covered - 1])) == OBJECTS:
        covered -= 1  # the GETs up to the one that completed the remote
    again = [key for key in after[:covered] if key in received]
    assert not again, f"fetched again before the rest of the pass: {again[:5]} ({len(again)} objects)"
    assert "going on with pass 0" in second.stderr()
    assert second.stop() == 0


def test_a_daemon_restarted_on_a_full_cache_keeps_its_pass_count_while_the_remote_cannot_be_listed(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    """Over its restart catalog alone, a pass that draws nothing is not counted (``plan.py``, "Counted passes"): it
    said "0 passes done" until a listing of the remote succeeded. The pass file keeps the count."""
    upload_arrays(bucket, BUCKET, 20, 4 << 10)
    sections = {"remote": {"refresh_interval": "1h"}}
    first = daemon(endpoint=fault_proxy.endpoint, sections=sections)
    first.wait_status(lambda d: d["remote"]["passes_completed"] >= 1, timeout_s=30, what="a first pass")
    assert first.stop() == 0
    fault_proxy.set_rules([Rule("status", op="ListObjectsV2", status=503)])
    fault_proxy.reset_counts()
    second = daemon(endpoint=fault_proxy.endpoint, sections=sections)
    start = second.wait_status(lambda d: d["state"] == "running", timeout_s=30, what="the restarted daemon")["plan"]
    doc = second.wait_status(lambda d: d["plan"]["pass"] >= start["pass"] + 2, timeout_s=30, what="two passes more")
    assert doc["remote"]["passes_completed"] == 1
    counts = fault_proxy.counts()
    assert counts.ops.get("ListObjectsV2", 0) >= 1 and counts.ops.get("GetObject", 0) == 0
    assert second.stop() == 0


def test_objects_a_lowered_budget_evicts_unread_at_the_restart_are_fetched_again_in_the_pass_it_goes_on_with(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    """The start brings a cache over a lowered ``cache.max_bytes`` under it, evicting unread samples; the pass file
    counted their objects as done in the pass, so they waited for the next one (a whole pass unserved)."""
    upload_arrays(bucket, BUCKET, 240, OBJECT_BYTES)  # 7.5 MiB: more than the cache holds
    gets: list[str] = []
    fault_proxy.set_rules([Rule("latency", op="GetObject", callback=lambda info: gets.append(info.key))])
    full = {**SECTIONS, "cache": {**SECTIONS["cache"], "max_bytes": "6MiB"}}
    first = daemon(endpoint=fault_proxy.endpoint, sections=full)
    paced(first)
    assert first.stop() == 0
    cached_before = {sample["__key__"] for _, sample in cache_samples(first.cache_dir)}
    at_restart = len(gets)
    lowered = {**SECTIONS, "cache": {**SECTIONS["cache"], "max_bytes": "4MiB"}}
    second = daemon(endpoint=fault_proxy.endpoint, sections=lowered)
    second.wait_status(lambda d: d["state"] == "running", timeout_s=30, what="the restarted daemon")
    evicted = cached_before - {sample["__key__"] for _, sample in cache_samples(second.cache_dir)}
    assert evicted, "the lowered budget evicted unread samples at the start"
    rounds = 0
    while not second.status()["remote"]["passes_completed"]:  # type: ignore[index]
        rounds += 1
        assert rounds < 40
        read_some(second, 40, f"round-{rounds}")
        paced(second)
    after = gets[at_restart:]
    seen = set(gets[:at_restart])  # the first daemon's GETs: those it cached, and those a stop cut short
    for index, key in enumerate(after):
        if key in seen and (key in cached_before - evicted or key in after[:index]):
            after = after[:index]  # the next pass begins: an object fetched in this one comes again
            break
    assert evicted <= set(after), f"not fetched again in the pass: {sorted(evicted - set(after))[:5]}"
    assert second.stop() == 0
