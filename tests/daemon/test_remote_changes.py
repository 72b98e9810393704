"""Epochs follow the remote's changes: an overwritten object's old samples and a deleted object's samples leave the
cache at the next listing (``plan.py``, "Retired samples").

Before, both stayed cached while the budget had room: every epoch served an overwritten object's old and new content
under one key (two or three times per epoch), and a deleted object's samples indefinitely. The witnesses: the segment
files' contents and what a training loop received; object ``i`` holds ``[i, version]``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from cachefeed._cache.records import Source
from cachefeed._daemon.plan import SamplingPlan
from cachefeed._remote import RemoteObject
from cachefeed._testing.daemon import DaemonProcess, start_daemon, wait_for
from cachefeed._testing.samples import cache_samples, npy_bytes
from cachefeed._trainer import EpochLoaderFactory
from tests.support.file_remote import file_daemon_config

OBJECTS = 40
CHANGED = range(0, 10)  # overwritten with version 1
DELETED = range(30, 40)


def write(remote: Path, i: int, version: int) -> None:
    path = remote / f"{i:03d}.npy"
    path.write_bytes(npy_bytes(np.array([i, version], np.int64)))
    os.utime(path, (1_700_000_000 + version, 1_700_000_000 + version))  # a new version: another mtime


def cached(daemon: DaemonProcess) -> list[tuple[int, int]]:
    """``(object, version)`` of every sample in the published segments."""
    return sorted((int(s["data"][0]), int(s["data"][1])) for _, s in cache_samples(daemon.cache_dir))


def epoch(daemon: DaemonProcess, run: str) -> list[tuple[int, int]]:
    received: list[tuple[int, int]] = []
    with EpochLoaderFactory(daemon.cache_dir, batch_size=8, progress=None, run_id=run, min_samples=1) as factory:
        for batch in factory.loader(0):
            received += [(int(row[0]), int(row[1])) for row in np.asarray(batch["data"])]
    return received


def listed_again(daemon: DaemonProcess) -> None:
    """SIGHUP lists at once (at most once a second: sent again until a listing ends after the first one sent)."""
    before = daemon.status()
    assert before is not None

    def listed() -> bool:
        os.kill(daemon.process.pid, signal.SIGHUP)
        doc = daemon.status()
        return doc is not None and (doc["remote"]["last_listed_at"] or 0) > (before["remote"]["last_listed_at"] or 0)

    wait_for(listed, timeout_s=30, interval_s=0.5, what="a listing after SIGHUP")


def cached_remote(tmp_path: Path, objects: int = 20) -> tuple[Path, Path, DaemonProcess]:
    """A remote of ``objects`` objects at version 0, its config, and a daemon that has cached it whole."""
    remote = tmp_path / "remote"
    remote.mkdir()
    for i in range(objects):
        write(remote, i, 0)
    config = file_daemon_config(tmp_path / "daemon.toml", remote, tmp_path / "cache")
    daemon = start_daemon(config, tmp_path / "cache", tmp_path / "daemon.err")
    daemon.wait_status(lambda d: d["cache"]["samples"] == objects, timeout_s=60, what="the remote cached")
    return remote, config, daemon


def test_overwritten_and_deleted_objects_leave_the_cache_and_epochs_serve_the_current_content_once(
    tmp_path: Path,
) -> None:
    remote, _config, daemon = cached_remote(tmp_path, OBJECTS)
    try:
        assert sorted(epoch(daemon, "before")) == [(i, 0) for i in range(OBJECTS)]
        for i in CHANGED:
            write(remote, i, 1)
        for i in DELETED:
            (remote / f"{i:03d}.npy").unlink()
        listed_again(daemon)
        now = sorted([(i, 1) for i in CHANGED] + [(i, 0) for i in range(10, 30)])
        wait_for(lambda: cached(daemon) == now, timeout_s=30, what=f"the cache to hold {len(now)} current samples")
        for run in ("after", "after-2"):
            received = epoch(daemon, run)
            assert sorted(received) == now, f"epoch {run}: {sorted(received)[:12]}"
            assert max(Counter(key for key, _ in received).values()) == 1
        doc = daemon.status()
        assert doc is not None and doc["evicted"]["retired_samples_total"] >= len(CHANGED) + len(DELETED)
        shown = subprocess.run(
            [sys.executable, "-m", "cachefeed", "status", "--cache-dir", str(daemon.cache_dir)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "retired: the remote overwrote or deleted their objects" in " ".join(shown.stdout.split())
        assert "retired" in daemon.stderr()
    finally:
        assert daemon.stop() == 0


def test_a_listing_that_shows_nothing_keeps_the_cache_for_when_the_remote_lists_again(tmp_path: Path) -> None:
    remote, _config, daemon = cached_remote(tmp_path)
    try:
        whole = cached(daemon)
        aside = tmp_path / "aside"
        remote.rename(aside)  # a mount missing: the directory is there, and empty
        remote.mkdir()
        listed_again(daemon)
        wait_for(lambda: "20 objects vanished" in daemon.stderr(), timeout_s=10, what="the empty listing folded in")
        daemon.wait_status(lambda d: d["remote"]["objects_listed"] == 0, timeout_s=10, what="status: nothing listed")
        assert cached(daemon) == whole
        assert daemon.status()["evicted"]["retired_samples_total"] == 0  # type: ignore[index]
        remote.rmdir()
        aside.rename(remote)
        listed_again(daemon)
        assert cached(daemon) == whole
        assert sorted(epoch(daemon, "back")) == whole
        assert daemon.status()["ingest"]["objects_total"] == 20, "nothing fetched again"  # type: ignore[index]
    finally:
        assert daemon.stop() == 0


def test_a_restart_while_the_remote_lists_nothing_keeps_what_the_cache_holds_for_when_it_lists_again(
    tmp_path: Path,
) -> None:
    """Restarted twice while the remote's mount is missing, then it lists again: the restarted daemon used to
    forget what its recovered segments held at the empty listing (and keep an empty restart catalog), and fetched
    everything again, every sample then cached twice. Witness: the samples in the segment files."""
    remote, config, daemon = cached_remote(tmp_path)
    assert daemon.stop() == 0
    whole = cached(daemon)
    aside = tmp_path / "aside"
    remote.rename(aside)  # a mount missing: the directory is there, and empty
    remote.mkdir()
    for run in range(2):
        daemon = start_daemon(config, tmp_path / "cache", tmp_path / f"empty-{run}.err")
        wait_for(lambda: "listed 0 objects" in daemon.stderr(), timeout_s=30, what="the empty listing")
        daemon.wait_status(lambda d: d["remote"]["objects_listed"] == 0, timeout_s=10, what="status: nothing listed")
        assert daemon.stop() == 0
    daemon = start_daemon(config, tmp_path / "cache", tmp_path / "back.err")
    try:
        wait_for(lambda: "listed 0 objects" in daemon.stderr(), timeout_s=30, what="the empty listing")
        remote.rmdir()
        aside.rename(remote)
        listed_again(daemon)
        daemon.wait_status(lambda d: d["remote"]["objects_listed"] == 20, timeout_s=10, what="the remote listed")
        time.sleep(2)  # what a daemon that forgot its cache would fetch again (20 small files: well under a second)
        assert cached(daemon) == whole, "every sample once in the segment files, none fetched again"
        assert sorted(epoch(daemon, "back")) == whole
    finally:
        assert daemon.stop() == 0


# -- the plan: which segments are stale ---------------------------------------------------------------------------


def test_segments_of_an_overwritten_or_deleted_object_are_stale_once_a_listing_shows_it() -> None:
    plan = SamplingPlan()
    plan.update_catalog([RemoteObject("d/a", 1, "v1"), RemoteObject("d/b", 1, "v1"), RemoteObject("d/c", 1, "v1")])
    drawn = {obj.path: oid for oid, obj in plan.next(3)}
    for seq, path in enumerate(("d/a", "d/b", "d/c")):
        plan.done([drawn[path]], seq)
    assert plan.take_stale() == set()
    plan.update_page(plan.fold([RemoteObject("d/a", 1, "v2"), RemoteObject("d/c", 1, "v1")]))
    assert plan.take_stale() == {0}, "a page that lists another version: its old samples at once"
    plan.end_listing()
    assert plan.take_stale() == {1}, "the end of a listing that no longer shows it"
    assert plan.take_stale() == set()


def test_a_version_listed_while_the_old_one_is_in_flight_makes_the_old_ones_segments_stale() -> None:
    plan = SamplingPlan()
    plan.update_catalog([RemoteObject("d/a", 1, "v1")])
    ((oid, _),) = plan.next(1)
    plan.update_catalog([RemoteObject("d/a", 1, "v2")])
    plan.spanning([(oid, 3)], 7)  # the old version's first samples, then its last ones
    plan.done([oid], 8)
    assert plan.take_stale() == {7, 8}
    assert [obj.etag for _, obj in plan.next(1)] == ["v2"]


def test_recovered_segments_of_a_version_the_first_listing_does_not_show_are_stale() -> None:
    plan = SamplingPlan()
    plan.adopt(3, [Source("d/a", "v1")])
    plan.adopt(4, [Source("d/b", "v1")])
    plan.adopt(5, [Source("d/gone", "v1")])
    plan.update_catalog([RemoteObject("d/a", 1, "v2"), RemoteObject("d/b", 1, "v1")])
    assert plan.take_stale() == {3, 5}
    assert [obj.path for _, obj in plan.next(5)] == ["d/a"]  # d/b is cached


def test_a_restart_catalog_older_than_the_cache_does_not_fetch_again_what_the_segments_hold() -> None:
    """The restart catalog was written before an object changed; the segments hold the new version. The remote's
    listing shows the new version: the recovered segments hold it (not fetched again, not stale)."""
    plan = SamplingPlan()
    plan.adopt(3, [Source("d/a", "v2")])
    plan.update_page(plan.fold([RemoteObject("d/a", 1, "v1")]))
    plan.end_listing(is_restored=True)
    assert plan.take_stale() == set()
    plan.update_catalog([RemoteObject("d/a", 1, "v2")])
    assert plan.take_stale() == set()
    assert plan.next(1) == [] and plan.cached_segments() == {3}


def test_an_object_dropped_for_a_404_and_then_deleted_is_no_longer_counted_as_dropped() -> None:
    plan = SamplingPlan()
    plan.update_catalog([RemoteObject("d/a", 1, "v1"), RemoteObject("d/b", 1, "v1")])
    drawn = {obj.path: oid for oid, obj in plan.next(2)}
    plan.failed(drawn["d/a"], "not_found")  # deleted between the listing and its GET
    plan.done([drawn["d/b"]], 0)
    assert plan.dropped == 1
    plan.update_catalog([RemoteObject("d/b", 1, "v1")])  # the next listing no longer shows it
    assert plan.dropped == 0 and plan.not_cached == {}


def test_a_listing_that_shows_nothing_keeps_the_objects_refused_for_when_the_remote_lists_again() -> None:
    """An object that killed a sampler twice stays quarantined across a missing mount: it used to be forgotten at
    the empty listing and drawn again once the remote listed it again at the same version."""
    plan = SamplingPlan()
    listed = [RemoteObject("d/poison", 1, "v1"), RemoteObject("d/ok", 1, "v1")]
    plan.update_catalog(listed)
    drawn = {obj.path: oid for oid, obj in plan.next(2)}
    plan.failed(drawn["d/poison"], "crash")
    plan.done([drawn["d/ok"]], 0)
    plan.update_catalog([])  # the mount is missing
    assert plan.take_stale() == set()
    plan.update_catalog(listed)  # back, at the same versions
    assert [obj.path for _, obj in plan.next(5)] == []
    assert plan.not_cached  # still said, with its reason


def test_an_object_deleted_while_in_flight_has_its_samples_retired_as_they_are_published() -> None:
    """The listing that no longer shows it ended while it was being fetched: its samples, published after, used to
    stay until the next complete listing (``remote.refresh_interval``), and epochs served a deleted object."""
    plan = SamplingPlan()
    plan.update_catalog([RemoteObject("d/a", 1, "v1"), RemoteObject("d/b", 1, "v1")])
    drawn = {obj.path: oid for oid, obj in plan.next(2)}
    plan.update_catalog([RemoteObject("d/b", 1, "v1")])  # d/a deleted while both are in flight
    assert plan.take_stale() == set()
    plan.spanning([(drawn["d/a"], 1)], 0)  # its first sample published
    plan.done([drawn["d/a"]], 1)  # the rest
    plan.done([drawn["d/b"]], 2)
    assert plan.take_stale() == {0, 1}
    plan.evicted([0, 1])
    assert plan.next(5) == [] and plan.cached_segments() == {2}  # d/a not drawn again: it is gone


def test_the_other_objects_of_a_retired_segment_are_drawn_again_in_the_same_pass() -> None:
    """A retired segment's other samples were evicted before any epoch needed to read them: their objects come back
    in the pass, not a pass later."""
    plan = SamplingPlan()
    plan.update_catalog([RemoteObject("d/a", 1, "v1"), RemoteObject("d/b", 1, "v1"), RemoteObject("d/c", 1, "v1")])
    drawn = plan.next(3)
    plan.done([oid for oid, _ in drawn], 0)  # one segment holds all three
    plan.update_page(plan.fold([RemoteObject("d/a", 1, "v2")]))
    assert plan.take_stale() == {0}
    pass_index = plan.pass_index
    plan.evicted([0])  # the supervisor retired it
    again = sorted((obj.path, obj.etag) for _, obj in plan.next(5))
    assert again == [("d/a", "v2"), ("d/b", "v1"), ("d/c", "v1")]
    assert plan.pass_index == pass_index
