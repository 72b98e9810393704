"""Read throughput of the snapshot dataset from a warm tmpfs cache, next to a plain sequential read of the same files.

    python -m benchmarks.read_throughput [--dir /dev/shm] [--mib 256] [--repeats 3] [--workers 2]

For each sample size (4 KiB, 128 KiB, 2 MiB) it builds a cache of about ``--mib`` MiB on tmpfs, then measures, in
payload bytes per second (the same numerator everywhere):

* ``raw read``: every segment file read sequentially with ``readinto`` into one reused, page-aligned buffer (one
  copy out of the page cache: the ceiling for anything that reads these bytes once; ``common/rawread.py``);
* ``dataset``: ``SnapshotDataset.__getitems__`` over shuffled batches: zero-copy views of fresh memory maps (page
  faults paid, as in a new epoch), every record's xxh3 checksum verified (so every byte is read once);
* ``dataset+collate``: the same plus ``default_collate`` (stacking the batch: one copy, what a DataLoader worker does);
* ``DataLoader``: ``EpochLoaderFactory`` with ``--workers`` fork workers, batches consumed by the main process,
  timed from the first batch to the last (steady state; the handover is ``benchmarks/handover.py``'s subject).

Each figure is the median of ``--repeats`` runs, the columns measured in turn within each run (so a neighbour's load
on a shared host weighs on all of them alike); ratios are against the raw read. Writes
``benchmarks/results/read_throughput.json`` (``--no-save`` to skip), which the README's table is rendered from.

Where a worker's time goes at 128 KiB (one-off profiles, 2026-11-24, 2 shared CPUs, AMD EPYC, Python 3.11.7; a
256 MiB cache on /dev/shm, batches of 32, one process, the batch's destination reused):

* the floor, the reader's ``read(verify=True)`` and one numpy copy into a batch row: 18.4-19.6 us a sample (apart:
  the xxh3 pass 10.5 us, the copy 10.1, the reader's Python 5.3; right after the checksum the copy reads the
  record from the CPU's cache);
* the worker's path at d09aac5 (``iter_items`` yielding tensors, ``RowCollator`` turning each back into an array,
  with its checks): 29.0-29.1 us; with the reader's arrays copied as they are (``iter_items(tensors=False)``,
  since then): 23.0-24.0 us;
* with 2 workers on 2 cores (``perf record -a``, 12 epochs): the copy (``memmove``) and the checksum (xxh3) are about
  half of each worker's time; both slow down when the two workers stream memory at once (a plain hash-and-copy
  loop over 128 KiB rows, no Python: 22.7 us a row alone, 34.3 us with a second one running), so two workers
  reach about 1.5x one, not 2x.

A new factory's first epoch (one-off, 2026-11-25, another host of the same kind, 7 factories per variant): 2048 x
128 KiB took 76-80 ms from the factory's creation to the end of its first epoch, 56 ms of it after the first batch.
With every segment map populated at open (``MADV_POPULATE_READ``) and each worker's first 32 MiB of shared memory
at start (``MADV_POPULATE_WRITE``), the part after the first batch fell to 32-33 ms and the whole stayed at 85-87 ms:
prefaulting moves the faults ahead of the first batch and saves nothing, so cachefeed does not do it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from benchmarks.common.rawread import read_buffer, read_files
from benchmarks.common.results import provenance_line, save
from benchmarks.common.static_cache import write_static_cache
from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.snapshots import Snapshot
from cachefeed._trainer import EpochLoaderFactory, SnapshotDataset

SIZES = [("4 KiB", 4 << 10, 256), ("128 KiB", 128 << 10, 32), ("2 MiB", 2 << 20, 4)]  # name, bytes, batch
SEGMENT_BYTES = 64 << 20


def build_cache(root: Path, sample_bytes: int, total_bytes: int) -> int:
    """A cache of ``total_bytes // sample_bytes`` random samples; returns the count."""
    count = max(1, total_bytes // sample_bytes)
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, size=sample_bytes + 4096, dtype=np.uint8)
    samples = ({"__key__": f"s{i}", "data": pool[i % 4096 : i % 4096 + sample_bytes]} for i in range(count))
    write_static_cache(root, samples, segment_bytes=SEGMENT_BYTES, max_bytes=total_bytes * 2 + (64 << 20))
    return count


def raw_read(root: Path, buffer: memoryview) -> float:
    """Seconds to read every segment file sequentially (``rawread.read_files``: the same read as the peer harness)."""
    layout = CacheLayout(root)
    paths = [layout.segments / name for name, _info in layout.list_segments()]
    started = time.perf_counter()
    read_files(paths, buffer)
    return time.perf_counter() - started


def dataset_pass(root: Path, batch: int, *, collate: bool) -> float:
    """Seconds for one shuffled pass over a fresh dataset (fresh maps) of the snapshot ``bench``."""
    with Snapshot.create(root, "bench-read") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot)
        order = np.random.default_rng(1).permutation(len(dataset))
        started = time.perf_counter()
        for start in range(0, len(order), batch):
            samples = dataset.__getitems__(order[start : start + batch])
            if collate:
                default_collate(samples)
        elapsed = time.perf_counter() - started
        dataset.close()
    return elapsed


def loader_pass(root: Path, batch: int, workers: int, epochs: int) -> tuple[float, float]:
    """Seconds for one epoch through a new factory: (its first epoch, the median of the ``epochs - 1`` after it).

    The first epoch's workers fault in the segments' pages and their shared memory; a training job pays that once,
    since its workers live across epochs, and reads every later epoch as the second figure does."""
    times: list[float] = []
    with EpochLoaderFactory(
        root,
        batch_size=batch,
        num_workers=workers,
        multiprocessing_context="fork",
        run_id="bench",
        prefetch_factor=4,
        progress=None,
    ) as factory:
        for epoch in range(epochs):
            loader = factory.loader(epoch)
            batches = iter(loader)
            next(batches)  # the first batch was prefetched while building: time the steady state
            started = time.perf_counter()
            consumed = 1
            for _ in batches:
                consumed += 1
            elapsed = time.perf_counter() - started
            times.append(elapsed * len(loader) / max(1, consumed - 1))  # scale to the whole epoch
    return times[0], statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/dev/shm", help="a tmpfs directory (default /dev/shm)")
    parser.add_argument("--mib", type=int, default=256, help="payload per sample size, MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4, help="epochs per factory: the first, and the later ones")
    parser.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/read_throughput.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"cpus={os.cpu_count()} torch={torch.__version__} dir={args.dir} payload={args.mib} MiB per size")
    header = (
        f"{'sample':>8} {'samples':>8} {'raw read':>10} {'dataset':>16} {'dataset+collate':>16} "
        f"{'loader, 1st epoch':>17} {'later epochs':>16}"
    )
    print(header)
    buffer = read_buffer(8 << 20)
    rows: list[dict[str, Any]] = []
    for name, sample_bytes, batch in SIZES:
        base = Path(tempfile.mkdtemp(prefix="cachefeed-read-", dir=args.dir))
        try:
            root = base / "cache"
            count = build_cache(root, sample_bytes, args.mib << 20)
            payload = count * sample_bytes
            raw_read(root, buffer)  # warm-up
            runs: dict[str, list[float]] = {"raw": [], "plain": [], "stacked": [], "first": [], "later": []}
            for _ in range(args.repeats):  # interleaved: a neighbour's load on the host lands on every column alike
                runs["raw"].append(raw_read(root, buffer))
                runs["plain"].append(dataset_pass(root, batch, collate=False))
                runs["stacked"].append(dataset_pass(root, batch, collate=True))
                first_s, later_s = loader_pass(root, batch, args.workers, args.epochs)
                runs["first"].append(first_s)
                runs["later"].append(later_s)
            raw, plain, stacked, first, loader = (payload / statistics.median(runs[key]) for key in runs)

            def cell(rate: float, raw: float = raw) -> str:
                return f"{rate / 1e9:6.2f} GB/s {rate / raw:4.2f}x"

            print(
                f"{name:>8} {count:>8} {raw / 1e9:6.2f} GB/s {cell(plain):>16} {cell(stacked):>16} "
                f"{cell(first):>17} {cell(loader):>16}"
            )
            rows.append(
                {
                    "sample": name,
                    "samples": count,
                    "batch": batch,
                    "raw_read_bytes_per_s": round(raw),
                    "dataset_bytes_per_s": round(plain),
                    "dataset_collate_bytes_per_s": round(stacked),
                    "loader_first_epoch_bytes_per_s": round(first),
                    "loader_bytes_per_s": round(loader),
                }
            )
        finally:
            shutil.rmtree(base, ignore_errors=True)
    if not args.no_save:
        figures = {
            "workers": args.workers,
            "mib": args.mib,
            "repeats": args.repeats,
            "epochs": args.epochs,
            "rows": rows,
        }
        print(f"wrote {save('read_throughput', figures, work_dir=Path(args.dir))}")


def readme_table(doc: dict[str, Any]) -> str:
    """The README's read-throughput table, from a committed result document."""
    figures = doc["figures"]
    lines = [
        f"Payload bytes per second from a warm tmpfs cache, next to a sequential read of the same segment files "
        f"({figures['mib']} MiB per sample size, median of {figures['repeats']}; the loader: "
        f"`EpochLoaderFactory` with {figures['workers']} workers, every record verified; its first epoch, when "
        f"new workers fault in the pages, and the median of the {figures.get('epochs', 4) - 1} after it):",
        "",
        "| sample size | raw read | dataset (zero-copy views) | dataset + collate | loader, first epoch "
        "| loader, later epochs |",
        "|---|---|---|---|---|---|",
    ]
    keys = (
        "dataset_bytes_per_s",
        "dataset_collate_bytes_per_s",
        "loader_first_epoch_bytes_per_s",
        "loader_bytes_per_s",
    )
    for row in figures["rows"]:
        raw = row["raw_read_bytes_per_s"]
        cells = [f"{row[key] / 1e9:.2f} GB/s ({row[key] / raw:.2f}x)" if key in row else "-" for key in keys]
        lines.append(f"| {row['sample']} | {raw / 1e9:.2f} GB/s | " + " | ".join(cells) + " |")
    lines += ["", "Measured with " + provenance_line(doc) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
