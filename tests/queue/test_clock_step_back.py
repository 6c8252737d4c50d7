"""The queue service after the wall clock steps back, on a real store.

A recipient the remote deferred must come back within its zone's retry intervals of the new
clock, not wait out the step: the service passes each zone's longest interval to the
store's ``promote_due`` (``zoneq/storage/stepback.py``).
"""

from __future__ import annotations

from tests.queue.test_service import Clock, Z, outcome, service_for
from tests.storage.conftest import MINUTE, T0, async_test, queue_message
from zoneq.queue.service import QueueService, Result
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

HOUR = 60 * MINUTE
DAY = 24 * HOUR


async def deferred_once(store: QueueStore, clock: Clock) -> QueueService:
    """A service whose one recipient was just deferred at ``clock.now`` (next try in 15
    minutes: the first interval of the default schedule, whose longest is 4 hours)."""
    service = service_for(store, clock)
    await queue_message(store, [("a@slow.test", Z)], now_ms=clock.now)
    (job,) = await service.lease(Z, "w1")
    await service.report("w1", outcome(job, Result.DEFERRED, reply="451 4.7.1 try later"))
    assert store.count(Z, State.DEFERRED) == 1
    return service


@async_test
async def test_a_deferral_comes_back_after_a_step_back_of_a_day(store: QueueStore) -> None:
    clock = Clock()
    service = await deferred_once(store, clock)
    clock.now = T0 - DAY + 16 * MINUTE
    assert await service.promote_due() == 1
    (job,) = await service.lease(Z, "w1")
    assert [r.address for r in job.recipients] == ["a@slow.test"]


@async_test
async def test_on_a_clock_that_moves_forward_it_waits_its_interval(store: QueueStore) -> None:
    clock = Clock()
    service = await deferred_once(store, clock)
    clock.now = T0 + 15 * MINUTE - 1
    assert await service.promote_due() == 0
    clock.now = T0 + 15 * MINUTE
    assert await service.promote_due() == 1


@async_test
async def test_a_step_back_within_the_longest_interval_keeps_the_schedule(
    store: QueueStore,
) -> None:
    clock = Clock()
    service = await deferred_once(store, clock)
    clock.now = T0 - HOUR  # 1 h 15 min from its due time: less than the longest, 4 h
    assert await service.promote_due() == 0
    clock.now = T0 + 15 * MINUTE
    assert await service.promote_due() == 1
