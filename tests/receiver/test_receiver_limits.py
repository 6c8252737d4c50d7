"""The receiver's limits through the real ``SmtpReceiver`` and queue, with its config:
recipients, command and text lines (DSN parameters lengthen MAIL and RCPT), the error limit,
and ``<Postmaster>``.  The state machine's own tests (tests/protocol) cover the edges; these
show that the receiver applies them with what the config says, and stores nothing refused.
"""

from __future__ import annotations

from pathlib import Path

import aiosmtplib

from tests.receiver.harness import (
    MESSAGE,
    Raw,
    nothing_left,
    only_messages,
    queued_id,
    run,
    split_received,
    stored_body,
)
from zoneq.protocol.ids import parse_id
from zoneq.receiver import SmtpReceiver
from zoneq.storage.store import QueueStore

LONG_ADDRESS = "l" * 64 + "@" + "d" * 184 + ".test"  # 254 octets: the longest path holds
NOT_ALLOWED = ["127.0.0.2/32"]  # allow_networks that leave the test client (127.0.0.1) out


def test_configured_limits_hold_through_the_receiver(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        assert (await raw.cmd("NOOP " + "x" * 505)).startswith("250 ")  # 512 octets
        over = "NOOP " + "x" * 506
        assert len(over) + 2 == 513
        assert (await raw.cmd(over)).startswith("500 5.5.2")
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        assert (await raw.cmd("RCPT TO:<a@b.test>")).startswith("250 ")
        assert (await raw.cmd("RCPT TO:<x@y.test>")).startswith("250 ")
        assert (await raw.cmd("RCPT TO:<third@y.test>")).startswith("452 4.5.3")
        assert (await raw.cmd("DATA")).startswith("354 ")
        await raw.send(b"Subject: long\r\n\r\n" + b"z" * 999 + b"\r\nafter\r\n")
        assert (await raw.cmd(".")).startswith("500 5.5.2")  # 1001 octets with CRLF
        await raw.quit()
        await nothing_left(store)

    run(tmp_path, body, max_recipients=2)


def test_a_998_octet_text_line_is_stored(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.start()
        await raw.send(b"Subject: long\r\n\r\n" + b"z" * 998 + b"\r\n")
        msg_id = queued_id(await raw.cmd("."))
        await raw.quit()
        assert split_received(stored_body(store, msg_id))[1].endswith(b"z" * 998 + b"\r\n")

    run(tmp_path, body)


def test_full_dsn_parameters_fit_on_mail_and_rcpt(tmp_path: Path) -> None:
    """RFC 3461 section 4 (and RFC 1870, 6152): a 563-octet RCPT and a MAIL with SIZE= (added by
    aiosmtplib), BODY=, RET= and a 100-character ENVID, all over 512 octets, are accepted."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        smtp = aiosmtplib.SMTP(hostname="127.0.0.1", port=rx.port, start_tls=False)
        envid = "E" * 100
        orcpt = "rfc822;" + LONG_ADDRESS
        async with smtp:
            _, reply = await smtp.sendmail(
                "c@" + "s" * 180 + ".test",
                [LONG_ADDRESS],
                MESSAGE,
                mail_options=["BODY=8BITMIME", "RET=HDRS", f"ENVID={envid}"],
                rcpt_options=["NOTIFY=SUCCESS,FAILURE,DELAY", f"ORCPT={orcpt}"],
            )
        msg_id = parse_id(reply.rsplit(" ", 1)[1])
        assert store.message(msg_id).envid == envid
        [queued] = store.recipients(msg_id)
        assert queued.recipient.address == LONG_ADDRESS
        assert queued.recipient.orcpt == orcpt
        assert queued.recipient.notify == ("SUCCESS", "FAILURE", "DELAY")

    run(tmp_path, body)


def test_rcpt_over_the_extended_limit_is_refused(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        await raw.cmd("MAIL FROM:<c@d.test>")
        line = "RCPT TO:<a@b.test> ORCPT=rfc822;" + "q" * 1000
        assert (await raw.cmd(line[:1010])).startswith("501 5.5.4")  # parsed: ORCPT too long
        assert (await raw.cmd(line[:1011])).startswith("500 5.5.2")  # 1013 octets: not parsed
        assert (await raw.cmd("RCPT TO:<a@b.test>")).startswith("250 ")  # still in step
        await raw.quit()
        await nothing_left(store)

    run(tmp_path, body)


# --- the error limit ------------------------------------------------------------------------


def test_recipients_past_the_limit_do_not_cut_the_session_off(tmp_path: Path) -> None:
    """The default limits (1,000 recipients, 20 errors) and 1,021 pipelined RCPTs: 21 x 452
    (RFC 5321 4.5.3.1.10: the client sends those later), not a 421 that would lose the
    1,000 accepted on every retry; the message is stored with its 1,000 recipients."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        rcpts = b"".join(b"RCPT TO:<r%d@b.test>\r\n" % i for i in range(1021))
        await raw.send(b"MAIL FROM:<c@d.test>\r\n" + rcpts + b"DATA\r\n")
        replies = [await raw.reply() for _ in range(1 + 1021 + 1)]
        assert replies[0].startswith("250 2.1.0")
        assert all(r.startswith("250 2.1.5") for r in replies[1:1001])
        assert all(r.startswith("452 4.5.3") for r in replies[1001:1022]), replies[1001:]
        assert replies[1022].startswith("354 ")
        msg_id = queued_id(await raw.cmd("Subject: many\r\n\r\nhi\r\n."))
        await raw.quit()
        stored = [queued.recipient.address for queued in store.recipients(msg_id)]
        assert sorted(stored) == sorted(f"r{i}@b.test" for i in range(1000))

    run(tmp_path, body)


def test_harvesting_client_is_cut_off_at_max_errors(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        for i in range(4):
            reply = await raw.cmd(f"RCPT TO:<user{i}@victim.test>")
            assert reply.startswith("554 5.7.1"), reply
        assert (await raw.reply()).startswith(f"421 4.7.0 {rx.hostname} Too many errors")
        assert await raw.reply() == ""  # closed by the server
        await raw.close()
        await nothing_left(store)

    run(tmp_path, body, allow_networks=NOT_ALLOWED, max_errors=4)


def test_default_error_limit_is_20_bad_commands(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.reply()
        await raw.send(b"BOGUS\r\n" * 25)  # pipelined: the replies stop at the limit
        replies = [await raw.reply() for _ in range(21)]
        assert all(r.startswith("500 5.5.2") for r in replies[:20]), replies
        assert replies[20].startswith("421 4.7.0")
        assert await raw.reply() == ""
        await raw.close()

    run(tmp_path, body)


def test_delivering_clients_are_not_cut_off(tmp_path: Path) -> None:
    """A bulk session with a refused recipient in every message is never closed: each
    message accepted starts the count again (Postfix: "without delivering mail")."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        ids = []
        for _ in range(3):
            assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
            assert (await raw.cmd("RCPT TO:<a%b@c.test>")).startswith("550 5.7.1")
            assert (await raw.cmd("RCPT TO:<a@b.test>")).startswith("250 ")
            assert (await raw.cmd("DATA")).startswith("354 ")
            ids.append(queued_id(await raw.cmd("hi\r\n.")))
        await raw.quit()
        await only_messages(store, *ids)

    run(tmp_path, body, max_errors=2)


# --- <Postmaster> ---------------------------------------------------------------------------


def test_postmaster_goes_to_the_configured_address_from_any_client(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        assert (await raw.cmd("RCPT TO:<a@b.test>")).startswith("554 5.7.1")  # no relay
        assert (await raw.cmd("RCPT TO:<PostMaster>")).startswith("250 ")  # any case
        assert (await raw.cmd("DATA")).startswith("354 ")
        msg_id = queued_id(await raw.cmd("Subject: abuse report\r\n\r\nhi\r\n."))
        await raw.quit()
        [queued] = store.recipients(msg_id)
        assert queued.recipient.address == "hostmaster@admin.test"
        received, _ = split_received(stored_body(store, msg_id))
        assert b"for <hostmaster@admin.test>;" in received

    run(tmp_path, body, allow_networks=NOT_ALLOWED, postmaster="hostmaster@admin.test")


def test_postmaster_without_a_configured_address_is_refused(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        await raw.cmd("MAIL FROM:<c@d.test>")
        reply = await raw.cmd("RCPT TO:<postmaster>")
        assert reply.startswith("550 5.1.1 No postmaster address is configured"), reply
        assert (await raw.cmd("DATA")).startswith("503")  # no recipient: nothing queued
        await raw.quit()
        await nothing_left(store)

    run(tmp_path, body)
