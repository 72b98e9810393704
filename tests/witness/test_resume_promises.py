"""Resume and ownership, checked by the witness (``cachefeed/_testing/witness.py``) against a real daemon.

* A trainer SIGKILLed mid-epoch and resumed from its last ``state_dict()`` gets exactly the rest of the interrupted
  epoch: what the killed loop received plus what the resumed loop receives is the snapshot's key set (read from its
  segment files), with no key twice; with a look-ahead (``DevicePrefetcher`` on a fake CUDA) too. The daemon then
  evicts only samples served (the resumed epoch credits what the checkpoint says was consumed).
* Two jobs on one node with the same run id (torchrun's default ``none``) never share a snapshot.
* A checkpoint resumed with changed settings is refused, naming the setting; ``strict=False`` takes a fresh snapshot.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from cachefeed._testing.daemon import DaemonProcess, wait_for
from cachefeed._testing.witness import SegmentWitness, Served, check_promises, final_status, sample_keys
from cachefeed._trainer import DevicePrefetcher, EpochLoaderFactory
from tests.support import fake_prefetch
from tests.support.child_env import REPO, child_env
from tests.witness.test_promises import make_remote, start

BATCH = 32
EPOCHS = 4


def factory_for(root: str | Path, **settings: Any) -> EpochLoaderFactory:
    options: dict[str, Any] = {"batch_size": BATCH, "min_samples": "75%", "run_id": "job", "progress": None}
    return EpochLoaderFactory(root, **{**options, **settings})


def trainer_main(root: str, progress: str, prefetch: bool) -> None:
    """Train slowly; after every batch the loop receives, save its keys and the factory's state together."""
    from cachefeed._fsutil import atomic_write

    if prefetch:
        fake_prefetch.install()
    received: list[list[str]] = []
    with factory_for(root) as factory:
        for epoch in range(EPOCHS):
            received.append([])
            loader = factory.loader(epoch)
            for batch in DevicePrefetcher(loader, "cuda") if prefetch else loader:
                received[-1] += sample_keys(batch)
                atomic_write(progress, json.dumps({"epochs": received, "state": factory.state_dict()}).encode())
                time.sleep(0.01)  # a training step


def python(code: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    environment = child_env(**(env or {}))
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=environment)


def kill_in_epoch(root: Path, progress: Path, *, epoch: int, batches: int, prefetch: bool) -> dict[str, Any]:
    trainer = python(
        f"from tests.witness.test_resume_promises import trainer_main; "
        f"trainer_main({str(root)!r}, {str(progress)!r}, {prefetch})"
    )

    def far_enough() -> bool:
        if not progress.exists():
            return False
        epochs = json.loads(progress.read_text())["epochs"]
        return len(epochs) > epoch and len(epochs[epoch]) >= batches * BATCH

    try:
        wait_for(far_enough, timeout_s=120, interval_s=0.005, what=f"epoch {epoch}, batch {batches}")
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    saved: dict[str, Any] = json.loads(progress.read_text())
    assert len(saved["epochs"]) == epoch + 1 and saved["state"]["epoch"] == epoch, "killed inside the epoch"
    return saved


def snapshot_keys(root: Path, snap_id: str, witness: SegmentWitness) -> list[str]:
    """The keys of a live snapshot, from its MANIFEST and the witness's reading of its segment files."""
    manifest = msgpack.unpackb((root / "snapshots" / snap_id / "MANIFEST").read_bytes(), raw=False)
    return [key for entry in manifest["segments"] for key in witness.keys[entry[0]]]


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "look-ahead"])
def test_a_killed_trainer_resumes_exactly_the_rest_of_its_epoch(tmp_path: Path, prefetch: bool) -> None:
    daemon = start(tmp_path, remote=make_remote(tmp_path / "data"), grace="60s")
    served = Served()
    with SegmentWitness(daemon.cache_dir) as witness:
        saved = kill_in_epoch(daemon.cache_dir, tmp_path / "progress.json", epoch=1, batches=20, prefetch=prefetch)
        state = saved["state"]
        assert state["batches_consumed"] * BATCH == len(saved["epochs"][1]), "consumed is what the loop received"
        with factory_for(daemon.cache_dir) as factory:
            epoch = factory.load_state_dict(state)
            assert epoch == 1
            loader = factory.loader(epoch)
            whole = snapshot_keys(daemon.cache_dir, state["snapshot_id"], witness)
            rest = [key for batch in loader for key in sample_keys(batch)]
            interrupted = saved["epochs"][1]
            assert not set(rest) & set(interrupted), "no sample twice in the epoch"
            assert sorted(interrupted + rest) == sorted(whole), "the resumed epoch is the rest of the interrupted one"
            served.epochs += [saved["epochs"][0], interrupted + rest]
            for later in range(2, EPOCHS):
                served.epoch(key for batch in factory.loader(later) for key in sample_keys(batch))
        status = final_status(daemon, EPOCHS)
    assert check_promises(witness, served, status)["evicted"] > 0


def job_main(root: str, out: str) -> None:
    """One job of one process (torchrun's default run id): three epochs, reporting each epoch's snapshot."""
    report = []
    with factory_for(root, run_id=None) as factory:
        for epoch in range(3):
            keys = [key for batch in factory.loader(epoch) for key in sample_keys(batch)]
            locks = sorted(p.name for p in (Path(root) / "snapshots").glob("*.lock"))
            report.append({"snapshot": factory.stats(epoch).snapshot_id, "keys": keys, "locks": locks})
            time.sleep(0.3)  # let the other job pin its epoch meanwhile
    Path(out).write_text(json.dumps(report))


def test_two_jobs_with_the_same_run_id_never_share_a_snapshot(tmp_path: Path) -> None:
    daemon: DaemonProcess = start(tmp_path, remote=make_remote(tmp_path / "data"))
    outs = [tmp_path / f"job{n}.json" for n in range(2)]
    env = {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with SegmentWitness(daemon.cache_dir) as witness:
        jobs = [
            python(
                f"from tests.witness.test_resume_promises import job_main; job_main({str(daemon.cache_dir)!r}, "
                f"{str(out)!r})",
                env,
            )
            for out in outs
        ]
        for job in jobs:
            assert job.wait(timeout=180) == 0
        status = final_status(daemon, 6)
    reports = [json.loads(out.read_text()) for out in outs]
    mine = [{epoch["snapshot"] for epoch in report} for report in reports]
    assert not mine[0] & mine[1], f"the jobs pinned the same snapshots: {mine}"
    served = Served([epoch["keys"] for report in reports for epoch in report])
    check_promises(witness, served, status)


def test_a_checkpoint_resumed_with_other_settings_is_refused_or_continued_on_a_fresh_snapshot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = start(tmp_path, remote=make_remote(tmp_path / "data"), grace="60s")
    try:
        with factory_for(daemon.cache_dir, samples_per_epoch=100) as factory:
            batches = iter(factory.loader(0))
            first = [sample_keys(next(batches)) for _ in range(2)]
            state = factory.state_dict()
        for change, message in (
            ({"samples_per_epoch": None}, "samples_per_epoch is 100, this factory's is None"),
            ({"samples_per_epoch": 100, "rank": 0, "world_size": 2}, "world_size is 1, this factory's is 2"),
            ({"samples_per_epoch": 100, "shuffle": False}, "shuffle is True, this factory's is False"),
            ({"samples_per_epoch": 100, "drop_last": True}, "drop_last is False"),
        ):
            settings = {"run_id": "job", **change}
            with factory_for(daemon.cache_dir, **settings) as factory, pytest.raises(ValueError, match=message):
                factory.load_state_dict(state)
        with caplog.at_level(logging.WARNING), factory_for(daemon.cache_dir, samples_per_epoch=120) as factory:
            assert factory.load_state_dict(state, strict=False) == 0
            rest = [key for batch in factory.loader(0) for key in sample_keys(batch)]
        assert len(rest) == 120 - 2 * BATCH, "the consumed batches are skipped: the step count stays right"
        assert len(first) == 2
        assert any("strict=False" in record.getMessage() for record in caplog.records)
    finally:
        assert daemon.stop() == 0, daemon.stderr()
