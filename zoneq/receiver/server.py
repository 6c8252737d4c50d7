"""The SMTP receiver: an asyncio server driving one ``ServerConnection`` per client.

Theory of operation
-------------------
The protocol lives in ``zoneq.protocol.smtp_server`` (sans-IO); this module owns the
sockets and the queue.  Each session is one task running a simple loop: read some bytes,
feed them to the machine, act on every event that comes back (deciding the ones that wait
for a decision, storing body chunks), write the replies, read again.  The task awaits each
decision and each chunk write before it reads more, so a client that sends faster than the
queue writes is held back by TCP (the machine documents that the driver should stop
reading while a decision is pending); other sessions are separate tasks and go on.

A message's life in a session: ``store.begin`` at MAIL (452/451 if the queue refuses), a
``Received:`` field first in the text at DATA, chunks of ``storage.chunk_size`` written as
they fill, and at the final dot one ``store.commit`` with the last partial chunk as its
tail.  Only once the commit has returned (the batch is synced) does the client get 250.
Everything that ends a transaction otherwise (a refusal, RSET, a new EHLO, QUIT, the client
going away, the server closing) abandons the message, removing any chunk written.

Choices:

* Local faults are never 5xx: a queue that refuses anything answers 451 4.3.0 (452 4.3.1
  for the free-space floor), so the client keeps the message and retries.
* Relaying is by client address only (``receiver.allow_networks``); others get 554 5.7.1
  at RCPT.  A percent-hack address (``user%host@relay``) is refused with 550 5.7.1 from
  every client: it asks the next hop to relay, which nobody should rely on.
* Loops: more than ``MAX_RECEIVED`` Received fields in the first chunk is 554 5.4.6 at the
  final dot (RFC 3463 section 3.5, "routing loop detected").
* Routing: every recipient goes to ``routing.default_zone`` for now (``route``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Final

from zoneq.config.model import Config
from zoneq.errors import InsufficientStorage, ZoneqError
from zoneq.protocol.dsn import Notify
from zoneq.protocol.ids import format_id
from zoneq.protocol.replies import INSUFFICIENT_STORAGE, LOCAL_ERROR, EnhancedStatus, Reply
from zoneq.protocol.smtp_commands import BodyType
from zoneq.protocol.smtp_server import (
    DataChunk,
    DataEnd,
    DataStart,
    Event,
    Hello,
    MailFrom,
    Quit,
    RcptTo,
    Reset,
    ServerConnection,
)
from zoneq.receiver.message import MAX_RECEIVED, received_header, scan_headers
from zoneq.storage.records import MessageMeta, NewRecipient
from zoneq.storage.store import QueueStore

__all__ = ["SmtpReceiver", "route"]

log = logging.getLogger("zoneq.receiver")

_READ_SIZE: Final = 65_536
_CLOSE_GRACE_S: Final = 5.0  # how long close() lets sessions finish a commit in flight


def _r(code: int, text: str, klass: int, subject: int, detail: int) -> Reply:
    return Reply(code, (text,), EnhancedStatus(klass, subject, detail))


RELAY_DENIED: Final = _r(554, "Relay access denied", 5, 7, 1)
PERCENT_HACK: Final = _r(550, "Percent-hack addresses are not accepted", 5, 7, 1)
MAIL_LOOP: Final = _r(554, "Too many Received headers: mail loop detected", 5, 4, 6)


def _bye(code_text: str, klass: int, subject: int, detail: int, hostname: str) -> Reply:
    return Reply(421, (f"{hostname} {code_text}",), EnhancedStatus(klass, subject, detail))


def route(config: Config, recipient: str) -> str:
    """The zone a recipient is queued in.  Zone rules will replace this; for now, every
    recipient goes to the default zone."""
    return config.routing.default_zone


def _notify_keywords(notify: frozenset[Notify] | None) -> tuple[str, ...]:
    if not notify:
        return ()
    return tuple(keyword.value for keyword in Notify if keyword in notify)


class SmtpReceiver:
    """Accepts mail over SMTP into ``store``.  ``clock`` returns milliseconds since the epoch."""

    def __init__(self, store: QueueStore, config: Config, *, clock: Callable[[], int]) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.hostname = config.server.resolved_hostname()
        self._networks = config.receiver.networks
        self._server: asyncio.Server | None = None
        self._port = 0
        self._sessions: set[_Session] = set()
        self._per_client: dict[str, int] = {}
        self._closing = False

    async def start(self) -> None:
        """Listen on ``receiver.listen``."""
        host, port = self.config.receiver.listen_address
        self._server = await asyncio.start_server(self._accept, host, port)
        self._port = int(self._server.sockets[0].getsockname()[1])

    @property
    def port(self) -> int:
        """The port bound (useful with port 0)."""
        if self._server is None:
            raise RuntimeError("receiver not started")
        return self._port

    async def close(self) -> None:
        """Stop accepting; sessions waiting for input get 421 4.3.2 and messages being
        received are abandoned.  A commit in flight may finish (and answer) first."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        sessions = list(self._sessions)
        for session in sessions:
            session.shutdown()
        tasks = [s.task for s in sessions if s.task is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=_CLOSE_GRACE_S)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=_CLOSE_GRACE_S)
        if self._server is not None:
            await self._server.wait_closed()

    def relay_allowed(self, ip: str) -> bool:
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in self._networks)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if self._closing:
            writer.close()
            return
        count = self._per_client.get(ip, 0)
        if count >= self.config.receiver.max_connections_per_client:
            bye = _bye("Too many connections from your address", 4, 7, 0, self.hostname)
            with contextlib.suppress(ConnectionError):
                writer.write(bye.to_wire())
                await writer.drain()
            writer.close()
            return
        self._per_client[ip] = count + 1
        session = _Session(self, reader, writer, ip)
        session.task = asyncio.current_task()
        self._sessions.add(session)
        try:
            await session.run()
        finally:
            self._sessions.discard(session)
            left = self._per_client.get(ip, 1) - 1
            if left > 0:
                self._per_client[ip] = left
            else:
                self._per_client.pop(ip, None)


class _Session:
    """One client connection and the message it is sending, if any."""

    def __init__(
        self,
        receiver: SmtpReceiver,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ip: str,
    ) -> None:
        config = receiver.config
        self.receiver = receiver
        self.store = receiver.store
        self.reader = reader
        self.writer = writer
        self.ip = ip
        self.task: asyncio.Task[None] | None = None
        self.conn = ServerConnection(
            receiver.hostname,
            max_message_size=int(config.receiver.max_message_size),
            max_recipients=config.receiver.max_recipients,
        )
        self.relay = receiver.relay_allowed(ip)
        self.chunk_size = config.storage.chunk_size
        self.helo = ""
        self.esmtp = False
        self._waiting_input = False
        self._stopping = False
        # The transaction
        self.msg_id: int | None = None
        self.mail: MailFrom | None = None
        self.recipients: list[NewRecipient] = []
        self.buffer = bytearray()
        self.index = 0  # chunks written
        self.size = 0  # octets stored (written and buffered)
        self.header_len = 0  # our Received field, first in chunk 0
        self.headers: dict[str, str] = {}
        self.fault: Reply | None = None  # decided while the body streams: answered at the dot
        self.received_ms = 0

    # --- the loop ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """The server is closing: stop at the next read (at once if waiting for one)."""
        self._stopping = True
        if self._waiting_input and self.task is not None:
            self.task.cancel()

    async def run(self) -> None:
        timeout = self.receiver.config.receiver.idle_timeout_s
        try:
            self.writer.write(self.conn.greeting())
            while not self.conn.closed:
                await self.writer.drain()
                if self._stopping:
                    self._say_bye("Service shutting down", 4, 3, 2)
                    break
                self._waiting_input = True
                try:
                    data = await asyncio.wait_for(self.reader.read(_READ_SIZE), timeout)
                except TimeoutError:
                    self._say_bye("Idle timeout, closing connection", 4, 4, 2)
                    break
                finally:
                    self._waiting_input = False
                if not data:
                    break  # the client went away
                await self._handle(self.conn.receive(data))
                self.writer.write(self.conn.data_to_send())
            await self.writer.drain()
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            # close() interrupted a read: say goodbye below.
            self._say_bye("Service shutting down", 4, 3, 2)
        except (ConnectionError, OSError):
            pass  # the client went away mid-write
        finally:
            await self._end_transaction()
            self.writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.writer.wait_closed(), 1.0)

    def _say_bye(self, text: str, klass: int, subject: int, detail: int) -> None:
        with contextlib.suppress(Exception):
            reply = _bye(text, klass, subject, detail, self.receiver.hostname)
            self.writer.write(self.conn.data_to_send() + reply.to_wire())

    async def _handle(self, events: Iterable[Event]) -> None:
        """Act on events in order; decisions produce more events, handled in turn."""
        queue = deque(events)
        while queue:
            event = queue.popleft()
            if isinstance(event, DataChunk):
                await self._body(event.data)
            elif isinstance(event, MailFrom):
                queue.extend(await self._mail(event))
            elif isinstance(event, RcptTo):
                queue.extend(self._rcpt(event))
            elif isinstance(event, DataStart):
                queue.extend(self._data_start())
            elif isinstance(event, DataEnd):
                queue.extend(await self._data_end(event))
            elif isinstance(event, Hello):
                self.helo = event.domain
                self.esmtp = event.command == "EHLO"
                await self._end_transaction()
            elif isinstance(event, Reset | Quit):
                await self._end_transaction()
            elif event.needs_decision:
                # AUTH is not offered, so the machine never asks; refuse rather than hang.
                queue.extend(self.conn.reject(_r(502, "Not available", 5, 5, 1)))

    # --- decisions -----------------------------------------------------------------------

    async def _mail(self, event: MailFrom) -> list[Event]:
        await self._end_transaction()  # none should be left; never leak one
        now = self.receiver.clock()
        try:
            msg_id = self.store.begin(now, size_hint=event.size or 0)
        except InsufficientStorage as exc:
            log.warning("refusing MAIL from %s: %s", self.ip, exc)
            return self.conn.reject(INSUFFICIENT_STORAGE)
        except ZoneqError as exc:
            log.warning("refusing MAIL from %s: queue unavailable: %s", self.ip, exc)
            return self.conn.reject(LOCAL_ERROR)
        self.msg_id = msg_id
        self.mail = event
        self.received_ms = now
        return self.conn.accept()

    def _rcpt(self, event: RcptTo) -> list[Event]:
        address = event.address
        local, at, _ = address.rpartition("@")
        if "%" in (local if at else address):
            return self.conn.reject(PERCENT_HACK)
        if not self.relay:
            return self.conn.reject(RELAY_DENIED)
        zone = route(self.receiver.config, address)
        notify = _notify_keywords(event.notify)
        self.recipients.append(NewRecipient(address, zone, notify=notify, orcpt=event.orcpt))
        return self.conn.accept()

    def _data_start(self) -> list[Event]:
        assert self.msg_id is not None and self.mail is not None
        protocol = "UTF8SMTP" if self.mail.smtputf8 else "ESMTP" if self.esmtp else "SMTP"
        single = self.recipients[0].address if len(self.recipients) == 1 else None
        header = received_header(
            helo=self.helo,
            client_ip=self.ip,
            hostname=self.receiver.hostname,
            protocol=protocol,
            msg_id=format_id(self.msg_id),
            recipient=single,
            now_ms=self.receiver.clock(),
        )
        self.buffer = bytearray(header)
        self.header_len = len(header)
        self.size = len(header)
        return self.conn.accept()

    async def _body(self, data: bytes) -> None:
        if self.fault is not None or self.msg_id is None:
            return  # refused already: the rest is only read past
        self.buffer += data
        self.size += len(data)
        step = self.chunk_size
        while len(self.buffer) >= step and self.fault is None:
            piece = bytes(self.buffer[:step])
            del self.buffer[:step]
            if self.index == 0:
                self._scan(piece)
                if self.fault is not None:
                    break
            try:
                await self.store.write_chunk(self.msg_id, self.index, piece)
            except ZoneqError as exc:
                log.warning("message %s: chunk write failed: %s", format_id(self.msg_id), exc)
                self.fault = LOCAL_ERROR
                break
            self.index += 1
        if self.fault is not None:
            self.buffer.clear()

    def _scan(self, first: bytes) -> None:
        scan = scan_headers(first[self.header_len :])
        self.headers = scan.headers
        if scan.received > MAX_RECEIVED:
            log.warning("message from %s: %d Received fields, a loop", self.ip, scan.received)
            self.fault = MAIL_LOOP

    async def _data_end(self, event: DataEnd) -> list[Event]:
        msg_id = self.msg_id
        if event.rejected is not None or msg_id is None or self.mail is None:
            await self._end_transaction()  # the machine answered already
            return []
        tail: bytes | None = bytes(self.buffer) if self.buffer else None
        if self.index == 0 and tail is not None and self.fault is None:
            self._scan(tail)
        if self.fault is not None:
            fault = self.fault
            await self._end_transaction()
            return self.conn.reject(fault)
        chunks = self.index + (1 if tail is not None else 0)
        mail = self.mail
        meta = MessageMeta(
            msg_id=msg_id,
            sender=mail.address,
            size=self.size,
            chunks=chunks,
            received_ms=self.received_ms,
            ret=None if mail.ret is None else mail.ret.value,
            envid=mail.envid,
            smtputf8=mail.smtputf8,
            body_8bit=mail.body is BodyType.EIGHT_BIT_MIME,
            headers=dict(self.headers),
            source={"client": self.ip, "helo": self.helo, "protocol": "smtp"},
        )
        # Replies to pipelined commands before the dot go out while the commit syncs.
        self.writer.write(self.conn.data_to_send())
        try:
            await asyncio.shield(
                self.store.commit(meta, self.recipients, self.receiver.clock(), tail=tail)
            )
        except (ZoneqError, ValueError) as exc:
            log.warning("message %s: commit failed: %s", format_id(msg_id), exc)
            await self._end_transaction()
            return self.conn.reject(LOCAL_ERROR)
        self.msg_id = None  # queued: nothing to abandon any more
        self._reset_message()
        queued = Reply(250, (f"Ok: queued as {format_id(msg_id)}",), EnhancedStatus(2, 0, 0))
        return self.conn.accept(queued)

    # --- the transaction -----------------------------------------------------------------

    def _reset_message(self) -> None:
        self.mail = None
        self.recipients = []
        self.buffer = bytearray()
        self.index = 0
        self.size = 0
        self.header_len = 0
        self.headers = {}
        self.fault = None

    async def _end_transaction(self) -> None:
        """Drop the message in progress, if any, removing what was written of it."""
        msg_id, self.msg_id = self.msg_id, None
        self._reset_message()
        if msg_id is None:
            return
        try:
            await asyncio.shield(self.store.abandon(msg_id))
        except ZoneqError as exc:
            # The sweep removes the chunks later (the receiving marker stays).
            log.warning("message %s: abandon failed: %s", format_id(msg_id), exc)
