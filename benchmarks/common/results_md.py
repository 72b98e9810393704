"""``results.md`` and the PNG plots of ``benchmarks/run_all.py``, from its results document (``results.json``).

Every number comes from the document; nothing is measured here. A figure a system could not produce shows its
status (``n/a``, ``skipped``, ``timeout``, ``misbehaved: ...``) instead of a number, and every problem is listed
with what the harness recorded. Plots need matplotlib (in ``.bench-venv``); without it the report says so.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.common.report import own_files_read_mb_per_s

_MB = 1e6
_WORKLOADS = ("small", "medium", "large")
_HANDOVER = ("handover-fork", "handover-fork-persistent", "handover-spawn", "handover-spawn-persistent")


def write_report(doc: dict[str, Any], out: Path) -> None:
    """Write ``out/results.md`` and the plots (``handover.png``, ``cache_size.png``, ``throughput.png``)."""
    plots = _plots(doc, out)
    (out / "results.md").write_text(render(doc, plots))


# ------------------------------------------------------------------------------------------------- helpers


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def _mb(value: Any) -> float | None:
    return None if value is None else value / _MB


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _workloads(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    found = doc.get("workloads", {})
    return [(name, found[name]) for name in (*_WORKLOADS, *found) if name in found][: len(found)]


def _measure(slot: dict[str, Any], label: str) -> dict[str, Any]:
    measure = slot.get("measures", {}).get(label)
    return measure if isinstance(measure, dict) else {}


def _status(measure: dict[str, Any]) -> str:
    return str(measure.get("status", "-"))


def _ok(measure: dict[str, Any]) -> bool:
    return bool(measure.get("epochs"))


def _shape(entry: dict[str, Any]) -> str:
    w = entry["workload"]
    size = w["sample_bytes"]
    label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
    return f"{w['count']} x {label} = {w['count'] * size / _MB:.1f} MB, batch {w['batch_size']}"


def _ceiling(entry: dict[str, Any]) -> dict[str, Any]:
    return entry.get("s3_ceiling", {}).get("s3_ceiling", {}).get("prefixes", {}) or {}


def _mean(values: list[float]) -> float | None:
    return round(statistics.mean(values), 4) if values else None


# ------------------------------------------------------------------------------------------------- sections


def render(doc: dict[str, Any], plots: dict[str, str]) -> str:
    parts = [_header(doc)]
    parts.append(_fig1(doc))
    parts.append(_fig2(doc))
    parts.append(_fig3(doc))
    parts.append(_fig4(doc))
    parts.append(_fig7(doc))
    parts.append(_problems(doc))
    if plots:
        parts.append("## Plots\n\n" + "\n".join(f"![{k}]({v})" for k, v in plots.items()))
    else:
        parts.append("## Plots\n\nNot drawn (matplotlib missing).")
    return "\n\n".join(parts) + "\n"


def _header(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    extra = doc.get("extra", {})
    versions = ", ".join(f"{k} {v}" for k, v in sorted((m.get("versions") or {}).items()) if v)
    mem = m.get("memory_bytes")
    lines = [
        "# cachefeed and its peers: results (issue 7)",
        "",
        f"Command: `{extra.get('command', 'benchmarks/run_all.py')}` (mode `{doc.get('mode')}`), run at "
        f"{m.get('time_utc')}, {doc.get('run_wall_s', doc.get('total_s'))} s wall.",
        "",
        f"Machine: {m.get('cpu_model')}, {m.get('usable_cpus')} usable CPUs of {m.get('logical_cpus')}, "
        f"{_fmt(mem / 2**30 if mem else None)} GiB RAM, {m.get('platform')}, Python {m.get('python')}; "
        f"data and caches on {m.get('work_fs')}. The machine is shared (2 cores, other jobs running): compare "
        "systems within this run, not across runs.",
        "",
        f"Versions: {versions}.",
        "",
        "S3: one moto server (in-memory, loopback) for every system, counting requests and bytes sent at the "
        "server. Every sample of every batch is verified (index, size, xxh3 checksum); duplicates within an "
        f"epoch and missing samples are counted. DataLoader workers: {extra.get('workers', 2)}, fork unless "
        "stated, prefetch 2, shuffled.",
        "",
        "Systems: **cachefeed** (daemon + `EpochLoaderFactory`, reads the per-sample objects as they are), "
        "**mosaic** (mosaicml-streaming MDS), **litdata** (litdata `optimize` chunks), and baselines: "
        "**local-files** (one local file per sample, map-style Dataset), **s3fs** (one GET per sample, no "
        "cache), **memory-batched** (the samples in one tensor in RAM, `__getitems__` gathering each batch in one "
        "copy, persistent workers: the DataLoader's ceiling for batched reads from RAM), **memory** (a per-sample "
        "Dataset over the same RAM: the ceiling of the per-sample path).",
        "",
        f"Cuts (to fit the machine): epoch counts per system and measurement {extra.get('epoch_cuts')}; "
        f"handover measured on the `{extra.get('handover_workload')}` workload only; 4 warm epochs (median of "
        "epochs 2-4), 2 cold epochs, 3 budget epochs, 3 epochs per handover variant (full run). See "
        "`benchmarks/peers/plan.py`.",
    ]
    for name, entry in _workloads(doc):
        lines.append(f"- `{name}`: {_shape(entry)}")
    lines += [
        "",
        "Figures are numbered as in issue 7; its figures 5 (peak DataLoader worker memory per system) and 6 (daemon "
        "ingest against a plain download: `python -m benchmarks.ingest`, quoted in the README from its own run) are "
        "no longer part of this comparison.",
    ]
    return "\n".join(lines)


def _fig1(doc: dict[str, Any]) -> str:
    out = [
        "## 1. Warm local read throughput",
        "",
        "Median of the warm epochs (epochs 2-4; epoch 1 warms the page cache and the system's own cache). "
        "`seq MB/s (own files)`: a raw sequential read (`readinto` one reused 1 MiB buffer, warm page cache: the "
        "storage ceiling) of the files the loader reads, on the same filesystem: the converted shards for "
        "mosaic/litdata, cachefeed's segment files (its daemon cached the local per-sample files before the first "
        "epoch), the per-sample files for the baselines; `ratio` = loader MB/s / that. The per-sample files' read "
        "is shown too. `memory-batched` is the DataLoader's ceiling for batched reads from RAM (no I/O, one copy "
        "per byte), `memory` the per-sample path over RAM. `in-process samples/s`: the same warm read with "
        "`num_workers=0` (its own run right after the warm one; median of its epochs after the first), the loader "
        "in the training process.",
    ]
    for name, entry in _workloads(doc):
        rows = []
        for system, slot in entry.get("systems", {}).items():
            local = _measure(slot, "local")
            inprocess = _measure(slot, "inprocess")
            in_process = inprocess.get("warm_samples_per_s") if _ok(inprocess) else _status(inprocess)
            if not _ok(local):
                rows.append([system, _status(local), "", "", in_process, "", "", "", ""])
                continue
            seq = own_files_read_mb_per_s(local)
            per_sample = (local.get("sequential_read") or {}).get("warm", {}).get("mb_per_s")
            warm = local.get("warm_mb_per_s")
            ratio = warm / seq if warm and seq else None
            status = _status(local)
            if inprocess and _status(inprocess) != "ok":
                status += f"; in-process: {_status(inprocess)}"
            rows.append(
                [
                    system,
                    local.get("warm_samples_per_s"),
                    warm,
                    local.get("warm_steady_mb_per_s"),
                    in_process,
                    seq,
                    ratio,
                    per_sample,
                    status,
                ]
            )
        out += [
            "",
            f"**{name}** ({_shape(entry)})",
            "",
            _table(
                [
                    "system",
                    "samples/s",
                    "MB/s",
                    "steady MB/s",
                    "in-process samples/s",
                    "seq MB/s (own files)",
                    "ratio",
                    "seq MB/s (per-sample files)",
                    "status",
                ],
                rows,
            ),
        ]
    return "\n".join(out)


def _fig2(doc: dict[str, Any]) -> str:
    out = [
        "## 2. Cold first epoch from S3",
        "",
        "Epoch 0 into an empty cache with no budget, then epoch 1 from the cache. `remote MB`: bytes the server "
        "sent during the epoch. For cachefeed epoch 0 includes the wait until the daemon has cached the whole "
        "dataset (its first epoch only starts on a complete snapshot here), so it is the time to the first full "
        "pass. The S3 ceiling: 8 threads of plain boto3 GETs of the same objects (per-sample objects, and each "
        "peer's converted shards).",
    ]
    for name, entry in _workloads(doc):
        rows = []
        for system, slot in entry.get("systems", {}).items():
            cold = _measure(slot, "cold")
            if not _ok(cold):
                rows.append([system, _status(cold), "", "", "", "", ""])
                continue
            first = cold["epochs"][0]
            second = cold["epochs"][1] if len(cold["epochs"]) > 1 else {}
            rows.append(
                [
                    system,
                    first["wall_s"],
                    first["mb_per_s"],
                    _mb(first.get("remote_bytes")),
                    first.get("first_batch_s"),
                    second.get("wall_s"),
                    _status(cold),
                ]
            )
        ceiling = [
            f"`{url}`: {p['objects']} objects, {p['requests_per_s']} req/s, {p['mb_per_s']} MB/s"
            for url, p in _ceiling(entry).items()
        ]
        out += [
            "",
            f"**{name}** ({_shape(entry)})",
            "",
            _table(["system", "cold epoch s", "MB/s", "remote MB", "first batch s", "cached epoch s", "status"], rows),
            "",
            "S3 ceiling: " + ("; ".join(ceiling) if ceiling else "-"),
        ]
    return "\n".join(out)


def _fig3(doc: dict[str, Any]) -> str:
    out = [
        "## 3. Cache budget = 30% of the dataset, several epochs",
        "",
        "Per epoch: wall time, bytes the server sent (server-counted), distinct samples delivered, and the peak "
        "on-disk size of the cache directory (sampled every 100 ms) over the budget. A rolling cache (cachefeed) "
        "trains each epoch on what is cached, so an epoch holds fewer samples than the dataset, by design; the "
        "peers stream the whole dataset through the bounded cache each epoch. The harness stops a run that "
        "downloads more than 10x the dataset per epoch (thrash).",
    ]
    for name, entry in _workloads(doc):
        rows = []
        for system, slot in entry.get("systems", {}).items():
            budget = _measure(slot, "budget30")
            if not _ok(budget):
                rows.append([system, _status(budget), "", "", "", ""])
                continue
            epochs = budget["epochs"]
            rows.append(
                [
                    system,
                    " / ".join(_fmt(e["wall_s"]) for e in epochs),
                    " / ".join(_fmt(_mb(e.get("remote_bytes"))) for e in epochs),
                    " / ".join(str(e["unique_samples"]) for e in epochs),
                    f"{_fmt(budget.get('peak_disk_over_budget'))} (budget {_fmt(_mb(budget.get('budget_bytes')))} MB)",
                    _status(budget),
                ]
            )
        out += [
            "",
            f"**{name}** ({_shape(entry)})",
            "",
            _table(
                ["system", "s / epoch", "remote MB / epoch", "samples / epoch", "peak disk / budget", "status"], rows
            ),
        ]
    return "\n".join(out)


def _fig4(doc: dict[str, Any]) -> str:
    extra = doc.get("extra", {})
    out = [
        "## 4. Epoch handover wait",
        "",
        "From the consumer finishing the last batch of epoch e to holding the first batch of e+1 (mean over the "
        "epoch boundaries; each system's recommended loader: cachefeed's `EpochLoaderFactory`, mosaic's and "
        "the baselines' `DataLoader`, litdata's `StreamingDataLoader`), with and without persistent workers, "
        f"fork and spawn, on the `{extra.get('handover_workload')}` workload, no budget. `cold` column: the "
        "boundary after the cold epoch (fork, not persistent) of every workload's figure 2 run.",
    ]
    for name, entry in _workloads(doc):
        rows = []
        any_handover = False
        for system, slot in entry.get("systems", {}).items():
            row: list[Any] = [system]
            for label in _HANDOVER:
                measure = _measure(slot, label)
                waits = [
                    e["handover_wait_s"] for e in measure.get("epochs", []) if e.get("handover_wait_s") is not None
                ]
                any_handover |= bool(measure)
                row.append(_mean(waits) if waits else (_status(measure) if measure else "-"))
            cold = _measure(slot, "cold")
            epochs = cold.get("epochs", [])
            row.append(epochs[1].get("handover_wait_s") if len(epochs) > 1 else "-")
            rows.append(row)
        title = f"**{name}**" + ("" if any_handover else " (cold boundary only)")
        out += ["", title, "", _table(["system", "fork", "fork persistent", "spawn", "spawn persistent", "cold"], rows)]
    return "\n".join(out)


def _fig7(doc: dict[str, Any]) -> str:
    out = [
        "## 7. Conversion time",
        "",
        "Time to write each system's format from the per-sample files, then to upload it (timed apart). "
        "cachefeed, local-files, s3fs and the in-memory baselines read the per-sample objects as they are: no "
        "conversion (0 s).",
        "",
    ]
    rows = []
    for name, entry in _workloads(doc):
        for system, slot in entry.get("systems", {}).items():
            convert = _measure(slot, "convert")
            if convert.get("status") == "ok":
                rows.append(
                    [
                        name,
                        system,
                        convert["convert_s"],
                        convert["upload_s"],
                        convert["files"],
                        convert["overhead_ratio"],
                    ]
                )
            else:
                rows.append([name, system, "0 (none)", "-", "-", "-"])
    out.append(_table(["workload", "system", "convert s", "upload s", "files", "size / dataset"], rows))
    return "\n".join(out)


def _problems(doc: dict[str, Any]) -> str:
    out = ["## What went wrong (as recorded)", ""]
    found = False
    for name, entry in _workloads(doc):
        for system, slot in entry.get("systems", {}).items():
            for label, measure in slot.get("measures", {}).items():
                if not isinstance(measure, dict) or measure.get("status") in ("ok", "n/a", "skipped", None):
                    continue
                found = True
                detail = measure.get("error") or ""
                out.append(f"- `{name}` / **{system}** / `{label}`: {measure.get('status')}. {detail}".rstrip())
            for child in slot.get("children", []):
                leaks = []
                if child.get("processes_left_after_exit"):
                    leaks.append(f"{child['processes_left_after_exit']} processes left after exit")
                if child.get("shm_left"):
                    leaks.append(f"/dev/shm left: {', '.join(child['shm_left'][:5])}")
                if leaks:
                    found = True
                    out.append(f"- `{name}` / **{system}**: " + "; ".join(leaks))
    if not found:
        out.append("Nothing: every measurement finished with status ok (or n/a where a system has no such mode).")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------- plots


def _plots(doc: dict[str, Any], out: Path) -> dict[str, str]:
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
    fig, axes = plt.subplots(1, len(_HANDOVER), figsize=(4 * len(_HANDOVER), 3.6), sharey=True)
    drawn = False
    for ax, label in zip(axes, _HANDOVER, strict=True):
        for i, system in enumerate(systems):
            epochs = _measure(entry["systems"][system], label).get("epochs", [])
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
    entries = _workloads(doc)
    if not entries:
        return None
    fig, axes = plt.subplots(1, len(entries), figsize=(5 * len(entries), 3.6), squeeze=False)
    drawn = False
    for ax, (name, entry) in zip(axes[0], entries, strict=True):
        budget_bytes = None
        for i, (system, slot) in enumerate(entry.get("systems", {}).items()):
            budget = _measure(slot, "budget30")
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
    entries = _workloads(doc)
    systems: list[str] = []
    for _, entry in entries:
        systems += [s for s in entry.get("systems", {}) if s not in systems]
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    labels = [f"{name}\n{entry['workload']['sample_bytes'] >> 10} KiB" for name, entry in entries]
    for i, system in enumerate(systems):
        values = [
            _measure(entry.get("systems", {}).get(system, {}), "local").get("warm_mb_per_s") for _, entry in entries
        ]
        if any(v is not None for v in values):
            drawn = True
            ax.plot(
                labels, [v if v is not None else float("nan") for v in values], marker="o", label=system, color=f"C{i}"
            )
    seq = []
    for _, entry in entries:
        local = _measure(entry.get("systems", {}).get("local-files", {}), "local")
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


# ------------------------------------------------------------------------------------------- the README's table


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def readme_table(doc: dict[str, Any]) -> str:
    """The README's side-by-side table (block ``peers``), from ``results.json``'s ``summary`` rows."""
    rows = {(row["workload"], row["system"]): row for row in doc.get("summary", [])}
    names = [name for name, _entry in _workloads(doc)]
    sizes = {name: _size(int(entry["workload"]["sample_bytes"])) for name, entry in _workloads(doc)}
    small, rest = names[0], names[1:]

    def cell(system: str, key: str, workloads: list[str], digits: int = 3) -> str:
        values = [rows.get((name, system), {}).get(key) for name in workloads]
        if all(v is None for v in values):
            return "-"
        return " / ".join(_fmt(v if not isinstance(v, list) else _mean(v), digits) for v in values)

    systems = ("cachefeed", "mosaic", "litdata")
    lines = [
        "| | cachefeed | mosaicml-streaming | litdata | baseline |",
        "|---|---|---|---|---|",
    ]

    def add(what: str, key: str, workloads: list[str], baseline: str, digits: int = 3) -> None:
        lines.append(f"| {what} | " + " | ".join(cell(s, key, workloads, digits) for s in systems) + f" | {baseline} |")

    def baselines(key: str, workloads: list[str]) -> str:
        """The read baselines: local files, the DataLoader's batched ceiling, the per-sample path over RAM."""
        return (
            f"local files {cell('local-files', key, workloads)}; "
            f"DataLoader ceiling, batched from RAM {cell('memory-batched', key, workloads)}; "
            f"per-sample Dataset over RAM {cell('memory', key, workloads)}"
        )

    def raw_read(system: str) -> str:
        """The storage ceiling: a raw sequential read of the files ``system``'s loader reads (from ``local``)."""
        values = [
            own_files_read_mb_per_s(_measure(entry.get("systems", {}).get(system, {}), "local"))
            for _name, entry in _workloads(doc)
        ]
        return "-" if all(v is None for v in values) else " / ".join(_fmt(v) for v in values)

    add(
        f"warm local read, {sizes[small]} (samples/s)",
        "warm_samples_per_s",
        [small],
        baselines("warm_samples_per_s", [small]),
    )
    add(
        f"warm local read, {' / '.join(sizes[n] for n in rest)} (MB/s)",
        "warm_mb_per_s",
        rest,
        baselines("warm_mb_per_s", rest),
    )
    add(
        f"warm local read in the training process (`num_workers=0`), {' / '.join(sizes[n] for n in names)} (samples/s)",
        "inprocess_samples_per_s",
        names,
        baselines("inprocess_samples_per_s", names),
    )
    lines.append(
        f"| raw sequential read of the files each loader reads (storage ceiling), "
        f"{' / '.join(sizes[n] for n in names)} (MB/s) | "
        + " | ".join(raw_read(s) for s in systems)
        + f" | per-sample files {raw_read('local-files')} |"
    )
    add(
        f"cold first epoch from S3, {' / '.join(sizes[n] for n in names)} (s)",
        "cold_epoch_s",
        names,
        f"s3fs {cell('s3fs', 'cold_epoch_s', names)}",
    )
    add("budget 30% of the dataset: peak on disk / budget", "budget_peak_disk_over_budget", names, "")
    add("budget 30%: remote MB per epoch (mean of the epochs run)", "budget_remote_mb_per_epoch", names, "")

    def distinct(system: str) -> str:
        shares = []
        for _name, entry in _workloads(doc):
            epochs = _measure(entry.get("systems", {}).get(system, {}), "budget30").get("epochs") or []
            counts = [e["unique_samples"] for e in epochs if e.get("unique_samples") is not None]
            total = int(entry["workload"]["count"])
            shares.append(f"{_mean(counts) / total:.0%}" if counts and total else "-")
        return " / ".join(shares)

    lines.append(
        "| budget 30%: distinct samples per epoch, share of the dataset | "
        + " | ".join(distinct(s) for s in systems)
        + " | |"
    )
    handover = doc.get("extra", {}).get("handover_workload", rest[0] if rest else small)
    fork = cell("memory", "handover-fork", [handover])
    persistent = cell("memory", "handover-fork-persistent", [handover])
    lines.append(
        f"| handover wait, {sizes.get(handover, handover)}, fork / fork + persistent workers (s) | "
        + " | ".join(
            f"{cell(s, 'handover-fork', [handover])} / {cell(s, 'handover-fork-persistent', [handover])}"
            for s in systems
        )
        + f" | new DataLoader {fork} / {persistent} |"
    )
    converts = {s: [rows.get((n, s), {}).get("convert_s") for n in names] for s in systems[1:]}
    spans = {
        s: f"{_fmt(min(v))}-{_fmt(max(v))}" if (v := [x for x in values if x is not None]) else "-"
        for s, values in converts.items()
    }
    lines.append(f"| conversion before training (s) | 0 (none needed) | {spans['mosaic']} | {spans['litdata']} | |")
    problems = [
        f"{row['system']} on {sizes.get(row['workload'], row['workload'])}, {label}: {text}"
        for row in doc.get("summary", [])
        for label, text in (row.get("problems") or {}).items()
    ]
    machine = doc.get("machine", {})
    prov = doc.get("provenance", {})
    commit = (prov.get("commit") or "")[:10] or "an unrecorded commit"
    commit += " with uncommitted changes" if prov.get("dirty") else ""
    lines += [""] + [f"- {problem}" for problem in problems]
    lines += [
        "",
        f"Measured with `{doc.get('extra', {}).get('command', 'benchmarks/run_all.py')}` at {commit}, "
        f"{str(machine.get('time_utc', ''))[:10]}, {machine.get('usable_cpus')} CPUs ({machine.get('cpu_model')}), "
        f"Python {machine.get('python')}, {doc.get('run_wall_s')} s wall.",
    ]
    return "\n".join(line for i, line in enumerate(lines) if line or (i and lines[i - 1]))
