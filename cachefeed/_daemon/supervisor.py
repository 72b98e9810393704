"""The daemon's main process: cache store, catalog, plan, samplers, status and systemd notifications.

Lifecycle (what a test or systemd observes)::

    starting -> (lock taken, recovery done, samplers spawned) READY=1 -> running <-> degraded
             -> SIGTERM/SIGINT: STOPPING=1, state "stopping", samplers drain -> state "stopped", exit 0

* The ``CacheStore`` is created first: it takes the cache's writer lock (a second daemon fails with
  ``CacheLockedError``, exit 75) and recovers the directory, all before READY.
* The main loop waits on the samplers' sockets and a self-pipe woken by signals (``signal.set_wakeup_fd``),
  with a timeout from the next timer (status, watchdog, restarts). Signal handlers only set flags; the loop acts.
* Samplers and what happens when one dies: NOTE [ Supervisor-sampler protocol ] in ``protocol.py``.
* Drain on SIGTERM: no new work; each sampler is told to drain; after ``DRAIN_TIMEOUT_S`` stragglers are
  SIGKILLed and their grants aborted. A second SIGTERM/SIGINT kills at once. Nothing partial is ever published.
* ``degraded`` while a sampler is down (restarting), hung writing one object (``_watch_writers``), silent
  (``pool.py``, "Silence") or holding objects ingest waits for (``_watch_held``), all after ``status.stuck_after``;
  while listing fails, the cache's filesystem is full, or nearly every remote request of the last seconds failed;
  the reasons are listed in the status document.
* SIGHUP lists the remote at once (objects refused with 401/403 are tried again) and reads the config file again:
  it applies no setting, and logs one line naming the keys an edit changed (they take effect at a restart), or why
  the file no longer loads (``_check_config_file``).

Not thread-safe: everything runs on the main thread, except the catalog's listing thread (see ``catalog.py``) and
the thread that writes the restart catalog (``catalog_file.py``; it only reads the table, ``ObjectTable.blocks``).

Why one long module: it is the daemon's one loop (the lifecycle above); each job it delegates has a module of its
own: grants (``grants.py``), sources and plans (``sources.py``, ``plan.py``), samplers (``pool.py``), status
(``reporter.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np

from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.sources import changed_settings, read_made_with, write_made_with
from cachefeed._cache.store import CacheStore
from cachefeed._codecs import get_decoder, get_preprocess
from cachefeed._config import Config, changed_keys, load_config
from cachefeed._config.model import NO_FILE
from cachefeed._daemon.catalog import ListingEnd
from cachefeed._daemon.catalog_file import (
    MAX_SHARE,
    CatalogHeader,
    load_restart,
    restart_header,
    save_restart,
)
from cachefeed._daemon.columns import key_hash, return_freed_memory
from cachefeed._daemon.grants import Abort, GrantServer, Publish, Reserve
from cachefeed._daemon.notify import SystemdNotifier
from cachefeed._daemon.pass_file import MAX_SHARE as PASS_MAX_SHARE
from cachefeed._daemon.pass_file import PassFileError, PassFileWriter, read_pass_file
from cachefeed._daemon.pool import SamplerHandle, SamplerPool, SamplerState
from cachefeed._daemon.protocol import (
    Credit,
    Done,
    Drain,
    Drained,
    Exiting,
    Failed,
    Init,
    Quarantined,
    Refused,
    Stats,
    Work,
    WorkItem,
    read_writing,
)
from cachefeed._daemon.quarantine import QuarantineLog
from cachefeed._daemon.reporter import StatusReporter
from cachefeed._daemon.sources import Input, Inputs
from cachefeed._daemon.wire import Message
from cachefeed._errors import ConfigError
from cachefeed._labels import ClassIndex, class_name
from cachefeed._logs import get_logger
from cachefeed._scrub import safe_url

if TYPE_CHECKING:
    from cachefeed._status.metrics import MetricsExporter

__all__ = ["DRAIN_TIMEOUT_S", "Supervisor"]

log = get_logger(__name__)

DRAIN_TIMEOUT_S = 5.0
CRASHES_TO_QUARANTINE = 2  # samplers that died writing one object before it is quarantined (``_undo``)
_MAX_WAIT_S = 0.25
_SHORT_NAP_S = 0.01  # the main loop's longest nap while a source's first listing runs or the samplers drain (_serve)
# What one sampler may hold of assigned objects: the larger of these, and always two objects (_assign).
_ASSIGNED_BYTES_MIN = 16 << 20
_ASSIGNED_SEGMENTS = 4
_UPKEEP_INTERVAL_S = 0.5
_EARLY_STATUS_GAP_S = 0.02  # at most this often a status document published early (``StatusSchedule``)


class Supervisor:
    """Runs the daemon until SIGTERM/SIGINT. ``run()`` returns the exit status (0 after a clean drain).

    Args:
        config: the parsed config.
        log_level: the level samplers log at (the CLI's ``--log-level`` or ``config.log.level``).
        notifier: where READY/STATUS/WATCHDOG/STOPPING go (default: from ``NOTIFY_SOCKET``).
    """

    def __init__(self, config: Config, *, log_level: str | None = None, notifier: SystemdNotifier | None = None):
        self.config = config
        self.log_level = log_level or config.log.level
        self.notifier = notifier if notifier is not None else SystemdNotifier(unset_environment=True)
        self.should_exit = False
        self.force_exit = False
        self.should_refresh = False
        self.state = "starting"
        self.started_at = time.time()
        self.inputs = Inputs(config)  # per source: a catalog and a sampling plan (sources.py)
        self._store: CacheStore | None = None
        self._grants: GrantServer | None = None  # room for segments, on the store (NOTE in grants.py)
        self._pool: SamplerPool | None = None
        self._metrics: MetricsExporter | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._lost: set[int] = set()
        self._is_draining = False
        self._drain_deadline = 0.0
        self._evicted_seen = (0, 0)  # the store's evicted and retired segments, as the plans know them
        self._turnover_s: float | None = None
        self._reporter: StatusReporter | None = None
        self.quarantine = QuarantineLog()  # the most recent objects and samples left out, for status
        self._deaths_writing: dict[int, int] = {}  # gid -> samplers that died writing it (``_undo``)
        self._next_handle = 0
        self._object_bytes = 0  # the largest object of the last draw: how many objects fill a sampler's room
        self._classes: ClassIndex | None = None  # sampler.label: the class index of the whole listing
        self._listed: set[int] = set()  # the inputs whose listing has ended once
        self._saver: threading.Thread | None = None  # writes the restart catalog (catalog_file.py)
        self._is_starved = False  # the last ``_assign`` had a sampler with credit and nothing to draw

    # -- signals: handlers only set flags (and the wakeup fd wakes the loop) -----------------------------------

    def handle_term(self, signum: int, frame: FrameType | None) -> None:
        self.force_exit = self.should_exit
        self.should_exit = True

    handle_int = handle_term

    def handle_hup(self, signum: int, frame: FrameType | None) -> None:
        self.should_refresh = True

    @contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        handlers = {signal.SIGTERM: self.handle_term, signal.SIGINT: self.handle_int, signal.SIGHUP: self.handle_hup}
        previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
        self._wake_w.setblocking(False)
        old_fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        try:
            yield
        finally:
            signal.set_wakeup_fd(old_fd)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    # -- lifecycle ------------------------------------------------------------------------------------------

    def preflight(self) -> None:
        """Load what the config names (decoder, preprocess, the URL's filesystem); ``ConfigError`` (exit 78) if any
        cannot be. Touches neither the cache nor the remote, so it can run before logging starts."""
        config = self.config
        loads: list[tuple[str, str, Callable[[str], object]]] = [
            (f"source[{e.index}].decode", e.config.decode, get_decoder)
            if e.config.decode
            else ("sampler.decode", config.sampler.decode, get_decoder)
            for e in self.inputs.inputs
        ]
        loads.append(("sampler.preprocess", config.sampler.preprocess, get_preprocess))
        for key, value, load in loads:
            try:
                load(value)
            except ConfigError as exc:  # name the file and the key, as every other config error does
                reason = str(exc).removeprefix(f"{value!r}: ")
                raise ConfigError(f"{config.source}: {key} = {value!r}: {reason}") from None
        self.inputs.open_catalogs()
        for catalog in self.inputs.catalogs():  # before any fork or thread: NOTE [ Warmed session ] (client.py)
            catalog.remote.warm_session()

    def run(self) -> int:
        config = self.config
        return_freed_memory()  # the catalog's columns grow by copies: give the old ones back (columns.py)
        with self._signal_handlers():
            self.preflight()
            store = CacheStore(config.cache)  # CacheLockedError (exit 75); recovery happens here
            self._store = store
            self._grants = GrantServer(store)
            if self.inputs.is_named:  # eviction keeps each source near its share (_cache/store.py)
                store.source_weights = {entry.tag: entry.weight for entry in self.inputs.inputs}
            dropped = store.drop_sources({entry.tag for entry in self.inputs.inputs})
            if dropped:
                log.warning("evicted %d cached segments of sources the config no longer names", dropped)
            self._drop_remade(store)
            store.shrink_to_budget()  # after the drops and with the weights: what goes first is what should
            tags = {segment.seq: segment.source for segment in store.segments}
            for seq, sources in store.recovered_sources.items():
                self.inputs.adopt(seq, tags.get(seq, 0), sources)  # what the cache holds is not fetched again
            store.recovered_sources.clear()
            if config.sampler.label:  # continues the index a previous run kept in the cache (_labels.py)
                layout = CacheLayout(config.cache.dir)
                self._classes = ClassIndex(layout.classes_file, config.sampler.label, file_mode=config.cache.file_mode)
            self._resume_passes(store)
            self._restore_catalogs(store)
            self.inputs.write_table(str(store.layout.sources_file), mode=config.cache.file_mode)
            try:
                if config.status.metrics_port or config.status.metrics_textfile:  # else: no prometheus_client
                    from cachefeed._status.metrics import MetricsExporter

                    self._metrics = MetricsExporter(config.status)
                self._pool = SamplerPool(
                    config.sampler.processes,
                    make_init=self._make_init,
                    lock_fd=store.lock_fd,
                    backoff_s=config.sampler.restart_backoff_s,
                    backoff_max_s=config.sampler.restart_backoff_max_s,
                    stuck_after_s=config.status.stuck_after_s,
                )
                return self._serve()
            finally:
                self._shutdown()

    def _serve(self) -> int:
        if self._pool is None:
            raise RuntimeError("the supervisor is not set up")
        for handle in self._pool:
            self._pool.start(handle)
        for catalog in self.inputs.catalogs():
            catalog.start()
        self.state = "running"
        self._publish_status()
        self.notifier.ready(self._status_line())
        log.info(
            "ready: cache %s, %d samplers, %s %s",
            self.config.cache.dir,
            len(self._pool.handles),
            "sources" if self.inputs.is_named else "remote",
            ", ".join(
                (f"{e.name} ({e.weight:.0%}) " if self.inputs.is_named else "") + safe_url(e.config.url)
                for e in self.inputs.inputs
            ),
        )
        watchdog_s = self.notifier.watchdog_interval_s()
        now = time.monotonic()
        status = StatusSchedule(self.config.status.interval_s, now, self._waited_on())
        next_watchdog = now
        next_upkeep = now
        while True:
            now = time.monotonic()
            timers = [status.next_at()] + ([next_watchdog] if watchdog_s else [])
            if not self._is_draining:  # upkeep waits while draining: its passed deadline kept the loop from napping
                timers.append(next_upkeep)
            is_listing = any(catalog.pending() for catalog in self.inputs.catalogs())  # pages waiting: no nap
            # Until a first listing ends, its pages are looked for often: they are what the samplers wait for; while
            # draining, the samplers' exits likewise (a sampler reaped a nap after its channel closed stops it late).
            nap = _SHORT_NAP_S if self._is_first_listing() or self._is_draining else _MAX_WAIT_S
            self._poll(0.0 if is_listing else min(nap, max(0.0, min(timers) - now)))
            if self.should_exit and not self._is_draining:
                self._begin_drain()
            if self._is_draining:
                if self._drain_step():
                    break
            else:
                self._step()
            now = time.monotonic()
            if now >= next_upkeep and not self._is_draining:
                next_upkeep = now + _UPKEEP_INTERVAL_S
                self._upkeep()
            if status.is_due(now, self._waited_on()):
                status.published(now)
                self._publish_status()
                self.notifier.status(self._status_line())
            if watchdog_s and now >= next_watchdog:
                next_watchdog = now + watchdog_s / 2
                self.notifier.watchdog()
        self._save_passes()  # what the drain resolved
        self.state = "stopped"
        layout = self._require_store().layout
        for index in range(self.config.sampler.processes):  # every sampler is gone: nothing for them to tell
            layout.writing_file(index).unlink(missing_ok=True)
        self._publish_status()
        log.info("stopped")
        return 0

    def _is_first_listing(self) -> bool:
        """Whether some source's first listing is under way (not done, and not failing: then the normal nap)."""
        states = [catalog.state() for catalog in self.inputs.catalogs()]
        return any(state.last_listed_at == 0 and not state.is_failing for state in states)

    def _shutdown(self) -> None:
        """Whatever happened: no sampler outlives us, the catalog thread stops, the lock is released."""
        if self._pool is not None:
            for handle in self._pool:
                self._pool.kill(handle)
            for handle in self._pool.reap(lost={h.index for h in self._pool.handles}):
                self._undo(handle)
        for catalog in self.inputs.catalogs():
            catalog.stop()
        if self._saver is not None:
            self._saver.join(timeout=10.0)  # atomic: a write cut short leaves the previous catalog
        for entry in self.inputs.inputs:
            if entry.pass_file is not None:
                entry.pass_file.close()
        if self._metrics is not None:
            self._metrics.close()
        if self._store is not None:
            self._store.close()
        self._wake_r.close()
        self._wake_w.close()
        self.notifier.close()

    # -- the loop's steps -----------------------------------------------------------------------------------

    def _poll(self, timeout_s: float) -> None:
        """Wait for messages or a signal; dispatch every message that arrived."""
        pool = self._require_pool()
        live = {handle.channel.sock: handle for handle in pool.live() if handle.channel is not None}
        ready = multiprocessing.connection.wait([self._wake_r, *live], timeout_s)
        for item in ready:
            if item is self._wake_r:
                try:
                    self._wake_r.recv(4096)
                except BlockingIOError:
                    pass
                continue
            if not isinstance(item, socket.socket):
                continue
            handle = live[item]
            channel = handle.channel
            if channel is None:
                continue
            try:
                messages = channel.recv_ready()
            except ConnectionError:
                self._lost.add(handle.index)
                messages = []
            pool.heard_from(handle)
            for message in messages:
                self._dispatch(handle, message)

    def _step(self) -> None:
        pool = self._require_pool()
        for handle in pool.reap(lost=self._lost):
            self._undo(handle)
            pool.schedule_restart(handle)
        self._lost.clear()
        pool.restart_due()
        if self.should_refresh:
            self.should_refresh = False
            self._check_config_file()  # first: the log reads in the order SIGHUP's work is done
            refused = sum(entry.plan.retry_forbidden() for entry in self.inputs.inputs)
            log.info(
                "SIGHUP: listing the remote now%s",
                f"; the {refused} objects refused with 401/403 are tried again" if refused else "",
            )
            for catalog in self.inputs.catalogs():
                catalog.refresh_now()
        for entry in self.inputs.inputs:
            for item in entry.catalog.take() if entry.catalog is not None else ():
                if isinstance(item, ListingEnd):
                    entry.is_joining = False
                    self._listed.add(entry.index)
                    if self._classes is not None and len(self._listed) == len(self.inputs.inputs):
                        self._classes.check_listing()  # the whole listing: every source's (one per class, say)
                    entry.plan.end_listing(is_restored=item.is_restored)
                    if item.is_restored:  # what the file holds already (0 objects: it failed, write it again)
                        entry.catalog_revision = entry.plan.revision if item.objects else -1
                    elif not entry.plan.listed_nothing:  # a missing mount, say: the catalog kept is the last one
                        self._save_catalog(entry)
                    continue
                if self._classes is not None:  # before any of the page's objects is handed out with a label
                    rule = self._classes.rule  # (a restart catalog's pages name no classes: from their paths)
                    self._classes.add(item.classes or {class_name(path, rule) for path in item.paths})
                added = entry.plan.update_page(item)
                if added:  # said once per listing at info (benchmarks.ingest times pass 0 from it), then at debug
                    of = self.inputs.of_source(entry.tag)
                    level = logging.DEBUG if entry.is_joining else logging.INFO
                    log.log(level, "%d new objects%s join pass %d", added, of, entry.plan.pass_index)
                    entry.is_joining = True
        self._retire_stale()
        self._assign()

    def _retire_stale(self) -> None:
        """Evict at once the segments the plans found stale: they hold samples of versions the remote no longer
        lists (``plan.py``, "Retired samples"); the plans then learn their other samples are gone."""
        retired = False
        for entry in self.inputs.inputs:
            stale = entry.plan.take_stale()
            if not stale:
                continue
            segments, samples = self._require_store().retire(stale)
            if segments:
                retired = True
                log.info(
                    "retired %d cached segments (%d samples)%s: they held samples of objects the remote no longer "
                    "lists at that version (overwritten or deleted); epochs from now on do not read them, and their "
                    "other samples are fetched again",
                    segments,
                    samples,
                    self.inputs.of_source(entry.tag),
                )
        if retired:
            self._check_evictions()

    def _check_config_file(self) -> None:
        """SIGHUP applies no setting: the daemon runs on the config it started with. It reads the file again and
        logs one line, at warning, where the file differs from what runs: the keys whose values changed, which take
        effect only after a restart; or why the file no longer loads (a restart would then exit 78), the daemon
        running on. Nothing where the file is unchanged, or where the config came from no file."""
        source = self.config.source
        if source == NO_FILE:  # a config parsed in memory (tests): no file to read again
            return
        try:
            edited = load_config(source)
        except (ConfigError, OSError) as exc:
            why = exc if isinstance(exc, ConfigError) else f"{source}: cannot read it ({exc.strerror or exc})"
            log.warning(
                "SIGHUP: the config file no longer loads (%s): a restart would fail (exit 78); the daemon runs on "
                "the settings it started with: fix the file before restarting",
                why,
            )
            return
        changed = changed_keys(self.config, edited)
        if changed:
            log.warning(
                "SIGHUP: the config file %s was edited: %s changed, which take effect only after a restart of the "
                "daemon (SIGHUP applies no setting; it runs on the settings it started with)",
                source,
                ", ".join(changed),
            )

    # -- the restart catalog (catalog_file.py) ------------------------------------------------------------------

    def _restart_header(self, entry: Input) -> CatalogHeader:
        node = self.config.node
        return restart_header(entry.config.url, entry.config.pattern, node.rank, node.count)

    def _drop_remade(self, store: CacheStore) -> None:
        """Evict the cached samples of each source that were made under other settings than the config's (another
        URL, pattern, decoder, image size, label, preprocess or node share: ``made_with.json``, ``_cache/sources.py``),
        naming what changed; then record the settings they are made with from now on. A record that is there but
        cannot be read (``read_made_with`` says why) says nothing of what the cached samples are: they are evicted,
        with a warning naming why, as if every setting had changed (``_drop_unknown``)."""
        path = store.layout.made_with_file
        (before, damage), now = read_made_with(path), self.inputs.made_with()
        if damage:
            self._drop_unknown(store, path, damage, set(now))
        for tag, settings in now.items():
            changes = changed_settings(before[tag], settings) if tag in before else []  # none recorded: a new cache
            if changes:
                dropped = store.drop_tags({tag})
                if not dropped:
                    log.info(
                        "the settings%s changed (%s); nothing was cached under the old ones",
                        self.inputs.of_source(tag),
                        "; ".join(changes),
                    )
                    continue
                log.warning(
                    "the cache's samples%s were made with other settings (%s): evicted those %d cached segments; "
                    "they are fetched again as the config says now",
                    self.inputs.of_source(tag),
                    "; ".join(changes),
                    dropped,
                )
        try:
            write_made_with(path, now, mode=self.config.cache.file_mode)
        except OSError as exc:  # the next start compares with the settings an earlier one recorded
            log.warning("could not record the settings the cache's samples are made with in %s: %s", path, exc)

    def _drop_unknown(self, store: CacheStore, path: Path, damage: str, tags: set[int]) -> None:
        """``made_with.json`` is damaged: the settings the cached samples were made with are unknown. Keeping them
        could serve samples of a remote, pattern, decoder or share the config no longer names (an edit made while
        the record was damaged goes unseen), which a kept cache promises never to do; evicting them costs one
        refill. So the configured sources' cached samples are evicted, and the record is written again."""
        dropped = store.drop_tags(tags)
        log.warning(
            "%s is damaged (%s): the settings the cache's samples were made with are unknown, so %s; it is written "
            "again from the config",
            path,
            damage,
            f"its {dropped} cached segments are evicted and fetched again" if dropped else "nothing cached is kept",
        )

    def _restore_catalogs(self, store: CacheStore) -> None:
        """Each source's restart catalog streams into the plan first, in the listing thread (``catalog.py``), so
        the first objects are handed out after its first block; the remote is listed after it."""
        for entry in self.inputs.inputs:
            if entry.catalog is None:
                continue
            path = store.layout.catalog_file(entry.tag)
            header = self._restart_header(entry)

            def restore(on_page: Callable[[Any], None], path: Path = path, header: CatalogHeader = header) -> int:
                restored = 0
                for page in load_restart(path, header):
                    restored += page.listed
                    on_page(page)
                return restored

            entry.catalog.restore = restore

    # -- the pass file (pass_file.py) -------------------------------------------------------------------------

    def _resume_passes(self, store: CacheStore) -> None:
        """Each source's plan goes on with the pass an earlier run was in, if that run had the same seed and source
        settings, and keeps its pass from now on."""
        made_with, mode = self.inputs.made_with(), self.config.cache.file_mode
        limit = int(self.config.cache.max_bytes * PASS_MAX_SHARE) // len(self.inputs.inputs)  # the sources' files
        for entry in self.inputs.inputs:
            path = store.layout.pass_file(entry.tag)
            identity = {"seed": self.config.sampler.seed, "settings": made_with[entry.tag]}
            try:
                state = read_pass_file(path, identity)
            except (PassFileError, OSError) as exc:
                log.warning("the pass file %s cannot be used (%s): the pass begins again", path, exc)
                state = None
            again = store.evicted_unread_at_start.pop(entry.tag, [])
            if state is not None and again:  # evicted unread by the start's shrink: fetched again in the pass
                keys = np.unique(np.array([key_hash(source.path) for source in again], np.uint64))
                state = dataclasses.replace(state, resolved=np.setdiff1d(state.resolved, keys, assume_unique=True))
            if state is not None:
                entry.plan.resume_pass(state.pass_index, state.passes_completed, state.resolved, drew=state.drew)
                log.info(
                    "going on with pass %d%s: the %d objects it resolved before the restart are not drawn in it",
                    state.pass_index,
                    self.inputs.of_source(entry.tag),
                    len(state.resolved),
                )
            entry.pass_file = PassFileWriter(path, identity, mode=mode, max_bytes=limit)
            if state is not None:
                entry.pass_file.carry(state)
        self._save_passes()

    def _save_passes(self) -> None:
        for entry in self.inputs.inputs:
            if entry.pass_file is not None:
                plan = entry.plan
                entry.pass_file.save(plan.pass_index, plan.counters.passes_completed, *plan.take_resolved())

    def _save_catalog(self, entry: Input) -> None:
        """Keep the last complete listing's owned objects for the next start, if they changed: written in a thread
        straight from the live table (``ObjectTable.blocks``), one at a time; a later listing saves what it missed."""
        plan = entry.plan
        if plan.revision == entry.catalog_revision or (self._saver is not None and self._saver.is_alive()):
            return
        store = self._require_store()
        path = store.layout.catalog_file(entry.tag)
        limit = int(self.config.cache.max_bytes * MAX_SHARE) // len(self.inputs.inputs)  # every source's catalog
        table, listed, owned = plan.table, plan.listed(), plan.owned  # the rows only grow: no copy of the table
        header, mode = self._restart_header(entry), self.config.cache.file_mode
        entry.catalog_revision = plan.revision

        def save() -> None:
            started = time.monotonic()
            try:
                kept = save_restart(path, table, listed, header, mode=mode, max_bytes=limit)
            except OSError as exc:
                log.warning("cannot keep the restart catalog %s: %s", path, exc)
                entry.catalog_revision = -1  # not kept: try again after the next listing, changed or not
                return
            if kept:
                log.info("kept the restart catalog (%d objects) in %.2fs", owned, time.monotonic() - started)
            elif not entry.catalog_too_large:
                entry.catalog_too_large = True
                log.warning(
                    "the catalog of %d objects would exceed its share of %.0f%% of cache.max_bytes: not kept for "
                    "restarts",
                    owned,
                    MAX_SHARE * 100,
                )

        self._saver = threading.Thread(target=save, name="restart catalog", daemon=True)
        self._saver.start()

    def _assign(self) -> None:
        pool = self._require_pool()
        handles = pool.handles[self._next_handle :] + pool.handles[: self._next_handle]
        self._next_handle = (self._next_handle + 1) % len(pool.handles)
        cached = self._require_store().samples_by_source() if self.inputs.is_named else {}
        classes = self._classes
        cap = max(_ASSIGNED_BYTES_MIN, _ASSIGNED_SEGMENTS * self.config.cache.segment_bytes)
        self._is_starved = False  # a sampler with credit drew nothing (``_watch_held``)
        for handle in handles:
            items: list[WorkItem] = []
            exhausted = False
            # Credits count objects, not bytes: a few large objects (tar shards) would all go to the first
            # sampler to ask, fetched at once and written one after another while the others idle. So a sampler
            # holds at most ``cap`` bytes of assigned objects (at least two of them); the rest waits for the
            # next sampler with credit.
            while handle.channel is not None and handle.credits > 0:
                room = cap - handle.assigned_bytes
                if room <= 0 and len(handle.assigned) >= 2:
                    break
                wanted = 1 if self._object_bytes <= 0 else max(1, room // self._object_bytes)
                entry, drawn = self.inputs.draw(handle.index, min(handle.credits, wanted), cached)
                if not drawn:
                    exhausted = True
                    break
                self._object_bytes = max(obj.size for _oid, obj in drawn)
                handle.credits -= len(drawn)
                handle.assign([(oid, obj.size) for oid, obj in drawn])
                items += [
                    WorkItem(
                        oid,
                        obj.path,
                        obj.size,
                        obj.etag,
                        classes.label(obj.path) if classes is not None else None,
                        entry.index,
                        entry.plan.cut(self.inputs.split(oid)[1]),
                    )
                    for oid, obj in drawn
                ]
            if items:
                pool.send(handle, Work(items))
            if exhausted:
                self._is_starved = True
                return

    def _upkeep(self) -> None:
        store = self._require_store()
        store.enforce()
        self._check_evictions()
        self._watch_writers()
        self._watch_held()
        self._save_passes()

    def _watch_writers(self) -> None:
        """A sampler's heartbeat comes from its event loop, so a writer thread stuck inside a decoder or preprocess
        (a hang, not a crash) went unnoticed while ingest stopped. The object it writes (``tmp/sampler-<i>.writing``,
        whose mtime is when it began) tells: one written for longer than ``status.stuck_after`` without a word from
        that thread (a wait for room re-asks every 0.1 s) makes the daemon degraded, naming it; at twice that the
        sampler is killed, a death while writing that object (``_undo``: quarantined after two)."""
        limit, now = self.config.status.stuck_after_s, time.time()
        layout = self._require_store().layout
        for handle in self._require_pool().live():
            handle.hung = ""
            path = layout.writing_file(handle.index)
            gid = read_writing(str(path))
            if gid < 0 or gid not in handle.assigned:
                continue
            try:
                began = os.stat(path).st_mtime
            except OSError:
                continue
            idle = now - max(began, handle.writer_heard_at)
            if idle <= limit:
                continue
            url = self._url_of(gid)
            if idle > 2 * limit:
                log.error("sampler %d has been writing %s for %.0fs: killing it", handle.index, url, idle)
                handle.exit_reason = f"hung for {idle:.0f}s"
                self._require_pool().kill(handle)
            else:
                handle.hung = (
                    f"sampler {handle.index} has been writing {url} for {idle:.0f}s (status.stuck_after = {limit:g}s): "
                    "a decoder or preprocess that hangs? It is killed at twice that"
                )

    def _watch_held(self) -> None:
        """Objects a sampler has held longer than ``status.stuck_after`` while ingest waits for them make the daemon
        degraded, naming the sampler and the oldest object. Ingest waits for them when a sampler with credit finds
        nothing to draw (``_is_starved``): a pass ends only once all its objects are done (``plan.py``), so the
        others idle. What holds them without a sign from the sampler is a fetch that does not return (a stalled
        network mount under a ``file://`` remote, which ``remote.read_timeout`` does not bound) or one that is
        merely slow (a large object through a rate cap). Neither is a reason to kill: the slow one would start over,
        and the stalled mount stalls whichever sampler reads the object next; so unlike a hung writer or a silent
        sampler (``pool.py``, "Silence"), which are named first and not twice, it is only said. While the store
        makes writers wait (paced, back-pressure, a full filesystem), what they hold waits for room, not for them."""
        limit, now, store = self.config.status.stuck_after_s, time.monotonic(), self._require_store()
        is_waiting_for_room = store.is_paced or store.is_backpressured or store.is_out_of_space
        for handle in self._require_pool().live():
            was, handle.holding_up = handle.holding_up, ""
            if not self._is_starved or is_waiting_for_room or handle.hung or handle.silent or not handle.assigned_at:
                continue
            gid, since = min(handle.assigned_at.items(), key=lambda entry: entry[1])
            if now - since <= limit:
                continue
            handle.holding_up = (
                f"ingest waits for sampler {handle.index}: the other samplers have nothing to fetch until the "
                f"{len(handle.assigned)} objects it holds are done (a pass ends only then); it has held "
                f"{self._url_of(gid)} for {now - since:.0f}s (status.stuck_after = {limit:g}s): a fetch that does "
                "not return (a stalled network mount: bound it at the mount, NFS soft,timeo=) or a very slow one"
            )
            if not was:
                log.warning("%s", handle.holding_up)

    def _check_evictions(self) -> None:
        store = self._require_store()
        counters = store.counters
        seen = (counters.evicted_segments, counters.retired_segments)
        if seen == self._evicted_seen:
            return
        self._evicted_seen = seen
        if counters.evicted_published_at:
            self._turnover_s = max(0.0, time.time() - counters.evicted_published_at[-1])
        published = {segment.seq for segment in store.segments}
        self.inputs.evicted([seq for seq in self.inputs.cached_segments() if seq not in published])

    # -- messages (NOTE [ Supervisor-sampler protocol ] in protocol.py) -----------------------------------------

    def _dispatch(self, handle: SamplerHandle, message: Message) -> None:
        pool = self._require_pool()
        grants = self._require_grants()
        if isinstance(message, Reserve | Publish | Abort | Done | Failed | Quarantined | Refused):
            handle.writer_heard_at = time.time()  # its writer thread is alive (a wait for room re-asks every 0.1 s)
        if isinstance(message, Credit):
            handle.credits += message.n
        elif isinstance(message, Reserve):
            pool.send(handle, grants.reserve(handle.index, message))
            self._check_evictions()
        elif isinstance(message, Publish):
            self._publish(handle, message)
        elif isinstance(message, Abort):
            grants.abort(handle.index, message)
        elif isinstance(message, Done):
            handle.settle(message.oids)
            self.inputs.done(message.oids, None)
            for gid in message.oids:
                self._deaths_writing.pop(gid, None)
        elif isinstance(message, Failed):
            handle.settle([message.oid])
            self.inputs.failed(message.oid, message.kind)
            catalog = self.inputs.split(message.oid)[0].catalog
            if message.kind == "changed" and catalog is not None:
                catalog.refresh_now()
        elif isinstance(message, Refused):
            self._refused(handle, message)
        elif isinstance(message, Quarantined):
            self.quarantine.add(message.url, message.key, message.kind, message.reason)
        elif isinstance(message, Stats):
            handle.stats = message.remote
            handle.objects_total = message.objects_total
        elif isinstance(message, Drained):
            handle.is_drained = True
        elif isinstance(message, Exiting):  # its exit status will say less (pool.py keeps this)
            handle.exit_reason = message.reason
        else:
            log.warning("sampler %d sent an unexpected %s message", handle.index, type(message).__name__)

    def _refused(self, handle: SamplerHandle, message: Refused) -> None:
        """The cache's filesystem refused a sampler's segment for lack of space (NOTE [ Supervisor-sampler protocol
        ]): the objects it held are fetched again, re-queued rather than failed (nothing is wrong with them), and
        the store says the filesystem is full and holds grants a while (``CacheStore.refused_write``), as when a
        grant finds no room: the same degraded reason, and fetching resumes once there is room."""
        self.inputs.requeue(handle.settle(message.oids))
        self._require_store().refused_write(message.reason)

    def _publish(self, handle: SamplerHandle, message: Publish) -> None:
        pool = self._require_pool()
        done = handle.settle(message.done)
        reply, segment = self._require_grants().publish(handle.index, message)
        if segment is None:
            self.inputs.requeue(done)
            pool.send(handle, reply)
            return
        self.inputs.done(done, message.seq)
        for gid in done:  # written whole after all: an earlier death was not its doing
            self._deaths_writing.pop(gid, None)
        self.inputs.spanning(message.spanning, message.seq)
        self.inputs.published(segment.source, segment.samples, segment.nbytes)
        self.inputs.segment_published(handle.index)  # it may be pointed at another source now
        log.debug(
            "sampler %d published segment %d with %d objects done, %s spanning",
            handle.index,
            message.seq,
            len(done),
            message.spanning,
        )
        handle.backoff_s = self.config.sampler.restart_backoff_s  # it works: a later crash restarts fast
        pool.send(handle, reply)
        self._check_evictions()

    def _undo(self, handle: SamplerHandle) -> None:
        """A sampler is gone: re-queue what it had not finished (but an object it died writing for the second
        time: quarantined, see NOTE [ Supervisor-sampler protocol ]), delete what it had not published."""
        writing = self._require_store().layout.writing_file(handle.index)
        culprit = read_writing(str(writing))
        writing.unlink(missing_ok=True)  # the next sampler in this slot names its own
        handle.writer_heard_at, handle.hung, handle.holding_up = 0.0, "", ""
        unfinished = handle.settle(sorted(handle.assigned))
        expected = handle.is_drained or self._is_draining  # a stop's exit: not the object's doing
        if culprit in unfinished and not expected:
            deaths = self._deaths_writing[culprit] = self._deaths_writing.get(culprit, 0) + 1
            if deaths >= CRASHES_TO_QUARANTINE:
                unfinished.remove(culprit)
                self._quarantine_crash(culprit, deaths, handle.last_error or "it exited")
        if unfinished:
            log.info("re-queueing %d objects of sampler %d", len(unfinished), handle.index)
        self.inputs.requeue(unfinished)
        self.inputs.forget_sampler(handle.index)
        self._require_grants().abort_all(handle.index)
        handle.credits = 0

    def _url_of(self, gid: int) -> str:
        """Object ``gid``'s URL, as its samples' ``__url__`` names it."""
        entry, oid = self.inputs.split(gid)
        path = entry.plan.table.path(oid)
        return entry.catalog.remote.url_of(path) if entry.catalog is not None else path

    def _quarantine_crash(self, gid: int, deaths: int, how: str) -> None:
        """Object ``gid`` killed the sampler writing it ``deaths`` times: never handed out again until it changes."""
        url = self._url_of(gid)
        reason = (
            f"a sampler died writing it {deaths} times (the last: {how}): its decoder or preprocess crashes or hangs"
        )
        log.error("quarantined %s: %s", url, reason)
        self.inputs.failed(gid, "crash")
        self.quarantine.add(url, None, "crash", reason)
        self._deaths_writing.pop(gid, None)

    # -- draining -------------------------------------------------------------------------------------------

    def _begin_drain(self) -> None:
        pool = self._require_pool()
        log.info("stopping: draining %d samplers (at most %.0fs)", len(pool.live()), DRAIN_TIMEOUT_S)
        self._is_draining = True
        self.state = "stopping"
        self.notifier.stopping()
        self._publish_status()
        for catalog in self.inputs.catalogs():
            catalog.stop()
        for handle in pool.live():
            if (
                handle.state is SamplerState.STARTING
                and not handle.assigned
                and not self._require_grants().holds(handle.index)
            ):
                pool.terminate(handle)  # still starting up: nothing to drain, no reason to wait for its imports
            else:
                pool.send(handle, Drain())
        pool.stop_all()
        self._drain_deadline = time.monotonic() + DRAIN_TIMEOUT_S

    def _drain_step(self) -> bool:
        """One step of the drain; True when every sampler is gone."""
        pool = self._require_pool()
        for handle in pool.reap(lost=self._lost):
            self._undo(handle)
        self._lost.clear()
        if not pool.live():
            return True
        if self.force_exit or time.monotonic() > self._drain_deadline:
            for handle in pool.live():
                log.warning("sampler %d did not drain in time: killing it", handle.index)
                pool.kill(handle)
            for handle in pool.reap(lost={h.index for h in pool.live()}):
                self._undo(handle)
            return True
        return False

    # -- status ---------------------------------------------------------------------------------------------

    def _publish_status(self) -> None:
        if self._reporter is None:
            self._reporter = StatusReporter(
                self.config,
                store=self._require_store(),
                pool=self._require_pool(),
                inputs=self.inputs,
                metrics=self._metrics,
                started_at=self.started_at,
                quarantine=self.quarantine,
            )
        self.state = self._reporter.publish(self.state, turnover_s=self._turnover_s)

    def _waited_on(self) -> tuple[int, bool, bool]:
        """What trainers wait for in the status document (``_trainer/wait.py``, ``fill_reached``): passes completed,
        ingest paced, ingest back-pressured. The loop publishes the document as soon as one changes, not at the next
        ``status.interval``: a growing epoch ends when the daemon can fill no further, and its trainer learns it
        here (at a 1 s interval the handover after a growing first epoch took 0.2-0.3 s, at once ~1 ms)."""
        store = self._require_store()
        passes = self.inputs.passes_completed  # every source's (the least)
        return passes, store.is_paced, store.is_backpressured

    def _status_line(self) -> str:
        return self._reporter.line() if self._reporter is not None else self.state

    # -- plumbing -------------------------------------------------------------------------------------------

    def _make_init(self, index: int) -> Init:
        config = self.config
        cache = config.cache
        return Init(
            index=index,
            share=1.0 / config.sampler.processes,
            log_level=self.log_level,
            remote=dataclasses.asdict(config.remote),
            sampler=dataclasses.asdict(config.sampler),
            sources=[
                {
                    **dataclasses.asdict(e.config),
                    "tag": e.tag,
                    "weight": e.weight,
                    "decode": e.config.decode or config.sampler.decode,
                }
                for e in self.inputs.inputs
            ],
            segment={
                "writing_path": str(self._require_store().layout.writing_file(index)),
                "segment_bytes": cache.segment_bytes,
                "compression": cache.compression,
                "file_mode": cache.file_mode,
                "fsync": cache.fsync,
                "published_bytes": self._require_store().published_bytes,
                "writers": config.sampler.processes,
            },
        )

    def _require_store(self) -> CacheStore:
        if self._store is None:
            raise RuntimeError("the cache store is not open")
        return self._store

    def _require_grants(self) -> GrantServer:
        if self._grants is None:
            raise RuntimeError("the cache store is not open")
        return self._grants

    def _require_pool(self) -> SamplerPool:
        if self._pool is None:
            raise RuntimeError("the sampler pool is not set up")
        return self._pool


class StatusSchedule:
    """When the main loop publishes the status document: every ``interval_s``, and early when what trainers wait
    for changes (``Supervisor._waited_on``: a growing epoch ends when the daemon can fill no further, and learns it
    from the document), at most every ``_EARLY_STATUS_GAP_S``.

    A change the gap holds back is published when the gap ends: ``next_at`` is then the gap's end, so the loop
    does not nap past it. Through 5b4094c (fixed in b94feac) the loop napped on to its next timer (up to
    ``_MAX_WAIT_S``, 0.25 s): a pass that completed within 20 ms of another publish was told up to 0.25 s late,
    and a growing first epoch waiting for it ended that late after its last batch. The side-by-side runs' first
    epochs on tar shards show such waits of 0.24-0.25 s (``end_of_epoch_s`` in ``benchmarks/results/results.json``)
    in four of the six runs from cad9785 to 5b4094c, one or two per run.
    """

    def __init__(self, interval_s: float, now: float, signal: object) -> None:
        self._interval_s = interval_s
        self._next = now + interval_s
        self._published_at = now
        self._signal = signal  # what the last document told
        self._held = False  # a change the gap holds back

    def is_due(self, now: float, signal: object) -> bool:
        """Whether to publish now, given what trainers wait for at ``now``."""
        changed = signal != self._signal
        self._held = changed and now < self._published_at + _EARLY_STATUS_GAP_S
        if now >= self._next or (changed and not self._held):
            self._signal = signal
            return True
        return False

    def published(self, now: float) -> None:
        self._published_at, self._next, self._held = now, now + self._interval_s, False

    def next_at(self) -> float:
        """The latest moment the loop may wait until: the next interval, or the end of the gap holding a change."""
        return self._published_at + _EARLY_STATUS_GAP_S if self._held else self._next
