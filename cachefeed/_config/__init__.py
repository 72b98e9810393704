"""The daemon's TOML configuration, parsed once into frozen dataclasses.

Every key, its unit and its default is listed in ``SCHEMA``; ``configs/*.toml`` and the README's config reference
are written from it. Sizes ("64MiB") and durations ("5m") are parsed here, so every field after parsing carries
its unit in its name (``max_bytes``, ``refresh_interval_s``).

A bad config raises ``ConfigError`` whose message is one line naming the key, the bad value and the expected
form, e.g. ``cache.max_bytes = '-5GiB': expected a size >= 0``. Nothing here reads the environment at import
time; ``node.rank``/``node.count`` default from the usual launcher variables when ``load_config`` runs.

One job per module:

* ``model.py``: the frozen dataclasses, one per section (``CacheConfig`` is the cache layer's own,
  ``cachefeed/_cache/settings.py``, so that the store never imports this package);
* ``fields.py``: the field parsers, one raw TOML value to one typed value or ``ValueError``;
* ``schema.py``: ``SCHEMA`` and ``SOURCE_SCHEMA``, every key with its field, parser and doc; names are validated
  against the registries that define them (eviction policies, compressions, decoders, label rules, log levels);
* ``parse.py``: ``parse_config`` and ``load_config``, with the cross-field checks; ``changed_keys`` (what an edit of
  the file changed, for the daemon's SIGHUP);
* ``writer.py``: ``toml_text``, for configs that programs generate.
"""

from __future__ import annotations

from cachefeed._cache.settings import CacheConfig
from cachefeed._config.model import (
    Config,
    LogConfig,
    NodeConfig,
    RemoteConfig,
    SamplerConfig,
    SourceConfig,
    StatusConfig,
)
from cachefeed._config.parse import changed_keys, load_config, parse_config
from cachefeed._config.schema import EVICTION_POLICIES, SCHEMA, SOURCE_SCHEMA
from cachefeed._config.writer import toml_text

__all__ = [
    "EVICTION_POLICIES",
    "SCHEMA",
    "SOURCE_SCHEMA",
    "CacheConfig",
    "Config",
    "LogConfig",
    "NodeConfig",
    "RemoteConfig",
    "SamplerConfig",
    "SourceConfig",
    "StatusConfig",
    "changed_keys",
    "load_config",
    "parse_config",
    "toml_text",
]
