"""Administrators' operations on many recipients at once, and zones paused by them.

``admin.py`` drops, holds and releases one message at a time; a purge by filter or a hold of
a whole zone picks recipients from anywhere in a zone.  The caller (``zoneq.queue.admin``)
pages through a zone with :meth:`browse` and hands each page's chosen records here, so one
call is one bounded batch: a million-recipient purge is a thousand small batches with the
event loop free between them, not one batch that blocks it for seconds.

The records given must be fresh from a read made without an ``await`` in between (each
method builds its whole batch before its first ``await``), so the state each one is in is
the state it is removed from, and the O(1) counters stay exact.

Paused zones are store-wide values in the ``meta`` family (``meta "paused-zone" <zone>``),
so a pause survives a restart; the queue service consults them before handing out work.

Holds that wait for an attempt (``holdmarks.py``): a hold of a zone marks the leased
recipients it passes over, as a hold of a message does, so they are held when they return;
a release of the zone drops them (``unmark_zone``), as a release of a message drops its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from zoneq.errors import NotFound, StorageCorruption
from zoneq.protocol.events import EventKind
from zoneq.storage import keys
from zoneq.storage.base import Outcome, QueuedRecipient, StoreBase
from zoneq.storage.holdmarks import unmark_zone
from zoneq.storage.leveldb import Op
from zoneq.storage.owed import owed_deletes
from zoneq.storage.records import MessageMeta, State

_PAUSED = keys.meta("paused-zone")


def _paused_key(zone: str) -> bytes:
    return _PAUSED + keys.text(zone)


class BulkMixin(StoreBase):
    async def drop_many(self, chosen: Sequence[QueuedRecipient], now_ms: int) -> int:
        """Remove these recipients (no DSN), each with a DROPPED event, and every message
        left without recipients; how many were removed.  A leased one is revoked, so the
        worker's report is refused (as :meth:`drop` does)."""
        self._check()
        # Heads first, before anything changes: a message whose head is missing or corrupt
        # still loses the records named, and goes itself once none is left (``_headless``).
        heads: dict[int, tuple[int, int] | None] = {}
        sizes: dict[int, Outcome] = {}  # each DROPPED event carries its message's size
        for queued in chosen:
            msg_id = queued.recipient.msg_id
            if msg_id not in heads:
                try:
                    heads[msg_id] = self._read_head(msg_id)
                except (NotFound, StorageCorruption):
                    heads[msg_id] = None
                sizes[msg_id] = Outcome(size=self._message_size(msg_id))
        ops: list[Op] = []
        gone: dict[int, int] = {}
        for queued in chosen:
            record = queued.recipient
            ops.extend(self._remove_record(queued))  # a hold on return goes too
            ops.append(self._outcome_event(EventKind.DROPPED, record, now_ms, sizes[record.msg_id]))
            gone[record.msg_id] = gone.get(record.msg_id, 0) + 1
        removed = {key for key, value in ops if value is None}
        for msg_id, count in gone.items():
            head = heads[msg_id]
            if head is None:
                removal = self._headless(msg_id, removed)  # its dead body noted there
            else:
                # A purge of big messages (a full disk's remedy) gets the space back: the
                # message's removal notes its dead body (``_note_dead_body``).
                removal = self._recipients_gone(msg_id, head, count)
            ops.extend(removal)
            if (keys.message_meta(msg_id), None) in removal:
                # Purged whole: silent, as ``postsuper -d`` is, for the failures it owed too.
                ops.extend(owed_deletes(self._writer, msg_id))
        if ops:
            await self._stage_removal(ops)
        return len(chosen)

    def _headless(self, msg_id: int, removed: set[bytes]) -> list[Op]:
        """Writes removing a message with a missing or corrupt head once ``removed`` takes
        its last record: no count says when that is, so its records are looked up.  Left
        behind, its metadata and chunks would stay for good (the sweep looks at receiving
        markers only, and no delivery ends such a message)."""
        if any(key not in removed for _, key, _ in self._raw_records(msg_id)):
            return []
        return self._message_removed(msg_id)

    def _message_size(self, msg_id: int) -> int:
        """The message's size in octets (as ``admin.drop`` records it); 0 when its metadata
        is missing or unreadable: the drop goes on, the event just cannot say."""
        key = keys.message_meta(msg_id)
        value = self._writer.read(key)
        if value is None:
            return 0
        try:
            return MessageMeta.decode(key, msg_id, value).size
        except StorageCorruption:
            return 0

    async def hold_many(self, chosen: Sequence[QueuedRecipient], reason: str) -> int:
        """Put these recipients on hold; how many were held.  Leased ones are marked, held
        when their attempt ends undelivered (``holdmarks.py``), as :meth:`hold` does."""
        self._check()
        held, _ = await self._hold_or_mark(chosen, reason)
        return held

    async def unmark_zone(self, zone: str) -> int:
        """Cancel the holds on return in a zone (its release): its recipients on the wire
        are no longer held when their attempt ends undelivered; how many were marked.

        The marks are forgotten in memory before the first ``await``, so an outcome written
        from then on is not held; the deletes on disk land before this returns (else a
        restart would hold them, ``recover``)."""
        self._check()
        unmarked = unmark_zone(self._hold_marks, zone) if self._hold_marks else []
        if unmarked:
            await self._writer.submit(unmarked, sync=False)
        return len(unmarked)

    async def ready_many(self, chosen: Sequence[QueuedRecipient]) -> int:
        """Make these held or deferred recipients ready at once (delays reset)."""
        self._check()
        return await self._make_ready(q for q in chosen if q.state in (State.HELD, State.DEFERRED))

    # --- paused zones ---------------------------------------------------------------------

    async def set_paused(self, zone: str, paused: bool) -> None:
        """Persist a zone's pause (synced: an administrator was told it is paused)."""
        self._check()
        key = _paused_key(zone)
        await self._writer.submit([(key, b"" if paused else None)], sync=True)

    def paused_zones(self) -> set[str]:
        """Zones an administrator paused, as persisted."""
        found: set[str] = set()
        for key in self._db.keys(prefix=_PAUSED):
            zone, _ = keys.split_text(key, len(_PAUSED))
            found.add(zone)
        return found
