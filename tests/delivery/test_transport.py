"""Tests for the SMTP client transaction (zoneq.delivery.transport).

Two servers play the remote MX: Postfix's smtp-sink (a real implementation, dumping what it
received) and ``FaultServer`` (ours, recording raw bytes and injecting faults).  Both listen
on 127.0.0.0/8 only.  pytest-asyncio is not installed: async bodies run under asyncio.run.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.support.faultserver import (
    EndAction,
    Faults,
    FaultServer,
    Session,
    StartTls,
    self_signed_tls,
)
from tests.support.smtpsink import run_smtp_sink
from zoneq.delivery.transport import (
    RFC5321_TIMEOUTS,
    MailOptions,
    Recipient,
    Timeouts,
    TlsPolicy,
    deliver,
)
from zoneq.delivery.transport.abort import Abort
from zoneq.protocol.dsn import Notify, Ret
from zoneq.protocol.encoder import dot_stuff
from zoneq.protocol.replies import EnhancedStatus, Reply, Stage, Verdict

SENDER = "sender@example.org"
BODY = b"From: sender@example.org\r\nTo: a@example.net\r\nSubject: test\r\n\r\nhello\r\n"
# Small but not tiny: a loaded CI machine must not turn a normal reply into a timeout.
FAST = Timeouts(
    greeting=5, ehlo=5, starttls=5, mail=5, rcpt=5, data_init=5, data_block=5, data_end=5
)


def run(**kwargs: Any) -> Any:
    kwargs.setdefault("helo_name", "client.example.org")
    kwargs.setdefault("sender", SENDER)
    kwargs.setdefault("body", lambda: [BODY])
    kwargs.setdefault("timeouts", FAST)
    kwargs.setdefault("tls", TlsPolicy.NONE)
    return asyncio.run(deliver(**kwargs))


def against(
    faults: Faults,
    server_tls: ssl.SSLContext | None = None,
    *,
    server_type: type[FaultServer] = FaultServer,
    **kwargs: Any,
) -> Any:
    """Run ``deliver`` against a FaultServer (with ``server_tls`` for STARTTLS); return
    (result, server)."""

    async def main() -> Any:
        async with server_type(faults, server_tls) as server:
            kwargs.setdefault("helo_name", "client.example.org")
            kwargs.setdefault("sender", SENDER)
            kwargs.setdefault("body", lambda: [BODY])
            kwargs.setdefault("timeouts", FAST)
            kwargs.setdefault("tls", TlsPolicy.NONE)
            result = await deliver(host=server.host, port=server.port, **kwargs)
            return result, server

    return asyncio.run(main())


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def as_lf(body: bytes) -> bytes:
    """The body as smtp-sink dumps it: every line ending LF, and a final one."""
    text = re.sub(rb"\r\n|\r|\n", b"\n", body)
    return text if not text or text.endswith(b"\n") else text + b"\n"


# --- without a server ----------------------------------------------------------------------


def test_default_timeouts_are_rfc5321_section_4_5_3_2() -> None:
    t = RFC5321_TIMEOUTS
    assert (t.greeting, t.mail, t.rcpt) == (300, 300, 300)
    assert (t.data_init, t.data_block, t.data_end) == (120, 180, 600)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"helo_name": "two words"},
        {"recipients": [Recipient("a@x", notify=frozenset({Notify.NEVER, Notify.SUCCESS}))]},
        {"options": MailOptions(envid="has space")},
    ],
)
def test_caller_mistakes_raise_value_error(kwargs: dict[str, Any]) -> None:
    kwargs.setdefault("recipients", ["a@example.net"])
    with pytest.raises(ValueError):
        run(host="127.0.0.1", port=unused_port(), **kwargs)


def test_address_with_control_characters_bounces_without_connecting() -> None:
    result = run(host="127.0.0.1", port=unused_port(), recipients=["a@x\r\nRSET"])
    (only,) = result.recipients
    assert (only.verdict, only.stage, only.status) == (
        Verdict.BOUNCE,
        Stage.RCPT,
        EnhancedStatus(5, 1, 3),
    )
    assert result.peer is None


@pytest.mark.parametrize("reply", [None, Reply(250, ("Ok",), EnhancedStatus(2, 0, 0))])
def test_an_abort_never_says_done(reply: Reply | None) -> None:
    """An Abort ends the session before any 2yz to the final dot, the only reply that
    delivers (RFC 5321 section 4.1.1.4): whatever verdict it is given, the recipients it
    settles go on (NEXT_HOST), and never with a 2.x.x status."""
    abort = Abort(Stage.EHLO, Verdict.DONE, reply=reply)
    assert abort.verdict is Verdict.NEXT_HOST
    assert abort.status is None or abort.status.klass == 4


@pytest.mark.integration
def test_connection_refused_is_next_host_for_everyone() -> None:
    result = run(host="127.0.0.1", port=unused_port(), recipients=["a@x.example", "b@x.example"])
    assert [r.verdict for r in result.recipients] == [Verdict.NEXT_HOST] * 2
    assert {r.stage for r in result.recipients} == {Stage.CONNECT}
    assert result.recipients[0].status == EnhancedStatus(4, 4, 1)
    assert not result.possible_duplicate


# --- smtp-sink -----------------------------------------------------------------------------


@pytest.mark.integration
def test_plain_delivery_to_smtp_sink() -> None:
    body = b"Subject: dots\n\n.leading dot\r\n..two\rbare CR\nbare LF\r\n.\r\nno final newline"
    chunks = [body[i : i + 7] for i in range(0, len(body), 7)]  # boundaries everywhere
    with run_smtp_sink() as sink:
        result = run(
            host=sink.host,
            port=sink.port,
            recipients=["a@example.net", "b@example.net", "c@example.com"],
            body=lambda: iter(chunks),
            source_address="127.0.0.9",
        )
        (message,) = sink.messages(1)
    assert [r.verdict for r in result.recipients] == [Verdict.DONE] * 3
    assert {r.stage for r in result.recipients} == {Stage.END_OF_DATA}
    assert result.recipients[0].reply.code == 250
    assert (result.peer, result.local, result.tls) == (sink.host, "127.0.0.9", False)
    assert message.client_addr == "127.0.0.9"
    assert message.helo == "client.example.org"
    assert message.mail_args == f"<{SENDER}>"
    assert message.rcpt_args == ["<a@example.net>", "<b@example.net>", "<c@example.com>"]
    assert message.content == as_lf(body)


@pytest.mark.integration
def test_dsn_parameters_reach_smtp_sink() -> None:
    with run_smtp_sink() as sink:
        result = run(
            host=sink.host,
            port=sink.port,
            recipients=[
                Recipient(
                    "a@example.net",
                    notify=frozenset({Notify.FAILURE, Notify.SUCCESS}),
                    orcpt="rfc822;A+2Bx@example.net",
                ),
                Recipient("b@example.net", notify=frozenset({Notify.NEVER})),
            ],
            options=MailOptions(ret=Ret.HDRS, envid="QQ+2B123", eight_bit=True),
        )
        (message,) = sink.messages(1)
    assert "DSN" in result.extensions
    assert message.mail_args == f"<{SENDER}> BODY=8BITMIME RET=HDRS ENVID=QQ+2B123"
    assert message.rcpt_args == [
        "<a@example.net> NOTIFY=SUCCESS,FAILURE ORCPT=rfc822;A+2Bx@example.net",
        "<b@example.net> NOTIFY=NEVER",
    ]


@pytest.mark.integration
def test_an_orcpt_that_cannot_be_sent_is_converted_or_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ORCPTs an older receiver stored: once a ValueError that deferred every recipient
    of the job until it bounced.  ORCPT is optional information (RFC 3461 section 4.2):
    the raw UTF-8 form is sent as utf-8-addr-xtext (RFC 6533 section 3), one that cannot
    be sent is left out with a log line, and the message is delivered to everyone.  So is
    one over section 4.2's 500 characters as sent: the receiver takes 500 as received, in
    the unitext form, and stores the longer xtext form (90 "ö": 540 characters)."""
    with run_smtp_sink() as sink, caplog.at_level(logging.WARNING):
        result = run(
            host=sink.host,
            port=sink.port,
            recipients=[
                Recipient("a@example.net", orcpt="utf-8;jörg@example.net"),
                Recipient("b@example.net", orcpt="rfc822;b+0D+0Ax@example.net"),
                Recipient("c@example.net"),
                Recipient("d@example.net", orcpt="utf-8;" + "\\x{F6}" * 90 + "@example.net"),
            ],
        )
        (message,) = sink.messages(1)
    assert [r.verdict for r in result.recipients] == [Verdict.DONE] * 4
    assert message.rcpt_args == [
        "<a@example.net> ORCPT=utf-8;j\\x{F6}rg@example.net",
        "<b@example.net>",
        "<c@example.net>",
        "<d@example.net>",
    ]
    logged = [r.getMessage() for r in caplog.records if "ORCPT" in r.getMessage()]
    assert [line.split()[2] for line in logged] == ["b@example.net", "d@example.net"]


@pytest.mark.integration
def test_dsn_parameters_are_left_out_when_not_offered() -> None:
    with run_smtp_sink("-N") as sink:
        result = run(
            host=sink.host,
            port=sink.port,
            recipients=[Recipient("a@example.net", notify=frozenset({Notify.SUCCESS}))],
            options=MailOptions(ret=Ret.FULL),
        )
        (message,) = sink.messages(1)
    assert "DSN" not in result.extensions
    assert result.recipients[0].verdict is Verdict.DONE
    assert message.mail_args == f"<{SENDER}>"
    assert message.rcpt_args == ["<a@example.net>"]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("option", "verdict", "code"), [("-r", Verdict.DEFER, 450), ("-f", Verdict.BOUNCE, 500)]
)
def test_smtp_sink_refusing_every_rcpt(option: str, verdict: Verdict, code: int) -> None:
    with run_smtp_sink(option, "RCPT") as sink:
        result = run(host=sink.host, port=sink.port, recipients=["a@example.net", "b@x.example"])
        assert sink.messages(0, timeout=0.2) == []  # no DATA without a recipient
    assert [r.verdict for r in result.recipients] == [verdict] * 2
    assert {r.stage for r in result.recipients} == {Stage.RCPT}
    assert {r.reply.code for r in result.recipients} == {code}


@pytest.mark.integration
def test_smtp_sink_421_after_the_dot_is_a_possible_duplicate() -> None:
    with run_smtp_sink("-Q", ".") as sink:
        result = run(host=sink.host, port=sink.port, recipients=["a@example.net"])
    (only,) = result.recipients
    assert (only.verdict, only.stage, only.possible_duplicate) == (
        Verdict.DEFER,
        Stage.END_OF_DATA,
        True,
    )


# --- fault server: per-recipient outcomes --------------------------------------------------


@pytest.mark.integration
def test_mixed_rcpt_replies_give_one_outcome_each() -> None:
    faults = Faults(
        rcpt_replies={
            2: b"450 4.2.1 Mailbox busy, try again",
            3: b"550 5.1.1 No such user",
        }
    )
    result, server = against(faults, recipients=["ok@x.example", "busy@x.example", "no@x.example"])
    ok, busy, no = result.recipients
    assert (ok.verdict, ok.stage) == (Verdict.DONE, Stage.END_OF_DATA)
    assert (busy.verdict, busy.stage, busy.status) == (
        Verdict.DEFER,
        Stage.RCPT,
        EnhancedStatus(4, 2, 1),
    )
    assert (no.verdict, no.stage, no.reply.code) == (Verdict.BOUNCE, Stage.RCPT, 550)
    # One transaction: the accepted recipient got the message once and was not sent again.
    assert len(server.payloads) == 1
    assert server.verbs().count(b"RCPT") == 3


@pytest.mark.integration
@pytest.mark.parametrize(("pipelining", "rcpt_commands"), [(False, 7), (True, 9)])
def test_452_too_many_recipients_are_sent_in_follow_up_transactions(
    pipelining: bool, rcpt_commands: int
) -> None:
    rcpts = [f"r{i}@x.example" for i in range(5)]
    faults = Faults(max_recipients=2, pipelining=pipelining)
    result, server = against(faults, recipients=rcpts)
    assert [r.verdict for r in result.recipients] == [Verdict.DONE] * 5
    assert [r.transaction for r in result.recipients] == [0, 0, 1, 1, 2]
    assert result.transactions == 3
    assert len(server.sessions) == 1  # the same connection
    assert len(server.payloads) == 3
    verbs = server.verbs()
    assert verbs.count(b"MAIL") == 3
    assert b"RSET" not in verbs  # a completed transaction needs no RSET (RFC 5321 4.1.1.4)
    sent = [c for c in server.commands() if c.startswith(b"RCPT")]
    # One by one: 5 accepted, plus the first 452 of each transaction (r2, r4); the rest wait
    # for the next transaction unsent.  Pipelined: every recipient of a group is sent, 5 + 3 + 1.
    assert len(sent) == rcpt_commands


@pytest.mark.integration
@pytest.mark.parametrize("pipelining", [False, True])
def test_all_recipients_refused_sends_no_data(pipelining: bool) -> None:
    faults = Faults(rcpt_replies={1: b"550 5.1.1 No", 2: b"551 5.1.6 Moved"}, pipelining=pipelining)
    result, server = against(faults, recipients=["a@x.example", "b@x.example"])
    assert [r.verdict for r in result.recipients] == [Verdict.BOUNCE] * 2
    if pipelining:
        # DATA went with the group; this server answers it 354 even with no recipient (RFC
        # 2920 section 3.1 says it must not), so it gets the bare terminator: no message.
        assert server.payloads == [b".\r\n"]
    else:
        assert b"DATA" not in server.verbs()
    assert server.verbs()[-1] == b"QUIT"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("faults", "stage", "verdict"),
    [
        (Faults(mail_reply=b"451 4.3.0 Try later"), Stage.MAIL, Verdict.DEFER),
        (Faults(mail_reply=b"553 5.1.8 Bad sender"), Stage.MAIL, Verdict.BOUNCE),
        (Faults(data_reply=b"554 5.7.1 No"), Stage.DATA, Verdict.BOUNCE),
        (Faults(end_reply=b"552 5.3.4 Too big"), Stage.END_OF_DATA, Verdict.BOUNCE),
        (Faults(end_reply=b"451 4.3.0 Later"), Stage.END_OF_DATA, Verdict.DEFER),
        (Faults(greeting=b"554 5.7.1 Go away"), Stage.GREETING, Verdict.NEXT_HOST),
    ],
)
def test_refusals_by_stage(faults: Faults, stage: Stage, verdict: Verdict) -> None:
    result, _ = against(faults, recipients=["a@x.example", "b@x.example"])
    assert {(r.stage, r.verdict) for r in result.recipients} == {(stage, verdict)}
    assert not result.possible_duplicate


@pytest.mark.integration
@pytest.mark.parametrize("pipelining", [False, True])
def test_421_at_rcpt_sends_everyone_to_the_next_host(pipelining: bool) -> None:
    faults = Faults(rcpt_replies={2: b"421 4.3.2 Shutting down"}, pipelining=pipelining)
    result, server = against(faults, recipients=["a@x.example", "b@x.example", "c@x.example"])
    assert [r.verdict for r in result.recipients] == [Verdict.NEXT_HOST] * 3
    assert {r.reply.code for r in result.recipients} == {421}
    assert not server.payloads  # pipelined, DATA went with the group, but no body followed
    assert (b"DATA" in server.verbs()) is pipelining


# --- fault server: a 2yz that is not the one expected while setting up --------------------


def ehlo_answered(reply: bytes | None) -> type[FaultServer]:
    """FaultServer answering EHLO with ``reply``, one line (None: as usual)."""

    class OddEhloServer(FaultServer):
        def _ehlo_lines(self, session: Session) -> list[bytes]:
            return [reply] if reply else super()._ehlo_lines(session)

    return OddEhloServer


@pytest.mark.integration
@pytest.mark.parametrize(
    ("greeting", "ehlo", "stage"),
    [
        # The banner twice in one packet: the second 220 is read as the reply to EHLO.
        (b"220 mx ESMTP\r\n220 mx ESMTP", None, Stage.EHLO),
        (b"250 mx ESMTP", None, Stage.GREETING),
        (b"220 mx ESMTP", b"252 2.0.0 hm", Stage.EHLO),
        (b"220 mx ESMTP", b"220 mx ESMTP", Stage.EHLO),
    ],
    ids=["banner-twice", "greeting-250", "ehlo-252", "ehlo-220"],
)
def test_a_2yz_other_than_the_expected_one_while_setting_up_delivers_nothing(
    greeting: bytes, ehlo: bytes | None, stage: Stage
) -> None:
    """Only a 2yz to the final dot delivers (RFC 5321 section 4.1.1.4); a greeting other
    than 220, or a reply to EHLO other than 250, is a session that never started (RFC 5321
    section 3.1): the next host, with no MAIL sent and no 2.x.x status."""
    result, server = against(
        Faults(greeting=greeting),
        server_type=ehlo_answered(ehlo),
        recipients=["a@x.example", "b@x.example"],
    )
    assert [r.verdict for r in result.recipients] == [Verdict.NEXT_HOST] * 2
    assert {r.stage for r in result.recipients} == {stage}
    assert {r.status for r in result.recipients} == {EnhancedStatus(4, 5, 0)}
    assert b"MAIL" not in server.verbs()
    assert not result.possible_duplicate


# --- fault server: after the dot -----------------------------------------------------------


@pytest.mark.integration
def test_no_reply_after_the_dot_is_defer_and_possible_duplicate() -> None:
    result, server = against(
        Faults(end_action=EndAction.DROP), recipients=["a@x.example", "b@x.example"]
    )
    assert len(server.payloads) == 1  # the server has the whole message
    for r in result.recipients:
        assert (r.verdict, r.stage, r.possible_duplicate) == (
            Verdict.DEFER,
            Stage.END_OF_DATA,
            True,
        )
        assert r.reply is None
    assert result.possible_duplicate


@pytest.mark.integration
def test_421_after_the_dot_is_defer_and_possible_duplicate() -> None:
    result, _ = against(Faults(end_reply=b"421 4.4.2 Timeout, closing"), recipients=["a@x.test"])
    (only,) = result.recipients
    assert (only.verdict, only.possible_duplicate, only.reply.code) == (Verdict.DEFER, True, 421)


@pytest.mark.integration
@pytest.mark.parametrize(
    "end_reply",
    [b"250 2.0.0 Ok: queued as 12345\rABC", b"250 2.0.0 Ok queued\r"],
    ids=["cr-inside", "cr-before-crlf"],
)
def test_a_bare_cr_in_the_text_of_the_final_250_is_still_delivered(end_reply: bytes) -> None:
    """The client acts on the code, not the text (RFC 5321 section 4.2): a stray CR in the
    250's text must not make it "no reply", a possible duplicate sent again later."""
    result, server = against(Faults(end_reply=end_reply), recipients=["a@x.example"])
    (only,) = result.recipients
    assert (only.verdict, only.stage, only.possible_duplicate) == (
        Verdict.DONE,
        Stage.END_OF_DATA,
        False,
    )
    assert only.reply.code == 250 and "\r" not in only.reply.text
    assert len(server.payloads) == 1
    assert server.verbs()[-1] == b"QUIT"  # the connection stayed usable


@pytest.mark.integration
def test_a_bare_cr_in_the_text_of_a_550_to_rcpt_still_bounces() -> None:
    faults = Faults(rcpt_replies={1: b"550 5.1.1 user\runknown"})
    result, server = against(faults, recipients=["a@x.example", "b@x.example"])
    assert [(r.verdict, r.stage) for r in result.recipients] == [
        (Verdict.BOUNCE, Stage.RCPT),
        (Verdict.DONE, Stage.END_OF_DATA),
    ]
    assert result.recipients[0].status == EnhancedStatus(5, 1, 1)
    assert len(server.payloads) == 1


@pytest.mark.integration
def test_a_bare_cr_in_a_refused_ehlo_still_falls_back_to_helo() -> None:
    """The refusal is read, CR and all (the client acts on the code, RFC 5321 section
    4.2), so a 5yz to EHLO still gets HELO (section 3.2) instead of the next host."""
    result, server = against(
        Faults(),
        server_type=ehlo_answered(b"502 5.5.2 Error: command\r not recognized"),
        recipients=["a@x.example"],
    )
    assert [r.verdict for r in result.recipients] == [Verdict.DONE]
    assert server.verbs()[:3] == [b"EHLO", b"HELO", b"MAIL"]


@pytest.mark.integration
def test_a_bare_cr_in_a_refused_greeting_keeps_its_code_and_text() -> None:
    result, _ = against(
        Faults(greeting=b"554 5.7.1 blocked\rusing zen.spamhaus.org"), recipients=["a@x.example"]
    )
    [recipient] = result.recipients
    assert recipient.stage is Stage.GREETING
    assert recipient.reply == Reply(
        554, ("blocked using zen.spamhaus.org",), EnhancedStatus(5, 7, 1)
    )


@pytest.mark.integration
def test_a_slow_final_reply_is_waited_for() -> None:
    # The server takes 2 s to answer the dot (a content scan).  With a DATA-termination
    # timeout above that there is one copy, delivered.  With a short one for everything
    # (aiosmtplib's style, scaled down), the same server would have been a timeout after it
    # had the message: a deferral, and a second copy on retry.
    slow = Faults(end_delay=2.0)
    patient = Timeouts(greeting=1, ehlo=1, mail=1, rcpt=1, data_init=1, data_block=1, data_end=4)
    result, server = against(slow, recipients=["a@x.example"], timeouts=patient)
    assert result.recipients[0].verdict is Verdict.DONE
    assert not result.possible_duplicate
    assert len(server.payloads) == 1

    hasty = Timeouts(greeting=1, ehlo=1, mail=1, rcpt=1, data_init=1, data_block=1, data_end=1)
    result, server = against(slow, recipients=["a@x.example"], timeouts=hasty)
    assert result.recipients[0].verdict is Verdict.DEFER
    assert result.possible_duplicate
    assert len(server.payloads) == 1  # ... although the server got it


# --- fault server: STARTTLS ----------------------------------------------------------------


@pytest.fixture
def tls_server(tmp_path: Any) -> Iterator[tuple[ssl.SSLContext, str]]:
    context, cert = self_signed_tls(tmp_path)
    yield context, str(cert)


def no_mail_sent(server: FaultServer) -> bool:
    return all(b"MAIL FROM" not in s.raw.upper() for s in server.sessions)


@pytest.mark.integration
def test_opportunistic_tls_is_used_when_offered(tls_server: tuple[ssl.SSLContext, str]) -> None:
    context, _ = tls_server
    result, server = against(
        Faults(starttls=True), context, recipients=["a@x.example"], tls=TlsPolicy.OPPORTUNISTIC
    )
    assert result.recipients[0].verdict is Verdict.DONE
    assert result.tls and result.tls_fallback is None
    (session,) = server.sessions
    assert session.tls
    assert server.verbs()[:4] == [b"EHLO", b"STARTTLS", b"EHLO", b"MAIL"]


@pytest.mark.integration
@pytest.mark.parametrize("mode", [StartTls.REFUSE, StartTls.BREAK])
def test_opportunistic_tls_falls_back_to_plaintext(
    mode: StartTls, tls_server: tuple[ssl.SSLContext, str]
) -> None:
    context, _ = tls_server
    faults = Faults(starttls=True, starttls_mode=mode)
    result, server = against(
        faults, context, recipients=["a@x.example"], tls=TlsPolicy.OPPORTUNISTIC
    )
    assert result.recipients[0].verdict is Verdict.DONE
    assert not result.tls
    assert result.tls_fallback is not None
    first, second = server.sessions
    assert b"MAIL" not in first.raw  # the failed session carried no mail
    assert b"STARTTLS" not in second.raw and b"MAIL FROM:<" in second.raw


@pytest.mark.integration
@pytest.mark.parametrize(
    ("faults", "status"),
    [
        (Faults(starttls=False), EnhancedStatus(4, 7, 4)),
        (Faults(starttls=True, starttls_mode=StartTls.REFUSE), EnhancedStatus(4, 7, 4)),
        (Faults(starttls=True, starttls_mode=StartTls.BREAK), EnhancedStatus(4, 7, 5)),
        (Faults(starttls=True), EnhancedStatus(4, 7, 5)),  # self-signed: verification fails
    ],
)
def test_required_tls_never_sends_mail_in_plaintext(
    faults: Faults, status: EnhancedStatus, tls_server: tuple[ssl.SSLContext, str]
) -> None:
    context, _ = tls_server
    result, server = against(
        faults, context, recipients=["a@x.example", "b@x.example"], tls=TlsPolicy.REQUIRED
    )
    # NEXT_HOST: another MX host may offer TLS (RFC 5321 section 5.1); the walk defers
    # with this 4.7.x reason when none does (``test_walk.py``).
    assert {(r.verdict, r.stage, r.status) for r in result.recipients} == {
        (Verdict.NEXT_HOST, Stage.STARTTLS, status)
    }
    assert len(server.sessions) == 1
    assert no_mail_sent(server)


@pytest.mark.integration
def test_required_tls_with_a_trusted_certificate(tls_server: tuple[ssl.SSLContext, str]) -> None:
    context, cert = tls_server
    client = ssl.create_default_context(cafile=cert)
    result, server = against(
        Faults(starttls=True),
        context,
        recipients=["a@x.example"],
        tls=TlsPolicy.REQUIRED,
        tls_context=client,
        tls_server_name="localhost",
    )
    assert result.recipients[0].verdict is Verdict.DONE
    assert result.tls and server.sessions[0].tls


# --- fault server: what goes on the wire ---------------------------------------------------


@pytest.mark.integration
def test_data_payload_has_only_crlf_and_short_lines() -> None:
    body = (
        b"Subject: nasty\n\n"
        + b".leading dot\n..double\r.after bare CR\r\n"
        + b"x" * 3000
        + b"\n"
        + b"smuggle\n.\nafter\r.\rend\r\n"
        + b"y" * 2500
    )
    chunks = [body[i : i + 999] for i in range(0, len(body), 999)]
    result, server = against(Faults(), recipients=["a@x.example"], body=lambda: chunks)
    assert result.recipients[0].verdict is Verdict.DONE
    (payload,) = server.payloads
    assert server.stats.bare_cr_or_lf == 0
    lines = payload.split(b"\r\n")
    assert lines[-2:] == [b".", b""]
    assert b"\r" not in b"".join(lines) and b"\n" not in b"".join(lines)
    assert max(len(line) for line in lines) + 2 <= 1000
    # Exactly the encoder's output for the whole body: chunking changed nothing.
    assert payload == b"".join(dot_stuff([body]))


@pytest.mark.integration
def test_a_large_body_is_streamed_never_held_whole() -> None:
    size = 20 * 1024 * 1024
    line = b"0123456789" * 7 + b"\n"  # LF-only: the encoder rewrites every line
    chunk = line * (65536 // len(line))
    count = size // len(chunk)
    streamed_before_end: list[int] = []
    server_box: list[FaultServer] = []

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(count):
            if i == count // 2 and server_box:
                streamed_before_end.append(server_box[0].stats.octets)
            yield chunk

    async def main() -> tuple[Any, FaultServer, int]:
        async with FaultServer(Faults(keep_payloads=False)) as server:
            server_box.append(server)
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                result = await deliver(
                    host=server.host,
                    port=server.port,
                    helo_name="client.example.org",
                    sender=SENDER,
                    recipients=["a@x.example"],
                    body=chunks,
                    tls=TlsPolicy.NONE,
                    timeouts=FAST,
                )
                peak = tracemalloc.get_traced_memory()[1] - base
            finally:
                tracemalloc.stop()
            return result, server, peak

    result, server, peak = asyncio.run(main())
    assert result.recipients[0].verdict is Verdict.DONE
    assert server.stats.count == 1
    assert server.stats.octets >= count * len(chunk)
    assert server.stats.bare_cr_or_lf == 0
    assert streamed_before_end and streamed_before_end[0] > 0  # on the wire while still reading
    assert peak < count * len(chunk) // 10, f"peak growth {peak} bytes"


@pytest.mark.integration
def test_a_failing_body_source_defers_and_sends_no_dot() -> None:
    def broken() -> Iterator[bytes]:
        yield b"Subject: half\r\n\r\nfirst part\r\n"
        raise OSError("chunk store unavailable")

    result, server = against(Faults(), recipients=["a@x.example"], body=broken)
    (only,) = result.recipients
    assert (only.verdict, only.stage, only.status) == (
        Verdict.DEFER,
        Stage.DATA,
        EnhancedStatus(4, 3, 0),
    )
    assert not only.possible_duplicate
    assert server.stats.count == 0  # the server never saw the end of data


@pytest.mark.integration
def test_smtputf8_and_size_are_checked_before_sending() -> None:
    result, server = against(
        Faults(smtputf8=False), recipients=["ascii@x.example", "jörg@x.example"]
    )
    ascii_one, utf8_one = result.recipients
    assert ascii_one.verdict is Verdict.DONE
    assert (utf8_one.verdict, utf8_one.status) == (Verdict.BOUNCE, EnhancedStatus(5, 6, 7))

    result, server = against(
        Faults(smtputf8=True), recipients=["jörg@x.example"], options=MailOptions(size=10)
    )
    assert result.recipients[0].verdict is Verdict.DONE
    mail = next(c for c in server.commands() if c.startswith(b"MAIL"))
    assert mail.endswith(b" SMTPUTF8")
    assert "jörg".encode() in next(c for c in server.commands() if c.startswith(b"RCPT"))

    result, server = against(
        Faults(size=1000), recipients=["a@x.example"], options=MailOptions(size=5000)
    )
    assert (result.recipients[0].verdict, result.recipients[0].status) == (
        Verdict.BOUNCE,
        EnhancedStatus(5, 3, 4),
    )
    assert b"MAIL" not in server.verbs()
