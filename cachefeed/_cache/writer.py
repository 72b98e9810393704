"""Turn a stream of samples into published segments, under grants from whoever keeps the budget.

``CacheWriter`` is used the same way in-process (a test, the demo, a benchmark: the provider is a ``CacheStore``)
and inside a sampler subprocess (the provider is a client that asks the supervisor over its socket; see
``cachefeed/_daemon/grants.py``).

Segment sizes: a writer given a ``SegmentRamp`` starts small and grows to ``segment_bytes`` (see the class); one
without writes every segment at ``segment_bytes``. A smaller segment never breaks the budget's bound
(``max_bytes + samplers x segment_bytes``, ``_config/parse.py``): every grant is at most ``segment_bytes``, or the
size of the one record that needs more.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cachefeed._cache.grant import Grant, GrantProvider
from cachefeed._cache.records import EncodedRecord, RecordEncoder, SegmentWriter
from cachefeed._errors import WriterStopped

__all__ = ["FIRST_SEGMENT_BYTES", "CacheWriter", "GrantProvider", "SegmentRamp", "WriterStopped"]

FIRST_SEGMENT_BYTES = 256 << 10
"""The smallest segment a ramp starts with (or ``segment_bytes // 256`` for segments over 64 MiB)."""


@dataclass(slots=True)
class SegmentRamp:
    """The size of the next segment while the cache fills: small first, doubling up to ``segment_bytes``.

    A cold cache publishes its first segments at ``first`` bytes (``FIRST_SEGMENT_BYTES``, at most
    ``segment_bytes``), so that a trainer that starts on what has arrived finds a segment per worker after a few
    objects rather than after ``samplers x segment_bytes``; after that each segment is as large as what the cache
    has published already (so sizes double), up to ``segment_bytes``. Only published bytes decide: a daemon that
    restarts on a cache holding at least ``segment_bytes`` writes full-size segments from the start.

    ``published_bytes`` is this writer's estimate of the cache's published bytes: what the cache held when the
    writer started, plus what it published itself times ``writers`` (the daemon's samplers publish about equal
    shares). It only ever grows, so the ramp happens once per writer.
    """

    segment_bytes: int
    published_bytes: int = 0
    writers: int = 1

    @property
    def first(self) -> int:
        return min(self.segment_bytes, max(FIRST_SEGMENT_BYTES, self.segment_bytes // 256))

    def target(self) -> int:
        """The size to ask for the next segment."""
        return min(self.segment_bytes, max(self.first, self.published_bytes))

    def published(self, nbytes: int) -> None:
        """This writer published a segment of ``nbytes``."""
        self.published_bytes += nbytes * self.writers


class CacheWriter:
    """Appends samples to the current segment and publishes it when full (or on ``flush``).

    Contract: a sample passed to ``add`` is either in a published segment after the next ``flush``/``close``, or
    lost with the whole unpublished segment if the process dies or ``abort`` is called; never partially visible.
    While the provider says the cache is full, ``add`` waits (back-pressure), polling every ``poll_s``, until room
    appears or ``stop`` is set (then it raises ``WriterStopped``). ``on_wait(seconds_waited)`` is called while
    waiting, for progress reporting. Segments are cut at ``segment_bytes``, or at ``ramp.target()`` while a
    ``ramp`` is given (a record larger than that gets a segment of its own size). ``before_publish`` (if set) is
    called just before a segment that holds samples is finished, while ``add_source`` still names sources in it:
    a segment cut inside an object's samples can name that object too.
    """

    def __init__(
        self,
        provider: GrantProvider,
        *,
        segment_bytes: int,
        compression: str = "none",
        file_mode: int = 0o640,
        fsync: bool = True,
        poll_s: float = 0.05,
        stop: threading.Event | None = None,
        on_wait: Callable[[float], None] | None = None,
        ramp: SegmentRamp | None = None,
    ) -> None:
        self._provider = provider
        self._segment_bytes = segment_bytes
        self._compression = compression
        self._file_mode = file_mode
        self._fsync = fsync
        self._poll_s = poll_s
        self._stop = stop or threading.Event()
        self._on_wait = on_wait
        self._ramp = ramp
        self._last_growth = 0  # what the last record added to its segment's size
        self._writer: SegmentWriter | None = None
        self._grant: Grant | None = None
        self._encoder = RecordEncoder(compression=compression)
        self.published = 0  # segments published (a count: a list of them grew for the writer's whole life)
        self.before_publish: Callable[[], None] | None = None
        self.source_room = 0  # kept free in each segment for the source its caller names next (records.source_bytes)
        self.source = 0  # the source tag of segments opened from now on (records.py); set it between segments

    @property
    def pending_samples(self) -> int:
        """Samples in the current, unpublished segment."""
        return self._writer.count if self._writer else 0

    def add(self, sample: Mapping[str, Any]) -> None:
        """Append one sample (a dict with a string ``__key__``); may block while the cache is full."""
        self.add_record(self.encode(sample))

    def encode(self, sample: Mapping[str, Any]) -> EncodedRecord:
        """``sample`` as the record ``add_record`` appends: what a sample that cannot be stored raises on, before
        anything of it is written. Views of the sample's payloads only: compression waits for ``add_record``."""
        return self._encoder.uncompressed(sample)

    def add_record(self, record: EncodedRecord) -> None:
        """Append one record of ``encode`` (compressed now, where the writer compresses); may block while the cache
        is full."""
        record = self._encoder.compressed(record)
        writer = self._writer
        before = writer.nbytes if writer is not None else 0
        if writer is not None:
            writer.source_room = self.source_room
        if writer is None or not writer.append(record):
            self.flush()
            target = self._segment_bytes if self._ramp is None else self._ramp.target()
            writer = self._open(max(target, SegmentWriter.size_for(record.nbytes)))
            before = writer.nbytes
            writer.append(record)  # the first record of a fresh segment is always accepted
        self._last_growth = writer.nbytes - before

    @property
    def is_full(self) -> bool:
        """Whether the open segment has no room for another record as large as the last one added: its caller
        can publish it now, at a sample boundary of its choosing, rather than when the next sample arrives."""
        writer = self._writer
        return writer is not None and writer.count > 0 and writer.capacity - writer.nbytes < self._last_growth

    def add_source(self, path: str, version: str | None, cut: int | None = None) -> bool:
        """Name the remote object whose last sample was just added (see "Sources" in ``records.py``).

        Returns False if it was left out: no open segment (the object had no samples) or no room left in it.
        """
        return self._writer is not None and self._writer.add_source(path, version, cut)

    def _open(self, nbytes: int) -> SegmentWriter:
        waited_from = time.monotonic()
        while True:
            grant = self._provider.reserve(nbytes)
            if grant is not None:
                break
            if self._stop.wait(self._poll_s):
                raise WriterStopped("stopped while waiting for room in the cache")
            if self._on_wait is not None:
                self._on_wait(time.monotonic() - waited_from)
        try:
            writer = SegmentWriter(
                grant.path,
                capacity=grant.nbytes,
                compression=self._compression,
                file_mode=self._file_mode,
                source=self.source,
            )
        except BaseException:
            self._provider.abort(grant)
            raise
        writer.source_room = self.source_room
        self._writer, self._grant = writer, grant
        return writer

    def flush(self) -> object | None:
        """Finish and publish the current segment, if it holds any sample. Returns what the provider returned."""
        writer, grant = self._writer, self._grant
        self._writer = self._grant = None
        if writer is None or grant is None:
            return None
        if writer.count == 0:
            writer.abort()
            self._provider.abort(grant)
            return None
        try:
            if self.before_publish is not None:
                self._writer = writer  # add_source names sources in it
                try:
                    self.before_publish()
                finally:
                    self._writer = None
            writer.finish(fsync=self._fsync)
        except BaseException:
            writer.abort()
            self._provider.abort(grant)
            raise
        result = self._provider.publish(grant)
        self.published += 1
        if self._ramp is not None:
            self._ramp.published(writer.nbytes)
        return result

    def abort(self) -> None:
        """Drop the current unpublished segment."""
        writer, grant = self._writer, self._grant
        self._writer = self._grant = None
        if writer is not None:
            writer.abort()
        if grant is not None:
            self._provider.abort(grant)

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
