"""The matcher of ``remote.pattern``: fsspec glob syntax (``*``, ``**``, ``?``, ``[...]``) plus brace lists."""

from __future__ import annotations

import re

from fsspec.utils import glob_translate

__all__ = ["compile_pattern", "expand_braces"]


def expand_braces(pattern: str) -> list[str]:
    """``"**/*.{jpg,png}"`` -> ``["**/*.jpg", "**/*.png"]`` (nested lists too); fsspec's glob has no braces."""
    start = pattern.find("{")
    if start < 0:
        return [pattern]
    depth = 0
    for end in range(start, len(pattern)):
        depth += {"{": 1, "}": -1}.get(pattern[end], 0)
        if depth == 0:
            break
    else:
        return [pattern]  # an unbalanced brace is taken literally
    inner, parts, depth, begin = pattern[start + 1 : end], [], 0, 0
    for i, char in enumerate(inner):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(inner[begin:i])
            begin = i + 1
    parts.append(inner[begin:])
    return [expanded for part in parts for expanded in expand_braces(pattern[:start] + part + pattern[end + 1 :])]


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """One regular expression matching a path (relative to the remote URL) that any expansion of ``pattern`` does."""
    return re.compile("|".join(f"(?:{glob_translate(p)})" for p in expand_braces(pattern)))
