"""The training process of ``benchmarks/cold_launch.py``: started fresh at t0, it imports what a training script
imports (torch first, then the loader's library through its adapter), opens the loader, reads epoch 0 and prints
its marks (``time.time()``, the launching process's clock too) as one JSON line.

    python -m benchmarks.cold_launch_trainer SPEC     # SPEC: JSON, written by cold_launch.py

Only the standard library is imported before the clock's first mark, so every import of either system is on its
own clock: torch, the adapter module (``benchmarks.peers.lit`` imports litdata; ``benchmarks.cachefeed_tar_adapter``
imports cachefeed's tar decoder and numpy), and the harness's settings and verification, which both share.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Import, open, read epoch 0 verifying every sample; the marks. Raises if the epoch served no batch."""
    import torch  # noqa: F401  (what a training script imports first)

    torch_done = time.time()
    module, _, name = spec["adapter"].partition(":")
    adapter = getattr(importlib.import_module(module), name)()
    from benchmarks.common.adapter import DataLocation, LoaderSettings
    from benchmarks.common.samples import Workload, verify_batch

    imported = time.time()
    workload = Workload(**spec["workload"])
    settings = LoaderSettings(
        batch_size=workload.batch_size,
        num_workers=spec["workers"],
        cache_dir=Path(spec["cache_dir"]),
        extra={"epochs": 1},
    )
    if spec.get("daemon_cache_dir"):  # the daemon was launched at t0 beside this process: the loader alone
        from benchmarks.cachefeed_adapter import make_factory

        source = make_factory(Path(spec["daemon_cache_dir"]), settings)
        epoch = source.loader
    else:
        source = adapter.open(workload, DataLocation(None, spec["url"], spec["endpoint"]), settings)
        epoch = source.epoch
    opened = time.time()
    first, served, distinct = None, 0, set()
    try:
        for batch in epoch(0):
            if first is None:
                first = time.time()
            indices = verify_batch(batch)
            served += len(indices)
            distinct.update(indices)
        end = time.time()
    finally:
        source.close()
    if first is None:
        raise RuntimeError(f"{spec['system']}: epoch 0 served no batch")
    return {
        "torch_imported": torch_done,
        "imported": imported,
        "opened": opened,
        "first_batch": first,
        "epoch_end": end,
        "samples": served,
        "distinct": len(distinct),
    }


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
