"""Parsing: a TOML document to a frozen ``Config``, key by key as ``schema.py`` says, then the cross-field checks.

Every error is a ``ConfigError`` with a one-line message naming the key, the bad value (hidden for keys that may
hold credentials) and the expected form. ``node.rank``/``node.count`` default from the launcher's environment
variables when ``parse_config`` runs, never at import time.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from typing import Any

from cachefeed._cache.settings import (
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_TURNOVER_PERCENT,
    METADATA_RESERVE_BYTES,
    MIN_SEGMENTS_IN_BUDGET,
    SMALL_CACHE_TURNOVER_PERCENT,
    default_turnover,
)
from cachefeed._cache.sources import MAX_SOURCES
from cachefeed._config.model import DEFAULT_PROCESSES, NO_FILE, Config, SourceConfig
from cachefeed._config.schema import (
    REMOVED,
    REQUIRED,
    SCHEMA,
    SECRET_KEYS,
    SECTION_TYPES,
    SOURCE_SCHEMA,
    SOURCE_SECRET_KEYS,
)
from cachefeed._errors import ConfigError
from cachefeed._images import require_pillow
from cachefeed._units import format_bytes

__all__ = ["BUDGET_FORMULA", "changed_keys", "load_config", "minimum_max_bytes", "parse_config"]


def _unknown(kind: str, name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name.rpartition(".")[2], known, n=1)
    hint = _elsewhere(name.rpartition(".")[2]) or (f"; did you mean {close[0]!r}?" if close else "")
    return f"unknown {kind} {name!r} (expected one of: {', '.join(known)}){hint}"


def _elsewhere(key: str) -> str:
    """Where a key of that name belongs, if another section has it: a key in the wrong section."""
    owners = [section for section, keys in SCHEMA.items() if key in keys]
    if not owners:
        return ""
    return "; " + " or ".join(f"{section}.{key}" for section in owners) + f" belongs in [{owners[0]}]"


def _env_int(env: Mapping[str, str], source: str, *names: str) -> int | None:
    """The first of ``names`` set in ``env``, as an int >= 0; a malformed value is an error, never ignored."""
    for name in names:
        raw = env.get(name, "").strip()
        if not raw:
            continue
        if not raw.isdigit():
            raise ConfigError(
                f"{source}: environment variable {name} = {raw!r}: expected an integer >= 0 "
                "(or set node.rank/node.count in the config)"
            )
        return int(raw)
    return None


def _env_default(
    env: Mapping[str, str], source: str, names: tuple[str, ...], default: int, key: str
) -> tuple[int, str]:
    """A ``[node]`` key's default from the first of ``names`` set in ``env``, and where it came from (for the
    messages: the user wrote neither key)."""
    for name in names:
        value = _env_int(env, source, name)
        if value is not None:
            return value, f"from the environment variable {name}"
    return default, f"the default of {key}"


def parse_config(document: Mapping[str, Any], *, source: str = NO_FILE, env: Mapping[str, str] | None = None) -> Config:
    """Validate a parsed TOML document and return the frozen Config. Raises ConfigError (one line)."""
    env = os.environ if env is None else env
    sections: dict[str, dict[str, object]] = {name: {} for name in SCHEMA}
    sources = _parse_sources(document.get("source"), source)
    for section_name, body in document.items():
        if section_name == "source":
            continue
        if section_name not in SCHEMA:
            if not isinstance(body, dict):  # ``url = ...`` above every table header: a key, not a section
                raise ConfigError(
                    f"{source}: the key {section_name!r} is outside every section: "
                    + (_elsewhere(section_name).removeprefix("; ") or "keys go under a [section] header")
                )
            raise ConfigError(f"{source}: " + _unknown("section", section_name, list(SCHEMA)))
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: [{section_name}] must be a table of keys")
        keys = SCHEMA[section_name]
        for key, raw in body.items():
            if (section_name, key) in REMOVED:
                raise ConfigError(f"{source}: {section_name}.{key} = {raw!r}: {REMOVED[section_name, key]}")
            if key not in keys:
                raise ConfigError(f"{source}: " + _unknown("key", f"{section_name}.{key}", list(keys)))
            field_name, parser, _doc = keys[key]
            try:
                sections[section_name][field_name] = parser(raw)
            except ValueError as exc:
                shown = _shown(raw, is_secret=(section_name, key) in SECRET_KEYS)
                raise ConfigError(f"{source}: {section_name}.{key} = {shown}: {exc}") from None
    if sources and "url" in sections["remote"]:
        raise ConfigError(
            f"{source}: remote.url and [[source]] tables both name the data: move remote.url into a [[source]] "
            "table (with a name) or remove the [[source]] tables"
        )
    for key in PER_SOURCE_KEYS:  # with sources, each table has its own: a [remote] value would be dropped unseen
        if sources and key in sections["remote"]:
            raise ConfigError(
                f"{source}: remote.{key} is set beside [[source]] tables, which each have their own "
                f"(source.{key}): move it into every [[source]] table that needs it"
            )
    for section_name, key in sorted(REQUIRED):
        field_name = SCHEMA[section_name][key][0]
        if sources and (section_name, key) == ("remote", "url"):
            continue
        if field_name not in sections[section_name]:
            raise ConfigError(f"{source}: {section_name}.{key} is required ({SCHEMA[section_name][key][2]})")

    node = sections["node"]
    origins = {key: f"node.{key}" for key in ("rank", "count")}  # where each value came from, for the messages
    if "rank" not in node:
        node["rank"], origins["rank"] = _env_default(env, source, ("NODE_RANK", "GROUP_RANK"), 0, "node.rank")
    if "count" not in node:
        node["count"], origins["count"] = _env_default(env, source, ("NNODES",), 1, "node.count")
        if node["count"] == 0:
            raise ConfigError(
                f"{source}: environment variable NNODES = 0 (the default of node.count): a job has at least one "
                "node; unset it or set node.count in the config"
            )
    if int(node["rank"]) >= int(node["count"]):  # type: ignore[call-overload]
        raise ConfigError(
            f"{source}: node.rank = {node['rank']} ({origins['rank']}) must be below node.count = {node['count']} "
            f"({origins['count']}): set both in the config's [node] table, or both in the environment"
        )
    _check_cross_field(sections, source)

    if sections["remote"].get("catalog_publish") and not (
        sections["remote"].get("catalog") or any(entry.catalog for entry in sources)
    ):
        raise ConfigError(
            f"{source}: remote.catalog_publish = true needs remote.catalog (or a source's catalog): where node 0 "
            "publishes the catalog generations the other nodes read"
        )
    _check_image_size_is_read(sections["sampler"], sources, source)
    for index, entry in enumerate(sources):
        _check_decoder(entry.decode or str(sections["sampler"].get("decode", "npy")), f"source[{index}].decode", source)
    built = {name: SECTION_TYPES[name](**values) for name, values in sections.items()}
    return Config(**built, source=source, sources=tuple(sources))


def _shown(value: object, *, is_secret: bool) -> str:
    """A refused value as an error shows it: hidden for a key that may hold credentials (a URL with a key and
    secret in it), unless it is a ``file:`` URL, a local path, which holds none and which the user needs to see."""
    if is_secret and not (isinstance(value, str) and value.lower().startswith("file:")):
        return "<hidden: may hold credentials>"
    return repr(value)


def changed_keys(running: Config, edited: Config) -> list[str]:
    """The keys whose parsed values differ between two configs, as a file writes them (``cache.max_bytes``,
    ``source[1].weight``; ``[[source]] tables`` where their number differs), in ``SCHEMA``'s order.

    Parsed values, not text: a comment or a ``64MiB`` written ``67108864`` changes nothing, and a default that
    follows another key moves with it (``cache.turnover`` with ``cache.max_bytes``). Only names, never values: some
    keys may hold credentials (``SECRET_KEYS``)."""
    changed = [
        f"{section}.{key}"
        for section, keys in SCHEMA.items()
        for key, (field_name, _parser, _doc) in keys.items()
        if getattr(getattr(running, section), field_name) != getattr(getattr(edited, section), field_name)
    ]
    if len(running.sources) != len(edited.sources):
        return [*changed, "[[source]] tables"]
    for index, (before, after) in enumerate(zip(running.sources, edited.sources, strict=True)):
        changed += [
            f"source[{index}].{key}"
            for key, (field_name, _parser, _doc) in SOURCE_SCHEMA.items()
            if getattr(before, field_name) != getattr(after, field_name)
        ]
    return changed


# ``[remote]`` keys that say what one listing reads: with ``[[source]]`` tables each source sets its own
# (``Config.remote_for``), so the daemon would never read them in ``[remote]`` (``remote.url`` has its own message).
PER_SOURCE_KEYS = ("pattern", "storage_options", "manifest", "catalog")


def _parse_sources(raw: object, source: str) -> list[SourceConfig]:
    """The ``[[source]]`` tables, validated: each key as ``SOURCE_SCHEMA`` says, names and their tags unique."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(entry, dict) for entry in raw):
        raise ConfigError(f"{source}: source must be written as [[source]] tables (name, url, ...), one per source")
    if not raw:
        return []
    if len(raw) > MAX_SOURCES:
        raise ConfigError(f"{source}: {len(raw)} [[source]] tables: at most {MAX_SOURCES} are supported")
    parsed: list[SourceConfig] = []
    tags: dict[int, str] = {}
    for index, body in enumerate(raw):
        values: dict[str, object] = {}
        for key, value in body.items():
            where = f"source[{index}].{key}"
            if key not in SOURCE_SCHEMA:
                raise ConfigError(f"{source}: " + _unknown("key", where, list(SOURCE_SCHEMA)))
            field_name, parser, _doc = SOURCE_SCHEMA[key]
            try:
                values[field_name] = parser(value)
            except ValueError as exc:
                shown = _shown(value, is_secret=key in SOURCE_SECRET_KEYS)
                raise ConfigError(f"{source}: {where} = {shown}: {exc}") from None
        for key in ("name", "url"):
            if key not in values:
                raise ConfigError(f"{source}: source[{index}].{key} is required ({SOURCE_SCHEMA[key][2]})")
        entry = SourceConfig(**values)  # type: ignore[arg-type]
        if entry.manifest and entry.catalog:
            raise ConfigError(
                f"{source}: source[{index}].manifest and source[{index}].catalog both replace the listing: "
                "set one of them"
            )
        clash = tags.get(entry.tag)
        if clash is not None:
            what = "is used twice" if clash == entry.name else f"has the same tag as {clash!r}: rename one"
            raise ConfigError(f"{source}: source[{index}].name = {entry.name!r} {what}")
        tags[entry.tag] = entry.name
        parsed.append(entry)
    return parsed


def _check_image_size_is_read(sampler: Mapping[str, object], sources: list[SourceConfig], source: str) -> None:
    """``sampler.image_size`` is read only by the image decoders (``decode = "image"``, or ``"tar"`` with
    ``decode_images = true``): set for decoders that never read it, it is refused rather than silently ignored."""
    size = sampler.get("image_size")
    if not isinstance(size, tuple):  # None: not set, or 0
        return
    default = str(sampler.get("decode", "npy"))
    decoders = [entry.decode or default for entry in sources] or [default]
    decodes_images = sampler.get("decode_images") is True
    if any(name == "image" or (name == "tar" and decodes_images) for name in decoders):
        return
    shown = size[0] if size[0] == size[1] else list(size)
    where = "sampler.decode" if not sources else "the sources' decode"
    raise ConfigError(
        f'{source}: sampler.image_size = {shown!r} is read only by the image decoders (decode = "image", or '
        f'decode = "tar" with decode_images = true), but {where} is '
        f"{', '.join(repr(name) for name in dict.fromkeys(decoders))}: remove image_size (resize in your "
        "decoder, preprocess or transform) or decode images"
    )


def _check_decoder(decode: str, key: str, source: str) -> None:
    """A source's decoder that needs Pillow needs it installed (the other decoders load at preflight)."""
    if decode == "image":
        try:
            require_pillow()
        except ConfigError as exc:
            raise ConfigError(f"{source}: {key}: {exc}") from None


# The budget floor, as the README's config table and configs/s3-ssd.toml state it (tests check all three agree).
BUDGET_FORMULA = (
    "max_bytes >= 1 MiB metadata reserve + max(max(4, 2 x sampler.processes) x segment_bytes, "
    "2 x segment_bytes + turnover)"
)


def _percent_of(max_bytes: int, percent: float) -> int:
    """``cache.turnover = "P%"`` in bytes: the one rounding (down), for the check and for the daemon."""
    return int(max_bytes * percent / 100)


def minimum_max_bytes(segment_bytes: int, processes: int, turnover_bytes: int | None, percent: float | None) -> int:
    """The least ``cache.max_bytes`` that ``BUDGET_FORMULA`` accepts: room for ``max(4, 2 x processes)`` segments
    (two in flight per sampler) and, after the turnover room, two segments for the cached set, plus the metadata
    reserve. Turnover is either ``turnover_bytes`` or ``percent`` of max_bytes (then the least integer that holds)."""
    floor = max(MIN_SEGMENTS_IN_BUDGET, 2 * processes) * segment_bytes + METADATA_RESERVE_BYTES
    cached_set = 2 * segment_bytes + METADATA_RESERVE_BYTES
    if percent is None:
        return max(floor, cached_set + int(turnover_bytes or 0))
    # max_bytes - _percent_of(max_bytes) never decreases as max_bytes grows: bisect for the least that holds (a walk
    # from the real-valued solution took seconds at a turnover of 99.99999%)
    low, high = 0, max(1, int(cached_set / (1 - percent / 100))) + 2
    while high - _percent_of(high, percent) < cached_set:
        high *= 2
    while low < high:
        middle = (low + high) // 2
        if middle - _percent_of(middle, percent) >= cached_set:
            high = middle
        else:
            low = middle + 1
    return max(floor, low)


def _check_cross_field(sections: dict[str, dict[str, object]], source: str) -> None:
    cache = sections["cache"]
    sampler = sections["sampler"]
    max_bytes = int(cache["max_bytes"])  # type: ignore[call-overload]
    segment_bytes = int(cache.get("segment_bytes", DEFAULT_SEGMENT_BYTES))  # type: ignore[call-overload]
    processes = int(sampler.get("processes", DEFAULT_PROCESSES))  # type: ignore[call-overload]
    turnover = cache.get("turnover_bytes")
    percent: float | None
    if turnover is None:  # the default: 67%, lowered to 50% at most where the budget is small (default_turnover)
        percent = float(SMALL_CACHE_TURNOVER_PERCENT)
        turnover_bytes = default_turnover(max_bytes, segment_bytes)
    else:
        percent = float(turnover[1]) if isinstance(turnover, tuple) else None
        turnover_bytes = _percent_of(max_bytes, percent) if percent is not None else int(turnover)  # type: ignore[call-overload]
    minimum = minimum_max_bytes(segment_bytes, processes, turnover_bytes if percent is None else None, percent)
    if max_bytes < minimum:
        shown = f"{percent:g}% = {turnover_bytes} bytes" if percent is not None else f"{turnover_bytes} bytes"
        if turnover is None:
            shown = (
                f"its default ({DEFAULT_TURNOVER_PERCENT}% of max_bytes, or as little as {percent:g}% in a small cache)"
            )
        raise ConfigError(
            f"{source}: cache.max_bytes = {max_bytes} bytes ({format_bytes(max_bytes)}) is below the minimum of "
            f"{minimum} bytes ({format_bytes(minimum)}) for "
            f"cache.segment_bytes = {segment_bytes} bytes ({format_bytes(segment_bytes)}), sampler.processes = "
            f"{processes} and cache.turnover = {shown}: "
            f"{BUDGET_FORMULA}: raise max_bytes, or lower segment_bytes or turnover"
        )
    cache["turnover_bytes"] = turnover_bytes
    decodes_images = sampler.get("decode") == "image" or sampler.get("decode_images") is True
    if decodes_images:
        try:
            require_pillow()
        except ConfigError as exc:
            key = "sampler.decode" if sampler.get("decode") == "image" else "sampler.decode_images"
            raise ConfigError(f"{source}: {key}: {exc}") from None
    if sampler.get("image_fields") and sampler.get("decode_images") is not True:
        raise ConfigError(
            f"{source}: sampler.image_fields = {list(sampler['image_fields'])!r} names the tar fields that "  # type: ignore[call-overload]
            "decode_images decodes, but sampler.decode_images is not true: set it, or drop image_fields"
        )
    if sampler.get("decode_images") is True and sampler.get("decode") != "tar":
        raise ConfigError(
            f"{source}: sampler.decode_images = true decodes the image members of tar shards, but sampler.decode "
            f'is {sampler.get("decode", "npy")!r}: use decode = "tar", or decode = "image" for one image per object'
        )
    for section, base, cap in (
        ("remote", "backoff_base", "backoff_max"),
        ("sampler", "restart_backoff", "restart_backoff_max"),
    ):
        values = sections[section]
        base_s = values.get(SCHEMA[section][base][0])
        cap_s = values.get(SCHEMA[section][cap][0])
        if base_s is not None and cap_s is not None and float(base_s) > float(cap_s):  # type: ignore[arg-type]
            raise ConfigError(
                f"{source}: {section}.{base} = {base_s}s is above {section}.{cap} = {cap_s}s: expected {base} <= {cap}"
            )
    remote = sections["remote"]
    if remote.get("manifest") and remote.get("catalog"):
        raise ConfigError(f"{source}: remote.manifest and remote.catalog both replace the listing: set one of them")


def load_config(path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a TOML config file. Raises ConfigError with a one-line message."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as handle:
            text = handle.read().decode("utf-8")
        document = tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a TOML file") from None
    except PermissionError:
        raise ConfigError(f"{source}: permission denied reading the config file") from None
    except tomllib.TOMLDecodeError as exc:
        _check_modes_are_written_octal(text, source, {})  # TOML refuses ``0755`` with a message about newlines
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not valid UTF-8 text") from None
    cache = document.get("cache")
    _check_modes_are_written_octal(text, source, cache if isinstance(cache, dict) else {})
    return parse_config(document, source=source, env=env)


# How a file wrote a mode: ``file_mode = 640`` (decimal) or ``0o640``; ``"0640"`` (a string) does not match.
_WRITTEN_MODE = re.compile(
    r"(?<![\w.])(?:cache\.)?(file_mode|dir_mode)[ \t]*=[ \t]*(0[oO][0-7_]+|[0-9][0-9_]*)(?![\w.])"
)


def _check_modes_are_written_octal(text: str, source: str, cache: Mapping[str, Any]) -> None:
    """Refuse ``file_mode = 640``: TOML reads a bare number as decimal (640 is 0o1200, and 440 is 0o670: group
    writable), never as the octal mode it looks like, and refuses ``0755`` (a leading zero) as a syntax error
    (``cache`` is then empty: called on the file that did not parse). The parsed document cannot tell ``416`` from
    ``0o640``, so where ``cache.file_mode`` or ``dir_mode`` came out an int above 7 (where the two readings
    differ), this looks at how the file wrote it; a dict given to ``parse_config`` takes an int as the bits."""
    for key in ("file_mode", "dir_mode"):
        value = cache.get(key)
        if cache and not (isinstance(value, int) and not isinstance(value, bool) and value > 7):
            continue
        written = [found.group(2) for found in _WRITTEN_MODE.finditer(text) if found.group(1) == key]
        if not written or any(form[:2].lower() == "0o" for form in written):
            continue  # not found (then it parsed as something else), or written as an octal literal
        digits = written[0].replace("_", "").lstrip("0") or "0"
        raise ConfigError(
            f"{source}: cache.{key} = {written[0]}: a bare number is decimal in TOML, not an octal mode; write it as "
            f'a string, "0{digits}", or as 0o{digits}'
        )
