"""A small SMTP server of our own for the transport tests: records bytes, injects faults.

It runs in the test's event loop (``async with FaultServer(Faults(...)) as server``) on
127.0.0.1 and an ephemeral port, or on another loopback address and a given port (MX hosts
share one port: an MX record names no port).  Everything a client sends is kept in
``server.sessions`` (one ``Session`` per connection: the raw bytes as received, decrypted
after STARTTLS, and the command lines), and each DATA payload, dot-stuffed and terminator
included, in ``server.payloads``.  ``Faults`` chooses what is advertised and how each
command is answered.  Replies are given without CRLF; the server adds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import shutil
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import pytest

Send = Callable[..., Awaitable[None]]


class StartTls(enum.Enum):
    OK = "ok"
    REFUSE = "refuse"  # 454 4.7.0
    BREAK = "break"  # 220, then bytes that are not TLS, then close


class EndAction(enum.Enum):
    REPLY = "reply"  # answer the final dot with ``end_reply`` (after ``end_delay``)
    DROP = "drop"  # no reply after the dot: close the connection


@dataclass
class Faults:
    greeting: bytes = b"220 fault.test ESMTP"
    pipelining: bool = True
    starttls: bool = False
    eight_bit_mime: bool = True
    dsn: bool = True
    smtputf8: bool = False
    size: int | None = None  # advertised SIZE limit; None: no SIZE keyword
    # The EHLO keywords after STARTTLS, instead of those the fields above give (None: the
    # same, less STARTTLS).  RFC 3207 section 4.2: a server may offer other extensions
    # under TLS, and the client must forget what it learnt before.
    tls_keywords: tuple[bytes, ...] | None = None
    auth_reply: bytes | None = None  # offer AUTH PLAIN LOGIN, answer every AUTH with this
    mail_reply: bytes = b"250 2.1.0 Ok"
    rcpt_replies: dict[int, bytes] = field(default_factory=dict)  # n-th RCPT of a transaction
    max_recipients: int | None = None  # then 452 4.5.3 for every further RCPT
    data_reply: bytes = b"354 End data with <CR><LF>.<CR><LF>"
    end_reply: bytes = b"250 2.0.0 Ok: queued"
    end_action: EndAction = EndAction.REPLY
    end_delay: float = 0.0
    starttls_mode: StartTls = StartTls.OK
    keep_payloads: bool = True  # False: keep only the statistics (for very large bodies)


@dataclass
class Session:
    raw: bytearray = field(default_factory=bytearray)
    commands: list[bytes] = field(default_factory=list)
    tls: bool = False


@dataclass
class _RcptCounter:
    """RCPT replies within one transaction: ``rcpt_replies`` by position, then the limit."""

    seen: int = 0
    accepted: int = 0

    def reply(self, faults: Faults) -> bytes:
        self.seen += 1
        if self.seen in faults.rcpt_replies:
            return faults.rcpt_replies[self.seen]
        if faults.max_recipients is not None and self.accepted >= faults.max_recipients:
            return b"452 4.5.3 Error: too many recipients"
        self.accepted += 1
        return b"250 2.1.5 Ok"


@dataclass
class PayloadStats:
    count: int = 0
    octets: int = 0
    longest_line: int = 0  # without CRLF
    bare_cr_or_lf: int = 0


class FaultServer:
    def __init__(
        self,
        faults: Faults | None = None,
        tls: ssl.SSLContext | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if not host.startswith("127."):
            raise ValueError(f"a test server listens on 127.0.0.0/8 only, not {host}")
        self.faults = faults or Faults()
        self.tls = tls
        self.host = host
        self.port = port
        self.sessions: list[Session] = []
        self.payloads: list[bytes] = []
        self.stats = PayloadStats()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> FaultServer:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=1 << 20)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        await self._server.wait_closed()

    def commands(self) -> list[bytes]:
        """Every command line of every session, in order."""
        return [line for session in self.sessions for line in session.commands]

    def verbs(self) -> list[bytes]:
        return [line.split(b" ", 1)[0].split(b":", 1)[0].upper() for line in self.commands()]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        session = Session()
        self.sessions.append(session)
        try:
            await self._dialogue(reader, writer, session)
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError, OSError):
            pass
        except asyncio.CancelledError:
            # Our own shutdown (``__aexit__``).  Ending normally keeps asyncio's stream
            # callback from logging the cancellation as an error.
            pass
        finally:
            self._tasks.discard(task)
            # abort(), not close() and wait_closed(): after a server-side TLS handshake that
            # the client gave up on, Python 3.11 never finishes closing the stream.
            writer.transport.abort()

    async def _dialogue(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: Session
    ) -> None:
        f = self.faults
        simple = {
            b"HELO": b"250 fault.test",
            b"NOOP": b"250 2.0.0 Ok",
            b"RSET": b"250 2.0.0 Ok",
            b"QUIT": b"221 2.0.0 Bye",
        }

        async def send(*lines: bytes) -> None:
            writer.write(b"".join(line + b"\r\n" for line in lines))
            await writer.drain()

        await send(f.greeting)
        rcpt = _RcptCounter()
        keep_going = True
        while keep_going:
            line = await reader.readline()
            if not line:
                return
            session.raw += line
            session.commands.append(line.rstrip(b"\r\n"))
            verb = line.split(b" ", 1)[0].split(b":", 1)[0].strip().upper()
            if verb in (b"MAIL", b"RSET"):
                rcpt = _RcptCounter()  # a new transaction
            if verb == b"EHLO":
                await send(*self._ehlo_lines(session))
            elif verb == b"STARTTLS":
                keep_going = await self._starttls(writer, session, send)
            elif verb == b"MAIL":
                await send(f.mail_reply)
            elif verb == b"RCPT":
                await send(rcpt.reply(f))
            elif verb == b"DATA":
                keep_going = await self._data(reader, session, send)
            elif verb == b"AUTH" and f.auth_reply is not None:
                await send(f.auth_reply)
            else:
                await send(simple.get(verb, b"502 5.5.2 Error: command not recognized"))
                keep_going = verb != b"QUIT"

    async def _starttls(self, writer: asyncio.StreamWriter, session: Session, send: Send) -> bool:
        """Answer STARTTLS; False when the connection is to be dropped."""
        mode = self.faults.starttls_mode
        if mode is StartTls.REFUSE or self.tls is None:
            await send(b"454 4.7.0 TLS not available due to temporary reason")
            return True
        await send(b"220 2.0.0 Ready to start TLS")
        if mode is StartTls.BREAK:
            await send(b"this is not a TLS server hello")
            return False
        await asyncio.wait_for(writer.start_tls(self.tls), 10)
        session.tls = True
        return True

    async def _data(self, reader: asyncio.StreamReader, session: Session, send: Send) -> bool:
        """Answer DATA, take the payload, answer the dot; False to drop the connection."""
        f = self.faults
        await send(f.data_reply)
        if not f.data_reply.startswith(b"354"):
            return True
        await self._payload(reader, session)
        if f.end_delay:
            await asyncio.sleep(f.end_delay)
        if f.end_action is EndAction.DROP:
            return False
        await send(f.end_reply)
        return not f.end_reply.startswith(b"421")

    def _ehlo_lines(self, session: Session) -> list[bytes]:
        keywords = [b"fault.test", *self._keywords(session)]
        return [b"250-" + k for k in keywords[:-1]] + [b"250 " + keywords[-1]]

    def _keywords(self, session: Session) -> list[bytes]:
        f = self.faults
        if session.tls and f.tls_keywords is not None:
            return list(f.tls_keywords)
        keywords = []
        if f.pipelining:
            keywords.append(b"PIPELINING")
        if f.size is not None:
            keywords.append(b"SIZE %d" % f.size)
        if f.starttls and not session.tls:
            keywords.append(b"STARTTLS")
        if f.eight_bit_mime:
            keywords.append(b"8BITMIME")
        if f.dsn:
            keywords.append(b"DSN")
        if f.smtputf8:
            keywords.append(b"SMTPUTF8")
        if f.auth_reply is not None:
            keywords.append(b"AUTH PLAIN LOGIN")
        keywords.append(b"ENHANCEDSTATUSCODES")
        return keywords

    async def _payload(self, reader: asyncio.StreamReader, session: Session) -> None:
        """Read a DATA payload up to and including the ``.`` CRLF line."""
        stats = self.stats
        kept = bytearray()
        while True:
            line = await reader.readline()
            if not line:
                raise ConnectionResetError("client went away during DATA")
            if self.faults.keep_payloads:
                kept += line
                session.raw += line
            stats.octets += len(line)
            content = line[:-2] if line.endswith(b"\r\n") else line.rstrip(b"\n")
            if not line.endswith(b"\r\n") or b"\r" in content or b"\n" in content:
                stats.bare_cr_or_lf += 1
            stats.longest_line = max(stats.longest_line, len(content))
            if line == b".\r\n":
                break
        stats.count += 1
        self.payloads.append(bytes(kept))


def self_signed_tls(directory: Path) -> tuple[ssl.SSLContext, Path]:
    """A server context with a fresh self-signed certificate for localhost and 127.0.0.1, and
    the certificate's path (for a client that is to trust it).  Made with the openssl command
    (the venv has no ``cryptography``); the test skips without it."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    cert_path = directory / "cert.pem"
    key_path = directory / "key.pem"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"),
            *("-nodes", "-days", "1", "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
            *("-keyout", str(key_path), "-out", str(cert_path)),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_path, key_path)
    return context, cert_path
