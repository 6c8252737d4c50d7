"""Group commit: many transitions, one LevelDB batch, one fsync.

Theory of operation
-------------------
A synced LevelDB write costs one fsync (measured here at ~6,800/s), so syncing each message
before its ``250`` would cap acceptance there.  Instead every transition is *staged*: its
writes are appended to the open group and the caller gets a future.  One writer thread takes
the open group as a whole, writes it as a single ``WriteBatch`` (synced if any member asked
for it) and resolves every member's future together.  While it is writing, the event loop
keeps staging into the next group, so the fsync rate stops mattering under load (Postfix and
databases call this group commit; LevelDB's own writer queue does the same across threads).

Staged writes are not in the database yet, but the transitions that follow must see them (a
message's last recipient must know the previous one is gone).  So every staged write is also
kept in an in-memory *overlay* until its group lands; :meth:`read` looks there first.  Range
scans read the database and consult :meth:`pending` for each key they meet: a staged delete
hides a record at once, while a staged insert becomes visible to the lease scan only once
durable, which is what a queue wants (nothing is leased before it is safe on disk).
Administrators' scans go through :meth:`scan`, which shows staged inserts too: removing or
holding a message must see every recipient it has, landed or not.  A commit's
writes are kept out of the overlay altogether: they are all new keys, and nobody has the
message's id before the commit returns, so nothing needs to read them early.

*Effects* are callbacks run on the event loop after their group is durable, in group order
(for example: move a zone's low-water mark back to a newly ready record).

Which thread writes: a synced group waits for an fsync (milliseconds), so it goes to the
writer thread and the event loop carries on.  An unsynced group is a memtable insert and a
log append: measured here at ~6 us of CPU for a delivery's few keys, against ~40 us for the
hop to the thread and back (a queue, two thread wake-ups, the GIL handed over twice).
Unsynced reports are most of the core's writes under delivery load, so a small unsynced
group (``INLINE_MAX_OPS`` keys, ``INLINE_MAX_BYTES`` of values) is written on the event
loop thread by the flusher itself.  Groups still land one at a time and in order
whichever thread writes them, so what a crash can leave behind is unchanged: a prefix of the
groups, every synced one up to the last fsync included.  Large unsynced groups (body chunks
of many sessions) keep the thread, as does a handle whose ``write`` may block
(``Database.inline_safe``).

If a write fails, LevelDB refuses all further writes until reopened, and nothing staged on
top of the failed group can land either: every pending future fails with
``StorageUnavailable``, the overlay is dropped, and ``on_failure`` tells the owner to reopen
and reload its in-memory state from what is really on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Final

from zoneq.errors import StorageUnavailable
from zoneq.storage import keys
from zoneq.storage.leveldb import Database, Op

log = logging.getLogger("zoneq.storage")

_MISSING = object()

# An unsynced group up to this size is written on the event loop (see above): a few
# deliveries' reports are ~10 keys and ~2 KB each; a 64 KiB body chunk is not "small".
INLINE_MAX_OPS: Final = 512
INLINE_MAX_BYTES: Final = 128 * 1024


class _Group:
    __slots__ = ("effects", "ops", "seq", "size", "staged", "sync", "waiters")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.ops: list[Op] = []
        self.size = 0  # bytes of values, counted while the group is unsynced
        self.staged: list[bytes] = []  # the keys this group put in the overlay
        self.sync = False
        self.effects: list[Callable[[], None]] = []
        self.waiters: list[asyncio.Future[None]] = []


_Job = tuple[_Group, asyncio.AbstractEventLoop, "asyncio.Future[None]"]
"""A group for the writer thread, the loop to answer on, and the future to answer."""


class _Lander:
    """The writer thread: writes the groups it is given one at a time, in order, and
    resolves each one's future on the event loop that handed it over.

    Not a ``ThreadPoolExecutor`` with ``run_in_executor``: every synced group (about one
    per two accepted messages under load) paid for the executor's work item, its lock and
    idle semaphore, a ``concurrent.futures.Future`` with its condition, and the two
    callbacks ``wrap_future`` chains between that future and the loop's, all on the event
    loop thread, which is the one that bounds the accept rate; here it is one queue put,
    and on the way back one ``call_soon_threadsafe``.  The thread is a daemon: a process
    that exits without ``close`` is not held up by it, and a write it cuts short is the
    crash LevelDB recovers from (nobody was told that group was durable).
    """

    def __init__(self, write: Callable[[_Group], None]) -> None:
        self._write = write
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def land(self, group: _Group, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """Write ``group`` on the thread; the future resolves (or fails) once it has."""
        if self._thread is None:  # the thread never dies of a write: _run catches all
            self._thread = threading.Thread(target=self._run, name="zoneq-writer", daemon=True)
            self._thread.start()
        future: asyncio.Future[None] = loop.create_future()
        self._jobs.put((group, loop, future))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            group, loop, future = job
            error: Exception | None = None
            try:
                self._write(group)
            except Exception as exc:  # handed to the awaiting flusher, which fails the group
                error = exc
            except BaseException as exc:
                # Not an Exception (SystemExit, KeyboardInterrupt, ...): raised into the event
                # loop it would stop it, and a dead thread would leave this group's future,
                # and so every later commit, waiting for ever.  A failed write it is.
                error = StorageUnavailable(f"the write was interrupted: {exc!r}")
            # RuntimeError: that loop is closed, so nothing waits for this group any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, future, error)

    def close(self) -> None:
        """Stop the thread once what it was given is written."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()


def _settle(future: asyncio.Future[None], error: Exception | None) -> None:
    if future.done():  # the flusher was cancelled while the thread wrote
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class GroupWriter:
    """Stages writes from the event loop and lands them in grouped batches."""

    def __init__(
        self,
        db: Database,
        *,
        seal: Callable[[], list[Op]] | None = None,
        on_failure: Callable[[StorageUnavailable], None] | None = None,
    ) -> None:
        self._db = db
        self._seal = seal
        self._on_failure = on_failure
        self._overlay: dict[bytes, tuple[bytes | None, int]] = {}
        self._open = _Group(1)
        self._writing = False
        self._flusher: asyncio.Task[None] | None = None
        self._failed: StorageUnavailable | None = None
        self._lander = _Lander(self._write)
        self._inline = db.inline_safe
        self._idle_waiters: list[asyncio.Future[None]] = []
        self.groups_written = 0
        self.ops_written = 0
        self.groups_inline = 0  # of groups_written, those written on the event loop

    # --- reads ----------------------------------------------------------------------------

    def read(self, key: bytes) -> bytes | None:
        """The latest value of ``key``, staged or durable."""
        entry = self._overlay.get(key)
        if entry is not None:
            return entry[0]
        return self._db.get(key)

    def pending(self, key: bytes) -> object:
        """The staged value of ``key`` (``None`` = staged delete), or ``MISSING``."""
        entry = self._overlay.get(key)
        return _MISSING if entry is None else entry[0]

    MISSING = _MISSING

    def scan(self, prefix: bytes, *, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """The keys under ``prefix`` (from ``start`` on) as the latest staged state shows them.

        Staged deletes hide keys, staged values replace durable ones, and staged inserts
        appear in their place in key order although not on disk yet.  For administrators'
        scans: a drop or a hold must see a recipient whose move (deferred to ready, ready
        to held...) is still on its way, or it would miss the record that then lands with
        no message behind it.  The lease scan does not come here: it hands out only what
        is durable.  The overlay is walked whole (the groups in flight, a few thousand
        keys at most), once per call, never on the delivery path.
        """
        stop = keys.prefix_upper_bound(prefix)
        low = prefix if start is None else max(prefix, start)
        staged = self._staged(low, stop)
        durable = self._db.items(start=low, stop=stop)
        merged = heapq.merge(staged, durable, key=lambda item: item[0])
        # ``sorted`` and ``heapq.merge`` keep a staged entry before the durable one of the
        # same key (staged comes first, and the merge is stable): it wins, the other goes.
        last: bytes | None = None
        for key, value in merged:
            if key == last:
                continue
            last = key
            if value is not None:
                yield key, value

    def staged_inserts(self, prefix: bytes) -> list[bytes]:
        """The keys under ``prefix`` staged with a value (not on disk yet), in key order:
        for an administrator's delete, which must delete them too (same cost as ``scan``)."""
        staged = self._staged(prefix, keys.prefix_upper_bound(prefix))
        return [key for key, value in staged if value is not None]

    def _staged(self, low: bytes, stop: bytes | None) -> list[tuple[bytes, bytes | None]]:
        """The overlay's entries in ``[low, stop)``, sorted by key (None: a staged delete)."""
        if not self._overlay:
            return []
        return sorted(
            (key, entry[0])
            for key, entry in self._overlay.items()
            if low <= key and (stop is None or key < stop)
        )

    # --- writes ---------------------------------------------------------------------------

    def submit(
        self,
        ops: Sequence[Op],
        *,
        sync: bool,
        effect: Callable[[], None] | None = None,
        visible: bool = True,
    ) -> asyncio.Future[None]:
        """Stage ``ops`` as one atomic transition; the future resolves once it is durable.

        ``visible=False`` leaves them out of the overlay: for writes of keys nothing may read
        before they are durable (a commit's new message), which saves the overlay's upkeep
        on the busiest path.
        """
        if self._failed is not None:
            raise self._failed
        loop = asyncio.get_running_loop()
        group = self._open
        if visible:
            seq = group.seq
            overlay = self._overlay
            staged = group.staged
            for key, value in ops:
                overlay[key] = (value, seq)
                staged.append(key)
        group.ops.extend(ops)
        if sync:
            group.sync = True
        elif not group.sync and group.size <= INLINE_MAX_BYTES:
            # Only while the group could still go inline; a synced one goes to the thread.
            group.size += sum(len(value) for _, value in ops if value is not None)
        if effect is not None:
            group.effects.append(effect)
        future: asyncio.Future[None] = loop.create_future()
        group.waiters.append(future)
        if not self._writing:
            self._writing = True
            self._flusher = loop.create_task(self._flush())
        return future

    async def _flush(self) -> None:
        try:
            while self._open.waiters:
                group = self._open
                self._open = _Group(group.seq + 1)
                if self._seal is not None:
                    group.ops.extend(self._seal())
                try:
                    await self._land(group)
                except StorageUnavailable as exc:
                    self._fail(group, exc)
                    return
                except Exception as exc:  # the binding's own errors, or a bug: still a 4xx
                    self._fail(group, StorageUnavailable(f"write failed: {exc!r}"))
                    return
                self._landed(group)
        finally:
            self._writing = False
            if not self._open.waiters:
                waiters, self._idle_waiters = self._idle_waiters, []
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)

    async def _land(self, group: _Group) -> None:
        """Write ``group``: here if it is small and unsynced, else on the writer thread."""
        if self._inline and self._small(group):
            self._write(group)
            self.groups_inline += 1
        else:
            await self._lander.land(group, asyncio.get_running_loop())

    def _landed(self, group: _Group) -> None:
        """``group`` is in the database: run its effects, unstage its keys, wake its waiters."""
        self.groups_written += 1
        self.ops_written += len(group.ops)
        for effect in group.effects:
            try:
                effect()
            except Exception:
                # The group is durable: its waiters are told so whatever an effect does (an
                # unanswered commit would be a client's time-out, then a duplicate).
                log.exception("an effect of a landed write group failed")
        overlay = self._overlay
        seq = group.seq
        for key in group.staged:
            entry = overlay.get(key)
            if entry is not None and entry[1] == seq:
                del overlay[key]
        for waiter in group.waiters:
            if not waiter.done():
                waiter.set_result(None)

    @staticmethod
    def _small(group: _Group) -> bool:
        return (
            not group.sync and len(group.ops) <= INLINE_MAX_OPS and group.size <= INLINE_MAX_BYTES
        )

    def _write(self, group: _Group) -> None:
        self._db.write(group.ops, sync=group.sync)

    def _fail(self, group: _Group, exc: StorageUnavailable) -> None:
        pending = [group, self._open]
        self._open = _Group(self._open.seq + 1)
        self._overlay.clear()
        self._failed = exc
        for failed in pending:
            for waiter in failed.waiters:
                if not waiter.done():
                    waiter.set_exception(exc)
        if self._on_failure is not None:
            self._on_failure(exc)

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def failed(self) -> StorageUnavailable | None:
        return self._failed

    def reset(self) -> None:
        """Accept writes again (after the owner has reopened the database)."""
        self._failed = None
        self._overlay.clear()

    @property
    def busy(self) -> bool:
        return self._writing or bool(self._open.waiters)

    async def drain(self) -> None:
        """Wait until everything staged so far has landed (or failed)."""
        while self.busy:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(waiter)
            await waiter

    def close(self) -> None:
        self._lander.close()
