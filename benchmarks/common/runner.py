"""Run measurements in a subprocess with a timeout each, and record exactly what happened.

NOTE [ Runner protocol ]
The parent starts ``python -m benchmarks.common.runner child SPEC EVENTS`` in a new session (its own process
group, so DataLoader workers and anything they start can be killed together). The child appends one JSON
object per line to EVENTS and flushes after each:

    {"event": "ready", "import_s": ...}               the adapter is imported and constructed
    {"event": "start", "label": ...}                  a measurement begins (its timeout starts now)
    {"event": "progress", "label": ..., "data": ...}  partial results (one per epoch), kept if it hangs later
    {"event": "result", "label": ..., "result": ...}  the measurement's dict (failures included, as data)

The parent polls EVENTS. A measurement that passes its timeout, or a child that dies in the middle of one, is
recorded as ``timeout``/``crashed`` with its progress and the tail of the child's log; the process group is
killed and a fresh child runs the measurements that remain. After each child the parent reports processes left
in its group and the /dev/shm names it left (then removes both): leaks are findings, not noise. /dev/shm is
shared with every other process on the host, so only names the child's processes were seen mapping or holding
open (a scan of /proc every 0.5 s) are counted, and only those are removed.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.results import REPO_ROOT
from cachefeed._testing.local_s3 import DUMMY_ENV

_POLL_S = 0.1
_SHM = Path("/dev/shm")


@dataclass(frozen=True, slots=True)
class MeasureSpec:
    """One measurement: a unique label, its kind (a key of ``measures.MEASURES``, or ``s3_ceiling``,
    ``describe``, ``skipped``), its parameters, ``timeout_s``: the longest it may go without reporting progress
    (its start, each finished epoch, a heartbeat every few seconds while batches arrive), and ``max_s``: a bound
    on the whole measurement (``None``: none)."""

    label: str
    kind: str
    params: dict[str, Any]
    timeout_s: float
    max_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "kind": self.kind,
            "params": self.params,
            "timeout_s": self.timeout_s,
            "max_s": self.max_s,
        }


def load_adapter(path: str) -> Any:
    """``"package.module:Class"`` -> an instance (constructed with no arguments)."""
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"adapter path {path!r} must look like 'package.module:Class'")
    return getattr(importlib.import_module(module_name), attr)()


def run_measures(
    adapter_path: str | None,
    context: dict[str, Any],
    measures: list[MeasureSpec],
    log_dir: Path,
    startup_timeout_s: float = 180.0,
    on_result: Any = None,
) -> dict[str, Any]:
    """Run ``measures`` for one adapter in child processes; return ``{label: result}`` plus ``_children``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    remaining = list(measures)
    results: dict[str, Any] = {}
    children: list[dict[str, Any]] = []
    attempt = 0
    while remaining:
        attempt += 1
        stem = f"{context['workload']['name']}-{_slug(adapter_path)}-{attempt}"
        spec_path = log_dir / f"{stem}.spec.json"
        events_path = log_dir / f"{stem}.events.jsonl"
        log_path = log_dir / f"{stem}.log"
        spec = {"adapter": adapter_path, "context": context, "measures": [m.to_json() for m in remaining]}
        spec_path.write_text(json.dumps(spec, indent=1))
        events_path.write_text("")
        child = _Child.start(spec_path, events_path, log_path)
        outcome = child.follow({m.label: m for m in remaining}, startup_timeout_s, results, on_result)
        children.append(outcome)
        remaining = [m for m in remaining if m.label not in results]
        if remaining and outcome["failed_label"] is None:
            # The child died or hung before starting any measurement: nothing would go better on a retry.
            for spec_ in remaining:
                results[spec_.label] = {"status": outcome["status"], "error": outcome["error"], **outcome["log"]}
            remaining = []
    results["_children"] = children
    return results


class _Child:
    def __init__(self, process: subprocess.Popen[bytes], events_path: Path, log_path: Path) -> None:
        self.process = process
        self.events_path = events_path
        self.log_path = log_path
        self._offset = 0
        self._shm_seen: set[str] = set()  # /dev/shm names the child's process group mapped or held open
        self._scanned_at = 0.0

    @classmethod
    def start(cls, spec_path: Path, events_path: Path, log_path: Path) -> _Child:
        env = {**os.environ, **DUMMY_ENV, "PYTHONUNBUFFERED": "1"}
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.common.runner", "child", str(spec_path), str(events_path)],
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(process, events_path, log_path)

    def follow(
        self, specs: dict[str, MeasureSpec], startup_timeout_s: float, results: dict[str, Any], on_result: Any
    ) -> dict[str, Any]:
        """Read events until the child exits or a deadline passes; fill ``results``; return the child's outcome.

        Deadlines: ``startup_timeout_s`` before the first measurement and between measurements; within one,
        ``timeout_s`` after its start and after each progress event, and never past ``max_s`` from its start.
        """
        current: str | None = None
        progress: list[Any] = []
        heartbeat: Any = None
        started_at = time.monotonic()
        deadline = started_at + startup_timeout_s
        status, error = "ok", None
        import_s = None
        while True:
            exited = self.process.poll() is not None
            self._scan_shm()
            for event in self._new_events():
                kind = event["event"]
                if kind == "ready":
                    import_s = event["import_s"]
                elif kind == "start":
                    current, progress, heartbeat = event["label"], [], None
                    started_at = time.monotonic()
                    deadline = self._deadline(specs[current], started_at)
                elif kind == "progress":
                    if "heartbeat" in event["data"]:
                        heartbeat = event["data"]["heartbeat"]
                    else:
                        progress.append(event["data"])
                    if current is not None:
                        deadline = self._deadline(specs[current], started_at)
                elif kind == "result":
                    result = dict(event["result"])
                    result["measure_wall_s"] = round(time.monotonic() - started_at, 3)
                    results[event["label"]] = result
                    if on_result is not None:
                        on_result(event["label"], result)
                    current = None
                    deadline = time.monotonic() + startup_timeout_s
            if exited:
                if current is not None or self.process.returncode != 0:
                    status, error = "crashed", f"child exited with status {self.process.returncode}"
                break
            if time.monotonic() > deadline:
                status, error = "timeout", self._timeout_text(specs.get(current or ""), started_at, startup_timeout_s)
                break
            time.sleep(_POLL_S)
        leaked = self._stop()
        log = {"log_tail": _tail(self.log_path), "log": str(self.log_path)}
        if current is not None:
            results[current] = {
                "status": status,
                "error": error,
                "timeout_s": specs[current].timeout_s,
                "max_s": specs[current].max_s,
                "partial": progress,
                "last_heartbeat": heartbeat,
                **log,
            }
            if on_result is not None:
                on_result(current, results[current])
        return {
            "status": status,
            "error": error,
            "failed_label": current,
            "import_s": import_s,
            "returncode": self.process.returncode,
            "log": log,
            **leaked,
        }

    @staticmethod
    def _deadline(spec: MeasureSpec, started_at: float) -> float:
        deadline = time.monotonic() + spec.timeout_s
        return deadline if spec.max_s is None else min(deadline, started_at + spec.max_s)

    @staticmethod
    def _timeout_text(spec: MeasureSpec | None, started_at: float, startup_timeout_s: float) -> str:
        if spec is None:
            return f"no measurement started within {startup_timeout_s:.0f}s"
        ran_s = time.monotonic() - started_at
        if spec.max_s is not None and ran_s >= spec.max_s:
            return f"measurement still running after its limit of {spec.max_s:.0f}s"
        return f"no progress for {spec.timeout_s:.0f}s (hung?)"

    def _new_events(self) -> list[dict[str, Any]]:
        with self.events_path.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def _stop(self) -> dict[str, Any]:
        """Kill the child's process group; report what was still alive after a clean exit, and /dev/shm leaks."""
        pgid = self.process.pid
        clean_exit = self.process.poll() is not None
        leftover = _group_members(pgid)
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_members(pgid):
                time.sleep(_POLL_S)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(0.5)
        if self.process.poll() is None:
            self.process.wait()
        # Only names this child's processes were seen using: /dev/shm is shared with everything else on the host.
        new_shm = sorted(name for name in self._shm_seen if (_SHM / name).exists())
        for name in new_shm:
            with contextlib.suppress(OSError):
                (_SHM / name).unlink()
        return {
            "processes_left_after_exit": len(leftover) if clean_exit else None,
            "shm_left": new_shm,
        }

    def _scan_shm(self, interval_s: float = 0.5) -> None:
        """Note the /dev/shm names the child's process group maps or holds open (at most every ``interval_s``)."""
        now = time.monotonic()
        if now - self._scanned_at < interval_s:
            return
        self._scanned_at = now
        for pid in _group_members(self.process.pid):
            self._shm_seen |= _shm_names_of(pid)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields: state ppid pgrp ...; zombies (Z) are dead, only waiting for their parent.
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _shm_names_of(pid: int) -> set[str]:
    """Names under /dev/shm that process ``pid`` has mapped (shared memory, named semaphores) or open."""
    names: set[str] = set()
    prefix = str(_SHM) + "/"
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.startswith(prefix):
                    names.add(path[len(prefix) :].removesuffix(" (deleted)").split("/")[0])
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    names.add(target[len(prefix) :].removesuffix(" (deleted)").split("/")[0])
    except OSError:
        pass
    return names


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _slug(adapter_path: str | None) -> str:
    if adapter_path is None:
        return "harness"
    return adapter_path.rpartition(":")[2].lower()


# ---------------------------------------------------------------------------------------------- child side


def _child_main(spec_path: Path, events_path: Path) -> int:
    from benchmarks.common.measures import MEASURES, Context, measure_s3_ceiling

    events = events_path.open("a")

    def emit(doc: dict[str, Any]) -> None:
        events.write(json.dumps(doc, default=str) + "\n")
        events.flush()

    spec = json.loads(spec_path.read_text())
    started = time.perf_counter()
    adapter = load_adapter(spec["adapter"]) if spec["adapter"] else None
    emit({"event": "ready", "import_s": round(time.perf_counter() - started, 3)})
    ctx = Context.from_json(spec["context"])
    for measure in spec["measures"]:
        label = measure["label"]
        emit({"event": "start", "label": label})

        def progress(data: dict[str, Any], label: str = label) -> None:
            emit({"event": "progress", "label": label, "data": data})

        try:
            if measure["kind"] == "s3_ceiling":
                result = measure_s3_ceiling(ctx, measure["params"], progress)
            elif measure["kind"] == "skipped":
                result = {"status": "skipped", **measure["params"]}
            elif measure["kind"] == "describe":
                result = {"status": "ok", **adapter.describe()} if adapter else {"status": "n/a"}
            elif adapter is None:
                raise ValueError(f"measurement {label!r} needs an adapter")
            else:
                result = MEASURES[measure["kind"]](adapter, ctx, measure["params"], progress)
        except Exception as exc:
            result = {
                "status": "failed",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=12)[-4000:],
            }
        emit({"event": "result", "label": label, "result": result})
    events.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "child":
        raise SystemExit("usage: python -m benchmarks.common.runner child SPEC EVENTS")
    sys.exit(_child_main(Path(sys.argv[2]), Path(sys.argv[3])))
