"""Delivery outcomes held in memory while the queue database cannot write (issue 7).

Theory of operation
-------------------
A failed fdatasync leaves LevelDB refusing every write until it is reopened, and reopening
needs a sync of its own (a new log and manifest), so a disk that cannot sync keeps the store
failed for as long as the fault lasts.  New mail is refused with 4xx meanwhile (nothing can
be made durable before a ``250``).  What is already queued should still go out, as it does
from Postfix's queue: the failed handle still reads, so recipients are still leased and
their bodies read; only the outcome of each delivery cannot be written.

So an outcome reported while the store is failed is *held*: the report is accepted, the
recipient stays leased (no scan hands it out again), and the transition is kept here as the
call that makes it.  Once the database reopens, every lease that was out is kept (the
deliveries in flight report afterwards) and the held calls are made again, in order, through
the normal paths.  An outcome whose batch failed its sync may still be in LevelDB's log
(LevelDB appends, then syncs) and come back with the reopen; its record is then already
gone from the ready family, and the held call is skipped rather than applied twice.

What this costs: a core that stops before the store heals loses the held outcomes, and
those recipients go out again after the restart.  A graceful stop logs each of them as a
possible duplicate (RFC 1047's window, widened by the fault); a crash cannot.  Postfix makes
the same trade: it removes a delivered queue file without a sync.  Leasing while failed is
bounded by ``MAX_LEASED_WHILE_FAILED`` and ``MAX_HELD_BYTES``, which bound what is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Final

from zoneq.errors import LeaseError, NotFound, StorageCorruption, StorageUnavailable
from zoneq.storage import retrymarks
from zoneq.storage.base import Lease, QueuedRecipient, StoreBase, ready_prefix, run_all
from zoneq.storage.leveldb import Op
from zoneq.storage.records import Notice, State

log = logging.getLogger("zoneq.storage")


@dataclass(frozen=True, slots=True)
class Held:
    """An outcome not written yet: the lease it ends, the call that writes it, and the
    octets of the notice (a DSN) that call carries, which count towards the bound."""

    lease: Lease
    replay: Callable[[], Awaitable[None]]
    size: int = 0
    # A delivery reported after a delete revoked its lease (``delivered_after_drop``): only
    # its event is owed, so its lease is neither checked nor put back while it is held.
    revoked: bool = False


def notice_size(notice: Notice | None) -> int:
    return 0 if notice is None else len(notice.body)


class HeldMixin(StoreBase):
    """Hold outcomes while the database is failed; make them again once it reopens."""

    # Leases out at once while the store is failed (in flight plus held), and the octets
    # of the notices held.  A held delivery is about 1.3 KB (measured with tracemalloc);
    # a held bounce also carries its DSN, up to a few hundred KB with the original.
    MAX_LEASED_WHILE_FAILED: Final = 50_000
    MAX_HELD_BYTES: Final = 64 << 20
    # Held calls written per step after a reopen: the loop serves sessions in between
    # (50,000 in one step stalled it for 2.9 s).
    REPLAY_STEP: Final = 256

    def _hold_if_failed(self, held: Held) -> bool:
        """True if the store is failed and could not reopen just now: ``held`` is held.

        A stale lease is still refused (``LeaseError``), as it would be when healthy.
        """
        if self._writer.failed is None:
            return False
        try:
            self._check()  # at most one reopen a second
            return False
        except StorageUnavailable as exc:
            if not held.revoked:
                self._current(held.lease)
            self._hold(held, exc)
            return True

    def _hold(self, held: Held, exc: StorageUnavailable) -> None:
        if not self._held:
            log.warning(
                "queue storage failed (%s): delivery goes on, and outcomes are held in "
                "memory until the storage heals",
                exc,
            )
        if not held.revoked:
            self._leases[held.lease.key] = held.lease  # out of circulation until it is applied
        self._held.append(held)
        self._held_bytes += held.size

    def _hold_settling(self, exc: StorageUnavailable) -> None:
        # Called by the writer's failure, synchronously: every outcome whose batch failed
        # (landed ones left ``_settling`` when they landed, ``_landed_outcome``).
        settling, self._settling = self._settling, {}
        for held in settling.values():
            self._hold(held, exc)

    def _landed_outcome(self, key: bytes) -> None:
        self._settling.pop(key, None)

    async def _write_outcome(
        self,
        held: Held,
        ops: list[Op],
        *,
        sync: bool,
        effect: Callable[[], None] | None = None,
    ) -> None:
        """Take ``held``'s lease and stage ``ops``; if their batch fails, the outcome is held.

        The bookkeeping is the writer's, not this task's: the entry leaves ``_settling``
        when the batch lands (an effect), or is held when it fails (``_on_failure``),
        whether or not this task is still there to see it (a report cancelled with its
        worker's connection still has its outcome written or held).
        """
        self._take(held.lease)
        # If its batch fails, it was held when the failure was noticed (``_hold_settling``):
        # the report is taken, and written after the reopen (or found already applied, if
        # the batch reached the log).
        with contextlib.suppress(StorageUnavailable):
            await self._settle(held, ops, sync=sync, effect=effect)

    def _settle(
        self,
        held: Held,
        ops: list[Op],
        *,
        sync: bool,
        effect: Callable[[], None] | None = None,
    ) -> asyncio.Future[None]:
        """Stage ``ops``, the writes of ``held``'s outcome (its lease taken, or revoked by a
        delete), to leave ``_settling`` when they land or be held if they fail.  A plain
        function, not a coroutine: it is on every outcome's path."""
        self._settling[held.lease.key] = held
        landed = functools.partial(self._landed_outcome, held.lease.key)
        return self._writer.submit(
            ops, sync=sync, effect=landed if effect is None else run_all((effect, landed))
        )

    def _may_lease_while_failed(self, limit: int) -> int:
        """How many recipients may still be leased while the store is failed (raises if
        none may): the failed handle reads, within the bounds."""
        try:
            self._check()
            return limit
        except StorageUnavailable:
            room = self.MAX_LEASED_WHILE_FAILED - len(self._leases)
            if not self._db.is_open or room <= 0 or self._held_bytes >= self.MAX_HELD_BYTES:
                raise
            return min(limit, room)

    @property
    def held(self) -> int:
        """Outcomes reported while the store was failed, not yet written."""
        return len(self._held)

    def _resume(self, leases: dict[bytes, Lease]) -> None:
        """After a reopen: keep the leases that were out, and make the held calls again."""
        for key, lease in leases.items():
            # A record that is gone was taken by an outcome (or a delete) whose batch failed
            # its sync after LevelDB appended it to the log: the reopen applied it already.
            # (Its marks go with it: ``_settle_stray_marks``.)
            if self._db.get(key) is not None:
                self._leases[key] = lease
        # What the reopen brought back from the log is ready with no event of its own:
        # every zone is worth a full look (the service's refill forgets what it read).
        for zone in sorted(self._counters.zones()):
            self._cursor_back(zone, ready_prefix(zone))
        held, self._held = self._held, []
        self._held_bytes = 0
        if held:
            log.warning("queue storage healed: writing %d held outcome(s)", len(held))
            self._in_background(self._replay_all(held))
        self._settle_stray_marks()

    def _in_background(self, work: Coroutine[None, None, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._replays.add(task)  # drained (``drain``), and awaited at a stop
        task.add_done_callback(self._replays.discard)

    def _settle_stray_marks(self) -> None:
        """After a reopen: act on the marks whose lease is no longer out, which a delete
        that failed left (``StoreBase._remove_key`` keeps a revoked lease's marks until the
        delete lands).  Either the delete landed all the same (its batch reached LevelDB's
        log before the sync failed) and the record is gone, its marks with it; or its
        worker ended the lease undelivered meanwhile (``StoreBase._ended``): the report was
        refused and the record left ready, and no attempt's end will come to act on the
        mark.  A hold is due now, as at start-up (``recover``); a retry has nothing left
        to do, its recipient being ready already."""
        for key in [key for key in self._retry_marks if key not in self._leases]:
            retrymarks.forget(self._retry_marks, key)
        stray = [key for key in self._hold_marks if key not in self._leases]
        if stray:
            self._in_background(self._hold_stray(stray))

    async def _hold_stray(self, stray: list[bytes]) -> None:
        """Hold the ready records at ``stray``, each with its mark's reason."""
        by_reason: dict[str, list[bytes]] = {}
        for key in stray:
            by_reason.setdefault(self._hold_marks[key], []).append(key)
        # Their marks go in the same batch (``_remove_key``); if it fails, the marks on disk
        # stay, and the next start holds them (``recover``).
        with contextlib.suppress(StorageUnavailable):
            for reason, marked in by_reason.items():
                held, _ = await self._hold_or_mark(self._still_marked(marked, reason), reason)
                log.info("held %d recipient(s) whose hold waited for a failed delete", held)

    def _still_marked(self, marked: list[bytes], reason: str) -> list[QueuedRecipient]:
        """The ready records at ``marked`` still marked with ``reason``, read as the latest
        staged state shows and held with no ``await`` in between (``_hold_or_mark``: one
        leased meanwhile is marked again).  A mark whose record is gone is forgotten."""
        chosen: list[QueuedRecipient] = []
        for key in marked:
            if self._hold_marks.get(key) != reason:
                continue  # released meanwhile, or held again for another reason
            value = self._writer.read(key)
            record = None if value is None else self._decode_record(key, value)
            if record is None:
                del self._hold_marks[key]  # (its mark on disk: ``recover`` removes it)
            else:
                chosen.append(QueuedRecipient(State.READY, record))
        return chosen

    async def _replay_all(self, held: list[Held]) -> None:
        # Each call stages its writes before its first await, in order: a message's later
        # recipients read the head its earlier ones left (as they would have live).  In
        # steps, each staged after the one before has landed, so the order holds.
        for start in range(0, len(held), self.REPLAY_STEP):
            step = held[start : start + self.REPLAY_STEP]
            await asyncio.gather(*(self._replay(item) for item in step))

    async def _replay(self, item: Held) -> None:
        try:
            await item.replay()
        except LeaseError:
            # Its lease did not outlive the reopen (``_resume``): its batch reached the log
            # before the failed sync and came back with the reopen, or an administrator
            # dropped the message since.  Either way there is nothing left to write.
            pass
        except (NotFound, StorageCorruption) as exc:
            # The message is gone or damaged: the lease goes, and the recipient meets the
            # usual handling (quarantine, a parked message) if it is still there.
            log.warning("held outcome of %s not written: %s", item.lease.recipient.address, exc)
            current = self._leases.get(item.lease.key)
            if current is item.lease:
                del self._leases[item.lease.key]
                self._cursor_back(item.lease.recipient.zone, item.lease.key)

    async def _give_up_held(self) -> None:
        """At a stop: one last try to write what is held, else log each as a duplicate."""
        if self._held and self._writer.failed is not None:
            self._next_reopen = 0.0  # now, not at the next second
            await self._writer.drain()
            with contextlib.suppress(StorageUnavailable):
                self._check()
        if self._replays:
            await asyncio.gather(*self._replays, return_exceptions=True)
        for item in self._held:
            if item.revoked:
                log.warning(
                    "%016x to %s was delivered after its delete, but its DELIVERED event was "
                    "held while the queue storage was failed, and is lost at this stop",
                    item.lease.recipient.msg_id,
                    item.lease.recipient.address,
                )
                continue
            log.warning(
                "possible duplicate: %016x to %s via ? (its outcome was held while the queue "
                "storage was failed, and is lost at this stop); sent again after the restart",
                item.lease.recipient.msg_id,
                item.lease.recipient.address,
            )
        self._held.clear()
        self._held_bytes = 0

    async def drain(self) -> None:
        """Wait until the held outcomes being written and everything staged have landed."""
        while self._replays:
            await asyncio.gather(*self._replays, return_exceptions=True)
        await super().drain()

    async def close(self) -> None:
        await self._give_up_held()
        await super().close()
