"""``connection.Link``, the receiver's protocol in place of asyncio's streams.

Over real loopback sockets: bytes arrive whole and in order however the peer splits them
(Hypothesis), a session that does not read stops the transport reading past the high-water
mark and loses nothing, EOF and a lost connection are seen; and through the real receiver
and queue, a pipelined batch split at every byte boundary gets the same replies as whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.receiver.conftest import HOSTNAME, TlsFiles
from tests.receiver.harness import Raw, nothing_left, run
from tests.receiver.test_tls_auth import client_context
from zoneq.receiver import SmtpReceiver
from zoneq.receiver.connection import HIGH_WATER, Link
from zoneq.receiver.tls import server_context, start_tls
from zoneq.storage.store import QueueStore

TIMEOUT = 20.0


@contextlib.asynccontextmanager
async def _linked() -> AsyncIterator[tuple[Link, socket.socket]]:
    """A server of ``Link`` on 127.0.0.1, a client connected to it, and the server's link
    for that connection; both closed afterwards."""
    links: asyncio.Queue[Link] = asyncio.Queue()

    async def on_connect(link: Link) -> None:
        await links.put(link)

    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Link(on_connect), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        yield await asyncio.wait_for(links.get(), TIMEOUT), client
    finally:
        client.close()
        server.close()
        await server.wait_closed()


async def _read_all(link: Link, size: int) -> bytes:
    got = bytearray()
    while len(got) < size:
        data = await asyncio.wait_for(link.read(), TIMEOUT)
        assert data, "EOF before every byte arrived"
        got += data
    return bytes(got)


@settings(max_examples=25, deadline=None)
@given(
    pieces=st.lists(
        st.tuples(st.binary(min_size=1, max_size=3000), st.booleans()), min_size=1, max_size=10
    )
)
def test_bytes_arrive_whole_and_in_order_however_the_peer_splits_them(
    pieces: list[tuple[bytes, bool]],
) -> None:
    """Each piece arrives on its own (a pause after it); after some the session reads,
    after others the bytes are held, so both the hand-over and the held path are taken."""

    async def main() -> None:
        async with _linked() as (link, client):
            got = bytearray()
            for piece, read_now in pieces:
                reading = asyncio.ensure_future(link.read()) if read_now else None
                await asyncio.to_thread(client.sendall, piece)
                await asyncio.sleep(0.003)
                if reading is not None:
                    got += await asyncio.wait_for(reading, TIMEOUT)
            expected = b"".join(piece for piece, _ in pieces)
            got += await _read_all(link, len(expected) - len(got))
            assert got == expected
            client.shutdown(socket.SHUT_WR)
            assert await asyncio.wait_for(link.read(), TIMEOUT) == b""  # EOF, and stays so
            assert await asyncio.wait_for(link.read(), TIMEOUT) == b""
            link.write(b"still open for our last reply\r\n")  # half-closed, not closed
            await link.drain()
            reply = await asyncio.to_thread(client.recv, 100)
            assert reply == b"still open for our last reply\r\n"
            link.close()
            await asyncio.wait_for(link.wait_closed(), TIMEOUT)

    asyncio.run(main())


def test_a_session_that_does_not_read_pauses_the_transport_and_loses_nothing() -> None:
    async def main() -> None:
        async with _linked() as (link, client):
            client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65_536)
            client.setblocking(False)
            data = bytes(range(256)) * 40_000  # 10 MB: far past every buffer on the way
            sent = 0
            # Bounded: the client writes until the kernel buffers are full, then stops.
            for _ in range(10_000):
                try:
                    sent += client.send(data[sent : sent + 65_536])
                except BlockingIOError:
                    await asyncio.sleep(0.05)
                    try:
                        sent += client.send(data[sent : sent + 65_536])
                    except BlockingIOError:
                        break
                if sent == len(data):
                    break
            assert sent < len(data), "nothing held the sender back"
            # What the link holds is bounded (one read past the mark at most).
            assert link._held_size <= HIGH_WATER + 262_144
            assert link._reading_paused
            got = await _read_all(link, 1)
            # Reading resumes the transport; the rest follows, in order.
            while sent < len(data):
                try:
                    sent += client.send(data[sent : sent + 65_536])
                except BlockingIOError:
                    got += await asyncio.wait_for(link.read(), TIMEOUT)
            got += await _read_all(link, len(data) - len(got))
            assert got == data

    asyncio.run(main())


def test_a_lost_connection_ends_reads_and_drains() -> None:
    async def main() -> None:
        async with _linked() as (link, client):
            client.sendall(b"last words")
            # An RST rather than a FIN: SO_LINGER with a zero timeout.
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            assert await _read_all(link, 10) == b"last words"
            await asyncio.wait_for(link.wait_closed(), TIMEOUT)
            with pytest.raises(ConnectionResetError):
                await link.drain()

    asyncio.run(main())


COMMANDS = (
    b"EHLO client.test\r\nMAIL FROM:<c@d.test>\r\nRCPT TO:<a@b.test>\r\n"
    b"RCPT TO:<e@f.test>\r\nNOOP\r\nDATA\r\n"
)
TEXT_AND_QUIT = b"Subject: split\r\n\r\nhello\r\n.\r\nQUIT\r\n"
REPLIES = 8  # EHLO, MAIL, RCPT, RCPT, NOOP, DATA (354), the dot, QUIT


async def _session(port: int, batch: bytes, split: int) -> list[str]:
    """Replies to ``batch`` (commands, then text and QUIT after the 354) sent as two
    segments, split at ``split``; queue ids masked."""
    raw = await Raw.connect(port)
    raw.writer.transport.get_extra_info("socket").setsockopt(
        socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
    )
    try:
        assert (await raw.reply()).startswith("220 ")
        commands, text = batch[: len(COMMANDS)], batch[len(COMMANDS) :]
        for part in (commands[:split], commands[split:]):
            if part:
                await raw.send(part)
                await asyncio.sleep(0)
        replies = [await raw.reply() for _ in range(6)]
        for part in (text[:split], text[split:]):
            if part:
                await raw.send(part)
                await asyncio.sleep(0)
        replies += [await raw.reply() for _ in range(REPLIES - 6)]
        return [re.sub(r"queued as \S+", "queued as ID", reply) for reply in replies]
    finally:
        await raw.close()


def test_a_pipelined_batch_split_at_every_byte_gets_the_replies_it_gets_whole(
    tmp_path: Path,
) -> None:
    batch = COMMANDS + TEXT_AND_QUIT

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        whole = await _session(rx.port, batch, 0)
        assert [reply[:3] for reply in whole] == [
            "250", "250", "250", "250", "250", "354", "250", "221"
        ]  # fmt: skip
        for split in range(1, len(COMMANDS)):
            assert await _session(rx.port, batch, split) == whole, f"split at {split}"

    run(tmp_path, body)


def test_a_batch_cut_short_by_the_client_leaves_nothing_behind(tmp_path: Path) -> None:
    """The client goes away after part of the text, at every cut: nothing is stored."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        for cut in range(0, len(TEXT_AND_QUIT) - len(b".\r\nQUIT\r\n"), 3):
            raw = await Raw.connect(rx.port)
            assert (await raw.reply()).startswith("220 ")
            await raw.send(COMMANDS)
            for _ in range(6):
                assert (await raw.reply())[:1] in "23"
            await raw.send(TEXT_AND_QUIT[:cut])
            await raw.close()
        await nothing_left(store)

    run(tmp_path, body)


@pytest.mark.parametrize("on_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_backpressure_holds_after_a_starttls_that_dropped_a_full_buffer(
    tls_files: TlsFiles, *, on_uvloop: bool
) -> None:
    """A link paused at HIGH_WATER whose held bytes STARTTLS drops (RFC 3207 4.2): once
    over TLS, a session slow for a moment must still stop reading near HIGH_WATER, not
    hold whatever the client sends (the pause used to outlive the bytes it was for)."""
    context = server_context(tls_files.cert, tls_files.key)
    seen: dict[str, int] = {}

    async def session(link: Link) -> None:
        while link.write_buffer_size() == 0 and link._held_size <= HIGH_WATER:
            await asyncio.sleep(0.01)  # the client's junk piles up, reading pauses
        link.write(b"220 go ahead\r\n")
        assert await start_tls(link, context, timeout_s=10, peer="test")
        await asyncio.sleep(1.5)  # slow for a moment (a storage write, a hook)
        seen["held"] = link._held_size
        link.close()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: Link(session), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"x" * (HIGH_WATER + 70_000))  # pipelined behind a STARTTLS
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"220")
        await writer.start_tls(client_context(tls_files), server_hostname=HOSTNAME)
        writer.write(b"y" * 8_000_000)  # as fast as the server reads
        await asyncio.sleep(2.0)
        writer.transport.abort()
        server.close()

    (uvloop.run if on_uvloop else asyncio.run)(main())
    # Reading stops near HIGH_WATER (plus a read or two and the TLS layer's buffer).
    assert seen["held"] < 2 * 1024 * 1024, seen
