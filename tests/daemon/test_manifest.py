"""remote.manifest end to end: a daemon reads an S3 Inventory report or a key list and never sends a LIST.

The witness is the S3 proxy in front of the server (it counts what the daemon sent), not the daemon's counters;
LIST requests are refused there (403), as for a role without s3:ListBucket.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from cachefeed._config import RemoteConfig, toml_text
from cachefeed._daemon.shared import publish_listing
from cachefeed._remote import Remote
from cachefeed._testing.daemon import BUCKET, StartDaemon, start_daemon, write_config
from cachefeed._testing.inventory import write_inventory, write_key_list
from cachefeed._testing.local_s3 import storage_options
from cachefeed._testing.proxy import FaultProxy, Rule
from cachefeed._testing.samples import cache_samples, upload_arrays

INVENTORY_BUCKET = "inventory-destination"
NO_LIST = [Rule("status", op="ListObjectsV2", status=403), Rule("status", op="ListObjects", status=403)]


def no_list_was_sent(proxy: FaultProxy) -> None:
    ops = proxy.counts().ops
    assert ops.get("ListObjectsV2", 0) == 0, ops
    assert ops.get("ListObjects", 0) == 0, ops


def run_daemon_on(
    manifest: str, uploaded: dict[str, Any], proxy: FaultProxy, daemon: StartDaemon, **remote: Any
) -> dict[str, Any]:
    proxy.set_rules(NO_LIST)
    proxy.reset_counts()
    proc = daemon(endpoint=proxy.endpoint, sections={"remote": {"manifest": manifest, **remote}})
    doc = proc.wait_status(
        lambda d: d["ingest"]["objects_total"] >= len(uploaded), timeout_s=40, what="every object cached"
    )
    assert proc.stop() == 0
    root = remote.get("url", f"s3://{BUCKET}/").removeprefix(f"s3://{BUCKET}/").strip("/")
    relative = {key.removeprefix(f"{root}/") if root else key for key in uploaded}  # __key__: relative to the URL
    assert {sample["__key__"] for _, sample in cache_samples(proc.cache_dir)} == relative
    assert proxy.counts().ops.get("GetObject", 0) >= len(uploaded)
    no_list_was_sent(proxy)
    assert doc["remote"]["list_requests_total"] == 0
    return doc


@pytest.mark.parametrize("file_format", ["CSV", "Parquet"])
def test_an_s3_inventory_drives_the_daemon_without_any_list(
    file_format: str, bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    if file_format == "Parquet":
        pytest.importorskip("pyarrow")
    uploaded = upload_arrays(bucket, BUCKET, 30, 2 << 10)
    uploaded |= upload_arrays(bucket, BUCKET, 2, 2 << 10, prefix="with space+plus/", start=30)  # URL-encoded in CSV
    bucket.create_bucket(Bucket=INVENTORY_BUCKET)
    deleted = {"bucket": BUCKET, "key": "gone.npy", "size": 10, "e_tag": "0" * 32, "is_delete_marker": True}
    deleted |= {"last_modified_date": None, "storage_class": "", "is_multipart_uploaded": False, "is_latest": True}
    key = write_inventory(
        bucket,
        source_bucket=BUCKET,
        destination_bucket=INVENTORY_BUCKET,
        file_format=file_format,
        extra_rows=[deleted] if file_format == "Parquet" else None,
    )
    doc = run_daemon_on(f"s3://{INVENTORY_BUCKET}/{key}", uploaded, fault_proxy, daemon)
    assert doc["remote"]["objects_listed"] == len(uploaded)


def test_a_gzipped_key_list_drives_the_daemon_without_any_list(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 25, 2 << 10, prefix="data/")
    bucket.create_bucket(Bucket=INVENTORY_BUCKET)
    key = write_key_list(
        bucket, source_bucket=BUCKET, destination_bucket=INVENTORY_BUCKET, key="keys.tsv.gz", prefix="data/"
    )
    doc = run_daemon_on(f"s3://{INVENTORY_BUCKET}/{key}", uploaded, fault_proxy, daemon, url=f"s3://{BUCKET}/data")
    assert doc["remote"]["objects_listed"] == 25


def test_a_key_list_without_sizes_is_fetched_without_the_length_check(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 10, 2 << 10, prefix="data/")
    bucket.create_bucket(Bucket=INVENTORY_BUCKET)
    key = write_key_list(
        bucket,
        source_bucket=BUCKET,
        destination_bucket=INVENTORY_BUCKET,
        key="keys.txt.gz",
        prefix="data/",
        sizes=False,
    )
    run_daemon_on(f"s3://{INVENTORY_BUCKET}/{key}", uploaded, fault_proxy, daemon, url=f"s3://{BUCKET}/data")


def test_an_unchanged_manifest_is_not_read_again_and_a_new_one_is(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 10, 2 << 10)
    bucket.create_bucket(Bucket=INVENTORY_BUCKET)
    key = write_inventory(bucket, source_bucket=BUCKET, destination_bucket=INVENTORY_BUCKET, files=1)
    fault_proxy.set_rules(NO_LIST)
    proc = daemon(
        endpoint=fault_proxy.endpoint,
        sections={"remote": {"manifest": f"s3://{INVENTORY_BUCKET}/{key}", "refresh_interval": "1s"}},
    )
    doc = proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 10, timeout_s=40, what="10 objects")
    fault_proxy.reset_counts()
    listed_at = doc["remote"]["last_listed_at"]
    # the next refresh (1s, or 10x the last read's duration) reads the manifest's version, no more
    proc.wait_status(lambda d: d["remote"]["last_listed_at"] > listed_at + 0.5, timeout_s=30, what="a refresh")
    inventory = {(method, key): n for (method, key), n in fault_proxy.counts().requests.items() if "inventory" in key}
    assert inventory, "the manifest was checked"
    assert {method for method, _ in inventory} == {"HEAD"}, inventory
    uploaded |= upload_arrays(bucket, BUCKET, 5, 2 << 10, start=10)
    write_inventory(bucket, source_bucket=BUCKET, destination_bucket=INVENTORY_BUCKET, files=1)
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 15, timeout_s=40, what="5 new objects from it")
    no_list_was_sent(fault_proxy)
    assert proc.stop() == 0


def test_sources_from_a_manifest_and_from_a_shared_catalog_are_cached_whole_without_any_list(
    tmp_path: Path, bucket: Any, fault_proxy: FaultProxy
) -> None:
    """[[source]] tables, one read from a key list and one from a shared catalog: every object of both cached,
    each counted for its source, and no LIST sent by the daemon."""
    ours = upload_arrays(bucket, BUCKET, 20, 2 << 10, prefix="a/")
    theirs = upload_arrays(bucket, BUCKET, 30, 2 << 10, prefix="b/", start=100)
    bucket.create_bucket(Bucket=INVENTORY_BUCKET)
    key = write_key_list(bucket, source_bucket=BUCKET, destination_bucket=INVENTORY_BUCKET, key="a.tsv.gz", prefix="a/")
    options = storage_options(fault_proxy.endpoint)
    remote = Remote(RemoteConfig(url=f"s3://{BUCKET}/b", storage_options=options))
    try:
        publish_listing(remote, f"s3://{INVENTORY_BUCKET}/b.cfcatalog")
    finally:
        remote.close()
    fault_proxy.set_rules(NO_LIST)
    fault_proxy.reset_counts()
    cache_dir = tmp_path / "cache"
    config = write_config(tmp_path / "daemon.toml", endpoint=fault_proxy.endpoint, bucket=BUCKET, cache_dir=cache_dir)
    document = tomllib.loads(config.read_text())
    del document["remote"]["url"], document["remote"]["storage_options"]
    document["source"] = [
        {
            "name": "a",
            "url": f"s3://{BUCKET}/a",
            "storage_options": options,
            "manifest": f"s3://{INVENTORY_BUCKET}/{key}",
        },
        {
            "name": "b",
            "url": f"s3://{BUCKET}/b",
            "storage_options": options,
            "catalog": f"s3://{INVENTORY_BUCKET}/b.cfcatalog",
        },
    ]
    config.write_text(toml_text(document))
    proc = start_daemon(config, cache_dir, tmp_path / "daemon.stderr")
    try:
        doc = proc.wait_status(
            lambda d: d["ingest"]["objects_total"] >= len(ours) + len(theirs), timeout_s=60, what="both sources cached"
        )
        assert proc.stop() == 0
    finally:
        proc.kill_group()
    cached = {sample["__key__"] for _, sample in cache_samples(cache_dir)}  # relative to each source's URL
    assert cached == {k.removeprefix("a/") for k in ours} | {k.removeprefix("b/") for k in theirs}
    rows = {row["name"]: row for row in doc["sources"]}
    assert rows["a"]["objects_listed"] == len(ours) and rows["a"]["objects_total"] == len(ours)
    assert rows["b"]["objects_listed"] == len(theirs) and rows["b"]["objects_total"] == len(theirs)
    no_list_was_sent(fault_proxy)
    assert doc["remote"]["list_requests_total"] == 0
