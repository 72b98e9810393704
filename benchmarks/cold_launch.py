"""A cold job timed from its launch: each loader in a fresh training process, its imports on its clock.

    python -m benchmarks.cold_launch [--rounds 5] [--workloads small,medium] [--systems cachefeed-tar,litdata]

Runs under ``.bench-venv`` (litdata lives there: ``benchmarks/peers/setup_env.sh``); it says so and exits elsewhere.

Why: run_all's cold-start table starts its clock when its measuring process opens a loader. That process has
imported torch and the peer's library already; cachefeed's daemon is launched on that clock, as a fresh process
whose imports are on it. A job starts neither way: its training process starts fresh,
imports torch and its loader's library, then opens the loader. So here, for each round, workload and system (the
systems alternate their order from round to round), a fresh training process is started at t0
(``benchmarks/cold_launch_trainer.py``: nothing but the standard library before its clock starts). It imports
torch, then the system's adapter module (``benchmarks.peers.lit`` imports litdata;
``benchmarks.cachefeed_tar_adapter`` imports cachefeed's tar decoder).
It opens the adapter as run_all's cold measurement does: the same adapter class, 2 fork workers, the workload's
batch, a fresh cache dir, no budget, one epoch. Then it reads epoch 0, verifying every sample, and prints its
marks. cachefeed's adapter launches the daemon when it is opened, after the trainer's own imports: the daemon's
whole start stays on cachefeed's clock, as if the training script started it. ``cachefeed-tar@job`` is the
deployment the README describes instead: the daemon (the same config) is launched at t0 beside the training
process, as systemd would start it with the job, and the trainer, once its imports are done, opens the loader
factory over the daemon's cache dir (``EpochLoaderFactory`` waits for the daemon to create it).

Figures per workload and system, the median of ``--rounds``: seconds from t0 to the end of the trainer's imports
(torch, then the adapter), to the first batch, and to the end of epoch 0; a run whose epoch 0 missed a sample
fails the benchmark. The data
is run_all's: its ``full`` workloads (``benchmarks/peers/plan.py``), each system's converted files uploaded to one
local moto server. Writes ``benchmarks/results/cold_launch.json`` (``--no-save`` to skip).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.cachefeed_adapter import launch_daemon, stop_launched
from benchmarks.cachefeed_tar_adapter import CachefeedTarAdapter
from benchmarks.common.adapter import DataLocation, LoaderSettings
from benchmarks.common.results import REPO_ROOT, provenance_line, save
from benchmarks.common.s3server import S3Server, upload_dir
from benchmarks.common.samples import write_samples
from benchmarks.peers.plan import SYSTEMS, WORKLOADS
from cachefeed._testing.env import checkout_env
from cachefeed._testing.local_s3 import DUMMY_ENV

BUCKET = "bench"
WITH_JOB = "cachefeed-tar@job"  # cachefeed-tar's data and adapter, the daemon launched at t0 (module docstring)
DEFAULT_SYSTEMS = ("cachefeed-tar", WITH_JOB, "litdata")
LABELS = {
    "cachefeed-tar": "cachefeed (tar shards), the daemon launched by the loader",
    WITH_JOB: "cachefeed (tar shards), the daemon launched with the job",
}
WORKERS = 2  # the trainer's DataLoader workers, as in run_all's cold measurement
DEFAULT_WORKLOADS = ("small", "medium")  # the tar-shard workloads of issue 27's cold-start line


def launch(spec: dict[str, Any], daemon_config: Path | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
    """Start one training process at t0 (and the daemon with ``daemon_config`` at t0 too); its marks as seconds
    from t0. Raises with the trainer's (or the daemon's) stderr if either fails."""
    env = checkout_env(REPO_ROOT, {**os.environ, **DUMMY_ENV})
    argv = [sys.executable, "-m", "benchmarks.cold_launch_trainer", json.dumps(spec)]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.time()
        daemon = None if daemon_config is None else launch_daemon(daemon_config, Path(spec["daemon_cache_dir"]), env)
        trainer = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=out, stderr=err)
        try:
            while trainer.poll() is None:
                if daemon is not None and daemon.process.poll() is not None:
                    raise RuntimeError(
                        f"the daemon exited with {daemon.process.returncode}:\n{daemon.stderr()[-3000:]}"
                    )
                if time.time() - started > timeout_s:
                    raise RuntimeError(f"{spec['system']}: no epoch 0 after {timeout_s:g} s")
                time.sleep(0.05)
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
            if daemon is not None:
                stop_launched(daemon.process)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode(errors="replace")
    if trainer.returncode != 0:
        raise RuntimeError(f"{spec['system']} trainer exited with {trainer.returncode}:\n{stderr[-3000:]}")
    marks = json.loads(stdout.strip().splitlines()[-1])
    if marks["distinct"] != spec["workload"]["count"]:
        raise RuntimeError(
            f"{spec['system']}: epoch 0 served {marks['distinct']} of {spec['workload']['count']} samples"
        )
    rel = {
        key: round(marks[key] - started, 3)
        for key in ("torch_imported", "imported", "opened", "first_batch", "epoch_end")
    }
    return {**rel, "samples": marks["samples"], "distinct": marks["distinct"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison; returns the figures (also written to ``cold_launch.json`` unless ``--no-save``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    parser.add_argument("--count", type=int, help="samples per workload (default: run_all's); fewer for a smoke run")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    adapters = {system.key: system.adapter for system in SYSTEMS}
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in adapters and s != WITH_JOB]
    if unknown:
        raise SystemExit(f"--systems: {', '.join(unknown)} not among {', '.join([*adapters, WITH_JOB])}")
    workloads = {w.name: w for w in WORKLOADS["full"]}
    bad = [n for n in args.workloads.split(",") if n not in workloads]
    if bad:
        raise SystemExit(f"--workloads: {', '.join(bad)} not among {', '.join(workloads)}")
    chosen = [workloads[n] for n in args.workloads.split(",")]
    if args.count is not None:
        if args.count < 1:
            raise SystemExit(f"--count {args.count}: expected at least 1 sample per workload")
        chosen = [dataclasses.replace(w, count=args.count) for w in chosen]
    if "litdata" in systems and importlib.util.find_spec("litdata") is None:
        raise SystemExit("litdata is not installed here: run under .bench-venv (benchmarks/peers/setup_env.sh)")
    root = Path(tempfile.mkdtemp(prefix="cold-launch-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    server = S3Server.start()
    rows: list[dict[str, Any]] = []
    try:
        server.client().create_bucket(Bucket=BUCKET)
        urls: dict[tuple[str, str], str] = {}
        for workload in chosen:
            samples = root / workload.name / "samples"
            write_samples(workload, samples)
            for system in dict.fromkeys(s.partition("@")[0] for s in systems):
                module, _, name = adapters[system].partition(":")
                out = root / workload.name / system
                out.mkdir(parents=True)
                getattr(importlib.import_module(module), name)().convert(workload, samples, out)
                url = f"s3://{BUCKET}/{system}/{workload.name}"
                upload_dir(server.endpoint, out, url)
                urls[workload.name, system] = url
        for round_ in range(args.rounds):
            for workload in chosen:
                for system in systems if round_ % 2 == 0 else systems[::-1]:
                    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=root))
                    base = system.partition("@")[0]
                    spec = {
                        "system": system,
                        "adapter": adapters[base],
                        "workload": {f: getattr(workload, f) for f in ("name", "sample_bytes", "count", "batch_size")},
                        "url": urls[workload.name, base],
                        "endpoint": server.endpoint,
                        "cache_dir": str(cache),
                        "workers": WORKERS,
                    }
                    config, work = None, None
                    if system == WITH_JOB:
                        settings = LoaderSettings(workload.batch_size, cache_dir=cache, extra={"epochs": 1})
                        location = DataLocation(None, spec["url"], server.endpoint)
                        config, daemon_cache, work, _ = CachefeedTarAdapter().daemon_config(
                            workload, location, settings
                        )
                        spec["daemon_cache_dir"] = str(daemon_cache)
                    try:
                        row = {"round": round_, "workload": workload.name, "system": system, **launch(spec, config)}
                    finally:
                        shutil.rmtree(cache, ignore_errors=True)
                        if work is not None:
                            shutil.rmtree(work, ignore_errors=True)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    summary = []
    for workload in chosen:
        for system in systems:
            mine = [r for r in rows if r["workload"] == workload.name and r["system"] == system]
            summary.append(
                {
                    "workload": workload.name,
                    "sample_bytes": workload.sample_bytes,
                    "count": workload.count,
                    "system": system,
                    **{
                        k: round(statistics.median(r[k] for r in mine), 3)
                        for k in ("imported", "first_batch", "epoch_end")
                    },
                }
            )
    for s in summary:
        print(
            f"{s['workload']:<7} {s['system']:<18} imports done {s['imported']:6.2f} s  first batch "
            f"{s['first_batch']:6.2f} s  epoch 0 {s['epoch_end']:6.2f} s  (every one of {s['count']} samples)"
        )
    figures = {"rounds": args.rounds, "workers": WORKERS, "summary": summary, "rows": rows}
    if not args.no_save:
        print(f"wrote {save('cold_launch', figures, work_dir=Path(tempfile.gettempdir()))}")
    return figures


def readme_table(doc: dict[str, Any]) -> str:
    """The README's block: per workload, each system's seconds from the training process's launch."""
    figures = doc["figures"]
    lines = [
        "Seconds from the launch of a fresh training process (it imports torch and its loader, opens it, reads the "
        f"first epoch, every sample verified), median of {figures['rounds']} rounds, {figures['workers']} workers:",
        "",
        "| workload | system | imports done | first batch | first epoch |",
        "|---|---|---|---|---|",
    ]
    for s in figures["summary"]:
        size = f"{s['count']:,} x {s['sample_bytes'] >> 10} KiB"
        name = LABELS.get(s["system"], s["system"])
        lines.append(f"| {size} | {name} | {s['imported']:.2f} | {s['first_batch']:.2f} | {s['epoch_end']:.2f} |")
    lines += ["", "Measured with " + provenance_line(doc) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
