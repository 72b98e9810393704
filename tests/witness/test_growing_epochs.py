"""A cold job's first epoch over a growing set (NOTE [ Growing snapshots ] in ``_trainer/growing.py``), witnessed by
what the training loop received and what the daemon had published when the first batch arrived.

The remote is slow (``remote.max_bytes_per_s``): filling the cache takes several seconds. The promises:
* the first batch arrives while the cache holds a small part of the dataset (not after a 75% fill);
* the first epoch keeps taking segments as they are published and serves every sample the daemon fetched,
  each exactly once (the cache here holds the whole dataset, so that is the whole dataset);
* local ranks sharing the cache get disjoint, equal shares of the growing epoch;
* the next epoch hands over as usual;
* a trainer killed inside the growing epoch resumes exactly the rest of it (the resumed creator grows it on).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from cachefeed._codecs import msgpack_default
from cachefeed._config import toml_text
from cachefeed._testing.daemon import DaemonProcess, start_daemon, wait_for
from cachefeed._testing.ranks import run_local_ranks
from cachefeed._testing.samples import payload
from cachefeed._testing.witness import sample_keys
from cachefeed._trainer import EpochLoaderFactory, lifecycle
from tests.daemon.test_remote_changes import listed_again
from tests.support.stalls import StallWindow
from tests.witness.test_resume_promises import python

OBJECTS = 60
PER_OBJECT = 20  # 1,200 samples
NBYTES = 1000  # about 1.2 MB on the remote: some 8 s at 150 KB/s


def make_remote(root: Path) -> set[str]:
    root.mkdir(parents=True)
    keys = set()
    for obj in range(OBJECTS):
        samples = [{"data": payload(f"{obj}/{i}", NBYTES)} for i in range(PER_OBJECT)]
        (root / f"obj-{obj:04d}.msgpack").write_bytes(msgpack.packb(samples, default=msgpack_default))
        keys.update(f"obj-{obj:04d}.msgpack#{i}" for i in range(PER_OBJECT))
    return keys


def start_slow_daemon(
    tmp_path: Path, remote: Path, rate: str = "150KB", status_interval: str = "100ms"
) -> DaemonProcess:
    cache_dir = tmp_path / "cache"
    document: dict[str, Any] = {
        "remote": {"url": f"file://{remote}", "refresh_interval": "60s", "max_bytes_per_s": rate},
        "cache": {
            "dir": str(cache_dir),
            "max_bytes": "16MiB",  # the whole dataset fits: the first epoch grows until the remote is exhausted
            "min_free_bytes": 0,
            "segment_bytes": "32KiB",
            "fsync": False,
            "snapshot_grace": "60s",  # a killed trainer's snapshot waits for its resume
        },
        "sampler": {"processes": 1, "concurrency": 2, "decode": "msgpack"},
        "status": {"interval": status_interval},
    }
    path = tmp_path / "daemon.toml"
    path.write_text(toml_text(document))
    return start_daemon(path, cache_dir, tmp_path / "daemon.stderr")


def cached_samples(daemon: DaemonProcess) -> int:
    status = daemon.status()
    return int(status["cache"]["samples"]) if status else 0


def test_a_cold_first_epoch_starts_on_the_first_segments_and_serves_every_sample_as_it_arrives(tmp_path: Path) -> None:
    every = make_remote(tmp_path / "data")
    daemon = start_slow_daemon(tmp_path, tmp_path / "data")
    epochs: list[list[str]] = []
    cached_at_first_batch = -1
    with EpochLoaderFactory(daemon.cache_dir, batch_size=32, num_workers=2, run_id="cold", progress=None) as factory:
        for epoch in range(2):
            keys: list[str] = []
            for batch in factory.loader(epoch):
                if epoch == 0 and not keys:
                    cached_at_first_batch = cached_samples(daemon)
                keys += sample_keys(batch)
            epochs.append(keys)
        stats = factory.stats(0)
    daemon.stop()
    first, second = epochs
    assert 0 < cached_at_first_batch < len(every) // 2, f"the first batch came at {cached_at_first_batch} cached"
    assert len(first) == len(set(first)), "no sample twice in the growing epoch"
    assert len(first) == len(every), f"the growing epoch served {len(first)} of the {len(every)} samples fetched"
    assert stats.batches == len(first) // 32 + (1 if len(first) % 32 else 0), "len() is exact once it closed"
    assert len(second) == len(set(second)) == len(every), "the next epoch reads the whole cache once"


def assert_served_once(keys: list[str], spe: int, every: set[str]) -> None:
    """The epoch served ``spe`` samples of the remote, each once: it did not end on what was cached to serve that
    over again."""
    assert len(keys) == spe, f"the epoch served {len(keys)} samples, not samples_per_epoch"
    assert len(set(keys)) == spe, f"the epoch served {spe - len(set(keys))} samples twice: it ended on what was cached"
    assert {key.rsplit("::", 1)[-1] for key in keys} <= every  # as the remote names them


def test_a_daemon_stalled_past_its_heartbeat_limit_does_not_end_a_growing_epoch_on_what_is_cached(
    tmp_path: Path,
) -> None:
    """A machine that gives the daemon no CPU for seconds (in one-off runs this 2-core VM stalled every process for
    5-12 s under load) leaves its heartbeat stale while it still holds the cache's lock. The growing epoch waits for
    it: it used to take the stale heartbeat for "no daemon runs" and end on what was cached, serving those samples
    over again."""
    every = make_remote(tmp_path / "data")  # 1,200 samples: some 8 s at 150 KB/s
    daemon = start_slow_daemon(tmp_path, tmp_path / "data")
    spe = 400
    keys: list[str] = []
    cached_at_stall, stalled_s = -1, 0.0
    with EpochLoaderFactory(
        daemon.cache_dir, batch_size=16, samples_per_epoch=spe, epochs=1, run_id="stall", progress=None
    ) as factory:
        for batch in factory.loader(0):
            if not keys:
                cached_at_stall = cached_samples(daemon)
                started = time.monotonic()
                resumed = daemon.stall(7.0)  # the status verdict's limit is 5 s at this daemon's 100 ms interval
            keys += sample_keys(batch)
        resumed.join()
        stalled_s = time.monotonic() - started
    daemon.stop()
    assert cached_at_stall < spe, f"the stall began with {cached_at_stall} samples cached: the epoch had to wait"
    assert stalled_s >= 7.0
    assert_served_once(keys, spe, every)


def test_a_daemon_restarted_mid_epoch_is_waited_for_and_the_growing_epoch_fills_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``systemctl restart`` (or ``Restart=on-failure`` after a crash) in a cold job's first epoch: the new daemon
    recovers the cache and fetches on, and the epoch takes its samples from it. It used to end on what was cached
    when the old daemon stopped and serve those samples over again to its size."""
    # A daemon's start takes about a second, but one run in nine (one-off, under load) ended the epoch at the default
    # 15 s, the new daemon not having logged a line (this 2-core VM stalls every process for up to 12 s at times).
    # The grace's length is not what is tested here.
    monkeypatch.setattr(lifecycle, "RESTART_GRACE_S", 120.0)
    every = make_remote(tmp_path / "data")  # 1,200 samples: some 8 s at 150 KB/s
    daemon = start_slow_daemon(tmp_path, tmp_path / "data")
    spe = 400
    keys: list[str] = []
    cached_at_stop = -1
    with EpochLoaderFactory(
        daemon.cache_dir, batch_size=16, samples_per_epoch=spe, epochs=1, run_id="restart", progress=None
    ) as factory:
        for batch in factory.loader(0):
            if not keys:
                cached_at_stop = cached_samples(daemon)
                assert daemon.stop() == 0  # drains, says "stopped", lets go of the cache
                daemon = start_slow_daemon(tmp_path, tmp_path / "data")
            keys += sample_keys(batch)
    daemon.stop()
    assert cached_at_stop < spe, f"the restart began with {cached_at_stop} samples cached: the epoch had to wait"
    assert_served_once(keys, spe, every)


def test_a_growing_epoch_ends_on_what_is_cached_once_its_daemon_stayed_away_for_the_restart_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(lifecycle, "RESTART_GRACE_S", 1.5)
    make_remote(tmp_path / "data")
    daemon = start_slow_daemon(tmp_path, tmp_path / "data")
    spe = 400
    keys: list[str] = []
    with EpochLoaderFactory(
        daemon.cache_dir, batch_size=16, samples_per_epoch=spe, epochs=1, run_id="gone", progress=None
    ) as factory:
        for batch in factory.loader(0):
            if not keys:
                stopped_at = time.monotonic()
                assert daemon.stop() == 0
                cached = cached_samples(daemon)  # its last document, written as it stopped
            keys += sample_keys(batch)
        ended_s = time.monotonic() - stopped_at
    assert ended_s >= 1.5, f"the epoch ended {ended_s:.1f}s after the daemon stopped: before the grace was over"
    assert ended_s < 30, f"the epoch ended {ended_s:.1f}s after the daemon stopped"
    assert len(keys) == spe, "ended on what was cached, reused to its size"
    assert len(set(keys)) == cached, "every sample cached when the daemon stopped, and nothing else"
    assert "is gone: the growing epoch waits up to 2s" in caplog.text


def test_a_growing_epoch_ends_when_the_daemon_has_fetched_everything_not_at_its_next_status_interval(
    tmp_path: Path, stalls: StallWindow
) -> None:
    """The daemon publishes its status at once when it can fill no further (here: a pass over the remote is done),
    so the growing epoch closes and the next one hands over in milliseconds, whatever ``status.interval`` is."""
    every = make_remote(tmp_path / "data")
    # A status document every 60 s unless something a trainer waits for changes.
    daemon = start_slow_daemon(tmp_path, tmp_path / "data", rate="4MB", status_interval="60s")
    first: list[str] = []
    started = time.monotonic()
    with EpochLoaderFactory(daemon.cache_dir, batch_size=32, num_workers=2, run_id="end", progress=None) as factory:
        for batch in factory.loader(0):
            first += sample_keys(batch)
            last_batch_at = time.monotonic()
        epoch_s = last_batch_at - started
        second = next(iter(factory.loader(1)))
        second_at = time.monotonic()
        handover_s = second_at - last_batch_at
    daemon.stop()
    # 1.2 MB at 4 MB/s: fetched in well under a second. Closing at the next status document took 60 s.
    assert epoch_s < 20.0, f"the growing epoch took {epoch_s:.1f}s to end"
    assert len(first) == len(set(first)) == len(every), "the growing epoch served every sample once"
    assert len(sample_keys(second)) == 32
    stalls.assert_handover(handover_s, 5.0, ended_at=second_at)  # the growing epoch's last batch to the next's first


def test_local_ranks_get_disjoint_equal_shares_of_a_growing_epoch(tmp_path: Path) -> None:
    every = make_remote(tmp_path / "data")
    daemon = start_slow_daemon(tmp_path, tmp_path / "data")

    def rank(number: int, step: Callable[[], None]) -> list[str]:
        keys: list[str] = []
        with EpochLoaderFactory(
            daemon.cache_dir, batch_size=16, rank=number, world_size=2, run_id="pair", epochs=1, progress=None
        ) as factory:
            for batch in factory.loader(0):
                keys += sample_keys(batch)
                step()
        return keys

    try:
        received = run_local_ranks(rank)
    finally:
        daemon.stop()
    zero, one = received[0], received[1]
    assert len(zero) == len(one), "equal shares: the same number of steps on every rank"
    assert not set(zero) & set(one), "disjoint shares"
    assert len(set(zero)) == len(zero) and len(set(one)) == len(one)
    assert len(zero) + len(one) >= len(every) - 1, "every sample but an odd one out"


def trainer_main(root: str, progress: str, ready: str) -> None:
    """Train the growing epoch slowly; after every batch, save the keys received and the factory's state. ``ready``
    is created once the interpreter and its imports are up (the factory then waits for the cache to appear)."""
    from cachefeed._fsutil import atomic_write

    Path(ready).touch()
    received: list[str] = []
    with EpochLoaderFactory(root, batch_size=16, run_id="job", progress=None) as factory:
        for batch in factory.loader(0):
            received += sample_keys(batch)
            atomic_write(progress, json.dumps({"keys": received, "state": factory.state_dict()}).encode())
            time.sleep(0.02)  # a training step


def kill_trainer_in_a_slow_fill(tmp_path: Path, module: str) -> tuple[DaemonProcess, dict[str, Any]]:
    """Run ``module``'s ``trainer_main`` over a daemon filling at 60 KB/s (some 20 s) and SIGKILL it once it has
    recorded three batches of 16 in its progress file; the daemon and what the trainer saved last."""
    progress, ready = tmp_path / "progress.json", tmp_path / "trainer-ready"
    # The trainer's interpreter and imports come first: on a loaded machine they took longer than the daemon took to
    # fetch the whole dataset, and the epoch had stopped growing before the kill. The daemon starts once they are up.
    trainer = python(
        f"from {module} import trainer_main; "
        f"trainer_main({str(tmp_path / 'cache')!r}, {str(progress)!r}, {str(ready)!r})"
    )
    try:
        wait_for(ready.exists, timeout_s=120, what="the trainer's imports")
        daemon = start_slow_daemon(tmp_path, tmp_path / "data", rate="60KB")  # killed well before the end
        assert daemon.cache_dir == tmp_path / "cache"
        wait_for(
            lambda: progress.exists() and len(json.loads(progress.read_text())["keys"]) >= 3 * 16,
            timeout_s=120,
            interval_s=0.005,
            what="three batches",
        )
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    saved: dict[str, Any] = json.loads(progress.read_text())
    return daemon, saved


def test_a_trainer_killed_in_a_growing_epoch_resumes_exactly_the_rest_of_it(tmp_path: Path) -> None:
    every = make_remote(tmp_path / "data")
    daemon, saved = kill_trainer_in_a_slow_fill(tmp_path, "tests.witness.test_growing_epochs")
    try:
        interrupted = saved["keys"]
        assert cached_samples(daemon) < len(every), "killed while the epoch was still growing"
        with EpochLoaderFactory(daemon.cache_dir, batch_size=16, run_id="job", progress=None) as factory:
            assert factory.load_state_dict(saved["state"]) == 0
            loader = factory.loader(0)
            assert loader.snapshot_id == saved["state"]["snapshot_id"], "the interrupted epoch's own snapshot, grown on"
            rest = [key for batch in loader for key in sample_keys(batch)]
    finally:
        daemon.stop()
    assert not set(rest) & set(interrupted), "no sample twice in the epoch"
    assert len(interrupted) + len(rest) == len(set(interrupted + rest)) == len(every), "exactly the rest of it"


def test_a_first_epoch_waiting_for_a_fill_level_waits_out_a_daemon_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``min_samples="75%"`` (the former behaviour, kept as a setting): a daemon restarted while the trainer waits
    for the fill is waited for, and the first epoch starts on the fill the new daemon reaches (here the whole
    dataset, which fits the cache). It used to start on what was cached the moment the old daemon stopped."""
    monkeypatch.setattr(lifecycle, "RESTART_GRACE_S", 120.0)  # the grace's length is not what is tested here
    every = make_remote(tmp_path / "data")
    daemons = [start_slow_daemon(tmp_path, tmp_path / "data")]
    cached_at_stop = -1

    def restart_once_some_are_cached() -> None:
        nonlocal cached_at_stop
        wait_for(lambda: cached_samples(daemons[0]) >= 100, timeout_s=30, what="100 samples cached")
        cached_at_stop = cached_samples(daemons[0])
        assert daemons[0].stop() == 0  # drains, says "stopped", lets go of the cache
        time.sleep(1.0)  # systemd's RestartSec, shortened
        daemons.append(start_slow_daemon(tmp_path, tmp_path / "data"))

    restarter = threading.Thread(target=restart_once_some_are_cached)
    restarter.start()
    keys: list[str] = []
    try:
        with EpochLoaderFactory(
            daemons[0].cache_dir, batch_size=16, epochs=1, min_samples="75%", run_id="fill", progress=None
        ) as factory:
            for batch in factory.loader(0):
                keys += sample_keys(batch)
    finally:
        restarter.join()
        daemons[-1].stop()
    assert 0 < cached_at_stop < len(every), "the restart came while the cache filled"
    names = sorted(key.rsplit("::", 1)[-1] for key in keys)  # as the remote names them
    assert names == sorted(every), "the first epoch started on the new daemon's fill: every sample, once"
    assert "is gone: waiting up to 120s for it to come back" in caplog.text


def overwrite(root: Path, obj: int) -> None:
    """A new version of object ``obj``: each sample's bytes are those of the key ``{obj}/{i}/new``."""
    path = root / f"obj-{obj:04d}.msgpack"
    samples = [{"data": payload(f"{obj}/{i}/new", NBYTES)} for i in range(PER_OBJECT)]
    path.write_bytes(msgpack.packb(samples, default=msgpack_default))
    os.utime(path, (1_800_000_000, 1_800_000_000))  # another version: another mtime


def test_an_object_overwritten_while_the_epoch_grows_is_served_once_in_it_and_in_its_new_content_after(
    tmp_path: Path,
) -> None:
    """The remote overwrites an object the growing first epoch has begun to serve. The daemon retires the segment
    of its old samples and fetches the new version while the epoch still grows: the epoch serves each of the
    object's keys once, in the content it began with (it used to take the new samples too: the keys twice, with two
    contents), and the next epoch serves the new content only. Witness: the keys and bytes the loop received."""
    every = make_remote(tmp_path / "data")  # 1,200 samples: some 8 s at 150 KB/s
    daemon = start_slow_daemon(tmp_path, tmp_path / "data")
    epochs: list[list[tuple[str, bytes]]] = []
    changed = -1
    with EpochLoaderFactory(daemon.cache_dir, batch_size=32, num_workers=2, run_id="over", progress=None) as factory:
        for epoch in range(2):
            received: list[tuple[str, bytes]] = []
            for batch in factory.loader(epoch):
                keys = sample_keys(batch)
                if changed < 0:
                    changed = int(keys[0].rsplit("obj-", 1)[1][:4])
                    overwrite(tmp_path / "data", changed)
                    listed_again(daemon)
                received += zip(keys, [row.tobytes() for row in np.asarray(batch["data"])], strict=True)
            epochs.append(received)
    daemon.stop()
    first, second = epochs
    ours = f"obj-{changed:04d}.msgpack#"
    for epoch, received in enumerate(epochs):
        keys = [key for key, _ in received]
        assert len(keys) == len(set(keys)), f"epoch {epoch} served {len(keys) - len(set(keys))} samples twice"
        assert {key.rsplit("::", 1)[-1] for key in keys} <= every
    old = {key: data for key, data in first if ours in key}
    assert old, "the growing epoch served the object it began with"
    assert all(data == payload(f"{changed}/{key.rsplit('#', 1)[1]}", NBYTES).tobytes() for key, data in old.items())
    new = {key: data for key, data in second if ours in key}
    assert len(new) == PER_OBJECT, "the next epoch serves the object in its new content"
    # What the next epoch may lack: the samples, in the retired segment, of the objects cut across it and a neighbour
    # (``plan.py``, "Retired samples": fetched again in their next pass), at most two objects.
    missing = every - {key.rsplit("::", 1)[-1] for key, _ in second}
    assert len({key.split("#")[0] for key in missing}) <= 2, f"the next epoch lacks {sorted(missing)}"
    assert all(data == payload(f"{changed}/{key.rsplit('#', 1)[1]}/new", NBYTES).tobytes() for key, data in new.items())
