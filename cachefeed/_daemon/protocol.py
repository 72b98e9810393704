"""The messages between the supervisor and its sampler subprocesses (the wire and channel: ``wire.py``).

NOTE [ Supervisor-sampler protocol ]
------------------------------------
Transport: one SEQPACKET socket pair per sampler, one message per datagram (``wire.py``). When either side dies
the other reads EOF: the supervisor then restarts the sampler, a sampler exits (it also asks the kernel for
SIGTERM when its parent dies, ``PR_SET_PDEATHSIG``, in case it is blocked elsewhere).

Supervisor -> sampler:

* ``Init``: always the first message: the remote and sampler config, the sources (URL, decoder, tag and weight
  of each; one unnamed source for the single ``[remote]`` form), this sampler's index, its share of the node's
  rate caps and the segment settings. A sampler never reads the config file itself.
* ``Work``: objects to fetch, by object id (``oid``) with the listed path, size and ETag, and the index of their
  source. Sent only against credit (below), so a slow sampler never hoards work. A segment holds one source's
  samples: the writer publishes its open segment before it writes an object of another source.
* ``GrantReply`` / ``PublishReply``: the answers to the writer's grant requests (NOTE [ Grant protocol ] in
  ``grants.py``).
* ``Drain``: stop. Take no more work, drop fetches in flight and queued bodies, finish the object being
  written, publish the current segment (it holds only whole samples), send ``Drained`` and exit. An object
  whose samples are not all in a published segment is simply not done: nothing partial is ever published.

Sampler -> supervisor:

* ``Credit(n)``: the sampler can take ``n`` more objects. It grants one credit per free slot: ``concurrency``
  fetches plus a small queue of fetched bodies waiting for the writer thread. A slot frees when the object's
  samples are handed to the segment writer (or the object failed), so when the writer waits for room
  (back-pressure) credits stop, and fetching stops once the queue is full.
* ``Reserve`` / ``Publish`` / ``Abort``: room for segments, asked by the writer thread and granted by the
  supervisor's ``CacheStore`` (NOTE [ Grant protocol ] in ``grants.py``). ``Publish`` lists the objects that
  became done with it: every object whose samples were all added before that segment was finished.
* ``Done``: objects that produced no sample (done without a segment).
* ``Failed``: one object could not be cached: ``kind`` is a ``RemoteError.kind`` (``not_found``, ``forbidden``,
  ``changed``, ``transient``, ``error``), ``decode`` (quarantined) or ``too_large``.
* ``Refused(oids, reason)``: the cache's filesystem refused a write into a granted segment (full, or over a
  quota: it filled after the grant, with another user's files). Not a failure of the sampler nor of any object:
  the writer thread drops that segment (its grant given back, its file deleted, ``Abort``) and goes on; ``oids``
  are the objects whose samples were in it, and the one it had in hand, none of them done. Sent by the writer
  thread, before its next ``Reserve``. The supervisor re-queues them and tells the store, which says the
  filesystem is full until it has room again and holds grants a while (``CacheStore.refused_write``); the sampler
  gives back the credit of the one in hand (the others' were given).
* ``Quarantined``: what was left out, for ``cachefeed status`` to name (the object's URL, the sample's
  ``__key__`` or None for the whole object, the kind and the reason): an object quarantined (``decode``,
  ``too_large``, besides its ``Failed``), or one sample of an object whose other samples are cached (a tar member
  that failed to decode: ``kind = "sample"``). Informational: it changes nothing in the plan.
* ``Stats``: cumulative counters of this sampler process (remote requests, retries, errors by kind, bytes,
  objects), about once a second; doubles as the heartbeat: a sampler silent for long is named in status, and
  killed later (``pool.py``, "Silence", says how long).
* ``Drained``: the answer to ``Drain``, sent last.
* ``Exiting(reason)``: sent last by a sampler that exits on a failure of its own (its writer thread died: a
  cache filesystem that fails writes for another cause than space, ``Refused``; a bug), so that ``cachefeed
  status`` names the cause (the sampler's ``last_error``) rather than its exit status. Best effort: a sampler that
  crashes sends nothing.

Beside the socket, the object being decoded: a sampler that dies leaves no message, so its writer thread keeps the
id of the object its decoder and preprocess are working on in ``tmp/sampler-<index>.writing`` (8 bytes,
``mark_writing``; -1 otherwise, a wait for room included; ``Init.segment["writing_path"]``; created empty by each
sampler, removed by the supervisor once it read it after a death). When a sampler dies other than by a stop, the
supervisor reads it (``read_writing``): an object two samplers died decoding (a decoder or preprocess that
crashes the process, a sample that exhausts its memory; a count an object written whole later clears) is
quarantined (kind ``crash``, named in ``cachefeed status``) instead of being handed out again, and again, stopping
all ingest. The same file, read while the sampler lives, shows a decoder that hangs (``Supervisor._watch_writers``).

Invariants:

* An object is *done* only once the segment holding its last sample is PUBLISHED. The supervisor keeps, per
  sampler, every object assigned and not yet done or failed; when a sampler dies (EOF, exit, or killed for not
  answering) those objects are re-queued at the front of the plan (but one quarantined for a second death while
  being decoded, above) and the sampler's outstanding grants are aborted (their tmp files deleted). So a crash
  loses work, never correctness, and never leaves partial output.
  An object re-queued after a segment holding some of its samples was published (``spanning``, NOTE [ Grant
  protocol ]) is drawn again only once that segment is evicted: the cache never holds a sample twice.
* The supervisor never blocks on a sampler for long: its sends time out (the sampler is then killed), and its
  reads are non-blocking. A message never exceeds ``MAX_MESSAGE_BYTES``.

Referenced from: ``supervisor.py`` (dispatch), ``pool.py`` (death and re-queue), ``sampler.py`` and ``sink.py``.
"""

from __future__ import annotations

import os
import struct
from dataclasses import astuple, dataclass, field
from typing import Any, ClassVar

from cachefeed._daemon.wire import Message, message
from cachefeed._fsutil import open_regular_for_write, read_regular

__all__ = [
    "Credit",
    "Done",
    "Drain",
    "Drained",
    "Exiting",
    "Failed",
    "Init",
    "Quarantined",
    "Refused",
    "Stats",
    "Work",
    "WorkItem",
    "mark_writing",
    "open_writing",
    "read_writing",
]


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One object to fetch: its id (``sources.py``), its listing entry, with ``sampler.label`` its class index,
    the index of its source in ``Init.sources``, and ``skip``: how many of its first samples are cached already
    (published before its sampler died or the daemon restarted; ``plan.py``, "Cut objects"), not written again."""

    oid: int
    path: str
    size: int
    etag: str | None
    label: int | None = None
    source: int = 0
    skip: int = 0


# -- supervisor -> sampler -------------------------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class Init(Message):
    TAG: ClassVar[str] = "init"
    index: int
    share: float
    log_level: str
    remote: dict[str, Any]
    sampler: dict[str, Any]
    segment: dict[str, Any]
    sources: list[dict[str, Any]] = field(default_factory=list)  # name, url, pattern, ..., tag, weight, decode


@message
@dataclass(frozen=True, slots=True)
class Work(Message):
    TAG: ClassVar[str] = "work"
    items: list[WorkItem] = field(default_factory=list)

    def wire(self) -> list[Any]:
        return [self.TAG, [astuple(item) for item in self.items]]

    @classmethod
    def from_wire(cls, fields: list[Any]) -> Work:
        return cls([WorkItem(*item) for item in fields[0]])


@message
@dataclass(frozen=True, slots=True)
class Drain(Message):
    TAG: ClassVar[str] = "drain"


# -- sampler -> supervisor -------------------------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class Credit(Message):
    TAG: ClassVar[str] = "credit"
    n: int


@message
@dataclass(frozen=True, slots=True)
class Done(Message):
    TAG: ClassVar[str] = "done"
    oids: list[int]


@message
@dataclass(frozen=True, slots=True)
class Failed(Message):
    TAG: ClassVar[str] = "failed"
    oid: int
    kind: str
    error: str


@message
@dataclass(frozen=True, slots=True)
class Refused(Message):
    TAG: ClassVar[str] = "refused"
    oids: list[int]
    reason: str


@message
@dataclass(frozen=True, slots=True)
class Quarantined(Message):
    TAG: ClassVar[str] = "quarantined"
    url: str
    key: str | None
    kind: str
    reason: str


@message
@dataclass(frozen=True, slots=True)
class Stats(Message):
    TAG: ClassVar[str] = "stats"
    remote: dict[str, Any]
    objects_total: int
    samples_total: int
    queued: int


@message
@dataclass(frozen=True, slots=True)
class Drained(Message):
    TAG: ClassVar[str] = "drained"


@message
@dataclass(frozen=True, slots=True)
class Exiting(Message):
    TAG: ClassVar[str] = "exiting"
    reason: str


_WRITING = struct.Struct("<q")


def mark_writing(fd: int, oid: int) -> None:
    """The sampler's writer thread: ``oid`` is being decoded and written now (-1: none). One ``pwrite``; best effort
    (a full disk loses only the crash attribution)."""
    try:
        os.pwrite(fd, _WRITING.pack(oid), 0)
    except OSError:
        pass


def open_writing(path: str) -> int:
    """The sampler's writer thread, at its start: the file it marks, emptied and marked -1 (a file a previous
    sampler left names nothing then); -1 where it cannot be opened (no attribution, nothing else lost)."""
    try:
        fd = open_regular_for_write(path, 0o600)
    except OSError:
        return -1
    mark_writing(fd, -1)
    return fd


def read_writing(path: str) -> int:
    """The supervisor: the object a sampler is writing, or -1 (none, or nothing readable: a planted symlink or
    FIFO is never followed or waited on)."""
    try:
        data = read_regular(path, _WRITING.size)
    except OSError:
        return -1
    return int(_WRITING.unpack(data)[0]) if len(data) == _WRITING.size else -1
