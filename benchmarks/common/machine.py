"""Machine details and package versions, recorded with every result so that figures can be compared honestly."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

PACKAGES = (
    "torch",
    "numpy",
    "cachefeed",
    "mosaicml-streaming",
    "litdata",
    "obstore",
    "torchvision",
    "transformers",
    "s3fs",
    "fsspec",
    "boto3",
    "botocore",
    "moto",
    "psutil",
    "xxhash",
)


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def machine(work_dir: Path) -> dict[str, Any]:
    """CPU, memory, kernel, the filesystem under ``work_dir``, Python, and package versions."""
    usage = shutil.disk_usage(work_dir)
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "platform": platform.platform(),
        "kernel": platform.release(),
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "memory_bytes": _memory_bytes(),
        "python": sys.version.split()[0],
        "work_dir": str(work_dir),
        "work_fs": _fs_type(work_dir),
        "work_fs_free_bytes": usage.free,
        "versions": versions(),
    }


def _memory_bytes() -> int | None:
    try:
        import psutil
    except ImportError:  # the main .venv (smoke test): read /proc
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None
    return int(psutil.virtual_memory().total)


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _fs_type(path: Path) -> str | None:
    """The filesystem type of the longest mount point containing ``path`` (from /proc/mounts)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    target = str(path.resolve())
    best: tuple[int, str] | None = None
    for fields in mounts:
        if len(fields) < 3:
            continue
        mount_point, fs_type = fields[1], fields[2]
        if (target == mount_point or target.startswith(mount_point.rstrip("/") + "/")) and (
            best is None or len(mount_point) > best[0]
        ):
            best = (len(mount_point), fs_type)
    return best[1] if best else None


def byte_compile_cachefeed() -> None:
    """Write cachefeed's ``.pyc`` files, as installing a wheel does, before a measurement that starts daemons.

    An editable install compiles a module at its first import, and not at all where ``PYTHONDONTWRITEBYTECODE``
    is set (it is on this machine): every daemon started by a benchmark then compiled the package from source
    (about 0.2 s of CPU per start, counted in its cold start), while the peers, installed from wheels, load their
    ``.pyc`` files."""
    import compileall

    import cachefeed

    compileall.compile_dir(Path(cachefeed.__file__).parent, quiet=1)
