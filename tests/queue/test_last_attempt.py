"""A job handed out at or past its message's expiry says it is the last attempt.

The retry schedule puts the last try at the expiry time itself (``RetrySchedule.
next_attempt``), and a failure then bounces: the worker must make that try a real one,
resting MX hosts included (``Job.last_attempt``; the walk in ``delivery/attempt.py``).
Real store on disk; the service's clock is the test's.
"""

from __future__ import annotations

import pytest

from tests.queue.test_service import Clock, Z, service_for
from tests.storage.conftest import MINUTE, T0, async_test, queue_message
from zoneq.config import load_config
from zoneq.storage.store import QueueStore

MAX_AGE = load_config().zones[Z].schedule.max_age_ms


@pytest.mark.parametrize(
    ("age_ms", "last"),
    [
        (0, False),  # the first attempt
        (MAX_AGE - 1, False),  # a failure now still gets a retry (at the expiry)
        (MAX_AGE, True),  # the attempt the schedule put at the expiry
        (MAX_AGE + MINUTE, True),  # handed out late (a backlog): still the last
    ],
)
@async_test
async def test_a_job_at_its_expiry_is_the_last_attempt(
    store: QueueStore, age_ms: int, last: bool
) -> None:
    clock = Clock()
    service = service_for(store, clock)
    await queue_message(store, [("a@down.test", Z), ("b@down.test", Z)], now_ms=T0)
    clock.now = T0 + age_ms
    (job,) = await service.lease(Z, "w1")
    assert job.last_attempt is last
