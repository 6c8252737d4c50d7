"""Tests for zoneq.protocol.smtp_server: the sans-IO SMTP server state machine."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoneq.protocol.dsn import Notify, Ret
from zoneq.protocol.replies import EnhancedStatus, Reply, parse_reply
from zoneq.protocol.smtp_commands import BodyType
from zoneq.protocol.smtp_server import (
    SASL_RESPONSE_LIMIT,
    AuthRequest,
    AuthResponse,
    DataChunk,
    DataEnd,
    DataStart,
    DecisionError,
    Event,
    Hello,
    MailFrom,
    Quit,
    RcptTo,
    Reset,
    ServerConnection,
    StartTLS,
    State,
    _long_line,
)

Policy = Callable[[Event], Reply | None]


def accept_all(event: Event) -> Reply | None:
    return None


def make(**kwargs: object) -> ServerConnection:
    options: dict[str, object] = {"max_message_size": 10_000}
    options.update(kwargs)
    return ServerConnection("mx.example", **options)  # type: ignore[arg-type]


def settle(conn: ServerConnection, events: list[Event], policy: Policy) -> list[Event]:
    """Answer every pending decision with ``policy`` (None: accept, a Reply: reject)."""
    out = list(events)
    while conn.pending is not None:
        reply = policy(conn.pending)
        out += conn.accept() if reply is None else conn.reject(reply)
    return out


def drive(
    chunks: Iterable[bytes], policy: Policy = accept_all, conn: ServerConnection | None = None
) -> tuple[list[Event], list[str]]:
    """Feed ``chunks`` one by one; returns merged events and the replies as short strings."""
    conn = conn or make()
    events: list[Event] = []
    wire = b""
    for chunk in chunks:
        events += settle(conn, conn.receive(chunk), policy)
        wire += conn.data_to_send()
    return merge(events), replies(wire)


def merge(events: list[Event]) -> list[Event]:
    """Join consecutive DataChunks: chunk boundaries carry no meaning."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, DataChunk) and out and isinstance(out[-1], DataChunk):
            out[-1] = DataChunk(out[-1].data + event.data)
        else:
            out.append(event)
    return out


def parse_replies(wire: bytes) -> list[Reply]:
    result: list[Reply] = []
    group: list[bytes] = []
    for line in wire.split(b"\r\n")[:-1]:
        group.append(line)
        if line[3:4] != b"-":
            result.append(parse_reply(group))
            group = []
    assert not group, "incomplete reply on the wire"
    return result


def replies(wire: bytes) -> list[str]:
    """``250 2.1.0`` style (code and enhanced status) for each reply."""
    return [f"{r.code} {r.enhanced}" if r.enhanced else str(r.code) for r in parse_replies(wire)]


def session(data: bytes, policy: Policy = accept_all, **kwargs: object) -> list[str]:
    return drive([data], policy, make(**kwargs))[1]


EHLO = b"EHLO client.example\r\n"
MAIL = b"MAIL FROM:<a@example.org>\r\n"
RCPT = b"RCPT TO:<b@example.net>\r\n"
TX = EHLO + MAIL + RCPT + b"DATA\r\n"
TX_REPLIES = ["250", "250 2.1.0", "250 2.1.5", "354"]


# --- greeting and EHLO ----------------------------------------------------------------------


def test_greeting() -> None:
    assert make().greeting() == b"220 mx.example ESMTP\r\n"


def ehlo_keywords(**kwargs: object) -> list[str]:
    conn = make(**kwargs)
    conn.receive(EHLO)
    (reply,) = parse_replies(conn.data_to_send())
    assert reply.code == 250
    assert reply.lines[0] == "mx.example"
    return list(reply.lines[1:])


BASE_KEYWORDS = ["PIPELINING", "SIZE 10000", "8BITMIME", "ENHANCEDSTATUSCODES", "SMTPUTF8", "DSN"]


@pytest.mark.parametrize(
    ("options", "extra"),
    [
        ({}, []),
        ({"tls_offered": True}, ["STARTTLS"]),
        ({"tls_offered": True, "tls_active": True}, []),
        ({"auth_offered": True}, []),  # AUTH only over TLS
        ({"auth_offered": True, "tls_active": True}, ["AUTH PLAIN LOGIN"]),
        (
            {"auth_offered": True, "tls_offered": True, "tls_active": True},
            ["AUTH PLAIN LOGIN"],
        ),
    ],
)
def test_ehlo_keywords(options: dict[str, object], extra: list[str]) -> None:
    assert ehlo_keywords(**options) == BASE_KEYWORDS + extra


def test_helo_has_one_line_and_no_extensions() -> None:
    conn = make()
    events = conn.receive(b"HELO client.example\r\n")
    assert events == [Hello("HELO", "client.example")]
    assert conn.data_to_send() == b"250 mx.example\r\n"
    # RFC 1869: no ESMTP parameters after HELO.
    assert session(b"HELO c\r\nMAIL FROM:<a@b> SIZE=10\r\n") == ["250", "555 5.5.4"]


# --- table of sessions: bytes in, replies out ----------------------------------------------

SESSIONS: list[tuple[str, bytes, list[str]]] = [
    ("full transaction", TX + b"Hi\r\n.\r\nQUIT\r\n", [*TX_REPLIES, "250 2.0.0", "221 2.0.0"]),
    ("lower-case verbs", b"ehlo c\r\nmail from:<a@b>\r\nrcpt to:<c@d>\r\n", TX_REPLIES[:3]),
    ("noop", b"NOOP\r\nNOOP anything\r\n", ["250 2.0.0", "250 2.0.0"]),
    ("rset", EHLO + MAIL + b"RSET\r\n" + RCPT, ["250", "250 2.1.0", "250 2.0.0", "503 5.5.1"]),
    ("rset argument", b"RSET x\r\n", ["501 5.5.4"]),
    ("vrfy", b"VRFY someone\r\n", ["252 2.0.0"]),
    ("vrfy without argument", b"VRFY\r\n", ["501 5.5.4"]),
    ("expn", b"EXPN list\r\n", ["502 5.5.1"]),
    ("help", b"HELP\r\nHELP MAIL\r\n", ["214 2.0.0", "214 2.0.0"]),
    ("quit", b"QUIT\r\nNOOP\r\n", ["221 2.0.0"]),
    ("quit argument", b"QUIT now\r\n", ["501 5.5.4"]),
    ("unknown command", b"FOO bar\r\n", ["500 5.5.2"]),
    ("empty line", b"\r\n", ["500 5.5.2"]),
    ("no verb", b" NOOP\r\n", ["500 5.5.2"]),
    ("ehlo without domain", b"EHLO\r\n", ["501 5.5.4"]),
    ("ehlo two words", b"EHLO a b\r\n", ["501 5.5.4"]),
    ("mail before ehlo", MAIL, ["503 5.5.1"]),
    ("rcpt before ehlo", RCPT, ["503 5.5.1"]),
    ("data before ehlo", b"DATA\r\n", ["503 5.5.1"]),
    ("rcpt before mail", EHLO + RCPT, ["250", "503 5.5.1"]),
    ("data before mail", EHLO + b"DATA\r\n", ["250", "503 5.5.1"]),
    ("data without rcpt", EHLO + MAIL + b"DATA\r\n", ["250", "250 2.1.0", "503 5.5.1"]),
    ("data argument", EHLO + MAIL + RCPT + b"DATA x\r\n", [*TX_REPLIES[:3], "501 5.5.4"]),
    ("nested mail", EHLO + MAIL + MAIL, ["250", "250 2.1.0", "503 5.5.1"]),
    (
        "ehlo resets the transaction",
        EHLO + MAIL + EHLO + RCPT,
        ["250", "250 2.1.0", "250", "503 5.5.1"],
    ),
    ("null sender", EHLO + b"MAIL FROM:<>\r\n", ["250", "250 2.1.0"]),
    ("space after colon", EHLO + b"MAIL FROM: <a@b>\r\n", ["250", "250 2.1.0"]),
    ("mail no brackets", EHLO + b"MAIL FROM:a@b\r\n", ["250", "501 5.5.4"]),
    ("mail no colon", EHLO + b"MAIL FROM <a@b>\r\n", ["250", "501 5.5.4"]),
    ("mail unclosed", EHLO + b"MAIL FROM:<a@b\r\n", ["250", "501 5.5.4"]),
    ("mail no domain", EHLO + b"MAIL FROM:<ab>\r\n", ["250", "501 5.1.3"]),
    ("mail text after path", EHLO + b"MAIL FROM:<a@b>x\r\n", ["250", "501 5.5.4"]),
    ("mail space in address", EHLO + b"MAIL FROM:<a b@c>\r\n", ["250", "501 5.1.3"]),
    ("quoted local part", EHLO + b'MAIL FROM:<"a b>"@c>\r\n', ["250", "250 2.1.0"]),
    ("local part too long", EHLO + b"MAIL FROM:<" + b"x" * 65 + b"@c>\r\n", ["250", "501 5.1.3"]),
    ("postmaster", EHLO + MAIL + b"RCPT TO:<Postmaster>\r\n", ["250", "250 2.1.0", "250 2.1.5"]),
    ("unknown mail parameter", EHLO + b"MAIL FROM:<a@b> FOO=1\r\n", ["250", "555 5.5.4"]),
    (
        "unknown rcpt parameter",
        EHLO + MAIL + b"RCPT TO:<c@d> FOO\r\n",
        ["250", "250 2.1.0", "555 5.5.4"],
    ),
    ("binarymime", EHLO + b"MAIL FROM:<a@b> BODY=BINARYMIME\r\n", ["250", "504 5.5.4"]),
    ("bad body", EHLO + b"MAIL FROM:<a@b> BODY=9BIT\r\n", ["250", "501 5.5.4"]),
    ("bad size", EHLO + b"MAIL FROM:<a@b> SIZE=ten\r\n", ["250", "501 5.5.4"]),
    ("size without value", EHLO + b"MAIL FROM:<a@b> SIZE\r\n", ["250", "501 5.5.4"]),
    ("size over limit", EHLO + b"MAIL FROM:<a@b> SIZE=10001\r\n", ["250", "552 5.3.4"]),
    ("size at limit", EHLO + b"MAIL FROM:<a@b> SIZE=10000\r\n", ["250", "250 2.1.0"]),
    ("duplicate parameter", EHLO + b"MAIL FROM:<a@b> RET=FULL RET=HDRS\r\n", ["250", "501 5.5.4"]),
    ("bad ret", EHLO + b"MAIL FROM:<a@b> RET=ALL\r\n", ["250", "501 5.5.4"]),
    ("smtputf8 with value", EHLO + b"MAIL FROM:<a@b> SMTPUTF8=1\r\n", ["250", "501 5.5.4"]),
    ("envid not xtext", EHLO + b"MAIL FROM:<a@b> ENVID=a+zz\r\n", ["250", "501 5.5.4"]),
    (
        "envid too long",
        EHLO + b"MAIL FROM:<a@b> ENVID=" + b"x" * 101 + b"\r\n",
        ["250", "501 5.5.4"],
    ),
    ("non-ascii without smtputf8", EHLO + "MAIL FROM:<é@b>\r\n".encode(), ["250", "553 5.6.7"]),
    (
        "non-ascii with smtputf8",
        EHLO + "MAIL FROM:<é@b> SMTPUTF8\r\n".encode(),
        ["250", "250 2.1.0"],
    ),
    (
        "non-ascii rcpt needs smtputf8 mail",
        EHLO + MAIL + "RCPT TO:<é@b>\r\n".encode(),
        ["250", "250 2.1.0", "553 5.6.7"],
    ),
    ("invalid utf-8 command", b"NOOP \xff\r\n", ["500 5.5.2"]),
    (
        "notify never alone",
        EHLO + MAIL + b"RCPT TO:<c@d> NOTIFY=NEVER,SUCCESS\r\n",
        ["250", "250 2.1.0", "501 5.5.4"],
    ),
    (
        "notify unknown",
        EHLO + MAIL + b"RCPT TO:<c@d> NOTIFY=SOMETIMES\r\n",
        ["250", "250 2.1.0", "501 5.5.4"],
    ),
    (
        "notify duplicate",
        EHLO + MAIL + b"RCPT TO:<c@d> NOTIFY=DELAY,DELAY\r\n",
        ["250", "250 2.1.0", "501 5.5.4"],
    ),
    (
        "orcpt without type",
        EHLO + MAIL + b"RCPT TO:<c@d> ORCPT=c@d\r\n",
        ["250", "250 2.1.0", "501 5.5.4"],
    ),
    (
        "orcpt bad xtext",
        EHLO + MAIL + b"RCPT TO:<c@d> ORCPT=rfc822;c+4\r\n",
        ["250", "250 2.1.0", "501 5.5.4"],
    ),
    ("starttls not offered", EHLO + b"STARTTLS\r\n", ["250", "502 5.5.1"]),
    ("starttls already active", EHLO + b"STARTTLS\r\n", ["250", "503 5.5.1"]),
    ("auth not offered", EHLO + b"AUTH PLAIN\r\n", ["250", "502 5.5.1"]),
]
# Options for the sessions above that need more than the defaults.
_OPTIONS: dict[str, dict[str, object]] = {
    "starttls already active": {"tls_offered": True, "tls_active": True},
}


@pytest.mark.parametrize(("name", "data", "expected"), SESSIONS, ids=[s[0] for s in SESSIONS])
def test_session(name: str, data: bytes, expected: list[str]) -> None:
    assert session(data, **_OPTIONS.get(name, {})) == expected


def test_every_session_gives_the_same_result_byte_by_byte() -> None:
    for name, data, expected in SESSIONS:
        conn = make(**_OPTIONS.get(name, {}))
        assert drive([bytes([b]) for b in data], conn=conn)[1] == expected, name


# --- MAIL and RCPT parameters in events ----------------------------------------------------


def first(data: bytes, kind: type[Event]) -> Event:
    events, _ = drive([data])
    return next(event for event in events if isinstance(event, kind))


def test_mail_parameters_parsed() -> None:
    event = first(
        EHLO + b"MAIL FROM:<a@b> size=500 BODY=8bitmime SMTPUTF8 RET=HDRS ENVID=QQ+2Bx\r\n",
        MailFrom,
    )
    assert event == MailFrom("a@b", 500, BodyType.EIGHT_BIT_MIME, True, Ret.HDRS, "QQ+2Bx")
    assert event.needs_decision


def test_mail_defaults_and_null_sender() -> None:
    assert first(EHLO + b"MAIL FROM:<> BODY=7BIT\r\n", MailFrom) == MailFrom(
        "", body=BodyType.SEVEN_BIT
    )


def test_source_route_dropped_from_the_reverse_path() -> None:
    # RFC 5321 appendix C: accepted, and the route ignored (bounces go to the mailbox).
    assert first(EHLO + b"MAIL FROM:<@r1,@r2:a@b>\r\n", MailFrom) == MailFrom("a@b")


def test_source_route_of_a_forward_path_is_handed_to_the_driver() -> None:
    # RFC 5321 section 3.6.1: the server may refuse it; the driver decides, so it must see it.
    event = first(EHLO + MAIL + b"RCPT TO:<@r1.example,@r2:c@d>\r\n", RcptTo)
    assert event == RcptTo("c@d", route="@r1.example,@r2")
    assert first(EHLO + MAIL + b"RCPT TO:<c@d>\r\n", RcptTo) == RcptTo("c@d")


@pytest.mark.parametrize(
    "path", [b"@:c@d", b"@r1,r2:c@d", b"@r 1:c@d", b"@r1,@:c@d", b"@r1", b"@r1;c@d"]
)
def test_malformed_source_routes_are_501(path: bytes) -> None:
    assert session(EHLO + MAIL + b"RCPT TO:<" + path + b">\r\n") == [
        "250",
        "250 2.1.0",
        "501 5.1.3",
    ]


def test_rcpt_parameters_parsed_orcpt_kept_raw() -> None:
    event = first(
        EHLO + MAIL + b"RCPT TO:<c@d> NOTIFY=success,Delay ORCPT=rfc822;c+2Bx@d\r\n", RcptTo
    )
    assert event == RcptTo("c@d", frozenset({Notify.SUCCESS, Notify.DELAY}), "rfc822;c+2Bx@d")
    assert first(EHLO + MAIL + b"RCPT TO:<c@d> NOTIFY=NEVER\r\n", RcptTo) == RcptTo(
        "c@d", frozenset({Notify.NEVER})
    )


def test_utf8_orcpt_checked_with_rfc6533() -> None:
    event = first(EHLO + MAIL + b"RCPT TO:<c@d> ORCPT=utf-8;u\\x{E9}@d\r\n", RcptTo)
    assert isinstance(event, RcptTo)
    assert event.orcpt == "utf-8;u\\x{E9}@d"


# --- decisions and pipelining ---------------------------------------------------------------


def test_pipelined_commands_wait_for_a_decision() -> None:
    conn = make()
    events = conn.receive(EHLO + MAIL + RCPT + b"NOOP\r\n")
    assert isinstance(events[-1], MailFrom)
    assert conn.pending == events[-1]
    assert replies(conn.data_to_send()) == ["250"]  # nothing after MAIL answered yet
    assert conn.receive(b"RSET\r\n") == []  # still buffered behind the decision
    events = conn.reject(Reply(550, ("no",), EnhancedStatus(5, 7, 1)))
    # RCPT after a rejected MAIL: bad sequence; then NOOP and RSET run.
    assert events == [Reset()]
    assert replies(conn.data_to_send()) == ["550 5.7.1", "503 5.5.1", "250 2.0.0", "250 2.0.0"]


def test_rejected_recipient_then_data_is_bad_sequence() -> None:
    def policy(event: Event) -> Reply | None:
        if isinstance(event, RcptTo):
            return Reply(550, ("unknown",), EnhancedStatus(5, 1, 1))
        return None

    _, out = drive([TX + b"QUIT\r\n"], policy)
    assert out == ["250", "250 2.1.0", "550 5.1.1", "503 5.5.1", "221 2.0.0"]


def test_accept_with_custom_reply_and_data_start_reject() -> None:
    conn = make()
    conn.receive(EHLO + MAIL)
    conn.accept(Reply(250, ("fine",), EnhancedStatus(2, 1, 0)))
    conn.receive(RCPT)
    conn.accept()
    assert conn.receive(b"DATA\r\n") == [DataStart()]
    conn.reject(Reply(451, ("later",), EnhancedStatus(4, 3, 0)))
    assert conn.state is State.RCPT  # the transaction survives a refused DATA
    assert b"250 2.1.0 fine\r\n" in conn.data_to_send()


def test_driver_misuse_raises() -> None:
    conn = make()
    with pytest.raises(DecisionError):
        conn.accept()
    conn.receive(EHLO + MAIL)
    with pytest.raises(DecisionError):
        conn.accept(Reply(550, ("x",)))  # accepting with a failure
    with pytest.raises(DecisionError):
        conn.reject(Reply(250, ("x",)))  # rejecting with a success
    conn.accept()
    with pytest.raises(DecisionError):
        conn.accept()  # deciding twice
    with pytest.raises(DecisionError):
        conn.challenge(b"x")
    with pytest.raises(DecisionError):
        conn.tls_established()


def test_data_start_accept_must_be_354() -> None:
    conn = make()
    conn.receive(TX)
    conn.accept()
    conn.accept()
    with pytest.raises(DecisionError):
        conn.accept(Reply(250, ("x",)))


def test_reject_with_421_closes() -> None:
    conn = make()
    conn.receive(EHLO + MAIL + b"NOOP\r\n")
    conn.reject(Reply(421, ("bye",), EnhancedStatus(4, 3, 2)))
    assert conn.closed
    assert replies(conn.data_to_send()) == ["250", "421 4.3.2"]
    assert conn.receive(b"NOOP\r\n") == []


def test_too_many_recipients() -> None:
    rcpts = b"".join(b"RCPT TO:<r%d@d>\r\n" % i for i in range(4))
    out = session(EHLO + MAIL + rcpts, max_recipients=3)
    assert out == ["250", "250 2.1.0", "250 2.1.5", "250 2.1.5", "250 2.1.5", "452 4.5.3"]


def test_rejected_recipients_do_not_count() -> None:
    def policy(event: Event) -> Reply | None:
        if isinstance(event, RcptTo) and event.address.startswith("bad"):
            return Reply(550, ("no",), EnhancedStatus(5, 1, 1))
        return None

    data = EHLO + MAIL + b"RCPT TO:<bad@d>\r\nRCPT TO:<a@d>\r\nRCPT TO:<b@d>\r\n"
    _, out = drive([data], policy, make(max_recipients=1))
    assert out == ["250", "250 2.1.0", "550 5.1.1", "250 2.1.5", "452 4.5.3"]


def rcpts(count: int) -> bytes:
    return b"".join(b"RCPT TO:<r%d@d>\r\n" % i for i in range(count))


# RFC 5321 4.5.3.1.10: a client told 452 for recipients past the limit sends them later.  The
# 452 is not an error, so a long pipelined list never reaches max_errors and loses with the
# 421 the recipients already accepted.  Other errors still count.
@pytest.mark.parametrize(
    ("name", "data", "limits", "expected"),
    [
        (
            "more over the limit than max_errors",
            EHLO + MAIL + rcpts(10) + b"DATA\r\nhi\r\n.\r\n",
            {"max_recipients": 3, "max_errors": 5},
            ["250", "250 2.1.0", *["250 2.1.5"] * 3, *["452 4.5.3"] * 7, "354", "250 2.0.0"],
        ),
        (
            "max_errors of one",
            EHLO + MAIL + rcpts(2) + b"DATA\r\nhi\r\n.\r\n",
            {"max_recipients": 1, "max_errors": 1},
            ["250", "250 2.1.0", "250 2.1.5", "452 4.5.3", "354", "250 2.0.0"],
        ),
        (
            # Postfix's smtpd_recipient_overshoot_limit: as many again as the limit are
            # free, then each counts, so RCPTs cannot go on for ever.
            "past the allowance each counts",
            EHLO + MAIL + rcpts(8) + b"NOOP\r\n",
            {"max_recipients": 2, "max_errors": 2},
            ["250", "250 2.1.0", *["250 2.1.5"] * 2, *["452 4.5.3"] * 4, "421 4.7.0"],
        ),
        (
            "other errors still count",
            EHLO + MAIL + rcpts(2) + b"BOGUS\r\nBOGUS\r\nNOOP\r\n",
            {"max_recipients": 1, "max_errors": 2},
            ["250", "250 2.1.0", "250 2.1.5", "452 4.5.3", *["500 5.5.2"] * 2, "421 4.7.0"],
        ),
        (
            "a malformed rcpt over the limit is an error",
            EHLO + MAIL + rcpts(2) + b"RCPT TO:<bad>\r\nNOOP\r\n",
            {"max_recipients": 1, "max_errors": 1},
            ["250", "250 2.1.0", "250 2.1.5", "452 4.5.3", "501 5.1.3", "421 4.7.0"],
        ),
    ],
)
def test_recipients_over_the_limit_are_not_errors(
    name: str, data: bytes, limits: dict[str, int], expected: list[str]
) -> None:
    events, out = drive([data], conn=make(**limits))
    assert out == expected, name
    accepted = expected.count("250 2.1.5")
    assert [e for e in events if isinstance(e, RcptTo)] == [
        RcptTo(f"r{i}@d") for i in range(accepted)
    ]
    assert (DataEnd() in events) == ("250 2.0.0" in expected)
    assert drive([bytes([b]) for b in data], conn=make(**limits)) == (events, out)


# --- command line limits and bare newlines --------------------------------------------------


def test_command_line_limit() -> None:
    ok = b"NOOP " + b"x" * (512 - 7) + b"\r\n"  # exactly 512 octets with CRLF
    too_long = b"NOOP " + b"x" * (512 - 6) + b"\r\n"
    assert len(ok) == 512
    assert session(ok) == ["250 2.0.0"]
    assert session(too_long + b"NOOP\r\n") == ["500 5.5.2", "250 2.0.0"]


def test_long_line_rest_is_discarded_not_executed() -> None:
    # The tail of an over-long line must not be run as a command.
    data = b"NOOP " + b"x" * 600 + b"QUIT\r\nNOOP\r\n"
    assert session(data) == ["500 5.5.2", "250 2.0.0"]
    conn = make()
    out = drive([bytes([b]) for b in data], conn=conn)[1]
    assert out == ["500 5.5.2", "250 2.0.0"]


# RFC 5321 4.5.3.1.4 lets extensions lengthen a command line: MAIL by SIZE (RFC 1870), BODY
# (RFC 6152), SMTPUTF8 (RFC 6531), ENVID and RET (RFC 3461); RCPT by NOTIFY and ORCPT (3461).
def padded(prefix: bytes, total: int) -> bytes:
    """``prefix`` with a NOOP-safe filler parameter making the line ``total`` octets."""
    return prefix + b"x" * (total - len(prefix) - 2) + b"\r\n"


LONG_ADDRESS = b"l" * 64 + b"@" + b"d" * 184 + b".test"  # 254 octets, the most in a path
DSN_RCPT = (
    b"RCPT TO:<" + LONG_ADDRESS + b"> NOTIFY=SUCCESS,FAILURE,DELAY ORCPT=rfc822;" + LONG_ADDRESS
)


@pytest.mark.parametrize(
    ("name", "line", "expected"),
    [
        ("rcpt with full DSN, 563", DSN_RCPT + b"\r\n", "250 2.1.5"),
        ("rcpt at 1012", padded(b"RCPT TO:<a@b.test> ORCPT=rfc822;", 1012), "501 5.5.4"),
        ("rcpt over 1012", padded(b"RCPT TO:<a@b.test> ORCPT=rfc822;", 1013), "500 5.5.2"),
        ("rcpt lower case at 1012", padded(b"rcpt to:<a@b.test> ORCPT=rfc822;", 1012), "501 5.5.4"),
        ("mail at 663", padded(b"MAIL FROM:<a@b.test> ENVID=", 663), "501 5.5.4"),
        ("mail over 663", padded(b"MAIL FROM:<a@b.test> ENVID=", 664), "500 5.5.2"),
        ("noop at 512", padded(b"NOOP ", 512), "250 2.0.0"),
        ("noop over 512", padded(b"NOOP ", 513), "500 5.5.2"),
        ("vrfy over 512", padded(b"VRFY ", 513), "500 5.5.2"),
        ("rcpt verb without space", padded(b"RCPTX", 600), "500 5.5.2"),
    ],
)
def test_mail_and_rcpt_lines_may_be_longer(name: str, line: bytes, expected: str) -> None:
    # A line over the limit is refused before it is parsed (500); one within it is parsed,
    # and the filler (too long for ENVID's 100 and ORCPT's 500 characters) is then a 501.
    data = EHLO + (MAIL if line.upper().startswith(b"RCPT") else b"") + line + b"NOOP\r\n"
    out = session(data)
    assert out[-2:] == [expected, "250 2.0.0"], name
    assert drive([bytes([b]) for b in data])[1] == session(data)  # byte by byte, the same


def test_full_dsn_rcpt_parameters_arrive() -> None:
    events, _ = drive([EHLO + MAIL + DSN_RCPT + b"\r\n"])
    (rcpt,) = [e for e in events if isinstance(e, RcptTo)]
    assert len(DSN_RCPT) + 2 == 563
    assert rcpt.address == LONG_ADDRESS.decode()
    assert rcpt.orcpt == "rfc822;" + LONG_ADDRESS.decode()


# --- the error limit (Postfix's smtpd_hard_error_limit) ------------------------------------

RELAY_DENIED = Reply(554, ("Relay access denied",), EnhancedStatus(5, 7, 1))


def deny_rcpts(event: Event) -> Reply | None:
    return RELAY_DENIED if isinstance(event, RcptTo) else None


@pytest.mark.parametrize(
    ("name", "data", "policy", "max_errors", "expected"),
    [
        ("bad commands", b"BOGUS\r\n" * 5, accept_all, 3, ["500 5.5.2"] * 3 + ["421 4.7.0"]),
        (
            "just under",
            b"BOGUS\r\n" * 2 + b"NOOP\r\n",
            accept_all,
            3,
            ["500 5.5.2"] * 2 + ["250 2.0.0"],
        ),
        ("limit of one", b"BOGUS\r\nNOOP\r\n", accept_all, 1, ["500 5.5.2", "421 4.7.0"]),
        (
            "harvesting",
            EHLO + MAIL + b"".join(b"RCPT TO:<u%d@victim.test>\r\n" % i for i in range(9)),
            deny_rcpts,
            4,
            ["250", "250 2.1.0"] + ["554 5.7.1"] * 4 + ["421 4.7.0"],
        ),
        (
            "mixed kinds",
            EHLO + b"DATA\r\nRCPT TO:<a@b>\r\n" + b"x" * 600 + b"\r\nNOOP\r\n",
            accept_all,
            3,
            ["250", "503 5.5.1", "503 5.5.1", "500 5.5.2", "421 4.7.0"],
        ),
        (
            "over-long lines",
            b"NOOP " + b"x" * 2000 + b"\r\nNOOP " + b"y" * 2000,
            accept_all,
            2,
            ["500 5.5.2", "500 5.5.2", "421 4.7.0"],
        ),
        ("positive replies do not count", b"NOOP\r\n" * 30, accept_all, 2, ["250 2.0.0"] * 30),
    ],
)
def test_error_limit_closes_with_421(
    name: str, data: bytes, policy: Policy, max_errors: int, expected: list[str]
) -> None:
    conn = make(max_errors=max_errors)
    events, out = drive([data], policy, conn)
    assert out == expected, name
    assert conn.closed == (expected[-1] == "421 4.7.0")
    assert conn.receive(b"NOOP\r\n") == [] or not conn.closed
    # The same fed byte by byte.
    assert drive([bytes([b]) for b in data], policy, make(max_errors=max_errors)) == (events, out)


def test_a_delivered_message_starts_the_error_count_again() -> None:
    bad = b"BOGUS\r\n" * 2
    tx = MAIL + RCPT + b"DATA\r\nhi\r\n.\r\n"
    conn = make(max_errors=3)
    _, out = drive([EHLO + bad + tx + bad + b"NOOP\r\n"], conn=conn)
    errors = ["500 5.5.2", "500 5.5.2"]
    assert out == [
        "250",
        *errors,
        "250 2.1.0",
        "250 2.1.5",
        "354",
        "250 2.0.0",
        *errors,
        "250 2.0.0",
    ]
    assert not conn.closed
    # A refused message is an error, and does not reset the count.
    conn = make(max_errors=3)
    _, out = drive(
        [EHLO + bad + tx], lambda e: RELAY_DENIED if isinstance(e, DataEnd) else None, conn
    )
    assert out[-2:] == ["554 5.7.1", "421 4.7.0"]
    assert conn.closed


def test_custom_command_line_limit() -> None:
    assert session(b"NOOP 1234\r\n", max_command_line=10) == ["500 5.5.2"]
    assert session(b"NOOP 123\r\n", max_command_line=10) == ["250 2.0.0"]


@pytest.mark.parametrize(
    "line",
    [b"NOOP\nNOOP\r\n", b"NOOP\rNOOP\r\n", b"NOOP\n\r\n", b"NO\x00OP\r\n", b"\nQUIT\r\n"],
)
def test_bare_newline_in_command_is_a_syntax_error(line: bytes) -> None:
    assert session(line) == ["500 5.5.2"]


@pytest.mark.parametrize(
    ("line", "text"),
    [
        (b"NOOP\rNOOP\r\n", "Bare CR or LF not allowed"),
        (b"MAIL FROM:<a\x00b@b.test>\r\n", "NUL octet not allowed"),  # says what it is
    ],
)
def test_a_refused_command_line_says_why(line: bytes, text: str) -> None:
    conn = make()
    conn.receive(line)
    assert conn.data_to_send() == f"500 5.5.2 {text}\r\n".encode()


def test_too_many_errors_is_a_421_naming_the_server() -> None:
    """RFC 5321 section 4.2.3: "421 <domain> Service not available"."""
    conn = make(max_errors=2)
    conn.receive(b"BAD\r\nBAD\r\n")
    assert conn.data_to_send().split(b"\r\n")[-2] == (
        b"421 4.7.0 mx.example Too many errors, closing connection"
    )
    assert conn.closed


def test_bare_lf_does_not_end_a_command() -> None:
    conn = make()
    assert conn.receive(b"QUIT\n") == []
    assert conn.data_to_send() == b""
    conn.receive(b"\r\n")
    assert replies(conn.data_to_send()) == ["500 5.5.2"]
    assert not conn.closed


# --- DATA -----------------------------------------------------------------------------------


def message(body: bytes, **kwargs: object) -> tuple[list[Event], list[str]]:
    """Run a transaction with ``body`` (which must include the end marker) and QUIT."""
    return drive([TX + body + b"QUIT\r\n"], conn=make(**kwargs))


def body_events(events: list[Event]) -> list[Event]:
    start = next(i for i, e in enumerate(events) if isinstance(e, DataStart))
    return [e for e in events[start + 1 :] if isinstance(e, DataChunk | DataEnd)]


def test_data_chunks_and_end() -> None:
    events, out = message(b"Subject: x\r\n\r\nbody\r\n.\r\n")
    assert body_events(events) == [DataChunk(b"Subject: x\r\n\r\nbody\r\n"), DataEnd()]
    assert out == [*TX_REPLIES, "250 2.0.0", "221 2.0.0"]
    assert isinstance(events[-1], Quit)


def test_empty_message() -> None:
    events, out = message(b".\r\n")
    assert body_events(events) == [DataEnd()]
    assert out[-2:] == ["250 2.0.0", "221 2.0.0"]


@pytest.mark.parametrize(
    ("wire", "text"),
    [
        (b"..\r\n", b".\r\n"),
        (b"..x\r\n", b".x\r\n"),
        (b"...\r\n", b"..\r\n"),
        (b"a.\r\n.b\r\n", b"a.\r\nb\r\n"),
        (b". \r\n", b" \r\n"),
        (b"x\r\n..\r\n", b"x\r\n.\r\n"),
    ],
)
def test_dot_unstuffing(wire: bytes, text: bytes) -> None:
    events, _ = message(wire + b".\r\n")
    assert body_events(events) == [DataChunk(text), DataEnd()]


def test_data_end_reject_and_transaction_reset() -> None:
    conn = make()
    settle(conn, conn.receive(TX), accept_all)
    events = conn.receive(b"x\r\n.\r\n" + RCPT)
    assert events == [DataChunk(b"x\r\n"), DataEnd()]
    assert events[-1].needs_decision
    conn.reject(Reply(554, ("spam",), EnhancedStatus(5, 7, 1)))
    assert replies(conn.data_to_send())[-2:] == ["554 5.7.1", "503 5.5.1"]


def test_commands_pipelined_after_the_final_dot() -> None:
    _, out = drive([TX + b"x\r\n.\r\n" + MAIL + RCPT + b"DATA\r\ny\r\n.\r\n"])
    assert out == [*TX_REPLIES, "250 2.0.0", "250 2.1.0", "250 2.1.5", "354", "250 2.0.0"]


# The 2023 SMTP smuggling sequences (and NUL variants): none may end DATA.
SMUGGLING = [
    b"\n.\n",
    b"\n.\r\n",
    b"\r.\r",
    b"\r\n.\n",
    b"\r.\r\n",
    b"\n.\x00\n",
    b"\x00\n.\n",
    b"\r\n.\r",
    b"\r\n\x00.\r\n",
    b"\r\n.\x00\r\n",
]
# A NUL before a real end (SEC Consult's ``\x00<CR><LF>.<CR><LF>``): that dot does end DATA,
# and the message before it is refused; what follows is the client's own next commands.
NUL_BEFORE_END = b"\x00\r\n.\r\n"


@pytest.mark.parametrize("end", SMUGGLING)
def test_smuggling_sequence_does_not_end_data(end: bytes) -> None:
    smuggled = b"MAIL FROM:<evil@x>\r\nRCPT TO:<victim@y>\r\nDATA\r\nforged\r\n"
    body = b"legit" + end + smuggled + b".\r\n"
    events, out = message(body)
    mail_froms = [e for e in events if isinstance(e, MailFrom)]
    assert [m.address for m in mail_froms] == ["a@example.org"]  # nothing smuggled in
    (data_end,) = [e for e in events if isinstance(e, DataEnd)]  # the real dot only
    assert data_end.rejected is not None
    assert data_end.rejected.code == 554
    assert not data_end.needs_decision  # already answered: nothing to commit
    assert out == [*TX_REPLIES, "554 5.6.0", "221 2.0.0"]
    # Fed one byte at a time, the same.
    assert drive([bytes([b]) for b in TX + body + b"QUIT\r\n"]) == (events, out)


def test_nul_before_a_real_end_refuses_the_message() -> None:
    smuggled = b"MAIL FROM:<evil@x>\r\nRCPT TO:<victim@y>\r\nDATA\r\nforged\r\n"
    events, out = message(b"legit" + NUL_BEFORE_END + smuggled + b".\r\n")
    ends = [e for e in events if isinstance(e, DataEnd)]
    assert ends == [DataEnd(rejected=NUL_REFUSED), DataEnd()]  # only the second is decided
    assert out == [
        *TX_REPLIES,
        "554 5.6.0",
        "250 2.1.0",
        "250 2.1.5",
        "354",
        "250 2.0.0",
        "221 2.0.0",
    ]


NUL_REFUSED = Reply(554, ("NUL octet not allowed in message data",), EnhancedStatus(5, 6, 0))


@pytest.mark.parametrize(
    ("body", "before"),
    [
        (b"a\r\n.\x00\r\nb\r\n", b"a\r\n"),  # the stuffed dot goes, the NUL stops it
        (b"a\r\n\x00.\r\nb\r\n", b"a\r\n"),
        (b"abc\x00def\r\n", b"abc"),
        (b"\x00\r\n", b""),
        (b"x" * 100 + b"\r\n" + b"y\x00" * 50 + b"\r\n", b"x" * 100 + b"\r\ny"),
    ],
)
def test_nul_in_data_is_refused_at_the_real_dot(body: bytes, before: bytes) -> None:
    events, out = message(body + b".\r\n")
    expected = [DataChunk(before)] if before else []
    assert body_events(events) == [*expected, DataEnd(rejected=NUL_REFUSED)]
    assert out[-2:] == ["554 5.6.0", "221 2.0.0"]  # in step: QUIT after the dot is read


def test_bare_newline_chunks_stop_at_the_fault() -> None:
    events, _ = message(b"ok\r\nbad\nrest\r\n.\r\n")
    assert body_events(events) == [
        DataChunk(b"ok\r\nbad"),
        DataEnd(
            rejected=Reply(
                554, ("Bare CR or LF not allowed in message data",), EnhancedStatus(5, 6, 0)
            )
        ),
    ]


def test_cr_before_crlf_is_bare() -> None:
    _, out = message(b"a\r\r\n.\r\n")
    assert out[-2] == "554 5.6.0"


def test_text_line_limit() -> None:
    ok_line = b"x" * 998 + b"\r\n"
    events, out = message(ok_line + b".\r\n")
    assert out[-2] == "250 2.0.0"
    assert body_events(events)[0] == DataChunk(ok_line)
    events, out = message(b"x" * 999 + b"\r\n.\r\n")
    assert out[-2:] == ["500 5.5.2", "221 2.0.0"]
    assert body_events(events)[0] == DataChunk(b"x" * 998)


_LINE78 = b"z" * 76 + b"\r\n"
_SHORT = b"ab\r\n" * 300  # longer than a line may be: the fast path walks it for long lines


# The branches of the DATA fast path (``_clean_lines``): where the first dot line is, and
# the long-line walk.  Each must give what feeding the same bytes one by one gives (the
# line-by-line path), and the text or reply listed here.
@pytest.mark.parametrize(
    ("name", "body", "text", "reply"),
    [
        ("no dot line", b"a\r\nb\r\n", b"a\r\nb\r\n", "250 2.0.0"),
        ("only the first line stuffed", b"..a\r\nb\r\n", b".a\r\nb\r\n", "250 2.0.0"),
        ("a stuffed line before the end", b"a\r\n..b\r\nc\r\n", b"a\r\n.b\r\nc\r\n", "250 2.0.0"),
        (
            "a stuffed line, the end past the window",
            b"a\r\n..b\r\n" + _LINE78 * 300,
            b"a\r\n.b\r\n" + _LINE78 * 300,
            "250 2.0.0",
        ),
        (
            "the end marker across the window's edge",
            b"y" * 79 + b"\r\n" + _LINE78 * 209,
            b"y" * 79 + b"\r\n" + _LINE78 * 209,
            "250 2.0.0",
        ),
        ("a line at the limit after short ones", _SHORT + b"x" * 998 + b"\r\n", None, "250 2.0.0"),
        ("a long line after short ones", _SHORT + b"x" * 999 + b"\r\n", None, "500 5.5.2"),
        ("a long line before short ones", b"x" * 999 + b"\r\n" + _SHORT, None, "500 5.5.2"),
        ("a long line between", _SHORT + b"x" * 1500 + b"\r\n" + _SHORT, None, "500 5.5.2"),
        ("a bare CR after short ones", _SHORT + b"a\rb\r\n", None, "554 5.6.0"),
    ],
)
def test_fast_path_branches_equal_byte_by_byte(
    name: str, body: bytes, text: bytes | None, reply: str
) -> None:
    data = TX + body + b".\r\nQUIT\r\n"
    events, out = drive([data], conn=make(max_message_size=100_000))
    assert (events, out) == drive([bytes([b]) for b in data], conn=make(max_message_size=100_000))
    assert out[-2] == reply, name
    if text is not None:
        chunks = b"".join(e.data for e in events if isinstance(e, DataChunk))
        assert chunks == text, name


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=30).filter(lambda b: not {13, 10} & set(b)), max_size=30),
    most=st.integers(0, 25),
)
def test_long_line_walk_finds_what_splitting_finds(lines: list[bytes], most: int) -> None:
    region = b"".join(line + b"\r\n" for line in lines)
    assert _long_line(region, len(region), most) == any(len(line) > most for line in lines)


def test_custom_text_line_limit_counts_after_unstuffing() -> None:
    _, out = message(b"..12\r\n.\r\n", max_text_line=5)
    assert out[-2] == "250 2.0.0"
    _, out = message(b"12345\r\n.\r\n", max_text_line=6)
    assert out[-2] == "500 5.5.2"


def test_message_size_limit_after_data() -> None:
    events, out = message(b"0123456789\r\n" * 3 + b".\r\n", max_message_size=36)
    assert out[-2:] == ["250 2.0.0", "221 2.0.0"]
    events, out = message(b"0123456789\r\n" * 3 + b"x\r\n.\r\n", max_message_size=36)
    assert out[-2:] == ["552 5.3.4", "221 2.0.0"]
    chunks = body_events(events)
    assert chunks[0] == DataChunk((b"0123456789\r\n" * 3)[:36])
    assert chunks[1] == DataEnd(rejected=chunks[1].rejected)  # type: ignore[union-attr]


def test_oversize_message_is_consumed_to_the_dot() -> None:
    conn = make(max_message_size=100)
    settle(conn, conn.receive(TX), accept_all)
    conn.data_to_send()
    total = 0
    for _ in range(1000):
        for event in conn.receive(b"y" * 70 + b"\r\n"):
            assert isinstance(event, DataChunk)
            total += len(event.data)
    assert total == 100
    assert len(conn._buffer) < 3  # bounded: nothing accumulates
    events = conn.receive(b".\r\nNOOP\r\n")
    assert isinstance(events[-1], DataEnd)
    assert replies(conn.data_to_send()) == ["552 5.3.4", "250 2.0.0"]


def test_data_buffer_stays_bounded() -> None:
    conn = make(max_message_size=10**9, max_text_line=10**9)
    settle(conn, conn.receive(TX), accept_all)
    for _ in range(100):
        conn.receive(b"z" * 10_000)
        assert len(conn._buffer) <= 2


# --- chunking invariance --------------------------------------------------------------------

INVARIANCE_SESSIONS = [
    TX + b"Subject: hi\r\n\r\n..stuffed\r\nline\r\n.\r\nQUIT\r\n",
    TX + b"a\n.\nMAIL FROM:<e@x>\r\n.\r\nNOOP\r\n",
    TX + b"x" * 1200 + b"\r\n.\r\nRSET\r\n",
    b"NOOP " + b"q" * 700 + b"\r\n" + TX + b".\r\n",
    TX + b"\r.\r\r\n..\r\n.\r\n",
]


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for point in points:
        pieces.append(data[last:point])
        last = point
    pieces.append(data[last:])
    return pieces


@settings(max_examples=150, deadline=None)
@given(
    index=st.integers(0, len(INVARIANCE_SESSIONS) - 1),
    cuts=st.lists(st.integers(0, 5000), max_size=30),
)
def test_any_chunking_gives_the_same_events_and_replies(index: int, cuts: list[int]) -> None:
    data = INVARIANCE_SESSIONS[index]
    whole = drive([data])
    assert drive(split_at(data, cuts)) == whole


@pytest.mark.parametrize("data", INVARIANCE_SESSIONS)
def test_byte_by_byte_equals_whole(data: bytes) -> None:
    assert drive([bytes([b]) for b in data]) == drive([data])


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=300), cuts=st.lists(st.integers(0, 400), max_size=10))
def test_arbitrary_body_chunking(body: bytes, cuts: list[int]) -> None:
    data = TX + body + b"\r\n.\r\nNOOP\r\n"
    assert drive(split_at(data, cuts), conn=make(max_message_size=100)) == drive(
        [data], conn=make(max_message_size=100)
    )


# The pieces DATA faults are made of: the fast path for whole lines (``_clean_lines``) must
# decide exactly as the line-by-line path, which byte-by-byte feeding always takes.
_DATA_TOKENS = st.sampled_from(
    [b"a", b"bb", b".", b"..", b"\r", b"\n", b"\r\n", b"\r\n.", b".\r\n", b"\0", b"x" * 7]
)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(_DATA_TOKENS, max_size=40),
    max_text_line=st.integers(3, 12),
    max_message_size=st.integers(0, 60),
)
def test_whole_lines_fast_path_equals_byte_by_byte(
    tokens: list[bytes], max_text_line: int, max_message_size: int
) -> None:
    data = TX + b"".join(tokens) + b"\r\n.\r\nNOOP\r\n"

    def conn() -> ServerConnection:
        return make(max_text_line=max_text_line, max_message_size=max_message_size)

    assert drive([data], conn=conn()) == drive([bytes([b]) for b in data], conn=conn())


@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=40).filter(lambda b: not {13, 10, 0} & set(b)), max_size=8)
)
def test_clean_body_round_trips_through_dot_stuffing(lines: list[bytes]) -> None:
    text = b"".join(line + b"\r\n" for line in lines)
    wire = b"".join((b"." + line if line.startswith(b".") else line) + b"\r\n" for line in lines)
    events, out = drive([TX + wire + b".\r\n"])
    chunks = b"".join(e.data for e in events if isinstance(e, DataChunk))
    assert chunks == text
    assert out[-1] == "250 2.0.0"


@settings(max_examples=200, deadline=None)
@given(junk=st.binary(max_size=200))
def test_peer_bytes_never_raise(junk: bytes) -> None:
    for prefix in (b"", EHLO, TX):
        drive([prefix + junk, b"\r\n.\r\nQUIT\r\n"])


# --- STARTTLS -------------------------------------------------------------------------------


def test_starttls_discards_pipelined_plaintext_and_resets() -> None:
    conn = make(tls_offered=True)
    conn.receive(EHLO + MAIL + b"RSET\r\nSTARTTLS\r\n" + MAIL + RCPT)
    assert conn.accept() == [Reset(), StartTLS()]
    assert replies(conn.data_to_send()) == ["250", "250 2.1.0", "250 2.0.0", "220 2.0.0"]
    assert conn.state is State.TLS
    assert conn.receive(b"NOOP\r\n") == []  # plaintext before the handshake is ignored
    assert conn.data_to_send() == b""
    assert conn.tls_established() == []
    assert conn.tls_active
    # RFC 3207 4.2: back to the start, the client must greet again.
    _, out = drive([MAIL + EHLO + MAIL], conn=conn)
    assert out == ["503 5.5.1", "250", "250 2.1.0"]
    assert "STARTTLS" not in ehlo_keywords(tls_offered=True, tls_active=True)


def test_starttls_event_and_sequence() -> None:
    conn = make(tls_offered=True)
    assert conn.receive(EHLO + b"STARTTLS\r\n") == [Hello("EHLO", "client.example"), StartTLS()]
    assert session(b"STARTTLS\r\n", tls_offered=True) == ["503 5.5.1"]
    assert session(EHLO + b"STARTTLS now\r\n", tls_offered=True) == ["250", "501 5.5.4"]


# --- AUTH -----------------------------------------------------------------------------------


def authed(**kwargs: object) -> ServerConnection:
    conn = make(auth_offered=True, tls_active=True, **kwargs)
    conn.receive(EHLO)
    conn.data_to_send()
    return conn


def test_auth_plain_with_initial_response() -> None:
    conn = authed()
    initial = base64.b64encode(b"\0user\0pass")
    assert conn.receive(b"AUTH plain " + initial + b"\r\n") == [
        AuthRequest("PLAIN", b"\0user\0pass")
    ]
    conn.accept()
    assert conn.authenticated
    conn.receive(b"AUTH PLAIN\r\n")
    assert replies(conn.data_to_send()) == ["235 2.7.0", "503 5.5.1"]


def test_auth_login_with_challenges() -> None:
    conn = authed()
    assert conn.receive(b"AUTH LOGIN\r\n") == [AuthRequest("LOGIN", None)]
    conn.challenge(b"Username:")
    assert conn.data_to_send() == b"334 VXNlcm5hbWU6\r\n"
    assert conn.receive(base64.b64encode(b"user") + b"\r\n") == [AuthResponse(b"user")]
    conn.challenge(b"Password:")
    assert conn.receive(base64.b64encode(b"pw") + b"\r\n") == [AuthResponse(b"pw")]
    conn.reject(Reply(535, ("bad",), EnhancedStatus(5, 7, 8)))
    assert replies(conn.data_to_send()) == ["334", "535 5.7.8"]
    assert not conn.authenticated
    assert conn.state is State.READY


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"AUTH CRAM-MD5\r\n", ["504 5.5.4"]),
        (b"AUTH\r\n", ["501 5.5.4"]),
        (b"AUTH PLAIN !!!\r\n", ["501 5.5.2"]),
        (MAIL + b"AUTH PLAIN\r\n", ["250 2.1.0", "503 5.5.1"]),
    ],
)
def test_auth_errors(data: bytes, expected: list[str]) -> None:
    assert drive([data], conn=authed())[1] == expected


def test_auth_empty_initial_response_and_cancel() -> None:
    conn = authed()
    assert conn.receive(b"AUTH PLAIN =\r\n") == [AuthRequest("PLAIN", b"")]
    conn.challenge(b"")
    assert conn.data_to_send() == b"334 \r\n"  # RFC 4954 4: "334" SP [base64], even empty
    assert conn.receive(b"*\r\nNOOP\r\n") == []
    assert replies(conn.data_to_send()) == ["501 5.0.0", "250 2.0.0"]


def test_auth_requires_tls() -> None:
    assert session(EHLO + b"AUTH PLAIN\r\n", auth_offered=True) == ["250", "538 5.7.11"]


def in_exchange() -> ServerConnection:
    """A connection in the middle of AUTH LOGIN: 334 sent, the client's response awaited."""
    conn = authed()
    assert conn.receive(b"AUTH LOGIN\r\n") == [AuthRequest("LOGIN", None)]
    conn.challenge(b"Username:")
    conn.data_to_send()
    assert conn.state is State.AUTH
    return conn


# RFC 4954 section 4: a response the server refuses fails the AUTH command; the client's next
# line is a command again.  Read as a SASL response, a MAIL would get 501 and bounce.
@pytest.mark.parametrize(
    ("name", "line", "expected"),
    [
        ("over-long", b"A" * SASL_RESPONSE_LIMIT + b"\r\n", "500 5.5.6"),  # RFC 4954 6
        ("bare LF", b"dXNl\ncg==\r\n", "501 5.5.2"),
        ("bare CR", b"dXNl\rcg==\r\n", "501 5.5.2"),
        ("NUL", b"dXNl\x00cg==\r\n", "501 5.5.2"),
        ("invalid UTF-8", b"\xff\xfe\r\n", "501 5.5.2"),
    ],
)
def test_a_refused_sasl_line_ends_the_exchange(name: str, line: bytes, expected: str) -> None:
    data = line + MAIL + b"NOOP\r\n"
    conn = in_exchange()
    events, out = drive([data], conn=conn)
    assert out == [expected, "250 2.1.0", "250 2.0.0"], name
    assert events == [MailFrom("a@example.org")]
    assert not conn.authenticated
    assert conn.state is State.MAIL
    assert drive([bytes([b]) for b in data], conn=in_exchange()) == (events, out)


def test_an_over_long_sasl_line_ends_the_exchange_at_once() -> None:
    conn = in_exchange()
    assert conn.receive(b"A" * (SASL_RESPONSE_LIMIT + 10)) == []
    assert replies(conn.data_to_send()) == ["500 5.5.6"]
    assert conn.state is State.READY  # before the line ends
    # The rest of the line is discarded, not run as a command; the next line is one.
    assert conn.receive(b"B" * 50 + MAIL[:-2] + b"\r\n" + MAIL) == [MailFrom("a@example.org")]


def plain(user: bytes, password: bytes) -> bytes:
    return base64.b64encode(b"\0" + user + b"\0" + password)


# RFC 4954 section 4: SASL responses up to 12288 octets; the AUTH command line stays at 512.
LONG_PLAIN = plain(b"u" * 200, b"p" * 200)  # 536 octets of base64
AT_LIMIT = SASL_RESPONSE_LIMIT - 2  # octets of a response line, its CRLF not counted


@pytest.mark.parametrize(
    ("name", "line", "expected"),
    [
        (
            "200-octet user and password",
            LONG_PLAIN,
            AuthResponse(b"\0" + b"u" * 200 + b"\0" + b"p" * 200),
        ),
        (
            "longest base64 within the limit",
            b"QUFB" * (AT_LIMIT // 4),
            AuthResponse(b"AAA" * (AT_LIMIT // 4)),
        ),
        ("at the limit, not base64", b"A" * AT_LIMIT, "501 5.5.2"),
        ("one octet over the limit", b"A" * (AT_LIMIT + 1), "500 5.5.6"),
    ],
)
def test_sasl_response_limit(name: str, line: bytes, expected: AuthResponse | str) -> None:
    data = line + b"\r\n"
    conn = in_exchange()
    events = conn.receive(data)
    out = replies(conn.data_to_send())
    if isinstance(expected, AuthResponse):
        assert (events, out) == ([expected], []), name
        assert conn.pending == expected
    else:
        assert (events, out) == ([], [expected]), name
        assert conn.state is State.READY


def test_the_auth_command_line_itself_stays_at_512() -> None:
    line = b"AUTH PLAIN " + LONG_PLAIN + b"\r\n"
    conn = authed()
    events, out = drive([line + b"NOOP\r\n"], conn=conn)
    assert len(line) > 512
    assert (events, out) == ([], ["500 5.5.2", "250 2.0.0"])
    assert conn.state is State.READY


# RFC 4954 section 5: where EHLO advertised AUTH, MAIL takes AUTH=xtext or AUTH=<> from any
# client, authenticated or not.  zoneq checks it and does not keep it (nor pass it on).
def mail_auth(value: bytes) -> bytes:
    return b"MAIL FROM:<a@example.org> AUTH=" + value + b"\r\n"


AUTH_LINE_LIMIT = 512 + 151 + 500  # RFC 5321 4.5.3.1.4, the MAIL parameters, RFC 4954 5
LONG_AUTH = b"MAIL FROM:<a@example.org> AUTH="


def long_auth(total: int) -> bytes:
    """A MAIL line of ``total`` octets with a valid AUTH= address."""
    return LONG_AUTH + b"x" * (total - len(LONG_AUTH) - 11) + b"+40b.test\r\n"


@pytest.mark.parametrize(
    ("name", "line", "options", "expected"),
    [
        ("unknown sender", mail_auth(b"<>"), {}, "250 2.1.0"),
        ("xtext address", mail_auth(b"alice+40b.test"), {}, "250 2.1.0"),
        ("lower-case keyword", b"MAIL FROM:<a@example.org> auth=<>\r\n", {}, "250 2.1.0"),
        ("with other parameters", mail_auth(b"<> SIZE=10 BODY=8BITMIME"), {}, "250 2.1.0"),
        ("bad xtext", mail_auth(b"bad+Z"), {}, "501 5.5.4"),
        ("not an address", mail_auth(b"alice"), {}, "501 5.5.4"),
        ("a control character", mail_auth(b"a+0Ab@c"), {}, "501 5.5.4"),
        ("no value", b"MAIL FROM:<a@example.org> AUTH\r\n", {}, "501 5.5.4"),
        ("twice", mail_auth(b"<> AUTH=<>"), {}, "501 5.5.4"),
        ("AUTH not advertised: no TLS", mail_auth(b"<>"), {"tls_active": False}, "555 5.5.4"),
        ("AUTH not offered", mail_auth(b"<>"), {"auth_offered": False}, "555 5.5.4"),
        ("line at the limit", long_auth(AUTH_LINE_LIMIT), {}, "250 2.1.0"),
        ("line over the limit", long_auth(AUTH_LINE_LIMIT + 1), {}, "500 5.5.2"),
        # Where AUTH is not advertised the line gets no extra room (a quoted local part
        # may hold " AUTH=" too).
        ("long line, AUTH not offered", long_auth(700), {"auth_offered": False}, "500 5.5.2"),
        ("long line, no TLS", long_auth(700), {"tls_active": False}, "500 5.5.2"),
        (
            "AUTH= past the MAIL limit does not extend it",
            b"MAIL FROM:<a@example.org>" + b" " * 640 + b"AUTH=<>\r\n",
            {},
            "500 5.5.2",
        ),
    ],
)
def test_mail_auth_parameter(
    name: str, line: bytes, options: dict[str, bool], expected: str
) -> None:
    kwargs: dict[str, object] = {"auth_offered": True, "tls_active": True, **options}
    data = EHLO + line + b"NOOP\r\n"
    events, out = drive([data], conn=make(**kwargs))
    assert out[1:] == [expected, "250 2.0.0"], name
    mails = [e for e in events if isinstance(e, MailFrom)]
    if expected.startswith("250"):
        # The event is the one without the parameter: the value is not kept.
        size, body = (10, BodyType.EIGHT_BIT_MIME) if b"SIZE" in line else (None, None)
        assert mails == [MailFrom("a@example.org", size, body)]
    else:
        assert mails == []
    assert drive([bytes([b]) for b in data], conn=make(**kwargs)) == (events, out)


def test_mail_auth_parameter_after_helo_is_555() -> None:
    data = b"HELO client.example\r\n" + mail_auth(b"<>")
    assert session(data, auth_offered=True, tls_active=True) == ["250", "555 5.5.4"]


def test_events_that_need_decisions() -> None:
    assert not Hello("EHLO", "x").needs_decision
    assert not DataChunk(b"").needs_decision
    assert MailFrom("a@b").needs_decision
    assert DataEnd().needs_decision
    assert not DataEnd(rejected=Reply(554, ("x",))).needs_decision
