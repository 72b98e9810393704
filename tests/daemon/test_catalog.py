"""The listing thread: pages stream to the plan as they arrive, LIST requests are counted, the refresh interval
adapts to the listing's cost."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachefeed._config import RemoteConfig
from cachefeed._daemon.catalog import Catalog, ListingEnd
from cachefeed._daemon.columns import FoldedPage
from cachefeed._remote import Remote, RemoteObject
from cachefeed._testing.daemon import wait_for


def make_tree(root: Path, dirs: int, per_dir: int) -> None:
    for d in range(dirs):
        (root / f"class-{d:02d}").mkdir(parents=True)
        for i in range(per_dir):
            (root / f"class-{d:02d}" / f"{i:03d}.bin").write_bytes(b"x" * i)


def test_a_local_listing_is_one_page_per_directory_in_path_order(tmp_path: Path) -> None:
    make_tree(tmp_path / "data", 4, 5)
    remote = Remote(RemoteConfig(url=f"file://{tmp_path}/data"))
    pages: list[list[RemoteObject]] = []
    assert remote.list_pages(pages.append) == 20
    paths = [obj.path for page in pages for obj in page]
    assert paths == sorted(paths)
    assert [len(page) for page in pages if page] == [5, 5, 5, 5]
    assert remote.stats.list_requests_total == 5  # the root and four directories


def test_pages_reach_the_plan_before_the_listing_ends(tmp_path: Path) -> None:
    make_tree(tmp_path / "data", 3, 4)
    catalog = Catalog(RemoteConfig(url=f"file://{tmp_path}/data"), label="parent")
    release = False
    inner = catalog.source

    def slow_source(on_page: Callable[[Any], None]) -> int | None:
        def gated(objects: Any) -> None:
            on_page(objects)
            if objects:  # (the root's page has no files)
                wait_for(lambda: release, timeout_s=10, what="the test to see the first page")

        return inner(gated)

    catalog.source = slow_source
    catalog.start()
    try:
        items: list[FoldedPage | ListingEnd] = []
        wait_for(
            lambda: items.extend(catalog.take()) or any(isinstance(i, FoldedPage) and i.paths for i in items),
            timeout_s=10,
            what="a page",
        )
        assert not any(isinstance(item, ListingEnd) for item in items)  # the listing is still running
        release = True
        wait_for(lambda: items.extend(catalog.take()) or isinstance(items[-1], ListingEnd), timeout_s=10)
        pages = [item for item in items if isinstance(item, FoldedPage)]
        assert sum(len(page.paths) for page in pages) == 12
        assert set().union(*(page.classes for page in pages)) == {"class-00", "class-01", "class-02"}
    finally:
        catalog.stop()


def test_the_refresh_interval_is_never_under_ten_listings(tmp_path: Path) -> None:
    make_tree(tmp_path / "data", 2, 3)
    catalog = Catalog(RemoteConfig(url=f"file://{tmp_path}/data", refresh_interval_s=0.5))
    inner = catalog.source

    def slow_source(on_page: Callable[[Any], None]) -> int | None:
        time.sleep(0.3)
        return inner(on_page)

    catalog.source = slow_source
    catalog.start()
    try:
        state = wait_for(lambda: catalog.state() if catalog.state().last_listed_at else None, timeout_s=10)
        assert state.last_listing_s >= 0.3
        assert state.refresh_interval_s >= 10 * state.last_listing_s  # not 0.5 s
        assert state.list_requests_total == 3
        assert abs(state.list_requests_per_hour - 3 * 3600 / state.refresh_interval_s) < 1e-6
    finally:
        catalog.stop()


def test_an_unreadable_restart_catalog_is_skipped_and_the_remote_is_listed(tmp_path: Path) -> None:
    make_tree(tmp_path / "data", 1, 3)
    catalog = Catalog(RemoteConfig(url=f"file://{tmp_path}/data"))

    def damaged(on_page: Callable[[Any], None]) -> int:
        raise ValueError("not JSON")  # what a damaged block header gives

    catalog.restore = damaged
    catalog.start()
    try:
        items: list[FoldedPage | ListingEnd] = []
        wait_for(lambda: items.extend(catalog.take()) or (items and isinstance(items[-1], ListingEnd)), timeout_s=10)
        assert items[-1] == ListingEnd(3, items[-1].duration_s)  # the listing, not a restore
    finally:
        catalog.stop()
