"""Due times no forward-moving clock can have set: the wall clock stepped back.

A deferral made at time ``t`` is due at most the zone's longest retry interval later
(``RetrySchedule.next_attempt`` gives ``min(t + interval, expiry)``).  So while the clock
only moves forward, no due time lies more than that interval ahead of now.  One that does
was set before the wall clock stepped back (an NTP step, an operator, a virtual machine
restored from a snapshot; RFC 5905 section 10 lets NTP step a clock that is far off), and
waiting for it would add the whole step to the wait: a recipient deferred for 15 minutes
before a step back of a day would wait a day and 15 minutes, while new mail goes out at
once.  ``QueueStore.promote_due`` promotes such recipients at once instead, so that a step
back never makes a wait longer than the longest interval, the rule the queue's feedback
periods keep too (``zoneq/queue/feedback.py``).
"""

from __future__ import annotations

__all__ = ["step_back_bound"]


def step_back_bound(now_ms: int, longest_ms: int) -> int:
    """The earliest due time (ms since the epoch) that no deferral made at or before
    ``now_ms`` can have, ``longest_ms`` being the longest retry interval of the zone.

    A due time exactly ``longest_ms`` ahead is a deferral made right now with the longest
    interval, so the bound lies one millisecond past it.
    """
    if longest_ms <= 0:
        raise ValueError(f"the longest retry interval must be positive, got {longest_ms} ms")
    return now_ms + longest_ms + 1
