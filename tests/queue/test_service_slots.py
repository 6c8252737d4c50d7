"""The queue service counts kept idle connections against the limits (issue 5), on a real store.

A worker that keeps a job's connection says so in its report (``kept``); the slot stays its
own, idle, until it says the connection is closed or a job it is granted takes it up.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.queue.test_limits import limited_service
from tests.queue.test_service import Clock, outcome, service_for
from tests.storage.conftest import async_test, queue_message
from zoneq.queue.service import Job, QueueService, Result
from zoneq.storage.store import QueueStore


async def queue_for(store: QueueStore, domain: str, count: int) -> None:
    for n in range(count):
        await queue_message(store, [(f"r{n}@{domain}", "default")])


async def deliver(
    service: QueueService, owner: str, job: Job, *, keep: bool, mx: str | None = None
) -> None:
    accepted, refused = await service.report(
        owner, outcome(job, Result.DELIVERED, mx=mx), kept={job.slot} if keep else set()
    )
    assert refused == [] and len(accepted) == len(job.recipients)


@async_test
async def test_the_worker_holding_an_idle_connection_gets_the_next_job_on_it(
    store: QueueStore,
) -> None:
    service = service_for(store, Clock(), domain_connections=1)
    await queue_for(store, "one.test", 3)
    (first,) = await service.lease("default", "w1", max_jobs=5)
    assert first.slot > 0
    await deliver(service, "w1", first, keep=True)
    # The connection is still open at the MX: a second worker would make it two.
    assert await service.lease("default", "w2", max_jobs=5) == []
    (second,) = await service.lease("default", "w1", max_jobs=5)
    assert second.slot == first.slot  # the same connection, taken up again
    await deliver(service, "w1", second, keep=True)
    # The worker closed it (idle too long): the slot is free for anyone.
    service.closed("default", "w1", [first.slot])
    (third,) = await service.lease("default", "w2", max_jobs=5)
    assert third.slot != first.slot


@pytest.mark.parametrize(
    ("what", "frees"),
    [
        ("nothing", False),
        ("closed", True),
        ("closed by another worker", False),  # only the holder can say so
        ("disconnected", True),
        ("another disconnected", False),
    ],
)
@async_test
async def test_an_idle_slot_is_freed_only_by_its_holder(
    store: QueueStore, what: str, frees: bool
) -> None:
    service = service_for(store, Clock(), domain_connections=1)
    await queue_for(store, "one.test", 2)
    (job,) = await service.lease("default", "w1")
    await deliver(service, "w1", job, keep=True)
    match what:
        case "closed":
            service.closed("default", "w1", [job.slot])
        case "closed by another worker":
            service.closed("default", "w2", [job.slot])
        case "disconnected":
            service.disconnected("w1")
        case "another disconnected":
            service.disconnected("w2")
    assert len(await service.lease("default", "w2")) == (1 if frees else 0)


@async_test
async def test_a_worker_that_keeps_nothing_frees_the_slot_with_its_report(
    store: QueueStore,
) -> None:
    """A worker of the previous release sends no ``kept``: the slot ends with the job."""
    service = service_for(store, Clock(), domain_connections=1)
    await queue_for(store, "one.test", 2)
    (job,) = await service.lease("default", "w1")
    await deliver(service, "w1", job, keep=False)
    assert len(await service.lease("default", "w2")) == 1


@async_test
async def test_a_kept_connection_above_a_learnt_mx_limit_is_closed_and_counted_until_then(
    store: QueueStore,
) -> None:
    service = limited_service(store, Clock())  # mx.shared.test: 2; each domain: 5
    await queue_for(store, "one.test", 6)
    jobs = await service.lease("default", "w1", max_jobs=10)
    assert len(jobs) == 5  # the learning window: the domain's own limit
    # The first report teaches the host: five open on a host allowed two.  The workers keep
    # every connection, but only the ones within the limit stay.
    for job in jobs[:3]:
        await deliver(service, "w1", job, keep=True, mx="mx.shared.test")
    told = service.closing("default", "w1")
    assert set(told) == {job.slot for job in jobs[:3]}
    assert service.closing("default", "w1") == ()  # told once
    for job in jobs[3:]:
        await deliver(service, "w1", job, keep=True, mx="mx.shared.test")
    # Five still open, three of them closing: no new connection, but a kept one may be
    # taken up (that opens none).
    assert await service.lease("default", "w2", max_jobs=10) == []
    (job,) = await service.lease("default", "w1", max_jobs=1)
    assert job.slot in {j.slot for j in jobs[3:]}
    service.closed("default", "w1", told)
    assert await service.lease("default", "w2", max_jobs=10) == []  # two open of two


@async_test
async def test_a_waiting_lease_returns_at_once_when_its_worker_must_close_something(
    store: QueueStore,
) -> None:
    service = limited_service(store, Clock())
    await queue_for(store, "one.test", 3)
    jobs = await service.lease("default", "w1", max_jobs=10)
    waiting = asyncio.ensure_future(service.lease("default", "w1", max_jobs=1, wait_ms=5_000))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    for job in jobs:  # three open, two allowed once the host is known
        await deliver(service, "w1", job, keep=True, mx="mx.shared.test")
    assert await asyncio.wait_for(waiting, 1.0) == []
    assert len(service.closing("default", "w1")) == 1
