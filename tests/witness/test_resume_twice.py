"""An epoch interrupted twice: a trainer killed mid-epoch, resumed from its last ``state_dict()``, killed again in the
same epoch and resumed again from the resumed run's last ``state_dict()``.

The resumed run's checkpoint counted only the batches received since the resume: the third run skipped too few and
served a whole batch again (on the same snapshot and on a fresh one alike), and a checkpoint saved right after
``load_state_dict()`` named epoch 0 at its start. Now the epoch counts on from its checkpoint, and a resume the loop
has not moved past is what ``state_dict()`` says.

Witnesses, outside the bookkeeping under test: the keys the three runs' loops received, the keys the cache's
segment files hold (``SegmentWitness``: the remote fits the cache, so every epoch is all of it) and the batch count
of a run of the epoch never killed. Real components: a daemon on a ``file://`` remote and trainer processes with
two DataLoader workers each, killed by SIGKILL, ended by ``os._exit`` (a crash that runs no cleanup) or stopped by
Ctrl-C (``KeyboardInterrupt``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cachefeed._fsutil import atomic_write
from cachefeed._testing.daemon import DaemonProcess, wait_for
from cachefeed._testing.witness import SegmentWitness, sample_keys
from cachefeed._trainer import DevicePrefetcher, EpochLoaderFactory
from tests.support import fake_prefetch
from tests.support.child_env import REPO, child_env
from tests.witness.test_promises import PER_OBJECT, make_remote, start

OBJECTS = 30
SAMPLES = OBJECTS * PER_OBJECT  # all of the remote, cached whole: every epoch is exactly these samples
BATCH = 20
KILL_AFTER = 5  # batches a run's loop receives before it is killed
SHORT_GRACE = "4s"  # long enough for a started trainer to resume, short enough to wait out


def factory_for(root: str | Path, **settings: Any) -> EpochLoaderFactory:
    options: dict[str, Any] = {
        "batch_size": BATCH,
        "samples_per_epoch": SAMPLES,
        "min_samples": SAMPLES,
        "run_id": "job",
        "progress": None,
        "epochs": 1,
    }
    return EpochLoaderFactory(root, **{**options, **settings})


def trainer_main(root: str, out: str, prefetch: bool, exit_at: str | None, hold_after: int | None) -> None:
    """One run of epoch 0 with two workers (``Progress`` says what it saves, when, and how it ends early). It says
    it is ready (``<out>.ready``), then waits for ``<out>.go``: the state to resume, or null."""
    if prefetch:
        fake_prefetch.install()
    try:
        with factory_for(root, num_workers=2) as factory:
            atomic_write(out + ".ready", b"")
            go = Path(out + ".go")
            while not go.exists():
                time.sleep(0.01)
            state = json.loads(go.read_text())
            progress = Progress(factory, out, exit_at, hold_after)
            start = factory.load_state_dict(state) if state is not None else 0
            progress.save("loaded")
            loader = factory.loader(start)
            progress.snapshot = loader.snapshot_id
            progress.save("loader")
            batches = iter(DevicePrefetcher(loader, "cuda") if prefetch else loader)
            progress.save("iter")
            for batch in batches:
                progress.received += sample_keys(batch)
                progress.save("batch")
                time.sleep(0.02)  # a training step
    except KeyboardInterrupt:
        pass  # exit_at "ctrl-c": the loop left the factory's with block by it, as a user stopping a run by hand


class Progress:
    """A run's record, saved to ``out`` after ``load_state_dict``, after ``loader()``, after ``iter()`` and after
    every batch: the keys its loop received and the factory's state, together. ``exit_at`` ends the run at a stage
    ("loaded", "loader", "iter"): by ``os._exit`` (a crash, no cleanup), or "ctrl-c" by ``KeyboardInterrupt`` after
    ``iter()``. After ``hold_after`` batches it says so (``<out>.held``) and waits to be killed."""

    def __init__(self, factory: EpochLoaderFactory, out: str, exit_at: str | None, hold_after: int | None) -> None:
        self.factory, self.out, self.exit_at, self.hold_after = factory, out, exit_at, hold_after
        self.received: list[str] = []
        self.snapshot: str | None = None

    def save(self, stage: str) -> None:
        document = {"keys": self.received, "state": self.factory.state_dict(), "snapshot": self.snapshot}
        atomic_write(self.out, json.dumps(document).encode())
        if stage == self.exit_at:
            os._exit(0)
        if stage == "iter" and self.exit_at == "ctrl-c":
            raise KeyboardInterrupt
        if stage == "batch" and len(self.received) == (self.hold_after or 0) * BATCH:
            atomic_write(self.out + ".held", b"")
            time.sleep(3600)


class Run:
    """A trainer process started ahead (its imports and factory ready), told when to go and from which state."""

    def __init__(
        self, root: Path, out: Path, *, prefetch: bool, exit_at: str | None = None, hold_after: int | None = None
    ) -> None:
        self.out = out
        code = (
            "from tests.witness.test_resume_twice import trainer_main; "
            f"trainer_main({str(root)!r}, {str(out)!r}, {prefetch}, {exit_at!r}, {hold_after!r})"
        )
        self.process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=child_env(), start_new_session=True)
        wait_for(self._ready, timeout_s=120, what=f"trainer {out.name} ready")

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"trainer {self.out.name} exited with {self.process.returncode} before it was told")
        return Path(f"{self.out}.ready").exists()

    def go(self, state: dict[str, Any] | None) -> None:
        atomic_write(f"{self.out}.go", json.dumps(state).encode())

    def progress(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.out.read_text()) if self.out.exists() else {"keys": []}
        return document

    def kill_when_held(self) -> dict[str, Any]:
        """SIGKILL the run (its workers too) once it holds after ``hold_after`` batches: its last saved progress."""

        def held() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"trainer {self.out.name} exited with {self.process.returncode} before it held")
            return Path(f"{self.out}.held").exists()

        try:
            wait_for(held, timeout_s=120, what=f"trainer {self.out.name} holding")
        finally:
            self.stop()
        return self.progress()

    def finish(self) -> dict[str, Any]:
        assert self.process.wait(timeout=120) == 0
        return self.progress()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def kept(root: Path, snap_id: str) -> bool:
    return (root / "snapshots" / f"{snap_id}.lock").exists()


def never_killed_batches(root: Path) -> int:
    """The batch count of epoch 0 read through by a run never killed."""
    with factory_for(root, run_id="reference") as factory:
        return sum(1 for _batch in factory.loader(0))


def started_daemon(tmp_path: Path, grace: str) -> DaemonProcess:
    daemon = start(tmp_path, remote=make_remote(tmp_path / "data", OBJECTS), grace=grace)
    try:
        daemon.wait_status(lambda doc: doc["cache"]["samples"] >= SAMPLES, timeout_s=120, what="the remote cached")
    except BaseException:
        daemon.stop()
        raise
    return daemon


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "look-ahead"])
def test_an_epoch_killed_twice_and_resumed_on_its_snapshot_serves_each_sample_once(
    tmp_path: Path, prefetch: bool
) -> None:
    daemon = started_daemon(tmp_path, grace="60s")
    runs: list[Run] = []
    try:
        with SegmentWitness(daemon.cache_dir) as witness:
            runs = [
                Run(daemon.cache_dir, tmp_path / f"run{n}.json", prefetch=prefetch, hold_after=hold)
                for n, hold in enumerate((KILL_AFTER, KILL_AFTER, None))
            ]
            runs[0].go(None)
            first = runs[0].kill_when_held()
            runs[1].go(first["state"])
            second = runs[1].kill_when_held()
            runs[2].go(second["state"])
            third = runs[2].finish()
            assert first["snapshot"] == second["snapshot"] == third["snapshot"], "each resume joined the snapshot"
            everything = witness.all_keys()
        reference = never_killed_batches(daemon.cache_dir)
    finally:
        for run in runs:
            run.stop()
        assert daemon.stop() == 0, daemon.stderr()
    assert len(everything) == SAMPLES, "the cache holds the whole remote: every epoch is all of it"
    received = first["keys"] + second["keys"] + third["keys"]
    assert sorted(received) == sorted(everything), "the epoch's samples, each exactly once across the three runs"
    assert len(received) == reference * BATCH, "as many batches as a run never killed"


@pytest.mark.parametrize("third", ["within the grace", "after the grace"])
def test_an_epoch_killed_twice_and_resumed_on_a_fresh_snapshot_keeps_its_step_count(tmp_path: Path, third: str) -> None:
    """The first resume comes after the grace: a fresh snapshot, its first batches skipped. The second resumes on
    that snapshot (its rest, exactly) or, after the grace again, on another fresh one."""
    daemon = started_daemon(tmp_path, grace=SHORT_GRACE)
    runs: list[Run] = []
    try:
        runs.append(Run(daemon.cache_dir, tmp_path / "run0.json", prefetch=True, hold_after=KILL_AFTER))
        runs[0].go(None)
        first = runs[0].kill_when_held()
        wait_for(lambda: not kept(daemon.cache_dir, first["snapshot"]), timeout_s=60, what="the grace over")
        runs.append(Run(daemon.cache_dir, tmp_path / "run1.json", prefetch=True, hold_after=KILL_AFTER))
        runs[1].go(first["state"])
        runs.append(Run(daemon.cache_dir, tmp_path / "run2.json", prefetch=True))  # ready before the kill
        second = runs[1].kill_when_held()
        if third == "after the grace":
            wait_for(lambda: not kept(daemon.cache_dir, second["snapshot"]), timeout_s=60, what="the grace over")
        runs[2].go(second["state"])
        last = runs[2].finish()
        reference = never_killed_batches(daemon.cache_dir)
    finally:
        for run in runs:
            run.stop()
        assert daemon.stop() == 0, daemon.stderr()
    assert second["snapshot"] != first["snapshot"], "the first resume ran on a fresh snapshot"
    assert (last["snapshot"] == second["snapshot"]) == (third == "within the grace")
    batches = [len(run["keys"]) // BATCH for run in (first, second, last)]
    assert sum(batches) == reference, f"as many batches as a run never killed: {batches} against {reference}"
    if third == "within the grace":
        rest = second["keys"] + last["keys"]
        assert len(set(rest)) == len(rest), "the fresh snapshot's rest of the epoch, each sample once"


@pytest.mark.parametrize(
    "exit_at",
    # "loader" and "iter" walk the path "loaded" does, a step later: in the slow run only (-m slow)
    ["loaded", pytest.param("loader", marks=pytest.mark.slow), pytest.param("iter", marks=pytest.mark.slow), "ctrl-c"],
)
def test_a_checkpoint_saved_before_the_resumed_runs_first_batch_resumes_where_it_was_loaded(
    tmp_path: Path, exit_at: str
) -> None:
    """The second run crashes right after ``load_state_dict()``, after ``loader()`` or after ``iter()``, or is
    stopped by Ctrl-C after ``iter()`` (its epoch left to the daemon for a resume), having saved a checkpoint there;
    the third resumes from that checkpoint, on the interrupted epoch's snapshot."""
    daemon = started_daemon(tmp_path, grace="60s")
    runs: list[Run] = []
    try:
        with SegmentWitness(daemon.cache_dir) as witness:
            runs.append(Run(daemon.cache_dir, tmp_path / "run0.json", prefetch=False, hold_after=KILL_AFTER))
            runs.append(Run(daemon.cache_dir, tmp_path / "run1.json", prefetch=False, exit_at=exit_at))
            runs.append(Run(daemon.cache_dir, tmp_path / "run2.json", prefetch=False))
            runs[0].go(None)
            first = runs[0].kill_when_held()
            runs[1].go(first["state"])
            second = runs[1].finish()
            runs[2].go(second["state"])
            third = runs[2].finish()
            everything = witness.all_keys()
        reference = never_killed_batches(daemon.cache_dir)
    finally:
        for run in runs:
            run.stop()
        assert daemon.stop() == 0, daemon.stderr()
    assert second["keys"] == [], "the second run received no batch"
    assert third["snapshot"] == first["snapshot"], "the third run resumed on the interrupted epoch's snapshot"
    received = first["keys"] + third["keys"]
    assert sorted(received) == sorted(everything), "the epoch's samples, each exactly once across the runs"
    assert len(received) == reference * BATCH, "as many batches as a run never killed"
