"""``cachefeed status`` and the metrics against a real daemon (subprocess) on the moto S3 server.

A running daemon: exit 0, human and JSON output, metrics (textfile and HTTP) that agree with status.json; a
SIGTERMed one: exit 3 "stopped"; a SIGKILLed one: exit 3 (pid gone, then stale heartbeat), never a crash.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachefeed._errors import NoSuchCacheError
from cachefeed._status.render import WIDTH
from cachefeed._status.report import StatusReport, read_report
from cachefeed._status.verdict import Health
from cachefeed._testing.local_s3 import LocalS3, free_port
from tests.status.test_metrics import parse, value

REPO = Path(__file__).resolve().parents[2]
OBJECTS = 40
# The real CLI entry point, with only the subcommands these tests use registered (the CLI imports every
# subcommand's module to build its parser; these tests must not depend on the others).
_RUNNER = (
    "import sys\n"
    "from cachefeed import _cli as cli\n"
    "cli.COMMANDS = {name: cli.COMMANDS[name] for name in ('daemon', 'status')}\n"
    "sys.exit(cli.main())\n"
)
CACHEFEED = [sys.executable, "-c", _RUNNER]


def put_objects(s3: LocalS3, bucket: str, count: int = OBJECTS) -> None:
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    for i in range(count):
        buffer = io.BytesIO()
        np.save(buffer, np.arange(256, dtype=np.float32) + i)
        client.put_object(Bucket=bucket, Key=f"train/{i:04d}.npy", Body=buffer.getvalue())


def write_config(path: Path, *, cache_dir: Path, url: str, storage_options: dict[str, str], **extra: str) -> Path:
    options = ", ".join(f"{key} = {json.dumps(val)}" for key, val in storage_options.items())
    sections = {
        "remote": {"url": json.dumps(url), "storage_options": "{ " + options + " }", "max_attempts": "2",
                   "backoff_base": '"10ms"', "backoff_max": '"50ms"', "refresh_interval": '"2s"'},
        "cache": {"dir": json.dumps(str(cache_dir)), "max_bytes": '"16MiB"', "segment_bytes": '"256KiB"',
                  "min_free_bytes": "0", "fsync": "false"},
        "sampler": {"processes": "2", "concurrency": "4", "restart_backoff": '"200ms"'},
        "status": {"interval": '"200ms"'},
        "log": {"level": '"info"'},
    }  # fmt: skip
    for dotted, raw in extra.items():
        section, key = dotted.split("__")
        sections[section][key] = raw
    text = "".join(
        f"[{name}]\n" + "".join(f"{key} = {raw}\n" for key, raw in body.items()) for name, body in sections.items()
    )
    path.write_text(text)
    return path


@dataclass
class Daemon:
    """A ``cachefeed daemon`` subprocess, its config and its stderr (a file, read after the fact)."""

    config: Path
    cache_dir: Path
    stderr_path: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] = field(init=False)

    def start(self) -> Daemon:
        with open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(
                [*CACHEFEED, "daemon", "--config", str(self.config)],
                cwd=REPO,
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        return self

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CACHEFEED, "status", *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=60
        )

    def wait_for(self, predicate: Callable[[StatusReport], bool], what: str, timeout_s: float = 45) -> StatusReport:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                report: StatusReport | None = read_report(self.cache_dir, interval_s=0.2)
            except NoSuchCacheError:
                report = None  # not created yet, or being created (layout first, then the tag)
            if report is not None and predicate(report):
                return report
            if self.process.poll() is not None and report is None:
                raise AssertionError(f"daemon exited {self.process.returncode}: {self.stderr()[-3000:]}")
            if time.monotonic() > deadline:
                shown = report.document if report else None
                raise AssertionError(f"timed out waiting for {what}: {shown}\n{self.stderr()[-3000:]}")
            time.sleep(0.05)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[Daemon]]:
    """Daemons started by the test; stopped (and their samplers checked gone) afterwards."""
    started: list[Daemon] = []
    yield started
    for daemon in started:
        daemon.stop()


def make_daemon(tmp_path: Path, s3: LocalS3, daemons: list[Daemon], **extra: str) -> Daemon:
    put_objects(s3, "data")
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "daemon.toml", cache_dir=cache_dir, url="s3://data/train", storage_options=s3.storage_options(),
        **extra,
    )  # fmt: skip
    daemon = Daemon(config, cache_dir, tmp_path / "daemon.err", dict(os.environ)).start()
    daemons.append(daemon)
    return daemon


def all_ingested(report: StatusReport) -> bool:
    document = report.document
    return (
        report.health == Health.RUNNING
        and document is not None
        and document["ingest"]["objects_total"] >= OBJECTS
        and all(s["state"] == "running" for s in document["samplers"])
    )


def agreeing_metrics(cache_dir: Path, textfile: Path, timeout_s: float = 20) -> tuple[dict[str, Any], Any]:
    """A status document and the textfile written from that same document (same updated_at)."""
    deadline = time.monotonic() + timeout_s
    while True:
        document = json.loads((cache_dir / "status.json").read_text())
        samples = parse(textfile.read_text())
        if value(samples, "cachefeed_status_updated_timestamp_seconds") == pytest.approx(document["updated_at"]):
            return document, samples
        assert time.monotonic() < deadline, "status.json and the textfile never matched"
        time.sleep(0.02)


def test_status_of_a_running_then_stopped_daemon(tmp_path: Path, s3: LocalS3, daemons: list[Daemon]) -> None:
    port = free_port()
    textfile = tmp_path / "cachefeed.prom"
    daemon = make_daemon(
        tmp_path, s3, daemons, status__metrics_port=str(port), status__metrics_textfile=json.dumps(str(textfile))
    )
    daemon.wait_for(all_ingested, "all objects ingested, samplers running")

    human = daemon.cli("--config", str(daemon.config))
    assert human.returncode == 0, human.stdout + human.stderr
    lines = human.stdout.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    text = " ".join(human.stdout.split())
    assert "health RUNNING" in text
    assert f"daemon running, pid {daemon.process.pid}" in text
    assert f"listing {OBJECTS} objects, listed" in text
    assert "samplers 2 of 2 running, 0 restarts" in text
    assert "remote s3://data/train" in text

    shown = daemon.cli("--cache-dir", str(daemon.cache_dir), "--json")
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert document["state"] == "running" and document["health"]["status"] == "running"
    assert 0 <= document["heartbeat_age_s"] < 5
    assert document["pid"] == daemon.process.pid
    assert document["ingest"]["objects_total"] >= OBJECTS and document["cache"]["samples"] >= OBJECTS
    assert isinstance(document["cache"], dict) and not any("." in key for key in document)

    on_disk, samples = agreeing_metrics(daemon.cache_dir, textfile)
    assert value(samples, "cachefeed_cache_bytes") == on_disk["cache"]["bytes"]
    assert value(samples, "cachefeed_cache_samples") == on_disk["cache"]["samples"]
    assert value(samples, "cachefeed_ingest_samples_total") == on_disk["ingest"]["samples_total"]
    assert value(samples, "cachefeed_remote_requests_total") == on_disk["remote"]["requests_total"]
    assert value(samples, "cachefeed_sampler_restarts_total", sampler="1") == 0
    assert value(samples, "cachefeed_state", state="running") == 1
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        served = parse(response.read().decode())
    assert value(served, "cachefeed_ingest_objects_total") >= OBJECTS
    assert value(served, "cachefeed_remote_objects_listed") == OBJECTS

    daemon.process.send_signal(signal.SIGTERM)
    assert daemon.process.wait(30) == 0
    stopped = daemon.cli("--cache-dir", str(daemon.cache_dir))
    assert stopped.returncode == 3, stopped.stdout
    assert "the daemon stopped" in stopped.stdout
    assert value(parse(textfile.read_text()), "cachefeed_state", state="stopped") == 1


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(")") + 2] in "ZX"


def test_status_of_a_sigkilled_daemon(tmp_path: Path, s3: LocalS3, daemons: list[Daemon]) -> None:
    daemon = make_daemon(tmp_path, s3, daemons)
    report = daemon.wait_for(all_ingested, "all objects ingested, samplers running")
    assert report.document is not None
    sampler_pids = [s["pid"] for s in report.document["samplers"]]

    daemon.process.kill()  # SIGKILL; not reaped yet: a zombie
    try:
        zombie = daemon.cli("--cache-dir", str(daemon.cache_dir))
        assert zombie.returncode == 3, zombie.stdout + zombie.stderr
        assert f"the daemon (pid {daemon.process.pid}) is gone" in zombie.stdout
        assert "daemon    running" not in zombie.stdout, "NOT RUNNING is never followed by 'running'"
        assert "last said running" in zombie.stdout
        assert "Traceback" not in zombie.stderr
    finally:
        daemon.process.wait()
    shown = daemon.cli("--cache-dir", str(daemon.cache_dir), "--json")
    assert shown.returncode == 3
    assert json.loads(shown.stdout)["health"]["status"] == "not_running"

    # with no pid to check (another host, or a pid reused), the heartbeat alone tells: stale after 5 s
    stale = daemon.wait_for(
        lambda r: any("stale heartbeat" in reason for reason in r.reasons), "a stale heartbeat", timeout_s=20
    )
    assert stale.health == Health.NOT_RUNNING
    human = daemon.cli("--cache-dir", str(daemon.cache_dir))
    assert human.returncode == 3 and "stale heartbeat" in human.stdout and "Traceback" not in human.stderr

    # the samplers notice that their supervisor died and exit (nothing left running after the test)
    deadline = time.monotonic() + 20
    try:
        while not all(_gone(pid) for pid in sampler_pids):
            assert time.monotonic() < deadline, "samplers outlived their SIGKILLed supervisor"
            time.sleep(0.05)
    finally:
        for pid in sampler_pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
