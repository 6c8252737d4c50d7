"""The client's reply reader (``transport/replies.py``) and the channel that uses it.

Pure tests: any cutting of a server's output into packets gives the same replies, in order;
garbled or endless output is refused.  The channel is tested on a real loopback connection.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.storage.conftest import async_test
from zoneq.delivery.transport.channel import Channel, ChannelClosed, ChannelTimeout
from zoneq.delivery.transport.replies import ReplyReader
from zoneq.errors import ProtocolError
from zoneq.protocol.replies import EnhancedStatus, Reply, parse_reply

# One reply as its wire lines: a code, then one or more lines of text.
codes = st.sampled_from([220, 221, 250, 251, 354, 421, 450, 451, 452, 500, 503, 550, 554])
texts = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)


@st.composite
def wire_replies(draw: st.DrawFn) -> list[bytes]:
    code = draw(codes)
    lines = draw(st.lists(texts, min_size=1, max_size=4))
    out = [b"%d-%s\r\n" % (code, t.encode()) for t in lines[:-1]]
    return [*out, b"%d %s\r\n" % (code, lines[-1].encode())]


def cut(data: bytes, points: list[int]) -> list[bytes]:
    edges = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@given(st.lists(wire_replies(), min_size=1, max_size=8), st.lists(st.integers(0, 10_000)))
def test_any_packet_boundaries_give_the_same_replies_in_order(
    replies: list[list[bytes]], points: list[int]
) -> None:
    expected = [parse_reply(lines) for lines in replies]
    data = b"".join(b"".join(lines) for lines in replies)
    reader = ReplyReader()
    got: list[Reply] = []
    for packet in cut(data, points):
        got += reader.feed(packet)
    assert got == expected
    assert not reader.pending


@pytest.mark.parametrize(
    ("packets", "replies", "pending"),
    [
        ([b"250 ok\r\n"], 1, False),
        ([b"250-a\r\n250 b\r\n354 go\r\n"], 2, False),  # 250 multiline, then 354: two
        ([b"25", b"0 ok\r", b"\n"], 1, False),
        ([b"250-a\r\n"], 0, True),  # a continuation line: the reply is not over
        ([b"250 ok\r\n25"], 1, True),
        ([b"250\r\n"], 1, False),  # a code alone is a whole reply
        ([b"250 ok\n"], 1, False),  # a bare LF is tolerated
    ],
)
def test_reply_boundaries(packets: list[bytes], replies: int, pending: bool) -> None:
    reader = ReplyReader()
    assert sum(len(reader.feed(p)) for p in packets) == replies
    assert reader.pending is pending


@pytest.mark.parametrize(
    ("packets", "expected"),
    [
        # RFC 5321 section 4.2: the client acts on the code, not the text, so a CR in a
        # remote reply's text is made a space, and CRs before the line end go.
        ([b"250 2.0.0 Ok: queued as 12345\rABC\r\n"], ("Ok: queued as 12345 ABC",)),
        ([b"250 2.0.0 Ok queued\r\r\n"], ("Ok queued",)),
        ([b"250 2.0.0 Ok queued\r", b"\r", b"\n"], ("Ok queued",)),
        ([b"250-2.0.0 a\rb\r\n250 2.0.0 c\r\r\n"], ("a b", "c")),
        ([b"250 2.0.0 Ok\r\n"], ("Ok",)),  # a sound line is unchanged
    ],
)
def test_a_cr_in_the_text_of_a_remote_reply_is_tolerated(
    packets: list[bytes], expected: tuple[str, ...]
) -> None:
    reader = ReplyReader()
    got = [reply for packet in packets for reply in reader.feed(packet)]
    assert got == [Reply(250, expected, EnhancedStatus(2, 0, 0))]
    assert not reader.pending and reader.failed is None


def test_replies_built_by_zoneq_still_refuse_a_bare_cr() -> None:
    """The reader's tolerance is for what a server sends; ``parse_reply`` stays strict."""
    with pytest.raises(ProtocolError, match="bare CR"):
        parse_reply([b"250 a\rb\r\n"])


def test_whole_replies_before_garbage_are_returned_then_the_reader_is_spent() -> None:
    reader = ReplyReader()
    assert [r.code for r in reader.feed(b"250 ok\r\n354 go\r\nnonsense\r\n")] == [250, 354]
    assert reader.failed is not None
    with pytest.raises(ProtocolError):
        reader.feed(b"250 ok\r\n")


@pytest.mark.parametrize(
    "data",
    [
        b"hello\r\n",  # not a code
        b"250-a\r\n550 b\r\n",  # codes differ within a reply
        b"x" * 9000,  # an endless line with no end
        b"250-" + b"y" * 9000 + b"\r\n",
        b"250-a\r\n" * 10_000,  # an endless multiline reply
    ],
)
def test_garbled_or_endless_output_is_refused_for_good(data: bytes) -> None:
    reader = ReplyReader()
    with pytest.raises(ProtocolError):
        reader.feed(data)
    with pytest.raises(ProtocolError):  # spent: the connection is in no known state
        reader.feed(b"250 ok\r\n")


# --- the channel on a real connection ----------------------------------------------------


async def channel_to(script: list[tuple[float, bytes]], close: bool) -> Channel:
    """A server on 127.0.0.1 that sends ``script`` (delay, bytes) and then maybe closes."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for delay, data in script:
            await asyncio.sleep(delay)
            writer.write(data)
            await writer.drain()
        if close:
            writer.close()
        else:
            await reader.read()  # until the client closes

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    server.close()
    assert isinstance(transport, asyncio.Transport)
    return Channel(transport)


@async_test
async def test_replies_that_came_before_the_close_are_still_read() -> None:
    channel = await channel_to([(0, b"250 a\r\n250 b\r\n")], close=True)
    await asyncio.sleep(0.2)  # both replies and the close have arrived
    assert [(await channel.read(1)).code for _ in range(2)] == [250, 250]
    with pytest.raises(ChannelClosed):
        await channel.read(1)
    with pytest.raises(ChannelClosed):
        channel.write(b"NOOP\r\n")


@async_test
async def test_each_read_has_its_own_deadline() -> None:
    channel = await channel_to([(0.3, b"250 a\r\n"), (0.3, b"250 b\r\n")], close=False)
    try:
        assert (await channel.read(0.5)).code == 250
        assert (await channel.read(0.5)).code == 250  # 0.6 s in all: each had 0.5 s
        with pytest.raises(ChannelTimeout):
            await channel.read(0.2)
    finally:
        channel.abort()


@async_test
async def test_a_garbled_reply_closes_the_channel() -> None:
    channel = await channel_to([(0, b"250 ok\r\nnonsense\r\n")], close=False)
    await asyncio.sleep(0.2)
    assert (await channel.read(1)).code == 250
    with pytest.raises(ChannelClosed, match="unusable reply"):
        await channel.read(1)
    assert not channel.is_open
