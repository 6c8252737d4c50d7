"""Browsing a zone's leased recipients reads the lease table, not the zone's READY family.

The page is read on the core's event loop: a scan of every ready record to find the few
with a lease out stalled SMTP and the API for as long as the zone was deep.  Counted here
by what LevelDB is asked for (a ``Database`` subclass), not timed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.storage.conftest import assert_consistent, async_test, queue_message
from zoneq.storage import keys
from zoneq.storage.leveldb import Database
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

Z = "bulk"
READY_MESSAGES = 40
PER_MESSAGE = 50  # 2,000 ready records
LATE = 3  # leased recipients, behind every ready one


class CountingDatabase(Database):
    """A real LevelDB handle that counts the READY records read from it."""

    ready_read = 0

    def _count(self, key: bytes) -> None:
        if key.startswith(keys.READY):
            self.ready_read += 1

    def get(self, key: bytes, *, fill_cache: bool = True) -> bytes | None:
        self._count(key)
        return super().get(key, fill_cache=fill_cache)

    def items(self, **options: Any) -> Iterator[tuple[bytes, bytes]]:
        for key, value in super().items(**options):
            self._count(key)
            yield key, value


async def _deep_zone_with_late_leases(store: QueueStore) -> list[bytes]:
    """A zone of many ready recipients and, queued after them, LATE leased ones; their keys."""
    for n in range(READY_MESSAGES):
        await queue_message(store, [(f"r{i}@m{n}.test", Z) for i in range(PER_MESSAGE)])
    await queue_message(store, [(f"late{i}@late.test", Z) for i in range(LATE)])
    leased = store.lease(Z, LATE, "worker", accept=lambda r: r.address.startswith("late"))
    assert len(leased) == LATE
    return sorted(lease.key for lease in leased)


@async_test
async def test_a_leased_page_reads_no_ready_record_but_its_own(tmp_path: Path) -> None:
    db = CountingDatabase(tmp_path / "queue")
    store = QueueStore(db)
    store.recover()
    try:
        leased = await _deep_zone_with_late_leases(store)
        await store.drain()
        db.ready_read = 0

        first, cursor = store.browse(Z, State.LEASED, limit=2)
        assert cursor is not None
        rest, end = store.browse(Z, State.LEASED, after=cursor, limit=2)
        assert end is None

        shown = [keys.record(keys.READY, r.zone, r.msg_id, r.address) for r in first + rest]
        assert shown == leased  # oldest first, each once, across the cursor
        # Each leased record is read by its key; none of the 2,000 ready ones is visited.
        assert db.ready_read <= LATE, db.ready_read
        # The ready page is unchanged: the leased ones are in it, read from the family.
        ready, _ = store.browse(Z, State.READY, limit=READY_MESSAGES * PER_MESSAGE + LATE)
        assert len(ready) == READY_MESSAGES * PER_MESSAGE + LATE
        await assert_consistent(store)
    finally:
        await store.close()
