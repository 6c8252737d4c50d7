"""Shared fixtures and helpers for the storage contract tests.

Every test here runs against a real LevelDB directory under ``tmp_path``; nothing about
LevelDB is mocked.  Faults are injected one level up, by :class:`FaultyDatabase`, a
``Database`` subclass that can refuse writes, refuse to (re)open, or hold a write at a gate
so a test can look at the store while a group is in flight.

pytest-asyncio is not installed: async test bodies are run with :func:`asyncio.run` through
the :func:`async_test` decorator.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import pytest

from zoneq.errors import StorageUnavailable
from zoneq.storage import keys
from zoneq.storage.leveldb import Database, Op
from zoneq.storage.records import MessageMeta, NewRecipient
from zoneq.storage.store import QueueStore

P = ParamSpec("P")
R = TypeVar("R")

# A realistic wall-clock reading (November 2023), so ids look like real ones.
T0 = 1_700_000_000_000
SECOND = 1_000
MINUTE = 60 * SECOND

DEFAULT_BODY = (b"From: a@example.org\r\nSubject: test\r\n\r\n", b"hello\r\n")


def async_test(fn: Callable[P, Awaitable[R]]) -> Callable[P, R]:
    """Run an ``async def`` test with :func:`asyncio.run` (fixtures still injected)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        async def main() -> R:
            return await fn(*args, **kwargs)

        return asyncio.run(main())

    return wrapper


def make_meta(msg_id: int, *, size: int = 0, chunks: int = 0, **fields: Any) -> MessageMeta:
    fields.setdefault("sender", "sender@example.org")
    fields.setdefault("received_ms", T0)
    return MessageMeta(msg_id=msg_id, size=size, chunks=chunks, **fields)


def rcpts(*pairs: tuple[str, str]) -> tuple[NewRecipient, ...]:
    """``(address, zone)`` pairs as commit input."""
    return tuple(NewRecipient(address=a, zone=z) for a, z in pairs)


async def queue_message(
    store: QueueStore,
    recipients: Sequence[tuple[str, str]] | Sequence[NewRecipient],
    *,
    now_ms: int = T0,
    body: Sequence[bytes] = DEFAULT_BODY,
    **meta_fields: Any,
) -> int:
    """begin / write_chunk / commit one message; return its id once it is durable."""
    new = tuple(r if isinstance(r, NewRecipient) else NewRecipient(r[0], r[1]) for r in recipients)
    msg_id = store.begin(now_ms)
    for index, chunk in enumerate(body):
        await store.write_chunk(msg_id, index, chunk)
    meta = make_meta(msg_id, size=sum(map(len, body)), chunks=len(body), **meta_fields)
    await store.commit(meta, new, now_ms)
    return msg_id


def message_keys(store: QueueStore, msg_id: int) -> list[bytes]:
    """Every durable key of a message: head, metadata and body chunks."""
    return list(store.database.keys(prefix=keys.message_prefix(msg_id)))


def family_keys(store: QueueStore, family: bytes) -> list[bytes]:
    return list(store.database.keys(prefix=family))


async def assert_consistent(store: QueueStore) -> None:
    """The O(1) counters equal a full scan (after everything staged has landed)."""
    await store.drain()
    assert store.counters() == store.recount()


class FaultyDatabase(Database):
    """A real LevelDB handle with switches for the failures a disk can produce.

    * ``fail_writes = n``: the next ``n`` writes raise ``StorageUnavailable`` (nothing
      written, as LevelDB does when the log append fails);
    * ``fail_syncs = n``: the next ``n`` synced writes are written, then raise (a failed
      fdatasync after the log append: the batch is in the log, and a reopen replays it);
    * ``unavailable = True``: every write and every (re)open fails until cleared (a full
      disk that stays full);
    * ``gate``: when set to a ``threading.Event``, writes wait for it (a slow fsync), so a
      test can act while a group is in flight; ``entered`` is set when a write starts.
    """

    def __init__(self, path: Path, **options: Any) -> None:
        self.fail_writes = 0
        self.fail_syncs = 0
        self.unavailable = False
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.writes = 0
        self.syncs: list[bool] = []  # the sync flag of every successful write, in order
        self.opens = 0
        super().__init__(path, **options)

    def probe_sync(self) -> None:
        if self.unavailable:  # the sync a reopen tries first fails too, as on a real disk
            raise StorageUnavailable(f"injected: cannot sync in {self.path}")
        super().probe_sync()

    def open(self) -> None:
        if self.unavailable:
            raise StorageUnavailable(f"injected: cannot open {self.path}")
        self.opens += 1
        super().open()

    def write(self, ops: Sequence[Op], *, sync: bool) -> None:
        self.entered.set()
        gate = self.gate
        if gate is not None:
            assert gate.wait(10), "test never opened the write gate"
        if self.unavailable:
            raise StorageUnavailable("injected: write failed (disk unavailable)")
        if self.fail_writes:
            self.fail_writes -= 1
            raise StorageUnavailable("injected: write failed")
        super().write(ops, sync=sync)
        self.writes += 1
        self.syncs.append(sync)
        if sync and self.fail_syncs:
            self.fail_syncs -= 1
            raise StorageUnavailable("injected: fdatasync failed after the log append")


class StoreFactory:
    """Opens stores on real directories and closes whatever a test left open."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / "queue"
        self._opened: list[QueueStore] = []

    def open(
        self,
        path: Path | None = None,
        *,
        faulty: bool = False,
        recover: bool = True,
        db_options: dict[str, Any] | None = None,
        **options: Any,
    ) -> QueueStore:
        db_options = db_options or {}
        where = self.path if path is None else path
        db = FaultyDatabase(where, **db_options) if faulty else Database(where, **db_options)
        store = QueueStore(db, **options)
        self._opened.append(store)
        if recover:
            store.recover()
        return store

    def faulty(self, store: QueueStore) -> FaultyDatabase:
        db = store.database
        assert isinstance(db, FaultyDatabase)
        return db

    def close_all(self) -> None:
        for store in self._opened:
            if store.database.is_open and not store._writer.busy:
                # A test that failed half-way may leave a store that cannot drain: the
                # fallback below closes it anyway.
                with contextlib.suppress(Exception):
                    asyncio.run(asyncio.wait_for(store.close(), 5))
            store._writer.close()
            store.database.close()


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[StoreFactory]:
    factory = StoreFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.close_all()


@pytest.fixture
def store(stores: StoreFactory) -> QueueStore:
    """A recovered store on a fresh directory."""
    return stores.open()
