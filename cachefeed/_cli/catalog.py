"""``cachefeed catalog build URL``: list a remote once and publish its catalog for every node (``_daemon/shared.py``).

Run it where listing is allowed (a cron job, a systemd timer, or node 0 before the job starts); daemons with
``remote.catalog`` pointing at ``--out`` then read the newest generation instead of listing.

A listing of no objects is not published (exit 66, one line naming the URL and the pattern): daemons read the newest
generation, so one typo'd rebuild would empty every node's listing. ``--allow-empty`` publishes it all the same. A
value on the command line that is refused exits 64 (``UsageError``); a bad ``--config`` file exits 78.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

from cachefeed._config import Config, RemoteConfig
from cachefeed._config.parse import load_config
from cachefeed._errors import EX_NOINPUT, EX_USAGE, ConfigError, UsageError
from cachefeed._scrub import safe_url

if TYPE_CHECKING:
    from cachefeed._remote import Remote

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
    build.add_argument(
        "--allow-empty",
        action="store_true",
        help="publish even a listing of no objects (refused by default: daemons reading it would list nothing)",
    )


def run(args: argparse.Namespace) -> int:
    loaded = load_config(args.config) if args.config else None  # a bad --config file: ConfigError, exit 78
    try:
        return _build(args, loaded)
    except ConfigError as exc:
        if loaded is not None and args.url is None:
            raise  # the URL came from the file: exit 78
        message = str(exc) if args.url is None else str(exc).removeprefix("remote.url = ")  # the URL typed, no key
        raise UsageError(message) from None  # the URL was typed: exit 64


def _build(args: argparse.Namespace, loaded: Config | None) -> int:
    from cachefeed._daemon.shared import default_out, publish_listing
    from cachefeed._remote import Remote

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
            raise UsageError(f"--storage-options is not JSON: {exc}") from None
        if not isinstance(options, dict):
            raise UsageError('--storage-options: expected a JSON object such as {"anon": true}')
    config = RemoteConfig(
        url=url,
        pattern=args.pattern or remote_config.pattern,
        storage_options=options,
        max_attempts=remote_config.max_attempts,
    )
    try:
        out = args.out or default_out(url)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None  # a whole bucket and no --out: the command line must name it
    remote = Remote(config)
    started = time.monotonic()
    try:
        local_root = _local_root(remote)
        if not args.allow_empty and local_root is not None and not os.path.exists(local_root):
            return _nothing_listed(config, local_root)
        made_out = local_root is not None and not remote.listing_fs().exists(out)
        name, objects, _ = publish_listing(remote, out, allow_empty=args.allow_empty)
        if not name and not objects:
            if made_out:
                _remove_empty_dir(remote, out)
            return _nothing_listed(config, local_root)
    finally:
        remote.close()
    print(
        f"published {name}: {objects} objects of {safe_url(url)} in {time.monotonic() - started:.1f}s "
        f"({remote.stats.list_requests_total} LIST requests) to {safe_url(out)}",
        file=sys.stdout,
    )
    return 0


def _local_root(remote: Remote) -> str | None:
    """The listed directory's local path, where the remote is the local filesystem (``file://``, a plain path),
    whose existence costs nothing to check; None elsewhere (an object store has no directories to ask about)."""
    from fsspec.implementations.local import LocalFileSystem

    return remote.root if isinstance(remote.listing_fs(), LocalFileSystem) else None


def _remove_empty_dir(remote: Remote, out: str) -> None:
    """Remove ``--out`` where this run created it and nothing was published there (a local directory)."""
    try:
        remote.listing_fs().rmdir(out)
    except OSError:
        pass  # not empty after all (someone else wrote there): left as it is


def _nothing_listed(config: RemoteConfig, local_root: str | None) -> int:
    """Refuse to publish a listing of no objects: one line on stderr naming the URL and the pattern, and what the
    local filesystem says of the root (nothing for an object store, where asking would cost requests); exit 66."""
    pattern, where = config.pattern, ""
    is_dir = local_root is None or os.path.isdir(local_root)
    if local_root is not None:
        if not os.path.exists(local_root):
            where = f" ({local_root} does not exist)"
        else:
            where = " (the directory exists)" if is_dir else f" ({local_root} is a file)"
    hint = ""
    if is_dir and "/" not in pattern and pattern != "**":
        hint = f"; {pattern!r} matches names at the top level only, '**/{pattern}' at any depth"
    print(
        f"cachefeed catalog build: nothing published: {safe_url(config.url)} lists no objects matching "
        f"{pattern!r}{where}: check the URL and --pattern{hint} (--allow-empty publishes an empty catalog, "
        "and every daemon reading it then lists nothing)",
        file=sys.stderr,
    )
    return EX_NOINPUT
