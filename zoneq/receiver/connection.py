"""One client connection as an SMTP session reads and writes it: a small ``asyncio.Protocol``.

Why not ``asyncio.start_server``'s streams: a session that does not pipeline (Postfix's
smtp-source, most bulk senders) costs seven reads per message, and every ``StreamReader``
read goes through ``feed_data`` into a buffer, a waiter future, a copy out of the buffer
and ``_maybe_resume_transport``, with ``StreamReaderProtocol`` and ``StreamWriter`` in
between.  ``Link`` hands the bytes the transport delivered straight to the waiting
session (no copy when it is waiting, which is the common case), and writes go to the
transport itself.  What the streams gave that a session needs is kept:

* Backpressure from a slow session (RFC 5321 leaves flow control to TCP): bytes the
  session has not asked for yet are held, and past ``HIGH_WATER`` octets the transport
  stops reading until the session catches up, as ``StreamReader``'s limit did (twice its
  64 KiB default).  So a client sending faster than the queue writes is held back by TCP.
* Backpressure from a slow client: ``drain`` waits while the transport's write buffer is
  over its high-water mark (``pause_writing`` / ``resume_writing``).
* STARTTLS (RFC 3207) and implicit TLS (RFC 8314): ``start_tls`` upgrades the transport in
  place, ``discard_buffered`` drops pipelined plaintext first (``tls.py`` says why).
* A peer that half-closes: EOF is kept (the transport stays open for our last replies,
  as ``StreamReaderProtocol`` does for plain TCP) and ``read`` returns ``b""``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, Final, cast

__all__ = ["HIGH_WATER", "Link", "LinkFactory"]

HIGH_WATER: Final = 131_072
"""Unread octets held before the transport stops reading (``StreamReader``'s 2 x 64 KiB)."""


class Link(asyncio.Protocol):
    """A connection's protocol; ``on_connect`` runs as the connection's task (the session).

    ``read`` returns whatever arrived since the last read (``b""`` at EOF); one reader at
    a time.  ``write`` queues on the transport; ``drain`` waits while that queue is full.
    """

    transport: asyncio.Transport
    task: asyncio.Task[None] | None = None

    def __init__(self, on_connect: Callable[[Link], Coroutine[Any, Any, None]]) -> None:
        self._on_connect = on_connect
        self._held: list[bytes] = []  # arrived, not read yet
        self._held_size = 0
        self._waiter: asyncio.Future[bytes] | None = None  # a read waiting for bytes
        self._eof = False
        self._error: BaseException | None = None  # the connection was lost with this
        self._reading_paused = False
        self._writing_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._lost = False
        self._closed: asyncio.Future[None] | None = None
        self._over_tls = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
        self.transport = cast(asyncio.Transport, transport)
        # Kept for every read: ``asyncio.get_running_loop`` is a getpid system call.
        self._loop = loop = asyncio.get_running_loop()
        # Created here, as StreamReaderProtocol does.  asyncio runs the task's first step
        # before it first reads the socket, uvloop may not: start_tls copes (tls.py).
        self.task = loop.create_task(self._on_connect(self))

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if waiter is not None and not self._held:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(data)  # the common case: handed over whole, no copy
                return
        self._held.append(data)
        self._held_size += len(data)
        if self._held_size > HIGH_WATER and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        # Keep a plain TCP connection half-open for the replies still due; over TLS the
        # transport must close (asyncio's SSL layer does not support half-close).
        return not self._over_tls

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._eof = True
        if exc is not None:
            self._error = exc
        self._wake()
        drain = self._drain_waiter
        if drain is not None and not drain.done():
            drain.set_exception(ConnectionResetError("Connection lost"))
        self._drain_waiter = None
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        drain = self._drain_waiter
        self._drain_waiter = None
        if drain is not None and not drain.done():
            drain.set_result(None)

    # --- reading -----------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(b"")  # read() looks at what is held, EOF or the error

    async def read(self) -> bytes:
        """The bytes that arrived since the last read, at least one; ``b""`` at EOF.
        Raises the error the connection was lost with, once what arrived is read."""
        while True:
            if self._held:
                return self._take()
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            loop = self._loop or asyncio.get_running_loop()
            waiter: asyncio.Future[bytes] = loop.create_future()
            self._waiter = waiter
            try:
                data = await waiter
            finally:
                self._waiter = None
            if data:
                return data

    def _take(self) -> bytes:
        held = self._held
        data = held[0] if len(held) == 1 else b"".join(held)
        held.clear()
        self._held_size = 0
        if self._reading_paused and not self._lost:
            self._reading_paused = False
            self.transport.resume_reading()
        return data

    def _take_all(self) -> bytes:
        """What is held, without resuming reading (``_take`` does).  Only before a TLS
        upgrade, whose ``start_tls`` resumes the transport: the pause is forgotten with the
        bytes, or reading would never be paused again once the link is over TLS."""
        data = b"".join(self._held)
        self._held.clear()
        self._held_size = 0
        self._reading_paused = False
        return data

    def discard_buffered(self) -> int:
        """Drop the bytes held unread (pipelined after STARTTLS); returns how many.  The
        TLS upgrade that follows resumes the transport (``_take_all`` says why the pause
        is forgotten here)."""
        return len(self._take_all())

    # --- writing -----------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Queue ``data`` for the client.  A write after the client reset the connection
        is a lost client, as a read or a drain then says (``ConnectionResetError``, which
        a session's end expects): asyncio's transport drops the bytes, but uvloop's raises
        RuntimeError ("the handler is closed"), which would escape the session and be
        logged as a fault of ours ("Task exception was never retrieved")."""
        try:
            self.transport.write(data)
        except RuntimeError as exc:
            raise ConnectionResetError(f"Connection lost: {exc}") from None

    def write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size()

    async def drain(self) -> None:
        """Wait while the transport's write buffer is over its high-water mark; raises
        ``ConnectionResetError`` if the connection is gone."""
        if self._lost:
            raise ConnectionResetError("Connection lost")
        if not self._writing_paused:
            return
        waiter = self._drain_waiter
        if waiter is None:
            waiter = self._drain_waiter = asyncio.get_running_loop().create_future()
        await waiter

    # --- the connection ----------------------------------------------------------------

    def get_extra_info(self, name: str) -> Any:
        return self.transport.get_extra_info(name)

    def peer_ip(self) -> str:
        peer = self.transport.get_extra_info("peername")
        return str(peer[0]) if isinstance(peer, tuple) and peer else ""

    async def start_tls(self, context: ssl.SSLContext, *, timeout_s: float) -> None:
        """The server side of a TLS handshake on this connection, within ``timeout_s``;
        then reads and writes go through TLS.  Raises what the handshake raised.

        Bytes this link holds unread when it starts are the client's first TLS records,
        and go to the TLS layer before anything read later.  They can only be: STARTTLS
        drops what it held before coming here (``tls.py``), and on the implicit-TLS
        listener the ClientHello may have been read before the session's first step
        (uvloop reads a new connection before the task ``connection_made`` created has
        run, and starts reading after ``connection_made`` whatever it asked).
        """
        loop = asyncio.get_running_loop()
        # Nothing more is read into this link: what arrives from here on is the TLS
        # layer's to read, once start_tls resumes reading.
        self.transport.pause_reading()
        early = self._take_all()
        upgrade = loop.create_task(
            loop.start_tls(
                self.transport, self, context, server_side=True, ssl_handshake_timeout=timeout_s
            )
        )
        try:
            if early:
                # start_tls's first step (before ours: its task was scheduled first) puts
                # its TLS protocol on the transport and schedules that protocol's
                # connection_made and the resume of reading; the early bytes go right
                # behind them, in the same turn of the loop, before the socket is read again.
                await asyncio.sleep(0)
                protocol = self.transport.get_protocol()
                if protocol is self and not upgrade.done():  # not the order assumed here
                    raise RuntimeError("start_tls did not take over the connection")
                if not upgrade.done():
                    loop.call_soon(_feed, protocol, early)
            transport = await upgrade
        except BaseException:
            upgrade.cancel()  # cancelled (the server is closing) or failed: no orphan
            raise
        if transport is None:  # the connection closed during the handshake
            raise ConnectionResetError("Connection lost during the TLS handshake")
        self.transport = transport
        self._over_tls = True

    def close(self) -> None:
        self.transport.close()

    async def wait_closed(self, *, timeout_s: float | None = None) -> None:
        """Until the connection is closed, or for ``timeout_s`` at most (a client that
        does not read what is still queued for it keeps a closing transport open); once
        that time is out, the wait is over for every caller.

        The time limit is a timer on the future, not ``asyncio.wait_for``: that wraps the
        wait in a task of its own, which with one message per connection (Postfix's
        smtp-source) was about 2% of the core's CPU per accepted message."""
        if self._lost:
            return
        closed = self._closed
        if closed is None:
            closed = self._closed = asyncio.get_running_loop().create_future()
        if timeout_s is None:
            await closed
            return
        timer = closed.get_loop().call_later(timeout_s, _settle, closed)
        try:
            await closed
        finally:
            timer.cancel()


def _feed(protocol: asyncio.BaseProtocol, data: bytes) -> None:
    """Hand ``data`` to ``protocol`` as if the transport had just read it (asyncio's and
    uvloop's TLS protocols are buffered protocols: ``get_buffer`` / ``buffer_updated``)."""
    if hasattr(protocol, "get_buffer"):
        buffered = cast(asyncio.BufferedProtocol, protocol)
        view = memoryview(data)
        while view:
            buffer = memoryview(buffered.get_buffer(len(view)))
            size = min(len(buffer), len(view))
            buffer[:size] = view[:size]
            buffered.buffer_updated(size)
            view = view[size:]
    else:
        cast(asyncio.Protocol, protocol).data_received(data)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


LinkFactory = Callable[[], Link]
