"""remote.manifest and remote.catalog: what replaces the listing, per source too, and one of them at most."""

from __future__ import annotations

import pytest

from cachefeed._config import parse_config
from cachefeed._errors import ConfigError

CACHE = {"dir": "/var/cache/cachefeed/test", "max_bytes": "1GiB"}


def test_a_manifest_or_a_catalog_reaches_the_remote_of_each_input() -> None:
    single = parse_config({"remote": {"url": "s3://b/p", "manifest": "s3://inv/manifest.json"}, "cache": CACHE}, env={})
    (only,) = single.inputs()
    assert single.remote_for(only).manifest == "s3://inv/manifest.json"
    assert single.remote_for(only).catalog == ""
    named = parse_config(
        {
            "cache": CACHE,
            "source": [
                {"name": "a", "url": "s3://b/a", "catalog": "s3://b/a.cfcatalog"},
                {"name": "b", "url": "s3://b/b", "manifest": "s3://b/keys.tsv.gz"},
            ],
        },
        env={},
    )
    a, b = named.inputs()
    assert named.remote_for(a).catalog == "s3://b/a.cfcatalog" and named.remote_for(a).manifest == ""
    assert named.remote_for(b).manifest == "s3://b/keys.tsv.gz"


def test_a_manifest_and_a_catalog_together_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"remote.manifest and remote.catalog both replace the listing"):
        parse_config({"remote": {"url": "s3://b/p", "manifest": "m", "catalog": "c"}, "cache": CACHE}, env={})
    both = {"name": "a", "url": "s3://b/a", "manifest": "m", "catalog": "c"}
    with pytest.raises(ConfigError, match=r"source\[0\].manifest and source\[0\].catalog both replace the listing"):
        parse_config({"cache": CACHE, "source": [both]}, env={})


def test_catalog_publish_needs_a_catalog_to_publish_to() -> None:
    with pytest.raises(ConfigError, match=r"remote.catalog_publish = true needs remote.catalog"):
        parse_config({"remote": {"url": "s3://b/p", "catalog_publish": True}, "cache": CACHE}, env={})
    with pytest.raises(ConfigError, match=r"remote.catalog_publish = 'yes': .*"):
        parse_config({"remote": {"url": "s3://b/p", "catalog": "c", "catalog_publish": "yes"}, "cache": CACHE}, env={})
    config = parse_config(
        {"remote": {"url": "s3://b/p", "catalog": "s3://b/c", "catalog_publish": True}, "cache": CACHE}
    )
    (only,) = config.inputs()
    assert config.remote_for(only).catalog_publish and config.remote_for(only).catalog == "s3://b/c"
