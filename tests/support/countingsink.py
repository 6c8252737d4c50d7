"""An SMTP sink that records when each connection and each transaction was open, so a test
can count how many a remote MX had at once (Postfix's smtp-sink cannot tell).

It is the project's :class:`FaultServer` (the same SMTP: greeting, EHLO with PIPELINING,
MAIL, RCPT, DATA, RSET, QUIT, and ``Faults.end_delay`` to answer the final dot slowly, so
that concurrency shows), run on an event loop in a thread of its own, so that a synchronous
test can drive a real ``zoneq serve`` meanwhile.  ``running_counting_sink(host, end_delay)``
starts it on ``host`` and a free port and stops it afterwards.

Times are ``time.monotonic()`` readings.  A *connection* spans from accept to close; a
*transaction* from the DATA command to the reply to its final dot (with PIPELINING, MAIL,
RCPT and DATA arrive in one write, RFC 2920 section 3.1, so DATA is when the transaction
reaches the server as a whole).  :func:`peak` counts spans open at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tests.support.faultserver import Faults, FaultServer, Send, Session

START_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class Span:
    """An interval of time something was open at the sink; ``end`` is inf while open."""

    start: float
    end: float


@dataclass(frozen=True)
class Transaction:
    """One transaction answered at the sink: when, and for which recipients."""

    span: Span
    recipients: tuple[str, ...]


def peak(spans: Iterable[Span], since: float = float("-inf")) -> int:
    """The most spans open at the same instant at or after ``since``.

    A span that ends at the instant another starts is not counted with it: the sink answered
    one transaction before it took the next.
    """
    events = []
    for span in spans:
        if span.end <= since:
            continue
        events.append((max(span.start, since), 1))
        events.append((span.end, -1))
    events.sort()  # at equal times -1 sorts first: an end before a start
    open_now = most = 0
    for _, step in events:
        open_now += step
        most = max(most, open_now)
    return most


def timeline(spans: list[Span], begin: float, step: float) -> list[int]:
    """The peak in each ``step``-long slot from ``begin`` to the last end (for reports)."""
    last = max((span.end for span in spans), default=begin)
    slots = []
    slot = begin
    while slot < last:
        inside = [
            Span(max(s.start, slot), min(s.end, slot + step))
            for s in spans
            if s.start < slot + step and s.end > slot
        ]
        slots.append(peak(inside))
        slot += step
    return slots


class CountingServer(FaultServer):
    """A :class:`FaultServer` that timestamps connections and transactions."""

    def __init__(self, faults: Faults, host: str) -> None:
        super().__init__(faults)
        self.host = host
        self.connections: list[Span] = []
        self.transactions: list[Transaction] = []
        self._opened: dict[int, float] = {}  # id(task) -> start, while the connection is open

    def open_connections(self) -> list[Span]:
        """Every connection so far; those still open end at ``inf``."""
        return self.connections + [Span(t, float("inf")) for t in list(self._opened.values())]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        key = id(asyncio.current_task())
        self._opened[key] = time.monotonic()
        try:
            await super()._handle(reader, writer)
        finally:
            self.connections.append(Span(self._opened.pop(key), time.monotonic()))

    async def _data(self, reader: asyncio.StreamReader, session: Session, send: Send) -> bool:
        begun = time.monotonic()
        keep_going = await super()._data(reader, session, send)
        ended = time.monotonic()
        if self.faults.end_reply.startswith(b"250"):
            self.transactions.append(Transaction(Span(begun, ended), _recipients(session)))
        return keep_going


def _recipients(session: Session) -> tuple[str, ...]:
    """The RCPT TO addresses of the session's last transaction (since its last MAIL)."""
    found: list[str] = []
    for line in reversed(session.commands):
        verb = line[:4].upper()
        if verb == b"MAIL":
            break
        if verb == b"RCPT":
            address = line.partition(b":")[2].strip().split(b" ", 1)[0]
            found.append(address.strip(b"<>").decode())
    return tuple(reversed(found))


@contextlib.contextmanager
def running_counting_sink(host: str, end_delay: float = 0.0) -> Iterator[CountingServer]:
    """A :class:`CountingServer` on ``host`` and a free port, in a thread; stopped after."""
    server = CountingServer(Faults(end_delay=end_delay, keep_payloads=False), host)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="counting-sink", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.__aenter__(), loop).result(START_TIMEOUT)
        try:
            yield server
        finally:
            stopping = server.__aexit__(None, None, None)
            asyncio.run_coroutine_threadsafe(stopping, loop).result(STOP_TIMEOUT)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_TIMEOUT)
        if not thread.is_alive():
            loop.close()
