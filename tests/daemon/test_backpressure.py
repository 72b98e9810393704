"""Budget back-pressure end to end: a cache full of pinned data pauses fetching, a release resumes it.

A trainer's snapshots pin segments; the store may evict them from ``segments/`` but their bytes stay counted. When
nothing evictable is left, ``reserve`` answers None, the sampler's writer waits (the RPC reply says "wait"), its
queue fills, credits stop, and fetching pauses; the directory never grows past ``max_bytes``.
"""

from __future__ import annotations

from typing import Any

import pytest

from cachefeed._cache.snapshots import Snapshot
from cachefeed._testing.daemon import BUCKET, StartDaemon
from cachefeed._testing.proxy import FaultProxy, Rule
from cachefeed._testing.samples import upload_arrays
from tests.support.cache_helpers import tree_bytes


def test_a_cache_full_of_pinned_data_pauses_fetching_until_released(
    bucket: Any, fault_proxy: FaultProxy, daemon: StartDaemon
) -> None:
    upload_arrays(bucket, BUCKET, 300, 64 << 10)
    max_bytes = 8 << 20
    # evict_after_reads = 0: the cache turns over without readers, so that only pins can stop it (the read
    # contract's own waiting is tested in tests/daemon/test_pacing.py)
    proc = daemon(endpoint=fault_proxy.endpoint, sections={"cache": {"max_bytes": max_bytes, "evict_after_reads": 0}})
    proc.wait_status(lambda d: d["evicted"]["segments_total"] > 0, timeout_s=30, what="a full cache")
    # Pin everything, again and again, until no room is left: each round holds the GETs until every writer has
    # flushed and given its grant back (a segment published after a pin is room that eviction can still take).
    snapshots: list[Snapshot] = []

    def paused_for_a_second() -> tuple[dict[str, Any], dict[str, Any]] | None:
        try:
            doc = proc.wait_status(lambda d: d["cache"]["is_backpressured"], timeout_s=3, what="back-pressure")
        except TimeoutError:
            return None
        later = proc.wait_status(lambda d: d["updated_at"] > doc["updated_at"] + 1.0, timeout_s=10, what="1 s later")
        if later["ingest"]["objects_total"] != doc["ingest"]["objects_total"]:
            return None
        return doc, later

    try:
        for round_ in range(10):
            fault_proxy.set_rules([Rule("latency", op="GetObject", delay_s=3.0)])
            proc.wait_status(lambda d: d["cache"]["reserved_bytes"] == 0, timeout_s=20, what="no grant outstanding")
            # each pin takes the epoch room at most, least-read first: what earlier pins hold counts as being read,
            # so the next one takes what is not pinned yet (several epochs' or jobs' pins)
            pinned = {name for snapshot in snapshots for name in snapshot.names}
            snapshots.append(Snapshot.create(proc.cache_dir, f"epoch-{round_}", reading=pinned))
            fault_proxy.clear()
            if (found := paused_for_a_second()) is not None:
                break
        else:
            pytest.fail("the cache never filled with pinned data")
        _doc, later = found
        paused = later["ingest"]["objects_total"]
        assert later["cache"]["is_backpressured"]  # nothing published for a second: fetching waits
        assert later["cache"]["bytes"] <= max_bytes
        assert tree_bytes(proc.cache_dir) <= max_bytes
        assert later["cache"]["pinned_bytes"] > 0
    finally:
        for snapshot in snapshots:
            snapshot.release()
    resumed = proc.wait_status(
        lambda d: d["ingest"]["objects_total"] > paused + 30 and not d["cache"]["is_backpressured"],
        timeout_s=30,
        what="fetching resumes once the snapshot is released",
    )
    assert resumed["cache"]["bytes"] <= max_bytes
    assert proc.stop() == 0
