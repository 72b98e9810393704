"""SIGHUP after editing the config file: the daemon says which settings changed and that they need a restart.

SIGHUP lists the remote at once; it applies no setting. A real daemon (``file://`` remote) is sent SIGHUP after its
config file was edited: its log has one line naming the changed keys and saying they take effect only after a
restart, while the daemon runs on as it started (its status document still shows the old budget). A file that no
longer parses is reported the same way, and the daemon keeps running; an unchanged file adds no such line.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from cachefeed._config import toml_text
from cachefeed._testing.daemon import DaemonProcess, start_daemon, wait_while_running
from cachefeed._testing.samples import npy_bytes

EDITED = " was edited: "  # the line an edit of the config file gives on SIGHUP


def config_text(remote: Path, cache_dir: Path, *, max_bytes: str, concurrency: int) -> str:
    document: dict[str, Any] = {
        "remote": {"url": remote.as_uri(), "refresh_interval": "10s"},
        "cache": {"dir": str(cache_dir), "max_bytes": max_bytes, "min_free_bytes": 0, "segment_bytes": "256KiB",
                  "fsync": False},
        "sampler": {"processes": 1, "concurrency": concurrency},
        "status": {"interval": "100ms"},
    }  # fmt: skip
    return toml_text(document)


def lines_with(daemon: DaemonProcess, text: str) -> list[str]:
    return [line for line in daemon.stderr().splitlines() if text in line]


def hup_and_wait(daemon: DaemonProcess) -> None:
    """SIGHUP, then wait until the daemon has handled it (its "listing the remote now" line)."""
    handled = len(lines_with(daemon, "SIGHUP: listing the remote now"))
    daemon.signal(signal.SIGHUP)
    wait_while_running(
        daemon,
        lambda: len(lines_with(daemon, "SIGHUP: listing the remote now")) > handled,
        timeout_s=20,
        what="the SIGHUP handled",
    )


def test_sighup_names_the_edited_settings_that_need_a_restart_and_survives_a_broken_file(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    for index in range(8):
        (remote / f"{index:03d}.npy").write_bytes(npy_bytes(np.full(64, index, dtype=np.float32)))
    cache_dir = tmp_path / "cache"
    config = tmp_path / "cachefeed.toml"
    started_with = config_text(remote, cache_dir, max_bytes="64MiB", concurrency=4)
    config.write_text(started_with)
    daemon = start_daemon(config, cache_dir, tmp_path / "daemon.stderr")
    try:
        daemon.wait_status(lambda d: d["state"] == "running", timeout_s=30, what="running")

        config.write_text("# edited\n" + config_text(remote, cache_dir, max_bytes="128MiB", concurrency=8))
        hup_and_wait(daemon)
        [line] = lines_with(daemon, EDITED)
        assert f"SIGHUP: the config file {config} was edited: cache.max_bytes, " in line, line
        assert "sampler.concurrency changed" in line and "take effect only after a restart" in line, line
        status = daemon.wait_status(lambda d: d["updated_at"] > time.time() - 1, timeout_s=10, what="a fresh status")
        assert status["cache"]["max_bytes"] == 64 << 20, "the daemon runs on the budget it started with"

        config.write_text("[cache\nmax_bytes = 1\n")
        hup_and_wait(daemon)
        [broken] = lines_with(daemon, "SIGHUP: the config file no longer loads")
        assert f"{config}: not valid TOML" in broken and "a restart would fail (exit 78)" in broken, broken
        after = time.time()
        status = daemon.wait_status(lambda d: d["updated_at"] > after, timeout_s=10, what="a status after it")
        assert status["state"] == "running" and daemon.process.poll() is None, "the daemon runs on"

        config.write_text(started_with)
        hup_and_wait(daemon)
        assert len(lines_with(daemon, EDITED)) == 1, "the file it started with again: nothing to restart for"
        assert "Traceback" not in daemon.stderr()
    finally:
        assert daemon.stop() == 0, daemon.stderr()[-4000:]
