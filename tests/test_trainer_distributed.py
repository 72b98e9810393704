"""Two real ranks (gloo) x two DataLoader workers each, while a writer process fills and evicts the cache:
every sample of each epoch's snapshot is delivered exactly once across ranks and workers, under fork and spawn.

The ranks and the writer are real processes started from here; they run functions of this module through
``python -c`` (so spawned DataLoader workers can import ``tag_worker`` by name).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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
    from cachefeed.cache.store import CacheStore
    from cachefeed.cache.writer import CacheWriter
    from tests.support.samples import cache_config, make_sample

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

    from cachefeed.cache.layout import CacheLayout
    from cachefeed.trainer import EpochLoaderFactory
    from tests.support.samples import check_sample

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
            if rank == 0:  # the pin is held until loader(epoch + 1): read the whole snapshot, see what was evicted
                dataset = loader.dataset
                entry["snapshot_keys"] = [dataset[i]["__key__"] for i in range(len(dataset))]
                live = {name for name, _info in layout.list_segments()}
                entry["evicted_while_pinned"] = sum(name not in live for name in factory._states[epoch].snapshot.names)
            lengths = [None, None]
            dist.all_gather_object(lengths, len(loader))
            entry["all_batches"] = lengths
            report["epochs"].append(entry)
            dist.barrier()  # DDP keeps ranks in step; so does this
    Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()
    del np


def node_rank_main(root: str, port: int, rank: int, out: str) -> None:
    """One of 4 ranks on 2 simulated nodes (LOCAL_RANK/LOCAL_WORLD_SIZE set by the test), each node its own cache."""
    import torch.distributed as dist

    from cachefeed.trainer import EpochLoaderFactory

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    epochs = []
    with EpochLoaderFactory(root, batch_size=10, run_id="nodes", epochs=2, progress=None) as factory:
        for epoch in range(2):
            loader = factory.loader(epoch)
            keys = [key for batch in loader for key in batch["__key__"]]
            epochs.append({"keys": keys, "batches": len(loader), "samples": factory.stats(epoch).samples})
            dist.barrier()
    Path(out).write_text(json.dumps(epochs))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def python(code: str, extra_env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
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
        f"from tests.test_trainer_distributed import writer_main; writer_main({str(root)!r}, 6000)",
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
                "from tests.test_trainer_distributed import rank_main; "
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
        evicted += first["evicted_while_pinned"]
    if epochs > 1:  # one short epoch may end before the writer turns the cache over
        assert evicted > 0, "the writer must have evicted pinned segments while the epochs ran"


def test_nodes_with_different_caches_agree_on_equal_shares(tmp_path: Path) -> None:
    from tests.test_trainer_loader import build_cache

    caches = [build_cache(tmp_path / "nodeA", 300), build_cache(tmp_path / "nodeB", 250)]
    port = free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(4)]
    ranks = [
        python(
            f"from tests.test_trainer_distributed import node_rank_main; "
            f"node_rank_main({str(caches[r // 2])!r}, {port}, {r}, {str(outs[r])!r})",
            extra_env={"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "RANK": str(r), "WORLD_SIZE": "4"},
        )
        for r in range(4)
    ]
    try:
        for proc in ranks:
            assert proc.wait(timeout=150) == 0
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reports = [json.loads(out.read_text()) for out in outs]
    for epoch in range(2):
        shares = [report[epoch] for report in reports]
        assert [share["samples"] for share in shares] == [300, 300, 250, 250]
        assert {len(share["keys"]) for share in shares} == {125}, "every rank gets the smallest node's share"
        assert len({share["batches"] for share in shares}) == 1
        for node in (0, 2):
            both = shares[node]["keys"] + shares[node + 1]["keys"]
            assert len(set(both)) == 250, "the two ranks of a node read disjoint parts of its snapshot"
