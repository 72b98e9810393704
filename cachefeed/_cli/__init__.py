"""The ``cachefeed`` command: ``daemon``, ``status``, ``catalog``, ``demo``; ``main`` is the console entry point.

Each subcommand lives in its own module of this package (``_cli/daemon.py``, ``_cli/status.py``, ``_cli/demo.py``)
and exposes ``add_arguments(parser)`` and ``run(args) -> int``; this module only wires them up. A
``CachefeedError`` becomes one line on stderr and its ``exit_code``; no traceback for user mistakes. A value given
on the command line that a subcommand refuses is ``UsageError`` (64, as argparse's own refusals), never
``ConfigError`` (78): that one is for a bad ``--config`` file.
``KeyboardInterrupt`` exits 130. ``python -m cachefeed`` (``cachefeed/__main__.py``) runs the same ``main``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from cachefeed._errors import EX_USAGE, CachefeedError

__all__ = ["main"]

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "daemon": ("cachefeed._cli.daemon", "run the cache daemon in the foreground (what systemd starts)"),
    "status": ("cachefeed._cli.status", "show what the cache and its daemon are doing"),
    "catalog": ("cachefeed._cli.catalog", "list a remote once and publish its catalog for every node to read"),
    "demo": ("cachefeed._cli.demo", "run the whole system end to end on a local S3 server, no set-up needed"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on ``EX_USAGE`` (64) instead of 2, which ``cachefeed status`` means "degraded"."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EX_USAGE, f"{self.prog}: error: {message}\n")


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser. Only the module of the subcommand named in ``argv`` is imported (the CLI starts fast, and one
    subcommand's heavy imports, torch or moto, never slow down or break another)."""
    parser = _Parser(
        prog="cachefeed",
        description="A rolling local sample cache for PyTorch training on object storage.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((arg for arg in argv if arg in COMMANDS), None)
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(command)
            command.set_defaults(_run=module.run)
    return parser


def _version() -> str:
    from cachefeed import __version__

    return __version__


def report_error(command: str, error: CachefeedError) -> int:
    """A user's error, as every command reports it: one line on stderr naming the command; its exit status."""
    print(f"cachefeed {command}: {error}", file=sys.stderr)
    return error.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args._run(args))
    except CachefeedError as exc:
        return report_error(args.command, exc)
    except KeyboardInterrupt:
        return 130
