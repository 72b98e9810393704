"""Credentials never leak: what ``tests/daemon/test_logs.py`` does not already cover.

That test runs a daemon at DEBUG with sentinel credentials in ``storage_options`` and the environment, answers
403s that echo the Authorization header, and checks logs, status, ``cachefeed status``, metrics and command lines.
Here:

* the **transient** error paths (500/503 echoing the credentials, resets, truncations: retried and logged at
  DEBUG) and a failing listing that echoes them, with a password in the URL's userinfo too; checked in the logs,
  ``status.json``, the command lines and the environment-free parts of ``/proc`` of the daemon and its samplers;
* **bad configs that hold a credential**: the one-line error of the CLI (exit 78) must not repeat it.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from cachefeed._config import toml_text
from cachefeed._testing.daemon import BUCKET, daemon_argv, start_daemon, write_config
from cachefeed._testing.proxy import FaultProxy, Rule
from tests.reliability.common import report, upload_sv


def sentinel(tag: str) -> str:
    return f"SNTL{tag}{uuid.uuid4().hex[:16].upper()}"


def test_transient_error_paths_at_debug_level_never_show_credentials(
    tmp_path: Path, bucket: Any, fault_proxy: FaultProxy
) -> None:
    upload_sv(bucket, BUCKET, 20, 1024)
    secrets = {"key": sentinel("KEY"), "secret": sentinel("SECRET"), "token": sentinel("TOKEN")}
    env_secrets = {"AWS_SECRET_ACCESS_KEY": sentinel("ENVSECRET"), "AWS_SESSION_TOKEN": sentinel("ENVTOKEN")}
    password = sentinel("URLPASS")
    fault_proxy.set_rules(
        [
            Rule("status", op="ListObjectsV2", status=503, code="SlowDown", echo_auth=True, max_count=2),
            Rule("status", op="GetObject", status=500, code="InternalError", echo_auth=True, probability=0.3),
            Rule("slowdown", op="GetObject", echo_auth=True, probability=0.2),
            Rule("reset", op="GetObject", probability=0.1),
            Rule("truncate", op="GetObject", probability=0.1),
        ]
    )
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "daemon.toml",
        endpoint=fault_proxy.endpoint,
        bucket=BUCKET,
        cache_dir=cache_dir,
        sections={
            "remote": {
                "storage_options": {"endpoint_url": fault_proxy.endpoint, **secrets},
                "max_attempts": 6,
                "retry_budget": 1.0,
            },
            "log": {"level": "debug"},
        },
    )
    # moto accepts any credentials; the proxy echoes whatever the client signs with
    proc = start_daemon(config, cache_dir, tmp_path / "daemon.stderr", env={**os.environ, **env_secrets})
    try:
        doc = proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 20, timeout_s=90, what="every object")
        pids = [proc.pid] + [s["pid"] for s in doc["samplers"] if s["pid"]]
        procfs = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") for pid in pids}
        procfs.update({-pid: Path(f"/proc/{pid}/comm").read_text() for pid in pids})
        assert proc.stop() == 0
    finally:
        if proc.process.poll() is None:
            proc.kill_group()
    # A second daemon with the password in the URL's userinfo: the URL is wrong for s3fs, the listing fails.
    url_config = tmp_path / "url.toml"
    text = config.read_text().replace(f'"s3://{BUCKET}/"', f'"s3://user:{password}@{BUCKET}/"')
    text = text.replace(f'"{cache_dir}"', f'"{tmp_path / "cache2"}"')
    url_config.write_text(text)
    url_proc = start_daemon(url_config, tmp_path / "cache2", tmp_path / "url.stderr", env={**os.environ, **env_secrets})
    try:
        url_doc = url_proc.wait_status(
            lambda d: d["remote"]["list_errors_total"] >= 1 or d["state"] == "degraded",
            timeout_s=60,
            what="the listing failing",
        )
        url_cmdline = Path(f"/proc/{url_proc.pid}/cmdline").read_bytes().decode(errors="replace")
        url_proc.stop()
    finally:
        if url_proc.process.poll() is None:
            url_proc.kill_group()
    outputs = {
        "logs": proc.stderr(),
        "status.json": (cache_dir / "status.json").read_text(),
        "url logs": url_proc.stderr(),
        "url status.json": (tmp_path / "cache2" / "status.json").read_text(),
        "url cmdline": url_cmdline,
        **{f"/proc/{pid}": text for pid, text in procfs.items()},
    }
    values = [*secrets.values(), *env_secrets.values(), password]
    leaks = [(name, value[:8]) for name, text in outputs.items() for value in values if value in text]
    counts = fault_proxy.counts()
    report(
        "secrets-transient-paths",
        sentinels=len(values),
        outputs_checked=len(outputs),
        faults_injected=sum(counts.faults.values()),
        echoed_errors=counts.fault("status") + counts.fault("slowdown"),
        debug_lines=outputs["logs"].count(" DEBUG "),
        url_state=url_doc["state"],
        violations=len(leaks),
    )
    assert " DEBUG " in outputs["logs"] and counts.fault("status") >= 2
    assert not leaks, leaks


def bad_config(tmp_path: Path, name: str, body: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"{name}.toml"
    path.write_text(body)
    return subprocess.run(daemon_argv(path), capture_output=True, text=True, timeout=60, check=False)


SECRET = "SNTLCONFIGSECRET0123456789"
BASE: dict[str, dict[str, Any]] = {
    "remote": {"url": "s3://data/", "storage_options": {"key": "AKIDSNTL", "secret": SECRET}},
    "cache": {"dir": "/tmp/cachefeed-bad-config", "max_bytes": "64MiB"},
}


def _with(section: str, key: str, value: Any) -> str:
    document = {name: dict(body) for name, body in BASE.items()}
    document.setdefault(section, {})[key] = value
    return toml_text(document)


SECRET_CONFIGS = [
    pytest.param(
        "storage-options-string",
        f'[remote]\nurl = "s3://data/"\nstorage_options = "secret={SECRET}"\n'
        '[cache]\ndir = "/tmp/x"\nmax_bytes = "64MiB"\n',
    ),
    pytest.param(
        "url-userinfo-newline",
        f'[remote]\nurl = "s3://user:{SECRET}@data/\\n"\n[cache]\ndir = "/tmp/x"\nmax_bytes = "64MiB"\n',
    ),
    ("other-key-bad", _with("remote", "max_attempts", 0)),
    ("secret-at-the-wrong-level", _with("remote", "secret", SECRET)),
    ("unterminated-secret", f'[remote]\nurl = "s3://data/"\nstorage_options = {{ secret = "{SECRET} }}\n'),
    ("cache-bad", _with("cache", "max_bytes", "-5GiB")),
]


@pytest.mark.parametrize(("name", "body"), SECRET_CONFIGS)
def test_a_bad_config_holding_a_credential_never_repeats_it(tmp_path: Path, name: str, body: str) -> None:
    result = bad_config(tmp_path, name, body)
    lines = result.stderr.strip().splitlines()
    leaked = SECRET in result.stderr or SECRET in result.stdout
    report(f"secrets-bad-config-{name}", exit=result.returncode, violations=int(leaked))
    assert result.returncode == 78, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert not leaked, lines[0]
