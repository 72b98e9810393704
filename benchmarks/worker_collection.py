"""What a worker's full garbage collection costs, with the objects it inherited frozen and, as a control, not.

    python -m benchmarks.worker_collection [--objects 500000] [--workers 2] [--no-save]

A training process (torch imported, as every trainer has it, and ``--objects`` small lists standing for the
model, the data and the harness of a real one) opens a factory with ``--workers`` forked workers over a small
cache. In each worker, the first sample's transform runs a full collection as the worker starts it (what the
worker inherited frozen: NOTE [ A worker's collector skips what it inherited ] in ``cachefeed/_trainer/pool.py``),
then unfreezes what it inherited and runs one more, as every worker's first full collection ran before the
freeze. Each is measured in that worker: CPU seconds (``time.process_time``) and minor page faults
(``getrusage``: a page fault per page of the training process the collection copied). The training process's
tracked objects at the fork are printed too. Writes ``benchmarks/results/worker_collection.json``
(``--no-save`` to skip).
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch  # noqa: F401  (imported as a trainer has it: its objects are inherited too)

from benchmarks.common.results import save
from benchmarks.common.static_cache import write_static_cache
from cachefeed._trainer import EpochLoaderFactory

SAMPLES = 16


def _collection() -> tuple[float, int]:
    """CPU seconds and minor page faults of one full collection in this process."""
    faults, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
    gc.collect()
    return time.process_time() - cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def measure_in_worker(sample: dict[str, Any]) -> dict[str, Any]:
    """The transform: on a worker's first sample, a full collection frozen, then one unfrozen (the control)."""
    found = getattr(measure_in_worker, "found", None)
    if found is None:
        frozen = _collection()
        gc.unfreeze()
        found = measure_in_worker.found = (*frozen, *_collection())  # type: ignore[attr-defined]
    sample["found"] = np.array(found, dtype=np.float64)
    return sample


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--objects", type=int, default=500_000, help="small lists the training process holds")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    ballast = [[i] for i in range(args.objects)]
    gc.collect()  # the free lists empty at the fork, as in the test
    tracked = len(gc.get_objects())
    with tempfile.TemporaryDirectory(prefix="cachefeed-collection-") as tmp:
        root = Path(tmp) / "cache"
        data = np.arange(16, dtype=np.uint8)
        write_static_cache(root, ({"__key__": f"s{i}", "data": data} for i in range(SAMPLES)))
        with EpochLoaderFactory(
            root,
            batch_size=1,
            num_workers=args.workers,
            transform=measure_in_worker,
            run_id="collection",
            progress=None,
        ) as factory:
            rows = {tuple(batch["found"][0].tolist()) for batch in factory.loader(0)}
    assert len(ballast) == args.objects
    figures = {
        "objects_in_training_process": tracked,
        "workers": len(rows),
        "frozen_cpu_s": round(statistics.median(row[0] for row in rows), 4),
        "frozen_pages": int(statistics.median(row[1] for row in rows)),
        "unfrozen_cpu_s": round(statistics.median(row[2] for row in rows), 4),
        "unfrozen_pages": int(statistics.median(row[3] for row in rows)),
    }
    print(f"training process: {tracked:,} tracked objects at the fork; {len(rows)} workers (medians):")
    print(
        f"  a full collection, inherited objects frozen: {figures['frozen_cpu_s'] * 1e3:.1f} ms of CPU, "
        f"{figures['frozen_pages']:,} pages copied"
    )
    print(
        f"  the control, unfrozen:                       {figures['unfrozen_cpu_s'] * 1e3:.1f} ms of CPU, "
        f"{figures['unfrozen_pages']:,} pages copied"
    )
    if not args.no_save:
        print(f"wrote {save('worker_collection', figures, work_dir=Path(tempfile.gettempdir()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
