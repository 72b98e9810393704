"""Benchmark the peers of cachefeed (mosaicml-streaming, litdata) and the baselines on the same data, same run.

    .bench-venv/bin/python benchmarks/peers/run_peers.py --smoke       # tiny sizes: 60-80 s (fixed library costs)
    .bench-venv/bin/python benchmarks/peers/run_peers.py               # full: 13-21 min for all peers
    ... --systems mosaic,s3fs --workloads small                         # a subset
    ... --add cachefeed=benchmarks.cachefeed_adapter:CachefeedAdapter   # another system, same measurements

Results: ``benchmarks/results/tmp/peers-<mode>-<time>/results.json`` (everything, incl. per-epoch figures,
failures and child logs) and ``summary.txt``. Create the environment first: ``benchmarks/peers/setup_env.sh``.

Where the full run cuts counts (2-core machine, whole suite within about an hour): the datasets are 32 MiB
(small), 128 MiB (medium), 256 MiB (large); handover is measured on medium only;
s3fs (no cache: every epoch is the same full download) runs 1 epoch cold, none under the budget (the same
figure), 2 per handover variant. The in-process read (``inprocess``: ``num_workers=0``, right after the warm
``local`` read, same files) runs 3 to 5 epochs (``inprocess_epochs``) in every mode. Smoke: 1024 samples of
16 KiB, persistent-fork handover only, no s3fs handover.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common.runner import MeasureSpec  # noqa: E402
from benchmarks.common.samples import Workload  # noqa: E402
from benchmarks.common.suite import Suite, System  # noqa: E402

PEERS = [
    System("mosaic", "benchmarks.peers.mosaic:MosaicAdapter"),
    System("litdata", "benchmarks.peers.lit:LitAdapter"),
    System("local-files", "benchmarks.peers.baselines:LocalFilesAdapter"),
    System("s3fs", "benchmarks.peers.baselines:S3fsAdapter"),
    System("memory", "benchmarks.peers.baselines:MemoryAdapter"),
    System("memory-batched", "benchmarks.peers.baselines:BatchedMemoryAdapter"),
]

WORKLOADS = {
    # 16 MiB: a 30% budget must leave cachefeed (1 MiB metadata reserve, 25% turnover) room for its segments.
    "smoke": [Workload("small", 16 << 10, 1024, 32)],
    "full": [
        Workload("small", 4 << 10, 8192, 256),
        Workload("medium", 128 << 10, 1024, 32),
        Workload("large", 2 << 20, 128, 4),
    ],
}
HANDOVER_WORKLOAD = {"smoke": "small", "full": "medium"}
# Epoch counts cut per system (see the module docstring); keys: measurement labels, 0 skips the measurement.
EPOCH_CUTS = {
    "full": {"s3fs": {"cold": 1, "budget30": 0, "handover": 2}},
    "smoke": {"s3fs": {"cold": 1, "budget30": 0, "handover": 0}},
}
_SKIP_REASON = "s3fs caches nothing: every epoch is the cold epoch again, whatever the budget"
# Systems that take no part in figure 4 (not a cut for time: the figure would say nothing about them).
NO_HANDOVER = {
    "memory-batched": "the read ceiling always keeps its workers: the DataLoader's own handover is the memory row",
}


def make_plan(mode: str, workers: int) -> object:
    smoke = mode == "smoke"
    # No batch (nor heartbeat) for this long means hung. Heartbeats come every 5 s while batches arrive.
    hang_s = 60.0 if smoke else 120.0

    def epoch_s(workload: Workload) -> float:
        """Generous time for one epoch: ~40 small GETs/s or ~5 MB/s is below every system's pace here."""
        return 30.0 + max(workload.count / 40, workload.total_bytes / 5e6)

    def plan(workload: Workload, key: str) -> list[MeasureSpec]:
        cuts = EPOCH_CUTS[mode].get(key, {})
        base = {"num_workers": workers}

        def epochs_spec(label: str, kind: str, epochs: int, **params: object) -> MeasureSpec:
            # ``max_remote_factor``: stop a run that downloads over 10x the dataset per epoch (thrash).
            full = {**base, "epochs": epochs, "max_remote_factor": 10, **params}
            return MeasureSpec(label, kind, full, hang_s, max_s=60.0 + epochs * epoch_s(workload))

        specs = [
            MeasureSpec("describe", "describe", {}, 120.0),
            MeasureSpec("convert", "convert", {}, hang_s + 2 * epoch_s(workload)),
            epochs_spec("local", "local", 2 if smoke else 4),
            epochs_spec("inprocess", "local", inprocess_epochs(workload), num_workers=0, sequential_read=False),
            epochs_spec("cold", "remote", cuts.get("cold", 2)),
            epochs_spec("budget30", "remote", cuts.get("budget30", 2 if smoke else 3), budget_fraction=0.3),
        ]
        if workload.name == HANDOVER_WORKLOAD[mode] and key in NO_HANDOVER:
            specs.append(MeasureSpec("handover", "skipped", {"reason": NO_HANDOVER[key]}, 10.0))
        elif workload.name == HANDOVER_WORKLOAD[mode]:
            # Smoke: the cold measurement's second epoch already gives the non-persistent fork handover.
            variants = (
                [("fork", True)] if smoke else [("fork", False), ("fork", True), ("spawn", False), ("spawn", True)]
            )
            for method, persistent in variants:
                label = f"handover-{method}" + ("-persistent" if persistent else "")
                epochs = cuts.get("handover", 2 if smoke else 3)
                specs.append(
                    epochs_spec(
                        label,
                        "remote",
                        epochs,
                        start_method=method,
                        persistent_workers=persistent,
                        local_fallback=True,
                    )
                )
        return [_skip_if_cut(spec, cuts) for spec in specs]

    return plan


def inprocess_epochs(workload: Workload) -> int:
    """Epochs of the in-process read (``num_workers=0``, issue 14): epoch 0 settles, the figure is the median of
    the rest: 2 to 4 of them, more where an epoch is short (1024 samples of 128 KiB take well under a second)."""
    return 1 + max(2, min(4, 4096 // workload.count))


def _skip_if_cut(spec: MeasureSpec, cuts: dict[str, int]) -> MeasureSpec:
    kind = "handover" if spec.label.startswith("handover-") else spec.label
    if cuts.get(kind) == 0:
        return MeasureSpec(spec.label, "skipped", {"reason": _SKIP_REASON}, 10.0)
    return spec


def ceiling_plan(workload: Workload, key: str) -> list[MeasureSpec]:
    return [MeasureSpec("s3_ceiling", "s3_ceiling", {"threads": 8}, 300.0)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one workload (60-80 s)")
    parser.add_argument("--systems", help="comma-separated keys among: " + ", ".join(s.key for s in PEERS))
    parser.add_argument("--add", action="append", default=[], help="KEY=module:Class, another system")
    parser.add_argument("--workloads", help="comma-separated workload names")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--out", type=Path, help="output directory (default benchmarks/results/tmp/...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    mode = "smoke" if args.smoke else "full"
    systems = list(PEERS)
    if args.systems:
        wanted = args.systems.split(",")
        systems = [s for s in systems if s.key in wanted]
    for item in args.add:
        key, _, adapter = item.partition("=")
        systems.append(System(key, adapter))
    workloads = WORKLOADS[mode]
    if args.workloads:
        workloads = [w for w in workloads if w.name in args.workloads.split(",")]
    out = args.out or REPO_ROOT / "benchmarks" / "results" / "tmp" / f"peers-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    suite = Suite(
        mode,
        systems,
        workloads,
        make_plan(mode, args.workers),  # type: ignore[arg-type]
        ceiling_plan,
        out,
        extra={
            "epoch_cuts": EPOCH_CUTS[mode],
            "handover_workload": HANDOVER_WORKLOAD[mode],
        },
    )
    doc = suite.run()
    print((out / "summary.txt").read_text())
    print(f"results: {out / 'results.json'} ({doc['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
