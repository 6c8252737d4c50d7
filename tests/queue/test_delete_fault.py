"""A delete of a recipient on the wire, with the queue storage failing around it.

Real LevelDB directories; ``FaultyDatabase`` (tests/storage/conftest.py) fails the writes.
A delete whose batch fails never happened: the recipient is still queued and its delivery
still on the wire, so its 250 completes it once the storage heals, and it is not handed out
again; but one its worker finished with undelivered meanwhile (deferred, bounced, returned,
or gone with its connection) is ready again, for another.  A delete that landed stays, and
the 250 reported after it is on record (its DELIVERED event) even when the storage fails
before that event is written.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from tests.queue.test_delete_in_flight import REPLY, TEXT, assert_nothing_queued, outcome_events
from tests.queue.test_service import Clock, Z, outcome, service_for
from tests.storage.conftest import (
    T0,
    FaultyDatabase,
    StoreFactory,
    assert_consistent,
    async_test,
    queue_message,
)
from tests.storage.test_held import break_disk, heal
from zoneq.errors import LeaseError, StorageUnavailable
from zoneq.protocol.events import EventKind
from zoneq.queue.service import QueueService, Result
from zoneq.storage.base import Lease, Outcome
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration


def faulty_world(stores: StoreFactory) -> tuple[QueueStore, FaultyDatabase, QueueService]:
    """A store on a ``FaultyDatabase`` and the queue service over it."""
    store = stores.open(faulty=True)
    return store, stores.faulty(store), service_for(store, Clock())


async def delete(store: QueueStore, how: str, msg_id: int) -> None:
    """An administrator's delete of the message's one recipient: ``queue delete`` or a purge."""
    if how == "drop":
        await store.drop(msg_id, T0 + 1)
    else:
        await store.drop_many(store.recipients(msg_id), T0 + 1)


@pytest.mark.parametrize("how", ["drop", "purge"])
@async_test
async def test_a_failed_delete_leaves_the_delivery_on_the_wire_to_complete(
    stores: StoreFactory, how: str
) -> None:
    store, db, service = faulty_world(stores)
    msg_id = await queue_message(store, [("a@one.test", Z)])
    (job,) = await service.lease(Z, "w1")
    db.fail_writes = 1  # the delete's own batch fails (a full disk, say)
    with pytest.raises(StorageUnavailable):
        await delete(store, how, msg_id)
    # Nothing was deleted: the recipient is still queued, and still leased to w1.
    assert (store.count(Z, State.READY), store.count(Z, State.LEASED)) == (1, 1)
    token = job.recipients[0].token
    reported = outcome(job, Result.DELIVERED, reply=TEXT, **REPLY)
    assert await service.report("w1", reported) == ([token], [])  # held until the heal
    await heal(store, db)
    assert await service.lease(Z, "w2") == []  # not handed out a second time
    assert [e.kind for e in outcome_events(store, "a@one.test")] == [EventKind.DELIVERED]
    assert_nothing_queued(store, msg_id)
    await assert_consistent(store)


@pytest.mark.parametrize("fault", ["disk broken before the report", "its own write fails"])
@async_test
async def test_a_delivery_after_a_delete_is_on_record_after_the_storage_heals(
    stores: StoreFactory, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    store, db, service = faulty_world(stores)
    msg_id = await queue_message(store, [("a@one.test", Z), ("keep@one.test", Z)])
    (job,) = await service.lease(Z, "w1")
    assert await store.drop(msg_id, T0 + 1, address="a@one.test") == 1
    await store.drain()
    if fault == "disk broken before the report":
        await break_disk(store, db)
    else:
        db.unavailable = True  # the report's batch is the first to fail
    tokens = {r.address: r.token for r in job.recipients}
    reported = outcome(job, Result.DELIVERED, reply=TEXT, **REPLY)
    with caplog.at_level(logging.WARNING, logger="zoneq.queue"):
        accepted, refused = await service.report("w1", reported)
    await store.drain()
    assert (accepted, refused) == ([tokens["keep@one.test"]], [tokens["a@one.test"]])
    assert "not written" not in caplog.text  # refused for its delete, not lost
    assert store.held == 2
    await heal(store, db)
    assert [e.kind for e in outcome_events(store, "a@one.test")] == [
        EventKind.DROPPED,
        EventKind.DELIVERED,
    ]
    assert [e.kind for e in outcome_events(store, "keep@one.test")] == [EventKind.DELIVERED]
    assert_nothing_queued(store, msg_id)
    await assert_consistent(store)


@pytest.mark.parametrize("how", ["drop", "purge"])
@async_test
async def test_a_landed_delete_gives_no_lease_back_when_the_storage_fails_later(
    stores: StoreFactory, how: str
) -> None:
    store, db, service = faulty_world(stores)
    msg_id = await queue_message(store, [("a@one.test", Z), ("b@one.test", Z)])
    assert len(await service.lease(Z, "w1")) == 1  # both on the wire
    await delete(store, how, msg_id)
    await break_disk(store, db)
    # Only a delete that failed puts its leases back; this one landed, and the two
    # recipients are gone for good (a lease back would hold a record that is not there).
    assert store.count(Z, State.LEASED) == 0
    await heal(store, db)
    assert_nothing_queued(store, msg_id)


@async_test
async def test_a_delivery_reported_while_a_failing_delete_is_written_completes_after_the_heal(
    stores: StoreFactory,
) -> None:
    """The 250 comes while the delete's batch is being written (its lease revoked, so it is
    taken as a delivery after a delete), and then that batch fails: the delete never
    happened, and the delivery completes the recipient once the storage heals."""
    store, db, service = faulty_world(stores)
    msg_id = await queue_message(store, [("a@one.test", Z)])
    (job,) = await service.lease(Z, "w1")
    db.gate = threading.Event()
    db.entered.clear()
    db.fail_writes = 1
    deleting = asyncio.ensure_future(store.drop(msg_id, T0 + 1))
    # The delete's batch is being written, held at the gate.
    assert await asyncio.to_thread(db.entered.wait, 10), "the delete's batch was never written"
    reported = outcome(job, Result.DELIVERED, reply=TEXT, **REPLY)
    reporting = asyncio.ensure_future(service.report("w1", reported))
    await asyncio.sleep(0.01)  # its event staged behind the delete
    db.gate.set()
    db.gate = None
    with pytest.raises(StorageUnavailable):
        await deleting
    assert await reporting == ([], [job.recipients[0].token])  # refused: it looked deleted
    await heal(store, db)
    assert await service.lease(Z, "w2") == []  # not handed out a second time
    assert [e.kind for e in outcome_events(store, "a@one.test")] == [EventKind.DELIVERED]
    assert_nothing_queued(store, msg_id)
    await assert_consistent(store)


# A delete's batch failing after the worker reported its recipient undelivered.  The report
# is refused (the lease looked revoked) and the core forgets the token; the failed delete
# then must not lease the record back to that worker, which has moved on: nobody would
# report it, and it would stay leased for good.  It is left ready, to be tried again.

# The reports of a recipient not delivered, by result: the fields a worker sends with it.
UNDELIVERED: dict[Result, dict[str, object]] = {
    Result.DEFERRED: {"reply": "451 4.3.0 later", "code": 451},
    Result.BOUNCED: {"reply": "550 5.1.1 no such user", "code": 550},
    Result.RETURNED: {},
}


async def start_failing_delete(
    store: QueueStore, db: FaultyDatabase, msg_id: int
) -> asyncio.Future[int]:
    """A delete whose batch will fail, returned once that batch is being written (held at
    the gate): its lease revoked, whether the delete happened not yet known."""
    db.gate = threading.Event()
    db.entered.clear()
    db.fail_writes = 1
    deleting = asyncio.ensure_future(store.drop(msg_id, T0 + 1))
    assert await asyncio.to_thread(db.entered.wait, 10), "the delete's batch was never written"
    return deleting


async def fail_delete(db: FaultyDatabase, deleting: asyncio.Future[int]) -> None:
    """Let the delete's batch go on, and fail: the delete never happened."""
    assert db.gate is not None
    db.gate.set()
    db.gate = None
    with pytest.raises(StorageUnavailable):
        await deleting


async def end_undelivered(store: QueueStore, how: str, lease: Lease) -> None:
    """The worker's end of ``lease`` without a delivery, refused for the delete in flight
    (``release_owner``: its connection dropped, nothing of it left to refuse)."""
    if how == "release_owner":
        assert store.release_owner("w1") == 0
        return
    with pytest.raises(LeaseError):
        if how == "defer":
            await store.defer(lease, T0 + 2, T0 + 60_000, Outcome(reply="451 4.3.0 later"))
        elif how == "bounce":
            await store.bounce(lease, T0 + 2, Outcome(reply="550 5.1.1 no such user"))
        elif how == "hold":
            await store.hold_leased(lease, "held by administrator", T0 + 2)
        else:
            store.release(lease)


@pytest.mark.parametrize("how", ["defer", "bounce", "hold", "release", "release_owner"])
@async_test
async def test_an_undelivered_report_during_a_failing_delete_leaves_the_record_ready(
    stores: StoreFactory, how: str
) -> None:
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    msg_id = await queue_message(store, [("a@one.test", Z)])
    (lease,) = store.lease(Z, 1, "w1")
    deleting = await start_failing_delete(store, db, msg_id)
    await end_undelivered(store, how, lease)
    await fail_delete(db, deleting)
    assert store.count(Z, State.LEASED) == 0  # no lease given back to a worker that is done
    await heal(store, db)
    assert (store.count(Z, State.READY), store.count(Z, State.LEASED)) == (1, 0)
    (again,) = store.lease(Z, 1, "w2")  # handed out again, as before the delete
    assert again.recipient.address == "a@one.test"
    assert [e.kind for e in outcome_events(store, "a@one.test")] == []  # no outcome written
    await assert_consistent(store)


@pytest.mark.parametrize("how", [Result.DEFERRED, Result.BOUNCED, Result.RETURNED, "disconnect"])
@async_test
async def test_a_worker_done_during_a_failing_delete_leaves_its_recipient_to_another(
    stores: StoreFactory, how: Result | str
) -> None:
    """Through the service: a ``zoneq queue delete`` whose batch fails while the worker
    reports (or goes away); after the heal the recipient goes out again, to another."""
    store, db, service = faulty_world(stores)
    msg_id = await queue_message(store, [("a@one.test", Z)])
    (job,) = await service.lease(Z, "w1")
    deleting = await start_failing_delete(store, db, msg_id)
    if isinstance(how, Result):
        fields = UNDELIVERED[how]
        token = job.recipients[0].token
        assert await service.report("w1", outcome(job, how, **fields)) == ([], [token])
    else:
        assert service.disconnected("w1") == 1
    await fail_delete(db, deleting)
    await heal(store, db)
    (again,) = await service.lease(Z, "w2")
    assert [r.address for r in again.recipients] == ["a@one.test"]
    assert (store.count(Z, State.READY), store.count(Z, State.LEASED)) == (1, 1)
    await assert_consistent(store)


@async_test
async def test_a_recipient_waiting_for_a_worker_during_a_failing_delete_goes_out_after_the_heal(
    stores: StoreFactory,
) -> None:
    """Its job waits in the service (leased to the core) when the delete revokes its lease;
    a worker's request then leaves it out of the job, and the delete fails: after the heal
    it goes out all the same."""
    store, db, service = faulty_world(stores)
    await queue_message(store, [("a@one.test", Z)])
    msg_id = await queue_message(store, [("b@two.test", Z)])
    (first,) = await service.lease(Z, "w1")  # b@two.test's job waits for the next worker
    assert first.msg_id != msg_id and store.count(Z, State.LEASED) == 2
    deleting = await start_failing_delete(store, db, msg_id)
    assert await service.lease(Z, "w2") == []  # looks deleted: not sent
    await fail_delete(db, deleting)
    await heal(store, db)
    (again,) = await service.lease(Z, "w3")
    assert [r.address for r in again.recipients] == ["b@two.test"]
    await assert_consistent(store)
