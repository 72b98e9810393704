"""Two real ranks (gloo) x two DataLoader workers each, while a writer process fills and evicts the cache:
every sample of each epoch's snapshot is delivered exactly once across ranks and workers, under fork and spawn.

The ranks and the writer are real processes started from here; they run functions of this module through
``python -c`` (so spawned DataLoader workers can import ``tag_worker`` by name).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachefeed._testing.local_s3 import free_port
from tests.support.child_env import REPO, child_env

EPOCHS = 2
BATCH = 32


def tag_worker(sample: dict) -> dict:
    """Per-sample transform (runs in the DataLoader workers): records which worker read the sample."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    sample["worker"] = -1 if info is None else info.id
    return sample


def writer_main(root: str, samples_per_s: float) -> None:
    """Keep adding samples (keys ``w<n>``) through a real CacheStore, which evicts the oldest as it goes."""
    from cachefeed._cache.store import CacheStore
    from cachefeed._cache.writer import CacheWriter
    from cachefeed._testing.samples import make_sample
    from tests.support.cache_helpers import cache_config

    config = cache_config(Path(root), max_bytes=6 << 20, segment_bytes=64 << 10, turnover_bytes=512 << 10)
    store = CacheStore(config)  # the budget left for segments: 6 MiB - 4 MiB metadata reserve = 2 MiB
    writer = CacheWriter(store, segment_bytes=config.segment_bytes, fsync=False, poll_s=0.005)
    print("ready", flush=True)
    started, n = time.monotonic(), 0
    while True:
        writer.add(make_sample(f"w{n}", 256))
        n += 1
        if n % 64 == 0:
            store.enforce()
            ahead = n / samples_per_s - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)


def rank_main(root: str, port: int, rank: int, context: str, out: str, epochs: int = EPOCHS) -> None:
    """One DDP rank: train ``epochs`` epochs, record what it was served (and, on rank 0, what each snapshot held)."""
    import numpy as np
    import torch.distributed as dist

    from cachefeed._cache.layout import CacheLayout
    from cachefeed._testing.samples import check_sample
    from cachefeed._trainer import EpochLoaderFactory

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    layout = CacheLayout(Path(root))
    report: dict = {"epochs": []}
    with EpochLoaderFactory(
        root,
        batch_size=BATCH,
        num_workers=2,
        multiprocessing_context=context,
        transform=tag_worker,
        run_id=f"dist-{context}",
        epochs=epochs,
        min_samples=2000,
        progress=None,
    ) as factory:
        for epoch in range(epochs):
            loader = factory.loader(epoch)
            keys: list[str] = []
            workers: set[int] = set()
            for batch in loader:
                for row, key in enumerate(batch["__key__"]):
                    check_sample({"__key__": key, "data": batch["data"][row], "n": batch["n"][row]})
                keys += batch["__key__"]
                workers.update(batch["worker"].tolist())
                time.sleep(0.005)  # a training step
            entry = {"keys": keys, "workers": sorted(workers), "batches": len(loader), "stats": None}
            stats = factory.stats(epoch)
            entry["stats"] = {"samples": stats.samples, "rank_samples": stats.rank_samples}
            if rank == 0:  # the pin is held until loader(epoch + 1): read the whole snapshot, see what turned over
                dataset = loader.dataset
                entry["snapshot_keys"] = [dataset[i]["__key__"] for i in range(len(dataset))]
                live = {name for name, _info in layout.list_segments()}
                newest = max(factory._epochs._states[epoch].snapshot.names)
                # an epoch pins its room at most (_cache/room.py): the writer evicts around the pin, not under it
                entry["published_while_pinned"] = sum(name > newest for name in live)
            lengths = [None, None]
            dist.all_gather_object(lengths, len(loader))
            entry["all_batches"] = lengths
            report["epochs"].append(entry)
            dist.barrier()  # DDP keeps ranks in step; so does this
    Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()
    del np


def node_rank_main(
    root: str, port: int, rank: int, out: str, world: int = 4, samples_per_epoch: int = 0, min_samples: int = 0
) -> None:
    """One of ``world`` ranks (LOCAL_RANK/LOCAL_WORLD_SIZE set by the test: several simulated nodes, each its own
    cache, or one); records each epoch's ``len(loader)`` before its first batch and every key served, verified."""
    import torch.distributed as dist

    from cachefeed._testing.samples import check_sample
    from cachefeed._trainer import EpochLoaderFactory

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    epochs = []
    with EpochLoaderFactory(
        root,
        batch_size=10,
        run_id="nodes",
        epochs=2,
        progress=None,
        samples_per_epoch=samples_per_epoch or None,
        min_samples=min_samples or None,
    ) as factory:
        for epoch in range(2):
            loader = factory.loader(epoch)
            planned = len(loader)
            keys = []
            for batch in loader:
                for row, key in enumerate(batch["__key__"]):
                    check_sample({"__key__": key, "data": batch["data"][row], "n": batch["n"][row]})
                keys += batch["__key__"]
            epochs.append(
                {
                    "keys": keys,
                    "batches": planned,
                    "samples": factory.stats(epoch).samples,
                    "known_before": factory.batches_per_epoch,
                }
            )
            dist.barrier()
    Path(out).write_text(json.dumps(epochs))
    dist.destroy_process_group()


def run_ranks(tmp_path: Path, roots: list[Path], world: int, local_world: int, samples_per_epoch: int = 0) -> list:
    """Start ``world`` ranks of ``node_rank_main`` (rank r on node r // local_world) and return their reports."""
    port = free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    sizes = f"{samples_per_epoch}, {min(samples_per_epoch, 100)}"  # samples_per_epoch, min_samples (0: defaults)
    ranks = [
        python(
            f"from tests.trainer.test_distributed import node_rank_main; node_rank_main("
            f"{str(roots[r // local_world])!r}, {port}, {r}, {str(outs[r])!r}, {world}, {sizes})",
            extra_env={
                "LOCAL_RANK": str(r % local_world),
                "LOCAL_WORLD_SIZE": str(local_world),
                "RANK": str(r),
                "WORLD_SIZE": str(world),
            },
        )
        for r in range(world)
    ]
    try:
        for proc in ranks:
            assert proc.wait(timeout=150) == 0, "a rank failed (its traceback is above)"
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [json.loads(out.read_text()) for out in outs]


def python(code: str, extra_env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    env = child_env()
    for name in (
        "TORCHELASTIC_RUN_ID",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
    ):
        env.pop(name, None)
    env.update(extra_env or {})
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, **kwargs)


# spawn starts 4 worker interpreters per epoch (2 ranks x 2 workers), each importing torch (~4 s each on this
# 2-core machine): the default run covers spawn over one epoch, the slow run over EPOCHS.
@pytest.mark.parametrize(
    ("context", "epochs"),
    [("fork", EPOCHS), ("spawn", 1), pytest.param("spawn", EPOCHS, marks=pytest.mark.slow)],
)
def test_every_sample_of_each_snapshot_is_delivered_exactly_once_across_ranks_and_workers(
    tmp_path: Path, context: str, epochs: int
) -> None:
    root = tmp_path / "cache"
    writer = python(
        f"from tests.trainer.test_distributed import writer_main; writer_main({str(root)!r}, 6000)",
        stdout=subprocess.PIPE,
        text=True,
    )
    ranks: list[subprocess.Popen] = []
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        port = free_port()
        outs = [tmp_path / f"rank{r}.json" for r in range(2)]
        ranks = [
            python(
                "from tests.trainer.test_distributed import rank_main; "
                f"rank_main({str(root)!r}, {port}, {r}, {context!r}, {str(outs[r])!r}, {epochs})"
            )
            for r in range(2)
        ]
        for proc in ranks:
            assert proc.wait(timeout=150) == 0, "a rank failed (its traceback is above)"
    finally:
        for proc in [*ranks, writer]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if writer.stdout is not None:
            writer.stdout.close()
    reports = [json.loads(out.read_text()) for out in outs]
    evicted = 0
    for epoch in range(epochs):
        first, second = (report["epochs"][epoch] for report in reports)
        snapshot = first["snapshot_keys"]
        assert len(snapshot) == len(set(snapshot)) == first["stats"]["samples"] >= 2000
        served = first["keys"] + second["keys"]
        assert len(served) == len(set(served)), f"epoch {epoch}: a sample was delivered twice"
        assert set(served) <= set(snapshot), f"epoch {epoch}: a sample outside the snapshot was delivered"
        per_rank = len(snapshot) // 2
        assert len(first["keys"]) == len(second["keys"]) == per_rank == first["stats"]["rank_samples"]
        assert len(snapshot) - len(served) < 2, "only the remainder of an odd count is dropped"
        assert first["all_batches"][0] == first["all_batches"][1] == first["batches"], "equal batches per rank"
        assert first["workers"] == second["workers"] == [0, 1], "both workers of each rank read"
        evicted += first["published_while_pinned"]
    if epochs > 1:  # one short epoch may end before the writer turns the cache over
        assert evicted > 0, "the writer must have turned the cache over while the epochs ran"


def test_nodes_with_different_caches_agree_on_equal_shares(tmp_path: Path) -> None:
    from tests.trainer.test_loader import build_cache

    caches = [build_cache(tmp_path / "nodeA", 300), build_cache(tmp_path / "nodeB", 250)]
    reports = run_ranks(tmp_path, caches, world=4, local_world=2)
    for epoch in range(2):
        shares = [report[epoch] for report in reports]
        assert [share["samples"] for share in shares] == [300, 300, 250, 250]
        assert {len(share["keys"]) for share in shares} == {125}, "every rank gets the smallest node's share"
        assert len({share["batches"] for share in shares}) == 1
        for node in (0, 2):
            both = shares[node]["keys"] + shares[node + 1]["keys"]
            assert len(set(both)) == 250, "the two ranks of a node read disjoint parts of its snapshot"


@pytest.mark.parametrize(("cached", "per_epoch"), [(300, 200), (150, 400)])
def test_two_ranks_get_epochs_of_the_set_size_known_before_training(
    tmp_path: Path, cached: int, per_epoch: int
) -> None:
    """``samples_per_epoch`` on two ranks of a node: ``len(loader)`` is per_epoch / 2 / batch for every epoch, the
    first included, and known before it; the ranks never share a sample within an epoch while the snapshot holds
    ``per_epoch`` samples, and reuse it evenly when it holds fewer."""
    from tests.trainer.test_loader import build_cache

    reports = run_ranks(
        tmp_path, [build_cache(tmp_path / "node", cached)], world=2, local_world=1 * 2, samples_per_epoch=per_epoch
    )
    for epoch in range(2):
        shares = [report[epoch] for report in reports]
        assert [share["batches"] for share in shares] == [per_epoch // 2 // 10] * 2
        assert [share["known_before"] for share in shares] == [per_epoch // 2 // 10] * 2
        assert [len(share["keys"]) for share in shares] == [per_epoch // 2] * 2
        served = shares[0]["keys"] + shares[1]["keys"]
        if cached >= per_epoch:
            assert len(set(served)) == per_epoch, f"epoch {epoch}: a sample served twice"
        else:
            assert set(served) == {f"k{i}" for i in range(cached)}, "a small snapshot is reused whole"
            assert max(served.count(key) for key in set(served)) <= -(-per_epoch // cached)
