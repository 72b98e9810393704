"""`cachefeed demo` end to end at a reduced size: per-epoch lines, status at the end, exit 0, nothing left over."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.child_env import child_env
from tests.support.cli import one_line

EPOCH_LINE = re.compile(
    r"^\s*(?P<epoch>\d+)\s+(?P<cached>\d+)\s+(?P<new>\d+)\s+(?P<evicted>\d+)\s+(?P<handover>-|[\d.]+ ms)\s+"
    r"(?P<rate>\d+)\s+(?P<loss>[\d.]+)$"
)


def run_demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = child_env(TMPDIR=str(tmp_path))
    return subprocess.run(
        [sys.executable, "-m", "cachefeed", "demo", "--objects", "600", "--epochs", "3", "--workers", "1", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


def test_demo_trains_over_a_rolling_cache_and_cleans_up(tmp_path: Path) -> None:
    result = run_demo(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    epochs = [m.groupdict() for m in map(EPOCH_LINE.match, result.stdout.splitlines()) if m]
    assert [int(e["epoch"]) for e in epochs] == [0, 1, 2], result.stdout
    assert all(int(e["cached"]) > 0 for e in epochs)
    assert int(epochs[0]["new"]) == int(epochs[0]["cached"]), "everything is new in the first epoch"
    assert epochs[0]["handover"] == "-" and all(e["handover"].endswith("ms") for e in epochs[1:])
    assert "health    RUNNING" in result.stdout or "health" in result.stdout
    seen = re.search(r"^epochs\s+(\d+) epochs? read", result.stdout, re.M)
    assert seen and int(seen.group(1)) >= 1, "the daemon counted the epochs that read its cache"
    assert "uploading" in result.stderr and "starting the cache daemon" in result.stderr, "progress is shown"
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("cachefeed-demo-*")), "the demo removes everything it created"


def test_demo_on_a_local_folder_of_images_decodes_and_labels_them_without_an_s3_server(tmp_path: Path) -> None:
    result = run_demo(tmp_path, "--images", "--local-dir", str(tmp_path / "images"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "moto" not in result.stderr, "a local directory as the remote needs no S3 server"
    assert "classes (from the whole listing): circle, cross, square, stripes" in result.stdout
    epochs = [m.groupdict() for m in map(EPOCH_LINE.match, result.stdout.splitlines()) if m]
    assert [int(e["epoch"]) for e in epochs] == [0, 1, 2], result.stdout
    assert float(epochs[-1]["loss"]) < float(epochs[0]["loss"]), "the labels match the pixels: the model learns"
    assert re.search(r"samples of 3\.\d KiB", result.stdout), "status shows the decoded pixels' cost per sample"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--epochs", "0"], "--epochs = 0: expected an integer >= 1"),
        (["--objects", "0"], "--objects = 0: expected an integer >= 1"),
        (["--budget", "5"], "--budget = 5.0: expected a fraction between 0.05 and 1"),
        (["--storage-option", "novalue"], "--storage-option 'novalue': expected KEY=VALUE"),
        (["--workers", "-1"], "--workers = -1: expected an integer >= 0"),
        (["--decode", "npyy"], "--decode = 'npyy': expected one of npy, npz"),
        (["--decode", "no_such_module:fn"], "--decode = 'no_such_module:fn': cannot import 'no_such_module'"),
        (["--max-bytes", "5XB"], "--max-bytes = '5XB': unknown unit 'XB'"),
        (["--max-bytes", "10gb"], "--max-bytes = '10gb': unknown unit 'gb' (did you mean 10GB?)"),
        (["--remote", "foo://bucket/x"], "--remote = 'foo://bucket/x': Protocol not known: foo"),
    ],
)
def test_demo_rejects_bad_options_in_one_line_as_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    """A value on the command line is a usage error (64, as for every cachefeed command), not a bad config (78)."""
    result = run_demo(tmp_path, *args)
    assert result.returncode == 64
    assert one_line(result.stderr).startswith(f"cachefeed demo: {message}")
    assert not list(tmp_path.glob("cachefeed-demo-*")), "refused before anything is written"


def test_a_demo_stopped_by_sigterm_stops_its_daemon_and_removes_its_files(tmp_path: Path) -> None:
    """``timeout 60 cachefeed demo`` (SIGTERM) left the demo's daemon running in its own session, for good."""
    import os
    import signal
    import time

    from cachefeed._status.report import read_report

    cache_dir = tmp_path / "demo-cache"
    options = ["--objects", "400", "--epochs", "50", "--workers", "1", "--cache-dir", str(cache_dir)]
    demo = subprocess.Popen(
        [sys.executable, "-m", "cachefeed", "demo", "--images", "--local-dir", str(tmp_path / "images"), *options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(TMPDIR=str(tmp_path)),
    )
    try:
        deadline = time.monotonic() + 120
        while not (cache_dir / "status.json").exists():
            assert demo.poll() is None and time.monotonic() < deadline, "the demo's daemon did not start"
            time.sleep(0.2)
        pid = int(read_report(cache_dir).document["pid"])  # type: ignore[index]
        demo.send_signal(signal.SIGTERM)
        _, stderr = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    for _ in range(100):  # the daemon was stopped and reaped by the demo before it exited
        if not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}"), "the daemon outlived its demo"
    assert not list(tmp_path.glob("cachefeed-demo-*")), "the demo removed what it created"


def test_a_demo_remote_that_lists_nothing_is_a_usage_error_at_once(tmp_path: Path) -> None:
    """``--remote file:///missing`` (or a pattern matching nothing) waited 300 s for segments, then failed."""
    import time

    (tmp_path / "empty").mkdir()
    for remote in (tmp_path / "empty", tmp_path / "missing"):
        started = time.monotonic()
        result = run_demo(tmp_path, "--remote", remote.as_uri(), "--decode", "npy")
        assert result.returncode == 64, result.stderr[-2000:]
        assert f"--remote '{remote.as_uri()}' lists no objects matching --pattern '**'" in result.stderr
        assert "Traceback" not in result.stderr
        assert time.monotonic() - started < 60
    assert not list(tmp_path.glob("cachefeed-demo-*")), "the demo removed what it created"


def test_a_demo_remote_none_of_whose_objects_can_be_decoded_is_a_usage_error_naming_why(tmp_path: Path) -> None:
    """``--remote`` of .npy files with ``--decode npz`` (once the demo's default, unlike the daemon's) quarantined
    every object and waited minutes, its progress line pointing to a log the demo then removed."""
    import time

    from tests.support.file_remote import npy_remote

    remote = npy_remote(tmp_path / "npy", 8)
    started = time.monotonic()
    result = run_demo(tmp_path, "--remote", remote.as_uri(), "--decode", "npz")
    assert result.returncode == 64, result.stderr[-2000:]
    assert "none of the 8 objects --remote lists can be cached (decode: 8); the first: " in result.stderr
    assert "is --decode 'npz' right for them?" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 60
