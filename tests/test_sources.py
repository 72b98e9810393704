"""Several weighted sources (``[[source]]``): the daemon keeps each source's share of the cache, every epoch gives
each source its weight's share of its samples (to the sample where samples must be reused; within a segment's
samples where a snapshot pins a source short of its share while more of it is cached, so that it repeats none), and
each sample names its source.

End to end against two ``file://`` remotes with real daemons, real DataLoader workers and, for two nodes, two
real gloo ranks each reading its own node's cache."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from cachefeed._cache.records import segment_trailer
from cachefeed._cache.room import Candidate, choose
from cachefeed._cache.sources import read_sources, source_tag
from cachefeed._cache.store import CacheStore
from cachefeed._codecs import msgpack_default
from cachefeed._config import parse_config, toml_text
from cachefeed._errors import ConfigError
from cachefeed._status.metrics import render_metrics
from cachefeed._testing.daemon import DaemonProcess, start_daemon
from cachefeed._testing.samples import cache_samples, payload
from cachefeed._trainer.partition import source_shares, weighted_order

# name -> (id, weight, objects). The curated set (1,000 samples) is smaller than its 30% of the cache (~1,600 of
# ~5,300 samples): the daemon caches all of it and every epoch upsamples it; the crawl (10,000) must be evicted.
SOURCES = {"crawl": (0, 0.7, 200), "curated": (1, 0.3, 20)}
PER_OBJECT = 50
NBYTES = 320  # the 4 MiB budget below holds some 5,300 of the 11,000 samples: it must evict


def make_source(root: Path, source_id: int, objects: int) -> Path:
    """``objects`` msgpack files of ``PER_OBJECT`` self-verifying samples each (fields src, obj, idx, data)."""
    root.mkdir(parents=True)
    for obj in range(objects):
        samples = [
            {"src": source_id, "obj": obj, "idx": i, "data": payload(f"{source_id}/{obj}/{i}", NBYTES)}
            for i in range(PER_OBJECT)
        ]
        (root / f"obj-{obj:04d}.msgpack").write_bytes(msgpack.packb(samples, default=msgpack_default))
    return root


def check_batch(
    batch: dict[str, Any], sources: dict[str, tuple[int, float, int]] = SOURCES
) -> list[tuple[str, int, int]]:
    """Verify every sample's bytes and that ``__source__`` names the source it came from (``sources``: as
    ``SOURCES``); its identities."""
    names = {source_id: name for name, (source_id, _w, _n) in sources.items()}
    seen = []
    for row, source in enumerate(batch["__source__"]):
        src, obj, idx = int(batch["src"][row]), int(batch["obj"][row]), int(batch["idx"][row])
        assert names[src] == source, f"a sample of {names[src]} says it came from {source}"
        expected = payload(f"{src}/{obj}/{idx}", NBYTES)
        assert np.array_equal(batch["data"][row].numpy(), expected), f"sample {src}/{obj}/{idx} is wrong"
        seen.append((source, obj, idx))
    return seen


def sources_config(
    tmp_path: Path,
    cache_dir: Path,
    *,
    rank: int = 0,
    count: int = 1,
    mix: Mapping[str, tuple[int, float, int]] = SOURCES,
    cache: Mapping[str, Any] | None = None,
) -> Path:
    """A daemon config over ``mix``'s sources in ``tmp_path/data`` (``make_source``), node ``rank`` of ``count``;
    ``cache`` overrides or adds cache keys."""
    data = tmp_path / "data"
    document: dict[str, Any] = {
        "remote": {"refresh_interval": "2s"},
        "cache": {
            "dir": str(cache_dir),
            "max_bytes": "4MiB",
            "min_free_bytes": 0,
            "segment_bytes": "32KiB",
            "fsync": False,
            **(cache or {}),
        },
        "sampler": {"processes": 2, "concurrency": 4, "decode": "msgpack"},
        "node": {"rank": rank, "count": count},
        "status": {"interval": "200ms"},
        "source": [
            {"name": name, "url": f"file://{data / name}", "weight": weight} for name, (_id, weight, _n) in mix.items()
        ],
    }
    path = tmp_path / f"sources{rank}.toml"
    path.write_text(toml_text(document))
    return path


@pytest.fixture(name="data")
def data_fixture(tmp_path: Path) -> Path:
    for name, (source_id, _weight, objects) in SOURCES.items():
        make_source(tmp_path / "data" / name, source_id, objects)
    return tmp_path / "data"


def start(tmp_path: Path, *, rank: int = 0, count: int = 1) -> DaemonProcess:
    cache_dir = tmp_path / f"cache{rank}"
    config = sources_config(tmp_path, cache_dir, rank=rank, count=count)
    daemon = start_daemon(config, cache_dir, tmp_path / f"daemon{rank}.err")
    daemon.wait_status(lambda doc: doc.get("state") == "running", timeout_s=60)
    return daemon


# -- the contract, on numbers ------------------------------------------------------------------------------------


def test_shares_add_up_to_the_epoch_and_follow_the_weights() -> None:
    assert source_shares({1: 900, 2: 900}, {1: 0.7, 2: 0.3}, 10) == {1: 7, 2: 3}
    assert source_shares({1: 900, 2: 900}, {1: 1, 2: 1, 3: 1}, 10) == {1: 5, 2: 5}, "an empty source gets no share"
    assert sum(source_shares({1: 5, 2: 5, 3: 5}, {1: 1, 2: 1, 3: 1}, 100).values()) == 100
    assert source_shares({}, {1: 1.0}, 10) == {}


def test_a_weighted_epoch_upsamples_a_small_source_and_never_repeats_a_large_one() -> None:
    counts, tags = (100, 100, 20), (1, 1, 2)  # source 1: 200 samples, source 2: 20
    reads = np.zeros(220, dtype=np.int64)
    order = weighted_order(counts, reads, tags, {1: 0.5, 2: 0.5}, 300, seed=3, epoch=0, shuffle=True)
    assert len(order) == 300
    small = order[order >= 200]
    large = order[order < 200]
    assert len(small) == len(large) == 150
    assert len(set(large.tolist())) == 150, "a source with enough samples gives each once"
    assert set(small.tolist()) == set(range(200, 220)), "a small source is reused whole"
    again = weighted_order(counts, reads, tags, {1: 0.5, 2: 0.5}, 300, seed=3, epoch=0, shuffle=True)
    assert np.array_equal(order, again), "the same seed and epoch give the same order on every rank"


def test_a_source_pinned_short_of_its_share_while_it_has_more_cached_is_capped_not_repeated() -> None:
    """A snapshot pins whole segments, so a source may be pinned a few samples short of its share while the cache
    holds more of it (MANIFEST ``left_out``): it must not repeat samples while another source has pinned samples the
    epoch would leave unserved; those take its excess, by weight."""
    pinned, weights = {1: 61, 2: 27}, {1: 0.7, 2: 0.3}  # the audit's snapshot: 61 + 27 of a 0.7 / 0.3 mix
    assert source_shares(pinned, weights, 88) == {1: 62, 2: 26}, "not recorded (an old MANIFEST): as before"
    assert source_shares(pinned, weights, 88, left_out={1, 2}) == {1: 61, 2: 27}
    assert source_shares(pinned, weights, 80, left_out={1, 2}) == {1: 56, 2: 24}, "a share within its pin: as is"
    assert source_shares(pinned, weights, 88, left_out={2}) == {1: 62, 2: 26}, "1 is pinned whole: upsampled"
    # the excess goes by weight to every source with pinned samples to spare (3; 2 has none)
    assert source_shares({1: 10, 2: 30, 3: 100}, {1: 1, 2: 1, 3: 1}, 90, left_out={1, 2, 3}) == {1: 10, 2: 30, 3: 50}
    # 2 is one short; 1 has samples to spare; 3 (5 samples, pinned whole) is upsampled by its own weight only
    assert source_shares({1: 61, 2: 27, 3: 5}, {1: 0.5, 2: 0.3, 3: 0.2}, 93, left_out={1, 2}) == {1: 47, 2: 27, 3: 19}
    # samples owed beyond the snapshot (samples_per_epoch): nobody has any to spare, repeats by weight as before;
    # nor does an upsampled source take the repeats of a source left out
    assert source_shares(pinned, weights, 200, left_out={1, 2}) == {1: 140, 2: 60}
    assert source_shares({1: 1638, 2: 500}, weights, 5000, left_out={1}) == {1: 3500, 2: 1500}
    for n in range(1, 160):
        for available in ({1: 61, 2: 27, 3: 5}, {1: 3, 2: 40, 3: 40}, {1: 100, 2: 1, 3: 9}):
            for left_out in ({1, 2}, {1, 2, 3}, {3}):
                shares = source_shares(available, {1: 0.5, 2: 0.3, 3: 0.2}, n, left_out=left_out)
                assert sum(shares.values()) == n, f"n={n}: {shares}"
                repeats = [tag for tag in left_out if shares[tag] > available[tag]]
                unserved = [tag for tag in shares if shares[tag] < available[tag]]
                assert not (repeats and unserved), f"n={n}, {available}, left out {left_out}: {shares}"
                reordered = {tag: available[tag] for tag in reversed(available)}
                assert shares == source_shares(reordered, {3: 0.2, 2: 0.3, 1: 0.5}, n, left_out=sorted(left_out))


def test_a_weighted_epoch_of_a_set_size_repeats_no_capped_source_within_what_it_pinned() -> None:
    counts, tags = (32, 29, 16, 11), (1, 1, 2, 2)  # source 1: 61 samples, source 2: 27
    reads = np.zeros(88, dtype=np.int64)
    for n in (88, 70, 40):
        order = weighted_order(counts, reads, tags, {1: 0.7, 2: 0.3}, n, seed=1, epoch=0, shuffle=True, left_out={1, 2})
        assert len(order) == n and len(set(order.tolist())) == n, f"samples_per_epoch={n}: a sample repeats"
    old = weighted_order(counts, reads, tags, {1: 0.7, 2: 0.3}, 88, seed=1, epoch=0, shuffle=True)
    assert len(set(old.tolist())) == 87, "without the record, the shares are as before (62 of 61: one twice)"


def test_the_room_reserves_each_source_its_share_of_samples_not_of_bytes() -> None:
    """Epochs weigh samples: a source of samples ten times larger needs ten times the bytes for the same share."""
    small = [Candidate(seq, 100, 0, tag=1, samples=10) for seq in range(10)]  # 10 bytes a sample
    large = [Candidate(seq, 100, 0, tag=2, samples=1) for seq in range(10, 20)]  # 100 bytes a sample
    chosen = set(choose(small + large, 1100, {1: 0.5, 2: 0.5}))
    pinned = Counter({1: 0, 2: 0})
    for candidate in small + large:
        if candidate.seq in chosen:
            pinned[candidate.tag] += candidate.samples
    assert pinned == {1: 10, 2: 10}, f"equal weights, equal samples: {pinned}"
    unknown = [Candidate(seq, 100, 0, tag=1 + seq // 10) for seq in range(20)]  # samples not said: bytes, as before
    assert choose(unknown, 1000, {1: 0.5, 2: 0.5}) == [*range(5), *range(10, 15)]


def test_a_snapshot_records_the_sources_it_left_out_and_one_made_before_the_record_reads_as_before(
    tmp_path: Path,
) -> None:
    """MANIFEST ``left_out``: the named sources with segments cached that the snapshot did not pin (checked against
    the directories); a MANIFEST without it (made before the field) reads as None: no caps, shares as before."""
    from cachefeed._cache.snapshots import MANIFEST, Snapshot
    from cachefeed._cache.sources import SourceEntry, write_sources
    from cachefeed._cache.writer import CacheWriter
    from cachefeed._fsutil import atomic_write
    from cachefeed._testing.samples import make_sample
    from tests.support.cache_helpers import cache_config

    root = tmp_path / "cache"
    large, small = source_tag("large"), source_tag("small")
    config = cache_config(root, max_bytes=6 << 20, segment_bytes=64 << 10, turnover_bytes=3 << 20)
    store = CacheStore(config)  # open: it holds the writer lock, so snapshots keep its room of ~2 MiB
    try:
        write_sources(store.layout.sources_file, [SourceEntry("large", large, 0.5), SourceEntry("small", small, 0.5)])
        writer = CacheWriter(store, segment_bytes=64 << 10, fsync=False)
        for tag, count in ((large, 800), (small, 40)):  # ~3.2 MB of the large source, ~160 KB of the small one
            writer.source = tag
            for n in range(count):
                writer.add(make_sample(f"{tag}-{n}", 4000))
            writer.flush()
        with Snapshot.create(root, "job-e000000") as snapshot:
            pinned = samples_by_source(snapshot.directory)
            cached = samples_by_source(root / "segments")
            assert set(cached[large]) - set(pinned[large]), "the large source has more cached than pinned"
            assert set(cached[small]) == set(pinned[small]), "the small source is pinned whole"
            assert snapshot.left_out == {large}
            manifest = msgpack.unpackb((snapshot.directory / MANIFEST).read_bytes(), raw=False)
            del manifest["left_out"]
            atomic_write(snapshot.directory / MANIFEST, msgpack.packb(manifest))
            with Snapshot.join(root, "job-e000000") as old:
                assert old.left_out is None and old.names == snapshot.names
    finally:
        store.close()


def test_source_tables_are_checked_key_by_key(tmp_path: Path) -> None:
    cache = {"dir": str(tmp_path / "c"), "max_bytes": "1GiB"}

    def error(sources: object, **extra: Any) -> str:
        with pytest.raises(ConfigError) as info:
            parse_config({"cache": cache, "source": sources, **extra}, source="x.toml")
        return str(info.value)

    assert "source[1].name = 'a' is used twice" in error([{"name": "a", "url": "u"}, {"name": "a", "url": "v"}])
    assert "source[0].name is required" in error([{"url": "u"}])
    assert "source[0].weight = 0: expected a number > 0" in error([{"name": "a", "url": "u", "weight": 0}])
    assert "did you mean 'weight'" in error([{"name": "a", "url": "u", "wieght": 2}])
    assert "remote.url and [[source]] tables both name the data" in error(
        [{"name": "a", "url": "u"}], remote={"url": "s3://b/p"}
    )
    assert "<hidden: may hold credentials>" in error([{"name": "a", "url": 5}])
    # what one listing reads is per source: set in [remote] too, it would be dropped without a word
    shared = {"endpoint_url": "http://minio:9000"}
    for key, value in (
        ("pattern", "**/*.tar"),
        ("storage_options", shared),
        ("manifest", "keys.txt"),
        ("catalog", "c"),
    ):
        message = error([{"name": "a", "url": "u"}], remote={key: value})
        assert f"remote.{key} is set beside [[source]] tables" in message and f"source.{key}" in message
    config = parse_config(
        {"cache": cache, "source": [{"name": "a", "url": "u", "weight": 7}, {"name": "b", "url": "v"}]}
    )
    assert config.weights() == (0.875, 0.125)
    assert [s.tag for s in config.inputs()] == [source_tag("a"), source_tag("b")]


def test_a_pass_is_done_when_every_source_completed_one_not_the_first_of_them(tmp_path: Path) -> None:
    """Trainers read ``passes_completed >= 1`` as "everything the remote lists was visited": a small source done
    (or one whose objects were all cached already at a restart) must not say so while another still fetches."""
    from cachefeed._daemon.sources import Inputs

    config = parse_config(
        {
            "cache": {"dir": str(tmp_path / "c"), "max_bytes": "1GiB"},
            "source": [{"name": "a", "url": "file:///a"}, {"name": "b", "url": "file:///b"}],
        }
    )
    inputs = Inputs(config)
    a, b = (entry.plan.counters for entry in inputs.inputs)
    a.passes_completed, a.skipped_cached_total, b.skipped_cached_total = 1, 5, 7
    assert inputs.counters.passes_completed == 0 and inputs.counters.skipped_cached_total == 12
    b.passes_completed = 3
    assert inputs.counters.passes_completed == 1


def test_eviction_takes_from_the_source_above_its_share_and_spares_the_one_below(tmp_path: Path) -> None:
    from cachefeed._cache.writer import CacheWriter
    from cachefeed._testing.samples import make_sample
    from tests.support.cache_helpers import cache_config

    small, large = source_tag("small"), source_tag("large")
    store = CacheStore(cache_config(tmp_path / "cache", max_bytes=8 << 20, segment_bytes=64 << 10))
    store.source_weights = {small: 0.5, large: 0.5}
    writer = CacheWriter(store, segment_bytes=64 << 10, fsync=False)
    writer.source = small
    for n in range(100):  # 100 samples of the small source: far below half of the budget
        writer.add(make_sample(f"s{n}", 4000))
    writer.flush()
    writer.source = large
    for n in range(3000):  # the large source alone overflows the budget many times over
        writer.add(make_sample(f"l{n}", 4000))
        if n % 50 == 0:
            store.enforce()
    writer.flush()
    assert store.counters.evicted_segments > 0
    assert store.samples_by_source()[small] == 100, "the source below its share lost nothing"
    store.close()


def read_epoch_then_fill(root: Path, weights: dict[int, float], first: tuple[int, int], then: int) -> CacheStore:
    """A paced store (``evict_after_reads = 1``) with ``weights``: ``first = (tag, samples)`` written and read by
    one epoch, then samples of source ``then`` written until the writer has to wait; the store, open."""
    from cachefeed._cache.snapshots import Snapshot
    from cachefeed._cache.writer import CacheWriter, WriterStopped
    from cachefeed._testing.samples import make_sample
    from tests.support.cache_helpers import cache_config

    store = CacheStore(
        cache_config(root, max_bytes=4 << 20, segment_bytes=64 << 10, turnover_bytes=1 << 20, evict_after_reads=1)
    )
    store.source_weights = weights
    stop = threading.Event()
    writer = CacheWriter(
        store, segment_bytes=64 << 10, fsync=False, poll_s=0.001, stop=stop, on_wait=lambda _s: stop.set()
    )
    writer.source, count = first
    for n in range(count):
        writer.add(make_sample(f"a{n}", 4000))
    writer.flush()
    snapshot = Snapshot.create(root, "job-e000000")  # an epoch reads what is cached so far
    snapshot.record_served(np.arange(snapshot.samples))
    snapshot.release()
    writer.source = then
    with pytest.raises(WriterStopped):
        for n in range(100_000):  # far more than the budget: the writer must come to wait
            writer.add(make_sample(f"b{n}", 4000))
    writer.abort()
    return store


def test_a_source_below_its_share_is_spared_even_when_only_its_segments_were_read(tmp_path: Path) -> None:
    """The trainers read the small source; the large one, above its share, is unread: ingest waits for reads
    rather than evict the small source (which is what a full cache after a job's last epoch looks like)."""
    small, large = source_tag("small"), source_tag("large")
    store = read_epoch_then_fill(tmp_path / "cache", {small: 0.5, large: 0.5}, (small, 100), large)
    assert store.samples_by_source()[large] > 100, "the large source is above its share"
    assert store.samples_by_source()[small] == 100, "its read segments were the only evictable ones, and stayed"
    assert store.counters.evicted_segments == 0 and store.usage().is_paced
    store.close()


def test_one_weighted_source_is_at_its_share_and_turns_over_once_read(tmp_path: Path) -> None:
    """A daemon with one source weighs it 1.0: always exactly at its share, never spared (the cache turns over)."""
    only = source_tag("only")
    store = read_epoch_then_fill(tmp_path / "cache", {only: 1.0}, (only, 300), only)
    assert store.counters.evicted_segments > 0, "the read segments were evicted"
    assert store.counters.evicted_unread_samples == 0
    store.close()


# -- end to end --------------------------------------------------------------------------------------------------


def test_two_weighted_sources_give_every_epoch_and_the_cache_their_shares(tmp_path: Path, data: Path) -> None:
    from cachefeed._trainer import EpochLoaderFactory

    (data / "curated" / "broken.msgpack").write_bytes(b"\xc1 not msgpack")  # quarantined, counted for curated
    daemon = start(tmp_path)
    try:
        with EpochLoaderFactory(
            daemon.cache_dir,
            batch_size=500,
            samples_per_epoch=10_000,
            min_samples="75%",
            num_workers=2,
            run_id="sources",
            epochs=2,
            progress=None,
        ) as factory:
            assert factory.sources == {"crawl": 0.7, "curated": 0.3}
            curated_seen: set[tuple[str, int, int]] = set()
            for epoch in range(2):
                served: list[tuple[str, int, int]] = []
                for batch in factory.loader(epoch):
                    served += check_batch(batch)
                per_source = Counter(source for source, _obj, _idx in served)
                assert len(served) == 10_000
                assert per_source == {"crawl": 7_000, "curated": 3_000}, f"epoch {epoch}: {per_source}"
                curated = Counter(sample for sample in served if sample[0] == "curated")
                assert max(curated.values()) - min(curated.values()) <= 1, "the small source is upsampled evenly"
                curated_seen |= set(curated)
            # an epoch pins its room (half the budget), each source its weight's share of it, least-read first:
            # the small source's samples are spread over consecutive epochs, every one of them read
            assert len(curated_seen) == 1_000
        document = daemon.wait_status(lambda doc: doc["ingest"]["samples_total"] > 0, timeout_s=10)
        rows = {row["name"]: row for row in document["sources"]}
        assert set(rows) == {"crawl", "curated"}
        assert rows["crawl"]["weight"] == pytest.approx(0.7)
        assert rows["curated"]["not_cached"] == {"decode": 1} and rows["crawl"]["not_cached"] == {}
        assert rows["curated"]["cached_samples"] == 1_000, "a source below its share is cached whole"
        # the files: every sample of each of curated's 20 objects is in a segment, as its row says
        in_files = Counter((int(sample["src"]), int(sample["obj"])) for _seg, sample in cache_samples(daemon.cache_dir))
        whole = {obj for (src, obj), n in in_files.items() if src == SOURCES["curated"][0] and n == PER_OBJECT}
        assert len(whole) == rows["curated"]["objects_cached"] == SOURCES["curated"][2]
        assert rows["curated"]["cached_whole"] and not rows["crawl"]["cached_whole"]
        # the log: the small source's passes are its own (the document's top-level count is the least over sources)
        passes = daemon.stderr().count("of source 'curated' completed")
        assert 1 <= rows["curated"]["passes_completed"] <= passes
        assert rows["crawl"]["cached_share"] >= 0.7 - 0.06, f"the crawl keeps its share: {rows['crawl']}"
        for name, (_id, _weight, objects) in SOURCES.items():
            assert rows[name]["objects_listed"] == objects + (name == "curated")
            assert rows[name]["samples_total"] > 0
            assert rows[name]["objects_failed_total"] == (name == "curated")
        total_cached = sum(row["cached_samples"] for row in rows.values())
        assert total_cached == document["cache"]["samples"]
        assert total_cached < sum(n for _i, _w, n in SOURCES.values()) * PER_OBJECT, "the cache must evict for this"
        human = subprocess.run(
            [sys.executable, "-m", "cachefeed", "status", "--cache-dir", str(daemon.cache_dir)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        assert "2 named; cached share / weight" in human, human
        assert "crawl: " in human and "/ 70% (" in human and "curated: " in human and "/ 30% (" in human, human
        crawl_row, curated_row = " ".join(human.split()).split("crawl: ")[1].split("curated: ")
        assert "cached whole, below its weight: epochs reuse its samples" in curated_row, human
        assert "cached whole" not in crawl_row, human
        assert " pass done" in curated_row or " passes done" in curated_row, human
        metrics = render_metrics(document).decode()
        assert 'cachefeed_source_cached_samples{source="crawl"}' in metrics
        assert 'cachefeed_source_weight{source="curated"} 0.3' in metrics
    finally:
        assert daemon.stop() == 0, daemon.stderr()


Mix = dict[str, tuple[int, float, int]]  # as SOURCES: name -> (id, weight, objects)


def samples_by_source(directory: Path) -> dict[int, dict[str, int]]:
    """What ``directory``'s segments hold, read from the files: {source tag: {segment name: samples}}."""
    held: dict[int, dict[str, int]] = {}
    for path in directory.glob("*.seg"):
        count, tag = segment_trailer(path)
        if count > 0:
            held.setdefault(tag, {})[path.name] = count
    return held


@dataclass(frozen=True)
class Served:
    """One epoch as the training loop saw it, beside what the files held as it began."""

    samples: list[tuple[str, int, int]]  # (source, object, index) of every sample received, verified
    pinned: dict[str, set[str]]  # source -> the segments of the epoch's snapshot
    cached: dict[str, set[str]]  # source -> the segments in the cache
    segment: int  # the most samples one pinned segment holds

    def count(self, name: str) -> Counter[tuple[str, int, int]]:
        return Counter(sample for sample in self.samples if sample[0] == name)


def one_pass_epochs(tmp_path: Path, mix: Mix, epochs: int) -> list[Served]:
    """``epochs`` one-pass epochs (no ``samples_per_epoch``) of a real daemon caching ``mix`` whole (the factory
    waits for every sample; ~1.9 MiB of segments for 4,100 samples, in 3 MiB after the metadata reserve) while the
    epoch room (4 MiB less 2,600 KiB of turnover and the 1 MiB reserve: 472 KiB) holds about a quarter of it."""
    from cachefeed._trainer import EpochLoaderFactory

    for name, (source_id, _weight, objects) in mix.items():
        make_source(tmp_path / "data" / name, source_id, objects)
    cache_dir = tmp_path / "cache"
    config = sources_config(tmp_path, cache_dir, mix=mix, cache={"turnover": "2600KiB"})
    total = sum(objects for _id, _w, objects in mix.values()) * PER_OBJECT
    daemon = start_daemon(config, cache_dir, tmp_path / "daemon.err")
    result = []
    try:
        daemon.wait_status(lambda doc: doc.get("state") == "running", timeout_s=60)
        with EpochLoaderFactory(
            cache_dir,
            batch_size=100,
            min_samples=total,
            wait_timeout_s=60,
            num_workers=2,
            run_id="mix",
            epochs=epochs,
            progress=None,
        ) as factory:
            for epoch in range(epochs):
                loader = factory.loader(epoch)
                pinned = samples_by_source(cache_dir / "snapshots" / factory.snapshot_id(epoch))
                cached = samples_by_source(cache_dir / "segments")
                served: list[tuple[str, int, int]] = []
                for batch in loader:
                    served += check_batch(batch, mix)
                result.append(
                    Served(
                        served,
                        {name: set(pinned.get(source_tag(name), {})) for name in mix},
                        {name: set(cached.get(source_tag(name), {})) for name in mix},
                        max(count for held in pinned.values() for count in held.values()),
                    )
                )
    finally:
        assert daemon.stop() == 0, daemon.stderr()
    return result


def test_an_epoch_repeats_no_sample_of_a_source_with_more_cached_than_its_snapshot_holds(tmp_path: Path) -> None:
    """A snapshot pins whole segments, each source first its weight's share of the room: a source is pinned up to a
    segment short of its share of the epoch. While it has more cached, it must not make that up by repeats (nor
    leave the other's pinned samples unserved); the shares follow the weights within a segment."""
    mix = {"web": (0, 0.7, 60), "books": (1, 0.3, 20)}  # 3,000 and 1,000 samples, both far beyond the room
    for epoch, served in enumerate(one_pass_epochs(tmp_path, mix, epochs=3)):
        n = len(served.samples)
        per_source = Counter(source for source, _obj, _idx in served.samples)
        for name, (_id, weight, _objects) in mix.items():
            beyond = served.cached[name] - served.pinned[name]
            assert beyond, f"epoch {epoch}: {name} has nothing cached beyond the snapshot: no witness"
            twice = sorted(sample for sample, times in served.count(name).items() if times > 1)
            assert not twice, (
                f"epoch {epoch}: {name} has {len(beyond)} segments cached beyond the snapshot, yet {len(twice)} "
                f"of its samples were served twice, such as {twice[:3]} ({dict(per_source)} of {n})"
            )
            assert abs(per_source[name] - n * weight) <= served.segment + 1, f"epoch {epoch}: {per_source} of {n}"


def test_a_source_cached_whole_below_its_share_is_still_upsampled(tmp_path: Path) -> None:
    """ "rare" (100 samples) fits its 20% of the room whole and is below its 20% of every epoch: it is reused,
    evenly; the two sources with more cached than pinned still repeat nothing."""
    mix = {"web": (0, 0.5, 60), "books": (1, 0.3, 20), "rare": (2, 0.2, 2)}
    for epoch, served in enumerate(one_pass_epochs(tmp_path, mix, epochs=2)):
        n = len(served.samples)
        per_source = Counter(source for source, _obj, _idx in served.samples)
        assert served.cached["rare"] <= served.pinned["rare"], f"epoch {epoch}: rare is not pinned whole"
        rare = served.count("rare")
        assert len(rare) == 100 and per_source["rare"] > 100, f"epoch {epoch}: rare is not upsampled: {per_source}"
        assert max(rare.values()) - min(rare.values()) <= 1, "evenly"
        for name in ("web", "books"):
            assert served.cached[name] - served.pinned[name], f"epoch {epoch}: no witness for {name}"
            assert max(served.count(name).values()) == 1, f"epoch {epoch}: {name} repeats samples ({per_source})"
        for name, (_id, weight, _objects) in mix.items():
            assert abs(per_source[name] - n * weight) <= served.segment + 1, f"epoch {epoch}: {per_source} of {n}"


def rank_main(root: str, port: int, rank: int, out: str) -> None:
    """One node's rank (world 2, one rank per node): two epochs of 5,000 samples, every sample verified."""
    import torch.distributed as dist

    from cachefeed._trainer import EpochLoaderFactory

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    epochs = []
    with EpochLoaderFactory(
        root, batch_size=250, samples_per_epoch=5_000, min_samples="75%", run_id="nodes", epochs=2, progress=None
    ) as factory:
        for epoch in range(2):
            served: list[tuple[str, int, int]] = []
            for batch in factory.loader(epoch):
                served += check_batch(batch)
            epochs.append(served)
            dist.barrier()
    Path(out).write_text(json.dumps(epochs))
    dist.destroy_process_group()


def test_two_nodes_each_give_every_epoch_the_weighted_shares_of_their_own_objects(tmp_path: Path, data: Path) -> None:
    from tests.support.nodes import run_one_rank_per_node

    daemons = [start(tmp_path, rank=rank, count=2) for rank in range(2)]
    try:
        for daemon in daemons:
            assert [e.name for e in read_sources(daemon.cache_dir / "sources.json")] == ["crawl", "curated"]
        outs = [tmp_path / f"rank{rank}.json" for rank in range(2)]
        run_one_rank_per_node(
            lambda rank, port: (
                f"from tests.test_sources import rank_main; "
                f"rank_main({str(daemons[rank].cache_dir)!r}, {port}, {rank}, {str(outs[rank])!r})"
            ),
            timeout_s=180,
        )
        reports = [json.loads(out.read_text()) for out in outs]
        for epoch in range(2):
            job = [tuple(sample) for report in reports for sample in report[epoch]]
            per_source = Counter(source for source, _obj, _idx in job)
            assert per_source == {"crawl": 7_000, "curated": 3_000}, f"epoch {epoch}: {per_source}"
            nodes = [{tuple(s) for s in report[epoch]} for report in reports]
            assert not nodes[0] & nodes[1], "each node reads only the objects it owns"
    finally:
        for daemon in daemons:
            assert daemon.stop() == 0, daemon.stderr()
