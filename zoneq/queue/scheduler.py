"""Scheduling decisions for one zone: pure, synchronous, time passed in.

Theory of operation
-------------------
The core leases a *window* of ready recipients from the store (oldest message first) and
turns it into *jobs*: one job is one SMTP transaction, the recipients of one message for one
destination domain, at most ``max_recipients`` of them (Postfix's default is 50).  Jobs are
handed to zone workers in the order of their oldest recipient, subject to two limits that
hold for the zone as a whole, because the core enforces them centrally (ZoneMTA throttled
per connection, which its users found useless):

* a connection limit per destination domain (and per MX host): a connection of the zone's
  workers, with a job on it or kept idle for the next, holds one slot of its domain;
* a zone-wide rate (jobs per second, minute or hour), spread evenly with GCRA, the generic
  cell rate algorithm: each job moves a "theoretical arrival time" on by one interval, and
  a job may start only while that time is at most ``burst - 1`` intervals ahead of now.

A job whose domain is at its limit is skipped for now, not dropped: the next free slot of
that domain picks it up, while jobs for other domains go ahead of it.

Per-MX limits (issue 5) and what a slot is: ``slots.py``.  A slot is held while its
connection is open, idle ones kept for reuse included, so a job whose domain has no free
slot may still start on a connection the asking worker holds idle for that domain or its
MX host (``DomainSlots.reusable``): that worker is the one to get it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from zoneq.queue.slots import MAX_LEARNT, DomainSlots

T = TypeVar("T")

DEFAULT_MAX_RECIPIENTS = 50

__all__ = [
    "DEFAULT_MAX_RECIPIENTS",
    "MAX_LEARNT",
    "ZONE_BURST",
    "DomainSlots",
    "JobQueue",
    "Planned",
    "RateLimiter",
    "plan_jobs",
]

ZONE_BURST = 2
"""GCRA's tolerance for a zone's rate, in jobs: 2 lets a job start up to one interval early.

Not a burst in the usual sense: a job is never early by more than one interval, so two
start at once at most, and any window of ``n`` intervals holds at most ``n + 1`` jobs.
What it buys is the long-run rate.  With a tolerance of 1 (none), every job that starts
late (the worker woke a millisecond after its time, or was busy) pushes every later job
back by as much, and the zone falls short of its setting on a loaded host; one interval
of tolerance lets the next job make that time up.  (ITU-T I.371's cell delay variation
tolerance is the same idea.)"""


class RateLimiter:
    """GCRA: at most ``count`` per ``per_ms``, spread evenly; ``count`` 0 means no limit."""

    __slots__ = ("_interval", "_slack", "_tat")

    def __init__(self, count: int, per_ms: int, burst: int = 1) -> None:
        if count < 0 or per_ms <= 0 or burst < 1:
            raise ValueError("a rate needs count >= 0, per_ms > 0 and burst >= 1")
        self._interval = per_ms / count if count else 0.0
        self._slack = (burst - 1) * self._interval
        self._tat = 0.0

    @classmethod
    def zone(cls, limit: tuple[int, int] | None) -> RateLimiter:
        """A zone's limiter from its ``rate_limit`` (None: no limit), with ``ZONE_BURST``."""
        if limit is None:
            return cls(0, 1000)
        count, per_ms = limit
        return cls(count, per_ms, ZONE_BURST)

    @property
    def unlimited(self) -> bool:
        return self._interval == 0.0

    def wait_ms(self, now_ms: float) -> float:
        """How long until :meth:`take` would succeed (0: now)."""
        if self.unlimited:
            return 0.0
        return max(0.0, self._tat - self._slack - now_ms)

    def take(self, now_ms: float) -> bool:
        if self.unlimited:
            return True
        tat = max(self._tat, now_ms)
        if tat - now_ms > self._slack:
            return False
        self._tat = tat + self._interval
        return True


@dataclass(frozen=True, slots=True)
class Planned(Generic[T]):
    """One future SMTP transaction: recipients (leases) of one message for one domain."""

    msg_id: int
    domain: str
    items: tuple[T, ...]


def plan_jobs(
    items: Iterable[T],
    *,
    group: Callable[[T], tuple[int, str]],
    max_recipients: int = DEFAULT_MAX_RECIPIENTS,
) -> list[Planned[T]]:
    """Group ``items`` by ``group(item) = (msg_id, domain)`` into jobs of at most
    ``max_recipients``, in the order each group first appears (oldest first)."""
    groups: OrderedDict[tuple[int, str], list[T]] = OrderedDict()
    for item in items:
        groups.setdefault(group(item), []).append(item)
    jobs: list[Planned[T]] = []
    for (msg_id, domain), members in groups.items():
        for start in range(0, len(members), max_recipients):
            jobs.append(Planned(msg_id, domain, tuple(members[start : start + max_recipients])))
    return jobs


class JobQueue(Generic[T]):
    """Planned jobs waiting for a slot, oldest first; takes the first one allowed to start."""

    def __init__(self) -> None:
        self._jobs: deque[Planned[T]] = deque()

    def __len__(self) -> int:
        return len(self._jobs)

    def recipients(self) -> int:
        return sum(len(job.items) for job in self._jobs)

    def extend(self, jobs: Sequence[Planned[T]]) -> None:
        self._jobs.extend(jobs)

    def take(
        self, slots: DomainSlots, rate: RateLimiter, now_ms: float, owner: str = ""
    ) -> tuple[Planned[T], int] | None:
        """The oldest job ``owner`` may start now (a free slot of its domain, or one the
        owner holds idle that fits), if the zone's rate allows one; with its slot's id.

        The rate is checked first: a job not started for want of rate keeps its place.
        """
        if rate.wait_ms(now_ms) > 0:
            return None
        for index, job in enumerate(self._jobs):
            slot = slots.try_acquire(job.domain, owner)
            if slot is not None:
                if not rate.take(now_ms):  # not after wait_ms said 0; but never one too many
                    slots.put_back(slot)
                    return None
                del self._jobs[index]
                return job, slot
        return None

    def blocked_domains(self, slots: DomainSlots) -> set[str]:
        """Domains with jobs waiting here that no worker could start now."""
        return {job.domain for job in self._jobs if not slots.could_start(job.domain)}

    def remove(self, msg_id: int) -> list[Planned[T]]:
        """Take out the waiting jobs of one message (an administrator holds or drops it)."""
        gone = [job for job in self._jobs if job.msg_id == msg_id]
        if gone:
            self._jobs = deque(job for job in self._jobs if job.msg_id != msg_id)
        return gone

    def drain(self) -> list[Planned[T]]:
        jobs = list(self._jobs)
        self._jobs.clear()
        return jobs
