"""Jobs of a bulk message fill up to ``max_recipients`` across refill windows (``Filling``).

A message to many domains comes from the store in address order, so each window of 2,000
holds only window / domains recipients of a domain; planned window by window, 10,000
recipients over 100 domains went out in 500 transactions of 20 instead of 200 of 50.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque

import pytest

from tests.queue.test_service import Clock, Z, outcome, service_for
from tests.storage.conftest import assert_consistent, async_test, queue_message
from zoneq.config import load_config
from zoneq.queue.service import RESCAN_S, Job, QueueService, Result, _TurnedDown
from zoneq.storage.store import QueueStore

MX = "mx.sink.test"


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


def assert_full_jobs(jobs: list[Job], addresses: list[str]) -> None:
    """Every address sent once, each domain's jobs of 50 but its last."""
    assert Counter(r.address for job in jobs for r in job.recipients) == Counter(addresses)
    sizes: defaultdict[str, list[int]] = defaultdict(list)
    for job in jobs:
        sizes[job.domain].append(len(job.recipients))
    for domain, got in sizes.items():
        wanted = sum(1 for address in addresses if address.endswith("@" + domain))
        full, rest = divmod(wanted, 50)
        assert sorted(got, reverse=True) == [50] * full + ([rest] if rest else []), domain


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
    assert_full_jobs(await deliver_all(service, max_jobs), addresses)
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


def limited_service(
    store: QueueStore, domain_connections: int, mx_limit: int = 0, wait_s: float = 60.0
) -> QueueService:
    """A zone with ``domain_connections`` per domain and, if ``mx_limit``, that many to
    ``MX`` (once a report has named it a domain's host), as in ``mx_limits``; jobs being
    filled wait ``wait_s`` at most (long by default: what they wait for must come)."""
    base = load_config()
    delivery = base.delivery.model_copy(
        update={
            "mx_limits": {MX: mx_limit} if mx_limit else {},
            "domain_connections": domain_connections,
        }
    )
    return QueueService(
        store,
        base.model_copy(update={"delivery": delivery}),
        hostname="mx.zoneq.test",
        clock=Clock(),
        domain_connections=domain_connections,
        filling_wait_s=wait_s,
    )


async def deliver_on(service: QueueService, connections: int) -> list[Job]:
    """Workers with ``connections`` between them, asking for as many jobs as they have
    free: each round leases, then the oldest job on the wire is reported delivered by
    ``MX`` (so its domain's host is learnt).  Done when nothing is on the wire and a lease
    finds nothing: a job still held open then is left out of what it returns."""
    handed: list[Job] = []
    wire: deque[Job] = deque()
    for _ in range(20_000):  # bounded: a job handed out or reported per round
        jobs = await service.lease(Z, "w1", max_jobs=connections - len(wire))
        handed.extend(jobs)
        wire.extend(jobs)
        if not wire:
            return handed
        job = wire.popleft()
        await service.report("w1", outcome(job, Result.DELIVERED, code=250, mx=MX))
    raise AssertionError("the queue never emptied")


@pytest.mark.parametrize(
    ("count", "domains", "domain_connections", "mx_limit"),
    [
        (10_000, 100, 3, 4),  # the reviewer's: mx_limits = { "mx.sink.test" = 4 }
        (7_013, 37, 1, 0),  # a domain limit alone
    ],
)
@async_test
async def test_jobs_are_full_while_a_limit_holds_delivery_back(
    store: QueueStore, count: int, domains: int, domain_connections: int, mx_limit: int
) -> None:
    # A window (2,000) holds window / domains of each domain, so jobs are topped up over
    # several; when the limit held the next job back, the open ones went out as they were
    # (10 + 40 in the first case: 300 transactions instead of 200).
    service = limited_service(store, domain_connections, mx_limit)
    names = [f"d{i:03d}.test" for i in range(domains)]
    await queue_message(store, [(f"first@{name}", Z) for name in names])
    await deliver_on(service, 20)  # the reports teach the domains' host
    addresses = [f"user{i:05d}@{names[i % domains]}" for i in range(count)]
    bulk = await queue_message(store, [(address, Z) for address in addresses])
    jobs = await deliver_on(service, 20)
    assert {job.msg_id for job in jobs} == {bulk}
    assert_full_jobs(jobs, addresses)
    await store.drain()
    assert store.message_count() == 0


@async_test
async def test_open_jobs_go_out_at_once_when_nothing_more_of_their_message_is_ready(
    store: QueueStore,
) -> None:
    # busy.test is at its limit with more of it ready, in another message: the scans turn
    # that down, but nothing more of the bulk message is coming, so its open jobs go.
    service = limited_service(store, 1)
    await queue_message(store, [("a@busy.test", Z)])
    assert len(await service.lease(Z, "w1")) == 1  # on the wire for the whole test
    await queue_message(store, [("b@busy.test", Z)])
    bulk = [f"u{i:03d}@d{i % 3}.test" for i in range(200)]
    await queue_message(store, [(address, Z) for address in bulk])
    first = await service.lease(Z, "w1", max_jobs=10)
    assert sorted(len(job.recipients) for job in first) == [50, 50, 50]
    for job in first:
        await service.report("w1", outcome(job, Result.DELIVERED, code=250))
    rest = await service.lease(Z, "w1", max_jobs=10)
    assert sorted(len(job.recipients) for job in rest) == [16, 17, 17]


@async_test
async def test_open_jobs_held_back_by_a_busy_domain_go_out_after_their_wait(
    store: QueueStore,
) -> None:
    # The bulk message's busy.test records are turned down while its job is on the wire
    # (say for minutes): the other domains' open jobs wait for them, but not for ever.
    service = limited_service(store, 1, wait_s=0.05)
    await queue_message(store, [("a@busy.test", Z)])
    await service.lease(Z, "w1")
    bulk = [f"u{i:03d}@{('d0', 'd1', 'busy')[i % 3]}.test" for i in range(210)]
    await queue_message(store, [(address, Z) for address in bulk])
    # Timed from before the lease whose refill first holds them back: the wait starts there.
    started = time.monotonic()
    first = await service.lease(Z, "w1", max_jobs=10)
    assert sorted((job.domain, len(job.recipients)) for job in first) == [
        ("d0.test", 50),
        ("d1.test", 50),
    ]
    for job in first:
        await service.report("w1", outcome(job, Result.DELIVERED, code=250))
    assert await service.lease(Z, "w1", max_jobs=10) == []  # held for busy.test's 70
    rest = await service.lease(Z, "w1", max_jobs=10, wait_ms=10_000)
    waited = time.monotonic() - started
    assert sorted((job.domain, len(job.recipients)) for job in rest) == [
        ("d0.test", 20),
        ("d1.test", 20),
    ]
    # Woken when their wait was up (not at the next rescan, RESCAN_S, nor the lease's end):
    # the bound leaves a loaded machine most of a second.
    assert 0.04 < waited < RESCAN_S


@pytest.mark.parametrize(
    ("watched", "scan", "asked", "turned_down"),
    [
        # A scan as (accepted?, message) in key order; was ``asked`` turned down in it?
        (None, [(True, 1), (False, 1), (True, 1)], 1, True),
        (None, [(False, 2), (True, 2)], 2, True),  # before its first lease
        (None, [(False, 1), (True, 2)], 2, False),  # an older message's
        (None, [(True, 2), (False, 2), (False, 3)], 2, True),  # and a newer one's after
        (5, [(False, 5), (False, 6)], 5, True),  # the one being filled, nothing leased
        (5, [(False, 4), (False, 6)], 5, False),
        (5, [(False, 5)], None, False),
    ],
)
def test_turned_down_follows_the_message_being_filled(
    watched: int | None, scan: list[tuple[bool, int]], asked: int | None, turned_down: bool
) -> None:
    seen = _TurnedDown(watched)
    for accepted, msg_id in scan:
        (seen.accepted if accepted else seen.refused)(msg_id)
    assert seen.of(asked) is turned_down
