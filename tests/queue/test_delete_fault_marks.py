"""A hold or a retry of a recipient on the wire, then a delete of it whose write fails.

Real LevelDB directories; ``FaultyDatabase`` (tests/storage/conftest.py) fails the writes.
An administrator holds a message (or asks to retry it now) while a worker has its
recipients: the store marks them, to be held (or due at once) when their attempt ends
undelivered.  A delete of them is then refused, its batch failing: the delete never
happened, the leases are given back (``test_delete_fault.py``), and so must their marks
be, so that a deferral reported afterwards still holds (or readies) its recipient.  A
delete that lands takes the marks with it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest

from tests.queue.test_delete_fault import fail_delete, faulty_world, start_failing_delete
from tests.queue.test_service import Clock, Z, outcome
from tests.storage.conftest import (
    T0,
    FaultyDatabase,
    StoreFactory,
    assert_consistent,
    async_test,
    queue_message,
)
from tests.storage.test_held import heal
from zoneq.errors import StorageUnavailable
from zoneq.queue.admin import QueueAdmin, Selection
from zoneq.queue.service import Job, RecipientOutcome, Result
from zoneq.storage import keys
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

A, B = "a@one.test", "b@one.test"

# An administrator's delete of A, by each route: its message, A alone, a purge of the zone.
DELETES: dict[str, Callable[[QueueAdmin, int], Awaitable[int]]] = {
    "message": lambda admin, msg_id: admin.delete(msg_id),
    "recipient": lambda admin, msg_id: admin.delete(msg_id, A),
    "purge": lambda admin, msg_id: admin.purge(Selection(zone=Z)),
}


class World:
    """A faulty store, its service and admin; a message to A and B, both on the wire."""

    def __init__(self, stores: StoreFactory) -> None:
        self.store, self.db, self.service = faulty_world(stores)
        self.admin = QueueAdmin(self.store, self.service, [Z], clock=Clock())

    async def start(self) -> tuple[int, Job]:
        msg_id = await queue_message(self.store, [(A, Z), (B, Z)])
        (job,) = await self.service.lease(Z, "w1")
        assert len(job.recipients) == 2
        return msg_id, job

    async def mark(self, how: str, msg_id: int) -> None:
        """Hold the message, or ask to retry it now, while its recipients are on the wire."""
        if how == "hold":
            assert (await self.admin.hold_message(msg_id)).on_return == 2
        else:
            assert await self.admin.retry_message(msg_id) == 2

    async def defer_a(self, job: Job) -> None:
        """w1 reports A deferred (451); accepted."""
        deferred = deferral_of_a(job)
        assert await self.service.report("w1", [deferred]) == ([deferred.token], [])


def deferral_of_a(job: Job) -> RecipientOutcome:
    (deferred,) = [
        r
        for r in outcome(job, Result.DEFERRED, reply="451 4.3.0 try later", code=451)
        if job_address(job, r.token) == A
    ]
    return deferred


def key_address(key: bytes) -> str:
    return keys.decode_record(key)[3]


def job_address(job: Job, token: int) -> str:
    (address,) = [r.address for r in job.recipients if r.token == token]
    return address


def state_of_a(store: QueueStore, msg_id: int) -> tuple[State, int, str, int]:
    """A's (state, next attempt, hold reason, attempts)."""
    (queued,) = [q for q in store.recipients(msg_id) if q.recipient.address == A]
    record = queued.recipient
    return queued.state, record.next_attempt_ms, record.hold_reason, record.attempts


# A's state after its deferral, by its mark: held, or ready at once; the attempt on record.
AFTER_DEFERRAL = {
    "hold": (State.HELD, 0, "held by administrator", 1),
    "retry": (State.READY, 0, "", 1),
}


async def fail(db: FaultyDatabase, delete: Awaitable[int]) -> None:
    db.fail_writes = 1  # the delete's own batch fails (a full disk, say)
    with pytest.raises(StorageUnavailable):
        await delete


@pytest.mark.parametrize("route", list(DELETES))
@pytest.mark.parametrize("how", ["hold", "retry"])
@async_test
async def test_a_failed_delete_keeps_the_mark_of_its_recipient_on_the_wire(
    stores: StoreFactory, how: str, route: str
) -> None:
    world = World(stores)
    msg_id, job = await world.start()
    await world.mark(how, msg_id)
    await fail(world.db, DELETES[route](world.admin, msg_id))
    await heal(world.store, world.db)
    assert world.store.count(Z, State.LEASED) == 2  # the delete never happened
    await world.defer_a(job)
    await world.store.drain()
    assert state_of_a(world.store, msg_id) == AFTER_DEFERRAL[how]
    await assert_consistent(world.store)


@pytest.mark.parametrize("how", ["hold", "retry"])
@async_test
async def test_a_deferral_held_while_the_delete_failed_keeps_its_mark(
    stores: StoreFactory, how: str
) -> None:
    """The deferral comes while the store is still failed: held, and made after the heal."""
    world = World(stores)
    msg_id, job = await world.start()
    await world.mark(how, msg_id)
    world.db.unavailable = True  # the delete's batch fails, and the disk stays bad
    with pytest.raises(StorageUnavailable):
        await world.admin.delete(msg_id, A)
    await world.defer_a(job)
    assert world.store.held == 1
    await heal(world.store, world.db)
    assert state_of_a(world.store, msg_id) == AFTER_DEFERRAL[how]
    await assert_consistent(world.store)


@pytest.mark.parametrize("route", list(DELETES))
@pytest.mark.parametrize("how", ["hold", "retry"])
@async_test
async def test_a_landed_delete_takes_the_marks_of_its_recipients(
    stores: StoreFactory, how: str, route: str
) -> None:
    world = World(stores)
    msg_id, _ = await world.start()
    await world.mark(how, msg_id)
    await DELETES[route](world.admin, msg_id)
    await world.store.drain()
    marks = world.store._hold_marks if how == "hold" else world.store._retry_marks
    kept = [B] if route == "recipient" else []
    assert sorted(key_address(key) for key in marks) == kept
    await assert_consistent(world.store)


@pytest.mark.parametrize("how", ["hold", "retry"])
@async_test
async def test_a_delete_that_failed_its_sync_but_landed_takes_the_marks_after_the_heal(
    stores: StoreFactory, how: str
) -> None:
    """The delete's batch goes in a synced group whose fdatasync fails after LevelDB logged
    it: the lease comes back with its mark, and the reopen replays the delete.  A's mark
    must then go with its record, B's (not deleted) stay."""
    world = World(stores)
    msg_id, _ = await world.start()
    other = await queue_message(world.store, [("c@two.test", Z)])
    await world.mark(how, msg_id)
    world.db.gate = threading.Event()
    world.db.entered.clear()
    blocking = asyncio.ensure_future(world.store.drop(other, T0 + 1))  # an unsynced group
    assert await asyncio.to_thread(world.db.entered.wait, 10), "the first group never went"
    # Both staged in the next group, synced for the pause.
    deleting = asyncio.ensure_future(world.admin.delete(msg_id, A))
    pausing = asyncio.ensure_future(world.store.set_paused("elsewhere", True))
    await asyncio.sleep(0)  # both staged
    world.db.fail_syncs = 1
    world.db.gate.set()
    world.db.gate = None
    assert await blocking == 1
    for staged in (deleting, pausing):
        with pytest.raises(StorageUnavailable):
            await staged
    await heal(world.store, world.db)
    marks = world.store._hold_marks if how == "hold" else world.store._retry_marks
    assert sorted(key_address(key) for key in marks) == [B]
    assert [q.recipient.address for q in world.store.recipients(msg_id)] == [B]
    await assert_consistent(world.store)


@pytest.mark.parametrize("how", ["hold", "retry"])
@async_test
async def test_a_deferral_during_a_failing_delete_meets_its_mark_after_the_heal(
    stores: StoreFactory, how: str
) -> None:
    """A's deferral comes while the delete's batch is being written: refused (A looked
    deleted), and A left ready by the failed delete (``test_delete_fault.py``).  Its mark
    still acts once the storage heals: held, or (a retry) ready as it is; B, still on the
    wire, keeps its own."""
    world = World(stores)
    msg_id, job = await world.start()
    await world.mark(how, msg_id)
    deleting = await start_failing_delete(world.store, world.db, msg_id)
    deferred = deferral_of_a(job)
    assert await world.service.report("w1", [deferred]) == ([], [deferred.token])
    await fail_delete(world.db, deleting)
    await heal(world.store, world.db)
    # (Its refused attempt is not on record: its report was not written.)
    assert state_of_a(world.store, msg_id)[:3] == AFTER_DEFERRAL[how][:3]
    assert world.store.count(Z, State.LEASED) == 1
    marks = world.store._hold_marks if how == "hold" else world.store._retry_marks
    assert sorted(key_address(key) for key in marks) == [B]
    await assert_consistent(world.store)
