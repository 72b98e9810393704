"""A node's local ranks as threads of one test process, stepping in lockstep as a data-parallel job's ranks do."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["run_local_ranks"]

T = TypeVar("T")


def run_local_ranks(
    body: Callable[[int, Callable[[], None]], T], ranks: int = 2, *, timeout_s: float = 120.0
) -> list[T]:
    """Run ``body(rank, step)`` for each local rank on a thread of its own; return the ranks' results in rank order.

    ``step()``, called by ``body`` after each training step, returns once every rank has taken the same step: a
    data-parallel step's gradient all-reduce keeps its ranks in lockstep. Threads that did not step together drifted
    apart under load until one rank finished its job (and released its epoch's snapshot) before the other had joined
    that epoch; the other then waited for the snapshot for minutes. So ranks whose epochs differ in batches fail
    here (``threading.BrokenBarrierError``), as such a job would hang.

    Raises the first error a rank raised (a rank that fails breaks the others' next step); fails naming the ranks
    still running after ``timeout_s``.
    """
    barrier = threading.Barrier(ranks, timeout=timeout_s)
    results: dict[int, T] = {}
    errors: list[BaseException] = []

    def step() -> None:
        barrier.wait()

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank, step)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,), name=f"rank-{rank}", daemon=True) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    first = [exc for exc in errors if not isinstance(exc, threading.BrokenBarrierError)] or errors
    if first:
        raise first[0]
    running = [thread.name for thread in threads if thread.is_alive()]
    if running:
        raise AssertionError(f"{', '.join(running)} still running after {timeout_s:g}s")
    return [results[rank] for rank in range(ranks)]
