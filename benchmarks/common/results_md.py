"""``results.md`` of ``benchmarks/run_all.py``, from its results document (``results.json``), next to its plots.

Every number comes from the document; nothing is measured here. A figure a system could not produce shows its
status (``n/a``, ``skipped``, ``timeout``, ``misbehaved: ...``) instead of a number, and every problem is listed
with what the harness recorded. The plots are ``plots.py``'s; the README's table is ``run_all.readme_table``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common.plots import write_plots
from benchmarks.common.report import (
    HANDOVER_LABELS,
    cold_starts,
    fmt,
    get_measure,
    mean,
    own_files_read_mb_per_s,
    size_label,
    trained,
    workloads,
)

_MB = 1e6


def write_report(doc: dict[str, Any], out: Path) -> None:
    """Write ``out/results.md`` and the plots (``handover.png``, ``cache_size.png``, ``throughput.png``)."""
    plots = write_plots(doc, out)
    (out / "results.md").write_text(render(doc, plots))


# ------------------------------------------------------------------------------------------------- helpers


def _mb(value: Any) -> float | None:
    return None if value is None else value / _MB


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _status(measure: dict[str, Any]) -> str:
    return str(measure.get("status", "-"))


def _ok(measure: dict[str, Any]) -> bool:
    return bool(measure.get("epochs"))


def _shape(entry: dict[str, Any]) -> str:
    w = entry["workload"]
    size = w["sample_bytes"]
    return f"{w['count']} x {size_label(size)} = {w['count'] * size / _MB:.1f} MB, batch {w['batch_size']}"


def _ceiling(entry: dict[str, Any]) -> dict[str, Any]:
    return entry.get("s3_ceiling", {}).get("s3_ceiling", {}).get("prefixes", {}) or {}


# ------------------------------------------------------------------------------------------------- sections


def render(doc: dict[str, Any], plots: dict[str, str]) -> str:
    parts = [_header(doc)]
    parts.append(_fig1(doc))
    parts.append(_fig2(doc))
    parts.append("## Cold start: time to the first batch and to the first complete epoch\n\n" + cold_start_table(doc))
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
        f"{fmt(mem / 2**30 if mem else None)} GiB RAM, {m.get('platform')}, Python {m.get('python')}; "
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
        "**cachefeed-tar** (the same, reading webdataset tar shards of the peers' shard size), "
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
    for name, entry in workloads(doc):
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
    for name, entry in workloads(doc):
        rows = []
        for system, slot in entry.get("systems", {}).items():
            local = get_measure(slot, "local")
            inprocess = get_measure(slot, "inprocess")
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
    for name, entry in workloads(doc):
        rows = []
        for system, slot in entry.get("systems", {}).items():
            cold = get_measure(slot, "cold")
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


COLD_START_SYSTEMS = ("cachefeed", "cachefeed-tar", "mosaic", "litdata", "s3fs")
_SYSTEM_NAMES = {
    "cachefeed": "cachefeed, one object per sample",
    "cachefeed-tar": "cachefeed, webdataset tar shards",
    "mosaic": "mosaicml-streaming",
    "s3fs": "s3fs (no cache)",
}


def cold_start_table(doc: dict[str, Any]) -> str:
    """The cold-start table (results.md's section and the README's block ``coldstart``): per workload and system,
    seconds from asking the system to start on an empty cache to its first batch, and to the end of its first
    complete epoch (``report.cold_start``: a ``cold`` measurement, ``open_s`` included), the median of the
    system's cold starts on the workload (``report.cold_starts``; how many, in its row's name), all from one run."""
    names = workloads(doc)
    shapes = [f"{e['workload']['count']} x {size_label(int(e['workload']['sample_bytes']))}" for _n, e in names]
    header = ["system"] + [f"{shape}: first batch / first epoch (s)" for shape in shapes]
    rows = []
    for system in COLD_START_SYSTEMS:
        cells, counts = [], set()
        for _name, entry in names:
            slot = entry.get("systems", {}).get(system, {})
            found = cold_starts(slot.get("measures", {}))
            if not found:
                cold = get_measure(slot, "cold")
                cells.append(_status(cold) if cold else "-")
                continue
            counts.add(int(found["cold_starts"]))
            cells.append(f"{fmt(found['cold_first_batch_s'])} / {fmt(found.get('cold_first_epoch_s'))}")
        if any(cell != "-" for cell in cells):
            rows.append([_SYSTEM_NAMES.get(system, system) + _starts_label(counts), *cells])
    prov = doc.get("provenance", {})
    commit = (prov.get("commit") or "")[:10] or "an unrecorded commit"
    commit += " with uncommitted changes" if prov.get("dirty") else ""
    machine = doc.get("machine", {})
    note = (
        "From an empty cache, the clock started when the system was asked to start (cachefeed: its daemon "
        "launched; the peers: their dataset built; cachefeed's tar shards and the peers' converted files already on "
        "S3, conversion not counted), 2 DataLoader workers, no budget; each cell the median of the system's cold "
        "starts on that workload, one after the other (how many: in the row's name). "
        f"Measured with `{doc.get('extra', {}).get('command', 'benchmarks/run_all.py')}` at {commit}, "
        f"{str(machine.get('time_utc', ''))[:10]}, {machine.get('usable_cpus')} CPUs ({machine.get('cpu_model')})."
    )
    return _table(header, rows) + "\n\n" + note


def _starts_label(counts: set[int]) -> str:
    """How many cold starts a cold-start row's cells are the median of: ``(median of 3)``, ``(median of 2-3)``,
    ``(one cold start)``."""
    if not counts:
        return ""
    low, high = min(counts), max(counts)
    if high == 1:
        return " (one cold start)"
    return f" (median of {low})" if low == high else f" (median of {low}-{high})"


def _fig3(doc: dict[str, Any]) -> str:
    intro = [
        "## 3. Cache budget = 30% of the dataset, equal work",
        "",
        "Every system trains the same number of samples (three passes' worth; two in smoke mode), in however many "
        "epochs that takes it: a rolling cache (cachefeed) trains each epoch on what it holds (at most the budget "
        "less its turnover room), so its epochs are smaller than a pass and it runs more of them; the peers stream "
        "the whole dataset through the bounded cache each epoch. Over the whole measurement: distinct samples seen "
        "(coverage of the dataset), the bytes the server sent (server-counted, from the system's start) per byte "
        "trained, the wall time, and the peak on-disk size of the cache directory (sampled every 100 ms) over the "
        "budget. The harness stops a run that downloads more than 10x the dataset per epoch (thrash). "
        + (
            f"Training ran at {rate:g} MB/s (a step per batch)."
            if (rate := doc.get("extra", {}).get("budget_train_mb_per_s"))
            else "Training took each batch as soon as it came (no step): every system is as remote-bound as its "
            "downloads make it, and a rolling cache re-reads what it holds rather than wait."
        ),
    ]
    out = intro + _budget_tables(doc, "budget30")
    if pass_s := doc.get("extra", {}).get("paced_pass_s"):
        out += [
            "",
            f"### 3b. The same, training at a pace the remote sustains: a pass's worth of samples every {pass_s:g} s",
            "",
            "A step per batch sets the pace (about litdata's own here, downloading every byte of each epoch): where "
            "the remote delivers fresh samples as fast as training reads them, a rolling cache need not re-read.",
        ]
        out += _budget_tables(doc, "budget30-paced")
    return "\n".join(out)


def _budget_tables(doc: dict[str, Any], label: str) -> list[str]:
    """One table per workload of measurement ``label`` (``budget30``, ``budget30-paced``)."""
    out: list[str] = []
    for name, entry in workloads(doc):
        rows = []
        count = int(entry["workload"]["count"])
        for system, slot in entry.get("systems", {}).items():
            budget = get_measure(slot, label)
            if not _ok(budget):
                rows.append([system, _status(budget), "", "", "", "", ""])
                continue
            epochs = budget["epochs"]
            whole = trained(epochs, count, int(entry["workload"]["sample_bytes"]))
            coverage, distinct = whole["coverage"], whole["distinct_samples"]
            rows.append(
                [
                    system,
                    f"{len(epochs)}, {whole['samples_trained']:,} samples ({whole['passes_trained']:.2f} passes)",
                    "-" if coverage is None else f"{distinct:,} ({coverage:.0%})",
                    f"{fmt(_mb(whole['server_bytes']))} MB ({fmt(whole['server_bytes_per_byte_trained'])} per byte "
                    "trained)",
                    fmt(sum(float(e.get("wall_s") or 0.0) for e in epochs)),
                    f"{fmt(budget.get('peak_disk_over_budget'))} (budget {fmt(_mb(budget.get('budget_bytes')))} MB)",
                    _status(budget),
                ]
            )
        out += [
            "",
            f"**{name}** ({_shape(entry)})",
            "",
            _table(
                [
                    "system",
                    "epochs, samples trained",
                    "distinct samples (coverage)",
                    "server sent",
                    "s",
                    "peak disk / budget",
                    "status",
                ],
                rows,
            ),
        ]
    return out


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
    for name, entry in workloads(doc):
        rows = []
        any_handover = False
        for system, slot in entry.get("systems", {}).items():
            row: list[Any] = [system]
            for label in HANDOVER_LABELS:
                measure = get_measure(slot, label)
                waits = [
                    e["handover_wait_s"] for e in measure.get("epochs", []) if e.get("handover_wait_s") is not None
                ]
                any_handover |= bool(measure)
                row.append(mean(waits) if waits else (_status(measure) if measure else "-"))
            cold = get_measure(slot, "cold")
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
        "conversion (0 s); cachefeed-tar packs them into webdataset tar shards.",
        "",
    ]
    rows = []
    for name, entry in workloads(doc):
        for system, slot in entry.get("systems", {}).items():
            convert = get_measure(slot, "convert")
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
    for name, entry in workloads(doc):
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
