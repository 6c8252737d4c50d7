"""Records whose message is gone, as the queue service meets them when handing out jobs.

Before administrators' scans saw staged moves, deleting a message while one of its
recipients was being moved left that record on disk with no message behind it.  The
service found no metadata for it and kept it leased to itself: out of circulation for good,
still counted, and the same again after every restart.  A store written by that version may
still hold such records, so they are removed when met, each with a DROPPED event.

The orphans are made here as that race left them: a real message, whose head, metadata and
chunks are then removed from the real LevelDB underneath the store, which is reopened.
"""

from __future__ import annotations

import pytest

from tests.storage.conftest import T0, StoreFactory, async_test, message_keys, queue_message
from zoneq.config import load_config
from zoneq.protocol.events import EventKind
from zoneq.protocol.ids import format_id
from zoneq.queue.service import QueueService
from zoneq.storage import keys
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

Z = "default"
ORPHANS = [("a@one.test", Z), ("b@one.test", Z)]


def _service(store: QueueStore) -> QueueService:
    return QueueService(store, load_config(), hostname="mx.zoneq.test", clock=lambda: T0 + 5)


async def _orphaned(stores: StoreFactory, *, keep_head: bool = False) -> tuple[QueueStore, int]:
    """A reopened store holding a message's records without (most of) the message."""
    store = stores.open()
    msg_id = await queue_message(store, ORPHANS)
    gone = [k for k in message_keys(store, msg_id) if not (keep_head and k.endswith(b"#"))]
    store.database.write([(key, None) for key in gone], sync=True)
    await store.close()
    return stores.open(), msg_id


def _ready_keys(store: QueueStore) -> list[bytes]:
    return list(store.database.keys(prefix=keys.READY))


@async_test
async def test_records_of_a_message_that_is_gone_are_removed_when_met(
    stores: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store, msg_id = await _orphaned(stores)
    service = _service(store)
    assert store.count(Z, State.READY) == 2
    assert await service.lease(Z, "w1", max_jobs=5) == []
    assert store.leased() == 0  # not kept by the core for ever
    assert store.count(Z, State.READY) == 0
    await store.drain()
    assert _ready_keys(store) == []
    dropped = [e for _, e in store.events() if e.kind is EventKind.DROPPED]
    assert sorted(e.recipient for e in dropped) == ["a@one.test", "b@one.test"]
    assert {e.message_id for e in dropped} == {format_id(msg_id)}
    assert all("gone" in (e.text or "") for e in dropped)
    assert "the message is gone" in caplog.text
    await store.close()
    again = stores.open()  # and they do not come back after a restart
    assert _ready_keys(again) == []
    assert again.count(Z, State.READY) == 0


@async_test
async def test_the_queue_goes_on_past_orphans(stores: StoreFactory) -> None:
    store, _ = await _orphaned(stores)
    fresh = await queue_message(store, [("c@one.test", Z)], now_ms=T0 + 1)
    (job,) = await _service(store).lease(Z, "w1", max_jobs=5)
    assert job.msg_id == fresh


@async_test
async def test_a_head_without_metadata_is_quarantined_not_removed(stores: StoreFactory) -> None:
    store, msg_id = await _orphaned(stores, keep_head=True)
    assert await _service(store).lease(Z, "w1", max_jobs=5) == []
    await store.drain()
    assert len(_ready_keys(store)) == 2  # kept on disk for the operator
    assert [q.key for q in store.quarantined] == [keys.message_meta(msg_id)]
    assert not [e for _, e in store.events() if e.kind is EventKind.DROPPED]
