"""SMTP connections between transactions, and the cache that keeps them for the next message.

See ``session.py`` for when a connection is kept and how a kept one is taken up again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
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


# host, port, source address (IP pools: a connection is never reused from another address),
# TLS policy, TLS server name, HELO name, implicit TLS, AUTH user.
CacheKey = tuple[str, int, str | None, str, str, str, bool, str | None]


class ConnectionCache:
    """Idle SMTP connections by destination (Postfix's ``smtp_connection_cache``).

    A connection is kept at most ``idle_s`` seconds between messages (well inside the five
    minutes a server may wait for a command, RFC 5321 section 4.5.3.2.7), at most ``max_age_s``
    in all and for ``max_messages`` messages, and at most ``max_idle`` are kept.  Not safe
    across event loops; one per worker process.
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

    def take(self, key: CacheKey) -> Connection | None:
        """The most recently used idle connection to ``key`` that is still good."""
        kept = self._idle.get(key)
        now = self._clock()
        while kept:
            connection = kept.pop()
            if not kept:
                del self._idle[key]
            if connection.channel.is_open and now - connection.idle_since <= self._idle_s:
                self.reused += 1
                return connection
            self._retire(connection)
            kept = self._idle.get(key)
        return None

    def put(self, key: CacheKey, connection: Connection) -> bool:
        """Keep ``connection``; False if it has served its time (the caller says QUIT)."""
        now = self._clock()
        if (
            connection.open_transaction
            or not connection.channel.is_open
            or connection.messages >= self._max_messages
            or now - connection.opened >= self._max_age_s
            or len(self) >= self._max_idle
        ):
            return False
        connection.idle_since = now
        self._idle.setdefault(key, []).append(connection)
        return True

    def prune(self) -> int:
        """Say QUIT to connections idle too long (call now and then); how many."""
        now = self._clock()
        stale = 0
        for key in list(self._idle):
            keep = []
            for connection in self._idle[key]:
                if now - connection.idle_since > self._idle_s or not connection.channel.is_open:
                    self._retire(connection)
                    stale += 1
                else:
                    keep.append(connection)
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        return stale

    def _retire(self, connection: Connection) -> None:
        task = asyncio.ensure_future(self._quit(connection))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _quit(self, connection: Connection) -> None:
        await connection.channel.quit(self._quit_timeout)

    async def close(self) -> None:
        """QUIT every kept connection (at shutdown)."""
        for kept in self._idle.values():
            for connection in kept:
                self._retire(connection)
        self._idle.clear()
        if self._closing:
            await asyncio.wait(list(self._closing), timeout=self._quit_timeout + 1)
