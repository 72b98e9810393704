"""Objects whose samples span several segments (a tar shard larger than a segment), witnessed through a real daemon.

Read-gated eviction removes segments in the order their samples are read, not the order they were written. The
plan must not draw an object again while any segment holding one of its samples is cached: otherwise the cache
holds two copies of those samples, and one snapshot, and so one epoch, can serve both. The remote here is twice
the cache, each object spans about five segments, and training goes on until the cache has taken the remote in
twice, so objects are fetched again after their first copies are evicted. The witness is what the segment files
held and what the loop received, not the plan's counts.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import msgpack

from cachefeed._cache.records import SegmentReader
from cachefeed._codecs import msgpack_default
from cachefeed._config import toml_text
from cachefeed._testing.daemon import start_daemon
from cachefeed._testing.samples import payload
from cachefeed._testing.witness import SegmentWitness, sample_keys
from cachefeed._trainer import EpochLoaderFactory

OBJECTS = 100
PER_OBJECT = 40  # 40 KB an object: about five segments of 8 KiB
NBYTES = 1000
SAMPLES_PER_EPOCH = 384


def cached_total(witness: SegmentWitness) -> int:
    """Samples the cache has taken in so far, copies included (read from the segment files)."""
    return sum(len(keys) for keys in list(witness.keys.values()))


def test_an_object_spanning_segments_is_fetched_again_only_once_none_of_its_samples_is_cached(tmp_path: Path) -> None:
    remote = tmp_path / "data"
    remote.mkdir()
    for obj in range(OBJECTS):
        samples = [{"data": payload(f"{obj}/{i}", NBYTES)} for i in range(PER_OBJECT)]
        (remote / f"obj-{obj:04d}.msgpack").write_bytes(msgpack.packb(samples, default=msgpack_default))
    cache_dir = tmp_path / "cache"
    config = tmp_path / "daemon.toml"
    config.write_text(
        toml_text(
            {
                "remote": {"url": f"file://{remote}", "refresh_interval": "60s"},
                "cache": {
                    "dir": str(cache_dir),
                    "max_bytes": "3MiB",  # about 2,000 of the remote's 4,000 samples
                    "turnover": "25%",  # an epoch's room (about 1,100 samples) holds its 384 with room to spare
                    "min_free_bytes": 0,
                    "segment_bytes": "8KiB",
                    "fsync": False,
                    "snapshot_grace": "0s",
                    "evict_after_reads": 1,
                },
                "sampler": {"processes": 2, "concurrency": 4, "decode": "msgpack"},
                "status": {"interval": "100ms"},
            }
        )
    )
    daemon = start_daemon(config, cache_dir, tmp_path / "daemon.stderr")
    daemon.wait_status(lambda d: d["cache"]["samples"] > 0, timeout_s=60, what="a first segment")
    served: list[list[str]] = []
    with SegmentWitness(cache_dir) as witness:
        with EpochLoaderFactory(
            cache_dir, batch_size=32, samples_per_epoch=SAMPLES_PER_EPOCH, run_id="spans", progress=None
        ) as factory:
            # Until the cache has taken in the remote twice over (however loaded the machine), within 500 epochs.
            while cached_total(witness) < 2 * OBJECTS * PER_OBJECT and len(served) < 500:
                keys = []
                for batch in factory.loader(len(served)):
                    keys += sample_keys(batch)
                    time.sleep(0.02)  # a training step: the daemon keeps up, the cache turns over
                served.append(keys)
    assert daemon.stop() == 0, daemon.stderr()

    spanning = sum(1 for keys in witness.keys.values() if len({key.split("#")[0] for key in keys}) > 1)
    assert spanning, "no segment held samples of two objects: the test would not cut objects across segments"
    assert witness.repeated_keys() > 0, "nothing was fetched twice: the run did not pass over its remote again"
    assert not witness.held_twice, (
        f"the cache held {len(witness.held_twice)} samples twice at once, e.g. {witness.held_twice[:3]}"
    )
    for number, keys in enumerate(served):
        twice = [key for key, n in Counter(keys).items() if n > 1]
        assert not twice, f"epoch {number} served {len(twice)} samples twice, e.g. {twice[:3]}"
        assert len(keys) == SAMPLES_PER_EPOCH, f"epoch {number} served {len(keys)} samples"


def test_a_daemon_killed_inside_an_object_fetches_only_the_rest_of_it_after_a_restart(tmp_path: Path) -> None:
    """The cache fills while no trainer reads: each sampler waits for room right after publishing a segment cut
    inside an object. Killed there and restarted with room for everything, the daemon must cache every sample of
    the remote exactly once: the cut objects' first samples are not fetched again, and their rest is not lost."""
    remote = tmp_path / "data"
    remote.mkdir()
    expected = set()
    for obj in range(60):  # 2.4 MB
        samples = [{"data": payload(f"{obj}/{i}", NBYTES)} for i in range(PER_OBJECT)]
        (remote / f"obj-{obj:04d}.msgpack").write_bytes(msgpack.packb(samples, default=msgpack_default))
        expected |= {f"obj-{obj:04d}.msgpack#{i}" for i in range(PER_OBJECT)}
    cache_dir = tmp_path / "cache"
    config = tmp_path / "daemon.toml"

    def write_config(max_bytes: str) -> None:
        config.write_text(
            toml_text(
                {
                    "remote": {"url": f"file://{remote}", "refresh_interval": "60s"},
                    "cache": {
                        "dir": str(cache_dir),
                        "max_bytes": max_bytes,
                        "min_free_bytes": 0,
                        "segment_bytes": "8KiB",
                        "fsync": False,
                        "evict_after_reads": 1,
                    },
                    "sampler": {"processes": 2, "concurrency": 2, "decode": "msgpack"},
                    "status": {"interval": "100ms"},
                }
            )
        )

    write_config("2200KiB")  # room for about half the remote
    daemon = start_daemon(config, cache_dir, tmp_path / "first.stderr")
    daemon.wait_status(lambda d: d["cache"]["is_paced"], timeout_s=60, what="a full cache")
    time.sleep(0.5)  # the samplers are waiting for room
    daemon.kill_group()
    cut = []
    for path in (cache_dir / "segments").glob("*.seg"):
        with SegmentReader(path) as reader:
            cut += [source for source in reader.sources() if source.cut is not None]
    assert cut, "no segment was cut inside an object: the test would not kill a daemon inside one"

    write_config("8MiB")  # room for everything: whatever is missing after the restart is lost, not evicted
    with SegmentWitness(cache_dir) as witness:
        daemon = start_daemon(config, cache_dir, tmp_path / "second.stderr")
        daemon.wait_status(lambda d: d["remote"]["passes_completed"] >= 1, timeout_s=60, what="a pass")
        assert daemon.stop() == 0, daemon.stderr()
    cached = Counter(key.split("::")[-1] for keys in witness.keys.values() for key in keys)
    assert not [key for key, n in cached.items() if n > 1], "samples cached twice"
    assert set(cached) == expected, f"{len(expected - set(cached))} samples of the remote were never cached"
