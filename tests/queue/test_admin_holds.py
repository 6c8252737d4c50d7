"""Administrators' holds against workers that keep leasing and reporting, on a real store.

A zone's hold walks the zone a page at a time with the event loop free in between; no lease
may take recipients of the zone meanwhile.  A message's hold also covers its recipients on
the wire: delivered or bounced they are done, but an attempt that ends any other way
(deferred, given back, the worker gone, the core restarted) leaves them held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from tests.queue.test_service import Clock, outcome, service_for
from tests.storage.conftest import (
    MINUTE,
    T0,
    StoreFactory,
    assert_consistent,
    async_test,
    message_keys,
    queue_message,
)
from zoneq.errors import StorageUnavailable
from zoneq.protocol.events import EventKind
from zoneq.queue.admin import QueueAdmin, Selection
from zoneq.queue.service import HoldCount, Job, QueueService, RecipientOutcome, Result
from zoneq.storage import keys
from zoneq.storage.base import Lease
from zoneq.storage.holdmarks import HOLD_MARKS
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

Z = "default"
DAY = 24 * 60 * MINUTE


def counts(store: QueueStore) -> dict[str, int]:
    return {state.value: store.count(Z, state) for state in State}


def recipients(jobs: list[Job]) -> int:
    return sum(len(job.recipients) for job in jobs)


@async_test
async def test_a_zone_hold_hands_nothing_out_during_its_walk(store: QueueStore) -> None:
    """2,000 recipients over 20 domains, walked in pages of 100 while a worker asks for a
    job at every turn of the loop: only the job it had before the hold goes out."""
    clock = Clock()
    service = service_for(store, clock, window=500)
    admin = QueueAdmin(store, service, [Z], clock=clock, batch=100)
    for n in range(20):
        await queue_message(store, [(f"u{i}@d{n}.test", Z) for i in range(100)], now_ms=T0 + n)
    before = await service.lease(Z, "w1", max_jobs=1)  # in the worker's hands: it finishes
    hold = asyncio.ensure_future(admin.hold_zone(Z))
    await asyncio.sleep(0)  # the walk has begun
    during: list[Job] = []
    turns = 0
    while not hold.done():
        during += await service.lease(Z, "w1", max_jobs=1)
        turns += 1
        await asyncio.sleep(0)
    assert turns > 10  # the worker really asked while the walk went on
    assert during == []
    assert await hold == 2000 - recipients(before)
    assert await service.lease(Z, "w2", max_jobs=1000) == []
    assert counts(store) == {"ready": 50, "leased": 50, "deferred": 0, "held": 1950}
    await assert_consistent(store)


@async_test
async def test_a_zone_hold_leaves_nothing_leased_to_the_core(store: QueueStore) -> None:
    """One domain with one connection: a lease during the walk used to refill the core's
    job queue, and those recipients went out after the hold answered."""
    clock = Clock()
    service = service_for(store, clock, domain_connections=1)
    admin = QueueAdmin(store, service, [Z], clock=clock, batch=100)
    for n in range(10):
        await queue_message(store, [(f"u{i}@one.test", Z) for i in range(100)], now_ms=T0 + n)
    hold = asyncio.ensure_future(admin.hold_zone(Z))
    await asyncio.sleep(0)  # the walk has held its first page and yielded
    assert await service.lease(Z, "w1", max_jobs=1) == []
    assert await hold == 1000
    assert service._zones[Z].queue.recipients() == 0
    assert store.leased(Z) == 0
    assert await service.lease(Z, "w1", max_jobs=100) == []
    await assert_consistent(store)


@async_test
async def test_a_zone_hands_out_again_after_its_hold_but_not_while_paused(
    store: QueueStore,
) -> None:
    """The hold's stop ends with the walk (new mail goes out), and neither a resume during
    the walk nor the walk's end lifts an administrator's pause."""
    clock = Clock()
    service = service_for(store, clock)
    admin = QueueAdmin(store, service, [Z], clock=clock, batch=10)
    for n in range(5):
        await queue_message(store, [(f"u{i}@d{n}.test", Z) for i in range(10)], now_ms=T0 + n)
    hold = asyncio.ensure_future(admin.hold_zone(Z))
    await asyncio.sleep(0)
    await admin.resume(Z)  # not paused: the walk still stops the zone
    assert await service.lease(Z, "w1", max_jobs=5) == []
    assert await hold == 50
    await queue_message(store, [("late@new.test", Z)])
    (job,) = await service.lease(Z, "w1", max_jobs=5)  # mail queued after the hold's walk
    assert [r.address for r in job.recipients] == ["late@new.test"]
    await service.report("w1", [RecipientOutcome(job.recipients[0].token, Result.RETURNED)])
    await admin.pause(Z)
    await admin.hold_zone(Z)
    await queue_message(store, [("later@new.test", Z)])
    assert await service.lease(Z, "w1", max_jobs=5) == []  # still paused
    await admin.resume(Z)
    assert recipients(await service.lease(Z, "w1", max_jobs=5)) == 1
    await assert_consistent(store)


def deferred(job: Job) -> list[RecipientOutcome]:
    return [
        RecipientOutcome(r.token, Result.DEFERRED, reply="451 4.3.0 later", code=451)
        for r in job.recipients
    ]


def returned(job: Job) -> list[RecipientOutcome]:
    return [RecipientOutcome(r.token, Result.RETURNED) for r in job.recipients]


async def report(service: QueueService, outcomes: list[RecipientOutcome]) -> None:
    accepted, refused = await service.report("w1", outcomes)
    assert refused == [] and len(accepted) == len(outcomes)


Ending = Callable[[QueueService, Job], Awaitable[None]]


async def defer_it(service: QueueService, job: Job) -> None:
    await report(service, deferred(job))


async def return_it(service: QueueService, job: Job) -> None:
    await report(service, returned(job))


async def disconnect(service: QueueService, job: Job) -> None:
    assert service.disconnected("w1") == len(job.recipients)
    await asyncio.sleep(0)  # the hold of a gone worker's leases is a task of its own


@pytest.mark.parametrize(
    ("ending", "attempted"),
    [(defer_it, True), (return_it, False), (disconnect, False)],
    ids=["deferred", "returned", "worker gone"],
)
@async_test
async def test_a_message_hold_holds_its_recipients_on_the_wire_when_they_come_back(
    store: QueueStore, ending: Ending, attempted: bool
) -> None:
    clock = Clock()
    service = service_for(store, clock)
    admin = QueueAdmin(store, service, [Z], clock=clock)
    msg = await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    (job, waiting) = await service.lease(Z, "w1", max_jobs=2)
    await report(service, returned(waiting))  # b is ready again: held at once
    assert await admin.hold_message(msg, "complaint #9") == HoldCount(now=1, on_return=1)
    await ending(service, job)
    await store.drain()
    assert counts(store) == {"ready": 0, "leased": 0, "deferred": 0, "held": 2}
    (a,) = [q.recipient for q in store.recipients(msg) if q.recipient.address == "a@one.test"]
    assert (a.hold_reason, a.attempts, a.next_attempt_ms) == ("complaint #9", int(attempted), 0)
    kinds = [event.kind for _, event in store.events()]
    assert kinds.count(EventKind.DEFERRED) == int(attempted)  # the attempt is on record
    clock.now = T0 + DAY
    await service.promote_due()
    assert await service.lease(Z, "w1", max_jobs=5) == []  # held: nothing goes out
    await assert_consistent(store)


@pytest.mark.parametrize("result", [Result.DELIVERED, Result.BOUNCED])
@async_test
async def test_a_delivered_or_bounced_recipient_on_the_wire_is_done(
    stores: StoreFactory, result: Result
) -> None:
    store = stores.open()
    clock = Clock()
    service = service_for(store, clock)
    msg = await queue_message(store, [("a@one.test", Z), ("b@one.test", Z)])
    (job,) = await service.lease(Z, "w1", max_jobs=1)
    assert await service.hold(msg) == HoldCount(now=0, on_return=2)
    reply = "550 5.1.1 no such user" if result is Result.BOUNCED else "250 ok"
    await report(service, [RecipientOutcome(r.token, result, reply=reply) for r in job.recipients])
    await store.drain()
    assert counts(store) == {"ready": 0, "leased": 0, "deferred": 0, "held": 0}
    await assert_consistent(store)
    # The hold's marks on disk outlive the outcome; a restart finds nothing to hold.
    await store.close()
    again = stores.open()
    assert {state.value: again.count(Z, state) for state in State}["held"] == 0
    assert not [k for k in again.database.keys(prefix=keys.META) if b"hold-on-return" in k]


@async_test
async def test_a_restart_mid_attempt_keeps_the_hold(stores: StoreFactory) -> None:
    """A lease does not survive a restart: the recipient of a message held while it was on
    the wire would be ready again, and go out.  The hold's mark on disk holds it."""
    store = stores.open()
    clock = Clock()
    service = service_for(store, clock)
    msg = await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    jobs = await service.lease(Z, "w1", max_jobs=2)
    assert recipients(jobs) == 2
    assert await service.hold(msg, "legal") == HoldCount(now=0, on_return=2)
    await store.close()  # the core stops with both attempts unreported
    again = stores.open()
    assert {state.value: again.count(Z, state) for state in State} == {
        "ready": 0,
        "leased": 0,
        "deferred": 0,
        "held": 2,
    }
    assert {q.recipient.hold_reason for q in again.recipients(msg)} == {"legal"}
    assert await service_for(again, clock).lease(Z, "w1", max_jobs=5) == []
    await assert_consistent(again)
    await again.close()
    third = stores.open()  # the marks went with the move: nothing is held twice
    assert third.count(Z, State.HELD) == 2
    await assert_consistent(third)


def state_of(store: QueueStore, msg: int, address: str) -> State:
    (found,) = [q.state for q in store.recipients(msg) if q.recipient.address == address]
    return found


@async_test
async def test_a_recipient_given_back_by_the_hold_is_held_whatever_leases_meanwhile(
    store: QueueStore,
) -> None:
    """a is on the wire; b waits in the core's job queue.  The hold gives b back and holds
    it before anything else runs: a lease during the hold's synced write finds nothing."""
    clock = Clock()
    service = service_for(store, clock)
    msg = await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    (job_a,) = await service.lease(Z, "w1", max_jobs=1)
    assert [r.address for r in job_a.recipients] == ["a@one.test"]
    hold = asyncio.ensure_future(service.hold(msg, "legal"))
    await asyncio.sleep(0)  # the hold awaits its synced write
    assert await service.lease(Z, "w2", max_jobs=5) == []
    assert await hold == HoldCount(now=1, on_return=1)
    await store.drain()
    assert state_of(store, msg, "b@two.test") is State.HELD
    await assert_consistent(store)


@pytest.mark.parametrize("result", [Result.DEFERRED, Result.RETURNED])
@async_test
async def test_a_hold_between_a_reports_claim_and_its_write_still_holds(
    store: QueueStore, result: Result
) -> None:
    """A report takes its token from the service at once but writes its outcome in a task
    later; a hold in between still finds the store's lease, marks it, and the outcome
    written after it holds the recipient (409 "nothing to hold" was the answer before)."""
    clock = Clock()
    service = service_for(store, clock)
    msg = await queue_message(store, [("a@one.test", Z)])
    (job,) = await service.lease(Z, "w1")
    fields = {"reply": "451 4.4.1 busy", "code": 451} if result is Result.DEFERRED else {}
    reported = asyncio.ensure_future(service.report("w1", outcome(job, result, **fields)))
    hold = asyncio.ensure_future(service.hold(msg))
    accepted, refused = await reported
    assert (len(accepted), refused) == (1, [])
    assert await hold == HoldCount(now=0, on_return=1)
    await store.drain()
    assert state_of(store, msg, "a@one.test") is State.HELD
    clock.now = T0 + DAY
    await service.promote_due()
    assert await service.lease(Z, "w1") == []
    await assert_consistent(store)


@async_test
async def test_a_release_then_a_restart_does_not_hold_by_a_stale_mark(stores: StoreFactory) -> None:
    store = stores.open()
    clock = Clock()
    service = service_for(store, clock)
    msg = await queue_message(store, [("a@one.test", Z)])
    await service.lease(Z, "w1", max_jobs=1)
    assert await service.hold(msg) == HoldCount(now=0, on_return=1)
    await store.unhold(msg)
    await store.close()
    again = stores.open()
    assert (again.count(Z, State.HELD), again.count(Z, State.READY)) == (0, 1)


@async_test
async def test_a_delete_takes_the_hold_on_return_with_it(stores: StoreFactory) -> None:
    store = stores.open()
    service = service_for(store, Clock())
    msg = await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    await service.lease(Z, "w1", max_jobs=2)
    assert await service.hold(msg) == HoldCount(now=0, on_return=2)
    assert await store.drop(msg, T0, "a@one.test") == 1
    await store.drain()
    marks = list(store.database.keys(prefix=keys.meta("hold-on-return")))
    assert [m for m in marks if b"a@one.test" in m] == []
    assert len(marks) == 1  # b's stays: it is still on the wire and still held


@async_test
async def test_a_zone_hold_holds_an_in_flight_deferral_when_it_returns(store: QueueStore) -> None:
    clock = Clock()
    service = service_for(store, clock)
    admin = QueueAdmin(store, service, [Z], clock=clock)
    msg = await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    (job,) = await service.lease(Z, "w1", max_jobs=1)
    assert await admin.hold_zone(Z, "zone maintenance") == 1
    await report(service, outcome(job, Result.DEFERRED, reply="451 4.4.1 busy", code=451))
    await store.drain()
    assert state_of(store, msg, "a@one.test") is State.HELD
    clock.now = T0 + DAY
    await service.promote_due()
    assert await service.lease(Z, "w1") == []
    assert {q.recipient.hold_reason for q in store.recipients(msg)} == {"zone maintenance"}
    await assert_consistent(store)


@async_test
async def test_a_failed_hold_leaves_no_mark(stores: StoreFactory) -> None:
    """A hold answered with an error (its synced write failed) must not hold anything on
    return: the administrator was told it did not happen."""
    store = stores.open(faulty=True)
    service = service_for(store, Clock())
    msg = await queue_message(store, [("a@one.test", Z)])
    await service.lease(Z, "w1")
    stores.faulty(store).fail_writes = 1
    with pytest.raises(StorageUnavailable):
        await service.hold(msg)
    assert store._hold_marks == {}


@pytest.mark.parametrize("released", ["zone", "message"])
@pytest.mark.parametrize("held_by", ["zone", "message"])
@pytest.mark.parametrize(
    ("ending", "after"),
    [(defer_it, {"ready": 1, "deferred": 1}), (return_it, {"ready": 2, "deferred": 0})],
    ids=["deferred", "returned"],
)
@async_test
async def test_a_release_cancels_the_hold_on_return(
    stores: StoreFactory, released: str, held_by: str, ending: Ending, after: dict[str, int]
) -> None:
    """a is on the wire when its zone (or its message) is held, and the zone (or the
    message) is released before a's attempt ends: a ends deferred (or ready), not held;
    and no mark is left on disk to hold it at the next start."""
    store = stores.open()
    clock = Clock()
    service = service_for(store, clock)
    admin = QueueAdmin(store, service, [Z], clock=clock)
    msg = await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    (job,) = await service.lease(Z, "w1", max_jobs=1)
    assert [r.address for r in job.recipients] == ["a@one.test"]
    if held_by == "zone":
        assert await admin.hold_zone(Z, "zone maintenance") == 1
    else:
        assert await admin.hold_message(msg) == HoldCount(now=1, on_return=1)
    assert len(list(store.database.keys(prefix=HOLD_MARKS))) == 1  # a's, synced
    if released == "zone":
        assert await admin.release_zone(Z) == 1
    else:
        assert await admin.release_message(msg) == HoldCount(now=1, on_return=1)
    await ending(service, job)
    await store.drain()
    assert counts(store) == {"leased": 0, "held": 0, **after}
    assert {q.recipient.hold_reason for q in store.recipients(msg)} == {""}
    await assert_consistent(store)
    await store.close()
    again = stores.open()
    assert again.count(Z, State.HELD) == 0
    assert not list(again.database.keys(prefix=HOLD_MARKS))


@async_test
async def test_a_zone_release_keeps_the_marks_of_other_zones(store: QueueStore) -> None:
    """Only the released zone's marks go: a message held while on the wire in another zone
    is still held when its attempt there ends."""
    clock = Clock()
    service = service_for(store, clock)
    admin = QueueAdmin(store, service, [Z, "bulk"], clock=clock)
    msg = await queue_message(store, [("a@one.test", Z), ("b@two.test", "bulk")])
    (in_z,) = await service.lease(Z, "w1", max_jobs=1)
    (in_bulk,) = await service.lease("bulk", "w1", max_jobs=1)
    assert await admin.hold_message(msg) == HoldCount(now=0, on_return=2)
    assert await admin.release_zone(Z) == 0
    await defer_it(service, in_z)
    await defer_it(service, in_bulk)
    await store.drain()
    assert state_of(store, msg, "a@one.test") is State.DEFERRED
    assert state_of(store, msg, "b@two.test") is State.HELD
    await assert_consistent(store)


async def _orphaned(store: QueueStore, msg: int, leases: list[Lease]) -> None:
    # The message goes from under its records, as a version that let a delete race a
    # move left it (``tests/queue/test_orphans.py``); the service then drops the orphans.
    store.database.write([(key, None) for key in message_keys(store, msg)], sync=True)
    assert store.drop_orphans(msg, leases, T0 + 1) == len(leases)


async def _deleted(store: QueueStore, msg: int, leases: list[Lease]) -> None:
    assert await store.drop(msg, T0 + 1) == len(leases)


async def _purged(store: QueueStore, msg: int, leases: list[Lease]) -> None:
    clock = Clock()
    admin = QueueAdmin(store, service_for(store, clock), [Z], clock=clock)
    assert await admin.purge(Selection(zone=Z)) == len(leases)


Removal = Callable[[QueueStore, int, list[Lease]], Awaitable[None]]


@pytest.mark.parametrize(
    "remove", [_orphaned, _deleted, _purged], ids=["orphans dropped", "deleted", "purged"]
)
@async_test
async def test_no_hold_on_return_outlives_its_recipient(
    stores: StoreFactory, remove: Removal
) -> None:
    """Leased recipients of a held message, marked, then removed from the queue: every
    removal takes the mark with it, in memory and on disk."""
    store = stores.open()
    msg = await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    leases = list(store.lease(Z, 10, "w1"))
    assert len(leases) == 2
    assert await store.hold_counted(msg, "legal") == (0, 2)
    assert len(store._hold_marks) == len(list(store.database.keys(prefix=HOLD_MARKS))) == 2
    await remove(store, msg, leases)
    await store.drain()
    assert store._hold_marks == {}
    assert list(store.database.keys(prefix=HOLD_MARKS)) == []
    assert store.leased() == store.count(Z, State.READY) == 0
    await store.close()
    again = stores.open()
    assert again._hold_marks == {}
    assert again.count(Z, State.HELD) == again.count(Z, State.READY) == 0
