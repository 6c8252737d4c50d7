"""A message being received whose abandon fails: its chunks go without a restart.

A session abandons its message when the client resets, quits or a chunk write fails.  If
the store cannot write just then (a failed fdatasync, a full disk), the abandon fails too;
the message must stop counting as "still streaming in" all the same, or the sweep skips
its chunks until the next start.  The fault is real: strace makes every ``fdatasync`` of
this process fail with EIO (as ``tests/reliability/test_fsync.py`` does to ``zoneq
serve``), then detaches.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.reliability.test_fsync import inject_eio, stop_tracer, strace_binary
from tests.storage.conftest import (
    T0,
    StoreFactory,
    assert_consistent,
    async_test,
    make_meta,
    rcpts,
)
from zoneq.errors import StorageUnavailable
from zoneq.storage import keys
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

CHUNK = b"A" * 65_536
DATA_TIMEOUT_MS = 600_000
LATER = T0 + 10 * DATA_TIMEOUT_MS  # the DATA timeout long past
ATTACH_S = 10.0  # how long strace may take to attach before the test gives up


def on_disk(store: QueueStore, msg_id: int) -> list[bytes]:
    """The message's chunks and its receiving marker, as on disk."""
    db = store.database
    return [*db.keys(prefix=keys.chunk_prefix(msg_id)), *db.keys(prefix=keys.receiving(msg_id))]


async def commit_until_refused(store: QueueStore) -> None:
    """Commit small messages until one is refused: the injected EIO is in force (strace
    attaches asynchronously).  Bounded in count and time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ATTACH_S
    n = 0
    while loop.time() < deadline:
        n += 1
        msg_id = store.begin(T0 + n)
        try:
            await store.commit(
                make_meta(msg_id, size=5, chunks=1),
                rcpts((f"b{n}@x.test", "default")),
                T0,
                tail=b"hello",
            )
        except StorageUnavailable:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("strace never made an fdatasync fail")


async def sweep_until_gone(store: QueueStore, msg_id: int, rounds: int = 5) -> None:
    """Maintenance rounds (the store reopens itself at most once a second), bounded."""
    for _ in range(rounds):
        await asyncio.sleep(QueueStore.REOPEN_INTERVAL_S + 0.1)
        await store.sweep(LATER, DATA_TIMEOUT_MS)
        await store.drain()
        if not on_disk(store, msg_id):
            return


@async_test
async def test_chunks_of_a_message_whose_abandon_failed_go_without_a_restart(
    stores: StoreFactory, tmp_path: Path
) -> None:
    strace_binary()
    store = stores.open()
    receiving = store.begin(T0)  # a session mid-DATA
    for index in range(3):
        await store.write_chunk(receiving, index, CHUNK)
    await store.drain()
    assert len(on_disk(store, receiving)) == 4  # three chunks and the marker

    tracer = inject_eio(os.getpid(), tmp_path / "strace.log")
    try:
        await commit_until_refused(store)  # another session's commit: its sync fails
        with pytest.raises(StorageUnavailable):
            await store.abandon(receiving)  # the client quits: the store cannot write
    finally:
        stop_tracer(tracer)

    await sweep_until_gone(store, receiving)
    assert on_disk(store, receiving) == [], "the chunks stayed until a restart"
    assert store.failure is None
    await assert_consistent(store)


@async_test
async def test_a_commit_that_never_landed_leaves_no_chunks_without_a_restart(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit refused before it reached the log, by a session that then went away
    without abandoning (cancelled while it waited): the reopen's undo of failed commits
    must let the sweep have its chunks."""
    monkeypatch.setattr(QueueStore, "REOPEN_INTERVAL_S", 0.1)  # rounds wait this long
    store = stores.open(faulty=True)
    msg_id = store.begin(T0)
    await store.write_chunk(msg_id, 0, CHUNK)
    await store.drain()
    stores.faulty(store).fail_writes = 1
    with pytest.raises(StorageUnavailable):
        await store.commit(
            make_meta(msg_id, size=2 * len(CHUNK), chunks=2),
            rcpts(("a@x.test", "default")),
            T0,
            tail=CHUNK,
        )
    await sweep_until_gone(store, msg_id)
    assert on_disk(store, msg_id) == [], "the chunks stayed until a restart"
    assert store.message_count() == 0
    await assert_consistent(store)
