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

A message to many domains comes from the store in address order (its ready keys are zone,
message id, address), so one window (2,000) holds only window / domains recipients of each
domain.  Planned one window at a time, 10,000 recipients over 100 domains went out in 500
transactions of 20 where 200 of 50 fit.  Postfix's queue manager reads up to 20,000
recipients of a message and sorts them by destination before it fills transactions;
``Filling`` does the same over several refills (see its docstring for the bounds).

Per-MX limits (issue 5) and what a slot is: ``slots.py``.  A slot is held while its
connection is open, idle ones kept for reuse included, so a job whose domain has no free
slot may still start on a connection the asking worker holds idle for that domain or its
MX host (``DomainSlots.reusable``): that worker is the one to get it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
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
    "Filling",
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


CLOCK_TICK_MS = 1.0  # the resolution of the service's clock (wall_clock_ms)


class RateLimiter:
    """GCRA: at most ``count`` per ``per_ms``, spread evenly; ``count`` 0 means no limit."""

    __slots__ = ("_interval", "_slack", "_tat")

    def __init__(self, count: int, per_ms: int, burst: int = 1) -> None:
        if count < 0 or per_ms <= 0 or burst < 1:
            raise ValueError("a rate needs count >= 0, per_ms > 0 and burst >= 1")
        self._interval = per_ms / count if count else 0.0
        # The service's clock counts whole milliseconds: a rate above one per millisecond
        # needs a tolerance of at least one tick, or at most ``burst`` start per reading
        # and the zone is held to 1000 (or 2000) a second whatever it says.
        tick = CLOCK_TICK_MS if 0.0 < self._interval < CLOCK_TICK_MS else 0.0
        self._slack = max((burst - 1) * self._interval, tick)
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
        # The same difference as take's, so a refused take never sees a wait of 0.
        return max(0.0, (self._within(now_ms) - now_ms) - self._slack)

    def take(self, now_ms: float) -> bool:
        if self.unlimited:
            return True
        tat = max(self._within(now_ms), now_ms)
        if tat - now_ms > self._slack:
            return False
        self._tat = tat + self._interval
        return True

    def _within(self, now_ms: float) -> float:
        """The theoretical arrival time, no later than a clock that only moves forward can
        leave it: one interval past the tolerance.  The service's clock is the wall clock
        (due times are stored), and a step back (NTP, an operator) would otherwise hold
        the zone for as long as the step."""
        self._tat = min(self._tat, now_ms + self._slack + self._interval)
        return self._tat


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
    return Filling(group=group, max_recipients=max_recipients).plan(list(items), cut=False)


class Filling(Generic[T]):
    """Plans each refill's recipients into jobs, and keeps the jobs of a message that the
    refill's window cut short open, to be topped up from the next refills.

    A refill's scan that stopped at its window (``cut``) may have stopped inside a message:
    more of it may follow, in the next window.  That message's partial jobs (fewer than
    ``max_recipients``) stay here, open, and the next refill's recipients of the same
    message and domain fill them first; only for a message of which at least
    ``max_recipients`` have been read, a bulk one.  An open job goes out (``plan`` returns it):

    * when a refill reads past its message (the next message starts, or the scan was not
      cut: it read all that is ready, so nothing more of the message is coming now);
    * when more than ``limit`` recipients are open: the fullest jobs go first, so a message
      to more than ``limit / max_recipients`` domains still fills what it can;
    * when the caller has nothing else to hand out and can read nothing more (``flush``):
      the queue service does that in the same lease call when nothing more of the message
      is ready, and a one-recipient message is never held back at all; while a domain or
      MX limit (or a full window) keeps the rest of it from being read, the service holds
      the open jobs for a few seconds at most (``filling_wait_s``), so that they go out
      full rather than as a tail of small transactions.

    Only the last message a refill read can stay open: one message's recipients are
    contiguous in the store's key order, so a later message means the open one is whole.
    """

    def __init__(
        self,
        *,
        group: Callable[[T], tuple[int, str]],
        max_recipients: int = DEFAULT_MAX_RECIPIENTS,
        limit: int = 0,
    ) -> None:
        if max_recipients < 1 or limit < 0:
            raise ValueError("filling needs max_recipients >= 1 and limit >= 0")
        self._group = group
        self._max = max_recipients
        self._limit = limit
        self._open: dict[tuple[int, str], list[T]] = {}
        self._recipients = 0

    def __len__(self) -> int:
        """How many recipients wait in open jobs."""
        return self._recipients

    def plan(self, items: Sequence[T], *, cut: bool) -> list[Planned[T]]:
        """The jobs ready to go out after a refill read ``items`` (in the store's key order);
        ``cut``: the scan stopped at its window, so more of its last message may follow."""
        groups, self._open, self._recipients = self._open, {}, 0
        for item in items:
            groups.setdefault(self._group(item), []).append(item)
        filling = self._group(items[-1])[0] if cut and items else None
        read = sum(len(members) for key, members in groups.items() if key[0] == filling)
        if read < self._max:
            # Fewer than one job's worth read: no bulk message, and its jobs go at once.
            # (Windows end inside messages all the time; holding a small one would only
            # make the lease read another window before anything went out.)
            filling = None
        jobs: list[Planned[T]] = []
        # In the order each group first appeared, the open ones first: they hold the oldest
        # part of what was read (a scan after them goes on from where they stopped).
        for key in list(groups):
            members = groups[key]
            whole = len(members)
            if key[0] == filling:
                whole -= whole % self._max
                if whole < len(members):
                    self._open[key] = members[whole:]
                    self._recipients += len(members) - whole
            jobs.extend(self._split(key, members[:whole]))
        if self._recipients > self._limit:
            for key in sorted(self._open, key=lambda key: -len(self._open[key])):
                if self._recipients <= self._limit:
                    break
                jobs.extend(self._take(key))
        return jobs

    def flush(self) -> list[Planned[T]]:
        """Every open job, as it is."""
        return [job for key in list(self._open) for job in self._take(key)]

    def remove(self, msg_id: int) -> list[Planned[T]]:
        """The open jobs of one message (an administrator holds or drops it)."""
        return [job for key in list(self._open) if key[0] == msg_id for job in self._take(key)]

    def _take(self, key: tuple[int, str]) -> list[Planned[T]]:
        members = self._open.pop(key)
        self._recipients -= len(members)
        return self._split(key, members)

    def _split(self, key: tuple[int, str], members: list[T]) -> list[Planned[T]]:
        msg_id, domain = key
        return [
            Planned(msg_id, domain, tuple(members[start : start + self._max]))
            for start in range(0, len(members), self._max)
        ]


class JobQueue(Generic[T]):
    """Planned jobs waiting for a slot, oldest first; takes the first one allowed to start.

    Kept per domain, with a heap of each domain's oldest job: whether a job may start
    depends on its domain alone, so a look at a domain's oldest job answers for all its
    others.  A take then costs one look per domain that cannot start, not one per job
    waiting: with one busy domain and a full window (2,000 recipients) the scan of every
    job on every lease was most of the core's CPU under delivery load.
    """

    def __init__(self) -> None:
        self._domains: dict[str, deque[tuple[int, Planned[T]]]] = {}
        self._heads: list[tuple[int, str]] = []  # (its oldest job's number, domain): a heap
        self._numbers = itertools.count()
        self._jobs = 0
        self._recipients = 0

    def __len__(self) -> int:
        return self._jobs

    def recipients(self) -> int:
        return self._recipients

    def extend(self, jobs: Sequence[Planned[T]]) -> None:
        for job in jobs:
            number = next(self._numbers)
            waiting = self._domains.get(job.domain)
            if waiting is None:
                waiting = self._domains[job.domain] = deque()
                heapq.heappush(self._heads, (number, job.domain))
            waiting.append((number, job))
            self._jobs += 1
            self._recipients += len(job.items)

    def take(
        self, slots: DomainSlots, rate: RateLimiter, now_ms: float, owner: str = ""
    ) -> tuple[Planned[T], int] | None:
        """The oldest job ``owner`` may start now (a free slot of its domain, or one the
        owner holds idle that fits), if the zone's rate allows one; with its slot's id.

        The rate is checked first: a job not started for want of rate keeps its place.
        """
        if rate.wait_ms(now_ms) > 0:
            return None
        heads = self._heads
        passed: list[tuple[int, str]] = []
        taken: tuple[Planned[T], int] | None = None
        while heads:
            head = heapq.heappop(heads)
            slot = slots.try_acquire(head[1], owner)
            if slot is None:
                passed.append(head)
                continue
            if not rate.take(now_ms):  # not after wait_ms said 0; but never one too many
                slots.put_back(slot)
                passed.append(head)
                break
            taken = self._pop(head[1]), slot
            break
        for head in passed:
            heapq.heappush(heads, head)
        return taken

    def _pop(self, domain: str) -> Planned[T]:
        """Take ``domain``'s oldest job (its heap entry already popped)."""
        waiting = self._domains[domain]
        _, job = waiting.popleft()
        if waiting:
            heapq.heappush(self._heads, (waiting[0][0], domain))
        else:
            del self._domains[domain]
        self._jobs -= 1
        self._recipients -= len(job.items)
        return job

    def blocked_domains(self, slots: DomainSlots) -> set[str]:
        """Domains with jobs waiting here that no worker could start now."""
        return {domain for domain in self._domains if not slots.could_start(domain)}

    def remove(self, msg_id: int) -> list[Planned[T]]:
        """Take out the waiting jobs of one message (an administrator holds or drops it)."""
        everything = self._in_order()
        gone = [job for job in everything if job.msg_id == msg_id]
        if gone:
            self._replace([job for job in everything if job.msg_id != msg_id])
        return gone

    def drain(self) -> list[Planned[T]]:
        jobs = self._in_order()
        self._replace([])
        return jobs

    def _in_order(self) -> list[Planned[T]]:
        numbered = [entry for waiting in self._domains.values() for entry in waiting]
        numbered.sort(key=lambda entry: entry[0])
        return [job for _, job in numbered]

    def _replace(self, jobs: list[Planned[T]]) -> None:
        self._domains.clear()
        self._heads.clear()
        self._jobs = self._recipients = 0
        self.extend(jobs)
