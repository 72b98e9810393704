"""The errors cachefeed raises, and the exit status each one means on the command line.

The tree::

    CachefeedError                      root; exit 1
    ├── ConfigError                     a bad config file or value; exit 78 (EX_CONFIG: systemd must not restart)
    ├── UsageError                      a command-line value a subcommand refuses (``--epochs 0``); exit 64 (EX_USAGE)
    ├── CacheLockedError                another daemon holds the cache dir; exit 75 (EX_TEMPFAIL)
    ├── NoSuchCacheError                the cache dir does not exist or is not a cache; exit 66 (EX_NOINPUT)
    ├── CacheUnusableError              the daemon cannot create or write its cache dir; exit 73 (EX_CANTCREAT)
    ├── CorruptRecordError              a record or segment failed verification (never served)
    ├── SnapshotError                   an epoch snapshot could not be created, joined or read
    ├── RemoteError                     the remote failed for one object (translated in _remote/errors.py only)
    │   ├── RemoteNotFoundError         404: counted, never retried
    │   ├── RemoteForbiddenError        401/403: counted, never retried
    │   ├── RemoteTransientError        5xx, throttling, resets, timeouts: retried with backoff
    │   └── RemoteChangedError          the object changed during the read (ETag or length mismatch)
    ├── DecodeError                     a remote object could not be decoded into samples (quarantined)
    ├── StatusUnreadable                status.json exists but cannot be used; exit 4 (``cachefeed status``)
    ├── WriterStopped                   a writer was told to stop while it waited for room (a clean stop)
    ├── GrantTooLarge (ValueError)      the supervisor says a segment of this size can never fit the cache
    └── ChannelClosed (ConnectionError) the other end of a daemon socket is gone (EOF or a reset)

Every error carries ``exit_code`` so the CLI maps it to a status without a table of its own. A command line the
CLI cannot parse exits ``EX_USAGE`` (64), so that no usage mistake reads as a status (``cachefeed status`` uses 2
for "degraded").
"""

from __future__ import annotations

__all__ = [
    "EX_NOINPUT",
    "EX_USAGE",
    "CacheLockedError",
    "CacheUnusableError",
    "CachefeedError",
    "ChannelClosed",
    "ConfigError",
    "CorruptRecordError",
    "DecodeError",
    "GrantTooLarge",
    "NoSuchCacheError",
    "RemoteChangedError",
    "RemoteError",
    "RemoteForbiddenError",
    "RemoteNotFoundError",
    "RemoteTransientError",
    "SnapshotError",
    "StatusUnreadable",
    "UsageError",
    "WriterStopped",
]


EX_USAGE = 64  # sysexits.h: the command was used incorrectly
EX_NOINPUT = 66  # sysexits.h: the input did not exist (no such cache; a catalog build that listed no objects)


class CachefeedError(Exception):
    """Root of every error cachefeed raises on purpose."""

    exit_code: int = 1


class ConfigError(CachefeedError):
    """A config value is missing, unknown or malformed. The message names the key, the value and the form."""

    exit_code = 78


class UsageError(CachefeedError):
    """A command-line value a subcommand refuses after parsing (``--epochs 0``): exit ``EX_USAGE`` (64), like a
    command line argparse cannot parse, never 78, which is for a bad ``--config`` file. The message names the
    option, the value and the expected form."""

    exit_code = EX_USAGE


class CacheLockedError(CachefeedError):
    """The cache directory's writer lock is held by another live process."""

    exit_code = 75


class CacheUnusableError(CachefeedError):
    """The daemon cannot create or write its cache directory (read-only filesystem, a file in the way, no
    permission). Fixing it needs a person, so systemd must not restart the daemon (``RestartPreventExitStatus``)."""

    exit_code = 73


class NoSuchCacheError(CachefeedError):
    """The directory is missing or holds no cachefeed cache."""

    exit_code = EX_NOINPUT


class CorruptRecordError(CachefeedError):
    """A record or segment failed its checks: wrong magic, length, checksum or key."""


class SnapshotError(CachefeedError):
    """An epoch snapshot could not be created, joined or read."""


class RemoteError(CachefeedError):
    """One remote object could not be read. ``kind`` is a short label used in counters."""

    kind = "error"


class RemoteNotFoundError(RemoteError):
    kind = "not_found"


class RemoteForbiddenError(RemoteError):
    kind = "forbidden"


class RemoteTransientError(RemoteError):
    kind = "transient"


class RemoteChangedError(RemoteError):
    """The object's ETag or length changed between the listing and the end of the read."""

    kind = "changed"


class DecodeError(CachefeedError):
    """A remote object's bytes could not be turned into samples."""


class StatusUnreadable(CachefeedError):
    """status.json exists but cannot be used: unreadable, not JSON, or not the documented shape."""

    exit_code = 4  # cachefeed._status.verdict.Health.UNREADABLE


class WriterStopped(CachefeedError):
    """Raised by ``CacheWriter.add`` when it was told to stop while waiting for room in the cache."""


class GrantTooLarge(CachefeedError, ValueError):
    """The supervisor says a segment of this size can never fit the cache."""


class ChannelClosed(CachefeedError, ConnectionError):
    """The other end of a daemon socket channel is gone (EOF or a reset)."""
