"""The intake socket: ``IntakeClient`` in a "receiver" and ``IntakeServer`` on a real queue.

Each test opens a LevelDB queue under ``tmp_path``, serves it through ``StoreSink`` (the
same adapter the in-core receiver uses) and connects clients over real Unix socket pairs,
as the supervisor does for receiver processes.  A receiver's crash is its socket closing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import pytest

from tests.receiver.harness import make_config
from zoneq.errors import InsufficientStorage, StorageUnavailable, TemporaryFailure
from zoneq.ipc import intake_client
from zoneq.ipc.intake_client import IntakeClient
from zoneq.ipc.intake_messages import CoreUnreachable, ReceivedMessage, ReceivedRecipient
from zoneq.ipc.intake_server import IntakeServer
from zoneq.runtime import StoreSink
from zoneq.storage import keys
from zoneq.storage.leveldb import Database, Op
from zoneq.storage.space import SpaceGuard
from zoneq.storage.store import QueueStore

T0 = 1_700_000_000_000
CHUNK = 65_536
TIMEOUT = 30.0

Connect = Callable[[str], Awaitable[IntakeClient]]


class GatedSyncs(Database):
    """Synced writes (commits) wait for ``gate``; ``fail`` makes them raise instead."""

    gate = threading.Event()
    fail = False

    def write(self, ops: Sequence[Op], *, sync: bool) -> None:
        if sync:
            assert self.gate.wait(20), "test never opened the gate"
            if self.fail:
                raise StorageUnavailable("injected: sync failed")
        super().write(ops, sync=sync)


def gated(*, opened: bool, fail: bool = False) -> type[GatedSyncs]:
    """``GatedSyncs`` with a fresh gate (open or held) and syncs failing or not."""
    GatedSyncs.gate = threading.Event()
    if opened:
        GatedSyncs.gate.set()
    GatedSyncs.fail = fail
    return GatedSyncs


@contextlib.asynccontextmanager
async def intake(
    tmp_path: Path, *, limit: int = 50, db: type[Database] = Database
) -> AsyncIterator[tuple[QueueStore, IntakeServer, Connect]]:
    store = QueueStore(db(tmp_path / "queue"), chunk_size=CHUNK)
    store.recover()
    server = IntakeServer(StoreSink(store, make_config(max_connections_per_client=limit)))
    clients: list[IntakeClient] = []

    async def connect(name: str) -> IntakeClient:
        core_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        await server.attach(core_end, name)
        client = await IntakeClient.from_fd(child_end.detach(), name)
        clients.append(client)
        return client

    try:
        yield store, server, connect
    finally:
        for client in clients:
            await client.close()
        await server.close()
        await store.close()


def run(body: Awaitable[None]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(body, TIMEOUT)

    asyncio.run(bounded())


def message(msg_id: int, text: bytes, chunks: int) -> ReceivedMessage:
    return ReceivedMessage(
        msg_id=msg_id,
        sender="c@d.test",
        size=len(text),
        chunks=chunks,
        received_ms=T0,
        headers={"Subject": "hi"},
        source={"client": "127.0.0.1", "helo": "client.test", "protocol": "smtp"},
    )


RECIPIENTS = [ReceivedRecipient("a@b.test", "default", ("SUCCESS", "FAILURE"), "rfc822;a@b.test")]


async def send(client: IntakeClient, text: bytes) -> int:
    """begin, full chunks, commit with the rest as its tail: the receiver's sequence."""
    msg_id = await client.begin(T0, len(text))
    pieces = [text[i : i + CHUNK] for i in range(0, len(text), CHUNK)]
    for index, piece in enumerate(pieces[:-1]):
        await client.write_chunk(msg_id, index, piece)
    await client.commit(message(msg_id, text, len(pieces)), RECIPIENTS, T0, tail=pieces[-1])
    return msg_id


def receiving(store: QueueStore) -> list[bytes]:
    return list(store.database.keys(prefix=keys.RECEIVING))


def chunks_of(store: QueueStore, msg_id: int) -> list[bytes]:
    return list(store.database.keys(prefix=keys.message_chunk(msg_id, 0)[:-4]))


async def wait_for(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in 5 s")


# --- messages ----------------------------------------------------------------------------


def test_a_message_sent_through_the_socket_is_queued_whole(tmp_path: Path) -> None:
    text = bytes(range(256)) * 1000  # 256,000 octets: three full chunks and a tail

    async def body() -> None:
        async with intake(tmp_path) as (store, _, connect):
            client = await connect("receiver-0")
            msg_id = await send(client, text)
            assert b"".join(store.body(msg_id)) == text
            meta = store.message(msg_id)
            assert (meta.sender, meta.size, meta.chunks) == ("c@d.test", len(text), 4)
            assert meta.headers == {"Subject": "hi"}
            assert store.message_count() == 1
            assert receiving(store) == []

    run(body())


def test_the_commit_is_answered_only_once_the_batch_is_synced(tmp_path: Path) -> None:
    db = gated(opened=False)

    async def body() -> None:
        async with intake(tmp_path, db=db) as (store, _, connect):
            client = await connect("receiver-0")
            msg_id = await client.begin(T0, 0)
            answer = client.commit(message(msg_id, b"x\r\n", 1), RECIPIENTS, T0, tail=b"x\r\n")
            await asyncio.sleep(0.3)
            assert not answer.done()  # the sync is held: no 250 may be given yet
            db.gate.set()
            await asyncio.wait_for(answer, 10)
            assert store.message_count() == 1

    run(body())


def test_a_failed_sync_comes_back_as_a_temporary_failure_and_loses_nothing(
    tmp_path: Path,
) -> None:
    db = gated(opened=True, fail=True)

    async def body() -> None:
        async with intake(tmp_path, db=db) as (store, _, connect):
            client = await connect("receiver-0")
            msg_id = await client.begin(T0, 0)
            await client.write_chunk(msg_id, 0, b"a" * CHUNK)
            with pytest.raises(TemporaryFailure) as caught:
                await client.commit(message(msg_id, b"", 2), RECIPIENTS, T0, tail=b"b\r\n")
            assert not isinstance(caught.value, InsufficientStorage)  # 451, not 452
            await client.abandon(msg_id)  # as the receiver does after a failed commit
            db.fail = False
            await wait_for(lambda: msg_id not in store._receiving)
            await store.drain()
            assert chunks_of(store, msg_id) == []
            assert store.message_count() == 0

    run(body())


def test_the_free_space_floor_comes_back_as_insufficient_storage(tmp_path: Path) -> None:
    async def body() -> None:
        async with intake(tmp_path) as (store, _, connect):
            store.space = SpaceGuard(store.database.path, min_free=1 << 62, interval=0.0)
            client = await connect("receiver-0")
            with pytest.raises(InsufficientStorage):
                await client.begin(T0, 1000)
            assert not client.lost.is_set()  # a refusal, not a broken connection

    run(body())


# --- crashes and the core going away -----------------------------------------------------


def test_a_receiver_that_dies_has_its_open_messages_abandoned_at_once(tmp_path: Path) -> None:
    async def body() -> None:
        async with intake(tmp_path) as (store, server, connect):
            dying = await connect("receiver-0")
            other = await connect("receiver-1")
            kept = await send(dying, b"kept\r\n" * 20_000)
            open_ids = []
            for _ in range(3):
                msg_id = await dying.begin(T0, 0)
                await dying.write_chunk(msg_id, 0, b"c" * CHUNK)
                await dying.write_chunk(msg_id, 1, b"d" * CHUNK)
                open_ids.append(msg_id)
            elsewhere = await other.begin(T0, 0)
            await other.write_chunk(elsewhere, 0, b"e" * CHUNK)
            assert all(chunks_of(store, m) for m in open_ids)
            dying._writer.transport.abort()  # as the kernel does for a killed process
            await wait_for(lambda: server.connected == ["receiver-1"])
            await store.drain()
            assert all(chunks_of(store, m) == [] for m in open_ids)
            assert b"".join(store.body(kept)) == b"kept\r\n" * 20_000
            # The other receiver's message is untouched and commits.
            await other.commit(message(elsewhere, b"", 2), RECIPIENTS, T0, tail=b"f\r\n")
            assert receiving(store) == []
            assert store.message_count() == 2
            counters = {k: v for k, v in store.counters().items() if v}
            assert counters == {k: v for k, v in store.recount().items() if v}

    run(body())


def test_the_core_going_away_fails_pending_and_later_calls(tmp_path: Path) -> None:
    db = gated(opened=False)

    async def body() -> None:
        async with intake(tmp_path, db=db) as (_, server, connect):
            client = await connect("receiver-0")
            msg_id = await client.begin(T0, 0)
            pending = client.commit(message(msg_id, b"", 1), RECIPIENTS, T0, tail=b"x\r\n")
            await asyncio.sleep(0.1)
            closing = asyncio.ensure_future(server.close())
            await asyncio.wait_for(client.lost.wait(), 5)
            with pytest.raises(CoreUnreachable):
                await pending
            with pytest.raises(CoreUnreachable):
                await client.begin(T0, 0)
            await client.abandon(msg_id)  # a no-op now: the core abandons by itself
            db.gate.set()
            await closing

    run(body())


# --- what a receiver may do --------------------------------------------------------------


def test_connections_per_client_are_counted_across_receivers(tmp_path: Path) -> None:
    async def body() -> None:
        async with intake(tmp_path, limit=2) as (_, server, connect):
            a = await connect("receiver-0")
            b = await connect("receiver-1")
            assert await a.admit("192.0.2.1")
            assert await b.admit("192.0.2.1")
            assert not await b.admit("192.0.2.1")  # the third, whichever process has it
            assert await b.admit("192.0.2.2")
            b.release("192.0.2.1")
            assert await b.admit("192.0.2.1")
            assert not await a.admit("192.0.2.1")
            a._writer.transport.abort()  # a crash releases what it held
            await wait_for(lambda: server.connected == ["receiver-1"])
            assert await b.admit("192.0.2.1")

    run(body())


def test_a_receiver_cannot_touch_another_receivers_message(tmp_path: Path) -> None:
    async def body() -> None:
        async with intake(tmp_path) as (store, server, connect):
            owner = await connect("receiver-0")
            intruder = await connect("receiver-1")
            msg_id = await owner.begin(T0, 0)
            await intruder.abandon(msg_id)  # not its own: ignored
            with pytest.raises(CoreUnreachable):
                await intruder.write_chunk(msg_id, 0, b"x")  # a protocol error: cut off
            await wait_for(lambda: server.connected == ["receiver-0"])
            await owner.commit(message(msg_id, b"", 1), RECIPIENTS, T0, tail=b"ok\r\n")
            assert b"".join(store.body(msg_id)) == b"ok\r\n"

    run(body())


# --- spare ids -----------------------------------------------------------------------------


def test_spare_ids_are_used_once_each_and_all_are_abandoned_at_close(tmp_path: Path) -> None:
    async def body() -> None:
        async with intake(tmp_path) as (store, server, connect):
            client = await connect("receiver-0")
            ids = []
            for n in range(20):
                ids.append(await send(client, b"message %d\r\n" % n))
            assert len(set(ids)) == 20
            # The first MAIL asked for a spare before its own id, so the second message got
            # that (smaller) id at once: it was served from the spares.
            assert ids[1] < ids[0]
            assert client._spares, "no id was begun ahead"
            spare_ids = [f.result() for _, f in client._spares if f.done()]
            assert spare_ids and all(i in store._receiving for i in spare_ids)
            await client.close()
            await wait_for(lambda: server.connected == [])
            await store.drain()
            assert store._receiving == {}  # the spares were abandoned
            assert store.message_count() == 20
            assert receiving(store) == []

    run(body())


def test_a_stale_spare_is_abandoned_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        async with intake(tmp_path) as (store, _, connect):
            client = await connect("receiver-0")
            await send(client, b"first\r\n")
            _, future = client._spares[0]
            stale = await future
            monkeypatch.setattr(intake_client, "SPARE_MAX_AGE_S", 0.0)
            await asyncio.sleep(0.01)
            fresh = await client.begin(T0, 0)
            assert fresh != stale
            await wait_for(lambda: stale not in store._receiving)

    run(body())


def test_a_large_declared_size_is_checked_at_mail_not_served_a_spare(tmp_path: Path) -> None:
    async def body() -> None:
        async with intake(tmp_path) as (store, _, connect):
            client = await connect("receiver-0")
            await send(client, b"first\r\n")
            assert client._spares
            store.space = SpaceGuard(store.database.path, min_free=1, interval=0.0)
            free = store.space.free_bytes()
            with pytest.raises(InsufficientStorage):
                await client.begin(T0, free + 1)  # declared larger than the disk: 452
            assert await client.begin(T0, 0) > 0  # a small message still gets a spare

    run(body())


def test_a_commit_with_a_list_of_long_recipients_is_not_refused_for_its_size(
    tmp_path: Path,
) -> None:
    # A bulk list at a raised receiver.max_recipients with long paths and ORCPTs (each
    # RCPT line up to 512 octets) makes a COMMIT frame far past a worker frame's 16 MiB.
    rcpts = [
        ReceivedRecipient(
            f"u{i:05d}{'x' * 180}@d{i % 100}.test",
            "default",
            ("SUCCESS", "FAILURE"),
            f"rfc822;u{i:05d}{'x' * 180}@d{i % 100}.test",
        )
        for i in range(40_000)
    ]
    text = b"Subject: list\r\n\r\nhello\r\n"

    async def body() -> None:
        async with intake(tmp_path) as (store, _, connect):
            client = await connect("receiver-0")
            msg_id = await client.begin(T0, len(text))
            await client.commit(message(msg_id, text, 1), rcpts, T0, tail=text)
            assert len(store.recipients(msg_id)) == len(rcpts)

    run(body())
