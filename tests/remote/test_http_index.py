"""A remote whose listing gives no sizes: an HTTP server's directory index page (fsspec's ``http://``), as a plain
``python -m http.server`` serves it. The listing said size 0 for each object, and every fetch was then refused as a
short body ("4224 of 0 bytes"): nothing was cached, while status said running. Unknown sizes are now unknown (-1, as
a manifest without sizes): the bodies are taken as they come."""

from __future__ import annotations

import io
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from cachefeed._config import toml_text
from cachefeed._testing.daemon import start_daemon
from cachefeed._testing.local_s3 import free_port
from cachefeed._trainer import EpochLoaderFactory

OBJECTS = 12


def test_a_daemon_caches_every_object_of_an_http_directory_index(tmp_path: Path) -> None:
    served = tmp_path / "www"
    served.mkdir()
    for i in range(OBJECTS):
        buffer = io.BytesIO()
        np.save(buffer, np.full(1000 + i, i, np.int32))
        (served / f"{i:03d}.npy").write_bytes(buffer.getvalue())
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "-b", "127.0.0.1", "-d", str(served), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the HTTP server did not start"
                time.sleep(0.05)
        cache_dir = tmp_path / "cache"
        config = tmp_path / "http.toml"
        config.write_text(
            toml_text(
                {
                    "remote": {"url": f"http://127.0.0.1:{port}/", "pattern": "*.npy", "refresh_interval": "1h"},
                    "cache": {"dir": str(cache_dir), "max_bytes": "64MiB", "segment_bytes": "64KiB", "fsync": False},
                    "sampler": {"processes": 1, "concurrency": 4, "decode": "npy"},
                    "status": {"interval": "200ms"},
                }
            )
        )
        daemon = start_daemon(config, cache_dir, tmp_path / "daemon.err")
        try:
            daemon.wait_status(
                lambda d: d["cache"]["samples"] == OBJECTS, timeout_s=60, what="every object of the index cached"
            )
            with EpochLoaderFactory(cache_dir, batch_size=1, run_id="http", progress=None) as factory:
                arrays = {int(batch["data"][0][0]): batch["data"][0] for batch in factory.loader(0)}
        finally:
            daemon.stop()
    finally:
        server.terminate()
        server.wait()
    assert sorted(arrays) == list(range(OBJECTS))
    for i, array in arrays.items():
        assert len(array) == 1000 + i and bool((array == i).all()), "each body whole, as the server sent it"
