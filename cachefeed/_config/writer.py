"""Writing a config: ``toml_text`` for configs that programs generate (the demo, the tests, the benchmarks)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["toml_text"]

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_text(document: Mapping[str, Any]) -> str:
    """``{section: {key: value}}`` as TOML text that ``load_config`` reads back to the same values; a list of
    tables (``{"source": [{...}, {...}]}``) becomes ``[[source]]`` tables.

    Values: bool, int, float, str (or a path), and tables of those (``storage_options``). Strings are TOML basic
    strings with JSON escapes, which TOML shares; a key that is not a bare key is quoted the same way.
    """
    lines: list[str] = []
    for section, body in document.items():
        is_array = isinstance(body, list | tuple)  # a list of tables ([[source]]): one [[section]] header each
        for table in body if is_array else [body]:
            lines.append(f"[[{_toml_key(section)}]]" if is_array else f"[{_toml_key(section)}]")
            lines += [f"{_toml_key(key)} = {_toml_value(value)}" for key, value in table.items()]
            lines.append("")
    return "\n".join(lines)


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"cannot write {value!r} as a config value")
        return repr(value)
    if isinstance(value, str | os.PathLike):
        return json.dumps(os.fspath(value))
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as a config value")
