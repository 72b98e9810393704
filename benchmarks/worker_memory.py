"""Worker memory over one epoch of a snapshot of 1,000,000 small samples: flat, not growing by copy-on-access.

    python -m benchmarks.worker_memory [--samples 1000000] [--workers 2] [--context fork] [--no-naive]

Builds a tmpfs cache of ``--samples`` 16-byte samples with an in-process writer, then runs one epoch through
``EpochLoaderFactory`` and reads every worker's ``/proc/<pid>/smaps_rollup`` as the epoch goes. Reported per
worker, in MiB:

* ``USS`` = Private_Clean + Private_Dirty, ``PSS``, ``RSS``;
* ``dirty`` = Private_Dirty: pages only this worker holds and has written, where copy-on-access shows (a forked
  worker that touches the reference counts of the parent's per-sample Python objects copies every page it
  touches into its own dirty memory);
* ``cache`` = Pss_Shmem + Pss_File: pages of the cache's segment files that the worker has mapped. They belong to
  tmpfs (the page cache), exist once however many workers map them, and are neither allocated nor freed by the
  worker; a worker that has read most of the snapshot maps most of it.

Growth is measured from 5% of the epoch (workers started, readers open, the snapshot's pages mapped: the line at
the first batch shows that ramp) to its end. With ``--naive`` (default on)
the same epoch runs again over a dataset that keeps a per-sample Python list as its index, as a control: there,
``dirty`` and ``USS`` grow with the share of the epoch read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.common.results import provenance_line, save
from benchmarks.common.static_cache import write_static_cache
from cachefeed._cache.records import SegmentReader
from cachefeed._cache.snapshots import Snapshot
from cachefeed._trainer import EpochLoaderFactory

FIELDS = ("Rss", "Pss", "Private_Clean", "Private_Dirty", "Anonymous", "Pss_Shmem", "Pss_File")
CHECKPOINTS = (0.0, 0.05, 0.25, 0.5, 0.75, 1.0)  # 0.0: the first batch
BASELINE = 0.05


def build_cache(root: Path, count: int) -> float:
    data = np.arange(16, dtype=np.uint8)
    started = time.perf_counter()
    write_static_cache(root, ({"__key__": f"s{i}", "data": data} for i in range(count)))
    return time.perf_counter() - started


def rollup(pid: int) -> dict[str, float]:
    """The smaps_rollup fields of ``pid``, in MiB."""
    values: dict[str, float] = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if name in FIELDS:
                values[name] = int(rest.split()[0]) / 1024
    return {
        "RSS": values["Rss"],
        "PSS": values["Pss"],
        "USS": values["Private_Clean"] + values["Private_Dirty"],
        "dirty": values["Private_Dirty"],
        "cache": values.get("Pss_Shmem", 0.0) + values.get("Pss_File", 0.0),
    }


def run_epoch(batches: Any, total: int, pids: list[int]) -> list[tuple[float, list[dict[str, float]]]]:
    """Consume an epoch, sampling every worker's memory at the checkpoints."""
    marks = sorted({max(1, round(total * point)) for point in CHECKPOINTS})
    samples: list[tuple[float, list[dict[str, float]]]] = []
    for done, _batch in enumerate(batches, start=1):
        if marks and done == marks[0]:
            marks.pop(0)
            samples.append((done / total, [rollup(pid) for pid in pids]))
    return samples


def report(title: str, samples: list[tuple[float, list[dict[str, float]]]]) -> dict[str, list[float]]:
    """Print the table; return each worker's growth of USS, PSS and dirty memory over the epoch (fractions)."""
    print(f"\n{title}")
    print(f"{'epoch':>6} {'worker':>6} {'RSS':>9} {'PSS':>9} {'USS':>9} {'dirty':>9} {'cache':>9}   (MiB)")
    for point, workers in samples:
        for index, mem in enumerate(workers):
            cells = " ".join(f"{mem[key]:9.1f}" for key in ("RSS", "PSS", "USS", "dirty", "cache"))
            print(f"{point:>6.0%} {index:>6} {cells}")
    base = next(workers for point, workers in samples if point >= BASELINE)
    last = samples[-1][1]
    growths: dict[str, list[float]] = {}
    for key in ("USS", "PSS", "dirty"):
        growth = [(b[key] - a[key]) / a[key] for a, b in zip(base, last, strict=True)]
        print(f"  {key} growth from {BASELINE:.0%} to 100% of the epoch: " + ", ".join(f"{g:+.1%}" for g in growth))
        growths[key] = [round(g, 4) for g in growth]
    return growths


class NaiveDataset(Dataset[Any]):
    """The control: a per-sample Python list as the index (what copy-on-access punishes)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.index = [
            (str(path), record)
            for path, count in zip(snapshot.paths, snapshot.counts, strict=True)
            for record in range(count)
        ]
        self._readers: dict[str, SegmentReader] = {}

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Any:
        path, record = self.index[i]
        reader = self._readers.get(path)
        if reader is None:
            reader = self._readers[path] = SegmentReader(path)
        sample = reader.read(record)
        return {"data": torch.from_numpy(sample["data"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--context", default="fork")
    parser.add_argument("--no-naive", dest="naive", action="store_false")
    parser.add_argument("--no-save", dest="save", action="store_false", help="do not write results/worker_memory.json")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="cachefeed-memory-", dir=args.dir))
    try:
        root = base / "cache"
        built_s = build_cache(root, args.samples)
        print(
            f"cpus={os.cpu_count()} torch={torch.__version__}: {args.samples} samples of 16 bytes written in "
            f"{built_s:.0f}s; {args.workers} {args.context} workers, batch {args.batch}"
        )
        with EpochLoaderFactory(
            root,
            batch_size=args.batch,
            num_workers=args.workers,
            multiprocessing_context=args.context,
            run_id="memory",
            epochs=1,
            progress=None,
        ) as factory:
            loader = factory.loader(0)
            batches = iter(loader)
            assert factory._pool is not None  # the factory's worker pool (_trainer/pool.py), started by loader(0)
            pids = [worker.process.pid for worker in factory._pool._workers]
            started = time.perf_counter()
            samples = run_epoch(batches, len(loader), pids)
            elapsed = time.perf_counter() - started
        figures: dict[str, Any] = {"samples": args.samples, "workers": args.workers, "context": args.context}
        figures["cachefeed_growth"] = report(
            f"EpochLoaderFactory (numpy index), epoch of {len(loader)} batches in {elapsed:.0f}s", samples
        )
        if args.naive:
            with Snapshot.create(root, "memory-naive") as snapshot:
                dataset = NaiveDataset(snapshot)
                naive = DataLoader(
                    dataset,
                    batch_size=args.batch,
                    shuffle=True,
                    num_workers=args.workers,
                    multiprocessing_context=args.context,
                )
                batches = iter(naive)
                pids = [worker.pid for worker in batches._workers]  # type: ignore[attr-defined]
                started = time.perf_counter()
                samples = run_epoch(batches, len(naive), pids)
                elapsed = time.perf_counter() - started
                del batches
            title = f"control: per-sample Python list index, epoch in {elapsed:.0f}s"
            figures["python_list_growth"] = report(title, samples)
        if args.save:
            print(f"results: {save('worker_memory', figures, work_dir=Path(args.dir))}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def readme_table(doc: dict[str, Any]) -> str:
    """The README's worker-memory line, from a committed result document."""
    figures = doc["figures"]

    def worst(growths: dict[str, list[float]], key: str) -> str:
        return f"{max(growths[key]):+.1%}"

    ours, naive = figures["cachefeed_growth"], figures.get("python_list_growth")
    lines = [
        f"Memory growth of each DataLoader worker over one epoch of {figures['samples']:,} samples "
        f"({figures['workers']} {figures['context']} workers; from 5% to 100% of the epoch, the worst worker):",
        "",
        "| index | USS | PSS | private dirty |",
        "|---|---|---|---|",
        f"| cachefeed (numpy arrays) | {worst(ours, 'USS')} | {worst(ours, 'PSS')} | {worst(ours, 'dirty')} |",
    ]
    if naive:
        lines.append(
            f"| control: a per-sample Python list | {worst(naive, 'USS')} | {worst(naive, 'PSS')} "
            f"| {worst(naive, 'dirty')} |"
        )
    lines += ["", "Measured with " + provenance_line(doc) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
