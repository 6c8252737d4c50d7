"""Connection slots per destination domain and per MX host, held while a connection is open.

Theory of operation
-------------------
A *slot* stands for one SMTP connection of a zone's workers to a destination.  It counts
against the limit of its recipient domain and, once the domain's MX host is known, against
that host's limit as well (issue 5: many domains share one provider's MX hosts).  What a
remote server counts is open connections, busy or idle, so a slot is held for as long as
its connection is open, not only while a job is on it:

* ``BUSY``: a job is on it.  Granted by :meth:`DomainSlots.acquire`, either as a new slot
  (the domain and its host are below their limits) or by taking up an ``IDLE`` slot of the
  same worker whose connection fits (same domain, or same MX host): that is connection
  reuse under a limit (issue 3), and why a worker holding an idle connection to a
  destination is the one that gets its next job.
* ``IDLE``: the job ended and the worker kept the connection for the next message
  (:meth:`DomainSlots.keep`).  A keep that would leave the domain or the host above its
  limit (a "slow down" lowered it, or the host was learnt meanwhile) is refused: the slot
  turns ``CLOSING`` instead.
* ``CLOSING``: the worker is told to close the connection (:meth:`DomainSlots.closing`);
  the slot counts until the worker says it is closed (:meth:`DomainSlots.closed`), since
  until then the remote server still sees it.

A slot ends when the worker says its idle connection is gone (idle timeout, the server
closed it, it was taken up for another slot), when a job ends without keeping its
connection, and when the worker disconnects (:meth:`DomainSlots.disconnect`).  So no
deadlock: an idle slot lasts at most the worker's idle timeout (five seconds) unless a job
takes it up, and one above a limit is closed at once.

The core does not resolve MX (the workers do), so the MX host of a domain is *learnt* from
the reports (every outcome names the host it was about).  The learning window: until the
first report for a domain arrives, its slots count against its domain limit only; so at
most ``domain limit`` connections per newly seen domain can go beyond an MX limit, once.
When the host is learnt, the domain's slots already held count against it from then on
(busy ones finish, idle ones above the limit are closed).  Only domains whose MX host has
a limit are remembered, at most ``MAX_LEARNT`` of them (the oldest learnt is forgotten
first, and is learnt again by its next report).

Pure and synchronous: the queue service (``service.py``) drives it from reports and leases.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from zoneq.config.zones import limit_for

if TYPE_CHECKING:  # feedback.py builds on the scheduler's RateLimiter; slots only call it
    from zoneq.queue.feedback import DomainFeedback

__all__ = ["MAX_LEARNT", "DomainSlots", "Slot", "SlotState"]

MAX_LEARNT: Final = 100_000
"""Domains whose MX host (with a limit) is remembered; and limits looked up, cached."""


class SlotState(enum.Enum):
    BUSY = "busy"
    IDLE = "idle"
    CLOSING = "closing"


@dataclass(slots=True, eq=False)
class Slot:
    """One connection, open or about to be, counted against its domain and host."""

    id: int
    owner: str  # the worker (its IPC connection) holding it
    domain: str
    host: str | None  # the MX host it counts against; None: not known, or no limit
    state: SlotState = SlotState.BUSY
    fresh: bool = True  # granted new for its job (no connection yet), not taken up idle


def _add(index: dict[str, dict[int, Slot]], key: str, slot: Slot) -> None:
    index.setdefault(key, {})[slot.id] = slot


def _remove(index: dict[str, dict[int, Slot]], key: str, slot: Slot) -> None:
    members = index.get(key)
    if members is not None:
        members.pop(slot.id, None)
        if not members:
            del index[key]


class DomainSlots:
    """Open connections per destination domain, against a limit per domain and one per MX
    host (see the module's docstring).

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
        self._domain_limit: dict[str, int] = {}  # limit_for's answers, cached
        self._mx_of: dict[str, tuple[str, int]] = {}  # domain -> (MX host, its limit)
        self._host_limit: dict[str, int] = {}  # MX host -> its limit, for slots charged to it
        self._ids = itertools.count(1)
        self._slots: dict[int, Slot] = {}
        self._of_domain: dict[str, dict[int, Slot]] = {}  # every slot, by domain
        self._on_host: dict[str, dict[int, Slot]] = {}  # every slot with a host, by host
        self._parked: dict[str, dict[int, Slot]] = {}  # IDLE and CLOSING slots, by owner
        # IDLE slots by (owner, domain) and (owner, host): what a lease may take up.
        self._idle_domain: dict[tuple[str, str], dict[int, Slot]] = {}
        self._idle_host: dict[tuple[str, str], dict[int, Slot]] = {}
        # IDLE slots per domain and per host, any owner (does a domain have a way in?).
        self._idle_domains: dict[str, int] = {}
        self._idle_hosts: dict[str, int] = {}
        self._to_close: dict[str, list[int]] = {}  # owner -> slots it has to be told to close
        self.feedback = feedback

    # --- limits and counts ----------------------------------------------------------------

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
        """Slots held for ``domain``: connections busy, idle or closing."""
        return len(self._of_domain.get(domain, ()))

    def mx_in_flight(self, mx_host: str) -> int:
        return len(self._on_host.get(mx_host.lower().rstrip("."), ()))

    def held(self, owner: str | None = None) -> list[Slot]:
        """Every slot held (by ``owner``); for tests and diagnostics."""
        return [s for s in self._slots.values() if owner is None or s.owner == owner]

    # --- learning ---------------------------------------------------------------------------

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
            self._recharge(domain, None)
            return
        if known is None and len(self._mx_of) >= MAX_LEARNT:
            del self._mx_of[next(iter(self._mx_of))]
        self._mx_of[domain] = (host, limit)
        self._host_limit[host] = limit
        self._recharge(domain, host)

    def _recharge(self, domain: str, host: str | None) -> None:
        """From now on, count the slots ``domain`` holds against ``host`` (its MX learnt
        anew); idle ones beyond the host's limit are closed."""
        for slot in list(self._of_domain.get(domain, {}).values()):
            if slot.host == host:
                continue
            idle = slot.state is SlotState.IDLE
            if idle:
                self._unidle(slot)
            if slot.host is not None:
                _remove(self._on_host, slot.host, slot)
            slot.host = host
            if host is not None:
                _add(self._on_host, host, slot)
            if idle:
                self._idle(slot)
        if host is not None:
            self.trim(self._on_host.get(host, {}), self._host_limit[host])

    # --- starting a job -------------------------------------------------------------------

    def available(self, domain: str) -> bool:
        """May a new connection open for ``domain`` now?"""
        if len(self._of_domain.get(domain, ())) >= self.limit(domain):
            return False
        mx = self._mx_of.get(domain)
        if mx is not None and len(self._on_host.get(mx[0], ())) >= mx[1]:
            return False
        return self.feedback is None or self.feedback.may_start(domain)

    def reusable(self, domain: str, owner: str) -> Slot | None:
        """An idle slot of ``owner`` that a job for ``domain`` may take up now, if any: one
        of the same domain, or of the same MX host (its connection serves both)."""
        if owner not in self._parked:
            return None
        same = self._idle_domain.get((owner, domain))
        mx = self._mx_of.get(domain)
        on_host = self._idle_host.get((owner, mx[0])) if mx is not None else None
        if not same and not on_host:
            return None
        if mx is not None and _over(self._on_host.get(mx[0], {}), mx[1]):
            return None  # more stay open than the host allows: its idle ones close
        held = self._of_domain.get(domain, {})
        limit = self.limit(domain)
        slot: Slot | None = None
        if same and not _over(held, limit):  # the same connection: no count changes
            slot = next(iter(same.values()))
        elif on_host and len(held) < limit:  # the count moves over to ``domain``
            slot = next(iter(on_host.values()))
        if slot is None or (self.feedback is not None and not self.feedback.may_start(domain)):
            return None
        return slot

    def startable(self, domain: str, owner: str) -> bool:
        """May ``owner`` start a job for ``domain`` now (a new slot, or one it holds idle)?"""
        return self.available(domain) or self.reusable(domain, owner) is not None

    def could_start(self, domain: str) -> bool:
        """Could some worker start a job for ``domain`` now, or when it asks next?"""
        if self.available(domain) or self._idle_domains.get(domain):
            return True
        mx = self._mx_of.get(domain)
        return mx is not None and bool(self._idle_hosts.get(mx[0]))

    def acquire(self, domain: str, owner: str = "") -> int:
        """Start a job for ``domain`` on a slot of ``owner``: one it holds idle if one fits
        (:meth:`reusable`), else a new one; the slot's id."""
        slot_id = self.try_acquire(domain, owner)
        if slot_id is None:
            raise RuntimeError(f"no free connection slot for {domain}")
        return slot_id

    def try_acquire(self, domain: str, owner: str = "") -> int | None:
        """As :meth:`acquire`, None when ``owner`` may not start a job for ``domain`` now
        (one look at the counts, for the scheduler's scan of its queue)."""
        slot = self.reusable(domain, owner)
        if slot is not None:
            self._unpark(slot)
            if slot.domain != domain:  # same host, another domain: the count moves over
                _remove(self._of_domain, slot.domain, slot)
                slot.domain = domain
                _add(self._of_domain, domain, slot)
            slot.state = SlotState.BUSY
            slot.fresh = False
        elif self.available(domain):
            mx = self._mx_of.get(domain)
            slot = Slot(next(self._ids), owner, domain, mx[0] if mx is not None else None)
            self._slots[slot.id] = slot
            _add(self._of_domain, domain, slot)
            if slot.host is not None:
                _add(self._on_host, slot.host, slot)
        else:
            return None
        if self.feedback is not None:
            self.feedback.started(domain)
        return slot.id

    # --- after a job ----------------------------------------------------------------------

    def keep(self, slot_id: int, owner: str) -> bool:
        """``owner`` keeps the connection of the busy slot ``slot_id`` for the next job.

        False if it may not: the domain or host is above its limit now (the slot turns
        CLOSING and the owner is told to close the connection, :meth:`closing`), or the
        slot is not a busy one of ``owner`` (it is released, if it was busy).
        """
        slot = self._slots.get(slot_id)
        if slot is None or slot.state is not SlotState.BUSY:
            return False
        if slot.owner != owner:
            self.release(slot_id)
            return False
        # Those being closed do not count here: once closed, this one is within the limit.
        over = _over(self._of_domain[slot.domain], self.limit(slot.domain))
        if slot.host is not None:
            over = over or _over(self._on_host[slot.host], self._host_limit[slot.host])
        self._park(slot)
        if over:
            self._close(slot)
            return False
        self._idle(slot)
        return True

    def put_back(self, slot_id: int) -> None:
        """A slot was granted for a job that did not go out after all: a new one is
        released, an idle one taken up goes back to its owner idle."""
        slot = self._slots.get(slot_id)
        if slot is None:
            return
        if slot.fresh:
            self.release(slot_id)
        else:
            self.keep(slot_id, slot.owner)

    def release(self, slot_id: int) -> bool:
        """End a slot: its connection is closed (or was never opened); False if unknown."""
        slot = self._slots.pop(slot_id, None)
        if slot is None:
            return False
        if slot.state is not SlotState.BUSY:
            self._unpark(slot)
        _remove(self._of_domain, slot.domain, slot)
        if slot.host is not None:
            _remove(self._on_host, slot.host, slot)
        return True

    def closed(self, slot_id: int, owner: str) -> bool:
        """``owner`` says the connection of its idle (or closing) slot is closed, or was
        taken up under another slot.  A busy slot is not ended: the report was about an
        earlier connection of the slot, before a job took it up again."""
        slot = self._slots.get(slot_id)
        if slot is None or slot.owner != owner or slot.state is SlotState.BUSY:
            return False
        return self.release(slot_id)

    def disconnect(self, owner: str) -> int:
        """The worker went away, its connections with it: end its idle and closing slots
        (its busy ones end with their jobs); how many."""
        parked = list(self._parked.get(owner, {}))
        for slot_id in parked:
            self.release(slot_id)
        self._to_close.pop(owner, None)
        return len(parked)

    def closing(self, owner: str) -> tuple[int, ...]:
        """The slots ``owner`` must close its connections of now (each told once)."""
        return tuple(self._to_close.pop(owner, ()))

    def has_closing(self, owner: str) -> bool:
        return owner in self._to_close

    def trim(self, slots: Mapping[int, Slot], limit: int) -> int:
        """Close idle slots among ``slots`` until at most ``limit`` are not closing; how
        many were told to close."""
        open_ = [s for s in slots.values() if s.state is not SlotState.CLOSING]
        excess = len(open_) - limit
        told = 0
        for slot in open_:
            if told >= excess:
                break
            if slot.state is SlotState.IDLE:
                self._unidle(slot)
                self._close(slot)
                told += 1
        return told

    def trim_domain(self, domain: str) -> int:
        """Close idle slots of ``domain`` above its limit (lowered by a "slow down")."""
        slots = self._of_domain.get(domain)
        return self.trim(slots, self.limit(domain)) if slots else 0

    # --- indexes --------------------------------------------------------------------------

    def _park(self, slot: Slot) -> None:
        self._parked.setdefault(slot.owner, {})[slot.id] = slot

    def _unpark(self, slot: Slot) -> None:
        if slot.state is SlotState.IDLE:
            self._unidle(slot)
        parked = self._parked.get(slot.owner)
        if parked is not None:
            parked.pop(slot.id, None)
            if not parked:
                del self._parked[slot.owner]

    def _idle(self, slot: Slot) -> None:
        slot.state = SlotState.IDLE
        self._idle_domain.setdefault((slot.owner, slot.domain), {})[slot.id] = slot
        self._idle_domains[slot.domain] = self._idle_domains.get(slot.domain, 0) + 1
        if slot.host is not None:
            self._idle_host.setdefault((slot.owner, slot.host), {})[slot.id] = slot
            self._idle_hosts[slot.host] = self._idle_hosts.get(slot.host, 0) + 1

    def _unidle(self, slot: Slot) -> None:
        """Out of the IDLE indexes (the caller sets the new state)."""
        _drop(self._idle_domain, (slot.owner, slot.domain), slot)
        _decrement(self._idle_domains, slot.domain)
        if slot.host is not None:
            _drop(self._idle_host, (slot.owner, slot.host), slot)
            _decrement(self._idle_hosts, slot.host)

    def _close(self, slot: Slot) -> None:
        """A parked slot turns CLOSING: its owner is told to close the connection."""
        slot.state = SlotState.CLOSING
        self._to_close.setdefault(slot.owner, []).append(slot.id)


def _over(slots: Mapping[int, Slot], limit: int) -> bool:
    """Are more than ``limit`` of ``slots`` staying open (not being closed)?  Counted only
    when all of them are more than the limit, which is rare."""
    if len(slots) <= limit:
        return False
    return sum(1 for slot in slots.values() if slot.state is not SlotState.CLOSING) > limit


def _drop(index: dict[tuple[str, str], dict[int, Slot]], key: tuple[str, str], slot: Slot) -> None:
    members = index.get(key)
    if members is not None:
        members.pop(slot.id, None)
        if not members:
            del index[key]


def _decrement(counts: dict[str, int], key: str) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
