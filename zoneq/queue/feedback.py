"""Feedback from remote replies: slowed destinations and rested source addresses, per zone.

Theory of operation
-------------------
The reply rules (``zoneq/protocol/reply_rules.py``) turn a reply into an action.  Two of
them change how the zone treats a destination domain afterwards; this module keeps that
state, one ``DomainFeedback`` per zone (each zone sends from its own addresses, and a
provider throttles and blocks addresses, so one zone's trouble is not another's):

* ``slow_down``: for ``slow_down_period`` the domain's connection limit is halved (again
  on each further "slow down" while it lasts, never below 1; multiplicative decrease, as
  TCP and Postfix's destination concurrency feedback do) and its transactions are spaced
  by ``slow_down_rate`` (a GCRA of its own, no tolerance).  Each "slow down" starts the
  period again; when it runs out the domain is back to its normal limit and the zone's rate,
  all at once.  Postfix restores concurrency gradually on success; a fixed period is
  simpler to reason about and to test, and the providers' texts ask for a pause, not a
  probe.
* ``blocked``: the source address that got the reply rests for that domain for
  ``blocked_rest``, so the next attempt uses another address of the zone's pool (issue 5).
  ``rested(domain)`` is what the pool chooser must avoid.

The scheduler's ``DomainSlots`` asks ``limit`` and ``may_start`` and calls ``started``;
the report path calls ``observe`` with each outcome's reply.  The clock is injected, so
tests drive time by hand.  It is the service's wall clock: a step back shortens nothing and
lengthens a period to at most its full length from the new time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from zoneq.config.reply_rules import ReplyRulesConfig
from zoneq.protocol.reply_rules import ReplyAction, ReplyRule, rule_report
from zoneq.queue.scheduler import RateLimiter

__all__ = ["DomainFeedback"]


@dataclass(slots=True)
class _Slowed:
    until_ms: float
    divisor: int
    rate: RateLimiter


@dataclass(slots=True)
class DomainFeedback:
    """One zone's feedback state; see the module's docstring."""

    clock: Callable[[], float]
    rules: Sequence[ReplyRule] = ()
    period_ms: int = 600_000
    slow_rate: tuple[int, int] = (1, 1000)
    rest_ms: int = 3_600_000
    _slowed: dict[str, _Slowed] = field(default_factory=dict)
    _rested: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: ReplyRulesConfig, clock: Callable[[], float]) -> DomainFeedback:
        return cls(
            clock,
            config.compiled(),
            config.slow_down_period_ms,
            config.slow_down_limit,
            config.blocked_rest_ms,
        )

    # --- what replies say ---------------------------------------------------------------

    def observe(
        self,
        domain: str,
        code: int | None,
        enhanced: str | None,
        reply: str,
        source_ip: str | None = None,
    ) -> ReplyAction | None:
        """Apply the rule that fits a reply to ``domain`` (as a worker reports it: code,
        status, one-line text); the action taken, None when no rule fits.  The core's
        report path calls ``rule_report`` itself (it needs the category too), then
        ``note``; this is the same in one step."""
        action = rule_report(self.rules, code, enhanced, reply).action
        if action is not None:
            self.note(domain, action, source_ip)
        return action

    def note(self, domain: str, action: ReplyAction, source_ip: str | None = None) -> None:
        now = self.clock()
        if action is ReplyAction.SLOW_DOWN:
            slowed = self._current(domain, now)
            if slowed is None:
                count, per_ms = self.slow_rate
                self._slowed[domain] = _Slowed(now + self.period_ms, 2, RateLimiter(count, per_ms))
            else:
                slowed.until_ms = now + self.period_ms
                slowed.divisor *= 2
        elif action is ReplyAction.BLOCKED and source_ip is not None:
            self._rested.setdefault(domain, {})[source_ip] = now + self.rest_ms

    # --- what the scheduler asks ----------------------------------------------------------

    # The scheduler asks these for every job and every leased recipient: a domain that was
    # never slowed costs one dict lookup, not a clock reading.

    def limit(self, domain: str, normal: int) -> int:
        """The domain's connection limit now, given its ``normal`` one."""
        if domain not in self._slowed:
            return normal
        slowed = self._current(domain, self.clock())
        return normal if slowed is None else max(1, normal // slowed.divisor)

    def may_start(self, domain: str) -> bool:
        if domain not in self._slowed:
            return True
        now = self.clock()
        slowed = self._current(domain, now)
        return slowed is None or slowed.rate.wait_ms(now) == 0

    def started(self, domain: str) -> None:
        if domain not in self._slowed:
            return
        now = self.clock()
        slowed = self._current(domain, now)
        if slowed is not None:
            slowed.rate.take(now)

    def slowed(self) -> frozenset[str]:
        """Domains slowed down now (for the admin API and logs)."""
        now = self.clock()
        return frozenset(d for d in list(self._slowed) if self._current(d, now) is not None)

    def rested(self, domain: str) -> frozenset[str]:
        """Source addresses resting for ``domain`` now: the next attempt avoids them."""
        resting = self._rested.get(domain)
        if resting is None:  # the common case: one dict lookup, no clock reading
            return frozenset()
        now = self.clock()
        for address, until in list(resting.items()):
            if until <= now:
                del resting[address]
            elif until > now + self.rest_ms:  # the clock stepped back: rest one period
                resting[address] = now + self.rest_ms
        if not resting:
            self._rested.pop(domain, None)
        return frozenset(resting)

    def _current(self, domain: str, now: float) -> _Slowed | None:
        slowed = self._slowed.get(domain)
        if slowed is None:
            return None
        if slowed.until_ms <= now:
            del self._slowed[domain]  # the period is over: back to normal
            return None
        # The (wall) clock may have stepped back: no longer than a "slow down" just received.
        slowed.until_ms = min(slowed.until_ms, now + self.period_ms)
        return slowed
