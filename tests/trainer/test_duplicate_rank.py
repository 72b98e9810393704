"""Two processes given the same rank: a launcher that set no ``RANK``/``LOCAL_RANK``, so both default to rank 0 of
``world_size=2``. Each read the same half of every epoch's snapshot and nothing said so: half the samples were read
twice, the other half never. Now the second is refused before it serves a batch, naming the rank, the world size
and what to check; the first reads its share undisturbed (NOTE [ Snapshot pinning protocol ], "Rank claims"). A
rank restarted while its predecessor still exits is not such a second process: it waits for the claim
(``CLAIM_WAIT_S``), saying so, and reads its share.

Real components: a daemon (``python -m cachefeed daemon``) on a ``file://`` remote, and two trainer processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefeed._cache import snapshots
from cachefeed._cache.snapshots import CLAIM_WAIT_S, Snapshot
from cachefeed._testing.daemon import DaemonProcess, start_daemon, wait_for
from tests.support.child_env import REPO, child_env
from tests.support.file_remote import file_daemon_config, npy_remote
from tests.trainer.test_loader import build_cache

OBJECTS = 120
BATCH = 10


def trainer_main(cache_dir: str, out: str, wait_for_file: str | None, hold_after: str | None = None) -> None:
    """Read epoch 0 as rank 0 of 2 (explicit ``rank=``/``world_size=``); write the keys received and the error, if
    any, to ``out``. With ``wait_for_file``: after the first batch, hold the epoch until that file exists. With
    ``hold_after``: once the epoch is read and the factory closed (``out`` + ".done"), live on until that file
    exists."""
    from cachefeed import EpochLoaderFactory
    from cachefeed._errors import SnapshotError
    from cachefeed._fsutil import atomic_write

    keys: list[str] = []
    error = None
    try:
        with EpochLoaderFactory(
            cache_dir, batch_size=BATCH, rank=0, world_size=2, run_id="job", progress=None, epochs=1
        ) as factory:
            for batch in factory.loader(0):
                keys += [str(key) for key in batch["__key__"]]
                if wait_for_file is not None and len(keys) == BATCH:
                    atomic_write(out + ".reading", b"")
                    deadline = time.monotonic() + 60
                    while not Path(wait_for_file).exists() and time.monotonic() < deadline:
                        time.sleep(0.02)
    except SnapshotError as exc:
        error = str(exc)
    if hold_after is not None:  # a rank gone on to its evaluation: alive, its share read, its epoch released
        atomic_write(out + ".done", json.dumps(keys).encode())
        deadline = time.monotonic() + 60
        while not Path(hold_after).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    atomic_write(out, json.dumps({"keys": keys, "error": error}).encode())


def start_trainer(
    cache_dir: Path,
    out: Path,
    wait_for_file: Path | None = None,
    stderr: Path | None = None,
    hold_after: Path | None = None,
) -> subprocess.Popen[bytes]:
    """``trainer_main`` in a process of its own; its stderr (its log) to the file ``stderr`` if given."""
    waiting = str(wait_for_file) if wait_for_file is not None else None
    holding = str(hold_after) if hold_after is not None else None
    code = (
        "from tests.trainer.test_duplicate_rank import trainer_main; "
        f"trainer_main({str(cache_dir)!r}, {str(out)!r}, {waiting!r}, {holding!r})"
    )
    if stderr is None:
        return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=child_env())
    with open(stderr, "wb") as err:
        return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=child_env(), stderr=err)


def start_second(cache_dir: Path, out: Path, log: Path) -> subprocess.Popen[bytes]:
    """A second process given rank 0, once it has found the rank claimed (its log says it waits), or ended."""
    second = start_trainer(cache_dir, out, stderr=log)
    wait_for(
        lambda: "waiting up to" in log.read_text() or second.poll() is not None,
        timeout_s=60,
        what="the second process to find its rank claimed",
    )
    return second


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    """A daemon that cached a ``file://`` remote of ``OBJECTS`` .npy files (object ``i`` holds ``i``)."""
    remote = npy_remote(tmp_path / "remote", OBJECTS)
    config = file_daemon_config(tmp_path / "daemon.toml", remote, tmp_path / "cache", {"sampler": {"concurrency": 4}})
    process = start_daemon(config, tmp_path / "cache", tmp_path / "daemon.err")
    try:
        process.wait_status(lambda d: d["cache"]["samples"] >= OBJECTS, timeout_s=60, what="the remote cached")
        yield process
    finally:
        process.stop()


def test_a_second_process_given_the_same_rank_is_refused_before_it_serves_a_batch(
    tmp_path: Path, daemon: DaemonProcess
) -> None:
    first_out, second_out, second_log = tmp_path / "first.json", tmp_path / "second.json", tmp_path / "second.log"
    first = start_trainer(daemon.cache_dir, first_out, wait_for_file=second_out)
    try:
        wait_for(Path(f"{first_out}.reading").exists, timeout_s=60, what="the first process to read epoch 0")
        second = start_second(daemon.cache_dir, second_out, second_log)
        found_claimed = time.monotonic()
        assert second.wait(timeout=60) == 0
        refused_in = time.monotonic() - found_claimed
        assert first.wait(timeout=60) == 0
    finally:
        first.kill()
    refused = json.loads(second_out.read_text())
    read = json.loads(first_out.read_text())
    assert refused["keys"] == [], "the second process served no batch"
    error = refused["error"]
    assert error is not None, f"the second process read {len(refused['keys'])} samples, the first's share"
    assert f"pid {first.pid} on" in error, error
    for told in ("rank=0", "world_size=2", "RANK and LOCAL_RANK"):
        assert told in error, error
    assert f"for the last {CLAIM_WAIT_S:.0f} s" in error, error
    assert refused_in < 2 * CLAIM_WAIT_S, f"refused once the claim's wait is over, not a timeout ({refused_in:.0f}s)"
    assert len(read["keys"]) == len(set(read["keys"])) == OBJECTS // 2, "the first read its share, undisturbed"


def test_a_second_process_given_the_same_rank_is_refused_though_the_first_read_its_share_while_it_waited(
    tmp_path: Path, daemon: DaemonProcess
) -> None:
    """A short epoch: the first process reads its whole share and goes on (to its evaluation, its next epoch)
    while the second waits for the claim. The claim was dropped with the first one's pin, so the second took it
    over and read the same share again (the audit: 23 of 23 samples twice, rank 1's never, both exiting 0)."""
    first_out, second_out, second_log = tmp_path / "first.json", tmp_path / "second.json", tmp_path / "second.log"
    go_on = tmp_path / "go-on"
    first = start_trainer(daemon.cache_dir, first_out, wait_for_file=go_on, hold_after=second_out)
    try:
        wait_for(Path(f"{first_out}.reading").exists, timeout_s=60, what="the first process to read epoch 0")
        second = start_second(daemon.cache_dir, second_out, second_log)
        go_on.write_bytes(b"")  # the first reads the rest of its share, closes its factory, and lives on
        wait_for(Path(f"{first_out}.done").exists, timeout_s=60, what="the first process to read its share")
        assert second.wait(timeout=60) == 0
        assert first.wait(timeout=60) == 0
    finally:
        first.kill()
    refused = json.loads(second_out.read_text())
    read = json.loads(first_out.read_text())
    assert len(read["keys"]) == len(set(read["keys"])) == OBJECTS // 2, "the first read its share"
    assert not set(refused["keys"]) & set(read["keys"]), f"the second read {len(refused['keys'])} of them again"
    assert refused["keys"] == [] and refused["error"] is not None
    assert f"pid {first.pid} on" in refused["error"], refused["error"]


def test_a_rank_goes_back_to_its_epoch_though_a_child_it_forked_lives_on(tmp_path: Path) -> None:
    """A forked child (a DataLoader worker of the user's own, say) inherits its parent's descriptors, the rank
    claim's too: that copy would keep the claim after the parent let it go (leaving the epoch for a resume, which
    drops the claim; a release keeps it in this process), and the rank, resuming the epoch, would be refused as a
    duplicate of itself."""
    root = build_cache(tmp_path / "c", 50)
    reading = Snapshot.create(root, "run-e000000", ranks=2, rank=0)
    other_rank = Snapshot.join(root, "run-e000000", ranks=2, rank=1)  # keeps the snapshot while rank 0 is away
    forked_r, forked_w = os.pipe()
    child = os.fork()
    if child == 0:  # its at-fork hooks have run once fork returns here: it says so, then lives on
        os.write(forked_w, b"1")
        time.sleep(30)
        os._exit(0)
    os.close(forked_w)
    try:
        assert os.read(forked_r, 1) == b"1"  # not before: the parent would race the child's hooks
        os.close(forked_r)
        reading.leave_for_resume()  # drops the claim (a release keeps it in this process)
        again = Snapshot.join(root, "run-e000000", ranks=2, rank=0, timeout_s=1.0)
        again.release()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        other_rank.release()


def test_a_rank_restarted_while_its_predecessor_still_exits_waits_for_its_claim_and_reads_its_share(
    tmp_path: Path, daemon: DaemonProcess
) -> None:
    """A scheduler restarts a rank while the old process, in its CUDA/NCCL teardown, still holds the rank's claim:
    the new one was refused at once as a second process given that rank. It now waits for the claim, saying so in
    its log, and reads the share once the old one is gone."""
    old_out, new_out, new_log = tmp_path / "old.json", tmp_path / "new.json", tmp_path / "new.log"
    old = start_trainer(daemon.cache_dir, old_out, wait_for_file=tmp_path / "never")
    try:
        wait_for(Path(f"{old_out}.reading").exists, timeout_s=60, what="the old process to read epoch 0")
        new = start_trainer(daemon.cache_dir, new_out, stderr=new_log)
        try:
            wait_for(
                lambda: "waiting up to" in new_log.read_text() or new.poll() is not None,
                timeout_s=60,
                what="the new process to wait for the old one's claim",
            )
            old.kill()  # its exit ends: the kernel drops its claim
            old.wait(timeout=60)
            assert new.wait(timeout=60) == 0
        finally:
            new.kill()
    finally:
        old.kill()
    restarted = json.loads(new_out.read_text())
    assert restarted["error"] is None, restarted["error"]
    assert f"pid {old.pid} on" in new_log.read_text(), "the wait names the process it waits for"
    keys = restarted["keys"]
    assert len(keys) == len(set(keys)) == OBJECTS // 2, "the restarted rank read its share"


def test_a_fork_while_a_rank_takes_its_claim_leaves_the_child_no_copy_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork on another thread (a DataLoader worker started while the next epoch is built) between the claim file's
    open and its record gave the child a copy of the claim that its at-fork hook did not know to close: the child
    held the claim after the parent let it go (leaving the epoch for a resume), and the rank, resuming the epoch, was
    refused as a duplicate of itself. The fork is made to happen while the claim is being taken (from inside its
    open)."""
    root = build_cache(tmp_path / "c", 50)
    other_rank = Snapshot.create(root, "run-e000000", ranks=2, rank=1)  # keeps the snapshot while rank 0 is away
    forked_r, forked_w = os.pipe()
    children: list[int] = []
    forking = threading.Thread(target=lambda: children.append(fork_child()))
    open_claim = snapshots._open_claim

    def fork_child() -> int:
        child = os.fork()
        if child == 0:  # its at-fork hooks have run: it says so, then lives on
            os.write(forked_w, b"1")
            time.sleep(30)
            os._exit(0)
        return child

    def opened_while_a_thread_forks(path: Path) -> object:
        opened = open_claim(path)
        forking.start()
        forking.join(timeout=1.0)  # a fork the claim's lock holds back goes on once the claim is recorded
        return opened

    monkeypatch.setattr(snapshots, "_open_claim", opened_while_a_thread_forks)
    try:
        reading = Snapshot.join(root, "run-e000000", ranks=2, rank=0)
        monkeypatch.undo()
        assert os.read(forked_r, 1) == b"1"  # the child's hooks ran: the claim is the parent's alone, or copied
        reading.leave_for_resume()  # drops the claim (a release keeps it in this process)
        again = Snapshot.join(root, "run-e000000", ranks=2, rank=0, timeout_s=1.0, claim_wait_s=1.0)
        again.release()
    finally:
        if forking.ident is not None:
            forking.join()
        for child in children:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        os.close(forked_r)
        os.close(forked_w)
        other_rank.release()
