"""A zone's source addresses: which one the next delivery binds, by ratio.

Theory of operation
-------------------
Smooth weighted round-robin (nginx's upstream balancer, 2012): every address has a weight
(its ``ratio``) and a running score.  Each pick adds every candidate's weight to its score,
takes the highest score, and takes the candidates' total weight off the winner.  Over any
run of ``total`` picks each address is chosen exactly ``weight`` times (for integer
weights), and the picks are interleaved rather than bunched: weights 3 and 1 give
A A B A, A A B A, ...; a provider sees a steady mix from each address rather than bursts,
which is what IP warm-up asks for.  It is deterministic, so the ratio holds within one
pick over any window, not only "on average" as a random choice would.

Addresses the core says are *resting* for the destination domain (a reply said they are
blocked or listed there: ``zoneq/queue/feedback.py``) are left out of the pick; the
others share their turns.  When every address of the pool is resting, the whole pool is
used again: the rest is advice on which address to prefer, and holding the mail back
would only move the same question to the next retry.

Addresses that could not be bound (they left the host after start: EADDRNOTAVAIL) are
left out of the pick for a while (``rest_unbindable``, by the worker's own clock), so that
the loops do not each lose a try on them at their full ratio; their turns go to the
others.  This rest is harder than the core's: an address of the pool that is neither
resting nor unbindable is preferred to a resting one that binds, and only when every
address of the family is unbindable are they all tried again (one may be back).  A walk
that met the failure passes the address in ``exclude`` to pick another at once.

Address families
----------------
A connection can only bind a source address of the family of the address it connects to
(an IPv4 source cannot reach an IPv6 MX address).  ``families`` says which the pool has,
and ``choose(family=...)`` picks among that family's addresses only, with the same ratio
among them; the MX walk (``attempt.py``) tries only the MX addresses whose family the pool
has, so a pool of IPv4 addresses means IPv6 is off for the zone whatever its ``ipv6`` key
says.  A zone without a pool lets the system pick, for either family.

One ``SourcePool`` per worker process, shared by its delivery loops (one event loop, no
locks needed); the zone's processes each run their own, and each keeps the ratio, so
their sum does too.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from zoneq.config.zones import PoolAddress

__all__ = ["Source", "SourcePool", "bind_failure", "family_of"]


def family_of(address: str) -> int | None:
    """4 or 6 for an IP address text; None for a host name (a smarthost given by name)."""
    try:
        return ipaddress.ip_address(address).version
    except ValueError:
        return None


def bind_failure(address: str) -> str | None:
    """Why ``address`` cannot be bound on this host now, or None if it can.

    Port 0 takes no port anyone could notice; the kernel refuses an address that is no
    longer on an interface (EADDRNOTAVAIL).  Asked only after a connection failed, to
    tell a local fault (do not blame the remote host) from a remote one."""
    family = socket.AF_INET6 if family_of(address) == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


@dataclass(frozen=True, slots=True)
class Source:
    """Where a connection comes from: the local address to bind and the EHLO name to give."""

    address: str | None
    """None: the operating system chooses (a zone without a pool)."""
    helo_name: str


class SourcePool:
    """Smooth weighted round-robin over a zone's pool (see the module's docstring)."""

    __slots__ = (
        "_clock",
        "_current",
        "_default",
        "_families",
        "_sources",
        "_unbindable_until",
        "_weights",
    )

    def __init__(
        self,
        pool: Sequence[PoolAddress],
        default_helo: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sources = [Source(entry.address, entry.ehlo_name or default_helo) for entry in pool]
        self._weights = [entry.ratio for entry in pool]
        self._current = [0.0] * len(pool)
        self._default = Source(None, default_helo)
        self._families = [family_of(entry.address) for entry in pool]
        self._clock = clock
        # Address -> the ``clock`` time its rest after a failed bind ends; only the pool's
        # own addresses are ever keys, so it stays as small as the pool.
        self._unbindable_until: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._sources)

    @property
    def families(self) -> frozenset[int] | None:
        """The IP versions (4, 6) the pool has addresses of; None: no pool, any family."""
        return frozenset(f for f in self._families if f is not None) if self._sources else None

    def rest_unbindable(self, address: str, seconds: float) -> None:
        """``address`` could not be bound: leave it out of the picks for ``seconds``."""
        self._unbindable_until[address] = self._clock() + seconds

    def choose(
        self,
        resting: Collection[str] = (),
        family: int | None = None,
        exclude: Collection[str] = (),
    ) -> Source:
        """The source for the next delivery, avoiding ``resting`` and unbindable addresses
        where it can, and never one in ``exclude``; ``family`` (4 or 6): only among the
        pool's addresses of that IP version.

        Raises ``LookupError`` when the pool has no address of ``family`` outside
        ``exclude`` (the caller asks only for families in ``families``)."""
        if not self._sources:
            return self._default
        usable = [
            i
            for i, f in enumerate(self._families)
            if (family is None or f == family) and self._sources[i].address not in exclude
        ]
        if not usable:
            raise LookupError(f"the pool has no IPv{family} address left to use")
        now = self._clock()
        bindable = [i for i in usable if not self._unbindable(i, now)] or usable
        candidates = [i for i in bindable if self._sources[i].address not in resting] or bindable
        total = 0.0
        best = -1
        for index in candidates:
            self._current[index] += self._weights[index]
            total += self._weights[index]
            if best < 0 or self._current[index] > self._current[best]:
                best = index
        self._current[best] -= total
        return self._sources[best]

    def _unbindable(self, index: int, now: float) -> bool:
        address = self._sources[index].address
        return address is not None and now < self._unbindable_until.get(address, now)
