"""The SMTP connection once the session is set up: our own writes, our own reply reading.

aiosmtplib sets the session up (connect, greeting, EHLO, STARTTLS: ``dialogue.py``) and is
then left behind: :class:`Channel` becomes the transport's protocol (``set_protocol``) and
carries the mail transactions.  The reason is PIPELINING (RFC 2920): aiosmtplib's protocol
keeps one reply at a time and drops bytes that arrive while it is not waiting for a reply, or
while a parsed reply waits to be picked up, and it does not look in its buffer for a second
reply that came in the same packet.  A pipelined group gets several replies at once, so the
channel keeps every byte: :class:`~zoneq.delivery.transport.replies.ReplyReader` cuts them into
replies, which wait in order until :meth:`Channel.read` takes them.  Replies are therefore
never lost between a write and a read, whatever the scheduling.

Each :meth:`read` has its own deadline: RFC 5321 section 4.5.3.2 sets a timeout per reply, and
with pipelining each reply still gets its own (counted from when it is asked for, that is once
the reply before it has arrived).  A reply that arrived before the connection closed is still
returned; only then does :meth:`read` report the loss.
"""

from __future__ import annotations

import asyncio
from collections import deque

from zoneq.delivery.transport.replies import ReplyReader
from zoneq.errors import ProtocolError
from zoneq.protocol.replies import Reply


class ChannelClosed(ConnectionError):
    """The connection is gone (closed by either end, reset, or a reply was unusable)."""


class ChannelTimeout(TimeoutError):
    """No reply within the deadline, or a write that made no progress within it."""


class Channel(asyncio.Protocol):
    """An SMTP connection between commands: write lines, read replies in order."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._reader = ReplyReader()
        self._replies: deque[Reply] = deque()
        self._failure: str | None = None  # why no further reply will come
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._drain: asyncio.Future[None] | None = None
        transport.set_protocol(self)

    @property
    def transport(self) -> asyncio.Transport:
        return self._transport

    @property
    def is_open(self) -> bool:
        return self._failure is None and not self._transport.is_closing()

    @property
    def quiet(self) -> bool:
        """Has every byte the server sent been read as the reply to a command of ours?

        A reply nobody asked for (a second 250 to the final dot, or text sent while idle)
        would be read as the answer to the next command, and every reply after it one step
        late: a recipient settled by another's reply (RFC 5321 section 4.2: replies answer
        commands in order).  A channel that is not quiet carries no further transaction.
        """
        return not self._replies and not self._reader.pending

    # --- asyncio.Protocol ----------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        try:
            replies = self._reader.feed(data)
        except ProtocolError as exc:
            self._fail(f"unusable reply: {exc}")
            self._transport.abort()
            return
        if replies:
            self._replies.extend(replies)
            self._wake()
        if self._reader.failed is not None:  # garbage after those replies
            self._fail(f"unusable reply: {self._reader.failed}")
            self._transport.abort()

    def eof_received(self) -> bool:
        self._fail("connection closed by the server")
        return False  # close our end too

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(f"connection lost: {exc}" if exc else "connection closed")
        self._paused = False
        self._wake_drain()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drain()

    # --- used by the session -------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self.is_open:
            raise ChannelClosed(self._failure or "connection closed")
        self._transport.write(data)

    async def drain(self, timeout: float) -> None:
        """Wait until the transport's buffer is below its high-water mark (flow control)."""
        if not self._paused:
            if self._failure is not None:
                raise ChannelClosed(self._failure)
            return
        self._drain = self._loop.create_future()
        await self._wait(self._drain, timeout, f"sending stalled for {timeout:g} s")
        if self._failure is not None:
            raise ChannelClosed(self._failure)

    async def read(self, timeout: float) -> Reply:
        """The next reply, waiting at most ``timeout`` seconds for it."""
        if not self._replies:
            if self._failure is None:
                self._waiter = self._loop.create_future()
                await self._wait(self._waiter, timeout, f"no reply within {timeout:g} s")
            if not self._replies:
                raise ChannelClosed(self._failure or "connection closed")
        return self._replies.popleft()

    async def quit(self, timeout: float) -> None:
        """Say QUIT (RFC 5321 section 4.1.1.10) and close, whatever the answer."""
        try:
            self.write(b"QUIT\r\n")
            await self.read(timeout)
        except (ChannelClosed, ChannelTimeout):
            pass
        self.close()

    def close(self) -> None:
        self._fail("closed by us")
        self._transport.close()

    def abort(self) -> None:
        self._fail("closed by us")
        self._transport.abort()

    # --- internals -----------------------------------------------------------------------

    async def _wait(self, future: asyncio.Future[None], timeout: float, why: str) -> None:
        # A timer on the future rather than asyncio.wait_for: no task per reply.
        timer = self._loop.call_later(timeout, _expire, future, why)
        try:
            await future
        finally:
            timer.cancel()

    def _fail(self, why: str) -> None:
        if self._failure is None:
            self._failure = why
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_drain(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)


def _expire(future: asyncio.Future[None], why: str) -> None:
    if not future.done():
        future.set_exception(ChannelTimeout(why))
