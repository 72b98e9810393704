"""Human sizes and durations ("64GiB", "5m") parsed once, at the edge, into ints and floats.

Sizes: an integer number of bytes, or a number with a unit: B, KB/MB/GB/TB (powers of 1000),
KiB/MiB/GiB/TiB (powers of 1024), spelled exactly so (case-sensitive, no space: ``SIZE_FORMS``). Durations: a
number of seconds, or a number with ms, s, m, h or d.
"""

from __future__ import annotations

import re

__all__ = ["SIZE_FORMS", "format_bytes", "format_duration", "parse_duration", "parse_size"]

# One spelling per unit, case-sensitive, written right after the number ("500MB", never "500 MB" or "500mb"): a
# size in a config is read by people who must not wonder whether "m" meant 10**6 or 2**20.
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
}
SIZE_FORMS = (
    "an integer number of bytes, or a number with one of the units B, KB, MB, GB, TB (powers of 1000), KiB, MiB, "
    "GiB, TiB (powers of 1024), spelled exactly so with no space, such as 64MiB or 500MB"
)
_SIZE = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([A-Za-z]*)$")
_DURATION_UNITS = {"": 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, *, minimum: int = 0) -> int:
    """Return a size in bytes, at least ``minimum`` (0 or 1). Raises ValueError naming the accepted forms.

    Accepted: an int, or a string of a number and one of ``_SIZE_UNITS``' spellings with nothing around them.
    The message of every refusal states the same bound (``>= 0`` or ``> 0``), whatever was wrong.
    """
    bound = "a size >= 0" if minimum <= 0 else "a size > 0" if minimum == 1 else f"a size >= {minimum}"
    if isinstance(value, int) and not isinstance(value, bool):
        if value < minimum:
            raise ValueError(f"expected {bound}: {SIZE_FORMS}")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2) in _SIZE_UNITS:
            size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])
            if size >= minimum:
                return size
        elif match:
            lower = match.group(2).lower()  # "10gb" or "8g": the unit meant, in its one spelling
            meant = next((unit for unit in _SIZE_UNITS if unit and unit.lower() in (lower, lower + "ib")), None)
            hint = f" (did you mean {match.group(1)}{meant}?)" if meant else ""
            raise ValueError(f"unknown unit {match.group(2)!r}{hint}: expected {bound}: {SIZE_FORMS}")
    raise ValueError(f"expected {bound}: {SIZE_FORMS}")


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
