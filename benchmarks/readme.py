"""The README's benchmark figures, rendered from the committed results (``benchmarks/results/<name>.json``).

    python -m benchmarks.readme           # rewrite the figure blocks of README.md from the committed results
    python -m benchmarks.readme --check   # exit 1 (and say which block) when README.md and the results disagree

A figure block in the README is the text between ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->``; its
content is ``RENDERERS[NAME](load(NAME))``, nothing else. So a figure in such a block can only come from a
committed result, and ``tests/test_readme_figures.py`` fails when someone edits one by hand or commits a new
result without rendering the README again.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common.results import REPO_ROOT, load

README = REPO_ROOT / "README.md"
_BLOCK = re.compile(r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.DOTALL)


def _renderer(target: str) -> Callable[[dict[str, Any]], str]:
    """``module``'s ``readme_table`` (or ``module:function``), imported when a block is rendered (benchmarks
    import torch)."""
    module, _, function = target.partition(":")

    def render_block(doc: dict[str, Any]) -> str:
        table: Callable[[dict[str, Any]], str] = getattr(importlib.import_module(module), function or "readme_table")
        return table(doc)

    return render_block


# Each README block: (the committed result it renders, benchmarks/results/<result>.json; the script whose
# readme_table(doc) renders it, or "module:function"). A benchmark's block is named after it; "peers" is
# run_all's comparison, "coldstart" its cold-start table.
SOURCES: dict[str, tuple[str, str]] = {
    **{
        name: (name, f"benchmarks.{name}")
        for name in (
            "catalog",
            "cold_launch",
            "decode",
            "echo",
            "egress",
            "feed",
            "feed_gpu",
            "first_batch",
            "handover",
            "ingest",
            "outcome",
            "read_throughput",
            "worker_memory",
        )
    },
    "feed_gpu_h200": ("feed_gpu_h200", "benchmarks.feed_gpu"),  # the same benchmark, on the other kind of GPU
    "peers": ("results", "benchmarks.run_all"),
    "coldstart": ("results", "benchmarks.common.results_md:cold_start_table"),
}
RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    name: _renderer(module) for name, (_r, module) in SOURCES.items()
}


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every figure block rendered again, and the names of the blocks that changed."""
    changed: list[str] = []

    def one(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in RENDERERS:
            raise KeyError(f"README figure block {name!r} has no renderer in benchmarks/readme.py")
        body = RENDERERS[name](load(SOURCES[name][0])).rstrip("\n") + "\n"
        if body != match["body"]:
            changed.append(name)
        return match.group(1) + body + match.group(4)

    return _BLOCK.sub(one, text), changed


def blocks(text: str) -> list[str]:
    """The names of the figure blocks in ``text``, in order."""
    return [match["name"] for match in _BLOCK.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a block is out of date")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    rendered, changed = render(text)
    if args.check:
        for name in changed:
            print(f"{args.readme}: figure block {name!r} differs from benchmarks/results/{SOURCES[name][0]}.json")
        return 1 if changed else 0
    if changed:
        args.readme.write_text(rendered)
    print(f"{args.readme}: {len(blocks(text))} figure blocks, rewritten: {', '.join(changed) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
