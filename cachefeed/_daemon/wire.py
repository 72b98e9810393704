"""The wire under the daemon's protocols: one message per SEQPACKET datagram, msgpack-encoded, and the channel.

Transport: one ``socketpair(AF_UNIX, SOCK_SEQPACKET)`` per sampler. A datagram is one message (the kernel keeps
the boundaries and the order), encoded as the msgpack array ``[tag, field, ...]``. When either side dies the other
reads EOF (``ChannelClosed``). A message never exceeds ``MAX_MESSAGE_BYTES``.

Messages are frozen dataclasses deriving from ``Message`` and registered by ``@message`` under a unique ``TAG``;
two modules declare them: ``protocol.py`` (the supervisor-sampler conversation) and ``grants.py`` (room for
segments). ``decode`` knows every registered message, so both modules must be imported by both ends (they are:
the sampler and the supervisor import both).
"""

from __future__ import annotations

import select
import socket
import threading
import time
from dataclasses import astuple
from typing import Any, ClassVar, TypeVar

import msgpack

from cachefeed._errors import ChannelClosed
from cachefeed._logs import get_logger

__all__ = ["MAX_MESSAGE_BYTES", "Channel", "ChannelClosed", "Message", "decode", "encode", "message", "socket_pair"]

log = get_logger(__name__)

MAX_MESSAGE_BYTES = 512 << 10
_BUFFER_BYTES = 1 << 20


class Message:
    """Base of every protocol message: sent as ``[TAG, *fields]``; a message with nested records overrides
    ``wire``/``from_wire``."""

    __slots__ = ()
    TAG: ClassVar[str]

    def wire(self) -> list[Any]:
        return [self.TAG, *astuple(self)]  # type: ignore[call-overload]

    @classmethod
    def from_wire(cls, fields: list[Any]) -> Message:
        return cls(*fields)


_TYPES: dict[str, type[Message]] = {}
M = TypeVar("M", bound=type[Message])


def message(cls: M) -> M:
    """Register a message class under its ``TAG`` (unique across the protocols)."""
    if cls.TAG in _TYPES:
        raise ValueError(f"message tag {cls.TAG!r} is taken by {_TYPES[cls.TAG].__name__}")
    _TYPES[cls.TAG] = cls
    return cls


def encode(item: Message) -> bytes:
    data: bytes = msgpack.packb(item.wire(), use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"{item.TAG} message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES} bytes")
    return data


def decode(data: bytes | memoryview) -> Message:
    wire = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)
    if not isinstance(wire, list) or not wire or wire[0] not in _TYPES:
        raise ValueError(f"not a protocol message: {str(wire)[:80]!r}")
    return _TYPES[wire[0]].from_wire(wire[1:])


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
