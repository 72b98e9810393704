"""``cachefeed daemon --config FILE``: run the cache daemon in the foreground (what systemd starts).

Exit statuses: 0 after a clean stop (SIGTERM/SIGINT), 78 for a bad config (``ConfigError``: systemd must not
restart-loop), 73 when the cache directory cannot be created or written, or is a directory of other files
(``CacheUnusableError``: systemd must not restart-loop either), 75 when another daemon holds the cache directory
(``CacheLockedError``, the holder is named). These errors are one line on stderr, printed by ``cachefeed._cli.main``;
nothing is logged before the config is valid.
"""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from cachefeed._errors import CacheLockedError, CacheUnusableError, ConfigError
from cachefeed._logs import LOG_LEVELS, get_logger, setup_logging
from cachefeed._scrub import secrets_from_options

__all__ = ["ONE_THREAD_POOLS", "add_arguments", "cache_refused", "one_math_thread", "run", "start_without_gc"]

log = get_logger(__name__)

# NOTE [ A daemon's start without the cyclic GC ]
# Until its samplers can fetch, a cold daemon is one process on one core: the interpreter, cachefeed with numpy,
# the config, then s3fs with aiobotocore, aiohttp and botocore and the first S3 session (``preflight``), about a
# second of CPU that every cold job waits for. Importing allocates hundreds of thousands of objects and nothing of
# it is garbage, yet the cyclic collector runs every 700 allocations, a full collection now and then: about 15% of
# that CPU. So the start runs with the collector paused (this module imports nothing heavy at module level, and
# ``import cachefeed`` loads only the error classes: everything heavy is imported inside ``start_without_gc``),
# and ends with ``gc.freeze()``: what the start loaded stays in the permanent generation, so neither the
# supervisor's later collections nor each forked sampler's first one (``sampler.serve_forked``, which copies every
# page it walks) scan it again. The start's own garbage (a few dozen objects) is frozen with it: kept, never
# finalized, in the supervisor and its forked children alike.


# NOTE [ One math thread per daemon process ]
# Importing numpy starts OpenBLAS's thread pool, a thread per core, and torch's OpenMP pool would do the same in a
# sampler whose preprocess uses torch. The daemon does no linear algebra. Those threads cost its start CPU that a
# cold job waits for. A one-off measurement on 2 cores (2026-11-26, 8 launches each way, alternating; the "started
# in" CPU the daemon logs): 0.72 s of CPU to the end of ``preflight`` with one thread, 0.86 s with a pool per core.
# The wall time moved less (0.72 s against 0.76 s to "starting"): the pool ran on the idle second core, which a node
# busy training does not have. And a user's preprocess that does use a pool would start one per sampler on cores
# training needs (why PyTorch runs its DataLoader workers with one thread). So the daemon's processes run with one
# thread in each pool unless the environment names a number: the variables are set before anything imports numpy,
# and forked samplers (or a fresh interpreter's, through the environment) inherit them.
ONE_THREAD_POOLS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def one_math_thread() -> None:
    """Set each of ``ONE_THREAD_POOLS`` to 1 where the environment does not set it (NOTE above); before numpy."""
    for name in ONE_THREAD_POOLS:
        os.environ.setdefault(name, "1")


@contextmanager
def start_without_gc() -> Iterator[None]:
    """Pause the cyclic collector for the block; then freeze what exists and restore the collector's state
    (NOTE [ A daemon's start without the cyclic GC ]), whether the block ends or raises."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE", help="the daemon's TOML config file")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None, help="override log.level from the config file")
    parser.epilog = "exit status: " + ", ".join(
        f"{code} {label}"
        for code, label in (
            (0, "stopped cleanly"),
            (ConfigError.exit_code, "bad config"),
            (CacheUnusableError.exit_code, "cache directory unusable"),
            (CacheLockedError.exit_code, "another daemon holds the cache"),
        )
    )


def run(args: argparse.Namespace) -> int:
    one_math_thread()
    with start_without_gc():
        from cachefeed._config import load_config
        from cachefeed._daemon.supervisor import Supervisor

        config = load_config(args.config)
        level = args.log_level or config.log.level
        supervisor = Supervisor(config, log_level=level)
        supervisor.preflight()  # a decoder or protocol that cannot be loaded is a config error: one line, no log
    setup_logging(level, secrets=secrets_from_options({s.name or "remote": s.storage_options for s in config.inputs()}))
    log.info("cachefeed daemon starting with %s", config.source)
    if log.isEnabledFor(logging.DEBUG):  # counting the frozen objects walks them all: ~10 ms, on every cold start
        log.debug(
            "started in %.2fs of CPU; %d objects of the start frozen (the cyclic GC skips them)",
            time.process_time(),
            gc.get_freeze_count(),
        )
    try:
        return supervisor.run()
    except OSError as exc:
        unusable = cache_refused(exc, str(config.cache.dir))
        if unusable is None:
            raise
        raise unusable from None


# What a filesystem answers when the cache cannot be written to until a person acts: exit 73, one line, not a traceback.
_REFUSALS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def cache_refused(exc: OSError, cache_dir: str) -> CacheUnusableError | None:
    """The one-line error for a write the cache's filesystem refused (full, read-only, no permission), where
    ``exc`` is about a path inside ``cache_dir``; None for anything else (a bug: its traceback is logged)."""
    path = str(exc.filename or "")
    if exc.errno not in _REFUSALS or not (path == cache_dir or path.startswith(cache_dir.rstrip("/") + "/")):
        return None
    what = "free space there" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable by the daemon's user"
    return CacheUnusableError(f"the cache's filesystem refused to write {path} ({exc.strerror}): {what}, then restart")
