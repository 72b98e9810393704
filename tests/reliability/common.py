"""Shared pieces of the reliability suite.

* **Self-verifying remote objects.** An object's key carries its payload size (``sv-00042-16384.npy``) and its
  bytes are ``payload(path + version, size)`` (``cachefeed/_testing/samples.py``), where ``path`` is the remote path
  (``"bucket/key"``: the sample's ``__url__`` without ``s3://``; ``sample_path``). Any reader checks what it was
  served against the path alone: a wrong, spliced, truncated or misattributed sample is a violation.
* **One line of counts per scenario**: ``report("crash-loop", kills=20, verified=..., violations=0)`` prints
  ``[reliability] crash-loop: kills=20, verified=..., violations=0``; ``scripts/reliability.sh`` collects them.
* **Watchers**: the cache directory's real size and the filesystem's free space, sampled in a thread; a fake
  systemd notify socket; the live members of a process group (zombies excluded: PID 1 of a container may not
  reap orphans).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.records import SegmentReader
from cachefeed._errors import CorruptRecordError
from cachefeed._testing.daemon import wait_for
from cachefeed._testing.samples import npy_bytes, payload
from tests.support.cache_helpers import tree_bytes

REPORT_PREFIX = "[reliability]"
_SIZED = re.compile(r"-(\d+)\.npy$")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*://")


def report(scenario: str, **figures: Any) -> str:
    """Print (and return) the scenario's one line of counts."""
    line = f"{REPORT_PREFIX} {scenario}: " + ", ".join(f"{name}={_fmt(value)}" for name, value in figures.items())
    print("\n" + line, flush=True)
    return line


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


# ------------------------------------------------------------------------------------------ self-verifying data


def sv_key(index: int, nbytes: int, prefix: str = "") -> str:
    return f"{prefix}sv-{index:05d}-{nbytes}.npy"


def sv_body(path: str, nbytes: int, version: str = "") -> bytes:
    """The ``.npy`` bytes of the object whose remote path (``bucket/key``) is ``path``."""
    return npy_bytes(payload(path + version, nbytes))


def size_of(path: str) -> int:
    match = _SIZED.search(path)
    if match is None:
        raise ValueError(f"{path!r} is not a self-verifying key")
    return int(match.group(1))


def upload_sv(
    client: Any, bucket: str, count: int, nbytes: int, *, prefix: str = "", start: int = 0, version: str = ""
) -> list[str]:
    """Put ``count`` self-verifying objects; returns their remote paths (``bucket/key``), i.e. the sample keys."""
    paths = []
    for i in range(start, start + count):
        key = sv_key(i, nbytes, prefix)
        client.put_object(Bucket=bucket, Key=key, Body=sv_body(f"{bucket}/{key}", nbytes, version))
        paths.append(f"{bucket}/{key}")
    return paths


def sample_path(sample: dict[str, Any]) -> str | None:
    """The remote path a sample came from (``bucket/key``, or a local file's path: its ``__url__`` without the
    scheme); its ``__key__`` for a sample written straight into a cache (no ``__url__``)."""
    url = sample.get("__url__")
    if isinstance(url, str):
        return _SCHEME.sub("", url, count=1)
    key = sample.get("__key__")
    return key if isinstance(key, str) else None


def sample_version(sample: dict[str, Any], versions: Iterable[str] = ("",)) -> tuple[str | None, str | None]:
    """``(version, None)`` if ``sample`` holds exactly the bytes its key implies for one of ``versions``, else
    ``(None, why not)``."""
    key = sample_path(sample)
    if key is None:
        return None, f"no string __url__ or __key__ in {sorted(sample)}"
    try:
        nbytes = size_of(key)
    except ValueError:
        return None, f"unexpected key {key!r}"
    data = np.asarray(sample.get("data"))
    if data.shape != (nbytes,):
        return None, f"{key!r}: shape {data.shape}, expected ({nbytes},) (partial or wrong)"
    for version in versions:
        if np.array_equal(data, payload(key + version, nbytes)):
            return version, None
    return None, f"{key!r}: wrong content"


def sample_problem(sample: dict[str, Any], versions: Iterable[str] = ("",)) -> str | None:
    """None if ``sample`` holds exactly the bytes its key implies (for one of ``versions``), else why not."""
    return sample_version(sample, versions)[1]


# ------------------------------------------------------------------------------------------ reading the cache


@dataclass
class CacheCheck:
    """What a full read of ``segments/`` found. ``problems`` are violations (wrong/partial/unverifiable)."""

    segments: int = 0
    samples: int = 0
    keys: list[str] = field(default_factory=list)
    versions: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    corrupt_segments: list[str] = field(default_factory=list)

    @property
    def duplicates(self) -> int:
        return len(self.keys) - len(set(self.keys))


def check_cache(cache_dir: Path, versions: Iterable[str] = ("",), *, expect_intact: bool = True) -> CacheCheck:
    """Open every published segment, verify every record and every sample's content.

    With ``expect_intact`` a segment or record failing verification is a problem; without, it is only listed
    in ``corrupt_segments`` (for tests that corrupt segments on purpose: detection is what they check).
    """
    versions = tuple(versions)
    result = CacheCheck()
    for name, _info in CacheLayout(cache_dir).list_segments():  # regular files only, as every reader lists them
        path = cache_dir / "segments" / name
        try:
            reader = SegmentReader(path)
        except FileNotFoundError:
            continue  # evicted while we looked
        except CorruptRecordError as exc:
            (result.problems if expect_intact else result.corrupt_segments).append(f"{path.name}: {exc}")
            continue
        with reader:
            result.segments += 1
            for i in range(reader.count):
                try:
                    sample = reader.read(i)
                except CorruptRecordError as exc:
                    (result.problems if expect_intact else result.corrupt_segments).append(f"{path.name}: {exc}")
                    continue
                version, problem = sample_version(sample, versions)
                key = str(sample_path(sample))
                result.samples += 1
                result.keys.append(key)
                if problem is not None:
                    result.problems.append(f"{path.name}: {problem}")
                else:
                    result.versions.setdefault(key, []).append(str(version))
                del sample
    return result


def read_status(cache_dir: Path) -> dict[str, Any] | None:
    """The status document if ``status.json`` is a regular file holding JSON (a planted FIFO must not block us)."""
    path = cache_dir / "status.json"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as handle:
            document = json.loads(handle.read())
    except ValueError:
        return None
    finally:
        os.close(fd)
    return document if isinstance(document, dict) else None


# ------------------------------------------------------------------------------------------ watchers


class DiskWatch:
    """Samples the real allocated size of ``root`` (hard links once) and the filesystem's free bytes."""

    def __init__(self, root: Path, interval_s: float = 0.05) -> None:
        self.root = root
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.min_free_bytes: int | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.root.exists():
                self.peak_bytes = max(self.peak_bytes, tree_bytes(self.root))
                with contextlib.suppress(OSError):
                    stats = os.statvfs(self.root)
                    free = stats.f_bavail * stats.f_frsize
                    self.min_free_bytes = free if self.min_free_bytes is None else min(self.min_free_bytes, free)
                self.samples += 1
            self._stop.wait(self.interval_s)

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class NotifyListener:
    """A fake service manager: a unix datagram socket recording ``(monotonic time, line)`` of sd_notify messages."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[tuple[float, str]] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="notify-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            now = time.monotonic()
            self.messages.extend((now, line) for line in data.decode(errors="replace").splitlines())

    def first_after(self, line: str, since: float) -> float | None:
        """When ``line`` first arrived at or after ``since`` (monotonic), or None."""
        for at, text in list(self.messages):
            if at >= since and text == line:
                return at
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()


# ------------------------------------------------------------------------------------------ processes


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw[raw.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...


def is_alive(pid: int) -> bool:
    """True while any thread of ``pid`` runs. A zombie is dead, but a zombie *leader* may still have threads in
    their exit, and those still hold the process's open files (and so its ``flock`` locks)."""
    fields = _stat_fields(pid)
    if fields is None:
        return False
    if fields[0] not in ("Z", "X"):
        return True
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        if raw[raw.rfind(")") + 2 :].split()[:1] not in (["Z"], ["X"]):
            return True
    return False


def group_members(pgid: int) -> list[int]:
    """Live processes whose process group is ``pgid`` (see ``is_alive``: a process is gone with its last thread)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None and int(fields[2]) == pgid and is_alive(int(entry)):
            members.append(int(entry))
    return members


def wait_until(predicate: Any, *, timeout_s: float, interval_s: float = 0.02, what: str = "") -> Any:
    """``wait_for`` (the harness's poll), polling a little faster by default."""
    return wait_for(predicate, timeout_s=timeout_s, interval_s=interval_s, what=what)


def tree_listing(root: Path, *, skip: Iterable[Path] = ()) -> dict[str, tuple[int, int, int]]:
    """``relative path -> (mode, size, mtime_ns)`` of everything under ``root`` (symlinks not followed)."""
    skipped = [p.resolve() for p in skip]
    found: dict[str, tuple[int, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if (here / d).resolve() not in skipped]
        for name in dirnames + filenames:
            path = here / name
            with contextlib.suppress(FileNotFoundError):
                info = os.lstat(path)
                found[str(path.relative_to(root))] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return found


@contextlib.contextmanager
def timed() -> Iterator[list[float]]:
    """``with timed() as t: ...`` then ``t[0]`` is the elapsed seconds."""
    box = [0.0]
    started = time.monotonic()
    try:
        yield box
    finally:
        box[0] = time.monotonic() - started
