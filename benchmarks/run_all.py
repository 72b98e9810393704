"""The whole comparison (issue 7): cachefeed, its peers and the baselines, same data, same S3 server, same run.

    benchmarks/run_all.py [--smoke] [--out benchmarks/results]

Runs under ``.bench-venv`` (the peers live there; it re-executes itself with that interpreter, creating the
environment with ``benchmarks/peers/setup_env.sh`` if it is missing). Writes into ``--out``:

* ``results.md``: the tables (machine, versions, each figure per system per workload, the S3 server's and the
  DataLoader's ceilings next to them, and every failure as it happened), ``results.json``: everything raw,
* ``handover.png``, ``cache_size.png``, ``throughput.png``: the figures a picture explains better.

The full run takes about 20 minutes on 2 cores; ``--smoke`` (one 16 MiB workload, fewer variants) about 2.
Measurement details, per-child logs and scratch space go to ``<out>/tmp/run-<mode>-<time>/`` (git-ignored).
Figure 6 (daemon ingest against a plain concurrent download) is ``benchmarks/ingest.py``, run here in a child
process with reduced counts. ``--report-only`` rebuilds the report from an existing ``results.json``.

Where counts are cut (to fit the machine): see ``CUTS`` below and ``run_peers.py``'s docstring; the report lists
them too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

log = logging.getLogger("benchmarks.run_all")
BENCH_VENV = REPO_ROOT / ".bench-venv"
MAIN_VENV = REPO_ROOT / ".venv"
CACHEFEED = ("cachefeed", "benchmarks.cachefeed_adapter:CachefeedAdapter")
# s3fs caches nothing: its handover epochs are its cold epoch again (5 min of the run in the previous full run).
CUTS = {
    "full": {"s3fs": {"cold": 1, "budget30": 0, "handover": 0}},
    "smoke": {"s3fs": {"cold": 1, "budget30": 0, "handover": 0}},
}
# Figure 6 counts: benchmarks/ingest.py's defaults are 3000 x 4 KiB and 400 x 1.5 MiB, best of 3.
INGEST_ARGS = {
    "full": ["--small", "2000", "--large", "150", "--repeat", "2"],
    "smoke": ["--small", "200", "--large", "10", "--repeat", "1"],
}


def _ensure_bench_venv(argv: list[str]) -> None:
    """Re-execute under .bench-venv (creating it if needed) unless already there."""
    if Path(sys.prefix).resolve() == BENCH_VENV.resolve():
        return
    python = BENCH_VENV / "bin" / "python"
    if not python.exists():
        print("creating .bench-venv (benchmarks/peers/setup_env.sh, about 2.5 min)", flush=True)
        subprocess.run([str(REPO_ROOT / "benchmarks" / "peers" / "setup_env.sh")], check=True)
    os.execv(str(python), [str(python), str(Path(__file__).resolve()), *argv])


def run_ingest(mode: str, log_path: Path) -> dict[str, Any]:
    """Figure 6: ``benchmarks/ingest.py`` in a child (main .venv if present), its table parsed."""
    python = MAIN_VENV / "bin" / "python"
    if not python.exists():
        python = Path(sys.executable)
    cmd = [str(python), "-m", "benchmarks.ingest", *INGEST_ARGS[mode]]
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        return {"status": "timeout", "command": " ".join(cmd[1:]), "output": str(exc.stdout or "")[-3000:]}
    log_path.write_text(done.stdout + "\n--- stderr\n" + done.stderr)
    out: dict[str, Any] = {
        "status": "ok" if done.returncode == 0 else f"failed (exit {done.returncode})",
        "command": "python " + " ".join(cmd[1:]),
        "wall_s": round(time.perf_counter() - started, 1),
        "output": done.stdout.strip(),
        "rows": [],
    }
    if done.returncode != 0:
        out["stderr_tail"] = done.stderr[-3000:]
    row = re.compile(r"^\s*(\d+)\s+(\S+)\s+\|\s+(\d+)\s+([\d.]+)\s+\|\s+(\d+)\s+([\d.]+)\s+\|\s+([\d.]+)\s*$")
    for line in done.stdout.splitlines():
        match = row.match(line)
        if match:
            objects, size, p_obj, p_mib, d_obj, d_mib, ratio = match.groups()
            out["rows"].append(
                {
                    "objects": int(objects),
                    "object_size": size,
                    "plain_objects_per_s": int(p_obj),
                    "plain_mib_per_s": float(p_mib),
                    "daemon_objects_per_s": int(d_obj),
                    "daemon_mib_per_s": float(d_mib),
                    # ingest.py's ratio: plain time / daemon time, i.e. daemon rate / plain rate.
                    "daemon_over_plain": float(ratio),
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one small workload, fewer variants (about 2 min)")
    parser.add_argument("--out", type=Path, help="output dir (default benchmarks/results; smoke: .../tmp/smoke)")
    parser.add_argument("--systems", help="comma-separated subset of: cachefeed, mosaic, litdata, local-files, ...")
    parser.add_argument("--workloads", help="comma-separated subset of: small, medium, large")
    parser.add_argument("--no-ingest", action="store_true", help="skip figure 6 (benchmarks/ingest.py)")
    parser.add_argument("--report-only", action="store_true", help="rebuild results.md and plots from results.json")
    args = parser.parse_args(argv)
    _ensure_bench_venv(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    from benchmarks.common.suite import Suite, System
    from benchmarks.peers import run_peers

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

    systems = [System(*CACHEFEED), *run_peers.PEERS]
    if args.systems:
        wanted = set(args.systems.split(","))
        systems = [s for s in systems if s.key in wanted]
    workloads = run_peers.WORKLOADS[mode]
    if args.workloads:
        workloads = [w for w in workloads if w.name in args.workloads.split(",")]
    run_peers.EPOCH_CUTS[mode] = CUTS[mode]
    work = out / "tmp" / f"run-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    from benchmarks.common.results import provenance

    start_provenance = provenance(out)  # which commit is measured, and whether the tree differed from it
    started = time.monotonic()
    suite = Suite(
        mode,
        systems,
        workloads,
        run_peers.make_plan(mode, 2),  # type: ignore[arg-type]
        run_peers.ceiling_plan,
        work,
        extra={
            "command": "benchmarks/run_all.py" + (" --smoke" if args.smoke else ""),
            "epoch_cuts": CUTS[mode],
            "handover_workload": run_peers.HANDOVER_WORKLOAD[mode],
            "rss_workload": run_peers.RSS_WORKLOAD,
            "workers": 2,
        },
    )
    doc = suite.run()
    if not args.no_ingest:
        log.info("figure 6: benchmarks/ingest.py %s", " ".join(INGEST_ARGS[mode]))
        doc["ingest"] = run_ingest(mode, work / "ingest.log")
    doc["provenance"] = start_provenance  # the code measured is the tree at the start of the run
    doc["run_wall_s"] = round(time.monotonic() - started, 1)
    doc["work_dir"] = str(work.relative_to(REPO_ROOT)) if work.is_relative_to(REPO_ROOT) else str(work)
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    from benchmarks.common.results_md import write_report  # imported late: the report can change mid-run

    write_report(doc, out)
    print((work / "summary.txt").read_text())
    print(f"report: {out / 'results.md'} ({doc['run_wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
