"""Real local faults for tests: a small tmpfs that really fills up (ENOSPC) or runs out of inodes.

``with small_tmpfs(1 << 20) as root:`` mounts a fresh tmpfs of that size on a new empty directory and yields it;
leaving the block unmounts it (lazily if something still holds it open) and removes the directory. When it cannot
mount (not root, no ``mount`` binary, or the kernel or container refuses), it calls ``pytest.skip`` with the
reason, so tests that need a real full disk are skipped, never faked.

Why the mount lives in the test's own mount namespace rather than a private one: the daemon under test runs in
subprocesses that must see the same filesystem at the same path, and ``unshare(CLONE_NEWNS)`` from a pytest
process that already runs threads (the fault proxy, botocore pools) moves only the calling thread into the new
namespace. ``unshare -m`` works here, but only for a whole re-exec'd child, which would put the test body in a
subprocess. So instead every mount point is a unique ``mkdtemp`` directory whose name carries the owning pid
(``cachefeed-tmpfs-<pid>-*``); each new mount first unmounts the leftovers of owners that are gone (a test
process killed with SIGKILL), so a crash leaks at most until the next run.

Sizes are bytes; the kernel rounds a tmpfs size up to whole pages. ``nr_inodes`` counts the root directory too,
so a tmpfs with ``nr_inodes=16`` holds 15 files or directories.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["small_tmpfs", "sweep_stale_mounts"]

logger = logging.getLogger(__name__)

_PREFIX = "cachefeed-tmpfs-"
_SOURCE = "cachefeed-test"
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")  # mountinfo writes " " as "\040"
_OWNER = re.compile(rf"/{re.escape(_PREFIX)}(\d+)-[^/]*$")


@contextlib.contextmanager
def small_tmpfs(size_bytes: int, *, nr_inodes: int | None = None, mode: int = 0o755) -> Iterator[Path]:
    """Mount a tmpfs of ``size_bytes`` (and at most ``nr_inodes`` inodes) and yield its root.

    Args:
        size_bytes: capacity; writes beyond it fail with ``ENOSPC``.
        nr_inodes: inode limit (root directory included); creating more fails with ``ENOSPC``.
        mode: permissions of the tmpfs root.

    Raises:
        ValueError: a size or inode count below 1.
        pytest.skip.Exception: the tmpfs cannot be mounted here (the reason says why).
    """
    if size_bytes < 1:
        raise ValueError(f"size_bytes must be >= 1, got {size_bytes}")
    if nr_inodes is not None and nr_inodes < 1:
        raise ValueError(f"nr_inodes must be >= 1, got {nr_inodes}")
    mount = shutil.which("mount")
    if os.geteuid() != 0:
        pytest.skip("small_tmpfs needs root to mount a tmpfs (run the root-marked tests as root)")
    if mount is None:
        pytest.skip("small_tmpfs needs the mount(8) binary (util-linux)")
    sweep_stale_mounts()
    options = f"size={size_bytes},mode={mode:o}"
    if nr_inodes is not None:
        options += f",nr_inodes={nr_inodes}"
    root = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
    result = subprocess.run(
        [mount, "-t", "tmpfs", "-o", options, _SOURCE, str(root)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        root.rmdir()
        pytest.skip(f"cannot mount a tmpfs here (mount -o {options}): {result.stderr.strip()}")
    try:
        yield root
    finally:
        _unmount(root)


def sweep_stale_mounts() -> list[Path]:
    """Unmount and remove the tmpfs mounts left by ``small_tmpfs`` owners that no longer run.

    Returns:
        The mount points removed.
    """
    removed = []
    for mount_point in _our_mounts():
        match = _OWNER.search(str(mount_point))
        if match is None or _pid_alive(int(match.group(1))):
            continue
        _unmount(mount_point)
        removed.append(mount_point)
    return removed


def _our_mounts() -> list[Path]:
    """Mount points of our tmpfs instances in this mount namespace (from ``/proc/self/mountinfo``)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) >= 5 and len(tail) >= 2 and tail[0] == "tmpfs" and tail[1] == _SOURCE:
            found.append(Path(_OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])))
    return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unmount(root: Path) -> None:
    """Unmount ``root`` (lazily if busy) and remove the directory; log, never raise."""
    umount = shutil.which("umount") or "umount"
    result = subprocess.run([umount, str(root)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        # Busy (a daemon subprocess still has a file open): detach now, the kernel frees it when unused.
        lazy = subprocess.run([umount, "-l", str(root)], capture_output=True, text=True, check=False)
        if lazy.returncode != 0:
            logger.warning("cannot unmount %s: %s", root, lazy.stderr.strip() or result.stderr.strip())
            return
    try:
        root.rmdir()
    except OSError as exc:
        logger.warning("cannot remove mount point %s: %s", root, exc)
