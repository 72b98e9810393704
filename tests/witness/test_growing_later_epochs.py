"""Later epochs of a set size over a growing set while the cache fills (NOTE [ Growing snapshots ] in
``_trainer/growing.py``, "later epochs"), witnessed by the keys the training loop received.

The remote is slow (``remote.max_bytes_per_s``) and the cache holds the whole dataset, so it is still filling while
several epochs of ``samples_per_epoch`` are read. The promises:

* where the remote keeps up with training, each later epoch starts on what is cached and no epoch has read and
  takes segments as the daemon publishes them: it serves only samples no earlier epoch served, each exactly once,
  and exactly ``samples_per_epoch`` of them (``len(loader)`` exact from the start);
* where training is faster than the remote, a later epoch does not wait for it: once the loop caught up with
  ingest, the epoch is topped up with the least-read cached samples (the remote sets the echo);
* when the daemon can fill no further (here: it has fetched everything the remote lists) before the epoch has its
  samples, the epoch is topped up with the least-read cached samples to exactly ``samples_per_epoch``, local ranks
  disjoint, each sample once, and what it served is credited to the daemon exactly (its read count per sample);
* a trainer killed inside a growing later epoch resumes exactly the rest of it, growing on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

from cachefeed._codecs import msgpack_default
from cachefeed._testing.daemon import stay_behind_ingest
from cachefeed._testing.ranks import run_local_ranks
from cachefeed._testing.samples import payload
from cachefeed._testing.witness import sample_keys
from cachefeed._trainer import EpochLoaderFactory
from tests.support.stalls import StallWindow
from tests.witness.test_growing_epochs import (
    NBYTES,
    PER_OBJECT,
    cached_samples,
    kill_trainer_in_a_slow_fill,
    make_remote,
    start_slow_daemon,
)


def test_later_epochs_of_a_set_size_read_what_no_epoch_read_as_the_remote_delivers_it(tmp_path: Path) -> None:
    every = make_remote(tmp_path / "data")  # 1,200 samples: some 8 s at 150 KB/s
    daemon = start_slow_daemon(tmp_path, tmp_path / "data")
    spe, batch = 80, 16
    epochs: list[list[str]] = []
    lengths: list[int] = []
    with EpochLoaderFactory(
        daemon.cache_dir,
        batch_size=batch,
        num_workers=2,
        samples_per_epoch=spe,
        epochs=3,
        run_id="later",
        progress=None,
    ) as factory:
        for epoch in range(3):
            loader = factory.loader(epoch)
            lengths.append(len(loader))
            keys: list[str] = []
            for batch_ in loader:
                keys += sample_keys(batch_)
                time.sleep(0.25)  # a training step: 64 samples/s, about half what the remote delivers
            epochs.append(keys)
        cached_at_end = cached_samples(daemon)
    daemon.stop()
    assert cached_at_end < len(every), "the cache was still filling when the last epoch ended"
    assert lengths == [spe // batch] * 3, f"len(loader) is exact from the start: {lengths}"
    for number, keys in enumerate(epochs):
        assert len(keys) == spe, f"epoch {number} served {len(keys)} samples, not samples_per_epoch"
        assert len(set(keys)) == len(keys), f"epoch {number} served a sample twice"
    zero, one, two = (set(keys) for keys in epochs)
    assert not one & zero, f"epoch 1 re-read {len(one & zero)} samples epoch 0 served while fresh ones arrived"
    assert not two & (zero | one), f"epoch 2 re-read {len(two & (zero | one))} samples earlier epochs served"


def test_a_later_epoch_faster_than_the_remote_is_topped_up_instead_of_waiting_for_it(
    tmp_path: Path, stalls: StallWindow
) -> None:
    make_remote(tmp_path / "data")  # 1,200 samples: some 8 s at 150 KB/s, ~140 samples/s
    daemon = start_slow_daemon(tmp_path, tmp_path / "data")
    spe = 200
    epochs: list[list[str]] = []
    took: list[float] = []
    with EpochLoaderFactory(
        daemon.cache_dir, batch_size=20, num_workers=2, samples_per_epoch=spe, epochs=4, run_id="fast", progress=None
    ) as factory:
        for epoch in range(4):
            started = time.monotonic()
            epochs.append([key for batch in stalls.batches(factory.loader(epoch)) for key in sample_keys(batch)])
            took.append(time.monotonic() - started)
        waits = [factory.stats(epoch).handover_wait_s or 0.0 for epoch in range(1, 4)]
    daemon.stop()
    print(
        f"later epochs faster than the remote: {', '.join(f'{t * 1e3:.0f}' for t in took[1:])} ms each, handover "
        f"waits up to {max(waits) * 1e3:.1f} ms"
    )
    for number, keys in enumerate(epochs):
        assert len(keys) == len(set(keys)) == spe, f"epoch {number}: {len(keys)} samples, {len(set(keys))} distinct"
    # Waiting for 200 fresh samples would take about 1.4 s an epoch; reading them from the cache takes milliseconds.
    assert max(took[1:]) < 0.7, f"later epochs took {took[1:]} s: they waited for the remote"
    for epoch, wait in enumerate(waits, start=1):
        stalls.assert_handover(wait, 0.5, epoch=epoch)
    earlier = set(epochs[0])
    assert any(set(keys) & earlier for keys in epochs[1:]), "the remote forced re-reads of epoch 0's samples"


def make_small_remote(root: Path, objects: int) -> set[str]:
    root.mkdir(parents=True)
    for obj in range(objects):
        samples = [{"data": payload(f"{obj}/{i}", NBYTES)} for i in range(PER_OBJECT)]
        (root / f"obj-{obj:04d}.msgpack").write_bytes(msgpack.packb(samples, default=msgpack_default))
    return {f"obj-{obj:04d}.msgpack#{i}" for obj in range(objects) for i in range(PER_OBJECT)}


@pytest.mark.parametrize(
    "behind",
    [
        # Every training step waits until the daemon has cached two steps more than both ranks have read, or fetched
        # everything: training slower than the remote, whatever the machine's load (a fixed step of 3/4 of the
        # remote's rate was not, with other daemons beside it on 2 cores). Epoch 0 then ends before the remote is
        # done, and epoch 1 never catches up with ingest and takes every sample the daemon fetches.
        pytest.param(True, id="the daemon can fill no further"),
        pytest.param(False, id="the loop caught up with ingest"),  # epoch 1 is topped up as soon as it has read all
    ],
)
def test_a_growing_later_epoch_is_topped_up_with_read_samples_to_its_size_disjoint_across_local_ranks(
    tmp_path: Path, behind: bool
) -> None:
    every = make_small_remote(tmp_path / "data", 30)  # 600 samples: some 4.5 s at 150 KB/s
    daemon = start_slow_daemon(tmp_path, tmp_path / "data")
    spe = 330  # epoch 0 takes 330 of the first arrivals; epoch 1 finds only 270 fresh, then the remote is done

    def rank(number: int, step: Callable[[], None]) -> list[list[str]]:
        with EpochLoaderFactory(
            daemon.cache_dir,
            batch_size=25,
            rank=number,
            world_size=2,
            samples_per_epoch=spe,
            epochs=2,
            run_id="top",
            progress=None,
        ) as factory:
            epochs = []
            for epoch in range(2):
                keys: list[str] = []
                for batch in factory.loader(epoch):
                    keys += sample_keys(batch)
                    if behind and number == 0:
                        # 100: the next step's 50, and the rest of epoch 0's last segment (~30 samples epoch 1 skips)
                        stay_behind_ingest(daemon.cache_dir, spe * epoch + 2 * len(keys) + 100)  # rank 1 steps along
                    step()
                epochs.append([key.rsplit("::", 1)[-1] for key in keys])  # as the remote names them
            return epochs

    try:
        received = run_local_ranks(rank)
        # Both receipts applied: every sample's reads are the epochs that served it.
        document = daemon.wait_status(lambda d: d["cache"]["epochs_total"] >= 2, timeout_s=60, what="2 receipts")
    finally:
        daemon.stop()
    for epoch in range(2):
        mine, theirs = received[0][epoch], received[1][epoch]
        assert len(mine) == len(theirs) == spe // 2, f"epoch {epoch}: {len(mine)} and {len(theirs)} samples"
        assert len(set(mine)) == len(mine) and len(set(theirs)) == len(theirs), f"epoch {epoch}: a sample twice"
        overlap = set(mine) & set(theirs)
        assert not overlap, f"epoch {epoch}: the ranks' shares overlap in {len(overlap)} samples"
    zero, one = (set(received[0][epoch] + received[1][epoch]) for epoch in range(2))
    unread = every - zero
    if behind:
        assert unread <= one, f"epoch 1 left {len(unread - one)} samples no epoch had read"
        assert len(one & zero) == spe - len(unread), "the rest of epoch 1 is samples epoch 0 read"
    else:
        assert one & zero, "topped up with samples epoch 0 read rather than waiting for the remote"
    assert document["cache"]["sample_reads_total"] == 2 * spe, "each epoch credited exactly what it served"


def trainer_main(root: str, progress: str, ready: str) -> None:
    """Train epoch 0 of a set size, then epoch 1 slower than the remote; after every batch of epoch 1, save the
    keys of both epochs and the factory's state. ``ready``: created once the interpreter and its imports are up."""
    from cachefeed._fsutil import atomic_write

    Path(ready).touch()
    with EpochLoaderFactory(root, batch_size=16, samples_per_epoch=160, run_id="job", progress=None) as factory:
        first = []
        for batch in factory.loader(0):
            first += sample_keys(batch)
            stay_behind_ingest(Path(root), len(first) + 50)  # a training step slower than the remote
        received: list[str] = []
        for batch in factory.loader(1):
            received += sample_keys(batch)
            state = factory.state_dict()
            atomic_write(progress, json.dumps({"first": first, "keys": received, "state": state}).encode())
            stay_behind_ingest(Path(root), 160 + len(received) + 50)  # 50: a batch, and epoch 0's last segment's rest


def test_a_trainer_killed_in_a_growing_later_epoch_resumes_exactly_the_rest_of_it(tmp_path: Path) -> None:
    every = make_remote(tmp_path / "data")
    daemon, saved = kill_trainer_in_a_slow_fill(tmp_path, "tests.witness.test_growing_later_epochs")  # in epoch 1
    try:
        first, interrupted = saved["first"], saved["keys"]
        assert cached_samples(daemon) < len(every), "killed while the cache was still filling"
        with EpochLoaderFactory(
            daemon.cache_dir, batch_size=16, samples_per_epoch=160, run_id="job", progress=None
        ) as factory:
            assert factory.load_state_dict(saved["state"]) == 1
            loader = factory.loader(1)
            assert loader.snapshot_id == saved["state"]["snapshot_id"], "the interrupted epoch's own snapshot, grown on"
            assert len(loader) == 160 // 16 - saved["state"]["batches_consumed"], "the rest of the epoch's batches"
            rest: list[str] = []
            for batch in loader:
                rest += sample_keys(batch)
                stay_behind_ingest(daemon.cache_dir, 160 + len(interrupted) + len(rest) + 50)
    finally:
        daemon.stop()
    assert not set(rest) & set(interrupted), "no sample twice in the epoch"
    assert len(interrupted) + len(rest) == len(set(interrupted + rest)) == 160, "exactly the rest of it"
    assert not set(interrupted + rest) & set(first), "the resumed epoch, too, reads only what epoch 0 did not"
