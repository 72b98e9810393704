"""Reading a results document of ``benchmarks/run_all.py``: its workloads and measurements, the number format of
its tables, and its summary rows (``results.json``'s ``summary``: per workload and system, the figures the README's
side-by-side table is made of). ``results_md.py``, ``plots.py`` and ``run_all.readme_table`` read through these.

Labels the plans use, and the figure each one gives: ``convert`` (7), ``local`` (1; the ``memory-batched``
system's row is the DataLoader's ceiling for batched reads from RAM, ``memory``'s the per-sample path over RAM),
``inprocess`` (1, read with ``num_workers=0``), ``cold`` (2; with ``cold-2`` .. ``cold-N``, the cold-start
table), ``budget30`` (3),
``handover-<start method>[-persistent]`` (4). The S3 ceiling is per workload, per prefix.
"""

from __future__ import annotations

import statistics
from typing import Any

_MB = 1e6
_WORKLOADS = ("small", "medium", "large")  # their order in every table, whatever order a document lists them in
HANDOVER_LABELS = ("handover-fork", "handover-fork-persistent", "handover-spawn", "handover-spawn-persistent")


def workloads(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(name, entry)`` of every workload in the document, small to large."""
    found = doc.get("workloads", {})
    return [(name, found[name]) for name in (*_WORKLOADS, *found) if name in found][: len(found)]


def get_measure(slot: dict[str, Any], label: str) -> dict[str, Any]:
    """A system's measurement ``label`` (``{}`` when it has none)."""
    found = slot.get("measures", {}).get(label)
    return found if isinstance(found, dict) else {}


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: ``-`` for none, ``digits`` significant digits below 100, none after the point above."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def mean(values: list[float]) -> float | None:
    return round(statistics.mean(values), 4) if values else None


def size_label(nbytes: int) -> str:
    """``4 KiB``, ``128 KiB``, ``2 MiB``."""
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def summary_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for workload_name, entry in doc.get("workloads", {}).items():
        workload = entry.get("workload", {})
        for system, slot in entry.get("systems", {}).items():
            rows.append({"workload": workload_name, "system": system, **_row(slot.get("measures", {}), workload)})
    return rows


def trained(results: list[dict[str, Any]], count: int, sample_bytes: int) -> dict[str, Any]:
    """What a remote measurement trained over all its epochs (any system): samples delivered (and in passes over
    the dataset), distinct samples among them (``coverage``: their share of the dataset; None for epochs measured
    before ``distinct_so_far`` was recorded) and the bytes the server sent (server-counted, from before the system
    opened to its last epoch's end) per byte delivered."""
    samples = sum(int(r.get("samples") or 0) for r in results)
    seen = [int(r["distinct_so_far"]) for r in results if r.get("distinct_so_far") is not None]
    distinct = max(seen) if seen else None
    server = sum(int(r.get("remote_bytes") or 0) for r in results)
    return {
        "samples_trained": samples,
        "passes_trained": round(samples / count, 3) if count else None,
        "distinct_samples": distinct,
        "coverage": round(distinct / count, 4) if count and distinct is not None else None,
        "server_bytes": server,
        "server_bytes_per_byte_trained": round(server / (samples * sample_bytes), 4) if samples else None,
    }


def _row(measures: dict[str, Any], workload: dict[str, Any]) -> dict[str, Any]:
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
    row.update(cold_starts(measures))
    budget = measures.get("budget30", {})
    if budget.get("epochs"):
        row["budget_remote_mb_per_epoch"] = [_mb(e.get("remote_bytes")) for e in budget["epochs"]]
        row["budget_peak_disk_over_budget"] = budget.get("peak_disk_over_budget")
    # over the whole measurement (coverage: None in documents from before ``distinct_so_far``)
    for label, prefix in (("budget30", "budget"), ("budget30-paced", "paced")):
        epochs = measures.get(label, {}).get("epochs")
        if epochs:
            whole = trained(epochs, int(workload.get("count") or 0), int(workload.get("sample_bytes") or 0))
            row[f"{prefix}_passes_trained"] = whole["passes_trained"]
            row[f"{prefix}_coverage"] = whole["coverage"]
            row[f"{prefix}_server_bytes_per_byte_trained"] = whole["server_bytes_per_byte_trained"]
    for label, measure in sorted(measures.items()):
        if label.startswith("handover-") and isinstance(measure, dict):
            waits = [e["handover_wait_s"] for e in measure.get("epochs", []) if e.get("handover_wait_s") is not None]
            row[label] = round(statistics.mean(waits), 3) if waits else measure.get("status")
    return row


def cold_starts(measures: dict[str, Any]) -> dict[str, float]:
    """The median of a system's cold starts on a workload (``cold``, ``cold-2``, ... : ``peers/plan.py``), each
    as ``cold_start`` gives it: ``cold_first_batch_s`` and ``cold_first_epoch_s`` (each the median of the starts
    that have it) and ``cold_starts`` (how many gave a first batch). Empty where none did."""
    labels = [label for label in measures if label == "cold" or (label[:5] == "cold-" and label[5:].isdigit())]
    found = [cold_start(measures[label]) for label in labels if isinstance(measures[label], dict)]
    found = [one for one in found if one]
    if not found:
        return {}
    result = {"cold_starts": len(found)}
    for key in ("cold_first_batch_s", "cold_first_epoch_s"):
        values = [one[key] for one in found if key in one]
        if values:
            result[key] = round(statistics.median(values), 3)
    return result


def cold_start(cold: dict[str, Any]) -> dict[str, float]:
    """Time to first batch and to the end of the first complete epoch of a ``cold`` measurement, from the moment
    the system was asked to start (its ``open``: cachefeed's daemon start, a peer's dataset construction) on an
    empty cache: ``open_s`` plus epoch 0's ``first_batch_s``, and plus its ``wall_s``. Neither without a first
    batch; no first epoch where the harness stopped epoch 0 (``partial``)."""
    epochs = cold.get("epochs") or []
    if not epochs or epochs[0].get("first_batch_s") is None:
        return {}
    opened = float(cold.get("open_s") or 0.0)
    found = {"cold_first_batch_s": round(opened + float(epochs[0]["first_batch_s"]), 3)}
    if not epochs[0].get("partial"):
        found["cold_first_epoch_s"] = round(opened + float(epochs[0]["wall_s"]), 3)
    return found


def own_files_read_mb_per_s(local: dict[str, Any]) -> float | None:
    """The raw sequential read (warm) of the files a system's loader reads, from its ``local`` measurement.

    The per-sample files for the baselines, the converted shards for the peers (their ``local_dir``), and for
    cachefeed its own segment files (``sequential_read_own_files``: its daemon cached the per-sample files first).
    """
    own = (local.get("sequential_read_own_files") or {}).get("warm", {}).get("mb_per_s")
    return own or (local.get("sequential_read") or {}).get("warm", {}).get("mb_per_s")


def _mb(value: Any) -> float | None:
    return None if value is None else round(value / _MB, 2)
