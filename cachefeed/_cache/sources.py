"""Named, weighted sources: the tag each segment carries, and the cache's ``sources.json`` that names the tags.

A daemon configured with ``[[source]]`` tables (``cachefeed/_config/``) reads several remotes. Every segment holds
samples of one source only and names it by a **tag** in its trailer (``records.py``): a u32 derived from the
source's name (``source_tag``), so the same name gives the same tag on every node, across restarts and config
edits. Tag 0 means "the one unnamed remote" of the single ``[remote]`` form.

``sources.json`` (written by the daemon at start, read by trainers) lists the configured sources::

    {"version": 1, "sources": [{"name": "crawl", "tag": 123, "weight": 0.7}, ...]}

``made_with.json`` (written by the daemon; trainers read its URLs and patterns, ``cached_data``) records, per tag,
the settings that decide what a
source's cached samples *are*: its URL and pattern, the decoder and image settings, the label and preprocess, and
the node's share. A daemon started over a cache whose samples of a source were made under other settings evicts
them, naming what changed (``changed_settings``): a cache kept across a config edit never serves samples of the
old remote, of a split the new pattern leaves out, decoded at another size, or owned by another node now. The
listing's own mechanics (a manifest, a catalog, timeouts, credentials) are not in it: they decide how objects are
found, not what a sample is.

Weights are normalised to sum to 1. Each epoch's snapshot copies ``{tag: weight}`` into its MANIFEST
(``snapshots.py``), so every rank and a resumed job draw the same weighted order even if the daemon's config
changes meanwhile. Samples of a named source carry its name in the field ``SOURCE_FIELD`` (added when a trainer
reads them, not stored per record).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from cachefeed._fsutil import atomic_write, read_regular

__all__ = [
    "MAX_SOURCES",
    "SOURCE_FIELD",
    "SourceEntry",
    "cached_data",
    "changed_settings",
    "read_made_with",
    "read_sources",
    "source_tag",
    "write_made_with",
    "write_sources",
]

SOURCE_FIELD = "__source__"
MAX_SOURCES = 32  # bounds what a snapshot's MANIFEST copies (the budget's per-snapshot room, layout.py)
_VERSION = 1
_MAX_MADE_WITH_BYTES = 1 << 20  # 32 sources' settings take a few KiB


def source_tag(name: str) -> int:
    """The tag of source ``name``: xxh32 of its UTF-8 bytes, never 0 (0 is the unnamed remote)."""
    return xxhash.xxh32_intdigest(name.encode()) or 1


@dataclass(frozen=True, slots=True)
class SourceEntry:
    name: str
    tag: int
    weight: float  # normalised: the weights of a cache's sources sum to 1


def write_sources(path: str | os.PathLike[str], entries: list[SourceEntry], *, mode: int = 0o640) -> None:
    """Replace ``sources.json`` atomically (the daemon, at start)."""
    document = {
        "version": _VERSION,
        "sources": [{"name": e.name, "tag": e.tag, "weight": e.weight} for e in entries],
    }
    atomic_write(path, json.dumps(document, indent=1).encode(), mode=mode)


def write_made_with(
    path: str | os.PathLike[str], settings: Mapping[int, Mapping[str, Any]], *, mode: int = 0o640
) -> None:
    """Replace ``made_with.json`` atomically: ``{tag: {setting: value}}`` (module docstring; the daemon, at start)."""
    document = {"version": _VERSION, "sources": {str(tag): dict(values) for tag, values in settings.items()}}
    atomic_write(path, json.dumps(document, indent=1, sort_keys=True).encode(), mode=mode)


def read_made_with(path: str | os.PathLike[str]) -> tuple[dict[int, dict[str, Any]], str]:
    """What ``write_made_with`` wrote, and "" ; or ``{}`` and why the file says nothing: "" without it (a cache from
    before it, or new: nothing to compare with), else the damage (unreadable, not a regular file, empty, or not the
    record the daemon writes, which always names a source)."""
    try:
        raw = read_regular(path, _MAX_MADE_WITH_BYTES)  # a planted FIFO never blocks the start
    except FileNotFoundError:
        return {}, ""
    except OSError as exc:
        return {}, f"cannot be read: {exc.strerror or exc}"
    try:
        document = json.loads(raw)
        record = {int(tag): dict(values) for tag, values in document["sources"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        record = {}
    if record:
        return record, ""
    return {}, "not the record the daemon writes" if raw else "empty"


def cached_data(path: str | os.PathLike[str]) -> list[str] | None:
    """What a cache holds samples of, as a checkpoint records it (``_trainer/resume.py``, setting ``data``): one
    ``"URL PATTERN"`` per source (URLs as ``made_with.json`` keeps them: no password), sorted; None where the file
    says nothing (no daemon wrote it yet, or it is damaged): unknown, never compared."""
    record, _why = read_made_with(path)
    if not record:
        return None
    return sorted(f"{values.get('url')} {values.get('pattern')}" for values in record.values())


def changed_settings(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``"key = old -> new"`` for each setting of ``now`` whose value differs from ``before``'s (one that
    ``before`` lacks, from an older cachefeed, is not a change)."""
    return [
        f"{key} = {before[key]!r} -> {value!r}" for key, value in now.items() if key in before and before[key] != value
    ]


def read_sources(path: str | os.PathLike[str]) -> list[SourceEntry]:
    """The sources a cache's daemon reads; ``[]`` without the file (one unnamed remote) or if it is unreadable."""
    try:
        document = json.loads(Path(path).read_bytes())
        return [
            SourceEntry(str(entry["name"]), int(entry["tag"]), float(entry["weight"])) for entry in document["sources"]
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return []
