"""The Received count read across stored chunks (``HeaderScan.more``).

The count decides loop detection (RFC 5321 section 6.3): it must not depend on where the
receiver cut the text into chunks, and must stop where the header section stops.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoneq.receiver.message import scan_headers


def _pieces(text: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def _count(pieces: list[bytes]) -> int:
    scan = scan_headers(pieces[0])
    for piece in pieces[1:]:
        scan.more(piece)
    return scan.received


@pytest.mark.parametrize(
    ("text", "cut", "received"),
    [
        # A field cut mid-name, then the section ends: both fields count.
        (b"Received: a\r\nRecei", b"ved: b\r\n\r\nReceived: in the body\r\n", 2),
        # The empty line split across the cut (CR | LF CRLF).
        (b"Received: a\r\n\r", b"\nReceived: body\r\n", 1),
        # The cut falls right after a CRLF, and the next piece starts with the empty line.
        (b"Received: a\r\n", b"\r\nReceived: body\r\n", 1),
        # A fold carried over the cut is part of the field before it, not a new field.
        (b"Received: a\r\n", b"  from Received: x\r\nRECEIVED : b\r\n\r\n", 2),
        # A line that is no field ends the section (a message without the empty line).
        (b"Received: a\r\n", b"just text\r\nReceived: b\r\n", 1),
        # ... also when that line is in the first piece.
        (b"Received: a\r\nnot a field\r\nReceived: b\r\n", b"Received: c\r\n", 2),
        # A section that ended in the first piece is not read on.
        (b"Received: a\r\n\r\n", b"Received: b\r\n", 1),
    ],
)
def test_received_counted_across_a_cut(text: bytes, cut: bytes, received: int) -> None:
    assert _count([text, cut]) == received


def test_a_line_past_the_limit_ends_the_count() -> None:
    # No line end within 1,000 octets (the receiver refuses longer lines): what follows
    # is not read as a header section, and what is carried stays bounded.
    head = b"Received: a\r\nX-Long: "
    assert _count([head, b"y" * 1200, b"\r\nReceived: b\r\n"]) == 1
    assert _count([head, b"y" * 900, b"\r\nReceived: b\r\n"]) == 2


_FIELD = st.one_of(
    st.builds(
        lambda v, folds: b"Received: " + v + b"".join(b"\r\n\t" + f for f in folds) + b"\r\n",
        st.binary(min_size=1, max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
        st.lists(st.sampled_from([b"by x", b"Received: folded", b"id 1"]), max_size=2),
    ),
    st.sampled_from([b"Subject: hi\r\n", b"received : spaced\r\n", b"X-Received: no\r\n"]),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_FIELD, min_size=1, max_size=30),
    st.lists(st.integers(min_value=0, max_value=4000), max_size=6),
)
def test_count_does_not_depend_on_the_cuts(fields: list[bytes], cuts: list[int]) -> None:
    # Field values without a colon-free line: every line here is a field or a fold.
    text = b"".join(fields) + b"\r\nReceived: in the body\r\n"
    whole = scan_headers(text).received
    assert whole == sum(f.lower().startswith((b"received:", b"received :")) for f in fields)
    assert _count(_pieces(text, cuts)) == whole
