"""The PNG plots of ``benchmarks/run_all.py`` (``handover.png``, ``cache_size.png``, ``throughput.png``), from its
results document. They need matplotlib (in ``.bench-venv``); without it none is drawn, and ``results.md`` says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common.report import HANDOVER_LABELS, get_measure, workloads

_MB = 1e6


def write_plots(doc: dict[str, Any], out: Path) -> dict[str, str]:
    """Draw every plot the document has data for into ``out``; return ``{name: file name}`` of those drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    made: dict[str, str] = {}
    for name, draw in (("handover", _plot_handover), ("cache_size", _plot_cache), ("throughput", _plot_throughput)):
        fig = draw(doc, plt)
        if fig is None:
            continue
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        made[name] = path.name
    return made


def _plot_handover(doc: dict[str, Any], plt: Any) -> Any:
    name = doc.get("extra", {}).get("handover_workload")
    entry = doc.get("workloads", {}).get(name)
    if not entry:
        return None
    systems = list(entry.get("systems", {}))
    fig, axes = plt.subplots(1, len(HANDOVER_LABELS), figsize=(4 * len(HANDOVER_LABELS), 3.6), sharey=True)
    drawn = False
    for ax, label in zip(axes, HANDOVER_LABELS, strict=True):
        for i, system in enumerate(systems):
            epochs = get_measure(entry["systems"][system], label).get("epochs", [])
            points = [(e["epoch"], e["handover_wait_s"]) for e in epochs if e.get("handover_wait_s") is not None]
            if points:
                drawn = True
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system, color=f"C{i}")
        ax.set_title(label.removeprefix("handover-"))
        ax.set_xlabel("epoch")
        ax.set_yscale("symlog", linthresh=0.01)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("handover wait (s)")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"Epoch handover wait per epoch ({name} workload)")
    return fig if drawn else None


def _plot_cache(doc: dict[str, Any], plt: Any) -> Any:
    entries = workloads(doc)
    if not entries:
        return None
    fig, axes = plt.subplots(1, len(entries), figsize=(5 * len(entries), 3.6), squeeze=False)
    drawn = False
    for ax, (name, entry) in zip(axes[0], entries, strict=True):
        budget_bytes = None
        for i, (system, slot) in enumerate(entry.get("systems", {}).items()):
            budget = get_measure(slot, "budget30")
            timeline = (budget.get("disk") or {}).get("timeline_1s") or []
            if not timeline:
                continue
            drawn = True
            budget_bytes = budget.get("budget_bytes") or budget_bytes
            ax.plot([t for t, _ in timeline], [b / _MB for _, b in timeline], label=system, color=f"C{i}")
        if budget_bytes:
            ax.axhline(budget_bytes / _MB, color="black", linestyle="--", label="budget")
        ax.set_title(f"{name}: cache dir size, budget 30%")
        ax.set_xlabel("s since open")
        ax.set_ylabel("MB on disk")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig if drawn else None


def _plot_throughput(doc: dict[str, Any], plt: Any) -> Any:
    entries = workloads(doc)
    systems: list[str] = []
    for _, entry in entries:
        systems += [s for s in entry.get("systems", {}) if s not in systems]
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    labels = [f"{name}\n{entry['workload']['sample_bytes'] >> 10} KiB" for name, entry in entries]
    for i, system in enumerate(systems):
        values = [
            get_measure(entry.get("systems", {}).get(system, {}), "local").get("warm_mb_per_s") for _, entry in entries
        ]
        if any(v is not None for v in values):
            drawn = True
            ax.plot(
                labels, [v if v is not None else float("nan") for v in values], marker="o", label=system, color=f"C{i}"
            )
    seq = []
    for _, entry in entries:
        local = get_measure(entry.get("systems", {}).get("local-files", {}), "local")
        seq.append((local.get("sequential_read") or {}).get("warm", {}).get("mb_per_s"))
    if any(v is not None for v in seq):
        ax.plot(
            labels,
            [v if v is not None else float("nan") for v in seq],
            linestyle="--",
            color="gray",
            label="sequential read (per-sample files)",
        )
    ax.set_yscale("log")
    ax.set_ylabel("warm epoch MB/s (median)")
    ax.set_title("Warm local read throughput per sample size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig if drawn else None
