"""The daemon SIGKILLed at random moments of fill and eviction, restarted, while a trainer reads and verifies.

Each round starts ``cachefeed daemon`` (its own session), waits for READY (a fake ``NOTIFY_SOCKET``) and for status
``running``, lets it work for a random time (sometimes until this incarnation has evicted), then SIGKILLs the
supervisor and the samplers: the whole process group, or each pid named in ``status.json`` in a random order.
Meanwhile a trainer process reads every epoch through ``EpochLoaderFactory`` and checks every sample against its
key (``tests/reliability/common.py``), and a thread samples the directory's real size.

Pass criteria: no wrong or partial sample served; no temporary file of a crashed incarnation survives the next
recovery (checked at READY by name, inode and ctime); the real size never exceeds ``max_bytes``; READY every time
within ``READY_LIMIT_S``; no process of a killed daemon outlives it; no traceback in any daemon's stderr.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cachefeed._cache.reads import RECEIPT_SUFFIX
from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import METADATA_RESERVE_BYTES, CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._testing.daemon import BUCKET, DaemonProcess, start_daemon, write_config
from cachefeed._testing.local_s3 import LocalS3
from cachefeed._testing.samples import make_sample
from tests.reliability.common import (
    DiskWatch,
    NotifyListener,
    check_cache,
    group_members,
    report,
    upload_sv,
    wait_until,
)
from tests.support.cache_helpers import cache_config

OBJECTS = 160
OBJECT_BYTES = 16 << 10
# the published set holds ~2 MiB (the budget less the 1 MiB reserve), less than the 2.5 MiB dataset: the fill lasts a
# few incarnations, then eviction
MAX_BYTES = 3 << 20
SEGMENT_BYTES = 128 << 10
READY_LIMIT_S = 10.0
SECTIONS: dict[str, dict[str, Any]] = {
    "cache": {"max_bytes": MAX_BYTES, "segment_bytes": SEGMENT_BYTES},
    "sampler": {"processes": 2, "concurrency": 4},
    "remote": {"refresh_interval": "1s"},
}


def tmp_entries(cache_dir: Path) -> set[tuple[str, int, int]]:
    """tmp/ entries by (name, inode, ctime): a new file that reuses a name is not mistaken for a leftover."""
    found = set()
    try:
        with os.scandir(cache_dir / "tmp") as entries:
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.add((entry.name, info.st_ino, info.st_ctime_ns))
    except FileNotFoundError:
        pass
    return found


def start_trainer(cache_dir: Path, log: Path, workers: int) -> subprocess.Popen[str]:
    with log.open("w") as stderr:
        trainer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.reliability.trainer_proc",
                str(cache_dir),
                "--run-id",
                "crash",
                "--workers",
                str(workers),
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    assert trainer.stdout is not None and trainer.stdout.readline().strip() == "started"
    return trainer


def stop_trainer(trainer: subprocess.Popen[str]) -> dict[str, Any]:
    trainer.send_signal(signal.SIGTERM)
    out, _ = trainer.communicate(timeout=60)
    return dict(json.loads(out.strip().splitlines()[-1]))


def kill_daemon(proc: DaemonProcess, rng: random.Random, by_pid: bool) -> str:
    """SIGKILL supervisor and samplers. Returns what this incarnation was doing then: "startup" (nothing
    published yet), "evict" (it evicted, or the published set is at its target: the next publication evicts),
    or "fill"."""
    doc = proc.status() or {}
    cache = doc.get("cache", {})
    target = MAX_BYTES - METADATA_RESERVE_BYTES  # the published set fills the budget (an epoch pins its room only)
    is_full = cache.get("bytes", 0) - cache.get("reserved_bytes", 0) + SEGMENT_BYTES > target
    if not doc.get("ingest", {}).get("segments_total", 0):
        phase = "startup"
    elif doc.get("evicted", {}).get("segments_total", 0) or is_full:
        phase = "evict"
    else:
        phase = "fill"
    if by_pid:
        pids = [proc.pid] + [s["pid"] for s in doc.get("samplers", []) if s.get("pid")]
        pids += [pid for pid in proc.sampler_pids() if pid not in pids]  # a sampler restarted since the document
        rng.shuffle(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    else:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.process.wait(timeout=10)
    return phase


def crash_loop(tmp_path: Path, s3: LocalS3, kills: int, seed: int, workers: int = 0) -> None:
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    upload_sv(client, BUCKET, OBJECTS, OBJECT_BYTES)
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "daemon.toml", endpoint=s3.endpoint, bucket=BUCKET, cache_dir=cache_dir, sections=SECTIONS
    )
    listener = NotifyListener(tmp_path / "notify.sock")
    env = {**os.environ, "NOTIFY_SOCKET": str(listener.path)}
    rng = random.Random(seed)
    ready_s: list[float] = []
    running_s: list[float] = []
    phases = {"startup": 0, "fill": 0, "evict": 0}
    leftovers_survived = orphans = tracebacks = 0
    startup_crashes: list[str] = []  # a start that exits before READY (systemd would restart it: so do we)
    seen_segments: set[str] = set()
    trainer: subprocess.Popen[str] | None = None
    proc: DaemonProcess | None = None
    try:
        with DiskWatch(cache_dir) as disk:
            round_ = kills_done = 0
            while True:
                round_ += 1
                before = tmp_entries(cache_dir)
                started = time.monotonic()
                proc = start_daemon(config, cache_dir, tmp_path / f"daemon-{round_}.stderr", env=env)

                def ready_or_exit(p: DaemonProcess = proc, t: float = started) -> float | str | None:
                    return listener.first_after("READY=1", t) or ("exited" if p.process.poll() is not None else None)

                ready_at = wait_until(ready_or_exit, timeout_s=60, what="READY=1 or an exit")
                if ready_at == "exited":
                    errors = [line for line in proc.stderr().replace("\\n", "\n").splitlines() if "Error" in line]
                    startup_crashes.append(errors[-1][-160:] if errors else proc.stderr()[-160:])
                    tracebacks += proc.stderr().count("Traceback")
                    if len(startup_crashes) > 5:
                        break
                    continue
                assert isinstance(ready_at, float)
                leftovers_survived += len(before & tmp_entries(cache_dir))
                ready_s.append(ready_at - started)
                proc.wait_status(lambda d: d["state"] in ("running", "degraded"), timeout_s=30, what="running")
                running_s.append(time.monotonic() - started)
                if trainer is None:
                    trainer = start_trainer(cache_dir, tmp_path / "trainer.stderr", workers)
                if kills_done == kills:
                    break  # the last incarnation is stopped cleanly below
                if rng.random() < 0.6:  # most kills once the samplers publish; the others during start-up
                    try:
                        proc.wait_status(lambda d: d["ingest"]["segments_total"] > 0, timeout_s=5, what="ingest")
                    except TimeoutError:
                        pass
                time.sleep(rng.uniform(0.0, 1.0))
                seen_segments.update(p.name for p in (cache_dir / "segments").glob("*.seg"))
                phases[kill_daemon(proc, rng, by_pid=kills_done % 2 == 1)] += 1
                kills_done += 1
                try:
                    wait_until(lambda p=proc: not group_members(p.pid), timeout_s=10, what="the daemon's group gone")
                except TimeoutError:
                    orphans += len(group_members(proc.pid))
                    os.killpg(proc.pid, signal.SIGKILL)
                    wait_until(lambda p=proc: not group_members(p.pid), timeout_s=10, what="orphans gone")
                tracebacks += proc.stderr().count("Traceback")
            assert proc is not None
            if proc.process.poll() is None:
                proc.wait_status(lambda d: d["ingest"]["segments_total"] > 0, timeout_s=30, what="the last ingesting")
                assert proc.stop() == 0
                tracebacks += proc.stderr().count("Traceback")
            assert trainer is not None
            counts = stop_trainer(trainer)
            trainer = None
    finally:
        listener.close()
        if trainer is not None:
            trainer.kill()
            trainer.wait()
        if proc is not None and proc.process.poll() is None:
            proc.kill_group()

    cached = check_cache(cache_dir)
    evicted = len(seen_segments - {p.name for p in (cache_dir / "segments").glob("*.seg")})
    violations = (
        counts["wrong"]
        + counts["skipped"]
        + len(cached.problems)
        + leftovers_survived
        + int(disk.peak_bytes > MAX_BYTES)
    )
    report(
        "daemon-crash-loop",
        kills=kills_done,
        kills_in_startup=phases["startup"],
        kills_in_fill=phases["fill"],
        kills_in_eviction=phases["evict"],
        samples_verified_by_trainer=counts["verified"],
        trainer_epochs=counts["epochs"],
        samples_verified_in_cache=cached.samples,
        violations=violations,
        wrong=counts["wrong"],
        skipped_corrupt=counts["skipped"],
        trainer_errors=counts["errors"],
        leftover_tmp=leftovers_survived,
        peak_bytes=disk.peak_bytes,
        max_bytes=MAX_BYTES,
        size_samples=disk.samples,
        max_ready_s=max(ready_s),
        max_running_s=max(running_s),
        orphans=orphans,
        startup_crashes=len(startup_crashes),
        tracebacks=tracebacks,
        segments_evicted=evicted,
        duplicate_samples=cached.duplicates,
    )
    assert not startup_crashes, startup_crashes
    assert counts["wrong"] == 0, counts["problems"]
    assert counts["skipped"] == 0
    assert counts["errors"] == 0, (tmp_path / "trainer.stderr").read_text()[-3000:]
    assert counts["verified"] > 0
    assert not cached.problems, cached.problems[:5]
    assert cached.duplicates == 0, "a restarted daemon never caches an object it already holds"
    assert leftovers_survived == 0
    assert not list((cache_dir / "tmp").iterdir()), "a clean stop leaves no temporary file"
    assert disk.samples > 0 and disk.peak_bytes <= MAX_BYTES
    assert max(ready_s) <= READY_LIMIT_S
    assert orphans == 0
    assert tracebacks == 0
    assert evicted > 0, "the loop must kill during eviction too"
    pins = [name for name in os.listdir(cache_dir / "snapshots") if not name.endswith(RECEIPT_SUFFIX)]
    assert not pins, "the trainer's pins are gone once it stopped (its last read receipts wait for the daemon)"


def test_daemon_killed_12_times_while_a_trainer_verifies(tmp_path: Path, s3: LocalS3) -> None:
    crash_loop(tmp_path, s3, kills=12, seed=8)  # enough to kill in start-up, fill and eviction; 500 below (slow)


@pytest.mark.slow
def test_daemon_killed_500_times_while_a_trainer_verifies(tmp_path: Path, s3: LocalS3) -> None:
    crash_loop(tmp_path, s3, kills=500, seed=500, workers=1)


def test_recovery_survives_a_snapshot_released_during_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interleaving the crash loop met, made deterministic: the snapshot goes right before its listdir."""
    root = tmp_path / "cache"
    store = CacheStore(cache_config(root))
    with CacheWriter(store, segment_bytes=64 << 10, fsync=False) as writer:
        for i in range(100):
            writer.add(make_sample(f"k{i}-256.npy", 256))
    store.close()
    snapshot = Snapshot.create(root, "leaving-e000001")
    real_listdir = os.listdir

    def listdir_after_release(path: Any = ".") -> list[str]:
        if Path(path) == snapshot.directory:
            snapshot.release()  # the trainer moves on to its next epoch right now
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir_after_release)
    try:
        CacheStore(cache_config(root)).close()
        crashed = ""
    except FileNotFoundError as exc:
        crashed = type(exc).__name__
    finally:
        monkeypatch.undo()
        snapshot.release()
    report("recovery-vs-release-race", violations=int(bool(crashed)), error=crashed or None)
    assert not crashed


def test_a_restarted_daemon_does_not_cache_what_it_already_holds(tmp_path: Path, s3: LocalS3) -> None:
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    keys = upload_sv(client, BUCKET, 30, 4 << 10)
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "daemon.toml",
        endpoint=s3.endpoint,
        bucket=BUCKET,
        cache_dir=cache_dir,
        sections={"cache": {"max_bytes": "32MiB"}, "remote": {"refresh_interval": "1s"}},
    )
    fetched = []
    for round_ in range(2):
        proc = start_daemon(config, cache_dir, tmp_path / f"daemon-{round_}.stderr")
        try:
            doc = proc.wait_status(lambda d: d["plan"]["pass"] >= 2, timeout_s=60, what="two passes over the remote")
            fetched.append(doc["ingest"]["objects_total"])
            assert proc.stop() == 0
        finally:
            if proc.process.poll() is None:
                proc.kill_group()
    found = check_cache(cache_dir)
    report(
        "restart-duplicates",
        objects=len(keys),
        cached_samples=found.samples,
        duplicates=found.duplicates,
        fetched_per_start=fetched,
        violations=found.duplicates + len(found.problems),
    )
    assert not found.problems
    assert set(found.keys) == set(keys)
    assert found.duplicates == 0
    assert fetched == [len(keys), 0]  # the restarted daemon downloaded nothing it already held
