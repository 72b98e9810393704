"""The daemon's TOML configuration, parsed once into frozen dataclasses.

Every key, its unit and its default is listed in ``SCHEMA`` below; ``configs/*.toml`` and the README's config
reference are written from it. Sizes ("64MiB") and durations ("5m") are parsed here, so every field after
parsing carries its unit in its name (``max_bytes``, ``refresh_interval_s``).

A bad config raises ``ConfigError`` whose message is one line naming the key, the bad value and the expected
form, e.g. ``cache.max_bytes = '-5GiB': expected a size >= 0``. Nothing here reads the environment at import
time; ``node.rank``/``node.count`` default from the usual launcher variables when ``load_config`` runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachefeed.cache.eviction import POLICIES
from cachefeed.cache.records import COMPRESSIONS
from cachefeed.cache.settings import (
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_TURNOVER_PERCENT,
    METADATA_RESERVE_BYTES,
    MIN_SEGMENTS_IN_BUDGET,
    CacheConfig,
)
from cachefeed.cache.sources import MAX_SOURCES, source_tag
from cachefeed.codecs import BUILTIN_DECODERS
from cachefeed.errors import ConfigError
from cachefeed.images import image_size, require_pillow
from cachefeed.labels import LABEL_RULES
from cachefeed.units import parse_duration, parse_size

__all__ = [
    "CacheConfig",
    "Config",
    "LogConfig",
    "NodeConfig",
    "RemoteConfig",
    "SamplerConfig",
    "SourceConfig",
    "StatusConfig",
    "load_config",
    "parse_config",
    "toml_text",
]

EVICTION_POLICIES = tuple(POLICIES)  # names come from the registries that define them
LOG_LEVELS = ("debug", "info", "warning", "error")
_DEFAULT_PROCESSES = 2


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    url: str = ""  # required unless the data comes from [[source]] tables
    pattern: str = "**"
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    refresh_interval_s: float = 300.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    max_attempts: int = 5
    backoff_base_s: float = 0.1
    backoff_max_s: float = 10.0
    retry_budget: float = 0.2
    max_requests_per_s: float = 0.0
    max_bytes_per_s: int = 0
    verify_md5: bool = True


@dataclass(frozen=True, slots=True)
class SourceConfig:
    """One ``[[source]]`` table: a named remote with its own listing, decoder and share of every epoch.

    ``weight`` is normalised over the config's sources (0.7 and 0.3, or 7 and 3, mean the same); ``decode`` empty
    means ``sampler.decode``. The ``[remote]`` table's other keys (timeouts, retries, rate caps, refresh) apply
    to every source; a rate cap is shared between sources by weight.
    """

    name: str
    url: str
    pattern: str = "**"
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    decode: str = ""
    weight: float = 1.0

    @property
    def tag(self) -> int:
        """The tag its segments carry (``cache/sources.py``)."""
        return source_tag(self.name)


@dataclass(frozen=True, slots=True)
class SamplerConfig:
    processes: int = _DEFAULT_PROCESSES
    concurrency: int = 32
    decode: str = "npy"
    decode_images: bool = False
    image_size: tuple[int, int] | None = None
    label: str = ""
    preprocess: str = ""
    seed: int = 0
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 60.0


@dataclass(frozen=True, slots=True)
class NodeConfig:
    rank: int = 0
    count: int = 1


@dataclass(frozen=True, slots=True)
class StatusConfig:
    interval_s: float = 1.0
    stuck_after_s: float = 600.0
    metrics_port: int = 0
    metrics_textfile: str = ""


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str = "info"


@dataclass(frozen=True, slots=True)
class Config:
    remote: RemoteConfig
    cache: CacheConfig
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    status: StatusConfig = field(default_factory=StatusConfig)
    log: LogConfig = field(default_factory=LogConfig)
    source: str = "<memory>"
    sources: tuple[SourceConfig, ...] = ()  # [[source]] tables; empty: the single [remote] form

    def inputs(self) -> tuple[SourceConfig, ...]:
        """What the daemon reads: the ``[[source]]`` tables, or the single ``[remote]`` as one unnamed source."""
        if self.sources:
            return self.sources
        remote = self.remote
        return (SourceConfig("", remote.url, remote.pattern, remote.storage_options, self.sampler.decode, 1.0),)

    def remote_for(self, source: SourceConfig) -> RemoteConfig:
        """The ``[remote]`` settings with ``source``'s URL, pattern and storage options."""
        return dataclasses.replace(
            self.remote, url=source.url, pattern=source.pattern, storage_options=source.storage_options
        )

    def weights(self) -> tuple[float, ...]:
        """Each input's share of every epoch and of the cache (sums to 1)."""
        inputs = self.inputs()
        total = sum(source.weight for source in inputs)
        return tuple(source.weight / total for source in inputs)


# --------------------------------------------------------------------------------------------------------------
# Field parsers: each takes the raw TOML value and returns the typed one, or raises ValueError("expected ...").


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value


def _nonempty_string(value: object) -> str:
    text = _string(value)
    if not text.strip():
        raise ValueError("expected a non-empty string")
    return text


def _boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError("expected true or false")
    return value


def _int_at_least(low: int) -> Callable[[object], int]:
    def parse(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer >= {low}")
        if value < low:
            raise ValueError(f"expected an integer >= {low}")
        return value

    return parse


def _float_at_least(low: float) -> Callable[[object], float]:
    def parse(value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"expected a number >= {low:g}")
        if value < low:
            raise ValueError(f"expected a number >= {low:g}")
        return float(value)

    return parse


def _port(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError("expected a TCP port from 1 to 65535, or 0 for off")
    return value


def _fraction(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError("expected a number between 0 and 1")
    return float(value)


def _positive_size(value: object) -> int:
    size = parse_size(value)
    if size <= 0:
        raise ValueError("expected a size > 0 such as 64MiB")
    return size


def _positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError("expected a duration > 0 such as 30s")
    return seconds


def _duration(value: object) -> float:
    seconds = parse_duration(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError("expected a duration >= 0 such as 5m")
    return seconds


def _one_of(choices: tuple[str, ...]) -> Callable[[object], str]:
    def parse(value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError("expected one of " + ", ".join(repr(c) for c in choices))
        return value

    return parse


def _callable_path(value: object) -> str:
    text = _string(value)
    if text and (":" not in text or not all(text.partition(":")[::2])):
        raise ValueError('expected "package.module:function"')
    return text


def _decoder(value: object) -> str:
    text = _string(value)
    if text in BUILTIN_DECODERS:
        return text
    try:
        return _callable_path(text) if text else _one_of(BUILTIN_DECODERS)(text)
    except ValueError:
        raise ValueError("expected one of " + ", ".join(BUILTIN_DECODERS) + ' or "package.module:function"') from None


def _image_size(value: object) -> tuple[int, int] | None:
    return image_size(value)  # type: ignore[arg-type]  # it checks the type itself


def _label_rule(value: object) -> str:
    text = _string(value)
    return text if not text else _one_of(LABEL_RULES)(text)


def _absolute_path(value: object) -> Path:
    text = _nonempty_string(value)
    path = Path(text)
    if not path.is_absolute():
        raise ValueError("expected an absolute path such as /dev/shm/cachefeed/example")
    if any(part == ".." for part in path.parts):
        raise ValueError("expected a path without '..'")
    return path


def _url(value: object) -> str:
    text = _nonempty_string(value)
    if "\n" in text or "\0" in text:
        raise ValueError("expected a URL on one line")
    return text


def _table(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError('expected a table such as { endpoint_url = "http://127.0.0.1:9000" }')
    return dict(value)


def _mode(value: object) -> int:
    if isinstance(value, str):
        try:
            mode = int(value, 8)
        except ValueError:
            raise ValueError('expected an octal mode such as "0640"') from None
    elif isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        raise ValueError('expected an octal mode such as "0640"')
    if not 0 <= mode <= 0o777:
        raise ValueError('expected an octal mode between "0000" and "0777"')
    return mode


def _turnover(value: object) -> object:
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
    except ValueError:
        raise ValueError('expected a size such as 2GiB or a percentage of max_bytes such as "25%"') from None


# --------------------------------------------------------------------------------------------------------------
# The schema: section -> key -> (field name, parser, doc). A key without a default in the dataclass is required.

Parser = Callable[[object], object]
SCHEMA: dict[str, dict[str, tuple[str, Parser, str]]] = {
    "remote": {
        "url": ("url", _url, "fsspec URL of the dataset root: s3://bucket/prefix, file:///data, memory://x"),
        "pattern": ("pattern", _nonempty_string, 'glob under url selecting the objects (default "**")'),
        "storage_options": ("storage_options", _table, "passed to fsspec as is (endpoint_url, key, ...)"),
        "refresh_interval": ("refresh_interval_s", _positive_duration, "re-list the remote this often (5m)"),
        "connect_timeout": ("connect_timeout_s", _positive_duration, "TCP connect timeout per request (5s)"),
        "read_timeout": ("read_timeout_s", _positive_duration, "socket read timeout per request (30s)"),
        "max_attempts": ("max_attempts", _int_at_least(1), "attempts per object, first included (5)"),
        "backoff_base": ("backoff_base_s", _positive_duration, "full-jitter backoff base (100ms)"),
        "backoff_max": ("backoff_max_s", _positive_duration, "full-jitter backoff cap (10s)"),
        "retry_budget": ("retry_budget", _fraction, "retries allowed as a fraction of requests (0.2)"),
        "max_requests_per_s": ("max_requests_per_s", _float_at_least(0), "request rate cap per node, 0 = none"),
        "max_bytes_per_s": ("max_bytes_per_s", parse_size, "download rate cap per node, 0 = none"),
        "verify_md5": ("verify_md5", _boolean, "check a body against an ETag that is its MD5 (true)"),
    },
    "cache": {
        "dir": ("dir", _absolute_path, "absolute path of the cache root (tmpfs or SSD)"),
        "max_bytes": ("max_bytes", _positive_size, "hard bound on everything under dir"),
        "min_free_bytes": ("min_free_bytes", parse_size, "free space the filesystem keeps (1GiB)"),
        "segment_bytes": ("segment_bytes", _positive_size, "target size of one segment file (64MiB)"),
        "eviction": ("eviction", _one_of(EVICTION_POLICIES), 'which segment goes first ("fifo")'),
        "evict_after_reads": (
            "evict_after_reads",
            _int_at_least(0),
            "epochs that must read a segment before it may be evicted; 0 = evict by age alone (1)",
        ),
        "snapshot_grace": (
            "snapshot_grace_s",
            _duration,
            "how long a dead trainer's snapshot is kept so its job can resume the epoch (5m)",
        ),
        "turnover": ("turnover_bytes", _turnover, 'room kept for fresh samples while pinned ("25%")'),
        "compression": ("compression", _one_of(COMPRESSIONS), 'per-record compression ("none")'),
        "fsync": ("fsync", _boolean, "fsync a segment before publishing it (true; free on tmpfs)"),
        "file_mode": ("file_mode", _mode, 'mode of files in the cache ("0640")'),
        "dir_mode": ("dir_mode", _mode, 'mode of directories in the cache ("0750")'),
    },
    "sampler": {
        "processes": ("processes", _int_at_least(1), "sampler subprocesses (2)"),
        "concurrency": ("concurrency", _int_at_least(1), "requests in flight per process (32)"),
        "decode": ("decode", _decoder, 'npy, npz, pt, msgpack, raw, tar, image or "pkg.mod:fn" ("npy")'),
        "decode_images": (
            "decode_images",
            _boolean,
            "decode the image members of tar shards to uint8 (3, H, W) arrays in the daemon (false)",
        ),
        "image_size": (
            "image_size",
            _image_size,
            "resize (shorter side) and centre-crop decoded images to N or [height, width]; 0 keeps sizes (0)",
        ),
        "label": ("label", _label_rule, 'an int "label" field per sample: "parent" = its directory\'s class ("")'),
        "preprocess": ("preprocess", _callable_path, 'deterministic "pkg.mod:fn" run once per sample ("")'),
        "seed": ("seed", _int_at_least(0), "seed of the sampling permutations (0)"),
        "restart_backoff": ("restart_backoff_s", _positive_duration, "first restart delay of a sampler (1s)"),
        "restart_backoff_max": ("restart_backoff_max_s", _positive_duration, "restart delay cap (60s)"),
    },
    "node": {
        "rank": ("rank", _int_at_least(0), "this node's index (default $NODE_RANK or $GROUP_RANK or 0)"),
        "count": ("count", _int_at_least(1), "number of nodes (default $NNODES or 1)"),
    },
    "status": {
        "interval": ("interval_s", _positive_duration, "status publication interval (1s)"),
        "stuck_after": (
            "stuck_after_s",
            _positive_duration,
            "a pinned snapshot nobody has read from for this long while fetching waits: degraded (10m)",
        ),
        "metrics_port": ("metrics_port", _port, "Prometheus HTTP port on 127.0.0.1, 0 = off (0)"),
        "metrics_textfile": ("metrics_textfile", _string, "node-exporter textfile path, empty = off"),
    },
    "log": {
        "level": ("level", _one_of(LOG_LEVELS), 'debug, info, warning or error ("info")'),
    },
}

_SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _source_name(value: object) -> str:
    text = _string(value)
    if not _SOURCE_NAME.match(text):
        raise ValueError("expected a name of letters, digits and _.- (at most 64, starting with a letter or digit)")
    return text


def _weight(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError("expected a number > 0 (its share relative to the other sources' weights)")
    return float(value)


# [[source]] tables (an array of tables, so not a section of SCHEMA): key -> (field name, parser, doc)
SOURCE_SCHEMA: dict[str, tuple[str, Parser, str]] = {
    "name": ("name", _source_name, "letters, digits and _.- (at most 64): names the source everywhere"),
    "url": ("url", _url, "fsspec URL of this source's root, as remote.url"),
    "pattern": ("pattern", _nonempty_string, 'glob under url, as remote.pattern (default "**")'),
    "storage_options": ("storage_options", _table, "passed to fsspec as is, as remote.storage_options"),
    "decode": ("decode", _decoder, "this source's decoder (default: sampler.decode)"),
    "weight": ("weight", _weight, "its share of every epoch and of the cache, relative to the others (1)"),
}
_SOURCE_SECRET_KEYS = {"url", "storage_options"}


_SECTION_TYPES: dict[str, type] = {
    "remote": RemoteConfig,
    "cache": CacheConfig,
    "sampler": SamplerConfig,
    "node": NodeConfig,
    "status": StatusConfig,
    "log": LogConfig,
}
_SECRET_KEYS = {("remote", "url"), ("remote", "storage_options")}  # never echoed in errors
_REQUIRED = {("remote", "url"), ("cache", "dir"), ("cache", "max_bytes")}
_REMOVED = {  # keys earlier versions took: what to do instead
    ("cache", "max_samples"): (
        "removed: a sample count could not be a hard bound (a segment's samples are known only once written, and "
        "snapshots keep evicted ones); bound the cache with cache.max_bytes and delete this line"
    ),
}


def _unknown(kind: str, name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name.rpartition(".")[2], known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown {kind} {name!r} (expected one of: {', '.join(known)}){hint}"


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


def parse_config(
    document: Mapping[str, Any], *, source: str = "<memory>", env: Mapping[str, str] | None = None
) -> Config:
    """Validate a parsed TOML document and return the frozen Config. Raises ConfigError (one line)."""
    env = os.environ if env is None else env
    sections: dict[str, dict[str, object]] = {name: {} for name in SCHEMA}
    sources = _parse_sources(document.get("source"), source)
    for section_name, body in document.items():
        if section_name == "source":
            continue
        if section_name not in SCHEMA:
            raise ConfigError(f"{source}: " + _unknown("section", section_name, list(SCHEMA)))
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: [{section_name}] must be a table of keys")
        keys = SCHEMA[section_name]
        for key, raw in body.items():
            if (section_name, key) in _REMOVED:
                raise ConfigError(f"{source}: {section_name}.{key} = {raw!r}: {_REMOVED[section_name, key]}")
            if key not in keys:
                raise ConfigError(f"{source}: " + _unknown("key", f"{section_name}.{key}", list(keys)))
            field_name, parser, _doc = keys[key]
            try:
                sections[section_name][field_name] = parser(raw)
            except ValueError as exc:
                shown = "<hidden: may hold credentials>" if (section_name, key) in _SECRET_KEYS else repr(raw)
                raise ConfigError(f"{source}: {section_name}.{key} = {shown}: {exc}") from None
    if sources and "url" in sections["remote"]:
        raise ConfigError(
            f"{source}: remote.url and [[source]] tables both name the data: move remote.url into a [[source]] "
            "table (with a name) or remove the [[source]] tables"
        )
    for section_name, key in sorted(_REQUIRED):
        field_name = SCHEMA[section_name][key][0]
        if sources and (section_name, key) == ("remote", "url"):
            continue
        if field_name not in sections[section_name]:
            raise ConfigError(f"{source}: {section_name}.{key} is required ({SCHEMA[section_name][key][2]})")

    node = sections["node"]
    if "rank" not in node:
        node["rank"] = _env_int(env, source, "NODE_RANK", "GROUP_RANK") or 0
    if "count" not in node:
        node["count"] = _env_int(env, source, "NNODES") or 1
    _check_cross_field(sections, source)

    for index, entry in enumerate(sources):
        _check_decoder(entry.decode or str(sections["sampler"].get("decode", "npy")), f"source[{index}].decode", source)
    built = {name: _SECTION_TYPES[name](**values) for name, values in sections.items()}
    return Config(**built, source=source, sources=tuple(sources))


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
                shown = "<hidden: may hold credentials>" if key in _SOURCE_SECRET_KEYS else repr(value)
                raise ConfigError(f"{source}: {where} = {shown}: {exc}") from None
        for key in ("name", "url"):
            if key not in values:
                raise ConfigError(f"{source}: source[{index}].{key} is required ({SOURCE_SCHEMA[key][2]})")
        entry = SourceConfig(**values)  # type: ignore[arg-type]
        clash = tags.get(entry.tag)
        if clash is not None:
            what = "is used twice" if clash == entry.name else f"has the same tag as {clash!r}: rename one"
            raise ConfigError(f"{source}: source[{index}].name = {entry.name!r} {what}")
        tags[entry.tag] = entry.name
        parsed.append(entry)
    return parsed


def _check_decoder(decode: str, key: str, source: str) -> None:
    """A source's decoder that needs Pillow needs it installed (the other decoders load at preflight)."""
    if decode == "image":
        try:
            require_pillow()
        except ConfigError as exc:
            raise ConfigError(f"{source}: {key}: {exc}") from None


def _check_cross_field(sections: dict[str, dict[str, object]], source: str) -> None:
    cache = sections["cache"]
    sampler = sections["sampler"]
    node = sections["node"]
    max_bytes = int(cache["max_bytes"])  # type: ignore[call-overload]
    segment_bytes = int(cache.get("segment_bytes", DEFAULT_SEGMENT_BYTES))  # type: ignore[call-overload]
    processes = int(sampler.get("processes", _DEFAULT_PROCESSES))  # type: ignore[call-overload]
    floor = max(MIN_SEGMENTS_IN_BUDGET, 2 * processes) * segment_bytes + METADATA_RESERVE_BYTES
    if max_bytes < floor:
        raise ConfigError(
            f"{source}: cache.max_bytes = {max_bytes} bytes is below {floor} bytes "
            f"(max({MIN_SEGMENTS_IN_BUDGET}, 2 x sampler.processes) x cache.segment_bytes + 1 MiB metadata): "
            "raise max_bytes or lower segment_bytes"
        )
    turnover = cache.get("turnover_bytes", ("percent", float(DEFAULT_TURNOVER_PERCENT)))
    if isinstance(turnover, tuple):
        turnover = int(max_bytes * float(turnover[1]) / 100)
    turnover_bytes = int(turnover)  # type: ignore[call-overload]
    if turnover_bytes > max_bytes - METADATA_RESERVE_BYTES - 2 * segment_bytes:
        raise ConfigError(
            f"{source}: cache.turnover = {turnover_bytes} bytes leaves less than two segments for the "
            "cached set: lower turnover or raise max_bytes"
        )
    cache["turnover_bytes"] = turnover_bytes
    decodes_images = sampler.get("decode") == "image" or sampler.get("decode_images") is True
    if decodes_images:
        try:
            require_pillow()
        except ConfigError as exc:
            key = "sampler.decode" if sampler.get("decode") == "image" else "sampler.decode_images"
            raise ConfigError(f"{source}: {key}: {exc}") from None
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
    if int(node["rank"]) >= int(node["count"]):  # type: ignore[call-overload]
        raise ConfigError(f"{source}: node.rank = {node['rank']} must be below node.count = {node['count']}")


def load_config(path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a TOML config file. Raises ConfigError with a one-line message."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as handle:
            document = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a TOML file") from None
    except PermissionError:
        raise ConfigError(f"{source}: permission denied reading the config file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not valid UTF-8 text") from None
    return parse_config(document, source=source, env=env)


# --------------------------------------------------------------------------------------------------------------
# Writing a config: for configs that programs generate (the demo, the tests, the benchmarks).

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
