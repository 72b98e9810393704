"""Starting the daemon: systemd notifications in order, a bad config (exit 78), a cache already in use (exit 75)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachefeed._cache.layout import CacheLayout
from cachefeed._testing.daemon import BUCKET, StartDaemon, daemon_argv, wait_for
from cachefeed._testing.samples import upload_arrays


class NotifyListener:
    """A fake service manager: a unix datagram socket collecting sd_notify messages with their arrival times."""

    def __init__(self, path: Path, cache_dir: Path) -> None:
        self.path = path
        self.cache_dir = cache_dir
        self.messages: list[tuple[float, str]] = []
        self.tmp_at_ready: list[str] | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            for line in data.decode().splitlines():
                if line == "READY=1":
                    tmp = os.listdir(self.cache_dir / "tmp")  # partial segments (not what samplers are writing)
                    self.tmp_at_ready = sorted(name for name in tmp if name.endswith(".tmp"))
                self.messages.append((time.monotonic(), line))

    def lines(self, prefix: str) -> list[str]:
        return [line for _, line in list(self.messages) if line.startswith(prefix)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()


@pytest.fixture
def notify_listener(tmp_path: Path) -> Iterator[NotifyListener]:
    listener = NotifyListener(tmp_path / "notify.sock", tmp_path / "cache")
    yield listener
    listener.close()


def test_systemd_notify_protocol(bucket: Any, daemon: StartDaemon, notify_listener: NotifyListener) -> None:
    upload_arrays(bucket, BUCKET, 20, 1024)
    tmp = notify_listener.cache_dir / "tmp"
    tmp.mkdir(parents=True)
    (tmp / "0000000000000007.tmp").write_bytes(b"left by a crash")  # recovery must remove it before READY
    env = {**os.environ, "NOTIFY_SOCKET": str(notify_listener.path), "WATCHDOG_USEC": "200000"}
    proc = daemon(env=env)
    wait_for(lambda: notify_listener.lines("READY=1"), timeout_s=20, what="READY=1")
    assert notify_listener.tmp_at_ready == []
    wait_for(lambda: len(notify_listener.lines("WATCHDOG=1")) >= 5, timeout_s=10, what="watchdog pings")
    wait_for(lambda: notify_listener.lines("STATUS="), timeout_s=10, what="a STATUS line")
    proc.signal(signal.SIGTERM)
    assert proc.process.wait(timeout=10) == 0
    assert notify_listener.lines("STOPPING=1")
    order = [line.split("=")[0] for _, line in notify_listener.messages]
    assert order.index("READY") < order.index("STOPPING")
    assert order.index("READY") < order.index("WATCHDOG")
    assert "MAINPID" not in order
    assert "NOTIFY_SOCKET" not in proc.stderr()


def test_bad_config_exits_78_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[remote]\nurl = "s3://data/"\n[cache]\ndir = "/tmp/x"\nmax_bytes = "-5GiB"\n')
    result = subprocess.run(daemon_argv(config), capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 78
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "cache.max_bytes" in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("key", ["decode", "preprocess"])
def test_a_callable_that_cannot_be_loaded_is_named_with_its_file_and_key(tmp_path: Path, key: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(
        f'[remote]\nurl = "file://{tmp_path}"\n[cache]\ndir = "{tmp_path / "c"}"\nmax_bytes = "64MiB"\n'
        f'segment_bytes = "1MiB"\n[sampler]\n{key} = "no.such.module:fn"\n'
    )
    result = subprocess.run(daemon_argv(config), capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 78
    [line] = result.stderr.strip().splitlines()
    assert f"{config}: sampler.{key} = 'no.such.module:fn': cannot import 'no.such.module'" in line


def test_a_source_decoder_that_cannot_be_loaded_is_named_with_its_table(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(
        f'[cache]\ndir = "{tmp_path / "c"}"\nmax_bytes = "64MiB"\nsegment_bytes = "1MiB"\n'
        f'[[source]]\nname = "a"\nurl = "file://{tmp_path}"\n'
        f'[[source]]\nname = "b"\nurl = "file://{tmp_path}"\ndecode = "no.such.module:fn"\n'
    )
    result = subprocess.run(daemon_argv(config), capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 78
    [line] = result.stderr.strip().splitlines()
    assert f"{config}: source[1].decode = 'no.such.module:fn': cannot import 'no.such.module'" in line


@pytest.mark.parametrize("named", [False, True])
def test_a_url_of_an_unknown_protocol_is_named_with_its_file_and_key(tmp_path: Path, named: bool) -> None:
    config = tmp_path / "bad.toml"
    data = '[[source]]\nname = "a"\nurl = "nosuch://b/x"\n' if named else '[remote]\nurl = "nosuch://b/x"\n'
    config.write_text(f'[cache]\ndir = "{tmp_path / "c"}"\nmax_bytes = "64MiB"\nsegment_bytes = "1MiB"\n{data}')
    result = subprocess.run(daemon_argv(config), capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 78
    [line] = result.stderr.strip().splitlines()
    key = "source[0].url" if named else "remote.url"
    assert f"{config}: {key} = 'nosuch://b/x': Protocol not known: nosuch" in line


def refused_cache_dir(tmp_path: Path, cache_dir: Path) -> str:
    """Start a daemon on ``cache_dir`` (a file:// remote): it must exit 73 (the unit's RestartPreventExitStatus:
    systemd does not restart it into the same refusal) with one line and no traceback; that line."""
    config = tmp_path / "bad.toml"
    config.write_text(
        f'[remote]\nurl = "file://{tmp_path}"\n[cache]\ndir = "{cache_dir}"\nmax_bytes = "64MiB"\n'
        'segment_bytes = "1MiB"\nmin_free_bytes = 0\n'
    )
    result = subprocess.run(daemon_argv(config), capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 73, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr.strip().splitlines()[-1]  # after the log's "starting" line


def test_a_cache_dir_that_cannot_be_created_exits_73_with_the_path_and_cause(tmp_path: Path) -> None:
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a directory")
    line = refused_cache_dir(tmp_path, in_the_way / "cache")
    assert f"cache.dir {in_the_way / 'cache'}: cannot create or write" in line
    assert "Not a directory" in line


@pytest.mark.parametrize("what", ["file", "symlink"])
def test_a_file_or_a_symlink_at_cache_dir_exits_73_saying_which_and_what_to_do(tmp_path: Path, what: str) -> None:
    target = tmp_path / "real-cache"
    target.mkdir()
    at = tmp_path / "cache"
    if what == "file":
        at.write_text("not a directory")
    else:
        at.symlink_to(target)
    line = refused_cache_dir(tmp_path, at)
    if what == "file":
        assert f"cache.dir {at} is a file: move it away or choose another cache.dir" in line
    else:
        assert f"cache.dir {at} is a symbolic link, which cachefeed does not follow" in line
    assert list(target.iterdir()) == [], "nothing was written through the link"


def test_a_cache_dir_that_holds_other_files_is_refused_with_exit_73_and_they_stay(tmp_path: Path) -> None:
    """``cache.dir`` pointed at the user's own directory (a dataset's root): it was accepted, its files charged to
    the budget and shown as data "pinned" by epochs that did not exist, and nothing was ever fetched. Now a
    directory that holds anything but the cache's own names is refused, naming what is there, which stays
    untouched (a small one too: ``tests/daemon/test_cache_dir_of_its_own.py``). A mount root's ``lost+found`` and
    quota files are the filesystem's: the daemon takes such a directory."""
    mine = tmp_path / "my-dataset"
    (mine / "images").mkdir(parents=True)
    for name in ("train.csv", "notes.txt", "README"):
        (mine / name).write_text("mine")
    line = refused_cache_dir(tmp_path, mine)
    assert f"cache.dir {mine}: holds files that are not a cachefeed cache (README, images/, notes.txt and more)" in line
    assert sorted(p.name for p in mine.iterdir()) == ["README", "images", "notes.txt", "train.csv"], "untouched"
    big = tmp_path / "big"
    big.mkdir()
    (big / "weights.bin").write_bytes(bytes(2 << 20))
    assert "holds files that are not a cachefeed cache (weights.bin)" in refused_cache_dir(tmp_path, big)
    mount_root = tmp_path / "ssd"
    (mount_root / "lost+found").mkdir(parents=True)
    (mount_root / "aquota.user").write_bytes(bytes(8 << 10))
    CacheLayout(mount_root).create()
    assert (mount_root / "CACHEDIR.TAG").is_file(), "a mount root's own files share the directory"


def test_second_daemon_on_the_same_cache_exits_75_naming_the_first(bucket: Any, daemon: StartDaemon) -> None:
    first = daemon()
    first.wait_status(lambda d: d["state"] == "running", timeout_s=20, what="first daemon ready")
    second = daemon()
    assert second.process.wait(timeout=20) == 75
    err = second.stderr()
    assert f"pid {first.pid}" in err
    assert "Traceback" not in err
    assert first.process.poll() is None
    assert first.stop() == 0


def test_an_existing_cache_dir_keeps_its_mode_and_one_the_daemon_cannot_write_is_refused(tmp_path: Path) -> None:
    from cachefeed._testing.daemon import start_daemon

    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "one.npy").write_bytes(b"x" * 64)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    os.chmod(cache_dir, 0o555)  # the user's directory, read-only to everyone but root
    config = tmp_path / "d.toml"
    config.write_text(
        f'[remote]\nurl = "{remote.as_uri()}"\n[cache]\ndir = "{cache_dir}"\nmax_bytes = "64MiB"\n'
        'segment_bytes = "1MiB"\nmin_free_bytes = 0\ndir_mode = "0750"\n[status]\ninterval = "200ms"\n'
    )
    if os.geteuid() == 0:  # root may write it: the daemon runs, and leaves the mode as it found it
        proc = start_daemon(config, cache_dir, tmp_path / "d.stderr")
        try:
            proc.wait_status(lambda d: d["state"] in ("running", "degraded"), timeout_s=30, what="ready")
            assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o555
            assert stat.S_IMODE(os.stat(cache_dir / "segments").st_mode) == 0o750  # its own directories
        finally:
            assert proc.stop() == 0
    else:  # the daemon's user cannot: one line saying so, exit 73, nothing changed
        result = subprocess.run(daemon_argv(config), capture_output=True, text=True, timeout=30, check=False)
        assert result.returncode == 73, result.stderr
        [line] = result.stderr.strip().splitlines()
        assert f"cache.dir {cache_dir}: exists with mode 0555" in line and "never changes the mode" in line, line
    assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o555


def test_the_daemon_starts_without_the_cyclic_gc_and_freezes_what_it_loaded() -> None:
    """NOTE [ A daemon's start without the cyclic GC ]: collections are paused inside the block and the collector is
    back (in the state it was) after it, raise or not; what existed then is frozen."""
    import gc

    from cachefeed._cli.daemon import start_without_gc

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with start_without_gc():
            assert not gc.isenabled()
            kept = [[object()] for _ in range(100)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(kept)
        with pytest.raises(RuntimeError), start_without_gc():
            raise RuntimeError("a start that fails")
        assert gc.isenabled()
        gc.disable()
        with start_without_gc():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()
        gc.unfreeze()


def test_a_daemon_loads_its_modules_inside_its_start_and_freezes_them(bucket: Any, daemon: StartDaemon) -> None:
    """Nothing heavy is imported before the daemon's start pauses the GC (the CLI's parser and ``import cachefeed``
    load no numpy, config or remote client), nothing the start does not need is imported in it (the Prometheus
    client, with metrics off), and a real daemon's start ends with everything it loaded frozen."""
    code = (
        "import sys, cachefeed, cachefeed._cli as cli; cli.build_parser(['daemon']);"
        "print(sorted(m for m in ('numpy', 'fsspec', 's3fs', 'cachefeed._config', 'cachefeed._daemon.supervisor')"
        " if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
    code = "import sys, cachefeed._daemon.supervisor; print('prometheus_client' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "False"  # only a daemon with metrics configured loads it
    upload_arrays(bucket, BUCKET, 4, 1024)
    proc = daemon(sections={"log": {"level": "debug"}})
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 4, timeout_s=60, what="every object cached")
    line = next((line for line in proc.stderr().splitlines() if "objects of the start frozen" in line), None)
    assert line is not None, proc.stderr()[-2000:]
    frozen = int(line.split("; ")[1].split()[0])
    assert frozen > 50_000, line  # numpy, s3fs, botocore and cachefeed: well over this many objects
    assert proc.stop() == 0
