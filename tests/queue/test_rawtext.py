"""Line ends made CRLF and the header section found, as the raw upload streams in; and the
intake's address check against the SMTP receiver's."""

from __future__ import annotations

from email import policy
from email.parser import BytesParser
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.protocol.smtp_commands import CommandError, parse_rcpt
from zoneq.queue.intake import Unacceptable, check_address, check_recipient
from zoneq.queue.rawtext import CrlfLines, HeaderSection, SectionTooLong, crlf
from zoneq.receiver.relay import address_refusal

# Text made of the octets that matter here: line ends, colons, spaces, letters.
TEXT = st.lists(
    st.sampled_from([b"\r", b"\n", b"\r\n", b":", b" ", b"\t", b"a", b"B", b"From ", b"x: y"]),
    max_size=60,
).map(b"".join)


def streamed(data: bytes, cuts: list[int]) -> bytes:
    lines = CrlfLines()
    edges = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    out = b"".join(lines.feed(data[a:b]) for a, b in pairwise(edges))
    return out + lines.end()


@given(data=TEXT, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8))
def test_crlf_lines_wherever_the_text_is_cut(data: bytes, cuts: list[int]) -> None:
    """Property: however the text is cut, the result is the whole text made CRLF, with a
    last line end when it had text; and only CRLF ends a line in it."""
    out = streamed(data, cuts)
    whole = crlf(data)
    assert out == (whole + b"\r\n" if whole and not whole.endswith(b"\n") else whole)
    assert b"\r" not in out.replace(b"\r\n", b"") and b"\n" not in out.replace(b"\r\n", b"")
    assert out.splitlines() == data.splitlines()  # the same lines, by Python's own rule


@pytest.mark.parametrize(
    ("data", "out"),
    [
        (b"", b""),
        (b"a", b"a\r\n"),
        (b"a\r\n", b"a\r\n"),
        (b"a\n", b"a\r\n"),
        (b"a\r", b"a\r\n"),
        (b"a\r\r\n", b"a\r\n\r\n"),
        (b"a\n\r", b"a\r\n\r\n"),
        (b"\r\n\r\n", b"\r\n\r\n"),
        (b"a\rb\nc\r\nd", b"a\r\nb\r\nc\r\nd\r\n"),
    ],
)
def test_crlf_lines_table(data: bytes, out: bytes) -> None:
    assert streamed(data, []) == out
    assert streamed(data, list(range(len(data)))) == out  # one octet at a time


@given(data=TEXT, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8))
def test_header_section_ends_where_the_email_parser_says(data: bytes, cuts: list[int]) -> None:
    """Property: the section found, pieces fed in any cut, parses to the same fields as
    the whole message does in ``email``, and what follows it is the parser's body."""
    text = streamed(data, [])
    found = HeaderSection()
    edges = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    fed = 0
    for a, b in pairwise(edges):
        fed = b
        if found.feed(text[a:b]):
            break  # the rest goes on as body text, past the section
    found.finish()
    whole = BytesParser(policy=policy.compat32).parsebytes(text)
    part = BytesParser(policy=policy.compat32).parsebytes(found.section)
    assert part.items() == whole.items()
    rest = found.rest + text[fed:]
    assert found.section + rest == text
    first = rest.split(b"\r\n", 1)[0]
    # The section ended at a line that is the body's first.  (Unless a "From " line ends
    # the section: the parser takes that for the body's first line, a quirk with no field
    # in it, so no matter for what is parsed, removed or taken.)
    if first and not found.section.startswith(b"From ") and b"\nFrom " not in found.section:
        assert whole.get_payload().encode("ascii", "surrogateescape").startswith(first)


def test_header_section_past_the_limit_is_refused() -> None:
    found = HeaderSection(limit=100)
    assert not found.feed(b"A: 1\r\n" * 16)
    with pytest.raises(SectionTooLong, match="longer than 100"):
        found.feed(b"A: 1\r\n" * 2)
    # Ending in the very piece that takes it past the limit is no way around it.
    with pytest.raises(SectionTooLong):
        HeaderSection(limit=100).feed(b"A: 1\r\n" * 20 + b"\r\nbody\r\n")
    ended = HeaderSection(limit=100)
    assert ended.feed(b"A: 1\r\n\r\n" + b"body " * 100)  # a long body is no matter
    assert ended.section == b"A: 1\r\n"


# --- addresses ---------------------------------------------------------------------------

ACCEPTED = [
    "bob@ok.test",
    "b.o+b@sub.ok.test",
    '"odd@local"@ok.test',
    "bob@[192.0.2.1]",
    "bob@[IPv6:2001:db8::1]",
    "jörg@bücher.test",
    "a" * 64 + "@ok.test",
    "b@" + "a" * 63 + ".test",
    "b@_dmarc.ok.test",
]
REFUSED = [
    ("", "empty"),
    ("bob", "local-part@domain"),
    ("bob@", "local-part@domain"),
    ("@ok.test", "local-part@domain"),
    ("a@b@c.test", "dot-string"),
    ("a(b)@ok.test", "dot-string"),
    ("bob@[1.2.3.4", "closing ]"),
    ("bob@[1.2.3.400]", "not an IP"),
    ("bob@[IPv6:zz]", "not an IP"),
    ("bob@1.2.3.4]", "not a domain label"),
    ("bob@ok.test.", "empty domain label"),
    ("bob@ok..test", "empty domain label"),
    ("b@" + "a" * 64 + ".test", "longer than 63"),
    ("b@" + "é" * 32 + ".test", "longer than 63"),  # 32 characters, 64 octets
    ("a" * 65 + "@ok.test", "too long"),
    ("é" * 33 + "@ok.test", "too long"),
    ("b@" + ".".join(["a" * 60] * 5), "longer than 254"),
    ("bob @ok.test", "whitespace"),
    ("bob@ok.test\r\nRCPT", "whitespace"),
]


@pytest.mark.parametrize("address", ACCEPTED)
def test_check_address_accepts(address: str) -> None:
    assert check_address(address) == address
    assert check_recipient(address) == address


@pytest.mark.parametrize(("address", "needle"), REFUSED)
def test_check_address_refuses_naming_the_problem(address: str, needle: str) -> None:
    with pytest.raises(Unacceptable, match=needle.replace("[", r"\[").replace("(", r"\(")):
        check_address(address)


def test_percent_hack_is_refused_for_recipients_as_the_receiver_does() -> None:
    address = "victim%evil.test@ok.test"
    assert address_refusal(address, None) is not None
    assert check_address(address, what="sender") == address  # a sender asks no relaying
    with pytest.raises(Unacceptable, match="percent-hack"):
        check_recipient(address)


ADDRESS_TEXT = st.lists(
    st.sampled_from([*'ab.@[]%"-_:é1 (\\', "IPv6:", "192.0.2.1", "::1"]), max_size=30
).map("".join)


@given(address=ADDRESS_TEXT)
def test_what_the_api_queues_the_smtp_receiver_takes(address: str) -> None:
    """Property: an address the intake takes as a recipient is one the SMTP receiver
    takes at RCPT (its syntax, and its relay rule), so the API is no way around either."""
    try:
        check_recipient(address)
    except Unacceptable:
        return
    try:
        command = parse_rcpt(f"TO:<{address}>", esmtp=True, smtputf8=True)
    except CommandError as exc:
        raise AssertionError(f"{address!r}: the receiver refuses it: {exc.reply}") from None
    assert address_refusal(command.recipient, command.route) is None
