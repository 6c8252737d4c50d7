"""Damaged stored messages, as a real store on disk holds them after a torn or lost write:
never delivered cut short, never sent again after a restart, and never the end of a report.

Messages are queued with the store's own helpers, the store is closed, the damage is
written with plyvel (``corrupt_key``: a lost ``#`` head, a garbage one, a short or missing
body chunk), and the store is opened again, as ``zoneq serve`` would find it after a crash.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.queue.test_service import BOUNCES, Clock, Z, outcome, service_for
from tests.reliability.test_corruption import corrupt_key
from tests.storage.conftest import T0, assert_consistent, async_test, queue_message
from zoneq.protocol.events import EventKind
from zoneq.queue.service import Result
from zoneq.storage import keys
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

GARBAGE = b"\xc1\xff not a head \x00"  # 0xc1 is never valid msgpack
BODY = (b"From: a@example.org\r\nSubject: damaged\r\n\r\n", b"line one\r\n" * 20)
DAMAGED = {"reply": "reading the message body failed", "enhanced": "4.6.0"}


def damage(path: Path, writes: Mapping[bytes, bytes | None]) -> None:
    """Overwrite (or, for None, delete) keys of a closed store, as a bad disk would."""
    for key, value in writes.items():
        corrupt_key(path, key, value)


def reopen(path: Path) -> QueueStore:
    store = QueueStore.open(path)
    store.recover()
    return store


async def queued(path: Path, *messages: list[tuple[str, str]]) -> list[int]:
    store = reopen(path)
    try:
        return [await queue_message(store, rcpts, body=BODY) for rcpts in messages]
    finally:
        await store.close()


def events_of(store: QueueStore, msg_id: int) -> list[tuple[EventKind, str]]:
    mid = f"{msg_id:016x}"
    return [(e.kind, e.recipient) for _, e in store.events() if e.message_id == mid]


@async_test
async def test_a_delivery_whose_message_lost_its_head_is_recorded_and_not_sent_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / "queue"
    headless, whole = await queued(
        path, [("a@one.test", Z), ("b@one.test", Z)], [("c@two.test", Z)]
    )
    damage(path, {keys.message_head(headless): None})
    store = reopen(path)
    service = service_for(store, Clock())
    jobs = await service.lease(Z, "w1", max_jobs=2)
    assert sorted(job.msg_id for job in jobs) == [headless, whole]  # its ``*`` reads fine
    report = [item for job in jobs for item in outcome(job, Result.DELIVERED, reply="250 ok")]
    accepted, refused = await service.report("w1", report)
    # The whole report stands: the damaged message's outcomes with the rest.
    assert (sorted(accepted), refused) == (sorted(item.token for item in report), [])
    await store.drain()
    assert store.leased() == 0 and store.count(Z, State.READY) == 0
    assert sorted(events_of(store, headless))[-2:] == [
        (EventKind.DELIVERED, "a@one.test"),
        (EventKind.DELIVERED, "b@one.test"),
    ]
    assert keys.message_head(headless) in [q.key for q in store.quarantined]
    assert store.message(headless).msg_id == headless  # kept, in quarantine, for an operator
    await store.close()
    # A restart finds nothing of it to send again.
    store = reopen(path)
    try:
        assert await service_for(store, Clock()).lease(Z, "w1") == []
    finally:
        await store.close()


@async_test
async def test_a_bounce_whose_message_has_a_garbage_head_is_recorded_with_its_dsn(
    tmp_path: Path,
) -> None:
    path = tmp_path / "queue"
    (msg_id,) = await queued(path, [("a@one.test", Z)])
    damage(path, {keys.message_head(msg_id): GARBAGE})
    store = reopen(path)
    try:
        service = service_for(store, Clock())
        (job,) = await service.lease(Z, "w1")
        bounced = outcome(job, Result.BOUNCED, reply="550 5.1.1 no such user", code=550)
        accepted, _ = await service.report("w1", bounced)
        assert accepted == [job.recipients[0].token]
        await store.drain()
        assert store.count(Z, State.READY) == 0 and store.leased() == 0
        assert (EventKind.BOUNCED, "a@one.test") in events_of(store, msg_id)
        assert store.count(BOUNCES, State.READY) == 1  # the sender still gets the DSN
        assert [q.key for q in store.quarantined] == [keys.message_head(msg_id)]
    finally:
        await store.close()


@async_test
async def test_a_local_fault_on_a_short_or_missing_chunk_quarantines_the_message(
    tmp_path: Path,
) -> None:
    path = tmp_path / "queue"
    short, missing, whole = await queued(
        path, [("a@one.test", Z)], [("b@two.test", Z)], [("c@three.test", Z)]
    )
    damage(
        path,
        {keys.message_chunk(short, 1): BODY[1][:25], keys.message_chunk(missing, 1): None},
    )
    store = reopen(path)
    try:
        service = service_for(store, Clock())
        jobs = await service.lease(Z, "w1", max_jobs=3)
        assert len(jobs) == 3
        report = [item for job in jobs for item in outcome(job, Result.DEFERRED, **DAMAGED)]
        accepted, _ = await service.report("w1", report)
        assert len(accepted) == 3
        await store.drain()
        # The damaged two are held (out of circulation, kept), the whole one deferred.
        assert store.count(Z, State.HELD) == 2
        assert store.count(Z, State.DEFERRED) == 1
        (deferred,) = store.browse(Z, State.DEFERRED)[0]
        assert deferred.msg_id == whole
        for msg_id in (short, missing):
            (queued_rcpt,) = store.recipients(msg_id)
            assert queued_rcpt.recipient.hold_reason.startswith("quarantined: damaged body")
        quarantined = {q.key for q in store.quarantined}
        assert quarantined == {keys.message_meta(short), keys.message_chunk(missing, 1)}
    finally:
        await store.close()


@pytest.mark.parametrize(
    "fault",
    [
        {"reply": "451 4.3.0 busy", "code": 451, "enhanced": "4.3.0"},  # the remote's
        {"reply": "local error: ValueError", "enhanced": "4.3.0"},  # the worker's, not the body
    ],
    ids=["remote-451", "local-error"],
)
@async_test
async def test_another_deferral_does_not_read_the_body(
    tmp_path: Path, fault: dict[str, Any]
) -> None:
    path = tmp_path / "queue"
    (msg_id,) = await queued(path, [("a@one.test", Z)])
    damage(path, {keys.message_chunk(msg_id, 1): None})
    store = reopen(path)
    try:
        service = service_for(store, Clock())
        (job,) = await service.lease(Z, "w1")
        await service.report("w1", outcome(job, Result.DEFERRED, **fault))
        await store.drain()
        # Only a damaged body reported as such makes the core read it (a whole body, on
        # the event loop): any other deferral, a fault of the worker's own included, not.
        assert store.count(Z, State.DEFERRED) == 1 and store.quarantined == []
    finally:
        await store.close()


@async_test
async def test_a_quarantine_with_corrupt_metadata_holds_the_recipient_and_the_report_stands(
    store: QueueStore,
) -> None:
    """The metadata goes bad while a job is out: the body check cannot read it, nor can the
    message's hold; the recipient still ends held, with its attempt on record, and the
    rest of the report is written."""
    service = service_for(store, Clock())
    bad = await queue_message(store, [("a@one.test", Z)], body=BODY)
    good = await queue_message(store, [("c@three.test", Z)], body=BODY)
    jobs = await service.lease(Z, "w1", max_jobs=2)
    assert len(jobs) == 2
    store.database.write([(keys.message_meta(bad), GARBAGE)], sync=True)
    (bad_job,) = [job for job in jobs if job.msg_id == bad]
    (good_job,) = [job for job in jobs if job.msg_id == good]
    items = [
        *outcome(bad_job, Result.DEFERRED, **DAMAGED),
        *outcome(good_job, Result.DELIVERED, reply="250 ok"),
    ]
    accepted, refused = await service.report("w1", items)
    await store.drain()
    assert (len(accepted), refused) == (2, [])
    assert store.leased() == 0
    assert store.count(Z, State.HELD) == 1
    assert (EventKind.DEFERRED, "a@one.test") in events_of(store, bad)


@async_test
async def test_a_quarantined_recipient_is_not_handed_out_again(store: QueueStore) -> None:
    """a and b of one damaged message are out with two workers; a's local fault holds the
    message, a included, and a third worker asking meanwhile gets nothing of it."""
    service = service_for(store, Clock())
    msg = await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)], body=BODY)
    store.database.write([(keys.message_chunk(msg, 1), None)], sync=True)
    (job_a,) = await service.lease(Z, "w1", max_jobs=1)
    (job_b,) = await service.lease(Z, "w2", max_jobs=1)
    reported = asyncio.ensure_future(
        service.report("w1", outcome(job_a, Result.DEFERRED, **DAMAGED))
    )
    for _ in range(3):
        await asyncio.sleep(0)
    again = await service.lease(Z, "w3", max_jobs=5)
    accepted, _ = await reported
    assert accepted == [job_a.recipients[0].token]
    assert again == []
    await store.drain()
    states = {q.recipient.address: q.state for q in store.recipients(msg)}
    assert states == {"a@one.test": State.HELD, "b@two.test": State.LEASED}
    # b's attempt fails the same way: held on return, by the mark the quarantine left.
    await service.report("w2", outcome(job_b, Result.DEFERRED, reply="451 4.4.1 busy", code=451))
    await store.drain()
    assert store.count(Z, State.HELD) == 2


@async_test
async def test_a_quarantine_refuses_a_revoked_lease(store: QueueStore) -> None:
    """A recipient deleted while on the wire: its local fault is refused like any stale
    report, and does not hold the rest of the message."""
    service = service_for(store, Clock())
    msg = await queue_message(store, [("a@one.test", Z), ("b@two.test", Z)], body=BODY)
    store.database.write([(keys.message_chunk(msg, 1), None)], sync=True)
    (job,) = await service.lease(Z, "w1", max_jobs=1)
    address = job.recipients[0].address
    reported = asyncio.ensure_future(service.report("w1", outcome(job, Result.DEFERRED, **DAMAGED)))
    dropped = asyncio.ensure_future(store.drop(msg, T0, address))
    accepted, refused = await reported
    assert await dropped == 1
    await store.drain()
    assert (accepted, refused) == ([], [job.recipients[0].token])
    # A refused report changes nothing: the other recipient (in the core's window) is not
    # held on its word.
    assert [(q.recipient.address, q.state) for q in store.recipients(msg)] == [
        (({"a@one.test", "b@two.test"} - {address}).pop(), State.LEASED)
    ]


@async_test
async def test_a_damaged_message_reported_for_many_recipients_is_held_once(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One job of four recipients of a torn message, all reported damaged in one report:
    the message is held once (one scan of its recipients, one log line), not once per
    recipient; every one of them ends held with its attempt on record, and so does the
    recipient of another domain still waiting in the core's window."""
    service = service_for(store, Clock())
    job_rcpts = [f"r{n}@one.test" for n in range(4)]
    msg = await queue_message(store, [(a, Z) for a in [*job_rcpts, "w@two.test"]], body=BODY)
    store.database.write([(keys.message_chunk(msg, 1), None)], sync=True)  # torn
    (job,) = await service.lease(Z, "w1", max_jobs=1)
    assert sorted(r.address for r in job.recipients) == job_rcpts
    holds: list[tuple[int, str]] = []
    hold_counted = store.hold_counted

    async def counted(msg_id: int, reason: str = "held by administrator") -> tuple[int, int]:
        holds.append((msg_id, reason))
        return await hold_counted(msg_id, reason)

    monkeypatch.setattr(store, "hold_counted", counted)
    caplog.set_level(logging.ERROR, logger="zoneq.queue")
    accepted, refused = await service.report("w1", outcome(job, Result.DEFERRED, **DAMAGED))
    await store.drain()
    assert (sorted(accepted), refused) == (sorted(r.token for r in job.recipients), [])
    assert [msg_id for msg_id, _ in holds] == [msg]
    assert holds[0][1].startswith("quarantined: damaged body")
    held_lines = [r for r in caplog.records if r.getMessage().endswith("; held")]
    assert len(held_lines) == 1, [r.getMessage() for r in held_lines]
    states = {q.recipient.address: q.state for q in store.recipients(msg)}
    assert states == dict.fromkeys([*job_rcpts, "w@two.test"], State.HELD)
    assert store.count(Z, State.HELD) == 5 and store.leased() == 0
    deferred = sorted(r for kind, r in events_of(store, msg) if kind is EventKind.DEFERRED)
    assert deferred == job_rcpts  # each attempt on record, once
    await assert_consistent(store)
