"""What a sampler's segment writer meets besides decoding: a sample no record can hold, a full filesystem.

* A webdataset shard with one member named in latin-1, not UTF-8 (an old archive): its key held a lone surrogate,
  encoding the record raised in the writer thread, the sampler exited, and the shard was handed out again at once:
  the daemon restarted its sampler forever and cached nothing more (the crash rule counts deaths while *decoding*
  only). Now the key escapes the byte, and any sample that cannot be stored fails its own object (quarantined,
  named) before anything of it is written: the writer lives.
* A cache filesystem that fills up (another user's files in a shared ``/dev/shm``). The writer thread that met
  ENOSPC ended its sampler, and status said "exit status 1"; with nothing left to evict, the store's refusal was
  logged as "full of pinned segments" and shown as back-pressure; and once not even the status file could be
  written, ``cachefeed status`` called the live daemon hung (exit 3). Now the writer drops the segment the
  filesystem refused and goes on (no traceback, no restart: ``Refused``), its objects are fetched again, the store
  says the filesystem is full (``cache.is_out_of_space``, a degraded reason), and the status reader names a full
  filesystem as the reason a live daemon writes no status (degraded, exit 2).

Witnesses: what the training loop receives, and what ``cachefeed status`` prints. The full filesystem is a real
8 MiB tmpfs (``tests/support/tmpfs.py``) filled by ballast files.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from cachefeed._codecs import Sample, decode_npy
from cachefeed._config import toml_text
from cachefeed._testing.daemon import DaemonProcess, start_daemon
from cachefeed._trainer import EpochLoaderFactory
from tests.cache.test_full_disk import fill_up
from tests.support.child_env import child_env
from tests.support.cli import run_cli
from tests.support.tmpfs import small_tmpfs

_calls = 0


def text_with_a_surrogate(key: str, body: bytes) -> list[Sample]:
    """``sampler.decode``: an ``.npy`` object's array, and for ``bad.npy`` a caption no UTF-8 can hold (a user's
    decoder that read a name with ``os.fsdecode``, say)."""
    samples = decode_npy(key, body)
    if key.startswith("bad"):
        samples[0]["caption"] = "caf\udce9"
    return samples


def fill_the_disk_at_the_second_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """``sampler.preprocess``: once (a marker file), at its process's second sample, fill the cache's filesystem,
    so that the record of the sample it returns meets ENOSPC inside a segment the writer has open."""
    global _calls
    _calls += 1
    marker = Path(os.environ["CACHEFEED_TEST_MARKER"])
    if _calls == 2 and not marker.exists():
        marker.touch()
        fill_up(Path(os.environ["CACHEFEED_TEST_BALLAST"]))
    return sample


def npy(value: int, nbytes: int = 64) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.full(nbytes, value, np.uint8))
    return buffer.getvalue()


def config_file(path: Path, remote: Path, cache_dir: Path, **sampler: Any) -> Path:
    path.write_text(
        toml_text(
            {
                "remote": {"url": remote.as_uri(), "refresh_interval": "1h"},
                "cache": {
                    "dir": str(cache_dir),
                    "max_bytes": "64MiB",
                    "segment_bytes": "1MiB",
                    "min_free_bytes": 0,
                    "fsync": False,
                },
                "sampler": {"processes": 1, "restart_backoff": "500ms", "restart_backoff_max": "1s", **sampler},
                "status": {"interval": "200ms"},
            }
        )
    )
    return path


def status_cli(cache_dir: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return run_cli("status", "--cache-dir", str(cache_dir), *options)


def served_keys(cache_dir: Path) -> list[str]:
    with EpochLoaderFactory(cache_dir, batch_size=1, run_id="writer", progress=None) as factory:
        return sorted(key for batch in factory.loader(0) for key in batch["__key__"])


def restarts(daemon: DaemonProcess) -> int:
    return sum(sampler["restarts"] for sampler in (daemon.status() or {}).get("samplers", []))


def test_a_tar_member_named_in_latin1_is_cached_and_the_sampler_lives(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    with tarfile.open(remote / "old.tar", "w", format=tarfile.USTAR_FORMAT, encoding="latin-1") as archive:
        for name in ("a.bin", "caf\xe9.bin", "b.bin"):
            info = tarfile.TarInfo(name)
            info.size = len(name)
            archive.addfile(info, io.BytesIO(name.encode("latin-1")))
    cache_dir = tmp_path / "cache"
    daemon = start_daemon(
        config_file(tmp_path / "tar.toml", remote, cache_dir, decode="tar"),
        cache_dir,
        tmp_path / "daemon.err",
        env=child_env(),
    )
    try:
        daemon.wait_status(lambda d: d["cache"]["samples"] == 3, timeout_s=60, what="the shard's 3 samples")
        assert restarts(daemon) == 0, daemon.stderr()[-3000:]
        keys = served_keys(cache_dir)
    finally:
        daemon.stop()
    assert keys == ["a", "b", "caf\\xe9"], "every sample, the latin-1 name's byte escaped"


def test_a_sample_no_record_can_hold_quarantines_its_object_and_the_writer_lives(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    for name in ("a", "bad", "b", "c"):
        (remote / f"{name}.npy").write_bytes(npy(1))
    cache_dir = tmp_path / "cache"
    daemon = start_daemon(
        config_file(
            tmp_path / "text.toml", remote, cache_dir, decode="tests.daemon.test_writer_failures:text_with_a_surrogate"
        ),
        cache_dir,
        tmp_path / "daemon.err",
        env=child_env(),
    )
    try:
        doc = daemon.wait_status(
            lambda d: d["cache"]["samples"] == 3 and d["remote"]["quarantined_total"] == 1,
            timeout_s=60,
            what="3 objects cached, the bad one quarantined",
        )
        assert restarts(daemon) == 0, daemon.stderr()[-3000:]
        keys = served_keys(cache_dir)
    finally:
        daemon.stop()
    (entry,) = doc["quarantined"]
    assert entry["url"] == (remote / "bad.npy").as_uri() and "cannot be stored" in entry["reason"], entry
    assert keys == ["a.npy", "b.npy", "c.npy"]


def test_a_full_filesystem_is_named_by_status_and_ingest_resumes_when_room_comes_back(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    for i in range(12):
        (remote / f"{i:03d}.npy").write_bytes(npy(i, 64 << 10))
    with small_tmpfs(8 << 20) as mount:
        cache_dir = mount / "cache"
        ballast, more_ballast = mount / "ballast", mount / "more-ballast"
        env = child_env(CACHEFEED_TEST_BALLAST=str(ballast), CACHEFEED_TEST_MARKER=str(tmp_path / "filled"))
        daemon = start_daemon(
            config_file(
                tmp_path / "full.toml",
                remote,
                cache_dir,
                decode="npy",
                preprocess="tests.daemon.test_writer_failures:fill_the_disk_at_the_second_sample",
            ),
            cache_dir,
            tmp_path / "daemon.err",
            env=env,
        )
        try:
            # The writer met ENOSPC: it dropped that segment and waits for room, and status says why.
            doc = daemon.wait_status(
                lambda d: d["cache"].get("is_out_of_space", False),
                timeout_s=60,
                what="the full filesystem in status",
            )
            assert restarts(daemon) == 0 and doc["samplers"][0]["last_error"] is None, doc["samplers"]
            assert any("the cache's filesystem is full" in reason for reason in doc["degraded_reasons"]), doc
            shown = status_cli(cache_dir)
            assert shown.returncode == 2 and "OUT OF SPACE" in shown.stdout, shown.stdout

            # Not even the status file can be written now: the reader says why a live daemon writes none.
            fill_up(more_ballast)
            deadline = time.monotonic() + 60  # past the heartbeat's limit (max(5 s, 5 x status.interval)) and on
            while "cannot write its status" not in " ".join((shown := status_cli(cache_dir)).stdout.split()):
                assert time.monotonic() < deadline, shown.stdout
                time.sleep(0.5)
            assert shown.returncode == 2, shown.stdout  # degraded, not "not running": it runs
            assert "cannot write its status: the cache's filesystem is full" in " ".join(shown.stdout.split())

            ballast.unlink()
            more_ballast.unlink()
            daemon.wait_status(
                lambda d: d["cache"]["samples"] == 12 and d["state"] == "running",
                timeout_s=60,
                what="every object cached once room came back",
            )
            keys = served_keys(cache_dir)
            report = json.loads(status_cli(cache_dir, "--json").stdout)
        finally:
            daemon.stop()
    assert keys == [f"{i:03d}.npy" for i in range(12)], "each sample once, the one cut by ENOSPC included"
    assert not report["cache"]["is_out_of_space"] and not report["degraded_reasons"], report
    stderr = daemon.stderr()
    assert "cache full of pinned segments" not in stderr, "a full filesystem is not back-pressure"
    assert "Traceback" not in stderr and "No space left on device" in stderr, "said in a line, not a traceback"
    assert stderr.count("cannot write the status file") <= 2, "once per episode, not at every interval"
