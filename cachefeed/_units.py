"""Human sizes and durations ("64GiB", "5m") parsed once, at the edge, into ints and floats.

Sizes: an integer number of bytes, or a number with a unit: B, KB/MB/GB/TB (powers of 1000),
KiB/MiB/GiB/TiB (powers of 1024). Durations: a number of seconds, or a number with ms, s, m, h or d.
"""

from __future__ import annotations

import re

__all__ = ["format_bytes", "format_duration", "parse_duration", "parse_size"]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "k": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tib": 1024**4,
}
_DURATION_UNITS = {"": 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """Return a size in bytes. Raises ValueError naming the accepted forms."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 64MiB or 1073741824")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("expected a size >= 0")
        return value
    if isinstance(value, str):
        match = _NUMBER_UNIT.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
        if value.strip().startswith("-"):
            raise ValueError("expected a size >= 0")
    raise ValueError("expected a size such as 64MiB, 8GiB, 500MB or an integer number of bytes")


def parse_duration(value: object) -> float:
    """Return a duration in seconds. Raises ValueError naming the accepted forms."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s or 5m")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("expected a duration >= 0")
        return float(value)
    if isinstance(value, str):
        match = _NUMBER_UNIT.match(value)
        if match and match.group(2).lower() in _DURATION_UNITS:
            return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]
        if value.strip().startswith("-"):
            raise ValueError("expected a duration >= 0")
    raise ValueError("expected a duration such as 500ms, 30s, 5m, 1h or a number of seconds")


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - loop always returns


def format_duration(seconds: float) -> str:
    """75 -> '1m15s'."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
