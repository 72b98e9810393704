"""Trainers SIGKILLed while they hold epoch snapshots: the daemon sweeps their pins and eviction resumes.

Three trainer processes pin the full cache of a running daemon configured with no turnover room, so their pins
stop eviction (back-pressure). Then they die three ways: a trainer and its DataLoader worker together (the
process group, as an OOM kill of the job), a trainer alone (its forked workers inherited the pin's lock and live
until torch's watchdog notices the parent is gone), and a trainer pinning without a DataLoader. The daemon must
remove each snapshot soon after its last holder died (``RELEASE_LIMIT_S``, plus torch's 5 s worker watchdog for
orphaned workers), leave nothing behind in ``snapshots/``, and resume eviction (back-pressure off).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._testing.daemon import BUCKET, StartDaemon
from cachefeed._testing.samples import make_sample
from tests.reliability.common import group_members, report, upload_sv, wait_until
from tests.support.cache_helpers import cache_config

RELEASE_LIMIT_S = 3.0  # the daemon sweeps once a second
WORKER_WATCHDOG_S = 5.0  # torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL


def start_holder(cache_dir: Path, name: str, mode: str, workers: int, log: Path) -> tuple[subprocess.Popen[str], str]:
    """A trainer that pins a snapshot and sleeps; returns it and its ``pinned ...`` line."""
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.reliability.trainer_proc",
                str(cache_dir),
                "--run-id",
                name,
                "--mode",
                mode,
                "--workers",
                str(workers),
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], 60)
    line = process.stdout.readline().strip() if ready else ""
    if not line.startswith("pinned "):
        process.kill()
        raise AssertionError(f"{name} did not pin: {line!r}\n{log.read_text()[-2000:]}")
    return process, line


def test_killed_trainers_pins_are_swept_and_eviction_resumes(tmp_path: Path, bucket: Any, daemon: StartDaemon) -> None:
    upload_sv(bucket, BUCKET, 90, 16 << 10)  # a little more than the cache holds
    proc = daemon(
        sections={
            # free-running (evict_after_reads = 0): only the dying trainers' pins may stop eviction here
            "cache": {"max_bytes": "2MiB", "segment_bytes": "64KiB", "turnover": 0, "evict_after_reads": 0},
            "remote": {"refresh_interval": "1s", "max_requests_per_s": 40},  # no need to churn faster
        }
    )
    cache_dir = proc.cache_dir
    proc.wait_status(lambda d: d["evicted"]["segments_total"] >= 1, timeout_s=60, what="a full cache")
    holders = {
        "group": start_holder(cache_dir, "group", "hold", 1, tmp_path / "group.err"),
        "main-only": start_holder(cache_dir, "main-only", "hold", 1, tmp_path / "main-only.err"),
        "raw": start_holder(cache_dir, "raw", "hold-raw", 0, tmp_path / "raw.err"),
    }
    # An EpochLoaderFactory pins epoch 0 and, near its end, epoch 1 too: a holder may own two snapshots.
    doc = proc.wait_status(
        lambda d: d["cache"]["is_backpressured"] and len(d["cache"]["snapshots"]) >= 3,
        timeout_s=60,
        what="the pins stopping eviction",
    )
    pinned_bytes = doc["cache"]["pinned_bytes"]
    prefixes = {name: f"{name}-{process.pid}" for name, (process, _) in holders.items()}

    def pins_of(name: str) -> list[Path]:
        return list((cache_dir / "snapshots").glob(f"{prefixes[name]}*"))

    assert all(pins_of(name) for name in holders)
    workers = {
        name: [p for p in group_members(process.pid) if p != process.pid] for name, (process, _) in holders.items()
    }
    assert workers["group"] and workers["main-only"], "the DataLoader workers run"

    killed = time.monotonic()
    os.killpg(holders["group"][0].pid, signal.SIGKILL)
    holders["main-only"][0].kill()  # its worker is orphaned, still holding the pin through the inherited lock
    holders["raw"][0].kill()
    for process, _ in holders.values():
        process.wait(timeout=10)
        assert process.stdout is not None
        process.stdout.close()
    released: dict[str, float] = {}

    def all_released() -> bool:
        for name in holders:
            if name not in released and not pins_of(name):
                released[name] = time.monotonic() - killed
        return len(released) == len(holders)

    wait_until(all_released, timeout_s=RELEASE_LIMIT_S + WORKER_WATCHDOG_S + 10, what="every pin released")
    doc = proc.wait_status(
        lambda d: (
            not d["cache"]["snapshots"] and d["cache"]["pinned_bytes"] == 0 and not d["cache"]["is_backpressured"]
        ),
        timeout_s=10,
        what="no pin counted and no back-pressure",
    )
    resumed_s = time.monotonic() - killed
    orphans_gone = wait_until(
        lambda: not any(group_members(h[0].pid) for h in holders.values()), timeout_s=15, what="every worker gone"
    )
    left = sorted(os.listdir(cache_dir / "snapshots"))
    report(
        "trainers-dying",
        trainers_killed=len(holders),
        pinned_bytes=pinned_bytes,
        released_s={name: round(seconds, 2) for name, seconds in sorted(released.items())},
        budget_free_again_s=resumed_s,
        left_in_snapshots=len(left),
        violations=len(left) + int(not orphans_gone),
    )
    assert released["group"] <= RELEASE_LIMIT_S
    assert released["raw"] <= RELEASE_LIMIT_S
    assert released["main-only"] <= RELEASE_LIMIT_S + WORKER_WATCHDOG_S + 2
    assert resumed_s <= RELEASE_LIMIT_S + WORKER_WATCHDOG_S + 5
    assert left == [], left
    assert proc.stop() == 0


TEMP_PLACES = ("/tmp/", "/dev/shm/", "/var/tmp/", "/run/")
# A DataLoader passes each batch through a shared-memory file (/dev/shm/torch_*) it creates and unlinks at once, so a
# SIGKILL between the two leaves one behind. cachefeed's workers write batches into memfds (_trainer/arena.py) and
# count into memfds (_trainer/counters.py): nothing of theirs has a name that could outlive them.


def temp_files_of(pids: list[int], own: Path, since: float) -> set[str]:
    """Files in temp places that these processes hold open or mapped, outside ``own`` (the test's directory),
    created at ``since`` (a unix time) or later: a checkout or a virtual environment under /tmp is not theirs."""
    found: set[str] = set()
    for pid in pids:
        paths = []
        with contextlib.suppress(OSError):
            paths += [
                line.split(None, 5)[5]
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                if len(line.split(None, 5)) == 6
            ]
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        for path in paths:
            path = path.removesuffix(" (deleted)")
            if path.startswith(TEMP_PLACES) and not path.startswith(str(own)) and _created_since(path, since):
                found.add(path)
    return found


def _created_since(path: str, since: float) -> bool:
    try:
        return os.stat(path).st_ctime >= since - 0.05  # file times come from a coarse clock: a tick of slack
    except OSError:
        return True  # already gone (deleted while held): it was theirs, and it is not left behind


def test_a_killed_trainer_leaves_nothing_behind(tmp_path: Path) -> None:
    """A trainer and its DataLoader worker SIGKILLed: its pins go at the next sweep, and no file it used outside
    the cache (shared memory, counters, semaphores) outlives it."""
    root = tmp_path / "cache"
    store = CacheStore(cache_config(root))
    with CacheWriter(store, segment_bytes=64 << 10, fsync=False) as writer:
        for i in range(200):
            writer.add(make_sample(f"k{i}-256.npy", 256))
    store.close()
    started = time.time()
    process, _line = start_holder(root, "leak", "hold", 1, tmp_path / "leak.err")
    members = group_members(process.pid)
    assert len(members) >= 2, "the trainer and its DataLoader worker"
    held = temp_files_of(members, tmp_path, started)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    assert process.stdout is not None
    process.stdout.close()
    wait_until(lambda: not group_members(process.pid), timeout_s=10, what="the trainer's processes gone")
    store = CacheStore(cache_config(root))  # what a daemon start (or its sweep) does with a dead trainer's pins
    store.close()
    left = sorted(path for path in held if os.path.exists(path))
    report(
        "trainer-killed-leftovers",
        processes_killed=len(members),
        temp_files_held=len(held),
        temp_files_left=len(left),
        left_in_snapshots=len(os.listdir(root / "snapshots")),
        violations=len(left) + len(os.listdir(root / "snapshots")),
    )
    assert os.listdir(root / "snapshots") == []
    assert left == [], left
