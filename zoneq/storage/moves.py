"""Moving queued recipients from one zone to another.

Theory of operation
-------------------
Only configured zones get workers, and a recipient's zone is part of its key (``keys.py``),
so mail queued in a zone that a new config removed or renamed would wait for ever: never
tried, so never expired and never bounced.  At start-up (``zoneq.runtime``) every stored
zone that is not configured is therefore emptied into the configured ones, and an
administrator can move a zone's recipients by hand (``QueueAdmin.move``).  Both are
:meth:`MovesMixin.move_zone`.

A move keeps a recipient's state: a ready record is ready in the new zone, a deferred one
keeps its record and its due time (its ``due`` index entry moves with it), a held one stays
held with its reason; attempts, replies and DSN parameters travel in the value, which does
not hold the zone and is copied unchanged.  A leased record (on the wire, or handed to a
worker) is left where it is: its worker's report must find it under its key.

Each page of at most ``batch`` records is one atomic batch: the deletes, the inserts, the
due entries, the counters of both zones (sealed into the same group, ``counters.py``) and
the metadata of every message it touches.  So a crash leaves each recipient in exactly one
zone, the counts exact, and a restart finishes the move (it is idempotent: what is moved is
no longer in the old zone).  A message's ``zones`` list (``MessageMeta``; its readers find
the records through it) gains the new zone in the batch that first moves a record there,
and loses the old one in the batch that moves its last record out: in between it names
both, so no reader misses a record.

A record whose key is taken in the target zone (the same recipient of the same message
queued there already, in any state) is not moved: two records for one recipient would be
two deliveries and a count too many.  It is logged and stays, as does a record that cannot
be decoded (quarantined, for the operator).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from zoneq.errors import StorageCorruption
from zoneq.protocol.ids import format_id
from zoneq.storage import keys
from zoneq.storage.base import FAMILY_STATE, STATE_FAMILY, StoreBase, log, run_all
from zoneq.storage.leveldb import Op
from zoneq.storage.records import MessageMeta, Recipient, State

MOVE_BATCH: Final = 1000
MOVABLE: Final = (State.READY, State.DEFERRED, State.HELD)


@dataclass(frozen=True, slots=True)
class Moved:
    """What a move did: ``moved`` recipients, ``in_flight`` leased ones left in place."""

    moved: int = 0
    in_flight: int = 0

    def __add__(self, other: Moved) -> Moved:
        return Moved(self.moved + other.moved, self.in_flight + other.in_flight)


@dataclass(slots=True)
class _Page:
    """One batch being built: its writes, and what its landing must tell the store."""

    ops: list[Op]
    moving: set[bytes]
    targets: dict[int, str]  # message -> the zone its records go to
    ready: dict[str, bytes]  # zone -> its oldest key made ready
    due: list[tuple[str, bytes]]  # (zone, due key) of each deferred record moved
    in_flight: int = 0


class MovesMixin(StoreBase):
    async def move_zone(
        self,
        zone: str,
        to: str,
        *,
        notices_to: str | None = None,
        states: Iterable[State] = MOVABLE,
        batch: int = MOVE_BATCH,
    ) -> Moved:
        """Move ``zone``'s recipients in ``states`` to zone ``to`` (those of zoneq's own
        notices to ``notices_to``, if given), ``batch`` at a time; what was moved."""
        if zone in (to, notices_to):
            raise ValueError(f"zone {zone!r} cannot be moved into itself")
        total = Moved()
        for state in states:
            prefix = keys.zone_prefix(STATE_FAMILY[state], zone)
            start = prefix
            while True:
                self._check()
                # Read and staged with no await in between (``_stage_page``): each record
                # is moved from the state it was read in, so the counters stay exact.
                records = list(itertools.islice(self._writer.scan(prefix, start=start), batch))
                page = self._stage_page(zone, state, records, to, notices_to)
                if page.ops:
                    await self._writer.submit(page.ops, sync=False, effect=self._moved(page))
                total += Moved(len(page.moving), page.in_flight)
                if len(records) < batch:
                    break
                # Past the last key read: left-behind records (leased, taken) are not read
                # again, and the tombstones of the moved ones are not stepped over.
                start = records[-1][0] + b"\x00"
        return total

    def _stage_page(
        self,
        zone: str,
        state: State,
        records: list[tuple[bytes, bytes]],
        to: str,
        notices_to: str | None,
    ) -> _Page:
        page = _Page([], set(), {}, {}, [])
        for item in records:
            key, value = item
            if key in self._leases:
                page.in_flight += 1
                continue
            record = self._decode_record(key, value)  # None: quarantined, left for the operator
            if record is not None:
                target = page.targets.get(record.msg_id) or self._target(record, to, notices_to)
                if self._move_record(page, state, item, record, target):
                    page.targets[record.msg_id] = target
        for msg_id, target in page.targets.items():
            page.ops.extend(self._zones_moved(msg_id, zone, target, page.moving))
        return page

    def _target(self, record: Recipient, to: str, notices_to: str | None) -> str:
        """Where ``record`` goes: a notice zoneq generated (a DSN) to ``notices_to``."""
        if notices_to is None:
            return to
        meta = self._meta_or_none(record.msg_id)
        return notices_to if meta is not None and meta.is_bounce else to

    def _move_record(
        self, page: _Page, state: State, item: tuple[bytes, bytes], record: Recipient, target: str
    ) -> bool:
        """Stage one record's move into ``target``; False if the target's key is taken."""
        key, value = item
        msg_id, address = record.msg_id, record.address
        if self._queued_in(target, msg_id, address):
            log.warning(
                "message %s: %s is queued in zone %s already; its record in zone %s is left",
                format_id(msg_id),
                address,
                target,
                record.zone,
            )
            return False
        family = STATE_FAMILY[state]
        new_key = keys.record(family, target, msg_id, address)
        page.ops.extend([(key, None), (new_key, value)])
        if state is State.DEFERRED:
            due = record.next_attempt_ms
            new_due = keys.due(target, due, msg_id, address)
            page.ops.extend([(keys.due(record.zone, due, msg_id, address), None), (new_due, b"")])
            page.due.append((target, new_due))
        elif state is State.READY and (target not in page.ready or new_key < page.ready[target]):
            page.ready[target] = new_key
        self._counters.move(record.zone, record.domain, state, None)
        self._counters.move(target, record.domain, None, state)
        page.moving.add(key)
        return True

    def _queued_in(self, zone: str, msg_id: int, address: str) -> bool:
        """Whether ``address`` of ``msg_id`` has a record in ``zone``, in any state."""
        return any(
            self._writer.read(keys.record(family, zone, msg_id, address)) is not None
            for family in FAMILY_STATE
        )

    def _zones_moved(self, msg_id: int, zone: str, target: str, moving: set[bytes]) -> list[Op]:
        """The metadata write naming ``target`` among the message's zones, and no longer
        ``zone`` once ``moving`` takes its last record there (none if nothing changes, or
        the metadata is missing or damaged: its readers then look in every zone)."""
        meta = self._meta_or_none(msg_id)
        if meta is None:
            return []
        zones = list(meta.zones)
        if target not in zones:
            zones.append(target)
        if zone in zones and not self._left_in(zone, msg_id, moving):
            zones.remove(zone)
        if tuple(zones) == meta.zones:
            return []
        return [(keys.message_meta(msg_id), meta.encode(zones=zones))]

    def _left_in(self, zone: str, msg_id: int, moving: set[bytes]) -> bool:
        """Whether a record of ``msg_id`` stays in ``zone`` once ``moving`` has left it."""
        for family in FAMILY_STATE:
            prefix = keys.record_message_prefix(family, zone, msg_id)
            if any(key not in moving for key, _ in self._writer.scan(prefix)):
                return True
        return False

    def _meta_or_none(self, msg_id: int) -> MessageMeta | None:
        key = keys.message_meta(msg_id)
        value = self._writer.read(key)
        if value is None:
            return None
        try:
            return MessageMeta.decode(key, msg_id, value)
        except StorageCorruption as exc:
            self._quarantine(exc)
            return None

    def _moved(self, page: _Page) -> Callable[[], None]:
        """Effect of a page landing: the target zones' cursors and due marks see what came
        (a scan reads the disk, so only once it is there), and their delivery loops wake."""
        effects = [self._readied(page.ready)]
        effects.extend(self._due_landed(zone, due_key) for zone, due_key in page.due)
        return run_all(effects)
