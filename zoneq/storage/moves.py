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
and loses the old one once no record is left there (below): in between it names both, so
no reader misses a record.

Whether a page moves a message's last record out of the zone is decided without a scan:
a seek into an emptied range steps over every tombstone the move has left so far (LevelDB
skips deleted keys one by one), and one such probe per message made a move quadratic
(100,000 messages: 297 s, with no mail accepted meanwhile at start-up).  The message's
head counts its queued records in every zone (leased ones included), so a page that moves
that many of them moves them all, which is every one-recipient message.  Any other
message keeps naming the zone until the walk is over; then one exact probe per such
message settles it (the zone's ranges were compacted, in a thread, before the last pass).
A message that has nothing left in the zone never gains a record there again (records
change state within their zone, and new mail is new messages), so the probes need no lock
against the loop.

The walk takes DEFERRED and HELD before READY, since a due deferred record is promoted to
ready (``promote_due`` runs each second, also for a zone held for the move), and a release
or a retry-now makes a record ready too: taken first, none of them lands behind a walk
still to come.  A record can still change family behind the walk when a leased one's
attempt ends (deferred, held, or ready again) or an administrator holds one meanwhile, so
the walk is repeated until a pass moves nothing while no lease of the zone ended.  Each
pass stops at the newest message queued when the move began, so mail still arriving in a
configured zone cannot keep it going, and each moves at least one record for good, so the
passes end.  Between pages the loop serves everything else (each page is one ``await``).

A record whose key is taken in the target zone (the same recipient of the same message
queued there already, in any state) is not moved: two records for one recipient would be
two deliveries and a count too many.  It is logged and stays, as does a record that cannot
be decoded (quarantined, for the operator).

The moved zone's ranges are noted for compaction (``maintenance.py``): its tombstones lie
behind no delivery cursor, so the usual round would never reach them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from zoneq.errors import StorageCorruption
from zoneq.protocol.ids import format_id
from zoneq.storage import keys
from zoneq.storage.base import FAMILY_STATE, STATE_FAMILY, log, run_all
from zoneq.storage.leveldb import Op
from zoneq.storage.maintenance import MaintenanceMixin, moved_zone_note
from zoneq.storage.records import Recipient, State, decode_head

MOVE_BATCH: Final = 1000
MOVABLE: Final = (State.READY, State.DEFERRED, State.HELD)
# READY last: promotions, releases and retries make records ready (the theory above).
WALK_ORDER: Final = (State.DEFERRED, State.HELD, State.READY)


@dataclass(frozen=True, slots=True)
class Moved:
    """What a move did: ``moved`` recipients, ``in_flight`` leased ones left in place."""

    moved: int = 0
    in_flight: int = 0

    def __add__(self, other: Moved) -> Moved:
        return Moved(self.moved + other.moved, self.in_flight + other.in_flight)


@dataclass(slots=True)
class _Move:
    """One move, across its pages and passes."""

    zone: str
    to: str
    notices_to: str | None
    newest: int  # the newest message id when the move began: no pass goes past it
    unsettled: set[int] = field(default_factory=set)  # messages that may have records left


@dataclass(slots=True)
class _Page:
    """One batch being built: its writes, and what its landing must tell the store."""

    ops: list[Op]
    moving: set[bytes]
    targets: dict[int, str]  # message -> the zone its records go to
    ready: dict[str, bytes]  # zone -> its oldest key made ready
    due: list[tuple[str, bytes]]  # (zone, due key) of each deferred record moved
    per_message: dict[int, int] = field(default_factory=dict)  # message -> records moved
    in_flight: int = 0


class MovesMixin(MaintenanceMixin):
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
        notices to ``notices_to``, if given), ``batch`` at a time; what was moved (leased
        ones as the last pass found them)."""
        if zone in (to, notices_to):
            raise ValueError(f"zone {zone!r} cannot be moved into itself")
        wanted = set(states)
        order = [state for state in WALK_ORDER if state in wanted]
        move = _Move(zone, to, notices_to, self._ids.last)
        moved = 0
        while True:
            leased = self._leases.in_zone(zone)
            done = Moved()
            for state in order:
                done += await self._walk_state(move, state, batch)
            moved += done.moved
            # A lease that ended may have put its record behind the walk (the theory).
            if not done.moved and self._leases.in_zone(zone) == leased:
                break
            # The next pass, and the settling probes, start where this one left only
            # tombstones: gone first, or their first seek steps over all of them.
            await self.compact_moved_zone(zone)
        await self._settle_zones(move, batch)
        return Moved(moved, done.in_flight)

    async def _walk_state(self, move: _Move, state: State, batch: int) -> Moved:
        """One pass over ``move.zone``'s records in ``state``, a page per batch."""
        prefix = keys.zone_prefix(STATE_FAMILY[state], move.zone)
        stop = keys.record_message_prefix(STATE_FAMILY[state], move.zone, move.newest + 1)
        start = prefix
        total = Moved()
        while True:
            self._check()
            # Read and staged with no await in between (``_stage_page``): each record
            # is moved from the state it was read in, so the counters stay exact.
            scan = self._writer.scan(prefix, start=start)
            records = list(
                itertools.islice(itertools.takewhile(lambda kv: kv[0] < stop, scan), batch)
            )
            page = self._stage_page(move, state, records)
            if page.ops:
                await self._writer.submit(page.ops, sync=False, effect=self._moved(page))
            else:
                await asyncio.sleep(0)  # a page that moved nothing still lets the loop in
            total += Moved(len(page.moving), page.in_flight)
            if len(records) < batch:
                return total
            # Past the last key read: left-behind records (leased, taken) are not read
            # again, and the tombstones of the moved ones are not stepped over.
            start = records[-1][0] + b"\x00"

    def _stage_page(self, move: _Move, state: State, records: list[tuple[bytes, bytes]]) -> _Page:
        page = _Page([], set(), {}, {}, [])
        for item in records:
            key, value = item
            if key in self._leases:
                page.in_flight += 1
                continue
            record = self._decode_record(key, value)  # None: quarantined, left for the operator
            if record is not None:
                target = page.targets.get(record.msg_id) or self._target(record, move)
                if self._move_record(page, state, item, record, target):
                    page.targets[record.msg_id] = target
                    page.per_message[record.msg_id] = page.per_message.get(record.msg_id, 0) + 1
        for msg_id, target in page.targets.items():
            gone = self._all_queued(msg_id, page.per_message[msg_id])
            if not gone:
                move.unsettled.add(msg_id)
            page.ops.extend(self._zones_moved(msg_id, move.zone, target, gone))
        if page.ops:
            page.ops.append((moved_zone_note(move.zone), b""))  # its tombstones, compacted
        return page

    def _target(self, record: Recipient, move: _Move) -> str:
        """Where ``record`` goes: a notice zoneq generated (a DSN) to ``notices_to``."""
        if move.notices_to is None:
            return move.to
        meta = self._meta_or_none(record.msg_id)
        return move.notices_to if meta is not None and meta.is_bounce else move.to

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

    def _all_queued(self, msg_id: int, moving: int) -> bool:
        """Whether ``moving`` records are all ``msg_id`` has queued, in any zone (its head
        counts them): then none is left behind.  False if the head is damaged."""
        key = keys.message_head(msg_id)
        value = self._writer.read(key)
        if value is None:
            return False
        try:
            return decode_head(key, value)[1] == moving
        except StorageCorruption as exc:
            self._quarantine(exc)
            return False

    def _zones_moved(self, msg_id: int, zone: str, target: str | None, gone: bool) -> list[Op]:
        """The metadata write naming ``target`` (if any) among the message's zones, and no
        longer ``zone`` if it is ``gone`` from there (none if nothing changes, or the
        metadata is missing or damaged: its readers then look in every zone)."""
        meta = self._meta_or_none(msg_id)
        if meta is None:
            return []
        zones = list(meta.zones)
        if target is not None and target not in zones:
            zones.append(target)
        if gone and zone in zones:
            zones.remove(zone)
        if tuple(zones) == meta.zones:
            return []
        return [(keys.message_meta(msg_id), meta.encode(zones=zones))]

    async def _settle_zones(self, move: _Move, batch: int) -> None:
        """After the walk: drop ``move.zone`` from the zones of the messages a page could not
        tell about (``_all_queued``) that have no record left there.  The zone's ranges were
        compacted before the last pass, which moved nothing: each probe seeks no tombstones."""
        unsettled = sorted(move.unsettled)
        for start in range(0, len(unsettled), batch):
            self._check()
            ops: list[Op] = []
            for msg_id in unsettled[start : start + batch]:
                if not self._left_in(move.zone, msg_id):
                    ops.extend(self._zones_moved(msg_id, move.zone, None, gone=True))
            if ops:
                await self._writer.submit(ops, sync=False)
            else:
                await asyncio.sleep(0)

    def _left_in(self, zone: str, msg_id: int) -> bool:
        """Whether a record of ``msg_id`` is in ``zone``, in any state."""
        return any(
            next(self._writer.scan(keys.record_message_prefix(family, zone, msg_id)), None)
            is not None
            for family in FAMILY_STATE
        )

    def _moved(self, page: _Page) -> Callable[[], None]:
        """Effect of a page landing: the target zones' cursors and due marks see what came
        (a scan reads the disk, so only once it is there), and their delivery loops wake."""
        effects = [self._readied(page.ready)]
        effects.extend(self._due_landed(zone, due_key) for zone, due_key in page.due)
        return run_all(effects)
