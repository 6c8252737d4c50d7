"""The queue service on a real store: jobs, limits, outcomes, retries, bounces, waiting."""

from __future__ import annotations

import asyncio
import email
import email.policy
from email.message import EmailMessage

import pytest

from tests.storage.conftest import (
    MINUTE,
    T0,
    assert_consistent,
    async_test,
    queue_message,
)
from zoneq.config import load_config
from zoneq.queue.service import HoldCount, Job, QueueService, RecipientOutcome, Result
from zoneq.storage.records import NewRecipient, State
from zoneq.storage.store import QueueStore

Z = "default"
BOUNCES = "bounces"


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def service_for(store: QueueStore, clock: Clock, **options: int) -> QueueService:
    return QueueService(store, load_config(), hostname="mx.zoneq.test", clock=clock, **options)


def outcome(job: Job, result: Result, **fields: object) -> list[RecipientOutcome]:
    return [RecipientOutcome(r.token, result, **fields) for r in job.recipients]  # type: ignore[arg-type]


def dsn_of(store: QueueStore) -> EmailMessage:
    (bounce_lease,) = store.lease(BOUNCES, 10, "test")
    body = b"".join(store.body(bounce_lease.recipient.msg_id))
    store.release(bounce_lease)
    message = email.message_from_bytes(body, policy=email.policy.default)
    assert isinstance(message, EmailMessage)
    return message


@async_test
async def test_jobs_group_one_message_per_domain_oldest_first(store: QueueStore) -> None:
    service = service_for(store, Clock())
    first = await queue_message(store, [("a@one.test", Z), ("b@two.test", Z), ("c@one.test", Z)])
    second = await queue_message(store, [("d@one.test", Z)])
    jobs = await service.lease(Z, "w1", max_jobs=10)
    assert [(j.msg_id, j.domain, [r.address for r in j.recipients]) for j in jobs] == [
        (first, "one.test", ["a@one.test", "c@one.test"]),
        (first, "two.test", ["b@two.test"]),
        (second, "one.test", ["d@one.test"]),
    ]
    assert jobs[0].sender == "sender@example.org"
    assert store.count(Z, State.LEASED) == 4


@async_test
async def test_a_transaction_holds_at_most_fifty_recipients(store: QueueStore) -> None:
    service = service_for(store, Clock())
    await queue_message(store, [(f"u{i}@big.test", Z) for i in range(120)])
    jobs = await service.lease(Z, "w1", max_jobs=10)
    assert [len(j.recipients) for j in jobs] == [50, 50, 20]


@async_test
async def test_domain_connection_limit_lets_other_domains_go_ahead(store: QueueStore) -> None:
    service = service_for(store, Clock(), domain_connections=1)
    await queue_message(store, [("a@busy.test", Z)])
    await queue_message(store, [("b@busy.test", Z)])
    await queue_message(store, [("c@free.test", Z)])
    jobs = await service.lease(Z, "w1", max_jobs=10)
    assert [j.domain for j in jobs] == ["busy.test", "free.test"]
    assert await service.lease(Z, "w1") == []  # busy.test is at its limit
    accepted, refused = await service.report(
        "w1", outcome(jobs[0], Result.DELIVERED, reply="250 ok")
    )
    assert refused == [] and len(accepted) == 1
    (third,) = await service.lease(Z, "w1")
    assert [r.address for r in third.recipients] == ["b@busy.test"]


@async_test
async def test_delivered_recipients_leave_the_queue(store: QueueStore) -> None:
    service = service_for(store, Clock())
    msg_id = await queue_message(store, [("a@one.test", Z), ("b@one.test", Z)])
    (job,) = await service.lease(Z, "w1")
    accepted, refused = await service.report(
        "w1", outcome(job, Result.DELIVERED, reply="250 2.0.0 ok", code=250, mx="mx1.one.test")
    )
    assert len(accepted) == 2 and refused == []
    assert store.message_count() == 0
    assert service.in_flight() == 0
    delivered = [e for _, e in store.events() if e.kind.value == "delivered"]
    assert {e.recipient for e in delivered} == {"a@one.test", "b@one.test"}
    assert all(e.mx == "mx1.one.test" and e.message_id == f"{msg_id:016x}" for e in delivered)
    await assert_consistent(store)


@async_test
async def test_deferred_recipients_wait_for_the_schedule_then_come_back(store: QueueStore) -> None:
    clock = Clock()
    service = service_for(store, clock)
    await queue_message(store, [("a@slow.test", Z)])
    (job,) = await service.lease(Z, "w1")
    await service.report("w1", outcome(job, Result.DEFERRED, reply="451 4.7.1 try later"))
    assert store.count(Z, State.DEFERRED) == 1
    (deferred,) = store.recipients(job.msg_id)
    assert deferred.recipient.next_attempt_ms == T0 + 15 * MINUTE  # first step of 15m|30m|..
    clock.now = T0 + 15 * MINUTE - 1
    assert await service.promote_due() == 0
    clock.now = T0 + 15 * MINUTE
    assert await service.promote_due() == 1
    (again,) = await service.lease(Z, "w1")
    assert again.recipients[0].attempts == 1
    await assert_consistent(store)


@async_test
async def test_expiry_bounces_once_with_a_dsn_to_the_sender(store: QueueStore) -> None:
    clock = Clock()
    service = service_for(store, clock)
    await queue_message(store, [("a@slow.test", Z)], now_ms=T0)
    (job,) = await service.lease(Z, "w1")
    clock.now = T0 + 73 * 60 * MINUTE  # past the 72h max age
    await service.report(
        "w1", outcome(job, Result.DEFERRED, reply="451 4.4.1 no answer", enhanced="4.4.1")
    )
    assert store.count(Z, State.DEFERRED) == 0
    assert store.count(BOUNCES, State.READY) == 1
    kinds = [e.kind.value for _, e in store.events()]
    assert kinds.count("expired") == 1
    report = dsn_of(store)
    assert report["To"] == "sender@example.org"
    status = report.get_payload()[1].get_payload()[1]  # type: ignore[index,union-attr]
    assert status["Action"] == "failed"
    assert status["Status"] == "4.4.1"
    await assert_consistent(store)


@async_test
async def test_bounce_sends_one_dsn_for_all_failed_recipients_of_a_message(
    store: QueueStore,
) -> None:
    service = service_for(store, Clock())
    await queue_message(store, [("a@one.test", Z), ("b@one.test", Z)], envid="ENV+2B1")
    (job,) = await service.lease(Z, "w1")
    await service.report(
        "w1",
        outcome(
            job,
            Result.BOUNCED,
            reply="550 5.1.1 user unknown",
            code=550,
            enhanced="5.1.1",
            mx="mx.one.test",
        ),
    )
    assert store.count(BOUNCES, State.READY) == 1  # one DSN, two recipients in it
    report = dsn_of(store)
    text = report.as_string()
    assert "a@one.test" in text and "b@one.test" in text
    assert "Original-Envelope-Id: ENV+1" in text  # xtext-decoded (RFC 3464 2.2.1)
    assert "550 5.1.1 user unknown" in text
    await assert_consistent(store)


@pytest.mark.parametrize("sender", ["", "<>"])
@async_test
async def test_no_dsn_to_the_null_sender(store: QueueStore, sender: str) -> None:
    service = service_for(store, Clock())
    await queue_message(store, [("a@one.test", Z)], sender=sender)
    (job,) = await service.lease(Z, "w1")
    await service.report("w1", outcome(job, Result.BOUNCED, reply="550 no", enhanced="5.0.0"))
    assert store.message_count() == 0
    assert store.count(BOUNCES, State.READY) == 0


@async_test
async def test_no_dsn_for_notify_never(store: QueueStore) -> None:
    service = service_for(store, Clock())
    await queue_message(store, [NewRecipient("a@one.test", Z, notify=("NEVER",))])
    (job,) = await service.lease(Z, "w1")
    await service.report("w1", outcome(job, Result.BOUNCED, reply="550 no", enhanced="5.0.0"))
    assert store.count(BOUNCES, State.READY) == 0


@async_test
async def test_returned_recipients_are_ready_at_once(store: QueueStore) -> None:
    service = service_for(store, Clock())
    await queue_message(store, [("a@one.test", Z)])
    (job,) = await service.lease(Z, "w1")
    await service.report("w1", outcome(job, Result.RETURNED))
    (again,) = await service.lease(Z, "w2")
    assert again.recipients[0].address == "a@one.test"
    assert again.recipients[0].token != job.recipients[0].token


@async_test
async def test_reports_with_stale_or_foreign_tokens_are_refused(store: QueueStore) -> None:
    service = service_for(store, Clock())
    msg_id = await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    first, second = await service.lease(Z, "w1", max_jobs=2)
    # Another worker cannot report what w1 holds.
    assert await service.report("w2", outcome(first, Result.DELIVERED)) == (
        [],
        [first.recipients[0].token],
    )
    # An administrator drops the message: w1's report for it is refused, nothing breaks.
    await store.drop(msg_id, T0)
    accepted, refused = await service.report("w1", outcome(second, Result.DELIVERED))
    assert accepted == [] and refused == [second.recipients[0].token]
    await assert_consistent(store)


@async_test
async def test_a_worker_that_goes_away_returns_everything_at_once(store: QueueStore) -> None:
    service = service_for(store, Clock())
    await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    jobs = await service.lease(Z, "w1", max_jobs=2)
    assert service.disconnected("w1") == 2
    assert service.in_flight() == 0
    again = await service.lease(Z, "w2", max_jobs=2)
    assert sorted(r.address for j in again for r in j.recipients) == ["a@one.test", "b@two.test"]
    refused = await service.report("w1", outcome(jobs[0], Result.DELIVERED))
    assert refused[0] == []


@async_test
async def test_a_waiting_lease_wakes_when_mail_arrives(store: QueueStore) -> None:
    service = service_for(store, Clock())
    waiter = asyncio.create_task(service.lease(Z, "w1", wait_ms=5_000))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await queue_message(store, [("a@one.test", Z)])
    (job,) = await asyncio.wait_for(waiter, 2)
    assert job.recipients[0].address == "a@one.test"
    assert loop.time() - started < 1.0  # woken, not timed out


@async_test
async def test_a_waiting_lease_gives_up_after_wait_ms(store: QueueStore) -> None:
    service = service_for(store, Clock())
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await service.lease(Z, "w1", wait_ms=200) == []
    assert 0.15 < loop.time() - started < 2.0


@async_test
async def test_bulk_message_to_many_domains_respects_every_domain_limit(
    store: QueueStore,
) -> None:
    service = service_for(store, Clock(), domain_connections=2)
    await queue_message(store, [(f"u{i}@d{i % 20}.test", Z) for i in range(2000)])
    handed: list[Job] = []
    while jobs := await service.lease(Z, "w1", max_jobs=50):
        handed.extend(jobs)
        per_domain: dict[str, int] = {}
        for job in handed:
            per_domain[job.domain] = per_domain.get(job.domain, 0) + 1
        assert max(per_domain.values()) <= 2
        for job in jobs:  # finish them so the next round can start
            await service.report("w1", outcome(job, Result.DELIVERED))
        handed.clear()
    assert store.message_count() == 0
    await assert_consistent(store)


@async_test
async def test_one_delay_notice_after_the_warning_time_when_notify_asks(
    store: QueueStore,
) -> None:
    clock = Clock()
    service = service_for(store, clock)
    await queue_message(
        store,
        [
            NewRecipient("wants@slow.test", Z, notify=("DELAY", "FAILURE")),
            NewRecipient("default@slow.test", Z),  # no NOTIFY: no delay notices (RFC 3461 4.1)
        ],
    )
    (job,) = await service.lease(Z, "w1")
    clock.now = T0 + 60 * MINUTE  # before the 4h warning time: nothing yet
    await service.report(
        "w1", outcome(job, Result.DEFERRED, reply="451 4.4.1 busy", enhanced="4.4.1")
    )
    assert store.count(BOUNCES, State.READY) == 0
    clock.now = T0 + 5 * 60 * MINUTE
    await service.promote_due()
    (job,) = await service.lease(Z, "w1")
    await service.report(
        "w1", outcome(job, Result.DEFERRED, reply="451 4.4.1 busy", enhanced="4.4.1")
    )
    assert store.count(BOUNCES, State.READY) == 1
    report = dsn_of(store)
    assert report["Subject"].startswith("Delayed Mail")
    status = report.get_payload()[1].get_payload()  # type: ignore[index,union-attr]
    blocks = [block for block in status[1:] if block["Final-Recipient"]]
    assert [b["Final-Recipient"] for b in blocks] == ["rfc822; wants@slow.test"]
    assert blocks[0]["Action"] == "delayed"
    assert blocks[0]["Will-Retry-Until"]
    assert [e.kind.value for _, e in store.events()].count("delayed") == 1
    # Deferred again later: the notice was sent once, not again.
    clock.now = T0 + 10 * 60 * MINUTE
    await service.promote_due()
    (job,) = await service.lease(Z, "w1")
    await service.report(
        "w1", outcome(job, Result.DEFERRED, reply="451 4.4.1 busy", enhanced="4.4.1")
    )
    assert store.count(BOUNCES, State.READY) == 1
    await assert_consistent(store)


@async_test
async def test_a_possible_duplicate_is_logged(
    store: QueueStore, caplog: pytest.LogCaptureFixture
) -> None:
    service = service_for(store, Clock())
    await queue_message(store, [("a@one.test", Z)])
    (job,) = await service.lease(Z, "w1")
    with caplog.at_level("WARNING", logger="zoneq.queue"):
        await service.report(
            "w1",
            outcome(
                job,
                Result.DEFERRED,
                reply="no reply after the final dot",
                mx="mx.one.test",
                possible_duplicate=True,
            ),
        )
    assert "possible duplicate" in caplog.text and "a@one.test" in caplog.text
    (event,) = [e for _, e in store.events() if e.kind.value == "deferred"]
    assert event.possible_duplicate


@async_test
async def test_a_one_chunk_body_travels_with_its_job(store: QueueStore) -> None:
    service = service_for(store, Clock())
    small = await queue_message(store, [("a@one.test", Z)], body=[b"all of it"])
    large = await queue_message(store, [("b@two.test", Z)], body=[b"part 1", b"part 2"])
    jobs = {job.msg_id: job for job in await service.lease(Z, "w1", max_jobs=2)}
    assert jobs[small].body == b"all of it"
    assert jobs[large].body is None  # fetched chunk by chunk by the worker


@async_test
async def test_a_recipient_dropped_while_waiting_in_the_core_is_never_handed_out(
    store: QueueStore,
) -> None:
    service = service_for(store, Clock(), domain_connections=1)
    msg_id = await queue_message(store, [("a@one.test", Z)])
    other = await queue_message(store, [("b@one.test", Z), ("c@one.test", Z)])
    (first,) = await service.lease(Z, "w1")  # one.test's only slot: the rest wait in the core
    assert first.msg_id == msg_id
    await store.drop(other, T0, address="b@one.test")  # an administrator removes one
    await service.report("w1", outcome(first, Result.DELIVERED))
    (second,) = await service.lease(Z, "w1")
    assert [r.address for r in second.recipients] == ["c@one.test"]
    await assert_consistent(store)


@async_test
async def test_hold_takes_recipients_waiting_in_the_core_but_not_those_in_flight(
    store: QueueStore,
) -> None:
    service = service_for(store, Clock(), domain_connections=1)
    msg_id = await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)])
    waiting = await queue_message(store, [("c@one.test", Z)])
    jobs = await service.lease(Z, "w1", max_jobs=5)  # one.test has one slot: c waits here
    assert sorted(j.msg_id for j in jobs) == [msg_id, msg_id]
    assert await service.hold(waiting) == HoldCount(now=1, on_return=0)
    # both of its recipients are on the wire: held if their attempt ends undelivered
    assert await service.hold(msg_id) == HoldCount(now=0, on_return=2)
    for job in jobs:
        await service.report("w1", outcome(job, Result.DELIVERED))
    assert await service.lease(Z, "w1", max_jobs=5) == []  # c is held, not handed out
    assert store.count(Z, State.HELD) == 1
    await assert_consistent(store)
