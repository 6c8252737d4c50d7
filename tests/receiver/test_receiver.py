"""The SMTP receiver against a real queue: what a client is told, and what is stored.

Every test opens a real LevelDB queue under ``tmp_path`` and a receiver on 127.0.0.1 with
port 0; clients are aiosmtplib, a raw socket (for what a well-behaved client never sends),
and swaks.  pytest-asyncio is not installed: each test body runs under ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence
from pathlib import Path

import aiosmtplib
import pytest

from tests.receiver.harness import (
    MESSAGE,
    T0,
    Raw,
    leftovers,
    nothing_left,
    only_messages,
    queued_id,
    run,
    split_received,
    stored_body,
    swaks,
)
from zoneq.errors import StorageUnavailable
from zoneq.protocol.ids import parse_id
from zoneq.receiver import SmtpReceiver
from zoneq.receiver.message import protocol_keyword, received_header, scan_headers
from zoneq.storage import keys
from zoneq.storage.leveldb import Database, Op
from zoneq.storage.space import SpaceGuard
from zoneq.storage.store import QueueStore


class FailingSyncs(Database):
    """A real database whose synced writes (the commits) fail while ``fail_syncs`` is set."""

    fail_syncs = False

    def write(self, ops: Sequence[Op], *, sync: bool) -> None:
        if sync and self.fail_syncs:
            raise StorageUnavailable("injected: sync failed")
        super().write(ops, sync=sync)


# --- accepted mail --------------------------------------------------------------------------


def test_aiosmtplib_message_is_queued_with_meta_and_recipients(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        errors, reply = await aiosmtplib.send(
            MESSAGE,
            sender="c@d.test",
            recipients=["a@b.test", "x@y.test"],
            hostname="127.0.0.1",
            port=rx.port,
            local_hostname="client.test",
            start_tls=False,
        )
        assert errors == {}
        msg_id = parse_id(reply.rsplit(" ", 1)[1])
        assert reply.startswith("2.0.0 Ok: queued as ")
        received, rest = split_received(stored_body(store, msg_id))
        assert rest == MESSAGE
        text = " ".join(received.decode().split())  # unfolded
        assert "from client.test ([127.0.0.1])" in text
        assert "by mx.zoneq.test (zoneq) with ESMTP id" in text
        assert " for " not in text  # two recipients: neither is disclosed
        assert all(len(line) <= 78 for line in received.decode().split("\r\n"))
        meta = store.message(msg_id)
        assert meta.sender == "c@d.test"
        assert meta.size == len(received) + len(MESSAGE)
        assert meta.chunks == 1
        assert meta.received_ms == T0
        assert meta.headers == {
            "From": "Sender <c@d.test>",
            "Subject": "Hello there",
            "Message-ID": "<m1@d.test>",
        }
        assert meta.source == {"client": "127.0.0.1", "helo": "client.test", "protocol": "smtp"}
        assert meta.zones == ("default",)
        rcpts = sorted((r.recipient.address, r.recipient.zone) for r in store.recipients(msg_id))
        assert rcpts == [("a@b.test", "default"), ("x@y.test", "default")]
        assert not list(store.database.keys(prefix=keys.RECEIVING))

    run(tmp_path, body)


def test_multi_chunk_body_is_stored_in_order(tmp_path: Path) -> None:
    lines = b"".join(b"line %06d " % i + b"x" * 60 + b"\r\n" for i in range(4300))
    message = b"Subject: big\r\n\r\n" + lines
    assert len(message) > 300 * 1024

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        smtp = aiosmtplib.SMTP(hostname="127.0.0.1", port=rx.port, start_tls=False)
        async with smtp:
            _, reply = await smtp.sendmail("c@d.test", ["a@b.test"], message)
        msg_id = parse_id(reply.rsplit(" ", 1)[1])
        meta = store.message(msg_id)
        chunks = list(store.body(msg_id))
        assert meta.chunks == len(chunks) == -(-meta.size // 65_536) >= 5
        assert all(len(chunk) == 65_536 for chunk in chunks[:-1])
        received, rest = split_received(b"".join(chunks))
        assert rest == message
        assert b"for <a@b.test>;" in received  # one recipient: named
        assert meta.size == len(received) + len(message)

    run(tmp_path, body)


def test_dsn_parameters_are_stored(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        smtp = aiosmtplib.SMTP(hostname="127.0.0.1", port=rx.port, start_tls=False)
        async with smtp:
            _, reply = await smtp.sendmail(
                "c@d.test",
                ["a@b.test"],
                MESSAGE,
                mail_options=["RET=HDRS", "ENVID=QQ314159", "BODY=8BITMIME"],
                rcpt_options=["NOTIFY=DELAY,FAILURE", "ORCPT=rfc822;orig+2Bx@b.test"],
            )
        msg_id = parse_id(reply.rsplit(" ", 1)[1])
        meta = store.message(msg_id)
        assert (meta.ret, meta.envid, meta.body_8bit, meta.smtputf8) == (
            "HDRS",
            "QQ314159",
            True,
            False,
        )
        [queued] = store.recipients(msg_id)
        assert queued.recipient.notify == ("FAILURE", "DELAY")
        assert queued.recipient.orcpt == "rfc822;orig+2Bx@b.test"

    run(tmp_path, body)


LONG = (b"y" * 998 + b"\r\n") * 80  # past the first 64 KiB chunk


@pytest.mark.parametrize(
    ("mail", "text", "eight_bit"),
    [
        ("MAIL FROM:<c@d.test>", b"Subject: caf\xc3\xa9\r\n\r\nbody\r\n", True),
        ("MAIL FROM:<c@d.test>", b"Subject: x\r\n\r\n" + LONG + b"\xe9\r\n", True),
        ("MAIL FROM:<c@d.test> BODY=8BITMIME", b"Subject: x\r\n\r\nbody\r\n", True),
        ("MAIL FROM:<c@d.test>", b"Subject: x\r\n\r\nbody\r\n", False),
    ],
)
def test_undeclared_8bit_data_is_stored_as_8bit(
    tmp_path: Path, mail: str, text: bytes, eight_bit: bool
) -> None:
    """RFC 6152 section 3: 8-bit data is declared, so the next hop is sent BODY=8BITMIME
    even when our client sent it without (the second case: past the first chunk)."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.start(mail=mail)
        await raw.send(text + b".\r\n")
        msg_id = queued_id(await raw.reply())
        assert store.message(msg_id).body_8bit is eight_bit
        # The next transaction on the connection starts over: 7-bit again.
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        assert (await raw.cmd("RCPT TO:<a@b.test>")).startswith("250 ")
        assert (await raw.cmd("DATA")).startswith("354 ")
        assert not store.message(queued_id(await raw.cmd("Subject: x\r\n\r\n."))).body_8bit
        await raw.quit()

    run(tmp_path, body)


def test_orcpt_is_stored_in_the_form_delivery_sends(tmp_path: Path) -> None:
    """RFC 6533 section 3: a utf-8 ORCPT in raw UTF-8 (with SMTPUTF8) is stored as
    utf-8-addr-xtext, which any next hop can be sent."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        refused = await raw.cmd("RCPT TO:<a@b.test> ORCPT=utf-8;jörg@b.test")
        assert refused == "501 5.5.4 Bad ORCPT parameter syntax"  # not without SMTPUTF8
        await raw.cmd("RSET")
        assert (await raw.cmd("MAIL FROM:<c@d.test> SMTPUTF8")).startswith("250 ")
        assert (await raw.cmd("RCPT TO:<a@b.test> ORCPT=utf-8;jörg@b.test")).startswith("250 ")
        assert (await raw.cmd("DATA")).startswith("354 ")
        msg_id = queued_id(await raw.cmd(MESSAGE.decode() + "."))
        [queued] = store.recipients(msg_id)
        assert queued.recipient.orcpt == "utf-8;j\\x{F6}rg@b.test"
        await raw.quit()

    run(tmp_path, body)


def test_pipelined_transactions_on_one_connection(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        assert (await raw.reply()).startswith("220 mx.zoneq.test ESMTP")
        one = b"MAIL FROM:<c@d.test>\r\nRCPT TO:<a@b.test>\r\nDATA\r\n"
        await raw.send(b"EHLO client.test\r\n" + one)
        replies = [await raw.reply() for _ in range(4)]
        assert [r[:3] for r in replies] == ["250", "250", "250", "354"]
        await raw.send(b"Subject: 1\r\n\r\none\r\n.\r\n" + one + b"two\r\n.\r\nQUIT\r\n")
        first = queued_id(await raw.reply())
        assert [(await raw.reply())[:3] for _ in range(3)] == ["250", "250", "354"]
        second = queued_id(await raw.reply())
        assert (await raw.reply()).startswith("221")
        await raw.close()
        assert split_received(stored_body(store, first))[1] == b"Subject: 1\r\n\r\none\r\n"
        assert split_received(stored_body(store, second))[1] == b"two\r\n"
        assert store.message(second).headers == {}

    run(tmp_path, body)


# --- size limits ----------------------------------------------------------------------------


def test_declared_size_over_the_limit_is_refused_at_mail(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.reply()
        assert "SIZE 10000" in await raw.cmd("EHLO client.test")
        assert (await raw.cmd("MAIL FROM:<c@d.test> SIZE=10001")).startswith("552 5.3.4")
        assert (await raw.cmd("MAIL FROM:<c@d.test> SIZE=100")).startswith("250 ")
        await raw.cmd("QUIT")
        await raw.close()
        await nothing_left(store)

    run(tmp_path, body, max_message_size=10_000)


def test_undeclared_oversize_message_is_refused_after_data(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.start()
        await raw.send(
            b"Subject: big\r\n\r\n" + b"y" * 998 + b"\r\n" * 1 + (b"z" * 500 + b"\r\n") * 400
        )
        assert (await raw.cmd(".")).startswith("552 5.3.4")
        assert (await raw.cmd("QUIT")).startswith("221")
        await raw.close()
        await nothing_left(store)

    # Above one chunk, so chunks were written before the limit was hit.
    run(tmp_path, body, max_message_size=100_000)


# --- smuggling ------------------------------------------------------------------------------


# The 2023 research's sequences, the NUL variants (SEC Consult) included.
@pytest.mark.parametrize(
    "sequence",
    [b"\n.\n", b"\n.\r\n", b"\r.\r", b"\r\n.\n", b"\r\n\x00.\r\n", b"\r\n.\x00\r\n"],
)
def test_smuggling_sequences_never_end_data(tmp_path: Path, sequence: bytes) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.start()
        smuggled = (
            b"MAIL FROM:<evil@d.test>\r\nRCPT TO:<victim@b.test>\r\nDATA\r\n"
            b"Subject: smuggled\r\n\r\nsmuggled\r\n.\r\n"
        )
        await raw.send(b"Subject: outer\r\n\r\nhello" + sequence + smuggled + b"QUIT\r\n")
        replies = [await raw.reply() for _ in range(2)]
        assert replies[0].startswith("554 5.6.0"), replies
        assert replies[1].startswith("221"), replies
        assert await raw.reply() == ""
        await raw.close()
        await nothing_left(store)

    run(tmp_path, body)


def test_nul_before_a_real_end_refuses_that_message(tmp_path: Path) -> None:
    """``NUL <CR><LF>.<CR><LF>`` does end DATA here (it holds CRLF "." CRLF): the message
    before it is refused with nothing stored; what follows is the client's own commands."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.start()
        after = b"MAIL FROM:<c@d.test>\r\nRCPT TO:<a@b.test>\r\nDATA\r\nnext\r\n.\r\nQUIT\r\n"
        await raw.send(b"Subject: outer\r\n\r\nhello\x00\r\n.\r\n" + after)
        assert (await raw.reply()).startswith("554 5.6.0 NUL")
        assert [(await raw.reply())[:3] for _ in range(3)] == ["250", "250", "354"]
        second = queued_id(await raw.reply())
        assert (await raw.reply()).startswith("221")
        await raw.close()
        assert split_received(stored_body(store, second))[1] == b"next\r\n"
        await only_messages(store, second)

    run(tmp_path, body)


# --- relay and addresses --------------------------------------------------------------------


def test_client_outside_allow_networks_may_not_relay(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.reply()
        await raw.cmd("EHLO client.test")
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        reply = await raw.cmd("RCPT TO:<a@b.test>")
        assert reply.startswith("554 5.7.1 Relay access denied"), reply
        assert (await raw.cmd("DATA")).startswith("503")
        await raw.cmd("QUIT")
        await raw.close()
        await nothing_left(store)

    run(tmp_path, body, allow_networks=["127.0.0.2/32"])


def test_percent_hack_is_refused_even_for_allowed_clients(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.reply()
        await raw.cmd("EHLO client.test")
        await raw.cmd("MAIL FROM:<c@d.test>")
        assert (await raw.cmd("RCPT TO:<user%elsewhere.test@b.test>")).startswith("550 5.7.1")
        assert (await raw.cmd("RCPT TO:<user@b.test>")).startswith("250 ")
        assert (await raw.cmd("RSET")).startswith("250")
        await raw.cmd("QUIT")
        await raw.close()
        await nothing_left(store)

    run(tmp_path, body)


def test_source_routes_are_refused_at_rcpt_and_dropped_from_mail(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.reply()
        await raw.cmd("EHLO client.test")
        # RFC 5321 appendix C: a reverse-path route is accepted and ignored.
        assert (await raw.cmd("MAIL FROM:<@hop.test:c@d.test>")).startswith("250 ")
        for path in ("@relay.test:a@b.test", "@r1.test,@r2.test:a@b.test"):
            assert (await raw.cmd(f"RCPT TO:<{path}>")).startswith("553 5.7.1"), path
        assert (await raw.cmd("RCPT TO:<a@b.test>")).startswith("250 ")
        assert (await raw.cmd("DATA")).startswith("354")
        msg_id = queued_id(await raw.cmd(MESSAGE.decode() + "."))
        assert store.message(msg_id).sender == "c@d.test"
        assert [r.recipient.address for r in store.recipients(msg_id)] == ["a@b.test"]
        await raw.cmd("QUIT")
        await raw.close()

    run(tmp_path, body)


# --- slow clients ---------------------------------------------------------------------------


async def trickle(raw: Raw, data: bytes, pause: float, limit: float) -> str:
    """Send ``data`` a byte at a time, ``pause`` apart, until a reply comes (or ``limit``)."""
    loop = asyncio.get_running_loop()
    reply = asyncio.ensure_future(raw.reply())
    started = loop.time()
    try:
        for byte in data:
            if reply.done() or loop.time() - started > limit:
                break
            with contextlib.suppress(ConnectionError):
                await raw.send(bytes([byte]))
            await asyncio.wait([reply], timeout=pause)
        return await asyncio.wait_for(reply, limit)
    finally:
        reply.cancel()


@pytest.mark.parametrize("phase", ["command", "data"])
def test_a_trickling_client_is_cut_off_within_the_request_deadline(
    tmp_path: Path, phase: str
) -> None:
    """One byte every 0.3 s is never idle for the 2 s timeout, yet the request must end."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        if phase == "data":
            await raw.start()
            data = MESSAGE * 20
        else:
            await raw.reply()
            data = b"EHLO " + b"x" * 400 + b"\r\n"
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply = await trickle(raw, data, pause=0.3, limit=15)
        elapsed = loop.time() - started
        assert reply.startswith("421 4.4.2"), reply
        # 2 s, plus at most the credit the text earned (1 octet / 0.3 s at 100 octets/s).
        assert 1.5 < elapsed < 6, elapsed
        await raw.close()
        await nothing_left(store)

    run(tmp_path, body, idle_timeout="2s", min_data_rate=100)


def test_message_text_at_a_steady_pace_earns_time_beyond_the_timeout(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.start()
        line = b"z" * 198 + b"\r\n"
        loop = asyncio.get_running_loop()
        started = loop.time()
        while loop.time() - started < 3:  # longer than the 2 s timeout, 2,000 octets/s
            await raw.send(line)
            await asyncio.sleep(0.1)
        queued_id(await raw.cmd("."))
        await raw.cmd("QUIT")
        await raw.close()

    run(tmp_path, body, idle_timeout="2s", min_data_rate=100)


# --- local faults: 4xx, never 5xx, never 250 before the commit -----------------------------


def test_queue_below_its_free_space_floor_answers_452_at_mail(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        store.space = SpaceGuard(tmp_path / "queue", min_free=1 << 62)
        raw = await Raw.connect(rx.port)
        await raw.reply()
        await raw.cmd("EHLO client.test")
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("452 4.3.1")
        await raw.cmd("QUIT")
        await raw.close()
        assert leftovers(store) == []

    run(tmp_path, body)


def test_commit_failure_answers_451_and_stores_nothing(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        db = store.database
        assert isinstance(db, FailingSyncs)
        db.fail_syncs = True
        raw = await Raw.connect(rx.port)
        await raw.start()
        await raw.send(MESSAGE)
        reply = await raw.cmd(".")
        assert reply.startswith("451 4.3.0"), reply
        db.fail_syncs = False
        # The session goes on; the next message is accepted once the queue has recovered.
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith(("250", "451"))
        await raw.cmd("QUIT")
        await raw.close()
        assert not list(store.database.keys(prefix=keys.READY))
        for _ in range(200):  # the store reopens itself on its next operation
            if store.failure is None:
                break
            try:
                store.begin(T0)
            except StorageUnavailable:
                await asyncio.sleep(0.05)
        await nothing_left(store)

    run(tmp_path, body, db=FailingSyncs)


class GatedSyncs(Database):
    """Synced writes (commits) wait for ``gate``; ``entered`` is set when one starts."""

    gate = threading.Event()
    entered = threading.Event()

    def write(self, ops: Sequence[Op], *, sync: bool) -> None:
        if sync:
            self.entered.set()
            assert self.gate.wait(20), "test never opened the gate"
        super().write(ops, sync=sync)


def test_no_250_before_the_commit_and_other_sessions_go_on(tmp_path: Path) -> None:
    GatedSyncs.gate = threading.Event()
    GatedSyncs.entered = threading.Event()

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        a = await Raw.connect(rx.port)
        await a.start()
        await a.send(MESSAGE + b".\r\n")
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, GatedSyncs.entered.wait, 10)
        pending = asyncio.ensure_future(a.reply())
        # While A's commit syncs, B is served.
        b = await Raw.connect(rx.port)
        assert (await b.reply()).startswith("220")
        assert (await b.cmd("EHLO other.test")).startswith("250")
        assert (await b.cmd("MAIL FROM:<c@d.test>")).startswith("250")
        assert not pending.done()  # no 250 before the commit returned
        GatedSyncs.gate.set()
        queued_id(await pending)
        await b.cmd("QUIT")
        await a.cmd("QUIT")
        await a.close()
        await b.close()

    try:
        run(tmp_path, body, db=GatedSyncs)
    finally:
        GatedSyncs.gate.set()


def test_chunk_write_failure_answers_451_at_the_dot(tmp_path: Path) -> None:
    class FailingChunks(Database):
        def write(self, ops: Sequence[Op], *, sync: bool) -> None:
            if any(key.startswith(keys.MESSAGE) for key, _ in ops) and not sync:
                raise StorageUnavailable("injected: chunk write failed")
            super().write(ops, sync=sync)

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.start()
        await raw.send((b"w" * 998 + b"\r\n") * 100)
        reply = await raw.cmd(".")
        assert reply.startswith("451 4.3.0"), reply
        await raw.cmd("QUIT")
        await raw.close()
        assert not list(store.database.keys(prefix=keys.READY))

    run(tmp_path, body, db=FailingChunks)


# --- loops ----------------------------------------------------------------------------------


# Short fields, and fields of ~1.4 KiB, folded (no line over 998 octets): 51 of those fill
# more than one 64 KiB chunk, so the count must go on in the chunks after the first.
_SHORT_HOP = b"Received: from h%d.test by h%d.test; Tue, 1 Jan 2030\r\n"
_LONG_HOP = (
    b"Received: from h%d.test\r\n\tby h%d.test with ESMTP id "
    + b"q" * 700
    + b"\r\n\t"
    + b"c" * 640
    + b";\r\n\tTue, 1 Jan 2030\r\n"
)


@pytest.mark.parametrize("hop", [_SHORT_HOP, _LONG_HOP], ids=["short", "past-one-chunk"])
@pytest.mark.parametrize(("hops", "accepted"), [(50, True), (51, False)])
def test_received_fields_over_50_are_a_loop(
    tmp_path: Path, hops: int, accepted: bool, hop: bytes
) -> None:
    trace = b"".join(hop % (i, i + 1) for i in range(hops))
    assert hop is _SHORT_HOP or len(trace) > 65536

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.start()
        await raw.send(trace + MESSAGE)
        reply = await raw.cmd(".")
        if accepted:
            queued_id(reply)
        else:
            assert reply.startswith("554 5.4.6"), reply
            await nothing_left(store)
        await raw.cmd("QUIT")
        await raw.close()

    run(tmp_path, body)


# --- the session ends -----------------------------------------------------------------------


def test_client_dropping_mid_data_leaves_nothing(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.start()
        await raw.send(b"Subject: cut\r\n\r\n" + (b"q" * 998 + b"\r\n") * 200)  # > 3 chunks
        for _ in range(200):  # until at least one chunk is on disk
            if list(store.database.keys(prefix=keys.RECEIVING)):
                break
            await asyncio.sleep(0.02)
        await raw.close()
        await nothing_left(store)

    run(tmp_path, body)


def test_close_answers_421_to_waiting_sessions_and_abandons_data(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        idle = await Raw.connect(rx.port)
        await idle.reply()
        await idle.cmd("EHLO client.test")
        mid = await Raw.connect(rx.port)
        await mid.start()
        await mid.send(b"Subject: half\r\n\r\n" + (b"h" * 998 + b"\r\n") * 80)
        for _ in range(200):
            if list(store.database.keys(prefix=keys.RECEIVING)):
                break
            await asyncio.sleep(0.02)
        await rx.close()
        assert (await idle.reply()).startswith("421 4.3.2")
        assert (await mid.reply()).startswith("421 4.3.2")
        await idle.close()
        await mid.close()
        await nothing_left(store)
        with pytest.raises(OSError):
            await Raw.connect(rx.port)

    run(tmp_path, body)


def test_connections_per_client_are_limited(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        first = await Raw.connect(rx.port)
        assert (await first.reply()).startswith("220")
        second = await Raw.connect(rx.port)
        assert (await second.reply()).startswith("421 4.7.0")
        await second.close()
        await first.cmd("QUIT")
        await first.close()
        for _ in range(200):  # the slot frees once the first session has ended
            third = await Raw.connect(rx.port)
            greeting = await third.reply()
            await third.close()
            if greeting.startswith("220"):
                break
            await asyncio.sleep(0.02)
        assert greeting.startswith("220")

    run(tmp_path, body, max_connections_per_client=1)


def test_idle_client_is_disconnected_with_421(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.reply()
        assert (await raw.reply()).startswith("421 4.4.2")
        assert await raw.reply() == ""
        await raw.close()

    run(tmp_path, body, idle_timeout="1s")


# --- swaks ----------------------------------------------------------------------------------


def test_swaks_pipelined_session(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        status, out = await swaks(rx.port, "--pipeline")
        assert status == 0, out
        [line] = [x for x in out.splitlines() if "queued as" in x]
        msg_id = parse_id(line.rsplit(" ", 1)[1])
        assert store.message(msg_id).sender == "c@d.test"
        assert [r.recipient.address for r in store.recipients(msg_id)] == ["a@b.test"]
        assert split_received(stored_body(store, msg_id))[1].startswith(b"Date: ")

    run(tmp_path, body)


# --- the pure helpers -----------------------------------------------------------------------


def test_received_header_folds_and_quotes() -> None:
    header = received_header(
        helo="evil(;)\u00e9",
        client_ip="2001:db8::1",
        hostname="mx.zoneq.test",
        protocol="UTF8SMTP",
        msg_id="0123456789abcdef",
        recipient="someone.with.a.long.name@a-rather-long-domain-name.example",
        now_ms=T0,
    ).decode()
    assert header.endswith("\r\n")
    assert header.startswith("Received: from evil???? ([IPv6:2001:db8::1])")
    lines = header[:-2].split("\r\n")
    assert all(len(line) <= 78 for line in lines)
    assert all(line.startswith("\t") for line in lines[1:])
    unfolded = " ".join(header.split())
    assert unfolded.endswith(
        "for <someone.with.a.long.name@a-rather-long-domain-name.example>;"
        " Tue, 14 Nov 2023 22:13:20 +0000"
    )


@pytest.mark.parametrize(
    ("utf8", "esmtp", "tls", "auth", "keyword"),
    [
        (False, False, False, False, "SMTP"),
        (False, False, True, True, "SMTP"),  # HELO: no extensions, so no RFC 3848 keyword
        (False, True, False, False, "ESMTP"),
        (False, True, True, False, "ESMTPS"),
        (False, True, False, True, "ESMTPA"),
        (False, True, True, True, "ESMTPSA"),
        (True, True, False, False, "UTF8SMTP"),
        (True, True, True, True, "UTF8SMTPSA"),
    ],
)
def test_protocol_keyword(utf8: bool, esmtp: bool, tls: bool, auth: bool, keyword: str) -> None:
    assert protocol_keyword(utf8=utf8, esmtp=esmtp, tls=tls, auth=auth) == keyword


def test_scan_headers() -> None:
    scan = scan_headers(
        b"Received: a\r\n\tb\r\nsubject: folded\r\n  subject\r\nReceived: c\r\n\r\nFrom: body\r\n"
    )
    assert scan.received == 2
    assert scan.headers == {"Subject": "folded subject"}
    # Cut mid-section: the incomplete last line is not read.
    assert scan_headers(b"From: a@b\r\nSubject: cut sho").headers == {"From": "a@b"}
    assert scan_headers(b"\r\nFrom: not a header\r\n").headers == {}
