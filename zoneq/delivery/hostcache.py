"""The dead-host cache: addresses that recently refused or dropped connections.

A zone worker consults it before connecting to an MX address, so that a server that is down
is not hammered by every queued message in turn; the delivery loop skips a dead address and
tries the next host of the ``MxResult``.

Theory of operation
-------------------
``mark_dead(ip)`` makes an address dead for a backoff period: ``base`` seconds the first
time, doubling with each further failure, never more than ``cap``.  The period runs out on
its own; nothing has to revive the address.  (ZoneMTA's equivalent cache only forgot a dead
host on restart, its issue #182.)  After the period ends the next delivery attempt is let
through as a probe; ``mark_alive(ip)`` after a successful connection forgets the address.

Failures reported while the address is already dead do not lengthen the period: they are
connections that started before the first failure was recorded (many run concurrently), not
new evidence, and counting them would send the backoff to its cap after one outage.

The failure count is kept past the end of the dead period, so a probe that fails again backs
off further, and is dropped ``cap`` seconds after the period ends: a host that then fails
again starts from ``base``.  Time comes only from the injected ``clock`` (monotonic
seconds).  The cache is bounded: beyond ``max_entries`` the address marked longest ago is
forgotten, which errs on the side of trying it again.

Each entry keeps the text of the last failure (``why_dead``): a walk that finds every MX
address resting reports what was wrong with them, not only that they rest, or a bounce at
expiry would carry no cause (RFC 3464 section 2.3.6: the Diagnostic-Code is the actual
problem).

What it logs (info, logger ``zoneq.delivery``): each time an address is marked dead and
for how long, and the first time in each period that it is let through again after its
rest.  Both are once per address per period, never per job: during an outage every queued
message asks ``is_dead`` in turn, and a line each would bury the two that matter.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DeadHostCache"]

log = logging.getLogger("zoneq.delivery")


@dataclass(slots=True)
class _Dead:
    failures: int
    until: float
    period: float
    reason: str = ""  # the last failure's text, for the reports of skipped addresses
    retried: bool = False  # logged "trying again" for this period already


class DeadHostCache:
    """Remembers failing addresses for a capped, exponentially growing, self-expiring time."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        base: float = 60.0,
        cap: float = 3600.0,
        max_entries: int = 10_000,
    ) -> None:
        if base <= 0 or cap < base:
            raise ValueError(f"need 0 < base <= cap, not base={base} cap={cap}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, not {max_entries}")
        self._clock = clock
        self._base = base
        self._cap = cap
        self._max_entries = max_entries
        self._entries: OrderedDict[str, _Dead] = OrderedDict()

    @property
    def base(self) -> float:
        """The first dead period, in seconds."""
        return self._base

    def is_dead(self, ip: str) -> bool:
        """True while ``ip`` is inside a dead period.

        The delivery loop asks this right before it connects, so the first False after a
        period is the probe: that one is logged, once per period.
        """
        if self.dead_for(ip) > 0:
            return True
        entry = self._entries.get(_key(ip))
        if entry is not None and not entry.retried:
            entry.retried = True
            log.info(
                "MX address %s: trying again after %g s dead (failure %d)",
                ip,
                entry.period,
                entry.failures,
            )
        return False

    def resting(self) -> int:
        """How many addresses are inside a dead period now."""
        now = self._clock()
        return sum(1 for entry in self._entries.values() if now < entry.until)

    def dead_for(self, ip: str) -> float:
        """Seconds until ``ip`` may be tried again; 0 if it may be tried now."""
        key = _key(ip)
        entry = self._entries.get(key)
        if entry is None:
            return 0.0
        now = self._clock()
        if now >= entry.until + self._cap:
            # Long past its dead period: forget the failure count too.
            del self._entries[key]
            return 0.0
        return max(0.0, entry.until - now)

    def why_dead(self, ip: str) -> str | None:
        """The last failure's text while ``ip`` is inside a dead period; None if it is not."""
        if self.dead_for(ip) <= 0:
            return None
        return self._entries[_key(ip)].reason

    def mark_dead(self, ip: str, reason: str = "") -> float:
        """Record a failed connection to ``ip`` (``reason``: what went wrong, for reports);
        returns the seconds it is now dead for."""
        key = _key(ip)
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None and now < entry.until:
            # Already dead: a connection that was under way when it died.  Not new evidence
            # for the period, but its text is the latest word on the host.
            entry.reason = reason or entry.reason
            return entry.until - now
        failures = 1
        if entry is not None and now < entry.until + self._cap:
            failures = entry.failures + 1
        # The exponent is bounded so the float cannot overflow after many failures.
        period = min(self._base * 2.0 ** min(failures - 1, 64), self._cap)
        self._entries[key] = _Dead(failures, now + period, period, reason)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        log.info("MX address %s marked dead for %g s (failure %d)", ip, period, failures)
        return period

    def mark_alive(self, ip: str) -> None:
        """A connection to ``ip`` succeeded: forget its failures."""
        if self._entries.pop(_key(ip), None) is not None:
            log.info("MX address %s is alive again", ip)

    def __len__(self) -> int:
        return len(self._entries)


def _key(ip: str) -> str:
    """The canonical text of an address, so "::0001" and "::1" are one host.

    Raises ValueError for text that is not an IP address: the cache is keyed by address,
    not by name, because one name can stand for several servers.
    """
    return ipaddress.ip_address(ip).compressed
