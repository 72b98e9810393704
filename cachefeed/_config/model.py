"""The parsed config: frozen dataclasses, one per TOML section, whose fields carry their units.

``CacheConfig`` (the ``[cache]`` section) is the cache layer's own (``_cache/settings.py``): a ``CacheStore`` takes it
without the rest of the config. Defaults here are the defaults of a config file (``schema.py`` lists each key).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cachefeed._cache.settings import CacheConfig
from cachefeed._cache.sources import source_tag

__all__ = [
    "DEFAULT_PROCESSES",
    "NO_FILE",
    "Config",
    "LogConfig",
    "NodeConfig",
    "RemoteConfig",
    "SamplerConfig",
    "SourceConfig",
    "StatusConfig",
]

DEFAULT_PROCESSES = 2
NO_FILE = "<memory>"  # ``Config.source`` of a config parsed from a document in memory, read from no file


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    url: str = ""  # required unless the data comes from [[source]] tables
    pattern: str = "**"
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    refresh_interval_s: float = 300.0
    manifest: str = ""  # a key list or an S3 Inventory manifest.json: read instead of listing
    catalog: str = ""  # a shared catalog's directory (cachefeed catalog build): read instead of listing
    catalog_publish: bool = False  # node 0 lists and publishes generations under catalog; the others read them
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
    manifest: str = ""
    catalog: str = ""
    decode: str = ""
    weight: float = 1.0

    @property
    def tag(self) -> int:
        """The tag its segments carry (``_cache/sources.py``)."""
        return source_tag(self.name)


@dataclass(frozen=True, slots=True)
class SamplerConfig:
    processes: int = DEFAULT_PROCESSES
    concurrency: int = 32
    decode: str = "npy"
    decode_images: bool = False
    image_fields: tuple[str, ...] = ()  # () = every field named as an image format (_codecs.py)
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
    metrics_address: str = "127.0.0.1"
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
    source: str = NO_FILE
    sources: tuple[SourceConfig, ...] = ()  # [[source]] tables; empty: the single [remote] form

    def inputs(self) -> tuple[SourceConfig, ...]:
        """What the daemon reads: the ``[[source]]`` tables, or the single ``[remote]`` as one unnamed source (whose
        ``decode`` is empty: ``sampler.decode``, as for a table that names none)."""
        if self.sources:
            return self.sources
        remote = self.remote
        return (
            SourceConfig(
                "",
                remote.url,
                remote.pattern,
                remote.storage_options,
                manifest=remote.manifest,
                catalog=remote.catalog,
            ),
        )

    def remote_for(self, source: SourceConfig) -> RemoteConfig:
        """The ``[remote]`` settings with ``source``'s URL, pattern and storage options."""
        return dataclasses.replace(
            self.remote,
            url=source.url,
            pattern=source.pattern,
            storage_options=source.storage_options,
            manifest=source.manifest,
            catalog=source.catalog,
        )

    def weights(self) -> tuple[float, ...]:
        """Each input's share of every epoch and of the cache (sums to 1)."""
        inputs = self.inputs()
        total = sum(source.weight for source in inputs)
        return tuple(source.weight / total for source in inputs)
