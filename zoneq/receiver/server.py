"""The SMTP receiver: an asyncio server driving one ``ServerConnection`` per client.

Theory of operation
-------------------
The protocol lives in ``zoneq.protocol.smtp_server`` (sans-IO); this module owns the
sockets (through ``connection.Link``, a small protocol in place of asyncio's streams);
what it accepts goes to a ``MessageSink`` (``zoneq.ipc.intake_messages``): the
queue store itself when the receiver runs in the core, the core over a socket when it runs
in receiver processes (``receiver.processes``; ``process.py``).  Each session is one task
running a simple loop: read some bytes, feed them to the machine, act on every event that
comes back (deciding the ones that wait for a decision, storing body chunks), write the
replies, read again.  The task awaits each decision and each chunk write before it reads
more, so a client that sends faster than the queue writes is held back by TCP (the machine
documents that the driver should stop reading while a decision is pending); other sessions
are separate tasks and go on.

A message's life in a session: ``sink.begin`` at MAIL (452/451 if the queue refuses), a
``Received:`` field first in the text at DATA, chunks of ``storage.chunk_size`` written as
they fill, and at the final dot one ``sink.commit`` with the last partial chunk as its
tail.  Only once the commit has returned (the batch is synced) does the client get 250.
Everything that ends a transaction otherwise (a refusal, RSET, a new EHLO, QUIT, the client
going away, the server closing) abandons the message, removing any chunk written.

Choices:

* Local faults are never 5xx: a queue that refuses anything answers 451 4.3.0 (452 4.3.1
  for the free-space floor), so the client keeps the message and retries.  A sink that is
  gone for good (``CoreUnreachable``: the core died) ends the session with 421 4.3.0.
* Connections per client address are counted by the sink (``admit``), in the core, so the
  limit holds across receiver processes.
* Relaying: clients in ``receiver.allow_networks`` and clients that authenticated; others
  get 554 5.7.1 at RCPT.  Source routes and the percent hack are refused from everyone
  (``relay.py``).
* ``RCPT TO:<Postmaster>`` (RFC 5321 section 4.5.1: no domain, must be accepted) goes to
  ``receiver.postmaster`` from any client; unset, it is refused 550 5.1.1 saying so.
* STARTTLS (``tls.py``) is offered when a certificate is configured; AUTH PLAIN and LOGIN
  (``auth.py``) once TLS is active and users are configured.  ``receiver.tls_listen`` adds
  a listener for implicit TLS (RFC 8314 section 3.3): the handshake first, then the same
  session, TLS from its start (no STARTTLS offered, AUTH at once, ESMTPS in Received).
* Each request (a command, or the text after 354) must complete within the idle timeout,
  which message text extends at ``min_data_rate`` (``deadline.py``): a client that
  trickles a byte at a time is cut off with 421 4.4.2 all the same.
* Loops: more than ``MAX_RECEIVED`` Received fields in the header section is 554 5.4.6 at
  the final dot (RFC 3463 section 3.5, "routing loop detected").
* Routing and the receive-time plugin hooks (``smtp:auth``, ``smtp:mail_from``,
  ``smtp:rcpt_to``, ``queue:route``, ``message:headers``) are asked through ``hooks.py``;
  a plugin's reply refuses the command, a failing plugin gives 451 4.3.0.  A recipient a
  plugin drops gets 250 and is left out of the queue; the commit writes its DROPPED event
  (if none is left, only the events: the text is removed), and no 250, no event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Final

from zoneq.config.model import Config
from zoneq.errors import InsufficientStorage, ListenError, ZoneqError
from zoneq.ipc.intake_messages import (
    CoreUnreachable,
    DroppedRecipient,
    MessageSink,
    ReceivedMessage,
    ReceivedRecipient,
)
from zoneq.logs import REPEATS
from zoneq.plugin import PluginHost, Session
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
from zoneq.receiver.auth import Authenticator, AuthSession, Outcome
from zoneq.receiver.connection import Link
from zoneq.receiver.deadline import RequestDeadline
from zoneq.receiver.hooks import ReceiveHooks, Routed
from zoneq.receiver.message import (
    MAX_RECEIVED,
    HeaderScan,
    protocol_keyword,
    received_header,
    scan_headers,
)
from zoneq.receiver.relay import RELAY_DENIED, RelayPolicy, address_refusal
from zoneq.receiver.sasl import Credentials
from zoneq.receiver.tls import accept_tls, handshake_timeout, server_context, start_tls

__all__ = ["SmtpReceiver"]

log = logging.getLogger("zoneq.receiver")

_CLOSE_GRACE_S: Final = 5.0  # how long close() lets sessions finish a commit in flight


def _r(code: int, text: str, klass: int, subject: int, detail: int) -> Reply:
    return Reply(code, (text,), EnhancedStatus(klass, subject, detail))


MAIL_LOOP: Final = _r(554, "Too many Received headers: mail loop detected", 5, 4, 6)
ALL_DROPPED: Final = Reply(250, ("Ok: accepted, nothing to deliver",), EnhancedStatus(2, 0, 0))
TOO_MANY: Final = "Too many connections from your address"  # 421 4.7.0 (RFC 3463 3.8)
NO_POSTMASTER: Final = _r(550, "No postmaster address is configured here", 5, 1, 1)


def _counted(admission: asyncio.Future[bool]) -> bool:
    """Whether a settled admission counted the connection (a failed one did not)."""
    return not admission.cancelled() and admission.exception() is None and admission.result()


def _bye(code_text: str, klass: int, subject: int, detail: int, hostname: str) -> Reply:
    return Reply(421, (f"{hostname} {code_text}",), EnhancedStatus(klass, subject, detail))


class _SessionOver(Exception):
    """The session cannot go on (a failed TLS handshake): close without a reply."""


def _notify_keywords(notify: frozenset[Notify] | None) -> tuple[str, ...]:
    if not notify:
        return ()
    return tuple(keyword.value for keyword in Notify if keyword in notify)


class SmtpReceiver:
    """Accepts mail over SMTP into ``sink``.  ``clock`` returns milliseconds since the epoch.
    ``plugins`` (the caller's, which the caller closes) are asked at the receive hooks."""

    def __init__(
        self,
        sink: MessageSink,
        config: Config,
        *,
        clock: Callable[[], int],
        plugins: PluginHost | None = None,
    ) -> None:
        self.sink = sink
        self.config = config
        self.clock = clock
        self.hostname = config.server.resolved_hostname()
        self.relay_policy = RelayPolicy(config.receiver.networks)
        # Asked for every connection: parsing the client's address (ipaddress) and testing
        # it against each network was about 3% of the core's CPU per accepted message
        # (py-spy under tools/bench/accept_bench.py, one message per connection).  The
        # networks never change and few distinct clients connect at once; bounded.
        self.may_relay = functools.lru_cache(maxsize=4096)(self.relay_policy.client_allowed)
        cert, key = config.receiver.tls_cert, config.receiver.tls_key
        self.tls_context = None if cert is None or key is None else server_context(cert, key)
        self.authenticator = Authenticator(config.receiver.auth_users)
        self.hooks = ReceiveHooks(config, plugins)
        # Read once: parsing them for every session showed in the accept-path profile.
        self.idle_timeout_s = config.receiver.idle_timeout_s
        self.max_message_size = int(config.receiver.max_message_size)
        self._server: asyncio.Server | None = None
        self._port = 0
        self._tls_server: asyncio.Server | None = None  # receiver.tls_listen
        self._tls_port = 0
        self._handshakes: set[asyncio.Task[None]] = set()  # implicit TLS, not yet sessions
        self._handshaking: Counter[str] = Counter()  # those handshakes per client address
        self.handshake_timeout_s = handshake_timeout(self.idle_timeout_s)
        self._sessions: set[_Session] = set()
        self._closing = False

    async def start(
        self, sock: socket.socket | None = None, tls_sock: socket.socket | None = None
    ) -> None:
        """Listen on ``receiver.listen`` (and ``receiver.tls_listen``), or accept on ``sock``
        (and ``tls_sock``): listening sockets that the core bound and handed to this
        receiver process and its siblings (the kernel spreads the connections among the
        processes accepting on one socket)."""
        loop = asyncio.get_running_loop()
        if sock is not None:
            self._server = await loop.create_server(self._link, sock=sock)
        else:
            host, port = self.config.receiver.listen_address
            self._server = await loop.create_server(self._link, host, port)
        self._port = int(self._server.sockets[0].getsockname()[1])
        if tls_sock is not None or (sock is None and self.config.receiver.tls_listen):
            await self._listen_implicit_tls(tls_sock)

    async def _listen_implicit_tls(self, sock: socket.socket | None) -> None:
        """The ``receiver.tls_listen`` listener (on ``sock`` if the core bound it); a port
        that cannot be bound closes ``listen`` again and is a ``ListenError`` naming the
        address (nothing half-started)."""
        loop = asyncio.get_running_loop()
        tls_link = functools.partial(Link, self._accept_implicit_tls)
        try:
            if sock is not None:
                self._tls_server = await loop.create_server(tls_link, sock=sock)
            else:
                host_port = self.config.receiver.tls_listen_address
                assert host_port is not None  # start() comes here only with tls_listen set
                self._tls_server = await loop.create_server(tls_link, *host_port)
        except OSError as exc:
            assert self._server is not None
            self._server.close()
            await self._server.wait_closed()
            address = self.config.receiver.tls_listen
            raise ListenError(
                f"SMTP receiver (implicit TLS) cannot listen on {address}: {exc.strerror or exc}"
            ) from None
        self._tls_port = int(self._tls_server.sockets[0].getsockname()[1])

    @property
    def port(self) -> int:
        """The port bound (useful with port 0)."""
        if self._server is None:
            raise RuntimeError("receiver not started")
        return self._port

    @property
    def tls_port(self) -> int:
        """The implicit-TLS port bound (``receiver.tls_listen``)."""
        if self._tls_server is None:
            raise RuntimeError("no implicit-TLS listener")
        return self._tls_port

    async def close(self) -> None:
        """Stop accepting; sessions waiting for input get 421 4.3.2 and messages being
        received are abandoned.  A commit in flight may finish (and answer) first."""
        self._closing = True
        for server in (self._server, self._tls_server):
            if server is not None:
                server.close()
        for handshake in list(self._handshakes):
            handshake.cancel()  # not a session yet: nothing to say, nothing to finish
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
        for server in (self._server, self._tls_server):
            if server is not None:
                await server.wait_closed()

    def _link(self) -> Link:
        return Link(self._accept)

    async def _accept_implicit_tls(self, link: Link) -> None:
        """RFC 8314 section 3.3: the handshake (bounded; one info line if it fails), then the
        session as on ``listen``, under TLS from its start.  The connection is counted
        against ``max_connections_per_client`` once the handshake is done, so that a 421
        for too many connections is said inside TLS, where the client can read it.

        Handshakes in progress are bounded by the same number per client address (in this
        process): a client that connects and never says its ClientHello holds a socket
        for the handshake's time limit, and with no bound one address could hold them all
        (the plain port's sessions too).  Past it a connection is closed at once: nothing
        can be said to a client before TLS."""
        context = self.tls_context
        assert context is not None  # config: tls_listen needs tls_cert and tls_key
        task = asyncio.current_task()
        assert task is not None
        ip = link.peer_ip()
        if self._handshaking[ip] >= self.config.receiver.max_connections_per_client:
            log.warning("refusing %s: too many TLS handshakes from that address", ip, extra=REPEATS)
            link.close()
            return
        self._handshaking[ip] += 1
        self._handshakes.add(task)
        try:
            # The first await of the connection; what was read before it is the ClientHello
            # (tls.py), which Link.start_tls hands to the TLS layer.
            timeout = self.handshake_timeout_s
            version = await accept_tls(link, context, timeout_s=timeout, peer=ip)
        except asyncio.CancelledError:
            version = None  # close() during the handshake
        finally:
            self._handshakes.discard(task)
            self._handshaking[ip] -= 1
            if not self._handshaking[ip]:
                del self._handshaking[ip]
        if version is None or self._closing:
            link.close()
            return
        await self._accept(link, tls=version)

    async def _accept(self, link: Link, tls: str = "") -> None:
        """A session on ``link``; ``tls``: the TLS version when the connection is under TLS
        already (the implicit-TLS listener)."""
        ip = link.peer_ip()
        if self._closing:
            link.close()
            return
        try:
            admission = self.sink.admit(ip)
        except CoreUnreachable:
            await self._turn_away(link, "Service not available, queue unreachable", 3, 0)
            return
        if admission.done() and not _counted(admission):
            if admission.exception() is not None:
                await self._turn_away(link, "Service not available, queue unreachable", 3, 0)
            else:
                await self._turn_away(link, TOO_MANY, 7, 0)
            return
        session = _Session(self, link, ip, admission, tls=tls)
        session.task = link.task  # the task running this (current_task() costs a getpid)
        self._sessions.add(session)
        try:
            await session.run()
        finally:
            self._sessions.discard(session)
            # Released as soon as the socket is closed, before waiting for the close to
            # finish: the client may be connecting again already, perhaps to another
            # receiver process, and the count is shared.  An answer still on its way is
            # released when it comes, if it counted the connection.
            if admission.done():
                self._release(admission, ip)
            else:
                admission.add_done_callback(lambda _: self._release(admission, ip))
            with contextlib.suppress(Exception):
                await link.wait_closed(timeout_s=1.0)

    def _release(self, admission: asyncio.Future[bool], ip: str) -> None:
        if _counted(admission):
            self.sink.release(ip)

    async def _turn_away(self, link: Link, text: str, subject: int, detail: int) -> None:
        """421 instead of the greeting (RFC 5321 section 3.1), then close."""
        bye = _bye(text, 4, subject, detail, self.hostname)
        with contextlib.suppress(ConnectionError):
            link.write(bye.to_wire())
            await link.drain()
        link.close()


class _Session:
    """One client connection and the message it is sending, if any."""

    # The read deadline's timer (``_watch``), armed by the first read.
    loop: asyncio.AbstractEventLoop
    _watchdog: asyncio.TimerHandle | None = None
    _expires = 0.0
    _timed_out = False

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
        # Awaited before the first command when the sink could not answer at once.
        self.admission: asyncio.Future[bool] | None = None if admission.done() else admission
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
        self.auth = AuthSession(receiver.authenticator, ip, self._auth_plugins)
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
                if data is None:
                    self._say_bye("Timeout, closing connection", 4, 4, 2)
                    break
                if not data:
                    break  # the client went away
                if self.admission is not None and not await self._admitted():
                    break
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
        ran out of time (``deadline.py``)."""
        deadline = self.deadline
        if deadline.expired:
            return None
        in_data = self.conn.state is State.DATA
        loop = self.loop
        started = loop.time()
        self._watch(started + deadline.left)
        self._waiting_input = True
        try:
            data = await self.link.read()
        except asyncio.CancelledError:
            if not self._timed_out:
                raise
            self._timed_out = False
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
            self._timed_out = True
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
            reply = _bye(text, klass, subject, detail, self.receiver.hostname)
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
        step = self.chunk_size
        while len(self.buffer) >= step and self.fault is None:
            piece = bytes(self.buffer[:step])
            del self.buffer[:step]
            if self.index == 0:
                self._scan(piece)
            else:
                self._scan_more(piece)
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
                self.fault = LOCAL_ERROR
                break
            self.index += 1
        if self.fault is not None:
            self.buffer.clear()

    def _scan(self, first: bytes) -> None:
        self.scan = scan_headers(first[self.header_len :])
        self._check_loop()

    def _scan_more(self, piece: bytes) -> None:
        """A header section longer than the first chunk: its Received fields count too."""
        if self.scan.carry is not None:
            self.scan.more(piece)
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
            if self.index == 0:
                self._scan(tail)
            else:
                self._scan_more(tail)
        if self.fault is not None:
            fault = self.fault
            await self._end_transaction()
            return self.conn.reject(fault)
        mail = self.mail
        accepted = await self.hooks.message(
            self._plugin_session,
            sender=mail.address,
            routed=self.recipients,
            dropped=self.dropped,
            fields=self.scan.fields(),
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
            body_8bit=mail.body is BodyType.EIGHT_BIT_MIME,
            headers=dict(self.scan.headers),
            source=self._source(),
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
            return self.conn.reject(LOCAL_ERROR)
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
            # The sweep removes the chunks later (the receiving marker stays).
            log.warning("message %s: abandon failed: %s", format_id(msg_id), exc, extra=REPEATS)
