"""Retry schedules: when to try a deferred recipient again, and when to give up.

Pure: no clock reads.  Every time is an integer count of milliseconds since the epoch passed
in by the caller (``now_ms``), so the same inputs always give the same answer and the tests
need no fake clock.

RFC 5321 section 4.5.4.1 asks for a retry interval of at least 30 minutes and a give-up time
of at least 4-5 days; both are deployment choices, so they live in configuration and this
module only parses and applies them.  The defaults below are shorter than those
suggestions (a first retry after 15 minutes, giving up after 3 days), a common choice for
bulk senders: most deferrals are greylisting or short outages that clear within minutes, and
a sender is better told of a failure in 3 days than in 5.

The schedule syntax follows Mailismus: a list of intervals separated by ``|`` whose last
entry repeats for as long as the message may live.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "BOUNCE_MAX_AGE",
    "DEFAULT_MAX_AGE",
    "DEFAULT_SCHEDULE",
    "RetrySchedule",
    "format_duration",
    "parse_duration",
]

DEFAULT_SCHEDULE: Final = "15m | 30m | 2h | 4h"
"""Retry intervals used when the configuration names none (the last one repeats)."""

DEFAULT_MAX_AGE: Final = "72h"
"""How long an ordinary message may stay queued before its recipients are bounced."""

BOUNCE_MAX_AGE: Final = "24h"
"""Max age for bounce messages (DSNs) we generate ourselves.

A DSN that cannot be delivered has nowhere else to go (its own bounce would loop, RFC 5321
section 6.1 and RFC 3464 section 2), so holding it as long as a real message only ties up
the queue.
"""

_MS_PER_UNIT: Final[dict[str, int]] = {
    "d": 86_400_000,
    "h": 3_600_000,
    "m": 60_000,
    "s": 1_000,
}

# One number-and-unit part; ``[0-9]`` rather than ``\d`` because ``\d`` also matches
# non-ASCII digits, which ``int()`` would then accept.
_PART: Final = re.compile(r"([0-9]+)([dhms])")
_PLAIN_SECONDS: Final = re.compile(r"[0-9]+")


def parse_duration(text: str) -> int:
    """Parse a duration and return it in milliseconds.

    Accepted forms: a plain count of seconds (``"90"``), or one or more number-and-unit
    parts with units ``d``, ``h``, ``m``, ``s`` (``"30s"``, ``"15m"``, ``"1h30m"``).
    Surrounding whitespace is ignored.  Units must appear largest first and at most once:
    ``"30m1h"`` or ``"1h1h"`` is far more likely a typo than an intended 90 minutes.  Units
    are lowercase only, so that ``"15M"`` (months? minutes?) is refused instead of guessed.
    Zero (``"0"``, ``"0s"``) is a valid duration here; callers for which zero makes no sense
    (retry intervals) reject it themselves.

    Raises ``ValueError`` naming the problem for an empty string, a negative value, or
    anything else that does not match.
    """
    stripped = text.strip()
    if not stripped:
        raise ValueError("empty duration: expected e.g. '30s', '15m', '2h', '3d', '1h30m' or '90'")
    if stripped.startswith("-"):
        raise ValueError(f"negative duration {text!r}: durations must be zero or more")
    if _PLAIN_SECONDS.fullmatch(stripped):
        return int(stripped) * _MS_PER_UNIT["s"]

    total = 0
    pos = 0
    units = list(_MS_PER_UNIT)  # largest first, as dicts keep insertion order
    last_rank = -1
    while pos < len(stripped):
        match = _PART.match(stripped, pos)
        if match is None:
            raise ValueError(
                f"invalid duration {text!r}: expected number-and-unit parts such as "
                "'1h30m' (units d, h, m, s) or a plain number of seconds"
            )
        number, unit = match.groups()
        rank = units.index(unit)
        if rank <= last_rank:
            raise ValueError(
                f"invalid duration {text!r}: units must appear largest first, each at most once"
            )
        last_rank = rank
        total += int(number) * _MS_PER_UNIT[unit]
        pos = match.end()
    return total


def format_duration(ms: int) -> str:
    """Render milliseconds in the form ``parse_duration`` reads back (``5400000`` -> ``"1h30m"``).

    Used for logs and for showing effective configuration.  Only whole seconds can be
    written in this syntax, so anything else raises ``ValueError``.
    """
    if ms < 0:
        raise ValueError(f"negative duration: {ms} ms")
    if ms % _MS_PER_UNIT["s"]:
        raise ValueError(f"{ms} ms is not a whole number of seconds")
    if ms == 0:
        return "0s"
    parts: list[str] = []
    rest = ms
    for unit, size in _MS_PER_UNIT.items():
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class RetrySchedule:
    """Intervals between delivery attempts and the age at which a recipient is given up.

    ``intervals_ms[i]`` is the wait after the ``i+1``-th failed attempt; the last interval
    repeats.  ``max_age_ms`` is measured from the time the message was queued.  The
    constructor validates, so a schedule that exists is always usable.
    """

    intervals_ms: tuple[int, ...]
    max_age_ms: int

    def __post_init__(self) -> None:
        if not self.intervals_ms:
            raise ValueError("retry schedule is empty: give at least one interval")
        for index, interval in enumerate(self.intervals_ms, start=1):
            if interval <= 0:
                raise ValueError(
                    f"retry interval {index} is {interval} ms: intervals must be positive"
                )
        if self.max_age_ms < self.intervals_ms[0]:
            raise ValueError(
                f"max age ({self.max_age_ms} ms) is shorter than the first retry interval "
                f"({self.intervals_ms[0]} ms): no retry could ever happen"
            )

    @classmethod
    def parse(cls, spec: str = DEFAULT_SCHEDULE, max_age: str = DEFAULT_MAX_AGE) -> RetrySchedule:
        """Build a schedule from ``"15m | 30m | 2h | 4h"`` and a max age such as ``"72h"``.

        Raises ``ValueError`` naming the problem: an empty spec, an empty entry
        (``"15m || 2h"``), an unparseable or zero interval, or a max age shorter than
        the first interval.
        """
        if not spec.strip():
            raise ValueError("retry schedule is empty: give at least one interval, e.g. '15m | 1h'")
        intervals: list[int] = []
        for index, entry in enumerate(spec.split("|"), start=1):
            if not entry.strip():
                raise ValueError(f"retry schedule {spec!r}: entry {index} is empty")
            try:
                interval = parse_duration(entry)
            except ValueError as exc:
                raise ValueError(f"retry schedule {spec!r}: entry {index}: {exc}") from None
            if interval == 0:
                raise ValueError(
                    f"retry schedule {spec!r}: entry {index} is zero; intervals must be positive"
                )
            intervals.append(interval)
        try:
            max_age_ms = parse_duration(max_age)
        except ValueError as exc:
            raise ValueError(f"retry max age: {exc}") from None
        return cls(tuple(intervals), max_age_ms)

    def expires_at(self, queued_at_ms: int) -> int:
        """The time at which a recipient queued at ``queued_at_ms`` is given up."""
        return queued_at_ms + self.max_age_ms

    def interval_after(self, attempts: int) -> int:
        """The regular wait after the ``attempts``-th failed attempt (the last interval repeats)."""
        if attempts < 1:
            raise ValueError(f"attempts must be 1 or more, got {attempts}")
        return self.intervals_ms[min(attempts, len(self.intervals_ms)) - 1]

    def next_attempt(self, attempts: int, queued_at_ms: int, now_ms: int) -> int | None:
        """When to try again after the ``attempts``-th failed attempt, or None to give up.

        The wait is counted from ``now_ms`` (the time the failure is recorded), not from
        the previous scheduled time, so a slow attempt or a backlog never produces a retry
        time already in the past.

        Returns None exactly when ``now_ms >= expires_at(queued_at_ms)``.  Otherwise, if
        the regular next attempt would fall after the expiry, the expiry time itself is
        returned: the recipient gets one last attempt at the end of its life rather than
        being bounced early merely because the next interval is long (with a 4h interval
        and a 72h max age, up to 4 hours of the promised lifetime would otherwise be lost).
        That last attempt, if it fails, lands here with ``now_ms >= expiry`` and gets None.
        The result is always strictly later than ``now_ms`` and never later than the expiry.
        """
        interval = self.interval_after(attempts)
        expiry = self.expires_at(queued_at_ms)
        if now_ms >= expiry:
            return None
        return min(now_ms + interval, expiry)
