"""The session set-up around STARTTLS, against ``FaultServer``: what the client learnt before
TLS is forgotten after it (RFC 3207 section 4.2), and a session that zoneq itself ends (no
TLS when it is required, STARTTLS refused, credentials refused) says QUIT first (RFC 5321
section 4.1.1.10), where one that is in no known state (a failed TLS handshake) is cut.
"""

from __future__ import annotations

import ssl

import pytest

from tests.delivery.test_transport import SENDER, against, tls_server
from tests.support.faultserver import Faults, FaultServer, StartTls
from zoneq.delivery.transport import MailOptions, Recipient, TlsPolicy
from zoneq.protocol.dsn import Notify, Ret
from zoneq.protocol.replies import Stage, Verdict

pytestmark = pytest.mark.integration
__all__ = ["tls_server"]  # the fixture, imported for pytest

# A message asking for every extension the tests below offer or take away.
OPTIONS = MailOptions(size=1000, ret=Ret.HDRS, envid="QQ123")
RECIPIENT = Recipient("a@x.example", notify=frozenset({Notify.FAILURE}))
REFUSED = {1: b"550 5.1.1 No such user"}  # with PIPELINING, DATA goes even so


def command(server: FaultServer, verb: bytes) -> bytes:
    return next(c for c in server.commands() if c.startswith(verb))


# --- RFC 3207 section 4.2: what was offered before TLS does not count after it -------------


def test_extensions_offered_only_before_tls_are_not_used_under_it(
    tls_server: tuple[ssl.SSLContext, str],
) -> None:
    # SIZE 100 would bounce this 1000-octet message; PIPELINING would send DATA even though
    # the only recipient is refused; DSN would add RET, ENVID and NOTIFY.
    faults = Faults(
        starttls=True, size=100, pipelining=True, dsn=True, rcpt_replies=REFUSED, tls_keywords=()
    )
    result, server = against(
        faults, tls_server[0], recipients=[RECIPIENT], options=OPTIONS, tls=TlsPolicy.OPPORTUNISTIC
    )
    (session,) = server.sessions
    assert session.tls and result.tls
    assert result.extensions == frozenset()
    ((verdict, stage),) = [(r.verdict, r.stage) for r in result.recipients]
    assert (verdict, stage) == (Verdict.BOUNCE, Stage.RCPT)  # not 5.3.4 at MAIL: no SIZE
    assert command(server, b"MAIL") == f"MAIL FROM:<{SENDER}>".encode()
    assert command(server, b"RCPT") == b"RCPT TO:<a@x.example>"
    assert b"DATA" not in server.verbs()  # not pipelined


def test_extensions_offered_only_under_tls_are_used(
    tls_server: tuple[ssl.SSLContext, str],
) -> None:
    faults = Faults(
        starttls=True,
        pipelining=False,
        dsn=False,
        rcpt_replies=REFUSED,
        tls_keywords=(b"PIPELINING", b"SIZE 100000", b"DSN"),
    )
    result, server = against(
        faults, tls_server[0], recipients=[RECIPIENT], options=OPTIONS, tls=TlsPolicy.OPPORTUNISTIC
    )
    assert result.tls and {"PIPELINING", "SIZE", "DSN"} <= result.extensions
    assert (
        command(server, b"MAIL") == f"MAIL FROM:<{SENDER}> SIZE=1000 RET=HDRS ENVID=QQ123".encode()
    )
    assert command(server, b"RCPT") == b"RCPT TO:<a@x.example> NOTIFY=FAILURE"
    assert b"DATA" in server.verbs()  # pipelined with MAIL and RCPT


# --- RFC 5321 section 4.1.1.10: QUIT before closing, when the session is in step ----------


@pytest.mark.parametrize(
    ("faults", "quit_sent"),
    [
        (Faults(starttls=False), True),  # not offered: EHLO answered, nothing pending
        (Faults(starttls=True, starttls_mode=StartTls.REFUSE), True),  # 454 read in step
        (Faults(starttls=True, starttls_mode=StartTls.BREAK), False),  # no TLS, no plaintext
        (Faults(starttls=True), False),  # the self-signed certificate does not verify
    ],
    ids=["not-offered", "refused", "broken-handshake", "unverified"],
)
def test_required_tls_says_quit_only_when_the_session_is_in_step(
    faults: Faults, quit_sent: bool, tls_server: tuple[ssl.SSLContext, str]
) -> None:
    result, server = against(
        faults, tls_server[0], recipients=["a@x.example"], tls=TlsPolicy.REQUIRED
    )
    assert result.recipients[0].stage is Stage.STARTTLS
    (session,) = server.sessions
    assert (session.commands[-1] == b"QUIT") is quit_sent, session.commands
    assert b"MAIL" not in server.verbs()


@pytest.mark.parametrize(("mode", "quit_sent"), [(StartTls.REFUSE, True), (StartTls.BREAK, False)])
def test_the_session_left_for_plaintext_says_quit_after_a_refusal(
    mode: StartTls, quit_sent: bool, tls_server: tuple[ssl.SSLContext, str]
) -> None:
    faults = Faults(starttls=True, starttls_mode=mode)
    result, server = against(
        faults, tls_server[0], recipients=["a@x.example"], tls=TlsPolicy.OPPORTUNISTIC
    )
    assert result.recipients[0].verdict is Verdict.DONE and result.tls_fallback is not None
    first, second = server.sessions
    assert (first.commands[-1] == b"QUIT") is quit_sent, first.commands
    assert second.commands[-1] == b"QUIT"


@pytest.mark.parametrize(
    ("faults", "tls", "auth_sent"),
    [
        # Credentials refused: RFC 4954 section 6, 535 5.7.8.
        (Faults(auth_reply=b"535 5.7.8 Authentication credentials invalid"), TlsPolicy.NONE, True),
        # No TLS to send them under: refused before any AUTH.
        (Faults(auth_reply=b"235 2.7.0 Ok"), TlsPolicy.OPPORTUNISTIC, False),
    ],
    ids=["refused", "no-tls"],
)
def test_a_relay_session_ended_at_auth_says_quit(
    faults: Faults, tls: TlsPolicy, auth_sent: bool
) -> None:
    result, server = against(faults, recipients=["a@x.example"], tls=tls, auth=("user", "pw"))
    assert (result.recipients[0].verdict, result.recipients[0].stage) == (
        Verdict.DEFER,
        Stage.AUTH,
    )
    (session,) = server.sessions
    assert (b"AUTH" in server.verbs()) is auth_sent
    assert session.commands[-1] == b"QUIT", session.commands
    assert b"MAIL" not in server.verbs()
