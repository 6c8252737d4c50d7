"""Recovery, garbage sweeps, compaction and event retention for the queue store."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from dataclasses import replace

import msgpack

from zoneq.protocol.events import Event
from zoneq.protocol.ids import COUNTER_BITS, id_time_ms
from zoneq.storage import keys
from zoneq.storage.base import DEAD_BODIES, FAMILY_STATE, StoreBase, dead_body_key, log
from zoneq.storage.counters import MESSAGES, domain_key, zone_key
from zoneq.storage.holdmarks import HOLD_MARKS
from zoneq.storage.leveldb import Op
from zoneq.storage.records import (
    State,
    recipient_domain,
)

# Zones emptied by a move (``moves.py``) whose ranges wait for compaction: no delivery
# cursor lies behind their tombstones, so the cursors' ranges never cover them.  On disk,
# written with the move's batches, so a move cut short by a stop is compacted too.
MOVED_ZONES = keys.meta("moved-zone")
# The ranges a moved zone leaves tombstones in: its records, and the due index of its
# deferred ones.
_MOVED_FAMILIES = (*keys.RECORD_FAMILIES, keys.DUE)


def moved_zone_note(zone: str) -> bytes:
    return MOVED_ZONES + keys.text(zone)


class MaintenanceMixin(StoreBase):
    def recover(self, *, receiving: dict[int, int] | None = None) -> int:
        """Make the in-memory state match the disk; return the number of orphans swept.

        Called once after open (before any traffic) and after a reopen.  Every lease is gone,
        so every recipient that was in flight is ready again at once.  ``receiving``: the
        messages still streaming in across a reopen, which are not orphans.
        """
        self._leases.clear()
        self._cursors.clear()
        self._due_marks.clear()
        self._receiving = dict(receiving or {})
        self._counters.load(self._db)
        self._load_floors()
        # Big bodies deleted before a stop and not compacted yet (``_note_dead_body``); after
        # a reopen, those noted in memory whose record's write failed stay listed too.
        self._dead_bodies.update(
            int.from_bytes(key[len(DEAD_BODIES) :], "big")
            for key in self._db.keys(prefix=DEAD_BODIES)
        )
        last_message = next(self._db.keys(prefix=keys.MESSAGE, reverse=True), None)
        last_receiving = next(self._db.keys(prefix=keys.RECEIVING, reverse=True), None)
        floor = 0
        if last_message is not None:
            floor = keys.decode_message_key(last_message)[0]
        if last_receiving is not None:
            floor = max(floor, keys.decode_receiving(last_receiving))
        self._ids.raise_floor(floor)
        last_event = next(self._db.keys(prefix=keys.EVENT, reverse=True), None)
        if last_event is not None:
            self._event_ids.raise_floor(keys.decode_event(last_event))
        # Every receiving marker is an orphan but those of messages still streaming in
        # (none at start-up; after a runtime reopen, the sessions that go on).
        orphans = self._orphans(lambda msg_id: msg_id not in self._receiving)
        if orphans:
            self._db.write(orphans, sync=True)
        if receiving is None:
            # A start, not a reopen: no lease is out, so a hold that waited for an attempt
            # the stop cut off is due now (``bulk.py``).  After a reopen the leases stay
            # out and the service still holds them when they end.
            held = self._hold_marked()
            if held:
                log.info("held %d recipient(s) whose hold waited for an attempt", held)
        return sum(1 for key, _ in orphans if key.startswith(keys.RECEIVING))

    def _hold_marked(self) -> int:
        """At start-up, before any lease: hold every marked recipient that is still ready
        (its attempt was cut off by the stop), and remove every mark; how many were held."""
        ops: list[Op] = []
        moved = 0
        for mark, reason in self._db.items(prefix=HOLD_MARKS):
            ops.append((mark, None))
            ready_key = mark[len(HOLD_MARKS) :]
            value = self._db.get(ready_key)
            record = None if value is None else self._decode_record(ready_key, value)
            if record is None:
                continue  # delivered, bounced, deferred-then-held or dropped since
            on_hold = replace(record, hold_reason=reason.decode(errors="replace"))
            held_key = keys.record(keys.HELD, record.zone, record.msg_id, record.address)
            ops.extend([(ready_key, None), (held_key, on_hold.encode())])
            self._counters.move(record.zone, record.domain, State.READY, State.HELD)
            moved += 1
        if ops:
            self._db.write([*ops, *self._seal()], sync=True)
        return moved

    async def sweep(self, now_ms: int, receive_timeout_ms: int) -> int:
        """Remove the chunks of messages that never committed and are older than the timeout."""
        self._check()
        cutoff = now_ms - receive_timeout_ms

        def stale(msg_id: int) -> bool:
            return msg_id not in self._receiving and id_time_ms(msg_id) < cutoff

        ops = self._orphans(stale)
        if ops:
            await self._writer.submit(ops, sync=False)
        return sum(1 for key, _ in ops if key.startswith(keys.RECEIVING))

    def _orphans(self, is_orphan: Callable[[int], bool]) -> list[Op]:
        ops: list[Op] = []
        for key in self._db.keys(prefix=keys.RECEIVING):
            msg_id = keys.decode_receiving(key)
            if not is_orphan(msg_id):
                continue
            if self._db.get(keys.message_head(msg_id)) is None:
                chunks = self._chunk_deletes(msg_id)
                ops.extend(chunks)
                ops.extend(self._note_dead_body(msg_id, len(chunks)))
            ops.append((key, None))
        return ops

    async def compact(self) -> None:
        """Compact the deleted ranges behind each zone's marks, the range of each big body
        deleted since the last round, and the ranges of each zone moved out of (explicit
        ranges only).

        LevelDB's CompactRange runs in a thread, which it can (plyvel releases the GIL
        around it): on the event loop one round after 180,000 deliveries held SMTP
        replies, the API and the workers' reports for 0.8 s.  What to compact is read
        here first, on the loop, which owns the marks and the dead-body notes; only the
        calls go to the thread, one range at a time (a close waits for one, ``leveldb.py``).
        """
        ranges = [
            (keys.zone_prefix(keys.READY, zone), cursor) for zone, cursor in self._cursors.items()
        ]
        ranges.extend(
            (keys.zone_prefix(keys.DUE, zone), mark) for zone, mark in self._due_marks.items()
        )
        bodies = self._dead_bodies_landed()
        moved = list(self._db.keys(prefix=MOVED_ZONES))
        for start, stop in ranges:
            await self._compact_range(start, stop)
        for msg_id in bodies:
            await self._compact_dead_body(msg_id)
        for note in moved:
            await self.compact_moved_zone(keys.split_text(note, len(MOVED_ZONES))[0])
            # After it: a failed one is tried next round, or after a restart.  A move
            # still going on writes the note again with its next batch.
            self._db.write([(note, None)], sync=False)

    async def compact_moved_zone(self, zone: str) -> None:
        """Compact the ranges a move out of ``zone`` fills with tombstones (whole: nothing
        in them is read in order by a cursor)."""
        for family in _MOVED_FAMILIES:
            start = keys.zone_prefix(family, zone)
            stop = keys.prefix_upper_bound(start)
            assert stop is not None  # a zone prefix ends in its text's terminator, 0x00
            await self._compact_range(start, stop)

    def _dead_bodies_landed(self) -> list[int]:
        """The dead bodies whose deletes are on disk, in id order; forgets those whose
        batch failed (nothing was deleted)."""
        landed: list[int] = []
        for msg_id in sorted(self._dead_bodies):
            record = dead_body_key(msg_id)
            if self._writer.pending(record) is not self._writer.MISSING:
                continue  # its deletes are still staged: compacted now, nothing would go
            if self._db.get(record) is None:
                self._dead_bodies.discard(msg_id)
            else:
                landed.append(msg_id)
        return landed

    async def _compact_dead_body(self, msg_id: int) -> None:
        # Each message's own range, not the span between the oldest and newest: live
        # messages received meanwhile sort in between and would be rewritten for nothing.
        # (The next id's prefix bounds every key of this one: head, metadata, chunks.)
        # Twice: LevelDB's CompactRange flushes the memtable (the deletes) first, then
        # compacts only the levels that held files in the range before that flush, so
        # a body already in a table file two levels down outlived one pass (8 MiB in
        # tests/storage/test_dead_bodies.py); the second merges the deletes with it.
        start, stop = keys.message_prefix(msg_id), keys.message_prefix(msg_id + 1)
        await self._compact_range(start, stop)
        await self._compact_range(start, stop)
        # After it: a failed one is tried next round, or after a restart.
        self._db.write([(dead_body_key(msg_id), None)], sync=False)
        self._dead_bodies.discard(msg_id)
        self.space.free_bytes(fresh=True)  # the space is back: intake sees it at once

    async def _compact_range(self, start: bytes, stop: bytes) -> None:
        # The store may have failed while the last range compacted: reopened first, or
        # StorageUnavailable, and the round ends (``maintain`` logs it).
        self._check()
        await asyncio.to_thread(self._db.compact_range, start, stop)

    async def trim_events(self, before_ms: int, limit: int = 50_000) -> int:
        """Delete up to ``limit`` events older than ``before_ms`` (one batch); how many."""
        return (await self._trim_batch(before_ms, keys.EVENT, limit))[0]

    async def trim_expired_events(self, before_ms: int, batch: int = 50_000) -> int:
        """Delete every event older than ``before_ms`` (retention), ``batch`` at a time;
        how many.

        One batch per maintenance round (10 minutes) trims ~83 events/s, far less than a
        busy node writes, so the log would grow without bound.  Each batch is one writer
        submission, which awaits its group write: the event loop serves SMTP clients and
        workers between batches, and ``sleep(0)`` yields even when the write was quick.
        Each batch resumes after the last key deleted, so no scan walks the tombstones
        of the batches before it again (LevelDB skips deleted keys one by one).
        """
        total, start = 0, keys.EVENT
        while True:
            deleted, last = await self._trim_batch(before_ms, start, batch)
            total += deleted
            if deleted < batch or last is None:
                return total
            start = last + b"\x00"
            await asyncio.sleep(0)

    async def _trim_batch(
        self, before_ms: int, start: bytes, limit: int
    ) -> tuple[int, bytes | None]:
        self._check()
        stop = keys.event(before_ms << COUNTER_BITS)  # event ids are time-ordered like msg ids
        ops: list[Op] = [
            (key, None) for key in itertools.islice(self._db.keys(start=start, stop=stop), limit)
        ]
        if ops:
            await self._writer.submit(ops, sync=False)
        return len(ops), (ops[-1][0] if ops else None)

    def events(
        self,
        *,
        after: bytes | None = None,
        snapshot: object = None,
        on_corrupt: Callable[[bytes, str], None] | None = None,
    ) -> Iterator[tuple[bytes, Event]]:
        """Events in time order after the key ``after`` (an export's watermark).

        A record that does not decode is logged with its key and skipped (``on_corrupt``
        hears its key and why, in order), as the queue's readers skip theirs: one damaged
        value must not stop every reader of the log at the same place, every time.  The
        record itself is left for retention to trim; nothing else depends on it.
        """
        start = keys.EVENT if after is None else after + b"\x00"
        for key, value in self._db.items(
            start=start, stop=keys.prefix_upper_bound(keys.EVENT), snapshot=snapshot
        ):
            try:
                event = Event.from_record(msgpack.unpackb(value))
            except (msgpack.UnpackException, ValueError, TypeError, KeyError) as exc:
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                log.error("event record %s does not decode, skipped: %s", key.hex(), reason)
                if on_corrupt is not None:
                    on_corrupt(key, reason)
                continue
            yield key, event

    def recount(self) -> dict[bytes, int]:
        """Count everything by scanning (slow; for checks and repair): the true counters."""
        true: dict[bytes, int] = {}

        def bump(key: bytes) -> None:
            true[key] = true.get(key, 0) + 1

        for family, state in FAMILY_STATE.items():
            for key in self._db.keys(prefix=family):
                _, zone, _, address = keys.decode_record(key)
                bump(zone_key(zone, state.value))
                bump(domain_key(zone, recipient_domain(address), state.value))
        for key in self._db.keys(prefix=keys.MESSAGE):
            if keys.decode_message_key(key)[1] == keys.HEAD_PART:
                bump(MESSAGES)
        return true
