"""The maintenance round compacts LevelDB in a thread, and the event loop keeps serving.

On the loop, one round after 180,000 deliveries held SMTP replies, the API and the workers'
reports for 0.8 s.  In a thread, the hard part is the handle: a reopen after a failed
write, or the close at a stop, deletes plyvel's handle, and a ``CompactRange`` still
running on it in the thread is a use after free (a segfault, seen in a plain plyvel
script).  A real store on disk; deleted 8 MiB bodies give the compactions real work.
The reopen and close race runs in a child process, so a crash is a failed test, not a
dead test run.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.queue.test_service import Z
from tests.storage.conftest import T0, assert_consistent, async_test, queue_message
from tests.storage.test_dead_bodies import BODY_MIB, MIB, big_message, disk_use
from zoneq import runtime
from zoneq.config import loads_config
from zoneq.errors import StorageUnavailable
from zoneq.storage import keys
from zoneq.storage.leveldb import Database
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

REPO = Path(__file__).resolve().parents[2]
LIVE = 50  # messages that stay queued through it all
TICK_S = 0.001
MAX_POLLS = 20_000  # 1 ms each: bounds every wait for the compaction thread


class WatchedDatabase(Database):
    """A real LevelDB handle that records each compaction's span (monotonic seconds) and
    shows while one of a message's ranges (a dead body's: the long ones) compacts."""

    def __init__(self, path: Path, **options: Any) -> None:
        self.spans: list[tuple[float, float]] = []
        self.compacting_body = threading.Event()
        super().__init__(path, **options)

    def compact_range(self, start: bytes, stop: bytes) -> None:
        body = start.startswith(keys.MESSAGE)
        began = time.monotonic()
        if body:
            self.compacting_body.set()
        try:
            super().compact_range(start, stop)
        finally:
            self.compacting_body.clear()
            self.spans.append((began, time.monotonic()))


async def add_dead_bodies(store: QueueStore, bodies: int) -> None:
    """``bodies`` big messages in table files (as on a disk filled over time), deleted."""
    dead = [await big_message(store) for _ in range(bodies)]
    await store.compact()
    for msg_id in dead:
        assert await store.drop(msg_id, T0) == 2
    await store.drain()


async def store_with_dead_bodies(path: Path, bodies: int) -> QueueStore:
    """``LIVE`` small messages queued, and ``bodies`` big ones deleted."""
    store = QueueStore(WatchedDatabase(path))
    store.recover()
    for index in range(LIVE):
        await queue_message(store, [(f"live{index}@dest.test", Z)])
    await add_dead_bodies(store, bodies)
    return store


async def ticker(ticks: list[float]) -> None:
    while True:
        ticks.append(time.monotonic())
        await asyncio.sleep(TICK_S)


@async_test
async def test_the_loop_keeps_ticking_while_the_round_compacts(tmp_path: Path) -> None:
    """A timer on the loop runs while LevelDB compacts (on the loop it ran 0 times)."""
    store = await store_with_dead_bodies(tmp_path / "queue", bodies=2)
    db = store.database
    assert isinstance(db, WatchedDatabase)
    db.spans.clear()
    ticks: list[float] = []
    timer = asyncio.create_task(ticker(ticks))
    try:
        await asyncio.sleep(0.01)
        await runtime.maintain(store, loads_config("[zones.default]\n[zones.bounces]\n"))
    finally:
        timer.cancel()
        await store.close()
    assert store._dead_bodies == set()  # the round compacted both bodies
    inside = sum(1 for tick in ticks for began, ended in db.spans if began < tick < ended)
    compacting = sum(ended - began for began, ended in db.spans)
    # A generous bound: a 1 ms timer over tens of ms of compaction ticks far more often.
    assert inside >= 3, (inside, round(compacting * 1000), len(db.spans))


_CHILD = (
    "import asyncio, sys; from pathlib import Path; "
    "from tests.storage.test_compaction_thread import race; "
    "asyncio.run(race(Path(sys.argv[1]))); print('ok')"
)


def test_a_reopen_and_a_close_during_a_compaction_neither_crash_nor_lose_data(
    tmp_path: Path,
) -> None:
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "queue")],
        cwd=REPO,
        check=False,  # the return code is the assertion below
        capture_output=True,
        text=True,
        timeout=300,
    )
    # -11 (SIGSEGV) was plyvel deleting the handle under the thread's CompactRange.
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    assert child.stdout.strip() == "ok", child.stdout


async def wait_for(event: threading.Event, task: asyncio.Task[None]) -> None:
    for _ in range(MAX_POLLS):
        if event.is_set() or task.done():
            return
        await asyncio.sleep(TICK_S)
    raise AssertionError("the compaction thread never started")


async def race(path: Path) -> None:
    """In the child: reopen over and over through a round (refused while a range
    compacts, done between ranges), then close while a body compacts; a fresh store must
    then hold every live message, and its first round compact what the close cut off."""
    store = await store_with_dead_bodies(path, bodies=2)
    db = store.database
    assert isinstance(db, WatchedDatabase)
    round_ = asyncio.create_task(store.compact())
    await wait_for(db.compacting_body, round_)
    refused = 0
    for _ in range(MAX_POLLS):
        if round_.done():
            break
        try:
            store.reopen()  # what a failed write's next operation does (``_check``)
        except StorageUnavailable as exc:
            assert "compaction is running" in str(exc), exc
            refused += 1
        await asyncio.sleep(TICK_S)
    await round_
    assert refused, "no reopen was tried while a compaction ran"
    assert store._dead_bodies == set()
    assert store.count(Z, State.READY) == LIVE

    await add_dead_bodies(store, 1)
    before = disk_use(path)
    round_ = asyncio.create_task(store.compact())
    await wait_for(db.compacting_body, round_)
    await store.close()  # waits for the range in flight, then closes
    try:
        await round_
    except StorageUnavailable as exc:  # its next range, or its record, found it closed
        assert "not open" in str(exc), exc

    store = QueueStore.open(path)
    store.recover()
    assert store.count(Z, State.READY) == LIVE
    await assert_consistent(store)
    await store.compact()
    assert store._dead_bodies == set()
    assert disk_use(path) < before - (BODY_MIB - 1) * MIB, (before // MIB, disk_use(path) // MIB)
    await store.close()
