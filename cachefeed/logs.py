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
  plus the values passed in ``secrets``, e.g. from ``remote.storage_options``) and every secret *pattern*
  (``Authorization`` headers, ``X-Amz-Signature=``/``X-Amz-Credential=``/``X-Amz-Security-Token``,
  ``aws_secret_access_key = ...`` and friends, AWS access key ids ``AKIA...``/``ASIA...``), replacing them with
  ``***``.

Uncaught exceptions (``sys.excepthook``, ``threading.excepthook``) and warnings (``logging.captureWarnings``)
go through the same handler, so an interpreter-printed traceback cannot bypass the redaction either.

It also caps the chatty third-party loggers (botocore, boto3, aiobotocore, s3fs, fsspec, urllib3, aiohttp) at
WARNING whatever ``level`` is: at DEBUG they print signed request headers and full request parameters.

Redaction is a second line of defence: messages should not carry secrets in the first place (``remote.py`` scrubs
its errors and never chains backend exceptions). ``add_secrets`` registers more values later (e.g. once a config
is loaded).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, TextIO

__all__ = [
    "CHATTY_LOGGERS",
    "LOG_LEVELS",
    "REDACTED",
    "OneLineFormatter",
    "RedactingFilter",
    "add_secrets",
    "redact",
    "safe_url",
    "secrets_from_env",
    "secrets_from_options",
    "setup_logging",
]

LOG_LEVELS = ("debug", "info", "warning", "error")  # the registry: config validates log.level against it
REDACTED = "***"
CHATTY_LOGGERS = ("botocore", "boto3", "aiobotocore", "s3fs", "fsspec", "urllib3", "aiohttp", "s3transfer")
MIN_SECRET_CHARS = 4  # shorter values would redact ordinary words; same threshold as remote.py
_MIN_GUESSED_SECRET_CHARS = 8

# Environment variables whose values are credentials. Names containing one of the words below count too.
_ENV_SECRET_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_ENV_SECRET_WORDS = ("SECRET", "TOKEN", "PASSWORD", "CREDENTIAL", "ACCESS_KEY", "CONNECTION_STRING", "SAS_KEY")
_OPTION_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "sas", "connection_string", "username")

_QUOTE = r"""['"]?"""
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # Authorization: AWS4-HMAC-SHA256 Credential=..., Signature=...   and   'Authorization': b'AWS4-...'
    (
        re.compile(
            r"((?:proxy-)?authorization" + _QUOTE + r"\s*[:=]\s*b?" + _QUOTE + r")[^'\"\r\n]+",
            re.IGNORECASE,
        ),
        r"\1" + REDACTED,
    ),
    # presigned URLs and signed headers
    (
        re.compile(
            r"(x-amz-(?:signature|credential|security-token)" + _QUOTE + r"\s*[:=]\s*b?" + _QUOTE + r")[^&'\"\s,;]+",
            re.IGNORECASE,
        ),
        r"\1" + REDACTED,
    ),
    # aws_secret_access_key = ..., "secret": "...", password: ..., token=...
    (
        re.compile(
            r"((?:aws_secret_access_key|aws_session_token|aws_security_token|secret_access_key|session_token"
            r"|secret_key|secret|password|passwd|token)" + _QUOTE + r"\s*[:=]\s*b?" + _QUOTE + r")[^'\"\s,;&}]+",
            re.IGNORECASE,
        ),
        r"\1" + REDACTED,
    ),
    # AWS access key ids (long-term AKIA..., temporary ASIA...)
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u0085\u2028\u2029]")

_lock = threading.Lock()
_secret_values: set[str] = set()
_secret_regex: re.Pattern[str] | None = None


def secrets_from_env(env: Mapping[str, str] | None = None) -> list[str]:
    """Credential values found in the environment (AWS_* keys, and any ``*SECRET*``/``*TOKEN*``-like name)."""
    env = os.environ if env is None else env
    found = []
    for name, value in env.items():
        upper = name.upper()
        if upper in _ENV_SECRET_NAMES and len(value) >= MIN_SECRET_CHARS:
            found.append(value)
        elif any(word in upper for word in _ENV_SECRET_WORDS) and len(value) >= _MIN_GUESSED_SECRET_CHARS:
            found.append(value)  # a guess by name: a longer minimum keeps flags like "true" out
    return found


def secrets_from_options(options: Mapping[str, Any]) -> list[str]:
    """Credential values in fsspec ``storage_options`` (nested tables included), by key name; longest first, so
    that a scrubber replacing them in order replaces a secret that contains another whole. The one list both the
    log filter and the remote's error messages scrub."""
    found: list[str] = []
    for name, value in options.items():
        if isinstance(value, Mapping):
            found += secrets_from_options(value)
        elif isinstance(value, str) and any(word in str(name).lower() for word in _OPTION_SECRET_WORDS):
            found.append(value)
    return sorted({value for value in found if len(value) >= MIN_SECRET_CHARS}, key=len, reverse=True)


def safe_url(url: str) -> str:
    """The URL with any ``user:password@`` part replaced by ``***@``, for logs, status and error messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = REDACTED + "@" + authority.rpartition("@")[2]
    return f"{scheme}://{authority}{slash}{path}"


def add_secrets(values: Iterable[str]) -> None:
    """Register more secret values to redact from every log record (thread-safe, idempotent)."""
    global _secret_regex
    with _lock:
        before = len(_secret_values)
        _secret_values.update(v for v in values if isinstance(v, str) and len(v) >= MIN_SECRET_CHARS)
        if len(_secret_values) != before:
            # longest first, so a secret that contains another is replaced whole
            ordered = sorted(_secret_values, key=len, reverse=True)
            _secret_regex = re.compile("|".join(re.escape(value) for value in ordered))


def redact(text: str) -> str:
    """``text`` with every registered secret value and every secret pattern replaced by ``***``."""
    regex = _secret_regex
    if regex is not None:
        text = regex.sub(REDACTED, text)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


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
        secrets: extra values to redact (e.g. ``secrets_from_options(config.remote.storage_options)``);
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
