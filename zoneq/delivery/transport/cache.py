"""SMTP connections between transactions, and the cache that keeps them for the next message.

See ``session.py`` for when a connection is kept and how a kept one is taken up again.

Slots (issue 5): the core counts open connections, idle ones included, against its limits
per destination domain and MX host, one *slot* per connection (``zoneq/queue/slots.py``),
and names each job's slot (``Job.slot``).  So a kept connection is kept *under* the slot
of the job it last served, and the cache keeps two promises the worker reports on:

* one slot, at most one connection: a job on slot S takes the connection kept under S if
  it goes where the job goes; if S's connection goes elsewhere, it is closed (QUIT, and
  waited for) before the job opens another;
* a slot whose connection is gone is reported free, once: a kept connection closed (idle
  too long, found dead, or the core asked, :meth:`ConnectionCache.close_slots`) or taken up
  by a job on another slot puts its slot in :meth:`ConnectionCache.released`, unless a job
  is on that slot now (the core counts it busy; the job's report settles it).  A close is
  counted only once the QUIT is done, so the core never lets a new connection open while
  the old one is still there.

Slot 0 means none (a core that does not send slots): connections are kept and reused as
before, and nothing is reported.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from zoneq.delivery.transport.channel import Channel


@dataclass(eq=False)
class Connection:
    """An SMTP session after EHLO (and STARTTLS): what was learnt, and where it stands."""

    channel: Channel
    extensions: dict[str, str]
    peer: str | None
    local: str | None
    tls: bool
    tls_fallback: str | None
    opened: float = 0.0
    messages: int = 0
    idle_since: float = 0.0
    # MAIL accepted and the end of data not answered: RSET before the next MAIL.
    open_transaction: bool = False
    slot: int = 0  # the core's connection slot it counts in (0: none)


# host, port, source address (IP pools: a connection is never reused from another address),
# TLS policy, TLS server name, HELO name, implicit TLS, AUTH user.
CacheKey = tuple[str, int, str | None, str, str, str, bool, str | None]


class ConnectionCache:
    """Idle SMTP connections by destination (Postfix's ``smtp_connection_cache``).

    A connection is kept at most ``idle_s`` seconds between messages (well inside the five
    minutes a server may wait for a command, RFC 5321 section 4.5.3.2.7), at most ``max_age_s``
    in all and for ``max_messages`` messages, and at most ``max_idle`` are kept.  Not safe
    across event loops; one per worker process.  Slots: see the module's docstring.
    """

    def __init__(
        self,
        *,
        idle_s: float = 5.0,
        max_age_s: float = 300.0,
        max_messages: int = 100,
        max_idle: int = 256,
        quit_timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._idle: dict[CacheKey, list[Connection]] = {}
        self._under: dict[int, tuple[CacheKey, Connection]] = {}  # slot -> its kept connection
        self._in_use: set[int] = set()  # slots a job is on now
        self._released: set[int] = set()
        # Set when a close has freed a slot: the worker tells the core at once, since a job
        # may be waiting for that slot (an idle timeout or a close the core asked for).
        self.urgent = asyncio.Event()
        self._idle_s = idle_s
        self._max_age_s = max_age_s
        self._max_messages = max_messages
        self._max_idle = max_idle
        self._quit_timeout = quit_timeout
        self._clock = clock
        self._closing: set[asyncio.Task[None]] = set()
        self.reused = 0

    def now(self) -> float:
        return self._clock()

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._idle.values())

    def _good(self, connection: Connection, now: float) -> bool:
        channel = connection.channel
        # Not quiet: the server sent something while the connection was kept, which the
        # next message would read as its replies (``Channel.quiet``).
        return channel.is_open and channel.quiet and now - connection.idle_since <= self._idle_s

    def _remove(self, key: CacheKey, connection: Connection) -> None:
        kept = self._idle.get(key)
        if kept is not None and connection in kept:
            kept.remove(connection)
            if not kept:
                del self._idle[key]
        if connection.slot and self._under.get(connection.slot, (key, None))[1] is connection:
            del self._under[connection.slot]

    def take(self, key: CacheKey) -> Connection | None:
        """The most recently used idle connection to ``key`` that is still good."""
        return self._pop(key, 0)

    def _pop(self, key: CacheKey, slot: int) -> Connection | None:
        """As :meth:`take`, for a job on ``slot``: the connection moves to that slot."""
        kept = self._idle.get(key)
        now = self._clock()
        while kept:
            connection = kept[-1]
            self._remove(key, connection)
            if self._good(connection, now):
                self.reused += 1
                self._move(connection, slot)
                return connection
            self._retire(connection)
            kept = self._idle.get(key)
        return None

    def _move(self, connection: Connection, slot: int) -> None:
        """``connection`` now serves ``slot``: the slot it was kept under is free."""
        old, connection.slot = connection.slot, slot
        if old != slot:
            self._free(old, urgent=False)

    async def adopt(self, key: CacheKey, slot: int) -> Connection | None:
        """A kept connection to ``key`` for a job on ``slot``: the one kept under ``slot``
        if it goes there, else the most recent to ``key``.  A connection kept under ``slot``
        that goes elsewhere is closed first (one connection per slot)."""
        own = self._under.get(slot) if slot else None
        if own is not None:
            own_key, connection = own
            self._remove(own_key, connection)
            if own_key == key and self._good(connection, self._clock()):
                self.reused += 1
                return connection
            connection.slot = 0  # the job on the slot settles it, not this close
            await self._quit(connection)
        return self._pop(key, slot)

    def put(self, key: CacheKey, connection: Connection, slot: int = 0) -> bool:
        """Keep ``connection`` (under ``slot``); False if it has served its time (the caller
        says QUIT)."""
        now = self._clock()
        if (
            connection.open_transaction
            or not connection.channel.is_open
            or not connection.channel.quiet  # a stray reply: see ``Channel.quiet``
            or connection.messages >= self._max_messages
            or now - connection.opened >= self._max_age_s
            or len(self) >= self._max_idle
        ):
            return False
        if slot:
            previous = self._under.get(slot)
            if previous is not None and previous[1] is not connection:
                self._remove(*previous)
                previous[1].slot = 0
                self._retire(previous[1])
            self._under[slot] = (key, connection)
        connection.slot = slot
        connection.idle_since = now
        self._idle.setdefault(key, []).append(connection)
        return True

    # --- slots ----------------------------------------------------------------------------

    def begin(self, slot: int) -> None:
        """A job on ``slot`` starts (its slot is busy at the core until it is reported)."""
        if slot:
            self._in_use.add(slot)

    def end(self, slot: int) -> bool:
        """The job on ``slot`` is over: is a connection kept under it (report it kept)?"""
        self._in_use.discard(slot)
        return bool(slot) and slot in self._under

    def close_slots(self, slots: Iterable[int]) -> None:
        """The core asks: close the connections kept under ``slots``.  Each is reported
        free once closed, even one already gone, so the core never waits on it."""
        for slot in slots:
            kept = self._under.get(slot)
            if kept is not None:
                self._remove(*kept)
                self._retire(kept[1])
            else:
                self._free(slot, urgent=True)

    def released(self) -> tuple[int, ...]:
        """The slots freed since the last call (for the next report's ``closed``)."""
        freed = tuple(sorted(self._released))
        self._released.clear()
        self.urgent.clear()
        return freed

    def _free(self, slot: int, *, urgent: bool) -> None:
        if not slot or slot in self._in_use or slot in self._under:
            return  # a job is on it, or another connection is kept under it
        self._released.add(slot)
        if urgent:
            self.urgent.set()

    # --- closing --------------------------------------------------------------------------

    def prune(self) -> int:
        """Say QUIT to connections idle too long (call now and then); how many."""
        now = self._clock()
        stale = [
            (key, connection)
            for key, kept in self._idle.items()
            for connection in kept
            if not self._good(connection, now)
        ]
        for key, connection in stale:
            self._remove(key, connection)
            self._retire(connection)
        return len(stale)

    def _retire(self, connection: Connection) -> None:
        task = asyncio.ensure_future(self._quit(connection))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _quit(self, connection: Connection) -> None:
        try:
            await connection.channel.quit(self._quit_timeout)
        finally:
            self._free(connection.slot, urgent=True)

    async def close(self) -> None:
        """QUIT every kept connection (at shutdown)."""
        for kept in self._idle.values():
            for connection in kept:
                self._retire(connection)
        self._idle.clear()
        self._under.clear()
        if self._closing:
            await asyncio.wait(list(self._closing), timeout=self._quit_timeout + 1)
