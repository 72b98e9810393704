"""Run a set of systems over a set of workloads against one counting S3 server, and write one results file.

Order of a run: start the server; for each workload, write the reference samples and upload them as one
object per sample; run each system's measurements (one child process per system, see ``runner.py``); measure
the server's ceiling on the same objects; drop that workload's objects and files. The results JSON is
rewritten after every measurement, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.machine import machine
from benchmarks.common.measures import Context
from benchmarks.common.report import summary_rows
from benchmarks.common.runner import MeasureSpec, run_measures
from benchmarks.common.s3server import S3Server, delete_prefix, upload_dir
from benchmarks.common.samples import Workload, write_samples

logger = logging.getLogger(__name__)
BUCKET = "bench"

PlanFn = Callable[[Workload, str], list[MeasureSpec]]


@dataclass(frozen=True, slots=True)
class System:
    """A system in a run: ``key`` names its paths and rows, ``adapter`` is ``"module:Class"``."""

    key: str
    adapter: str


class Suite:
    """One benchmark run. ``plan(workload, system_key)`` says which measurements each system gets."""

    def __init__(
        self,
        mode: str,
        systems: list[System],
        workloads: list[Workload],
        plan: PlanFn,
        ceiling_plan: PlanFn,
        out_dir: Path,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.mode = mode
        self.systems = systems
        self.workloads = workloads
        self.plan = plan
        self.ceiling_plan = ceiling_plan
        self.out_dir = out_dir
        self.results_path = out_dir / "results.json"
        self.doc: dict[str, Any] = {"mode": mode, "extra": extra or {}, "workloads": {}}

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.doc["machine"] = machine(self.out_dir)
        self.doc["systems"] = {s.key: s.adapter for s in self.systems}
        server = S3Server.start()
        try:
            server.client().create_bucket(Bucket=BUCKET)
            self.doc["server"] = {"endpoint": server.endpoint, "kind": "moto (counting WSGI wrapper)"}
            for workload in self.workloads:
                self._run_workload(server, workload)
        finally:
            server.stop()
            self.doc["total_s"] = round(time.monotonic() - started, 1)
            self.doc["summary"] = summary_rows(self.doc)
            self._save()
        return self.doc

    def _run_workload(self, server: S3Server, workload: Workload) -> None:
        data_dir = self.out_dir / "data" / workload.name
        entry: dict[str, Any] = {"workload": workload.to_json(), "systems": {}}
        self.doc["workloads"][workload.name] = entry
        started = time.perf_counter()
        write_samples(workload, data_dir / "samples")
        entry["generate_s"] = round(time.perf_counter() - started, 3)
        samples_url = f"s3://{BUCKET}/samples/{workload.name}"
        started = time.perf_counter()
        upload_dir(server.endpoint, data_dir / "samples", samples_url)
        entry["upload_samples_s"] = round(time.perf_counter() - started, 3)
        self._save()

        converted: list[str] = []
        for system in self.systems:
            ctx = self._context(server, workload, system.key, data_dir, samples_url)
            slot: dict[str, Any] = {"adapter": system.adapter, "measures": {}}
            entry["systems"][system.key] = slot

            def on_result(label: str, result: dict[str, Any], slot: dict[str, Any] = slot) -> None:
                slot["measures"][label] = result
                logger.info("%s/%s/%s: %s", workload.name, slot["adapter"], label, result.get("status"))
                self._save()

            measures = self.plan(workload, system.key)
            outcome = run_measures(system.adapter, ctx.to_json(), measures, self.out_dir / "logs", on_result=on_result)
            slot["children"] = outcome.pop("_children")
            slot["measures"].update(outcome)
            if slot["measures"].get("convert", {}).get("status") == "ok":
                converted.append(ctx.converted_url)
            shutil.rmtree(ctx.scratch_dir, ignore_errors=True)
            self._save()

        ctx = self._context(server, workload, "harness", data_dir, samples_url)
        ceiling = self.ceiling_plan(workload, "harness")
        for spec in ceiling:
            spec.params.setdefault("urls", [samples_url, *converted])
        outcome = run_measures(None, ctx.to_json(), ceiling, self.out_dir / "logs")
        outcome.pop("_children")
        entry["s3_ceiling"] = outcome
        self._drop(server, workload, data_dir)
        self._save()

    def _context(self, server: S3Server, workload: Workload, key: str, data_dir: Path, samples_url: str) -> Context:
        return Context(
            workload=workload,
            endpoint_url=server.endpoint,
            bucket=BUCKET,
            samples_dir=data_dir / "samples",
            samples_url=samples_url,
            converted_dir=data_dir / key,
            converted_url=f"s3://{BUCKET}/{key}/{workload.name}",
            scratch_dir=self.out_dir / "scratch" / workload.name / key,
        )

    def _drop(self, server: S3Server, workload: Workload, data_dir: Path) -> None:
        """Delete the workload's objects and files: the next workload starts from the same empty state."""
        client = server.client()
        for prefix in ["samples", *(s.key for s in self.systems)]:
            delete_prefix(client, BUCKET, f"{prefix}/{workload.name}")
        shutil.rmtree(data_dir, ignore_errors=True)

    def _save(self) -> None:
        tmp = self.results_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        tmp.replace(self.results_path)
