"""The SMTP receiver: an asyncio server driving one ``ServerConnection`` per client.

Theory of operation
-------------------
The protocol lives in ``zoneq.protocol.smtp_server`` (sans-IO); this module owns the
sockets (through ``connection.Link``, a small protocol in place of asyncio's streams);
what it accepts goes to a ``MessageSink`` (``zoneq.ipc.intake_messages``): the
queue store itself when the receiver runs in the core, the core over a socket when it runs
in receiver processes (``receiver.processes``; ``process.py``).  Each session
(``session.py``) is one task running a simple loop: read some bytes, feed them to the
machine, act on every event that comes back (deciding the ones that wait for a decision,
storing body chunks), write the replies, read again.  The task awaits each decision and
each chunk write before it reads more, so a client that sends faster than the queue
writes is held back by TCP (the machine documents that the driver should stop reading
while a decision is pending); other sessions are separate tasks and go on.

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
  limit holds across receiver processes.  A receiver process greets while the core
  decides (the round trip is not added to every connection's greeting); a refusal is
  421 4.7.0 and the close as soon as it comes, whether or not the client has spoken.
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
from collections import Counter
from collections.abc import Callable
from typing import Final

from zoneq.config.model import Config
from zoneq.errors import ListenError
from zoneq.ipc.intake_messages import (
    CoreUnreachable,
    MessageSink,
)
from zoneq.logs import REPEATS
from zoneq.plugin import PluginHost
from zoneq.receiver.auth import Authenticator
from zoneq.receiver.connection import Link
from zoneq.receiver.hooks import ReceiveHooks
from zoneq.receiver.relay import RelayPolicy
from zoneq.receiver.session import TOO_MANY, SmtpSession, counted, goodbye
from zoneq.receiver.tls import accept_tls, handshake_timeout, server_context

__all__ = ["SmtpReceiver"]

log = logging.getLogger("zoneq.receiver")

_CLOSE_GRACE_S: Final = 5.0  # how long close() lets sessions finish a commit in flight


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
        self._sessions: set[SmtpSession] = set()
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
        if admission.done() and not counted(admission):
            if admission.exception() is not None:
                await self._turn_away(link, "Service not available, queue unreachable", 3, 0)
            else:
                await self._turn_away(link, TOO_MANY, 7, 0)
            return
        session = SmtpSession(self, link, ip, admission, tls=tls)
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
        if counted(admission):
            self.sink.release(ip)

    async def _turn_away(self, link: Link, text: str, subject: int, detail: int) -> None:
        """421 instead of the greeting (RFC 5321 section 3.1), then close."""
        reply = goodbye(text, 4, subject, detail, self.hostname)
        with contextlib.suppress(ConnectionError):
            link.write(reply.to_wire())
            await link.drain()
        link.close()
