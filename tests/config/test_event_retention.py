"""The longest ``storage.event_retention`` a config takes is safe at run time.

A duration may be up to 100 years (``MAX_DURATION``), longer than the time since 1970, so
the retention cut-off ``now - retention`` can be negative; ``maintain`` clamps it at 0
(keep everything) rather than packing a negative time into an event key.  A real
QueueStore on disk, the real ``runtime.maintain``.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.storage.conftest import async_test
from zoneq import runtime
from zoneq.config import loads_config
from zoneq.config.types import MAX_DURATION
from zoneq.protocol.events import Event, EventKind
from zoneq.protocol.ids import format_id
from zoneq.storage.store import QueueStore


def _event(time_ms: int) -> Event:
    return Event(EventKind.DELIVERED, time_ms, "default", format_id(1), "a@b.test", "b.test", 0)


@async_test
async def test_maintain_keeps_every_event_under_the_longest_retention(tmp_path: Path) -> None:
    config = loads_config(
        f'[storage]\nevent_retention = "{MAX_DURATION}"\n[zones.default]\n[zones.bounces]\n'
    )
    assert config.storage.event_retention_ms > time.time_ns() // 1_000_000  # before 1970
    store = QueueStore.open(tmp_path / "queue")
    try:
        store.recover()
        times = [1_000, 86_400_000, time.time_ns() // 1_000_000]  # 1970 to now
        await store._writer.submit([store._event_op(_event(t)) for t in times], sync=False)
        await store.drain()
        await runtime.maintain(store, config)
        assert [event.time_ms for _, event in store.events()] == times
    finally:
        await store.close()
