"""A real full disk: a 4 MiB tmpfs fills up under the store, then space comes back.

Needs root (``mount -t tmpfs``): without it, or where the mount fails, the tests fail
under the test bed (``ZONEQ_TESTBED``, as in CI) and skip in a run by hand
(``tests/support/tmpfs.py``).  The contract:

* a commit on a full disk raises ``StorageUnavailable`` and nothing else;
* no commit that returned normally is lost;
* while the disk is full every further commit raises ``StorageUnavailable``;
* once space is back, the first operation after ``QueueStore.REOPEN_INTERVAL_S`` succeeds
  without anyone calling ``reopen`` (the store heals itself in ``_check``);
* with a reserve, it heals even when nothing else is freed (incompressible bodies);
* with a free-space floor, new mail is refused before LevelDB ever sees a full disk.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.storage.conftest import T0, StoreFactory, async_test, make_meta, rcpts
from tests.support.tmpfs import mounted_tmpfs
from zoneq.errors import DiskFull, InsufficientStorage, StorageUnavailable
from zoneq.storage.space import SpaceGuard
from zoneq.storage.store import Outcome, QueueStore

pytestmark = pytest.mark.integration

Z = "default"
TMPFS_SIZE = "4m"
FILLER_SIZE = 1 << 20
CHUNK = 64 * 1024
CHUNKS_PER_MESSAGE = 3


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs with a 1 MiB filler file on it (deleted later to free space)."""
    for mount_point in mounted_tmpfs(tmp_path / "tmpfs", TMPFS_SIZE):
        (mount_point / "filler").write_bytes(b"\0" * FILLER_SIZE)
        yield mount_point


@pytest.fixture
def disk_stores(tmpfs: Path) -> Iterator[StoreFactory]:
    """Stores on the tmpfs, all closed before it is unmounted."""
    factory = StoreFactory(tmpfs)
    try:
        yield factory
    finally:
        factory.close_all()


def mail_chunk(n: int, index: int) -> bytes:
    """64 KiB of mail-like text (compresses well, like most mail)."""
    line = b"Received: from host%d.example.org by mx.example.net; part %d\r\n" % (n, index)
    return (line * (CHUNK // len(line) + 1))[:CHUNK]


def random_chunk(n: int, index: int) -> bytes:
    """64 KiB that does not compress (attachments that are already compressed)."""
    del n, index
    return os.urandom(CHUNK)


async def fill_until_full(
    store: QueueStore, make_chunk: Callable[[int, int], bytes], limit: int = 1000
) -> tuple[dict[int, list[bytes]], StorageUnavailable]:
    """Commit messages until one fails; every other exception propagates (and fails)."""
    committed: dict[int, list[bytes]] = {}
    for n in range(limit):
        now = T0 + n
        msg_id = store.begin(now)
        chunks = [make_chunk(n, i) for i in range(CHUNKS_PER_MESSAGE)]
        meta = make_meta(msg_id, size=sum(map(len, chunks)), chunks=len(chunks))
        try:
            for index, chunk in enumerate(chunks[:-1]):
                await store.write_chunk(msg_id, index, chunk)
            await store.commit(meta, rcpts((f"user{n}@example.org", Z)), now, tail=chunks[-1])
        except StorageUnavailable as exc:
            return committed, exc
        committed[msg_id] = chunks
    raise AssertionError("the disk never filled up")


def assert_all_there(store: QueueStore, committed: dict[int, list[bytes]]) -> None:
    for msg_id, chunks in committed.items():
        assert store.message(msg_id).chunks == len(chunks)
        assert list(store.body(msg_id)) == chunks, f"message {msg_id:x} lost or damaged"


async def commit_small(store: QueueStore, n: int) -> int:
    msg_id = store.begin(T0 + 10_000 + n)
    meta = make_meta(msg_id, size=5, chunks=1)
    await store.commit(meta, rcpts((f"after{n}@example.org", Z)), T0, tail=b"small")
    return msg_id


@async_test
async def test_full_disk_refuses_keeps_what_it_accepted_and_heals(
    disk_stores: StoreFactory, tmpfs: Path
) -> None:
    store = disk_stores.open()
    committed, failure = await fill_until_full(store, mail_chunk)
    assert len(committed) >= 5, "the disk filled up before anything was committed"
    assert "No space left" in str(failure) or "space" in str(failure).lower()
    assert store.failure is not None

    # While full: every commit (and the steps before it) answers StorageUnavailable.
    for n in range(3):
        with pytest.raises(StorageUnavailable):
            await commit_small(store, n)
    # What is queued still goes out: the failed handle reads (zoneq/storage/held.py).
    assert len(store.lease(Z, 10, "w")) == min(10, len(committed))
    store.release_owner("w")

    # Space comes back; after the reopen interval the next operation just works.
    (tmpfs / "filler").unlink()
    await asyncio.sleep(QueueStore.REOPEN_INTERVAL_S + 0.1)
    after = await commit_small(store, 10)
    assert store.failure is None

    # Every commit that returned is there, whole; nothing of the failed ones.
    assert_all_there(store, committed)
    assert store.message_count() == len(committed) + 1
    leased = store.lease(Z, 10_000, "w")
    assert sorted(lease.recipient.msg_id for lease in leased) == sorted([*committed, after])
    store.release_owner("w")
    assert store.counters() == store.recount()
    await store.close()

    # And so does a fresh store on the same directory (one opener at a time).
    fresh = disk_stores.open()
    assert_all_there(fresh, committed)
    assert fresh.message_count() == len(committed) + 1
    assert fresh.counters() == fresh.recount()


@pytest.fixture
def roomy_stores(tmp_path: Path) -> Iterator[StoreFactory]:
    """Stores on a 32 MiB tmpfs: room for a LevelDB log of a few MiB plus an 8 MiB reserve."""
    for mount_point in mounted_tmpfs(tmp_path / "roomy", "32m"):
        factory = StoreFactory(mount_point)
        try:
            yield factory
        finally:
            factory.close_all()


@async_test
async def test_full_disk_with_incompressible_bodies_heals_with_the_reserve(
    roomy_stores: StoreFactory,
) -> None:
    """LevelDB's reopen replays the log into a table first, which needs about a log's worth
    of space: with incompressible bodies, freeing a little is not enough.  The reserve is
    released when a write fails for space, so the store heals with nothing else freed."""
    # The reserve must cover the logs a reopen replays: up to two memtables (the one being
    # flushed and the current one), so 4x the write buffer, as the defaults (16 MiB, 64 MiB).
    store = roomy_stores.open(db_options={"write_buffer_mb": 2})
    store.space = SpaceGuard(store.database.path, reserve=8 << 20)
    assert store.space.restore()
    assert store.space.reserve_path.stat().st_size == 8 << 20
    committed, failure = await fill_until_full(store, random_chunk, limit=2000)
    assert isinstance(failure, DiskFull)
    assert committed
    assert not store.space.reserve_path.exists()  # given back to get out of the hole
    await asyncio.sleep(QueueStore.REOPEN_INTERVAL_S + 0.1)
    await commit_small(store, 1)  # nothing else was freed
    assert store.failure is None
    assert_all_there(store, committed)
    # Deliveries (deletes) work again, so the queue can drain.
    for lease in store.lease(Z, 5, "w"):
        await store.complete(lease, T0, Outcome("250 ok"))
    assert store.counters() == store.recount()


@async_test
async def test_free_space_floor_refuses_new_mail_before_the_disk_fills(
    disk_stores: StoreFactory,
) -> None:
    """Postfix's queue_minfree: below the floor, new mail gets a temporary refusal
    (InsufficientStorage, 452 4.3.1) and the database never hits ENOSPC; delivery goes on."""
    store = disk_stores.open()
    store.space = SpaceGuard(store.database.path, min_free=1 << 20, interval=0.0)
    committed: dict[int, list[bytes]] = {}
    with pytest.raises(InsufficientStorage):
        for n in range(1000):
            msg_id = store.begin(T0 + n, size_hint=3 * CHUNK)
            chunks = [mail_chunk(n, i) for i in range(CHUNKS_PER_MESSAGE)]
            meta = make_meta(msg_id, size=3 * CHUNK, chunks=len(chunks))
            for index, chunk in enumerate(chunks[:-1]):
                await store.write_chunk(msg_id, index, chunk)
            await store.commit(meta, rcpts((f"user{n}@example.org", Z)), T0, tail=chunks[-1])
            committed[msg_id] = chunks
    assert committed
    assert store.failure is None  # refused in time: LevelDB never saw a full disk
    assert_all_there(store, committed)
    for lease in store.lease(Z, 3, "w"):
        await store.complete(lease, T0, Outcome("250 ok"))
    assert store.counters() == store.recount()
