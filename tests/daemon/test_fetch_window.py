"""A sampler's fetches start one at a time and open up as they complete (``FetchWindow`` in ``sampler.py``), so a
cold cache gets its first object whole without sharing the remote with ``sampler.concurrency`` others; a fetch that
never completes does not keep it shut (its patience).

The window on its own (an event loop, no remote), then a real daemon behind the S3 proxy, whose added latency on
every GET makes a completion take at least that long whatever the machine's load.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from cachefeed._daemon.sampler import FIRST_FETCHES, FetchWindow
from cachefeed._testing.daemon import BUCKET, StartDaemon, wait_for
from cachefeed._testing.proxy import FaultProxy, Rule
from cachefeed._testing.samples import cache_samples, upload_arrays


def test_the_window_opens_by_one_per_completed_fetch_up_to_the_limit() -> None:
    async def scenario() -> list[int]:
        window = FetchWindow(1, 4)
        in_flight: list[int] = []
        release = asyncio.Event()

        async def fetch() -> None:
            async with window:
                in_flight.append(window.active)
                await release.wait()

        tasks = [asyncio.create_task(fetch()) for _ in range(12)]
        seen: list[int] = []
        for _ in range(6):
            await asyncio.sleep(0.01)
            seen.append(window.active)
            release.set()  # every fetch in flight completes
            await asyncio.sleep(0)
            release.clear()
        release.set()
        await asyncio.gather(*tasks)
        assert window.active == 0 and len(in_flight) == 12
        return seen

    seen = asyncio.run(scenario())
    assert seen[0] == 1  # the first fetch alone
    assert seen[1] == 2  # one more per completion: the window doubles per round trip
    assert max(seen) == 4  # never above the limit


def test_a_fetch_that_never_completes_does_not_keep_the_window_shut() -> None:
    """The first fetch hangs (a stalled mount): the others start one per patience, then open up as they complete."""

    async def scenario() -> tuple[list[int], float]:
        window = FetchWindow(1, 4, patience_s=0.2)
        hang = asyncio.Event()
        done: list[int] = []

        async def fetch(index: int) -> None:
            async with window:
                if index == 0:
                    await hang.wait()
                done.append(index)

        started = time.monotonic()
        stuck = asyncio.create_task(fetch(0))
        await asyncio.sleep(0)
        others = [asyncio.create_task(fetch(i)) for i in range(1, 8)]
        await asyncio.wait_for(asyncio.gather(*others), 5)
        took = time.monotonic() - started
        hang.set()
        await stuck
        return done, took

    done, took = asyncio.run(scenario())
    assert sorted(done[:7]) == list(range(1, 8)) and done[7] == 0, "every other fetch done while the first one hung"
    assert 0.15 < took < 2, f"the first other one waits a patience, the rest follow as they complete: {took:.2f}s"


def test_the_patience_counts_from_the_first_fetch_not_from_an_idle_window() -> None:
    """A sampler's window is built a while before its first work arrives (its warm-up, the listing): a cold cache's
    first object is still fetched alone for a whole patience."""

    async def scenario() -> int:
        window = FetchWindow(1, 4, patience_s=0.3)
        await asyncio.sleep(0.4)  # idle for longer than the patience
        hang = asyncio.Event()

        async def fetch() -> None:
            async with window:
                await hang.wait()

        tasks = [asyncio.create_task(fetch()) for _ in range(3)]
        await asyncio.sleep(0.1)
        alone = window.active
        hang.set()
        await asyncio.gather(*tasks)
        return alone

    assert asyncio.run(scenario()) == 1


def test_a_window_needs_room_for_one_fetch() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FetchWindow(0, 4)


def test_a_cold_daemon_sends_one_get_per_sampler_until_the_first_completes(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    uploaded = upload_arrays(bucket, BUCKET, 40, 4 << 10)
    fault_proxy.set_rules([Rule("latency", op="GetObject", delay_s=1.5, max_count=2)])
    proc = daemon(endpoint=fault_proxy.endpoint, sections={"sampler": {"processes": 2, "concurrency": 8}})
    wait_for(lambda: fault_proxy.counts().ops.get("GetObject", 0) >= 1, timeout_s=60, what="the first GET")
    first = time.monotonic()
    most = 0
    while time.monotonic() < first + 0.75:  # no GET can have completed: each of the first two takes 1.5 s
        most = max(most, fault_proxy.counts().ops.get("GetObject", 0))
        time.sleep(0.02)
    assert most <= 2 * FIRST_FETCHES  # without the window: 16 (2 samplers x concurrency 8) at once
    fault_proxy.clear()
    proc.wait_status(lambda d: d["ingest"]["objects_total"] >= 40, timeout_s=60, what="every object cached")
    keys = [sample["__key__"] for _, sample in cache_samples(proc.cache_dir)]
    assert sorted(keys) == sorted(uploaded)  # every object exactly once
    assert proc.stop() == 0
