"""Field parsers: each takes one raw TOML value and returns the typed one, or raises ``ValueError("expected ...")``.

``schema.py`` pairs every config key with one of these; ``parse.py`` turns the ``ValueError`` into a one-line
``ConfigError`` naming the key and the value. A parser of names checks them against the registry of the module
that defines them (``POLICIES`` in ``_cache/eviction.py`` is checked in ``schema.py``, ``BUILTIN_DECODERS`` in
``_codecs.py``, ``LABEL_RULES`` in ``_labels.py``): no list of names is written twice.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachefeed import _images as images
from cachefeed._codecs import BUILTIN_DECODERS
from cachefeed._labels import LABEL_RULES
from cachefeed._patterns import unbalanced_brace
from cachefeed._units import parse_duration, parse_size

__all__ = [
    "absolute_path",
    "boolean",
    "callable_path",
    "decoder",
    "duration",
    "float_at_least",
    "fraction",
    "image_fields",
    "image_size",
    "int_at_least",
    "ip_address",
    "label_rule",
    "mode",
    "nonempty_string",
    "one_of",
    "port",
    "positive_duration",
    "positive_size",
    "source_name",
    "string",
    "table",
    "turnover",
    "url",
    "weight",
]


def string(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value


def nonempty_string(value: object) -> str:
    text = string(value)
    if not text.strip():
        raise ValueError("expected a non-empty string")
    return text


def glob_pattern(value: object) -> str:
    """A non-empty glob (``_patterns.py``) whose braces pair up."""
    text = nonempty_string(value)
    at = unbalanced_brace(text)
    if at is not None:
        raise ValueError(
            f"the {text[at]!r} at position {at} has no pair: write {{a,b}} for alternatives, with each brace closed"
        )
    return text


def boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError("expected true or false")
    return value


def int_at_least(low: int) -> Callable[[object], int]:
    def parse(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer >= {low}")
        if value < low:
            raise ValueError(f"expected an integer >= {low}")
        return value

    return parse


def float_at_least(low: float) -> Callable[[object], float]:
    def parse(value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"expected a number >= {low:g}")
        if value < low:
            raise ValueError(f"expected a number >= {low:g}")
        return float(value)

    return parse


def ip_address(value: object) -> str:
    """An IPv4 or IPv6 address to listen on, such as "127.0.0.1", "0.0.0.0" or "::"."""
    text = string(value)
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise ValueError('expected an IP address such as "127.0.0.1", "0.0.0.0" (every interface) or "::"') from None


def port(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError("expected a TCP port from 1 to 65535, or 0 for off")
    return value


def fraction(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError("expected a number between 0 and 1")
    return float(value)


def positive_size(value: object) -> int:
    return parse_size(value, minimum=1)


def positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError("expected a duration > 0 such as 30s")
    return seconds


def duration(value: object) -> float:
    seconds = parse_duration(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError("expected a duration >= 0 such as 5m")
    return seconds


def one_of(choices: tuple[str, ...]) -> Callable[[object], str]:
    def parse(value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError("expected one of " + ", ".join(repr(c) for c in choices))
        return value

    return parse


def callable_path(value: object) -> str:
    text = string(value)
    if text and (":" not in text or not all(text.partition(":")[::2])):
        raise ValueError('expected "package.module:function"')
    return text


def decoder(value: object) -> str:
    text = string(value)
    if text in BUILTIN_DECODERS:
        return text
    try:
        return callable_path(text) if text else one_of(BUILTIN_DECODERS)(text)
    except ValueError:
        raise ValueError("expected one of " + ", ".join(BUILTIN_DECODERS) + ' or "package.module:function"') from None


def image_size(value: object) -> tuple[int, int] | None:
    return images.image_size(value)  # type: ignore[arg-type]  # it checks the type itself


def image_fields(value: object) -> tuple[str, ...]:
    """Tar field names (``"jpg"``, ``"left.jpg"``), each ending in an image format of ``_images.IMAGE_EXTENSIONS``."""
    formats = ", ".join(sorted(images.IMAGE_EXTENSIONS))
    if not isinstance(value, list) or not all(isinstance(name, str) and name.strip() for name in value):
        raise ValueError(f'expected a list of tar field names such as ["jpg", "left.jpg"], each ending in {formats}')
    for name in value:
        if name.rsplit(".", 1)[-1].lower() not in images.IMAGE_EXTENSIONS:
            raise ValueError(f"{name!r} is not an image field: a field's last extension must be one of {formats}")
    return tuple(value)


def label_rule(value: object) -> str:
    text = string(value)
    return text if not text else one_of(LABEL_RULES)(text)


def absolute_path(value: object) -> Path:
    text = nonempty_string(value)
    path = Path(text)
    if not path.is_absolute():
        raise ValueError("expected an absolute path such as /dev/shm/cachefeed/example")
    if any(part == ".." for part in path.parts):
        raise ValueError("expected a path without '..'")
    return path


def url(value: object) -> str:
    text = nonempty_string(value)
    if "\n" in text or "\0" in text:
        raise ValueError("expected a URL on one line")
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() == "file" and not rest.startswith("/"):  # file://data/x is "data/x" in the cwd
        raise ValueError(
            f"expected an absolute path after file:// (three slashes: file:///{rest}); file://{rest} would be read "
            "relative to the daemon's working directory"
        )
    return text


def optional_url(value: object) -> str:
    """A URL, or "" for none."""
    if value == "":
        return ""
    return url(value)


def table(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError('expected a table such as { endpoint_url = "http://127.0.0.1:9000" }')
    return dict(value)


def mode(value: object) -> int:
    if isinstance(value, str):
        try:
            bits = int(value, 8)
        except ValueError:
            raise ValueError('expected an octal mode such as "0640"') from None
    elif isinstance(value, int) and not isinstance(value, bool):
        bits = value
    else:
        raise ValueError('expected an octal mode such as "0640"')
    if not 0 <= bits <= 0o777:
        raise ValueError('expected an octal mode between "0000" and "0777"')
    return bits


def turnover(value: object) -> object:
    """A size, or a percentage of max_bytes ("25%"); resolved against max_bytes after parsing."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            raise ValueError('expected a size such as 2GiB or a percentage of max_bytes such as "25%"') from None
        if not 0 <= percent < 100:
            raise ValueError('expected a percentage of max_bytes from "0%" to below "100%"')
        return ("percent", percent)
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f'{exc}; or a percentage of max_bytes such as "25%"') from None


_SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def source_name(value: object) -> str:
    text = string(value)
    if not _SOURCE_NAME.match(text):
        raise ValueError("expected a name of letters, digits and _.- (at most 64, starting with a letter or digit)")
    return text


def weight(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError("expected a number > 0 (its share relative to the other sources' weights)")
    return float(value)
