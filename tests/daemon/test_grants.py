"""Room for segments over the grant protocol (NOTE [ Grant protocol ] in ``cachefeed/_daemon/grants.py``): a
sampler's writer publishes a segment and reserves the next one's room in one round trip, never holds more than one
grant, and gives kept room back.

Both ends are the real ones: ``RpcGrantProvider`` under a ``CacheWriter`` on one end of a protocol socket pair, and
``GrantServer`` on a real ``CacheStore`` on the other, served by a thread as the supervisor's loop serves it; the
last test runs a real daemon.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter, SegmentRamp, WriterStopped
from cachefeed._daemon.grants import Abort, GrantReply, GrantServer, Publish, PublishReply, Reserve, RpcGrantProvider
from cachefeed._daemon.wire import Channel, ChannelClosed, Message, socket_pair
from cachefeed._testing.daemon import BUCKET, StartDaemon
from cachefeed._testing.samples import make_sample, upload_arrays
from tests.support.cache_helpers import cache_config

SEGMENT = 64 << 10
SAMPLE = 4096


@dataclass
class Wire:
    """What the supervisor's end saw: every request, and the store's reserved bytes after serving each."""

    provider: RpcGrantProvider
    store: CacheStore
    requests: list[Message] = field(default_factory=list)
    reserved_after: list[int] = field(default_factory=list)

    def count(self, kind: type[Message]) -> int:
        return sum(isinstance(request, kind) for request in self.requests)


@contextmanager
def grant_wire(root: Path, **overrides: object) -> Iterator[Wire]:
    """A real store behind a ``GrantServer`` (one sampler, index 0) and a provider talking to it over a socket."""
    store = CacheStore(cache_config(root, segment_bytes=SEGMENT, **overrides))
    server = GrantServer(store)
    sampler_end, supervisor_end = (Channel(sock) for sock in socket_pair())
    wire = Wire(RpcGrantProvider(sampler_end), store)
    stop = threading.Event()

    def supervisor() -> None:  # the supervisor's loop: one reply per Reserve and Publish, in order
        while not stop.is_set():
            try:
                request = supervisor_end.recv(timeout_s=0.05)
            except ChannelClosed:
                return
            if request is None:
                continue
            wire.requests.append(request)
            if isinstance(request, Reserve):
                supervisor_end.send(server.reserve(0, request))
            elif isinstance(request, Publish):
                supervisor_end.send(server.publish(0, request)[0])
            elif isinstance(request, Abort):
                server.abort(0, request)
            wire.reserved_after.append(store.reserved_bytes)

    def sampler_loop() -> None:  # the sampler's loop thread: routes replies to the waiting writer
        while not stop.is_set():
            try:
                reply = sampler_end.recv(timeout_s=0.05)
            except ChannelClosed:
                return
            if isinstance(reply, GrantReply | PublishReply):
                wire.provider.on_reply(reply)

    threads = [threading.Thread(target=supervisor, daemon=True), threading.Thread(target=sampler_loop, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        yield wire
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
        sampler_end.close()
        supervisor_end.close()
        store.close()


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.01)


def _write(writer: CacheWriter, first: int, count: int) -> None:
    for key in range(first, first + count):
        writer.add(make_sample(f"k{key}", SAMPLE))


def test_a_writer_publishes_each_segment_and_reserves_the_next_in_one_round_trip(tmp_path: Path) -> None:
    with grant_wire(tmp_path / "c") as wire:
        writer = CacheWriter(wire.provider, segment_bytes=SEGMENT, fsync=False, ramp=SegmentRamp(SEGMENT))
        _write(writer, 0, 200)
        writer.close()
        segments = len(writer.published)
        assert segments >= 10, "the samples span many segments"
        assert wire.count(Reserve) == 1, "only the first segment's room is asked for on its own"
        assert wire.count(Publish) == segments
        publishes = [request for request in wire.requests if isinstance(request, Publish)]
        assert all(request.reserve > 0 for request in publishes[:-1]), "each cut reserves the next segment"
        assert publishes[-1].reserve == 0, "closing reserves nothing"
        assert wire.count(Abort) == 0, "every room reserved was written"
        assert max(wire.reserved_after) <= SEGMENT + 4096, "never more than one grant held"
        assert wire.store.samples == 200
        assert wire.store.reserved_bytes == 0
        assert list((tmp_path / "c" / "tmp").iterdir()) == []


def test_room_kept_for_a_next_segment_is_given_back_when_nothing_comes(tmp_path: Path) -> None:
    with grant_wire(tmp_path / "c") as wire:
        writer = CacheWriter(wire.provider, segment_bytes=SEGMENT, fsync=False)
        _write(writer, 0, 3)
        writer.flush(keep_room=True)
        assert writer.holds_room
        assert wire.store.reserved_bytes > 0, "the publish reserved the next segment's room"
        writer.release_room()
        assert not writer.holds_room
        writer.close()
        _until(lambda: wire.count(Abort) == 1, "the room is given back (Abort, which has no reply)")
        assert wire.store.reserved_bytes == 0
        assert wire.store.samples == 3
        assert list((tmp_path / "c" / "tmp").iterdir()) == []


def test_a_record_larger_than_the_kept_room_gets_a_grant_of_its_own_size(tmp_path: Path) -> None:
    with grant_wire(tmp_path / "c") as wire:
        writer = CacheWriter(wire.provider, segment_bytes=SEGMENT, fsync=False)
        _write(writer, 0, 3)
        writer.flush(keep_room=True)
        writer.add(make_sample("big", 3 * SEGMENT))  # the kept room is given back, a larger grant reserved
        writer.close()
        assert wire.count(Reserve) == 2
        _until(lambda: wire.count(Abort) == 1, "the kept room, too small, was given back")
        assert max(wire.reserved_after) <= 3 * SEGMENT + 8192, "the kept room was given back before the larger grant"
        assert wire.store.samples == 4
        assert wire.store.reserved_bytes == 0


def test_a_full_cache_answers_the_reservation_with_a_publish_only_and_the_writer_waits_as_before(
    tmp_path: Path,
) -> None:
    budget = 24 * SEGMENT
    with grant_wire(tmp_path / "c", max_bytes=budget, evict_after_reads=1, turnover_bytes=budget // 4) as wire:
        stop = threading.Event()

        def on_wait(waited_s: float) -> None:
            stop.set()  # it waits for room: enough seen

        writer = CacheWriter(wire.provider, segment_bytes=SEGMENT, fsync=False, poll_s=0.01, stop=stop, on_wait=on_wait)
        with pytest.raises(WriterStopped):  # nothing was read, so nothing can be evicted: it waits
            _write(writer, 0, 10_000)
        publishes = [request for request in wire.requests if isinstance(request, Publish)]
        assert publishes and all(request.reserve > 0 for request in publishes)
        reserves = wire.count(Reserve)
        assert reserves >= 2, "the reservation the store could not give is asked for again with Reserve"
        assert max(wire.reserved_after) <= SEGMENT + 4096
        writer.abort()
        _until(lambda: wire.store.reserved_bytes == 0, "an aborted writer holds no room")


def test_a_daemon_with_nothing_left_to_write_holds_no_room(bucket: Any, daemon: StartDaemon) -> None:
    upload_arrays(bucket, BUCKET, 60, 16 << 10)  # about 4 objects a segment: every sampler cuts many
    proc = daemon(sections={"cache": {"segment_bytes": SEGMENT}})
    proc.wait_status(lambda d: d["cache"]["samples"] >= 60, timeout_s=60, what="every sample cached")
    proc.wait_status(
        lambda d: d["cache"]["reserved_bytes"] == 0, timeout_s=30, what="the room kept for next segments given back"
    )
    assert list((proc.cache_dir / "tmp").iterdir()) == []
    assert proc.stop() == 0
