"""Administrators' operations while a recipient's move is still on its way to disk.

Every transition is staged in the group writer's overlay until its batch lands.  A move
(deferred to ready, ready to held, ...) is a staged delete of one key and a staged insert
of another; the insert is on no disk yet.  A delete, hold or show in that window must still
see the recipient: a delete that missed it removed the message anyway, and the record then
landed with no message behind it, counted for ever and leased to the core for ever.

Each test holds the move's batch at the database's write gate (a real LevelDB handle, see
``FaultyDatabase``), acts while it waits, then lets it land.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest

from tests.storage.conftest import (
    MINUTE,
    T0,
    StoreFactory,
    assert_consistent,
    async_test,
    family_keys,
    make_meta,
    message_keys,
    queue_message,
)
from zoneq.errors import NotFound
from zoneq.protocol.events import EventKind
from zoneq.storage import keys
from zoneq.storage.admin import same_mailbox
from zoneq.storage.base import FAMILY_STATE, Outcome
from zoneq.storage.records import NewRecipient, Notice, State
from zoneq.storage.store import QueueStore

Z = "default"
LATER = Outcome(reply="451 4.3.0 later")
RECIPIENTS = [("a@example.org", Z), ("b@example.org", Z)]

Move = Callable[[QueueStore, int], Awaitable[object]]


async def _deferred(store: QueueStore) -> None:
    for lease in store.lease(Z, 10, "w"):
        await store.defer(lease, T0, T0 + MINUTE, LATER)


async def _defer_all(store: QueueStore, msg_id: int) -> None:
    leases = store.lease(Z, 10, "w")
    await asyncio.gather(*(store.defer(lease, T0, T0 + MINUTE, LATER) for lease in leases))


async def _promote(store: QueueStore, msg_id: int) -> int:
    return await store.promote_due(Z, T0 + MINUTE)


async def _retry(store: QueueStore, msg_id: int) -> int:
    return await store.retry_now(Z)


async def _hold(store: QueueStore, msg_id: int) -> int:
    return await store.hold(msg_id)


async def _release(store: QueueStore, msg_id: int) -> int:
    return await store.unhold(msg_id)


async def _none(store: QueueStore) -> None:
    return None


async def _held(store: QueueStore) -> None:
    msg_id = next(iter(store.lease(Z, 1, "probe"))).recipient.msg_id
    store.release_owner("probe")
    await store.hold(msg_id)


# (the state the recipients are in before, the move held at the gate, their state after it)
MOVES: dict[str, tuple[Callable[[QueueStore], Awaitable[None]], Move, State]] = {
    "defer": (_none, _defer_all, State.DEFERRED),
    "promote-due": (_deferred, _promote, State.READY),
    "retry-now": (_deferred, _retry, State.READY),
    "hold": (_none, _hold, State.HELD),
    "release": (_held, _release, State.READY),
}


each_move = pytest.mark.parametrize("move", sorted(MOVES))


async def _during_move(
    stores: StoreFactory, move: str, act: Callable[[QueueStore, int], Awaitable[object]]
) -> tuple[QueueStore, int, object]:
    """Queue a two-recipient message, start ``move`` and hold its batch at the gate, run
    ``act`` while it waits, then let everything land; the store, the message and what
    ``act`` returned (or raised)."""
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    prepare, moving, _ = MOVES[move]
    msg_id = await queue_message(store, RECIPIENTS)
    await prepare(store)
    await store.drain()
    db.gate = threading.Event()
    db.entered.clear()
    task = asyncio.ensure_future(moving(store, msg_id))
    while not db.entered.is_set():  # the move's batch is being written, held at the gate
        await asyncio.sleep(0.001)
    acting = asyncio.ensure_future(act(store, msg_id))
    await asyncio.sleep(0.01)  # staged behind the move (it cannot land before it)
    db.gate.set()
    db.gate = None
    await task
    try:
        result: object = await acting
    except NotFound as exc:
        result = exc
    await store.drain()
    return store, msg_id, result


def _records_of(store: QueueStore, msg_id: int) -> list[bytes]:
    return [
        key
        for family in FAMILY_STATE
        for key in family_keys(store, family)
        if keys.decode_record(key)[2] == msg_id
    ]


def _dropped_events(store: QueueStore) -> list[str]:
    return [e.recipient for _, e in store.events() if e.kind is EventKind.DROPPED]


@each_move
@async_test
async def test_a_delete_during_a_move_removes_every_recipient(
    stores: StoreFactory, move: str
) -> None:
    store, msg_id, dropped = await _during_move(
        stores, move, lambda s, m: s.drop(m, T0 + 2 * MINUTE)
    )
    assert dropped == 2
    assert _records_of(store, msg_id) == []
    assert list(store.database.keys(prefix=keys.DUE)) == []
    assert message_keys(store, msg_id) == []
    assert sorted(_dropped_events(store)) == ["a@example.org", "b@example.org"]
    assert store.message_count() == 0
    await assert_consistent(store)


@each_move
@async_test
async def test_a_one_recipient_delete_during_a_move_finds_it(
    stores: StoreFactory, move: str
) -> None:
    store, msg_id, dropped = await _during_move(
        stores, move, lambda s, m: s.drop(m, T0 + 2 * MINUTE, "b@example.org")
    )
    assert dropped == 1
    assert [keys.decode_record(k)[3] for k in _records_of(store, msg_id)] == ["a@example.org"]
    assert len(message_keys(store, msg_id)) >= 2  # head and metadata stay with "a"
    await assert_consistent(store)


@each_move
@async_test
async def test_show_during_a_move_lists_every_recipient_in_its_new_state(
    stores: StoreFactory, move: str
) -> None:
    async def show(store: QueueStore, msg_id: int) -> list[tuple[str, State]]:
        return sorted((q.recipient.address, q.state) for q in store.recipients(msg_id))

    _, _, shown = await _during_move(stores, move, show)
    after = MOVES[move][2]
    assert shown == [("a@example.org", after), ("b@example.org", after)]


@async_test
async def test_a_delete_of_a_dsn_not_landed_yet_removes_it_whole(stores: StoreFactory) -> None:
    """A DSN is staged (visible) with the bounce that queues it; an administrator who
    finds it by browsing and deletes it before it lands must take its chunks too."""
    store = stores.open(faulty=True, chunk_size=64)
    db = stores.faulty(store)
    await queue_message(store, [("rcpt@remote.example", Z)])
    (lease,) = store.lease(Z, 10, "w")
    notice = Notice(
        meta=make_meta(0, sender="", is_bounce=True),
        recipients=(NewRecipient("sender@example.org", "bounces"),),
        body=b"".join(b"DSN line %02d\r\n" % i for i in range(12)),  # 3 chunks
    )
    db.gate = threading.Event()
    db.entered.clear()
    bouncing = asyncio.ensure_future(store.bounce(lease, T0, LATER, notice=notice))
    while not db.entered.is_set():
        await asyncio.sleep(0.001)
    (page, _) = store.browse("bounces")
    (dsn,) = page  # seen while its batch is held at the gate
    dropping = asyncio.ensure_future(store.drop(dsn.msg_id, T0))
    await asyncio.sleep(0.01)
    db.gate.set()
    db.gate = None
    await bouncing
    assert await dropping == 1
    await store.drain()
    assert message_keys(store, dsn.msg_id) == []
    assert _records_of(store, dsn.msg_id) == []
    assert store.message_count() == 0
    await assert_consistent(store)


@pytest.mark.parametrize(
    ("stored", "given", "same"),
    [
        ("User@example.org", "User@example.org", True),
        ("User@example.org", "User@EXAMPLE.org", True),  # the domain is case-insensitive
        ("User@EXAMPLE.ORG", "User@example.org", True),
        ("User@example.org", "user@example.org", False),  # the local part may not be
        ("a@b@Example.org", "a@b@example.org", True),  # the domain follows the last "@"
        ("a@example.org", "a@example.org.", False),
        ("postmaster", "postmaster", True),
        ("postmaster", "postmaster@example.org", False),
        ("a@example.org", "b@example.org", False),
    ],
)
def test_same_mailbox(stored: str, given: str, same: bool) -> None:
    assert same_mailbox(stored, given) is same


@async_test
async def test_a_one_recipient_delete_ignores_the_case_of_the_domain(
    stores: StoreFactory,
) -> None:
    store = stores.open()
    msg_id = await queue_message(store, [("User@example.org", Z), ("other@example.org", Z)])
    with pytest.raises(NotFound):
        await store.drop(msg_id, T0, "user@example.org")  # the local part is exact
    assert await store.drop(msg_id, T0, "User@EXAMPLE.ORG") == 1
    assert [q.recipient.address for q in store.recipients(msg_id)] == ["other@example.org"]
    await assert_consistent(store)


@pytest.mark.parametrize("head", ["missing", "corrupt"])
@async_test
async def test_a_purge_of_a_headless_message_removes_it_with_its_last_record(
    stores: StoreFactory, head: str
) -> None:
    store = stores.open()
    msg_id = await queue_message(store, RECIPIENTS)
    head_key = keys.message_head(msg_id)
    store.database.write([(head_key, None if head == "missing" else b"\xc1")], sync=True)
    first, second = sorted(store.recipients(msg_id), key=lambda q: q.recipient.address)
    assert await store.drop_many([first], T0) == 1
    await store.drain()
    # one record left: its metadata and body stay for it
    assert keys.message_meta(msg_id) in message_keys(store, msg_id)
    assert len(_records_of(store, msg_id)) == 1
    assert await store.drop_many([second], T0) == 1
    await store.drain()
    assert message_keys(store, msg_id) == []
    assert _records_of(store, msg_id) == []
    if head == "corrupt":  # (a head removed behind the store's back leaves it counted)
        await assert_consistent(store)
    assert store.count(Z, State.READY) == 0
