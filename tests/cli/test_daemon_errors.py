"""A write the cache's filesystem refuses while the daemon runs, on a path no guard of its own covers: one line
naming the path, the reason and what to do, exit 73 (systemd does not restart it into the same wall), rather than
a traceback and exit 1. Other errors stay bugs: their tracebacks are logged."""

from __future__ import annotations

import errno
import os

from cachefeed._cli.daemon import cache_refused


def test_a_refused_write_in_the_cache_is_one_line_and_exit_73() -> None:
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/dev/shm/cachefeed/sources.json")
    error = cache_refused(full, "/dev/shm/cachefeed")
    assert error is not None and error.exit_code == 73
    assert str(error) == (
        "the cache's filesystem refused to write /dev/shm/cachefeed/sources.json (No space left on device): "
        "free space there, then restart"
    )
    read_only = OSError(errno.EROFS, os.strerror(errno.EROFS), "/dev/shm/cachefeed/reads")
    assert "make it writable by the daemon's user" in str(cache_refused(read_only, "/dev/shm/cachefeed/"))


def test_other_errors_and_other_paths_stay_tracebacks() -> None:
    assert cache_refused(OSError(errno.ENOSPC, "full", "/dev/shm/cachefeed-other/x"), "/dev/shm/cachefeed") is None
    assert cache_refused(OSError(errno.EIO, "I/O error", "/dev/shm/cachefeed/x"), "/dev/shm/cachefeed") is None
    assert cache_refused(OSError(errno.ENOSPC, "full"), "/dev/shm/cachefeed") is None
