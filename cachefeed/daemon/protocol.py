"""The messages between the supervisor and its sampler subprocesses, and the channel that carries them.

NOTE [ Supervisor-sampler protocol ]
------------------------------------
Transport: one ``socketpair(AF_UNIX, SOCK_SEQPACKET)`` per sampler. A datagram is one message (the kernel keeps
the boundaries and the order), encoded as the msgpack array ``[tag, field, ...]``. When either side dies the other
reads EOF: the supervisor then restarts the sampler, a sampler exits (it also asks the kernel for SIGTERM when
its parent dies, ``PR_SET_PDEATHSIG``, in case it is blocked elsewhere).

Supervisor -> sampler:

* ``Init``: always the first message: the remote and sampler config, the sources (URL, decoder, tag and weight
  of each; one unnamed source for the single ``[remote]`` form), this sampler's index, its share of the node's
  rate caps and the segment settings. A sampler never reads the config file itself.
* ``Work``: objects to fetch, by object id (``oid``) with the listed path, size and ETag, and the index of their
  source. Sent only against credit (below), so a slow sampler never hoards work. A segment holds one source's
  samples: the writer publishes its open segment before it writes an object of another source.
* ``GrantReply``: the answer to ``Reserve``: a grant (``seq``, tmp path, bytes), or ``wait`` (the cache is full
  of pinned data: ask again later), or an ``error`` (the segment can never fit).
* ``PublishReply``: the answer to ``Publish``: ``ok``, or an ``error`` (the file did not verify; it was deleted).
* ``Drain``: stop. Take no more work, drop fetches in flight and queued bodies, finish the object being
  written, publish the current segment (it holds only whole samples), send ``Drained`` and exit. An object
  whose samples are not all in a published segment is simply not done: nothing partial is ever published.

Sampler -> supervisor:

* ``Credit(n)``: the sampler can take ``n`` more objects. It grants one credit per free slot: ``concurrency``
  fetches plus a small queue of fetched bodies waiting for the writer thread. A slot frees when the object's
  samples are handed to the segment writer (or the object failed), so when the writer waits for room
  (back-pressure) credits stop, and fetching stops once the queue is full.
* ``Reserve`` / ``Publish`` / ``Abort``: the ``GrantProvider`` calls of ``CacheWriter``, made by the writer thread
  and executed by the supervisor on its ``CacheStore`` (the single owner of the budget). ``Publish`` lists the
  objects that became done with it: every object whose samples were all added before that segment was
  finished. ``Abort`` needs no reply.
* ``Done``: objects that produced no sample (done without a segment).
* ``Failed``: one object could not be cached: ``kind`` is a ``RemoteError.kind`` (``not_found``, ``forbidden``,
  ``changed``, ``transient``, ``error``), ``decode`` (quarantined) or ``too_large``.
* ``Stats``: cumulative counters of this sampler process (remote requests, retries, errors by kind, bytes,
  objects), about once a second; doubles as the heartbeat.
* ``Drained``: the answer to ``Drain``, sent last.

Invariants:

* An object is *done* only once the segment holding its last sample is PUBLISHED. The supervisor keeps, per
  sampler, every object assigned and not yet done or failed; when a sampler dies (EOF, exit, or killed for not
  answering) those objects are re-queued at the front of the plan and the sampler's outstanding grants are
  aborted (their tmp files deleted). So a crash loses work, never correctness, and never leaves partial output.
* Every ``Reserve`` and ``Publish`` gets exactly one reply, in order; the writer thread has at most one request
  outstanding (it blocks on the reply), so replies carry the request id only as a check.
* The supervisor never blocks on a sampler for long: its sends time out (the sampler is then killed), and its
  reads are non-blocking. A message never exceeds ``MAX_MESSAGE_BYTES``.

Referenced from: ``supervisor.py`` (dispatch), ``pool.py`` (death and re-queue), ``sampler.py`` and ``sink.py``.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from dataclasses import astuple, dataclass, field
from typing import Any, ClassVar

import msgpack

from cachefeed.errors import ChannelClosed

__all__ = [
    "MAX_MESSAGE_BYTES",
    "Abort",
    "Channel",
    "ChannelClosed",
    "Credit",
    "Done",
    "Drain",
    "Drained",
    "Failed",
    "GrantReply",
    "Init",
    "Message",
    "Publish",
    "PublishReply",
    "Reserve",
    "Stats",
    "Work",
    "WorkItem",
    "socket_pair",
]

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 512 << 10
_BUFFER_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One object to fetch: its id (``sources.py``), its listing entry, with ``sampler.label`` its class index,
    and the index of its source in ``Init.sources``."""

    oid: int
    path: str
    size: int
    etag: str | None
    label: int | None = None
    source: int = 0


# -- supervisor -> sampler -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Init:
    TAG: ClassVar[str] = "init"
    index: int
    share: float
    log_level: str
    remote: dict[str, Any]
    sampler: dict[str, Any]
    segment: dict[str, Any]
    sources: list[dict[str, Any]] = field(default_factory=list)  # name, url, pattern, ..., tag, weight, decode


@dataclass(frozen=True, slots=True)
class Work:
    TAG: ClassVar[str] = "work"
    items: list[WorkItem] = field(default_factory=list)

    def wire(self) -> list[Any]:
        return [self.TAG, [astuple(item) for item in self.items]]

    @classmethod
    def from_wire(cls, fields: list[Any]) -> Work:
        return cls([WorkItem(*item) for item in fields[0]])


@dataclass(frozen=True, slots=True)
class GrantReply:
    TAG: ClassVar[str] = "grant"
    req: int
    seq: int = -1
    path: str = ""
    nbytes: int = 0
    wait: bool = False
    error: str = ""


@dataclass(frozen=True, slots=True)
class PublishReply:
    TAG: ClassVar[str] = "published"
    req: int
    error: str = ""


@dataclass(frozen=True, slots=True)
class Drain:
    TAG: ClassVar[str] = "drain"


# -- sampler -> supervisor -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Credit:
    TAG: ClassVar[str] = "credit"
    n: int


@dataclass(frozen=True, slots=True)
class Reserve:
    TAG: ClassVar[str] = "reserve"
    req: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Publish:
    TAG: ClassVar[str] = "publish"
    req: int
    seq: int
    done: list[int]


@dataclass(frozen=True, slots=True)
class Abort:
    TAG: ClassVar[str] = "abort"
    seq: int


@dataclass(frozen=True, slots=True)
class Done:
    TAG: ClassVar[str] = "done"
    oids: list[int]


@dataclass(frozen=True, slots=True)
class Failed:
    TAG: ClassVar[str] = "failed"
    oid: int
    kind: str
    error: str


@dataclass(frozen=True, slots=True)
class Stats:
    TAG: ClassVar[str] = "stats"
    remote: dict[str, Any]
    objects_total: int
    samples_total: int
    queued: int


@dataclass(frozen=True, slots=True)
class Drained:
    TAG: ClassVar[str] = "drained"


Message = (
    Init
    | Work
    | GrantReply
    | PublishReply
    | Drain
    | Credit
    | Reserve
    | Publish
    | Abort
    | Done
    | Failed
    | Stats
    | Drained
)
_TYPES: dict[str, type[Any]] = {
    cls.TAG: cls
    for cls in (
        Init,
        Work,
        GrantReply,
        PublishReply,
        Drain,
        Credit,
        Reserve,
        Publish,
        Abort,
        Done,
        Failed,
        Stats,
        Drained,
    )
}


def encode(message: Message) -> bytes:
    wire = message.wire() if isinstance(message, Work) else [message.TAG, *astuple(message)]
    data: bytes = msgpack.packb(wire, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"{message.TAG} message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES} bytes")
    return data


def decode(data: bytes | memoryview) -> Message:
    wire = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)
    if not isinstance(wire, list) or not wire or wire[0] not in _TYPES:
        raise ValueError(f"not a protocol message: {str(wire)[:80]!r}")
    cls = _TYPES[wire[0]]
    if cls is Work:
        return Work.from_wire(wire[1:])
    message: Message = cls(*wire[1:])
    return message


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """A connected SEQPACKET pair with buffers big enough for ``MAX_MESSAGE_BYTES``; both ends close-on-exec."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for end in (parent, child):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER_BYTES)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER_BYTES)
    return parent, child


class Channel:
    """One end of a protocol socket, in non-blocking mode. ``send`` is thread-safe; receiving belongs to one thread.

    Args:
        sock: a connected SEQPACKET socket.
        send_timeout_s: a send that cannot complete in this time raises ``TimeoutError`` (the peer is stuck);
            None waits for ever.
    """

    def __init__(self, sock: socket.socket, *, send_timeout_s: float | None = None) -> None:
        self.sock = sock
        sock.setblocking(False)
        self._send_timeout_s = send_timeout_s
        self._send_lock = threading.Lock()
        self._buffer = bytearray(MAX_MESSAGE_BYTES + 1)
        self.is_closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def _wait(self, events: int, timeout_s: float | None) -> bool:
        poller = select.poll()
        poller.register(self.sock.fileno(), events)
        return bool(poller.poll(None if timeout_s is None else max(0, int(timeout_s * 1000))))

    def send(self, message: Message) -> None:
        """Send one message; raises ``ChannelClosed`` if the peer is gone, ``TimeoutError`` if it is stuck."""
        data = encode(message)
        timeout_s = self._send_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._send_lock:
            while True:
                try:
                    self.sock.send(data)  # SEQPACKET: all or nothing
                    return
                except BlockingIOError:
                    pass
                except OSError as exc:
                    raise ChannelClosed(f"peer gone: {exc}") from None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"the peer took no message for {timeout_s}s")
                self._wait(select.POLLOUT, left)

    def _recv_one(self) -> Message | None:
        try:
            n = self.sock.recv_into(self._buffer, len(self._buffer))
        except BlockingIOError:
            return None
        except OSError as exc:
            raise ChannelClosed(f"peer gone: {exc}") from None
        if n == 0:
            raise ChannelClosed("peer closed the channel")
        return decode(memoryview(self._buffer)[:n])

    def recv_ready(self) -> list[Message]:
        """Every message that can be read without blocking (maybe none); ``ChannelClosed`` on EOF."""
        messages: list[Message] = []
        while True:
            message = self._recv_one()
            if message is None:
                return messages
            messages.append(message)

    def recv(self, timeout_s: float | None) -> Message | None:
        """Block for one message up to ``timeout_s`` (None: for ever); None on timeout."""
        if not self._wait(select.POLLIN, timeout_s):
            return None
        return self._recv_one()

    def close(self) -> None:
        self.is_closed = True
        self.sock.close()
