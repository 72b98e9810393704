"""A sampler subprocess: fetch objects (many requests in flight), decode them, write segments.

Started by the supervisor (``spawn.py``): forked from it (``serve_forked``), or as ``python -m
cachefeed._daemon.sampler --fd N --parent-pid P --index I``; either way with the protocol socket and the cache's
writer-lock descriptor inherited (so a new daemon cannot take the cache while
this process could still write into it). See NOTE [ Supervisor-sampler protocol ] in ``protocol.py``.

Threads: the asyncio loop (socket, fetches, credits, stats) and the segment writer thread (``sink.py``).

Exit paths, all without publishing anything partial:

* ``Drain`` from the supervisor: finish the object being written, publish the current segment, ``Drained``.
* EOF on the socket (the supervisor died) or SIGTERM (``PR_SET_PDEATHSIG``, or someone else): abort the
  current segment and exit at once. SIGINT is ignored: on Ctrl-C the supervisor orchestrates the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from cachefeed._codecs import get_decoder, get_preprocess, printable
from cachefeed._config import RemoteConfig
from cachefeed._daemon.grants import GrantReply, PublishReply, RpcGrantProvider
from cachefeed._daemon.notify import NOTIFY_VARIABLES
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
)
from cachefeed._daemon.sink import SegmentSink, SinkSettings
from cachefeed._daemon.wire import Channel, Message
from cachefeed._errors import ChannelClosed, RemoteError
from cachefeed._logs import RepeatedWarnings, get_logger, setup_logging
from cachefeed._remote import Remote, RemoteObject, RemoteStats
from cachefeed._sched import yield_to_training
from cachefeed._scrub import secrets_from_options

__all__ = ["Sampler", "main"]

log = get_logger("cachefeed._daemon.sampler")  # not __name__: this module runs as __main__

_PR_SET_PDEATHSIG = 1
_STATS_INTERVAL_S = 1.0
_EXIT_GRACE_S = 5.0
_REASON_CHARS = 500  # a reason sent to the supervisor (a quarantine, an exit: status shows it) is cut to this length
FIRST_FETCHES = 1  # fetches in flight at a sampler's start; one more per completed fetch (FetchWindow)
WINDOW_PATIENCE_S = 5.0  # with nothing completed for this long, the window opens by one all the same (FetchWindow)


class FetchWindow:
    """How many fetches may be in flight: ``first`` at the start, one more each time a fetch completes (a slow
    start, as TCP's: the window doubles per round trip), up to ``limit`` (``sampler.concurrency``); and one more
    each ``patience_s`` in which no fetch completed while one waits for a slot.

    Why the slow start: objects arrive whole before they are decoded, and the remote's bandwidth is shared by every
    request in flight; a sampler that asked for ``limit`` shards at once would get the first one complete only when
    about all of them are, so a cold trainer's first segment would wait for ``limit`` objects instead of one. The
    window reaches ``limit`` after a few completions, so steady ingest is unchanged.

    Why the patience: a window that opens only on completions stays shut behind a fetch that never completes (a
    stalled mount under ``file://``, a server that stops sending): with the first fetch stuck, the sampler would
    fetch none of the other objects it holds, for as long as the fetch hangs. The patience lets one more in each
    ``patience_s`` instead. It counts completions, not bytes: it costs a cold start nothing where the first object
    arrives within it, and where one takes longer (shards of a GiB or more on one stream) the first object shares
    the remote with one more fetch per ``patience_s`` (a fetch's progress, which would tell slow from stuck, is not
    seen: bodies arrive whole). Used as ``async with window:``.
    """

    def __init__(self, first: int, limit: int, *, patience_s: float = WINDOW_PATIENCE_S) -> None:
        if limit < 1 or first < 1:
            raise ValueError(f"first and limit must be at least 1, got {first!r} and {limit!r}")
        if patience_s <= 0:
            raise ValueError(f"patience_s must be positive, got {patience_s!r}")
        self.limit = limit
        self.size = min(first, limit)
        self.active = 0
        self.patience_s = patience_s
        self._changed = asyncio.Condition()
        self._opened_at = time.monotonic()  # the last completion, opening or start from idle: patience counts from it

    async def __aenter__(self) -> None:
        async with self._changed:
            while self.active >= self.size:
                left = self._opened_at + self.patience_s - time.monotonic()
                if left <= 0:  # nothing completed for the patience: let one more in (one per patience, not per waiter)
                    self._open()
                    continue
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    pass
            if self.active == 0:  # idle until now: the patience counts from this fetch, not from the last one
                self._opened_at = time.monotonic()
            self.active += 1

    async def __aexit__(self, *exc: object) -> None:
        async with self._changed:
            self.active -= 1
            self._open()

    def _open(self) -> None:
        """One more fetch may be in flight (up to ``limit``); the caller holds the condition."""
        self.size = min(self.limit, self.size + 1)
        self._opened_at = time.monotonic()
        self._changed.notify_all()


def die_with_parent(parent_pid: int) -> bool:
    """Ask the kernel for SIGTERM when the parent dies; False if it is already gone (we were orphaned)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: EOF on the socket still ends us
        pass
    return os.getppid() == parent_pid


class Sampler:
    """The loop side of one sampler process."""

    def __init__(self, channel: Channel, init: Init) -> None:
        self._channel = channel
        self._init = init
        concurrency = int(init.sampler["concurrency"])
        self._slots = concurrency + max(2, concurrency // 4)
        self._credit_batch = max(1, min(16, self._slots // 4))
        self._free = 0
        sources = init.sources or [_unnamed_source(init)]
        # One client per source, each with its weight's part of this process's share of the node's rate caps. A
        # retry burst of at least one wave of requests: when the remote hiccups, every fetch in flight fails at
        # once and each deserves its retry; the budget still caps a remote that keeps failing.
        self._remotes = [
            Remote(
                RemoteConfig(
                    **{
                        **init.remote,
                        "url": source["url"],
                        "pattern": source["pattern"],
                        "storage_options": source["storage_options"],
                    }
                ),
                share=init.share * float(source["weight"]),
                max_connections=concurrency,
                retry_budget_burst=max(10.0, float(concurrency)),
            )
            for source in sources
        ]
        self._fetch_slots = FetchWindow(FIRST_FETCHES, concurrency)
        self._provider = RpcGrantProvider(channel)
        self._sink = SegmentSink(
            self._provider,
            SinkSettings(**init.segment),
            decoders=[
                get_decoder(
                    str(source["decode"]),
                    decode_images=bool(init.sampler["decode_images"]),
                    image_size=init.sampler["image_size"],
                    image_fields=init.sampler.get("image_fields") or (),
                )
                for source in sources
            ],
            names=[_names_of(remote) for remote in self._remotes],
            tags=[int(source["tag"]) for source in sources],
            preprocess=get_preprocess(str(init.sampler["preprocess"])),
            on_handled=self._handled_threadsafe,
            on_failed=self._failed_threadsafe,
            on_skipped=self._skipped_threadsafe,
            on_refused=self._refused_threadsafe,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._objects_total = 0
        self._samples_total = 0
        self._is_draining = False
        self._repeated = RepeatedWarnings(log)  # a decoder that fails on every object: a few lines, then counts
        self._loop: asyncio.AbstractEventLoop | None = None
        self._finished: asyncio.Future[int] | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._finished = loop.create_future()
        loop.add_signal_handler(signal.SIGTERM, self._abandon, "SIGTERM")
        loop.add_reader(self._channel.fileno(), self._on_readable)
        self._sink.start()
        await self._warm_up()
        self._give_credit(self._slots)
        stats = loop.create_task(self._send_stats())
        try:
            return await self._finished
        finally:
            stats.cancel()
            loop.remove_reader(self._channel.fileno())
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for remote in self._remotes:
                await remote.aclose()
            self._repeated.flush()  # what the writer reported while it stopped, after ``_finish``'s flush

    async def _warm_up(self) -> None:
        """Build the HTTP client before asking for work: loading botocore's models takes a second or more, and
        this overlaps it with the supervisor's first listing instead of delaying the first fetches."""
        for remote in self._remotes:
            started = time.process_time()
            try:
                await remote.connect()
            except Exception as exc:  # the first fetch will meet (and report) the same problem
                log.debug("warming up the remote client failed: %s", type(exc).__name__)
            else:
                log.debug(
                    "remote client for %s built in %.3fs of CPU (%s)",
                    remote.where,
                    time.process_time() - started,
                    "the supervisor's warmed session" if remote.has_warm_session else "a session of its own",
                )

    # -- messages -------------------------------------------------------------------------------------------

    def _send(self, message: Message) -> None:
        try:
            self._channel.send(message)
        except ChannelClosed:
            self._abandon("the supervisor is gone")

    def _on_readable(self) -> None:
        try:
            messages = self._channel.recv_ready()
        except ChannelClosed:
            self._abandon("the supervisor is gone")
            return
        for message in messages:
            if isinstance(message, Work):
                for item in message.items:
                    task = asyncio.get_running_loop().create_task(self._fetch(item))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            elif isinstance(message, GrantReply | PublishReply):
                self._provider.on_reply(message)
            elif isinstance(message, Drain):
                self._drain()
            else:
                log.warning("unexpected message %r", message)

    def _give_credit(self, n: int) -> None:
        self._free += n
        if self._free >= self._credit_batch and not self._is_draining:
            self._send(Credit(self._free))
            self._free = 0

    async def _send_stats(self) -> None:
        """Counters once a second (the heartbeat); also notices a writer thread that died (then exit 1: the
        supervisor re-queues our objects and restarts us, rather than waiting on a sampler that cannot write)."""
        while True:
            if not self._sink.is_alive() and not self._is_draining:
                log.error("the segment writer died (%r): exiting", self._sink.error)
                self._send(Exiting(_failure(self._sink.error, "the segment writer")))
                self._abandon("segment writer failed", code=1)
                return
            self._repeated.flush(only_due=True)
            stats = _summed([remote.stats for remote in self._remotes])
            self._send(Stats(stats, self._objects_total, self._samples_total, self._sink.qsize()))
            await asyncio.sleep(_STATS_INTERVAL_S)

    # -- work -----------------------------------------------------------------------------------------------

    async def _fetch(self, item: WorkItem) -> None:
        async with self._fetch_slots:
            if self._is_draining:
                return
            try:
                body = await self._remotes[item.source].fetch(RemoteObject(item.path, item.size, item.etag))
            except RemoteError as exc:
                log.info("object failed (%s): %s", exc.kind, exc)
                self._send(Failed(item.oid, exc.kind, str(exc)))
                self._give_credit(1)
                return
            except Exception as exc:
                log.exception("fetching %s failed unexpectedly", item.path)
                self._send(Failed(item.oid, "error", f"{item.path}: {type(exc).__name__}"))
                self._give_credit(1)
                return
        self._sink.put(item, body)

    def _handled_threadsafe(self, item: WorkItem, samples: int) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._handled, item, samples)

    def _handled(self, item: WorkItem, samples: int) -> None:
        self._objects_total += 1
        self._samples_total += samples
        if samples == 0:
            self._send(Done([item.oid]))
        self._give_credit(1)
        self._flush_if_idle()

    def _flush_if_idle(self) -> None:
        """Nothing fetching and nothing queued: publish the open segment now rather than after ``idle_flush_s``
        (the tail of a pass, a trickle of new objects). Fetching already resumed? Then the segment keeps filling."""
        if not self._tasks and self._sink.qsize() == 0:
            self._sink.request_flush()

    def _failed_threadsafe(self, item: WorkItem, kind: str, message: str) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._failed, item, kind, message)

    def _failed(self, item: WorkItem, kind: str, message: str) -> None:
        url, message = self._remotes[item.source].url_of(item.path), printable(message)
        if kind in ("decode", "too_large"):  # what status lists; "error" objects are tried again
            self._repeated.warn(kind, "object quarantined (%s) %s: %s", kind, url, message)
            self._send(Quarantined(url, None, kind, message[:_REASON_CHARS]))
        else:
            log.warning("object failed (%s), to be fetched again: %s: %s", kind, url, message)
        self._send(Failed(item.oid, kind, message))
        self._give_credit(1)
        self._flush_if_idle()

    def _skipped_threadsafe(self, item: WorkItem, skipped: list[tuple[str, str]]) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._skipped, item, skipped)

    def _skipped(self, item: WorkItem, skipped: list[tuple[str, str]]) -> None:
        url = self._remotes[item.source].url_of(item.path)
        for name, why in skipped:
            key, reason = printable(name), printable(why)
            self._repeated.warn("sample", "sample left out of %s: %s: %s", url, key, reason)
            self._send(Quarantined(url, key, "sample", reason[:_REASON_CHARS]))

    def _refused_threadsafe(self, oids: list[int], reason: str, item: WorkItem | None) -> None:
        """The cache's filesystem refused the segment being written (``sink.py``, "A full filesystem"): no
        traceback, no exit. ``Refused`` goes from the writer thread, as its ``Abort`` did, before its next
        ``Reserve``: the store holds grants before that one is answered. The supervisor re-queues ``oids``; the
        loop says so and frees the slot of the object in hand."""
        try:
            self._channel.send(Refused(oids, reason[:_REASON_CHARS]))
        except ChannelClosed:
            return  # the supervisor is gone: the loop ends us
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._refused, len(oids), reason, item)

    def _refused(self, lost: int, reason: str, item: WorkItem | None) -> None:
        self._repeated.warn(
            "no_space",
            "the cache's filesystem refused a segment (%s): dropped; its %d objects are fetched again once there "
            "is room",
            reason,
            lost,
        )
        if item is not None:
            self._give_credit(1)

    # -- endings --------------------------------------------------------------------------------------------

    def _drain(self) -> None:
        if self._is_draining:
            return
        log.info("draining")
        self._is_draining = True
        for task in list(self._tasks):
            task.cancel()
        self._sink.drain()
        asyncio.get_running_loop().create_task(self._finish_drain())

    async def _finish_drain(self) -> None:
        # The writer may still publish its segment: the loop keeps routing the reply while we wait.
        await asyncio.to_thread(self._sink.join, None)
        self._send(Drained())
        self._finish(0)

    def _abandon(self, reason: str, *, code: int = 0) -> None:
        """Exit now, publishing nothing more (the supervisor is gone, we were told to terminate, or we failed)."""
        if self._finished is None or self._finished.done():
            return
        log.info("exiting: %s", reason)
        # A later SIGTERM (the group's, then the supervisor's) has nothing to add, and asyncio's handler writes to the
        # loop's wakeup pipe while the loop shuts down: "Exception ignored when trying to write to the signal wakeup
        # fd" once reached a crash-loop test's stderr (the cause not established). Ignored from here on.
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._is_draining = True
        self._provider.close(ChannelClosed(reason))
        self._sink.kill()
        if not self._sink.join(_EXIT_GRACE_S):
            log.warning("segment writer did not stop in %.0fs", _EXIT_GRACE_S)
        self._finish(code)

    def _finish(self, code: int) -> None:
        self._repeated.flush()
        if self._finished is not None and not self._finished.done():
            self._finished.set_result(code)


def _names_of(remote: Remote) -> Callable[[str], tuple[str, str]]:
    """``path -> (key, url)`` of one source: the key its decoder is called with and the samples' ``__url__``."""
    return lambda path: (remote.key_of(path), remote.url_of(path))


def _unnamed_source(init: Init) -> dict[str, Any]:
    """The single ``[remote]`` form as a source (an ``Init`` without sources)."""
    remote = init.remote
    return {
        "url": remote["url"],
        "pattern": remote["pattern"],
        "storage_options": remote["storage_options"],
        "decode": init.sampler["decode"],
        "tag": 0,
        "weight": 1.0,
    }


def _summed(stats: list[RemoteStats]) -> dict[str, Any]:
    """The counters of every source's client, added up (the status document's ``remote`` totals)."""
    total: dict[str, Any] = {}
    for entry in stats:
        for key, value in entry.as_dict().items():
            if isinstance(value, dict):
                errors = total.setdefault(key, {})
                for kind, n in value.items():
                    errors[kind] = errors.get(kind, 0) + n
            else:
                total[key] = total.get(key, 0) + value
    return total


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cachefeed-sampler", description="cachefeed sampler subprocess")
    parser.add_argument("--fd", type=int, required=True, help="the protocol socket's descriptor")
    parser.add_argument("--parent-pid", type=int, required=True, help="the supervisor's pid")
    parser.add_argument("--index", type=int, required=True, help="this sampler's index")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return serve(args.fd, args.parent_pid, args.index)


def _failure(error: BaseException | None, what: str) -> str:
    """One line for ``Exiting``: what failed and the exception, at most ``_REASON_CHARS`` characters."""
    detail = "no exception recorded" if error is None else f"{type(error).__name__}: {error}"
    return f"{what} failed: {detail}"[:_REASON_CHARS]


def serve_forked(fd: int, lock_fd: int, parent_pid: int, index: int) -> int:
    """A sampler forked from the supervisor (``spawn.py``): leave the supervisor's state behind, then ``serve``."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)
    gc.collect()  # the supervisor's garbage goes now, while its descriptors are still the ones it knew
    gc.freeze()  # and its live objects never: their descriptors are closed below, the numbers may be reused
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    keep = sorted({0, 1, 2, fd, lock_fd})
    for low, high in zip(keep, [*keep[1:], None], strict=True):
        os.closerange(low + 1, high if high is not None else os.sysconf("SC_OPEN_MAX"))
    for name in NOTIFY_VARIABLES:
        os.environ.pop(name, None)
    return serve(fd, parent_pid, index)


def serve(fd: int, parent_pid: int, index: int) -> int:
    """The sampler's life on protocol socket ``fd``, however it was started: ``Init``, then fetch and write."""
    yield_to_training()  # a finished download never preempts a training thread on this node (_sched.py)
    if not die_with_parent(parent_pid):
        return 0
    channel = Channel(socket.socket(fileno=fd))
    init = channel.recv(timeout_s=30.0)
    if not isinstance(init, Init):
        print(f"sampler {index}: expected an init message, got {init!r}", file=sys.stderr)
        return 2
    options = [init.remote.get("storage_options") or {}, *(source["storage_options"] for source in init.sources)]
    setup_logging(init.log_level, secrets=secrets_from_options({str(i): o for i, o in enumerate(options)}))
    started = time.monotonic()
    code = asyncio.run(Sampler(channel, init).run())
    log.info("sampler %d exits after %.1fs", index, time.monotonic() - started)
    return code


if __name__ == "__main__":
    sys.exit(main())
