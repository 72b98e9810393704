"""Waiting for the first samples: train while the cache fills, starting once ``min_samples`` are cached, or once
the cache is filled to a level (``min_samples="75%"``, see ``wait_for_fill``).

New segments appear in ``segments/`` by an atomic rename. ``watchdog`` (inotify on Linux) wakes the wait on
each such rename there (``watch_publishes``), so the first epoch starts within milliseconds of the segment that
completes ``min_samples``; if an observer cannot be started (inotify instances exhausted, an unsupported
filesystem), the wait falls back to polling every ``poll_s``. Counting reads each new segment's trailer once (one
small ``pread``). A growing epoch's grower (``growing.py``) is woken the same way while a rank waits for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TextIO

from watchdog.events import FileCreatedEvent, FileMovedEvent, FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.records import segment_count
from cachefeed._errors import CachefeedError, NoSuchCacheError, SnapshotError
from cachefeed._logs import get_logger
from cachefeed._status.report import read_report  # the reader of the daemon's document
from cachefeed._status.verdict import Health

__all__ = [
    "Fill",
    "PublishWatch",
    "SampleCounter",
    "fill_reached",
    "parse_fill",
    "wait_for_cache",
    "wait_for_fill",
    "wait_for_samples",
    "wait_for_segments",
    "watch_publishes",
]

log = get_logger(__name__)

_BAR_WIDTH = 24
_PLAIN_EVERY_S = 10.0  # progress line interval when stderr is not a terminal
_NOTE_EVERY_S = 2.0  # how often a progress line looks again at why it waits (the daemon's status document)
_NOTE_CHARS = 200  # a degraded reason on a progress line, at most


class SampleCounter:
    """Counts the samples published in a cache, reading each segment's trailer once."""

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self._counts: dict[str, int] = {}

    def count(self) -> int:
        listed = {name for name, _info in self.layout.list_segments()}
        self._counts = {name: n for name, n in self._counts.items() if name in listed}
        for name in listed - self._counts.keys():
            self._counts[name] = max(0, segment_count(self.layout.segments / name))
        return sum(self._counts.values())


# What a publish looks like to inotify: a rename into the watched directory. A segment comes from ``tmp/``, a
# directory nobody watches, so watchdog reports it created; the status document replaces itself from a temp file
# beside it: moved. Nothing else may wake a waiter: opens, reads and closes of the same files (every worker's, the
# grower's own look at the segments and read of the status document) would wake it again at once, a loop of looks
# that took a core from the daemon its rank waits for (``test_a_waiting_grower_is_woken_by_publishes_not_by_reads``).
_PUBLISHES: list[type[FileSystemEvent]] = [FileCreatedEvent, FileMovedEvent]


class _Wake(FileSystemEventHandler):
    """Calls ``wake`` on a publish (``_PUBLISHES``); with ``names``, only on one whose file (a rename's target) is
    one of them."""

    def __init__(self, wake: Callable[[], None], names: frozenset[str] | None = None) -> None:
        self._wake = wake
        self._names = names

    def on_any_event(self, event: FileSystemEvent) -> None:  # a publish: the schedule's filter drops the rest
        if self._names is not None:
            path = getattr(event, "dest_path", "") or event.src_path
            if os.path.basename(os.fsdecode(path)) not in self._names:
                return
        self._wake()


class _Progress:
    """One line on a terminal (redrawn), or a line every ``_PLAIN_EVERY_S`` in a log file; each ends with why the
    wait may last (``note``, looked at every ``_NOTE_EVERY_S``: ``daemon_note``)."""

    def __init__(
        self,
        stream: TextIO | None,
        root: str,
        target: int,
        *,
        is_fill: bool = False,
        noun: str = "samples",
        note: Callable[[], str] | None = None,
    ) -> None:
        self._is_fill = is_fill  # have/target are percents of the daemon's fill level, not samples
        self._noun = noun
        self._stream = stream
        self._root = root
        self._target = target
        self._note = note
        self._note_text = ""
        self._noted_at: float | None = None
        self._is_tty = bool(stream is not None and stream.isatty())
        self._last_plain = 0.0
        self._width = 0  # of the line drawn last on a terminal: a shorter one is padded over it
        self._drawn = False
        self._has_shown = False

    def show(self, have: int, waited_s: float, *, force: bool = False) -> None:
        if self._stream is None:
            return
        now = time.monotonic()
        if not (self._is_tty or force or now - self._last_plain >= _PLAIN_EVERY_S):
            return
        fraction = min(1.0, have / self._target) if self._target else 1.0
        filled = int(fraction * _BAR_WIDTH)
        bar = f"[{'#' * filled}{'.' * (_BAR_WIDTH - filled)}]"
        if self._is_fill:
            line = f"cachefeed: waiting for the cache in {self._root} to fill {bar} {have}% of {self._target}%"
        else:
            line = f"cachefeed: waiting for {self._noun} in {self._root} {bar} {have}/{self._target} ({fraction:.0%})"
        line += f" {waited_s:.0f}s{self._why(now)}"
        if self._is_tty:
            self._stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
            self._drawn = True
        else:
            self._stream.write(line + "\n")
            self._last_plain = now
        self._stream.flush()
        self._has_shown = True

    def finish(self, have: int, waited_s: float, *, force: bool) -> None:
        """The last line of a wait that showed one; nothing where none was shown (it held at the first look)."""
        if self._has_shown:
            self.show(have, waited_s, force=force)

    def _why(self, now: float) -> str:
        if self._note is None:
            return ""
        if self._noted_at is None or now - self._noted_at >= _NOTE_EVERY_S:
            self._noted_at = now
            note = self._note()
            self._note_text = f"; {note} (cachefeed status)" if note else ""
        return self._note_text

    def done(self) -> None:
        if self._stream is not None and self._drawn:
            self._stream.write("\n")
            self._stream.flush()


def daemon_note(layout: CacheLayout) -> str:
    """Why a wait for the daemon may last, for a progress line or an error: no daemon holds the cache, or the
    daemon reports itself degraded (its first reason), or its heartbeat is stale while it holds the cache's lock
    (hung); "" when it runs well (or is starting). Words only: the waits do not change (a daemon may be about to
    start with the job)."""
    if not layout.has_writer():
        return "no daemon runs on this cache"
    try:
        report = read_report(layout.root)
    except (CachefeedError, OSError):
        return ""  # the wait's own checks say what is wrong with the directory
    if not report.reasons or report.document is None:
        return ""
    reason = "".join(ch if ch.isprintable() else "?" for ch in report.reasons[0])  # the remote's words, maybe
    if len(reason) > _NOTE_CHARS:
        reason = reason[: _NOTE_CHARS - 3] + "..."
    if report.health is Health.DEGRADED:
        return f"the daemon is degraded: {reason}"
    if report.health is Health.NOT_RUNNING and report.document["state"] != "stopped":  # stale, the lock held
        return reason  # (a stopped one's document, the lock held: a new daemon starting, about to write its own)
    return ""


def _noted(note: str) -> str:
    """``daemon_note``'s words for an error message."""
    return f"; {note}" if note else ""


def wait_for_cache(
    layout: CacheLayout, *, timeout_s: float, progress: TextIO | None = sys.stderr, poll_s: float = 0.02
) -> None:
    """Block until the daemon has created the cache at ``layout.root`` (a trainer started together with it). A look
    is a few system calls; every 20 ms by default, so that a trainer started beside its daemon starts its first epoch
    about as soon as the cache exists (a look every 100 ms, the default until 5b4094c, started it up to 0.1 s later).

    Raises:
        NoSuchCacheError: not there after ``timeout_s``; at once where the path is a file, a directory that
            holds a cache in a subdirectory (the parent of ``cache.dir`` given for it: the error names the cache),
            or whatever the daemon would refuse as its cache.dir (``CacheLayout.refusal``: a symbolic link, a path
            below a file, a directory of other files such as a dataset's root). An empty directory may still
            become a cache: it is waited for.
    """
    started = time.monotonic()
    shown = 0.0
    while True:
        try:
            layout.check()
            return
        except NoSuchCacheError as exc:
            waited = time.monotonic() - started
            inside = _caches_inside(layout.root)
            if inside:
                raise NoSuchCacheError(
                    f"{layout.root} is not a cachefeed cache, but {', '.join(map(str, inside))} "
                    f"{'is' if len(inside) == 1 else 'are'}: give the cache directory (the daemon's cache.dir)"
                ) from None
            why = layout.refusal()  # the daemon's own rule: what it would refuse, no trainer waits for
            if why is not None:
                raise NoSuchCacheError(f"{layout.root} is not a cachefeed cache and cannot become one: {why}") from None
            if waited > timeout_s:
                raise NoSuchCacheError(f"{exc} (waited {timeout_s:g}s for the daemon to create it)") from None
            if progress is not None and (not shown or waited - shown >= _PLAIN_EVERY_S):
                line = (
                    f"waiting for a daemon to create the cache at {layout.root} (the directory exists but is not a "
                    f"cachefeed cache yet: is it the daemon's cache.dir? giving up after {timeout_s:g}s)"
                    if layout.root.is_dir()
                    else f"waiting for the cache at {layout.root} to appear (is the daemon starting? check the "
                    f"path; giving up after {timeout_s:g}s)"
                )
                progress.write(f"cachefeed: {line} {waited:.0f}s\n")
                progress.flush()
                shown = waited or 1e-9
        time.sleep(poll_s)  # outside the except: a Ctrl-C here is not "during handling of" the check's error


def _caches_inside(root: Path) -> list[Path]:
    """The cachefeed caches directly under ``root`` (at most a few looked at: a large directory is not scanned)."""
    found = []
    try:
        with os.scandir(root) as entries:
            for count, entry in enumerate(entries):
                if count >= 64:
                    break
                if entry.is_dir(follow_symlinks=False):
                    try:
                        CacheLayout(Path(entry.path)).check()
                    except NoSuchCacheError:
                        continue
                    found.append(Path(entry.path))
    except OSError:
        return []
    return sorted(found)


def wait_for_samples(
    layout: CacheLayout,
    min_samples: int,
    *,
    timeout_s: float,
    progress: TextIO | None = sys.stderr,
    poll_s: float = 1.0,
    stop: threading.Event | None = None,
    is_default: bool = False,
) -> int:
    """Block until at least ``min_samples`` samples are published; return how many there are. On a cache no
    daemon holds when the wait begins (a static cache: what is cached is all there will be) it does not wait, as a
    fill level does not (``fill_reached``), unless nothing is cached (a daemon may be starting). ``is_default``:
    the user did not set ``min_samples`` (it is ``samples_per_epoch``), as the timeout's message then says.

    Raises:
        NoSuchCacheError: the cache directory is missing.
        SnapshotError: ``timeout_s`` passed first (the message says how far the cache got and what to check),
            or ``stop`` was set.
    """
    layout.check()
    counter = SampleCounter(layout)
    have = counter.count()
    if have >= min_samples:
        return have
    if have and not layout.has_writer():  # it used to wait out the whole timeout (600 s by default)
        log.info(
            "no daemon holds %s: starting on the %d samples cached (min_samples=%d)", layout.root, have, min_samples
        )
        return have
    started = time.monotonic()
    woken = threading.Event()
    observer = watch_publishes(layout, woken.set)
    bar = _Progress(progress, str(layout.root), min_samples, note=lambda: daemon_note(layout))
    try:
        bar.show(have, 0.0, force=True)
        while have < min_samples:
            waited = time.monotonic() - started
            if waited > timeout_s:
                wanted = (
                    f"the {min_samples} samples the first epoch waits for by default (samples_per_epoch)"
                    if is_default
                    else f"min_samples={min_samples} samples"
                )
                raise SnapshotError(
                    f"only {have} of {wanted} were cached in {layout.root} after {timeout_s:g}s"
                    f"{_noted(daemon_note(layout))}: check that the daemon runs and fetches (cachefeed status), "
                    f"or {'set a lower' if is_default else 'lower'} min_samples / raise wait_timeout_s"
                )
            if stop is not None and stop.is_set():
                raise SnapshotError("stopped while waiting for samples")
            woken.wait(min(poll_s, max(0.01, timeout_s - waited)))  # poll_s: a safety net for missed events
            woken.clear()
            layout.check()
            have = counter.count()
            bar.show(have, time.monotonic() - started)
        bar.show(have, time.monotonic() - started, force=True)
    finally:
        bar.done()
        stop_watch(observer)
    log.info("%d samples cached in %s after %.1fs", have, layout.root, time.monotonic() - started)
    return have


def wait_for_segments(
    layout: CacheLayout,
    segments: int,
    *,
    timeout_s: float,
    progress: TextIO | None = sys.stderr,
    poll_s: float = 0.02,
    wake: threading.Event | None = None,
) -> int:
    """Block until ``segments`` segments are published, or fewer once the daemon can publish no more
    (``fill_reached``: a small dataset, a paced daemon, no daemon); returns the segments published. What a growing
    first epoch waits for (``growing.py``): a segment for each worker to read. It polls (a look is a directory
    listing of a few files), and looks at once when ``wake`` is set: a ``PublishWatch.event``, which a cold first
    epoch starts before this wait for its grower to take over. The daemon's document and the cache directory
    itself (``layout.check``, three system calls) are looked at only every ``10 * poll_s``: the wait runs while a
    cold daemon starts, and what it takes of the cores it takes from that start.

    Raises:
        NoSuchCacheError: the cache directory is missing.
        SnapshotError: ``timeout_s`` passed first.
    """
    layout.check()
    started = time.monotonic()
    bar = _Progress(progress, str(layout.root), segments, noun="segments", note=lambda: daemon_note(layout))
    checked_at = layout_at = 0.0
    try:
        while True:
            have = len(layout.list_segments())
            waited = time.monotonic() - started
            if have >= segments:
                break
            if have and waited - checked_at >= 10 * poll_s:  # the daemon's document: now and then, not every poll
                checked_at = waited
                if fill_reached(layout, 1.0, have).ready:
                    break
            if waited - layout_at >= 10 * poll_s:  # the cache directory, likewise
                layout_at = waited
                layout.check()
            if waited > timeout_s:
                raise SnapshotError(
                    f"only {have} of the {segments} segments the first epoch starts on were published in "
                    f"{layout.root} after {timeout_s:g}s: check that the daemon runs and fetches (cachefeed status), "
                    "or raise wait_timeout_s"
                )
            bar.show(have, waited)
            if wake is None:
                time.sleep(poll_s)
            elif wake.wait(poll_s):
                wake.clear()  # before the next look: a publish after it sets the event again
        bar.finish(have, time.monotonic() - started, force=waited > 1.0)
    finally:
        bar.done()
    log.info("%d segments published in %s after %.2fs", have, layout.root, time.monotonic() - started)
    return have


def parse_fill(value: str) -> float:
    """``"75%"`` -> 0.75. Raises ValueError naming the value and the form expected."""
    text = value.strip()
    try:
        if not text.endswith("%"):
            raise ValueError
        fraction = float(text[:-1]) / 100
    except ValueError:
        raise ValueError(f"min_samples = {value!r}: expected a count (int) or a fill level such as '75%'") from None
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"min_samples = {value!r}: a fill level is between 0% (excluded) and 100%")
    return fraction


class Fill(NamedTuple):
    """``fill_reached``'s answer."""

    ready: bool  # start (or stop growing) now
    fill: float  # the fill level the daemon reports (0 without one)
    why: str  # for the log: why ready
    daemon_gone: bool = False  # ready because no daemon runs (a restart looks the same for a while)


class DaemonAbsence:
    """The one rule for a wait that finds no daemon (``Fill.daemon_gone``): a daemon restarted (``systemctl
    restart``, or ``Restart=on-failure`` after a crash) comes back on the same cache and fills on, so the wait
    holds on for ``grace_s`` from when it first found the daemon gone before it ends on what is cached. Used by a
    growing epoch's grower (``lifecycle.Epochs._growth_done``) and by ``wait_for_fill``; ``waiter`` and ``then``
    word its one warning (``then`` formats the samples cached)."""

    def __init__(self, layout: CacheLayout, grace_s: float, *, waiter: str, then: str) -> None:
        self.layout, self.grace_s, self.waiter, self.then = layout, grace_s, waiter, then
        self._since: float | None = None

    def back(self) -> None:
        """A daemon runs (again)."""
        self._since = None

    def waited_out(self, have: int) -> bool:
        """No daemon now: whether it has stayed away ``grace_s`` (the first call of an absence warns)."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
            log.warning(
                "the daemon of %s is gone: %s up to %.0fs for it to come back (a restart) before %s",
                self.layout.root,
                self.waiter,
                self.grace_s,
                self.then % have,
            )
        return now - self._since >= self.grace_s

    @property
    def away_s(self) -> float:
        """Seconds since this absence began (0 while a daemon runs)."""
        return 0.0 if self._since is None else time.monotonic() - self._since


def fill_reached(layout: CacheLayout, fraction: float, have: int) -> Fill:
    """Whether to start now (and the fill level, and why) from the daemon's status document.

    The cache is full enough when the daemon reports ``cache.fill >= fraction``, or when it cannot fill further:
    it waits for trainers to read (paced), for pins to go (back-pressure) or for space on its filesystem, or it
    has fetched everything the remote lists (a dataset smaller than the cache). Without a running daemon (a static
    cache) what is cached is all there will be.

    Whether a daemon runs is the kernel's word, not the heartbeat's: a daemon holds the cache's writer lock until
    it exits (``CacheLayout.has_writer``). A heartbeat older than the status verdict's limit while the lock is held
    is a daemon that did not get the CPU for some seconds (a stalled machine: every process stops, and the trainer,
    woken first, finds the document older than the limit), or one that hangs. Neither is a reason to end a growing
    epoch on what is cached: in a one-off run an epoch of 330 samples ended that way at 84, each served about four
    times (``test_a_daemon_stalled_past_its_heartbeat_limit...`` witnesses the promise). So the
    fill is not judged then; the waits have their own timeouts, whose messages point to ``cachefeed status``.
    """
    report = read_report(layout.root)
    document = report.document
    if (
        report.health is Health.NOT_RUNNING
        and document is not None
        and document["state"] != "stopped"
        and layout.has_writer()
    ):
        return Fill(False, float(document["cache"].get("fill", 0.0)), "")  # its heartbeat is late (see above)
    if report.health in (Health.NOT_RUNNING, Health.UNREADABLE) or document is None:
        return Fill(have > 0, 0.0, "no daemon is running: starting on what is cached", daemon_gone=True)
    cache = document["cache"]
    fill = float(cache.get("fill", 0.0))
    if report.health is Health.NOT_READY or have == 0:
        return Fill(False, fill, "")
    if fill >= fraction:
        return Fill(True, fill, f"cache {fill:.0%} full")
    if cache["is_paced"] or cache["is_backpressured"]:
        return Fill(True, fill, f"cache {fill:.0%} full and waiting for trainers: starting")
    if cache.get("is_out_of_space"):
        return Fill(True, fill, f"cache {fill:.0%} full: its filesystem has no room for more (cachefeed status)")
    if document["remote"]["passes_completed"] >= 1:
        return Fill(True, fill, f"cache {fill:.0%} full with everything the remote lists: starting")
    return Fill(False, fill, "")


def wait_for_fill(
    layout: CacheLayout,
    fraction: float,
    *,
    timeout_s: float,
    progress: TextIO | None = sys.stderr,
    poll_s: float = 0.5,
    restart_grace_s: float = 0.0,
    is_default: bool = False,
) -> int:
    """Block until the daemon has filled the cache to ``fraction`` of what it keeps (see ``fill_reached``);
    return the samples cached. The user states a level; segment sizes and metadata are the daemon's business.

    A daemon seen running during this wait that goes away is waited for up to ``restart_grace_s`` (a restart:
    ``systemctl restart``, or ``Restart=on-failure`` after a crash, comes back on the same cache and fills on)
    before the wait ends on what is cached; a cache no daemon ran on during the wait is what there will be, and
    the wait ends at once, as ``fill_reached`` says. ``is_default``: the user did not set ``min_samples`` (the
    level is the factory's default), as the timeout's message then says.

    Raises:
        NoSuchCacheError: the cache directory is missing.
        SnapshotError: ``timeout_s`` passed first (the message says how far the cache got and what to check).
    """
    layout.check()
    counter = SampleCounter(layout)
    started = time.monotonic()
    bar = _Progress(progress, str(layout.root), round(fraction * 100), is_fill=True, note=lambda: daemon_note(layout))
    absence = DaemonAbsence(layout, restart_grace_s, waiter="waiting", then="starting on the %d samples cached")
    seen_daemon, last_fill = False, 0.0
    try:
        while True:
            have = counter.count()
            ready, fill, why, gone = fill_reached(layout, fraction, have)
            waited = time.monotonic() - started
            if not gone:
                seen_daemon, last_fill = True, fill
                absence.back()
            elif seen_daemon and ready and restart_grace_s > 0:
                # the grace ends at the wait's own timeout too: then it starts on what is cached, as without one
                ready = absence.waited_out(have) or waited > timeout_s
                why = f"no daemon came back within {absence.away_s:.0f}s: starting on what is cached"
                fill = last_fill
            if ready:
                bar.finish(round(fill * 100), waited, force=True)
                log.info("%s (%d samples) after %.1fs", why, have, waited)
                return have
            if waited > timeout_s:
                wanted = (
                    f"the first epoch's default fill ({fraction:.0%})"
                    if is_default
                    else f"min_samples = '{fraction:.0%}'"
                )
                raise SnapshotError(
                    f"the cache in {layout.root} was {fill:.0%} full ({have} samples) after {timeout_s:g}s, "
                    f"short of {wanted}{_noted(daemon_note(layout))}: check that the daemon runs and fetches "
                    f"(cachefeed status), or {'set a lower' if is_default else 'lower'} min_samples / raise "
                    "wait_timeout_s"
                )
            bar.show(round(fill * 100), waited)
            time.sleep(poll_s)
            layout.check()
    finally:
        bar.done()


class _DropStopRace(logging.Filter):
    """watchdog 7's inotify emitter logs an ERROR when its thread is stopped between two reads (a benign race in
    ``InotifyEmitter.queue_events``); we stop an observer after every wait, so drop exactly that record."""

    MESSAGE = "InotifyEmitter.queue_events() called when the thread is inactive"

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.MESSAGE


_STOP_RACE_FILTER = _DropStopRace()


def watch_publishes(layout: CacheLayout, wake: Callable[[], None], *, status: bool = False) -> BaseObserver | None:
    """An inotify observer that calls ``wake`` (on its own thread: keep it to setting a flag or an event) when a
    segment is published in ``layout`` and, with ``status``, when the daemon replaces its status document (where
    it says it can fill no further), and at nothing else (``_PUBLISHES``); None where none can start: the caller
    polls instead. ``stop_watch`` ends it."""
    logging.getLogger("watchdog.observers.inotify").addFilter(_STOP_RACE_FILTER)  # idempotent: same object
    observer = Observer()
    observer.daemon = True
    try:
        observer.schedule(_Wake(wake), str(layout.segments), recursive=False, event_filter=_PUBLISHES)
        if status:
            names = frozenset({layout.status_file.name})
            observer.schedule(_Wake(wake, names), str(layout.root), recursive=False, event_filter=_PUBLISHES)
        observer.start()
    except (OSError, RuntimeError) as exc:  # no inotify instance or watch left, no thread: the caller polls
        with contextlib.suppress(Exception):
            observer.unschedule_all()  # an emitter started before the one that failed stops too
        log.warning("cannot watch %s (%s): polling for new segments instead", layout.segments, exc)
        return None
    return observer


class PublishWatch:
    """An observer of the daemon's publishes (``watch_publishes``, status documents included) started before whoever
    will listen to it: a cold first epoch starts one before it waits for its first segments, so that neither that
    wait (woken by ``event``) nor its grower (which takes it over: ``listen``, and stops it with the growth) waits
    for the observer's threads to start, milliseconds on a busy machine that a first batch would wait for.
    ``is_running`` is False where none could start (the waits poll); ``stop`` is idempotent."""

    def __init__(self, layout: CacheLayout) -> None:
        self.event = threading.Event()  # set at each publish
        self._listener: Callable[[], None] | None = None
        self._observer = watch_publishes(layout, self._heard, status=True)

    @property
    def is_running(self) -> bool:
        return self._observer is not None

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (on the observer's thread) at each publish from now on, as well as setting ``event``."""
        self._listener = listener

    def stop(self) -> None:
        observer, self._observer = self._observer, None
        stop_watch(observer)

    def _heard(self) -> None:
        self.event.set()
        listener = self._listener
        if listener is not None:
            listener()


def stop_watch(observer: BaseObserver | None) -> None:
    """Stop an observer from ``watch_publishes`` (None: nothing to stop) and wait for its threads."""
    if observer is not None:
        observer.stop()
        observer.join()
