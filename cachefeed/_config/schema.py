"""The schema: every config key with the dataclass field it fills, its parser and its one-line doc.

``SCHEMA`` maps section -> key -> (field name, parser, doc); ``SOURCE_SCHEMA`` does the same for the keys of a
``[[source]]`` table (an array of tables, so not a section). A key without a default in its dataclass is required.
``configs/*.toml`` and the README's config reference are written from these (``tests/test_readme.py`` and
``tests/config/test_examples.py`` check both).
"""

from __future__ import annotations

from collections.abc import Callable

from cachefeed._cache.eviction import POLICIES
from cachefeed._cache.records import COMPRESSIONS
from cachefeed._cache.settings import CacheConfig
from cachefeed._codecs import BUILTIN_DECODERS
from cachefeed._config import fields
from cachefeed._config.model import LogConfig, NodeConfig, RemoteConfig, SamplerConfig, StatusConfig
from cachefeed._logs import LOG_LEVELS
from cachefeed._units import parse_size

__all__ = [
    "EVICTION_POLICIES",
    "REMOVED",
    "REQUIRED",
    "SCHEMA",
    "SECRET_KEYS",
    "SECTION_TYPES",
    "SOURCE_SCHEMA",
    "SOURCE_SECRET_KEYS",
    "Parser",
]

EVICTION_POLICIES = tuple(POLICIES)  # names come from the registries that define them

Parser = Callable[[object], object]


SCHEMA: dict[str, dict[str, tuple[str, Parser, str]]] = {
    "remote": {
        "url": ("url", fields.url, "fsspec URL of the dataset root: s3://bucket/prefix, file:///data, memory://x"),
        "pattern": ("pattern", fields.glob_pattern, 'glob under url selecting the objects (default "**")'),
        "storage_options": ("storage_options", fields.table, "passed to fsspec as is (endpoint_url, key, ...)"),
        "refresh_interval": ("refresh_interval_s", fields.positive_duration, "re-list the remote this often (5m)"),
        "manifest": (
            "manifest",
            fields.optional_url,
            "a key list or an S3 Inventory manifest.json to read instead of LIST",
        ),
        "catalog": (
            "catalog",
            fields.optional_url,
            "a shared catalog (cachefeed catalog build) to read instead of LIST",
        ),
        "catalog_publish": (
            "catalog_publish",
            fields.boolean,
            "node 0 lists and publishes each new listing as a catalog generation; the others read it (false)",
        ),
        "connect_timeout": (
            "connect_timeout_s",
            fields.positive_duration,
            "TCP connect timeout per request, S3 only (5s)",
        ),
        "read_timeout": ("read_timeout_s", fields.positive_duration, "socket read timeout per request, S3 only (30s)"),
        "max_attempts": ("max_attempts", fields.int_at_least(1), "attempts per object, first included (5)"),
        "backoff_base": ("backoff_base_s", fields.positive_duration, "full-jitter backoff base (100ms)"),
        "backoff_max": ("backoff_max_s", fields.positive_duration, "full-jitter backoff cap (10s)"),
        "retry_budget": ("retry_budget", fields.fraction, "retries allowed as a fraction of requests (0.2)"),
        "max_requests_per_s": ("max_requests_per_s", fields.float_at_least(0), "request rate cap per node, 0 = none"),
        "max_bytes_per_s": ("max_bytes_per_s", parse_size, "download rate cap per node, 0 = none"),
        "verify_md5": ("verify_md5", fields.boolean, "check a body against an ETag that is its MD5 (true)"),
    },
    "cache": {
        "dir": ("dir", fields.absolute_path, "absolute path of the cache root (tmpfs or SSD)"),
        "max_bytes": ("max_bytes", fields.positive_size, "hard bound on everything under dir"),
        "min_free_bytes": ("min_free_bytes", parse_size, "free space the filesystem keeps (1GiB)"),
        "segment_bytes": ("segment_bytes", fields.positive_size, "target size of one segment file (64MiB)"),
        "eviction": ("eviction", fields.one_of(EVICTION_POLICIES), 'which segment goes first ("fifo")'),
        "evict_after_reads": (
            "evict_after_reads",
            fields.int_at_least(0),
            "epochs that must have served every sample of a segment before it may be evicted; 0 = by age alone (1)",
        ),
        "snapshot_grace": (
            "snapshot_grace_s",
            fields.duration,
            "how long a dead trainer's snapshot is kept so its job can resume the epoch (5m)",
        ),
        "turnover": ("turnover_bytes", fields.turnover, 'room kept for fresh samples while pinned ("67%")'),
        "compression": ("compression", fields.one_of(COMPRESSIONS), 'per-record compression ("none")'),
        "fsync": ("fsync", fields.boolean, "fsync a segment before publishing it (true; free on tmpfs)"),
        "file_mode": ("file_mode", fields.mode, 'mode of files in the cache ("0640")'),
        "dir_mode": ("dir_mode", fields.mode, 'mode of directories in the cache ("0750")'),
    },
    "sampler": {
        "processes": ("processes", fields.int_at_least(1), "sampler subprocesses (2)"),
        "concurrency": ("concurrency", fields.int_at_least(1), "requests in flight per process (32)"),
        "decode": ("decode", fields.decoder, ", ".join(BUILTIN_DECODERS) + ' or "pkg.mod:fn" ("npy")'),
        "decode_images": (
            "decode_images",
            fields.boolean,
            "decode the image members of tar shards to uint8 (3, H, W) arrays in the daemon (false)",
        ),
        "image_fields": (
            "image_fields",
            fields.image_fields,
            'with decode_images: the tar fields to decode, e.g. ["jpg", "left.jpg"]; [] = those named jpg, png, ...',
        ),
        "image_size": (
            "image_size",
            fields.image_size,
            "resize (shorter side) and centre-crop decoded images to N or [height, width]; 0 keeps sizes (0)",
        ),
        "label": (
            "label",
            fields.label_rule,
            'an int "label" field per sample: "parent" = its directory\'s class ("")',
        ),
        "preprocess": ("preprocess", fields.callable_path, 'deterministic "pkg.mod:fn" run once per sample ("")'),
        "seed": ("seed", fields.int_at_least(0), "seed of the sampling permutations (0)"),
        "restart_backoff": ("restart_backoff_s", fields.positive_duration, "first restart delay of a sampler (1s)"),
        "restart_backoff_max": ("restart_backoff_max_s", fields.positive_duration, "restart delay cap (60s)"),
    },
    "node": {
        "rank": ("rank", fields.int_at_least(0), "this node's index (default $NODE_RANK or $GROUP_RANK or 0)"),
        "count": ("count", fields.int_at_least(1), "number of nodes (default $NNODES or 1)"),
    },
    "status": {
        "interval": (
            "interval_s",
            fields.positive_duration,
            "status publication interval (1s; at once when a pass completes or ingest starts or stops waiting)",
        ),
        "stuck_after": (
            "stuck_after_s",
            fields.positive_duration,
            "a pinned snapshot unread, one object being written, or fetched while ingest waits, this long: degraded "
            "(10m; a writer, or a silent sampler, killed at 2x)",
        ),
        "metrics_port": ("metrics_port", fields.port, "Prometheus HTTP port on metrics_address, 0 = off (0)"),
        "metrics_address": (
            "metrics_address",
            fields.ip_address,
            'address the metrics port listens on: "0.0.0.0" for a scrape from another host or pod ("127.0.0.1")',
        ),
        "metrics_textfile": ("metrics_textfile", fields.string, "node-exporter textfile path, empty = off"),
    },
    "log": {
        "level": ("level", fields.one_of(LOG_LEVELS), ", ".join(LOG_LEVELS[:-1]) + f' or {LOG_LEVELS[-1]} ("info")'),
    },
}

# [[source]] tables (an array of tables, so not a section of SCHEMA): key -> (field name, parser, doc)
SOURCE_SCHEMA: dict[str, tuple[str, Parser, str]] = {
    "name": ("name", fields.source_name, "letters, digits and _.- (at most 64): names the source everywhere"),
    "url": ("url", fields.url, "fsspec URL of this source's root, as remote.url"),
    "pattern": ("pattern", fields.glob_pattern, 'glob under url, as remote.pattern (default "**")'),
    "storage_options": ("storage_options", fields.table, "passed to fsspec as is, as remote.storage_options"),
    "manifest": ("manifest", fields.optional_url, "this source's listing from a manifest, as remote.manifest"),
    "catalog": ("catalog", fields.optional_url, "this source's listing from a shared catalog, as remote.catalog"),
    "decode": ("decode", fields.decoder, "this source's decoder (default: sampler.decode)"),
    "weight": ("weight", fields.weight, "its share of every epoch and of the cache, relative to the others (1)"),
}
SOURCE_SECRET_KEYS = {"url", "storage_options", "manifest", "catalog"}  # never echoed in errors

SECTION_TYPES: dict[str, type] = {
    "remote": RemoteConfig,
    "cache": CacheConfig,
    "sampler": SamplerConfig,
    "node": NodeConfig,
    "status": StatusConfig,
    "log": LogConfig,
}
SECRET_KEYS = {
    ("remote", "url"),
    ("remote", "storage_options"),
    ("remote", "manifest"),
    ("remote", "catalog"),
}  # never echoed in errors
REQUIRED = {("remote", "url"), ("cache", "dir"), ("cache", "max_bytes")}
REMOVED = {  # keys earlier versions took: what to do instead
    ("cache", "max_samples"): (
        "removed: a sample count could not be a hard bound (a segment's samples are known only once written, and "
        "snapshots keep evicted ones); bound the cache with cache.max_bytes and delete this line"
    ),
}
