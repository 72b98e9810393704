"""Drive an :class:`~benchmarks.common.adapter.EpochSource` through epochs: time, verify, and measure handover.

Definitions (all wall-clock, ``time.perf_counter``):

- *wait*: time the consumer spends inside ``next()`` waiting for a batch. The consumer's own work (verifying
  the batch, standing in for a training step) is excluded.
- *first batch*: from asking for the epoch's iterator to holding its first batch.
- *handover wait* of epoch e+1: from the moment the consumer finished the last batch of epoch e (and asked
  for the next one) to the moment it holds the first batch of epoch e+1. Everything the system does between
  the two epochs (rebuilding iterators, starting workers, reshuffling, downloading) is inside it.
- *epoch time*: from asking for the iterator to the end-of-epoch signal (``StopIteration``).
- *steady pace*: samples/s from the first batch to the last (the epoch's start-up and shutdown excluded).
- *end of epoch*: the time the last ``next()`` (the one that raises ``StopIteration``) takes: shutting down
  non-persistent workers happens there. It is part of the handover wait, which starts when that call starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from benchmarks.common.adapter import EpochSource
from benchmarks.common.samples import SampleError, verify_batch


def run_epochs(
    source: EpochSource,
    epochs: int,
    dataset_count: int,
    sample_bytes: int,
    on_epoch_end: Callable[[int], dict[str, Any]] | None = None,
    report: Callable[[dict[str, Any]], None] | None = None,
    check: Callable[[dict[str, Any]], str | None] | None = None,
    check_interval_s: float = 1.0,
    until_samples: int | None = None,
    step_s: float = 0.0,
) -> list[dict[str, Any]]:
    """Consume ``epochs`` epochs, verifying every sample; return one dict per epoch.

    ``until_samples``: stop after the first epoch that brings the samples delivered so far to at least this many
    (equal work for systems whose epochs differ in size: a rolling cache's epoch is what it holds, a peer's is a
    pass); ``epochs`` is then only a bound. Each epoch's dict has ``distinct_so_far``: the distinct samples
    delivered by it and every epoch before it.

    ``step_s``: a training step per batch: the consumer sleeps until ``step_s`` after it got the batch (verifying
    it included), as a trainer at a given rate would, leaving the CPU to the system (0: none, as fast as the
    system delivers).

    ``on_epoch_end(epoch)`` is called right after an epoch's last batch (outside every timing) and its dict is
    merged into that epoch's result: the caller uses it to read server counters and disk peaks. ``report``
    then receives the complete epoch result (the runner streams it out, so a later hang loses nothing).
    ``check(partial_epoch_result)`` is called between batches, at most every ``check_interval_s``: it may
    report a heartbeat, and returns a reason to stop the run (e.g. a system downloading without bound) or
    ``None``. Its time counts in the epoch's wall time, not in the waits.

    Raises:
        StopEpochs: when ``check`` gave a reason; the epochs so far (the last one partial) are attached.
    """
    results: list[dict[str, Any]] = []
    previous_end: float | None = None  # when the consumer asked for the batch after epoch e's last one
    callback_s = 0.0
    seen: set[int] = set()
    delivered = 0
    for epoch in range(epochs):
        if until_samples is not None and delivered >= until_samples:
            break
        stats = _EpochStats(epoch, dataset_count)
        started = time.perf_counter()
        iterator = iter(source.epoch(epoch))
        last_check = started
        while True:
            asked = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                break
            got = time.perf_counter()
            if stats.batches == 0:
                stats.first_batch_s = got - started
                stats.first_batch_samples = len(batch)
                if previous_end is not None:
                    stats.handover_s = got - previous_end - callback_s
            stats.add_wait(got - asked)
            stats.add_batch(batch)
            if step_s > 0:
                time.sleep(max(0.0, got + step_s - time.perf_counter()))
            if check is not None and got - last_check >= check_interval_s:
                last_check = got
                partial = stats.to_json(time.perf_counter() - started, sample_bytes)
                reason = check(partial)
                if reason is not None:
                    results.append({**partial, "partial": True, "distinct_so_far": len(seen | stats.seen)})
                    raise StopEpochs(reason, results)
        ended = time.perf_counter()
        stats.stop_s = ended - asked
        result = stats.to_json(ended - started, sample_bytes)
        seen |= stats.seen
        delivered += stats.samples
        result["distinct_so_far"] = len(seen)
        if on_epoch_end is not None:
            result.update(on_epoch_end(epoch))
        if report is not None:
            report(result)
        results.append(result)
        previous_end = asked
        callback_s = time.perf_counter() - ended  # the harness's own time is not the system's
    return results


class StopEpochs(Exception):
    """A ``check`` stopped the epochs early. ``reason`` says why; ``results`` holds what was measured."""

    def __init__(self, reason: str, results: list[dict[str, Any]]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.results = results


class _EpochStats:
    def __init__(self, epoch: int, dataset_count: int) -> None:
        self.epoch = epoch
        self.dataset_count = dataset_count
        self.batches = 0
        self.samples = 0
        self.first_batch_s: float | None = None
        self.first_batch_samples = 0
        self.handover_s: float | None = None
        self.stop_s: float | None = None
        self.wait_s = 0.0
        self.max_wait_s = 0.0
        self.seen: set[int] = set()
        self.duplicates = 0
        self.corrupt = 0
        self.first_error: str | None = None

    def add_wait(self, wait_s: float) -> None:
        self.wait_s += wait_s
        self.max_wait_s = max(self.max_wait_s, wait_s)

    def add_batch(self, batch: Any) -> None:
        self.batches += 1
        try:
            indices = verify_batch(batch)
        except SampleError as exc:
            # Count the whole batch as corrupt; verify each row to know how many really are.
            self.corrupt += _count_corrupt(batch)
            self.first_error = self.first_error or str(exc)
            return
        self.samples += len(indices)
        for index in indices:
            if index in self.seen or index >= self.dataset_count:
                self.duplicates += 1
            self.seen.add(index)

    def to_json(self, wall_s: float, sample_bytes: int) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "wall_s": round(wall_s, 4),
            "batches": self.batches,
            "samples": self.samples,
            "unique_samples": len(self.seen),
            "missing_samples": self.dataset_count - len(self.seen),
            "duplicate_samples": self.duplicates,
            "corrupt_samples": self.corrupt,
            "first_error": self.first_error,
            "samples_per_s": round(self.samples / wall_s, 1) if wall_s > 0 else None,
            "mb_per_s": round(self.samples * sample_bytes / wall_s / 1e6, 2) if wall_s > 0 else None,
            "steady_samples_per_s": self._steady(wall_s),
            "first_batch_s": _round(self.first_batch_s),
            "handover_wait_s": _round(self.handover_s),
            "wait_s": round(self.wait_s, 4),
            "end_of_epoch_s": _round(self.stop_s),
            "max_wait_s": round(self.max_wait_s, 4),
        }

    def _steady(self, wall_s: float) -> float | None:
        """Samples/s between the first batch and the end of the epoch: the pace once the pipeline is full."""
        if self.first_batch_s is None or self.stop_s is None or self.batches < 2:
            return None
        span = wall_s - self.first_batch_s - self.stop_s
        return round((self.samples - self.first_batch_samples) / span, 1) if span > 0 else None


def _count_corrupt(batch: Any) -> int:
    from benchmarks.common.samples import verify_sample

    bad = 0
    rows = batch.numpy() if hasattr(batch, "numpy") else batch
    for row in rows:
        try:
            verify_sample(row)
        except SampleError:
            bad += 1
    return bad


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
