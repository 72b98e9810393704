"""What the comparison (``benchmarks/run_all.py``) runs: the systems, the workloads, each system's measurements.

Where the full run cuts counts (2-core machine): the datasets are 32 MiB (small), 128 MiB (medium), 256 MiB
(large); handover is measured on medium only; s3fs (no cache: every epoch is the same full download) runs 1 epoch
cold, none under the budget (the same figure) and none per handover variant (``EPOCH_CUTS``). The in-process read
(``inprocess``: ``num_workers=0``, right after the warm ``local`` read, same files) runs 3 to 5 epochs
(``inprocess_epochs``) in every mode. A system starts cold ``COLD_STARTS`` times per workload (once where that takes
minutes, and in smoke mode). Under the 30% budget every system trains three passes' worth of samples (two in smoke
mode), however many epochs that takes it: once as fast as batches come (``budget30``: every system as remote-bound
as its downloads make it) and once at a pace the remote sustains (``budget30-paced``: a pass's worth of samples
every ``PACED_PASS_S`` seconds, about litdata's own pace here while it downloads every byte of each epoch), where a
rolling cache need not re-read. Smoke: 1024 samples of 16 KiB, persistent-fork handover only.
"""

from __future__ import annotations

from benchmarks.common.runner import MeasureSpec
from benchmarks.common.samples import Workload
from benchmarks.common.suite import PlanFn, System

SYSTEMS = [
    System("cachefeed", "benchmarks.cachefeed_adapter:CachefeedAdapter"),
    System("cachefeed-tar", "benchmarks.cachefeed_tar_adapter:CachefeedTarAdapter"),
    System("mosaic", "benchmarks.peers.mosaic:MosaicAdapter"),
    System("litdata", "benchmarks.peers.lit:LitAdapter"),
    System("local-files", "benchmarks.peers.baselines:LocalFilesAdapter"),
    System("s3fs", "benchmarks.peers.baselines:S3fsAdapter"),
    System("memory", "benchmarks.peers.baselines:MemoryAdapter"),
    System("memory-batched", "benchmarks.peers.baselines:BatchedMemoryAdapter"),
]

WORKLOADS = {
    # 16 MiB: a 30% budget must leave cachefeed (1 MiB metadata reserve, turnover) room for its segments.
    "smoke": [Workload("small", 16 << 10, 1024, 32)],
    "full": [
        Workload("small", 4 << 10, 8192, 256),
        Workload("medium", 128 << 10, 1024, 32),
        Workload("large", 2 << 20, 128, 4),
    ],
}
HANDOVER_WORKLOAD = {"smoke": "small", "full": "medium"}
# Epoch counts cut per system, in every mode; keys: measurement labels, 0 skips the measurement. s3fs caches
# nothing: its budget and handover epochs are its cold epoch again (its handover alone took 5 min of a full run).
EPOCH_CUTS = {"s3fs": {"cold": 1, "budget30": 0, "budget30-paced": 0, "handover": 0}}
# ``budget30-paced``: a pass's worth of samples per this many seconds (16.8 / 67 / 134 MB/s on the full workloads;
# litdata took 1.6-2.3 s per budget epoch at commit 9f2c867, downloading every byte each time).
PACED_PASS_S = 2.0
_SKIP_REASON = "s3fs caches nothing: every epoch is the cold epoch again, whatever the budget"
# Cold starts per system and workload (full mode): ``cold`` (two epochs: figure 2 reads its second), then
# ``cold-2`` .. ``cold-N`` (one epoch each); the cold-start table gives their median (``report.cold_starts``). One
# cold start is noise-bound on 2 shared cores: a cell moved by a tenth of a second or two between runs, and the
# three starts of one run spread over tens of milliseconds, as much as cachefeed's and litdata's 4 KiB first batches
# differed by (a median of 3 at cad9785): five starts per cell. Systems whose cold epoch takes a minute or more
# (per-sample GETs at 4 KiB) start cold once.
COLD_STARTS = 5
ONE_COLD_START = frozenset({"s3fs", "cachefeed"})
# Systems that take no part in figure 4 (not a cut for time: the figure would say nothing about them).
NO_HANDOVER = {
    "memory-batched": "the read ceiling always keeps its workers: the DataLoader's own handover is the memory row",
}


def make_plan(mode: str, workers: int = 2, budget_train_mb_per_s: float | None = None) -> PlanFn:
    """``budget_train_mb_per_s``: under the budget, the consumer trains at this rate (a step per batch) rather
    than as fast as batches come: a remote faster than that keeps up with training, and a rolling cache then need
    not re-read (none: every system is as remote-bound as its downloads make it)."""
    smoke = mode == "smoke"
    # No batch (nor heartbeat) for this long means hung. Heartbeats come every 5 s while batches arrive.
    hang_s = 60.0 if smoke else 120.0

    def epoch_s(workload: Workload) -> float:
        """Generous time for one epoch: ~40 small GETs/s or ~5 MB/s is below every system's pace here."""
        return 30.0 + max(workload.count / 40, workload.total_bytes / 5e6)

    def plan(workload: Workload, key: str) -> list[MeasureSpec]:
        cuts = EPOCH_CUTS.get(key, {})
        base = {"num_workers": workers}
        # Equal work under the budget: every system trains this many passes' worth of samples (a rolling cache's
        # epoch is what it holds, smaller than a pass: it runs more epochs), so coverage and bytes downloaded per
        # byte trained compare.
        budget_passes = cuts.get("budget30", 2 if smoke else 3)

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
            *(
                epochs_spec(f"cold-{n}", "remote", 1)
                for n in range(2, 1 + (1 if smoke or key in ONE_COLD_START else COLD_STARTS))
            ),
            epochs_spec(
                "budget30",
                "remote",
                budget_passes,
                budget_fraction=0.3,
                passes=budget_passes,
                **({"train_mb_per_s": budget_train_mb_per_s} if budget_train_mb_per_s else {}),
            ),
            epochs_spec(
                "budget30-paced",
                "remote",
                budget_passes,
                budget_fraction=0.3,
                passes=budget_passes,
                train_pass_s=PACED_PASS_S,
            ),
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
