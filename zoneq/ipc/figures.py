"""Figures the zone workers report to the core, kept for ``/metrics``.

Theory of operation
-------------------
Each worker process keeps state the core cannot see, such as its dead-host cache
(``zoneq.delivery.hostcache``).  A worker tells the core the figure with its reports
(``Report.dead_hosts``, ``messages.py``) whenever it changes; ``QueueHandler`` records the
latest value per connection here and forgets it when the connection ends, so a worker that
died or was restarted stops counting at once (its replacement starts again from nothing, as
its cache does).  ``dead_hosts`` sums the latest values over each zone's connected workers:
that is what a Prometheus gauge per zone should show.  One worker's addresses are not
merged with another's: two workers of a zone that both rest the same address count it
twice, as each of them skips it.

Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["WorkerFigures"]


class WorkerFigures:
    """The latest figures per worker connection, summed per zone on demand."""

    __slots__ = ("_dead_hosts", "_zones")

    def __init__(self, zones: Iterable[str] = ()) -> None:
        # Zones shown even before any of their workers has said anything: a gauge that
        # appears only once it is non-zero cannot be told apart from a missing scrape.
        self._zones = tuple(zones)
        self._dead_hosts: dict[str, tuple[str, int]] = {}  # owner -> (zone, count)

    def dead_hosts_of(self, owner: str, zone: str, count: int) -> None:
        """The worker on connection ``owner`` (of ``zone``) rests ``count`` addresses now."""
        if count < 0:
            raise ValueError(f"a count of dead hosts cannot be negative, not {count}")
        self._dead_hosts[owner] = (zone, count)

    def forget(self, owner: str) -> None:
        """The connection ended: its worker's figures no longer count."""
        self._dead_hosts.pop(owner, None)

    def dead_hosts(self) -> dict[str, int]:
        """Dead MX addresses per zone, summed over the zone's connected workers."""
        totals = dict.fromkeys(self._zones, 0)
        for zone, count in self._dead_hosts.values():
            totals[zone] = totals.get(zone, 0) + count
        return totals
