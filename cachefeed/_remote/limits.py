"""How hard a ``Remote`` may push: backoff between retries, the retry budget, and the rate caps.

These are the arithmetic of NOTE [ One retry layer ] (``client.py``), which owns the retry loop:

- Backoff: full jitter, ``sleep = uniform(0, min(backoff_max, base * 2**n))`` before retry ``n`` (0-based).
- Retry budget: a token bucket that earns ``retry_budget`` tokens per first attempt and spends one per retry,
  starting (and capped) at ``retry_budget_burst`` tokens, so a failing remote sees at most ``(1 + retry_budget)``
  times the load plus a small burst.
- Rate caps (``max_requests_per_s``, ``max_bytes_per_s``, node-wide) are multiplied by ``share``, this process's
  fraction of the node; each is a token bucket that lets a request go into debt and makes later callers wait it
  off, so an object larger than the burst still goes through and the long-run rate holds. A bucket holds
  ``BURST_S`` seconds' worth of tokens (at least one request).

Each bucket belongs to one event loop and takes no lock: the loop runs one coroutine at a time.
"""

from __future__ import annotations

import asyncio
import random
import time

__all__ = ["BURST_S", "RateBucket", "RetryBudget", "backoff_delay", "rate_bucket"]

BURST_S = 0.1


def backoff_delay(retry: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Full-jitter backoff before retry number ``retry`` (0-based): uniform in [0, min(max_s, base_s * 2**retry)]."""
    return rng.uniform(0.0, min(max_s, base_s * 2.0 ** min(retry, 62)))


class RateBucket:
    """Token bucket that allows debt: ``acquire(n)`` takes n tokens now and sleeps until the balance is >= 0.

    Invariant: tokens <= burst. Single event loop only (no lock: the loop runs one coroutine at a time).
    """

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._stamp = time.monotonic()

    async def acquire(self, amount: float) -> float:
        """Take ``amount`` tokens; returns the seconds slept to pay off the debt."""
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate) - amount
        self._stamp = now
        delay = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if delay > 0:
            await asyncio.sleep(delay)
        return delay


def rate_bucket(rate: float, *, minimum: float) -> RateBucket | None:
    """The bucket of a rate cap (``BURST_S`` seconds' worth, at least ``minimum``); None (no cap) unless rate > 0."""
    return RateBucket(rate, max(minimum, rate * BURST_S)) if rate > 0 else None


class RetryBudget:
    """Each first attempt earns ``ratio`` tokens, each retry spends one; starts full at ``burst`` (the cap)."""

    def __init__(self, ratio: float, burst: float) -> None:
        self.ratio = ratio
        self.burst = burst
        self._tokens = burst

    def deposit(self) -> None:
        self._tokens = min(self.burst, self._tokens + self.ratio)

    def withdraw(self) -> bool:
        """Spend one token for a retry; False (nothing spent) where the budget is exhausted."""
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
