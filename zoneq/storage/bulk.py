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

Holds that wait for an attempt: a hold cannot move a recipient that is on the wire (its
worker's report must still find it ready), so the queue service holds it when its attempt
ends without a delivery (``QueueService.hold``).  That promise is kept in memory by the
service, and on disk here as ``meta "hold-on-return" <ready key>`` -> reason, written
(synced) before the hold answers: a lease does not survive a restart, so without it a core
that stopped mid-attempt would make the recipient ready again and send a message the
administrator held.  At start-up (``recover``) every marked recipient still ready is held;
a mark whose recipient was delivered or bounced meanwhile is just removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from zoneq.errors import NotFound, StorageCorruption
from zoneq.protocol.events import EventKind
from zoneq.storage import keys
from zoneq.storage.base import STATE_FAMILY, Outcome, QueuedRecipient, StoreBase
from zoneq.storage.leveldb import Op
from zoneq.storage.records import MessageMeta, State

_PAUSED = keys.meta("paused-zone")
HOLD_MARKS = keys.meta("hold-on-return")  # + a ready key -> the hold's reason


def _paused_key(zone: str) -> bytes:
    return _PAUSED + keys.text(zone)


def hold_mark_key(ready_key: bytes) -> bytes:
    """The mark of a leased recipient to hold when its attempt ends (see the top)."""
    return HOLD_MARKS + ready_key


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
            ops.extend(self._remove_record(queued))
            ops.append(self._outcome_event(EventKind.DROPPED, record, now_ms, sizes[record.msg_id]))
            gone[record.msg_id] = gone.get(record.msg_id, 0) + 1
        removed = {key for key, value in ops if value is None}
        for msg_id, count in gone.items():
            head = heads[msg_id]
            if head is not None:
                ops.extend(self._recipients_gone(msg_id, head, count))
            else:
                ops.extend(self._headless(msg_id, removed))
        if ops:
            await self._writer.submit(ops, sync=False)
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
        """Put these recipients on hold; leased ones are passed over (they may be on the
        wire and finish their attempt, as :meth:`hold` does); how many were held."""
        self._check()
        ops: list[Op] = []
        held = 0
        for queued in chosen:
            record = queued.recipient
            if queued.state not in (State.READY, State.DEFERRED):
                continue
            family = STATE_FAMILY[queued.state]
            if keys.record(family, record.zone, record.msg_id, record.address) in self._leases:
                continue
            ops.extend(self._remove_record(queued))
            self._counters.move(record.zone, record.domain, None, State.HELD)
            on_hold = replace(record, hold_reason=reason)
            held_key = keys.record(keys.HELD, record.zone, record.msg_id, record.address)
            ops.append((held_key, on_hold.encode()))
            held += 1
        if ops:
            await self._writer.submit(ops, sync=False)
        return held

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

    # --- holds that wait for an attempt to end ------------------------------------------

    async def mark_hold_on_return(self, leased: Sequence[bytes], reason: str) -> None:
        """Remember on disk (synced: the administrator is told they will be held) that the
        leased records at these ready keys are to be held when their attempt ends."""
        self._check()
        value = reason.encode()
        await self._writer.submit([(hold_mark_key(key), value) for key in leased], sync=True)
