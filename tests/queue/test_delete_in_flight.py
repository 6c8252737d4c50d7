"""A recipient an administrator deletes while its delivery is on the wire, on a real store.

The delete stands (the DROPPED event, nothing left in the queue) and the worker's report is
refused; but a delivery the remote accepted happened all the same, so its DELIVERED event
is written next to the DROPPED one.  A deferral or a bounce of a deleted recipient stays a
drop: nothing to retry, and no notice for a message the sender's side deleted.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.queue.test_service import BOUNCES, Clock, Z, outcome, service_for
from tests.storage.conftest import T0, assert_consistent, async_test, queue_message
from zoneq.errors import NotFound
from zoneq.protocol.events import Event, EventKind
from zoneq.queue.service import Result
from zoneq.storage.base import Outcome
from zoneq.storage.records import NewRecipient, State
from zoneq.storage.store import QueueStore

REPLY = {"mx": "mx.one.test", "source_ip": "127.0.0.7", "code": 250, "enhanced": "2.0.0"}
TEXT = "250 2.0.0 queued as 4Xy"


def outcome_events(store: QueueStore, address: str) -> list[Event]:
    """The events about ``address``, in order (ACCEPTED, written per message, names none)."""
    return [e for _, e in store.events() if e.recipient == address]


def assert_nothing_queued(store: QueueStore, msg_id: int) -> None:
    """The delete stands: no record of the message in any state, no notice queued."""
    with pytest.raises(NotFound):
        store.recipients(msg_id)
    assert store.message_count() == 0
    for zone in (Z, BOUNCES):
        assert [store.count(zone, state) for state in State] == [0] * len(State)


@pytest.mark.parametrize(
    ("result", "fields", "after_drop"),
    [
        pytest.param(
            Result.DELIVERED, {"reply": TEXT, **REPLY}, [EventKind.DELIVERED], id="delivered"
        ),
        # NOTIFY=SUCCESS to a server without DSN: its "relayed" notice is not sent (the
        # message is deleted), but the delivery is on record.
        pytest.param(
            Result.DELIVERED,
            {"reply": TEXT, "relayed": True, **REPLY},
            [EventKind.DELIVERED],
            id="relayed",
        ),
        pytest.param(Result.DEFERRED, {"reply": "451 4.3.0 later", "code": 451}, [], id="deferred"),
        pytest.param(Result.BOUNCED, {"reply": "550 5.1.1 unknown", "code": 550}, [], id="bounced"),
    ],
)
@async_test
async def test_a_delete_on_the_wire_keeps_a_delivery_on_record(
    store: QueueStore,
    caplog: pytest.LogCaptureFixture,
    result: Result,
    fields: dict[str, object],
    after_drop: list[EventKind],
) -> None:
    service = service_for(store, Clock())
    notify = ("SUCCESS", "FAILURE", "DELAY")
    msg_id = await queue_message(store, [NewRecipient("a@one.test", Z, notify=notify)])
    (job,) = await service.lease(Z, "w1")
    assert await store.drop(msg_id, T0 + 1) == 1  # the administrator's ``queue delete``
    with caplog.at_level(logging.INFO, logger="zoneq.storage"):
        accepted, refused = await service.report("w1", outcome(job, result, **fields))
    await store.drain()
    # Refused, as every report on a revoked lease: nothing is left to complete.
    assert (accepted, refused) == ([], [job.recipients[0].token])
    events = outcome_events(store, "a@one.test")
    assert [e.kind for e in events] == [EventKind.DROPPED, *after_drop]
    if after_drop:
        delivered = events[-1]
        assert {name: getattr(delivered, name) for name in REPLY} == REPLY
        assert (delivered.text, delivered.attempt, delivered.size) == (TEXT, 1, job.size)
        assert delivered.message_id == events[0].message_id
        assert "deleted while on the wire, was delivered" in caplog.text
    assert_nothing_queued(store, msg_id)
    assert await service.lease(Z, "w1") == []
    await assert_consistent(store)


@async_test
async def test_one_recipient_deleted_on_the_wire_leaves_the_others_to_complete(
    store: QueueStore,
) -> None:
    service = service_for(store, Clock())
    msg_id = await queue_message(store, [("a@one.test", Z), ("b@one.test", Z)])
    (job,) = await service.lease(Z, "w1")
    assert await store.drop(msg_id, T0 + 1, address="a@one.test") == 1  # ``queue delete ID RCPT``
    reported = outcome(job, Result.DELIVERED, reply=TEXT, **REPLY)
    accepted, refused = await service.report("w1", reported)
    await store.drain()
    tokens = {r.address: r.token for r in job.recipients}
    assert (accepted, refused) == ([tokens["b@one.test"]], [tokens["a@one.test"]])
    assert [e.kind for e in outcome_events(store, "a@one.test")] == [
        EventKind.DROPPED,
        EventKind.DELIVERED,
    ]
    assert [e.kind for e in outcome_events(store, "b@one.test")] == [EventKind.DELIVERED]
    # b's completion was the message's last recipient: the head counted the drop once only.
    assert_nothing_queued(store, msg_id)
    await assert_consistent(store)


@async_test
async def test_a_delete_between_the_report_and_its_write_keeps_the_delivery(
    store: QueueStore,
) -> None:
    """The delete runs after the report took the token but before the completion's own
    write looks at the lease (the event loop runs the delete's task first)."""
    service = service_for(store, Clock())
    msg_id = await queue_message(store, [("a@one.test", Z)])
    (job,) = await service.lease(Z, "w1")
    reporting = asyncio.create_task(
        service.report("w1", outcome(job, Result.DELIVERED, reply=TEXT, **REPLY))
    )
    dropping = asyncio.create_task(store.drop(msg_id, T0 + 1))
    assert await reporting == ([], [job.recipients[0].token])
    assert await dropping == 1
    await store.drain()
    assert [e.kind for e in outcome_events(store, "a@one.test")] == [
        EventKind.DROPPED,
        EventKind.DELIVERED,
    ]
    assert_nothing_queued(store, msg_id)
    await assert_consistent(store)


@async_test
async def test_only_a_lease_revoked_by_a_delete_gets_a_delivery_recorded(
    store: QueueStore,
) -> None:
    """``delivered_after_drop`` writes nothing for a lease still held, or one whose record
    is still there (given back and leased again): those were not deleted."""
    await queue_message(store, [("a@one.test", Z)])
    wire = Outcome(reply=TEXT, code=250, mx="mx.one.test")
    (held,) = store.lease(Z, 1, "w1")
    assert not await store.delivered_after_drop(held, T0 + 1, wire)
    store.release(held)
    (again,) = store.lease(Z, 1, "w2")
    assert not await store.delivered_after_drop(held, T0 + 1, wire)  # the old token
    await store.drain()
    assert outcome_events(store, "a@one.test") == []
    assert store.count(Z, State.LEASED) == 1 and store.holds(again)
    await assert_consistent(store)
