"""The whole comparison (issue 7): cachefeed, its peers and the baselines, same data, same S3 server, same run.

    benchmarks/run_all.py [--smoke] [--out benchmarks/results]

Runs under ``.bench-venv`` (the peers live there; it re-executes itself with that interpreter, creating the
environment with ``benchmarks/peers/setup_env.sh`` if it is missing). Writes into ``--out``:

* ``results.md``: the tables (machine, versions, each figure per system per workload, the S3 server's and the
  DataLoader's ceilings next to them, and every failure as it happened), ``results.json``: everything raw,
* ``handover.png``, ``cache_size.png``, ``throughput.png``: the figures a picture explains better.

The full run takes about 15 minutes on 2 cores (903 s in the committed run, with cachefeed-tar); ``--smoke`` (one
16 MiB workload, fewer variants) about 3.
Measurement details, per-child logs and scratch space go to ``<out>/tmp/run-<mode>-<time>/`` (git-ignored).
``--report-only`` rebuilds the report from an existing ``results.json``.

What runs (systems, workloads, each system's measurements, and where counts are cut to fit the machine):
``benchmarks/peers/plan.py``; the report lists the cuts too. ``readme_table`` renders the README's block ``peers``
from the committed ``results.json`` (``python -m benchmarks.readme``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

BENCH_VENV = REPO_ROOT / ".bench-venv"


def _ensure_bench_venv(argv: list[str]) -> None:
    """Re-execute under .bench-venv (creating it if needed) unless already there."""
    if Path(sys.prefix).resolve() == BENCH_VENV.resolve():
        return
    python = BENCH_VENV / "bin" / "python"
    if not python.exists():
        print("creating .bench-venv (benchmarks/peers/setup_env.sh, about 2.5 min)", flush=True)
        subprocess.run([str(REPO_ROOT / "benchmarks" / "peers" / "setup_env.sh")], check=True)
    os.execv(str(python), [str(python), str(Path(__file__).resolve()), *argv])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one small workload, fewer variants (about 3 min)")
    parser.add_argument("--out", type=Path, help="output dir (default benchmarks/results; smoke: .../tmp/smoke)")
    parser.add_argument("--systems", help="comma-separated subset of: cachefeed, mosaic, litdata, local-files, ...")
    parser.add_argument("--workloads", help="comma-separated subset of: small, medium, large")
    parser.add_argument("--report-only", action="store_true", help="rebuild results.md and plots from results.json")
    parser.add_argument(
        "--budget-train-mb-per-s",
        type=float,
        help="under the 30%% budget, train at this rate (a step per batch) instead of as fast as batches come",
    )
    args = parser.parse_args(argv)
    _ensure_bench_venv(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    from benchmarks.common.suite import Suite
    from benchmarks.peers import plan

    mode = "smoke" if args.smoke else "full"
    out: Path = args.out or (REPO_ROOT / "benchmarks" / "results" / ("tmp/smoke" if args.smoke else ""))
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        from benchmarks.common.results_md import write_report

        doc = json.loads((out / "results.json").read_text())
        write_report(doc, out)
        print(f"report: {out / 'results.md'}")
        return 0

    systems = plan.SYSTEMS
    if args.systems:
        wanted = set(args.systems.split(","))
        systems = [s for s in systems if s.key in wanted]
    workloads = plan.WORKLOADS[mode]
    if args.workloads:
        workloads = [w for w in workloads if w.name in args.workloads.split(",")]
    work = out / "tmp" / f"run-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    from benchmarks.common.results import provenance

    start_provenance = provenance(out)  # which commit is measured, and whether the tree differed from it
    from benchmarks.common.machine import byte_compile_cachefeed

    byte_compile_cachefeed()  # as a wheel's install does: the daemons' starts load .pyc files, as the peers' do
    started = time.monotonic()
    suite = Suite(
        mode,
        systems,
        workloads,
        plan.make_plan(mode, budget_train_mb_per_s=args.budget_train_mb_per_s),
        plan.ceiling_plan,
        work,
        extra={
            "command": "benchmarks/run_all.py"
            + (" --smoke" if args.smoke else "")
            + (f" --budget-train-mb-per-s {args.budget_train_mb_per_s:g}" if args.budget_train_mb_per_s else ""),
            "epoch_cuts": plan.EPOCH_CUTS,
            "handover_workload": plan.HANDOVER_WORKLOAD[mode],
            "workers": 2,
            "budget_train_mb_per_s": args.budget_train_mb_per_s,
            "paced_pass_s": plan.PACED_PASS_S,
        },
    )
    doc = suite.run()
    doc["provenance"] = start_provenance  # the code measured is the tree at the start of the run
    doc["run_wall_s"] = round(time.monotonic() - started, 1)
    doc["work_dir"] = str(work.relative_to(REPO_ROOT)) if work.is_relative_to(REPO_ROOT) else str(work)
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    from benchmarks.common.results_md import write_report  # imported late: the report can change mid-run

    write_report(doc, out)
    print(readme_table(doc))
    print(f"report: {out / 'results.md'} ({doc['run_wall_s']} s)")
    return 0


def readme_table(doc: dict[str, Any]) -> str:
    """The README's side-by-side table (block ``peers``), from ``results.json``'s ``summary`` rows."""
    from benchmarks.common.report import (
        fmt,
        get_measure,
        mean,
        own_files_read_mb_per_s,
        size_label,
        summary_rows,
        workloads,
    )

    # the stored summary, completed with rows added since it was written (derived from the measurements)
    rows = {(row["workload"], row["system"]): row for row in summary_rows(doc)}
    for row in doc.get("summary", []):
        rows[(row["workload"], row["system"])] = {**rows.get((row["workload"], row["system"]), {}), **row}
    names = [name for name, _entry in workloads(doc)]
    sizes = {name: size_label(int(entry["workload"]["sample_bytes"])) for name, entry in workloads(doc)}
    small, rest = names[0], names[1:]

    def cell(system: str, key: str, which: list[str], digits: int = 3) -> str:
        values = [rows.get((name, system), {}).get(key) for name in which]
        if all(v is None for v in values):
            return "-"
        return " / ".join(fmt(v if not isinstance(v, list) else mean(v), digits) for v in values)

    systems = ("cachefeed", "cachefeed-tar", "mosaic", "litdata")
    lines = [
        "| | cachefeed | cachefeed, tar shards | mosaicml-streaming | litdata | baseline |",
        "|---|---|---|---|---|---|",
    ]

    def add(what: str, key: str, which: list[str], baseline: str, digits: int = 3) -> None:
        lines.append(f"| {what} | " + " | ".join(cell(s, key, which, digits) for s in systems) + f" | {baseline} |")

    def baselines(key: str, which: list[str]) -> str:
        """The read baselines: local files, the DataLoader's batched ceiling, the per-sample path over RAM."""
        return (
            f"local files {cell('local-files', key, which)}; "
            f"DataLoader ceiling, batched from RAM {cell('memory-batched', key, which)}; "
            f"per-sample Dataset over RAM {cell('memory', key, which)}"
        )

    def raw_read(system: str) -> str:
        """The storage ceiling: a raw sequential read of the files ``system``'s loader reads (from ``local``)."""
        values = [
            own_files_read_mb_per_s(get_measure(entry.get("systems", {}).get(system, {}), "local"))
            for _name, entry in workloads(doc)
        ]
        return "-" if all(v is None for v in values) else " / ".join(fmt(v) for v in values)

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
    # Equal work under the budget (``peers/plan.py``): every system trains the same passes' worth of samples,
    # in however many epochs; coverage and bytes over the whole measurement (``measures.trained``).
    add("budget 30%, equal work: passes' worth of samples trained", "budget_passes_trained", names, "")

    def coverage(system: str, key: str) -> str:
        shares = [rows.get((name, system), {}).get(key) for name in names]
        return "-" if all(v is None for v in shares) else " / ".join("-" if v is None else f"{v:.0%}" for v in shares)

    # As fast as batches come (every system as remote-bound as its downloads make it), then at a pace the remote
    # sustains (``budget30-paced``: a pass's worth every ``plan.PACED_PASS_S`` seconds).
    paces = [("budget", "as fast as batches come")]
    if pass_s := doc.get("extra", {}).get("paced_pass_s"):  # runs from before it had no paced measurement
        paces.append(("paced", f"a pass per {pass_s:g} s"))
    for prefix, how in paces:
        lines.append(
            f"| budget 30%, equal work, {how}: distinct samples seen (coverage of the dataset) | "
            + " | ".join(coverage(s, f"{prefix}_coverage") for s in systems)
            + " | |"
        )
        add(
            f"budget 30%, equal work, {how}: bytes the server sent per byte trained",
            f"{prefix}_server_bytes_per_byte_trained",
            names,
            "",
            digits=2,
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
        s: f"{fmt(min(v))}-{fmt(max(v))}" if (v := [x for x in values if x is not None]) else "-"
        for s, values in converts.items()
    }
    lines.append(
        f"| conversion before training (s) | 0 (none needed) | {spans['cachefeed-tar']} | {spans['mosaic']} "
        f"| {spans['litdata']} | |"
    )
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


if __name__ == "__main__":
    sys.exit(main())
