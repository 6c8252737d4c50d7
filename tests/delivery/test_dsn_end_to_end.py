"""Bounces end to end: the DSN as the sender's MX receives it.

The real store, queue service and zone worker processes of ``test_end_to_end``; the original
bounces at an NXDOMAIN domain and the DSN goes to the sender's MX, Postfix's smtp-sink,
which records the MAIL command's parameters (``X-Mail-Args``) and the content.  smtp-sink
offers 8BITMIME but not SMTPUTF8.
"""

from __future__ import annotations

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
    # smtp-sink never offers SMTPUTF8.  The DSN returning UTF-8 headers in message/global
    # (RFC 6532) needs it, so the session gives it up with 5.6.7 (RFC 6531) instead of
    # handing raw UTF-8 headers to a server that did not agree to them; being a DSN (null
    # reverse-path), it is not bounced in turn.
    assert sorted((e.kind.value, e.enhanced) for e in dsn_outcomes) == [
        ("bounced", "5.6.7"),
        ("delivered", "2.0.0"),
    ]
    (got,) = bed.sink.messages(1, timeout=10)
    message = email.message_from_bytes(got.content, policy=email.policy.default)
    assert isinstance(message, EmailMessage)
    assert list(message.iter_parts())[2].get_content_type() == "message/rfc822"
    # The 8-bit body returned: BODY=8BITMIME (RFC 6152), the null reverse-path, no SMTPUTF8.
    args = got.mail_args.split()
    assert args[0] == "<>" and "BODY=8BITMIME" in args and "SMTPUTF8" not in args
    # The original once, header section and body (smtp-sink writes lines with LF).
    assert got.content.count(b"Subject: latin1") == 1
    assert LATIN1 in got.content.replace(b"\n", b"\r\n")
