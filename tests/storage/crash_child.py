"""The child program of the crash-consistency test (``tests/storage/test_crash.py``).

It opens a :class:`QueueStore` on a directory, recovers it, and runs a seeded workload on
asyncio: several concurrent receiving sessions (``begin``, 1 to 4 ``write_chunk`` calls,
then ``commit`` with 1 to 3 recipients in 1 or 2 zones, or ``abandon`` midway), an
administrator who holds and releases some messages, and a delivery loop that leases
recipients and completes, defers or releases them while ``promote_due`` brings the deferred
ones back.

What the child did is appended to a ledger (JSON lines, each one written with a single
``os.write`` and fsynced), so the parent can tell what must be on disk after a crash:

* ``P`` before ``commit`` is called: id, body length, chunk count, recipients.  The body is
  ``body_for(id, length)``, so the parent can check it byte for byte;
* ``C`` after ``commit`` returned: the message is committed and must survive whole;
* ``A`` before ``abandon``: the message must leave no trace;
* ``X`` before ``complete`` and ``D`` after it returned: the recipient may be gone;
* ``ready`` once the store is recovered and ``end`` once the workload is done.

``--kill-after N`` wraps ``Database.write`` (here, in the child only) so that the process
sends itself SIGKILL right after the N-th successful write: the database then holds exactly
the first N batches, and the ledger says which calls had returned.  With ``--crash-at-end``
the child kills itself after the workload instead of closing the store; with neither it
closes the store cleanly (the counting run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from zoneq.errors import NotFound
from zoneq.protocol.ids import format_id
from zoneq.storage.leveldb import Database, Op
from zoneq.storage.records import MessageMeta
from zoneq.storage.store import Outcome, QueueStore, new_recipients

CHUNK_SIZE = 1024
# A zone name with a space: the case ZoneMTA's space-joined keys got wrong.
ZONES = ("default", "pool b")
WORKER = "crash-worker"
# A promote_due "now" far enough ahead that every deferred recipient is due at once.
PROMOTE_AHEAD_MS = 3_600_000
# Upper bounds on the delivery loop, so the child always ends.
MAX_WORKER_ROUNDS = 5_000
TAIL_ROUNDS = 8


def body_for(msg_id: int, length: int) -> bytes:
    """The body of message ``msg_id``: derived from the id, so it can be checked exactly."""
    return random.Random(msg_id).randbytes(length)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Ledger:
    """Append-only JSON lines, each fsynced before the call returns."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(self, kind: str, **fields: Any) -> None:
        data = memoryview(
            (json.dumps({"t": kind, **fields}, separators=(",", ":")) + "\n").encode()
        )
        # os.write may write less than asked (seen under load in CI: a line cut short and
        # the next glued to it); the rest must follow, or the ledger is unreadable.
        while data:
            data = data[os.write(self._fd, data) :]
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def install_kill_hook(kill_after: int) -> Callable[[], int]:
    """Count successful ``Database.write`` calls; SIGKILL ourselves after the N-th one."""
    original = Database.write
    lock = threading.Lock()
    count = 0

    def write(self: Database, ops: Sequence[Op], *, sync: bool) -> None:
        nonlocal count
        original(self, ops, sync=sync)
        with lock:
            count += 1
            reached = count
        if kill_after and reached >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    Database.write = write  # type: ignore[method-assign]

    def written() -> int:
        with lock:
            return count

    return written


class Workload:
    def __init__(self, store: QueueStore, ledger: Ledger, seed: int, sessions: int, messages: int):
        self.store = store
        self.ledger = ledger
        self.seed = seed
        self.sessions = sessions
        self.messages = messages
        self.sessions_done = asyncio.Event()

    async def run(self) -> None:
        worker = asyncio.create_task(self.deliver(random.Random(self.seed * 1000 + 999)))
        await asyncio.gather(
            *(self.session(random.Random(self.seed * 1000 + n)) for n in range(self.sessions))
        )
        self.sessions_done.set()
        await worker
        await self.store.drain()

    async def session(self, rng: random.Random) -> None:
        store = self.store
        unhold_later: int | None = None
        for _ in range(self.messages):
            msg_id = store.begin(now_ms())
            hex_id = format_id(msg_id)
            chunks = rng.randint(1, 4)
            length = (chunks - 1) * CHUNK_SIZE + rng.randint(1, CHUNK_SIZE)
            body = body_for(msg_id, length)
            pieces = [body[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE] for i in range(chunks)]
            # Half the messages hand their last chunk to commit() (one batch fewer).
            tail = pieces.pop() if rng.random() < 0.5 else None
            abandon_after = None
            if pieces and rng.random() < 0.2:
                abandon_after = rng.randint(1, len(pieces))
            abandoned = False
            for index, piece in enumerate(pieces):
                await store.write_chunk(msg_id, index, piece)
                if index + 1 == abandon_after:
                    self.ledger.log("A", id=hex_id)
                    await store.abandon(msg_id)
                    abandoned = True
                    break
            if abandoned:
                continue
            zones = rng.sample(ZONES, rng.randint(1, 2))
            rcpts = [
                (f"rcpt{n}@d{rng.randint(0, 2)}.example", zones[n % len(zones)])
                for n in range(rng.randint(1, 3))
            ]
            meta = MessageMeta(
                msg_id=msg_id,
                sender="sender@origin.example",
                size=length,
                chunks=chunks,
                received_ms=now_ms(),
                headers={"Subject": f"crash test {hex_id}"},
                source={"proto": "smtp", "client": "192.0.2.1"},
            )
            self.ledger.log(
                "P", id=hex_id, len=length, chunks=chunks, rcpts=rcpts, tail=tail is not None
            )
            await store.commit(meta, new_recipients(rcpts), now_ms(), tail=tail)
            self.ledger.log("C", id=hex_id)
            if unhold_later is not None:
                await self._unhold(unhold_later)
                unhold_later = None
            if rng.random() < 0.15:
                await self._hold(msg_id)
                unhold_later = msg_id
            await asyncio.sleep(0)
        if unhold_later is not None:
            await self._unhold(unhold_later)

    async def _hold(self, msg_id: int) -> None:
        with contextlib.suppress(NotFound):  # every recipient delivered already
            await self.store.hold(msg_id, "crash test hold")

    async def _unhold(self, msg_id: int) -> None:
        with contextlib.suppress(NotFound):
            await self.store.unhold(msg_id)

    async def deliver(self, rng: random.Random) -> None:
        store = self.store
        tail = 0
        for _ in range(MAX_WORKER_ROUNDS):
            leased = 0
            for zone in ZONES:
                for lease in store.lease(zone, 3, WORKER):
                    leased += 1
                    record = lease.recipient
                    roll = rng.random()
                    if roll < 0.6:
                        hex_id = format_id(record.msg_id)
                        where = {"id": hex_id, "zone": zone, "rcpt": record.address}
                        self.ledger.log("X", **where)
                        await store.complete(lease, now_ms(), Outcome(reply="250 ok", code=250))
                        self.ledger.log("D", **where)
                    elif roll < 0.85:
                        now = now_ms()
                        outcome = Outcome(reply="451 try later", code=451)
                        await store.defer(lease, now, now + 60_000, outcome)
                    else:
                        store.release(lease)
                await store.promote_due(zone, now_ms() + PROMOTE_AHEAD_MS)
            if self.sessions_done.is_set():
                tail += 1
                if tail > TAIL_ROUNDS:
                    return
            await asyncio.sleep(0 if leased else 0.001)


async def amain(args: argparse.Namespace, written: Callable[[], int]) -> int:
    ledger = Ledger(args.ledger)
    ledger.log("start", pid=os.getpid(), kill_after=args.kill_after)
    store = QueueStore.open(args.directory, chunk_size=CHUNK_SIZE)
    swept = store.recover()
    ledger.log("ready", swept=swept, writes=written(), at=time.monotonic())
    await Workload(store, ledger, args.seed, args.sessions, args.messages).run()
    ledger.log("end", writes=written(), at=time.monotonic())
    if args.kill_after or args.crash_at_end:
        os.kill(os.getpid(), signal.SIGKILL)
    await store.close()
    ledger.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("ledger", type=Path)
    parser.add_argument("--kill-after", type=int, default=0, help="SIGKILL after write N")
    parser.add_argument("--crash-at-end", action="store_true", help="SIGKILL, do not close")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--messages", type=int, default=6, help="per session")
    args = parser.parse_args(argv)
    written = install_kill_hook(args.kill_after)
    return asyncio.run(amain(args, written))


if __name__ == "__main__":
    sys.exit(main())
