"""The read promises, checked by a witness that does not trust the ledger (``cachefeed/_testing/witness.py``).

Each test runs a real daemon on a ``file://`` remote larger than its cache, trains through the public interface and
checks, from what the loop received and what the segment files held: no key served twice in an epoch, every
evicted sample served at least ``cache.evict_after_reads`` times, and status's "evicted unread" equal to the
witness's count. The configurations are those where an epoch serves part of its snapshot: epochs of a set size at
10% of the cache, two nodes agreeing on the smallest node's share, two weighted sources, ``drop_last``, an epoch
abandoned after one batch. Resume and job ownership live in ``test_resume_promises.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from cachefeed._codecs import msgpack_default
from cachefeed._config import toml_text
from cachefeed._testing.daemon import DaemonProcess, start_daemon
from cachefeed._testing.samples import payload
from cachefeed._testing.witness import SegmentWitness, Served, check_promises, final_status, sample_keys
from cachefeed._trainer import EpochLoaderFactory
from tests.support.nodes import run_one_rank_per_node

OBJECTS = 600
PER_OBJECT = 20  # 12,000 samples on the remote: no test serves them all, so no object is fetched twice
NBYTES = 400
MAX_BYTES = "3MiB"  # the daemon keeps some 2,000 of them: it must evict to serve the rest


def make_remote(root: Path, objects: int = OBJECTS, *, tag: str = "") -> Path:
    root.mkdir(parents=True)
    for obj in range(objects):
        samples = [{"data": payload(f"{tag}{obj}/{i}", NBYTES)} for i in range(PER_OBJECT)]
        (root / f"obj-{obj:04d}.msgpack").write_bytes(msgpack.packb(samples, default=msgpack_default))
    return root


def daemon_config(
    tmp_path: Path,
    cache_dir: Path,
    *,
    remote: Path | None = None,
    sources: dict[str, tuple[Path, float]] | None = None,
    k: int = 1,
    grace: str = "0s",
    node: tuple[int, int] = (0, 1),
    name: str = "daemon",
) -> Path:
    document: dict[str, Any] = {
        "remote": {"refresh_interval": "2s"},
        "cache": {
            "dir": str(cache_dir),
            "max_bytes": MAX_BYTES,
            "min_free_bytes": 0,
            "segment_bytes": "32KiB",
            "fsync": False,
            "snapshot_grace": grace,
            "evict_after_reads": k,
        },
        "sampler": {"processes": 1, "concurrency": 4, "decode": "msgpack"},
        "node": {"rank": node[0], "count": node[1]},
        "status": {"interval": "100ms"},
    }
    if sources:
        document["source"] = [
            {"name": source, "url": f"file://{path}", "weight": weight} for source, (path, weight) in sources.items()
        ]
    else:
        document["remote"]["url"] = f"file://{remote}"
    path = tmp_path / f"{name}.toml"
    path.write_text(toml_text(document))
    return path


def start(tmp_path: Path, name: str = "daemon", **config: Any) -> DaemonProcess:
    cache_dir = tmp_path / f"cache-{name}"
    path = daemon_config(tmp_path, cache_dir, name=name, **config)
    return start_daemon(path, cache_dir, tmp_path / f"{name}.stderr")


def train(
    factory: EpochLoaderFactory,
    epochs: int,
    served: Served,
    *,
    batches: int | None = None,
    step: Callable[[], Any] | None = None,
) -> None:
    """Run ``epochs`` epochs, recording every key the loop receives (``batches``: abandon each after that many)."""
    for epoch in range(epochs):
        keys: list[str] = []
        for number, batch in enumerate(factory.loader(epoch)):
            if batches is not None and number == batches:
                break
            keys += sample_keys(batch)
            if step is not None:
                step()
        served.epoch(keys)


@pytest.mark.parametrize("k", [1, 2])
def test_epochs_of_a_tenth_of_the_cache_evict_only_what_they_served(tmp_path: Path, k: int) -> None:
    """Today's main credited each epoch's whole snapshot: 1,366 samples evicted never served while status said 0."""
    daemon = start(tmp_path, remote=make_remote(tmp_path / "data"), k=k)
    served = Served()
    epochs = 40 * k  # enough reads for every cached sample to reach k and be evicted, however fast the daemon
    with SegmentWitness(daemon.cache_dir) as witness:
        with EpochLoaderFactory(
            daemon.cache_dir, batch_size=32, samples_per_epoch=224, min_samples="75%", run_id="tenth", progress=None
        ) as factory:
            train(factory, epochs, served)
        status = final_status(daemon, epochs)
    figures = check_promises(witness, served, status, k=k)
    assert figures["evicted"] > 0, f"the cache turned over: {figures}"
    # Least-read first: an epoch of a tenth of the cache serves samples no epoch has served yet while there are any.
    assert figures["served_distinct"] >= min(epochs * 224 // k, 2_000) * 0.9, figures


def test_drop_last_and_abandoned_epochs_count_only_what_reached_the_loop(tmp_path: Path) -> None:
    daemon = start(tmp_path, remote=make_remote(tmp_path / "data"))
    served = Served()
    with SegmentWitness(daemon.cache_dir) as witness:
        with EpochLoaderFactory(
            daemon.cache_dir, batch_size=48, samples_per_epoch=200, drop_last=True, run_id="cut", progress=None
        ) as factory:
            # 4 batches of 48: 8 samples of each epoch never reach the loop; 40 epochs, so that the cache turns
            # over (an epoch pins at most half the budget) however loaded the machine
            train(factory, 40, served)
            train_more = Served()
            for epoch in range(40, 50):  # abandoned after one batch each
                keys = sample_keys(next(iter(factory.loader(epoch))))
                train_more.epoch(keys)
            served.epochs += train_more.epochs
        status = final_status(daemon, 50)
    assert all(len(keys) == 192 for keys in served.epochs[:40])
    assert check_promises(witness, served, status)["evicted"] > 0


def test_two_weighted_sources_evict_only_what_their_epochs_served(tmp_path: Path) -> None:
    sources = {
        "crawl": (make_remote(tmp_path / "crawl", tag="c"), 0.7),
        "curated": (make_remote(tmp_path / "curated", 20, tag="q"), 0.3),
    }
    daemon = start(tmp_path, sources=sources)
    served = Served()
    with SegmentWitness(daemon.cache_dir) as witness:
        with EpochLoaderFactory(
            daemon.cache_dir, batch_size=32, samples_per_epoch=320, min_samples="75%", run_id="mix", progress=None
        ) as factory:
            for epoch in range(25):
                keys: list[str] = []
                for batch in factory.loader(epoch):
                    keys += sample_keys(batch)
                served.epoch(keys)
        status = final_status(daemon, 25)
    # The small curated source (400 samples) is upsampled: its samples repeat within an epoch by design; the
    # crawl's never do.
    for number, keys in enumerate(served.epochs):
        crawl = [key for key in keys if "/crawl/" in key]
        assert len(crawl) == len(set(crawl)), f"epoch {number} served a crawl sample twice"
        assert len(crawl) == 224, f"epoch {number}: the crawl's 70% of 320"
    assert check_promises(witness, served, status, repeats_allowed=True)["evicted"] > 0


def rank_main(root: str, port: int, rank: int, out: str, epochs: int) -> None:
    """One node's rank (world 2, one rank per node): epochs of one pass, cut to the smaller node's share."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    report = []
    with EpochLoaderFactory(root, batch_size=32, min_samples="75%", run_id="nodes", progress=None) as factory:
        for epoch in range(epochs):
            report.append([key for batch in factory.loader(epoch) for key in sample_keys(batch)])
            dist.barrier()
    Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


def test_two_nodes_agreeing_on_the_smaller_share_evict_only_what_they_served(tmp_path: Path) -> None:
    remote = make_remote(tmp_path / "data", 2 * OBJECTS)  # each node owns half
    daemons = [start(tmp_path, f"node{rank}", remote=remote, node=(rank, 2)) for rank in range(2)]
    epochs = 4  # one pass over some 2,000 cached samples each: fewer than a node owns
    outs = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    witnesses = [SegmentWitness(d.cache_dir).__enter__() for d in daemons]
    run_one_rank_per_node(
        lambda rank, port: (
            f"from tests.witness.test_promises import rank_main; "
            f"rank_main({str(daemons[rank].cache_dir)!r}, {port}, {rank}, {str(outs[rank])!r}, {epochs})"
        )
    )
    statuses = [final_status(d, epochs) for d in daemons]
    for witness, out, status in zip(witnesses, outs, statuses, strict=True):
        witness.stop()
        served = Served(json.loads(out.read_text()))
        assert check_promises(witness, served, status)["evicted"] > 0, "the node's cache turned over"
    reports = [json.loads(out.read_text()) for out in outs]
    assert all(len(a) == len(b) for a, b in zip(*reports, strict=True)), "every epoch the same size on both nodes"
