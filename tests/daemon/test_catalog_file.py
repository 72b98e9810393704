"""Catalog files: written once, read page by page for one node; the restart catalog of a real daemon."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from cachefeed._daemon.catalog_file import (
    CatalogFileError,
    CatalogHeader,
    CatalogWriter,
    load_restart,
    read_pages,
    restart_header,
    save_restart,
)
from cachefeed._daemon.columns import FoldedPage
from cachefeed._daemon.plan import SamplingPlan, owner_of
from cachefeed._remote import RemoteObject
from cachefeed._testing.daemon import BUCKET, StartDaemon
from cachefeed._testing.proxy import FaultProxy, Rule
from cachefeed._testing.samples import cache_samples, upload_arrays

VERSIONS = ['"0123456789abcdef0123456789abcdef"', "1700000000000000000-10", "gen-7", None, '"abc-3"']


def objects(n: int) -> list[RemoteObject]:
    return [RemoteObject(f"bucket/data/c{i % 7}/k{i:05d}", i, VERSIONS[i % len(VERSIONS)]) for i in range(n)]


def write(pages: list[list[RemoteObject]], header: CatalogHeader) -> bytes:
    out = io.BytesIO()
    writer = CatalogWriter(out, header)
    for page in pages:
        writer.write_objects(page)
    writer.close()
    return out.getvalue()


def read_all(data: bytes, rank: int = 0, count: int = 1) -> list[RemoteObject]:
    plan = SamplingPlan(rank=rank, count=count)
    pages = read_pages(io.BytesIO(data).read, rank, count, label="parent")
    assert isinstance(next(pages), CatalogHeader)
    for page in pages:
        assert isinstance(page, FoldedPage)
        plan.update_page(page)
    plan.end_listing()
    return sorted((plan.object(int(oid)) for oid in plan.listed_oids()), key=lambda o: o.path)


def test_a_catalog_file_reads_back_every_object_of_each_node_exactly() -> None:
    listing = sorted(objects(3000), key=lambda o: o.path)
    data = write([listing[:1000], listing[1000:]], CatalogHeader("s3://bucket/data", "**"))
    assert read_all(data) == listing
    for rank in range(3):
        assert read_all(data, rank, 3) == [o for o in listing if owner_of(o.path, 3) == rank]


def test_each_page_of_a_catalog_file_names_its_classes() -> None:
    data = write([objects(30)], CatalogHeader("s3://bucket/data", "**"))
    pages = [p for p in read_pages(io.BytesIO(data).read, 0, 1, label="parent") if isinstance(p, FoldedPage)]
    assert pages[0].classes == {f"c{i}" for i in range(7)}


def test_a_truncated_catalog_file_is_an_error_not_a_shorter_listing() -> None:
    data = write([objects(100), objects(200)[100:]], CatalogHeader("u", "**"))
    with pytest.raises(CatalogFileError, match="truncated"):
        read_all(data[:-10])
    with pytest.raises(CatalogFileError, match="not a cachefeed catalog"):
        read_all(b"something else")


def test_a_catalog_file_of_one_node_is_refused_by_another() -> None:
    data = write([objects(10)], CatalogHeader("u", "**", rank=1, count=4))
    with pytest.raises(CatalogFileError, match="node 1 of 4"):
        read_all(data, 2, 4)


def test_a_restart_catalog_round_trips_and_is_ignored_for_another_remote(tmp_path: Path) -> None:
    plan = SamplingPlan(rank=1, count=2)
    plan.update_catalog(objects(500))
    header = restart_header("s3://bucket/data", "**", 1, 2)
    path = tmp_path / "catalog.cfcat"
    assert save_restart(path, plan.table, plan.listed(), header, mode=0o600, max_bytes=1 << 20)
    again = SamplingPlan(rank=1, count=2)
    for page in load_restart(path, header):
        again.update_page(page)
    again.end_listing(is_restored=True)

    def by_path(p: SamplingPlan) -> list[RemoteObject]:  # the file keeps rows in hash order
        return sorted((p.object(int(i)) for i in p.listed_oids()), key=lambda o: o.path)

    assert by_path(again) == by_path(plan)
    assert list(load_restart(path, restart_header("s3://bucket/other", "**", 1, 2))) == []
    assert not save_restart(path, plan.table, plan.listed(), header, mode=0o600, max_bytes=1000)
    assert not path.exists()  # too large for its share of the budget: not kept


def test_a_restarted_daemon_fetches_from_its_restart_catalog_while_listing_is_refused(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 40, 4 << 10)
    first = daemon(endpoint=fault_proxy.endpoint, sections={"remote": {"refresh_interval": "1h"}})
    first.wait_status(lambda d: d["ingest"]["objects_total"] >= 40, timeout_s=40, what="40 objects cached")
    assert first.stop() == 0
    assert list(first.cache_dir.glob("catalog-*.cfcat"))
    for segment in (first.cache_dir / "segments").iterdir():
        segment.unlink()  # the cache lost its data, not its catalog: every object must be fetched again
    fault_proxy.set_rules([Rule("status", op="ListObjectsV2", status=403)])
    fault_proxy.reset_counts()
    second = daemon(endpoint=fault_proxy.endpoint, sections={"remote": {"refresh_interval": "1h"}})
    doc = second.wait_status(lambda d: d["ingest"]["objects_total"] >= 40, timeout_s=40, what="40 objects again")
    counts = fault_proxy.counts()
    assert counts.ops.get("GetObject", 0) >= 40
    assert counts.ops.get("ListObjectsV2", 0) >= 1  # it did try to list, and was refused
    assert doc["remote"]["objects_listed"] == 0
    assert second.stop() == 0
    keys = {sample["__key__"] for _, sample in cache_samples(second.cache_dir)}
    assert keys == set(uploaded)


def test_a_restart_catalog_written_while_the_table_grows_holds_the_listing_it_was_asked_for(tmp_path: Path) -> None:
    plan = SamplingPlan()
    plan.update_catalog(objects(300))
    listed = plan.listed()  # what the supervisor hands the writer thread
    plan.update_page(plan.fold(objects(400)[300:]))  # the next listing goes on in the table meanwhile
    path = tmp_path / "catalog.cfcat"
    header = restart_header("s3://bucket/data", "**", 0, 1)
    assert save_restart(path, plan.table, listed, header, mode=0o600, max_bytes=1 << 20)
    again = SamplingPlan()
    for page in load_restart(path, header):
        again.update_page(page)
    again.end_listing(is_restored=True)
    assert sorted(again.object(int(i)).path for i in again.listed_oids()) == sorted(o.path for o in objects(300))
