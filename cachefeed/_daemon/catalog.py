"""The catalog refresher: lists the remote in a background thread and streams the pages to the supervisor.

Listing a large bucket takes seconds to hours, so it never runs on the supervisor's main loop, and the plan does
not wait for its end: each page (one LIST request's worth, ``_remote/listing.py``; or a slice of a manifest,
``_remote/manifest.py``) is folded in the thread to what this node keeps (``columns.fold_page``: owned objects as
arrays, the rest counted) and queued; the main loop collects pages with ``take()`` and hands them to the plan as
they come, then a ``ListingEnd`` when the listing is complete. The queue is bounded: a slow main loop slows the
listing, never grows memory.

Timing:

* A listing starts at ``start()``, then every *refresh interval*: ``remote.refresh_interval``, but never less than
  ``_COST_FACTOR`` times the last listing's duration, so a listing that takes minutes is not repeated back to
  back on every node.
* A failed listing keeps what is known in force (transient errors never invalidate it: pages already handed out
  stay, and nothing vanishes until a listing completes) and is retried with backoff, faster than the interval.
* ``refresh_now()`` (SIGHUP, or a fetch that found an object changed) asks for an early listing, at most once per
  ``_MIN_EARLY_REFRESH_S``.

``state()`` reports the listing for status, including LIST requests: ``list_requests_total`` and
``list_requests_per_hour`` (the last complete listing's requests times listings per hour at the current interval:
what this node costs the store per hour, steady state).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cachefeed._config import RemoteConfig
from cachefeed._daemon.columns import FoldedPage, fold_page
from cachefeed._daemon.shared import Publisher, SharedCatalog
from cachefeed._errors import CachefeedError
from cachefeed._logs import get_logger
from cachefeed._remote import Remote, RemoteObject
from cachefeed._scrub import safe_url

__all__ = ["Catalog", "CatalogState", "ListingEnd", "ListingSource"]

log = get_logger(__name__)

_RETRY_MIN_S = 1.0
_MIN_EARLY_REFRESH_S = 5.0
_COST_FACTOR = 10.0  # never list more often than this many times the last listing's duration
_QUEUE_PAGES = 32  # pages folded ahead of the main loop


@dataclass(frozen=True, slots=True)
class CatalogState:
    """What status shows about the listing."""

    objects_listed: int
    last_listed_at: float  # unix time of the last successful listing, 0 if none yet
    list_errors_total: int
    last_error: str
    is_failing: bool  # the latest listing attempt failed
    list_requests_total: int = 0  # LIST requests sent (0 with a manifest or a shared catalog)
    list_requests_per_hour: float = 0.0  # steady state: the last listing's requests x listings per hour
    refresh_interval_s: float = 0.0  # the interval in force (adapted to the listing's cost)
    last_listing_s: float = 0.0  # how long the last complete listing took


@dataclass(frozen=True, slots=True)
class ListingEnd:
    """The listing whose pages came before is complete."""

    objects: int
    duration_s: float
    is_restored: bool = False  # the restart catalog, not the remote (``SamplingPlan.end_listing``)


# Where a listing comes from: called with a page callback, returns how many objects it listed. The default is the
# remote's paged LIST (``Remote.list_pages``); a manifest or a shared catalog replaces it (``_remote/manifest.py``).
# It returns None when its input is unchanged since the last read (a manifest or catalog: nothing listed again).
ListingSource = Callable[[Callable[[Any], None]], int | None]


class Catalog:
    """Lists in a daemon thread and streams folded pages. ``take``, ``state`` and ``refresh_now`` are safe from
    any thread.

    Args:
        config: the remote section (URL, pattern, refresh interval, retries).
        name: the source's name in log lines ([[source]]); "" for the single [remote].
        rank, count: this node and the node count (what a page keeps, ``columns.fold_page``).
        label: ``sampler.label`` (pages then carry the class names of every listed object).
    """

    def __init__(self, config: RemoteConfig, *, name: str = "", rank: int = 0, count: int = 1, label: str = "") -> None:
        self._config = config
        self._name = name
        self._rank, self._count, self._label = rank, count, label
        self._interval_s = config.refresh_interval_s
        self._remote = Remote(config)  # validates the URL now: a bad protocol is a ConfigError before READY
        self.restore: ListingSource | None = None  # streamed once before the first listing (the restart catalog)
        self.source: ListingSource = self._remote.list_pages
        if config.catalog and config.catalog_publish and rank == 0:  # node 0 lists and publishes (shared.py)
            self.source = Publisher(self._remote, config.catalog)
        elif config.catalog:  # a shared catalog replaces the listing (shared.py)
            self.source = SharedCatalog(self._remote, config.catalog, rank=rank, count=count, label=label)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pages: queue.Queue[FoldedPage | ListingEnd] = queue.Queue(maxsize=_QUEUE_PAGES)
        self._state = CatalogState(0, 0.0, 0, "", False, refresh_interval_s=self._interval_s)
        self._last_early = 0.0
        self._thread = threading.Thread(target=self._run, name=f"catalog {name}".strip(), daemon=True)

    @property
    def remote(self) -> Remote:
        return self._remote

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop; a listing in progress is abandoned (the thread is a daemon thread)."""
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:  # a start that failed before ``start`` (a metrics port in use) stops too
            self._thread.join(timeout=1.0)
        if not self._thread.is_alive():
            self._remote.close()

    def refresh_now(self) -> None:
        now = time.monotonic()
        if now - self._last_early >= _MIN_EARLY_REFRESH_S:
            self._last_early = now
            self._wake.set()

    def pending(self) -> bool:
        """Whether pages wait to be taken (the supervisor then polls without waiting)."""
        return not self._pages.empty()

    def take(self, limit: int = 16) -> list[FoldedPage | ListingEnd]:
        """Up to ``limit`` pages (and listing ends) not taken yet, in order."""
        out: list[FoldedPage | ListingEnd] = []
        while len(out) < limit:
            try:
                out.append(self._pages.get_nowait())
            except queue.Empty:
                break
        return out

    def why_empty(self) -> str:
        """Why a listing of this remote may match nothing (``Remote.why_empty``): "" where nothing can be told."""
        return self._remote.why_empty()

    def state(self) -> CatalogState:
        with self._lock:
            return self._state

    def _put(self, item: FoldedPage | ListingEnd) -> None:
        while not self._stop.is_set():
            try:
                self._pages.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise _Stopped

    def _on_page(self, objects: list[RemoteObject] | FoldedPage) -> None:
        if isinstance(objects, FoldedPage):  # a catalog file's block: folded for this node already
            self._put(objects)
        else:
            self._put(fold_page(objects, self._rank, self._count, label=self._label))

    def _failed(self, message: str) -> None:
        with self._lock:
            self._state = dataclasses.replace(
                self._state, list_errors_total=self._state.list_errors_total + 1, last_error=message, is_failing=True
            )

    def _restore(self) -> None:
        """Stream the restart catalog (if any) as a listing of its own, before the first real one. A file that
        fails part way still ends its listing, so that the real listing's end drops what it does not show."""
        if self.restore is None:
            return
        started = time.monotonic()
        pages = 0

        def on_page(page: Any) -> None:
            nonlocal pages
            self._on_page(page)
            pages += 1

        try:
            restored = self.restore(on_page) or 0
        except _Stopped:
            raise
        except Exception as exc:  # a damaged or unreadable file must never stop the listing that follows
            log.warning("the restart catalog%s is not usable (%s): listing the remote instead", self._of(), exc)
            restored = 0
        if pages:
            self._put(ListingEnd(restored, time.monotonic() - started, is_restored=True))
            took = time.monotonic() - started
            log.info("planned from the restart catalog%s: %d objects in %.2fs", self._of(), restored, took)

    def _run(self) -> None:
        try:
            self._restore()
        except _Stopped:
            return
        retry_s = _RETRY_MIN_S
        while not self._stop.is_set():
            started = time.monotonic()
            requests_before = self._remote.stats.list_requests_total
            try:
                found = self.source(self._on_page)
                unchanged = found is None
                if found is None:  # unchanged: the listing in force stays
                    listed = self._state.objects_listed
                else:
                    listed = found
                    self._put(ListingEnd(listed, time.monotonic() - started))
            except _Stopped:
                return
            except CachefeedError as exc:
                log.warning("listing %s failed: %s (retrying in %.0fs)", self._safe_url(), exc, retry_s)
                self._failed(str(exc))
                wait_s = min(retry_s, self._interval_s)
                retry_s = min(retry_s * 2, max(self._interval_s, _RETRY_MIN_S))
            except Exception as exc:  # a bug or an unexpected backend error: keep the daemon alive, report it
                log.exception("listing %s failed unexpectedly", self._safe_url())
                self._failed(type(exc).__name__)
                wait_s = min(retry_s, self._interval_s)
                retry_s = min(retry_s * 2, max(self._interval_s, _RETRY_MIN_S))
            else:
                retry_s = _RETRY_MIN_S
                duration = time.monotonic() - started
                wait_s = max(self._config.refresh_interval_s, _COST_FACTOR * duration)
                requests = self._remote.stats.list_requests_total - requests_before
                if not listed and not unchanged:  # status says degraded; the journal says why
                    log.warning(
                        "listed 0 objects under %s%s matching %r: nothing to cache (check the URL and the pattern)",
                        self._safe_url(),
                        self._remote.why_empty(),
                        self._config.pattern,
                    )
                else:
                    log.log(
                        logging.DEBUG if unchanged else logging.INFO,
                        "%s %d objects%s in %.2fs (%d LIST requests; next listing in %.0fs)",
                        "unchanged:" if unchanged else "listed",
                        listed,
                        self._of(),
                        duration,
                        requests,
                        wait_s,
                    )
                with self._lock:
                    self._interval_s = wait_s
                    self._state = CatalogState(
                        listed,
                        time.time(),
                        self._state.list_errors_total,
                        "",
                        False,
                        self._remote.stats.list_requests_total,
                        requests * 3600.0 / wait_s,
                        wait_s,
                        duration,
                    )
            with self._lock:
                self._state = dataclasses.replace(
                    self._state, list_requests_total=self._remote.stats.list_requests_total
                )
            self._wake.wait(wait_s)
            self._wake.clear()

    def _safe_url(self) -> str:
        return safe_url(self._config.url) + self._of()

    def _of(self) -> str:
        return f" (source {self._name!r})" if self._name else ""


class _Stopped(Exception):
    """The catalog was stopped while a listing was streaming."""
