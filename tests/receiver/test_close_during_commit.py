"""The receiver closing while a message's commit is still syncing (``SmtpReceiver.close``
cancels sessions still busy after its grace).  The commit goes on and lands; the message
it queues must be whole, its first chunks included (they were written before the dot).
A real queue on LevelDB whose synced writes wait at a gate (a slow fsync)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

import zoneq.receiver.server as server_module
from tests.receiver.harness import MESSAGE, Raw, run, split_received, stored_body
from zoneq.receiver import SmtpReceiver
from zoneq.storage import keys
from zoneq.storage.leveldb import Database, Op
from zoneq.storage.store import QueueStore

GATE = threading.Event()
ENTERED = threading.Event()


class SlowSync(Database):
    """Synced writes wait for ``GATE``; ``ENTERED`` says one is waiting."""

    def write(self, ops: Sequence[Op], *, sync: bool) -> None:
        if sync:
            ENTERED.set()
            assert GATE.wait(20), "the test never opened the gate"
        super().write(ops, sync=sync)


def test_a_commit_cut_off_by_close_queues_the_whole_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "_CLOSE_GRACE_S", 0.3)
    GATE.clear()
    ENTERED.clear()
    body = MESSAGE + (b"p" * 998 + b"\r\n") * 100  # over 64 KiB: chunk 0 goes ahead

    async def scenario(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.start()
        await raw.send(body.replace(b"\r\n.", b"\r\n..") + b".\r\n")  # dot-stuffed
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, ENTERED.wait, 10)  # the commit syncs
        closing = asyncio.ensure_future(rx.close())
        assert (await raw.reply()).startswith("421 ")  # cut off: the client was not told 250
        GATE.set()
        await closing
        await store.drain()
        [msg_id] = {keys.decode_message_key(k)[0] for k in store.database.keys(prefix=keys.MESSAGE)}
        meta = store.message(msg_id)
        assert meta.chunks == 2
        _, text = split_received(stored_body(store, msg_id))  # every chunk read
        assert text == body
        assert list(store.database.keys(prefix=keys.READY))  # and it is queued
        await raw.close()

    try:
        run(tmp_path, scenario, db=SlowSync)
    finally:
        GATE.set()
