"""``changed_keys``: what an edit of a config file changed, by key name, for the daemon's SIGHUP line.

Parsed values are compared, not text: the same setting written another way changes nothing. Keys are named as a file
writes them, never with their values (some hold credentials).
"""

from __future__ import annotations

from typing import Any

from cachefeed._config import changed_keys, parse_config


def config(**sections: dict[str, Any]) -> Any:
    document: dict[str, Any] = {
        "remote": {"url": "s3://bucket/data", "storage_options": {"key": "AKIA-SECRET"}},
        "cache": {"dir": "/var/cache/cachefeed/test", "max_bytes": "1GiB"},
    }
    for name, body in sections.items():
        document.setdefault(name, {}).update(body)
    return parse_config(document, env={})


def sources(*weights: float) -> Any:
    tables = [{"name": f"s{index}", "url": f"s3://bucket/s{index}", "weight": w} for index, w in enumerate(weights)]
    return parse_config({"cache": {"dir": "/var/cache/cachefeed/test", "max_bytes": "1GiB"}, "source": tables}, env={})


def test_the_same_settings_written_another_way_change_nothing() -> None:
    assert changed_keys(config(), config(cache={"max_bytes": 1 << 30}, sampler={"processes": 2})) == []


def test_changed_keys_are_named_as_the_file_writes_them_without_their_values() -> None:
    edited = config(sampler={"concurrency": 4}, remote={"storage_options": {"key": "AKIA-OTHER"}})
    changed = changed_keys(config(), edited)
    assert changed == ["remote.storage_options", "sampler.concurrency"]
    assert not any("AKIA" in key for key in changed)


def test_source_tables_are_named_by_index_or_by_their_number() -> None:
    assert changed_keys(sources(1, 1), sources(1, 3)) == ["source[1].weight"]
    assert changed_keys(sources(1, 1), sources(1, 1, 1)) == ["[[source]] tables"]
