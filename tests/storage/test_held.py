"""Outcomes held while the database cannot write (``zoneq/storage/held.py``, issue 7).

Real LevelDB directories; ``FaultyDatabase`` (conftest) makes a write, a sync or the whole
disk fail the way LevelDB reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator

import pytest

from tests.storage.conftest import (
    SECOND,
    T0,
    FaultyDatabase,
    StoreFactory,
    assert_consistent,
    async_test,
    make_meta,
    queue_message,
    rcpts,
)
from zoneq.errors import LeaseError, StorageUnavailable
from zoneq.protocol.events import EventKind
from zoneq.storage import keys
from zoneq.storage.base import Lease
from zoneq.storage.records import Notice, State
from zoneq.storage.store import Outcome, QueueStore

BOUNCES = "bounces"
Z = "default"
OK = Outcome(reply="250 2.0.0 ok", code=250, enhanced="2.0.0")


def addresses(n: int, domain: str = "example.org") -> list[tuple[str, str]]:
    return [(f"user{i}@{domain}", Z) for i in range(n)]


def failed_store(stores: StoreFactory) -> tuple[QueueStore, FaultyDatabase]:
    store = stores.open(faulty=True)
    return store, stores.faulty(store)


async def break_disk(store: QueueStore, db: FaultyDatabase) -> None:
    """Fail the store with a disk that stays bad (every write, sync and open refused)."""
    db.unavailable = True
    with pytest.raises(StorageUnavailable):
        await queue_message(store, addresses(1, domain="trigger.example"))
    assert store.failure is not None


async def heal(store: QueueStore, db: FaultyDatabase) -> None:
    db.unavailable = False
    store._next_reopen = 0.0  # not a second later: the test's clock is not the point
    store.lease("none", 1, "w")  # the first operation reopens
    assert store.failure is None
    await store.drain()


def notice() -> Notice:
    return Notice(
        meta=make_meta(0, sender="", is_bounce=True),
        recipients=rcpts(("sender@example.org", BOUNCES)),
        body=b"dsn",
    )


async def report(store: QueueStore, how: str, lease: Lease, now_ms: int = T0) -> None:
    if how == "complete":
        await store.complete(lease, now_ms, OK)
    elif how == "defer":
        await store.defer(lease, now_ms, now_ms + 60 * SECOND, Outcome(reply="451 later"))
    else:
        await store.bounce(lease, now_ms, Outcome(reply="550 no"), notice=notice())


# (report, the recipient's state after, DSNs queued, the event)
OUTCOMES = [
    ("complete", None, 0, EventKind.DELIVERED),
    ("defer", State.DEFERRED, 0, EventKind.DEFERRED),
    ("bounce", None, 1, EventKind.BOUNCED),
]


@pytest.mark.parametrize(("how", "state", "dsns", "kind"), OUTCOMES)
@async_test
async def test_an_outcome_reported_while_failed_is_held_then_written_once(
    stores: StoreFactory, how: str, state: State | None, dsns: int, kind: EventKind
) -> None:
    store, db = failed_store(stores)
    msg_id = await queue_message(store, addresses(2))
    first, second = store.lease(Z, 2, "w")
    await break_disk(store, db)

    await report(store, how, first)
    assert store.held == 1
    # Still out of circulation: a scan while failed does not hand it out again.
    assert store.lease(Z, 10, "w") == []
    assert store.holds(first) and store.holds(second)

    await heal(store, db)
    assert store.held == 0
    assert not store.holds(first)  # written: the lease is over
    assert store.holds(second)  # still out, and its report is taken after the reopen
    events = [e for _, e in store.events() if e.recipient == first.recipient.address]
    assert [e.kind for e in events] == [kind]
    assert events[-1].time_ms == T0  # the time it was reported, not the time written
    assert store.count(BOUNCES, State.READY) == dsns
    if state is not None:
        assert store.count(Z, state) == 1
    await store.complete(second, T0, OK)
    if state is None:
        assert store.message_count() == dsns
        assert store.database.get(keys.message_head(msg_id)) is None
    await assert_consistent(store)


@pytest.mark.parametrize(("how", "state", "dsns", "kind"), OUTCOMES)
@async_test
async def test_an_outcome_whose_sync_failed_after_the_log_append_is_not_applied_twice(
    stores: StoreFactory, how: str, state: State | None, dsns: int, kind: EventKind
) -> None:
    # LevelDB appends a batch to its log, then syncs: when the sync fails the batch is in
    # the log and the reopen brings it back.  The held outcome must then be skipped, or
    # the message's head would count the recipient out twice (losing its other one) and
    # a bounce would queue two DSNs.
    store, db = failed_store(stores)
    msg_id = await queue_message(store, addresses(2))
    first, second = store.lease(Z, 2, "w")
    # Hold a write in flight, so the outcome and a synced commit share the next group.
    writes = db.writes
    db.gate = threading.Event()
    db.entered.clear()
    blocker = asyncio.ensure_future(store.write_chunk(store.begin(T0), 0, b"x"))
    for _ in range(5000):
        if db.entered.is_set():
            break
        await asyncio.sleep(0.001)
    assert db.entered.is_set()
    other = store.begin(T0)
    reporting = asyncio.ensure_future(report(store, how, first))
    await asyncio.sleep(0)  # the report stages its writes
    committing = store.commit(make_meta(other, chunks=0), rcpts(("x@example.org", Z)), T0)
    db.fail_syncs = 1
    db.gate.set()
    results = await asyncio.gather(blocker, reporting, committing, return_exceptions=True)
    assert list(results[:2]) == [None, None] and isinstance(results[2], StorageUnavailable)
    assert store.held == 1
    assert db.writes == writes + 2  # both groups reached the log

    await heal(store, db)
    events = [e for _, e in store.events() if e.recipient == first.recipient.address]
    assert [e.kind for e in events] == [kind]
    assert store.count(BOUNCES, State.READY) == dsns
    await store.complete(second, T0, OK)
    if state is None:
        assert store.database.get(keys.message_head(msg_id)) is None
    else:
        assert store.count(Z, state) == 1
    await assert_consistent(store)


@async_test
async def test_leasing_while_failed_is_bounded(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(QueueStore, "MAX_LEASED_WHILE_FAILED", 3)
    store, db = failed_store(stores)
    await queue_message(store, addresses(5))
    await break_disk(store, db)
    assert len(store.lease(Z, 2, "w")) == 2
    assert len(store.lease(Z, 1, "w")) == 1
    with pytest.raises(StorageUnavailable):
        store.lease(Z, 10, "w")
    await heal(store, db)
    assert len(store.lease(Z, 10, "w")) == 2  # the three stay out; the rest go on


@async_test
async def test_a_stale_lease_is_refused_while_failed(stores: StoreFactory) -> None:
    store, db = failed_store(stores)
    await queue_message(store, addresses(1))
    (lease,) = store.lease(Z, 1, "w")
    store.release(lease)
    await break_disk(store, db)
    with pytest.raises(LeaseError):
        await store.complete(lease, T0, OK)
    assert store.held == 0


@async_test
async def test_a_stop_before_the_store_heals_logs_each_held_outcome_as_a_duplicate(
    stores: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # The held outcomes are lost with the process, so those recipients go out again after
    # the restart: RFC 1047's window, widened by the fault, logged in the usual words.
    store, db = failed_store(stores)
    msg_id = await queue_message(store, addresses(2))
    first, second = store.lease(Z, 2, "w")
    await break_disk(store, db)
    await store.complete(first, T0, OK)
    with caplog.at_level(logging.WARNING, logger="zoneq.storage"):
        await store.close()
    assert f"possible duplicate: {msg_id:016x} to {first.recipient.address} via" in caplog.text
    assert second.recipient.address not in caplog.text  # never delivered: nothing to say
    db.unavailable = False
    again = stores.open()
    assert sorted(lease.key for lease in again.lease(Z, 10, "w")) == sorted([first.key, second.key])


@async_test
async def test_a_stop_once_the_disk_is_back_writes_what_was_held(stores: StoreFactory) -> None:
    store, db = failed_store(stores)
    msg_id = await queue_message(store, addresses(1))
    (lease,) = store.lease(Z, 1, "w")
    await break_disk(store, db)
    await store.complete(lease, T0, OK)
    db.unavailable = False
    await store.close()  # tries a last reopen at once, and writes the held outcome
    again = stores.open()
    assert again.lease(Z, 10, "w") == []
    assert again.database.get(keys.message_head(msg_id)) is None
    assert again.counters() == again.recount()


# --- found by a review: the bookkeeping must not depend on the reporting task ---------------


@contextlib.asynccontextmanager
async def busy_session(store: QueueStore) -> AsyncIterator[None]:
    """An SMTP session starting a DATA every loop iteration: any store call reopens a
    failed store once its cause is gone, so the reopen slips in between a failure and
    the resumption of the task whose write failed."""
    stop = False

    async def session() -> None:
        while not stop:
            with contextlib.suppress(StorageUnavailable):
                store.begin(T0)
            await asyncio.sleep(0)

    running = asyncio.ensure_future(session())
    await asyncio.sleep(0)
    try:
        yield
    finally:
        stop = True
        await running


@async_test
async def test_a_reopen_before_the_reporting_task_resumes_still_writes_the_outcome(
    stores: StoreFactory,
) -> None:
    # One transient write error; another task (an SMTP session starting its next DATA)
    # reopens the store before the delivery's own task resumes.  The outcome was held when
    # the failure was noticed, so the reopen writes it.
    store, db = failed_store(stores)
    msg_id = await queue_message(store, addresses(1))
    (lease,) = store.lease(Z, 1, "w")
    async with busy_session(store):
        store._next_reopen = 0.0
        db.fail_writes = 1
        await store.complete(lease, T0, OK)
    await store.drain()
    assert store.failure is None and store.held == 0
    assert store.database.get(keys.message_head(msg_id)) is None
    assert [e.kind for _, e in store.events() if e.recipient] == [EventKind.DELIVERED]
    await assert_consistent(store)


@async_test
async def test_a_deferral_that_reached_the_log_is_applied_once_and_comes_due(
    stores: StoreFactory,
) -> None:
    store, db = failed_store(stores)
    await queue_message(store, addresses(1))
    (lease,) = store.lease(Z, 1, "w")
    async with busy_session(store):
        store._next_reopen = 0.0
        db.fail_syncs = 1  # a synced deferral (it carries a delay notice) reaches the log
        await store.defer(
            lease, T0, T0 + 60 * SECOND, Outcome(reply="451 later"), delay_notice=notice()
        )
    await store.drain()
    assert store.failure is None and store.held == 0
    assert store.count(BOUNCES, State.READY) == 1  # one notice, not two
    assert not store.is_leased(lease.key)
    assert await store.promote_due(Z, T0 + 120 * SECOND) == 1
    (again,) = store.lease(Z, 10, "w")  # due: handed out again
    assert again.key == lease.key
    deferred = [e for _, e in store.events() if e.kind is EventKind.DEFERRED]
    assert len(deferred) == 1
    await assert_consistent(store)


@async_test
async def test_a_report_cancelled_while_its_batch_fails_is_held(stores: StoreFactory) -> None:
    # The IPC server cancels the requests of a worker whose connection dropped.
    store, db = failed_store(stores)
    msg_id = await queue_message(store, addresses(1))
    (lease,) = store.lease(Z, 1, "w")
    db.unavailable = True
    task = asyncio.ensure_future(store.complete(lease, T0, OK))
    await asyncio.sleep(0)  # staged, waiting for its batch
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await store.drain()
    assert store.failure is not None and store.held == 1 and store.is_leased(lease.key)
    await heal(store, db)
    assert store.database.get(keys.message_head(msg_id)) is None


@async_test
async def test_a_reopen_whose_recovery_fails_keeps_the_leases(stores: StoreFactory) -> None:
    store, db = failed_store(stores)
    await queue_message(store, addresses(1))
    (lease,) = store.lease(Z, 1, "w")
    other = store.begin(T0)
    await store.write_chunk(other, 0, b"x")
    db.fail_writes = 1  # the abandon fails: its receiving marker stays, an orphan
    with pytest.raises(StorageUnavailable):
        await store.abandon(other)
    store._next_reopen = 1e18
    await store.complete(lease, T0, OK)
    assert store.held == 1
    store._next_reopen = 0.0
    db.fail_syncs = 1  # the reopen's open works; recovery's synced orphan write fails
    with pytest.raises(StorageUnavailable):
        store._check()
    assert store.is_leased(lease.key)
    assert store.lease(Z, 10, "w") == []  # not handed out twice
    await heal(store, db)
    assert [e.kind for _, e in store.events() if e.recipient] == [EventKind.DELIVERED]
    await assert_consistent(store)
