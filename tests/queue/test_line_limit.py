"""``LineLimit``: lines of at most 998 octets (RFC 5322 section 2.1.1), numbered as they
stream in, whatever the cuts between pieces."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.queue.line_limit import MAX_LINE, LineLimit, LineTooLong, check_lines

X = b"x"


@pytest.mark.parametrize(
    ("text", "bad_line"),
    [
        (b"", None),
        (X * MAX_LINE, None),  # exactly 998: allowed, with or without its CRLF
        (X * MAX_LINE + b"\r\n", None),
        (X * (MAX_LINE + 1), 1),
        (X * (MAX_LINE + 1) + b"\r\n", 1),
        (b"a\r\n" + X * (MAX_LINE + 1) + b"\r\nb\r\n", 2),
        (b"a\r\nb\r\n" + X * MAX_LINE + b"\r\n" + X * (MAX_LINE + 1), 4),  # the last, unended
        (b"\r\n" * 5 + X * 5000 + b"\r\n", 6),
        ((X * 500 + b"\r\n") * 100, None),  # many lines under the limit
        (X * 600 + b"\r\n" + X * 600, None),  # the CRLF is not counted into either line
    ],
)
@pytest.mark.parametrize("piece", [0, 1, 7, 999, 4096], ids=lambda n: f"pieces of {n or 'all'}")
def test_the_first_long_line_is_named(text: bytes, bad_line: int | None, piece: int) -> None:
    limit = LineLimit()
    step = piece or max(len(text), 1)
    # A CRLF cut in two never reaches the limit (CrlfLines holds a last CR back): join it.
    pieces, start = [], 0
    while start < len(text):
        end = start + step
        if text[end - 1 : end] == b"\r":
            end += 1
        pieces.append(text[start:end])
        start = end
    if bad_line is None:
        for part in pieces:
            limit.feed(part)
        return
    with pytest.raises(LineTooLong) as caught:
        for part in pieces:
            limit.feed(part)
    assert caught.value.line == bad_line
    assert f"line {bad_line} of the message is longer than 998 octets" in str(caught.value)


LINES = st.lists(st.integers(0, 1200), max_size=8)


@given(lengths=LINES, cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_the_verdict_is_the_whole_texts_wherever_it_is_cut(
    lengths: list[int], cuts: list[int]
) -> None:
    """Property: fed in pieces cut anywhere but inside a CRLF, the limit refuses exactly
    when some line is over 998 octets, and names the first such line."""
    text = b"\r\n".join(X * n for n in lengths)
    over = [i for i, n in enumerate(lengths, 1) if n > MAX_LINE]
    edges = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    edges = [e for e in edges if text[e - 1 : e] != b"\r"] + [len(text)]
    limit = LineLimit()
    try:
        for a, b in pairwise(sorted(set(edges))):
            limit.feed(text[a:b])
    except LineTooLong as exc:
        assert over and exc.line == over[0]
    else:
        assert not over
    if over:
        with pytest.raises(LineTooLong):
            check_lines(text)
    else:
        check_lines(text)
