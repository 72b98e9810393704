"""Logging for the daemon and its samplers: one line per event on stderr, with credentials redacted.

``setup_logging(level, secrets=...)`` is called once per process (the supervisor, and each sampler process it
starts) before anything logs. It installs on the root logger a single stderr handler that

- writes one line per event: ``LEVEL logger[pid]: message``, with newlines and other control characters in the
  message and traceback escaped (``\\n``), so a multi-line traceback stays one journald entry and a hostile remote
  key cannot forge log lines or send terminal escapes. When stderr is the systemd journal (``$JOURNAL_STREAM``
  names it), each line starts with a syslog priority prefix (``<3>``) so that journald records the level, and the
  timestamp is left to journald; otherwise lines start with a local ISO timestamp;
- redacts, through ``RedactingFilter`` (a handler filter, so it sees every record, its formatted arguments, its
  traceback and its stack), every known secret *value* (AWS keys, secrets and session tokens from the environment,
  plus the values passed in ``secrets``, e.g. from ``remote.storage_options``) and every secret *pattern*, replacing
  them with ``***``. Which values and patterns are secret, and the scrubbing itself, belong to ``cachefeed._scrub``
  (shared with the remote's error messages); this module keeps the process's registry of values.

Uncaught exceptions (``sys.excepthook``, ``threading.excepthook``) and warnings (``logging.captureWarnings``)
go through the same handler, so an interpreter-printed traceback cannot bypass the redaction either.

It also caps the chatty third-party loggers (botocore, boto3, aiobotocore, s3fs, fsspec, urllib3, aiohttp) at
WARNING whatever ``level`` is: at DEBUG they print signed request headers and full request parameters.

Logger names are public, module names are not: ``get_logger(__name__)`` in ``cachefeed._trainer.pool`` is the
logger ``cachefeed.trainer.pool``, so the names users configure (and read in the log) stay put when private
modules move.

Redaction is a second line of defence: messages should not carry secrets in the first place (``Remote`` scrubs
its errors with the same ``Scrubber`` and never chains backend exceptions). ``add_secrets`` registers more values
later (e.g. once a config is loaded).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TextIO

from cachefeed._scrub import Scrubber, secrets_from_env


def get_logger(module: str) -> logging.Logger:
    """The logger of ``module`` (pass ``__name__``) under its public name: private parts lose their underscore."""
    return logging.getLogger(module.replace("._", "."))


__all__ = [
    "CHATTY_LOGGERS",
    "LOG_LEVELS",
    "OneLineFormatter",
    "RedactingFilter",
    "RepeatedWarnings",
    "add_secrets",
    "redact",
    "setup_logging",
]

LOG_LEVELS = ("debug", "info", "warning", "error")  # the registry: config validates log.level against it
CHATTY_LOGGERS = ("botocore", "boto3", "aiobotocore", "s3fs", "fsspec", "urllib3", "aiohttp", "s3transfer")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u0085\u2028\u2029]")

_lock = threading.Lock()
_scrubber = Scrubber()  # replaced, never changed in place: ``redact`` reads it without the lock


def add_secrets(values: Iterable[str]) -> None:
    """Register more secret values to redact from every log record (thread-safe, idempotent)."""
    global _scrubber
    with _lock:
        _scrubber = _scrubber.with_values(values)


def redact(text: str) -> str:
    """``text`` with every registered secret value and every secret pattern replaced by ``***``."""
    return _scrubber(text)


def _one_line(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\n", "\\n").replace("\r", "\\r")
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


class RedactingFilter(logging.Filter):
    """Rewrites each record in place: message (arguments merged), traceback and stack, all redacted.

    Attach it to handlers, not loggers: a logger's filters do not see records propagated from child loggers.
    After it runs, ``record.args`` is empty and ``record.exc_info`` is None (the traceback is kept, redacted, in
    ``record.exc_text``), so no later formatter can re-render the raw values.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not lose the event (nor crash the caller)
            message = f"{record.msg!r} % {record.args!r}"
        record.msg = redact(message)
        record.args = ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.exc_info = None
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


_SYSLOG_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class OneLineFormatter(logging.Formatter):
    """``[<prio>]`` or ``<timestamp> `` then ``LEVEL logger[pid]: message``, all on one line (see module doc)."""

    def __init__(self, *, is_journal: bool = False) -> None:
        super().__init__("%(levelname)s %(name)s[%(process)d]: %(message)s")
        self.is_journal = is_journal

    def format(self, record: logging.LogRecord) -> str:
        line = _one_line(super().format(record))
        if self.is_journal:
            level = max((lvl for lvl in _SYSLOG_PRIORITY if lvl <= record.levelno), default=logging.DEBUG)
            return f"<{_SYSLOG_PRIORITY[level]}>{line}"
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        return f"{stamp}.{int(record.msecs):03d} {line}"


def _is_journal(stream: TextIO, env: Mapping[str, str]) -> bool:
    """True when ``stream`` is the journald stream systemd connected us to ($JOURNAL_STREAM = "dev:ino")."""
    device, _, inode = env.get("JOURNAL_STREAM", "").partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        info = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return info.st_dev == int(device) and info.st_ino == int(inode)


def setup_logging(
    level: str | int = "info",
    *,
    secrets: Iterable[str] = (),
    stream: TextIO | None = None,
    env: Mapping[str, str] | None = None,
) -> logging.Handler:
    """Configure this process's logging (see the module docstring). Idempotent: replaces its own handler.

    Args:
        level: one of ``LOG_LEVELS`` (config ``log.level``) or a ``logging`` level number.
        secrets: extra values to redact (e.g. ``scrub.secrets_from_options(config.remote.storage_options)``);
            credentials found in the environment are always added.
        stream: where to write (default ``sys.stderr``).
        env: the environment to read (default ``os.environ``).

    Returns:
        The installed handler (tests attach to it; the daemon has no need to).
    """
    env = os.environ if env is None else env
    numeric = level if isinstance(level, int) else logging.getLevelName(str(level).upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r}: expected {', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]}")
    add_secrets(secrets_from_env(env))
    add_secrets(secrets)
    target = sys.stderr if stream is None else stream
    handler = logging.StreamHandler(target)
    handler.set_name("cachefeed")
    handler.addFilter(RedactingFilter())
    handler.setFormatter(OneLineFormatter(is_journal=_is_journal(target, env)))
    root = logging.getLogger()
    for old in list(root.handlers):
        if old.get_name() == "cachefeed":
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, numeric))
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread
    return handler


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """An exception nobody caught: logged (one line, redacted) instead of printed raw by the interpreter."""
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("cachefeed.uncaught").critical("uncaught exception", exc_info=(kind, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None or issubclass(args.exc_type, SystemExit):
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("cachefeed.uncaught").critical(
        "uncaught exception in thread %s", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback)
    )


class RepeatedWarnings:
    """Warnings that come once per object and may come for every object: a decoder that does not fit the
    bucket's format fails on each of its objects, and a warning apiece would bury everything else in the journal.

    The first ``first`` of each kind are logged as they come. After that each one is logged at DEBUG only, and a
    WARNING says how many more there were, with the last of them: at most once per ``every_s`` (``warn`` says it
    when the next one comes, ``flush`` when called, which the owner does periodically and before it exits).
    Not thread-safe: one owner (the sampler's event loop).
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        first: int = 5,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger, self._first, self._every_s, self._clock = logger, first, every_s, clock
        self._seen: dict[str, int] = {}
        self._held: dict[str, tuple[int, str, float]] = {}  # kind -> (held since the last summary, last one, since)

    def warn(self, kind: str, message: str, *args: object) -> None:
        seen = self._seen[kind] = self._seen.get(kind, 0) + 1
        if seen <= self._first:
            self._logger.warning(message, *args)
            if seen == self._first:
                self._logger.warning(
                    "further %r warnings are counted, not logged one by one (each at debug level): a count every %.0fs",
                    kind,
                    self._every_s,
                )
            return
        self._logger.debug(message, *args)
        count, _, since = self._held.get(kind, (0, "", self._clock()))
        self._held[kind] = (count + 1, message % args if args else message, since)
        self.flush(only_due=True)

    def flush(self, *, only_due: bool = False) -> None:
        """Say how many were held back, for every kind (``only_due``: those held for ``every_s`` or longer)."""
        now = self._clock()
        for kind, (count, last, since) in list(self._held.items()):
            if only_due and now - since < self._every_s:
                continue
            del self._held[kind]
            self._logger.warning("%d more %r warnings in %.0fs, the last: %s", count, kind, now - since, last)
