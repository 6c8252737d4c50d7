"""The receiver with the core's intake socket as its sink, as in a receiver process.

One process, real parts: a LevelDB queue served by ``IntakeServer`` through ``StoreSink``,
an ``IntakeClient`` on the other end of a Unix socket pair, and ``SmtpReceiver`` on a port
of 127.0.0.1 around it.  What differs from the receiver in the core is when the answers
come: the connection limit after the greeting, and the core's absence as 421 4.3.0.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

from tests.receiver.harness import (
    MESSAGE,
    TIMEOUT,
    Raw,
    make_config,
    queued_id,
    split_received,
    stored_body,
)
from zoneq.ipc.intake_client import IntakeClient
from zoneq.ipc.intake_server import ADMIT_GRACE_S, IntakeServer
from zoneq.receiver import SmtpReceiver
from zoneq.runtime import StoreSink
from zoneq.storage.store import QueueStore

T0 = 1_700_000_000_000

Body = Callable[[SmtpReceiver, QueueStore, IntakeServer], Awaitable[None]]


def run(tmp_path: Path, body: Body, **receiver: object) -> None:
    async def main() -> None:
        store = QueueStore.open(tmp_path / "queue")
        store.recover()
        config = make_config(**receiver)
        server = IntakeServer(StoreSink(store, config))
        core_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        await server.attach(core_end, "receiver-0")
        client = await IntakeClient.from_fd(child_end.detach(), "receiver-0")
        rx = SmtpReceiver(client, config, clock=lambda: T0)
        await rx.start()
        try:
            await asyncio.wait_for(body(rx, store, server), TIMEOUT)
        finally:
            await rx.close()
            await client.close()
            await server.close()
            await store.close()

    asyncio.run(main())


def test_a_message_is_queued_through_the_core_and_answered_250_after_it(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore, _: IntakeServer) -> None:
        client = await Raw.connect(rx.port)
        await client.start()
        await client.send(MESSAGE.replace(b"\r\n.", b"\r\n..") + b".\r\n")  # stuffed
        msg_id = queued_id(await client.reply())
        received, rest = split_received(stored_body(store, msg_id))
        assert rest == MESSAGE
        assert b"by mx.zoneq.test (zoneq)" in received
        assert store.message(msg_id).source["client"] == "127.0.0.1"
        await client.close()

    run(tmp_path, body)


def test_over_the_limit_the_first_command_is_answered_421_4_7_0(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, _: QueueStore, __: IntakeServer) -> None:
        held = []
        for _n in range(2):
            client = await Raw.connect(rx.port)
            assert (await client.reply()).startswith("220 ")
            assert (await client.cmd("EHLO client.test")).startswith("250")
            held.append(client)
        third = await Raw.connect(rx.port)
        assert (await third.reply()).startswith("220 ")  # greeted while the core decides
        assert (await third.cmd("EHLO client.test")).startswith("421 4.7.0 ")
        assert await third.reply() == ""  # and closed
        await third.close()
        await held.pop().close()  # one fewer: a new connection is welcome again
        for _ in range(100):
            again = await Raw.connect(rx.port)
            assert (await again.reply()).startswith("220 ")
            reply = await again.cmd("EHLO client.test")
            await again.close()
            if reply.startswith("250"):
                break
            await asyncio.sleep(0.02)  # the release is on its way to the core
        assert reply.startswith("250"), reply
        for client in held:
            await client.close()

    run(tmp_path, body, max_connections_per_client=2)


def test_the_core_gone_is_421_4_3_0_in_session_and_at_connect(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, _: QueueStore, server: IntakeServer) -> None:
        client = await Raw.connect(rx.port)
        assert (await client.reply()).startswith("220 ")
        assert (await client.cmd("EHLO client.test")).startswith("250")
        await server.close()  # as if the core died
        await asyncio.sleep(0.2)
        assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("421 4.3.0 ")
        await client.close()
        late = await Raw.connect(rx.port)
        assert (await late.reply()).startswith("421 4.3.0 ")
        await late.close()

    run(tmp_path, body)


def test_an_admit_over_the_limit_waits_for_a_release_from_another_receiver(
    tmp_path: Path,
) -> None:
    # Frames are ordered on one socket, not across two: a client that reconnects at once
    # can be admitted by another receiver process before the first one's release arrives.
    async def body(rx: SmtpReceiver, _: QueueStore, server: IntakeServer) -> None:
        core_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        await server.attach(core_end, "receiver-1")
        other = await IntakeClient.from_fd(child_end.detach(), "receiver-1")
        try:
            first = rx.sink
            assert [await first.admit("192.0.2.7") for _ in range(2)] == [True, True]
            reconnected = other.admit("192.0.2.7")
            await asyncio.sleep(0.05)  # its ADMIT reaches the core first
            first.release("192.0.2.7")  # the old connection's, on the other socket
            assert await reconnected is True
            began = asyncio.get_running_loop().time()
            assert await other.admit("192.0.2.7") is False  # no release comes: refused
            assert asyncio.get_running_loop().time() - began < 5 * ADMIT_GRACE_S
        finally:
            await other.close()

    run(tmp_path, body, max_connections_per_client=2)
