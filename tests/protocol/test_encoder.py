"""Tests for the streaming DATA encoder (zoneq.protocol.encoder)."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoneq.errors import ProtocolError
from zoneq.protocol.encoder import DotStuffer, _fits, dot_stuff, dot_unstuff

# --- an independent reference, written for obviousness rather than speed -------------------


def ref_normalise(body: bytes) -> bytes:
    """NULs dropped, every line ending -> CRLF; a CRLF appended if the (non-empty) body
    lacks one."""
    text = re.sub(rb"\r\n|\r|\n", b"\r\n", body.replace(b"\x00", b""))
    return text if text == b"" or text.endswith(b"\r\n") else text + b"\r\n"


def ref_encode(body: bytes, limit: int = 998) -> bytes:
    """Line by line: fold the text with CRLF SPACE, then double a leading dot (RFC 5321
    4.5.3.1.6: the doubled dot is not counted), then add the terminator."""
    wire_lines = []
    for body_line in ref_normalise(body).split(b"\r\n")[:-1]:
        line, folded = body_line, []
        while limit and len(line) > limit:
            folded.append(line[:limit])
            line = b" " + line[limit:]
        folded.append(line)
        if body_line.startswith(b"."):
            folded[0] = b"." + folded[0]
        wire_lines += folded
    return b"".join(line + b"\r\n" for line in wire_lines) + b".\r\n"


def encode(chunks: list[bytes], limit: int = 998) -> bytes:
    return b"".join(dot_stuff(chunks, limit))


BARE_CR_OR_LF = re.compile(rb"\r(?!\n)|(?<!\r)\n")

# --- table-driven cases ------------------------------------------------------------------------

X = b"x"
CASES: list[tuple[str, list[bytes], int, bytes]] = [
    # line endings
    ("crlf", [b"a\r\nb\r\n"], 998, b"a\r\nb\r\n.\r\n"),
    ("bare-lf", [b"a\nb\n"], 998, b"a\r\nb\r\n.\r\n"),
    ("bare-cr", [b"a\rb\r"], 998, b"a\r\nb\r\n.\r\n"),
    ("mixed", [b"a\r\nb\nc\rd"], 998, b"a\r\nb\r\nc\r\nd\r\n.\r\n"),
    ("cr-cr-lf", [b"a\r\r\nb"], 998, b"a\r\n\r\nb\r\n.\r\n"),
    ("lf-cr", [b"a\n\rb"], 998, b"a\r\n\r\nb\r\n.\r\n"),
    ("cr|lf-split", [b"a\r", b"\nb"], 998, b"a\r\nb\r\n.\r\n"),
    ("cr|empty|lf", [b"a\r", b"", b"\nb"], 998, b"a\r\nb\r\n.\r\n"),
    ("cr|cr", [b"a\r", b"\rb"], 998, b"a\r\n\r\nb\r\n.\r\n"),
    ("cr|lf|lf", [b"a\r", b"\n", b"\nb"], 998, b"a\r\n\r\nb\r\n.\r\n"),
    ("lf|lf", [b"a\n", b"\nb"], 998, b"a\r\n\r\nb\r\n.\r\n"),
    # leading dots (RFC 5321 section 4.5.2)
    ("dot-first-line", [b".a"], 998, b"..a\r\n.\r\n"),
    ("dot-after-crlf", [b"a\r\n.b"], 998, b"a\r\n..b\r\n.\r\n"),
    ("dot-after-lf", [b"a\n.b"], 998, b"a\r\n..b\r\n.\r\n"),
    ("dot-after-cr", [b"a\r.b"], 998, b"a\r\n..b\r\n.\r\n"),
    ("dot|after-crlf", [b"a\r\n", b".b"], 998, b"a\r\n..b\r\n.\r\n"),
    ("dot|after-split-crlf", [b"a\r", b"\n.b"], 998, b"a\r\n..b\r\n.\r\n"),
    ("dot|after-cr", [b"a\r", b".b"], 998, b"a\r\n..b\r\n.\r\n"),
    ("dot|after-lf", [b"a\n", b".b"], 998, b"a\r\n..b\r\n.\r\n"),
    ("dot|mid-line", [b"a", b".b"], 998, b"a.b\r\n.\r\n"),
    ("dot-mid-line", [b"a.b\r\n"], 998, b"a.b\r\n.\r\n"),
    ("dot-only-line", [b".\r\n"], 998, b"..\r\n.\r\n"),
    ("two-dots", [b"..\r\n"], 998, b"...\r\n.\r\n"),
    ("dot-lines", [b".\r\n.\r\n"], 998, b"..\r\n..\r\n.\r\n"),
    ("ends-like-terminator", [b"a\r\n.\r\n"], 998, b"a\r\n..\r\n.\r\n"),
    ("terminator-split", [b"a\r\n", b".", b"\r\n"], 998, b"a\r\n..\r\n.\r\n"),
    # SMTP smuggling (2023): every fake end-of-data must become a stuffed dot line
    ("smuggle-lf.lf", [b"a\n.\nb"], 998, b"a\r\n..\r\nb\r\n.\r\n"),
    ("smuggle-lf.crlf", [b"a\n.\r\nb"], 998, b"a\r\n..\r\nb\r\n.\r\n"),
    ("smuggle-cr.cr", [b"a\r.\rb"], 998, b"a\r\n..\r\nb\r\n.\r\n"),
    ("smuggle-crlf.lf", [b"a\r\n.\nb"], 998, b"a\r\n..\r\nb\r\n.\r\n"),
    ("smuggle-lf.cr", [b"a\n.\rb"], 998, b"a\r\n..\r\nb\r\n.\r\n"),
    ("smuggle-split", [b"a\n", b".", b"\nb"], 998, b"a\r\n..\r\nb\r\n.\r\n"),
    # ... and the NUL variants: NULs are dropped, then the dot line is stuffed
    ("smuggle-nul-before-dot", [b"a\r\n\x00.\r\nb"], 998, b"a\r\n..\r\nb\r\n.\r\n"),
    ("smuggle-nuls-before-dot", [b"a\r\n\x00\x00.\r\nb"], 998, b"a\r\n..\r\nb\r\n.\r\n"),
    ("smuggle-nul|dot", [b"a\r\n\x00", b".\r\nb"], 998, b"a\r\n..\r\nb\r\n.\r\n"),
    ("smuggle-nul-after-dot", [b"a\r\n.\x00\r\nb"], 998, b"a\r\n..\r\nb\r\n.\r\n"),
    ("smuggle-nul-before-crlf", [b"a\x00\r\n.\r\nb"], 998, b"a\r\n..\r\nb\r\n.\r\n"),
    ("smuggle-mid-line-nul-dot", [b"a\x00.\r\nb"], 998, b"a.\r\nb\r\n.\r\n"),
    ("smuggle-lf.nul-lf", [b"a\n.\x00\nb"], 998, b"a\r\n..\r\nb\r\n.\r\n"),
    ("cr|nul|lf", [b"a\r", b"\x00", b"\nb"], 998, b"a\r\nb\r\n.\r\n"),
    ("only-nuls", [b"\x00\x00"], 998, b".\r\n"),
    # empty body, missing final line ending
    ("empty-no-chunks", [], 998, b".\r\n"),
    ("empty-chunk", [b""], 998, b".\r\n"),
    ("empty-chunks", [b"", b""], 998, b".\r\n"),
    ("only-crlf", [b"\r\n"], 998, b"\r\n.\r\n"),
    ("only-lf", [b"\n"], 998, b"\r\n.\r\n"),
    ("only-cr", [b"\r"], 998, b"\r\n.\r\n"),
    ("no-final-newline", [b"x"], 998, b"x\r\n.\r\n"),
    ("no-final-newline-2", [b"a\r\nb"], 998, b"a\r\nb\r\n.\r\n"),
    # folding (Postfix-style CRLF SPACE)
    ("fold-at-limit", [X * 998], 998, X * 998 + b"\r\n.\r\n"),
    ("fold-limit+1", [X * 999], 998, X * 998 + b"\r\n x\r\n.\r\n"),
    (
        "fold-much-longer",
        [X * 2994],
        998,
        X * 998 + b"\r\n " + X * 997 + b"\r\n " + X * 997 + b"\r\n " + X * 2 + b"\r\n.\r\n",
    ),
    ("fold-limit-across-chunks", [X * 500, X * 498, b"\r\n"], 998, X * 998 + b"\r\n.\r\n"),
    ("fold-limit|next-octet", [X * 998, X], 998, X * 998 + b"\r\n x\r\n.\r\n"),
    ("fold-limit|cr|lf", [X * 998 + b"\r", b"\ny"], 998, X * 998 + b"\r\ny\r\n.\r\n"),
    # RFC 5321 4.5.3.1.6: the doubled dot is not counted; 998 octets of text go unfolded
    ("fold-dot-not-counted", [b"." + X * 997], 998, b".." + X * 997 + b"\r\n.\r\n"),
    ("fold-dot-fits", [b"." + X * 996], 998, b".." + X * 996 + b"\r\n.\r\n"),
    ("fold-dot-limit+1", [b"." + X * 998], 998, b".." + X * 997 + b"\r\n x\r\n.\r\n"),
    (
        "fold-dot-2nd-line",
        [b"a\r\n." + X * 997 + b"\r\n"],
        998,
        b"a\r\n.." + X * 997 + b"\r\n.\r\n",
    ),
    ("fold-dot|rest", [b".", X * 997, b"\r\n"], 998, b".." + X * 997 + b"\r\n.\r\n"),
    (
        "fold-dot|rest|octet",
        [b"." + X * 500, X * 497, X],
        998,
        b".." + X * 997 + b"\r\n x\r\n.\r\n",
    ),
    (
        "fold-crlf|dot-line",
        [b"a\r\n", b"." + X * 998],
        998,
        b"a\r\n.." + X * 997 + b"\r\n x\r\n.\r\n",
    ),
    ("fold-small-dot", [b".abcde"], 3, b"..ab\r\n cd\r\n e\r\n.\r\n"),
    ("fold-small-dot-fits", [b".ab\r\n.c"], 3, b"..ab\r\n..c\r\n.\r\n"),
    ("fold-small", [b"abcdefghij"], 4, b"abcd\r\n efg\r\n hij\r\n.\r\n"),
    ("fold-small-dot-not-stuffed", [b"abcd.efg"], 4, b"abcd\r\n .ef\r\n g\r\n.\r\n"),
    ("fold-limit-2", [b".abc"], 2, b"..a\r\n b\r\n c\r\n.\r\n"),
    ("fold-off", [X * 5000], 0, X * 5000 + b"\r\n.\r\n"),
    ("fold-off-dot", [b"." + X * 5000], 0, b".." + X * 5000 + b"\r\n.\r\n"),
]


@pytest.mark.parametrize(
    ("chunks", "limit", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_encode_table(chunks: list[bytes], limit: int, expected: bytes) -> None:
    assert encode(chunks, limit) == expected
    # The reference agrees, so it can be trusted in the property tests below.
    assert ref_encode(b"".join(chunks), limit) == expected


def test_feed_and_finish_pieces() -> None:
    stuffer = DotStuffer()
    assert stuffer.feed(b"a\r") == b"a\r\n"  # the CR is sent at once, nothing held back
    assert stuffer.feed(b"\n.b") == b"..b"
    assert stuffer.feed(b"") == b""
    assert stuffer.finish() == b"\r\n.\r\n"


def test_feed_after_finish_is_refused() -> None:
    stuffer = DotStuffer()
    stuffer.finish()
    with pytest.raises(RuntimeError):
        stuffer.feed(b"x")
    with pytest.raises(RuntimeError):
        stuffer.finish()


@pytest.mark.parametrize("limit", [-1, 1])
def test_bad_limit(limit: int) -> None:
    with pytest.raises(ValueError):
        DotStuffer(limit)


def test_store_sized_chunks_match_reference() -> None:
    """64 KiB chunks of mixed text: exercises the fast path and its fall-backs at full size."""
    lines = []
    for i in range(6000):
        text = b"." * (i % 3 == 0) + b"line %d " % i + b"y" * (i * 7 % 120)
        if i % 97 == 0:
            text += b"z" * (900 + i % 300)  # some lines near and over the limit
        lines.append(text + (b"\r\n", b"\n", b"\r", b"\r\n", b"\r\n")[i % 5])
    body = b"".join(lines)
    for size in (65536, 65537, 1000):
        chunks = [body[i : i + size] for i in range(0, len(body), size)]
        assert encode(chunks) == ref_encode(body)
    crlf_only = ref_normalise(body)
    chunks = [crlf_only[i : i + 65536] for i in range(0, len(crlf_only), 65536)]
    assert encode(chunks) == ref_encode(crlf_only)


# --- dot_unstuff ---------------------------------------------------------------------------------

UNSTUFF_OK = [
    (b".\r\n", b""),
    (b"\r\n.\r\n", b"\r\n"),
    (b"x\r\n.\r\n", b"x\r\n"),
    (b"..a\r\n..\r\n.\r\n", b".a\r\n.\r\n"),
    (b".a\r\n.\r\n", b"a\r\n"),  # RFC 5321 4.5.2: the receiver drops a lone leading dot too
    (b"a\r\n\x00.\r\n.\r\n", b"a\r\n\x00.\r\n"),
]

UNSTUFF_BAD = [
    b"",
    b"a\r\n",
    b"a.\r\n",
    b"\n.\r\n",
    b"a\r\n.\n",
    b".\r\n.\r\n",
    b"a\r\n.\r\nb\r\n.\r\n",
    b"a\nb\r\n.\r\n",
    b"a\rb\r\n.\r\n",
    b"a\n.\nb\r\n.\r\n",
    b"\r\r\n.\r\n",
]


@pytest.mark.parametrize(("wire", "body"), UNSTUFF_OK)
def test_unstuff(wire: bytes, body: bytes) -> None:
    assert dot_unstuff(wire) == body


@pytest.mark.parametrize("wire", UNSTUFF_BAD)
def test_unstuff_rejects(wire: bytes) -> None:
    with pytest.raises(ProtocolError):
        dot_unstuff(wire)


# --- properties ----------------------------------------------------------------------------------

# Mostly the octets that matter, so line endings and dots meet in every combination.
INTERESTING = st.lists(
    st.sampled_from([b"\r", b"\n", b"\r\n", b".", b"a", b" ", b"\x00", b"\xff"]), max_size=60
).map(b"".join)
BODIES = st.one_of(INTERESTING, st.binary(max_size=200))
LIMITS = st.one_of(st.just(0), st.just(998), st.integers(2, 12))


@st.composite
def chunked(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """A body and an arbitrary cut of it into chunks (empty chunks included)."""
    body = draw(BODIES)
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=8)))
    bounds = [0, *cuts, len(body)]
    return body, [body[a:b] for a, b in itertools.pairwise(bounds)]


def wire_lines(wire: bytes) -> list[bytes]:
    """The lines of a payload, without the final "." terminator line."""
    assert wire.endswith(b".\r\n")
    return wire[: -len(b".\r\n")].split(b"\r\n")[:-1] if wire != b".\r\n" else []


@settings(max_examples=400)
@given(chunked(), LIMITS)
def test_properties(case: tuple[bytes, list[bytes]], limit: int) -> None:
    body, chunks = case
    wire = encode(chunks, limit)
    # (1) the chunking does not matter, and the output is what the reference says
    assert wire == encode([body], limit)
    assert wire == ref_encode(body, limit)
    # (2) no bare CR or LF
    assert BARE_CR_OR_LF.search(wire) is None
    # (3) no line starts with a single dot, except the terminator; and it is terminated
    assert wire == b".\r\n" or wire.endswith(b"\r\n.\r\n")
    for line in wire_lines(wire):
        assert not line.startswith(b".") or line.startswith(b"..")
    # (4) the recipient gets the normalised body when no line of it is over the limit: a
    # doubled dot does not count (RFC 5321 4.5.3.1.6), so "." + 997 octets is not folded
    normalised = ref_normalise(body)
    if limit == 0 or max(map(len, normalised.split(b"\r\n"))) <= limit:
        assert dot_unstuff(wire) == normalised
    # (5) with folding on, no line on the wire exceeds the limit, its doubled dot not counted
    # (a wire line that starts with "." is a dot-stuffed one; a continuation starts with " ")
    if limit:
        assert all(len(line) - line.startswith(b".") <= limit for line in wire_lines(wire))


# Lines near the RFC 5321 limit, many of them dot-led: 998 octets of text, with CRLF 1000.
LONG_LINES = st.lists(
    st.tuples(st.sampled_from([b"", b".", b".."]), st.integers(0, 998), st.sampled_from(b"x. ")),
    min_size=1,
    max_size=6,
).map(lambda rows: [(lead + bytes([fill]) * 998)[:n] for lead, n, fill in rows])


@settings(max_examples=200)
@given(LONG_LINES, st.lists(st.integers(0, 6000), max_size=6))
def test_a_line_of_998_octets_reaches_the_recipient_unchanged(
    lines: list[bytes], cuts: list[int]
) -> None:
    """Property: with the default limit, the unstuffed payload is the body itself when no
    line is over 998 octets (what the receiver and the API accept), however it is cut."""
    body = b"".join(line + b"\r\n" for line in lines)
    bounds = [0, *sorted(c % (len(body) + 1) for c in cuts), len(body)]
    wire = encode([body[a:b] for a, b in itertools.pairwise(bounds)])
    assert dot_unstuff(wire) == body
    assert all(len(line) - line.startswith(b".") <= 998 for line in wire_lines(wire))


SMUGGLE_WORDS = st.lists(
    st.sampled_from([b"\r\n", b"\r", b"\n", b".", b"\x00", b"a"]), max_size=40
).map(b"".join)
# What a lax receiver could take for the end of data: a line of NULs and one dot, with any
# line ending (the 2023 smuggling research); also the strict end, CRLF "." CRLF.
LAX_END = re.compile(rb"(?:\r\n|\r|\n)\x00*\.\x00*(?:\r\n|\r|\n)")


@settings(max_examples=400)
@given(st.one_of(SMUGGLE_WORDS, st.binary(max_size=200)), st.lists(st.integers(0, 200)))
def test_no_end_of_data_before_the_terminator(body: bytes, cuts: list[int]) -> None:
    """Whatever the body, the payload holds no end of data, strict or lax, but its own."""
    bounds = [0, *sorted(c % (len(body) + 1) for c in cuts), len(body)]
    wire = encode([body[a:b] for a, b in itertools.pairwise(bounds)])
    before = wire[: -len(b".\r\n")]
    assert b"\r\n.\r\n" not in b"\r\n" + before
    assert LAX_END.search(b"\r\n" + before) is None
    for line in before.split(b"\r\n"):
        # No line starts with NULs and then a single dot (NULs never reach the wire at all).
        assert not line.lstrip(b"\x00").startswith(b".") or line.startswith(b"..")
    assert b"\x00" not in wire


@given(chunked())
def test_unstuff_inverts_without_folding(case: tuple[bytes, list[bytes]]) -> None:
    body, chunks = case
    assert dot_unstuff(encode(chunks, 0)) == ref_normalise(body)


@given(chunked())
def test_feed_pieces_concatenate(case: tuple[bytes, list[bytes]]) -> None:
    """Each piece from feed() is final: concatenating them is the whole payload."""
    body, chunks = case
    stuffer = DotStuffer(5)
    pieces = [stuffer.feed(chunk) for chunk in chunks]
    assert b"".join(pieces) + stuffer.finish() == ref_encode(body, 5)


# ``_fits`` lets the encoder skip the exact folding code; a wrong True would let an over-long
# line out, so its soundness is tested on its own, on CRLF-only text as it receives.
@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=20),
    st.integers(0, 12),
    st.integers(2, 12),
)
def test_fits_is_sound(lengths: list[int], col: int, limit: int) -> None:
    col = min(col, limit)
    wire = b"\r\n".join(b"x" * n for n in lengths)
    if _fits(wire, col, limit):
        lines = wire.split(b"\r\n")
        assert col + len(lines[0]) <= limit
        assert all(len(line) <= limit for line in lines[1:])
