"""The outgoing copy: fields added in front, the routing header removed, chunking irrelevant."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.delivery.headers import HEADER_LIMIT, OutgoingBody, without_field

ZONE_HEADER = "X-Sending-Zone"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (b"A: 1\r\nX-Sending-Zone: bulk\r\nB: 2\r\n\r\n", b"A: 1\r\nB: 2\r\n\r\n"),
        (b"x-sending-zone:bulk\r\nB: 2\r\n\r\n", b"B: 2\r\n\r\n"),  # names ignore case
        (b"X-Sending-Zone : bulk\r\n\r\n", b"\r\n"),  # RFC 5322 obs: WSP before the colon
        # A folded field goes whole, continuation lines and all (RFC 5322 section 2.2.3).
        (b"X-Sending-Zone: bulk\r\n  more\r\n\tmore\r\nB: 2\r\n\r\n", b"B: 2\r\n\r\n"),
        # Every occurrence goes.
        (b"X-Sending-Zone: a\r\nB: 2\r\nX-Sending-Zone: b\r\n\r\n", b"B: 2\r\n\r\n"),
        # Another field whose name starts the same stays, as does a mention in a value.
        (b"X-Sending-Zone-Note: x\r\n\r\n", b"X-Sending-Zone-Note: x\r\n\r\n"),
        (b"Subject: X-Sending-Zone: no\r\n\r\n", b"Subject: X-Sending-Zone: no\r\n\r\n"),
        (b"A: 1\n X-Sending-Zone: folded\nB: 2\n\n", b"A: 1\n X-Sending-Zone: folded\nB: 2\n\n"),
        (b"A: 1\nX-Sending-Zone: x\nB: 2\n\n", b"A: 1\nB: 2\n\n"),  # bare LF line ends too
    ],
)
def test_without_field(header: bytes, expected: bytes) -> None:
    assert without_field(header, ZONE_HEADER) == expected


def collect(body: OutgoingBody) -> bytes:
    async def run() -> bytes:
        return b"".join([chunk async for chunk in body()])

    return asyncio.run(run())


def chunked(message: bytes, cuts: Sequence[int]) -> list[bytes]:
    points = sorted({c % (len(message) + 1) for c in cuts} | {0, len(message)})
    return [message[a:b] for a, b in itertools.pairwise(points) if b > a]


HEAD = b"From: a@src.test\r\nX-Sending-Zone: bulk\r\n folded\r\nSubject: s\r\n\r\n"
BODY = b"X-Sending-Zone: in the body stays\r\n.dot\r\n" * 3


@given(st.lists(st.integers(min_value=0, max_value=400), max_size=12), st.booleans())
def test_any_chunking_gives_the_same_copy(cuts: list[int], sync_source: bool) -> None:
    message = HEAD + BODY
    pieces = chunked(message, cuts)

    async def source_async():  # type: ignore[no-untyped-def]
        for piece in pieces:
            yield piece

    source = (lambda: iter(pieces)) if sync_source else source_async
    added = b"DKIM-Signature: v=1; x\r\n"
    body = OutgoingBody(source, ZONE_HEADER, added)
    expected_head = b"From: a@src.test\r\nSubject: s\r\n\r\n"
    assert collect(body) == added + expected_head + BODY
    assert asyncio.run(body.header()) == expected_head

    async def rest() -> bytes:
        return b"".join([chunk async for chunk in body.body()])

    assert asyncio.run(rest()) == BODY


def test_messages_without_body_or_headers_and_an_endless_header() -> None:
    only_head = OutgoingBody(lambda: [b"A: 1\r\nX-Sending-Zone: z\r\n"], ZONE_HEADER, b"B: 2\r\n")
    assert collect(only_head) == b"B: 2\r\nA: 1\r\n"
    no_head = OutgoingBody(lambda: [b"\r\nbody\r\n"], ZONE_HEADER)
    assert collect(no_head) == b"\r\nbody\r\n"
    # A header section that does not end within the limit is taken to end there: memory
    # stays bounded, and nothing is lost.
    long = [b"A: " + b"x" * (HEADER_LIMIT // 4) + b"\r\n"] * 5 + [b"\r\nbody"]
    assert collect(OutgoingBody(lambda: long, ZONE_HEADER)) == b"".join(long)
