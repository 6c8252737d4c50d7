"""One SMTP session: a client connection, its ``ServerConnection`` and the message it sends.

``SmtpReceiver`` (``server.py``, whose docstring has the receiver's theory of operation)
accepts the connection and runs ``SmtpSession.run``: read, feed the sans-IO machine, act on
its events (decisions through ``hooks.py``, body chunks to the sink, the commit at the
final dot), write the replies, read again.  Everything that ends a transaction other than
a commit abandons the message, removing any chunk written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

from zoneq.errors import InsufficientStorage, ZoneqError
from zoneq.ipc.intake_messages import (
    CoreUnreachable,
    DroppedRecipient,
    ReceivedMessage,
    ReceivedRecipient,
)
from zoneq.logs import REPEATS
from zoneq.plugin import Session
from zoneq.protocol.dsn import Notify
from zoneq.protocol.ids import format_id
from zoneq.protocol.replies import INSUFFICIENT_STORAGE, LOCAL_ERROR, EnhancedStatus, Reply
from zoneq.protocol.smtp_commands import BodyType
from zoneq.protocol.smtp_server import (
    AuthRequest,
    AuthResponse,
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
    StartTLS,
    State,
)
from zoneq.receiver.auth import AuthSession, Outcome
from zoneq.receiver.connection import Link
from zoneq.receiver.deadline import RequestDeadline
from zoneq.receiver.hooks import Routed
from zoneq.receiver.message import (
    MAX_RECEIVED,
    HeaderScan,
    protocol_keyword,
    received_header,
    scan_headers,
)
from zoneq.receiver.relay import RELAY_DENIED, address_refusal
from zoneq.receiver.sasl import Credentials
from zoneq.receiver.tls import start_tls

if TYPE_CHECKING:
    from zoneq.receiver.server import SmtpReceiver  # which creates sessions

__all__ = [
    "ALL_DROPPED",
    "MAIL_LOOP",
    "NO_POSTMASTER",
    "TOO_MANY",
    "SmtpSession",
    "counted",
    "goodbye",
]

log = logging.getLogger("zoneq.receiver")


def _r(code: int, text: str, klass: int, subject: int, detail: int) -> Reply:
    return Reply(code, (text,), EnhancedStatus(klass, subject, detail))


MAIL_LOOP: Final = _r(554, "Too many Received headers: mail loop detected", 5, 4, 6)
ALL_DROPPED: Final = Reply(250, ("Ok: accepted, nothing to deliver",), EnhancedStatus(2, 0, 0))
TOO_MANY: Final = "Too many connections from your address"  # 421 4.7.0 (RFC 3463 3.8)
NO_POSTMASTER: Final = _r(550, "No postmaster address is configured here", 5, 1, 1)


def goodbye(code_text: str, klass: int, subject: int, detail: int, hostname: str) -> Reply:
    return Reply(421, (f"{hostname} {code_text}",), EnhancedStatus(klass, subject, detail))


def counted(admission: asyncio.Future[bool]) -> bool:
    """Whether a settled admission counted the connection (a failed one did not)."""
    return not admission.cancelled() and admission.exception() is None and admission.result()


class _SessionOver(Exception):
    """The session cannot go on (a failed TLS handshake): close without a reply."""


def _storage_fault(exc: Exception) -> Reply:
    """The reply to a message the queue could not take: 452 4.3.1 below the free-space floor
    (RFC 5321 section 4.2.2 and RFC 3463 section 3.4: insufficient system storage, a chunk
    write included, when the client gave no SIZE=), 451 4.3.0 for any other local fault."""
    return INSUFFICIENT_STORAGE if isinstance(exc, InsufficientStorage) else LOCAL_ERROR


def _notify_keywords(notify: frozenset[Notify] | None) -> tuple[str, ...]:
    if not notify:
        return ()
    return tuple(keyword.value for keyword in Notify if keyword in notify)


class SmtpSession:
    """One client connection and the message it is sending, if any."""

    # The read deadline's timer (``_watch``), armed by the first read.
    loop: asyncio.AbstractEventLoop
    _watchdog: asyncio.TimerHandle | None = None
    _expires = 0.0
    _read_cut = False  # our own cancel of the read: its deadline, or the connection refused
    _refused = False  # the late admission came back refused (or failed)

    def __init__(
        self,
        receiver: SmtpReceiver,
        link: Link,
        ip: str,
        admission: asyncio.Future[bool],
        *,
        tls: str = "",
    ) -> None:
        config = receiver.config
        # Awaited before the first command when the sink could not answer at once; a
        # refusal that comes first ends the session without waiting for one.
        self.admission: asyncio.Future[bool] | None = None
        if not admission.done():
            self.admission = admission
            admission.add_done_callback(self._on_admission)
        self.receiver = receiver
        self.sink = receiver.sink
        self.link = link
        self.ip = ip
        self.task: asyncio.Task[None] | None = None
        self.conn = ServerConnection(
            receiver.hostname,
            max_message_size=receiver.max_message_size,
            max_recipients=config.receiver.max_recipients,
            max_errors=config.receiver.max_errors,
            tls_offered=receiver.tls_context is not None,
            tls_active=bool(tls),  # implicit TLS: no STARTTLS, AUTH at once (RFC 3207, 8314)
            auth_offered=receiver.authenticator.enabled or receiver.hooks.auth_hook,
        )
        self.hooks = receiver.hooks
        self.relay_by_address = receiver.may_relay(ip)
        self.auth = AuthSession(
            receiver.authenticator, ip, self._auth_plugins, hostname=receiver.hostname
        )
        self.tls = tls  # the TLS version: from the start (implicit TLS) or after STARTTLS
        self.deadline = RequestDeadline(receiver.idle_timeout_s, config.receiver.min_data_rate)
        self.chunk_size = config.storage.chunk_size
        self.helo = ""
        self.esmtp = False
        self._waiting_input = False
        self._stopping = False
        # The transaction
        self.msg_id: int | None = None
        self.mail: MailFrom | None = None
        self.recipients: list[Routed] = []
        self.dropped: tuple[DroppedRecipient, ...] = ()  # () allocates nothing per message
        self.buffer = bytearray()
        self.index = 0  # chunks written
        self.size = 0  # octets stored (written and buffered)
        self.header_len = 0  # our Received field, first in chunk 0
        self.scan = HeaderScan()
        self.eight_bit = False  # an octet over 0x7F in the data, declared or not
        self.fault: Reply | None = None  # decided while the body streams: answered at the dot
        self.received_ms = 0

    # --- the loop ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """The server is closing: stop at the next read (at once if waiting for one)."""
        self._stopping = True
        if self._waiting_input and self.task is not None:
            self.task.cancel()

    @property
    def relay(self) -> bool:
        """May relay, and is trusted with the routing header (issue 5): the same clients."""
        return self.relay_by_address or self.auth.user is not None

    def _plugin_session(self) -> Session:
        """This session as the receive hooks see it (built only when a plugin listens)."""
        return Session(self.ip, self.helo or None, self.auth.user, self.relay)

    async def _auth_plugins(self, mechanism: str, credentials: Credentials) -> bool | Reply | None:
        return await self.hooks.auth(
            self._plugin_session, mechanism, credentials.username, credentials.password
        )

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            link = self.link
            link.write(self.conn.greeting())
            while not self.conn.closed:
                # Only when a reply is still queued (a slow client): drain() is two
                # coroutine calls per read for nothing otherwise, as a loopback or LAN
                # client takes each reply whole.
                if link.write_buffer_size():
                    await link.drain()
                if self._stopping:
                    self._say_bye("Service shutting down", 4, 3, 2)
                    break
                data = await self._read()
                # The admission first: a refusal cuts the read (None) of a silent client.
                if self.admission is not None and not await self._admitted():
                    break
                if data is None:
                    self._say_bye("Timeout, closing connection", 4, 4, 2)
                    break
                if not data:
                    break  # the client went away
                await self._handle(self.conn.receive(data))
                out = self.conn.data_to_send()
                if out:
                    self.deadline.restart()  # a request was answered: the next one starts
                    link.write(out)
            await link.drain()
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            # close() interrupted a read: say goodbye below.
            self._say_bye("Service shutting down", 4, 3, 2)
        except CoreUnreachable as exc:
            # The core is gone: nothing can be queued, so the client must go elsewhere or
            # come back (RFC 5321 section 3.8); its message was not acknowledged.
            log.warning("session from %s ends: %s", self.ip, exc)
            self._say_bye("Service not available, queue unreachable", 4, 3, 0)
        except (ConnectionError, OSError, _SessionOver):
            pass  # the client went away mid-write, or the TLS handshake failed
        finally:
            self._unwatch()
            await self._end_transaction()
            self.link.close()  # SmtpReceiver._accept waits for the close

    async def _read(self) -> bytes | None:
        """The next bytes from the client ("" at EOF), or None when the request in progress
        ran out of time (``deadline.py``) or the connection was refused (``_on_admission``)."""
        deadline = self.deadline
        if deadline.expired or self._refused:
            return None
        in_data = self.conn.state is State.DATA
        loop = self.loop
        started = loop.time()
        self._watch(started + deadline.left)
        self._waiting_input = True
        try:
            data = await self.link.read()
        except asyncio.CancelledError:
            if not self._read_cut:
                raise
            self._read_cut = False
            if self.task is not None:
                self.task.uncancel()  # our own cancel, spent here (as asyncio.timeout does)
            return None
        finally:
            self._waiting_input = False
        deadline.spend(loop.time() - started, len(data) if in_data else 0)
        return data

    def _watch(self, expires: float) -> None:
        """Time out the wait for input at loop time ``expires``.

        One lazy timer per session instead of ``asyncio.timeout`` around every read: that
        cost a timer armed and cancelled and four ``get_running_loop`` calls (each a
        ``getpid`` system call) per read, seven reads per message, about 6% of the core's
        CPU per accepted message in tools/bench/accept_bench.py.  The expiry only ever
        moves later (time spent not waiting for input is not charged), so the timer stays
        armed at the earliest expiry and, if it fires early, re-arms itself for the later
        one (the lazy deadlines of Go's netpoller)."""
        self._expires = expires
        watchdog = self._watchdog
        if watchdog is None or watchdog.when() > expires:
            if watchdog is not None:
                watchdog.cancel()
            self._watchdog = self.loop.call_at(expires, self._on_watchdog)

    def _unwatch(self) -> None:
        """The session is over: its timer goes (it holds the session for the timeout)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _on_watchdog(self) -> None:
        self._watchdog = None
        if not self._waiting_input:
            return  # the next read arms it again
        if self.loop.time() < self._expires:
            self._watchdog = self.loop.call_at(self._expires, self._on_watchdog)
        elif self.task is not None:
            self._read_cut = True
            self.task.cancel()

    def _on_admission(self, admission: asyncio.Future[bool]) -> None:
        """The sink's late answer came.  A refusal must not wait for the client to speak:
        one that never does would hold its socket and session until the idle timeout, past
        the limit (1,500 of them from one address all stayed open).  Cut the read, as the
        deadline does, and the loop answers 421 (RFC 5321 section 3.8) and closes."""
        if counted(admission):
            return
        self._refused = True
        if self._waiting_input and self.task is not None:
            self._read_cut = True
            self.task.cancel()

    async def _admitted(self) -> bool:
        """The sink's late answer to this connection; False (after a 421) if refused."""
        assert self.admission is not None
        admitted = await asyncio.shield(self.admission)
        self.admission = None
        if admitted is not True:
            log.warning(
                "refusing %s: too many connections from that address", self.ip, extra=REPEATS
            )
            self._say_bye(TOO_MANY, 4, 7, 0)
        return admitted is True

    def _say_bye(self, text: str, klass: int, subject: int, detail: int) -> None:
        with contextlib.suppress(Exception):
            reply = goodbye(text, klass, subject, detail, self.receiver.hostname)
            self.link.write(self.conn.data_to_send() + reply.to_wire())

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
                queue.extend(await self._rcpt(event))
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
            elif isinstance(event, StartTLS):
                await self._starttls()
            elif isinstance(event, AuthRequest):
                queue.extend(self._auth(await self.auth.request(event.mechanism, event.initial)))
            elif isinstance(event, AuthResponse):
                queue.extend(self._auth(await self.auth.response(event.data)))

    async def _starttls(self) -> None:
        """RFC 3207: the 220 out, the handshake, and the session starts over (no EHLO)."""
        await self._end_transaction()
        context = self.receiver.tls_context
        assert context is not None  # the machine offers STARTTLS only with a context
        self.link.write(self.conn.data_to_send())
        timeout = self.receiver.idle_timeout_s
        if not await start_tls(self.link, context, timeout_s=timeout, peer=self.ip):
            raise _SessionOver
        ssl_object = self.link.get_extra_info("ssl_object")
        self.tls = str(ssl_object.version()) if ssl_object is not None else "TLS"
        self.helo = ""
        self.deadline.restart()
        self.conn.tls_established()

    def _auth(self, outcome: Outcome) -> list[Event]:
        if isinstance(outcome, bytes):
            return self.conn.challenge(outcome)
        if outcome.code == 235:
            return self.conn.accept(outcome)
        return self.conn.reject(outcome)

    # --- decisions -----------------------------------------------------------------------

    async def _mail(self, event: MailFrom) -> list[Event]:
        await self._end_transaction()  # none should be left; never leak one
        refusal = await self.hooks.mail_from(self._plugin_session, event.address)
        if refusal is not None:
            return self.conn.reject(refusal)
        now = self.receiver.clock()
        try:
            msg_id = await self.sink.begin(now, event.size or 0)
        except CoreUnreachable:
            raise
        except InsufficientStorage as exc:
            log.warning("refusing MAIL from %s: %s", self.ip, exc, extra=REPEATS)
            return self.conn.reject(INSUFFICIENT_STORAGE)
        except ZoneqError as exc:
            log.warning("refusing MAIL from %s: queue unavailable: %s", self.ip, exc, extra=REPEATS)
            return self.conn.reject(LOCAL_ERROR)
        self.msg_id = msg_id
        self.mail = event
        self.received_ms = now
        return self.conn.accept()

    async def _rcpt(self, event: RcptTo) -> list[Event]:
        address = event.address
        refusal = address_refusal(address, event.route)
        if refusal is not None:
            return self.conn.reject(refusal)
        if "@" not in address:  # <Postmaster>, the one address the machine takes bare
            address = self.receiver.config.receiver.postmaster or ""
            if not address:
                return self.conn.reject(NO_POSTMASTER)
        elif not self.relay:
            return self.conn.reject(RELAY_DENIED)
        assert self.mail is not None  # the machine asks for RCPT only after MAIL
        decided = await self.hooks.rcpt(
            self._plugin_session,
            sender=self.mail.address,
            recipient=address,
            client_ip=self.ip,
            trusted=self.relay,
        )
        if isinstance(decided, Reply):
            return self.conn.reject(decided)
        if isinstance(decided, DroppedRecipient):
            # Accepted and never queued: its DROPPED event goes with the commit, so there
            # is one exactly when the client is told 250 for the message.
            log.info("RCPT %s from %s dropped by a plugin: %s", address, self.ip, decided.reason)
            self.dropped += (decided,)
            return self.conn.accept()
        notify = _notify_keywords(event.notify)
        recipient = ReceivedRecipient(address, decided.zone, notify, event.orcpt)
        self.recipients.append(Routed(recipient, decided.rule))
        return self.conn.accept()

    def _data_start(self) -> list[Event]:
        assert self.msg_id is not None and self.mail is not None
        protocol = protocol_keyword(
            utf8=self.mail.smtputf8,
            esmtp=self.esmtp,
            tls=bool(self.tls),
            auth=self.auth.user is not None,
        )
        single = self.recipients[0].recipient.address if len(self.recipients) == 1 else None
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
        # RFC 6152 section 3: 8-bit data is sent with BODY=8BITMIME, whether or not our
        # client declared it; one C-speed scan per piece, and none once one is found.
        self.eight_bit = self.eight_bit or not data.isascii()
        step = self.chunk_size
        while len(self.buffer) >= step and self.fault is None:
            piece = bytes(self.buffer[:step])
            del self.buffer[:step]
            self._scan_piece(piece)
            if self.fault is not None:
                break
            try:
                await self.sink.write_chunk(self.msg_id, self.index, piece)
            except CoreUnreachable:
                raise
            except ZoneqError as exc:
                log.warning(
                    "message %s: chunk write failed: %s", format_id(self.msg_id), exc, extra=REPEATS
                )
                self.fault = _storage_fault(exc)
                break
            self.index += 1
        if self.fault is not None:
            self.buffer.clear()

    def _scan_piece(self, piece: bytes) -> None:
        """Read the header section in the first chunk; in a later one, count its Received
        fields while the section goes on past the first chunk."""
        if self.index == 0:
            self.scan = scan_headers(piece[self.header_len :])
        elif self.scan.carry is not None:
            self.scan.more(piece)
        else:
            return
        self._check_loop()

    def _check_loop(self) -> None:
        scan = self.scan
        if scan.received > MAX_RECEIVED:
            log.warning("message from %s: %d Received fields, a loop", self.ip, scan.received)
            self.fault = MAIL_LOOP

    async def _data_end(self, event: DataEnd) -> list[Event]:
        msg_id = self.msg_id
        if event.rejected is not None or msg_id is None or self.mail is None:
            await self._end_transaction()  # the machine answered already
            return []
        tail: bytes | None = bytes(self.buffer) if self.buffer else None
        if tail is not None and self.fault is None:
            self._scan_piece(tail)
        if self.fault is not None:
            fault = self.fault
            await self._end_transaction()
            return self.conn.reject(fault)
        mail = self.mail
        fields = self.scan.fields()
        accepted = await self.hooks.message(
            self._plugin_session,
            sender=mail.address,
            routed=self.recipients,
            dropped=self.dropped,
            fields=fields,
            trusted=self.relay,
        )
        if isinstance(accepted, Reply):
            await self._end_transaction()
            return self.conn.reject(accepted)
        # With no recipient left (every one dropped by a plugin) the commit stores only the
        # DROPPED events and removes the text: accepted as the plugins asked.
        recipients, dropped = accepted
        chunks = self.index + (1 if tail is not None else 0)
        message = ReceivedMessage(
            msg_id=msg_id,
            sender=mail.address,
            size=self.size,
            chunks=chunks,
            received_ms=self.received_ms,
            ret=None if mail.ret is None else mail.ret.value,
            envid=mail.envid,
            smtputf8=mail.smtputf8,
            body_8bit=self.eight_bit or mail.body is BodyType.EIGHT_BIT_MIME,
            headers=dict(self.scan.headers),
            source=self._source(),
            zone_header=self.hooks.routing_field(fields, trusted=self.relay),
        )
        # Replies to pipelined commands before the dot go out while the commit syncs.
        self.link.write(self.conn.data_to_send())
        try:
            now = self.receiver.clock()
            await asyncio.shield(
                self.sink.commit(message, recipients, now, tail=tail, dropped=dropped)
            )
        except CoreUnreachable:
            raise
        except (ZoneqError, ValueError) as exc:
            log.warning("message %s: commit failed: %s", format_id(msg_id), exc, extra=REPEATS)
            await self._end_transaction()
            return self.conn.reject(_storage_fault(exc))
        except asyncio.CancelledError:
            # The server is closing and its grace ran out while the commit synced.  The
            # commit goes on (shielded) and may land: abandoning the message now would
            # delete what it stores (its first chunks, written before the dot).  If it
            # lands, the client, told 421, may send it again (RFC 1047's duplicate); if
            # it fails, the store undoes it, and start-up removes the chunks.
            self.msg_id = None
            self._reset_message()
            raise
        self.msg_id = None  # queued: nothing to abandon any more
        self._reset_message()
        if not recipients:
            return self.conn.accept(ALL_DROPPED)
        queued = Reply(250, (f"Ok: queued as {format_id(msg_id)}",), EnhancedStatus(2, 0, 0))
        return self.conn.accept(queued)

    def _source(self) -> dict[str, str]:
        source = {"client": self.ip, "helo": self.helo, "protocol": "smtp"}
        if self.tls:
            source["tls"] = self.tls
        if self.auth.user is not None:
            source["auth"] = self.auth.user
        return source

    # --- the transaction -----------------------------------------------------------------

    def _reset_message(self) -> None:
        self.mail = None
        self.recipients = []
        self.dropped = ()
        self.buffer = bytearray()
        self.index = 0
        self.size = 0
        self.header_len = 0
        self.scan = HeaderScan()
        self.eight_bit = False
        self.fault = None

    async def _end_transaction(self) -> None:
        """Drop the message in progress, if any, removing what was written of it."""
        msg_id, self.msg_id = self.msg_id, None
        self._reset_message()
        if msg_id is None:
            return
        try:
            await asyncio.shield(self.sink.abandon(msg_id))
        except ZoneqError as exc:
            # The store no longer counts it as streaming in: its receiving marker stays,
            # and the next sweep after the DATA timeout (or a reopen) removes the chunks.
            log.warning("message %s: abandon failed: %s", format_id(msg_id), exc, extra=REPEATS)
