"""Tests for zoneq.protocol.replies: parsing, rendering, classification, categories."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from zoneq.errors import ProtocolError
from zoneq.protocol.replies import (
    INSUFFICIENT_STORAGE,
    LOCAL_ERROR,
    Category,
    EnhancedStatus,
    Reply,
    Stage,
    Verdict,
    categorize,
    classify,
    classify_connection_failure,
    parse_reply,
    reply_from_text,
)

E = EnhancedStatus

# --- EnhancedStatus -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5.1.1", E(5, 1, 1)),
        ("2.0.0", E(2, 0, 0)),
        ("4.7.1", E(4, 7, 1)),
        ("5.999.999", E(5, 999, 999)),
        ("4.10.20", E(4, 10, 20)),
        ("5.7.26", E(5, 7, 26)),
    ],
)
def test_enhanced_parse_valid(text: str, expected: EnhancedStatus) -> None:
    assert EnhancedStatus.parse(text) == expected
    assert str(expected) == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "5.1",
        "5.1.1.1",
        "3.1.1",  # class must be 2, 4 or 5
        "1.0.0",
        "6.0.0",
        "0.0.0",
        "5.01.1",  # leading zeros are forbidden (RFC 3463 section 2)
        "5.1.01",
        "5.00.0",
        "05.1.1",
        "5.1000.1",  # at most three digits
        "5.1.1000",
        "5..1",
        "5.1.",
        " 5.1.1",
        "5.1.1 ",
        "5.1.1x",
        "5.a.1",
        "5.1.-1",
        "5.\u0661.1",  # non-ASCII digit
        "5,1,1",
    ],
)
def test_enhanced_parse_invalid(text: str) -> None:
    assert EnhancedStatus.parse(text) is None


@pytest.mark.parametrize(
    ("klass", "subject", "detail"),
    [(3, 0, 0), (6, 0, 0), (5, -1, 0), (5, 1000, 0), (5, 0, -1), (5, 0, 1000)],
)
def test_enhanced_constructor_validates(klass: int, subject: int, detail: int) -> None:
    with pytest.raises(ValueError, match="enhanced status"):
        EnhancedStatus(klass, subject, detail)


@given(st.sampled_from([2, 4, 5]), st.integers(0, 999), st.integers(0, 999))
def test_enhanced_str_parse_round_trips(klass: int, subject: int, detail: int) -> None:
    status = EnhancedStatus(klass, subject, detail)
    assert EnhancedStatus.parse(str(status)) == status


# --- parse_reply: valid ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        # Single line, with the various line endings and none.
        ([b"250 OK\r\n"], Reply(250, ("OK",))),
        ([b"250 OK\n"], Reply(250, ("OK",))),
        ([b"250 OK"], Reply(250, ("OK",))),
        # Bare code and code with an empty text (RFC 5321 section 4.2).
        ([b"250\r\n"], Reply(250, ("",))),
        ([b"250 \r\n"], Reply(250, ("",))),
        # Text is kept as is, including inner and trailing spaces.
        ([b"250  two  spaces \r\n"], Reply(250, (" two  spaces ",))),
        # Enhanced code (RFC 2034).
        ([b"550 5.1.1 User unknown\r\n"], Reply(550, ("User unknown",), E(5, 1, 1))),
        ([b"250 2.0.0\r\n"], Reply(250, ("",), E(2, 0, 0))),
        ([b"250 2.0.0 \r\n"], Reply(250, ("",), E(2, 0, 0))),
        ([b"451 4.3.0  spaced\r\n"], Reply(451, (" spaced",), E(4, 3, 0))),
        # Enhanced code whose class disagrees with the reply: ignored, text kept whole.
        ([b"550 4.1.1 odd\r\n"], Reply(550, ("4.1.1 odd",))),
        ([b"250 5.0.0 odd\r\n"], Reply(250, ("5.0.0 odd",))),
        ([b"354 2.0.0 go ahead\r\n"], Reply(354, ("2.0.0 go ahead",))),
        # Malformed enhanced code: just text.
        ([b"550 5.01.1 x\r\n"], Reply(550, ("5.01.1 x",))),
        ([b"550 5.1.1x y\r\n"], Reply(550, ("5.1.1x y",))),
        # Multi-line (RFC 5321 section 4.2.1).
        (
            [b"250-mx.example.org\r\n", b"250-PIPELINING\r\n", b"250 8BITMIME\r\n"],
            Reply(250, ("mx.example.org", "PIPELINING", "8BITMIME")),
        ),
        ([b"250-first\r\n", b"250\r\n"], Reply(250, ("first", ""))),
        ([b"250-\r\n", b"250 last\r\n"], Reply(250, ("", "last"))),
        # Enhanced code on every line (RFC 2034 section 4): stripped from each.
        (
            [b"550-5.7.1 Blocked.\r\n", b"550-5.7.1 See\r\n", b"550 5.7.1 https://x\r\n"],
            Reply(550, ("Blocked.", "See", "https://x"), E(5, 7, 1)),
        ),
        # Enhanced code on the first line only.
        (
            [b"452-4.2.2 Mailbox full\r\n", b"452 try later\r\n"],
            Reply(452, ("Mailbox full", "try later"), E(4, 2, 2)),
        ),
        # A different code on a later line is left in the text.
        (
            [b"550-5.1.1 No such user\r\n", b"550 5.7.1 and policy\r\n"],
            Reply(550, ("No such user", "5.7.1 and policy"), E(5, 1, 1)),
        ),
        # Later lines are not searched when the first line has no enhanced code.
        ([b"550-No\r\n", b"550 5.1.1 user\r\n"], Reply(550, ("No", "5.1.1 user"))),
        # Text is UTF-8; undecodable bytes are replaced, not fatal.
        ([b"250 d\xc3\xa9j\xc3\xa0 vu\r\n"], Reply(250, ("déjà vu",))),
        ([b"250 bad \xff byte\r\n"], Reply(250, ("bad \ufffd byte",))),
        # Codes outside RFC 5321's grammar that we still accept (classify deals with them).
        ([b"150 preliminary\r\n"], Reply(150, ("preliminary",))),
        ([b"599 x\r\n"], Reply(599, ("x",))),
        ([b"299 x\r\n"], Reply(299, ("x",))),
    ],
)
def test_parse_reply_valid(lines: list[bytes], expected: Reply) -> None:
    assert parse_reply(lines) == expected


def test_parse_reply_accepts_any_sequence() -> None:
    assert parse_reply((b"221 bye\r\n",)) == Reply(221, ("bye",))


# --- parse_reply: malformed -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "problem"),
    [
        ([], "empty reply"),
        ([b""], "does not start with a code"),
        ([b"\r\n"], "does not start with a code"),
        ([b"25\r\n"], "does not start with a code"),
        ([b"2a0 OK\r\n"], "does not start with a code"),
        ([b"abc def\r\n"], "does not start with a code"),
        ([b" 250 OK\r\n"], "does not start with a code"),
        ([b"-250 OK\r\n"], "does not start with a code"),
        ([b"\xd9\xa350 OK\r\n"], "does not start with a code"),  # non-ASCII digit
        ([b"000 x\r\n"], "out of range"),
        ([b"099 x\r\n"], "out of range"),
        ([b"600 x\r\n"], "out of range"),
        ([b"999 x\r\n"], "out of range"),
        ([b"250x\r\n"], "expected '-' or space"),
        ([b"2500 OK\r\n"], "expected '-' or space"),
        ([b"250\tOK\r\n"], "expected '-' or space"),
        ([b"250-OK\r\n", b"251 OK\r\n"], "mixes codes 250 and 251"),
        ([b"250-a\r\n", b"250-b\r\n", b"550 c\r\n"], "mixes codes"),
        ([b"250-OK\r\n"], "incomplete"),
        ([b"250-a\r\n", b"250-b\r\n"], "incomplete"),
        ([b"250 a\r\n", b"250 b\r\n"], "after its final line"),
        ([b"250 a\r\n", b"250-b\r\n", b"250 c\r\n"], "after its final line"),
        ([b"250 a\rb\r\n"], "bare CR or LF"),
        ([b"250 a\nb\r\n"], "bare CR or LF"),
        ([b"250 a\r\r\n"], "bare CR or LF"),
        ([b"250-a\r\n", b"250 b\n\n"], "bare CR or LF"),
    ],
)
def test_parse_reply_malformed(lines: list[bytes], problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        parse_reply(lines)


@given(st.lists(st.binary(max_size=20), max_size=4))
def test_parse_reply_only_raises_protocol_error(lines: list[bytes]) -> None:
    try:
        reply = parse_reply(lines)
    except ProtocolError:
        return
    assert 100 <= reply.code <= 599


# --- reply_from_text ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "text", "expected"),
    [
        (250, "OK", Reply(250, ("OK",))),
        (550, "5.1.1 User unknown", Reply(550, ("User unknown",), E(5, 1, 1))),
        (550, "5.7.1 Blocked\n5.7.1 see url", Reply(550, ("Blocked", "see url"), E(5, 7, 1))),
        (250, "", Reply(250, ("",))),
        (550, "4.1.1 mismatch", Reply(550, ("4.1.1 mismatch",))),
        # A remote server's CR: trailing ones dropped, one inside the text a space.
        (250, "OK\r", Reply(250, ("OK",))),
        (250, "a\rb", Reply(250, ("a b",))),
        (554, "5.7.1 blocked\rusing zen", Reply(554, ("blocked using zen",), E(5, 7, 1))),
        (550, "5.7.1 one\r\r\n5.7.1 two", Reply(550, ("one", "two"), E(5, 7, 1))),
    ],
)
def test_reply_from_text(code: int, text: str, expected: Reply) -> None:
    assert reply_from_text(code, text) == expected


@pytest.mark.parametrize(
    ("code", "text", "problem"),
    [(-1, "x", "out of range"), (600, "x", "out of range")],
)
def test_reply_from_text_invalid(code: int, text: str, problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        reply_from_text(code, text)


# --- Reply value ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "lines", "enhanced", "problem"),
    [
        (99, ("x",), None, "100-599"),
        (600, ("x",), None, "100-599"),
        (250, (), None, "at least one line"),
        (250, ("a\r\nb",), None, "CR or LF"),
        (250, ("ok", "a\nb"), None, "CR or LF"),
        (250, ("a\rb",), None, "CR or LF"),
        (550, ("x",), E(4, 1, 1), "does not match"),
        (250, ("x",), E(5, 0, 0), "does not match"),
        (354, ("x",), E(2, 0, 0), "does not match"),
    ],
)
def test_reply_constructor_validates(
    code: int, lines: tuple[str, ...], enhanced: EnhancedStatus | None, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        Reply(code, lines, enhanced)


def test_reply_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        LOCAL_ERROR.code = 250  # type: ignore[misc]


@pytest.mark.parametrize(
    ("code", "positive", "transient", "permanent"),
    [
        (150, False, False, False),
        (220, True, False, False),
        (250, True, False, False),
        (354, False, False, False),
        (421, False, True, False),
        (451, False, True, False),
        (550, False, False, True),
        (554, False, False, True),
    ],
)
def test_reply_class_properties(
    code: int, positive: bool, transient: bool, permanent: bool
) -> None:
    reply = Reply(code, ("x",))
    assert reply.is_positive is positive
    assert reply.is_transient is transient
    assert reply.is_permanent is permanent


def test_reply_text_joins_lines() -> None:
    assert Reply(250, ("a", "b", "")).text == "a\nb\n"
    assert Reply(250, ("",)).text == ""


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (Reply(550, ("User unknown",), E(5, 1, 1)), "550 5.1.1 User unknown"),
        (Reply(250, ("OK",)), "250 OK"),
        (Reply(250, ("",)), "250"),
        (Reply(250, ("",), E(2, 0, 0)), "250 2.0.0"),
        (Reply(550, ("Blocked.", "", "  See url  "), E(5, 7, 1)), "550 5.7.1 Blocked. See url"),
        (Reply(421, ("a", "b")), "421 a b"),
    ],
)
def test_reply_str_is_one_line(reply: Reply, expected: str) -> None:
    assert str(reply) == expected


# --- to_wire --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "wire"),
    [
        (Reply(250, ("OK",)), b"250 OK\r\n"),
        (Reply(250, ("",)), b"250\r\n"),
        (Reply(250, ("",), E(2, 0, 0)), b"250 2.0.0\r\n"),
        (Reply(550, ("User unknown",), E(5, 1, 1)), b"550 5.1.1 User unknown\r\n"),
        (Reply(250, ("a", "b", "c")), b"250-a\r\n250-b\r\n250 c\r\n"),
        (Reply(250, ("a", "")), b"250-a\r\n250\r\n"),
        (Reply(250, ("", "b")), b"250-\r\n250 b\r\n"),
        # RFC 2034 section 4: the enhanced code on every line.
        (
            Reply(550, ("Blocked.", "See url"), E(5, 7, 1)),
            b"550-5.7.1 Blocked.\r\n550 5.7.1 See url\r\n",
        ),
        (Reply(250, ("", ""), E(2, 0, 0)), b"250-2.0.0\r\n250 2.0.0\r\n"),
        (Reply(250, ("déjà",)), "250 déjà\r\n".encode()),
    ],
)
def test_to_wire(reply: Reply, wire: bytes) -> None:
    assert reply.to_wire() == wire
    assert parse_reply(wire.splitlines(keepends=True)) == reply


def test_local_fault_replies() -> None:
    # RFC 5321 section 4.2.2 codes and texts, RFC 3463 section 3.4 enhanced codes.
    assert LOCAL_ERROR.to_wire() == (
        b"451 4.3.0 Requested action aborted: local error in processing\r\n"
    )
    assert INSUFFICIENT_STORAGE.to_wire() == (
        b"452 4.3.1 Requested action not taken: insufficient system storage\r\n"
    )
    assert LOCAL_ERROR.is_transient
    assert INSUFFICIENT_STORAGE.is_transient
    assert categorize(LOCAL_ERROR) is Category.MAIL_SYSTEM
    assert categorize(INSUFFICIENT_STORAGE) is Category.MAIL_SYSTEM


# Text for reply lines: anything but CR and LF (and lone surrogates, which are not text).
line_text = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=30)


@st.composite
def replies(draw: st.DrawFn) -> Reply:
    code = draw(st.integers(100, 599))
    enhanced = None
    if code // 100 in (2, 4, 5) and draw(st.booleans()):
        enhanced = EnhancedStatus(code // 100, draw(st.integers(0, 999)), draw(st.integers(0, 999)))
    lines = tuple(draw(st.lists(line_text, min_size=1, max_size=5)))
    if enhanced is None:
        # The one ambiguous case (see Reply.to_wire): without an enhanced code, a first
        # line that starts with one would read back as having it.
        token, _, _ = lines[0].partition(" ")
        status = EnhancedStatus.parse(token)
        assume(status is None or status.klass != code // 100)
    return Reply(code, lines, enhanced)


@given(replies())
def test_to_wire_parse_reply_round_trips(reply: Reply) -> None:
    wire = reply.to_wire()
    assert wire.endswith(b"\r\n")
    assert parse_reply(wire.splitlines(keepends=True)) == reply
    # Also when the transport has already removed the line endings.
    assert parse_reply(wire.split(b"\r\n")[:-1]) == reply


@given(replies())
def test_wire_lines_each_carry_code_and_enhanced(reply: Reply) -> None:
    wire_lines = reply.to_wire().split(b"\r\n")[:-1]
    assert len(wire_lines) == len(reply.lines)
    for line in wire_lines:
        assert line[:3] == str(reply.code).encode()
        if reply.enhanced is not None:
            assert line[4:].split(b" ")[0] == str(reply.enhanced).encode()


@given(replies())
def test_str_is_a_single_line(reply: Reply) -> None:
    text = str(reply)
    assert "\r" not in text
    assert "\n" not in text
    assert text.startswith(str(reply.code))


# --- classify -------------------------------------------------------------------------------

D, F, B, N = Verdict.DONE, Verdict.DEFER, Verdict.BOUNCE, Verdict.NEXT_HOST

# Columns: one representative code per case that matters.
CODES = (150, 220, 250, 334, 354, 301, 421, 450, 451, 452, 550, 552, 554)
# Rows: the expected verdict for every stage and every column above.
EXPECTED: dict[Stage, tuple[Verdict, ...]] = {
    #                  150 220 250 334 354 301 421 450 451 452 550 552 554
    Stage.CONNECT: (N, D, D, N, N, N, N, N, N, N, N, N, N),
    # RFC 5321 sections 3.1 and 4.3.2, RFC 3207 section 4: each has one success, and any
    # other 2yz (a 250 greeting, a second 220 banner read as the EHLO reply) is no session.
    Stage.GREETING: (N, D, N, N, N, N, N, N, N, N, N, N, N),
    Stage.EHLO: (N, N, D, N, N, N, N, N, N, N, N, N, N),
    Stage.STARTTLS: (N, D, N, N, N, N, N, N, N, N, N, N, N),
    Stage.AUTH: (N, D, D, D, N, N, N, N, N, N, N, N, N),
    Stage.MAIL: (F, D, D, F, F, F, N, F, F, F, B, B, B),
    # RFC 5321 section 4.5.3.1.10: 552 to RCPT is "too many recipients", taken as 452.
    Stage.RCPT: (F, D, D, F, F, F, N, F, F, F, B, F, B),
    # RFC 5321 sections 4.1.1.4 and 4.3.2: DATA's only success is 354; a 2yz is out of step.
    Stage.DATA: (F, F, F, F, D, F, N, F, F, F, B, B, B),
    Stage.END_OF_DATA: (F, D, D, F, F, F, N, F, F, F, B, B, B),
    Stage.RSET: (N, D, D, N, N, N, N, N, N, N, N, N, N),
    Stage.QUIT: (D, D, D, D, D, D, D, D, D, D, D, D, D),
}


def test_expected_table_covers_every_stage() -> None:
    assert set(EXPECTED) == set(Stage)
    assert all(len(row) == len(CODES) for row in EXPECTED.values())


@pytest.mark.parametrize(
    ("stage", "code", "verdict"),
    [
        pytest.param(stage, code, verdict, id=f"{stage}-{code}")
        for stage, row in EXPECTED.items()
        for code, verdict in zip(CODES, row, strict=True)
    ],
)
def test_classify_table(stage: Stage, code: int, verdict: Verdict) -> None:
    assert classify(Reply(code, ("text",)), stage) is verdict


@pytest.mark.parametrize(
    ("reply", "stage", "verdict"),
    [
        # A 554 greeting refuses the session, not the recipient (RFC 5321 section 3.1).
        (Reply(554, ("No SMTP service here",)), Stage.GREETING, N),
        # A 2yz other than the stage's one success sets no session up: never DONE, which
        # would mark every recipient delivered (only the final dot's 2yz delivers).
        (Reply(250, ("mx ESMTP",)), Stage.GREETING, N),
        (Reply(220, ("mx ESMTP",)), Stage.EHLO, N),
        (Reply(252, ("hm",), E(2, 0, 0)), Stage.EHLO, N),
        (Reply(250, ("Ok",)), Stage.STARTTLS, N),
        # 421 from anywhere means the server is closing the channel (RFC 5321 section 3.8).
        (Reply(421, ("closing",), E(4, 4, 2)), Stage.RCPT, N),
        (Reply(421, ("closing",)), Stage.END_OF_DATA, N),
        # Typical recipient and content outcomes.
        (Reply(550, ("User unknown",), E(5, 1, 1)), Stage.RCPT, B),
        (Reply(452, ("Too many recipients",), E(4, 5, 3)), Stage.RCPT, F),
        # 552 to RCPT is the older form of the same (RFC 5321 section 4.5.3.1.10).
        (Reply(552, ("Too many recipients",), E(5, 5, 3)), Stage.RCPT, F),
        # A 250 to DATA: no body was sent, so nothing was delivered (RFC 5321 4.3.2).
        (Reply(250, ("Ok",), E(2, 0, 0)), Stage.DATA, F),
        (Reply(552, ("Message too big",), E(5, 3, 4)), Stage.END_OF_DATA, B),
        (Reply(451, ("Greylisted",), E(4, 7, 1)), Stage.RCPT, F),
        (Reply(250, ("Queued as ABC",), E(2, 0, 0)), Stage.END_OF_DATA, D),
        # Authentication trouble is about the host or our credentials (RFC 4954 codes).
        (Reply(535, ("Bad credentials",), E(5, 7, 8)), Stage.AUTH, N),
        (Reply(454, ("Try later",), E(4, 7, 0)), Stage.AUTH, N),
        # Our own local-error replies, should they ever be seen from a peer.
        (LOCAL_ERROR, Stage.RCPT, F),
        (INSUFFICIENT_STORAGE, Stage.MAIL, F),
        # The enhanced code does not change the verdict: the basic code decides.
        (Reply(550, ("x",), E(5, 7, 1)), Stage.MAIL, B),
    ],
)
def test_classify_examples(reply: Reply, stage: Stage, verdict: Verdict) -> None:
    assert classify(reply, stage) is verdict


@given(replies(), st.sampled_from(Stage))
def test_classify_invariants(reply: Reply, stage: Stage) -> None:
    verdict = classify(reply, stage)
    only_success = {Stage.GREETING: 220, Stage.EHLO: 250, Stage.STARTTLS: 220}
    if reply.is_positive and stage is not Stage.DATA:
        assert (verdict is Verdict.DONE) is (only_success.get(stage, reply.code) == reply.code)
    if stage is Stage.DATA:
        # RFC 5321 section 4.3.2: 354 is DATA's only success; nothing else delivers.
        assert (verdict is Verdict.DONE) is (reply.code == 354)
    if stage is Stage.RCPT and reply.code in (452, 552):
        # RFC 5321 section 4.5.3.1.10: too many recipients, temporary either way.
        assert verdict is Verdict.DEFER
    if verdict is Verdict.BOUNCE:
        # Only a 5yz bounces, and never one about the session rather than the recipient.
        assert reply.is_permanent
        assert stage in (Stage.MAIL, Stage.RCPT, Stage.DATA, Stage.END_OF_DATA)
    if stage is not Stage.QUIT and (reply.is_transient or reply.is_permanent):
        assert verdict is not Verdict.DONE
    if reply.code == 421 and stage is not Stage.QUIT:
        assert verdict is Verdict.NEXT_HOST


@pytest.mark.parametrize(
    ("stage", "verdict"),
    [(stage, D if stage is Stage.QUIT else N) for stage in Stage],
)
def test_classify_connection_failure(stage: Stage, verdict: Verdict) -> None:
    assert classify_connection_failure(stage) is verdict


# --- categorize -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "category"),
    [
        (E(5, 0, 0), Category.OTHER),
        (E(5, 1, 1), Category.ADDRESSING),
        (E(5, 2, 2), Category.MAILBOX),
        (E(4, 3, 1), Category.MAIL_SYSTEM),
        (E(4, 4, 1), Category.NETWORK),
        (E(5, 5, 3), Category.PROTOCOL),
        (E(5, 6, 1), Category.CONTENT),
        (E(5, 7, 1), Category.POLICY),
        (E(5, 8, 0), Category.OTHER),
        (E(5, 999, 0), Category.OTHER),
        (E(2, 1, 5), Category.ADDRESSING),
    ],
)
def test_categorize_by_enhanced_subject(status: EnhancedStatus, category: Category) -> None:
    code = {2: 250, 4: 450, 5: 550}[status.klass]
    assert categorize(Reply(code, ("x",), status)) is category


def test_enhanced_subject_wins_over_basic_code() -> None:
    # 550 alone would be ADDRESSING; the enhanced code says policy.
    assert categorize(Reply(550, ("Spam",), E(5, 7, 1))) is Category.POLICY


@pytest.mark.parametrize(
    ("code", "category"),
    [
        (250, Category.OTHER),
        (354, Category.OTHER),
        (421, Category.MAIL_SYSTEM),
        (450, Category.MAILBOX),
        (451, Category.MAIL_SYSTEM),
        (452, Category.MAIL_SYSTEM),
        (454, Category.POLICY),
        (455, Category.PROTOCOL),
        (500, Category.PROTOCOL),
        (501, Category.PROTOCOL),
        (502, Category.PROTOCOL),
        (503, Category.PROTOCOL),
        (504, Category.PROTOCOL),
        (530, Category.POLICY),
        (534, Category.POLICY),
        (535, Category.POLICY),
        (538, Category.POLICY),
        (550, Category.ADDRESSING),
        (551, Category.ADDRESSING),
        (552, Category.MAILBOX),
        (553, Category.ADDRESSING),
        (554, Category.POLICY),
        (555, Category.PROTOCOL),
        (599, Category.OTHER),
        (471, Category.OTHER),
    ],
)
def test_categorize_by_basic_code(code: int, category: Category) -> None:
    assert categorize(Reply(code, ("x",))) is category


def test_enum_values_are_stable_strings() -> None:
    # Stored in analytics and logs: renaming a value is a data migration.
    assert [c.value for c in Category] == [
        "other",
        "addressing",
        "mailbox",
        "mail_system",
        "network",
        "protocol",
        "content",
        "policy",
    ]
    assert [v.value for v in Verdict] == ["done", "defer", "bounce", "next_host"]
    assert Stage.END_OF_DATA.value == "end_of_data"
