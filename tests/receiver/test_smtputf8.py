"""SMTPUTF8 through the real receiver (RFC 6531): non-ASCII addresses need the MAIL
parameter, and a message sent with it is stored with its addresses as sent and the flag
that makes delivery require SMTPUTF8 of the next hop (section 3.4)."""

from __future__ import annotations

from pathlib import Path

from tests.receiver.harness import Raw, nothing_left, queued_id, run, stored_body
from zoneq.receiver import SmtpReceiver
from zoneq.storage.store import QueueStore

NEEDS_SMTPUTF8 = "553 5.6.7"  # RFC 6531 section 3.5: 553 with X.6.7 (RFC 6533)


def test_non_ascii_addresses_need_the_smtputf8_parameter(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        assert (await raw.reply()).startswith("220 ")
        assert "250-SMTPUTF8" in (await raw.cmd("EHLO client.test")).splitlines()
        assert (await raw.cmd("MAIL FROM:<jürgen@d.test>")).startswith(NEEDS_SMTPUTF8)
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        assert (await raw.cmd("RCPT TO:<ñandú@b.test>")).startswith(NEEDS_SMTPUTF8)
        assert (await raw.cmd("RCPT TO:<a@bücher.test>")).startswith(NEEDS_SMTPUTF8)
        await raw.quit()
        await nothing_left(store)

    run(tmp_path, body)


def test_a_message_sent_with_smtputf8_is_stored_as_sent_and_flagged(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        assert (await raw.cmd("MAIL FROM:<jürgen@d.test> SMTPUTF8")).startswith("250 ")
        assert (await raw.cmd("RCPT TO:<ñandú@bücher.test>")).startswith("250 ")
        assert (await raw.cmd("RCPT TO:<plain@b.test>")).startswith("250 ")
        assert (await raw.cmd("DATA")).startswith("354 ")
        text = "Subject: Grüße\r\nFrom: Jürgen <jürgen@d.test>\r\n\r\nHallo, Ñandú.\r\n"
        await raw.send(text.encode())
        msg_id = queued_id(await raw.cmd("."))
        await raw.quit()
        meta = store.message(msg_id)
        assert meta.smtputf8 and meta.sender == "jürgen@d.test"
        addresses = sorted(q.recipient.address for q in store.recipients(msg_id))
        assert addresses == ["plain@b.test", "ñandú@bücher.test"]
        assert stored_body(store, msg_id).endswith(text.encode())

    run(tmp_path, body)


def test_without_smtputf8_a_plain_message_is_not_flagged(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        assert (await raw.cmd("RCPT TO:<a@b.test>")).startswith("250 ")
        assert (await raw.cmd("DATA")).startswith("354 ")
        await raw.send(b"Subject: plain\r\n\r\nhello\r\n")
        msg_id = queued_id(await raw.cmd("."))
        await raw.quit()
        assert not store.message(msg_id).smtputf8

    run(tmp_path, body)
