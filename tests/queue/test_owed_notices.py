"""One failure DSN per message, however many jobs its failures came in (``bounces.py``).

A real store on disk and the real ``QueueService``: a bulk message's recipients fail in
several jobs (50 recipients each, one domain each), and the sender gets one DSN listing
them all; failures owed a notice when the store closes are told once after it reopens.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from tests.queue.test_service import BOUNCES, Clock, Z, dsn_of, outcome, service_for
from tests.queue.test_storage_fault import fail, heal
from tests.storage.conftest import (
    MINUTE,
    T0,
    StoreFactory,
    assert_consistent,
    async_test,
    queue_message,
)
from zoneq.config import load_config
from zoneq.queue.service import Job, QueueService, Result
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

REFUSED = {"reply": "550 5.1.1 no such user", "enhanced": "5.1.1"}
DAY = 24 * 60 * MINUTE
BULK = [(f"user{n:03}@dest.test", Z) for n in range(200)]  # four jobs of 50


def listed(dsn: Any) -> list[str]:
    """The Final-Recipient of each per-recipient block (RFC 3464 section 2.3)."""
    status = dsn.get_payload()[1].get_payload()
    return sorted(str(block["Final-Recipient"]) for block in status[1:])


def rfc822(addresses: list[tuple[str, str]] | list[str]) -> list[str]:
    return sorted(f"rfc822; {a if isinstance(a, str) else a[0]}" for a in addresses)


async def jobs_of(service: QueueService, count: int) -> list[Job]:
    jobs = await service.lease(Z, "w1", max_jobs=100)
    assert len(jobs) == count
    return jobs


@async_test
async def test_a_bulk_message_refused_in_four_jobs_gets_one_dsn_listing_all(
    store: QueueStore,
) -> None:
    service = service_for(store, Clock())
    await queue_message(store, BULK)
    jobs = await jobs_of(service, 4)
    for job in jobs[:-1]:
        await service.report("w1", outcome(job, Result.BOUNCED, **REFUSED))
        # Its other jobs are still out: the notice waits for them.
        assert store.count(BOUNCES, State.READY) == 0
    await service.report("w1", outcome(jobs[-1], Result.BOUNCED, **REFUSED))
    assert store.count(BOUNCES, State.READY) == 1
    assert listed(dsn_of(store)) == rfc822(BULK)
    assert store.message_count() == 1  # the DSN; the bounced message and its records gone
    assert store.owed_messages() == []
    await assert_consistent(store)


@async_test
async def test_a_message_failing_at_three_domains_gets_one_dsn(store: QueueStore) -> None:
    service = service_for(store, Clock())
    rcpts = [("a@one.test", Z), ("b@two.test", Z), ("c@three.test", Z)]
    await queue_message(store, rcpts)
    for job in await jobs_of(service, 3):
        await service.report("w1", outcome(job, Result.BOUNCED, **REFUSED))
    assert store.count(BOUNCES, State.READY) == 1
    assert listed(dsn_of(store)) == rfc822(rcpts)
    await assert_consistent(store)


@pytest.mark.parametrize(("wait_s", "at_first"), [(0.0, ["a@one.test"]), (30.0, [])])
@async_test
async def test_a_job_still_out_holds_the_notice_only_for_the_wait(
    store: QueueStore, wait_s: float, at_first: list[str]
) -> None:
    """A slow domain's job holds the other's notice back for ``owed_wait_s`` at most;
    past it, the failures so far are told, and the later ones in a notice of their own."""
    service = QueueService(
        store, load_config(), hostname="mx.zoneq.test", clock=Clock(), owed_wait_s=wait_s
    )
    await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    fast, slow = sorted(await jobs_of(service, 2), key=lambda job: job.domain)
    await service.report("w1", outcome(fast, Result.BOUNCED, **REFUSED))
    assert store.count(BOUNCES, State.READY) == len(at_first)
    if at_first:
        assert listed(dsn_of(store)) == rfc822(at_first)
    await service.report("w1", outcome(slow, Result.BOUNCED, **REFUSED))
    assert store.count(BOUNCES, State.READY) == len(at_first) + 1
    await assert_consistent(store)


@async_test
async def test_failures_owed_when_the_store_closes_are_told_once_after_it_reopens(
    stores: StoreFactory,
) -> None:
    """Three of four jobs fail and the core stops before the fourth is reported (its
    notice still waiting, as at a crash: the owed records are on disk, synced with the
    bounces).  After the reopen the 150 are told in one DSN, once; the fourth job's
    recipients are ready again, and their own failure is told in a second one."""
    store = stores.open()
    service = service_for(store, Clock())
    await queue_message(store, BULK)
    jobs = await jobs_of(service, 4)
    for job in jobs[:-1]:
        await service.report("w1", outcome(job, Result.BOUNCED, **REFUSED))
    assert store.count(BOUNCES, State.READY) == 0
    await store.drain()
    store._writer.close()  # no clean stop: nothing more is composed or written
    store.database.close()

    store = stores.open()
    service = service_for(store, Clock())
    stop = asyncio.Event()
    stop.set()
    await service.run(stop)  # start-up: whatever is owed is told first
    await service.run(stop)  # and only once
    assert store.count(BOUNCES, State.READY) == 1
    told = [r.address for job in jobs[:-1] for r in job.recipients]
    assert listed(dsn_of(store)) == rfc822(told)
    (again,) = await jobs_of(service, 1)
    await service.report("w1", outcome(again, Result.BOUNCED, **REFUSED))
    assert store.count(BOUNCES, State.READY) == 2
    assert store.owed_messages() == []
    await assert_consistent(store)


@async_test
async def test_recipients_expiring_in_several_jobs_get_one_dsn(store: QueueStore) -> None:
    """The clock jumps past the message's lifetime: its recipients at two domains are tried
    once more, in two jobs, and expire (``EXPIRED_STATUS``) into one DSN."""
    clock = Clock()
    service = service_for(store, clock)
    rcpts = [("a@one.test", Z), ("b@two.test", Z)]
    await queue_message(store, rcpts)
    for job in await jobs_of(service, 2):
        await service.report("w1", outcome(job, Result.DEFERRED, reply="451 4.4.1 later"))
    clock.now = T0 + 30 * DAY
    assert await service.promote_due() == 2
    for job in await jobs_of(service, 2):
        await service.report("w1", outcome(job, Result.DEFERRED, reply="451 4.4.1 later"))
    assert store.count(BOUNCES, State.READY) == 1
    dsn = dsn_of(store)
    assert listed(dsn) == rfc822(rcpts)
    await assert_consistent(store)


@async_test
async def test_failures_reported_while_the_store_cannot_write_are_told_after_it_heals(
    stores: StoreFactory,
) -> None:
    """The bounces are held in memory while the database refuses writes (``held.py``), and
    their owed records go to disk with them once it heals: one DSN then, for both jobs."""
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    service = service_for(store, Clock())
    rcpts = [("a@one.test", Z), ("b@two.test", Z)]
    await queue_message(store, rcpts)
    jobs = await jobs_of(service, 2)
    await fail(store, db)
    store._next_reopen = 1e18  # no reopen until the test heals it
    for job in jobs:
        accepted, _ = await service.report("w1", outcome(job, Result.BOUNCED, **REFUSED))
        assert len(accepted) == 1  # held
    heal(store, db)
    await store.drain()
    stop = asyncio.Event()
    stop.set()
    await service.run(stop)
    assert store.count(BOUNCES, State.READY) == 1
    assert listed(dsn_of(store)) == rfc822(rcpts)
    await assert_consistent(store)


@async_test
async def test_a_failure_on_its_way_keeps_the_original_its_notice_needs(
    stores: StoreFactory,
) -> None:
    """The first job's failure is owed (its notice waits for the second job); the second
    job's bounce is staged, its batch not on disk yet, when every owed notice is composed
    (as at start-up).  That bounce found the original on record and did not write it
    again, so the notice composed now must leave it: the second failure gets its DSN."""
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    service = service_for(store, Clock())
    await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    first, second = sorted(await jobs_of(service, 2), key=lambda job: job.domain)
    await service.report("w1", outcome(first, Result.BOUNCED, **REFUSED))
    assert store.count(BOUNCES, State.READY) == 0  # waiting for the second job
    db.gate = threading.Event()  # writes wait: the second bounce stays on its way
    db.entered.clear()
    reported = asyncio.ensure_future(
        service.report("w1", outcome(second, Result.BOUNCED, **REFUSED))
    )
    while not db.entered.is_set():
        await asyncio.sleep(0.01)
    settled = asyncio.ensure_future(service._settle_owed(T0, every=True))
    await asyncio.sleep(0.05)
    db.gate.set()
    await asyncio.gather(reported, settled)
    await store.drain()
    assert store.count(BOUNCES, State.READY) == 2
    assert store.owed_messages() == []
    await assert_consistent(store)
