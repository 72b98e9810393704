"""Inside a sampler: the writer thread (decode, preprocess, append to segments).

The event loop fetches; this thread does the CPU work (decode, preprocess, encode, write) so that fetching never
waits on it, and it is the only thread that touches the segment being written. It talks to the supervisor's
``CacheStore`` through ``RpcGrantProvider`` (see NOTE [ Grant protocol ] in ``grants.py``).

Keys: the decoder is called with the object's key relative to its source's URL, and every sample gets the
object's URL as ``__url__`` (``_codecs.py``: the ``__key__``/``__url__`` contract). A sample that a decoder left out
(a tar member that failed to decode, ``Decoded.skipped``) is reported through ``on_skipped``; its object's other
samples are written.

Sources: a segment holds samples of one source only (its tag in the trailer, ``_cache/records.py``): an object of
another source than the open segment's first publishes that segment.

Sizes: the first segments of a filling cache are small and grow to ``segment_bytes`` (``SegmentRamp`` in
``_cache/writer.py``; the cache's published bytes at the sampler's start come in ``Init``), so that the first
segments reach trainers after a few objects.

Objects across segments: an object's samples may not fit the open segment; the writer then publishes it and
goes on in the next. Each segment holds at least one of the samples of every object it names: the object being
written when a segment is cut is named in it (``before_publish``; the writer keeps room for that name,
``records.source_bytes``) with how many of its first samples are published (``cut``), and reported to the
supervisor as ``spanning`` (NOTE [ Grant protocol ]), so the plan never draws an object again while any of its
samples is cached. An object drawn again after a crash cut it short comes with ``WorkItem.skip``: its first
``skip`` samples are cached, and only the rest are written.

A full filesystem: a write into a granted segment that the filesystem refuses for lack of space
(``REFUSED_ERRNOS``: it filled after the grant, with another user's files) is no failure of the writer. The segment
is dropped (``CacheWriter.abort``: its file deleted, its grant given back) and the thread goes on; the objects whose
samples were in it, and the one in hand, go to ``on_refused`` (the sampler sends ``Refused``, NOTE [
Supervisor-sampler protocol ]): they are fetched again once the store has room. Any other write error ends the
thread (``error``), and the sampler with it.

Flushing: a segment is published when full (once another sample as large as the last would not fit: at the end
of the object that filled it, not when the next object arrives), when the sampler has nothing in flight
(``request_flush``: the tail of a pass, a trickle of new objects), when no body arrived for ``idle_flush_s`` (a slow
remote still reaches the cache quickly), when it is ``max_age_s`` old, or when it holds the last sample of
``max_objects`` objects (which bounds the size of the ``Publish`` message).
"""

from __future__ import annotations

import errno
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cachefeed._cache.records import EncodedRecord, source_bytes
from cachefeed._cache.writer import CacheWriter, SegmentRamp, WriterStopped
from cachefeed._codecs import Decoded, Sample, printable
from cachefeed._daemon.grants import RpcGrantProvider
from cachefeed._daemon.protocol import WorkItem, mark_writing, open_writing
from cachefeed._errors import ChannelClosed, CorruptRecordError, DecodeError, GrantTooLarge
from cachefeed._logs import get_logger

__all__ = ["SegmentSink", "SinkSettings"]

log = get_logger(__name__)

_FLUSH = "flush"
REFUSED_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})  # a full filesystem, a quota: no room, nothing broken


def _writable(sample: Sample) -> Sample:
    """The sample with writable arrays: decoders may return read-only views of the body (``.npy`` does, to save a
    copy), and a user's preprocess may change its arrays in place."""
    return {
        name: value.copy() if isinstance(value, np.ndarray) and not value.flags.writeable else value
        for name, value in sample.items()
    }


@dataclass(frozen=True, slots=True)
class SinkSettings:
    segment_bytes: int
    compression: str
    file_mode: int
    fsync: bool
    idle_flush_s: float = 0.5
    max_age_s: float = 10.0
    max_objects: int = 8192
    published_bytes: int | None = None  # the cache's at the sampler's start: segments ramp up (None: they do not)
    writers: int = 1  # the daemon's samplers (SegmentRamp.writers)
    writing_path: str = ""  # where the object being written is kept for the supervisor ("" : nowhere; protocol.py)


class SegmentSink:
    """The writer thread of a sampler. ``put`` from the loop; callbacks run on this thread.

    Callbacks: ``on_handled(item, samples)`` when an object's samples are all in the writer (its slot is free;
    ``samples == 0`` means done without a segment), ``on_failed(item, kind, message)`` when it cannot be cached,
    ``on_skipped(item, [(key, reason)])`` before ``on_handled`` when the decoder left some of its samples out,
    ``on_refused(oids, reason, item)`` when the filesystem refused the open segment (module docstring): ``oids``
    lost their samples with it; ``item``, the object in hand (not handled, its slot still taken), or None.
    ``names[source](path)`` gives an object's ``(key, url)``: the key its decoder is called with, and ``__url__``.
    """

    def __init__(
        self,
        provider: RpcGrantProvider,
        settings: SinkSettings,
        *,
        decoders: Sequence[Callable[[str, bytes], Decoded]],
        names: Sequence[Callable[[str], tuple[str, str]]],
        tags: Sequence[int],
        preprocess: Callable[[Sample], Sample] | None,
        on_handled: Callable[[WorkItem, int], None],
        on_failed: Callable[[WorkItem, str, str], None],
        on_refused: Callable[[list[int], str, WorkItem | None], None],
        on_skipped: Callable[[WorkItem, list[tuple[str, str]]], None] | None = None,
    ) -> None:
        self._provider = provider
        self._settings = settings
        self._decoders = list(decoders)  # by source index (WorkItem.source)
        self._names = list(names)  # by source index too
        self._tags = list(tags)
        self._on_skipped = on_skipped
        self._preprocess = preprocess
        self._on_handled = on_handled
        self._on_failed = on_failed
        self._on_refused = on_refused
        self._queue: queue.SimpleQueue[tuple[WorkItem, bytes] | str | None] = queue.SimpleQueue()
        self._stop = threading.Event()  # interrupts a wait for room
        self._is_hard_stop = False
        self._thread = threading.Thread(target=self._run, name="segment-writer", daemon=True)
        self._writing_fd = -1  # the file the supervisor reads after a crash: the object being written (protocol.py)
        self._writing: WorkItem | None = None  # the object being added, once a sample of it is in the open segment
        self._cut = 0  # its samples added before the one being added now (its first ``skip`` included)
        self._in_hand: WorkItem | None = None  # the object taken from the queue and not handled or failed yet
        self._opened_at = 0.0  # when the open segment got its first sample
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def put(self, item: WorkItem, body: bytes) -> None:
        self._queue.put((item, body))

    def qsize(self) -> int:
        return self._queue.qsize()

    def request_flush(self) -> None:
        """Publish the open segment once the objects queued before this call are written."""
        self._queue.put(_FLUSH)

    def drain(self) -> None:
        """Finish the object in hand, skip queued bodies, publish the current segment, end the thread."""
        self._stop.set()
        self._queue.put(None)

    def kill(self) -> None:
        """End without publishing anything more: the current segment is aborted."""
        self._is_hard_stop = True
        self.drain()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float | None = None) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        settings = self._settings
        writer = CacheWriter(
            self._provider,
            segment_bytes=settings.segment_bytes,
            compression=settings.compression,
            file_mode=settings.file_mode,
            fsync=settings.fsync,
            poll_s=0.1,
            stop=self._stop,
            ramp=None
            if settings.published_bytes is None
            else SegmentRamp(settings.segment_bytes, settings.published_bytes, settings.writers),
        )
        writer.before_publish = lambda: self._name_spanning(writer)
        if settings.writing_path:
            self._writing_fd = open_writing(settings.writing_path)
        try:
            while True:
                timeout = settings.idle_flush_s if writer.pending_samples else None
                try:
                    entry = self._queue.get(timeout=timeout)
                except queue.Empty:
                    entry = _FLUSH  # idle: publish what we have
                if entry is None or self._stop.is_set():
                    break
                self._step(writer, entry)
            if self._is_hard_stop:
                writer.abort()
            else:
                self._step(writer, _FLUSH)
        except (WriterStopped, ChannelClosed) as exc:
            log.info("segment writer stopping: %s", exc)
            writer.abort()
        except BaseException as exc:
            self.error = exc
            log.exception("segment writer failed")
            writer.abort()

    def _step(self, writer: CacheWriter, entry: tuple[WorkItem, bytes] | str) -> None:
        """Write one queued object (or publish the open segment: ``_FLUSH``); a write the filesystem refuses for
        lack of space drops the open segment (``_refused``), any other error ends the thread."""
        try:
            if isinstance(entry, str):
                writer.flush()
            else:
                self._take(writer, *entry)
        except OSError as exc:
            if exc.errno not in REFUSED_ERRNOS:
                raise
            self._refused(writer, exc)

    def _take(self, writer: CacheWriter, item: WorkItem, body: bytes) -> None:
        """Write ``item`` into the open segment, publishing it first where it holds another source, and after
        where it is full, old or names enough objects (module docstring, "Flushing")."""
        self._in_hand = item
        tag = self._tags[item.source]
        if writer.source != tag:
            writer.flush()  # one source per segment
            writer.source = tag
        if not writer.pending_samples:
            self._opened_at = time.monotonic()
        self._write_object(writer, item, body)
        self._in_hand = None  # handled or failed: reported
        settings = self._settings
        too_old = writer.pending_samples and time.monotonic() - self._opened_at > settings.max_age_s
        if too_old or writer.is_full or len(self._provider.completed) >= settings.max_objects:
            writer.flush()

    def _refused(self, writer: CacheWriter, exc: OSError) -> None:
        """The filesystem refused a write for lack of space: drop the open segment and report what it held, with
        the object in hand, to be fetched again (module docstring, "A full filesystem")."""
        writer.abort()
        lost = self._provider.completed
        self._provider.completed, self._provider.spanning = [], []
        item, self._in_hand, self._writing = self._in_hand, None, None
        if item is not None:
            lost.append(item.oid)
        self._on_refused(lost, str(exc.strerror or exc), item)

    def _name_spanning(self, writer: CacheWriter) -> None:
        """A segment is cut inside the samples of the object being written: it names that object too."""
        item = self._writing
        if item is not None:
            writer.add_source(item.path, item.etag, self._cut)  # best effort, as for the object's last segment
            self._provider.spanning.append([item.oid, self._cut])
            self._writing = None  # until its next sample is added to the next segment

    def _write_object(self, writer: CacheWriter, item: WorkItem, body: bytes) -> None:
        decoded = self._decode(item, body, writer.encode)
        if decoded is None:
            return
        del body
        result, records = decoded
        if result.skipped and self._on_skipped is not None:
            self._on_skipped(item, result.skipped)
        writer.source_room = source_bytes(item.path, item.etag)  # its name always fits where its samples are
        try:
            for index, record in enumerate(records):
                self._cut = item.skip + index
                writer.add_record(record)
                self._writing = item
        except GrantTooLarge as exc:
            self._on_failed(item, "too_large", f"{item.path}: {exc}")
            return
        except CorruptRecordError as exc:  # publishing the previous segment failed; its objects were re-queued
            log.warning("publishing a segment failed: %s", exc)
            self._on_failed(item, "error", f"{item.path}: {exc}")
            return
        finally:
            self._writing = None
        if records:
            writer.add_source(item.path, item.etag)  # best effort: lets a restarted daemon skip this object
            self._provider.completed.append(item.oid)
        self._on_handled(item, len(records))

    def _decode(
        self, item: WorkItem, body: bytes, encode: Callable[[Sample], EncodedRecord]
    ) -> tuple[Decoded, list[EncodedRecord]] | None:
        """The object's decoded result and its samples (labelled, preprocessed) encoded as the records to write,
        or None where it failed (reported; a sample that cannot be stored fails its object here, before any of it
        is written, instead of ending the writer thread). Marked in the writing file while it runs: a crash or hang
        here is the object's doing (NOTE [ Supervisor-sampler protocol ]); a wait for room afterwards is not."""
        key, url = self._names[item.source](item.path)
        if self._writing_fd >= 0:
            mark_writing(self._writing_fd, item.oid)
        try:
            decoded = self._decoders[item.source](key, body)
            samples = list(decoded)[item.skip :]  # the first ``skip`` are cached already (a crash cut the object)
            for sample in samples:
                sample["__url__"] = url
                if item.label is not None:  # sampler.label: the class index of the object's path (_labels.py)
                    sample["label"] = item.label
            if self._preprocess is not None:
                samples = [self._preprocess(_writable(sample)) for sample in samples]
                for sample in samples:
                    sample["__url__"] = url
            records = []
            for sample in samples:
                try:
                    records.append(encode(sample))
                except Exception as exc:
                    name = printable(str(sample.get("__key__")))  # not ``key``: the object's, above
                    raise DecodeError(f"{name}: cannot be stored: {type(exc).__name__}: {printable(str(exc))}") from exc
        except DecodeError as exc:
            self._on_failed(item, "decode", str(exc))
            return None
        except Exception as exc:  # a user decoder may raise anything: quarantine the object, keep going
            self._on_failed(item, "decode", f"{item.path}: {type(exc).__name__}: {exc}")
            return None
        finally:
            if self._writing_fd >= 0:
                mark_writing(self._writing_fd, -1)
        return decoded, records
