"""Group commit: grouping, read-your-writes through the overlay, and failure handling."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.storage.conftest import (
    MINUTE,
    T0,
    FaultyDatabase,
    StoreFactory,
    assert_consistent,
    async_test,
    make_meta,
    queue_message,
    rcpts,
)
from zoneq.errors import LeaseError, NotFound, StorageUnavailable
from zoneq.protocol.ids import format_id
from zoneq.storage import keys
from zoneq.storage.leveldb import Database
from zoneq.storage.records import State
from zoneq.storage.store import Outcome, QueueStore
from zoneq.storage.writer import GroupWriter

Z = "default"
OK = Outcome(reply="250 ok", code=250)


async def commit_whole(store: QueueStore, n: int, now_ms: int = T0) -> int:
    """One message, body included in the commit's batch (``tail``)."""
    msg_id = store.begin(now_ms)
    body = b"message %d\r\n" % n
    meta = make_meta(msg_id, size=len(body), chunks=1)
    await store.commit(meta, rcpts((f"user{n}@example.org", Z)), now_ms, tail=body)
    return msg_id


async def wait_for_write(db: FaultyDatabase) -> None:
    """Until the writer thread has entered ``write`` (and waits at the gate)."""
    for _ in range(5000):
        if db.entered.is_set():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the writer never started a write")


# --- grouping ---------------------------------------------------------------------------


@async_test
async def test_concurrent_commits_share_groups_and_all_are_durable(stores: StoreFactory) -> None:
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    groups, writes = store._writer.groups_written, db.writes
    ids = await asyncio.gather(*(commit_whole(store, n) for n in range(200)))
    assert len(set(ids)) == 200
    groups_used = store._writer.groups_written - groups
    assert 1 <= groups_used <= 5, groups_used  # far below one fsync per commit
    assert db.writes - writes == groups_used
    assert all(db.syncs[-groups_used:])  # each group carried a commit: synced
    assert store.message_count() == 200
    await assert_consistent(store)
    await store.close()

    fresh = stores.open()  # a fresh store on the same directory finds every message
    assert fresh.message_count() == 200
    for n, msg_id in enumerate(ids):
        assert fresh.message(msg_id).chunks == 1
        assert list(fresh.body(msg_id)) == [b"message %d\r\n" % n]
    leased = fresh.lease(Z, 1000, "w")
    assert sorted(lease.recipient.msg_id for lease in leased) == sorted(ids)
    assert fresh.counters() == fresh.recount()


@async_test
async def test_concurrent_outcomes_share_groups(store: QueueStore) -> None:
    for n in range(10):
        await queue_message(store, [(f"u{i}@example.org", Z) for i in range(10)], now_ms=T0 + n)
    leases = store.lease(Z, 100, "w")
    groups = store._writer.groups_written
    await asyncio.gather(
        *(
            store.complete(lease, T0, OK)
            if i % 2
            else store.defer(lease, T0, T0 + MINUTE, Outcome(reply="451"))
            for i, lease in enumerate(leases)
        )
    )
    assert store._writer.groups_written - groups <= 5
    assert store.count(Z, State.DEFERRED) == 50
    assert store.message_count() == 10
    await assert_consistent(store)


@async_test
async def test_group_writer_groups_seals_and_runs_effects_in_order(tmp_path: Path) -> None:
    db = Database(tmp_path / "w")
    seals: list[int] = []

    def seal() -> list[tuple[bytes, bytes | None]]:
        seals.append(len(seals))
        return [(b"sealed-%d" % len(seals), b"")]

    writer = GroupWriter(db, seal=seal)
    effects: list[int] = []

    def effect(i: int) -> Callable[[], None]:
        def run() -> None:
            # An effect runs only once its transition is on disk.
            assert db.get(b"key-%03d" % i) == b"value"
            effects.append(i)

        return run

    try:
        futures = [
            writer.submit([(b"key-%03d" % i, b"value")], sync=i == 0, effect=effect(i))
            for i in range(100)
        ]
        # Staged, not yet durable: visible through the overlay only.
        assert writer.read(b"key-000") == b"value"
        assert writer.pending(b"key-000") == b"value"
        await asyncio.gather(*futures)
        assert writer.groups_written == len(seals) <= 2
        assert writer.ops_written == 100 + len(seals)
        assert effects == list(range(100))
        assert writer.pending(b"key-000") is GroupWriter.MISSING  # overlay cleaned up
        assert writer.read(b"key-099") == b"value"
        assert db.get(b"sealed-1") == b""

        # A staged delete hides a durable key until it lands, then it is gone.
        gone = writer.submit([(b"key-000", None)], sync=False)
        assert writer.pending(b"key-000") is None
        assert writer.read(b"key-000") is None
        await gone
        assert db.get(b"key-000") is None
        await writer.drain()
        assert not writer.busy
    finally:
        writer.close()
        db.close()


# --- read-your-writes -------------------------------------------------------------------


@async_test
async def test_overlay_shows_staged_writes_before_the_group_lands(stores: StoreFactory) -> None:
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    older = await queue_message(store, [("a@example.org", Z), ("b@example.org", Z)])
    first, second = store.lease(Z, 2, "w")
    await store.complete(first, T0, OK)

    db.gate = threading.Event()
    db.entered.clear()
    newer = store.begin(T0)
    committing = asyncio.ensure_future(
        store.commit(
            make_meta(newer, size=4, chunks=1), rcpts(("c@example.org", Z)), T0, tail=b"body"
        )
    )
    await wait_for_write(db)  # the commit's group is being written
    completing = asyncio.ensure_future(store.complete(second, T0, OK))  # the next group
    await asyncio.sleep(0)

    # A commit in flight is invisible until it is on disk: nobody has its id before the
    # commit returns (the 250 waits for it), and nothing is leased before it is safe.
    assert store.database.get(keys.message_meta(newer)) is None
    with pytest.raises(NotFound):
        store.message(newer)
    assert store.lease(Z, 10, "w") == []
    # The staged completion of the last recipient hides the whole older message at once.
    assert store.database.get(keys.message_meta(older)) is not None
    with pytest.raises(NotFound):
        store.message(older)
    assert store.browse(Z)[0] == []

    db.gate.set()
    await asyncio.gather(committing, completing)
    (lease,) = store.lease(Z, 10, "w")
    assert lease.recipient.msg_id == newer
    assert store.database.get(keys.message_meta(older)) is None
    await assert_consistent(store)


# --- failures ---------------------------------------------------------------------------


@async_test
async def test_failed_write_fails_pending_writes_and_holds_outcomes_until_reopen(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(QueueStore, "REOPEN_INTERVAL_S", 0.25)
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    durable = [await commit_whole(store, n) for n in range(3)]
    old_lease = store.lease(Z, 1, "w")[0]
    events_before = list(store.events())
    counters_before = store.counters()

    db.gate = threading.Event()
    db.entered.clear()
    in_flight = asyncio.gather(
        *(commit_whole(store, n) for n in range(10, 15)), return_exceptions=True
    )
    await wait_for_write(db)
    # Staged on top of the failing group: must fail too, it cannot land after it.
    streaming = store.begin(T0)
    staged = asyncio.gather(
        *(commit_whole(store, n) for n in range(20, 25)),
        store.complete(old_lease, T0, OK),
        store.write_chunk(streaming, 0, b"chunk"),
        return_exceptions=True,
    )
    await asyncio.sleep(0)
    db.unavailable = True  # the write fails, and the disk stays bad for a while
    db.gate.set()
    results = list(await in_flight) + list(await staged)
    assert len(results) == 12
    # The delivery's outcome is held (zoneq/storage/held.py); everything else failed.
    assert results[10] is None
    del results[10]
    assert all(isinstance(r, StorageUnavailable) for r in results), results
    assert isinstance(store.failure, StorageUnavailable)
    assert store.held == 1

    # While the cause lasts, whatever must be durable refuses with StorageUnavailable (a
    # 4xx); what is queued still goes out, but never the held recipient a second time.
    with pytest.raises(StorageUnavailable):
        await commit_whole(store, 30)
    with pytest.raises(StorageUnavailable):
        store.begin(T0)
    with pytest.raises(StorageUnavailable):
        await store.write_chunk(streaming, 1, b"more")
    during = store.lease(Z, 10, "w")
    assert sorted(lease.recipient.msg_id for lease in during) == durable[1:]
    await store.complete(during[0], T0 + 1, OK)  # delivered during the fault: held too
    assert store.held == 2
    assert store.database.get(keys.message_head(durable[0])) is not None  # not written yet

    # The cause is gone; the store retries its reopen after REOPEN_INTERVAL_S at most.
    db.unavailable = False
    if time.monotonic() < store._next_reopen - 0.05:
        with pytest.raises(StorageUnavailable):
            store.begin(T0)
    await asyncio.sleep(QueueStore.REOPEN_INTERVAL_S + 0.05)
    assert store.lease(Z, 10, "w") == []  # no explicit reopen: the store healed itself
    assert store.failure is None
    await store.drain()
    assert store.held == 0

    # The held outcomes are written; nothing of the failed groups is there; the lease
    # handed out during the fault is still good.
    assert store.message_count() == 1
    assert store.counters() == store.recount()
    assert counters_before != store.counters()
    delivered = [e.message_id for _, e in store.events()][len(events_before) :]
    assert delivered == [
        format_id(old_lease.recipient.msg_id),
        format_id(during[0].recipient.msg_id),
    ]
    assert list(store.database.keys(prefix=keys.RECEIVING)) == []
    with pytest.raises(LeaseError):
        await store.complete(old_lease, T0, OK)  # written once, not twice
    await store.complete(during[1], T0, OK)
    new_id = await commit_whole(store, 40)
    assert new_id > max(durable)
    await assert_consistent(store)
    counters = store.counters()
    await store.close()

    fresh = stores.open()
    assert fresh.counters() == counters == fresh.recount()
    assert fresh.message_count() == 1
    assert [lease.recipient.msg_id for lease in fresh.lease(Z, 10, "w")] == [new_id]


@async_test
async def test_transient_failure_heals_at_the_next_operation(stores: StoreFactory) -> None:
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    kept = await commit_whole(store, 1)
    opens = db.opens
    db.fail_writes = 1
    with pytest.raises(StorageUnavailable):
        await commit_whole(store, 2)
    assert store.failure is not None
    again = await commit_whole(store, 3)  # the first check after a failure reopens at once
    assert store.failure is None
    assert db.opens == opens + 1
    assert store.message_count() == 2
    assert {lease.recipient.msg_id for lease in store.lease(Z, 10, "w")} == {kept, again}
    await assert_consistent(store)


@async_test
async def test_failed_bounce_loses_neither_the_recipient_nor_queues_the_notice(
    stores: StoreFactory,
) -> None:
    from zoneq.storage.records import Notice

    store = stores.open(faulty=True)
    db = stores.faulty(store)
    msg_id = await commit_whole(store, 1)
    lease = store.lease(Z, 1, "w")[0]
    notice = Notice(
        meta=make_meta(0, sender="", is_bounce=True),
        recipients=rcpts(("sender@example.org", "bounces")),
        body=b"dsn",
    )
    db.fail_writes = 1
    await store.bounce(lease, T0, Outcome(reply="550 no"), notice=notice)  # held
    assert store.held == 1
    assert store.lease(Z, 10, "w") == []  # healed; the held bounce is written, once
    await store.drain()
    assert store.held == 0
    with pytest.raises(NotFound):
        store.message(msg_id)
    (notice_lease,) = store.lease("bounces", 10, "w")
    assert store.database.get(keys.message_chunk(notice_lease.recipient.msg_id, 0)) == b"dsn"
    assert store.message_count() == 1
    await assert_consistent(store)


@async_test
async def test_group_writer_failure_is_sticky_until_reset(tmp_path: Path) -> None:
    db = FaultyDatabase(tmp_path / "w")
    failures: list[StorageUnavailable] = []
    ran: list[str] = []
    writer = GroupWriter(db, on_failure=failures.append)
    try:
        db.fail_writes = 1
        futures = [
            writer.submit([(b"k%d" % i, b"v")], sync=True, effect=lambda: ran.append("no"))
            for i in range(3)
        ]
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert all(isinstance(r, StorageUnavailable) for r in results)
        assert len(failures) == 1
        assert ran == []  # effects of a failed group never run
        assert writer.read(b"k0") is None  # the overlay was dropped
        with pytest.raises(StorageUnavailable):
            writer.submit([(b"k9", b"v")], sync=False)
        db.reopen()
        writer.reset()
        await writer.submit([(b"k9", b"v")], sync=False)
        assert db.get(b"k9") == b"v"
        assert db.get(b"k0") is None
    finally:
        writer.close()
        db.close()


# --- which thread writes -----------------------------------------------------------------


@contextlib.contextmanager
def writer_on(path: Path, **options: Any) -> Iterator[tuple[Database, GroupWriter]]:
    """A group writer on a real LevelDB directory, both closed afterwards."""
    db = Database(path)
    writer = GroupWriter(db, **options)
    try:
        yield db, writer
    finally:
        writer.close()
        db.close()


@async_test
async def test_small_unsynced_groups_are_written_inline_and_in_order(tmp_path: Path) -> None:
    landed: list[int] = []
    with writer_on(tmp_path / "w") as (db, writer):
        assert db.inline_safe
        # Synced groups (the writer thread) between unsynced ones (inline); every round
        # rewrites the same keys, so a group landing out of order would leave an old value.
        for round_ in range(20):
            sync = round_ % 3 == 0
            futures = [
                writer.submit(
                    [(b"key-%02d" % (i % 5), b"round-%02d" % round_)],
                    sync=sync,
                    effect=lambda r=round_: landed.append(r),
                )
                for i in range(10)
            ]
            await asyncio.gather(*futures)
        assert writer.groups_written == 20
        assert writer.groups_inline == 20 - 7  # rounds 0, 3, ..., 18 were synced
        assert landed == sorted(landed)
        assert [db.get(b"key-%02d" % i) for i in range(5)] == [b"round-19"] * 5


@async_test
async def test_large_or_synced_groups_keep_the_writer_thread(tmp_path: Path) -> None:
    from zoneq.storage.writer import INLINE_MAX_BYTES, INLINE_MAX_OPS

    with writer_on(tmp_path / "w") as (db, writer):
        big_value = b"x" * (INLINE_MAX_BYTES + 1)
        await writer.submit([(b"chunk", big_value)], sync=False)
        many = [(b"k%05d" % i, b"") for i in range(INLINE_MAX_OPS + 1)]
        await writer.submit(many, sync=False)
        await writer.submit([(b"commit", b"v")], sync=True)
        assert writer.groups_inline == 0
        await writer.submit([(b"small", b"v")], sync=False)
        assert writer.groups_inline == 1
        assert db.get(b"chunk") == big_value
        assert db.get(b"k%05d" % INLINE_MAX_OPS) == b""


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "zoneq-writer"]


@async_test
async def test_the_writer_thread_starts_when_needed_and_close_stops_it(tmp_path: Path) -> None:
    before = len(_writer_threads())  # other tests' writers are closed; count only this one's
    db = FaultyDatabase(tmp_path / "w")
    writer = GroupWriter(db)
    try:
        assert len(_writer_threads()) == before  # none until a group needs one
        for n in range(3):  # one thread for every synced group, however many
            await writer.submit([(b"k%d" % n, b"v")], sync=True)
        assert len(_writer_threads()) == before + 1
        # close() while the thread is in a write (a slow fsync): it waits for that write.
        db.gate = threading.Event()
        db.entered.clear()
        landing = writer.submit([(b"late", b"v")], sync=True)
        await wait_for_write(db)
        threading.Timer(0.2, db.gate.set).start()
        await asyncio.to_thread(writer.close)
        assert db.get(b"late") == b"v"
        assert len(_writer_threads()) == before
        await landing  # answered on the loop after the thread wrote it
    finally:
        writer.close()  # a second close does nothing
        db.close()


def test_a_handle_that_overrides_write_is_never_written_inline(tmp_path: Path) -> None:
    # Tests hold such a handle's writes at a gate: on the event loop that would hang it.
    db = FaultyDatabase(tmp_path / "w")
    try:
        assert not db.inline_safe
    finally:
        db.close()


@async_test
async def test_failed_inline_write_fails_its_group_and_what_is_staged(tmp_path: Path) -> None:
    failures: list[StorageUnavailable] = []
    with writer_on(tmp_path / "w", on_failure=failures.append) as (db, writer):
        await writer.submit([(b"kept", b"v")], sync=False)
        db.close()  # a real handle that can no longer write
        futures = [writer.submit([(b"lost-%d" % i, b"v")], sync=False) for i in range(3)]
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert all(isinstance(r, StorageUnavailable) for r in results), results
        assert len(failures) == 1
        assert writer.pending(b"lost-0") is GroupWriter.MISSING  # the overlay is dropped
        with pytest.raises(StorageUnavailable):
            writer.submit([(b"later", b"v")], sync=False)
        db.open()
        writer.reset()
        await writer.submit([(b"later", b"v")], sync=False)
        assert db.get(b"kept") == b"v"
        assert db.get(b"lost-0") is None
        assert db.get(b"later") == b"v"


class _RaisingDatabase(FaultyDatabase):
    """Raises ``raise_next`` from its next write: errors no real disk gives LevelDB."""

    def __init__(self, path: Path) -> None:
        self.raise_next: BaseException | None = None
        super().__init__(path)

    def write(self, ops: Any, *, sync: bool) -> None:
        error, self.raise_next = self.raise_next, None
        if error is not None:
            raise error
        super().write(ops, sync=sync)


class _NotAnException(BaseException):
    pass


@pytest.mark.parametrize(
    "error", [ValueError("a binding's own error"), _NotAnException("not an Exception")]
)
@async_test
async def test_an_unexpected_error_in_a_write_fails_its_group_and_nothing_hangs(
    tmp_path: Path, error: BaseException
) -> None:
    # Anything a write raises is a failed write (its clients get 4xx), never a commit that
    # waits for ever, nor a writer thread gone with every later commit behind it.
    failures: list[StorageUnavailable] = []
    db = _RaisingDatabase(tmp_path / "w")
    writer = GroupWriter(db, on_failure=failures.append)
    try:
        await writer.submit([(b"a", b"1")], sync=True)
        db.raise_next = error
        with pytest.raises(StorageUnavailable):
            await asyncio.wait_for(writer.submit([(b"b", b"2")], sync=True), 5)
        assert len(failures) == 1
        writer.reset()  # as the store does once it has reopened
        await asyncio.wait_for(writer.submit([(b"c", b"3")], sync=True), 5)
        assert [db.get(k) for k in (b"a", b"b", b"c")] == [b"1", None, b"3"]
    finally:
        writer.close()
        db.close()


@pytest.mark.parametrize("sync", [True, False], ids=["thread", "inline"])
@async_test
async def test_an_effect_that_raises_still_answers_its_group(
    tmp_path: Path, sync: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # The group is on disk: every commit in it is answered, the other effects run, and
    # the writer goes on; the failure is logged.
    ran: list[str] = []

    def broken() -> None:
        raise ValueError("an effect's bug")

    with writer_on(tmp_path / "w") as (db, writer):
        first = writer.submit([(b"a", b"1")], sync=sync, effect=broken)
        second = writer.submit([(b"b", b"2")], sync=sync, effect=lambda: ran.append("b"))
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        await asyncio.wait_for(writer.submit([(b"c", b"3")], sync=sync), 5)
        assert ran == ["b"]
        assert [db.get(k) for k in (b"a", b"b", b"c")] == [b"1", b"2", b"3"]
    assert "an effect of a landed write group failed" in caplog.text
