"""The shared catalog: ``cachefeed catalog build`` lists once; N daemons read its generations and never list.

Witness: the S3 proxy's request counts (what the store saw), with LIST refused for the daemons.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cachefeed._config import RemoteConfig
from cachefeed._daemon.catalog_file import CatalogFileError
from cachefeed._daemon.shared import SharedCatalog, publish_listing
from cachefeed._errors import RemoteTransientError
from cachefeed._remote import Remote
from cachefeed._testing.daemon import BUCKET, DaemonProcess, start_daemon, wait_while_running, write_config
from cachefeed._testing.local_s3 import LocalS3, storage_options
from cachefeed._testing.proxy import FaultProxy, Rule
from cachefeed._testing.samples import cache_samples, upload_arrays

NODES = 3
CATALOGS = "catalogs"


def build(proxy: FaultProxy) -> str:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachefeed",
            "catalog",
            "build",
            f"s3://{BUCKET}/",
            "--out",
            f"s3://{CATALOGS}/train",
            "--storage-options",
            json.dumps(storage_options(proxy.endpoint)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def cached_keys(proc: DaemonProcess) -> set[str]:
    return {sample["__key__"] for _, sample in cache_samples(proc.cache_dir)}


def test_n_daemons_on_a_shared_catalog_cost_one_listing_of_list_requests(
    tmp_path: Path, s3: LocalS3, bucket: Any, fault_proxy: FaultProxy
) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 1100, 16)  # two LIST pages of 1,000
    bucket.create_bucket(Bucket=CATALOGS)
    fault_proxy.reset_counts()
    out = build(fault_proxy)
    assert "1100 objects" in out, out
    one_listing = fault_proxy.counts().ops.get("ListObjectsV2", 0)
    assert one_listing == 2

    fault_proxy.set_rules([Rule("status", op="ListObjectsV2", status=403)])  # the daemons may not list
    daemons = []
    try:
        for rank in range(NODES):
            config = write_config(
                tmp_path / f"node-{rank}.toml",
                endpoint=fault_proxy.endpoint,
                bucket=BUCKET,
                cache_dir=tmp_path / f"cache-{rank}",
                sections={
                    "remote": {"catalog": f"s3://{CATALOGS}/train", "refresh_interval": "1s"},
                    "node": {"rank": rank, "count": NODES},
                    "sampler": {"processes": 1},
                },
            )
            daemons.append(start_daemon(config, tmp_path / f"cache-{rank}", tmp_path / f"node-{rank}.stderr", env={}))

        def all_cached() -> bool:
            return sum(len(cached_keys(proc)) for proc in daemons if proc.status()) == len(uploaded)

        wait_while_running(daemons, all_cached, timeout_s=90, what="every object cached by one of the nodes")
        per_node = [cached_keys(proc) for proc in daemons]
        assert set().union(*per_node) == set(uploaded)
        assert sum(len(keys) for keys in per_node) == len(uploaded)  # disjoint
        assert all(per_node)

        # a refresh: the lister publishes a new generation; the nodes pick up its new objects, still no LIST
        fault_proxy.set_rules([])
        uploaded |= upload_arrays(bucket, BUCKET, 30, 16, start=1100)
        build(fault_proxy)
        fault_proxy.set_rules([Rule("status", op="ListObjectsV2", status=403)])
        wait_while_running(daemons, all_cached, timeout_s=60, what="the 30 new objects cached")

        def all_read_the_new_generation() -> bool:  # the status document is rewritten every second or so
            docs = [proc.status() for proc in daemons]
            return all(doc is not None and doc["remote"]["objects_listed"] == len(uploaded) for doc in docs)

        wait_while_running(
            daemons, all_read_the_new_generation, timeout_s=30, what="every node's status counting 1,130 objects"
        )
        for proc in daemons:
            doc = proc.status()
            assert doc is not None and doc["remote"]["list_requests_total"] == 0
        counts = fault_proxy.counts()
        assert counts.faults.get("status", 0) == 0, "no daemon tried to list"
        assert counts.ops.get("ListObjectsV2", 0) == 2 * one_listing  # two listings, by the lister, for N nodes
    finally:
        for proc in daemons:
            proc.kill_group()


def test_a_damaged_generation_is_refused_by_name_and_the_one_in_force_stays(
    s3: LocalS3, bucket: Any, fault_proxy: FaultProxy
) -> None:
    upload_arrays(bucket, BUCKET, 300, 16)
    bucket.create_bucket(Bucket=CATALOGS)
    config = RemoteConfig(url=f"s3://{BUCKET}/", storage_options=storage_options(fault_proxy.endpoint))
    remote = Remote(config)
    try:
        good, _, _ = publish_listing(remote, f"s3://{CATALOGS}/train")
        reader = SharedCatalog(remote, f"s3://{CATALOGS}/train", rank=0, count=1)
        assert reader(lambda page: None) == 300
        whole = bucket.get_object(Bucket=CATALOGS, Key=f"train/{good}")["Body"].read()
        middle = len(whole) * 3 // 5  # in the columns of the block: only its checksum can tell
        garbled = whole[:middle] + bytes(255 - b for b in whole[middle : middle + 8]) + whole[middle + 8 :]
        for damaged, body in [("gen-z-truncated.cfcat", whole[: len(whole) // 2]), ("gen-z-garbled.cfcat", garbled)]:
            bucket.put_object(Bucket=CATALOGS, Key=f"train/{damaged}", Body=body)
            bucket.put_object(Bucket=CATALOGS, Key="train/LATEST", Body=f"{damaged}\n{good}\n".encode())
            unusable = rf"generation {damaged} under s3://{CATALOGS}/train is not usable \(the catalog file is"
            with pytest.raises(CatalogFileError, match=unusable):
                reader(lambda page: None)
        bucket.put_object(Bucket=CATALOGS, Key="train/LATEST", Body=f"{good}\n".encode())
        assert reader(lambda page: None) is None  # the generation in force is still the good one: nothing to read
    finally:
        remote.close()


def test_a_generation_read_through_a_reset_and_a_500_lists_every_object(
    s3: LocalS3, bucket: Any, fault_proxy: FaultProxy
) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 300, 16)
    bucket.create_bucket(Bucket=CATALOGS)
    config = RemoteConfig(
        url=f"s3://{BUCKET}/", storage_options=storage_options(fault_proxy.endpoint), backoff_base_s=0.01
    )
    remote = Remote(config)
    try:
        publish_listing(remote, f"s3://{CATALOGS}/train")
        fault_proxy.set_rules(
            [
                Rule("reset", op="GetObject", key="gen-", body_fraction=0.5, max_count=1),
                Rule("error500", op="GetObject", key="gen-", max_count=1),
            ]
        )
        paths: list[str] = []
        reader = SharedCatalog(remote, f"s3://{CATALOGS}/train", rank=0, count=1)
        assert reader(lambda page: paths.extend(page.paths)) == 300
        assert sorted(paths) == sorted(f"{BUCKET}/{key}" for key in uploaded)
        assert fault_proxy.counts().fault("reset") == 1 and fault_proxy.counts().fault("error500") == 1
    finally:
        remote.close()


def test_node_0_publishes_each_changed_listing_and_the_other_nodes_read_it_without_listing(
    tmp_path: Path, s3: LocalS3, bucket: Any, fault_proxy: FaultProxy
) -> None:
    """Witness: LATEST, what every reader reads, and the generation objects in the bucket. (Node 0 writes each
    listing as a generation object while it lists and deletes it when the listing is the one published last:
    between its last page and that deletion the bucket holds an unnamed object no reader opens, so the objects are
    counted only between listings.)"""
    uploaded = upload_arrays(bucket, BUCKET, 1100, 16)
    bucket.create_bucket(Bucket=CATALOGS)
    daemons: list[DaemonProcess] = []

    def published() -> list[str]:
        """The generations LATEST names, newest first."""
        latest: bytes = bucket.get_object(Bucket=CATALOGS, Key="train/LATEST")["Body"].read()
        return latest.decode().split()

    def generations() -> list[str]:
        listed = bucket.list_objects_v2(Bucket=CATALOGS, Prefix="train/").get("Contents", [])
        return [item["Key"].removeprefix("train/") for item in listed if "/gen-" in item["Key"]]

    def all_cached() -> bool:
        return sum(len(cached_keys(proc)) for proc in daemons if proc.status()) == len(uploaded)

    def wait_for_node_0_listing(what: str) -> None:
        """Until node 0 has ended one more listing (its log line), published or not."""
        ended = len(re.findall(r" listed \d+ objects", daemons[0].stderr()))
        wait_while_running(
            daemons,
            lambda: len(re.findall(r" listed \d+ objects", daemons[0].stderr())) > ended,
            timeout_s=120,
            what=what,
        )

    try:
        for rank in range(2):
            config = write_config(
                tmp_path / f"node-{rank}.toml",
                endpoint=fault_proxy.endpoint,
                bucket=BUCKET,
                cache_dir=tmp_path / f"cache-{rank}",
                sections={
                    "remote": {"catalog": f"s3://{CATALOGS}/train", "catalog_publish": True, "refresh_interval": "1s"},
                    "node": {"rank": rank, "count": 2},
                    "sampler": {"processes": 1},
                },
            )
            daemons.append(start_daemon(config, tmp_path / f"cache-{rank}", tmp_path / f"node-{rank}.stderr", env={}))
        wait_while_running(daemons, all_cached, timeout_s=90, what="every object cached by one of the two nodes")
        per_node = [cached_keys(proc) for proc in daemons]
        assert per_node[0] and per_node[1] and not per_node[0] & per_node[1]

        first = published()
        assert len(first) == 1
        # Any listing that ends now began after the first one ended (node 1 read that one's generation): it
        # lists the same 1100 objects.
        wait_for_node_0_listing("node 0 listing once more (every 10 listing durations)")
        assert re.findall(r" listed (\d+) objects", daemons[0].stderr())[-1] == "1100"
        assert published() == first  # an unchanged listing publishes nothing new ...
        assert first[0] in generations()  # ... and the generation readers read stays

        uploaded |= upload_arrays(bucket, BUCKET, 30, 16, start=1100)
        wait_while_running(
            daemons, all_cached, timeout_s=60, what="the 30 new objects cached, node 1's share from a new generation"
        )
        wait_for_node_0_listing("node 0 listing after the new objects were cached")
        # One generation more, or two where a listing ran during the upload and saw part of it (each changed
        # listing is published); the unchanged listing since published nothing.
        newest = published()
        assert 2 <= len(newest) <= 3 and newest[-1] == first[0]
        assert set(newest) <= set(generations())
        reader = daemons[1].status()
        assert reader is not None and reader["remote"]["list_requests_total"] == 0  # node 1 never listed
        assert reader["remote"]["objects_listed"] == len(uploaded)
    finally:
        for proc in daemons:
            proc.kill_group()


def test_a_listing_that_fails_part_way_publishes_nothing(s3: LocalS3, bucket: Any, fault_proxy: FaultProxy) -> None:
    upload_arrays(bucket, BUCKET, 1100, 16)  # two LIST pages: the second one fails
    bucket.create_bucket(Bucket=CATALOGS)
    fault_proxy.set_rules([Rule("error500", op="ListObjectsV2", query="continuation-token")])
    config = RemoteConfig(
        url=f"s3://{BUCKET}/", storage_options=storage_options(fault_proxy.endpoint), max_attempts=2, backoff_max_s=0.1
    )
    remote = Remote(config)
    try:
        with pytest.raises(RemoteTransientError):
            publish_listing(remote, f"s3://{CATALOGS}/train")
    finally:
        remote.close()
    assert fault_proxy.counts().fault("error500") == 2
    assert bucket.list_objects_v2(Bucket=CATALOGS).get("KeyCount") == 0  # no generation object, no LATEST
