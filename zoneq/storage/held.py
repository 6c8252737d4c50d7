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
bounded by ``MAX_LEASED_WHILE_FAILED``, which bounds what is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from zoneq.errors import LeaseError, NotFound, StorageUnavailable
from zoneq.storage.base import Lease, StoreBase

log = logging.getLogger("zoneq.storage")


@dataclass(frozen=True, slots=True)
class Held:
    """An outcome that could not be written: the lease it ends, and the call to make again."""

    lease: Lease
    replay: Callable[[], Awaitable[None]]


class HeldMixin(StoreBase):
    """Hold outcomes while the database is failed; make them again once it reopens."""

    # Leases out at once while the store is failed (in flight plus held).  A held outcome is
    # a few hundred bytes; this keeps a long fault's backlog to tens of megabytes.
    MAX_LEASED_WHILE_FAILED: Final = 50_000

    def _hold_if_failed(self, lease: Lease, replay: Callable[[], Awaitable[None]]) -> bool:
        """True if the store is failed and could not reopen just now: the outcome is held.

        A stale lease is still refused (``LeaseError``), as it would be when healthy.
        """
        if self._writer.failed is None:
            return False
        try:
            self._check()  # at most one reopen a second
            return False
        except StorageUnavailable as exc:
            self._current(lease)
            self._hold(Held(lease, replay), exc)
            return True

    def _hold(self, held: Held, exc: StorageUnavailable) -> None:
        if not self._held:
            log.warning(
                "queue storage failed (%s): delivery goes on, and outcomes are held in "
                "memory until the storage heals",
                exc,
            )
        self._leases[held.lease.key] = held.lease  # out of circulation until it is applied
        self._held.append(held)

    def _settled(self, lease: Lease) -> None:
        """``lease``'s outcome is written (or held): it is no longer on its way."""
        self._settling.pop(lease.key, None)

    async def _settle(
        self,
        lease: Lease,
        landing: Awaitable[None],
        replay: Callable[[], Awaitable[None]],
    ) -> None:
        """Wait for an outcome's batch; if the store failed under it, hold the outcome."""
        try:
            await landing
        except StorageUnavailable as exc:
            # The lease went back to ``_leases`` when the failure was noticed (``_on_failure``,
            # before any other task could lease the record again); keep it there, held.
            self._hold(Held(lease, replay), exc)
        else:
            # Landed; but a later group's failure, noticed before this task resumed, may
            # have put the lease back (``_on_failure``): it is over all the same.
            if self._leases.get(lease.key) is lease:
                del self._leases[lease.key]
        finally:
            self._settled(lease)

    def _may_lease_while_failed(self) -> None:
        """Raise unless recipients may still be leased while the store is failed."""
        try:
            self._check()
        except StorageUnavailable:
            if not self._db.is_open or len(self._leases) >= self.MAX_LEASED_WHILE_FAILED:
                raise

    @property
    def held(self) -> int:
        """Outcomes reported while the store was failed, not yet written."""
        return len(self._held)

    def _resume(self, leases: dict[bytes, Lease]) -> None:
        """After a reopen: keep the leases that were out, and make the held calls again."""
        for key, lease in leases.items():
            # A record that is gone was taken by an outcome whose batch failed its sync
            # after LevelDB appended it to the log: the reopen applied it already.
            if self._db.get(key) is not None:
                self._leases[key] = lease
        held, self._held = self._held, []
        if held:
            log.warning("queue storage healed: writing %d held outcome(s)", len(held))
            task = asyncio.get_running_loop().create_task(self._replay_all(held))
            self._replays.add(task)
            task.add_done_callback(self._replays.discard)

    async def _replay_all(self, held: list[Held]) -> None:
        # Each call stages its writes before its first await, in order: a message's later
        # recipients read the head its earlier ones left (as they would have live).
        await asyncio.gather(*(self._replay(item) for item in held))

    async def _replay(self, item: Held) -> None:
        try:
            await item.replay()
        except LeaseError:
            # Its lease did not outlive the reopen (``_resume``): its batch reached the log
            # before the failed sync and came back with the reopen, or an administrator
            # dropped the message since.  Either way there is nothing left to write.
            pass
        except NotFound as exc:
            log.warning("held outcome of %s not written: %s", item.lease.recipient.address, exc)

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
            log.warning(
                "possible duplicate: %016x to %s via ? (its outcome was held while the queue "
                "storage was failed, and is lost at this stop); sent again after the restart",
                item.lease.recipient.msg_id,
                item.lease.recipient.address,
            )
        self._held.clear()

    async def drain(self) -> None:
        """Wait until the held outcomes being written and everything staged have landed."""
        while self._replays:
            await asyncio.gather(*self._replays, return_exceptions=True)
        await super().drain()

    async def close(self) -> None:
        await self._give_up_held()
        await super().close()
