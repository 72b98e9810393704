"""The catalog refresher: lists the remote in a background thread, at start and every ``refresh_interval_s``.

Listing a large bucket takes seconds to minutes, so it never runs on the supervisor's main loop. The thread keeps
only the newest listing; the main loop collects it with ``take()`` and hands it to the plan. A failed listing keeps
the previous one in force (transient errors never invalidate what is known) and is retried with backoff, faster
than the refresh interval. ``refresh_now()`` (SIGHUP, or a fetch that found an object changed) asks for an early
listing, at most once per ``_MIN_EARLY_REFRESH_S``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from cachefeed._config import RemoteConfig
from cachefeed._errors import CachefeedError
from cachefeed._logs import get_logger
from cachefeed._remote import Remote, RemoteObject
from cachefeed._scrub import safe_url

__all__ = ["Catalog", "CatalogState"]

log = get_logger(__name__)

_RETRY_MIN_S = 1.0
_MIN_EARLY_REFRESH_S = 5.0


@dataclass(frozen=True, slots=True)
class CatalogState:
    """What status shows about the listing."""

    objects_listed: int
    last_listed_at: float  # unix time of the last successful listing, 0 if none yet
    list_errors_total: int
    last_error: str
    is_failing: bool  # the latest listing attempt failed


class Catalog:
    """Lists the remote periodically in a daemon thread. ``take`` and ``state`` are safe from any thread."""

    def __init__(self, config: RemoteConfig, *, name: str = "") -> None:
        self._config = config
        self._name = name  # the source's name in log lines ([[source]]); "" for the single [remote]
        self._interval_s = config.refresh_interval_s
        self._remote = Remote(config)  # validates the URL now: a bad protocol is a ConfigError before READY
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._fresh: list[RemoteObject] | None = None
        self._state = CatalogState(0, 0.0, 0, "", False)
        self._last_early = 0.0
        self._thread = threading.Thread(target=self._run, name=f"catalog {name}".strip(), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop; a listing in progress is abandoned (the thread is a daemon thread)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=1.0)
        if not self._thread.is_alive():
            self._remote.close()

    def refresh_now(self) -> None:
        now = time.monotonic()
        if now - self._last_early >= _MIN_EARLY_REFRESH_S:
            self._last_early = now
            self._wake.set()

    def take(self) -> list[RemoteObject] | None:
        """The newest listing not taken yet, or None."""
        with self._lock:
            fresh, self._fresh = self._fresh, None
        return fresh

    def state(self) -> CatalogState:
        with self._lock:
            return self._state

    def _run(self) -> None:
        retry_s = _RETRY_MIN_S
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                listing = self._remote.list_objects()
            except CachefeedError as exc:
                log.warning("listing %s failed: %s (retrying in %.0fs)", self._safe_url(), exc, retry_s)
                with self._lock:
                    state = self._state
                    self._state = CatalogState(
                        state.objects_listed, state.last_listed_at, state.list_errors_total + 1, str(exc), True
                    )
                wait_s = min(retry_s, self._interval_s)
                retry_s = min(retry_s * 2, max(self._interval_s, _RETRY_MIN_S))
            except Exception as exc:  # a bug or an unexpected backend error: keep the daemon alive, report it
                log.exception("listing %s failed unexpectedly", self._safe_url())
                with self._lock:
                    state = self._state
                    self._state = CatalogState(
                        state.objects_listed,
                        state.last_listed_at,
                        state.list_errors_total + 1,
                        f"{type(exc).__name__}",
                        True,
                    )
                wait_s = min(retry_s, self._interval_s)
                retry_s = min(retry_s * 2, max(self._interval_s, _RETRY_MIN_S))
            else:
                retry_s = _RETRY_MIN_S
                if listing:
                    log.info("listed %d objects%s in %.2fs", len(listing), self._of(), time.monotonic() - started)
                else:  # status says degraded; the journal says why
                    log.warning(
                        "listed 0 objects under %s matching %r: nothing to cache (check the URL and the pattern)",
                        self._safe_url(),
                        self._config.pattern,
                    )
                with self._lock:
                    self._fresh = listing
                    self._state = CatalogState(len(listing), time.time(), self._state.list_errors_total, "", False)
                wait_s = self._interval_s
            self._wake.wait(wait_s)
            self._wake.clear()

    def _safe_url(self) -> str:
        return safe_url(self._config.url) + self._of()

    def _of(self) -> str:
        return f" (source {self._name!r})" if self._name else ""
