"""The notices the queue service queues: what they return, how many, and what they cost.

A real store on disk and the real ``QueueService``; the DSN is read back from the bounce
zone and parsed with the ``email`` package.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from tests.queue.test_bounces import returned_part
from tests.queue.test_service import BOUNCES, Clock, Z, dsn_of, outcome, service_for
from tests.storage.conftest import MINUTE, T0, assert_consistent, async_test, queue_message
from zoneq.protocol.dsn import SUBJECT_DELIVERED
from zoneq.protocol.events import EventKind
from zoneq.queue.service import QueueService, RecipientOutcome, Result, delayed_status
from zoneq.storage.records import NewRecipient, State
from zoneq.storage.store import QueueStore

# Stored in three chunks, the header section cut across the first two.
ORIGINAL = (
    b"From: Alice <alice@src.test>\r\nTo: user@dest.test\r\n",
    b"Subject: full return\r\nMessage-ID: <full@src.test>\r\n\r\nfirst line\r\n",
    b"\r\nGr\xfc\xdfe in latin1\r\n",
)


@async_test
async def test_a_ret_full_dsn_returns_the_stored_message_exactly(store: QueueStore) -> None:
    service = service_for(store, Clock())
    # A UTF-8 sender: only a notice that needs SMTPUTF8 anyway may return an 8-bit body in
    # message/rfc822 (an ASCII sender gets its header section, tests/queue/test_bounces.py).
    await queue_message(
        store,
        [("a@dest.test", Z)],
        body=ORIGINAL,
        ret="FULL",
        body_8bit=True,
        sender="jörg@src.test",
        smtputf8=True,
    )
    (job,) = await service.lease(Z, "w1")
    await service.report("w1", outcome(job, Result.BOUNCED, reply="550 5.1.1 no", enhanced="5.1.1"))
    dsn = dsn_of(store)
    assert [p.get_content_type() for p in dsn.iter_parts()][2] == "message/rfc822"
    (lease,) = store.lease(BOUNCES, 10, "test")
    body = b"".join(store.body(lease.recipient.msg_id))
    assert returned_part(body) == ("message/rfc822", b"".join(ORIGINAL))
    assert body.count(b"Subject: full return") == 1  # the header section once, not twice
    # The returned body is 8-bit: the notice goes out with BODY=8BITMIME (RFC 6152), and
    # SMTPUTF8 for its UTF-8 recipient (RFC 6531).
    meta = store.message(lease.recipient.msg_id)
    assert (meta.body_8bit, meta.smtputf8, meta.sender) == (True, True, "")
    store.release(lease)
    await assert_consistent(store)


async def lease_and_defer(service: QueueService) -> tuple[list[int], list[int]]:
    """Lease the one job waiting and report every recipient deferred (451 4.4.1)."""
    (job,) = await service.lease(Z, "w1")
    return await service.report(
        "w1", outcome(job, Result.DEFERRED, reply="451 4.4.1 busy", enhanced="4.4.1")
    )


@async_test
async def test_delayed_recipients_of_one_report_share_one_delay_notice(store: QueueStore) -> None:
    clock = Clock()
    service = service_for(store, clock)
    wanting = [f"r{n}@slow.test" for n in range(5)]
    recipients = [NewRecipient(a, Z, notify=("DELAY", "FAILURE")) for a in wanting]
    recipients.append(NewRecipient("quiet@slow.test", Z))  # no NOTIFY: no delay notice
    msg_id = await queue_message(store, recipients, ret="FULL")
    clock.now = T0 + 5 * 60 * MINUTE  # past the 4h delay warning
    accepted, refused = await lease_and_defer(service)
    assert len(accepted) == 6 and refused == []
    assert store.count(Z, State.DEFERRED) == 6
    assert store.count(BOUNCES, State.READY) == 1  # one notice, not one per recipient
    report = dsn_of(store)
    assert report["Subject"].startswith("Delayed Mail")
    status = report.get_payload()[1].get_payload()  # type: ignore[index,union-attr]
    blocks = [block for block in status[1:] if block["Final-Recipient"]]
    assert sorted(b["Final-Recipient"] for b in blocks) == [f"rfc822; {a}" for a in wanting]
    assert {b["Action"] for b in blocks} == {"delayed"}
    # A delay notice returns the headers only (RFC 3461 section 4.3 leaves it to the MTA).
    assert [p.get_content_type() for p in report.iter_parts()][2] == "text/rfc822-headers"
    notified = {r.recipient.address: r.recipient.delay_notified for r in store.recipients(msg_id)}
    assert notified == {**dict.fromkeys(wanting, True), "quiet@slow.test": False}
    # Deferred again: everyone listed was told once, and is not told again.
    clock.now = T0 + 10 * 60 * MINUTE
    await service.promote_due()
    await lease_and_defer(service)
    assert store.count(BOUNCES, State.READY) == 1
    await assert_consistent(store)


@pytest.mark.parametrize(
    ("sender", "notify", "notices"),
    [
        ("", (), 0),  # the null reverse-path
        ("sender@src.test", ("NEVER",), 0),
        ("sender@src.test", (), 1),  # the control: a notice, so the original is read
    ],
    ids=["null-sender", "notify-never", "control"],
)
@async_test
async def test_the_original_is_read_only_when_a_notice_is_sent(
    store: QueueStore,
    monkeypatch: pytest.MonkeyPatch,
    sender: str,
    notify: tuple[str, ...],
    notices: int,
) -> None:
    service = service_for(store, Clock())
    await queue_message(
        store, [NewRecipient("a@dest.test", Z, notify=notify)], sender=sender, ret="FULL"
    )
    (job,) = await service.lease(Z, "w1")
    reads: list[str] = []
    chunk, body = store.chunk, store.body

    def counted_chunk(msg_id: int, index: int) -> bytes:
        reads.append("chunk")
        return chunk(msg_id, index)

    def counted_body(msg_id: int) -> Any:
        reads.append("body")
        return body(msg_id)

    monkeypatch.setattr(store, "chunk", counted_chunk)
    monkeypatch.setattr(store, "body", counted_body)
    await service.report("w1", outcome(job, Result.BOUNCED, reply="550 5.1.1 no", enhanced="5.1.1"))
    assert store.count(BOUNCES, State.READY) == notices
    assert bool(reads) == bool(notices)
    assert store.message_count() == notices


def _slow_pair() -> list[NewRecipient]:
    return [NewRecipient(a, Z, notify=("DELAY",)) for a in ("a@slow.test", "b@slow.test")]


@async_test
async def test_a_delay_notice_survives_its_first_recipient_deleted_while_on_the_wire(
    store: QueueStore,
) -> None:
    """An administrator deletes a while the job for a and b is out: a's deferral is refused,
    and the shared notice rides with b instead of going down with a (b flagged as told)."""
    clock = Clock()
    service = service_for(store, clock)
    msg = await queue_message(store, _slow_pair())
    clock.now = T0 + 5 * 60 * MINUTE
    (job,) = await service.lease(Z, "w1")
    assert await store.drop(msg, clock.now, "a@slow.test") == 1
    accepted, refused = await service.report(
        "w1", outcome(job, Result.DEFERRED, reply="451 4.4.1 busy", enhanced="4.4.1")
    )
    await store.drain()
    assert (len(accepted), len(refused)) == (1, 1)
    assert store.count(BOUNCES, State.READY) == 1  # the notice is queued
    assert _listed(dsn_of(store)) == ["rfc822; b@slow.test"]  # not a: it is not retried
    (b,) = [q.recipient for q in store.recipients(msg)]
    assert (b.address, b.delay_notified) == ("b@slow.test", True)
    await assert_consistent(store)


@async_test
async def test_a_delay_notice_survives_its_carrier_deleted_before_the_write(
    store: QueueStore,
) -> None:
    """The narrow window: the delete comes after the report is claimed, before its writes."""
    clock = Clock()
    service = service_for(store, clock)
    msg = await queue_message(store, _slow_pair())
    clock.now = T0 + 5 * 60 * MINUTE
    (job,) = await service.lease(Z, "w1")
    reported = asyncio.ensure_future(
        service.report(
            "w1", outcome(job, Result.DEFERRED, reply="451 4.4.1 busy", enhanced="4.4.1")
        )
    )
    dropped = asyncio.ensure_future(store.drop(msg, clock.now, "a@slow.test"))
    accepted, refused = await reported
    assert await dropped == 1
    await store.drain()
    assert (len(accepted), len(refused)) == (1, 1)
    assert store.count(BOUNCES, State.READY) == 1
    (b,) = [q.recipient for q in store.recipients(msg)]
    assert b.delay_notified
    await assert_consistent(store)


def _listed(report: Any) -> list[str]:
    """The recipients a DSN's per-recipient blocks list (RFC 3464 section 2.3)."""
    status = report.get_payload()[1].get_payload()
    return sorted(b["Final-Recipient"] for b in status[1:] if b["Final-Recipient"])


_TRIO = ("a@dest.test", "b@dest.test", "c@dest.test")


@pytest.mark.parametrize("window", ["on-the-wire", "before-the-write"])
@async_test
async def test_a_dsn_survives_its_first_recipient_deleted(store: QueueStore, window: str) -> None:
    """Three recipients of one message fail in one report; an administrator deletes the
    first of them while the job is out (``on-the-wire``: before the report; or in the
    narrow window after the report is claimed, before its writes).  That one's bounce is
    refused; the DSN is queued exactly once.  Listed: those whose bounces were written
    (each writes its own owed failure), never the deleted one (a delete is silent)."""
    service = service_for(store, Clock())
    msg = await queue_message(store, [(a, Z) for a in _TRIO])
    (job,) = await service.lease(Z, "w1")
    first = job.recipients[0]
    failed = outcome(job, Result.BOUNCED, reply="550 5.1.1 no such user", enhanced="5.1.1")
    if window == "on-the-wire":
        assert await store.drop(msg, T0, first.address) == 1
        accepted, refused = await service.report("w1", failed)
    else:
        reported = asyncio.ensure_future(service.report("w1", failed))
        dropped = asyncio.ensure_future(store.drop(msg, T0, first.address))
        accepted, refused = await reported
        assert await dropped == 1
    await store.drain()
    assert (len(accepted), refused) == (2, [first.token])
    assert store.count(BOUNCES, State.READY) == 1  # the DSN, once
    others = [f"rfc822; {a}" for a in _TRIO if a != first.address]
    assert _listed(dsn_of(store)) == others
    mid = f"{msg:016x}"
    ends = [(e.recipient, e.kind) for _, e in store.events() if e.message_id == mid]
    assert sorted(end for end in ends if end[1] in (EventKind.BOUNCED, EventKind.DROPPED)) == [
        (a, EventKind.DROPPED if a == first.address else EventKind.BOUNCED) for a in _TRIO
    ]
    assert store.message_count() == 1  # the bounced message is gone; the DSN is queued
    await assert_consistent(store)


@pytest.mark.parametrize(
    ("reported", "status"),
    [
        ("4.4.1", "4.4.1"),
        ("5.7.1", "4.7.1"),  # a 554 greeting from every MX: deferred, not failed
        ("2.0.0", "4.0.0"),  # a DATA answered 250: out of step, deferred
        ("5.1.10", "4.1.10"),
        ("", "4.0.0"),
        ("not-a-code", "4.0.0"),
    ],
)
def test_a_delay_notice_status_is_transient(reported: str, status: str) -> None:
    # RFC 3463 section 3.1: class 5 is permanent; "Action: delayed" must not carry it.
    assert delayed_status(reported) == status


@async_test
async def test_a_deferral_with_a_permanent_code_gets_a_transient_delay_status(
    store: QueueStore,
) -> None:
    clock = Clock()
    service = service_for(store, clock)
    await queue_message(store, [NewRecipient("a@slow.test", Z, notify=("DELAY",))])
    clock.now = T0 + 5 * 60 * MINUTE  # past the 4h delay warning
    (job,) = await service.lease(Z, "w1")
    reply = "554 5.7.1 client host blocked"
    accepted, _ = await service.report(
        "w1", outcome(job, Result.DEFERRED, reply=reply, enhanced="5.7.1")
    )
    assert len(accepted) == 1
    status = dsn_of(store).get_payload()[1].get_payload()  # type: ignore[index,union-attr]
    (block,) = [block for block in status[1:] if block["Final-Recipient"]]
    assert (block["Action"], block["Status"]) == ("delayed", "4.7.1")
    assert "5.7.1 client host blocked" in block["Diagnostic-Code"]  # the reply as given
    await assert_consistent(store)


@pytest.mark.parametrize(
    ("local_reply", "remote_mta", "diagnostic"),
    [
        (False, "dns; mx.dest.test", "smtp; 451 4.7.0 not now"),  # the MX host said it
        (True, None, "X-zoneq; 451 4.7.0 not now"),  # a sender:connect plugin said it
    ],
)
@async_test
async def test_a_delay_notice_names_a_remote_mta_only_for_its_reply(
    store: QueueStore, local_reply: bool, remote_mta: str | None, diagnostic: str
) -> None:
    """RFC 3464 sections 2.3.5 and 2.3.6: Remote-MTA is the MTA that reported the status,
    and the type smtp is for its reply; a plugin's refusal made before any connection has
    neither, though the report still names the host it was about."""
    clock = Clock()
    service = service_for(store, clock)
    await queue_message(store, [NewRecipient("a@dest.test", Z, notify=("DELAY",))])
    clock.now = T0 + 5 * 60 * MINUTE  # past the 4h delay warning
    (job,) = await service.lease(Z, "w1")
    reported = outcome(
        job,
        Result.DEFERRED,
        reply="451 4.7.0 not now",
        code=451,
        enhanced="4.7.0",
        mx="mx.dest.test",
        local_reply=local_reply,
    )
    accepted, _ = await service.report("w1", reported)
    assert len(accepted) == 1
    status = dsn_of(store).get_payload()[1].get_payload()  # type: ignore[index,union-attr]
    (block,) = [block for block in status[1:] if block["Final-Recipient"]]
    assert (block["Action"], block["Remote-MTA"]) == ("delayed", remote_mta)
    assert block["Diagnostic-Code"] == diagnostic
    await assert_consistent(store)


_SUCCESS = ("SUCCESS", "FAILURE")


def _delivered(job: Any, relayed: set[str], **fields: Any) -> list[RecipientOutcome]:
    """Every recipient of ``job`` delivered (250 to the final dot from mx.dest.test); those
    in ``relayed`` as a worker reports them when the server did not offer DSN."""
    return [
        RecipientOutcome(
            r.token,
            Result.DELIVERED,
            reply="250 Ok: queued as 4C1D2",
            code=250,
            mx="mx.dest.test",
            relayed=r.address in relayed,
            **fields,
        )
        for r in job.recipients
    ]


@async_test
async def test_success_relayed_to_a_server_without_dsn_gets_one_relayed_notice(
    store: QueueStore,
) -> None:
    """RFC 3461 section 5.2.2: one notice for the report's relayed recipients of a message,
    queued with their completion; RET=FULL returns the headers only (section 4.3: RET is
    for notices that report a failure)."""
    service = service_for(store, Clock())
    recipients = [
        NewRecipient("a@dest.test", Z, notify=_SUCCESS, orcpt="rfc822;a@dest.test"),
        NewRecipient("b@dest.test", Z, notify=("SUCCESS",)),
        NewRecipient("c@dest.test", Z),  # no NOTIFY: delivered, nothing owed
    ]
    msg = await queue_message(store, recipients, body=ORIGINAL, ret="FULL", envid="env1")
    (job,) = await service.lease(Z, "w1")
    accepted, refused = await service.report("w1", _delivered(job, {"a@dest.test", "b@dest.test"}))
    await store.drain()
    assert (len(accepted), refused) == (3, [])
    assert store.count(BOUNCES, State.READY) == 1
    assert store.message_count() == 1  # the original is gone, its notice queued
    report = dsn_of(store)
    assert report["Subject"] == SUBJECT_DELIVERED and report["To"] == "sender@example.org"
    parts = list(report.iter_parts())
    assert [p.get_content_type() for p in parts] == [
        "text/plain",
        "message/delivery-status",
        "text/rfc822-headers",
    ]
    assert b"first line" not in parts[2].get_payload(decode=True)  # headers only
    status = parts[1].get_payload()
    assert status[0]["Original-Envelope-Id"] == "env1"
    blocks = {b["Final-Recipient"]: b for b in status[1:]}
    assert sorted(blocks) == ["rfc822; a@dest.test", "rfc822; b@dest.test"]
    for block in blocks.values():
        assert block["Action"] == "relayed"
        assert block["Status"] == "2.0.0"
        assert block["Remote-MTA"] == "dns; mx.dest.test"
        assert block["Diagnostic-Code"] == "smtp; 250 Ok: queued as 4C1D2"
    assert blocks["rfc822; a@dest.test"]["Original-Recipient"] == "rfc822; a@dest.test"
    mid = f"{msg:016x}"
    ends = sorted((e.recipient, e.kind) for _, e in store.events() if e.message_id == mid)
    assert [kind for _, kind in ends if kind is not EventKind.ACCEPTED] == [EventKind.DELIVERED] * 3
    await assert_consistent(store)


@pytest.mark.parametrize(
    ("sender", "notify", "relayed"),
    [
        ("", ("SUCCESS",), True),  # the null reverse-path (RFC 5321 section 4.5.5)
        ("sender@src.test", ("SUCCESS",), False),  # the server took NOTIFY (it offers DSN)
        ("sender@src.test", ("FAILURE",), False),  # no success asked
    ],
    ids=["null-sender", "passed-on", "failure-only"],
)
@async_test
async def test_no_relayed_notice_when_none_is_owed(
    store: QueueStore, sender: str, notify: tuple[str, ...], relayed: bool
) -> None:
    """Next to a message that is owed a notice (the control), one that is not owed any
    gets none: one notice in all, about the control's recipient alone."""
    service = service_for(store, Clock())
    control = [NewRecipient("owed@dest.test", Z, notify=("SUCCESS",))]
    await queue_message(store, control)
    await queue_message(store, [NewRecipient("a@dest.test", Z, notify=notify)], sender=sender)
    jobs = await service.lease(Z, "w1", max_jobs=2)
    reported = [
        item
        for job in jobs
        for item in _delivered(job, {"owed@dest.test", "a@dest.test"} if relayed else set())
    ]
    reported[0] = replace(reported[0], relayed=True)  # the control's: owed a notice
    accepted, _ = await service.report("w1", reported)
    await store.drain()
    assert len(accepted) == 2
    assert store.message_count() == 1  # both delivered; one notice queued
    assert _listed(dsn_of(store)) == ["rfc822; owed@dest.test"]
    await assert_consistent(store)


@async_test
async def test_a_relayed_notice_survives_its_first_recipient_deleted_on_the_wire(
    store: QueueStore,
) -> None:
    """The first relayed recipient's completion is refused (an administrator deleted it
    while it was out): the notice rides with the next, once, and lists only that one."""
    service = service_for(store, Clock())
    msg = await queue_message(store, [NewRecipient(a, Z, notify=("SUCCESS",)) for a in _TRIO])
    (job,) = await service.lease(Z, "w1")
    first = job.recipients[0]
    assert await store.drop(msg, T0, first.address) == 1
    accepted, refused = await service.report("w1", _delivered(job, set(_TRIO)))
    await store.drain()
    assert (len(accepted), refused) == (2, [first.token])
    assert store.count(BOUNCES, State.READY) == 1
    assert _listed(dsn_of(store)) == [f"rfc822; {a}" for a in _TRIO if a != first.address]
    await assert_consistent(store)
