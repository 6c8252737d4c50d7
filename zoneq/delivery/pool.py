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

One ``SourcePool`` per worker process, shared by its delivery loops (one event loop, no
locks needed); the zone's processes each run their own, and each keeps the ratio, so
their sum does too.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from zoneq.config.zones import PoolAddress

__all__ = ["Source", "SourcePool"]


@dataclass(frozen=True, slots=True)
class Source:
    """Where a connection comes from: the local address to bind and the EHLO name to give."""

    address: str | None
    """None: the operating system chooses (a zone without a pool)."""
    helo_name: str


class SourcePool:
    """Smooth weighted round-robin over a zone's pool (see the module's docstring)."""

    __slots__ = ("_current", "_default", "_sources", "_weights")

    def __init__(self, pool: Sequence[PoolAddress], default_helo: str) -> None:
        self._sources = [Source(entry.address, entry.ehlo_name or default_helo) for entry in pool]
        self._weights = [entry.ratio for entry in pool]
        self._current = [0.0] * len(pool)
        self._default = Source(None, default_helo)

    def __len__(self) -> int:
        return len(self._sources)

    def choose(self, resting: Collection[str] = ()) -> Source:
        """The source for the next delivery, avoiding ``resting`` addresses where it can."""
        if not self._sources:
            return self._default
        candidates = [
            index for index, source in enumerate(self._sources) if source.address not in resting
        ] or range(len(self._sources))
        total = 0.0
        best = -1
        for index in candidates:
            self._current[index] += self._weights[index]
            total += self._weights[index]
            if best < 0 or self._current[index] > self._current[best]:
                best = index
        self._current[best] -= total
        return self._sources[best]
