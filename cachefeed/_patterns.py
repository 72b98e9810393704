"""The matcher of ``remote.pattern``: fsspec glob syntax (``*``, ``**``, ``?``, ``[...]``) plus brace lists."""

from __future__ import annotations

import re

__all__ = ["compile_pattern", "expand_braces", "unbalanced_brace"]


def unbalanced_brace(pattern: str) -> int | None:
    """The index of the first brace of ``pattern`` without its pair (a ``{`` never closed, or a ``}`` never
    opened), or None; a brace inside a bracket expression (``[{]``) is a character, not a brace. ``expand_braces``
    would take an unpaired brace literally: the config refuses it as a typo."""
    opened: list[int] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "[":
            end = pattern.find("]", i + 2 if pattern[i + 1 : i + 2] in ("!", "^", "]") else i + 1)
            if end > 0:
                i = end + 1
                continue
        if char == "{":
            opened.append(i)
        elif char == "}":
            if not opened:
                return i
            opened.pop()
        i += 1
    return opened[0] if opened else None


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
    from fsspec.utils import glob_translate  # here, not at import: the config imports this module (trainers too)

    return re.compile("|".join(f"(?:{glob_translate(p)})" for p in expand_braces(pattern)))
