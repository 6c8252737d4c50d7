"""Connection reuse: a kept SMTP connection carries the next message to the same destination."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.storage.conftest import async_test
from tests.support.faultserver import Faults, FaultServer
from zoneq.delivery.transport import ConnectionCache, Timeouts, TlsPolicy, deliver
from zoneq.protocol.replies import Verdict

FAST = Timeouts(greeting=5, ehlo=5, mail=5, rcpt=5, data_init=5, data_block=5, data_end=5)


async def send(
    host: str, port: int, cache: ConnectionCache, rcpt: str = "a@ok.test", slot: int = 0
) -> Any:
    return await deliver(
        host=host,
        port=port,
        helo_name="mx.zoneq.test",
        sender="s@src.test",
        recipients=[rcpt],
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
