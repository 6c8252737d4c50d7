"""Moving a zone's recipients to another zone (``zoneq/storage/moves.py``).

Real LevelDB directories.  A crash is a database that holds exactly the first N batches of
the move (its writes refused from then on, as a killed process leaves it), reopened by a
new store as a restart would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.storage.conftest import (
    MINUTE,
    T0,
    assert_consistent,
    async_test,
    queue_message,
)
from zoneq.errors import StorageUnavailable
from zoneq.storage import keys, moves
from zoneq.storage.leveldb import Database, Op
from zoneq.storage.maintenance import moved_zone_note
from zoneq.storage.records import State
from zoneq.storage.store import Outcome, QueueStore

OLD, NEW, NOTICES = "bulk", "default", "bounces"
DUE = T0 + 10 * MINUTE


class Disk(Database):
    """A real LevelDB handle that records the size of each batch, and refuses every write
    after ``keep`` of them (None: never): the state a crash after them leaves on disk.
    It counts the iterators opened (each one a seek, which steps over every deleted key
    up to the first live one) and records the ranges compacted."""

    def __init__(self, path: Path, keep: int | None = None) -> None:
        self.keep = keep
        self.batches: list[int] = []
        self.seeks = 0
        self.compacted: list[tuple[bytes, bytes]] = []
        super().__init__(path)

    def write(self, ops: Sequence[Op], *, sync: bool) -> None:
        if self.keep is not None and len(self.batches) >= self.keep:
            raise StorageUnavailable("injected: the process is gone")
        super().write(ops, sync=sync)
        self.batches.append(len(ops))

    def items(self, *args: Any, **kwargs: Any) -> Iterator[tuple[bytes, bytes]]:
        self.seeks += 1
        return super().items(*args, **kwargs)

    def keys(self, *args: Any, **kwargs: Any) -> Iterator[bytes]:
        self.seeks += 1
        return super().keys(*args, **kwargs)

    def compact_range(self, start: bytes, stop: bytes) -> None:
        self.compacted.append((start, stop))
        super().compact_range(start, stop)


def opened(path: Path, keep: int | None = None) -> QueueStore:
    store = QueueStore(Disk(path, keep))
    store.recover()
    return store


def crash(store: QueueStore) -> None:
    """Gone without a clean close: what is on disk stays, nothing more is written."""
    store._writer.close()
    store.database.close()


async def in_state(store: QueueStore, address: str, state: State) -> int:
    """A message with one recipient of ``OLD`` in ``state``; its id."""
    msg_id = await queue_message(store, [(address, OLD)])
    if state is State.DEFERRED:
        (lease,) = store.lease(OLD, 1, "w", accept=lambda r: r.msg_id == msg_id)
        await store.defer(lease, T0, DUE, Outcome(reply="451 later"))
    elif state is State.HELD:
        assert await store.hold(msg_id, "spam check") == 1
    return msg_id


def where(store: QueueStore, msg_id: int, address: str) -> list[tuple[bytes, str]]:
    """Every (family, zone) holding a record of this recipient."""
    found = []
    for family in keys.RECORD_FAMILIES:
        for zone in (OLD, NEW, NOTICES):
            if store.database.get(keys.record(family, zone, msg_id, address)) is not None:
                found.append((family, zone))
    return found


def due_keys(store: QueueStore, zone: str) -> list[bytes]:
    return list(store.database.keys(prefix=keys.zone_prefix(keys.DUE, zone)))


@pytest.mark.parametrize(
    ("state", "family"),
    [(State.READY, keys.READY), (State.DEFERRED, keys.DEFERRED), (State.HELD, keys.HELD)],
)
@async_test
async def test_a_recipient_keeps_its_state(store: QueueStore, state: State, family: bytes) -> None:
    msg_id = await in_state(store, "a@example.org", state)
    before = store.database.get(keys.record(family, OLD, msg_id, "a@example.org"))

    moved = await store.move_zone(OLD, NEW)

    assert (moved.moved, moved.in_flight) == (1, 0)
    assert where(store, msg_id, "a@example.org") == [(family, NEW)]
    # Attempts, reply, due time and hold reason travel in the value, unchanged.
    assert store.database.get(keys.record(family, NEW, msg_id, "a@example.org")) == before
    assert store.message(msg_id).zones == (NEW,)
    assert store.count(NEW, state) == 1 and store.zones() == {NEW}
    await assert_consistent(store)
    if state is State.DEFERRED:
        assert due_keys(store, OLD) == []
        assert due_keys(store, NEW) == [keys.due(NEW, DUE, msg_id, "a@example.org")]
        assert await store.promote_due(NEW, DUE) == 1  # due in its new zone, on time


@async_test
async def test_only_the_state_asked_for_moves(store: QueueStore) -> None:
    ready = await in_state(store, "r@example.org", State.READY)
    held = await in_state(store, "h@example.org", State.HELD)

    assert (await store.move_zone(OLD, NEW, states=[State.HELD])).moved == 1

    assert where(store, held, "h@example.org") == [(keys.HELD, NEW)]
    assert where(store, ready, "r@example.org") == [(keys.READY, OLD)]
    await assert_consistent(store)


@async_test
async def test_a_leased_recipient_stays_and_its_message_names_both_zones(
    store: QueueStore,
) -> None:
    msg_id = await queue_message(store, [("a@example.org", OLD), ("b@example.org", OLD)])
    (lease,) = store.lease(OLD, 1, "w")

    moved = await store.move_zone(OLD, NEW)

    assert (moved.moved, moved.in_flight) == (1, 1)
    assert where(store, msg_id, lease.recipient.address) == [(keys.READY, OLD)]
    assert set(store.message(msg_id).zones) == {OLD, NEW}
    # Its worker's report still finds it.
    await store.complete(lease, T0, Outcome(reply="250 ok"))
    assert {q.recipient.zone for q in store.recipients(msg_id)} == {NEW}
    await assert_consistent(store)


@async_test
async def test_notices_go_to_their_own_zone(store: QueueStore) -> None:
    mail = await queue_message(store, [("a@example.org", OLD)])
    dsn = await queue_message(store, [("sender@example.org", OLD)], sender="", is_bounce=True)

    await store.move_zone(OLD, NEW, notices_to=NOTICES)

    assert where(store, mail, "a@example.org") == [(keys.READY, NEW)]
    assert where(store, dsn, "sender@example.org") == [(keys.READY, NOTICES)]
    assert store.message(dsn).zones == (NOTICES,)
    await assert_consistent(store)


@async_test
async def test_a_recipient_queued_in_the_target_already_is_left(store: QueueStore) -> None:
    msg_id = await queue_message(store, [("a@example.org", OLD), ("a@example.org", NEW)])

    assert (await store.move_zone(OLD, NEW)).moved == 0

    assert where(store, msg_id, "a@example.org") == [(keys.READY, OLD), (keys.READY, NEW)]
    assert set(store.message(msg_id).zones) == {OLD, NEW}
    await assert_consistent(store)


@async_test
async def test_a_big_zone_moves_in_bounded_batches(tmp_path: Path) -> None:
    store = opened(tmp_path / "queue")
    try:
        addresses = [(f"user{i}@d{i % 7}.example", OLD) for i in range(2000)]
        msg_id = await queue_message(store, addresses)
        await queue_message(store, addresses[:300])
        disk = store.database
        assert isinstance(disk, Disk)
        disk.batches.clear()

        moved = await store.move_zone(OLD, NEW, batch=100)

        assert moved.moved == 2300
        # 23 batches, each of a page's deletes and inserts plus counters and metadata.
        assert len(disk.batches) >= 23
        assert max(disk.batches) <= 2 * 100 + 40
        assert store.zones() == {NEW} and store.count(NEW, State.READY) == 2300
        assert store.message(msg_id).zones == (NEW,)
        await assert_consistent(store)
    finally:
        await store.close()


@pytest.mark.parametrize("keep", [1, 3, 7])
@async_test
async def test_a_crash_midway_leaves_each_recipient_once_and_a_restart_finishes(
    tmp_path: Path, keep: int
) -> None:
    path = tmp_path / "queue"
    store = opened(path)
    ids = []
    for state in (State.READY, State.DEFERRED, State.HELD):
        for i in range(12):
            ids.append((await in_state(store, f"{state.value}{i}@example.org", state), state))
    await store.close()

    store = opened(path, keep=keep)
    with pytest.raises(StorageUnavailable):
        await store.move_zone(OLD, NEW, batch=5)
    crash(store)

    store = opened(path)
    try:
        half = [
            where(store, msg_id, f"{s.value}{i % 12}@example.org")
            for i, (msg_id, s) in enumerate(ids)
        ]
        assert all(len(found) == 1 for found in half)
        assert {zone for found in half for _, zone in found} == {OLD, NEW}
        await assert_consistent(store)

        moved = await store.move_zone(OLD, NEW, batch=5)

        assert moved.moved == sum(1 for found in half if found[0][1] == OLD)
        for i, (msg_id, state) in enumerate(ids):
            family = {State.READY: keys.READY, State.DEFERRED: keys.DEFERRED}.get(state, keys.HELD)
            assert where(store, msg_id, f"{state.value}{i % 12}@example.org") == [(family, NEW)]
            assert store.message(msg_id).zones == (NEW,)
        assert due_keys(store, OLD) == [] and len(due_keys(store, NEW)) == 12
        assert (await store.move_zone(OLD, NEW)).moved == 0  # idempotent
        await assert_consistent(store)
    finally:
        await store.close()


@async_test
async def test_a_zone_cannot_move_into_itself(store: QueueStore) -> None:
    with pytest.raises(ValueError, match="itself"):
        await store.move_zone(OLD, OLD)


@pytest.mark.parametrize("shape", ["one recipient each", "one message"])
@async_test
async def test_a_move_seeks_per_page_not_per_message(tmp_path: Path, shape: str) -> None:
    """A probe per message for its records left in the zone stepped over the tombstones
    of every record moved before it: 100,000 messages took 297 s.  The seeks must not
    grow with the messages (a page's read, a pass's start, a few to settle)."""
    store = opened(tmp_path / "queue")
    try:
        addresses = [(f"u{i:03d}@d{i % 7}.example", OLD) for i in range(300)]
        if shape == "one message":
            ids = [await queue_message(store, addresses)]
        else:
            ids = [await queue_message(store, [address]) for address in addresses]
        disk = store.database
        assert isinstance(disk, Disk)
        disk.seeks = 0

        assert (await store.move_zone(OLD, NEW, batch=50)).moved == 300

        # Two passes of three families: 6 pages, and 3 more reads, in each.
        assert disk.seeks <= 2 * (300 // 50 + 3) + 3
        assert all(store.message(msg_id).zones == (NEW,) for msg_id in ids)
        await assert_consistent(store)
    finally:
        await store.close()


@async_test
async def test_the_moved_zone_is_compacted_by_the_maintenance_round(tmp_path: Path) -> None:
    """No delivery cursor lies behind the moved zone's tombstones, so the cursors' ranges
    never cover them: each later scan of the zone would step over all of them."""
    store = opened(tmp_path / "queue")
    try:
        await in_state(store, "d@example.org", State.DEFERRED)
        await in_state(store, "r@example.org", State.READY)
        await store.move_zone(OLD, NEW)
        disk = store.database
        assert isinstance(disk, Disk)
        note = moved_zone_note(OLD)
        assert disk.get(note) is not None
        disk.compacted.clear()

        await store.compact()

        for family in (*keys.RECORD_FAMILIES, keys.DUE):
            prefix = keys.zone_prefix(family, OLD)
            assert (prefix, keys.prefix_upper_bound(prefix)) in disk.compacted
        assert disk.get(note) is None  # once
        held_stop = keys.prefix_upper_bound(keys.zone_prefix(keys.HELD, OLD))
        disk.compacted.clear()
        await store.compact()
        assert (keys.zone_prefix(keys.HELD, OLD), held_stop) not in disk.compacted
    finally:
        await store.close()


def between_pages(store: QueueStore, act: Callable[[], Awaitable[object]]) -> None:
    """Run ``act`` once, right after the move's first batch lands: the loop is free then,
    and the service's timers and workers' reports come in."""
    real = store._writer.submit
    calls = 0

    async def submit(ops: Sequence[Op], **kwargs: Any) -> None:
        nonlocal calls
        await real(ops, **kwargs)
        calls += 1
        if calls == 1:
            await act()

    store._writer.submit = submit  # type: ignore[assignment,method-assign]


@async_test
async def test_a_recipient_that_comes_due_during_the_move_is_moved(store: QueueStore) -> None:
    """``promote_due`` runs each second for a zone held for the move: a deferred recipient
    made ready behind the READY walk was left, and the answer said 0 in flight."""
    early = await in_state(store, "early@example.org", State.DEFERRED)
    later = [await in_state(store, f"r{i}@example.org", State.READY) for i in range(4)]
    between_pages(store, lambda: store.promote_due(OLD, DUE))

    moved = await store.move_zone(OLD, NEW, batch=2)

    assert (moved.moved, moved.in_flight) == (5, 0)
    assert where(store, early, "early@example.org")[0][1] == NEW
    assert all(
        where(store, msg_id, f"r{i}@example.org") == [(keys.READY, NEW)]
        for i, msg_id in enumerate(later)
    )
    assert store.zones() == {NEW}
    await assert_consistent(store)


@async_test
async def test_a_recipient_deferred_by_its_worker_during_the_move_is_moved(
    store: QueueStore,
) -> None:
    """A leased recipient's attempt ends during the move: deferred, it lands in the zone's
    DEFERRED range behind that walk.  Another pass takes it."""
    first = await queue_message(store, [("a@example.org", OLD)])
    (lease,) = store.lease(OLD, 1, "w", accept=lambda r: r.msg_id == first)
    rest = [await queue_message(store, [(f"r{i}@example.org", OLD)]) for i in range(4)]
    between_pages(store, lambda: store.defer(lease, T0, DUE, Outcome(reply="451 later")))

    moved = await store.move_zone(OLD, NEW, batch=2)

    assert (moved.moved, moved.in_flight) == (5, 0)
    assert where(store, first, "a@example.org") == [(keys.DEFERRED, NEW)]
    assert due_keys(store, OLD) == [] and len(due_keys(store, NEW)) == 1
    assert all(store.message(msg_id).zones == (NEW,) for msg_id in [first, *rest])
    await assert_consistent(store)


@async_test
async def test_moved_recipients_are_leased_in_a_target_already_past_them(
    store: QueueStore,
) -> None:
    """The target's lease cursor has passed the moved record's (older) key: the landed
    move moves the cursor back, or a running core would not see it until a restart."""
    old = await queue_message(store, [("o@example.org", OLD)])
    await queue_message(store, [("n@example.org", NEW)])
    (lease,) = store.lease(NEW, 10, "w")
    await store.complete(lease, T0, Outcome(reply="250 ok"))

    await store.move_zone(OLD, NEW)

    assert [(got.recipient.msg_id, got.recipient.address) for got in store.lease(NEW, 10, "w")] == [
        (old, "o@example.org")
    ]


@async_test
async def test_moved_deferred_recipients_come_due_in_a_target_already_past_them(
    store: QueueStore,
) -> None:
    """The target's due mark has passed the moved record's due time: the landed move
    moves the mark back, or ``promote_due`` would not find it until a restart."""
    await in_state(store, "o@example.org", State.DEFERRED)  # due at DUE, in OLD
    mine = await queue_message(store, [("n@example.org", NEW)])
    (lease,) = store.lease(NEW, 1, "w", accept=lambda r: r.msg_id == mine)
    await store.defer(lease, T0, DUE + MINUTE, Outcome(reply="451 later"))
    assert await store.promote_due(NEW, DUE + 2 * MINUTE) == 1  # the mark passes DUE
    assert (await store.move_zone(OLD, NEW)).moved == 1

    assert await store.promote_due(NEW, DUE + 3 * MINUTE) == 1
    assert store.count(NEW, State.READY) == 2


def in_an_idle_page(monkeypatch: pytest.MonkeyPatch, act: Callable[[], Awaitable[object]]) -> None:
    """Run ``act`` once, in the first page of the move that moved nothing (its
    ``asyncio.sleep(0)`` lets the loop in, so a worker's report comes in there)."""
    acted = False

    async def sleep(delay: float) -> None:
        nonlocal acted
        if not acted:
            acted = True
            await act()
        await asyncio.sleep(delay)

    monkeypatch.setattr(moves, "asyncio", SimpleNamespace(sleep=sleep))


@async_test
async def test_a_lease_that_ends_in_a_pass_that_moved_nothing_is_moved(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every record is leased, so the first pass moves nothing; meanwhile one attempt
    ends (deferred) behind the walk.  The pass must not be the last: the zone's leases
    changed during it, and the deferred record is there to move."""
    first = await queue_message(store, [("a@example.org", OLD)])
    second = await queue_message(store, [("b@example.org", OLD)])
    (lease,) = store.lease(OLD, 1, "w", accept=lambda r: r.msg_id == first)
    store.lease(OLD, 1, "w", accept=lambda r: r.msg_id == second)
    in_an_idle_page(monkeypatch, lambda: store.defer(lease, T0, DUE, Outcome(reply="451 later")))

    moved = await store.move_zone(OLD, NEW, batch=1)

    assert (moved.moved, moved.in_flight) == (1, 1)
    assert where(store, first, "a@example.org") == [(keys.DEFERRED, NEW)]
    assert due_keys(store, OLD) == [] and len(due_keys(store, NEW)) == 1
    await assert_consistent(store)
