"""``cachefeed status`` on status documents written by the test (the daemon's side: test_daemon.py here).

Every document here follows the contract (tests/api brief, ``STATUS_SCHEMA``); each test changes one thing and
checks the verdict (exit status), the human output and the JSON output, through the real CLI entry point.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import pty
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachefeed import _cli as cli
from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.records import SegmentWriter
from cachefeed._cache.snapshots import Snapshot
from cachefeed._fsutil import atomic_write
from cachefeed._status.render import WIDTH, render_human
from cachefeed._status.report import read_report
from cachefeed._status.verdict import Health, stale_after_s

REPO = Path(__file__).resolve().parents[2]
# ``cachefeed status`` through the real CLI, with only the status subcommand registered: the CLI imports every
# subcommand's module to build its parser, and the status command must not depend on the others.
# Ctrl-C as at a terminal: a suite started as a shell's background job (``pytest &``) inherits SIGINT ignored,
# and Python then installs no KeyboardInterrupt handler, so the --watch tests restore the one a terminal gives.
_ONLY_STATUS = (
    "import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "from cachefeed import _cli as cli\n"
    "cli.COMMANDS = {'status': cli.COMMANDS['status']}\nsys.exit(cli.main())\n"
)
STATUS_CMD = [sys.executable, "-c", _ONLY_STATUS, "status"]


def flat(text: str) -> str:
    """``text`` with every run of whitespace one space: the human output wraps long lines (a long temporary path
    moves the breaks), so phrases are checked across them."""
    return " ".join(text.split())


@pytest.fixture(autouse=True)
def _only_status_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "COMMANDS", {"status": cli.COMMANDS["status"]})


def make_document(cache_dir: Path, **changes: Any) -> dict[str, Any]:
    """A healthy, running daemon's document (every key of the contract), with ``changes`` applied."""
    now = time.time()
    document: dict[str, Any] = {
        "version": 1,
        "state": "running",
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started_at": now - 7260,
        "updated_at": now,
        "degraded_reasons": [],
        "cache": {
            "dir": str(cache_dir),
            "bytes": 12 << 30,
            "max_bytes": 16 << 30,
            "samples": 1_234_567,
            "fill": 0.75,
            "segments": 183,
            "pinned_bytes": 3 << 30,
            "pinned_only_bytes": 1 << 30,
            "reserved_bytes": 128 << 20,
            "free_bytes": 40 << 30,
            "min_free_bytes": 1 << 30,
            "turnover_bytes": 4 << 30,
            "is_backpressured": False,
            "is_paced": True,
            "waiting_for_reads_samples": 600_000,
            "evict_after_reads": 1,
            "echo_factor": 2.9,
            "ingest_bound": "remote",
            "is_remote_bound": True,
            "unread_samples": 40_000,
            "max_reads": 3,
            "epochs_total": 12,
            "sample_reads_total": 14_000_000,
            "newest_age_s": 1.5,
            "oldest_age_s": 900.0,
            "snapshots": [
                {
                    "id": "run1-e3",
                    "samples": 12_345,
                    "segments": 20,
                    "owner": "pid 555 on node7",
                    "age_s": 180.0,
                    "idle_s": 2.0,
                },
            ],
        },
        "ingest": {
            "bytes_per_s": 120.3 * (1 << 20),
            "samples_per_s": 812.0,
            "objects_per_s": 3.1,
            "objects_total": 45_678,
            "samples_total": 9_123_456,
            "bytes_total": 1 << 40,
            "segments_total": 1234,
        },
        "evicted": {
            "samples_total": 6_000_000,
            "bytes_total": 800 << 30,
            "segments_total": 5000,
            "turnover_s": 860.0,
            "unread_samples_total": 1_000,
            "epochs_per_sample": 1.93,
            "max_reads": 4,
        },
        "remote": {
            "url": "s3://bucket/prefix",
            "objects_listed": 12_345,
            "last_listed_at": now - 80,
            "list_errors_total": 1,
            "passes_completed": 3,
            "requests_total": 123_456,
            "retries_total": 1234,
            "errors_total": 56,
            "errors_by_kind": {"forbidden": 3, "transient": 53},
            "quarantined_total": 2,
            "not_cached": {"decode": 2, "too_large": 1},
            "bytes_total": 1 << 40,
            "bytes_per_sample_read": 78_500.0,
        },
        "samplers": [
            {"index": 0, "pid": 1235, "state": "running", "restarts": 0, "objects_total": 12_345, "last_error": None},
            {
                "index": 1,
                "pid": None,
                "state": "restarting",
                "restarts": 2,
                "objects_total": 2345,
                "last_error": "RemoteForbiddenError: access denied",
            },
        ],
    }
    for path, value in changes.items():
        target = document
        *parents, last = path.split("__")
        for parent in parents:
            target = target[parent]
        target[last] = value
    return document


def make_cache(root: Path) -> CacheLayout:
    layout = CacheLayout(root)
    layout.create()
    return layout


def write_status(layout: CacheLayout, document: dict[str, Any]) -> None:
    atomic_write(layout.status_file, json.dumps(document).encode())


def status(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["status", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_running_daemon_human_output_fits_80_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = make_cache(tmp_path / "cache")
    write_status(layout, make_document(layout.root))
    code, out, _ = status(capsys, "--cache-dir", str(layout.root))
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= WIDTH
    for expected in (
        "health RUNNING",
        "12.0 GiB of 16.0 GiB (75%), 1,234,567 samples of 10.2 KiB, 183 segments",
        "40.0 GiB on the filesystem, floor 1.0 GiB",
        "120.3 MiB/s",
        "812 samples/s",
        "6,000,000 samples",
        "a segment stays about 14m20s; 4.0 GiB kept for fresh samples",
        "3.0 GiB by 1 snapshot (1.0 GiB already evicted)",
        "run1-e3: 12,345 samples, pid 555 on node7, 3m00s old, idle 2.0s",
        "1 of 2 running, 2 restarts",
        "#1 restarting",
        "RemoteForbiddenError: access denied",
        "s3://bucket/prefix",
        "12,345 objects, listed 1m20s ago, 3 passes done, 1 failed",
        "123,456 requests, 1,234 retries",
        "56 failed (forbidden 3, transient 53)",
        "3 listed objects not cached (decode 2, too_large 1)",
        "up 2h01m",
    ):
        assert expected in " ".join(out.split()), (expected, out)


def test_json_is_the_document_plus_heartbeat_age(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = make_cache(tmp_path / "cache")
    document = make_document(layout.root, updated_at=time.time() - 2.0)
    write_status(layout, document)
    code, out, _ = status(capsys, "--cache-dir", str(layout.root), "--json")
    assert code == 0
    shown = json.loads(out)
    assert 1.9 <= shown.pop("heartbeat_age_s") < 10
    assert shown.pop("health") == {"status": "running", "exit_status": 0, "reasons": []}
    assert shown == document  # nested objects, unchanged


def test_degraded_reasons_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = make_cache(tmp_path / "cache")
    reason = "sampler 1 restarted 5 times in 60s"
    write_status(layout, make_document(layout.root, state="degraded", degraded_reasons=[reason]))
    code, out, _ = status(capsys, "--cache-dir", str(layout.root))
    assert code == Health.DEGRADED == 2
    assert "DEGRADED (exit 2)" in out and flat(reason) in flat(out)
    code, out, _ = status(capsys, "--cache-dir", str(layout.root), "--json")
    assert code == 2 and json.loads(out)["health"]["reasons"] == [reason]


@pytest.mark.parametrize(("state", "expected"), [("starting", 5), ("stopping", 5), ("stopped", 3), ("weird", 4)])
def test_states_map_to_exit_statuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], state: str, expected: int
) -> None:
    layout = make_cache(tmp_path / "cache")
    write_status(layout, make_document(layout.root, state=state))
    code, out, _ = status(capsys, "--cache-dir", str(layout.root))
    assert code == expected, out


def test_stale_heartbeat_is_not_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = make_cache(tmp_path / "cache")
    write_status(layout, make_document(layout.root, updated_at=time.time() - 6.0))
    code, out, _ = status(capsys, "--cache-dir", str(layout.root))
    assert code == Health.NOT_RUNNING == 3
    assert "stale heartbeat" in out and "NOT RUNNING" in out
    assert "1,234,567 samples" in out  # the last known status is still shown


def test_a_stale_heartbeat_says_what_the_lock_and_the_process_show(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the daemon's host, status looks at the process and the cache's lock: a stopped daemon (SIGSTOP, a
    debugger, a machine that stopped it) is not a dead one."""
    layout = make_cache(tmp_path / "cache")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(layout.lock_file)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        write_status(layout, make_document(layout.root, pid=holder.pid, updated_at=time.time() - 9.0))
        code, out, _ = status(capsys, "--cache-dir", str(layout.root))
        assert code == Health.NOT_RUNNING
        assert f"the daemon (pid {holder.pid}) still holds the cache's lock but writes no status: it is hung" in flat(
            out
        )
        holder.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{holder.pid}/stat").read_text().split(") ")[1][0] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        code, out, _ = status(capsys, "--cache-dir", str(layout.root))
        assert code == Health.NOT_RUNNING and "it is stopped by a signal or a debugger" in flat(out)
        layout.lock_file.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": "now"}))
        code, out, _ = status(capsys, "--cache-dir", str(layout.root))  # the lock names another daemon
        assert f"another daemon (pid {os.getpid()}) holds the cache's lock and has not written its status" in flat(out)
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.communicate()
    code, out, _ = status(capsys, "--cache-dir", str(layout.root))
    assert code == Health.NOT_RUNNING and f"(pid {holder.pid}) is gone: killed or crashed" in flat(out)
    assert "stale heartbeat: last status 9." in flat(out)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    samplers = os.open(layout.lock_file, os.O_RDWR)  # a killed daemon's samplers, still on their way out
    fcntl.flock(samplers, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        write_status(layout, make_document(layout.root, pid=gone.pid, updated_at=time.time() - 9.0))
        layout.lock_file.write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "since": "then"}))
        code, out, _ = status(capsys, "--cache-dir", str(layout.root))
        assert f"the daemon (pid {gone.pid}) is gone, but its samplers still hold the cache's lock" in flat(out)
    finally:
        os.close(samplers)
    write_status(layout, make_document(layout.root, updated_at=time.time() - 9.0))  # this process: alive, no lock
    code, out, _ = status(capsys, "--cache-dir", str(layout.root))
    assert f"the daemon (pid {os.getpid()}) no longer holds the cache's lock: it exited or is exiting" in flat(out)


def test_stale_limit_follows_the_configured_interval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = make_cache(tmp_path / "cache")
    write_status(layout, make_document(layout.root, updated_at=time.time() - 8.0))
    config = tmp_path / "c.toml"
    config.write_text(
        f'[remote]\nurl = "memory://x"\n[cache]\ndir = "{layout.root}"\nmax_bytes = "1GiB"\n'
        'segment_bytes = "1MiB"\n[status]\ninterval = "2s"\n'
    )
    assert stale_after_s(2.0) == 10.0
    code, _, _ = status(capsys, "--config", str(config))
    assert code == 0  # 8 s old, limit 10 s
    code, _, _ = status(capsys, "--cache-dir", str(layout.root))
    assert code == 3  # default interval 1 s: limit 5 s
    write_status(layout, make_document(layout.root, updated_at=time.time() - 8.0, interval_s=2.0))
    code, _, _ = status(capsys, "--cache-dir", str(layout.root))
    assert code == 0  # the document's optional interval_s hint


def test_dead_pid_on_this_host_is_not_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = make_cache(tmp_path / "cache")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    write_status(layout, make_document(layout.root, pid=child.pid))
    code, out, _ = status(capsys, "--cache-dir", str(layout.root))
    assert code == 3
    assert f"pid {child.pid}) is gone" in flat(out)
    # a zombie (killed, not yet reaped by its parent) is gone too
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        zombie.kill()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{zombie.pid}/stat").read_text().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        write_status(layout, make_document(layout.root, pid=zombie.pid))
        assert status(capsys, "--cache-dir", str(layout.root))[0] == 3
    finally:
        zombie.wait()
    # the same dead pid on another host is not checked: the fresh heartbeat decides
    write_status(layout, make_document(layout.root, pid=child.pid, host="another-host"))
    assert status(capsys, "--cache-dir", str(layout.root))[0] == 0


def test_dead_pid_with_an_advancing_heartbeat_is_alive(tmp_path: Path) -> None:
    """Another pid namespace under the same host name: the pid looks gone but the document keeps moving."""
    layout = make_cache(tmp_path / "cache")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    write_status(layout, make_document(layout.root, pid=child.pid))
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import json, sys, time\n"
            "from cachefeed._fsutil import atomic_write\n"
            "doc = json.loads(open(sys.argv[1]).read())\n"
            "for _ in range(200):\n"
            "    doc['updated_at'] = time.time()\n"
            "    atomic_write(sys.argv[1], json.dumps(doc).encode())\n"
            "    time.sleep(0.1)\n",
            str(layout.status_file),
        ],
        cwd=REPO,
    )
    try:
        first = layout.status_file.stat().st_mtime_ns
        deadline = time.monotonic() + 30
        while layout.status_file.stat().st_mtime_ns == first and time.monotonic() < deadline:
            time.sleep(0.05)  # the writer's interpreter is up and writing (slow to start on a loaded machine)
        report = read_report(layout.root, interval_s=0.2)
        assert report.health == Health.RUNNING, report.reasons
    finally:
        writer.kill()
        writer.wait()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (b'{"version": 1, "state": "runn', "not valid JSON"),
        (b"\xff\xfe garbage", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b'{"version": 2}', "status version 2"),
        (b'{"version": 1, "state": "running"}', "pid is missing"),
    ],
)
def test_corrupt_or_half_written_status_never_crashes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    layout = make_cache(tmp_path / "cache")
    layout.status_file.write_bytes(content)
    code, out, _ = status(capsys, "--cache-dir", str(layout.root))
    assert code == Health.UNREADABLE == 4
    assert flat(message) in flat(out) and "UNREADABLE" in out
    code, out, _ = status(capsys, "--cache-dir", str(layout.root), "--json")
    shown = json.loads(out)
    assert code == 4 and shown["health"]["status"] == "unreadable" and message in shown["health"]["reasons"][0]
    assert shown["cache"]["segments"] == 0  # the directory's own view comes with it


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("cache__bytes", "12", "cache.bytes: expected a number"),
        ("cache__is_backpressured", None, "cache.is_backpressured"),
        ("samplers", {"0": {}}, "samplers: expected a list"),
        ("remote__errors_by_kind", {"forbidden": "many"}, "remote.errors_by_kind.forbidden"),
        ("pid", True, "pid: expected a number"),
    ],
)
def test_wrong_types_are_reported_by_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], path: str, value: object, message: str
) -> None:
    layout = make_cache(tmp_path / "cache")
    write_status(layout, make_document(layout.root, **{path: value}))
    code, out, _ = status(capsys, "--cache-dir", str(layout.root))
    assert code == 4 and flat(message) in flat(out)


def test_status_symlink_is_not_followed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = make_cache(tmp_path / ("a-long-directory-name-" * 6) / "cache")  # the reason is shown whole
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(make_document(layout.root)))
    layout.status_file.symlink_to(elsewhere)
    code, out, _ = status(capsys, "--cache-dir", str(layout.root))
    assert code == 4 and "symlink is never followed" in flat(out), out


def _as_unprivileged() -> list[str]:
    """A command prefix that drops to nobody (when root), so that permissions apply."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot drop privileges")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_permission_problems_are_explained(tmp_path: Path) -> None:
    prefix = _as_unprivileged()
    base = Path(tempfile.mkdtemp(prefix="cachefeed-perm-", dir="/tmp"))  # traversable by nobody, unlike tmp_path
    try:
        base.chmod(0o755)
        layout = make_cache(base / "cache")
        write_status(layout, make_document(layout.root))

        def run_status() -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*prefix, *STATUS_CMD, "--cache-dir", str(layout.root)], cwd=REPO, capture_output=True, text=True
            )

        layout.root.chmod(0o750)  # group-readable only: another user
        result = run_status()
        assert result.returncode == 4 and "readable by its group: join that group" in result.stdout + result.stderr
        assert "Traceback" not in result.stderr
        layout.root.chmod(0o755)
        layout.status_file.chmod(0o640)
        result = run_status()
        assert result.returncode == 4 and "permission denied" in result.stdout, result.stdout + result.stderr
        base.chmod(0o700)  # cannot even reach the cache
        result = run_status()
        assert result.returncode == 4 and "Traceback" not in result.stderr, result.stderr
    finally:
        base.chmod(0o755)
        shutil.rmtree(base)


def _write_segment(path: Path, samples: int) -> None:
    writer = SegmentWriter(path, capacity=1 << 20)
    for i in range(samples):
        assert writer.append(writer.encode({"__key__": f"k{i}", "x": np.arange(8, dtype=np.float32) + i}))
    writer.finish(fsync=False)


def test_static_cache_without_status_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = make_cache(tmp_path / "cache")
    _write_segment(layout.segments / "0000000000000000.seg", 5)
    _write_segment(layout.segments / "0000000000000001.seg", 7)
    (layout.segments / "0000000000000002.seg").write_bytes(b"junk")
    with Snapshot.create(layout.root, "run-e0"):
        code, out, _ = status(capsys, "--cache-dir", str(layout.root))
        assert code == Health.NOT_RUNNING == 3
        text = " ".join(out.split())
        assert "no status file" in text
        assert "12 samples, 3 segments (1 invalid)" in text
        assert "by 1 snapshot" in text and f"pid {os.getpid()}" in text
        code, out, _ = status(capsys, "--cache-dir", str(layout.root), "--json")
        shown = json.loads(out)
    assert code == 3
    assert shown["state"] is None and shown["heartbeat_age_s"] is None
    assert shown["cache"]["samples"] == 12 and shown["cache"]["segments"] == 3
    assert [snap["id"] for snap in shown["cache"]["snapshots"]] == ["run-e0"]
    assert shown["health"]["status"] == "not_running"


def test_no_such_cache_exits_66(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = status(capsys, "--cache-dir", str(tmp_path / "missing"))
    assert code == 66 and "no cache at" in err
    (tmp_path / "plain").mkdir()
    code, _, err = status(capsys, "--cache-dir", str(tmp_path / "plain"))
    assert code == 66 and "not a cachefeed cache" in err


def test_bad_config_exits_78(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = status(capsys, "--config", str(tmp_path / "missing.toml"))
    assert code == 78 and "no such config file" in err


def test_hostile_strings_cannot_reach_the_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = make_cache(tmp_path / "cache")
    document = make_document(layout.root)
    document["samplers"][1]["last_error"] = "not found: evil\x1b[2J\x1b]0;pwned\x07key\nFAKE LINE " + "x" * 500
    document["remote"]["url"] = "s3://b/\x1b[31mred"
    document["cache"]["snapshots"][0]["id"] = "e\u202ex"
    write_status(layout, document)
    code, out, _ = status(capsys, "--cache-dir", str(layout.root))
    assert code == 0
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "\nFAKE LINE" not in out
    assert max(len(line) for line in out.splitlines()) <= WIDTH


def test_many_samplers_and_snapshots_stay_compact(tmp_path: Path) -> None:
    layout = make_cache(tmp_path / "cache")
    document = make_document(layout.root)
    sampler = document["samplers"][0]
    document["samplers"] = [{**copy.deepcopy(sampler), "index": i} for i in range(32)]
    document["samplers"][7]["state"] = "restarting"
    snap = document["cache"]["snapshots"][0]
    document["cache"]["snapshots"] = [{**snap, "id": f"run-e{i}"} for i in range(20)]
    write_status(layout, document)
    out = render_human(read_report(layout.root))
    assert len(out.splitlines()) < 40
    assert "31 of 32 running" in out and "#7 restarting" in out and "#8 " not in out
    assert "... and 12 more" in out


@contextlib.contextmanager
def watching(*argv: str, limit_s: float = 30) -> Iterator[subprocess.Popen[str]]:
    """``cachefeed status --watch`` as a subprocess; killed after ``limit_s`` so a blocked readline ends (EOF)."""
    process = subprocess.Popen(
        [*STATUS_CMD, *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    killer = threading.Timer(limit_s, process.kill)
    killer.start()
    try:
        yield process
    finally:
        killer.cancel()
        process.kill()
        process.wait()
        for pipe in (process.stdout, process.stderr):  # a failed test leaves no open pipe for a later test's GC
            if pipe is not None:
                pipe.close()


def signal_state(pid: int) -> str:
    """What the kernel says about a process that did not exit on Ctrl-C: its state, where it sleeps, and which
    signals it blocks, ignores and catches (hex masks; SIGINT is bit 1, 0x2). A failure message, read once."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as exc:
        return f"pid {pid}: {exc}"
    kept = [
        " ".join(line.split())
        for line in lines
        if line.startswith(("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
    ]
    return f"pid {pid}: " + "; ".join(kept) + f"; wchan {wchan}"


def interrupt(process: subprocess.Popen[str]) -> str:
    """Ctrl-C; returns stderr. The process must exit by itself."""
    process.send_signal(signal.SIGINT)
    try:
        _, err = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"no exit 20 s after SIGINT: {signal_state(process.pid)}")
    return err


def test_watch_refreshes_until_ctrl_c(tmp_path: Path) -> None:
    layout = make_cache(tmp_path / "cache")
    write_status(layout, make_document(layout.root, state="starting"))
    with watching("--cache-dir", str(layout.root), "--watch", "0.1", "--json") as process:
        assert process.stdout is not None
        assert json.loads(process.stdout.readline())["state"] == "starting"  # one JSON document per line
        write_status(layout, make_document(layout.root, state="running"))
        deadline = time.monotonic() + 20
        while json.loads(process.stdout.readline())["state"] != "running":
            assert time.monotonic() < deadline
        err = interrupt(process)
    assert process.returncode == 0, err
    assert "Traceback" not in err


def test_watch_human_frames_and_a_missing_cache(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    with watching("--cache-dir", str(root), "--watch", "0.1") as process:
        assert process.stdout is not None
        assert "no cache at" in process.stdout.readline()  # not there yet: watching goes on
        layout = make_cache(root)
        write_status(layout, make_document(root))
        deadline = time.monotonic() + 20
        while "health    RUNNING" not in process.stdout.readline():
            assert time.monotonic() < deadline
        err = interrupt(process)
    assert process.returncode == 0 and "Traceback" not in err


def test_watch_on_a_terminal_redraws_in_place(tmp_path: Path) -> None:
    layout = make_cache(tmp_path / "cache")
    write_status(layout, make_document(layout.root))
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [*STATUS_CMD, "--cache-dir", str(layout.root), "--watch", "0.1"],
        cwd=REPO,
        stdout=terminal,
        stderr=subprocess.DEVNULL,
    )
    os.close(terminal)
    seen = b""
    try:
        deadline = time.monotonic() + 20
        while seen.count(b"\x1b[H\x1b[2J") < 3:  # home + clear before each frame
            assert time.monotonic() < deadline, seen[-500:]
            if select.select([controller], [], [], 0.1)[0]:
                seen += os.read(controller, 65536)
        process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 20
        while process.poll() is None:  # keep reading: a full terminal would hold the exit's last flush
            assert time.monotonic() < deadline, f"no exit 20 s after SIGINT: {signal_state(process.pid)}"
            if select.select([controller], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):  # EIO once the child closed its end
                    os.read(controller, 65536)
        assert process.returncode == 0
    finally:
        process.kill()
        process.wait()
        os.close(controller)
    frame = seen.split(b"\x1b[H\x1b[2J")[1].decode()
    assert "health    RUNNING" in frame and len(frame.splitlines()) < 30


def test_render_says_a_small_cache_is_full_below_max_bytes(tmp_path: Path) -> None:
    """The audit: a 3 MiB cache said "fill 1.9 MiB of 3.0 MiB (65%)" while ``cache.fill`` (against what the daemon
    fills to: max_bytes less its metadata reserve) said 1.0, and it fetched no more."""
    layout = make_cache(tmp_path / "cache")
    write_status(layout, make_document(layout.root, cache__bytes=2_039_808, cache__max_bytes=3 << 20, cache__fill=1.0))
    out = " ".join(render_human(read_report(layout.root)).split())
    assert "1.9 MiB of 3.0 MiB (65%: full, the rest is kept for metadata)" in out, out
    write_status(layout, make_document(layout.root))
    assert "(75%)," in " ".join(render_human(read_report(layout.root)).split())


def test_render_shows_backpressure_and_low_free_space(tmp_path: Path) -> None:
    layout = make_cache(tmp_path / "cache")
    document = make_document(layout.root, cache__is_backpressured=True, cache__free_bytes=1 << 20)
    document["evicted"].update(segments_total=0, turnover_s=None)
    document["remote"]["last_listed_at"] = None
    write_status(layout, document)
    out = " ".join(render_human(read_report(layout.root)).split())
    assert "BACK-PRESSURE" in out
    assert "BELOW THE FLOOR" in out
    assert "nothing evicted yet" in out
    assert "not listed yet" in out


def test_render_shows_the_echo_factor_and_what_bounds_ingest(tmp_path: Path) -> None:
    layout = make_cache(tmp_path / "cache")
    write_status(layout, make_document(layout.root))
    out = " ".join(render_human(read_report(layout.root)).split())
    assert "(2.90 lately, up to 4)" in out and "remote-bound" in out
    document = make_document(layout.root, cache__ingest_bound="trainer", cache__is_remote_bound=False)
    write_status(layout, document)
    assert "trainer-bound" in " ".join(render_human(read_report(layout.root)).split())
    for key in ("echo_factor", "ingest_bound", "is_remote_bound"):  # a document from before them
        del document["cache"][key]
    write_status(layout, document)
    out = " ".join(render_human(read_report(layout.root)).split())
    assert "-bound" not in out and "health RUNNING" in out


def test_a_gone_daemon_is_not_called_remote_bound(tmp_path: Path) -> None:
    """What bounded ingest is the running daemon's news: once the daemon is gone, nothing ingests."""
    layout = make_cache(tmp_path / "cache")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    write_status(layout, make_document(layout.root, pid=child.pid))
    out = " ".join(render_human(read_report(layout.root)).split())
    assert "gone (pid" in out and "-bound" not in out


def test_failed_requests_are_on_the_requests_line_not_an_errors_line_of_their_own(tmp_path: Path) -> None:
    """ "errors 0" beside quarantined objects read as "nothing went wrong": failed requests are a figure of the
    requests line, and objects left out have lines of their own."""
    layout = make_cache(tmp_path / "cache")
    document = make_document(layout.root)
    document["remote"].update(errors_total=3, errors_by_kind={"timeout": 2, "http_5xx": 1})
    write_status(layout, document)
    lines = render_human(read_report(layout.root)).splitlines()
    requests = [line for line in lines if line.strip().startswith("requests")]
    assert len(requests) == 1 and "3 failed (http_5xx 1, timeout 2)" in requests[0], requests
    assert not [line for line in lines if line.strip().startswith("errors")], lines


def test_a_usage_error_has_its_own_exit_status_apart_from_degraded(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["status"])  # neither --cache-dir nor --config
    assert exited.value.code == 64 != int(Health.DEGRADED)
    assert "one of the arguments --config --cache-dir is required" in capsys.readouterr().err


def test_watch_ctrl_c_exits_with_the_last_verdict(tmp_path: Path) -> None:
    layout = make_cache(tmp_path / "cache")
    write_status(layout, make_document(layout.root, state="stopped"))
    with watching("--cache-dir", str(layout.root), "--watch", "0.1", "--json") as process:
        assert process.stdout is not None
        assert json.loads(process.stdout.readline())["health"]["status"] == "not_running"
        err = interrupt(process)
    assert process.returncode == int(Health.NOT_RUNNING), err
    assert "Traceback" not in err


def closed_pipe_run(*argv: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    """``cachefeed status ARGV`` whose stdout is a pipe nobody reads any more (``| head -c 400`` after its 400
    bytes): the read end is closed before the command writes, so every write fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [*STATUS_CMD, *argv], cwd=REPO, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=timeout_s
        )
    finally:
        os.close(write_end)


def test_a_reader_that_goes_away_ends_status_quietly(tmp_path: Path) -> None:
    layout = make_cache(tmp_path / "cache")
    write_status(layout, make_document(layout.root, state="stopped"))  # a verdict that no heartbeat age changes
    for argv in (("--json",), (), ("--json", "--watch", "0.1")):
        finished = closed_pipe_run("--cache-dir", str(layout.root), *argv)
        assert finished.stderr == "", (argv, finished.stderr)  # no BrokenPipeError traceback, nothing at all
        assert finished.returncode == int(Health.NOT_RUNNING), argv


def test_json_piped_into_head_prints_no_traceback(tmp_path: Path) -> None:
    layout = make_cache(tmp_path / "cache")
    snapshot = make_document(layout.root)["cache"]["snapshots"][0]
    many = [{**snapshot, "id": f"run1-e{index}"} for index in range(2000)]  # more than a pipe holds: head exits first
    write_status(layout, make_document(layout.root, cache__snapshots=many))
    command = shlex.join([*STATUS_CMD, "--cache-dir", str(layout.root), "--json"]) + " | head -c 400"
    finished = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert len(finished.stdout) == 400 and finished.stdout.startswith("{")
    assert "Traceback" not in finished.stderr and "BrokenPipe" not in finished.stderr
