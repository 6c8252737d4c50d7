"""How owed failure notices are settled (``bounces.OwedNotices``, ``storage/owed.py``):
bounded work per message and per round, the event loop free while thousands settle, a
delete that is silent, and the guards that keep a failure told once and never forgotten.

A real store on disk and the real ``QueueService``; the faulty database
(``tests/storage/conftest.py``) holds a write at its gate or fails its sync.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.queue.test_owed_notices import REFUSED, jobs_of, listed, rfc822
from tests.queue.test_service import BOUNCES, Clock, Z, dsn_of, outcome, service_for
from tests.queue.test_storage_fault import heal
from tests.storage.conftest import (
    T0,
    FaultyDatabase,
    StoreFactory,
    assert_consistent,
    async_test,
    queue_message,
)
from zoneq.config import load_config
from zoneq.queue import bounces
from zoneq.queue.service import QueueService, Result
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

OTHER = "other"  # a zone nobody leases from here: its recipients stay ready (a paused zone)


def counted(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    """Count the calls of ``owner.name`` (one-element list, read after the fact)."""
    calls = [0]
    real: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


async def bounce_all(service: QueueService, zone: str = Z) -> None:
    """Lease and refuse everything ready in ``zone``, 100 jobs per report round."""
    while jobs := await service.lease(zone, "w1", max_jobs=100):
        await asyncio.gather(
            *(service.report("w1", outcome(job, Result.BOUNCED, **REFUSED)) for job in jobs)
        )


async def run_once(service: QueueService) -> None:
    stop = asyncio.Event()
    stop.set()
    await service.run(stop)


async def until(event: threading.Event) -> None:
    for _ in range(500):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the write never reached the disk")


@async_test
async def test_thousands_owed_at_start_up_settle_in_passes_with_no_overlay_scan(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 messages owed at a start-up: each message's settle costs no scan of the
    writer's overlay (it sorted the whole overlay once per message: quadratic, 62 s of a
    blocked loop for 5,000), and the loop runs between passes of ``SETTLE_STEP``."""
    count = 2_000
    store = stores.open()
    service = service_for(store, Clock())
    for n in range(count):
        await queue_message(store, [(f"a{n}@bad.test", Z)])
    with monkeypatch.context() as patch:
        patch.setattr(bounces.OwedNotices, "settle", no_settle)
        await bounce_all(service)
    await store.drain()
    assert len(store.owed_messages()) == count

    # Composing costs ~7 ms a notice, the same whatever else is owed: left out here, it
    # would cost the test 14 s (``test_notices_are_composed_off_the_event_loop``).
    monkeypatch.setattr(bounces, "compose", lambda *_, **__: None)
    sorts = counted(monkeypatch, store._writer, "_staged")
    staged = counted(monkeypatch, store, "settle_owed")
    most = 0  # the most settles staged between two turns of the loop

    async def ticker() -> None:
        nonlocal most
        last = 0
        while True:
            await asyncio.sleep(0)
            most, last = max(most, staged[0] - last), staged[0]

    ticking = asyncio.ensure_future(ticker())
    await run_once(service)
    ticking.cancel()
    await store.drain()
    assert store.owed_messages() == []
    assert list(store.database.keys(prefix=b"owed")) == []
    assert sorts[0] == 0
    assert 0 < most <= bounces.SETTLE_STEP


async def no_settle(*_: object, **__: object) -> int:
    return 0


@async_test
async def test_a_round_reads_no_waiting_message_until_its_wait_is_up(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 messages, each with a refused recipient and one in a zone that is not tried
    (paused): their notices wait.  A round of ``run`` reads none of them (each second it
    read every one: 10,000 waiting cost 4 s a round); a report about one of them looks at
    that one at once, and the rest are told when their wait is up."""
    count = 300
    service = QueueService(
        store, load_config(), hostname="mx.zoneq.test", clock=Clock(), owed_wait_s=0.5
    )
    for n in range(count):
        await queue_message(store, [(f"a{n}@bad.test", Z), (f"b{n}@slow.test", OTHER)])
    await bounce_all(service)
    assert store.count(BOUNCES, State.READY) == 0  # all waiting for their other recipient
    reads = counted(monkeypatch, store, "message")
    for _ in range(3):
        await service._settle_owed(T0)
    assert reads[0] == 0

    (job,) = await service.lease(OTHER, "w1", max_jobs=1)
    await service.report("w1", outcome(job, Result.DELIVERED, reply="250 ok"))
    assert store.count(BOUNCES, State.READY) == 1  # that one, touched by the report

    await asyncio.sleep(0.5)
    reads[0] = 0
    await service._settle_owed(T0)
    assert reads[0] == 0  # told because their wait is up: nothing to read
    assert store.count(BOUNCES, State.READY) == count
    assert store.owed_messages() == []


@pytest.mark.parametrize("recipients", [1, 200])
@async_test
async def test_notices_are_composed_off_the_event_loop(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch, recipients: int
) -> None:
    """A notice costs about 7 ms to compose, and a 10,000-recipient one took 1.6 s, all of
    it on the event loop; ``compose`` is pure, so it runs in a thread."""
    threads: list[int] = []
    real = bounces.compose

    def compose(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(bounces, "compose", compose)
    service = service_for(store, Clock())
    rcpts = [(f"user{n:03}@dest{n % 2}.test", Z) for n in range(recipients)]
    await queue_message(store, rcpts)
    await bounce_all(service)
    assert store.count(BOUNCES, State.READY) == 1
    assert listed(dsn_of(store)) == rfc822(rcpts)
    assert len(threads) == 1
    assert threads != [threading.get_ident()]
    await assert_consistent(store)


@pytest.mark.parametrize("purge", [False, True])
@async_test
async def test_a_message_deleted_while_its_notice_waits_is_not_told(
    store: QueueStore, purge: bool
) -> None:
    """A delete is silent, as ``postsuper -d`` is: a message deleted (or purged) while its
    first failure's notice waits for its other recipient gets no DSN (after a spam wave is
    purged, its refusals must not become backscatter)."""
    service = service_for(store, Clock())
    msg_id = await queue_message(store, [("a@one.test", Z), ("b@two.test", OTHER)])
    (first,) = await jobs_of(service, 1)
    await service.report("w1", outcome(first, Result.BOUNCED, **REFUSED))
    assert store.owed_messages() == [msg_id]
    if purge:
        assert await store.drop_many(store.recipients(msg_id), T0) == 1
    else:
        assert await store.drop(msg_id, T0) == 1
    await run_once(service)
    await service._settle_owed(T0, every=True)
    await store.drain()
    assert store.count(BOUNCES, State.READY) == 0
    assert store.message_count() == 0
    assert list(store.database.keys(prefix=b"owed")) == []
    assert store.owed_messages() == []
    await assert_consistent(store)


@async_test
async def test_a_failure_staged_while_its_messages_notice_lands_is_told(
    stores: StoreFactory,
) -> None:
    """The first failure's notice is at the disk (its batch held at the gate) when the
    second failure's bounce is staged behind it: the notice's landing must not forget
    the message, or the second failure would wait for the next start to be told."""
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    service = QueueService(
        store, load_config(), hostname="mx.zoneq.test", clock=Clock(), owed_wait_s=0.0
    )
    await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    first, second = sorted(await jobs_of(service, 2), key=lambda job: job.domain)
    real = store.settle_owed

    def gated(*args: Any, **kwargs: Any) -> Any:
        db.gate = threading.Event()
        db.entered.clear()
        return real(*args, **kwargs)

    store.settle_owed = gated  # type: ignore[method-assign]
    reported = asyncio.ensure_future(
        service.report("w1", outcome(first, Result.BOUNCED, **REFUSED))
    )
    await until_gated(db)
    store.settle_owed = real  # type: ignore[method-assign]
    gate = db.gate
    assert gate is not None
    again = asyncio.ensure_future(service.report("w1", outcome(second, Result.BOUNCED, **REFUSED)))
    await asyncio.sleep(0.1)  # its bounce is staged behind the notice
    db.gate = None
    gate.set()
    await asyncio.gather(reported, again)
    await run_once(service)
    await store.drain()
    assert store.count(BOUNCES, State.READY) == 2
    assert store.owed_messages() == []
    await assert_consistent(store)


def held_compose(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """``compose`` held in its thread: (entered, go): it waits for ``go`` (10 s at most)."""
    entered, go = threading.Event(), threading.Event()
    real = bounces.compose

    def compose(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        go.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(bounces, "compose", compose)
    return entered, go


@pytest.mark.parametrize("meanwhile", ["deleted", "second failure"])
@async_test
async def test_what_changes_while_a_notice_is_composed_is_read_again_before_it_lands(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    """The notice is composed in a thread from what the message owed when it was taken;
    meanwhile the message is deleted (a delete is silent: no DSN), or its second failure
    is staged (told once, in the notice composed next, not lost and not told twice).
    Only the records read again before staging say so."""
    store = stores.open()
    service = service_for(store, Clock())
    rcpts = [("a@one.test", Z), ("b@two.test", Z)]
    msg_id = await queue_message(store, rcpts)
    first, second = sorted(await jobs_of(service, 2), key=lambda job: job.domain)
    await service.report("w1", outcome(first, Result.BOUNCED, **REFUSED))  # waits for b
    entered, go = held_compose(monkeypatch)
    settling = asyncio.ensure_future(service._settle_owed(T0, every=True))
    try:
        await until(entered)
        if meanwhile == "deleted":
            assert await store.drop(msg_id, T0) == 1  # b still leased: the message goes
        else:
            await service.report("w1", outcome(second, Result.BOUNCED, **REFUSED))
        await store.drain()
    finally:
        go.set()
    await settling
    await run_once(service)
    await service._settle_owed(T0, every=True)
    await store.drain()
    if meanwhile == "deleted":
        assert store.count(BOUNCES, State.READY) == 0
    else:
        assert store.count(BOUNCES, State.READY) == 1
        assert listed(dsn_of(store)) == rfc822(rcpts)
    assert store.owed_messages() == []
    await assert_consistent(store)


async def until_gated(db: FaultyDatabase) -> None:
    for _ in range(500):
        if db.gate is not None and db.entered.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the notice's batch never reached the disk")


@async_test
async def test_two_settles_overlapping_tell_a_failure_once(stores: StoreFactory) -> None:
    """A second settle starts while the first one's batch is at the disk: the records the
    first deletes are not durable for it (``_durable`` skips a staged delete)."""
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    service = service_for(store, Clock())
    await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    first, _ = sorted(await jobs_of(service, 2), key=lambda job: job.domain)
    await service.report("w1", outcome(first, Result.BOUNCED, **REFUSED))  # waits for b
    db.gate = threading.Event()
    db.entered.clear()
    settling = asyncio.ensure_future(service._settle_owed(T0, every=True))
    await until(db.entered)
    overlapping = asyncio.ensure_future(service._settle_owed(T0, every=True))
    await asyncio.sleep(0.05)
    db.gate.set()
    await asyncio.gather(settling, overlapping)
    await store.drain()
    assert store.count(BOUNCES, State.READY) == 1


@async_test
async def test_a_notice_whose_sync_failed_after_its_log_append_is_forgotten(
    stores: StoreFactory,
) -> None:
    """The notice's batch fails its sync once LevelDB has appended it: the reopen brings
    it back (DSN queued, records deleted) but its landing never ran, so the message
    stayed in memory as owing for good.  A look that finds nothing on disk or on its way
    forgets it."""
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    service = service_for(store, Clock())
    await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    first, second = sorted(await jobs_of(service, 2), key=lambda job: job.domain)
    await service.report("w1", outcome(first, Result.BOUNCED, **REFUSED))
    real = store.settle_owed

    def failing(*args: Any, **kwargs: Any) -> Any:
        db.fail_syncs = 1
        return real(*args, **kwargs)

    store.settle_owed = failing  # type: ignore[method-assign]
    await service.report("w1", outcome(second, Result.BOUNCED, **REFUSED))
    store.settle_owed = real  # type: ignore[method-assign]
    assert store.failure is not None
    heal(store, db)
    await store.drain()
    await run_once(service)
    await store.drain()
    assert store.count(BOUNCES, State.READY) == 1
    assert store.owed_messages() == []
    await assert_consistent(store)
