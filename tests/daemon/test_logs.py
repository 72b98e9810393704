"""No credential leaks from a real daemon at DEBUG level, with remote errors that echo the credentials back.

Sentinel credentials (unique strings) go in ``remote.storage_options`` (key, secret, token) and in the daemon's
``AWS_*`` environment. The remote is reached through the fault proxy, which answers the first listing and every
GET with 403 ``SignatureDoesNotMatch`` and copies the request's Authorization header and session token into the
error body (as S3 does with the key id). Then no sentinel may appear in the daemon's and samplers' logs (stderr),
status.json, ``cachefeed status`` (human and ``--json``), the metrics (textfile and HTTP), or the command lines of
the daemon and its samplers.
"""

from __future__ import annotations

import json
import os
import urllib.request
import uuid
from pathlib import Path

from cachefeed._status.report import StatusReport
from cachefeed._status.verdict import Health
from cachefeed._testing.local_s3 import LocalS3, free_port
from cachefeed._testing.proxy import FaultProxy, Rule
from tests.status.test_daemon import Daemon, put_objects, write_config


def sentinel(tag: str) -> str:
    return f"SNTL{tag}{uuid.uuid4().hex[:20].upper()}"


def forbidden_seen(report: StatusReport) -> bool:
    document = report.document
    return (
        document is not None
        and document["remote"]["errors_by_kind"].get("forbidden", 0) >= 2
        and document["remote"]["list_errors_total"] >= 1
    )


def test_no_sentinel_anywhere(tmp_path: Path, s3: LocalS3, fault_proxy: FaultProxy) -> None:
    put_objects(s3, "data", count=8)
    fault_proxy.set_rules(
        [
            Rule("status", op="ListObjectsV2", status=403, code="SignatureDoesNotMatch", echo_auth=True, max_count=1),
            Rule("status", op="GetObject", status=403, code="SignatureDoesNotMatch", echo_auth=True),
        ]
    )
    options = {
        "endpoint_url": fault_proxy.endpoint,
        "key": sentinel("KEY"),
        "secret": sentinel("SECRET"),
        "token": sentinel("TOKEN"),
    }
    env_values = {
        "AWS_ACCESS_KEY_ID": sentinel("ENVKEY"),
        "AWS_SECRET_ACCESS_KEY": sentinel("ENVSECRET"),
        "AWS_SESSION_TOKEN": sentinel("ENVTOKEN"),
    }
    sentinels = [options["key"], options["secret"], options["token"], *env_values.values()]
    port = free_port()
    textfile = tmp_path / "cachefeed.prom"
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "daemon.toml",
        cache_dir=cache_dir,
        url="s3://data/train",
        storage_options=options,
        status__metrics_port=str(port),
        status__metrics_textfile=json.dumps(str(textfile)),
        log__level='"debug"',
    )
    daemon = Daemon(config, cache_dir, tmp_path / "daemon.err", {**os.environ, **env_values}).start()
    try:
        report = daemon.wait_for(forbidden_seen, "a failed listing and forbidden GETs")
        assert report.document is not None
        pids = [daemon.process.pid] + [s["pid"] for s in report.document["samplers"] if s["pid"]]
        command_lines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") for pid in pids}
        human = daemon.cli("--config", str(config))
        as_json = daemon.cli("--cache-dir", str(cache_dir), "--json")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            served = response.read().decode()
    finally:
        daemon.stop()
    assert daemon.process.returncode == 0

    logs = daemon.stderr()
    outputs = {
        "logs": logs,
        "status.json": (cache_dir / "status.json").read_text(),
        "status": human.stdout + human.stderr,
        "status --json": as_json.stdout + as_json.stderr,
        "textfile": textfile.read_text(),
        "http": served,
        **{f"cmdline of {pid}": line for pid, line in command_lines.items()},
    }
    for name, text in outputs.items():
        for value in sentinels:
            assert value not in text, f"{value} leaked into {name}"
    # the test exercised what it claims: debug logging, the error paths, the echoing proxy
    assert " DEBUG " in logs
    assert fault_proxy.counts().fault("status") >= 3
    assert as_json.returncode in (Health.RUNNING, Health.DEGRADED)
    shown = json.loads(as_json.stdout)
    assert shown["remote"]["errors_by_kind"]["forbidden"] >= 2
    assert all(line.count(" cachefeed.") <= 1 for line in logs.splitlines())  # one line per event
