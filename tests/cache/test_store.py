"""The cache directory: exclusivity, recovery, eviction order, pins, back-pressure, turnover."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cachefeed._cache import snapshots
from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.reads import ReadLedger
from cachefeed._cache.records import SegmentReader
from cachefeed._cache.settings import CacheConfig
from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import METADATA_RESERVE_BYTES, CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._errors import SnapshotError
from cachefeed._testing.samples import check_sample, make_sample
from cachefeed._testing.witness import SegmentWitness
from tests.support.cache_helpers import FORMAT_3_SEGMENT, cache_config, write_until_full


def fill(store: CacheStore, keys: range, nbytes: int = 4096) -> None:
    with CacheWriter(store, segment_bytes=store.config.segment_bytes, fsync=False) as writer:
        for i in keys:
            writer.add(make_sample(f"k{i}", nbytes))


def cached_keys(root: Path) -> list[str]:
    keys = []
    for name, _ in CacheLayout(root).list_segments():
        with SegmentReader(root / "segments" / name) as reader:
            for sample in reader:
                check_sample(sample)
                keys.append(sample["__key__"])
    return keys


def test_a_second_writer_is_refused_at_once_naming_the_first(tmp_path: Path) -> None:
    config = cache_config(tmp_path / "c")
    store = CacheStore(config)
    code = (
        "import sys; from pathlib import Path\n"
        "from tests.support.cache_helpers import cache_config\n"
        "from cachefeed._cache.store import CacheStore\n"
        f"CacheStore(cache_config(Path({str(config.dir)!r})))\n"
    )
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 30
    assert "CacheLockedError" in result.stderr and f"pid {os.getpid()}" in result.stderr
    assert result.returncode != 0
    store.close()
    again = CacheStore(config)  # after the first one let go, the next start succeeds
    again.close()


def test_a_daemon_that_loses_the_race_by_microseconds_still_names_the_winner(tmp_path: Path) -> None:
    """The winner takes the lock, then writes itself into the lock file: a loser reading in between waits for it."""
    import fcntl
    import threading

    from cachefeed._errors import CacheLockedError

    config = cache_config(tmp_path / "c")
    CacheStore(config).close()  # the directory exists, unlocked
    lock = CacheLayout(config.dir).lock_file
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the winner holds the lock ...
    os.ftruncate(fd, 0)  # ... and has not written itself yet
    late = threading.Timer(0.2, lambda: os.pwrite(fd, b'{"pid": 4242, "host": "h", "since": "now"}', 0))
    late.start()
    try:
        with pytest.raises(CacheLockedError, match="in use by pid 4242 on host h"):
            CacheStore(config)
    finally:
        late.join()
        os.close(fd)


def exited_pid() -> int:
    """A pid of this host whose process has exited (a daemon stopped or killed earlier)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


@pytest.mark.parametrize("holder", ["never written", "a daemon that has exited"])
def test_a_daemon_starting_while_trainers_ask_whether_one_runs_takes_the_lock(tmp_path: Path, holder: str) -> None:
    """``has_writer`` takes the lock shared for a moment: a daemon starting in that moment used to refuse. Here the
    moment lasts 0.3 s (the asking process stopped by the machine between its lock and its unlock); a second
    reader comes and goes meanwhile. The lock file names nobody (no daemon got that far), or, as on every cache a
    daemon ran on before, a daemon that has exited."""
    import json
    import socket
    import threading

    config = cache_config(tmp_path / "c")
    CacheStore(config).close()
    lock = CacheLayout(config.dir).lock_file
    previous = {"pid": exited_pid(), "host": socket.gethostname(), "since": "then"}
    lock.write_text("" if holder == "never written" else json.dumps(previous))
    readers = [os.open(lock, os.O_RDONLY) for _ in range(2)]
    for fd in readers:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    timers = [threading.Timer(delay, os.close, (fd,)) for delay, fd in zip((0.1, 0.3), readers, strict=True)]
    for timer in timers:
        timer.start()
    try:
        store = CacheStore(config)
        assert CacheLayout(config.dir).has_writer()
        store.close()
    finally:
        for timer in timers:
            timer.join()


def test_a_reader_that_never_lets_go_is_named_when_the_daemon_gives_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cachefeed._cache import store as store_module
    from cachefeed._errors import CacheLockedError

    config = cache_config(tmp_path / "c")
    CacheStore(config).close()
    reader = os.open(CacheLayout(config.dir).lock_file, os.O_RDONLY)
    fcntl.flock(reader, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a trainer stopped in the middle of asking
    monkeypatch.setattr(store_module, "_LOCK_WAIT_S", 0.3)
    started = time.monotonic()
    try:
        with pytest.raises(
            CacheLockedError, match=r"processes asking whether a daemon runs .*, for over 0\.3s: `fuser"
        ):
            CacheStore(config)
    finally:
        os.close(reader)
    assert time.monotonic() - started >= 0.3


def holding_the_lock(config: CacheConfig, pid: int) -> int:
    """Take the cache's lock exclusively on a descriptor of its own, naming ``pid`` in the lock file, as a daemon
    does; returns the descriptor (closing it lets go)."""
    import json
    import socket

    fd = os.open(CacheLayout(config.dir).lock_file, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": pid, "host": socket.gethostname(), "since": "then"}).encode(), 0)
    return fd


def test_a_live_daemons_lock_is_refused_at_once_and_a_gone_ones_samplers_are_named_after_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cachefeed._cache import store as store_module
    from cachefeed._errors import CacheLockedError

    config = cache_config(tmp_path / "c")
    CacheStore(config).close()
    live = holding_the_lock(config, os.getpid())
    started = time.monotonic()
    try:
        with pytest.raises(CacheLockedError, match=f"in use by pid {os.getpid()} .*: stop that daemon first"):
            CacheStore(config)
    finally:
        os.close(live)
    assert time.monotonic() - started < 1.0, "a live daemon is not waited for"
    gone = exited_pid()
    samplers = holding_the_lock(config, gone)  # samplers of a daemon that has exited, stuck
    monkeypatch.setattr(store_module, "_LOCK_WAIT_S", 0.3)
    try:
        with pytest.raises(
            CacheLockedError, match=rf"locked by the samplers of pid {gone}, which has exited, for over"
        ):
            CacheStore(config)
    finally:
        os.close(samplers)


def test_a_daemon_restarted_at_once_waits_for_the_samplers_of_a_killed_one_to_let_go(tmp_path: Path) -> None:
    """A killed daemon's samplers keep its lock until they follow it out (PR_SET_PDEATHSIG): a daemon started in
    between (systemd's restart, the crash-loop test) used to refuse, naming a process that no longer existed."""
    import threading

    config = cache_config(tmp_path / "c")
    CacheStore(config).close()
    fd = holding_the_lock(config, exited_pid())  # the killed daemon's sampler, which inherited the lock
    exits = threading.Timer(0.5, os.close, (fd,))  # the sampler follows its daemon out
    exits.start()
    try:
        store = CacheStore(config)  # waits for it instead of refusing
        store.close()
    finally:
        exits.join()


def test_fifo_eviction_keeps_the_newest_samples_within_budget(tmp_path: Path) -> None:
    store = CacheStore(cache_config(tmp_path / "c", max_bytes=8 << 20, segment_bytes=256 << 10))
    fill(store, range(5000))
    keys = cached_keys(tmp_path / "c")
    numbers = sorted(int(k[1:]) for k in keys)
    assert numbers == list(range(numbers[0], 5000)), "FIFO keeps a contiguous run of the newest samples"
    assert store.usage().bytes <= (8 << 20) - METADATA_RESERVE_BYTES
    assert store.counters.evicted_samples == 5000 - len(keys)


def test_recovery_removes_temp_files_partial_and_foreign_entries(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = CacheStore(cache_config(root))
    fill(store, range(500))
    store.close()
    layout = CacheLayout(root)
    (layout.tmp / "0000000000000099.tmp").write_bytes(b"partial")
    good = sorted(layout.segments.iterdir())
    (layout.segments / "00000000000000ff.seg").write_bytes(good[0].read_bytes()[:1000])  # a partial segment
    (layout.segments / "notes.txt").write_text("foreign")
    outside = tmp_path / "outside.txt"
    outside.write_text("must survive")
    (layout.segments / "00000000000000fe.seg").symlink_to(outside)
    os.mkfifo(layout.segments / "00000000000000fd.seg")
    store = CacheStore(cache_config(root))
    assert sorted(os.listdir(layout.tmp)) == []
    assert sorted(p.name for p in layout.segments.iterdir()) == [p.name for p in good]
    assert outside.read_text() == "must survive"
    assert len(cached_keys(root)) == 500
    store.close()


def test_a_segment_of_an_older_format_is_left_out_of_snapshots_and_dropped_at_recovery(tmp_path: Path) -> None:
    """An upgrade: the cache holds a segment written by an older cachefeed (format 3). A trainer of the new one
    leaves it out of its snapshot; the daemon's start drops it (its samples are fetched again) and starts."""
    root = tmp_path / "c"
    store = CacheStore(cache_config(root))
    fill(store, range(50))
    store.close()
    old = CacheLayout(root).segments / "00000000000000f0.seg"
    old.write_bytes(FORMAT_3_SEGMENT)
    with Snapshot.create(root, "run-e000000") as snapshot:
        assert old.name not in snapshot.names and snapshot.samples == 50
    store = CacheStore(cache_config(root))
    assert not old.exists() and store.counters.dropped_corrupt == 1
    assert sorted(cached_keys(root)) == sorted(f"k{i}" for i in range(50))
    store.close()


def test_an_evicted_segment_stays_readable_while_a_snapshot_holds_it(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = CacheStore(cache_config(root, max_bytes=8 << 20, turnover_bytes=2 << 20))
    fill(store, range(1000))
    snapshot = Snapshot.create(root, "run-e000000")
    pinned = snapshot.samples
    store.collect_reads()
    assert store.drop_sources(keep=set()) > 0  # a source no longer configured: its pinned segments go too
    assert store.counters.evicted_segments > 0
    usage = store.usage()
    assert usage.pinned_only_bytes > 0, "evicted-but-pinned bytes are still counted"
    assert usage.bytes <= store.limit_bytes
    seen = 0
    for path in snapshot.paths:
        with SegmentReader(path) as reader:
            for sample in reader:
                check_sample(sample)
                seen += 1
    assert seen == pinned
    snapshot.release()
    assert not (root / "snapshots" / "run-e000000").exists()
    store._pins_scanned_at = 0
    assert store.usage().pinned_only_bytes == 0


def test_writers_wait_when_everything_is_pinned_and_resume_after_release(tmp_path: Path) -> None:
    root = tmp_path / "c"
    config = cache_config(root, max_bytes=8 << 20, turnover_bytes=0, evict_after_reads=1)
    store = CacheStore(config)
    write_until_full(store, 0, nbytes=100_000)  # paced: nothing read yet
    with Snapshot.create(root, "read-all") as first:
        first.record_served(np.arange(first.samples))
    store.collect_reads()  # every segment read, so every one may go, but for the next pin
    snapshot = Snapshot.create(root, "pin-all")  # turnover 0: the epoch room is the whole budget
    store._pins_scanned_at = 0
    assert snapshot.samples == store.samples
    assert store.reserve(config.segment_bytes) is None, "all data pinned: back-pressure, not overshoot"
    assert store.usage().bytes <= store.limit_bytes
    assert store.usage().is_backpressured
    snapshot.release()
    store._swept_at = store._pins_scanned_at = 0
    assert store.reserve(config.segment_bytes) is not None


def test_turnover_keeps_room_for_fresh_samples_under_a_full_pin(tmp_path: Path) -> None:
    root = tmp_path / "c"
    config = cache_config(root, max_bytes=8 << 20, turnover_bytes=2 << 20)
    store = CacheStore(config)
    fill(store, range(2000))
    with Snapshot.create(root, "epoch-0"):
        store._pins_scanned_at = 0
        before = store.counters.published_samples
        fill(store, range(2000, 2300))  # must not block: turnover room exists
        assert store.counters.published_samples - before == 300
        assert store.usage().bytes <= store.limit_bytes


def test_a_dead_holders_snapshot_is_swept(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = CacheStore(cache_config(root))
    fill(store, range(200))
    code = (
        "import sys, time\nfrom cachefeed._cache.snapshots import Snapshot\n"
        f"s = Snapshot.create({str(root)!r}, 'dead-e1')\nprint('pinned', flush=True)\ntime.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "pinned"
    store._swept_at = 0
    assert store.sweep() == [], "a live holder's snapshot is kept"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    holder.stdout.close()
    store._swept_at = 0
    assert store.sweep() == ["dead-e1"]
    assert os.listdir(root / "snapshots") == []


def test_a_sample_larger_than_the_budget_is_refused(tmp_path: Path) -> None:
    store = CacheStore(cache_config(tmp_path / "c", max_bytes=8 << 20))
    with pytest.raises(ValueError, match="too large"):
        store.reserve(64 << 20)


def test_cache_files_have_explicit_modes(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        root = tmp_path / "c"
        store = CacheStore(cache_config(root, file_mode=0o640, dir_mode=0o750))
        fill(store, range(100))
    finally:
        os.umask(old)
    assert (root.stat().st_mode & 0o777) == 0o750
    for path in (root / "segments").iterdir():
        assert (path.stat().st_mode & 0o777) == 0o640


def test_a_leftover_snapshot_of_the_same_id_is_replaced_not_joined(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = a_store_of_100_samples(root)
    old = Snapshot.create(root, "run-e000001")
    (root / "snapshots" / "run-e000001.lock").unlink()  # simulate a crash that left an unheld lock behind:
    os.close(os.open(root / "snapshots" / "run-e000001.lock", os.O_CREAT | os.O_WRONLY))  # a fresh, unlocked one
    fill(store, range(100, 200))
    fresh = Snapshot.create(root, "run-e000001")
    assert fresh.samples == 200, "the new snapshot pins what is cached now, not the leftover"
    fresh.release()
    old._lock_fd = None  # its lock file is gone; nothing to release


def a_store_of_100_samples(root: Path) -> CacheStore:
    """An open store at ``root`` holding samples 0-99."""
    store = CacheStore(cache_config(root))
    fill(store, range(100))
    return store


def with_a_dead_trainers_snapshot(root: Path) -> CacheStore:
    """A cache of 100 samples with snapshot ``run-e000001``, whose trainer died: the kernel dropped its pin, the
    snapshot stays (kept for a resume); the store is open."""
    store = a_store_of_100_samples(root)
    dead = Snapshot.create(root, "run-e000001")
    os.close(dead._lock_fd)
    dead._lock_fd = None
    return store


def test_a_join_waits_on_a_snapshot_another_process_holds_exclusively_then_gives_up_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    store = with_a_dead_trainers_snapshot(root)
    probe = os.open(root / "snapshots" / "run-e000001.lock", os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a sweep's probe that does not let go
    monkeypatch.setattr(snapshots, "BUSY_WAIT_S", 0.5)
    started = time.monotonic()
    with pytest.raises(SnapshotError, match="stayed locked by another process"):
        Snapshot.join(root, "run-e000001", timeout_s=0.1)
    assert time.monotonic() - started >= 0.5, "waited past its own timeout, for the lock"
    os.close(probe)
    joined = Snapshot.join(root, "run-e000001", timeout_s=0.1)
    assert joined.samples == 100
    joined.release()  # the last holder: it removes the snapshot
    store.close()


def test_a_join_that_waited_on_a_snapshot_being_removed_says_it_was_removed_at_once(tmp_path: Path) -> None:
    import threading

    root = tmp_path / "c"
    store = with_a_dead_trainers_snapshot(root)
    lock = root / "snapshots" / "run-e000001.lock"
    remover = os.open(lock, os.O_RDONLY)
    fcntl.flock(remover, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the sweep, its grace over, removes it: slowly

    def remove() -> None:
        time.sleep(0.3)
        shutil.rmtree(root / "snapshots" / "run-e000001")
        lock.unlink()
        os.close(remover)

    removal = threading.Thread(target=remove)
    removal.start()
    started = time.monotonic()
    try:
        with pytest.raises(SnapshotError, match=r"was removed .* while another process held its lock"):
            Snapshot.join(root, "run-e000001", timeout_s=0.1)
    finally:
        removal.join()
    assert time.monotonic() - started < snapshots.BUSY_WAIT_S / 2, "ended when the snapshot went, not at the limit"
    store.close()


def test_release_in_a_forked_child_leaves_the_parents_pin(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = a_store_of_100_samples(root)
    snapshot = Snapshot.create(root, "forked")
    pid = os.fork()
    if pid == 0:
        snapshot.release()
        os._exit(0)
    os.waitpid(pid, 0)
    store._swept_at = 0
    assert store.sweep() == [], "the parent still holds its pin"
    snapshot.release()
    assert not (root / "snapshots" / "forked").exists()


def test_a_child_forked_while_the_parent_pins_holds_no_copy_of_the_pin(tmp_path: Path) -> None:
    """A process forked while its parent pins a snapshot (a worker started in place of a dead one, a user's own
    fork) lives on after the parent leaves the epoch for a resume; once the grace is over the daemon's sweep finds
    the snapshot unheld and removes it, as when no child lives (NOTE [ Snapshot pinning protocol ], "Forks"). The
    witness is the snapshot's directory on disk."""
    root = tmp_path / "c"
    store = CacheStore(cache_config(root, snapshot_grace_s=0.0))
    fill(store, range(100))
    stopped = Snapshot.create(root, "run-e000001")
    finishing = Snapshot.join(root, "run-e000001", timeout_s=1.0)
    wake, wait = os.pipe()
    started, ready = os.pipe()
    pid = os.fork()
    if pid == 0:  # past the fork's hooks, it says so, then lives until the test lets it go, as a worker does
        try:
            os.close(wait)
            os.write(ready, b"r")
            os.read(wake, 1)
        finally:
            os._exit(0)
    os.close(wake)
    os.close(ready)
    assert os.read(started, 1) == b"r"
    os.close(started)
    try:
        stopped.leave_for_resume()
        finishing.release()
        store._swept_at = 0
        assert store.sweep() == ["run-e000001"], "the child's copy of the stopped rank's pin kept the snapshot"
        assert not (root / "snapshots" / "run-e000001").exists()
    finally:
        os.close(wait)
        os.waitpid(pid, 0)
    store.close()


def test_a_child_that_drops_a_snapshot_it_inherited_keeps_the_pin_it_took_itself(tmp_path: Path) -> None:
    """A forked child pins a snapshot of its own (its descriptor may get the number of the parent's pin, closed at
    the fork), then drops the ``Snapshot`` it inherited, as its garbage collection or a teardown would: its own pin
    stays held, and the parent's too (NOTE [ Snapshot pinning protocol ], "Forks"). The witness is the lock table:
    a probe for an exclusive lock on each snapshot's lock file."""
    root = tmp_path / "c"
    store = a_store_of_100_samples(root)
    inherited = Snapshot.create(root, "parents")
    report, told = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(report)
            own = Snapshot.create(root, "childs")
            inherited.touch()
            inherited.leave_for_resume()
            inherited.release()
            held = [not probe_unheld(root / "snapshots" / f"{name}.lock") for name in ("childs", "parents")]
            os.write(told, bytes(held))
            own.release()
            code = 0
        finally:
            os._exit(code)
    os.close(told)
    try:
        held = os.read(report, 2)
    finally:
        os.close(report)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's own release went through"
    assert held == bytes([True, True]), "the child's pin and the parent's are both held (childs, parents)"
    assert not (root / "snapshots" / "parents" / "LEFT").exists(), "the child left nothing for a resume"
    inherited.release()
    assert not (root / "snapshots" / "parents").exists(), "the parent, its last holder, removed it"
    store.close()


def probe_unheld(lock: Path) -> bool:
    """Whether nobody holds ``lock``: an exclusive lock on a descriptor of our own is granted (and let go)."""
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_evictions_report_how_many_epochs_read_each_sample(tmp_path: Path) -> None:
    """Each receipt is one epoch over what it served; evicted samples settle as 'served n times' or 'never served'
    (``evict_after_reads = 0`` here, so unread samples may go). The counters are checked against the files: which
    segments the two epochs pinned, and which of all the published ones are gone."""
    root = tmp_path / "c"
    store = CacheStore(cache_config(root, max_bytes=8 << 20, turnover_bytes=2 << 20))
    fill(store, range(300))
    served: dict[str, int] = {}
    for epoch in range(2):  # two epochs over the first 300 samples
        snapshot = Snapshot.create(root, f"run-e{epoch:06d}")
        store._rescan_pins()
        store._rescan_pins()  # a snapshot is one epoch however often the daemon looks at it
        snapshot.record_served(np.arange(snapshot.samples))
        served.update(zip(snapshot.names, snapshot.counts, strict=True))
        snapshot.release()
    store._rescan_pins()
    assert store.counters.epochs_seen == 2
    before = store.usage()
    assert before.unread_samples == 0
    assert before.oldest_published_at is not None and before.newest_published_at is not None
    with SegmentWitness(root) as witness:  # reads every segment file as it appears
        fill(store, range(300, 2000))  # samples no epoch pins, then eviction of the oldest
        store.enforce()
    published = {name: len(keys) for name, keys in witness.keys.items()}
    present = {p.name for p in (root / "segments").iterdir()}
    read_twice = sum(count for name, count in served.items() if name not in present)
    never = sum(count for name, count in published.items() if name not in present and name not in served)
    counters = store.counters
    assert read_twice > 0 and never > 0
    assert counters.evicted_sample_reads == 2 * read_twice, "each evicted sample of the first 300 served twice"
    assert counters.evicted_unread_samples == never
    assert counters.evicted_samples == read_twice + never
    assert store.usage().unread_samples == store.samples  # what is left was never pinned by an epoch
    store.close()


def test_most_read_eviction_keeps_what_no_epoch_has_read(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = CacheStore(cache_config(root, max_bytes=8 << 20, turnover_bytes=2 << 20, eviction="most-read"))
    fill(store, range(300))
    read = {segment.seq for segment in store.segments}
    snapshot = Snapshot.create(root, "run-e000000")  # one epoch reads the first 300 samples
    store._rescan_pins()
    snapshot.record_served(np.arange(snapshot.samples))
    snapshot.release()
    store.collect_reads()
    fill(store, range(300, 2000))  # more than the budget holds: evictions
    store.enforce()
    left = {segment.seq for segment in store.segments}
    unread_evicted = sorted(set(range(max(read) + 1, max(left) + 1)) - left)
    assert not read & left, "every segment an epoch read went first"
    assert unread_evicted, "then unread ones, as the budget required"
    assert unread_evicted == list(range(max(read) + 1, max(read) + 1 + len(unread_evicted))), "oldest unread first"
    store.close()


@pytest.mark.parametrize(
    ("reads", "expected"),
    [({}, 3), ({5: 1}, 5), ({4: 2, 5: 2}, 4), ({3: 1, 4: 3, 5: 2}, 4)],
)
def test_most_read_policy_order(reads: dict[int, int], expected: int) -> None:
    from cachefeed._cache.eviction import make_policy

    assert make_policy("most-read").choose([3, 4, 5], reads) == expected


def test_a_writer_is_full_once_a_sample_like_the_last_would_not_fit_and_a_ramp_grows_its_segments(
    tmp_path: Path,
) -> None:
    """``is_full`` lets the daemon's sink publish a segment at the end of the object that filled it; with a
    ``SegmentRamp`` the segments start at the ramp's first size and grow to ``segment_bytes``."""
    from cachefeed._cache.writer import FIRST_SEGMENT_BYTES, SegmentRamp

    segment_bytes = 2 << 20
    store = CacheStore(cache_config(tmp_path / "c", max_bytes=64 << 20, segment_bytes=segment_bytes))
    ramp = SegmentRamp(segment_bytes)
    sizes = []
    with CacheWriter(store, segment_bytes=segment_bytes, fsync=False, ramp=ramp) as writer:
        for i in range(120):
            writer.add(make_sample(f"k{i:04d}", 64 << 10))
            if writer.is_full:
                before = len(store.segments)
                writer.flush()
                assert len(store.segments) == before + 1, "a full writer publishes its segment"
                sizes.append(store.segments[-1].nbytes)
            else:
                assert writer.pending_samples, "a segment with room is not published"
    store.close()
    assert FIRST_SEGMENT_BYTES - (72 << 10) <= sizes[0] <= FIRST_SEGMENT_BYTES  # full at its first size
    assert sizes == sorted(sizes), f"the ramp only grows: {sizes}"
    assert segment_bytes - (72 << 10) <= max(sizes) <= segment_bytes
    assert len(cached_keys(tmp_path / "c")) == 120


def test_the_last_release_removes_the_snapshot_and_leaves_its_receipt_though_a_sweep_probed_mid_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flock(2) converts a shared lock to exclusive by dropping it first. The daemon's sweep, probing in that
    instant, holds the lock exclusively for a moment: the release's conversion fails. The kernel's two steps are
    played here one by one, the probe between them, and the probe lets go before the releaser's next look; the
    witness is the files: the snapshot directory gone and the epoch's receipt handed over, not left to the
    sweep's grace for a resume."""
    root = tmp_path / "c"
    store = a_store_of_100_samples(root)
    snapshot = Snapshot.create(root, "run-e000001")
    snapshot.record_served(np.arange(snapshot.samples))
    lock = root / "snapshots" / "run-e000001.lock"
    real_flock, held = fcntl.flock, snapshot._lock_fd
    probes: list[int] = []
    calls: list[int] = []

    def flock_with_a_probe_mid_conversion(fd: int, operation: int) -> None:
        if fd == held:
            calls.append(operation)
            if operation == fcntl.LOCK_EX | fcntl.LOCK_NB and not probes:
                real_flock(fd, fcntl.LOCK_UN)  # the kernel's first step: the shared lock is dropped
                probes.append(os.open(lock, os.O_RDONLY))
                real_flock(probes[0], fcntl.LOCK_EX | fcntl.LOCK_NB)  # the sweep's probe, in between
            elif operation == fcntl.LOCK_EX | fcntl.LOCK_NB and probes[0] >= 0:
                os.close(probes[0])  # the probe let go before the releaser's next look
                probes[0] = -1
        real_flock(fd, operation)

    monkeypatch.setattr(snapshots.fcntl, "flock", flock_with_a_probe_mid_conversion)
    snapshot.release()
    monkeypatch.undo()
    assert probes == [-1], "the probe came between the two steps, and let go"
    assert fcntl.LOCK_SH | fcntl.LOCK_NB in calls, "the releaser told an exclusive holder from sharing ranks"
    assert not (root / "snapshots" / "run-e000001").exists() and not lock.exists(), "the last releaser removed it"
    receipts = [p.name for p in (root / "snapshots").iterdir() if p.name.endswith(snapshots.RECEIPT_SUFFIX)]
    assert len(receipts) == 1, "and handed the epoch's reads to the daemon"
    store.close()


def test_a_release_that_is_not_the_last_leaves_the_snapshot_to_the_other_rank_without_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    store = a_store_of_100_samples(root)
    creator = Snapshot.create(root, "run-e000001")
    other = Snapshot.join(root, "run-e000001", timeout_s=1.0)  # another local rank of the epoch
    monkeypatch.setattr(snapshots, "_RELEASE_RETRIES_S", (30.0,))  # a look again would take 30 s (not 5 ms: load)
    started = time.monotonic()
    creator.release()
    assert time.monotonic() - started < 10.0, "shared: no look again"
    assert (root / "snapshots" / "run-e000001").exists(), "the other rank still reads it"
    other.release()
    assert not (root / "snapshots" / "run-e000001").exists(), "the last of them removed it"
    store.close()


def test_a_budget_larger_than_the_filesystem_is_named_at_the_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``max_bytes = "10TiB"`` on a 60 GiB disk used to start without a word: the free-space floor then binds first."""
    stats = os.statvfs(tmp_path)
    free = stats.f_bavail * stats.f_frsize
    with caplog.at_level(logging.WARNING, logger="cachefeed"):
        CacheStore(cache_config(tmp_path / "small", max_bytes=64 << 20)).close()
        assert "more than the filesystem" not in caplog.text
        CacheStore(cache_config(tmp_path / "large", max_bytes=2 * free)).close()
    assert f"is more than the filesystem of {tmp_path / 'large'} can give the cache" in caplog.text
    assert "set cache.max_bytes to at most" in caplog.text


def test_a_free_space_floor_above_the_free_space_names_min_free_bytes_not_max_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An example config's ``min_free_bytes = "50GiB"`` copied onto a smaller disk: the cache can hold nothing, and
    the warning and the out-of-space reason used to say to lower ``max_bytes``, which cannot help."""
    stats = os.statvfs(tmp_path)
    free = stats.f_bavail * stats.f_frsize
    with caplog.at_level(logging.WARNING, logger="cachefeed"):
        store = CacheStore(cache_config(tmp_path / "floor", min_free_bytes=free + (1 << 30)))
    try:
        assert "cache.min_free_bytes = " in caplog.text and "the cache can hold nothing" in caplog.text
        assert "set cache.max_bytes to at most" not in caplog.text
        assert store.reserve(4096) is None and store.is_out_of_space
        reason = store.out_of_space_reason()
        assert "free-space floor" in reason and "lower cache.min_free_bytes" in reason, reason
    finally:
        store.close()


def test_a_snapshot_one_rank_left_for_a_resume_outlives_the_other_ranks_release(tmp_path: Path) -> None:
    """Two local ranks read an epoch; one is stopped by Ctrl-C and leaves it for a resume, the other finishes its
    share and releases last. That release removed the snapshot, and the resume read other samples. Now the snapshot
    stays (the daemon keeps it for the grace), a resume's join takes it back, and its last release removes it and
    hands the epoch's reads over. The witness is the files."""
    root = tmp_path / "c"
    store = CacheStore(cache_config(root, snapshot_grace_s=300.0))
    fill(store, range(100))
    stopped = Snapshot.create(root, "run-e000001")
    finishing = Snapshot.join(root, "run-e000001", timeout_s=1.0)
    nonce, directory = stopped.nonce, root / "snapshots" / "run-e000001"
    stopped.record_served(np.arange(10))
    stopped.leave_for_resume()
    finishing.record_served(np.arange(50, finishing.samples))
    finishing.release()
    assert directory.is_dir() and (root / "snapshots" / "run-e000001.lock").exists(), "kept for the stopped rank"
    store._swept_at = 0
    assert store.sweep() == [], "within the grace the daemon keeps it"
    resumed = Snapshot.join(root, "run-e000001", timeout_s=1.0, nonce=nonce)  # the restarted job's rank
    resumed.record_served(np.arange(10, 50))
    resumed.release()
    assert not directory.exists(), "the resumed job's last release removed it"
    receipts = [p for p in (root / "snapshots").iterdir() if p.name.endswith(snapshots.RECEIPT_SUFFIX)]
    assert len(receipts) == 1, "and handed the whole epoch's reads to the daemon"
    store.close()


def test_a_snapshot_left_for_a_resume_that_never_comes_goes_after_the_grace(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = CacheStore(cache_config(root, snapshot_grace_s=0.0))
    fill(store, range(100))
    stopped = Snapshot.create(root, "run-e000001")
    finishing = Snapshot.join(root, "run-e000001", timeout_s=1.0)
    stopped.leave_for_resume()
    finishing.release()
    assert (root / "snapshots" / "run-e000001").is_dir(), "the releasing rank left it to the daemon"
    store._swept_at = 0
    assert store.sweep() == ["run-e000001"], "which removes it once the grace is over"
    store.close()


def test_an_epoch_released_while_the_daemon_restarts_is_credited_by_the_next_one(tmp_path: Path) -> None:
    """A trainer that finished its epoch during the daemon's restart (systemd's 5 s delay, a crash loop) left no
    receipt, as on a static cache: the epoch's reads were lost and its samples stayed unread. A daemon that wrote its
    status within the last minutes is restarting, not gone: the receipt is left, and the next daemon credits it.
    The witness is the ledger file the restarted daemon writes."""
    root = tmp_path / "c"
    store = CacheStore(cache_config(root))
    fill(store, range(100))
    snapshot = Snapshot.create(root, "run-e000001")
    store.close()  # the daemon stops; its last status (the reporter's heartbeat file) is a second old
    CacheLayout(root).status_file.write_text("{}")
    snapshot.record_served(np.arange(snapshot.samples))
    snapshot.release()
    restarted = CacheStore(cache_config(root))
    restarted.close()
    counts = ReadLedger(root, root / "snapshots").load()
    assert sum(len(c) for c in counts.values()) == 100 and {int(c) for v in counts.values() for c in v} == {1}


def test_on_a_cache_no_daemon_ran_on_lately_no_receipt_is_left(tmp_path: Path) -> None:
    root = tmp_path / "c"
    a_store_of_100_samples(root).close()
    status = CacheLayout(root).status_file
    status.write_text("{}")
    an_hour_ago = time.time() - 3600
    os.utime(status, (an_hour_ago, an_hour_ago))
    with Snapshot.create(root, "run-e000001") as snapshot:
        snapshot.record_served(np.arange(snapshot.samples))
    assert [p for p in (root / "snapshots").iterdir()] == [], "nobody would collect it"
