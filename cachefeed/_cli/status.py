"""``cachefeed status``: read the daemon's status document, judge the daemon's health, show it.

Usage::

    cachefeed status --config /etc/cachefeed/train.toml     # or --cache-dir /dev/shm/cachefeed/train
    cachefeed status --cache-dir DIR --json                 # the daemon's document + heartbeat_age_s + health
    cachefeed status --cache-dir DIR --watch [SECONDS]      # refresh in place until Ctrl-C

The exit status (one invocation, without ``--watch``) is the verdict: the table is in ``_status/verdict.py``, with
``Health``; the staleness rule and the pid check are there too. The reading is ``_status/report.py``, the output
``_status/render.py``; this module only parses the command line and prints.

With ``--json`` stdout is JSON whatever the command can answer: where there is no report to give (no cache at the
path, exit 66; a directory this user cannot read, 4; a bad ``--config``, 78) it is the error's document
(``render.error_json``: ``health`` with that exit status and the error as its reason, ``cache.dir``, ``error``), and
the error's line is on stderr as without ``--json``. Only a command line argparse refuses (64) prints no JSON.

``--watch`` re-reads the file every SECONDS (a poll: the heartbeat age changes every second anyway). On a terminal
each frame replaces the last (cursor home, clear); otherwise frames follow each other, and with ``--json`` each is
one line (NDJSON). A cache that does not exist yet is reported and watched for, and so is a directory holding
nothing but what a starting daemon creates before it marks it as a cache (``_may_become_cache``); a path that can
never become one (a file, a directory of other things) exits 66 at once, as one invocation does. Ctrl-C exits with
the last frame's verdict (0 only if the daemon was running and healthy then; 66 if the last frame found no cache),
as one invocation would have exited at that moment.

A reader that goes away (``cachefeed status --json | head -c 400``) ends the command quietly: the rest of the output
goes to ``/dev/null`` (the recipe in the Python docs' ``signal`` module notes), no ``BrokenPipeError`` traceback,
and the exit status is still the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from cachefeed._cache.layout import CacheLayout
from cachefeed._cli import report_error
from cachefeed._config import load_config
from cachefeed._errors import EX_USAGE, CachefeedError, ConfigError, NoSuchCacheError
from cachefeed._status.render import error_json, render_human, to_json
from cachefeed._status.report import read_report
from cachefeed._status.verdict import Health

__all__ = ["add_arguments", "run"]

# The exit statuses in --help: numbers from where they are declared, one short label each.
_EXIT_STATUSES = (
    (Health.RUNNING, "running"), (Health.DEGRADED, "degraded"), (Health.NOT_RUNNING, "not running"),
    (Health.UNREADABLE, "status unreadable"), (Health.NOT_READY, "starting/stopping"), (EX_USAGE, "usage error"),
    (NoSuchCacheError.exit_code, "no such cache"), (ConfigError.exit_code, "bad config"),
)  # fmt: skip


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds such as 2 or 0.5") from None
    if not 0.05 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: expected between 0.05 and 3600 seconds")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", metavar="FILE", help="the daemon's TOML config (gives the cache dir)")
    where.add_argument("--cache-dir", metavar="DIR", type=Path, help="the cache directory")
    parser.add_argument("--json", action="store_true", help="print one JSON document (with --watch: one per line)")
    parser.add_argument(
        "--watch",
        metavar="SECONDS",
        nargs="?",
        const=1.0,
        type=_positive_seconds,
        help="refresh every SECONDS (default 1) until Ctrl-C, then exit with the last verdict",
    )
    parser.epilog = "exit status: " + ", ".join(f"{int(code)} {label}" for code, label in _EXIT_STATUSES)


def run(args: argparse.Namespace) -> int:
    """One reading (or ``--watch``); with ``--json`` an error it can answer is a JSON document too (``_answer``)."""
    cache_dir: Path | None = args.cache_dir
    try:
        cache_dir, interval_s = _where(args)
        if args.watch is not None:
            return _watch(cache_dir, interval_s, period_s=args.watch, as_json=args.json)
        report = read_report(cache_dir, interval_s=interval_s)
    except CachefeedError as exc:
        if not args.json:
            raise  # one line on stderr and the error's exit status (``_cli/__init__.py``)
        return _answer(exc, cache_dir, indent=None if args.watch is not None else 2)
    _write(json.dumps(to_json(report), indent=2) + "\n" if args.json else render_human(report))
    return int(report.health)


def _where(args: argparse.Namespace) -> tuple[Path, float | None]:
    """The cache directory, and the daemon's status interval where ``--config`` gives it. Raises ConfigError."""
    if args.config:
        config = load_config(args.config)
        return config.cache.dir, config.status.interval_s
    return Path(args.cache_dir), None


def _answer(error: CachefeedError, cache_dir: Path | None, *, indent: int | None) -> int:
    """``--json`` where there is no report (no cache at the path, a bad ``--config``...): the error's document on
    stdout (``render.error_json``: a script always reads JSON), its line on stderr, and its exit status."""
    _write(json.dumps(error_json(cache_dir, error), indent=indent) + "\n")
    return report_error("status", error)


def _write(text: str) -> None:
    """Print ``text`` on stdout; a reader that went away ends the output quietly (module docstring)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()


def _may_become_cache(cache_dir: Path) -> bool:
    """Whether a path that is no cache yet may still become one while ``--watch`` waits: what the daemon would not
    refuse as its cache.dir (``CacheLayout.refusal``: a path that does not exist yet, an empty directory, one a
    starting daemon is making). A file, a symbolic link or a directory holding other files (any at all) never
    becomes one."""
    return CacheLayout(cache_dir).refusal() is None


def _silence_stdout() -> None:
    """The reader of stdout went away: point stdout at /dev/null so that Python's flush at exit cannot fail
    again (and print a traceback). The Python docs' recipe for SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


_HOME_CLEAR = "\x1b[H\x1b[2J"


def _watch(cache_dir: Path, interval_s: float | None, *, period_s: float, as_json: bool) -> int:
    """Redraw until interrupted. A missing cache is shown as such (the daemon may not have created it yet); a path
    that cannot become a cache ends the watch at once, with its one-line error (``_may_become_cache``)."""
    is_tty = sys.stdout.isatty() and not as_json
    verdict = int(Health.NOT_RUNNING)  # a Ctrl-C before the first frame: nothing seen running
    try:
        while True:
            try:
                report = read_report(cache_dir, interval_s=interval_s)
                text = json.dumps(to_json(report)) + "\n" if as_json else render_human(report)
                verdict = int(report.health)
            except CachefeedError as exc:
                if isinstance(exc, NoSuchCacheError) and not _may_become_cache(cache_dir):
                    raise  # waiting cannot help: as without --watch (one line on stderr, exit 66; --json: a frame)
                text = json.dumps(error_json(cache_dir, exc)) + "\n" if as_json else f"cachefeed status: {exc}\n"
                verdict = exc.exit_code
            if is_tty:
                sys.stdout.write(_HOME_CLEAR + text)
            else:
                sys.stdout.write(text if as_json else text + "\n")
            sys.stdout.flush()
            time.sleep(period_s)
    except KeyboardInterrupt:
        return verdict
    except BrokenPipeError:
        _silence_stdout()  # the reader went away (``| head``): stop quietly
        return verdict
