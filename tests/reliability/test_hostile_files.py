"""Symlinks, FIFOs and foreign files planted in the cache directory are never followed, served or waited on.

Planted in ``segments/``, ``tmp/``, ``snapshots/`` and the root, before the daemon starts and while it runs. The
symlinks point outside the cache: at a *valid* segment of samples keyed ``planted-...`` (so only the refusal to
follow can keep them out), at a file whose content and mtime must not change, at a directory. Pass criteria: the
daemon reaches ``running`` and stops cleanly (no hang on a FIFO), a trainer process reads every epoch without ever
seeing a planted sample and without hanging, nothing outside the cache changes, and the next recovery removes the
foreign entries from ``segments/`` and ``tmp/``. A hostile entry where the daemon's own files live (the lock, the
directories) either is replaced without being followed or makes the daemon refuse to start with one clean line.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._testing.daemon import BUCKET, DaemonProcess, start_daemon, wait_while_running, write_config
from cachefeed._testing.local_s3 import LocalS3
from cachefeed._testing.samples import payload
from tests.reliability.common import check_cache, read_status, report, tree_listing, upload_sv, wait_until
from tests.support.cache_helpers import cache_config

SAMPLE_BYTES = 64


def outside_world(base: Path) -> dict[str, Path]:
    """A valid foreign segment of ``planted-*`` samples, a precious file, a directory: all outside the cache."""
    base.mkdir()
    store = CacheStore(cache_config(base / "foreign-cache"))
    with CacheWriter(store, segment_bytes=64 << 10, fsync=False) as writer:
        for i in range(20):
            key = f"planted-{i}-{SAMPLE_BYTES}.npy"
            writer.add({"__key__": key, "data": payload(key, SAMPLE_BYTES)})
    store.close()
    (segment,) = (base / "foreign-cache" / "segments").glob("*.seg")
    precious = base / "precious.txt"
    precious.write_text("must never change\n")
    return {"segment": segment, "precious": precious, "dir": base / "foreign-cache" / "segments"}


def plant(cache_dir: Path, world: dict[str, Path], tag: str) -> list[str]:
    """Plant hostile entries; returns their paths relative to the cache root. ``tag`` keeps names unique."""
    seg, tmp, snaps = cache_dir / "segments", cache_dir / "tmp", cache_dir / "snapshots"
    nowhere = world["precious"]  # the target of the kinds that have none
    planted = {
        seg / f"ffffffffffff{tag}01.seg": ("symlink", world["segment"]),
        seg / f"ffffffffffff{tag}02.seg": ("fifo", nowhere),
        seg / f"ffffffffffff{tag}03.seg": ("dir", nowhere),
        seg / f"ffffffffffff{tag}04.seg": ("garbage", nowhere),
        seg / f"foreign-{tag}.txt": ("garbage", nowhere),
        seg / f"ffffffffffff{tag}05.seg": ("symlink", world["dir"]),
        tmp / f"ffffffffffff{tag}06.tmp": ("symlink", world["precious"]),
        tmp / f"fifo-{tag}.tmp": ("fifo", nowhere),
        snaps / f"evil{tag}.lock": ("symlink", world["precious"]),
        snaps / f"evil{tag}": ("snapdir", world["segment"]),
        snaps / f"linked{tag}": ("symlink", world["dir"]),
        snaps / f".evil{tag}.1.ab.partial": ("symlink", world["precious"]),
    }
    for path, (kind, target) in planted.items():
        if kind == "symlink":
            path.symlink_to(target)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "dir":
            path.mkdir()
            (path / "inside").write_text("x")
        elif kind == "garbage":
            path.write_bytes(b"not a segment at all" * 10)
        elif kind == "snapdir":
            path.mkdir()
            (path / target.name).symlink_to(target)
            (path / "MANIFEST").write_bytes(b"\x80")
    return [str(p.relative_to(cache_dir)) for p in planted]


def trainer_epochs(cache_dir: Path, log: Path, epochs: int = 3) -> dict[str, Any]:
    """Read ``epochs`` epochs in a trainer process (a hang there is a failure, bounded by the timeout)."""
    with log.open("w") as stderr:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.reliability.trainer_proc",
                str(cache_dir),
                "--run-id",
                "hostile",
                "--max-epochs",
                str(epochs),
                "--step-s",
                "0",
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=120,
            check=True,
        )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def test_planted_symlinks_fifos_and_foreign_files_are_never_followed_or_served(
    tmp_path: Path, s3: LocalS3, bucket: Any
) -> None:
    keys = upload_sv(bucket, BUCKET, 30, 4 << 10)
    world = outside_world(tmp_path / "outside")
    world_before = tree_listing(tmp_path / "outside")
    cache_dir = tmp_path / "cache"
    for sub in ("segments", "tmp", "snapshots"):
        (cache_dir / sub).mkdir(parents=True)
    planted = plant(cache_dir, world, "a")
    (cache_dir / "status.json").symlink_to(world["precious"])
    config = write_config(
        tmp_path / "daemon.toml",
        endpoint=s3.endpoint,
        bucket=BUCKET,
        cache_dir=cache_dir,
        sections={"remote": {"refresh_interval": "1s"}},
    )
    proc: DaemonProcess = start_daemon(config, cache_dir, tmp_path / "daemon-0.stderr")
    try:
        started = time.monotonic()
        proc.wait_status(lambda d: d["state"] == "running", timeout_s=30, what="running despite the planted entries")
        ready_s = time.monotonic() - started
        left_after_recovery = [p for p in planted if os.path.lexists(cache_dir / p)]
        planted += plant(cache_dir, world, "b")  # and again while it runs
        wait_while_running(
            proc, lambda: set(keys) <= set(check_cache(cache_dir).keys), timeout_s=60, what="every object cached"
        )
        first = trainer_epochs(cache_dir, tmp_path / "trainer-0.err")
        assert proc.process.poll() is None
        assert proc.stop() == 0
        proc = start_daemon(config, cache_dir, tmp_path / "daemon-1.stderr")  # recovery meets the "b" entries
        proc.wait_status(lambda d: d["state"] == "running", timeout_s=30, what="running after a restart")
        second = trainer_epochs(cache_dir, tmp_path / "trainer-1.err")
        assert proc.stop() == 0
    finally:
        if proc.process.poll() is None:
            proc.kill_group()
    found = check_cache(cache_dir)
    served_planted = sum("planted" in p for p in first["problems"] + second["problems"])
    in_segments_or_tmp = [p for p in planted if p.startswith(("segments/", "tmp/")) and os.path.lexists(cache_dir / p)]
    world_after = tree_listing(tmp_path / "outside")
    report(
        "hostile-files",
        planted=len(planted) + 1,
        ready_s=ready_s,
        samples_verified=first["verified"] + second["verified"] + found.samples - len(found.problems),
        violations=first["wrong"]
        + second["wrong"]
        + len(found.problems)
        + int(world_after != world_before)
        + len(in_segments_or_tmp),
        planted_served=served_planted,
        left_after_first_recovery=left_after_recovery,
        left_in_segments_or_tmp_after_second=len(in_segments_or_tmp),
        trainer_errors=first["errors"] + second["errors"],
    )
    assert first["wrong"] == 0 and second["wrong"] == 0, first["problems"] + second["problems"]
    assert first["verified"] > 0 and second["verified"] > 0
    assert first["errors"] == 0 and second["errors"] == 0, (tmp_path / "trainer-0.err").read_text()[-3000:]
    assert not any("planted" in key for key in found.keys)
    assert not found.problems, found.problems[:5]
    assert world_after == world_before, "nothing outside the cache changes"
    assert world["precious"].read_text() == "must never change\n"
    assert not (cache_dir / "status.json").is_symlink()
    assert in_segments_or_tmp == [], in_segments_or_tmp


def test_a_fifo_named_like_a_snapshot_lock_does_not_hang_the_daemon(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    # An empty remote is degraded ("lists 0 objects"), and so is one whose only object cannot be decoded (every
    # listed object refused): one valid object, so that a daemon that does not hang says "running".
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(8, np.uint8))
    (remote / "one.npy").write_bytes(buffer.getvalue())
    cache_dir = tmp_path / "cache"
    (cache_dir / "snapshots").mkdir(parents=True)
    os.mkfifo(cache_dir / "snapshots" / "trap.lock")
    config = write_config(
        tmp_path / "daemon.toml",
        endpoint="",
        bucket=BUCKET,
        cache_dir=cache_dir,
        sections={"remote": {"url": f"file://{remote}"}},
    )
    proc = start_daemon(config, cache_dir, tmp_path / "daemon.stderr")
    try:
        started = time.monotonic()
        try:
            proc.wait_status(lambda d: d["state"] == "running", timeout_s=8, what="running")
            ready_s: float | None = time.monotonic() - started
        except TimeoutError:
            ready_s = None
        report("hostile-fifo-lock", ready_s=ready_s, violations=int(ready_s is None))
        assert ready_s is not None, "the daemon hangs on a FIFO in snapshots/"
        assert proc.stop() == 0
    finally:
        if proc.process.poll() is None:
            proc.kill_group()


ROOT_CASES = [
    "lock-symlink",
    "lock-fifo",
    "segments-symlink",
    "tmp-symlink",
    "snapshots-symlink",
    "tag-symlink",
    "status-fifo",
    "made_with.json-fifo",  # read at every start (a plain read blocked the daemon for good)
    "made_with.json-symlink",
]


def make_root_case(name: str, cache_dir: Path, world: dict[str, Path]) -> None:
    entry, _, kind = name.rpartition("-")
    path = cache_dir / {"lock": "lock", "tag": "CACHEDIR.TAG", "status": "status.json"}.get(entry, entry)
    if kind == "symlink":
        path.symlink_to(world["dir"] if entry in ("segments", "tmp", "snapshots") else world["precious"])
    else:
        os.mkfifo(path)


@pytest.mark.parametrize("case", ROOT_CASES)
def test_hostile_entries_where_the_daemon_keeps_its_own_files(tmp_path: Path, case: str) -> None:
    """The daemon either runs without following anything, or refuses at once with one line and no traceback."""
    world = outside_world(tmp_path / "outside")
    before = tree_listing(tmp_path / "outside")
    remote = tmp_path / "remote"
    remote.mkdir()
    # An empty remote is degraded ("lists 0 objects"), and so is one whose only object cannot be decoded (every
    # listed object refused): one valid object, so that a daemon that does not hang says "running".
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(8, np.uint8))
    (remote / "one.npy").write_bytes(buffer.getvalue())
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    make_root_case(case, cache_dir, world)
    config = write_config(
        tmp_path / "daemon.toml",
        endpoint="",
        bucket=BUCKET,
        cache_dir=cache_dir,
        sections={"remote": {"url": f"file://{remote}"}},
    )
    proc = start_daemon(config, cache_dir, tmp_path / "daemon.stderr")
    try:
        wait_until(
            lambda: proc.process.poll() is not None or (read_status(cache_dir) or {}).get("state") == "running",
            timeout_s=20,
            what=f"{case}: running or refused",
        )
        runs = proc.process.poll() is None
        code = proc.stop() if runs else proc.process.returncode
    finally:
        if proc.process.poll() is None:
            proc.kill_group()
    err = proc.stderr()
    untidy = not runs and ("Traceback" in err or len(err.strip().splitlines()) > 2)
    after = tree_listing(tmp_path / "outside")
    report(
        f"hostile-root-{case}",
        outcome="runs" if runs else "refused",
        exit=code,
        error_line=err.strip().splitlines()[-1][-100:] if not runs and err.strip() else "",
        violations=int(untidy) + int(after != before) + int(runs and code != 0),
    )
    assert after == before, "nothing outside the cache changes"
    assert world["precious"].read_text() == "must never change\n"
    assert code == 0 if runs else code in (66, 73, 75, 78), (code, err[-2000:])
    assert not untidy, err[-2000:]
