"""Resume mid-epoch: a trainer SIGKILLed in the middle of an epoch and restarted from its last ``state_dict()``
gets exactly the samples of that epoch it had not received, from the same snapshot, while the daemon keeps the dead
trainer's snapshot (``cache.snapshot_grace``); after the grace, the documented fallback and its log line."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.store import CacheStore
from cachefeed._testing.daemon import DaemonProcess, start_daemon, wait_for
from cachefeed._testing.local_s3 import free_port
from cachefeed._trainer import EpochLoaderFactory
from cachefeed._trainer.wait import fill_reached
from tests.status.test_status import make_document, write_status
from tests.support.cache_helpers import cache_config
from tests.support.child_env import REPO, child_env
from tests.support.file_remote import file_daemon_config, npy_remote
from tests.trainer.test_loader import build_cache, check_batch

SAMPLES = 300
BATCH = 10


def trainer_main(root: str, progress: str, workers: int = 0) -> None:
    """Train epoch 0 slowly; after every batch, save the keys received and the factory's state together."""
    from cachefeed._fsutil import atomic_write

    received: list[str] = []
    with EpochLoaderFactory(
        root, batch_size=BATCH, num_workers=workers, run_id="job", progress=None, epochs=1
    ) as factory:
        for batch in factory.loader(0):
            received += check_batch(batch)
            atomic_write(progress, json.dumps({"keys": received, "state": factory.state_dict()}).encode())
            time.sleep(0.05)  # a training step


def interrupted_trainer_main(root: str, progress: str, workers: int = 0) -> None:
    """Train epoch 0, saving keys and state after every batch; Ctrl-C (KeyboardInterrupt) at the 10th batch, inside
    the factory's ``with`` block, as a user stopping a run by hand."""
    from cachefeed._fsutil import atomic_write

    received: list[str] = []
    with EpochLoaderFactory(
        root, batch_size=BATCH, num_workers=workers, run_id="job", progress=None, min_samples=0, epochs=1
    ) as factory:
        for n, batch in enumerate(factory.loader(0), 1):
            received += check_batch(batch)
            atomic_write(progress, json.dumps({"keys": received, "state": factory.state_dict()}).encode())
            if n == 10:
                raise KeyboardInterrupt


def start_trainer(root: Path, progress: Path, workers: int = 0) -> subprocess.Popen[bytes]:
    code = (
        f"from tests.trainer.test_resume import trainer_main; trainer_main({str(root)!r}, {str(progress)!r}, {workers})"
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=child_env())


def kill_mid_epoch(root: Path, tmp_path: Path, workers: int = 0) -> dict:
    progress = tmp_path / "progress.json"
    trainer = start_trainer(root, progress, workers)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if progress.exists() and len(json.loads(progress.read_text())["keys"]) >= 10 * BATCH:
            break
        time.sleep(0.01)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    saved: dict = json.loads(progress.read_text())
    assert 10 * BATCH <= len(saved["keys"]) < SAMPLES, "killed in the middle of the epoch"
    return saved


def resume(root: Path, saved: dict, workers: int = 0) -> list[str]:
    with EpochLoaderFactory(
        root, batch_size=BATCH, num_workers=workers, run_id="job-restarted", progress=None, epochs=1
    ) as factory:
        epoch = factory.load_state_dict(saved["state"])
        assert epoch == 0
        loader = factory.loader(epoch)
        assert len(loader) == (SAMPLES - len(saved["keys"])) // BATCH
        return [key for batch in loader for key in check_batch(batch)]


@pytest.mark.parametrize("workers", [0, 2])  # in the training process, and through the factory's worker pool
def test_a_killed_trainer_resumes_exactly_the_rest_of_its_epoch_within_the_grace(tmp_path: Path, workers: int) -> None:
    root = build_cache(tmp_path / "c", SAMPLES)
    saved = kill_mid_epoch(root, tmp_path, workers)
    daemon = CacheStore(cache_config(root, snapshot_grace_s=60.0))  # the daemon's sweep, within the grace
    daemon.sweep()
    snap_id = saved["state"]["snapshot_id"]
    assert (root / "snapshots" / f"{snap_id}.lock").exists(), "the dead trainer's snapshot is kept"
    rest = resume(root, saved, workers)
    daemon.close()
    assert not set(rest) & set(saved["keys"]), "no sample twice"
    assert sorted(saved["keys"] + rest) == sorted(f"k{i}" for i in range(SAMPLES)), "the whole epoch, exactly"


def test_a_resume_waits_out_a_sweep_probing_the_kept_snapshot_and_resumes_exactly_the_rest(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", SAMPLES)
    saved = kill_mid_epoch(root, tmp_path)
    evicted = sorted((root / "segments").iterdir())[-1]
    evicted.unlink()  # the cache moved on since the kill: only the kept snapshot still links this segment
    # The daemon's sweep learns that nobody holds a kept snapshot by taking its lock exclusively, for a moment. Here
    # the moment lasts 2 s, as when the machine stops the daemon between that probe and its release.
    probe = os.open(root / "snapshots" / f"{saved['state']['snapshot_id']}.lock", os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    release = threading.Timer(2.0, os.close, (probe,))
    release.start()
    try:
        rest = resume(root, saved)
    finally:
        release.join()
    assert not set(rest) & set(saved["keys"]), "no sample twice"
    assert sorted(saved["keys"] + rest) == sorted(f"k{i}" for i in range(SAMPLES)), "the whole epoch, exactly"


@pytest.mark.parametrize(("daemon_runs", "workers"), [(True, 0), (True, 2), (False, 0)])
def test_a_loop_stopped_by_ctrl_c_resumes_exactly_where_a_daemon_runs(
    tmp_path: Path, daemon_runs: bool, workers: int
) -> None:
    """The ``with`` block closed the factory on the exception, which released the epoch and removed its snapshot:
    the resume ran on a fresh one (other samples). Now the epoch is left for the grace, as a killed trainer's; on a
    static cache (no daemon to remove it later) it is released as before, leaving nothing behind."""
    root = build_cache(tmp_path / "c", SAMPLES)
    daemon = CacheStore(cache_config(root, snapshot_grace_s=300.0)) if daemon_runs else None  # holds the cache
    try:
        progress = tmp_path / "progress.json"
        code = (
            "from tests.trainer.test_resume import interrupted_trainer_main as m; "
            f"m({str(root)!r}, {str(progress)!r}, {workers})"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120
        )
        assert result.returncode != 0 and "KeyboardInterrupt" in result.stderr, result.stderr[-2000:]
        saved = json.loads(progress.read_text())
        assert len(saved["keys"]) == 10 * BATCH
        left = sorted(p.name for p in (root / "snapshots").iterdir())
        if not daemon_runs:
            assert left == [], "a static cache keeps nothing: nobody would remove it"
            return
        assert f"{saved['state']['snapshot_id']}.lock" in left
        rest = resume(root, saved, workers)
        assert not set(rest) & set(saved["keys"]), "the rest of the same epoch: no sample twice"
        assert sorted(saved["keys"] + rest) == sorted(f"k{i}" for i in range(SAMPLES))
    finally:
        if daemon is not None:
            daemon.close()


def test_an_exact_resume_does_not_wait_for_the_cache_to_fill(tmp_path: Path) -> None:
    """A trainer killed early in training, while the daemon still fills the cache: its restart resumes the kept
    snapshot (fixed samples, all cached) at once. It waited for the first epoch's default fill (75%) instead, and
    failed where that took longer than ``wait_timeout_s``."""
    root = build_cache(tmp_path / "c", SAMPLES)
    daemon = CacheStore(cache_config(root, snapshot_grace_s=300.0))  # holds the cache, as a running daemon does
    try:
        progress = tmp_path / "progress.json"
        code = (
            f"from tests.trainer.test_resume import interrupted_trainer_main as m; m({str(root)!r}, {str(progress)!r})"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120
        )
        assert result.returncode != 0 and "KeyboardInterrupt" in result.stderr, result.stderr[-2000:]
        saved = json.loads(progress.read_text())
        # The daemon's word: 10% full, still fetching (neither paced nor done), its heartbeat fresh.
        layout = CacheLayout(root)
        document = make_document(root, cache__fill=0.1, cache__is_paced=False, remote__passes_completed=0)
        write_status(layout, document)
        assert not fill_reached(layout, 0.75, SAMPLES).ready, "a fresh job would wait for the fill"
        with EpochLoaderFactory(
            root, batch_size=BATCH, run_id="job-restarted", progress=None, epochs=1, wait_timeout_s=5.0
        ) as factory:
            epoch = factory.load_state_dict(saved["state"])
            rest = [key for batch in factory.loader(epoch) for key in check_batch(batch)]
        assert not set(rest) & set(saved["keys"]), "the rest of the same epoch: no sample twice"
        assert sorted(saved["keys"] + rest) == sorted(f"k{i}" for i in range(SAMPLES))
    finally:
        daemon.close()


def test_after_the_grace_the_epoch_resumes_on_a_fresh_snapshot_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = build_cache(tmp_path / "c", SAMPLES)
    saved = kill_mid_epoch(root, tmp_path)
    daemon = CacheStore(cache_config(root, snapshot_grace_s=0.0))  # the grace is over
    daemon.close()
    assert not (root / "snapshots" / f"{saved['state']['snapshot_id']}.lock").exists()
    with caplog.at_level(logging.WARNING, logger="cachefeed.trainer.loader"):
        rest = resume(root, saved)
    assert len(rest) == SAMPLES - len(saved["keys"]), "the step count stays right"
    (warning,) = [r.getMessage() for r in caplog.records if "resuming epoch 0 on a fresh snapshot" in r.getMessage()]
    assert f"its snapshot {saved['state']['snapshot_id']!r} is gone" in warning, "not: is the creating rank running?"


def test_a_resume_on_a_cache_no_daemon_keeps_says_why_its_snapshot_is_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A static cache: no daemon keeps a stopped trainer's snapshot, and Ctrl-C releases it. The warning named
    ``cache.snapshot_grace``, a setting such a cache does not have."""
    root = build_cache(tmp_path / "c", SAMPLES)
    assert not CacheLayout(root).has_writer()
    keys: list[str] = []
    with pytest.raises(KeyboardInterrupt), EpochLoaderFactory(root, batch_size=BATCH, run_id="static") as factory:
        for batch in factory.loader(0):
            keys += check_batch(batch)
            state = factory.state_dict()
            if len(keys) >= 3 * BATCH:
                raise KeyboardInterrupt
    with caplog.at_level(logging.WARNING):
        rest = resume(root, {"state": state, "keys": keys})
    assert len(rest) == SAMPLES - len(keys), "the step count stays right"
    (warning,) = [r.getMessage() for r in caplog.records if "resuming epoch 0 on a fresh snapshot" in r.getMessage()]
    assert "snapshot_grace" not in warning and "no daemon runs on this cache to keep it" in warning, warning


@pytest.mark.parametrize("workers", [0, 2])
def test_a_checkpoint_saved_at_the_end_of_an_epoch_resumes_with_the_next_one(tmp_path: Path, workers: int) -> None:
    """The loop received every batch of epoch 0 and saved: resuming ran epoch 0 again, empty, and with it the
    loop's end-of-epoch code (a scheduler step, an evaluation); now it continues with epoch 1, whole."""
    root = build_cache(tmp_path / "c", 50)
    with EpochLoaderFactory(root, batch_size=BATCH, num_workers=workers, run_id="a", progress=None) as factory:
        loader = factory.loader(0)
        batches = iter(loader)
        next(batches)
        assert factory.state_dict()["epoch"] == 0, "in the middle of the epoch: that epoch"
        rest = list(batches)
        assert len(rest) == len(loader) - 1
        state = factory.state_dict()
    assert (state["epoch"], state["batches_consumed"], state["snapshot_id"]) == (1, 0, None)
    with EpochLoaderFactory(root, batch_size=BATCH, num_workers=workers, run_id="b", progress=None) as factory:
        epoch = factory.load_state_dict(state)
        assert epoch == 1
        keys = [key for batch in factory.loader(epoch) for key in check_batch(batch)]
    assert len(keys) == len(set(keys)) == 50


def test_what_an_epoch_served_is_recorded_when_its_pass_ends_not_only_at_its_release(tmp_path: Path) -> None:
    """A checkpoint at the epoch's end names the next epoch: a run killed before the release (an evaluation between
    epochs) is never resumed into this epoch, so its reads must be on record already."""
    from cachefeed._cache.reads import SERVED_PREFIX

    root = build_cache(tmp_path / "c", 50)
    with EpochLoaderFactory(root, batch_size=BATCH, run_id="a", progress=None) as factory:
        directory = root / "snapshots" / factory.loader(0).snapshot_id
        for _ in factory.loader(0):
            pass
        assert factory.state_dict()["epoch"] == 1
        deadline = time.monotonic() + 10  # recorded on the teardown thread, after the handover's hold
        while not any(p.name.startswith(SERVED_PREFIX) for p in directory.iterdir()):
            assert time.monotonic() < deadline, "nothing recorded while the epoch is still pinned"
            time.sleep(0.05)


@pytest.mark.parametrize("code", [0, None])
def test_a_clean_sys_exit_inside_the_with_block_releases_the_epoch(tmp_path: Path, code: int | None) -> None:
    root = build_cache(tmp_path / "c", 50)
    daemon = CacheStore(cache_config(root, snapshot_grace_s=300.0))
    try:
        with pytest.raises(SystemExit):
            with EpochLoaderFactory(root, batch_size=BATCH, run_id="a", progress=None, min_samples=0) as factory:
                next(iter(factory.loader(0)))
                sys.exit(code)
        assert [p for p in (root / "snapshots").iterdir() if p.name.endswith(".lock")] == []
    finally:
        daemon.close()


def test_a_state_at_an_epochs_start_is_accepted_whatever_changed(tmp_path: Path) -> None:
    """Nothing inside an epoch to resume: a restart at an epoch boundary may change the batch size or world size."""
    root = build_cache(tmp_path / "c", 50)
    with EpochLoaderFactory(root, batch_size=BATCH, progress=None) as factory:
        for _ in factory.loader(0):
            pass
        state = factory.state_dict()
    with EpochLoaderFactory(root, batch_size=2 * BATCH, progress=None) as factory:
        assert factory.load_state_dict(state) == 1


def test_a_malformed_checkpoint_is_refused_naming_what_is_wrong(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 50)
    with EpochLoaderFactory(root, batch_size=BATCH, progress=None) as factory:
        next(iter(factory.loader(0)))
        state = factory.state_dict()
    with EpochLoaderFactory(root, batch_size=BATCH, progress=None) as factory:
        with pytest.raises(ValueError, match="expected the dict state_dict\\(\\) returned, got NoneType"):
            factory.load_state_dict(None)  # type: ignore[arg-type]
        for key, value in (("batches_consumed", -5), ("epoch", 1.7), ("epoch", "1"), ("epoch", -3)):
            with pytest.raises(ValueError, match=f"'{key}' is {value!r}, expected an integer >= 0"):
                factory.load_state_dict({**state, key: value})
        with pytest.raises(ValueError, match="'settings' is NoneType"):
            factory.load_state_dict({**state, "settings": None})


def test_a_checkpoint_from_other_settings_is_refused(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 50)
    with EpochLoaderFactory(root, batch_size=BATCH, seed=7, progress=None) as factory:
        next(iter(factory.loader(0)))
        state = factory.state_dict()
    with EpochLoaderFactory(root, batch_size=BATCH, progress=None) as factory:
        with pytest.raises(ValueError, match="seed is 7, this factory's is 0"):
            factory.load_state_dict(state)
        with pytest.raises(ValueError, match="'epoch' is missing"):
            factory.load_state_dict({"version": 2})
        old = {"version": 1, "epoch": 2, "batches_consumed": 3, "seed": 0, "snapshot_id": "x", "batch_size": BATCH}
        with pytest.raises(ValueError, match="older cachefeed"):
            factory.load_state_dict(old)


def two_ranks_main(root: str, port: int, rank: int, out: str, resume_from: str | None = None) -> None:
    """One of two gloo ranks on one node reading epoch 0, keys and state saved after every batch. Rank 1 is stopped by
    Ctrl-C after 3 batches, inside the factory's ``with`` block; rank 0 reads its whole share and closes its factory
    only once rank 1 has left (the barrier). With ``resume_from``, both ranks resume from that state instead."""
    import torch.distributed as dist

    from cachefeed._fsutil import atomic_write

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    received: list[str] = []
    try:
        with EpochLoaderFactory(
            root, batch_size=BATCH, run_id="job", progress=None, min_samples=0, epochs=1
        ) as factory:
            if resume_from is not None:
                factory.load_state_dict(json.loads(Path(resume_from).read_text())["state"])
            for n, batch in enumerate(factory.loader(0), 1):
                received += check_batch(batch)
                atomic_write(out, json.dumps({"keys": received, "state": factory.state_dict()}).encode())
                if rank == 1 and resume_from is None and n == 3:
                    raise KeyboardInterrupt
            dist.barrier()  # rank 0: release only after rank 1 left its epoch
    finally:
        if rank == 1 and resume_from is None:
            dist.barrier()


def test_a_rank_stopped_by_ctrl_c_resumes_exactly_though_another_rank_released_the_epoch_last(
    tmp_path: Path,
) -> None:
    """Rank 0 finished its share and released the epoch after rank 1 had left it for a resume: as the last holder it
    removed the snapshot, and rank 1's resume read other samples. Now the snapshot stays for the daemon's grace and
    both ranks resume on it: rank 1 gets exactly the rest of its share."""
    root = build_cache(tmp_path / "c", SAMPLES)
    daemon = CacheStore(cache_config(root, snapshot_grace_s=300.0))  # holds the cache
    try:

        def run_ranks(outs: list[Path], resume_from: Path | None) -> list[subprocess.CompletedProcess[str]]:
            port = free_port()
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        "from tests.trainer.test_resume import two_ranks_main as m; "
                        f"m({str(root)!r}, {port}, {rank}, {str(outs[rank])!r}, "
                        f"{str(resume_from) if resume_from else None!r})",
                    ],
                    cwd=REPO,
                    env=child_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for rank in range(2)
            ]
            results = []
            for proc in procs:
                stdout, stderr = proc.communicate(timeout=120)
                results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
            return results

        first = run_ranks([tmp_path / "r0.json", tmp_path / "r1.json"], None)
        assert first[0].returncode == 0, first[0].stderr[-2000:]
        assert first[1].returncode != 0 and "KeyboardInterrupt" in first[1].stderr, first[1].stderr[-2000:]
        stopped = json.loads((tmp_path / "r1.json").read_text())
        done = json.loads((tmp_path / "r0.json").read_text())
        assert len(stopped["keys"]) == 3 * BATCH and len(done["keys"]) == SAMPLES // 2
        snap_id = stopped["state"]["snapshot_id"]
        assert (root / "snapshots" / f"{snap_id}.lock").exists(), "rank 0's release left rank 1's epoch in place"

        again = run_ranks([tmp_path / "again0.json", tmp_path / "again1.json"], tmp_path / "r1.json")
        assert [r.returncode for r in again] == [0, 0], again[0].stderr[-2000:] + again[1].stderr[-2000:]
        rest = json.loads((tmp_path / "again1.json").read_text())["keys"]
        assert not set(rest) & set(stopped["keys"]), "the rest of the same epoch: no sample twice"
        assert len(stopped["keys"]) + len(rest) == SAMPLES // 2, "rank 1's whole share"
        assert not set(stopped["keys"] + rest) & set(done["keys"]), "and only rank 1's: the same snapshot's split"
    finally:
        daemon.close()


def test_on_a_static_cache_a_dead_trainers_snapshot_is_kept_for_the_grace_then_removed_by_the_next_factory(
    tmp_path: Path,
) -> None:
    """No daemon holds a static cache, and nothing removed what a killed trainer left there: its snapshot directory
    stayed for good. A factory starting on such a cache now removes the snapshots nobody holds whose trainer showed
    no progress for the daemon's default grace (5 min), and keeps the others, for a resume."""
    root = build_cache(tmp_path / "c", SAMPLES)
    saved = kill_mid_epoch(root, tmp_path)  # SIGKILL mid-epoch, no daemon
    rest = resume(root, saved)  # within the grace: kept, and resumed exactly
    assert sorted(saved["keys"] + rest) == sorted(f"k{i}" for i in range(SAMPLES))
    (tmp_path / "progress.json").unlink()
    saved = kill_mid_epoch(root, tmp_path)  # another trainer, killed too
    lock = root / "snapshots" / f"{saved['state']['snapshot_id']}.lock"
    assert lock.exists()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))  # its trainer's last progress
    EpochLoaderFactory(root, batch_size=BATCH, run_id="later", progress=None).close()
    assert sorted(p.name for p in (root / "snapshots").iterdir()) == [], "removed: the lock and the directory"


def cached_remote(tmp_path: Path, name: str, objects: int) -> DaemonProcess:
    """A daemon that cached a ``file://`` remote ``name`` of ``objects`` .npy files (it writes ``made_with.json``)."""
    remote = npy_remote(tmp_path / name, objects, values=4, prefix=f"{name}-")
    cache = tmp_path / f"{name}-cache"
    daemon = start_daemon(file_daemon_config(tmp_path / f"{name}.toml", remote, cache), cache, tmp_path / f"{name}.err")
    daemon.wait_status(lambda d: d["cache"]["samples"] >= objects, timeout_s=60, what=f"{name} cached")
    return daemon


def test_a_checkpoint_resumed_on_a_cache_of_other_data_is_refused_naming_both(tmp_path: Path) -> None:
    """The audit: a trainer killed on one cache and resumed with its checkpoint on another (another daemon, another
    remote) was told the epoch's snapshot "is gone" and trained on the other data with no error, while the first
    cache still kept the snapshot. The checkpoint now names what its cache held samples of."""
    first, other = cached_remote(tmp_path, "first", 40), cached_remote(tmp_path, "other", 40)
    try:
        with EpochLoaderFactory(first.cache_dir, batch_size=BATCH, run_id="job", progress=None) as factory:
            loop = iter(factory.loader(0))
            received = [str(key) for key in next(loop)["__key__"]]
            state = factory.state_dict()
        assert all(key.startswith("first-") for key in received)
        with EpochLoaderFactory(other.cache_dir, batch_size=BATCH, run_id="job", progress=None) as factory:
            with pytest.raises(ValueError) as refused:
                factory.load_state_dict(state)
        message = str(refused.value)
        assert "the checkpoint was taken on a cache of" in message and (tmp_path / "first").as_uri() in message
        assert (tmp_path / "other").as_uri() in message and "Point the factory at the cache" in message, message
        with EpochLoaderFactory(first.cache_dir, batch_size=BATCH, run_id="job", progress=None) as factory:
            assert factory.load_state_dict(state) == 0  # its own cache: accepted
            for _batch in factory.loader(0):
                pass
            at_next_epoch = factory.state_dict()  # at an epoch's start: other settings are accepted, not the data
        assert at_next_epoch["snapshot_id"] is None and at_next_epoch["epoch"] == 1
        with EpochLoaderFactory(other.cache_dir, batch_size=BATCH, run_id="job", progress=None) as factory:
            with pytest.raises(ValueError, match="the checkpoint was taken on a cache of"):
                factory.load_state_dict(at_next_epoch)
            assert factory.load_state_dict(at_next_epoch, strict=False) == 1
    finally:
        assert first.stop() == 0 and other.stop() == 0


def prepared_ahead_main(root: str, progress: str) -> None:
    """Read epoch 0 slowly, its next epoch prepared (pinned) early on; keys and state saved after every batch."""
    from cachefeed._fsutil import atomic_write

    received: list[str] = []
    with EpochLoaderFactory(root, batch_size=4, run_id="job", progress=None, epochs=2, prepare_at=0.1) as factory:
        for batch in factory.loader(0):
            received += [str(key) for key in batch["__key__"]]
            atomic_write(progress, json.dumps({"keys": received, "state": factory.state_dict()}).encode())
            time.sleep(0.5)  # a training step: the epoch lasts 5 s, the test kills it after 2 batches


def test_the_epoch_a_killed_trainer_prepared_ahead_is_not_kept_for_a_resume_that_cannot_join_it(
    tmp_path: Path,
) -> None:
    """The audit: a trainer killed in the second half of an epoch had pinned the next one ahead; no checkpoint names
    an epoch its loop never began, so no resume could join it, yet the daemon kept it for ``cache.snapshot_grace``
    (5 minutes), its room pinned: after a few kills, the daemon back-pressured on snapshots nobody would read.
    Witness: the snapshot directories in the cache."""
    daemon = cached_remote(tmp_path, "data", 40)
    snapshots = daemon.cache_dir / "snapshots"

    def epoch_dirs(epoch: int) -> list[Path]:
        return [path for path in snapshots.glob(f"*-e{epoch:06d}") if path.is_dir()]

    progress = tmp_path / "progress.json"
    code = (
        "from tests.trainer.test_resume import prepared_ahead_main; "
        f"prepared_ahead_main({str(daemon.cache_dir)!r}, {str(progress)!r})"
    )
    trainer = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=child_env())
    try:
        wait_for(
            lambda: bool(epoch_dirs(1)) and progress.exists() and len(json.loads(progress.read_text())["keys"]) >= 8,
            timeout_s=60,
            what="epoch 1 pinned ahead while epoch 0 is read",
        )
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        [ahead] = epoch_dirs(1)
        wait_for(lambda: not ahead.exists(), timeout_s=15, what=f"the never-read {ahead.name} removed by the daemon")
        [interrupted] = epoch_dirs(0)  # the epoch the loop began stays for its resume
        document = daemon.wait_status(
            lambda d: [s["kept_for_resume"] for s in d["cache"]["snapshots"]] == [True],
            timeout_s=15,
            what="the begun epoch kept for a resume",
        )
        assert document["cache"]["snapshots"][0]["id"] == interrupted.name and interrupted.exists()
        saved = json.loads(progress.read_text())
        with EpochLoaderFactory(daemon.cache_dir, batch_size=4, run_id="job-restarted", progress=None) as factory:
            assert factory.load_state_dict(saved["state"]) == 0
            rest = [str(key) for batch in factory.loader(0) for key in batch["__key__"]]
        assert sorted(saved["keys"] + rest) == sorted(f"data-{i:03d}.npy" for i in range(40)), "resumed exactly"
    finally:
        trainer.kill()
        assert daemon.stop() == 0
