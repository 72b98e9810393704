"""``cachefeed daemon --config FILE``: run the cache daemon in the foreground (what systemd starts).

Exit statuses: 0 after a clean stop (SIGTERM/SIGINT), 78 for a bad config (``ConfigError``: systemd must not
restart-loop), 73 when the cache directory cannot be created or written (``CacheUnusableError``: systemd must not
restart-loop either), 75 when another daemon holds the cache directory (``CacheLockedError``, the holder is named).
These errors are one line on stderr, printed by ``cachefeed._cli.main``; nothing is logged before the config is valid.
"""

from __future__ import annotations

import argparse

from cachefeed._config import load_config
from cachefeed._daemon.supervisor import Supervisor
from cachefeed._logs import LOG_LEVELS, get_logger, setup_logging
from cachefeed._scrub import secrets_from_options

__all__ = ["add_arguments", "run"]

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE", help="the daemon's TOML config file")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None, help="override log.level from the config file")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    level = args.log_level or config.log.level
    supervisor = Supervisor(config, log_level=level)
    supervisor.preflight()  # a decoder or protocol that cannot be loaded is a config error: one line, no log
    setup_logging(level, secrets=secrets_from_options({s.name or "remote": s.storage_options for s in config.inputs()}))
    log.info("cachefeed daemon starting with %s", config.source)
    return supervisor.run()
