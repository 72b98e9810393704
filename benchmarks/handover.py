"""The epoch handover: how long a training loop waits between the last batch of one epoch and the first of the next.

    python -m benchmarks.handover [--contexts fork,forkserver,spawn] [--epochs 3] [--epoch-s 8] [--workers 2]

Writes ``benchmarks/results/handover.json`` (``--no-save`` to skip), from which the README's table is rendered.

Three ways to run epochs over the same cache, each with ``--workers`` DataLoader workers doing real decoding
(every sample is a zlib-compressed 64x64x3 image, decompressed, converted to float, normalised and transposed to
CHW in the worker), and a training step of ``--step-ms`` (a sleep: the GPU's time, which leaves the CPU to the
workers):

* ``factory``: ``EpochLoaderFactory`` (the next epoch's snapshot, DataLoader and workers built in the background);
* ``new DataLoader``: a new DataLoader per epoch (what most training loops do);
* ``persistent``: one DataLoader with ``persistent_workers=True``, iterated once per epoch.

The wait is measured by the loop itself: from the end of the training step on the last batch of epoch ``e`` to
the moment the first batch of ``e + 1`` is in hand (so it includes ``factory.loader(e + 1)``, building a
DataLoader, starting workers, and the first batch). One line per (start method, way); the worst wait counts.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from benchmarks.common.results import provenance_line, save
from benchmarks.common.static_cache import write_static_cache
from cachefeed._cache.snapshots import Snapshot
from cachefeed._trainer import EpochLoaderFactory, SnapshotDataset

SIDE = 64
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32) * 255


def decode(sample: dict[str, Any]) -> dict[str, Any]:
    """The per-sample work of a worker: decompress, to float, normalise, HWC -> CHW (contiguous)."""
    pixels = np.frombuffer(zlib.decompress(sample["image"]), dtype=np.uint8).reshape(SIDE, SIDE, 3)
    image = (pixels.astype(np.float32) - MEAN) / STD
    return {"image": torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))), "label": sample["label"]}


def build_cache(root: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    ramp = np.add.outer(np.arange(SIDE), np.arange(SIDE)).astype(np.uint8)[:, :, None]

    def samples() -> Iterator[dict[str, Any]]:
        for i in range(count):
            noise = rng.integers(0, 16, size=(SIDE, SIDE, 3), dtype=np.uint8)
            pixels = (ramp * (i % 7 + 1) + noise).astype(np.uint8)
            yield {"__key__": f"img{i}", "image": zlib.compress(pixels.tobytes(), 6), "label": i % 1000}

    write_static_cache(root, samples())


def run_epochs(next_loader: Callable[[int], Iterable[Any]], epochs: int, step_s: float) -> list[float]:
    """Train ``epochs`` epochs; return the waits between epochs as the loop sees them."""
    waits: list[float] = []
    step_done = 0.0
    for epoch in range(epochs):
        first = True
        for batch in next_loader(epoch):
            if first and epoch:
                waits.append(time.perf_counter() - step_done)
            first = False
            if batch["image"].shape[1:] != (3, SIDE, SIDE):
                raise RuntimeError("bad batch")
            time.sleep(step_s)
            step_done = time.perf_counter()
    return waits


def measure(method: str, root: Path, context: Any, args: argparse.Namespace) -> tuple[list[float], str]:
    options: dict[str, Any] = {"num_workers": args.workers, "multiprocessing_context": context}
    step_s = args.step_ms / 1000
    if method == "factory":
        with EpochLoaderFactory(
            root,
            batch_size=args.batch,
            transform=decode,
            run_id=f"handover-{os.getpid()}",
            epochs=args.epochs,
            progress=None,
            **options,
        ) as factory:
            waits = run_epochs(factory.loader, args.epochs, step_s)
            own = [factory.stats(e).handover_wait_s or 0.0 for e in range(1, args.epochs)]
            builds = [factory.stats(e).build_s for e in range(args.epochs)]
        note = f"own measure {_ms(own)}; builds {_ms(builds)} (background: {_ms(builds[1:])})"
        return waits, note
    with Snapshot.create(root, f"handover-{os.getpid()}-fixed") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot, transform=decode)
        if method == "new DataLoader":

            def fresh(epoch: int) -> Iterable[Any]:
                generator = torch.Generator().manual_seed(epoch)
                return DataLoader(dataset, batch_size=args.batch, shuffle=True, generator=generator, **options)

            waits = run_epochs(fresh, args.epochs, step_s)
        else:
            loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, persistent_workers=True, **options)
            waits = run_epochs(lambda _epoch: loader, args.epochs, step_s)
            del loader
        dataset.close()
    return waits, ""


def _ms(values: list[float]) -> str:
    return "[" + ", ".join(f"{v * 1000:.1f}" for v in values) + "] ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--contexts", default="fork,forkserver,spawn")
    parser.add_argument("--methods", default="factory,new DataLoader,persistent")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--epoch-s", type=float, default=8.0, help="target epoch length in seconds (default 8)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="training step per batch (default 10 ms)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-save", dest="save", action="store_false", help="do not write results/handover.json")
    args = parser.parse_args()
    batches = max(4, int(args.epoch_s * 1000 / args.step_ms))
    count = batches * args.batch
    multiprocessing.set_forkserver_preload(["torch", "cachefeed._trainer.dataset", "benchmarks.handover"])
    base = Path(tempfile.mkdtemp(prefix="cachefeed-handover-", dir=args.dir))
    results: dict[tuple[str, str], list[float]] = {}
    try:
        root = base / "cache"
        build_cache(root, count)
        print(
            f"cpus={os.cpu_count()} torch={torch.__version__}: {count} samples, batch {args.batch}, {batches} "
            f"batches/epoch, step {args.step_ms:g} ms, {args.workers} workers, {args.epochs} epochs"
        )
        print(f"{'context':<11} {'method':<15} {'worst':>10} {'median':>10}  waits")
        for name in args.contexts.split(","):
            context = multiprocessing.get_context(name)
            for method in args.methods.split(","):
                waits, note = measure(method, root, context, args)
                results[(name, method)] = waits
                print(
                    f"{name:<11} {method:<15} {max(waits) * 1000:8.1f}ms {statistics.median(waits) * 1000:8.1f}ms"
                    f"  {_ms(waits)} {note}",
                    flush=True,
                )
        figures = {
            "samples": count,
            "batch_size": args.batch,
            "batches_per_epoch": batches,
            "step_ms": args.step_ms,
            "workers": args.workers,
            "epochs": args.epochs,
            "cpus": os.cpu_count(),
            "rows": [
                {
                    "context": name,
                    "method": method,
                    "worst_ms": round(max(waits) * 1000, 2),
                    "median_ms": round(statistics.median(waits) * 1000, 2),
                    "waits_ms": [round(w * 1000, 2) for w in waits],
                }
                for (name, method), waits in results.items()
            ],
        }
        if args.save:
            print(f"results: {save('handover', figures, work_dir=Path(args.dir))}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for name in args.contexts.split(","):
        factory = results.get((name, "factory"))
        fresh = results.get((name, "new DataLoader"))
        if factory and fresh:
            print(
                f"{name}: factory worst {max(factory) * 1000:.2f} ms, {max(fresh) / max(factory):.0f}x better than "
                f"a new DataLoader per epoch (worst {max(fresh) * 1000:.0f} ms)"
            )


def readme_table(doc: dict[str, Any]) -> str:
    """The README's handover table, from a committed result document."""
    figures = doc["figures"]
    worst = {(row["context"], row["method"]): row["worst_ms"] for row in figures["rows"]}
    contexts = list(dict.fromkeys(row["context"] for row in figures["rows"]))
    lines = [
        f"Worst wait between two epochs ({figures['workers']} workers decoding, a {figures['step_ms']:g} ms step, "
        f"{figures['batches_per_epoch']} batches an epoch, {figures['cpus']} CPUs):",
        "",
        "| start method | EpochLoaderFactory | a new DataLoader per epoch | one DataLoader, persistent workers |",
        "|---|---|---|---|",
    ]
    for context in contexts:
        cells = [worst.get((context, method)) for method in ("factory", "new DataLoader", "persistent")]
        lines.append(f"| {context} | " + " | ".join("-" if v is None else f"{v:,.1f} ms" for v in cells) + " |")
    lines += ["", "Measured with " + provenance_line(doc) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
