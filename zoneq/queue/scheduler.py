"""Scheduling decisions for one zone: pure, synchronous, time passed in.

Theory of operation
-------------------
The core leases a *window* of ready recipients from the store (oldest message first) and
turns it into *jobs*: one job is one SMTP transaction, the recipients of one message for one
destination domain, at most ``max_recipients`` of them (Postfix's default is 50).  Jobs are
handed to zone workers in the order of their oldest recipient, subject to two limits that
hold for the zone as a whole, because the core enforces them centrally (ZoneMTA throttled
per connection, which its users found useless):

* a connection limit per destination domain: a job in flight holds one slot of its domain;
* a zone-wide rate (jobs per second, minute or hour), spread evenly with GCRA, the generic
  cell rate algorithm: each job moves a "theoretical arrival time" on by one interval, and
  a job may start only while that time is at most ``burst - 1`` intervals ahead of now.

A job whose domain is at its limit is skipped for now, not dropped: the next free slot of
that domain picks it up, while jobs for other domains go ahead of it.

Per-MX limits (issue 5): many domains share one provider's MX hosts, and a limit per domain
alone lets a thousand small domains on one provider open a thousand connections to it.  The
core does not resolve MX (the workers do), so ``DomainSlots`` *learns* each domain's MX host
from the reports (every outcome names the host it was about) and counts a domain's jobs
against the limit of its MX host as well, across every domain known to share it.  The
learning window: until the first report for a domain arrives, its jobs count against its
domain limit only; so at most ``domain limit`` connections per newly seen domain can go
beyond an MX limit, once.  Only domains whose MX host has a limit are remembered, at most
``MAX_LEARNT`` of them (the oldest learnt is forgotten first, and is learnt again by its
next report).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Generic, TypeVar

from zoneq.config.zones import limit_for

if TYPE_CHECKING:  # feedback.py builds on RateLimiter below; the scheduler only calls it
    from zoneq.queue.feedback import DomainFeedback

T = TypeVar("T")

DEFAULT_MAX_RECIPIENTS = 50

MAX_LEARNT: Final = 100_000
"""Domains whose MX host (with a limit) is remembered; and limits looked up, cached."""

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


class DomainSlots:
    """Connections in flight per destination domain, against a limit per domain and one
    per MX host (see the module's docstring).

    ``limits`` and ``mx_limits`` are the config's ``domain_limits`` and ``mx_limits``: a
    name, or a parent written with a leading dot (``limit_for``).  With ``feedback``
    (``feedback.py``), a domain a remote server asked to slow down has a lower limit and a
    rate of its own for a while.
    """

    def __init__(
        self,
        default_limit: int,
        limits: Mapping[str, int] | None = None,
        feedback: DomainFeedback | None = None,
        mx_limits: Mapping[str, int] | None = None,
    ) -> None:
        if default_limit < 1:
            raise ValueError("a domain connection limit must be at least 1")
        self._default = default_limit
        self._limits = dict(limits or {})
        self._mx_limits = dict(mx_limits or {})
        self._busy: dict[str, int] = {}
        self._domain_limit: dict[str, int] = {}  # limit_for's answers, cached
        self._mx_of: dict[str, tuple[str, int]] = {}  # domain -> (MX host, its limit)
        self._mx_busy: dict[str, int] = {}  # MX host -> jobs in flight counted against it
        self._charged: dict[str, dict[str, int]] = {}  # domain -> MX host -> jobs counted
        self.feedback = feedback

    def limit(self, domain: str) -> int:
        normal = self._domain_limit.get(domain)
        if normal is None:
            found = limit_for(self._limits, domain) if self._limits else None
            normal = self._default if found is None else found
            if len(self._domain_limit) >= MAX_LEARNT:
                self._domain_limit.clear()
            self._domain_limit[domain] = normal
        return normal if self.feedback is None else self.feedback.limit(domain, normal)

    def in_flight(self, domain: str) -> int:
        return self._busy.get(domain, 0)

    def mx_in_flight(self, mx_host: str) -> int:
        return self._mx_busy.get(mx_host.lower().rstrip("."), 0)

    def learn(self, domain: str, mx_host: str) -> None:
        """A report says ``domain`` was delivered (or tried) through ``mx_host``."""
        if not self._mx_limits:
            return
        host = mx_host.lower().rstrip(".")
        known = self._mx_of.get(domain)
        if known is not None and known[0] == host:
            return
        limit = limit_for(self._mx_limits, host)
        if limit is None:
            self._mx_of.pop(domain, None)
            return
        if known is None and len(self._mx_of) >= MAX_LEARNT:
            del self._mx_of[next(iter(self._mx_of))]
        self._mx_of[domain] = (host, limit)

    def available(self, domain: str) -> bool:
        if self._busy.get(domain, 0) >= self.limit(domain):
            return False
        mx = self._mx_of.get(domain)
        if mx is not None and self._mx_busy.get(mx[0], 0) >= mx[1]:
            return False
        return self.feedback is None or self.feedback.may_start(domain)

    def acquire(self, domain: str) -> None:
        if not self.available(domain):
            raise RuntimeError(f"no free connection slot for {domain}")
        self._busy[domain] = self._busy.get(domain, 0) + 1
        mx = self._mx_of.get(domain)
        if mx is not None:
            # Remember which host this job was counted against: the domain's MX may be
            # learnt anew before the job is released.
            host = mx[0]
            self._mx_busy[host] = self._mx_busy.get(host, 0) + 1
            charged = self._charged.setdefault(domain, {})
            charged[host] = charged.get(host, 0) + 1
        if self.feedback is not None:
            self.feedback.started(domain)

    def release(self, domain: str) -> None:
        left = self._busy.get(domain, 0) - 1
        if left < 0:
            raise RuntimeError(f"released a slot of {domain} that was not held")
        if left:
            self._busy[domain] = left
        else:
            del self._busy[domain]
        charged = self._charged.get(domain)
        if charged and left < sum(charged.values()):
            # Jobs started before the domain's MX was learnt were not counted against it;
            # uncount only as many as were counted.
            host = next(iter(charged))
            _decrement(charged, host)
            _decrement(self._mx_busy, host)
            if not charged:
                del self._charged[domain]


def _decrement(counts: dict[str, int], key: str) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


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

    def take(self, slots: DomainSlots, rate: RateLimiter, now_ms: float) -> Planned[T] | None:
        """The oldest job whose domain has a free slot, if the zone's rate allows one now.

        The rate is checked first: a job not started for want of rate keeps its place.
        """
        if rate.wait_ms(now_ms) > 0:
            return None
        for index, job in enumerate(self._jobs):
            if slots.available(job.domain):
                if not rate.take(now_ms):
                    return None
                del self._jobs[index]
                slots.acquire(job.domain)
                return job
        return None

    def blocked_domains(self, slots: DomainSlots) -> set[str]:
        """Domains with jobs waiting here that are at their connection limit."""
        return {job.domain for job in self._jobs if not slots.available(job.domain)}

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
