"""The compact catalog: memory per object, exact versions, the index, and listings folded in page by page."""

from __future__ import annotations

import numpy as np
import pytest

from cachefeed._daemon import columns
from cachefeed._daemon.columns import ObjectTable, fold_page, merge_runs, order_keys, pass_order
from cachefeed._daemon.plan import SamplingPlan
from cachefeed._remote import RemoteObject


def listing(n: int, start: int = 0, *, version: str = "v") -> list[RemoteObject]:
    return [
        RemoteObject(f"bucket/train/class-{i % 100:03d}/{i:09d}.jpg", 1000 + i, f'"{i:031x}{version[0]}"')
        for i in range(start, start + n)
    ]


def paths_of(drawn: list[tuple[int, RemoteObject]]) -> list[str]:
    return [obj.path for _, obj in drawn]


def test_a_settled_catalog_costs_at_most_64_bytes_per_owned_object_beyond_its_keys() -> None:
    objects = listing(200_000, version="a")
    plan = SamplingPlan(seed=1)
    for page in range(0, len(objects), 1000):
        plan.update_page(plan.fold(objects[page : page + 1000]))
    plan.end_listing()
    plan.next(1)  # a pass started: its queue is counted too
    assert plan.owned == 200_000
    beyond_keys = plan.nbytes - plan.table.key_bytes
    assert beyond_keys / plan.owned <= 64


def test_objects_other_nodes_own_cost_nothing() -> None:
    objects = listing(100_000, version="a")
    plan = SamplingPlan(rank=3, count=10)
    plan.update_catalog(objects)
    plan.next(1)
    assert 9_000 < plan.owned < 11_000
    assert (plan.nbytes - plan.table.key_bytes) / plan.owned <= 64  # nothing kept for the other 90%
    assert plan.table.key_bytes < sum(len(o.path) for o in objects) / 5


def test_every_kind_of_version_reads_back_exactly() -> None:
    versions = [
        '"0123456789abcdef0123456789abcdef"',  # S3, quoted MD5
        "0123456789abcdef0123456789abcdef",  # bare (S3 Inventory)
        '"0123456789ABCDEF0123456789ABCDEF"',  # upper case: kept as a string
        '"0123456789abcdef0123456789abcdef-12"',  # multipart
        "1700000000123456789-4096",  # a local file's mtime_ns and size
        "-5-7",
        "007-1",  # not canonical: kept as a string
        "1712345678901234",  # a GCS generation
        None,
    ]
    objects = [RemoteObject(f"b/k{i}", i, v) for i, v in enumerate(versions)]
    table = ObjectTable()
    page = fold_page(objects, 0, 1)
    table.add(page, np.arange(len(objects)))
    assert [table.get(i) for i in range(len(objects))] == objects
    changed = [RemoteObject(o.path, o.size, "x") for o in objects]
    other = fold_page(changed, 0, 1)
    oids = table.lookup(other.paths, other.hashes)
    assert table.changed(oids, other, np.arange(len(objects))).all()
    assert not table.changed(oids, page, np.arange(len(objects))).any()


def test_paths_whose_hashes_collide_keep_their_own_rows() -> None:
    table = ObjectTable()
    page = fold_page([RemoteObject("b/one", 1, None), RemoteObject("b/two", 2, None)], 0, 1)
    page.hashes[:] = 42  # force a collision
    table.add(page, np.arange(2))
    assert table.lookup(page.paths, page.hashes).tolist() == [0, 1]
    third = fold_page([RemoteObject("b/three", 3, None)], 0, 1)
    third.hashes[:] = 42
    assert table.lookup(third.paths, third.hashes).tolist() == [-1]
    table.add(third, np.arange(1))
    assert table.lookup(third.paths, third.hashes).tolist() == [2]
    assert table.get(2) == RemoteObject("b/three", 3, None)
    assert sorted(np.concatenate([oids for _, oids in table.runs()]).tolist()) == [0, 1, 2]  # all take part in passes


def test_the_first_page_is_drawn_before_the_listing_ends() -> None:
    plan = SamplingPlan(seed=3)
    plan.update_page(plan.fold(listing(1000)))
    first = plan.next(10)
    assert len(first) == 10


def test_a_pass_over_a_catalog_listed_page_by_page_is_without_replacement() -> None:
    objects = listing(5000)
    plan = SamplingPlan(seed=4)
    drawn: list[str] = []
    for page in range(0, len(objects), 1000):
        plan.update_page(plan.fold(objects[page : page + 1000]))
        batch = plan.next(700)  # draws run ahead of the listing, then fall behind it
        plan.done([oid for oid, _ in batch], 1)
        drawn += paths_of(batch)
    plan.end_listing()
    while batch := plan.next(1000):
        plan.done([oid for oid, _ in batch], 1)
        drawn += paths_of(batch)
    assert sorted(drawn) == sorted(o.path for o in objects)  # each object once
    # the next listing shows the same objects again: they are cached, nothing is drawn twice
    for page in range(0, len(objects), 1000):
        plan.update_page(plan.fold(objects[page : page + 1000]))
    plan.end_listing()
    assert plan.next(1000) == []


def test_objects_vanish_only_when_a_listing_completes() -> None:
    objects = listing(3000)
    plan = SamplingPlan()
    plan.update_catalog(objects)
    plan.update_page(plan.fold(objects[:1000]))  # a refresh, still listing: the rest is still drawable
    assert plan.owned == 3000
    assert len(plan.next(5000)) == 3000
    plan.end_listing()
    assert plan.owned == 1000


def test_a_failed_listing_drops_nothing() -> None:
    objects = listing(2000)
    plan = SamplingPlan()
    plan.update_catalog(objects)
    plan.update_page(plan.fold(objects[:500]))  # the listing fails after one page: no end_listing
    plan.update_page(plan.fold(objects[:1000]))  # the retry lists further, then completes
    plan.update_page(plan.fold(objects[1000:]))
    plan.end_listing()
    assert plan.owned == 2000


def test_merged_runs_and_a_laid_out_pass_agree_with_a_full_sort() -> None:
    rng = np.random.default_rng(7)
    hashes = rng.integers(0, 2**63, 5000, dtype=np.int64).astype(np.uint64)
    hashes[4000:4100] = hashes[:100]  # equal hashes in both runs: the first run's come first
    first, second = np.sort(hashes[:3000]), np.sort(hashes[3000:])
    merged, oids = merge_runs(first, np.arange(3000, dtype=np.uint32), second, np.arange(3000, 5000, dtype=np.uint32))
    assert merged.tolist() == sorted(hashes.tolist())
    both = np.concatenate([first, second])
    assert oids.tolist() == np.argsort(both, kind="stable").tolist()
    distinct = np.unique(hashes)
    runs = [
        (distinct[:2000], np.arange(2000, dtype=np.uint32)),
        (distinct[2000:], np.arange(2000, len(distinct), dtype=np.uint32)),
    ]
    laid_out = np.concatenate(pass_order(runs, seed=11)).tolist()
    assert laid_out == np.argsort(order_keys(distinct, 11), kind="stable").tolist()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(columns, "PASS_CHUNK", 256)  # laid out in 16 buckets, as 10⁷ rows are
        assert np.concatenate(pass_order(runs, seed=11)).tolist() == laid_out
    odd = np.concatenate(pass_order(runs, seed=11, keep=lambda o: o % 2 == 1)).tolist()
    assert odd == [oid for oid in laid_out if oid % 2 == 1]


def test_an_index_of_capped_runs_finds_every_path_and_a_pass_visits_each_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(columns, "MAX_RUN", 4096)  # 10⁵ rows then make many unmerged runs, as 10⁸ rows would
    objects = listing(100_000)
    plan = SamplingPlan(seed=2)
    for start in range(0, len(objects), 1000):
        plan.update_page(plan.fold(objects[start : start + 1000]))
    plan.end_listing()
    runs = plan.table.runs()
    assert len(runs) > 10 and max(len(h) for h, _ in runs) <= 4096
    page = plan.fold(objects)
    assert plan.table.lookup(page.paths, page.hashes).tolist() == list(range(len(objects)))
    drawn = paths_of(plan.next(200_000))
    assert sorted(drawn) == sorted(o.path for o in objects)


def test_narrow_columns_widen_when_a_key_end_a_size_or_a_segment_does_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Key ends, sizes and segment numbers are held in 4 bytes until a value needs 8; then the column is widened
    # once and every value reads back exactly.
    column = columns.Column(np.uint32, wide=np.int64)
    column.extend([1, 2, 3])
    assert column.data.dtype == np.uint32
    column.extend([2**32 + 7])
    column.put(0, np.int64(2**40))
    assert column.data.dtype == np.int64
    assert column.view.tolist() == [2**40, 2, 3, 2**32 + 7]
    held = column.data  # a reference held elsewhere: the column grows by a copy, not in place
    column.extend(np.arange(100_000))
    assert column.data is not held and column.view[:5].tolist() == [2**40, 2, 3, 2**32 + 7, 0]
    assert column.view[-1] == 99_999 and held[0] == 2**40
    huge = 5 << 30  # an object over 4 GiB (a tar shard)
    objects = [RemoteObject("b/small", 10, '"' + "a" * 32 + '"'), RemoteObject("b/huge", huge, None)]
    table = ObjectTable()
    table.add(fold_page(objects, 0, 1), np.arange(2))
    assert [table.get(i) for i in range(2)] == objects
    grown = fold_page([RemoteObject("b/small", huge + 1, "v2")], 0, 1)
    table.set_version_from(0, grown, 0)
    assert table.get(0) == RemoteObject("b/small", huge + 1, "v2")
    block = next(table.blocks(np.ones(2, dtype=bool), 10))
    assert sorted(block.sizes.tolist()) == [huge, huge + 1]
    plan = SamplingPlan()
    plan.update_catalog(listing(3))
    drawn = plan.next(3)
    plan.done([drawn[0][0]], 2**40)  # a segment number past 2³¹: the column widens
    plan.done([drawn[1][0]], 5)
    assert plan.cached_segments() == {2**40, 5}
    plan.evicted([2**40])
    assert plan.cached_segments() == {5}
