"""Administrators' operations interleaved at random with worker outcomes, on a real store.

Deletes, purges, holds, releases and retries run concurrently with leases, reports and due
promotions, so an operation often meets recipients whose moves are still on their way to
disk.  Whatever the interleaving, once everything has landed: the O(1) counters equal a
full scan, no recipient record is left without its message, and each message's head counts
exactly the records it has.  Deterministic seeds, bounded in operations (about 0.1 s each).
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from tests.storage.conftest import MINUTE, T0, StoreFactory, async_test, queue_message
from zoneq.config import load_config
from zoneq.errors import NotFound
from zoneq.protocol.events import EventKind
from zoneq.queue.admin import QueueAdmin, Selection
from zoneq.queue.service import Job, QueueService, RecipientOutcome, Result
from zoneq.storage import keys
from zoneq.storage.base import FAMILY_STATE
from zoneq.storage.records import decode_head
from zoneq.storage.store import QueueStore

ZONES = ("default", "other")
SEEDS = range(24)
ROUNDS = 60
CODES = {Result.DELIVERED: 250, Result.DEFERRED: 451, Result.BOUNCED: 550, Result.RETURNED: 0}


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


class Run:
    """One seed's world: a store, its service and admin, and what the workers hold."""

    def __init__(self, store: QueueStore, seed: int) -> None:
        self.rnd = random.Random(seed)
        self.store = store
        self.clock = Clock()
        self.service = QueueService(
            store, load_config(), hostname="mx.zoneq.test", clock=self.clock, window=50
        )
        self.admin = QueueAdmin(store, self.service, list(ZONES), clock=self.clock, batch=7)
        self.ids: list[int] = []
        self.jobs: list[Job] = []

    def zone(self) -> str:
        return self.rnd.choice(ZONES)

    async def report(self, job: Job, result: Result) -> None:
        code = CODES[result] or None
        outcomes = [RecipientOutcome(r.token, result, reply="x", code=code) for r in job.recipients]
        await self.service.report("w", outcomes)

    async def step(self) -> None:
        rnd = self.rnd
        choice = rnd.randrange(12)
        if choice == 0 or not self.ids:
            rcpts = [
                (f"u{i}@d{rnd.randrange(3)}.test", self.zone()) for i in range(rnd.randrange(1, 6))
            ]
            self.ids.append(await queue_message(self.store, rcpts, now_ms=self.clock.now))
        elif choice == 1:
            self.jobs.extend(await self.service.lease(self.zone(), "w", max_jobs=3))
        elif choice in (2, 3) and self.jobs:
            job = self.jobs.pop(rnd.randrange(len(self.jobs)))
            await self.report(job, rnd.choice(list(CODES)))
        elif choice == 4:
            await self.admin.delete(rnd.choice(self.ids))
        elif choice == 5:
            domain = f"d{rnd.randrange(3)}.test"
            await self.admin.purge(Selection(zone=self.zone(), recipient_domain=domain))
        elif choice == 6:
            await self.admin.hold_message(rnd.choice(self.ids))
        elif choice == 7:
            await self.admin.release_message(rnd.choice(self.ids))
        elif choice == 8:
            await self.admin.hold_zone(self.zone())
        elif choice == 9:
            await self.admin.release_zone(self.zone())
        elif choice == 10:
            await self.admin.retry(rnd.choice([None, ZONES[0]]))
        else:
            self.clock.now += 30 * MINUTE
            await self.service.promote_due()

    async def op(self) -> None:
        with contextlib.suppress(NotFound):  # deleted by an earlier operation meanwhile
            await self.step()


def records_by_message(store: QueueStore) -> dict[int, int]:
    found: dict[int, int] = {}
    for family in FAMILY_STATE:
        for key in store.database.keys(prefix=family):
            msg_id = keys.decode_record(key)[2]
            found[msg_id] = found.get(msg_id, 0) + 1
    return found


@pytest.mark.parametrize("seed", SEEDS)
@async_test
async def test_random_interleavings_keep_the_queue_whole(stores: StoreFactory, seed: int) -> None:
    run = Run(stores.open(), seed)
    for _ in range(ROUNDS):
        await asyncio.gather(*(run.op() for _ in range(run.rnd.randrange(1, 5))))
    for job in run.jobs:
        await run.report(job, Result.RETURNED)
    store = run.store
    await store.drain()
    assert store.counters() == store.recount()
    heads: dict[int, int] = {}
    for key, value in store.database.items(prefix=keys.MESSAGE):
        msg_id, part, _ = keys.decode_message_key(key)
        if part == keys.HEAD_PART:
            heads[msg_id] = decode_head(key, value)[1]
    assert records_by_message(store) == heads  # no orphan record, no count astray
    # ... and none was made on the way (the queue service removes those it meets)
    assert not [
        e for _, e in store.events() if e.kind is EventKind.DROPPED and "gone" in (e.text or "")
    ]
