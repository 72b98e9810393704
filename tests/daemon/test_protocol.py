"""The supervisor-sampler and grant protocols: every message survives the wire, the channel keeps boundaries and
reports EOF, and a tag is registered once."""

from __future__ import annotations

import pytest

from cachefeed._daemon.grants import Abort, GrantReply, Publish, PublishReply, Reserve
from cachefeed._daemon.protocol import Credit, Done, Drain, Drained, Failed, Init, Stats, Work, WorkItem
from cachefeed._daemon.wire import MAX_MESSAGE_BYTES, Channel, ChannelClosed, Message, decode, encode, socket_pair

EXAMPLES: list[Message] = [
    Init(0, 0.5, "info", {"url": "s3://b/p", "storage_options": {"key": "k"}}, {"concurrency": 4}, {"fsync": False}),
    Work([WorkItem(1, "b/a.npy", 10, '"etag"'), WorkItem(2, "b/ü b.npy", 0, None, 3, 1, 17)]),
    Work([]),
    GrantReply(3, 7, "/cache/tmp/0000000000000007.tmp", 4096),
    GrantReply(4, wait=True),
    GrantReply(5, error="too large"),
    PublishReply(6),
    PublishReply(7, error="bad trailer"),
    Drain(),
    Credit(16),
    Reserve(8, 1 << 20),
    Publish(9, 7, [1, 2, 3], [[4, 10]]),
    Abort(7),
    Done([4]),
    Failed(5, "not_found", "not found for b/x"),
    Stats({"requests_total": 3, "errors_total": {"transient": 1}}, 10, 12, 2),
    Drained(),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: Message) -> None:
    assert decode(encode(message)) == message


def test_unknown_and_oversized_messages_are_refused() -> None:
    with pytest.raises(ValueError, match="not a protocol message"):
        decode(b"\x93\xa3bad\x01\x02")
    with pytest.raises(ValueError, match="exceeds"):
        encode(Done(list(range(MAX_MESSAGE_BYTES))))


def test_channel_keeps_boundaries_and_reports_eof() -> None:
    a, b = socket_pair()
    left, right = Channel(a), Channel(b)
    for message in EXAMPLES:
        left.send(message)
    received: list[Message] = []
    while len(received) < len(EXAMPLES):
        message = right.recv(timeout_s=5)
        assert message is not None
        received.append(message)
    assert received == EXAMPLES
    assert right.recv_ready() == []
    assert right.recv(timeout_s=0.01) is None
    left.close()
    with pytest.raises(ChannelClosed):
        right.recv_ready()
    with pytest.raises(ChannelClosed):
        right.send(Drain())
    right.close()


def test_a_peer_that_does_not_read_makes_send_time_out() -> None:
    a, b = socket_pair()
    sender = Channel(a, send_timeout_s=0.2)
    big = Done(list(range(40_000)))
    with pytest.raises(TimeoutError):
        for _ in range(10_000):
            sender.send(big)
    sender.close()
    b.close()


def test_a_message_tag_is_registered_once() -> None:
    from cachefeed._daemon.wire import message

    class Impostor(Message):
        TAG = "publish"

    with pytest.raises(ValueError, match="taken by Publish"):
        message(Impostor)
