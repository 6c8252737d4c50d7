"""Retry now against recipients on the wire, on a real store and queue service.

A retry (of a message, a domain or a zone) resets the delay of deferred recipients and
counts, and remembers, those leased at that moment: when such an attempt defers, the
recipient is ready again at once (leased by the next call, the clock not moved), its
attempt on record; a delivery, a bounce, a job given back, a delete, a purge or a hold
forgets the mark, so nothing is retried early later.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from tests.queue.test_admin_holds import Z, counts, deferred, report, returned
from tests.queue.test_service import Clock, outcome, service_for
from tests.storage.conftest import MINUTE, T0, assert_consistent, async_test, queue_message
from zoneq.protocol.events import EventKind
from zoneq.queue.admin import QueueAdmin, Selection
from zoneq.queue.service import Job, QueueService, Result
from zoneq.storage import keys
from zoneq.storage.base import Outcome
from zoneq.storage.records import Recipient, State
from zoneq.storage.store import QueueStore

Retry = Callable[[QueueAdmin, dict[str, int]], Awaitable[int]]


async def _message(admin: QueueAdmin, ids: dict[str, int]) -> int:
    return await admin.retry_message(ids["b@one.test"])


async def _zone(admin: QueueAdmin, ids: dict[str, int]) -> int:
    return await admin.retry(Z)


async def _domain(admin: QueueAdmin, ids: dict[str, int]) -> int:
    return await admin.retry(None, "ONE.test")  # either case names the domain


async def _zone_domain(admin: QueueAdmin, ids: dict[str, int]) -> int:
    return await admin.retry(Z, "one.test")


def by_address(jobs: list[Job]) -> dict[str, Job]:
    return {r.address: job for job in jobs for r in job.recipients}


def record_of(store: QueueStore, msg: int) -> tuple[State, Recipient]:
    (queued,) = store.recipients(msg)
    return queued.state, queued.recipient


class World:
    """a@one.test deferred (an hour), b@one.test and c@two.test on the wire."""

    def __init__(self, store: QueueStore) -> None:
        self.store = store
        self.clock = Clock()
        self.service: QueueService = service_for(store, self.clock)
        self.admin = QueueAdmin(store, self.service, [Z], clock=self.clock)
        self.ids: dict[str, int] = {}
        self.jobs: dict[str, Job] = {}

    async def start(self) -> None:
        for address in ("a@one.test", "b@one.test", "c@two.test"):
            self.ids[address] = await queue_message(self.store, [(address, Z)])
        self.jobs = by_address(await self.service.lease(Z, "w1", max_jobs=3))
        assert set(self.jobs) == set(self.ids)
        await report(self.service, deferred(self.jobs.pop("a@one.test")))
        assert counts(self.store) == {"ready": 2, "leased": 2, "deferred": 1, "held": 0}

    async def defer(self, address: str) -> None:
        await report(self.service, deferred(self.jobs.pop(address)))

    async def due_now(self) -> set[str]:
        """Who goes out now, the clock where it was (no promotion: due means ready)."""
        await self.store.drain()
        jobs = await self.service.lease(Z, "w2", max_jobs=10)
        return set(by_address(jobs))


async def started(store: QueueStore) -> World:
    world = World(store)
    await world.start()
    return world


@pytest.mark.parametrize(
    ("retry", "count", "due"),
    [
        (_message, 1, {"b@one.test"}),
        (_zone, 3, {"a@one.test", "b@one.test", "c@two.test"}),
        (_domain, 2, {"a@one.test", "b@one.test"}),
        (_zone_domain, 2, {"a@one.test", "b@one.test"}),
    ],
    ids=["message", "zone", "domain", "zone and domain"],
)
@async_test
async def test_a_retry_while_on_the_wire_makes_the_deferral_due_now(
    store: QueueStore, retry: Retry, count: int, due: set[str]
) -> None:
    world = await started(store)
    assert await retry(world.admin, world.ids) == count  # deferred and on the wire alike
    await world.defer("b@one.test")
    await world.defer("c@two.test")
    assert await world.due_now() == due
    for address, msg in world.ids.items():
        state, record = record_of(store, msg)
        assert record.attempts == 1  # each attempt is on record whatever the retry
        if address in due:
            assert (state, record.next_attempt_ms) == (State.LEASED, 0)
        else:  # out of the retry's scope: its full delay
            assert state is State.DEFERRED
            assert record.next_attempt_ms > world.clock.now + MINUTE
    kinds = [event.kind for _, event in store.events()]
    assert kinds.count(EventKind.DEFERRED) == 3
    await assert_consistent(store)


@pytest.mark.parametrize("result", [Result.DELIVERED, Result.BOUNCED, Result.RETURNED])
@async_test
async def test_an_attempt_that_does_not_defer_takes_the_retry_with_it(
    store: QueueStore, result: Result
) -> None:
    """The retry was for that attempt: a given-back job is ready at once anyway, and its
    next attempt, once deferred, waits its normal delay."""
    world = await started(store)
    assert await world.admin.retry_message(world.ids["b@one.test"]) == 1
    job = world.jobs.pop("b@one.test")
    reply = {Result.DELIVERED: "250 ok", Result.BOUNCED: "550 5.1.1 no such user"}
    await report(world.service, outcome(job, result, reply=reply.get(result, "")))
    await store.drain()
    assert store._retry_marks == {}  # nothing left behind to retry a later attempt early
    if result is Result.RETURNED:
        (again,) = await world.service.lease(Z, "w1", max_jobs=5)
        await report(world.service, deferred(again))
        await world.defer("c@two.test")
        assert await world.due_now() == set()
        state, record = record_of(store, world.ids["b@one.test"])
        assert state is State.DEFERRED and record.next_attempt_ms > world.clock.now + MINUTE
    await assert_consistent(store)


async def _deleted(admin: QueueAdmin, msg: int) -> None:
    assert await admin.delete(msg) == 1


async def _purged(admin: QueueAdmin, msg: int) -> None:
    assert await admin.purge(Selection(zone=Z, recipient_domain="one.test")) == 2


async def _held(admin: QueueAdmin, msg: int) -> None:
    held = await admin.hold_message(msg, "complaint")
    assert (held.now, held.on_return) == (0, 1)


@pytest.mark.parametrize("act", [_deleted, _purged, _held], ids=["delete", "purge", "hold"])
@async_test
async def test_a_delete_purge_or_hold_forgets_the_retry(
    store: QueueStore, act: Callable[[QueueAdmin, int], Awaitable[None]]
) -> None:
    world = await started(store)
    assert await world.admin.retry(Z) == 3
    msg = world.ids["b@one.test"]
    await act(world.admin, msg)
    b_key = keys.record(keys.READY, Z, msg, "b@one.test")
    assert b_key not in store._retry_marks
    job = world.jobs.pop("b@one.test")
    accepted, refused = await world.service.report("w1", deferred(job))
    if act is _held:  # its attempt ends held, not ready: the hold came after the retry
        assert refused == [] and len(accepted) == 1
        await store.drain()
        assert record_of(store, msg)[0] is State.HELD
    else:  # revoked with its record
        assert accepted == []
    await world.defer("c@two.test")  # the other mark still stands
    assert "c@two.test" in await world.due_now()
    await assert_consistent(store)


@async_test
async def test_a_retry_twice_while_on_the_wire_counts_it_each_time(store: QueueStore) -> None:
    """The API's 409 for a message comes only when nothing is deferred or on the wire."""
    world = await started(store)
    msg = world.ids["c@two.test"]
    assert await world.admin.retry_message(msg) == 1
    assert await world.admin.retry_message(msg) == 1  # still on the wire: still to retry
    await world.defer("c@two.test")
    assert await world.due_now() == {"c@two.test"}
    await report(world.service, returned(world.jobs.pop("b@one.test")))
    await store.drain()
    # c is leased again by due_now: a new attempt, counted for a new retry.
    assert await world.admin.retry_message(msg) == 1
    await assert_consistent(store)


@async_test
async def test_a_retry_leaves_a_hold_on_return_alone(store: QueueStore) -> None:
    """A hold that came first wins: a retry resets delays, it never releases a hold."""
    world = await started(store)
    msg = world.ids["b@one.test"]
    held = await world.admin.hold_message(msg, "complaint")
    assert (held.now, held.on_return) == (0, 1)
    assert await world.admin.retry_message(msg) == 0  # nothing it may retry: the API's 409
    assert await world.admin.retry(Z, "one.test") == 1  # a, deferred; b stays to be held
    await world.defer("b@one.test")
    await store.drain()
    assert record_of(store, msg)[0] is State.HELD
    assert await world.due_now() == {"a@one.test"}
    await assert_consistent(store)


@async_test
async def test_a_lease_ended_by_a_hold_takes_the_retry_with_it(store: QueueStore) -> None:
    """A damaged message's leases end held (the service's quarantine, ``hold_leased``)."""
    msg = await queue_message(store, [("a@one.test", Z)])
    (lease,) = store.lease(Z, 1, "w1")
    assert await store.retry_now(Z, msg_id=msg) == 1
    await store.hold_leased(lease, "damaged body", T0, Outcome(reply="451 4.3.0 local"))
    await store.drain()
    assert store._retry_marks == {}
    assert record_of(store, msg)[0] is State.HELD
    await assert_consistent(store)
