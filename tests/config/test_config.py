"""The config parser: every bad config is rejected with one line naming the key, the bad value and the form.

A valid config parses into frozen dataclasses whose fields carry units (bytes, seconds); node identity
defaults from the launcher's environment mapping.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import pytest

from cachefeed._cache.settings import default_turnover
from cachefeed._config import (
    EVICTION_POLICIES,
    SCHEMA,
    CacheConfig,
    Config,
    LogConfig,
    NodeConfig,
    RemoteConfig,
    SamplerConfig,
    StatusConfig,
    load_config,
    parse_config,
)
from cachefeed._errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20
DROP = object()  # an override value that removes the key


def document(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A minimal valid document with ``{"section.key": value}`` (or ``{"section": value}``) overrides."""
    doc: dict[str, Any] = {
        "remote": {"url": "s3://bucket/prefix"},
        "cache": {"dir": "/var/cache/cachefeed/test", "max_bytes": "1GiB"},
    }
    for name, value in (overrides or {}).items():
        section, _, key = name.partition(".")
        if not key:
            if value is DROP:
                doc.pop(section, None)
            else:
                doc[section] = value
        elif value is DROP:
            doc[section].pop(key, None)
        else:
            doc.setdefault(section, {})[key] = value
    return doc


def rejected(overrides: dict[str, Any], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(document(overrides), env={} if env is None else env)
    return str(info.value)


def assert_one_line(message: str) -> None:
    assert "\n" not in message and "\r" not in message, message
    assert message == message.strip(), message


# (overrides, key named, bad value named, expected form named)
INVALID = [
    pytest.param({"cahce": {}}, "'cahce'", "'cahce'", "did you mean 'cache'?", id="unknown-section"),
    pytest.param(
        {"cache.max_byte": "1GiB"}, "'cache.max_byte'", "max_byte", "did you mean 'max_bytes'?", id="unknown-key"
    ),
    pytest.param(
        {"remote.retries": 3}, "'remote.retries'", "retries", "max_attempts", id="unknown-key-lists-the-known"
    ),
    pytest.param({"log": "debug"}, "[log]", "[log]", "table of keys", id="section-not-a-table"),
    pytest.param(
        {"remote.max_attempts": "5"}, "remote.max_attempts", "'5'", "expected an integer >= 1", id="string-for-int"
    ),
    pytest.param(
        {"sampler.processes": True}, "sampler.processes", "True", "expected an integer >= 1", id="bool-for-int"
    ),
    pytest.param(
        {"sampler.concurrency": 1.5}, "sampler.concurrency", "1.5", "expected an integer >= 1", id="float-for-int"
    ),
    pytest.param({"cache.max_bytes": 1.5e9}, "cache.max_bytes", "1500000000.0", "expected a size > 0", id="float-size"),
    pytest.param({"cache.max_bytes": "-5GiB"}, "cache.max_bytes", "'-5GiB'", "expected a size > 0", id="negative-size"),
    pytest.param(
        {"cache.min_free_bytes": -1}, "cache.min_free_bytes", "-1", "expected a size >= 0", id="negative-int-size"
    ),
    pytest.param(
        {"cache.segment_bytes": "0MiB"}, "cache.segment_bytes", "'0MiB'", "expected a size > 0", id="zero-size"
    ),
    pytest.param({"cache.max_bytes": "64XB"}, "cache.max_bytes", "'64XB'", "such as 64MiB", id="bad-size-unit"),
    pytest.param(
        {"remote.max_bytes_per_s": "10 MB/s"},
        "remote.max_bytes_per_s",
        "'10 MB/s'",
        "such as 64MiB",
        id="rate-written-with-per-second",
    ),
    pytest.param(
        {"cache.dir": "cache/test"}, "cache.dir", "'cache/test'", "expected an absolute path", id="relative-dir"
    ),
    pytest.param(
        {"cache.dir": "/var/cache/../etc"}, "cache.dir", "'/var/cache/../etc'", "without '..'", id="dotdot-dir"
    ),
    pytest.param({"cache.dir": ""}, "cache.dir", "''", "expected a non-empty string", id="empty-dir"),
    pytest.param(
        {"remote.url": "  "},
        "remote.url",
        "<hidden: may hold credentials>",
        "expected a non-empty string",
        id="blank-url",
    ),
    pytest.param(
        {"remote.url": "s3://b/p\nx"},
        "remote.url",
        "<hidden: may hold credentials>",
        "a URL on one line",
        id="url-newline",
    ),
    pytest.param(
        {"remote.storage_options": "anon"},
        "remote.storage_options",
        "<hidden: may hold credentials>",
        "expected a table",
        id="options",
    ),
    pytest.param(
        {"remote.retry_budget": 1.5}, "remote.retry_budget", "1.5", "between 0 and 1", id="fraction-too-large"
    ),
    pytest.param(
        {"remote.max_requests_per_s": -1},
        "remote.max_requests_per_s",
        "-1",
        "expected a number >= 0",
        id="negative-rate",
    ),
    pytest.param({"cache.eviction": "lru"}, "cache.eviction", "'lru'", "expected one of 'fifo'", id="bad-eviction"),
    pytest.param({"cache.compression": "gzip"}, "cache.compression", "'gzip'", "'none', 'zlib'", id="bad-compression"),
    pytest.param({"cache.fsync": "yes"}, "cache.fsync", "'yes'", "expected true or false", id="string-for-bool"),
    pytest.param({"cache.file_mode": "0999"}, "cache.file_mode", "'0999'", 'such as "0640"', id="not-octal"),
    pytest.param(
        {"cache.dir_mode": "01777"}, "cache.dir_mode", "'01777'", 'between "0000" and "0777"', id="mode-too-big"
    ),
    pytest.param({"cache.file_mode": 6.4}, "cache.file_mode", "6.4", "octal mode", id="float-mode"),
    pytest.param({"sampler.decode": "jpeg"}, "sampler.decode", "'jpeg'", '"package.module:function"', id="bad-decoder"),
    pytest.param({"sampler.decode": ""}, "sampler.decode", "''", "npy, npz, pt", id="empty-decoder"),
    pytest.param(
        {"sampler.preprocess": "mypkg.resize"},
        "sampler.preprocess",
        "'mypkg.resize'",
        '"package.module:function"',
        id="callable-without-colon",
    ),
    pytest.param(
        {"sampler.preprocess": ":resize"},
        "sampler.preprocess",
        "':resize'",
        '"package.module:function"',
        id="callable-without-module",
    ),
    pytest.param(
        {"sampler.decode": "mypkg.codecs:"},
        "sampler.decode",
        "'mypkg.codecs:'",
        '"package.module:function"',
        id="callable-without-function",
    ),
    pytest.param(
        {"remote.refresh_interval": "5 minutes"},
        "remote.refresh_interval",
        "'5 minutes'",
        "such as 500ms, 30s, 5m",
        id="bad-duration-unit",
    ),
    pytest.param(
        {"remote.connect_timeout": "0s"}, "remote.connect_timeout", "'0s'", "duration > 0", id="zero-duration"
    ),
    pytest.param(
        {"remote.read_timeout": "-1s"}, "remote.read_timeout", "'-1s'", "duration >= 0", id="negative-duration"
    ),
    pytest.param(
        {"sampler.restart_backoff": True},
        "sampler.restart_backoff",
        "True",
        "such as 30s",
        id="bool-for-duration",
    ),
    pytest.param({"log.level": "verbose"}, "log.level", "'verbose'", "'debug', 'info'", id="bad-log-level"),
    pytest.param({"status.metrics_port": -1}, "status.metrics_port", "-1", "TCP port", id="negative-port"),
    pytest.param({"status.metrics_textfile": 5}, "status.metrics_textfile", "5", "a string", id="int-for-path"),
    pytest.param({"node.count": 0}, "node.count", "0", "integer >= 1", id="zero-nodes"),
    pytest.param({"sampler.seed": -1}, "sampler.seed", "-1", "integer >= 0", id="negative-seed"),
    pytest.param({"cache.turnover": "100%"}, "cache.turnover", "'100%'", 'below "100%"', id="turnover-100pc"),
    pytest.param({"cache.turnover": "lots%"}, "cache.turnover", "'lots%'", '"25%"', id="turnover-not-a-pc"),
    pytest.param({"cache.turnover": "lots"}, "cache.turnover", "'lots'", "such as 64MiB", id="turnover-not-a-size"),
]


@pytest.mark.parametrize(("overrides", "key", "value", "form"), INVALID)
def test_invalid_value_is_one_line_naming_key_value_and_form(
    overrides: dict[str, Any], key: str, value: str, form: str
) -> None:
    message = rejected(overrides)
    assert_one_line(message)
    assert message.startswith("<memory>: "), message
    assert key in message, message
    assert value in message, message
    assert form in message, message


# Cross-field checks: (overrides, env, substrings that must all appear).
CROSS_FIELD = [
    pytest.param(
        {"cache.max_bytes": "100MiB"},
        {},
        # the default turnover (67%, or as little as 50% in a small cache) binds before the four segments' floor
        # (269484032): at 50% the epoch room holds two
        [
            "cache.max_bytes = 104857600 bytes",
            "below the minimum of 270532607 bytes",
            "its default (67% of max_bytes, or as little as 50% in a small cache)",
            "cache.segment_bytes = 67108864 bytes (64.0 MiB)",
        ],
        id="budget-below-an-epoch-room-of-two-segments",
    ),
    pytest.param(
        {"cache.max_bytes": "512MiB", "cache.segment_bytes": "32MiB", "sampler.processes": 16},
        {},
        ["cache.max_bytes = 536870912 bytes", "below the minimum of 1074790400 bytes", "sampler.processes = 16"],
        id="budget-below-two-segments-per-sampler",
    ),
    pytest.param(
        {"cache.turnover": "90%"},
        {},
        ["cache.turnover = 90% = 966367641 bytes", "2 x segment_bytes + turnover", "lower segment_bytes or turnover"],
        id="turnover-percent-too-large",
    ),
    pytest.param(
        {"cache.turnover": "2GiB"},
        {},
        ["cache.turnover = 2147483648 bytes", "below the minimum of 2282749952 bytes"],
        id="turnover-size-above-budget",
    ),
    pytest.param(
        {"sampler.decode": "npz", "sampler.image_size": 224},
        {},
        ["sampler.image_size = 224 is read only by the image decoders", "sampler.decode is 'npz'", "remove image_size"],
        id="image-size-with-a-decoder-that-never-reads-it",
    ),
    pytest.param(
        {"sampler.decode": "tar", "sampler.image_size": [24, 32]},
        {},
        ["sampler.image_size = [24, 32]", "decode_images = true", "sampler.decode is 'tar'"],
        id="image-size-with-tar-but-no-decode-images",
    ),
    pytest.param(
        {"remote": DROP, "source": [{"name": "a", "url": "s3://a/", "decode": "npy"}], "sampler.image_size": 64},
        {},
        ["sampler.image_size = 64", "the sources' decode is 'npy'"],
        id="image-size-with-sources-that-never-read-it",
    ),
    pytest.param(
        {"node.rank": 2, "node.count": 2}, {}, ["node.rank = 2", "below node.count = 2"], id="rank-equals-count"
    ),
    pytest.param({}, {"NODE_RANK": "3"}, ["node.rank = 3", "below node.count = 1"], id="env-rank-without-nnodes"),
    pytest.param({"node.count": 2}, {"NODE_RANK": "5"}, ["node.rank = 5", "node.count = 2"], id="env-rank-above-count"),
]


@pytest.mark.parametrize(
    "overrides",
    [
        {"sampler.decode": "image", "sampler.image_size": 224},
        {"sampler.decode": "tar", "sampler.decode_images": True, "sampler.image_size": 224},
        {"sampler.decode": "npz", "sampler.image_size": 0},  # 0: keep each image's size, the default
        {
            "remote": DROP,
            "source": [{"name": "a", "url": "s3://a/", "decode": "npy"}, {"name": "b", "url": "s3://b/"}],
            "sampler.decode": "image",
            "sampler.image_size": 64,
        },
    ],
)
def test_image_size_is_accepted_where_a_decoder_reads_it(overrides: dict[str, Any]) -> None:
    parse_config(document(overrides), env={})


@pytest.mark.parametrize(("overrides", "env", "parts"), CROSS_FIELD)
def test_cross_field_errors(overrides: dict[str, Any], env: dict[str, str], parts: list[str]) -> None:
    message = rejected(overrides, env)
    assert_one_line(message)
    for part in parts:
        assert part in message, message


@pytest.mark.parametrize(
    ("drop", "named"),
    [
        ("remote.url", "remote.url is required"),
        ("cache.dir", "cache.dir is required"),
        ("cache.max_bytes", "cache.max_bytes is required"),
        ("remote", "remote.url is required"),
    ],
)
def test_missing_required_key(drop: str, named: str) -> None:
    message = rejected({drop: DROP})
    assert_one_line(message)
    assert named in message, message


def write(tmp_path: Path, content: str | bytes, name: str = "example.toml") -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


VALID_TOML = """
[remote]
url = "s3://bucket/prefix"
[cache]
dir = "/var/cache/cachefeed/test"
max_bytes = "1GiB"
"""


@pytest.mark.parametrize(
    ("content", "form"),
    [
        pytest.param("[remote\nurl = 1\n", "not valid TOML", id="not-toml"),
        pytest.param("remote.url = s3://x\n", "not valid TOML", id="unquoted-string"),
        pytest.param(VALID_TOML + 'max_bytes = "2GiB"\n', "not valid TOML", id="duplicate-key"),
        pytest.param(b"\xff\xfe[remote]\n", "not valid UTF-8", id="not-utf8"),
    ],
)
def test_unreadable_file(tmp_path: Path, content: str | bytes, form: str) -> None:
    path = write(tmp_path, content)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert_one_line(message)
    assert message.startswith(f"{path}: "), message
    assert form in message, message


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.toml: no such config file$"):
        load_config(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match=r"is a directory, expected a TOML file$"):
        load_config(tmp_path, env={})


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_permissions(tmp_path: Path) -> None:
    path = write(tmp_path, VALID_TOML)
    path.chmod(0)
    with pytest.raises(ConfigError, match="permission denied"):
        load_config(path, env={})


def test_a_bad_value_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, VALID_TOML.replace('"1GiB"', '"1 gigabyte"'))
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(info.value).startswith(f"{path}: cache.max_bytes = '1 gigabyte': expected a size")
    assert info.value.exit_code == 78
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no parser traceback noise


# --- known gaps in cachefeed/_config/, reported to the lead; strict xfail turns green-to-red when fixed ---------


def test_did_you_mean_for_a_short_key() -> None:
    assert "did you mean 'dir'?" in rejected({"cache.dri": "/x"})


def test_a_key_in_the_wrong_section_or_outside_every_section_names_where_it_belongs() -> None:
    """``decode`` under [remote], or ``url`` above every header: the error listed the section's keys, or called the
    key a section, without saying where it goes."""
    assert "sampler.decode belongs in [sampler]" in rejected({"remote.decode": "npz"})
    assert "cache.max_bytes belongs in [cache]" in rejected({"remote.max_bytes": "1GiB"})  # not max_bytes_per_s
    with pytest.raises(ConfigError) as info:
        parse_config({**document({}), "url": "file:///data"}, env={})
    assert_one_line(str(info.value))
    assert "the key 'url' is outside every section: remote.url belongs in [remote]" in str(info.value)


def test_a_pattern_with_an_unpaired_brace_is_refused_where_it_was_taken_literally() -> None:
    """``**/*.{npy`` matched nothing (its brace taken as a character of the names), said only as a listing of 0."""
    message = rejected({"remote.pattern": "**/*.{npy"})
    assert_one_line(message)
    assert "remote.pattern = '**/*.{npy': the '{' at position 5 has no pair" in message
    assert "the '}' at position 3 has no pair" in rejected({"remote.pattern": "**/}*.npy"})
    parse_config(document({"remote.pattern": "**/{a,{b,c}}.{jpg,png}"}), env={})
    parse_config(document({"remote.pattern": "data[{]*.npy"}), env={})  # a brace in a bracket is a character


def test_the_removed_max_samples_is_refused_saying_what_to_use_instead() -> None:
    """cache.max_samples was a bound it could not keep (253 cached with a limit of 100): it is gone, and a config
    that still sets it is told so rather than silently ignored."""
    message = rejected({"cache": {"max_samples": 100}})
    assert_one_line(message)
    assert "cache.max_samples = 100" in message and "removed" in message and "cache.max_bytes" in message


def test_port_above_65535_is_rejected() -> None:
    assert "status.metrics_port = 70000" in rejected({"status.metrics_port": 70000})


@pytest.mark.parametrize("key", ["remote.refresh_interval", "remote.max_requests_per_s"])
def test_nan_is_rejected(key: str) -> None:
    assert key in rejected({key: math.nan})


@pytest.mark.parametrize(
    ("base", "cap"),
    [("remote.backoff_base", "remote.backoff_max"), ("sampler.restart_backoff", "sampler.restart_backoff_max")],
)
def test_backoff_base_above_cap_is_rejected(base: str, cap: str) -> None:
    assert base in rejected({base: "2m", cap: "1m"})


def test_malformed_node_rank_in_env_is_rejected() -> None:
    assert "NODE_RANK" in rejected({}, {"NODE_RANK": "node-3", "NNODES": "4"})


# --- valid configs ------------------------------------------------------------------------------------------


def test_minimal_config_takes_every_default() -> None:
    config = parse_config(document(), env={})
    assert config.source == "<memory>"
    assert config.remote == RemoteConfig(url="s3://bucket/prefix")
    assert config.cache == CacheConfig(dir=Path("/var/cache/cachefeed/test"), max_bytes=GiB), "one default"
    assert config.cache.turnover_bytes == GiB * 67 // 100
    assert config.sampler == SamplerConfig()
    assert config.node == NodeConfig(rank=0, count=1)
    assert config.status == StatusConfig()
    assert config.log == LogConfig()
    # The documented defaults, in units.
    assert config.remote.pattern == "**"
    assert config.remote.refresh_interval_s == 300.0
    assert config.remote.backoff_base_s == 0.1
    assert config.cache.segment_bytes == 64 * MiB
    assert config.cache.min_free_bytes == GiB
    assert (config.cache.file_mode, config.cache.dir_mode) == (0o640, 0o750)
    assert config.cache.eviction == "fifo"
    assert config.sampler.decode == "npy"


def test_config_is_frozen() -> None:
    config = parse_config(document(), env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.max_bytes = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.log = LogConfig()  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64GiB", 64 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("500MB", 500_000_000),
        ("2TB", 2 * 10**12),
        ("8192KiB", 8 << 20),
        ("1073741824", GiB),
        (GiB, GiB),
    ],
)
def test_sizes_are_parsed_to_bytes(text: str | int, expected: int) -> None:
    config = parse_config(document({"cache.max_bytes": text, "cache.segment_bytes": "1MiB"}), env={})
    assert config.cache.max_bytes == expected


@pytest.mark.parametrize(
    ("text", "meant"),
    [("8mb", "8MB"), ("8 MB", None), ("8Mb", "8MB"), ("8g", "8GiB"), ("8G", "8GiB"), ("8gib", "8GiB"), (" 8MB", None)],
)
def test_a_size_has_one_spelling_per_unit(text: str, meant: str | None) -> None:
    message = rejected({"cache.max_bytes": text, "cache.segment_bytes": "1MiB"})
    assert f"cache.max_bytes = {text!r}" in message
    assert "B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)" in message, message
    assert (f"did you mean {meant}?" in message) if meant else ("did you mean" not in message), message


@pytest.mark.parametrize(
    ("key", "bound", "values"),
    [("cache.max_bytes", "> 0", [-1, "-1", 0, "0", "0MiB"]), ("cache.min_free_bytes", ">= 0", [-1, "-1", "-1MiB"])],
)
def test_a_size_refused_states_the_same_bound_whatever_was_wrong(key: str, bound: str, values: list[object]) -> None:
    for value in [*values, "lots", 1.5]:
        message = rejected({key: value})
        assert f"expected a size {bound}:" in message, message


@pytest.mark.parametrize(
    ("text", "expected"),
    [("5m", 300.0), ("500ms", 0.5), ("30s", 30.0), ("1h", 3600.0), ("1d", 86400.0), (45, 45.0), (0.25, 0.25)],
)
def test_durations_are_parsed_to_seconds(text: str | float, expected: float) -> None:
    config = parse_config(document({"remote.refresh_interval": text}), env={})
    assert config.remote.refresh_interval_s == expected


@pytest.mark.parametrize(
    ("turnover", "expected"),
    [("25%", 16 * GiB), ("10%", int(64 * GiB * 0.1)), ("0%", 0), ("12.5%", 8 * GiB), ("2GiB", 2 * GiB), (0, 0)],
)
def test_turnover_as_percentage_or_size(turnover: str | int, expected: int) -> None:
    config = parse_config(document({"cache.max_bytes": "64GiB", "cache.turnover": turnover}), env={})
    assert config.cache.turnover_bytes == expected


def test_other_values_parse() -> None:
    config = parse_config(
        document(
            {
                "remote.storage_options": {"endpoint_url": "http://127.0.0.1:9000", "client_kwargs": {"x": 1}},
                "remote.max_bytes_per_s": "200MiB",
                "remote.retry_budget": 0,
                "cache.file_mode": "0600",
                "cache.dir_mode": 0o700,
                "cache.fsync": False,
                "cache.eviction": EVICTION_POLICIES[-1],
                "sampler.decode": "mypkg.codecs:decode_jpeg",
                "sampler.preprocess": "mypkg.prep:resize",
                "log.level": "debug",
            }
        ),
        env={},
    )
    assert config.remote.storage_options == {"endpoint_url": "http://127.0.0.1:9000", "client_kwargs": {"x": 1}}
    assert config.remote.max_bytes_per_s == 200 * MiB
    assert config.remote.retry_budget == 0.0
    assert (config.cache.file_mode, config.cache.dir_mode) == (0o600, 0o700)
    assert config.cache.fsync is False
    assert config.cache.eviction == EVICTION_POLICIES[-1]
    assert config.sampler.decode == "mypkg.codecs:decode_jpeg"
    assert config.sampler.preprocess == "mypkg.prep:resize"
    assert config.log.level == "debug"


@pytest.mark.parametrize("decoder", ["npy", "npz", "pt", "msgpack", "raw", "tar"])
def test_builtin_decoders(decoder: str) -> None:
    assert parse_config(document({"sampler.decode": decoder}), env={}).sampler.decode == decoder


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (0, 1)),
        ({"NODE_RANK": "2", "NNODES": "4"}, (2, 4)),
        ({"GROUP_RANK": "1", "NNODES": "2"}, (1, 2)),
        ({"NODE_RANK": "3", "GROUP_RANK": "1", "NNODES": "4"}, (3, 4)),  # NODE_RANK first
        ({"NODE_RANK": " 1 ", "NNODES": "2"}, (1, 2)),
        ({"NNODES": "8"}, (0, 8)),
    ],
)
def test_node_defaults_from_env(env: dict[str, str], expected: tuple[int, int]) -> None:
    node = parse_config(document(), env=env).node
    assert (node.rank, node.count) == expected


def test_node_keys_beat_env() -> None:
    node = parse_config(document({"node.rank": 1, "node.count": 3}), env={"NODE_RANK": "7", "NNODES": "9"}).node
    assert (node.rank, node.count) == (1, 3)


def test_node_defaults_from_the_environment_are_named_as_such_in_errors() -> None:
    """The user wrote neither key: the message says where each value came from."""
    with pytest.raises(ConfigError) as info:
        parse_config(document(), env={"NODE_RANK": "1"})
    assert "node.rank = 1 (from the environment variable NODE_RANK) must be below node.count = 1 (the default of " in (
        str(info.value)
    )
    with pytest.raises(ConfigError, match=r"NNODES = 0 .*at least one node"):
        parse_config(document(), env={"NNODES": "0"})
    with pytest.raises(ConfigError, match=r"node.rank = 3 \(from the environment variable GROUP_RANK\)"):
        parse_config(document(), env={"GROUP_RANK": "3", "NNODES": "2"})


def test_env_defaults_to_os_environ_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("NNODES", "2")
    node = parse_config(document()).node
    assert (node.rank, node.count) == (1, 2)
    assert parse_config(document(), env={}).node == NodeConfig()


def test_load_config_from_file(tmp_path: Path) -> None:
    text = VALID_TOML + 'file_mode = 0o600\nturnover = "50%"\n[sampler]\nprocesses = 3\n'
    path = write(tmp_path, text)
    config = load_config(path, env={})
    assert isinstance(config, Config)
    assert config.source == str(path)
    assert config.cache.file_mode == 0o600
    assert config.cache.turnover_bytes == GiB // 2
    assert config.sampler.processes == 3
    assert config.cache.dir == Path("/var/cache/cachefeed/test")


@pytest.mark.parametrize("written", ["440", "640  # owner and group", "0755"])
def test_a_mode_written_as_a_bare_number_is_refused_not_read_as_decimal(tmp_path: Path, written: str) -> None:
    """``file_mode = 440`` would be 0o670 (group-writable), silently; TOML's ``0o440`` and ``"0440"`` are modes."""
    path = write(tmp_path, VALID_TOML + f"file_mode = {written}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    digits = written.split(maxsplit=1)[0]
    assert f"cache.file_mode = {digits}: a bare number is decimal in TOML, not an octal mode" in str(info.value)
    assert f'"0{digits.lstrip("0")}"' in str(info.value)
    for fine in (f"0o{digits.lstrip('0')}", f'"0{digits.lstrip("0")}"'):
        assert load_config(write(tmp_path, VALID_TOML + f"file_mode = {fine}\n"), env={}).cache.file_mode == int(
            digits, 8
        )


def test_a_mode_check_reads_only_the_cache_keys_as_written(tmp_path: Path) -> None:
    dotted = VALID_TOML.replace("[cache]\n", "") + "cache.file_mode = 440\n"  # a dotted key, CRLF line ends
    with pytest.raises(ConfigError, match=r"cache\.file_mode = 440: a bare number is decimal"):
        load_config(write(tmp_path, dotted.replace("\n", "\r\n")), env={})
    quoted = VALID_TOML.replace("[remote]\n", '[remote]\nstorage_options = { note = """file_mode = 640""" }\n')
    config = load_config(write(tmp_path, quoted + 'file_mode = "0640"\ndir_mode = 7\n'), env={})
    assert (config.cache.file_mode, config.cache.dir_mode) == (0o640, 7), "decimal 7 is octal 7"


def test_schema_matches_the_dataclasses() -> None:
    from cachefeed._config.schema import SECTION_TYPES as types

    assert set(types.values()) == {RemoteConfig, CacheConfig, SamplerConfig, NodeConfig, StatusConfig, LogConfig}
    assert set(SCHEMA) == set(types)
    for section, keys in SCHEMA.items():
        field_names = {f.name for f in dataclasses.fields(types[section])}
        assert {entry[0] for entry in keys.values()} == field_names, section


def test_generated_configs_read_back_to_the_same_values(tmp_path: Path) -> None:
    """The one TOML writer (demo, tests, benchmarks): quotes, backslashes, non-ASCII and tables survive."""
    from cachefeed._config import toml_text

    odd = 'C:\\data "quoted" ünïcode'
    document = {
        "remote": {"url": "s3://bucket/prefix", "pattern": odd, "storage_options": {"key": odd, "anon": False}},
        "cache": {"dir": tmp_path / "c", "max_bytes": "1GiB", "fsync": False},
    }
    path = write(tmp_path, toml_text(document))
    config = load_config(path, env={})
    assert config.remote.pattern == odd and config.remote.storage_options == {"key": odd, "anon": False}
    assert config.cache.dir == tmp_path / "c" and config.cache.fsync is False


def _least_budget_by_the_readme(segment_bytes: int, processes: int, turnover: str) -> int:
    """The README's formula, worked out here independently: the least max_bytes with max_bytes >= 1 MiB +
    max(max(4, 2 x processes) x segment_bytes, 2 x segment_bytes + turnover), turnover in bytes or "P%" of
    max_bytes (rounded down), found by bisection."""
    mib = 1 << 20

    def holds(max_bytes: int) -> bool:
        room = int(max_bytes * float(turnover[:-1]) / 100) if turnover.endswith("%") else int(turnover)
        return max_bytes >= mib + max(max(4, 2 * processes) * segment_bytes, 2 * segment_bytes + room)

    low, high = 0, 1 << 50
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle + 1, high)
    return low


@pytest.mark.parametrize(
    ("segment_bytes", "processes", "turnover"),
    [
        (16 << 10, 2, "25%"),  # the case: small segments, where the turnover term and the reserve dominate
        (64 << 20, 2, "25%"),  # the defaults
        (32 << 20, 16, "0%"),  # many samplers
        (64 << 20, 2, str(300 << 20)),  # turnover as a size
        (1 << 20, 1, "90%"),
    ],
)
def test_a_budget_at_the_readmes_minimum_is_accepted_and_one_byte_less_refused_naming_the_formula(
    segment_bytes: int, processes: int, turnover: str
) -> None:
    from cachefeed._config.parse import BUDGET_FORMULA

    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    assert f"`{BUDGET_FORMULA}`" in readme  # the formula the check applies is the README's
    least = _least_budget_by_the_readme(segment_bytes, processes, turnover)
    overrides = {
        "cache.segment_bytes": segment_bytes,
        "sampler.processes": processes,
        "cache.turnover": turnover if turnover.endswith("%") else int(turnover),
    }
    assert parse_config(document({**overrides, "cache.max_bytes": least}), env={}).cache.max_bytes == least
    message = rejected({**overrides, "cache.max_bytes": least - 1})
    assert f"cache.max_bytes = {least - 1} bytes (" in message and f"is below the minimum of {least} bytes (" in message
    assert BUDGET_FORMULA in message


def test_the_default_turnover_is_two_thirds_and_never_below_the_half_a_small_cache_had() -> None:
    """67% of max_bytes where that leaves the epoch room a quarter of it; lower in a small cache, never below 50%
    (every budget the earlier 50% default accepted is still accepted, with at least that turnover)."""
    seg = 256 << 10
    assert default_turnover(GiB, 64 << 20) == GiB * 67 // 100
    assert default_turnover(28 << 20, seg) == (28 << 20) * 67 // 100
    eight = 8 << 20  # 67% would leave the room 1.6 MiB beside the 1 MiB reserve: it keeps a quarter instead
    assert default_turnover(eight, seg) == eight - (1 << 20) - eight // 4
    for max_bytes in (2 << 20, 3 << 20, 270532607):
        for segment_bytes in (8 << 10, seg, 64 << 20):
            assert max_bytes // 2 <= default_turnover(max_bytes, segment_bytes) <= max_bytes * 67 // 100
    config = parse_config(document({"cache.max_bytes": 270532607}), env={})  # the least 50% accepted
    assert config.cache.turnover_bytes == 270532607 // 2


def test_a_file_url_with_two_slashes_is_refused_saying_to_use_three() -> None:
    """``file://data/x`` is "data/x" relative to the daemon's working directory: it listed nothing under systemd
    (cwd /) and something else in a shell, silently."""
    message = rejected({"remote.url": "file://data/train"})
    assert "expected an absolute path after file:// (three slashes: file:///data/train)" in message, message
    assert "relative to the daemon's working directory" in message
    # a local path holds no credentials: shown, not "<hidden>" beside a message that names it anyway
    assert "remote.url = 'file://data/train': " in message and "<hidden" not in message, message
