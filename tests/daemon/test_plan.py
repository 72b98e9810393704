"""The sampling plan: passes without replacement, node partition, re-queues, skips, idle waits."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefeed._cache.records import Source
from cachefeed._daemon.plan import SamplingPlan, owner_of, pass_order_key
from cachefeed._remote import RemoteObject


def objects(n: int, prefix: str = "b/k") -> list[RemoteObject]:
    return [RemoteObject(f"{prefix}{i:04d}", 100, f"e{i}") for i in range(n)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drain_pass(plan: SamplingPlan, *, seq: int = 0) -> list[str]:
    """Draw everything currently drawable, mark it done in segment ``seq``; return the paths."""
    drawn = plan.next(10_000)
    plan.done([oid for oid, _ in drawn], seq)
    return [obj.path for _, obj in drawn]


def test_a_pass_visits_every_object_once_in_a_seeded_order() -> None:
    plan = SamplingPlan(seed=7)
    plan.update_catalog(objects(50))
    first = drain_pass(plan)
    assert sorted(first) == [o.path for o in objects(50)]
    assert first != sorted(first)  # a permutation, not the listing order

    again = SamplingPlan(seed=7)
    again.update_catalog(reversed(objects(50)))  # listing order does not matter
    assert drain_pass(again) == first

    other = SamplingPlan(seed=8)
    other.update_catalog(objects(50))
    assert drain_pass(other) != first


def test_next_pass_starts_only_when_the_last_object_is_resolved() -> None:
    plan = SamplingPlan(seed=1)
    plan.update_catalog(objects(4))
    drawn = plan.next(10)
    assert len(drawn) == 4
    assert plan.next(10) == []  # all in flight: pass 0 is not over
    plan.done([oid for oid, _ in drawn[:3]], 0)
    assert plan.next(10) == []
    plan.done([drawn[3][0]], 1)
    plan.evicted([0, 1])  # evicted: the objects may come back
    assert len(plan.next(10)) == 4
    assert plan.counters.passes_completed == 1
    assert plan.pass_index == 1


def test_cached_objects_are_skipped_until_their_segment_is_evicted() -> None:
    clock = Clock()
    plan = SamplingPlan(clock=clock)
    plan.update_catalog(objects(6))
    drawn = plan.next(10)
    plan.done([oid for oid, _ in drawn[:3]], 10)
    plan.done([oid for oid, _ in drawn[3:]], 11)
    assert plan.next(10) == []  # a new pass would only find cached objects
    plan.evicted([10])
    again = plan.next(10)
    assert {oid for oid, _ in again} == {oid for oid, _ in drawn[:3]}
    assert plan.counters.skipped_cached_total >= 3


def test_idle_passes_back_off_instead_of_spinning() -> None:
    clock = Clock()
    plan = SamplingPlan(clock=clock)
    plan.update_catalog(objects(3))
    drawn = plan.next(10)
    plan.done([oid for oid, _ in drawn], 5)
    for _ in range(100):
        assert plan.next(10) == []
    passes = plan.pass_index
    assert passes <= 2  # not one pass per call
    clock.now += 100
    assert plan.next(10) == []  # everything still cached: nothing to draw after the wait either
    assert plan.counters.passes_completed == 1


def test_requeued_objects_come_first() -> None:
    plan = SamplingPlan(seed=3)
    plan.update_catalog(objects(20))
    batch = plan.next(5)
    plan.requeue([batch[3][0], batch[1][0]])
    again = plan.next(2)
    assert [oid for oid, _ in again] == [batch[3][0], batch[1][0]]
    assert plan.counters.requeued_total == 2


def test_failures_drop_quarantine_or_retry_next_pass() -> None:
    clock = Clock()
    plan = SamplingPlan(clock=clock)
    plan.update_catalog(objects(4))
    (a, _), (b, _), (c, _), (d, _) = plan.next(4)
    plan.failed(a, "not_found")
    plan.failed(b, "decode")
    plan.failed(c, "transient")
    plan.done([d], 1)
    plan.evicted([1])
    # next pass: only c (transient) and d (evicted) come back
    clock.now += 100
    assert {oid for oid, _ in plan.next(10)} == {c, d}
    assert plan.counters.dropped_total == 1
    assert plan.counters.quarantined_total == 1
    # a new version of the dropped and the quarantined objects brings them back
    changed = [RemoteObject(o.path, o.size, "new" if i in (a, b) else o.etag) for i, o in enumerate(objects(4))]
    plan.update_catalog(changed)
    assert {oid for oid, _ in plan.next(10)} == {a, b}


def test_objects_added_by_a_refresh_join_the_current_pass() -> None:
    plan = SamplingPlan(seed=5)
    plan.update_catalog(objects(10))
    first = plan.next(4)
    assert plan.update_catalog(objects(15)) == 5
    rest = plan.next(100)
    drawn = [obj.path for _, obj in first + rest]
    assert sorted(drawn) == [o.path for o in objects(15)]
    new_paths = [p for p in drawn if p >= "b/k0010"]
    assert drawn[-5:] == new_paths  # appended after the pass's remaining objects
    assert new_paths == sorted(new_paths, key=lambda p: pass_order_key(p, 5, 0))


def test_vanished_objects_are_not_drawn() -> None:
    plan = SamplingPlan()
    plan.update_catalog(objects(10))
    plan.update_catalog(objects(10)[:6])
    assert {obj.path for _, obj in plan.next(100)} == {o.path for o in objects(6)}
    assert plan.owned == 6


@settings(max_examples=30, deadline=None)
@given(count=st.integers(1, 6), n=st.integers(0, 200))
def test_node_partition_is_disjoint_complete_and_stable(count: int, n: int) -> None:
    listing = objects(n, prefix="bucket/shard-")
    owners: Counter[str] = Counter()
    for rank in range(count):
        plan = SamplingPlan(rank=rank, count=count)
        plan.update_catalog(listing)
        owners.update(obj.path for _, obj in plan.next(10_000))
    assert owners == Counter(o.path for o in listing)  # each object exactly once across nodes
    grown = objects(n + 50, prefix="bucket/shard-")
    for obj in listing:
        assert owner_of(obj.path, count) == owner_of(grown[listing.index(obj)].path, count)


def test_rank_is_checked() -> None:
    with pytest.raises(ValueError, match="rank"):
        SamplingPlan(rank=2, count=2)


def test_a_new_version_listed_while_the_old_one_is_in_flight_is_fetched_again() -> None:
    plan = SamplingPlan()
    plan.update_catalog(objects(3))
    drawn = {obj.path: oid for oid, obj in plan.next(10)}
    changed = [RemoteObject(o.path, o.size, "v2" if o.path == "b/k0001" else o.etag) for o in objects(3)]
    plan.update_catalog(changed)  # b/k0001 changed while its old version was being fetched
    assert plan.next(10) == []  # still in flight
    plan.done(list(drawn.values()), 7)  # the old version's samples landed in segment 7
    again = plan.next(10)
    assert [(obj.path, obj.etag) for _, obj in again] == [("b/k0001", "v2")]
    plan.done([again[0][0]], 8)
    plan.evicted([7])  # the old version's segment goes: the new version is still cached in 8
    assert sorted(obj.path for _, obj in plan.next(10)) == ["b/k0000", "b/k0002"]


def test_a_failure_of_an_old_version_does_not_hold_back_the_new_one() -> None:
    plan = SamplingPlan()
    plan.update_catalog(objects(1))
    ((oid, _),) = plan.next(10)
    plan.update_catalog([RemoteObject("b/k0000", 100, "v2")])
    plan.failed(oid, "changed")  # the GET of the old version was refused (412)
    assert [obj.etag for _, obj in plan.next(10)] == ["v2"]  # drawn again in the same pass


def test_objects_held_by_recovered_segments_are_not_fetched_again() -> None:
    plan = SamplingPlan()
    listing = objects(4)
    plan.adopt(3, [Source(listing[0].path, listing[0].etag), Source(listing[1].path, "an older version")])
    plan.adopt(4, [Source(listing[2].path, listing[2].etag), Source("b/gone", "e")])
    plan.update_catalog(listing)
    assert sorted(obj.path for _, obj in plan.next(10)) == ["b/k0001", "b/k0003"]
    assert plan.cached_segments() == {3, 4}
    plan.evicted([3])
    plan.done([], None)
    assert plan.cached_segments() == {4}


def test_a_pass_over_objects_all_held_by_recovered_segments_is_counted_once_and_idle_passes_are_paced() -> None:
    """A daemon restarted on a cache that holds everything: its first pass draws nothing, and is a pass all the
    same (trainers wait for ``passes_completed >= 1``); the passes after it neither count nor spin."""
    clock = Clock()
    plan = SamplingPlan(clock=clock)
    listing = objects(6)
    plan.adopt(1, [Source(o.path, o.etag) for o in listing[:3]])
    plan.adopt(2, [Source(o.path, o.etag) for o in listing[3:]])
    plan.update_catalog(listing)
    assert plan.next(10) == []  # nothing fetched again
    assert plan.counters.passes_completed == 1
    assert plan.counters.drawn_total == 0
    for _ in range(100):
        assert plan.next(10) == []
    assert plan.pass_index <= 2  # not one pass per call
    clock.now += 100
    assert plan.next(10) == []
    assert plan.counters.passes_completed == 1  # an idle pass after it repeats what is known
    assert plan.counters.skipped_cached_total >= 2 * len(listing)
    plan.evicted([1])  # evicted: those come back, in a pass that counts
    clock.now += 100
    again = plan.next(10)
    assert sorted(obj.path for _, obj in again) == [o.path for o in listing[:3]]
    plan.done([oid for oid, _ in again], 3)
    clock.now += 100
    plan.next(10)
    assert plan.counters.passes_completed == 2


def test_an_idle_pass_over_the_restart_catalog_alone_counts_only_once_the_remote_is_listed() -> None:
    """The restart catalog is what the remote listed before the restart; the remote may list more now."""
    clock = Clock()
    plan = SamplingPlan(clock=clock)
    listing = objects(4)
    plan.adopt(1, [Source(o.path, o.etag) for o in listing])
    plan.update_page(plan.fold(listing))
    plan.end_listing(is_restored=True)
    for _ in range(3):
        assert plan.next(10) == []
        clock.now += 100
    assert plan.counters.passes_completed == 0
    plan.update_catalog(listing)  # the remote lists the same: the wait ends, the pass is counted at once
    assert plan.next(10) == []
    assert plan.counters.passes_completed == 1


def test_pages_of_cached_objects_do_not_start_a_pass_each() -> None:
    """A first listing in pages whose objects are all cached (adopted): each page joins the current pass, whose
    idle wait it does not end (a pass of skips per page, every one over all the objects so far)."""
    clock = Clock()
    plan = SamplingPlan(clock=clock)
    listing = objects(50)
    plan.adopt(1, [Source(o.path, o.etag) for o in listing])
    for start in range(0, 50, 10):
        assert plan.update_page(plan.fold(listing[start : start + 10])) == 10
        assert plan.next(10) == []
    assert plan.pass_index == 0
    assert plan.counters.skipped_cached_total == 50
    plan.end_listing()
    assert plan.next(10) == []
    assert plan.counters.passes_completed == 1


def test_a_recovered_segment_evicted_before_the_first_listing_is_forgotten() -> None:
    plan = SamplingPlan()
    listing = objects(2)
    plan.adopt(3, [Source(o.path, o.etag) for o in listing])
    assert plan.cached_segments() == {3}
    plan.evicted([3])
    plan.update_catalog(listing)
    assert len(plan.next(10)) == 2


def drawn_paths(plan: SamplingPlan, clock: Clock, seq: int) -> list[str]:
    """After any idle wait: the paths the plan draws now, each then done in segment ``seq`` (never evicted here)."""
    clock.now += 60
    drawn = plan.next(100)
    plan.done([oid for oid, _ in drawn], seq)
    return sorted(obj.path for _, obj in drawn)


def test_an_object_whose_samples_span_segments_is_drawn_again_only_when_all_of_them_are_evicted() -> None:
    clock = Clock()
    plan = SamplingPlan(clock=clock)
    plan.update_catalog(objects(2))
    (a, _), (b, _) = sorted(plan.next(2), key=lambda pair: pair[1].path)
    plan.spanning([(a, 10)], 5)  # a's first samples, published while a was still being written
    plan.spanning([(a, 20)], 6)
    plan.done([a, b], 7)  # a's last samples, and all of b's
    assert plan.cached_segments() == {5, 6, 7}
    plan.evicted([7])  # read-gated eviction: the segment of the last samples may go first
    assert drawn_paths(plan, clock, 101) == ["b/k0001"]
    plan.evicted([5])
    assert drawn_paths(plan, clock, 102) == []
    plan.evicted([6])
    assert drawn_paths(plan, clock, 103) == ["b/k0000"]


def test_a_spanning_segment_of_a_version_the_listing_replaced_does_not_hold_back_the_new_one() -> None:
    clock = Clock()
    plan = SamplingPlan(clock=clock)
    plan.update_catalog(objects(1))
    ((oid, _),) = plan.next(1)
    plan.spanning([(oid, 10)], 5)
    plan.done([oid], 6)
    plan.update_catalog([RemoteObject("b/k0000", 100, "v2")])  # a new version: another sample
    assert [obj.etag for _, obj in plan.next(10)] == ["v2"]
    plan.spanning([(oid, 10)], 8)
    plan.done([oid], 9)
    plan.evicted([5, 6])  # the old version's segments go: the new one's are still cached
    assert drawn_paths(plan, clock, 104) == []
    plan.evicted([8, 9])
    assert drawn_paths(plan, clock, 105) == ["b/k0000"]


def test_an_object_named_by_several_recovered_segments_is_fetched_again_when_the_last_of_them_goes() -> None:
    clock = Clock()
    plan = SamplingPlan(clock=clock)
    listing = objects(1)
    plan.adopt(3, [Source(listing[0].path, listing[0].etag, 10)])
    plan.adopt(4, [Source(listing[0].path, listing[0].etag)])
    plan.update_catalog(listing)
    assert plan.next(10) == []
    plan.evicted([4])
    assert drawn_paths(plan, clock, 106) == []
    plan.evicted([3])
    assert drawn_paths(plan, clock, 107) == ["b/k0000"]


def test_an_object_cut_by_a_dead_sampler_is_drawn_again_at_once_to_skip_what_is_cached() -> None:
    clock = Clock()
    plan = SamplingPlan(clock=clock)
    plan.update_catalog(objects(2))
    (a, _), (b, _) = sorted(plan.next(2), key=lambda pair: pair[1].path)
    plan.spanning([(a, 12)], 5)  # a's first 12 samples were published; then its sampler died
    plan.done([b], 5)
    plan.requeue([a])
    assert [(oid, plan.cut(oid)) for oid, _ in plan.next(10)] == [(a, 12)]  # only its rest is fetched
    plan.done([a], 6)
    assert plan.cut(a) == 0
    plan.evicted([6])
    assert drawn_paths(plan, clock, 300) == []  # its first samples are still cached
    plan.evicted([5])
    assert drawn_paths(plan, clock, 301) == ["b/k0000", "b/k0001"]  # whole again, as is b


def test_a_first_listing_joins_its_objects_without_loading_numpy_ma() -> None:
    """A cold daemon's first listing is on the way to its first batch: folding it in loads nothing more (numpy
    loads ``numpy.ma``, 23 ms of CPU, the first time ``np.isin`` is given an empty list)."""
    code = (
        "import sys\n"
        "from cachefeed._daemon.plan import SamplingPlan\n"
        "from cachefeed._remote import RemoteObject\n"
        "plan = SamplingPlan(seed=1)\n"
        "plan.update_catalog([RemoteObject(f'b/k{i:04d}', 100, f'e{i}') for i in range(50)])\n"
        "assert len(plan.next(100)) == 50\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "folding a first listing in loaded numpy.ma"
