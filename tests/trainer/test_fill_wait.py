"""``wait_for_fill``'s restart grace at the edges the daemon tests do not reach: the wait's own timeout inside the
grace, and no grace asked for. The daemon's answers (``fill_reached``) and the sample count are played by fakes:
a daemon seen filling, then gone with 100 samples cached."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cachefeed._cache.layout import CacheLayout
from cachefeed._trainer import wait


@pytest.fixture
def a_daemon_that_goes_away(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CacheLayout:
    looks = iter([wait.Fill(False, 0.4, "")])  # the first look: a daemon filling, 40% there

    def fill_reached(layout: CacheLayout, fraction: float, have: int) -> wait.Fill:
        return next(looks, wait.Fill(True, 0.0, "no daemon is running: starting on what is cached", daemon_gone=True))

    class HundredSamples:
        def __init__(self, layout: CacheLayout) -> None:
            pass

        def count(self) -> int:
            return 100

    monkeypatch.setattr(wait, "fill_reached", fill_reached)
    monkeypatch.setattr(wait, "SampleCounter", HundredSamples)
    monkeypatch.setattr(CacheLayout, "check", lambda self: None)
    return CacheLayout(tmp_path / "cache")


def test_a_restart_grace_longer_than_the_waits_timeout_ends_at_the_timeout_on_what_is_cached(
    a_daemon_that_goes_away: CacheLayout,
) -> None:
    started = time.monotonic()
    have = wait.wait_for_fill(
        a_daemon_that_goes_away, 0.75, timeout_s=0.5, progress=None, poll_s=0.05, restart_grace_s=15.0
    )
    assert have == 100, "started on what is cached, not a timeout error"
    assert 0.5 <= time.monotonic() - started < 5.0, "waited for the daemon until the wait's own timeout"


def test_without_a_restart_grace_a_gone_daemon_starts_the_epoch_at_once(a_daemon_that_goes_away: CacheLayout) -> None:
    started = time.monotonic()
    have = wait.wait_for_fill(a_daemon_that_goes_away, 0.75, timeout_s=5.0, progress=None, poll_s=0.05)
    assert have == 100
    assert time.monotonic() - started < 1.0


def test_the_wait_for_the_first_segments_wakes_at_a_publish_not_at_its_next_poll(tmp_path: Path) -> None:
    """A cold first epoch waits for a segment per worker with a ``PublishWatch`` started before the wait: the wait
    returns at the publish that completes its count, not at its next poll (5 s apart here), and the watch is left
    running for the grower that takes it over."""
    import threading

    from tests.cache.test_growing_snapshot import add_segments

    root = tmp_path / "c"
    add_segments(root, 0, 8)  # one segment
    layout = CacheLayout(root)
    have = len(layout.list_segments())
    watch = wait.PublishWatch(layout)
    try:
        assert watch.is_running
        publisher = threading.Timer(0.3, add_segments, args=(root, 8, 8))
        publisher.start()
        started = time.monotonic()
        got = wait.wait_for_segments(layout, have + 1, timeout_s=30, progress=None, poll_s=5.0, wake=watch.event)
        took = time.monotonic() - started
        publisher.join()
        assert got >= have + 1
        assert took < 2.5, f"the wait returned {took:.2f} s in, at its poll rather than at the publish"
        assert watch.is_running
    finally:
        watch.stop()
