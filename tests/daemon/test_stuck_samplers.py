"""A sampler that stops (SIGSTOP, a debugger, a hang that holds the interpreter) or one whose fetch never returns (a
stalled network mount under a ``file://`` remote) held up all ingest: the other samplers finished the pass and
then waited for its objects, since a pass ends only once every object drawn is done. Status said ``running``, the
sampler ``running``, exit 0, whatever ``status.stuck_after``; a stopped sampler was killed after a fixed 60 s, a
stuck fetch never. Now a silent sampler makes the daemon degraded, named, with what it holds, and is killed later
(``pool.py``, "Silence": the stuck-decode rule's times, within floors), so its objects are fetched by another; a fetch
that does not return is named once ingest waits for it, and not killed (a slow fetch must not be, and another
sampler would stall on a dead mount too). Witnesses: ``cachefeed status`` and what the training loop receives."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import numpy as np

from cachefeed._config import toml_text
from cachefeed._daemon.plan import pass_order_key
from cachefeed._daemon.pool import KILL_MIN_S, SILENT_MIN_S
from cachefeed._daemon.sampler import WINDOW_PATIENCE_S
from cachefeed._testing.daemon import DaemonProcess, start_daemon
from cachefeed._testing.samples import npy_bytes
from cachefeed._trainer import EpochLoaderFactory
from tests.support.child_env import child_env
from tests.support.cli import run_cli

OBJECTS = 40
STUCK_AFTER_S = 2.0


def npy(value: int) -> bytes:
    return npy_bytes(np.full(16, value, np.int32))


def write_remote(remote: Path) -> None:
    remote.mkdir()
    for i in range(OBJECTS):
        (remote / f"{i:03d}.npy").write_bytes(npy(i))


def start(tmp_path: Path, remote: Path, *, processes: int = 2, **remote_keys: object) -> DaemonProcess:
    cache_dir = tmp_path / "cache"
    config = tmp_path / "daemon.toml"
    config.write_text(
        toml_text(
            {
                "remote": {"url": remote.as_uri(), "refresh_interval": "1h", **remote_keys},
                "cache": {"dir": str(cache_dir), "max_bytes": "64MiB", "segment_bytes": "64KiB", "fsync": False},
                "sampler": {"processes": processes, "concurrency": 2, "restart_backoff": "100ms"},
                "status": {"interval": "200ms", "stuck_after": f"{STUCK_AFTER_S:g}s"},
            }
        )
    )
    return start_daemon(config, cache_dir, tmp_path / "daemon.err", env=child_env())


class StalledObject:
    """An object of the remote whose read blocks, as one from a stalled network mount does, until ``release``: a
    FIFO held open by a writer that never writes (the sampler's read waits, not its open). The remote is then listed
    through a manifest, ``manifest_uri`` (a FIFO has no size to list)."""

    def __init__(self, remote: Path, name: str, manifest: Path) -> None:
        self.path = remote / name
        os.mkfifo(self.path)
        self._writer = os.open(self.path, os.O_RDWR)
        manifest.write_text("".join(f"{n}\t{len(npy(0))}\n" for n in sorted(os.listdir(remote))))
        self.manifest_uri = manifest.as_uri()

    def release(self) -> None:
        """The mount comes back: the read ends (short, so retried) and the object reads as the last one, OBJECTS."""
        self.path.unlink()
        self.path.write_bytes(npy(OBJECTS))
        self.close()

    def close(self) -> None:
        if self._writer >= 0:
            os.close(self._writer)
            self._writer = -1


def values_served(cache_dir: Path) -> list[int]:
    with EpochLoaderFactory(cache_dir, batch_size=1, run_id="stuck", progress=None) as factory:
        return sorted(int(batch["data"][0][0]) for batch in factory.loader(0))


def test_a_stopped_sampler_is_named_then_killed_so_that_ingest_goes_on(
    tmp_path: Path,
) -> None:
    remote = tmp_path / "remote"
    write_remote(remote)
    daemon = start(tmp_path, remote, max_requests_per_s=10)  # a pass of several seconds: time to stop one
    victim = 0
    try:
        doc = daemon.wait_status(
            lambda d: d["samplers"][0]["state"] == "running" and d["plan"]["in_flight"] > 0,
            timeout_s=60,
            what="sampler 0 at work",
        )
        victim = doc["samplers"][0]["pid"]
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        doc = daemon.wait_status(
            lambda d: any("has sent nothing for" in reason for reason in d["degraded_reasons"]),
            timeout_s=SILENT_MIN_S + 10,  # stuck_after is shorter than the floor
            what="the stopped sampler named in status",
        )
        (reason,) = [r for r in doc["degraded_reasons"] if "has sent nothing for" in r]
        assert f"sampler 0 (pid {victim}) has sent nothing for" in reason and "objects assigned to it" in reason
        assert doc["samplers"][0]["state"] == "silent", doc["samplers"]
        shown = run_cli("status", "--cache-dir", str(daemon.cache_dir))
        text = " ".join(shown.stdout.split())
        assert shown.returncode == 2 and f"sampler 0 (pid {victim})" in text and "1 of 2 running" in text, text
        daemon.wait_status(
            lambda d: d["cache"]["samples"] == OBJECTS and d["state"] == "running",
            timeout_s=30,
            what="every object cached once the stopped sampler was killed",
        )
        waited = time.monotonic() - stopped_at
        served = values_served(daemon.cache_dir)
    finally:
        if victim:
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                pass
        daemon.stop()
    assert served == list(range(OBJECTS)), "each object's sample once, those the stopped sampler held included"
    assert waited < KILL_MIN_S + 15, f"ingest waited {waited:.0f}s for a stopped sampler"
    assert f"sampler 0 (pid {victim}) has sent nothing for" in daemon.stderr()


def test_a_fetch_that_never_returns_is_named_while_ingest_waits_for_it_and_is_not_killed(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    write_remote(remote)
    stuck = StalledObject(remote, "stuck.npy", tmp_path / "keys.txt")
    daemon = start(tmp_path, remote, manifest=stuck.manifest_uri)
    try:
        doc = daemon.wait_status(
            lambda d: any("ingest waits for sampler" in reason for reason in d["degraded_reasons"]),
            timeout_s=STUCK_AFTER_S + 30,
            what="the stuck fetch named in status",
        )
        (reason,) = [r for r in doc["degraded_reasons"] if "ingest waits for sampler" in r]
        assert re.search(rf"it has held {re.escape(stuck.path.as_uri())} for \d+s", reason), reason
        # every object but the stuck one: the sampler's other fetches go on (its window's patience, next test)
        daemon.wait_status(lambda d: d["cache"]["samples"] == OBJECTS, timeout_s=30, what="the others")
        time.sleep(3 * STUCK_AFTER_S)  # past the silent rule's kill: the sampler is not silent, and not killed
        doc = daemon.wait_status(lambda d: True, timeout_s=5)
        assert [s["restarts"] for s in doc["samplers"]] == [0, 0], doc["samplers"]
        assert doc["state"] == "degraded", doc
        stuck.release()  # the object is cached like any other
        daemon.wait_status(
            lambda d: d["cache"]["samples"] == OBJECTS + 1 and d["state"] == "running",
            timeout_s=30,
            what="the object cached once its read returned, and the reason gone",
        )
        served = values_served(daemon.cache_dir)
    finally:
        stuck.close()
        daemon.stop()
    assert served == list(range(OBJECTS + 1)), "each object's sample once"


def test_a_sampler_whose_first_fetch_never_returns_fetches_the_other_objects(tmp_path: Path) -> None:
    """The stuck object is the first one the only sampler fetches: its fetch window, which opens as fetches
    complete, stayed shut behind it, and no other object was fetched for as long as the read hung."""
    remote = tmp_path / "remote"
    write_remote(remote)
    paths = [str(remote / name) for name in os.listdir(remote)]
    first_key = min(pass_order_key(path, 0, 0) for path in paths)  # the config's seed (0), the first pass
    name = next(
        n for n in (f"stuck-{j}.npy" for j in range(10_000)) if pass_order_key(str(remote / n), 0, 0) < first_key
    )
    stuck = StalledObject(remote, name, tmp_path / "keys.txt")
    daemon = start(tmp_path, remote, processes=1, manifest=stuck.manifest_uri)
    try:
        daemon.wait_status(
            lambda d: d["cache"]["samples"] == OBJECTS,
            timeout_s=WINDOW_PATIENCE_S + 30,
            what="every other object cached while the first fetch hangs",
        )
        stuck.release()
        daemon.wait_status(lambda d: d["cache"]["samples"] == OBJECTS + 1, timeout_s=30, what="the stuck one too")
        served = values_served(daemon.cache_dir)
    finally:
        stuck.close()
        daemon.stop()
    assert served == list(range(OBJECTS + 1)), "each object's sample once"
