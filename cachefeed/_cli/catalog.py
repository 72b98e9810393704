"""``cachefeed catalog build URL``: list a remote once and publish its catalog for every node (``_daemon/shared.py``).

Run it where listing is allowed (a cron job, a systemd timer, or node 0 before the job starts); daemons with
``remote.catalog`` pointing at ``--out`` then read the newest generation instead of listing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from cachefeed._config import RemoteConfig
from cachefeed._config.parse import load_config
from cachefeed._errors import EX_USAGE, ConfigError
from cachefeed._scrub import safe_url

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = sub.add_parser(
        "build", help="list URL once and publish its catalog", description="list URL once and publish its catalog"
    )
    build.add_argument("url", nargs="?", help="the data's fsspec URL (default: remote.url of --config)")
    build.add_argument("--out", help="where the catalog's generations go (default: <URL>.cfcatalog, next to the data)")
    build.add_argument("--config", help="take url, pattern and storage_options from this config's [remote]")
    build.add_argument("--pattern", help='glob under URL selecting the objects (default "**", or the config\'s)')
    build.add_argument("--storage-options", help="fsspec storage options as JSON (default {}, or the config's)")


def run(args: argparse.Namespace) -> int:
    from cachefeed._daemon.shared import default_out, publish
    from cachefeed._remote import Remote

    loaded = load_config(args.config) if args.config else None
    remote_config = loaded.remote if loaded is not None else RemoteConfig()
    url = args.url or remote_config.url
    if not url:
        if loaded is not None and loaded.sources:
            names = ", ".join(source.name for source in loaded.sources)
            print(
                f"cachefeed catalog build: {args.config} names its data in [[source]] tables ({names}), one catalog "
                "each: run it once per source with the source's URL (and --pattern, --storage-options)",
                file=sys.stderr,
            )
        else:
            print("cachefeed catalog build: name the data's URL (or --config with remote.url)", file=sys.stderr)
        return EX_USAGE
    options = remote_config.storage_options
    if args.storage_options:
        try:
            options = json.loads(args.storage_options)
        except ValueError as exc:
            raise ConfigError(f"--storage-options is not JSON: {exc}") from None
        if not isinstance(options, dict):
            raise ConfigError('--storage-options: expected a JSON object such as {"anon": true}')
    config = RemoteConfig(
        url=url,
        pattern=args.pattern or remote_config.pattern,
        storage_options=options,
        max_attempts=remote_config.max_attempts,
    )
    out = args.out or default_out(url)
    remote = Remote(config)
    started = time.monotonic()
    try:
        name, objects = publish(remote, out)
    finally:
        remote.close()
    print(
        f"published {name}: {objects} objects of {safe_url(url)} in {time.monotonic() - started:.1f}s "
        f"({remote.stats.list_requests_total} LIST requests) to {safe_url(out)}",
        file=sys.stdout,
    )
    return 0
