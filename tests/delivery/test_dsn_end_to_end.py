"""Bounces end to end: the DSN as the sender's MX receives it.

The real store, queue service and zone worker processes of ``test_end_to_end``; the original
bounces at an NXDOMAIN domain and the DSN goes to the sender's MX, Postfix's smtp-sink,
which records the MAIL command's parameters (``X-Mail-Args``) and the content.  smtp-sink
offers 8BITMIME but not SMTPUTF8.
"""

from __future__ import annotations

import binascii
import email
import email.policy
from collections.abc import Iterator
from email.message import EmailMessage
from pathlib import Path

import pytest

from tests.delivery.test_end_to_end import (  # noqa: F401 (bed is a fixture)
    Bed,
    bed,
    running_core,
    until_empty,
    write_config,
)
from tests.storage.conftest import async_test
from tests.support.dnsmasq import running_dnsmasq
from tests.support.smtpsink import Sink, run_smtp_sink
from zoneq.protocol.dsn import SUBJECT_DELIVERED
from zoneq.storage.records import MessageMeta, NewRecipient
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

LATIN1 = (
    b"From: sender@src.test\r\nTo: y@nx.test\r\nSubject: latin1\r\n"
    b"Message-ID: <latin1@src.test>\r\nContent-Type: text/plain; charset=latin1\r\n"
    b"Content-Transfer-Encoding: 8bit\r\n\r\nGr\xfc\xdfe\r\n"
)
UTF8 = (
    "From: Jörg <sender@src.test>\r\nTo: y@nx.test\r\nSubject: Grüße\r\n"
    "Message-ID: <utf8@src.test>\r\n\r\nHallo\r\n"
).encode()


async def queue_full(store: QueueStore, body: bytes, *, smtputf8: bool) -> None:
    """A RET=FULL message from sender@src.test to an NXDOMAIN domain (it bounces)."""
    msg_id = store.begin(0)
    meta = MessageMeta(
        msg_id, "sender@src.test", len(body), 1, 0, ret="FULL", body_8bit=True, smtputf8=smtputf8
    )
    await store.commit(meta, [NewRecipient("y@nx.test", "default")], 0, tail=body)


@async_test
async def test_ret_full_dsns_carry_the_original_once_with_their_mail_parameters(
    bed: Bed,  # noqa: F811 (the fixture imported above)
) -> None:
    async with running_core(write_config(bed)) as core:
        await queue_full(core.store, LATIN1, smtputf8=False)
        await queue_full(core.store, UTF8, smtputf8=True)
        await until_empty(core.store)
        dsn_outcomes = [
            e for _, e in core.store.events() if e.zone == "bounces" and e.kind.value != "accepted"
        ]
    # smtp-sink never offers SMTPUTF8.  Both notices still arrive: to an ASCII sender a
    # notice is 7-bit whatever the original held, because it is built before anyone knows
    # what the sender's MX offers, and one refused for that (5.6.7, as this test once
    # expected for the UTF-8 original) is lost, a notice never being bounced in turn.
    assert sorted((e.kind.value, e.enhanced) for e in dsn_outcomes) == [
        ("delivered", "2.0.0"),
        ("delivered", "2.0.0"),
    ]
    got = bed.sink.messages(2, timeout=10)
    assert len(got) == 2
    by_subject: dict[str, tuple[EmailMessage, bytes]] = {}
    for one in got:
        content = one.content.replace(b"\n", b"\r\n")  # smtp-sink writes lines with LF
        message = email.message_from_bytes(content, policy=email.policy.default)
        assert isinstance(message, EmailMessage)
        # The null reverse-path; 7-bit, so neither BODY=8BITMIME (RFC 6152) nor SMTPUTF8.
        args = one.mail_args.split()
        assert args[0] == "<>" and "BODY=8BITMIME" not in args and "SMTPUTF8" not in args
        assert content.isascii() and message.get("Content-Transfer-Encoding") is None
        by_subject["latin1" if b"Subject: latin1" in content else "utf8"] = (message, content)
    assert set(by_subject) == {"latin1", "utf8"}

    # The 8-bit body cannot go in message/rfc822 (RFC 2046 section 5.2.1): the header
    # section comes back alone, once, and the text says why (RFC 3461 section 4.3).
    message, content = by_subject["latin1"]
    parts = list(message.iter_parts())
    assert parts[2].get_content_type() == "text/rfc822-headers"
    assert content.count(b"Subject: latin1") == 1
    assert LATIN1.partition(b"\r\n\r\n")[0] + b"\r\n" in content
    assert "body is not returned" in " ".join(str(parts[0].get_content()).split())

    # The UTF-8 headers come back in message/global, quoted-printable (RFC 6532 section
    # 3.5), exactly as they were once decoded.
    message, content = by_subject["utf8"]
    third = list(message.iter_parts())[2]
    assert third.get_content_type() == "message/global"
    assert third["Content-Transfer-Encoding"] == "quoted-printable"
    boundary = message.get_boundary()
    assert boundary is not None
    raw = content.split(b"\r\n--" + boundary.encode("ascii"))[3]
    assert binascii.a2b_qp(raw.partition(b"\r\n\r\n")[2]) == UTF8


@pytest.fixture
def plain_mx(tmp_path: Path) -> Iterator[tuple[Bed, Sink]]:
    """Two remote MX hosts on one port: the bed's sink, which offers DSN, for ok.test and
    for the sender's own domain src.test (the notices land there); and ``smtp-sink -e``
    for plain.test, which refuses EHLO, so zoneq speaks HELO to it and no extension (no
    DSN) is offered."""
    with run_smtp_sink() as sink, run_smtp_sink("-e", port=sink.port) as plain:
        records = [
            "mx-host=ok.test,mx.ok.test,10",
            f"host-record=mx.ok.test,{sink.host}",
            "mx-host=src.test,mx.src.test,10",
            f"host-record=mx.src.test,{sink.host}",
            "mx-host=plain.test,mx.plain.test,10",
            f"host-record=mx.plain.test,{plain.host}",
        ]
        with running_dnsmasq(records, tmp_path / "dns") as dns:
            yield Bed(sink, dns, "127.0.0.1", tmp_path), plain


async def queue_notify(
    store: QueueStore,
    recipients: list[tuple[str, tuple[str, ...]]],
    sender: str = "sender@src.test",
) -> None:
    """A RET=FULL message with an ENVID: each recipient with its NOTIFY keywords."""
    msg_id = store.begin(0)
    meta = MessageMeta(msg_id, sender, len(BODY), 1, 0, ret="FULL", envid="e2e")
    rcpts = [
        NewRecipient(address, "default", notify, f"rfc822;{address}")
        for address, notify in recipients
    ]
    await store.commit(meta, rcpts, 0, tail=BODY)


BODY = (
    b"From: sender@src.test\r\nTo: a@plain.test\r\nSubject: relayed\r\n"
    b"Message-ID: <relayed@src.test>\r\n\r\nthe body stays home\r\n"
)


@async_test
async def test_success_relayed_to_a_server_without_dsn_is_reported_to_the_sender_once(
    plain_mx: tuple[Bed, Sink],
) -> None:
    """RFC 3461 section 5.2.2: a recipient with NOTIFY=SUCCESS delivered to a server that
    does not offer DSN gets a "relayed" notice from zoneq, one per message for all such
    recipients; none for NOTIFY=FAILURE or no NOTIFY, none to the null reverse-path, and
    none where the server offers DSN (NOTIFY goes on to it, and the notice is its to send).
    """
    two_mx, plain = plain_mx
    async with running_core(write_config(two_mx)) as core:
        await queue_notify(
            core.store,
            [
                ("a@plain.test", ("SUCCESS",)),
                ("b@plain.test", ("SUCCESS", "FAILURE")),
                ("c@plain.test", ("FAILURE",)),
                ("d@plain.test", ()),
            ],
        )
        await queue_notify(core.store, [("e@plain.test", ("FAILURE",)), ("f@plain.test", ())])
        await queue_notify(core.store, [("g@plain.test", ("SUCCESS",))], sender="")
        await queue_notify(core.store, [("h@ok.test", ("SUCCESS",))])
        await until_empty(core.store)
        kinds = {(e.zone, e.kind.value) for _, e in core.store.events()}
    assert kinds == {
        ("default", "accepted"),
        ("default", "delivered"),
        ("bounces", "accepted"),
        ("bounces", "delivered"),
    }
    assert len(plain.messages(3, timeout=10)) == 3
    got = two_mx.sink.messages(2, timeout=10)
    notices = [m for m in got if m.mail_args.split()[0] == "<>"]
    assert len(notices) == 1, [m.mail_args for m in got]
    (passed_on,) = [m for m in got if m not in notices]
    assert "NOTIFY=SUCCESS" in passed_on.rcpt_args[0]  # ok.test's MX owes the notice
    (notice,) = notices
    assert notice.rcpt_args[0].startswith("<sender@src.test>")
    report = email.message_from_bytes(notice.content, policy=email.policy.default)
    assert isinstance(report, EmailMessage)
    assert report["Subject"] == SUBJECT_DELIVERED
    parts = list(report.iter_parts())
    assert [p.get_content_type() for p in parts] == [
        "text/plain",
        "message/delivery-status",
        "text/rfc822-headers",  # RET=FULL, but a success returns the headers only (4.3)
    ]
    assert b"the body stays home" not in notice.content
    status = parts[1].get_payload()
    assert status[0]["Original-Envelope-Id"] == "e2e"
    blocks = status[1:]
    assert [b["Final-Recipient"] for b in blocks] == [
        "rfc822; a@plain.test",
        "rfc822; b@plain.test",
    ]
    for block in blocks:
        assert (block["Action"], block["Status"]) == ("relayed", "2.0.0")
        assert block["Remote-MTA"] == "dns; mx.plain.test"
        assert block["Diagnostic-Code"].startswith("smtp; 250")  # the reply to the final dot
        assert block["Original-Recipient"] == block["Final-Recipient"]
