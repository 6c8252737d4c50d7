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
from email.message import EmailMessage

import pytest

from tests.delivery.test_end_to_end import (  # noqa: F401 (bed is a fixture)
    Bed,
    bed,
    running_core,
    until_empty,
    write_config,
)
from tests.storage.conftest import async_test
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
