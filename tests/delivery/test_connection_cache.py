"""Connection reuse: a kept SMTP connection carries the next message to the same destination."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tests.storage.conftest import async_test
from tests.support.faultserver import Faults, FaultServer, Send, Session
from zoneq.delivery.transport import ConnectionCache, Timeouts, TlsPolicy, deliver
from zoneq.delivery.transport.abort import OUT_OF_STEP
from zoneq.protocol.replies import Stage, Verdict

FAST = Timeouts(greeting=5, ehlo=5, mail=5, rcpt=5, data_init=5, data_block=5, data_end=5)


async def send(
    host: str, port: int, cache: ConnectionCache, rcpt: str | list[str] = "a@ok.test", slot: int = 0
) -> Any:
    return await deliver(
        host=host,
        port=port,
        helo_name="mx.zoneq.test",
        sender="s@src.test",
        recipients=[rcpt] if isinstance(rcpt, str) else rcpt,
        body=lambda: [b"Subject: x\r\n\r\nbody\r\n"],
        tls=TlsPolicy.NONE,
        timeouts=FAST,
        cache=cache,
        slot=slot,
    )


@async_test
async def test_the_next_message_reuses_the_connection_without_a_new_session() -> None:
    cache = ConnectionCache()
    async with FaultServer(Faults()) as server:
        first = await send(server.host, server.port, cache)
        second = await send(server.host, server.port, cache, "b@ok.test")
        assert [r.verdict for r in (*first.recipients, *second.recipients)] == [Verdict.DONE] * 2
        assert len(server.sessions) == 1
        assert server.verbs() == [b"EHLO", b"MAIL", b"RCPT", b"DATA", b"MAIL", b"RCPT", b"DATA"]
        assert cache.reused == 1 and len(cache) == 1
        await cache.close()  # shutdown says QUIT to what is kept
        await asyncio.sleep(0.1)
        assert server.verbs()[-1] == b"QUIT"
        assert len(cache) == 0


@async_test
async def test_a_connection_serves_at_most_max_messages() -> None:
    cache = ConnectionCache(max_messages=2)
    async with FaultServer(Faults()) as server:
        for n in range(3):
            result = await send(server.host, server.port, cache, f"r{n}@ok.test")
            assert result.recipients[0].verdict is Verdict.DONE
        assert len(server.sessions) == 2  # two messages on the first, then a new one
        assert server.sessions[0].commands[-1] == b"QUIT"
        await cache.close()


@async_test
async def test_an_idle_connection_past_its_time_is_not_reused() -> None:
    now = [0.0]
    cache = ConnectionCache(idle_s=5.0, clock=lambda: now[0])
    async with FaultServer(Faults()) as server:
        await send(server.host, server.port, cache)
        now[0] = 6.0
        await send(server.host, server.port, cache)
        assert len(server.sessions) == 2
        assert cache.reused == 0
        await cache.close()


class HangsUpAfterOneMessage:
    """Accepts one message per connection, then closes when the next MAIL arrives, without
    a reply: what a server's idle timeout looks like to a client that kept the connection."""

    def __init__(self) -> None:
        self.connections = 0
        self.messages = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        delivered = 0
        writer.write(b"220 hangs.test ESMTP\r\n")
        try:
            while line := await reader.readline():
                verb = line[:4].upper()
                if verb == b"EHLO":
                    writer.write(b"250-hangs.test\r\n250 8BITMIME\r\n")
                elif verb == b"MAIL":
                    if delivered:
                        break  # hang up, no reply
                    writer.write(b"250 2.1.0 Ok\r\n")
                elif verb == b"RCPT":
                    writer.write(b"250 2.1.5 Ok\r\n")
                elif verb == b"DATA":
                    writer.write(b"354 go ahead\r\n")
                    await writer.drain()
                    while (await reader.readline()) != b".\r\n":
                        pass
                    delivered += 1
                    self.messages += 1
                    writer.write(b"250 2.0.0 Ok\r\n")
                elif verb == b"QUIT":
                    writer.write(b"221 bye\r\n")
                    break
                await writer.drain()
        finally:
            writer.close()


@async_test
async def test_a_kept_connection_closed_while_idle_is_replaced_transparently() -> None:
    behaviour = HangsUpAfterOneMessage()
    server = await asyncio.start_server(behaviour.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cache = ConnectionCache()
    try:
        first = await send("127.0.0.1", port, cache)
        second = await send("127.0.0.1", port, cache, "b@ok.test")
        # Not NEXT_HOST: the idle close is no verdict on the host or the recipient.
        assert second.recipients[0].verdict is Verdict.DONE
        assert first.recipients[0].verdict is Verdict.DONE
        assert behaviour.connections == 2 and behaviour.messages == 2
        await cache.close()
    finally:
        server.close()
        await server.wait_closed()


# --- a reply nobody asked for ----------------------------------------------------------------

# The final dot answered twice: the second 250 answers nothing we sent, and would be read as
# the reply to the next command, every reply after it one step late (RFC 5321 section 4.2).
TWO_REPLIES = b"250 2.0.0 Ok: queued\r\n250 2.0.0 extra"


@async_test
async def test_a_connection_with_a_stray_reply_is_not_kept() -> None:
    cache = ConnectionCache()
    async with FaultServer(Faults(end_reply=TWO_REPLIES)) as server:
        first = await send(server.host, server.port, cache)
        assert first.recipients[0].verdict is Verdict.DONE
        assert len(cache) == 0
        await asyncio.sleep(0.1)  # for the server to read the QUIT
        assert server.sessions[0].commands[-1] == b"QUIT"
        # On the kept connection, "bad" would have been read as accepted (MAIL's 250) and
        # "good" refused (bad's 550): a valid recipient bounced.
        server.faults.end_reply = Faults().end_reply
        server.faults.rcpt_replies = {1: b"550 5.1.1 No such user"}
        second = await send(server.host, server.port, cache, ["bad@ok.test", "good@ok.test"])
        assert [r.verdict for r in second.recipients] == [Verdict.BOUNCE, Verdict.DONE]
        assert len(server.sessions) == 2
        await cache.close()


class StrayWhileIdle(FaultServer):
    """FaultServer that sends one more 250 after answering the final dot, when the test
    says (``stray``): while the client keeps the connection idle."""

    stray: asyncio.Event

    async def _data(self, reader: asyncio.StreamReader, session: Session, send: Send) -> bool:
        keep_going = await super()._data(reader, session, send)
        await self.stray.wait()
        await send(b"250 2.0.0 extra")
        return keep_going


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not within the time allowed"
        await asyncio.sleep(0.01)


@async_test
async def test_a_kept_connection_that_got_a_stray_reply_while_idle_is_not_reused() -> None:
    cache = ConnectionCache()
    async with StrayWhileIdle(Faults()) as server:
        server.stray = asyncio.Event()
        await send(server.host, server.port, cache)
        assert len(cache) == 1  # kept: the stray reply had not come yet
        [[kept]] = cache._idle.values()
        server.stray.set()
        await until(lambda: not kept.channel.quiet)  # the client has read it, unasked
        server.faults.rcpt_replies = {1: b"550 5.1.1 No such user"}
        second = await send(server.host, server.port, cache, ["bad@ok.test", "good@ok.test"])
        assert [r.verdict for r in second.recipients] == [Verdict.BOUNCE, Verdict.DONE]
        assert len(server.sessions) == 2 and cache.reused == 0
        await cache.close()
        await asyncio.sleep(0.1)
    # Retired with QUIT, as any kept connection no longer good (not cut at the next MAIL).
    assert server.sessions[0].commands[-1] == b"QUIT"


@async_test
async def test_a_stray_reply_ends_the_session_before_a_follow_up_transaction() -> None:
    """After a 452, the recipients left go in a second transaction on the same connection
    (RFC 5321 section 4.5.3.1.10); with a stray reply waiting, its replies would all be one
    step late, so they go to the next host instead, and no second MAIL is sent."""
    faults = Faults(max_recipients=1, end_reply=TWO_REPLIES)
    async with FaultServer(faults) as server:
        result = await send(server.host, server.port, ConnectionCache(), ["a@ok.test", "b@ok.test"])
    a, b = result.recipients
    assert (a.verdict, a.stage) == (Verdict.DONE, Stage.END_OF_DATA)
    assert (b.verdict, b.stage, b.status) == (Verdict.NEXT_HOST, Stage.MAIL, OUT_OF_STEP)
    assert server.verbs().count(b"MAIL") == 1 and len(server.payloads) == 1
