"""Jobs of a bulk message fill up to ``max_recipients`` across refill windows (``Filling``).

A message to many domains comes from the store in address order, so each window of 2,000
holds only window / domains recipients of a domain; planned window by window, 10,000
recipients over 100 domains went out in 500 transactions of 20 instead of 200 of 50.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from tests.queue.test_service import Clock, Z, outcome, service_for
from tests.storage.conftest import assert_consistent, async_test, queue_message
from zoneq.queue.service import Job, QueueService, Result
from zoneq.storage.store import QueueStore


async def deliver_all(service: QueueService, max_jobs: int) -> list[Job]:
    """Lease and report delivered until nothing is left; every job handed out."""
    handed: list[Job] = []
    for _ in range(10_000):  # bounded: a job at least per round
        jobs = await service.lease(Z, "w1", max_jobs=max_jobs)
        if not jobs:
            return handed
        handed.extend(jobs)
        for job in jobs:
            await service.report("w1", outcome(job, Result.DELIVERED, reply="250 ok", code=250))
    raise AssertionError("the queue never emptied")


@pytest.mark.parametrize(
    ("count", "domains", "max_jobs"),
    [(10_000, 100, 1000), (10_000, 100, 1), (7_013, 37, 10), (3_000, 1, 5)],
)
@async_test
async def test_a_bulk_message_goes_out_in_full_jobs(
    store: QueueStore, count: int, domains: int, max_jobs: int
) -> None:
    service = service_for(store, Clock(), domain_connections=1000)
    addresses = [f"user{i:05d}@d{i % domains:03d}.test" for i in range(count)]
    await queue_message(store, [(address, Z) for address in addresses])
    jobs = await deliver_all(service, max_jobs)
    sent = Counter(r.address for job in jobs for r in job.recipients)
    assert sent == Counter(addresses)  # every recipient exactly once
    sizes: defaultdict[str, list[int]] = defaultdict(list)
    for job in jobs:
        sizes[job.domain].append(len(job.recipients))
    for domain, got in sizes.items():
        wanted = sum(1 for address in addresses if address.endswith("@" + domain))
        full, rest = divmod(wanted, 50)
        assert sorted(got, reverse=True) == [50] * full + ([rest] if rest else []), domain
    await store.drain()
    assert store.message_count() == 0
    await assert_consistent(store)


@async_test
async def test_a_small_message_goes_out_in_the_first_lease(store: QueueStore) -> None:
    service = service_for(store, Clock())
    alone = await queue_message(store, [("t@fast.test", Z)])
    (job,) = await service.lease(Z, "w1")
    assert job.msg_id == alone


@async_test
async def test_a_small_message_after_a_bulk_one_is_not_held_for_it(store: QueueStore) -> None:
    service = service_for(store, Clock(), domain_connections=1000)
    bulk = await queue_message(store, [(f"u{i:05d}@d{i % 100:03d}.test", Z) for i in range(5_000)])
    small = await queue_message(store, [("t@fast.test", Z), ("u@other.test", Z)])
    jobs = await service.lease(Z, "w1", max_jobs=1000)
    assert {job.msg_id for job in jobs} == {bulk, small}
    assert all(len(job.recipients) == 50 for job in jobs if job.msg_id == bulk)
    assert sum(len(job.recipients) for job in jobs) == 5_002


@async_test
async def test_partial_jobs_go_out_when_the_window_ends_with_the_message(
    store: QueueStore,
) -> None:
    # The scan stops at the window exactly where the message ends: its open jobs go out in
    # the same lease, when the next read finds nothing more.
    service = service_for(store, Clock(), domain_connections=1000, window=200)
    await queue_message(store, [(f"u{i:03d}@d{i % 3}.test", Z) for i in range(200)])
    jobs = await service.lease(Z, "w1", max_jobs=100)
    assert sorted(len(job.recipients) for job in jobs) == [16, 17, 17, 50, 50, 50]


@async_test
async def test_a_hold_takes_back_jobs_still_being_filled(store: QueueStore) -> None:
    # Windows of 13 a domain: the first lease reads four, and leaves 2 of each domain open.
    service = service_for(store, Clock(), domain_connections=1, window=130)
    bulk = await queue_message(store, [(f"u{i:03d}@d{i % 10}.test", Z) for i in range(1_000)])
    first = await service.lease(Z, "w1", max_jobs=1)
    assert [len(job.recipients) for job in first] == [50]
    assert len(service._zone(Z).filling) == 20
    count = await service.hold(bulk)
    # Everything not on the wire is held: nothing was stranded in open jobs.
    assert (count.now, count.on_return) == (
        1_000 - len(first[0].recipients),
        len(first[0].recipients),
    )
    assert service.unqueue(Z) == 0


@async_test
async def test_a_pause_gives_back_jobs_still_being_filled(store: QueueStore) -> None:
    service = service_for(store, Clock(), domain_connections=1, window=130)
    await queue_message(store, [(f"u{i:03d}@d{i % 10}.test", Z) for i in range(1_000)])
    (first,) = await service.lease(Z, "w1", max_jobs=1)
    assert len(service._zone(Z).filling) == 20
    await service.pause(Z)
    assert store.leased(Z) == len(first.recipients)  # only what is on the wire
