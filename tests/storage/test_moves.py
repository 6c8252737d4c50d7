"""Moving a zone's recipients to another zone (``zoneq/storage/moves.py``).

Real LevelDB directories.  A crash is a database that holds exactly the first N batches of
the move (its writes refused from then on, as a killed process leaves it), reopened by a
new store as a restart would.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.storage.conftest import (
    MINUTE,
    T0,
    assert_consistent,
    async_test,
    queue_message,
)
from zoneq.errors import StorageUnavailable
from zoneq.storage import keys
from zoneq.storage.leveldb import Database, Op
from zoneq.storage.records import State
from zoneq.storage.store import Outcome, QueueStore

OLD, NEW, NOTICES = "bulk", "default", "bounces"
DUE = T0 + 10 * MINUTE


class Disk(Database):
    """A real LevelDB handle that records the size of each batch, and refuses every write
    after ``keep`` of them (None: never): the state a crash after them leaves on disk."""

    def __init__(self, path: Path, keep: int | None = None) -> None:
        self.keep = keep
        self.batches: list[int] = []
        super().__init__(path)

    def write(self, ops: Sequence[Op], *, sync: bool) -> None:
        if self.keep is not None and len(self.batches) >= self.keep:
            raise StorageUnavailable("injected: the process is gone")
        super().write(ops, sync=sync)
        self.batches.append(len(ops))


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
