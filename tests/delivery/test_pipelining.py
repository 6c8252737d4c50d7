"""PIPELINING (RFC 2920) on the client side: one write per group, replies matched in order.

The remote end is ``FaultServer`` (tests/support), extended here to record each chunk of bytes
as it is received (one client write of a few hundred octets arrives as one chunk on loopback),
to answer in small, slow pieces, to drop the connection on a given command, and to refuse
DATA when no recipient was accepted, as a sound server does (RFC 2920 section 3.1).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from tests.storage.conftest import async_test
from tests.support.faultserver import Faults, FaultServer, Send, Session, _RcptCounter
from zoneq.delivery.transport import ConnectionCache, Timeouts, TlsPolicy, deliver
from zoneq.protocol.encoder import dot_stuff
from zoneq.protocol.replies import EnhancedStatus, Stage, Verdict

SENDER = "sender@example.org"
BODY = b"Subject: pipelining\r\n\r\n.a line with a dot\r\nbye\r\n"
FAST = Timeouts(greeting=5, ehlo=5, mail=5, rcpt=5, data_init=5, data_block=5, data_end=5, rset=5)


class RecordingServer(FaultServer):
    """FaultServer, plus: ``reads`` (chunks as received, per connection), replies cut into
    ``piece``-octet writes ``pause`` seconds apart, a connection dropped on reading a line
    starting with ``drop_on``, and DATA refused (554) when no RCPT was accepted."""

    def __init__(
        self,
        faults: Faults,
        *,
        piece: int = 0,
        pause: float = 0.0,
        drop_on: bytes | None = None,
        strict_data: bool = True,
    ) -> None:
        super().__init__(faults)
        self.reads: list[list[bytes]] = []
        self.piece, self.pause = piece, pause
        self.drop_on = drop_on
        self.strict_data = strict_data

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        chunks: list[bytes] = []
        self.reads.append(chunks)
        feed = reader.feed_data

        def recording_feed(data: bytes) -> None:
            chunks.append(bytes(data))
            feed(data)

        reader.feed_data = recording_feed  # type: ignore[method-assign]
        if self.drop_on is not None:
            readline, drop_on = reader.readline, self.drop_on

            async def dropping_readline() -> bytes:
                line = await readline()
                return b"" if line.startswith(drop_on) else line  # EOF: the server hangs up

            reader.readline = dropping_readline  # type: ignore[method-assign]
        if self.piece:
            self._slow_replies(writer)
        await super()._handle(reader, writer)

    def _slow_replies(self, writer: asyncio.StreamWriter) -> None:
        pending = bytearray()
        write = writer.write

        async def drain() -> None:
            while pending:
                write(bytes(pending[: self.piece]))
                del pending[: self.piece]
                await asyncio.sleep(self.pause)

        writer.write = pending.extend  # type: ignore[method-assign,assignment]
        writer.drain = drain  # type: ignore[method-assign]

    async def _data(self, reader: asyncio.StreamReader, session: Session, send: Send) -> bool:
        if self.strict_data and not self._accepted(session):
            await send(b"554 5.5.1 Error: no valid recipients")
            return True
        return await super()._data(reader, session, send)

    def _accepted(self, session: Session) -> int:
        """RCPTs accepted in the current transaction (FaultServer's replies, replayed)."""
        counter, accepted = _RcptCounter(), 0
        for line in session.commands:
            verb = line[:4].upper()
            if verb in (b"MAIL", b"RSET"):
                counter, accepted = _RcptCounter(), 0
            elif verb == b"RCPT":
                accepted += counter.reply(self.faults).startswith(b"2")
        return accepted


async def send_to(
    server: FaultServer,
    recipients: list[str],
    *,
    cache: ConnectionCache | None = None,
    timeouts: Timeouts = FAST,
    body: Callable[[], Any] = lambda: [BODY],
) -> Any:
    return await deliver(
        host=server.host,
        port=server.port,
        helo_name="client.example.org",
        sender=SENDER,
        recipients=recipients,
        body=body,
        tls=TlsPolicy.NONE,
        timeouts=timeouts,
        cache=cache,
    )


def verdicts(result: Any) -> list[Verdict]:
    return [r.verdict for r in result.recipients]


async def send_clean_message(server: FaultServer, cache: ConnectionCache) -> None:
    """After the faulty exchange: one more message, the faults lifted, on whatever
    connection the cache kept; it is delivered, and the cache is closed."""
    server.faults.rcpt_replies = {}
    server.faults.data_reply = Faults().data_reply
    again = await send_to(server, ["c@x.example"], cache=cache)
    await cache.close()
    assert verdicts(again) == [Verdict.DONE]


RCPTS = ["a@x.example", "b@x.example", "c@x.example"]
GROUP = (
    b"MAIL FROM:<sender@example.org>\r\n"
    b"RCPT TO:<a@x.example>\r\nRCPT TO:<b@x.example>\r\nRCPT TO:<c@x.example>\r\n"
    b"DATA\r\n"
)


# --- the group on the wire -------------------------------------------------------------------


@pytest.mark.integration
@async_test
async def test_mail_rcpts_and_data_go_in_one_write_and_the_body_with_its_dot_in_another() -> None:
    async with RecordingServer(Faults(dsn=False)) as server:
        result = await send_to(server, RCPTS)
    assert verdicts(result) == [Verdict.DONE] * 3
    chunks = server.reads[0]
    assert GROUP in chunks  # the whole group as one chunk: one write
    assert b"".join(dot_stuff([BODY])) in chunks  # body, dot-stuffed, and the terminator: one write
    assert server.payloads == [b"".join(dot_stuff([BODY]))]


@pytest.mark.integration
@async_test
async def test_without_pipelining_each_command_waits_for_its_reply() -> None:
    async with RecordingServer(Faults(dsn=False, pipelining=False)) as server:
        result = await send_to(server, RCPTS)
    assert verdicts(result) == [Verdict.DONE] * 3
    commands = [c for c in server.reads[0] if c[:4] in (b"MAIL", b"RCPT", b"DATA")]
    assert commands == [line + b"\r\n" for line in GROUP.split(b"\r\n")[:-1]]


@pytest.mark.integration
@async_test
async def test_a_reused_connection_sends_each_message_as_one_group() -> None:
    cache = ConnectionCache()
    async with RecordingServer(Faults(dsn=False)) as server:
        for _ in range(3):
            result = await send_to(server, RCPTS, cache=cache)
            assert verdicts(result) == [Verdict.DONE] * 3
        await cache.close()
    assert len(server.sessions) == 1
    assert server.reads[0].count(GROUP) == 3


# --- replies matched to recipients ---------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("pipelining", [True, False])
@async_test
async def test_mixed_rcpt_replies_each_settle_their_own_recipient(pipelining: bool) -> None:
    replies = {2: b"450 4.2.1 Busy", 3: b"550 5.1.1 No such user", 5: b"452 4.3.1 Full"}
    faults = Faults(rcpt_replies=replies, pipelining=pipelining)
    rcpts = [f"r{i}@x.example" for i in range(1, 6)]
    async with RecordingServer(faults) as server:
        result = await send_to(server, rcpts)
    # r5's 452 comes after an acceptance: too many recipients, so r5 goes in a second
    # transaction (where it is the first RCPT, and accepted).
    assert verdicts(result) == [
        Verdict.DONE,
        Verdict.DEFER,
        Verdict.BOUNCE,
        Verdict.DONE,
        Verdict.DONE,
    ]
    assert [r.stage for r in result.recipients][1:3] == [Stage.RCPT, Stage.RCPT]
    assert [r.transaction for r in result.recipients] == [0, 0, 0, 0, 1]
    assert len(server.payloads) == 2
    rcpt_lines = [c for c in server.commands() if c.startswith(b"RCPT")]
    # The first transaction names r1..r5 once each; the second names r5 only.
    assert sorted(rcpt_lines) == sorted(
        [f"RCPT TO:<{r}>".encode() for r in rcpts] + [b"RCPT TO:<r5@x.example>"]
    )


@pytest.mark.integration
@async_test
async def test_all_refused_is_reset_and_the_connection_kept_without_a_body() -> None:
    faults = Faults(rcpt_replies={1: b"550 5.1.1 No", 2: b"553 5.1.3 Bad"})
    cache = ConnectionCache()
    async with RecordingServer(faults) as server:
        result = await send_to(server, ["a@x.example", "b@x.example"], cache=cache)
        assert verdicts(result) == [Verdict.BOUNCE] * 2
        assert server.verbs() == [b"EHLO", b"MAIL", b"RCPT", b"RCPT", b"DATA", b"RSET"]
        assert not server.payloads
        assert len(cache) == 1  # RSET answered 250: clean, kept
        await send_clean_message(server, cache)
    assert len(server.sessions) == 1 and len(server.payloads) == 1


@pytest.mark.integration
@pytest.mark.parametrize(
    ("data_reply", "verdict"),
    [(b"554 5.7.1 Not from you", Verdict.BOUNCE), (b"451 4.3.0 Later", Verdict.DEFER)],
)
@async_test
async def test_data_refused_after_accepted_rcpts_settles_those_by_the_data_reply(
    data_reply: bytes, verdict: Verdict
) -> None:
    faults = Faults(rcpt_replies={2: b"550 5.1.1 No"}, data_reply=data_reply)
    cache = ConnectionCache()
    async with RecordingServer(faults) as server:
        result = await send_to(server, RCPTS, cache=cache)
        assert verdicts(result) == [verdict, Verdict.BOUNCE, verdict]
        assert [r.stage for r in result.recipients] == [Stage.DATA, Stage.RCPT, Stage.DATA]
        assert not server.payloads
        # The transaction was left open by the refused DATA: RSET before the connection is
        # kept (RFC 5321 section 4.1.1.5).
        assert server.verbs()[-1] == b"RSET"
        await cache.close()


@pytest.mark.integration
@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize(
    "data_reply",
    [b"250 2.0.0 Ok", b"220 2.0.0 Ready", b"334 VXNlcm5hbWU6", b"150 Opening data connection"],
)
@async_test
async def test_a_reply_to_data_out_of_step_defers_everyone_and_ends_the_session(
    pipelining: bool, data_reply: bytes
) -> None:
    """RFC 5321 sections 4.1.1.4 and 4.3.2: DATA's one success is 354.  Any other reply
    that is no refusal (here a 2yz, a 3yz other than 354, a 1yz) means no body was sent:
    the accepted recipient is deferred by it, never delivered, and so is the one waiting
    for a second transaction after a 452; the connection carries nothing more and is not
    kept, so the next message starts a new session."""
    faults = Faults(
        pipelining=pipelining,
        rcpt_replies={2: b"452 4.5.3 Too many recipients"},
        data_reply=data_reply,
    )
    cache = ConnectionCache()
    async with RecordingServer(faults) as server:
        result = await send_to(server, ["a@x.example", "b@x.example"], cache=cache)
        assert verdicts(result) == [Verdict.DEFER] * 2
        # The server's own reply for the record, and 4.5.0 (RFC 3463 section 3.6): its
        # 2.0.0 would read as success in a delay notice.
        assert {(r.stage, r.reply.code, r.status) for r in result.recipients} == {
            (Stage.DATA, int(data_reply[:3]), EnhancedStatus(4, 5, 0))
        }
        assert not server.payloads
        # Not a line after DATA on that connection (no RSET, no QUIT, no second MAIL).
        assert server.verbs() == [b"EHLO", b"MAIL", b"RCPT", b"RCPT", b"DATA"]
        assert len(cache) == 0
        await send_clean_message(server, cache)
    assert len(server.sessions) == 2 and len(server.payloads) == 1


@pytest.mark.integration
@pytest.mark.parametrize("pipelining", [True, False])
@async_test
async def test_552_to_rcpt_after_an_acceptance_is_the_recipient_limit_as_452(
    pipelining: bool,
) -> None:
    """RFC 5321 section 4.5.3.1.10: a 552 to RCPT SHOULD be treated as 452 (too many
    recipients): b goes in a second transaction on the same connection, not bounced."""
    faults = Faults(pipelining=pipelining, rcpt_replies={2: b"552 5.5.3 Too many recipients"})
    async with RecordingServer(faults) as server:
        result = await send_to(server, ["a@x.example", "b@x.example"])
    assert verdicts(result) == [Verdict.DONE] * 2
    assert [r.transaction for r in result.recipients] == [0, 1]
    assert len(server.sessions) == 1 and len(server.payloads) == 2


@pytest.mark.integration
@async_test
async def test_a_250_after_a_452_in_the_same_group_still_counts() -> None:
    """Pipelined 250 / 452 / 250: the server took c despite b's 452, so c goes with the
    first message and only b is sent again (naming c a second time would be a second
    copy); RFC 5321 section 4.5.3.1.10 and RFC 2920 section 3.1 (replies in order)."""
    faults = Faults(rcpt_replies={2: b"452 4.5.3 Too many recipients"})
    async with RecordingServer(faults) as server:
        result = await send_to(server, RCPTS)
    assert verdicts(result) == [Verdict.DONE] * 3
    assert [(r.stage, r.transaction) for r in result.recipients] == [
        (Stage.END_OF_DATA, 0),
        (Stage.END_OF_DATA, 1),
        (Stage.END_OF_DATA, 0),
    ]
    rcpt_lines = [c for c in server.commands() if c.startswith(b"RCPT")]
    assert rcpt_lines[3:] == [b"RCPT TO:<b@x.example>"]  # the second transaction: b only
    assert len(server.payloads) == 2


@pytest.mark.integration
@pytest.mark.parametrize("pipelining", [True, False])
@async_test
async def test_rset_before_the_follow_up_mail_when_data_was_refused(pipelining: bool) -> None:
    """DATA refused (451) leaves the transaction open (RFC 5321 section 4.1.1.5): before
    the MAIL for the recipient a 452 put off, the client says RSET."""
    faults = Faults(
        pipelining=pipelining,
        rcpt_replies={2: b"452 4.5.3 Too many recipients"},
        data_reply=b"451 4.3.0 Try later",
    )
    async with RecordingServer(faults) as server:
        result = await send_to(server, ["a@x.example", "b@x.example"])
    assert [(r.verdict, r.stage, r.transaction) for r in result.recipients] == [
        (Verdict.DEFER, Stage.DATA, 0),
        (Verdict.DEFER, Stage.DATA, 1),
    ]
    verbs = server.verbs()
    assert verbs[: verbs.index(b"MAIL", 2) + 1] == [
        *(b"EHLO", b"MAIL", b"RCPT", b"RCPT", b"DATA"),
        *(b"RSET", b"MAIL"),
    ]
    assert not server.payloads


@pytest.mark.integration
@async_test
async def test_552_to_the_only_rcpt_defers_it_as_452_would() -> None:
    faults = Faults(rcpt_replies={1: b"552 5.5.3 Too many recipients"})
    async with RecordingServer(faults) as server:
        result = await send_to(server, ["a@x.example"])
    (only,) = result.recipients
    assert (only.verdict, only.stage, only.reply.code) == (Verdict.DEFER, Stage.RCPT, 552)
    assert not server.payloads


# --- the connection lost ---------------------------------------------------------------------


@pytest.mark.integration
@async_test
async def test_connection_lost_mid_group_sends_everyone_on_with_no_body_and_no_duplicate() -> None:
    async with RecordingServer(Faults(), drop_on=b"RCPT TO:<b@") as server:
        result = await send_to(server, RCPTS)
    # a's RCPT was answered 250 before the drop, but no message was sent: a goes on too.
    assert verdicts(result) == [Verdict.NEXT_HOST] * 3
    assert not any(r.possible_duplicate for r in result.recipients)
    assert not server.payloads


# --- a slow server that answers in pieces --------------------------------------------------


@pytest.mark.integration
@async_test
async def test_replies_in_small_slow_pieces_each_get_their_own_deadline() -> None:
    # Each reply comes in 4-octet pieces 50 ms apart: about 0.3 s a reply, 2 s for the
    # group's seven replies, against a deadline of 1 s per reply.
    replies = {2: b"550 5.1.1 No such user", 4: b"450 4.2.1 Busy"}
    faults = Faults(rcpt_replies=replies, dsn=False)
    per_reply = Timeouts(greeting=10, ehlo=10, mail=1, rcpt=1, data_init=1, data_end=1)
    rcpts = [f"r{i}@x.example" for i in range(1, 6)]
    async with RecordingServer(faults, piece=4, pause=0.05) as server:
        started = asyncio.get_running_loop().time()
        result = await send_to(server, rcpts, timeouts=per_reply)
        took = asyncio.get_running_loop().time() - started
    assert verdicts(result) == [
        Verdict.DONE,
        Verdict.BOUNCE,
        Verdict.DONE,
        Verdict.DEFER,
        Verdict.DONE,
    ]
    assert took > 1.5  # longer than one deadline: each reply had its own
    assert len(server.payloads) == 1
