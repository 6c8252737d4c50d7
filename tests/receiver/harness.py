"""The receiver test harness: a real queue and a real ``SmtpReceiver`` on 127.0.0.1.

``run`` opens a LevelDB queue under ``tmp_path`` and a receiver on port 0 (``receiver``
keys override the test config), runs the test body under ``asyncio.run`` (pytest-asyncio
is not installed) bounded by ``TIMEOUT``, and closes both.  ``Raw`` is a client that sends
exactly the bytes given, for what a well-behaved client never sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop

from tests.support.testbed import missing
from zoneq.config.model import Config
from zoneq.plugin import PluginHost
from zoneq.protocol.ids import parse_id
from zoneq.receiver import SmtpReceiver
from zoneq.runtime import StoreSink
from zoneq.storage import keys
from zoneq.storage.leveldb import Database
from zoneq.storage.store import QueueStore

T0 = 1_700_000_000_000
TIMEOUT = 60.0

Body = Callable[[SmtpReceiver, QueueStore], Awaitable[None]]


def make_config(sections: dict[str, Any] | None = None, **receiver: Any) -> Config:
    """The test config: ``receiver`` keys, and other top-level ``sections`` (zones,
    routing, plugins) replacing the defaults."""
    receiver.setdefault("listen", "127.0.0.1:0")
    data: dict[str, Any] = {
        "server": {"hostname": "mx.zoneq.test"},
        "zones": {"default": {}, "bounces": {}},
        "receiver": receiver,
        **(sections or {}),
    }
    return Config.model_validate(data)


def run(
    tmp_path: Path,
    body: Body,
    *,
    db: type[Database] = Database,
    sections: dict[str, Any] | None = None,
    on_uvloop: bool = False,
    **receiver: Any,
) -> None:
    """Open a queue and a receiver (with the plugins ``sections`` enables, if any), run
    ``body``, close them all (bounded in time).  ``on_uvloop``: on the event loop
    ``zoneq serve`` runs (whose order of first read and first task step differs)."""

    async def main() -> None:
        store = QueueStore(db(tmp_path / "queue"))
        store.recover()
        config = make_config(sections, **receiver)
        plugins = PluginHost.from_config(config)
        rx = SmtpReceiver(StoreSink(store, config), config, clock=lambda: T0, plugins=plugins)
        await rx.start()
        try:
            await asyncio.wait_for(body(rx, store), TIMEOUT)
        finally:
            await rx.close()
            await plugins.close()
            await store.close()

    if on_uvloop:
        uvloop.run(main())
    else:
        asyncio.run(main())


class Raw:
    """A raw SMTP client: sends exactly the bytes given, reads whole replies."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, port: int, host: str = "127.0.0.1", source: str | None = None) -> Raw:
        """Connect to ``host:port``, from the address ``source`` when given."""
        local = None if source is None else (source, 0)
        reader, writer = await asyncio.open_connection(host, port, local_addr=local)
        return cls(reader, writer)

    @classmethod
    async def greeted(cls, port: int) -> Raw:
        """Connected to ``port``, the greeting read and EHLO answered."""
        raw = await cls.connect(port)
        assert (await raw.reply()).startswith("220 ")
        assert (await raw.cmd("EHLO client.test")).startswith("250")
        return raw

    async def quit(self) -> None:
        """QUIT, expected to be answered 221, then close."""
        assert (await self.cmd("QUIT")).startswith("221")
        await self.close()

    async def start_tls(self, context: ssl.SSLContext, server_hostname: str) -> None:
        """The client side of STARTTLS, after the server's 220."""
        await self.writer.start_tls(context, server_hostname=server_hostname)

    async def reply(self) -> str:
        """One reply (all its lines), e.g. ``"250 2.1.0 Sender OK"``; "" at EOF."""
        lines: list[str] = []
        while True:
            line = await asyncio.wait_for(self.reader.readline(), 10)
            if not line:
                return "\n".join(lines)
            text = line.decode().rstrip("\r\n")
            lines.append(text)
            if text[3:4] != "-":
                return "\n".join(lines)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def cmd(self, line: str) -> str:
        await self.send(line.encode() + b"\r\n")
        return await self.reply()

    async def start(self, rcpt: str = "a@b.test", mail: str = "MAIL FROM:<c@d.test>") -> None:
        """Greeting, EHLO, MAIL, RCPT and DATA, each expected to succeed."""
        assert (await self.reply()).startswith("220 ")
        assert (await self.cmd("EHLO client.test")).startswith("250")
        assert (await self.cmd(mail)).startswith("250 ")
        assert (await self.cmd(f"RCPT TO:<{rcpt}>")).startswith("250 ")
        assert (await self.cmd("DATA")).startswith("354 ")

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, TimeoutError):
            await asyncio.wait_for(self.writer.wait_closed(), 5)


def queued_id(reply: str) -> int:
    assert reply.startswith("250 2.0.0 Ok: queued as "), reply
    return parse_id(reply.rsplit(" ", 1)[1])


def leftovers(store: QueueStore) -> list[bytes]:
    """Every message and receiving key on disk."""
    db = store.database
    return [*db.keys(prefix=keys.MESSAGE), *db.keys(prefix=keys.RECEIVING)]


async def nothing_left(store: QueueStore) -> None:
    """Wait (bounded) for abandons to land, then sweep: no message key may remain."""
    for _ in range(200):
        await store.drain()
        if not leftovers(store):
            break
        await asyncio.sleep(0.02)
    await store.sweep(T0 + 3_600_000, 1)
    await store.drain()
    assert leftovers(store) == []


async def only_messages(store: QueueStore, *msg_ids: int) -> None:
    """Wait (bounded) for abandons to land, then sweep: the messages on disk are exactly
    ``msg_ids`` (a refused message left nothing) and none is still being received."""
    found: set[int] = set()
    for _ in range(200):
        await store.drain()
        found = {keys.decode_message_key(k)[0] for k in store.database.keys(prefix=keys.MESSAGE)}
        if found == set(msg_ids):
            break
        await asyncio.sleep(0.02)
    await store.sweep(T0 + 3_600_000, 1)
    await store.drain()
    assert found == set(msg_ids)
    assert list(store.database.keys(prefix=keys.RECEIVING)) == []


MESSAGE = (
    b"From: Sender <c@d.test>\r\n"
    b"To: a@b.test\r\n"
    b"Subject: Hello there\r\n"
    b"Message-ID: <m1@d.test>\r\n"
    b"\r\n"
    b"first line\r\n"
    b".a line starting with a dot\r\n"
    b"last line\r\n"
)


def stored_body(store: QueueStore, msg_id: int) -> bytes:
    return b"".join(store.body(msg_id))


def split_received(body: bytes) -> tuple[bytes, bytes]:
    """(our Received field, the rest)."""
    assert body.startswith(b"Received: from ")
    end = body.index(b"\r\n")
    while body[end + 2 : end + 3] in (b" ", b"\t"):
        end = body.index(b"\r\n", end + 2)
    return body[: end + 2], body[end + 2 :]


async def swaks(port: int, *options: str) -> tuple[int, str]:
    """Run swaks against ``127.0.0.1:port`` (c@d.test to a@b.test) with ``options``; returns
    its exit status and output (bounded in time; killed by its PID if it overruns)."""
    binary = shutil.which("swaks")
    if binary is None:
        missing("swaks is not installed")
    assert binary is not None
    proc = await asyncio.create_subprocess_exec(
        binary,
        "--server",
        f"127.0.0.1:{port}",
        "--to",
        "a@b.test",
        "--from",
        "c@d.test",
        *options,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "LC_ALL": "C"},
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")
