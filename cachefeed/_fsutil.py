"""Small filesystem helpers shared by the cache, the snapshots and the status file."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["atomic_write", "fsync_dir", "remove_tree"]


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
