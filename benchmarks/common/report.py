"""A results document's summary rows (``results.json``'s ``summary``): per workload and system, the figures the
README's side-by-side table is made of.

Labels the plans use, and the figure each one gives: ``convert`` (7), ``local`` (1; the ``memory-batched``
system's row is the DataLoader's ceiling for batched reads from RAM, ``memory``'s the per-sample path over RAM),
``inprocess`` (1, read with ``num_workers=0``), ``cold`` (2), ``budget30`` (3),
``handover-<start method>[-persistent]`` (4). The S3 ceiling is per workload, per prefix.
"""

from __future__ import annotations

from statistics import mean
from typing import Any

_MB = 1e6


def summary_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for workload_name, entry in doc.get("workloads", {}).items():
        for system, slot in entry.get("systems", {}).items():
            rows.append({"workload": workload_name, "system": system, **_row(slot.get("measures", {}))})
    return rows


def _row(measures: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    problems = {
        label: m.get("status")
        for label, m in measures.items()
        if isinstance(m, dict) and m.get("status") not in ("ok", "n/a", "skipped", None)
    }
    if problems:
        row["problems"] = problems
    convert = measures.get("convert", {})
    if convert.get("status") == "ok":
        row["convert_s"] = convert["convert_s"]
    local = measures.get("local", {})
    if local.get("epochs"):
        row["warm_samples_per_s"] = local.get("warm_samples_per_s")
        row["warm_mb_per_s"] = local.get("warm_mb_per_s")
    inprocess = measures.get("inprocess", {})
    if inprocess.get("epochs"):
        row["inprocess_samples_per_s"] = inprocess.get("warm_samples_per_s")
    cold = measures.get("cold", {})
    if cold.get("epochs"):
        row["cold_epoch_s"] = cold["epochs"][0]["wall_s"]
    budget = measures.get("budget30", {})
    if budget.get("epochs"):
        row["budget_remote_mb_per_epoch"] = [_mb(e.get("remote_bytes")) for e in budget["epochs"]]
        row["budget_peak_disk_over_budget"] = budget.get("peak_disk_over_budget")
    for label, measure in sorted(measures.items()):
        if label.startswith("handover-") and isinstance(measure, dict):
            waits = [e["handover_wait_s"] for e in measure.get("epochs", []) if e.get("handover_wait_s") is not None]
            row[label] = round(mean(waits), 3) if waits else measure.get("status")
    return row


def own_files_read_mb_per_s(local: dict[str, Any]) -> float | None:
    """The raw sequential read (warm) of the files a system's loader reads, from its ``local`` measurement.

    The per-sample files for the baselines, the converted shards for the peers (their ``local_dir``), and for
    cachefeed its own segment files (``sequential_read_own_files``: its daemon cached the per-sample files first).
    """
    own = (local.get("sequential_read_own_files") or {}).get("warm", {}).get("mb_per_s")
    return own or (local.get("sequential_read") or {}).get("warm", {}).get("mb_per_s")


def _mb(value: Any) -> float | None:
    return None if value is None else round(value / _MB, 2)
