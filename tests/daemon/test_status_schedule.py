"""When the supervisor publishes its status document (``StatusSchedule``): every interval, and early, at most every
gap, when what trainers wait for changes. A growing first epoch ends when the document says the daemon can fill no
further, so a change held back must be told when the gap ends, not at the loop's next timer."""

from __future__ import annotations

from cachefeed._daemon.supervisor import _EARLY_STATUS_GAP_S, StatusSchedule

INTERVAL_S = 5.0
GAP_S = _EARLY_STATUS_GAP_S


def test_a_change_right_after_a_publish_is_told_when_the_gap_ends_not_at_the_next_interval() -> None:
    schedule = StatusSchedule(INTERVAL_S, now=100.0, signal=(0, False, False))
    assert not schedule.is_due(100.0 + GAP_S / 4, (1, False, False)), "held back: a document went out just now"
    assert schedule.next_at() == 100.0 + GAP_S, "the loop wakes when the gap ends, with no message to wake it"
    assert schedule.is_due(100.0 + GAP_S, (1, False, False))
    schedule.published(100.0 + GAP_S)
    assert schedule.next_at() == 100.0 + GAP_S + INTERVAL_S


def test_a_change_after_the_gap_is_told_at_once() -> None:
    schedule = StatusSchedule(INTERVAL_S, now=100.0, signal=(0, False, False))
    assert schedule.is_due(100.0 + 2 * GAP_S, (0, True, False))


def test_without_a_change_the_document_goes_out_every_interval_only() -> None:
    schedule = StatusSchedule(INTERVAL_S, now=100.0, signal=(0, False, False))
    assert not schedule.is_due(100.0 + GAP_S / 4, (0, False, False))
    assert schedule.next_at() == 100.0 + INTERVAL_S, "nothing held back: no early wake"
    assert not schedule.is_due(100.0 + INTERVAL_S / 2, (0, False, False))
    assert schedule.is_due(100.0 + INTERVAL_S, (0, False, False))


def test_a_change_told_is_not_told_again() -> None:
    schedule = StatusSchedule(INTERVAL_S, now=100.0, signal=(0, False, False))
    assert schedule.is_due(101.0, (1, False, False))
    schedule.published(101.0)
    assert not schedule.is_due(101.0 + 2 * GAP_S, (1, False, False)), "the document already says it"


def test_a_change_undone_within_the_gap_holds_nothing_back() -> None:
    schedule = StatusSchedule(INTERVAL_S, now=100.0, signal=(0, False, False))
    assert not schedule.is_due(100.0 + GAP_S / 4, (0, True, False))
    assert not schedule.is_due(100.0 + GAP_S / 2, (0, False, False)), "back to what the document says"
    assert schedule.next_at() == 100.0 + INTERVAL_S


def test_the_interval_coming_due_publishes_a_change_the_gap_holds() -> None:
    schedule = StatusSchedule(GAP_S / 2, now=100.0, signal=(0, False, False))
    assert schedule.is_due(100.0 + GAP_S / 2, (1, False, False)), "the interval, whatever the gap"
