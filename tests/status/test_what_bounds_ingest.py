"""What ``cachefeed status`` says bounds ingest is true in each state, and ``--json`` and the metrics say the same.

A real daemon reads a ``file://`` remote capped below training's rate; real trainers (``EpochLoaderFactory`` with
DataLoader workers) read it. Three states, one after the other on one daemon:

* remote slower than training (a trainer reads fast): "remote-bound", not paced;
* no trainer (the fast one has gone; the daemon fills its budget and is paced): the status says no trainer reads,
  and calls ingest neither remote- nor trainer-bound (the audit saw "remote-bound" beside "paced: waiting for
  trainers", an earlier trainer's verdict);
* a trainer reading and the daemon paced (a slow trainer on the full cache): "trainer-bound", never "remote-bound".

Each state is witnessed through the real ``cachefeed status`` command (text and ``--json``) and the metrics textfile.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import pytest

from cachefeed._codecs import msgpack_default
from cachefeed._config import toml_text
from cachefeed._testing.daemon import DaemonProcess, start_daemon
from cachefeed._testing.samples import payload
from cachefeed._testing.witness import sample_keys
from cachefeed._trainer import EpochLoaderFactory
from tests.reliability.test_trainers_dying import start_holder
from tests.status.test_daemon import agreeing_metrics
from tests.status.test_metrics import value
from tests.status.test_status import REPO, STATUS_CMD, flat

SAMPLE_BYTES = 16 << 10
PER_OBJECT = 10
OBJECTS = 100
BATCH = 16
EPOCH_SAMPLES = 48
CAP = 600 << 10  # the remote's rate: about 36 samples/s, a fifth of the fast trainer's
LOOKS = 3  # readings of status while the fast trainer reads


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory on tmpfs for the remote and the cache."""
    root = Path(tempfile.mkdtemp(prefix="cachefeed-ingest-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def start(root: Path) -> DaemonProcess:
    remote = root / "data"
    remote.mkdir()
    for obj in range(OBJECTS):
        rows = [{"data": payload(f"{obj}/{i}", SAMPLE_BYTES)} for i in range(PER_OBJECT)]
        (remote / f"obj-{obj:05d}.msgpack").write_bytes(msgpack.packb(rows, default=msgpack_default))
    document: dict[str, Any] = {
        "remote": {"url": remote.as_uri(), "refresh_interval": "10s", "max_bytes_per_s": CAP},
        "cache": {"dir": str(root / "cache"), "max_bytes": "6MiB", "min_free_bytes": 0, "segment_bytes": "128KiB",
                  "fsync": False},
        "sampler": {"processes": 1, "concurrency": 4, "decode": "msgpack"},
        "status": {"interval": "100ms", "metrics_textfile": str(root / "cachefeed.prom")},
    }  # fmt: skip
    (root / "daemon.toml").write_text(toml_text(document))
    return start_daemon(root / "daemon.toml", root / "cache", root / "daemon.stderr")


Reading = tuple[str, dict[str, Any], dict[Any, float]]


def shown(daemon: DaemonProcess) -> Reading:
    """What ``cachefeed status`` prints (text, flattened), what ``--json`` prints, and the metrics textfile (read
    from the same document as a status.json of that moment)."""
    argv = [*STATUS_CMD, "--cache-dir", str(daemon.cache_dir)]
    text = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=30, check=False)
    as_json = subprocess.run([*argv, "--json"], cwd=REPO, capture_output=True, text=True, timeout=30, check=False)
    assert text.returncode == as_json.returncode == 0, (text.stderr, as_json.stderr)
    _document, metrics = agreeing_metrics(daemon.cache_dir, daemon.cache_dir.parent / "cachefeed.prom")
    return flat(text.stdout), json.loads(as_json.stdout), metrics


def readings(daemon: DaemonProcess, done: threading.Event, count: int) -> list[Reading]:
    """``count`` readings of ``shown``, one after the other (fewer if ``done`` is set first)."""
    seen: list[Reading] = []
    while len(seen) < count and not done.is_set():
        seen.append(shown(daemon))
    return seen


def remote_bound_metric(metrics: dict[Any, float]) -> float | None:
    try:
        return value(metrics, "cachefeed_ingest_remote_bound")
    except KeyError:
        return None


def test_status_says_what_bounds_ingest_with_a_fast_trainer_with_none_and_with_a_slow_one(shm_dir: Path) -> None:
    daemon = start(shm_dir)
    try:
        daemon.wait_status(lambda d: d["cache"]["segments"] >= 2, timeout_s=60, what="the first segments")
        # Remote slower than training: a trainer reads 48-sample epochs at about 160 samples/s. Status is looked at
        # from another thread while it reads: a pause of the loop to look would be a trainer slower than the remote.
        received = 0
        with EpochLoaderFactory(
            daemon.cache_dir, batch_size=BATCH, samples_per_epoch=EPOCH_SAMPLES, num_workers=1, run_id="fast",
            progress=None,
        ) as fast, ThreadPoolExecutor(1) as pool:  # fmt: skip
            done = threading.Event()
            looking: Future[list[Reading]] | None = None
            for epoch in range(80):
                for batch in fast.loader(epoch):
                    received += len(sample_keys(batch))
                    daemon.check_running()
                    time.sleep(0.1)  # the training step
                status = daemon.status()
                if looking is None and epoch >= 4 and status and status["cache"].get("ingest_bound") == "remote":
                    looking = pool.submit(readings, daemon, done, LOOKS)
                if looking is not None and looking.done():
                    break
            done.set()
            assert looking is not None, "ingest never became remote-bound with a trainer five times faster"
            seen = looking.result()
        assert received >= 5 * EPOCH_SAMPLES, "the loop received epochs of samples"
        assert len(seen) == LOOKS and not any("paced" in text for text, _json, _metrics in seen), seen
        # An epoch's verdict follows its fresh share: a reading of the daemon's last verdict, by all three outputs.
        assert any(
            "remote-bound" in text
            and as_json["cache"]["ingest_bound"] == "remote"
            and as_json["cache"]["is_remote_bound"] is True
            and remote_bound_metric(metrics) == 1
            for text, as_json, metrics in seen
        ), seen

        # No trainer: the fast one has gone, and the daemon fills its budget with samples nobody reads.
        daemon.wait_status(lambda d: d["cache"]["is_paced"] and not d["cache"]["snapshots"], timeout_s=90, what="paced")
        text, as_json, metrics = shown(daemon)
        assert "paced: no trainer is reading" in text, text
        assert "; no trainer reading" in text, text
        assert "remote-bound" not in text and "trainer-bound" not in text, text
        assert as_json["cache"]["is_paced"] is True
        assert as_json["cache"]["ingest_bound"] is None and as_json["cache"]["is_remote_bound"] is None
        assert remote_bound_metric(metrics) is None, "no remote-bound gauge while no trainer reads"
        assert value(metrics, "cachefeed_cache_paced") == 1

        # A trainer reading, slower than the remote: it holds its epoch while the cache stays full and paced.
        with EpochLoaderFactory(
            daemon.cache_dir, batch_size=BATCH, num_workers=1, run_id="slow", progress=None
        ) as slow:
            batches = iter(slow.loader(0))
            assert len(sample_keys(next(batches))) == BATCH, "the slow trainer received a batch"
            daemon.wait_status(  # the daemon's pin scans (twice a second) have seen the trainer's snapshot
                lambda d: d["cache"]["is_paced"] and d["cache"]["snapshots"] and d["cache"]["ingest_bound"],
                timeout_s=30,
                what="paced while a trainer reads",
            )
            text, as_json, metrics = shown(daemon)
            assert "paced: waiting for trainers to read" in text and "trainer-bound" in text, text
            assert "remote-bound" not in text, text
            assert as_json["cache"]["ingest_bound"] == "trainer" and as_json["cache"]["is_remote_bound"] is False
            assert remote_bound_metric(metrics) == 0
            del batches
    finally:
        assert daemon.stop() == 0, daemon.stderr()[-4000:]


def test_a_dead_trainers_snapshot_kept_for_a_resume_is_no_trainer_reading(shm_dir: Path, tmp_path: Path) -> None:
    """A trainer SIGKILLed while it holds its epoch: the daemon keeps the snapshot for ``cache.snapshot_grace`` so
    that its job resumes on it, but nobody reads it. Status said what bounds ingest by that dead trainer's epoch
    (the snapshot counted as a trainer); now it says no trainer reads, and marks the snapshot as kept."""
    daemon = start(shm_dir)
    holder = None
    try:
        daemon.wait_status(lambda d: d["cache"]["segments"] >= 2, timeout_s=60, what="the first segments")
        holder, pinned = start_holder(daemon.cache_dir, "gone", "hold-raw", 0, tmp_path / "holder.err")
        snap_id = pinned.split()[1]
        daemon.wait_status(
            lambda d: d["cache"]["ingest_bound"] is not None and not d["cache"]["snapshots"][0]["kept_for_resume"],
            timeout_s=30,
            what="a verdict on the live trainer's epoch",
        )
        text, _as_json, _metrics = shown(daemon)
        assert "no trainer reading" not in text and "kept for a resume" not in text, text
        holder.kill()
        holder.wait(timeout=10)
        daemon.wait_status(
            lambda d: [s["kept_for_resume"] for s in d["cache"]["snapshots"]] == [True],
            timeout_s=30,
            what="the dead trainer's snapshot kept for a resume",
        )
        text, as_json, metrics = shown(daemon)
        assert f"{snap_id}: " in text and "(its trainer is gone: kept for a resume)" in text, text
        assert "; no trainer reading" in text and "-bound" not in text, text
        assert as_json["cache"]["ingest_bound"] is None and as_json["cache"]["is_remote_bound"] is None, as_json
        assert remote_bound_metric(metrics) is None
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(timeout=10)
            if holder.stdout is not None:
                holder.stdout.close()
        assert daemon.stop() == 0, daemon.stderr()[-4000:]
