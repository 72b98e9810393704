"""Small filesystem helpers shared by the cache, the snapshots and the status file."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["atomic_write", "file_version", "fsync_dir", "remove_tree"]


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | Callable[[IO[bytes]], None],
    *,
    mode: int = 0o640,
    fsync: bool = False,
) -> None:
    """Replace ``path`` with ``data`` atomically: a temp file in the same directory, then ``os.replace``.

    ``data`` is the content, or a function that writes it to the open temp file (a large file streamed out).
    Readers see the old content or the new one, never a mix. On error the temp file is removed.
    """
    target = Path(path)
    fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            if callable(data):
                data(handle)
            else:
                handle.write(data)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file ``path``. A symlink is never followed and a FIFO or device never
    blocks the caller: ``OSError`` for them, as for a missing file (what a planted file in a cache must get)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        chunks, left = [], limit
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_regular_for_write(path: str | os.PathLike[str], mode: int) -> int:
    """A write descriptor of the regular file ``path``, created or emptied; as ``read_regular``, never through a
    symlink and never blocking on a FIFO (``OSError``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    fd = os.open(path, flags, mode)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def file_version(path: str | os.PathLike[str]) -> tuple[int, int, int] | None:
    """What tells one version of a small file from another without reading it (an atomic rewrite gives it a new
    inode): inode, size and mtime; None if it cannot be looked at. Never follows a symlink."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename in ``path`` durable (a no-op cost on tmpfs)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove a directory tree without following symlinks; a symlink or file is just unlinked."""
    target = Path(path)
    try:
        if target.is_symlink() or not target.is_dir():
            target.unlink()
        else:
            shutil.rmtree(target)
    except FileNotFoundError:
        pass
