"""Refilling a zone's window while its domains are busy (``QueueService._refill``).

A refill scan that leases nothing has read every ready record past the zone's cursor and
turned each down.  Repeated on every lease call while a domain sits at its connection
limit, that made the core's CPU per delivered message grow with the queue; so an empty
scan's verdicts stand until something they depend on changes, and only what became ready
after them is read.  These tests pin both halves: the records read, and that nothing the
verdicts depended on is missed.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.queue.test_service import Clock, outcome, service_for
from tests.storage.conftest import MINUTE, async_test, queue_message
from zoneq.protocol.reply_rules import ReplyAction
from zoneq.queue.service import RESCAN_S, Result
from zoneq.storage.base import StoreBase
from zoneq.storage.store import QueueStore

Z = "default"


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The ready records the store decodes (every record a lease scan looks at)."""
    seen: list[bytes] = []
    original = StoreBase._decode_record

    def counting(self: StoreBase, key: bytes, value: bytes) -> object:
        seen.append(key)
        return original(self, key, value)

    monkeypatch.setattr(StoreBase, "_decode_record", counting)
    return seen


@async_test
async def test_an_empty_refill_is_not_repeated_and_new_mail_is_read_alone(
    store: QueueStore, decoded: list[bytes]
) -> None:
    service = service_for(store, Clock(), domain_connections=1, window=5)
    for n in range(30):
        await queue_message(store, [(f"u{n}@busy.test", Z)])
    decoded.clear()
    # busy.test's one connection; then the window's rest waits, and the records past it
    # are each read and turned down once.
    (first,) = await service.lease(Z, "w1", max_jobs=10)
    assert first.domain == "busy.test"
    assert len(decoded) == 30
    decoded.clear()
    for _ in range(3):
        assert await service.lease(Z, "w2", max_jobs=10) == []
    assert decoded == []  # nothing changed: not read again
    # New mail for another domain is read on its own, and goes out.
    await queue_message(store, [("a@idle.test", Z)])
    decoded.clear()
    (job,) = await service.lease(Z, "w2", max_jobs=10)
    assert job.domain == "idle.test"
    assert len(decoded) == 1


@async_test
async def test_a_slot_freed_for_a_domain_with_nothing_planned_reads_all_again(
    store: QueueStore, decoded: list[bytes]
) -> None:
    service = service_for(store, Clock(), domain_connections=1, window=1)
    await queue_message(store, [("a@one.test", Z)])
    await queue_message(store, [("b@one.test", Z)])
    (first,) = await service.lease(Z, "w1", max_jobs=10)
    # one.test has nothing planned (the window holds one), and its connection is busy:
    # its second record is turned down.
    assert await service.lease(Z, "w1", max_jobs=10) == []
    await service.report("w1", outcome(first, Result.DELIVERED))
    decoded.clear()
    (second,) = await service.lease(Z, "w1", max_jobs=10)
    assert [r.address for r in second.recipients] == ["b@one.test"]
    assert len(decoded) == 1


@async_test
async def test_a_record_ready_again_before_the_last_one_read_reads_all_again(
    store: QueueStore,
) -> None:
    clock = Clock()
    service = service_for(store, clock, domain_connections=1, window=1)
    await queue_message(store, [("x@other.test", Z)])
    await queue_message(store, [("a@busy.test", Z)])
    await queue_message(store, [("b@busy.test", Z)])
    (other,) = await service.lease(Z, "w1", max_jobs=1)
    await service.report("w1", outcome(other, Result.DEFERRED, reply="451 4.3.0 later"))
    (busy,) = await service.lease(Z, "w1", max_jobs=10)  # b@busy.test is turned down
    assert busy.domain == "busy.test"
    # The older record comes due: ready again before the last record the scan read.
    clock.now += 24 * 60 * MINUTE
    assert await service.promote_due() == 1
    (again,) = await service.lease(Z, "w1", max_jobs=10)
    assert [r.address for r in again.recipients] == ["x@other.test"]


@async_test
async def test_a_domain_startable_again_without_an_event_is_leased_within_a_second(
    store: QueueStore,
) -> None:
    # A "slow down" turns a domain's second record down; its rate allows it again later
    # with no event to wake anyone.  A worker waiting for work looks again when the
    # refill's verdicts expire (RESCAN_S), not at the end of its wait.
    clock = Clock()
    service = service_for(store, clock, window=1)
    await queue_message(store, [("a@slow.test", Z)])
    await queue_message(store, [("b@slow.test", Z)])
    feedback = service._zone(Z).slots.feedback
    assert feedback is not None
    feedback.note("slow.test", ReplyAction.SLOW_DOWN)  # one start a second
    (first,) = await service.lease(Z, "w1")
    assert first.domain == "slow.test"
    assert await service.lease(Z, "w2") == []  # b@slow.test turned down: the rate
    clock.now += 2000  # the slowed rate lets slow.test start again
    await queue_message(store, [("c@other.test", Z)])  # a wake, past the last key read
    (other,) = await service.lease(Z, "w2")
    assert other.domain == "other.test"
    started = time.monotonic()
    jobs = await service.lease(Z, "w2", wait_ms=5000)
    waited = time.monotonic() - started
    assert [job.domain for job in jobs] == ["slow.test"]
    assert waited < RESCAN_S + 0.5, f"b@slow.test waited {waited:.2f} s"


@async_test
async def test_leases_woken_together_do_not_each_scan_the_zone(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every lease waiting for a zone wakes when a message is committed; one of them takes
    # the job, and the rest must not open a database iterator each to find nothing.
    scans: list[str] = []
    original = QueueStore.lease

    def counting(self: QueueStore, zone: str, *args: object, **kwargs: object) -> object:
        scans.append(zone)
        return original(self, zone, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(QueueStore, "lease", counting)
    service = service_for(store, Clock())
    waiting = [
        asyncio.create_task(service.lease(Z, f"w{n}", max_jobs=1, wait_ms=3000)) for n in range(8)
    ]
    await asyncio.sleep(0.05)
    assert len(scans) == 1  # the first found the zone empty; the others knew it then
    scans.clear()
    msg_id = await queue_message(store, [("a@one.test", Z)])
    done, pending = await asyncio.wait(waiting, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.sleep(0.05)  # the others have woken, looked and gone back to waiting
    (job,) = done.pop().result()
    assert job.msg_id == msg_id
    # The one that took the job read the new record; one more read on to find nothing new.
    assert len(scans) == 2, scans
    # A later message is still found by those still waiting.
    second = await queue_message(store, [("b@two.test", Z)])
    done, pending = await asyncio.wait(pending, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    (job,) = done.pop().result()
    assert job.msg_id == second
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


@async_test
async def test_jobs_given_back_by_a_pause_go_out_at_once_after_the_resume(
    store: QueueStore,
) -> None:
    # Planned in the core's queue but not handed out, then given back to the store by the
    # pause: they lie behind the last key the refill read, so it must read them again.
    service = service_for(store, Clock())
    for domain in ("one", "two", "three"):
        await queue_message(store, [(f"a@{domain}.test", Z)])
    (first,) = await service.lease(Z, "w1", max_jobs=1)  # the other two stay planned here
    await service.pause(Z)
    await service.resume(Z)
    jobs = await service.lease(Z, "w1", max_jobs=10)  # no wait: at once, not after RESCAN_S
    assert sorted(job.domain for job in jobs) == ["three.test", "two.test"]
    assert first.domain == "one.test"
