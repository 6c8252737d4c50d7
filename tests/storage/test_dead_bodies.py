"""Deleted big bodies give their disk space back at the next maintenance round.

LevelDB frees a deleted value's space only when a compaction reaches its range, and no
zone mark's range covers the message family.  On a full disk the operator's first move is
to delete the big message: that must free the disk, as an abandoned one's does.  A real
store on disk; the body is incompressible, so the sizes are the data's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest

from tests.queue.test_service import Z
from tests.storage.conftest import (
    T0,
    StoreFactory,
    assert_consistent,
    async_test,
    make_meta,
    queue_message,
)
from zoneq.errors import StorageUnavailable
from zoneq.storage import keys
from zoneq.storage.base import Outcome, dead_body_key
from zoneq.storage.records import NewRecipient, State
from zoneq.storage.store import QueueStore

MIB = 1 << 20
CHUNK = 64 * 1024
BODY_MIB = 8


def disk_use(directory: Path) -> int:
    return sum(entry.stat().st_size for entry in directory.iterdir() if entry.is_file())


async def big_message(store: QueueStore) -> int:
    body = [os.urandom(CHUNK) for _ in range(BODY_MIB * MIB // CHUNK)]
    return await queue_message(store, [("a@dest.test", Z), ("b@dest.test", Z)], body=body)


async def body_in_tables(store: QueueStore, directory: Path) -> int:
    """Compact, so the body is in table files as on a disk that filled up over time; the
    directory's size then."""
    await store.compact()
    size = disk_use(directory)
    assert size > BODY_MIB * MIB
    return size


def assert_space_back(directory: Path, before: int) -> None:
    after = disk_use(directory)
    assert after < before - (BODY_MIB - 1) * MIB, (before // MIB, after // MIB)


@pytest.mark.parametrize("how", ["deleted", "purged"])
@async_test
async def test_a_big_message_deleted_by_an_operator_gives_its_space_back(
    stores: StoreFactory, how: str
) -> None:
    store = stores.open()
    directory = stores.path
    msg_id = await big_message(store)
    before = await body_in_tables(store, directory)
    if how == "deleted":
        assert await store.drop(msg_id, T0) == 2
    else:
        chosen = list(store.recipients(msg_id))
        assert await store.drop_many(chosen, T0) == 2
    await store.drain()
    await store.compact()  # the maintenance round
    assert_space_back(directory, before)
    assert store.count(Z, State.READY) == 0
    await assert_consistent(store)


@pytest.mark.parametrize("how", ["delivered", "bounced"])
@async_test
async def test_a_big_message_that_left_the_queue_by_delivery_gives_its_space_back(
    stores: StoreFactory, how: str
) -> None:
    """The way most bodies go: their last recipient's outcome.  Left to LevelDB, 8 MiB of
    a delivered body's table data stayed on disk through rounds and a restart."""
    store = stores.open()
    directory = stores.path
    await big_message(store)
    before = await body_in_tables(store, directory)
    for lease in store.lease(Z, 10, "w1"):
        if how == "delivered":
            await store.complete(lease, T0, Outcome(reply="250 ok", code=250))
        else:
            await store.bounce(lease, T0, Outcome(reply="550 no", code=550))
    await store.drain()
    await store.compact()  # the maintenance round
    assert_space_back(directory, before)
    await assert_consistent(store)


@pytest.mark.parametrize("how", ["deleted", "abandoned"])
@async_test
async def test_a_dead_body_is_still_compacted_after_a_stop_before_the_round(
    stores: StoreFactory, how: str
) -> None:
    """A stop between the delete and the next maintenance round must not forget the body:
    the list of bodies to compact is on disk with the deletes (60 MiB stayed for good)."""
    store = stores.open()
    directory = stores.path
    if how == "deleted":
        msg_id = await big_message(store)
    else:
        msg_id = store.begin(T0)
        for index in range(BODY_MIB * MIB // CHUNK):
            await store.write_chunk(msg_id, index, os.urandom(CHUNK))
    before = await body_in_tables(store, directory)
    if how == "deleted":
        assert await store.drop(msg_id, T0) == 2
    else:
        await store.abandon(msg_id)
    await store.close()  # stopped before the maintenance round
    store = stores.open()
    await store.compact()  # the first round after the restart
    assert_space_back(directory, before)
    await store.close()
    store = stores.open()
    assert store._dead_bodies == set()  # compacted once: the record went with it
    await assert_consistent(store)


@async_test
async def test_a_round_while_the_deletes_are_staged_leaves_the_body_for_the_next(
    stores: StoreFactory,
) -> None:
    """A maintenance round between an operator's delete and its batch landing must not
    compact (nothing is deleted yet) and forget the body: 8 MiB stayed until a restart."""
    store = stores.open()
    directory = stores.path
    msg_id = await big_message(store)
    before = await body_in_tables(store, directory)
    drop = asyncio.create_task(store.drop(msg_id, T0))
    while msg_id not in store._dead_bodies:
        await asyncio.sleep(0)
    assert store.database.get(dead_body_key(msg_id)) is None  # staged, not landed
    await store.compact()  # the round, now
    assert await drop == 2
    await store.drain()
    await store.compact()  # the next round
    assert_space_back(directory, before)
    assert store.database.get(dead_body_key(msg_id)) is None  # and the record went
    await assert_consistent(store)


@async_test
async def test_a_big_message_whose_failed_commit_landed_gives_its_space_back(
    stores: StoreFactory,
) -> None:
    """A commit whose sync failed but whose batch is in the log is removed at the reopen
    (its client was told 4xx): a failing or full disk is when its body's space matters."""
    store = stores.open(faulty=True, sync_commits=True)
    directory = stores.path
    msg_id = store.begin(T0)
    chunks = BODY_MIB * MIB // CHUNK
    for index in range(chunks):
        await store.write_chunk(msg_id, index, os.urandom(CHUNK))
    before = await body_in_tables(store, directory)
    stores.faulty(store).fail_syncs = 1
    meta = make_meta(msg_id, size=BODY_MIB * MIB, chunks=chunks)
    with contextlib.suppress(StorageUnavailable):
        await store.commit(meta, (NewRecipient("a@dest.test", Z),), T0)
    store.reopen()
    assert store.database.get(keys.message_head(msg_id)) is None  # removed by the reopen
    await store.compact()  # the maintenance round
    assert_space_back(directory, before)
    await assert_consistent(store)
