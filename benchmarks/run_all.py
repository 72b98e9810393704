"""The whole comparison (issue 7): cachefeed, its peers and the baselines, same data, same S3 server, same run.

    benchmarks/run_all.py [--smoke] [--out benchmarks/results]

Runs under ``.bench-venv`` (the peers live there; it re-executes itself with that interpreter, creating the
environment with ``benchmarks/peers/setup_env.sh`` if it is missing). Writes into ``--out``:

* ``results.md``: the tables (machine, versions, each figure per system per workload, the S3 server's and the
  DataLoader's ceilings next to them, and every failure as it happened), ``results.json``: everything raw,
* ``handover.png``, ``cache_size.png``, ``throughput.png``: the figures a picture explains better.

The full run takes about 20 minutes on 2 cores; ``--smoke`` (one 16 MiB workload, fewer variants) about 2.
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
    parser.add_argument("--smoke", action="store_true", help="one small workload, fewer variants (about 2 min)")
    parser.add_argument("--out", type=Path, help="output dir (default benchmarks/results; smoke: .../tmp/smoke)")
    parser.add_argument("--systems", help="comma-separated subset of: cachefeed, mosaic, litdata, local-files, ...")
    parser.add_argument("--workloads", help="comma-separated subset of: small, medium, large")
    parser.add_argument("--report-only", action="store_true", help="rebuild results.md and plots from results.json")
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
    started = time.monotonic()
    suite = Suite(
        mode,
        systems,
        workloads,
        plan.make_plan(mode),
        plan.ceiling_plan,
        work,
        extra={
            "command": "benchmarks/run_all.py" + (" --smoke" if args.smoke else ""),
            "epoch_cuts": plan.EPOCH_CUTS,
            "handover_workload": plan.HANDOVER_WORKLOAD[mode],
            "workers": 2,
        },
    )
    doc = suite.run()
    doc["provenance"] = start_provenance  # the code measured is the tree at the start of the run
    doc["run_wall_s"] = round(time.monotonic() - started, 1)
    doc["work_dir"] = str(work.relative_to(REPO_ROOT)) if work.is_relative_to(REPO_ROOT) else str(work)
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    from benchmarks.common.results_md import write_report  # imported late: the report can change mid-run

    write_report(doc, out)
    print(f"report: {out / 'results.md'} ({doc['run_wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
