"""The example configs in configs/: they load, and the reference one documents every key with its default.

The documented defaults are checked against the parser: writing a key with the value its comment calls the
default must parse to the same Config as leaving the key out, so the comments cannot drift from the schema.
The examples are also checked against the units in systemd/ (cache dirs writable by the sandbox, the tmpfs big
enough for the config that uses it).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from cachefeed._config import SCHEMA, load_config, parse_config
from cachefeed._config.parse import BUDGET_FORMULA
from cachefeed._errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
REFERENCE = ROOT / "configs" / "s3-ssd.toml"
SERVICE = ROOT / "systemd" / "cachefeed@.service"
MOUNT = ROOT / "systemd" / "mnt-cachefeed.mount"
REQUIRED = {("remote", "url"), ("cache", "dir"), ("cache", "max_bytes")}
DEFAULT = re.compile(r'Default (\{\}|\[\]|"[^"]*"|true|false|[0-9]+(?:\.[0-9]+)?)')
MINIMAL = {
    "remote": {"url": "s3://bucket/prefix"},
    "cache": {"dir": "/var/cache/cachefeed/test", "max_bytes": "1GiB"},
}


def comments_above_keys(path: Path) -> dict[tuple[str, str], str]:
    """(section, key) -> the comment lines directly above the key's assignment, joined."""
    found: dict[tuple[str, str], str] = {}
    section = ""
    block: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#"):
            block.append(line.lstrip("#").strip())
            continue
        header = re.fullmatch(r"\[([a-z_]+)\]", line)
        assignment = re.match(r"([a-z_0-9]+)\s*=", line)
        if header:
            section = header.group(1)
        elif assignment:
            found[(section, assignment.group(1))] = " ".join(block)
        block = []
    return found


def test_there_are_examples() -> None:
    assert {p.name for p in CONFIGS} >= {"s3-ssd.toml", "s3-tmpfs.toml", "local-dir.toml", "multi-node.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_loads(path: Path) -> None:
    cache_dir = Path(tomllib.loads(path.read_text())["cache"]["dir"])
    existed = cache_dir.exists()
    config = load_config(path, env={})
    assert config.source == str(path)
    assert config.cache.dir == cache_dir
    # Loading never creates the cache dir: it need not exist on the machine that checks the config.
    assert cache_dir.exists() == existed
    multi = load_config(path, env={"NODE_RANK": "3", "NNODES": "8"})
    assert multi.remote == config.remote and multi.cache == config.cache


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_starts_with_when_to_use_it(path: Path) -> None:
    lines = path.read_text().splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    assert header and header[0].startswith("# cachefeed example:"), path.name
    assert "Use it when" in "\n".join(header) or "Use it for" in "\n".join(header), path.name


@pytest.mark.parametrize(("section", "key"), [(s, k) for s, keys in SCHEMA.items() for k in keys], ids=lambda v: str(v))
def test_reference_documents_every_key(section: str, key: str) -> None:
    document = tomllib.loads(REFERENCE.read_text())
    assert key in document.get(section, {}), f"[{section}] {key} is missing from {REFERENCE.name}"
    comment = comments_above_keys(REFERENCE)[(section, key)]
    field_name = SCHEMA[section][key][0]
    if field_name.endswith("_bytes") or field_name.endswith("bytes_per_s"):
        assert "size" in comment.lower(), comment
    elif field_name.endswith("_s") and not field_name.endswith("per_s"):
        assert "Duration" in comment, comment
    if (section, key) in REQUIRED:
        assert "Required" in comment, comment
        return
    if section == "node":
        assert "$NNODES" in comment or "$NODE_RANK" in comment, comment
        return
    match = DEFAULT.search(comment)
    assert match, f"no 'Default <value>' in the comment above [{section}] {key}: {comment!r}"
    value = tomllib.loads(f"v = {match.group(1)}")["v"]
    with_default = {name: dict(body) for name, body in MINIMAL.items()}
    with_default.setdefault(section, {})[key] = value
    assert parse_config(with_default, env={}) == parse_config(MINIMAL, env={}), (
        f"[{section}] {key}: the documented default {match.group(1)} is not the parser's default"
    )


def test_multi_node_takes_its_identity_from_the_environment() -> None:
    path = ROOT / "configs" / "multi-node.toml"
    assert "node" not in tomllib.loads(path.read_text())
    node = load_config(path, env={"NODE_RANK": "3", "NNODES": "8"}).node
    assert (node.rank, node.count) == (3, 8)


def _unit_setting(path: Path, name: str) -> str:
    values = [line.partition("=")[2] for line in path.read_text().splitlines() if line.startswith(f"{name}=")]
    assert len(values) == 1, (path.name, name, values)
    return values[0]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_cache_dir_is_writable_under_the_unit(path: Path) -> None:
    writable = [Path(entry.lstrip("-")) for entry in _unit_setting(SERVICE, "ReadWritePaths").split()]
    cache_dir = load_config(path, env={}).cache.dir
    assert any(cache_dir.is_relative_to(root) and cache_dir != root for root in writable), (cache_dir, writable)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_file_remote_lies_where_the_unit_lets_the_daemon_see_it(path: Path) -> None:
    hidden = {"ProtectHome": ("/home", "/root", "/run/user"), "PrivateTmp": ("/tmp", "/var/tmp")}
    config = load_config(path, env={})
    urls = [source.url for source in config.sources] or [config.remote.url]
    for setting, roots in hidden.items():
        assert _unit_setting(SERVICE, setting) == "yes"
        for url in urls:
            if url.startswith("file://"):
                where = Path(url.removeprefix("file://"))
                assert not any(where.is_relative_to(root) for root in roots), (url, setting)
                assert any(root in path.read_text() for root in roots)  # and the config says so


def test_tmpfs_example_fits_the_mount_unit() -> None:
    config = load_config(ROOT / "configs" / "s3-tmpfs.toml", env={})
    where = Path(_unit_setting(MOUNT, "Where"))
    assert config.cache.dir.parent == where
    options = dict(item.partition("=")[::2] for item in _unit_setting(MOUNT, "Options").split(",") if "=" in item)
    number, unit = re.fullmatch(r"([0-9]+)([kmgKMG]?)", options["size"]).groups()  # type: ignore[union-attr]
    size = int(number) * 1024 ** " kmg".index(unit.lower() or " ")  # tmpfs: k/m/g are powers of 1024
    assert config.cache.max_bytes + config.cache.min_free_bytes <= size


def test_the_reference_states_the_budget_floor_that_the_check_applies() -> None:
    comment = " ".join(comments_above_keys(REFERENCE)[("cache", "max_bytes")].split())
    assert BUDGET_FORMULA in comment
    document = tomllib.loads(REFERENCE.read_text())
    processes = document["sampler"]["processes"]
    segment_bytes = 64 << 20
    floor = max(4, 2 * processes) * segment_bytes + (1 << 20)  # the turnover term is 0 here
    for max_bytes, is_accepted in ((floor, True), (floor - 1, False)):
        cache = {**document["cache"], "max_bytes": max_bytes, "segment_bytes": segment_bytes, "turnover": 0}
        candidate = {**document, "cache": cache}
        if is_accepted:
            parse_config(candidate, env={})
        else:
            with pytest.raises(ConfigError, match=r"cache\.max_bytes"):
                parse_config(candidate, env={})
