"""Committed benchmark results: one JSON document per benchmark under ``benchmarks/results/``, with its provenance.

Every figure the README quotes from a benchmark comes from one of these documents: ``python -m benchmarks.readme``
renders the README's figure blocks from them, and ``tests/test_readme_figures.py`` fails when the README and the
committed documents disagree. A document::

    {
      "benchmark": "handover",                         # its file is benchmarks/results/handover.json
      "command": "python -m benchmarks.handover ...",  # what produced it, to run again
      "provenance": {"commit": "<sha>", "dirty": false, "date_utc": "...", "machine": {...}},
      "figures": {...}                                 # the benchmark's own figures
    }

``dirty`` is true when the working tree had uncommitted changes to tracked files (other than the results
themselves): such a result was not measured on the commit it names, and the README says so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.machine import machine

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def provenance(work_dir: Path) -> dict[str, Any]:
    """The commit (and whether tracked files differ from it), the date, the machine and the package versions.

    A copy of the tree sent to another machine (a GPU machine: ``scripts/gpu_checks.sh``) is recorded as the commit
    named in ``CACHEFEED_COMMIT``, clean: whoever sends the copy sets it, from a clean checkout of that commit. The
    copy's own ``.git``, if it has one, is not asked: the GPU machine's names the commit its session started from,
    with every later change as uncommitted."""
    named = os.environ.get("CACHEFEED_COMMIT")
    if named:
        if not re.fullmatch(r"[0-9a-f]{40}", named):
            raise ValueError(f"CACHEFEED_COMMIT={named!r}: expected a full commit hash (git rev-parse HEAD)")
        commit, status = named, ""
    else:
        commit = _git("rev-parse", "HEAD")
        # Results already written by an earlier benchmark of the same run do not make the code dirty.
        status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    return {
        "commit": commit,
        "dirty": bool(status) if status is not None else None,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(work_dir),
    }


def save(name: str, figures: dict[str, Any], *, work_dir: Path, out_dir: Path = RESULTS_DIR) -> Path:
    """Write ``<out_dir>/<name>.json``: the figures of ``python -m benchmarks.<name>`` with this process's arguments."""
    command = " ".join(["python -m benchmarks." + name, *sys.argv[1:]])
    doc = {"benchmark": name, "command": command, "provenance": provenance(work_dir), "figures": figures}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    return path


def load(name: str, out_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """The committed document of benchmark ``name``."""
    doc: dict[str, Any] = json.loads((out_dir / f"{name}.json").read_text())
    return doc


def provenance_line(doc: dict[str, Any]) -> str:
    """One line saying where and when a result was measured, for the README under its figures."""
    prov = doc["provenance"]
    host = prov["machine"]
    versions = host.get("versions", {})
    commit = (prov.get("commit") or "unknown")[:10] + (" with uncommitted changes" if prov.get("dirty") else "")
    return (
        f"`{doc['command']}` at {commit}, {prov['date_utc'][:10]}, {host.get('usable_cpus')} CPUs "
        f"({host.get('cpu_model')}), Python {host.get('python')}, torch {versions.get('torch')}"
    )


def dash(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec``, or "-" where a result has none (an older result, a run without it)."""
    return "-" if value is None else format(value, spec)


def readme_block(intro: str, table: list[str], doc: dict[str, Any]) -> str:
    """A README figure block: what was measured, the table, and where and when (``provenance_line``)."""
    return "\n".join([intro, "", *table, "", "Measured with " + provenance_line(doc) + "."])
