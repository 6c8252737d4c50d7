"""The queue store's lifecycle contract, on a real LevelDB directory.

Every scenario ends with :func:`assert_consistent`: the O(1) counters must equal a full scan
of the records (``recount``), whatever happened before.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest

from tests.storage.conftest import (
    DEFAULT_BODY,
    MINUTE,
    SECOND,
    T0,
    StoreFactory,
    assert_consistent,
    async_test,
    family_keys,
    make_meta,
    message_keys,
    queue_message,
    rcpts,
)
from zoneq.errors import LeaseError, NotFound
from zoneq.protocol.events import EventKind
from zoneq.protocol.ids import format_id, id_time_ms
from zoneq.storage import keys
from zoneq.storage.records import Notice, Recipient, State
from zoneq.storage.store import Lease, Outcome, QueueStore

Z = "default"
OK = Outcome(reply="250 2.0.0 ok", code=250, enhanced="2.0.0")
LATER = Outcome(reply="451 4.7.1 try later", code=451, enhanced="4.7.1")
NO = Outcome(reply="550 5.1.1 no such user", code=550, enhanced="5.1.1")


def addresses(n: int, domain: str = "example.org", zone: str = Z) -> list[tuple[str, str]]:
    return [(f"user{i:03d}@{domain}", zone) for i in range(n)]


def lease_one(store: QueueStore, zone: str = Z, owner: str = "worker") -> Lease:
    (lease,) = store.lease(zone, 1, owner)
    return lease


def leased_pairs(leases: list[Lease]) -> list[tuple[int, str]]:
    return [(lease.recipient.msg_id, lease.recipient.address) for lease in leases]


def states(store: QueueStore, msg_id: int) -> dict[str, State]:
    return {q.recipient.address: q.state for q in store.recipients(msg_id)}


# --- commit and counts ------------------------------------------------------------------


@async_test
async def test_commit_makes_message_and_counts(store: QueueStore) -> None:
    body = (b"chunk-0 ", b"chunk-1 ", b"chunk-2")
    msg_id = await queue_message(
        store,
        [("a@one.example", Z), ("b@Two.Example", Z), ("c@one.example", "bulk")],
        body=body,
        headers={"Subject": "hi"},
    )
    assert store.count(Z, State.READY) == 2
    assert store.count("bulk", State.READY) == 1
    assert store.count(Z, State.DEFERRED) == store.count(Z, State.HELD) == 0
    assert store.count(Z, State.LEASED) == 0
    assert store.domain_count(Z, "one.example", State.READY) == 1
    assert store.domain_count(Z, "TWO.example", State.READY) == 1  # domains are lowercased
    assert store.domain_counts(Z, State.READY) == {"one.example": 1, "two.example": 1}
    assert store.domain_counts("bulk", State.READY) == {"one.example": 1}
    assert store.message_count() == 1
    assert store.zones() == {Z, "bulk"}

    meta = store.message(msg_id)
    assert meta.msg_id == msg_id
    assert set(meta.zones) == {Z, "bulk"}
    assert meta.recipient_count == 3
    assert meta.size == sum(map(len, body))
    assert meta.chunks == 3
    assert meta.headers == {"Subject": "hi"}
    assert list(store.body(msg_id)) == list(body)
    assert states(store, msg_id) == {
        "a@one.example": State.READY,
        "b@Two.Example": State.READY,
        "c@one.example": State.READY,
    }
    # The receiving marker is gone with the commit.
    assert family_keys(store, keys.RECEIVING) == []
    await assert_consistent(store)


@async_test
async def test_commit_is_synced_and_outcomes_are_not(stores: StoreFactory) -> None:
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    await queue_message(store, addresses(2))
    assert db.syncs[-1] is True  # the commit fsyncs (the 250 may follow)
    await store.complete(lease_one(store), T0, OK)
    assert db.syncs[-1] is False
    await assert_consistent(store)


@async_test
async def test_commit_with_tail_writes_last_chunk_in_the_same_batch(store: QueueStore) -> None:
    msg_id = store.begin(T0)
    await store.write_chunk(msg_id, 0, b"first ")
    await store.write_chunk(msg_id, 1, b"second ")
    meta = make_meta(msg_id, size=17, chunks=3)
    await store.commit(meta, rcpts(("a@b.example", Z)), T0, tail=b"tail")
    assert list(store.body(msg_id)) == [b"first ", b"second ", b"tail"]
    # A one-chunk message can be committed whole, with no write_chunk at all.
    single = store.begin(T0)
    await store.commit(
        make_meta(single, size=4, chunks=1), rcpts(("a@b.example", Z)), T0, tail=b"body"
    )
    assert list(store.body(single)) == [b"body"]
    assert store.chunk(single, 0) == b"body"
    await assert_consistent(store)


@async_test
async def test_commit_without_recipients_is_refused(store: QueueStore) -> None:
    msg_id = store.begin(T0)
    with pytest.raises(ValueError):
        await store.commit(make_meta(msg_id), (), T0)
    await assert_consistent(store)
    assert store.message_count() == 0


@async_test
async def test_body_returns_chunks_in_order(store: QueueStore) -> None:
    body = [f"chunk {i:02d}|".encode() * (i + 1) for i in range(12)]  # 10, 11 after 9
    msg_id = await queue_message(store, addresses(1), body=body)
    assert list(store.body(msg_id)) == body
    assert [store.chunk(msg_id, i) for i in range(12)] == body
    with pytest.raises(NotFound):
        store.chunk(msg_id, 12)
    # A neighbouring message's chunks never leak into this body.
    other = await queue_message(store, addresses(1), body=[b"other"])
    assert list(store.body(msg_id)) == body
    assert list(store.body(other)) == [b"other"]


# --- leasing and completing -------------------------------------------------------------


@async_test
async def test_lease_is_oldest_message_first(store: QueueStore) -> None:
    ids = [await queue_message(store, [("b@x.example", Z), ("a@x.example", Z)]) for _ in range(5)]
    assert ids == sorted(ids)
    first = store.lease(Z, 3, "w1")
    assert leased_pairs(first) == [
        (ids[0], "a@x.example"),
        (ids[0], "b@x.example"),
        (ids[1], "a@x.example"),
    ]
    assert all(lease.owner == "w1" for lease in first)
    assert store.count(Z, State.LEASED) == store.leased(Z) == store.leased() == 3
    assert store.count(Z, State.READY) == 10  # leased ones are still ready on disk
    rest = store.lease(Z, 100, "w2")
    assert (
        leased_pairs(rest) == [(i, a) for i in ids[1:] for a in ("a@x.example", "b@x.example")][1:]
    )
    assert store.lease(Z, 10, "w3") == []
    assert store.lease("other-zone", 10, "w3") == []
    assert len({lease.token for lease in first + rest}) == 10
    await assert_consistent(store)


@async_test
async def test_lease_does_not_cross_into_neighbouring_zones(store: QueueStore) -> None:
    for zone in ("a", "a b", "a~", "ab", "\u00e9"):
        await queue_message(store, [(f"r@{zone.replace(' ', '-')}.example", zone)])
    for zone in ("a", "a b", "a~", "ab", "\u00e9"):
        leases = store.lease(zone, 10, "w")
        assert [lease.recipient.zone for lease in leases] == [zone]
        assert store.count(zone, State.READY) == 1
    await assert_consistent(store)


@async_test
async def test_complete_removes_recipient_and_message_goes_with_the_last(
    store: QueueStore,
) -> None:
    msg_id = await queue_message(store, addresses(3), body=[b"a", b"b", b"c"])
    all_keys = message_keys(store, msg_id)
    assert len(all_keys) == 5  # head, meta, three chunks
    leases = store.lease(Z, 3, "w")
    await store.complete(leases[0], T0 + SECOND, OK)
    assert message_keys(store, msg_id) == all_keys
    assert store.count(Z, State.READY) == 2
    assert store.message_count() == 1
    assert len(store.recipients(msg_id)) == 2
    await assert_consistent(store)
    await store.complete(leases[1], T0 + SECOND, OK)
    assert message_keys(store, msg_id) == all_keys
    assert list(store.body(msg_id)) == [b"a", b"b", b"c"]
    await store.complete(leases[2], T0 + SECOND, OK)
    await store.drain()
    assert message_keys(store, msg_id) == []
    with pytest.raises(NotFound):
        store.message(msg_id)
    assert store.message_count() == 0
    assert store.count(Z, State.READY) == 0
    assert store.zones() == set()
    assert store.counters() == {}
    assert family_keys(store, keys.READY) == []
    await assert_consistent(store)


@async_test
async def test_concurrent_completes_of_one_message_remove_it_once(store: QueueStore) -> None:
    msg_id = await queue_message(store, addresses(20))
    leases = store.lease(Z, 20, "w")
    await asyncio.gather(*(store.complete(lease, T0, OK) for lease in leases))
    assert message_keys(store, msg_id) == []
    assert store.message_count() == 0
    await assert_consistent(store)


# --- defer and promote ------------------------------------------------------------------


@async_test
async def test_defer_moves_to_deferred_with_a_due_index(store: QueueStore) -> None:
    msg_id = await queue_message(store, addresses(2))
    lease = lease_one(store)
    due = T0 + 10 * MINUTE
    await store.defer(lease, T0 + SECOND, due, LATER)
    assert store.count(Z, State.READY) == 1
    assert store.count(Z, State.DEFERRED) == 1
    assert store.domain_count(Z, "example.org", State.DEFERRED) == 1
    assert store.leased() == 0
    assert states(store, msg_id) == {
        "user000@example.org": State.DEFERRED,
        "user001@example.org": State.READY,
    }
    (deferred,) = [q.recipient for q in store.recipients(msg_id) if q.state is State.DEFERRED]
    assert deferred.attempts == 1
    assert deferred.first_attempt_ms == deferred.last_attempt_ms == T0 + SECOND
    assert deferred.next_attempt_ms == due
    assert deferred.last_reply == LATER.reply
    assert [keys.decode_due(k) for k in family_keys(store, keys.DUE)] == [
        (Z, due, msg_id, "user000@example.org")
    ]
    assert store.next_due(Z) == due
    # The deferred recipient is not leased again; the other one is.
    assert leased_pairs(store.lease(Z, 10, "w")) == [(msg_id, "user001@example.org")]
    await assert_consistent(store)


@async_test
async def test_promote_due_promotes_only_due_ones_and_keeps_attempts(store: QueueStore) -> None:
    msg_id = await queue_message(store, addresses(3))
    leases = store.lease(Z, 3, "w")
    for i, lease in enumerate(leases):
        await store.defer(lease, T0, T0 + (i + 1) * MINUTE, LATER)
    assert store.next_due(Z) == T0 + MINUTE
    assert await store.promote_due(Z, T0 + MINUTE - 1) == 0
    assert await store.promote_due(Z, T0 + 2 * MINUTE) == 2  # due_ms <= now is due
    assert store.count(Z, State.READY) == 2
    assert store.count(Z, State.DEFERRED) == 1
    assert store.next_due(Z) == T0 + 3 * MINUTE
    promoted = store.lease(Z, 10, "w")
    assert leased_pairs(promoted) == [
        (msg_id, "user000@example.org"),
        (msg_id, "user001@example.org"),
    ]
    for lease in promoted:
        assert lease.recipient.attempts == 1
        assert lease.recipient.last_reply == LATER.reply
        assert lease.recipient.first_attempt_ms == T0
    # A second failure counts as a second attempt.
    await store.defer(promoted[0], T0 + 3 * MINUTE, T0 + 4 * MINUTE, LATER)
    assert await store.promote_due(Z, T0 + 5 * MINUTE) == 2
    again = {lease.recipient.address: lease.recipient for lease in store.lease(Z, 10, "w")}
    assert again["user000@example.org"].attempts == 2
    assert again["user002@example.org"].attempts == 1
    assert family_keys(store, keys.DUE) == []
    assert family_keys(store, keys.DEFERRED) == []
    assert store.next_due(Z) is None
    await assert_consistent(store)


@async_test
async def test_promote_due_respects_limit_and_zone(store: QueueStore) -> None:
    await queue_message(store, addresses(5) + addresses(2, zone="other"))
    for lease in store.lease(Z, 5, "w") + store.lease("other", 5, "w"):
        await store.defer(lease, T0, T0 + MINUTE, LATER)
    assert await store.promote_due(Z, T0 + MINUTE, limit=2) == 2
    assert await store.promote_due(Z, T0 + MINUTE, limit=2) == 2
    assert await store.promote_due(Z, T0 + MINUTE) == 1
    assert await store.promote_due(Z, T0 + MINUTE) == 0
    assert store.count("other", State.DEFERRED) == 2
    assert await store.promote_due("other", T0 + MINUTE) == 2
    await assert_consistent(store)


@async_test
async def test_a_deferral_earlier_than_the_due_mark_is_still_promoted(store: QueueStore) -> None:
    await queue_message(store, addresses(2))
    first, second = store.lease(Z, 2, "w")
    await store.defer(first, T0, T0 + 10 * MINUTE, LATER)
    assert await store.promote_due(Z, T0 + 10 * MINUTE) == 1  # the mark moves past it
    await store.defer(second, T0, T0 + MINUTE, LATER)  # due before the mark
    assert store.next_due(Z) == T0 + MINUTE
    assert await store.promote_due(Z, T0 + 20 * MINUTE) == 1
    await assert_consistent(store)


# --- bounce -----------------------------------------------------------------------------


@async_test
async def test_bounce_without_notice(store: QueueStore) -> None:
    msg_id = await queue_message(store, addresses(2))
    first, second = store.lease(Z, 2, "w")
    await store.bounce(first, T0 + SECOND, NO)
    assert store.count(Z, State.READY) == 1
    assert store.message_count() == 1
    await store.bounce(second, T0 + 2 * SECOND, NO, expired=True)
    await store.drain()
    assert message_keys(store, msg_id) == []
    assert store.message_count() == 0
    kinds = [event.kind for _, event in store.events()]
    assert kinds == [EventKind.ACCEPTED, EventKind.BOUNCED, EventKind.EXPIRED]
    await assert_consistent(store)


@async_test
async def test_bounce_with_notice_queues_the_dsn_in_the_same_batch(stores: StoreFactory) -> None:
    store = stores.open(faulty=True, chunk_size=64)
    db = stores.faulty(store)
    msg_id = await queue_message(store, [("rcpt@remote.example", Z)])
    lease = lease_one(store)
    dsn_body = b"".join(b"DSN line %02d\r\n" % i for i in range(12))  # 156 bytes: 3 chunks
    notice = Notice(
        meta=make_meta(0, sender="", is_bounce=True, headers={"Subject": "failure"}),
        recipients=rcpts(("sender@example.org", "bounces")),
        body=dsn_body,
    )
    groups, writes = store._writer.groups_written, db.writes
    await store.bounce(lease, T0 + SECOND, NO, notice=notice)
    assert store._writer.groups_written == groups + 1
    assert db.writes == writes + 1  # one LevelDB batch for the bounce and the DSN
    assert db.syncs[-1] is True  # the DSN is a new message: synced like a commit

    assert message_keys(store, msg_id) == []
    assert store.message_count() == 1
    assert store.count("bounces", State.READY) == 1
    (dsn_lease,) = store.lease("bounces", 10, "w")
    dsn_id = dsn_lease.recipient.msg_id
    assert dsn_id > msg_id
    assert dsn_lease.recipient.address == "sender@example.org"
    meta = store.message(dsn_id)
    assert meta.is_bounce
    assert meta.sender == ""
    assert meta.size == len(dsn_body)
    assert meta.chunks == 3
    assert meta.zones == ("bounces",)
    assert b"".join(store.body(dsn_id)) == dsn_body
    assert [len(c) for c in store.body(dsn_id)] == [64, 64, 28]
    events = [event for _, event in store.events()]
    assert [(e.kind, e.zone) for e in events] == [
        (EventKind.ACCEPTED, Z),
        (EventKind.BOUNCED, Z),
        (EventKind.ACCEPTED, "bounces"),
    ]
    assert events[2].message_id == format_id(dsn_id)
    assert events[2].size == len(dsn_body)
    await assert_consistent(store)


# --- release and stale leases -----------------------------------------------------------


@async_test
async def test_release_makes_a_lease_ready_again_at_once(store: QueueStore) -> None:
    await queue_message(store, addresses(3))
    a, b, c = store.lease(Z, 3, "w")
    store.release(b)
    assert store.leased() == 2
    assert leased_pairs(store.lease(Z, 10, "w")) == leased_pairs([b])
    store.release_owner("w")
    await assert_consistent(store)
    del a, c


@async_test
async def test_release_owner_returns_only_that_owners_leases(store: QueueStore) -> None:
    await queue_message(store, addresses(6))
    mine = store.lease(Z, 2, "conn-1")
    theirs = store.lease(Z, 2, "conn-2")
    assert store.release_owner("conn-1") == 2
    assert store.release_owner("conn-1") == 0
    assert store.leased() == 2
    again = store.lease(Z, 10, "conn-3")
    # The released ones come first (oldest), then the two never leased.
    assert leased_pairs(again)[:2] == leased_pairs(mine)
    assert len(again) == 4
    for lease in theirs:
        await store.complete(lease, T0, OK)
    with pytest.raises(LeaseError):
        await store.complete(mine[0], T0, OK)
    await assert_consistent(store)


async def _report(store: QueueStore, kind: str, lease: Lease) -> None:
    if kind == "complete":
        await store.complete(lease, T0 + SECOND, OK)
    elif kind == "defer":
        await store.defer(lease, T0 + SECOND, T0 + MINUTE, LATER)
    else:
        await store.bounce(lease, T0 + SECOND, NO)


@pytest.mark.parametrize("report", ["complete", "defer", "bounce"])
@pytest.mark.parametrize(
    "staleness", ["released", "dropped", "wrong-token", "reported-twice", "taken-over"]
)
@async_test
async def test_stale_or_foreign_lease_is_refused(
    store: QueueStore, report: str, staleness: str
) -> None:
    msg_id = await queue_message(store, addresses(2))
    lease = lease_one(store)
    if staleness == "released":
        store.release(lease)
    elif staleness == "dropped":
        await store.drop(msg_id, T0, lease.recipient.address)
    elif staleness == "wrong-token":
        lease = replace(lease, token=lease.token ^ 1)
    elif staleness == "reported-twice":
        await _report(store, report, lease)
    else:
        store.release(lease)
        current = lease_one(store, owner="someone-else")
        assert current.key == lease.key
    before = store.counters()
    with pytest.raises(LeaseError):
        await _report(store, report, lease)
    assert store.counters() == before
    await assert_consistent(store)


@async_test
async def test_a_lease_for_another_key_is_refused(store: QueueStore) -> None:
    await queue_message(store, addresses(2))
    first, second = store.lease(Z, 2, "w")
    forged = replace(first, key=second.key)  # right token, wrong recipient
    with pytest.raises(LeaseError):
        await store.complete(forged, T0, OK)
    await store.complete(first, T0, OK)
    await store.complete(second, T0, OK)
    await assert_consistent(store)


# --- administration ---------------------------------------------------------------------


@async_test
async def test_drop_whole_message_in_every_state(store: QueueStore) -> None:
    msg_id = await queue_message(store, addresses(3) + addresses(1, zone="other"))
    keep = await queue_message(store, addresses(1))
    leased, deferred = store.lease(Z, 2, "w")
    await store.defer(deferred, T0, T0 + MINUTE, LATER)
    assert await store.drop(msg_id, T0 + SECOND) == 4
    await store.drain()
    assert message_keys(store, msg_id) == []
    assert family_keys(store, keys.DUE) == []
    assert store.message_count() == 1
    assert store.leased() == 0  # the lease was revoked
    with pytest.raises(LeaseError):
        await store.complete(leased, T0, OK)
    with pytest.raises(NotFound):
        await store.drop(msg_id, T0)
    dropped = [e for _, e in store.events() if e.kind is EventKind.DROPPED]
    assert len(dropped) == 4
    assert {(e.zone, e.recipient, e.attempt) for e in dropped} == {
        (Z, "user000@example.org", 0),
        (Z, "user001@example.org", 1),
        (Z, "user002@example.org", 0),
        ("other", "user000@example.org", 0),
    }
    assert all(e.message_id == format_id(msg_id) for e in dropped)
    # The other message is untouched and still leases.
    assert leased_pairs(store.lease(Z, 10, "w")) == [(keep, "user000@example.org")]
    await assert_consistent(store)


@async_test
async def test_drop_one_recipient_revokes_its_lease(store: QueueStore) -> None:
    msg_id = await queue_message(store, addresses(3))
    lease = lease_one(store)
    assert await store.drop(msg_id, T0, lease.recipient.address) == 1
    assert store.leased() == 0
    with pytest.raises(LeaseError):
        await store.complete(lease, T0, OK)
    assert len(message_keys(store, msg_id)) == 4  # head, meta, two chunks
    assert set(states(store, msg_id)) == {"user001@example.org", "user002@example.org"}
    with pytest.raises(NotFound):
        await store.drop(msg_id, T0, "nobody@example.org")
    with pytest.raises(NotFound):
        await store.drop(msg_id + 1, T0)
    # Dropping the rest one by one removes the message with the last.
    await store.drop(msg_id, T0, "user001@example.org")
    assert store.message_count() == 1
    await store.drop(msg_id, T0, "user002@example.org")
    await store.drain()
    assert message_keys(store, msg_id) == []
    assert store.message_count() == 0
    await assert_consistent(store)


@async_test
async def test_hold_and_unhold(store: QueueStore) -> None:
    msg_id = await queue_message(store, addresses(3))
    leased, deferred = store.lease(Z, 2, "w")
    await store.defer(deferred, T0, T0 + MINUTE, LATER)
    # Leased recipients finish first; ready and deferred ones go on hold.
    assert await store.hold(msg_id, reason="spam check") == 2
    assert states(store, msg_id) == {
        "user000@example.org": State.LEASED,
        "user001@example.org": State.HELD,
        "user002@example.org": State.HELD,
    }
    assert store.count(Z, State.HELD) == 2
    assert store.count(Z, State.DEFERRED) == 0
    assert store.count(Z, State.READY) == 1  # the leased one
    held = {q.recipient.address: q.recipient for q in store.recipients(msg_id)}
    assert held["user001@example.org"].hold_reason == "spam check"
    assert held["user001@example.org"].attempts == 1
    assert family_keys(store, keys.DUE) == []  # a held recipient is never promoted
    assert await store.promote_due(Z, T0 + 60 * MINUTE) == 0
    assert store.next_due(Z) is None
    assert store.lease(Z, 10, "w") == []
    await assert_consistent(store)

    assert await store.unhold(msg_id) == 2
    assert await store.unhold(msg_id) == 0
    assert store.count(Z, State.HELD) == 0
    assert store.count(Z, State.READY) == 3
    released = {lease.recipient.address: lease.recipient for lease in store.lease(Z, 10, "w")}
    assert set(released) == {"user001@example.org", "user002@example.org"}
    assert released["user001@example.org"].attempts == 1  # history kept
    assert released["user001@example.org"].hold_reason == ""
    assert released["user001@example.org"].next_attempt_ms == 0
    await store.complete(leased, T0, OK)
    await assert_consistent(store)


@async_test
async def test_retry_now_by_zone_message_and_domain(store: QueueStore) -> None:
    m1 = await queue_message(store, [("a@one.example", Z), ("b@two.example", Z)])
    m2 = await queue_message(store, [("c@one.example", Z), ("d@Two.Example", Z)])
    m3 = await queue_message(store, [("e@one.example", Z), ("f@one.example", "other")])
    for lease in store.lease(Z, 10, "w") + store.lease("other", 10, "w"):
        await store.defer(lease, T0, T0 + 60 * MINUTE, LATER)
    assert store.count(Z, State.DEFERRED) == 5

    assert await store.retry_now(Z, domain="TWO.example") == 2
    assert {
        (lease.recipient.msg_id, lease.recipient.address) for lease in store.lease(Z, 10, "w")
    } == {
        (m1, "b@two.example"),
        (m2, "d@Two.Example"),
    }
    # Leased recipients count too: due at once if their attempt defers (retrymarks.py).
    assert await store.retry_now(Z, msg_id=m2) == 2  # c, and d on the wire
    assert leased_pairs(store.lease(Z, 10, "w")) == [(m2, "c@one.example")]
    assert await store.retry_now(Z) == 5  # a and e, and b, c and d on the wire
    assert leased_pairs(store.lease(Z, 10, "w")) == [(m1, "a@one.example"), (m3, "e@one.example")]
    assert await store.retry_now(Z) == 5  # nothing deferred: the five on the wire
    assert store.count(Z, State.DEFERRED) == 0
    assert store.count("other", State.DEFERRED) == 1  # another zone is untouched
    # Their due entries went with them: nothing is promoted twice.
    assert await store.promote_due(Z, T0 + 120 * MINUTE) == 0
    assert [keys.decode_due(k)[0] for k in family_keys(store, keys.DUE)] == ["other"]
    await assert_consistent(store)


@async_test
async def test_recipients_shows_leased_ones_as_leased(store: QueueStore) -> None:
    msg_id = await queue_message(store, addresses(3))
    lease = lease_one(store)
    assert states(store, msg_id) == {
        "user000@example.org": State.LEASED,
        "user001@example.org": State.READY,
        "user002@example.org": State.READY,
    }
    store.release(lease)
    assert set(states(store, msg_id).values()) == {State.READY}
    with pytest.raises(NotFound):
        store.recipients(msg_id + 1)


@async_test
async def test_browse_pages_through_a_deep_zone(store: QueueStore) -> None:
    ids = [await queue_message(store, addresses(10)) for _ in range(25)]
    # Neighbouring zones must not show up in the pages.
    await queue_message(store, addresses(3, zone=Z + " b") + addresses(3, zone=Z + "~"))
    expected = [(i, a) for i in ids for a, _ in addresses(10)]
    seen: list[tuple[int, str]] = []
    after = None
    pages = 0
    while True:
        page, after = store.browse(Z, State.READY, after=after, limit=40)
        pages += 1
        seen += [(r.msg_id, r.address) for r in page]
        assert all(r.zone == Z for r in page)
        if after is None:
            break
        assert len(page) == 40
    assert pages == 7  # 6 full pages and one of 10
    assert seen == expected  # key order, each record once

    # An exact multiple of the page size ends with an empty page.
    page, after = store.browse(Z, State.READY, limit=250)
    assert len(page) == 250
    assert after is not None
    assert store.browse(Z, State.READY, after=after, limit=250) == ([], None)

    # Other states page their own families.
    for lease in store.lease(Z, 15, "w"):
        await store.defer(lease, T0, T0 + MINUTE, LATER)
    await store.hold(ids[-1])
    deferred, cursor = store.browse(Z, State.DEFERRED, limit=100)
    assert cursor is None
    assert [(r.msg_id, r.address) for r in deferred] == expected[:15]
    held, _ = store.browse(Z, State.HELD)
    assert [(r.msg_id, r.address) for r in held] == expected[-10:]
    assert [r.hold_reason for r in held] == ["held by administrator"] * 10
    ready, _ = store.browse(Z, State.READY, limit=1000)
    assert len(ready) == 250 - 15 - 10
    await assert_consistent(store)


@async_test
async def test_browse_hides_what_is_being_deleted(store: QueueStore) -> None:
    await queue_message(store, addresses(3))
    lease = lease_one(store)
    task = asyncio.ensure_future(store.complete(lease, T0, OK))
    await asyncio.sleep(0)  # staged, maybe not yet written
    page, _ = store.browse(Z)
    assert [r.address for r in page] == ["user001@example.org", "user002@example.org"]
    await task
    await assert_consistent(store)


# --- the per-zone low-water mark --------------------------------------------------------


@async_test
async def test_lease_after_many_completions_starts_at_the_cursor(store: QueueStore) -> None:
    ids = [await queue_message(store, addresses(4)) for _ in range(15)]
    for _ in range(7):  # 56 of 60 delivered, in batches
        for lease in store.lease(Z, 8, "w"):
            await store.complete(lease, T0, OK)
    await store.drain()
    first_key = keys.record(keys.READY, Z, ids[0], "user000@example.org")
    assert store._cursors[Z] > first_key  # the scan no longer starts at the zone's top
    assert leased_pairs(store.lease(Z, 10, "w")) == [(ids[14], a) for a, _ in addresses(4)]
    late = await queue_message(store, addresses(1))
    assert leased_pairs(store.lease(Z, 10, "w")) == [(late, "user000@example.org")]
    await assert_consistent(store)


@async_test
async def test_released_recipient_older_than_cursor_is_leased_next(store: QueueStore) -> None:
    await queue_message(store, addresses(6))
    first = store.lease(Z, 3, "w")
    store.lease(Z, 2, "w")  # the cursor is now past the fifth
    store.release(first[1])
    assert leased_pairs(store.lease(Z, 1, "w")) == leased_pairs([first[1]])
    store.release_owner("w")
    assert len(store.lease(Z, 10, "w")) == 6
    await assert_consistent(store)


@async_test
async def test_retried_recipient_older_than_cursor_is_leased_next(store: QueueStore) -> None:
    ids = [await queue_message(store, addresses(1)) for _ in range(6)]
    oldest = lease_one(store)
    await store.defer(oldest, T0, T0 + 60 * MINUTE, LATER)
    for lease in store.lease(Z, 3, "w"):
        await store.complete(lease, T0, OK)
    assert await store.retry_now(Z) == 1
    assert leased_pairs(store.lease(Z, 1, "w")) == [(ids[0], "user000@example.org")]
    await assert_consistent(store)


@async_test
async def test_promoted_recipient_older_than_cursor_is_leased_next(store: QueueStore) -> None:
    ids = [await queue_message(store, addresses(1)) for _ in range(6)]
    oldest = lease_one(store)
    await store.defer(oldest, T0, T0 + MINUTE, LATER)
    for lease in store.lease(Z, 3, "w"):
        await store.complete(lease, T0, OK)
    assert await store.promote_due(Z, T0 + MINUTE) == 1
    assert leased_pairs(store.lease(Z, 1, "w")) == [(ids[0], "user000@example.org")]
    await assert_consistent(store)


@async_test
async def test_unheld_recipient_older_than_cursor_is_leased_next(store: QueueStore) -> None:
    ids = [await queue_message(store, addresses(1)) for _ in range(4)]
    await store.hold(ids[0])
    assert leased_pairs(store.lease(Z, 2, "w")) == [
        (ids[1], "user000@example.org"),
        (ids[2], "user000@example.org"),
    ]
    await store.unhold(ids[0])
    assert leased_pairs(store.lease(Z, 1, "w")) == [(ids[0], "user000@example.org")]
    await assert_consistent(store)


@async_test
async def test_late_commit_of_an_older_id_is_leased_next(store: QueueStore) -> None:
    slow = store.begin(T0)  # a long DATA: its id is older than what commits meanwhile
    await store.write_chunk(slow, 0, b"slow body")
    fast = [await queue_message(store, addresses(1), now_ms=T0 + SECOND) for _ in range(3)]
    assert len(store.lease(Z, 10, "w")) == 3
    await store.commit(
        make_meta(slow, size=9, chunks=1), rcpts(("late@example.org", Z)), T0 + MINUTE
    )
    assert slow < min(fast)
    assert leased_pairs(store.lease(Z, 10, "w")) == [(slow, "late@example.org")]
    await assert_consistent(store)


@async_test
async def test_passed_over_recipient_keeps_the_cursor(store: QueueStore) -> None:
    await queue_message(
        store, [("a@slow.example", Z), ("b@fast.example", Z), ("c@fast.example", Z)]
    )
    got = store.lease(Z, 10, "w", accept=lambda r: r.domain != "slow.example")
    assert [lease.recipient.address for lease in got] == ["b@fast.example", "c@fast.example"]
    (slow,) = store.lease(Z, 10, "w")
    assert slow.recipient.address == "a@slow.example"
    await assert_consistent(store)


@async_test
async def test_readied_while_a_scan_moves_past_is_found_once_durable(stores: StoreFactory) -> None:
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    ids = [await queue_message(store, addresses(1)) for _ in range(4)]
    oldest = lease_one(store)
    await store.defer(oldest, T0, T0 + 60 * MINUTE, LATER)
    db.gate = threading.Event()
    db.entered.clear()
    retry = asyncio.ensure_future(store.retry_now(Z))
    while not db.entered.is_set():
        await asyncio.sleep(0.001)
    # The retry is staged but not on disk: a lease scan passes its position.
    assert leased_pairs(store.lease(Z, 10, "w")) == [(i, "user000@example.org") for i in ids[1:]]
    db.gate.set()
    assert await retry == 1
    assert leased_pairs(store.lease(Z, 10, "w")) == [(ids[0], "user000@example.org")]
    await assert_consistent(store)


# --- corruption -------------------------------------------------------------------------


@async_test
async def test_corrupt_record_is_quarantined_and_the_rest_still_lease(store: QueueStore) -> None:
    ids = [await queue_message(store, addresses(1)) for _ in range(3)]
    bad_key = keys.record(keys.READY, Z, ids[1], "user000@example.org")
    store.database.write([(bad_key, b"garbage")], sync=True)
    leases = store.lease(Z, 10, "w")
    assert leased_pairs(leases) == [
        (ids[0], "user000@example.org"),
        (ids[2], "user000@example.org"),
    ]
    assert [q.key for q in store.quarantined] == [bad_key]
    assert "corrupt" in str(store.quarantined[0])
    store.release_owner("w")
    assert len(store.lease(Z, 10, "w")) == 2
    assert [q.key for q in store.quarantined] == [bad_key]  # reported once
    page, _ = store.browse(Z)
    assert [r.msg_id for r in page] == [ids[0], ids[2]]
    await assert_consistent(store)  # the record is still counted, and still on disk


@async_test
async def test_record_with_wrong_version_is_quarantined(store: QueueStore) -> None:
    msg_id = await queue_message(store, addresses(2))
    key = keys.record(keys.READY, Z, msg_id, "user000@example.org")
    newer = Recipient(Z, msg_id, "user000@example.org", "example.org").encode()
    store.database.write([(key, b"\x9a\x02" + newer[2:])], sync=True)  # version 2
    assert leased_pairs(store.lease(Z, 10, "w")) == [(msg_id, "user001@example.org")]
    assert [q.key for q in store.quarantined] == [key]


# --- sweep ------------------------------------------------------------------------------


def chunk_keys(store: QueueStore, msg_id: int) -> list[bytes]:
    return list(store.database.keys(prefix=keys.chunk_prefix(msg_id)))


@async_test
async def test_sweep_removes_only_stale_uncommitted_chunks(store: QueueStore) -> None:
    in_progress = store.begin(T0)  # DATA still streaming: never swept, however old
    await store.write_chunk(in_progress, 0, b"streaming")
    orphan = store.begin(T0)
    await store.write_chunk(orphan, 0, b"lost 0")
    await store.write_chunk(orphan, 1, b"lost 1")
    young = store.begin(T0 + 10 * MINUTE)
    await store.write_chunk(young, 0, b"lost young")
    # A receiver that lost track of a message without abandon() (the store has no public
    # way to produce this while running: it is what a failed commit leaves behind).
    store._receiving.pop(orphan)
    store._receiving.pop(young)
    committed = await queue_message(store, addresses(1), body=[b"kept 0", b"kept 1"])

    assert await store.sweep(T0 + 10 * MINUTE + SECOND, 5 * MINUTE) == 1
    await store.drain()
    assert chunk_keys(store, orphan) == []
    assert store.database.get(keys.receiving(orphan)) is None
    assert len(chunk_keys(store, young)) == 1
    assert len(chunk_keys(store, in_progress)) == 1
    assert list(store.body(committed)) == [b"kept 0", b"kept 1"]

    assert await store.sweep(T0 + 60 * MINUTE, 5 * MINUTE) == 1  # now the young one
    assert await store.sweep(T0 + 60 * MINUTE, 5 * MINUTE) == 0
    await store.drain()
    assert chunk_keys(store, young) == []
    assert chunk_keys(store, in_progress) == [keys.message_chunk(in_progress, 0)]
    assert list(store.body(committed)) == [b"kept 0", b"kept 1"]
    # The streaming message can still commit, whole.
    await store.write_chunk(in_progress, 1, b" on")
    await store.commit(make_meta(in_progress, size=12, chunks=2), rcpts(("a@b.example", Z)), T0)
    assert list(store.body(in_progress)) == [b"streaming", b" on"]
    assert family_keys(store, keys.RECEIVING) == []
    await assert_consistent(store)


@async_test
async def test_abandon_removes_chunks_and_marker(store: QueueStore) -> None:
    msg_id = store.begin(T0)
    for i in range(3):
        await store.write_chunk(msg_id, i, b"x" * 10)
    await store.abandon(msg_id)
    await store.drain()
    assert chunk_keys(store, msg_id) == []
    assert family_keys(store, keys.RECEIVING) == []
    assert await store.sweep(T0 + 60 * MINUTE, MINUTE) == 0
    await assert_consistent(store)


# --- recover and reopen -----------------------------------------------------------------


@async_test
async def test_recover_after_restart(stores: StoreFactory) -> None:
    first = stores.open()
    m1 = await queue_message(first, addresses(3), body=[b"one ", b"body"])
    m2 = await queue_message(first, addresses(1) + addresses(2, zone="other"))
    m3 = await queue_message(first, addresses(1))
    leased = first.lease(Z, 2, "w")  # m1's first two: in flight at the "crash"
    to_defer = first.lease(Z, 1, "w")[0]
    await first.defer(to_defer, T0, T0 + MINUTE, LATER)
    await first.hold(m3)
    orphan = first.begin(T0)
    await first.write_chunk(orphan, 0, b"never committed")
    counters = first.counters()
    ids_before = [m1, m2, m3, orphan]
    await first.close()

    second = stores.open(recover=False)
    assert second.recover() == 1  # the orphan's marker
    assert chunk_keys(second, orphan) == []
    assert second.leased() == 0
    assert second.counters() == counters == second.recount()
    again = second.lease(Z, 10, "w")
    # Everything that was leased is ready again at once, oldest first.
    assert leased_pairs(again)[:2] == leased_pairs(leased)
    assert {lease.recipient.msg_id for lease in again} == {m1, m2}
    assert second.count(Z, State.DEFERRED) == 1
    assert second.next_due(Z) == T0 + MINUTE
    assert second.count(Z, State.HELD) == 1
    assert list(second.body(m1)) == [b"one ", b"body"]
    # New ids are above every id the store holds, even when the clock reads earlier.
    new_id = second.begin(T0 - 60 * MINUTE)
    assert new_id > max(ids_before)
    assert await second.promote_due(Z, T0 + MINUTE) == 1
    await assert_consistent(second)


@async_test
async def test_reopen_in_process_keeps_the_leases_that_are_out(store: QueueStore) -> None:
    # A reopen heals a storage fault while deliveries are in flight: they report after it,
    # and their recipients must not be handed out again meanwhile (zoneq/storage/held.py).
    await queue_message(store, addresses(2))
    lease = lease_one(store)
    before = store.counters()
    store.reopen()
    assert store.leased() == 1
    assert store.counters() == before
    (other,) = store.lease(Z, 10, "w")
    assert other.key != lease.key
    await store.complete(lease, T0, OK)
    await store.complete(other, T0, OK)
    assert store.message_count() == 0
    await assert_consistent(store)


@async_test
async def test_recover_after_many_transitions_matches_recount(stores: StoreFactory) -> None:
    first = stores.open()
    for n in range(12):
        await queue_message(first, addresses(n % 4 + 1, domain=f"d{n % 3}.example"))
    leases = first.lease(Z, 100, "w")
    for i, lease in enumerate(leases):
        if i % 3 == 0:
            await first.complete(lease, T0, OK)
        elif i % 3 == 1:
            await first.defer(lease, T0, T0 + i * SECOND, LATER)
        else:
            await first.bounce(lease, T0, NO)
    await first.promote_due(Z, T0 + 10 * SECOND)
    counters = first.counters()
    await assert_consistent(first)
    await first.close()
    second = stores.open()
    assert second.counters() == counters == second.recount()


# --- events -----------------------------------------------------------------------------


@async_test
async def test_events_record_every_transition(store: QueueStore) -> None:
    msg_id = await queue_message(
        store, [("a@one.example", Z), ("b@two.example", Z), ("c@three.example", "other")]
    )
    mid = format_id(msg_id)
    queued_at = id_time_ms(msg_id)
    first, second = store.lease(Z, 2, "w")
    delivered = Outcome(
        reply="250 2.0.0 queued as X",
        code=250,
        enhanced="2.0.0",
        mx="mx.one.example",
        source_ip="192.0.2.1",
    )
    await store.complete(first, T0 + 1 * SECOND, delivered)
    await store.defer(second, T0 + 2 * SECOND, T0 + MINUTE, replace(LATER, possible_duplicate=True))
    await store.bounce(lease_one(store, "other"), T0 + 3 * SECOND, NO)
    await store.drop(msg_id, T0 + 4 * SECOND)

    events = [event for _, event in store.events()]
    assert [e.kind for e in events] == [
        EventKind.ACCEPTED,
        EventKind.ACCEPTED,
        EventKind.DELIVERED,
        EventKind.DEFERRED,
        EventKind.BOUNCED,
        EventKind.DROPPED,
    ]
    # ACCEPTED is one event per (message, zone), with the number of recipients.
    accepted = {e.zone: e for e in events[:2]}
    assert accepted[Z].recipients == 2
    assert accepted["other"].recipients == 1
    for e in accepted.values():
        assert (e.time_ms, e.message_id, e.queued_at_ms) == (T0, mid, queued_at)
        assert e.size == sum(map(len, DEFAULT_BODY))
        assert (e.recipient, e.domain) == ("", "")
    done = events[2]
    assert (done.time_ms, done.zone, done.message_id) == (T0 + SECOND, Z, mid)
    assert (done.recipient, done.domain, done.attempt) == ("a@one.example", "one.example", 1)
    assert (done.mx, done.source_ip, done.code, done.enhanced) == (
        "mx.one.example",
        "192.0.2.1",
        250,
        "2.0.0",
    )
    assert done.text == delivered.reply
    assert done.queued_at_ms == queued_at
    assert not done.possible_duplicate
    later = events[3]
    assert (later.recipient, later.code, later.attempt) == ("b@two.example", 451, 1)
    assert later.possible_duplicate
    bounced = events[4]
    assert (bounced.zone, bounced.recipient, bounced.code, bounced.enhanced) == (
        "other",
        "c@three.example",
        550,
        "5.1.1",
    )
    dropped = events[5]
    assert (dropped.zone, dropped.recipient, dropped.attempt) == (Z, "b@two.example", 1)
    assert dropped.time_ms == T0 + 4 * SECOND
    await assert_consistent(store)


@async_test
async def test_events_are_in_time_order_and_trimmed(store: QueueStore) -> None:
    await queue_message(store, addresses(4), now_ms=T0)
    leases = store.lease(Z, 4, "w")
    # The log is in the order events were written, even if the clock stepped back between
    # two of them: an incremental export resumes after its watermark key, so an event must
    # never be written below a key that was already there.
    reported = (T0 + 30 * SECOND, T0 + 10 * SECOND, T0 + 20 * SECOND, T0 + 40 * SECOND)
    for lease, at in zip(leases, reported, strict=True):
        await store.complete(lease, at, OK)
    listed = list(store.events())
    times = [e.time_ms for _, e in listed]
    assert times == [T0, *reported]
    assert [key for key, _ in listed] == sorted(key for key, _ in listed)
    assert len(listed) == 5
    # An export resumes after its watermark.
    resumed = [e.time_ms for _, e in store.events(after=listed[1][0])]
    assert resumed == times[2:]
    assert list(store.events(after=listed[-1][0])) == []
    # Retention trims in log order, in bounded batches, up to the first event written at or
    # after the cut (here T0+30s, so the two events written later with earlier clock
    # readings stay: retention is coarse, and the log is never reordered).
    assert await store.trim_events(T0 + 40 * SECOND, limit=1) == 1
    assert await store.trim_events(T0 + 40 * SECOND) == 3
    assert await store.trim_events(T0 + 40 * SECOND) == 0
    await store.drain()
    assert [e.time_ms for _, e in store.events()] == [T0 + 40 * SECOND]
    await assert_consistent(store)


@async_test
async def test_event_numbering_continues_after_restart(stores: StoreFactory) -> None:
    first = stores.open()
    await queue_message(first, addresses(1), now_ms=T0)
    await queue_message(first, addresses(1), now_ms=T0 + SECOND)
    await first.close()
    second = stores.open()
    await queue_message(second, addresses(1), now_ms=T0 + 2 * SECOND)
    assert len(list(second.events())) == 3


# --- regressions: bugs these tests found in the store, fixed since ------------------------


@async_test
async def test_runtime_reopen_keeps_chunks_of_messages_being_received(
    stores: StoreFactory,
) -> None:
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    receiving = store.begin(T0)
    await store.write_chunk(receiving, 0, b"first half, ")
    # Another session's commit hits a transient write failure.
    other = store.begin(T0)
    db.fail_writes = 1
    with pytest.raises(Exception, match="injected"):
        await store.commit(make_meta(other, chunks=0), rcpts(("x@example.org", Z)), T0)
    assert store.lease(Z, 1, "w") == []  # the next operation heals the store (reopen)
    assert store.failure is None
    await store.write_chunk(receiving, 1, b"second half")
    await store.commit(make_meta(receiving, size=23, chunks=2), rcpts(("a@b.example", Z)), T0)
    assert list(store.body(receiving)) == [b"first half, ", b"second half"]


@async_test
async def test_a_commit_that_failed_but_landed_is_removed_at_the_reopen(
    stores: StoreFactory,
) -> None:
    # Found by the fault suite: fdatasync fails after LevelDB appended the batch to its
    # log, the client is told 4xx and sends again, and the reopen replays the batch: two
    # copies.  The store remembers the failed commit and removes it at the reopen.
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    kept = await queue_message(store, addresses(2), now_ms=T0)
    failed = store.begin(T0)
    db.fail_syncs = 1
    with pytest.raises(Exception, match="fdatasync"):
        await store.commit(make_meta(failed, chunks=0), rcpts(("x@example.org", Z)), T0 + 1)
    assert store.lease(Z, 10, "w") != []  # the next operation reopens the store
    assert store.failure is None
    with pytest.raises(NotFound):
        store.message(failed)
    assert store.message(kept).msg_id == kept
    assert store.message_count() == 1
    assert store.counters() == store.recount()
    dropped = [e for _, e in store.events() if e.kind is EventKind.DROPPED]
    assert [(e.message_id, e.recipient, e.time_ms) for e in dropped] == [
        (format_id(failed), "x@example.org", T0 + 1)
    ]


@async_test
async def test_a_commit_that_failed_before_its_write_leaves_nothing_to_undo(
    stores: StoreFactory,
) -> None:
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    kept = await queue_message(store, addresses(1), now_ms=T0)
    failed = store.begin(T0)
    db.fail_writes = 1
    with pytest.raises(Exception, match="injected"):
        await store.commit(make_meta(failed, chunks=0), rcpts(("x@example.org", Z)), T0)
    store.lease(Z, 10, "w")
    assert store.failure is None
    assert store.message_count() == 1 and store.message(kept).msg_id == kept
    assert not [e for _, e in store.events() if e.kind is EventKind.DROPPED]
    assert store.counters() == store.recount()


@async_test
async def test_abandon_while_a_chunk_is_in_flight_leaves_nothing(stores: StoreFactory) -> None:
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    msg_id = store.begin(T0)
    db.gate = threading.Event()
    db.entered.clear()
    writing = asyncio.ensure_future(store.write_chunk(msg_id, 0, b"in flight"))
    while not db.entered.is_set():
        await asyncio.sleep(0.001)
    abandoning = asyncio.ensure_future(store.abandon(msg_id))
    await asyncio.sleep(0)
    db.gate.set()
    await asyncio.gather(writing, abandoning)
    await store.drain()
    assert await store.sweep(T0 + 60 * MINUTE, MINUTE) == 0
    await store.drain()
    assert chunk_keys(store, msg_id) == []


@async_test
async def test_events_survive_restart_after_the_clock_stepped_back(stores: StoreFactory) -> None:
    first = stores.open()
    await queue_message(first, addresses(1), now_ms=T0 + MINUTE)  # event (T0+1m, seq n)
    await queue_message(first, addresses(1), now_ms=T0)  # clock stepped back: (T0, n+1)
    await first.close()
    second = stores.open()  # numbering restarts at n+1
    await queue_message(second, addresses(1), now_ms=T0)  # (T0, n+1) again
    assert len(list(second.events())) == 3


@async_test
async def test_ids_are_not_reused_after_the_queue_emptied(stores: StoreFactory) -> None:
    first = stores.open()
    used = [await queue_message(first, addresses(1), now_ms=T0) for _ in range(3)]
    for lease in first.lease(Z, 10, "w"):
        await first.complete(lease, T0, OK)
    await first.close()
    second = stores.open()
    assert second.begin(T0) > max(used)


@async_test
async def test_duplicate_recipient_in_one_commit_stays_consistent(store: QueueStore) -> None:
    msg_id = store.begin(T0)
    try:
        await store.commit(make_meta(msg_id), rcpts(("a@b.example", Z), ("a@b.example", Z)), T0)
    except ValueError:
        return  # refusing the duplicate would be fine too
    await assert_consistent(store)
    for lease in store.lease(Z, 10, "w"):
        await store.complete(lease, T0, OK)
    await store.drain()
    assert message_keys(store, msg_id) == []


@async_test
async def test_corrupt_head_does_not_corrupt_the_counters(store: QueueStore) -> None:
    msg_id = await queue_message(store, addresses(1))
    store.database.write([(keys.message_head(msg_id), b"\xc1")], sync=True)
    lease = lease_one(store)
    # Delivered all the same: the record leaves with its event (kept, it would be sent
    # again after every restart); the damaged message stays, quarantined.
    await store.complete(lease, T0, OK)
    assert [q.key for q in store.quarantined] == [keys.message_head(msg_id)]
    assert store.leased() == 0
    await assert_consistent(store)


@async_test
async def test_lease_stays_in_its_zone_when_a_zone_name_continues_with_nul(
    store: QueueStore,
) -> None:
    await queue_message(store, [("x@y.example", "a\x00b")])
    assert store.lease("a", 10, "w") == []


@async_test
async def test_drop_removes_a_message_with_a_corrupt_record(store: QueueStore) -> None:
    msg_id = await queue_message(store, addresses(2))
    bad_key = keys.record(keys.READY, Z, msg_id, "user000@example.org")
    store.database.write([(bad_key, b"garbage")], sync=True)
    await store.drop(msg_id, T0)
    await store.drain()
    assert message_keys(store, msg_id) == []
    assert store.database.get(bad_key) is None


def test_a_record_written_before_the_delay_flag_still_decodes() -> None:
    import msgpack

    from zoneq.storage.records import Recipient

    old = msgpack.packb([1, "example.org", 2, 10, 20, 30, "451 busy", ["DELAY"], None, ""])
    record = Recipient.decode(b"k", "z", 1, "a@example.org", old)
    assert record.attempts == 2 and record.notify == ("DELAY",)
    assert record.delay_notified is False
