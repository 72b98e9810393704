"""`cachefeed demo` end to end at a reduced size: per-epoch lines, status at the end, exit 0, nothing left over."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EPOCH_LINE = re.compile(
    r"^\s*(?P<epoch>\d+)\s+(?P<cached>\d+)\s+(?P<new>\d+)\s+(?P<evicted>\d+)\s+(?P<handover>-|[\d.]+ ms)\s+"
    r"(?P<rate>\d+)\s+(?P<loss>[\d.]+)$"
)


def run_demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
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
        (["--epochs", "0"], "--epochs = 0"),
        (["--budget", "3"], "--budget = 3.0"),
        (["--storage-option", "novalue"], "KEY=VALUE"),
        (["--workers", "-1"], "--workers = -1: expected an integer >= 0"),
        (["--decode", "npyy"], "--decode = 'npyy': expected one of npy, npz"),
        (["--decode", "no_such_module:fn"], "--decode = 'no_such_module:fn': cannot import 'no_such_module'"),
        (["--max-bytes", "5XB"], "--max-bytes = '5XB': unknown unit 'XB'"),
    ],
)
def test_demo_rejects_bad_options_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_demo(tmp_path, *args)
    assert result.returncode == 78
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
