"""``cachefeed status --watch`` waits only for a cache that may still appear: a path that does not exist yet (the
daemon creates it), or a directory a starting daemon is making into one. A path that can never become a cache (a
file, a directory of other things, a path below a file) exits 66 at once with one line, as without ``--watch``."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.child_env import child_env
from tests.support.cli import CLI, one_line, run_cli


def dataset_dir(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "000.npy").write_bytes(b"x")
    return tmp_path / "data", "{path} is not a cachefeed cache (no CACHEDIR.TAG or segments/)"


def regular_file(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "cache").write_text("")
    return tmp_path / "cache", "{path} is not a directory"


def below_a_file(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "data.npy").write_bytes(b"x")
    return tmp_path / "data.npy" / "cache", "no cache at {path}: " + f"{tmp_path}/data.npy is a file, not a directory"


@pytest.mark.parametrize("make", [dataset_dir, regular_file, below_a_file])
@pytest.mark.parametrize("as_json", [False, True])
def test_watch_exits_66_at_once_on_a_path_that_cannot_become_a_cache(
    tmp_path: Path, make: Callable[[Path], tuple[Path, str]], as_json: bool
) -> None:
    path, message = make(tmp_path)
    result = run_cli(
        "status", "--cache-dir", str(path), "--watch", "0.1", *(["--json"] if as_json else []), timeout_s=20
    )
    assert result.returncode == 66
    assert one_line(result.stderr) == "cachefeed status: " + message.format(path=path)
    if as_json:  # a script reads JSON whatever the command can answer: one frame saying so
        frame = json.loads(result.stdout)
        assert frame["health"]["exit_status"] == 66 and frame["error"] == message.format(path=path)
    else:
        assert result.stdout == ""


def test_without_watch_a_path_below_a_file_is_one_line_too(tmp_path: Path) -> None:
    path, message = below_a_file(tmp_path)
    result = run_cli("status", "--cache-dir", str(path), timeout_s=20)
    assert result.returncode == 66
    assert one_line(result.stderr) == "cachefeed status: " + message.format(path=path)


def test_watch_keeps_waiting_while_the_cache_does_not_exist_or_is_being_made(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    process = subprocess.Popen(
        [*CLI, "status", "--cache-dir", str(root), "--watch", "0.1", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    killer = threading.Timer(20, process.kill)  # a blocked readline ends (EOF) if the test goes wrong
    killer.start()
    try:
        stdout = process.stdout
        assert stdout is not None

        def frames_until(text: str) -> None:
            deadline = time.monotonic() + 10
            while text not in stdout.readline():
                assert time.monotonic() < deadline and process.poll() is None

        frames_until(f'"error": "no cache at {root}: start the daemon')
        root.mkdir()  # what a starting daemon does first (CacheLayout.create), CACHEDIR.TAG last
        (root / "segments").mkdir()
        frames_until(f'"error": "{root} is not a cachefeed cache')
        frames_until(f'"error": "{root} is not a cachefeed cache')  # still watching
        assert process.poll() is None
    finally:
        killer.cancel()
        process.kill()
        process.wait()
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
