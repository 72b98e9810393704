"""Turn a results document into summary rows (JSON) and a plain-text table.

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
        row["upload_s"] = convert["upload_s"]
    local = measures.get("local", {})
    if local.get("epochs"):
        row["warm_samples_per_s"] = local.get("warm_samples_per_s")
        row["warm_mb_per_s"] = local.get("warm_mb_per_s")
        row["warm_steady_samples_per_s"] = local.get("warm_steady_samples_per_s")
        row["warm_steady_mb_per_s"] = local.get("warm_steady_mb_per_s")
        seq = local.get("sequential_read", {}).get("warm", {})
        row["sequential_read_mb_per_s"] = seq.get("mb_per_s")
        row["own_files_read_mb_per_s"] = own_files_read_mb_per_s(local)
    inprocess = measures.get("inprocess", {})
    if inprocess.get("epochs"):
        row["inprocess_samples_per_s"] = inprocess.get("warm_samples_per_s")
        row["inprocess_mb_per_s"] = inprocess.get("warm_mb_per_s")
    cold = measures.get("cold", {})
    if cold.get("epochs"):
        first = cold["epochs"][0]
        row["cold_epoch_s"] = first["wall_s"]
        row["cold_mb_per_s"] = first["mb_per_s"]
        row["cold_remote_mb"] = _mb(first.get("remote_bytes"))
        row["cold_first_batch_s"] = first["first_batch_s"]
        if len(cold["epochs"]) > 1:
            row["cached_epoch_s"] = cold["epochs"][1]["wall_s"]
            row["cold_handover_s"] = cold["epochs"][1]["handover_wait_s"]
            row["cached_epoch_remote_mb"] = _mb(cold["epochs"][1].get("remote_bytes"))
    budget = measures.get("budget30", {})
    if budget.get("epochs"):
        row["budget_mb"] = _mb(budget.get("budget_bytes"))
        row["budget_epoch_s"] = [e["wall_s"] for e in budget["epochs"]]
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


_COLUMNS = (
    ("system", "system", 14),
    ("convert_s", "conv s", 7),
    ("warm_samples_per_s", "warm smp/s", 10),
    ("warm_mb_per_s", "warm MB/s", 9),
    ("warm_steady_mb_per_s", "steady MB/s", 11),
    ("inprocess_samples_per_s", "w=0 smp/s", 9),
    ("own_files_read_mb_per_s", "seq MB/s", 8),
    ("cold_epoch_s", "cold s", 7),
    ("cold_remote_mb", "cold MB", 8),
    ("cached_epoch_s", "cached s", 8),
    ("budget_epoch_s", "budget30 s/epoch", 18),
    ("budget_remote_mb_per_epoch", "budget30 MB/epoch", 20),
    ("budget_peak_disk_over_budget", "disk/bdg", 8),
)
_HANDOVER = (
    "handover-fork",
    "handover-fork-persistent",
    "handover-spawn",
    "handover-spawn-persistent",
    "cold_handover_s",
)


def summary_text(doc: dict[str, Any]) -> str:
    """A fixed-width table per workload, then handover waits, S3 ceilings and problems."""
    lines = [
        f"mode={doc.get('mode')} total_s={doc.get('total_s')} machine={_machine_line(doc)}",
        "w=0 = warm read in the training process (num_workers=0); seq = raw sequential read of the files the"
        " loader reads (cachefeed: its segments).",
        "",
    ]
    rows = doc.get("summary") or summary_rows(doc)
    for workload_name, entry in doc.get("workloads", {}).items():
        w = entry["workload"]
        lines.append(
            f"== {workload_name}: {w['count']} x {w['sample_bytes']} B = {w['count'] * w['sample_bytes'] / _MB:.1f} MB,"
            f" batch {w['batch_size']}"
        )
        lines.append(" ".join(title.rjust(width) for _, title, width in _COLUMNS))
        mine = [r for r in rows if r["workload"] == workload_name]
        for row in mine:
            lines.append(" ".join(_fmt(row.get(key)).rjust(width) for key, _, width in _COLUMNS))
        handover = [r for r in mine if any(k in r for k in _HANDOVER)]
        if handover:
            lines.append(
                "handover wait s (mean of epochs >= 1): " + ", ".join(_HANDOVER[:-1]) + ", and in `cold`"
                " (fork, epoch 0 -> 1)"
            )
            for row in handover:
                lines.append(f"  {row['system']:<14} " + " ".join(_fmt(row.get(k)).rjust(12) for k in _HANDOVER))
        for url, ceiling in (entry.get("s3_ceiling", {}).get("s3_ceiling", {}).get("prefixes") or {}).items():
            lines.append(
                f"S3 ceiling {url}: {ceiling['objects']} objects, {ceiling['requests_per_s']} req/s,"
                f" {ceiling['mb_per_s']} MB/s"
            )
        for row in mine:
            if row.get("problems"):
                lines.append(f"PROBLEM {row['system']}: {row['problems']}")
        lines.append("")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return "/".join(_fmt(v) for v in value)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _machine_line(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    return f"{m.get('usable_cpus')} cpus, {m.get('cpu_model')}, fs {m.get('work_fs')}"
