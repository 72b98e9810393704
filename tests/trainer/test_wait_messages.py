"""What a new user reads while ``EpochLoaderFactory`` starts: a misspelled keyword named as the factory's, a wait
that says why nothing will fill the cache, a wrong ``cache_dir`` told at once or while waiting, and no progress
line where nothing waited."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest

from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.store import CacheStore
from cachefeed._errors import NoSuchCacheError, SnapshotError
from cachefeed._fsutil import atomic_write
from cachefeed._trainer import EpochLoaderFactory
from tests.status.test_status import make_document
from tests.support.cache_helpers import cache_config
from tests.trainer.test_loader import build_cache


def test_a_misspelled_keyword_is_the_factorys_error_with_a_close_match_and_told_at_once(tmp_path: Path) -> None:
    """It was DataLoader's TypeError (a class the user never called), raised after the wait for the cache."""
    root = build_cache(tmp_path / "c", 20)
    with pytest.raises(TypeError) as raised:
        EpochLoaderFactory(root, batch_size=8, num_worker=2, progress=None)
    assert str(raised.value) == (
        "EpochLoaderFactory() got an unexpected keyword argument 'num_worker': did you mean 'num_workers'?"
    )
    with pytest.raises(TypeError, match=r"'wait_timeout': did you mean 'wait_timeout_s'\?"):
        EpochLoaderFactory(root, batch_size=8, wait_timeout=5, progress=None)
    with pytest.raises(TypeError, match=r"'pin_memroy': did you mean 'pin_memory'\?"):
        EpochLoaderFactory(root, batch_size=8, pin_memroy=True, progress=None)
    with pytest.raises(TypeError, match=r"^EpochLoaderFactory\(\) got an unexpected keyword argument 'zzz'"):
        EpochLoaderFactory(root, batch_size=8, zzz=1, progress=None)
    started = time.monotonic()
    with pytest.raises(TypeError, match="'num_worker'"):  # before the wait for a cache that is not there yet
        EpochLoaderFactory(tmp_path / "not-yet", batch_size=8, num_worker=2, wait_timeout_s=60, progress=None)
    assert time.monotonic() - started < 5
    with EpochLoaderFactory(root, batch_size=8, pin_memory=False, timeout=0, in_order=True, progress=None) as factory:
        assert sum(len(batch["__key__"]) for batch in factory.loader(0)) == 20, "DataLoader's own keywords pass"


def empty_cache(root: Path) -> Path:
    """A cache no daemon holds (created, then let go), with nothing in it."""
    CacheStore(cache_config(root)).close()
    return root


def test_a_wait_on_an_empty_cache_without_a_daemon_says_so_and_names_the_default_it_waited_for(
    tmp_path: Path,
) -> None:
    """It showed `... to fill [....] 0% of 75%` every 10 s for 600 s, then blamed min_samples = '75%' (unset)."""
    root = empty_cache(tmp_path / "c")
    shown = io.StringIO()
    with EpochLoaderFactory(root, batch_size=8, wait_timeout_s=0.3, progress=shown) as factory:
        with pytest.raises(SnapshotError) as raised:
            factory.loader(0)
    first_line = shown.getvalue().splitlines()[0]
    assert "0% of 75%" in first_line and "no daemon runs on this cache (cachefeed status)" in first_line
    assert "the first epoch's default fill (75%)" in str(raised.value)
    assert "min_samples = " not in str(raised.value)
    with EpochLoaderFactory(root, batch_size=8, min_samples="50%", wait_timeout_s=0.3, progress=None) as factory:
        with pytest.raises(SnapshotError, match="short of min_samples = '50%'"):  # the user's own setting
            factory.loader(0)


@pytest.mark.parametrize("min_samples", [None, "75%", 10])
def test_a_wait_on_a_degraded_daemon_shows_its_first_reason(tmp_path: Path, min_samples: int | str | None) -> None:
    root = tmp_path / "c"
    daemon = CacheStore(cache_config(root))  # holds the cache's lock as a daemon does, fetches nothing
    reason = "remote s3://bucket/prefix: access denied (403) on every object: check the credentials"
    document = make_document(
        root, state="degraded", degraded_reasons=[reason, "a second reason"], cache__fill=0.0, cache__is_paced=False
    )
    atomic_write(CacheLayout(root).status_file, json.dumps(document).encode())
    shown = io.StringIO()
    try:
        with EpochLoaderFactory(
            root, batch_size=8, min_samples=min_samples, wait_timeout_s=0.3, progress=shown
        ) as factory:
            with pytest.raises(SnapshotError):
                factory.loader(0)
    finally:
        daemon.close()
    first_line = shown.getvalue().splitlines()[0]
    assert f"the daemon is degraded: {reason}" in first_line
    assert "a second reason" not in first_line


def test_a_cache_dir_that_does_not_appear_says_check_the_path_while_waiting(tmp_path: Path) -> None:
    shown = io.StringIO()
    with pytest.raises(NoSuchCacheError, match="check the path"):
        EpochLoaderFactory(tmp_path / "cahce", batch_size=8, wait_timeout_s=0.3, progress=shown)
    first_line = shown.getvalue().splitlines()[0]
    assert f"waiting for the cache at {tmp_path / 'cahce'} to appear" in first_line
    assert "check the path; giving up after 0.3s" in first_line


def test_a_directory_that_holds_other_files_and_no_cache_is_refused_at_once(tmp_path: Path) -> None:
    """The dataset's root given for the cache: it waited wait_timeout_s (600 s by default) for a daemon."""
    dataset = tmp_path / "imagenet"
    (dataset / "train").mkdir(parents=True)
    (dataset / "labels.csv").write_text("n01440764,0\n")
    started = time.monotonic()
    with pytest.raises(NoSuchCacheError) as raised:
        EpochLoaderFactory(dataset, batch_size=8, wait_timeout_s=60, progress=None)
    assert time.monotonic() - started < 5
    message = str(raised.value)
    assert str(dataset) in message and "is not a cachefeed cache and cannot become one" in message
    assert "(labels.csv, train/)" in message, message
    # a fresh filesystem's mount point, a cache a daemon is creating, a mount root's quota file: it may become a
    # cache (any other file, however small, may not: tests/daemon/test_cache_dir_of_its_own.py)
    for name, made in (("mounted", "lost+found"), ("being-made", "segments"), ("quota", "aquota.user")):
        if made == "aquota.user":
            (tmp_path / name).mkdir()
            (tmp_path / name / made).write_bytes(bytes(8 << 10))
        else:
            (tmp_path / name / made).mkdir(parents=True)
        with pytest.raises(NoSuchCacheError, match=r"waited 0\.2s"):
            EpochLoaderFactory(tmp_path / name, batch_size=8, wait_timeout_s=0.2, progress=None)


def test_a_start_that_waits_for_nothing_prints_nothing(tmp_path: Path) -> None:
    """Every start printed `waiting for segments ... 12/1 (100%) 0s` while nothing waited."""
    root = build_cache(tmp_path / "c", 40)
    daemon = CacheStore(cache_config(root))  # a daemon runs: the first epoch grows (waits for a segment)
    atomic_write(CacheLayout(root).status_file, json.dumps(make_document(root)).encode())  # paced: it ends
    shown = io.StringIO()
    try:
        with EpochLoaderFactory(root, batch_size=8, progress=shown) as factory:
            assert sum(len(batch["__key__"]) for batch in factory.loader(0)) == 40
            assert factory.stats(0).samples == 40
    finally:
        daemon.close()
    assert shown.getvalue() == ""
