"""Shared state and helpers of the queue store (see ``store.py`` for the theory).

``QueueStore`` is assembled from this base and two mixins, each a module named for what it
owns: ``store.py`` (receiving, leasing, outcomes), ``admin.py`` (reads and administrators'
operations) and ``maintenance.py`` (recovery, sweeps, compaction, retention).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

import msgpack

from zoneq.errors import DiskFull, LeaseError, NotFound, StorageCorruption, StorageUnavailable
from zoneq.protocol.events import Event, EventKind
from zoneq.protocol.ids import IdGenerator, format_id, id_time_ms
from zoneq.storage import keys
from zoneq.storage.counters import MESSAGES, Counters
from zoneq.storage.holdmarks import mark, unmark, unmark_on_disk, write_hold
from zoneq.storage.leases import LeaseTable
from zoneq.storage.leveldb import Database, Op
from zoneq.storage.records import (
    MessageMeta,
    Notice,
    Recipient,
    State,
    decode_head,
    encode_head,
    recipient_domain,
)
from zoneq.storage.retrymarks import forget
from zoneq.storage.space import SpaceGuard
from zoneq.storage.writer import GroupWriter

if TYPE_CHECKING:
    from zoneq.storage.held import Held

FAMILY_STATE: Final = {
    keys.READY: State.READY,
    keys.DEFERRED: State.DEFERRED,
    keys.HELD: State.HELD,
}
STATE_FAMILY: Final = {v: k for k, v in FAMILY_STATE.items()}
READY_STATE: Final = State.READY.value
# A deleted body at least this big has its key range compacted at the next maintenance
# round; smaller ones (most abandons are a chunk or two) are left to LevelDB's own.
DEAD_BODY_COMPACT: Final = 1 << 20
# A big body deleted but not yet compacted: ``meta "dead-body" <id:u64>`` -> b"".
DEAD_BODIES: Final = keys.meta("dead-body")


def dead_body_key(msg_id: int) -> bytes:
    return DEAD_BODIES + keys.u64(msg_id)


log = logging.getLogger("zoneq.storage")


@functools.lru_cache(maxsize=1024)
def ready_prefix(zone: str) -> bytes:
    return keys.zone_prefix(keys.READY, zone)


def run_all(effects: Sequence[Callable[[], None]]) -> Callable[[], None]:
    """One effect that runs ``effects`` in order (a group writer takes one per write)."""

    def run() -> None:
        for effect in effects:
            effect()

    return run


@dataclass(frozen=True, slots=True)
class Lease:
    """A ready recipient handed to a delivery loop; ``token`` must come back with the report."""

    token: int
    key: bytes
    recipient: Recipient
    owner: str


@dataclass(frozen=True, slots=True)
class QueuedRecipient:
    """A recipient as administrators see it."""

    state: State
    recipient: Recipient


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a report says happened at the remote end (for the event)."""

    reply: str = ""
    code: int | None = None
    enhanced: str | None = None
    mx: str | None = None
    source_ip: str | None = None
    possible_duplicate: bool = False
    # The message's size in octets, for the event (issue 6: every event carries it).  The
    # caller knows it from the job it handed out, which saves a metadata read per outcome.
    size: int = 0
    # Why it failed, for the event (``reply_rules.rule_report``); None when delivered.
    category: str | None = None


class StoreBase:
    """The in-memory state every part of the store shares, and the helpers they share."""

    # How long a failed store waits before trying to reopen the database again.
    REOPEN_INTERVAL_S: Final = 1.0

    def __init__(
        self,
        db: Database,
        *,
        sync_commits: bool = True,
        chunk_size: int = 65_536,
        space: SpaceGuard | None = None,
    ) -> None:
        self._db = db
        self.space = space if space is not None else SpaceGuard(db.path)
        self.sync_commits = sync_commits
        self.chunk_size = chunk_size
        self._next_reopen = 0.0
        self._counters = Counters()
        self._writer = GroupWriter(db, seal=self._seal, on_failure=self._on_failure)
        # Message ids and event ids must never repeat, even after the queue emptied or the
        # clock stepped back across a restart: old events (and an export's watermark) refer
        # to them.  Their floors are persisted with every group (see _seal).
        self._ids = IdGenerator()
        self._event_ids = IdGenerator()
        self._floors_written = (0, 0)
        self._tokens = itertools.count(secrets.randbits(48))
        self._leases = LeaseTable()  # with a count per zone (``count(zone, LEASED)``)
        # Leased recipients to hold when their attempt ends undelivered (``holdmarks.py``).
        self._hold_marks: dict[bytes, str] = {}
        # Leased recipients a retry asked for: due at once if they defer (``retrymarks.py``).
        self._retry_marks: dict[bytes, int] = {}
        # Outcomes on their way to disk (their leases taken, their batches not landed), and
        # outcomes held while the database cannot write (``held.py``).
        self._settling: dict[bytes, Held] = {}
        self._held: list[Held] = []
        self._held_bytes = 0
        self._replays: set[asyncio.Task[None]] = set()
        # Leases revoked by deletes whose batches have not landed: put back if they fail
        # (``_on_failure``), for the record is still queued and its delivery on the wire
        # (unless its worker reported it undelivered meanwhile: ``_ended``).
        self._revoking: dict[bytes, Lease] = {}
        self._cursors: dict[str, bytes] = {}
        self._due_marks: dict[str, bytes] = {}
        # Per zone, a key above every live due key, once known (``QueueStore.promote_due``:
        # due times further ahead than a forward clock allows mean it stepped back).
        self._due_ceilings: dict[str, bytes] = {}
        # Messages whose DATA is streaming in: id -> chunks staged so far (highest index + 1).
        # Kept because a chunk write may still be staged (not on disk) when the message is
        # abandoned; its delete must be staged too, or the chunk lands after the marker is gone
        # and nothing would ever find it again.
        self._receiving: dict[int, int] = {}
        # Messages whose big body was deleted (abandoned, or swept as an orphan): their key
        # ranges are compacted at the next maintenance round (``maintenance.compact``).
        self._dead_bodies: set[int] = set()
        # Messages whose commit failed (their client got 4xx); see _undo_failed_commits.
        self._failed_commits: dict[int, int] = {}  # msg_id -> the commit's now_ms
        self.quarantined: list[StorageCorruption] = []
        # Called with a zone's name and the oldest key made ready when recipients become
        # ready there (once durable), so the queue service can wake delivery loops waiting
        # for work instead of polling.
        self.on_ready: Callable[[str, bytes], None] | None = None

    def recover(self, *, receiving: dict[int, int] | None = None) -> int:
        """Reload in-memory state from disk (``maintenance.py``)."""
        raise NotImplementedError

    def _resume(self, leases: dict[bytes, Lease]) -> None:
        """After a reopen: keep the leases that were out, write what was held (``held.py``)."""
        raise NotImplementedError

    def _hold_settling(self, exc: StorageUnavailable) -> None:
        """Hold the outcomes of the batches that failed (``held.py``)."""
        raise NotImplementedError

    def _hold_if_failed(self, held: Held) -> bool:
        """Hold ``held`` if the store is failed and cannot reopen now (``held.py``)."""
        raise NotImplementedError

    async def complete(
        self, lease: Lease, now_ms: int, outcome: Outcome, *, notice: Notice | None = None
    ) -> None:
        """Delivered: the recipient leaves the queue (``store.py``)."""
        raise NotImplementedError

    def _settle(
        self,
        held: Held,
        ops: list[Op],
        *,
        sync: bool,
        effect: Callable[[], None] | None = None,
    ) -> asyncio.Future[None]:
        """Stage an outcome's writes, held if their batch fails (``held.py``)."""
        raise NotImplementedError

    def _seal(self) -> list[Op]:
        """Writes every group carries: changed counters, and the id floors when they moved."""
        ops = self._counters.seal()
        floors = (self._ids.last, self._event_ids.last)
        if floors != self._floors_written:
            ops.append((keys.meta("floors"), keys.u64(floors[0]) + keys.u64(floors[1])))
            self._floors_written = floors
        return ops

    def _load_floors(self) -> None:
        value = self._db.get(keys.meta("floors"))
        if value is not None and len(value) == 16:
            self._ids.raise_floor(int.from_bytes(value[:8], "big"))
            self._event_ids.raise_floor(int.from_bytes(value[8:], "big"))
        self._floors_written = (self._ids.last, self._event_ids.last)

    def _on_failure(self, exc: StorageUnavailable) -> None:
        # LevelDB's error is sticky: leave the handle failed until reopen() succeeds.  The
        # leases stay: what the workers report from now on is held (``held.py``), and so
        # are the outcomes in the failed batches, now, before any other task runs (one
        # could reopen the store, or lease their records again).
        self._hold_settling(exc)
        self._put_back_revoked()
        self._recount_failed()
        if isinstance(exc, DiskFull):
            self.space.release()  # room for the reopen and the deletes that drain the queue

    def _put_back_revoked(self) -> None:
        """The deletes that revoked these leases failed: the records are still queued, and
        their deliveries on the wire.  Their reports are taken again (held until the heal,
        then written), and the records are not handed out a second time meanwhile or after
        the heal (``_resume`` keeps a lease whose record is on disk)."""
        revoking, self._revoking = self._revoking, {}
        self._leases.update(revoking)

    def _recount_failed(self) -> None:
        """Undo the counts the failed batches moved when they were staged: read them back
        from the disk, which the failed handle still reads.  Their outcomes are held and
        their leases back, so until the heal ready must still count each such recipient
        (else ``/metrics`` showed ready below leased); the reopen's ``recover`` reads them
        again anyway.  A handle that cannot read leaves that to the reopen."""
        with contextlib.suppress(StorageUnavailable):
            self._counters.load(self._db)

    def reopen(self) -> None:
        """Clear a sticky write error: reopen the database and reload state from disk.

        Raises ``StorageUnavailable`` while the cause persists (a full disk makes even the
        reopen fail); the owner retries later.  Callers see 4xx in the meantime.  Messages
        still streaming in keep their chunks: a session whose own chunk write failed was
        told so and abandons its message; the others carry on.  Leases that were out stay
        out (their deliveries report afterwards), and held outcomes are written.
        """
        receiving = dict(self._receiving)
        leases = dict(self._leases)
        try:
            self._db.reopen()
        except DiskFull:
            self.space.release()
            raise
        try:
            self.recover(receiving=receiving)
        except BaseException:
            self._leases.update(leases)  # still out there: never handed out twice
            raise
        self._resume(leases)
        self._writer.reset()
        self._undo_failed_commits()

    def _undo_failed_commits(self) -> None:
        """Remove the messages whose commit failed but landed after all.

        LevelDB appends a batch to its log before syncing it: when the sync fails the batch
        is in the log, and the reopen replays it.  Its client was told 4xx and will send the
        message again, so keeping it would deliver two copies.  (A crash before this point
        keeps it: a possible duplicate, the RFC 1047 trade of a copy for no loss.)
        """
        failed, self._failed_commits = self._failed_commits, {}
        ops: list[Op] = []
        for msg_id, now_ms in sorted(failed.items()):
            if self._db.get(keys.message_head(msg_id)) is None:
                # The batch did not land: its message is no longer streaming in (its client
                # was told 4xx), so the sweep after the DATA timeout removes its chunks.
                self._receiving.pop(msg_id, None)
                continue
            for state, key, _ in list(self._raw_records(msg_id)):
                ops.extend(self._remove_key(key, state, None))
                _, zone, _, address = keys.decode_record(key)
                # Its ACCEPTED event landed with it: the log says what became of it.
                dropped = Event(
                    EventKind.DROPPED,
                    now_ms,
                    zone,
                    format_id(msg_id),
                    address,
                    recipient_domain(address),
                    id_time_ms(msg_id),
                    text="commit failed (the client was told 4xx)",
                )
                ops.append(self._event_op(dropped))
            ops.extend(self._message_removed(msg_id))  # nothing staged: the writer was reset
            self._receiving.pop(msg_id, None)
            log.warning("removed message %016x: its commit failed (4xx) but landed", msg_id)
        if ops:
            try:
                self._db.write([*ops, *self._seal()], sync=True)
            except StorageUnavailable:
                self._failed_commits.update(failed)  # the next reopen tries again
                raise

    def _note_dead_body(self, msg_id: int, chunks: int) -> list[Op]:
        """``chunks`` of ``msg_id``'s body are being deleted: a big body's range is compacted
        at the next maintenance round.  LevelDB frees a deleted value's space only when a
        compaction reaches it, and no zone mark's range covers the message family, so
        without this 40 MiB of dead chunks kept the disk below the floor for good.

        Returns the write that records it on disk, for the deletes' own batch: a stop
        before the next round must not forget it (``recover`` reads the records back)."""
        if chunks * self.chunk_size < DEAD_BODY_COMPACT:
            return []
        self._dead_bodies.add(msg_id)
        return [(dead_body_key(msg_id), b"")]

    @property
    def failure(self) -> StorageUnavailable | None:
        return self._writer.failed

    async def close(self) -> None:
        await self._writer.drain()
        self._writer.close()
        self._db.close()

    async def drain(self) -> None:
        await self._writer.drain()

    @property
    def database(self) -> Database:
        return self._db

    def _check(self) -> None:
        """Refuse work while the database is failed, trying a reopen now and then.

        LevelDB stays failed until reopened, and reopening fails too while the cause lasts
        (a full disk); so the store heals itself on the first operation after the cause is
        gone, without an operator, and answers ``StorageUnavailable`` (a 4xx) until then.
        """
        failure = self._writer.failed
        if failure is None:
            return
        now = time.monotonic()
        if now >= self._next_reopen and not self._writer.busy:
            self._next_reopen = now + self.REOPEN_INTERVAL_S
            try:
                self.reopen()
                return
            except StorageUnavailable as exc:
                raise exc from failure
        raise failure

    def _readied(self, oldest: dict[str, bytes]) -> Callable[[], None]:
        """Effect: move each zone's cursor back to its oldest newly ready key."""

        def effect() -> None:
            for zone, key in oldest.items():
                self._cursor_back(zone, key)

        return effect

    def _cursor_back(self, zone: str, key: bytes) -> None:
        """A record of ``zone`` is ready (again): scans must see it, waiters may wake."""
        cursor = self._cursors.get(zone)
        if cursor is not None and key < cursor:
            self._cursors[zone] = key
        if self.on_ready is not None:
            self.on_ready(zone, key)

    def _due_landed(self, zone: str, due_key: bytes) -> Callable[[], None]:
        """Effect of a deferral's due key landing: the zone's due mark moves back to it, and
        its ceiling (``QueueStore._due_ceiling``) lies above it.  On landing, not staging: a
        scan reads the disk, so a key staged but not yet written is not passed over when the
        ceiling is lowered after a scan."""

        def effect() -> None:
            mark = self._due_marks.get(zone)
            if mark is not None and due_key < mark:
                self._due_marks[zone] = due_key
            ceiling = self._due_ceilings.get(zone)
            if ceiling is not None and due_key >= ceiling:
                self._due_ceilings[zone] = due_key + b"\x00"

        return effect

    def _records(
        self, prefix: bytes, *, start: bytes | None = None
    ) -> Iterator[tuple[bytes, Recipient]]:
        """Decoded records under ``prefix`` as the latest staged state shows them, staged
        inserts included (``GroupWriter.scan``: for administrators' reads, not leasing)."""
        for key, value in self._writer.scan(prefix, start=start):
            record = self._decode_record(key, value)
            if record is not None:
                yield key, record

    def _decode_record(self, key: bytes, value: bytes) -> Recipient | None:
        try:
            _, zone, msg_id, address = keys.decode_record(key)
            return Recipient.decode(key, zone, msg_id, address, value)
        except (StorageCorruption, ValueError, UnicodeDecodeError) as exc:
            # Quarantine: report it and go on with the rest of the queue.
            error = exc if isinstance(exc, StorageCorruption) else StorageCorruption(key, str(exc))
            self._quarantine(error)
            return None

    def _quarantine(self, error: StorageCorruption) -> None:
        if all(q.key != error.key for q in self.quarantined):
            self.quarantined.append(error)
            # Once per record: the operator must hear of it (the record stays on disk for
            # inspection; the rest of the queue goes on without it).
            log.error("quarantined a corrupt queue record: %s", error)

    def _event_op(self, event: Event) -> Op:
        return self._event_record_op(event.time_ms, event.to_record())

    def _event_record_op(self, time_ms: int, record: dict[str, object]) -> Op:
        return (keys.event(self._event_ids.next(time_ms)), msgpack.packb(record))

    def _outcome_event(
        self, kind: EventKind, record: Recipient, now_ms: int, outcome: Outcome
    ) -> Op:
        return self._event_op(
            Event(
                kind,
                now_ms,
                record.zone,
                format_id(record.msg_id),
                record.address,
                record.domain,
                id_time_ms(record.msg_id),
                size=outcome.size,
                attempt=record.attempts,
                mx=outcome.mx,
                source_ip=outcome.source_ip,
                code=outcome.code,
                enhanced=outcome.enhanced,
                text=outcome.reply or None,
                possible_duplicate=outcome.possible_duplicate,
                category=outcome.category,
            )
        )

    def _chunk_deletes(self, msg_id: int) -> list[Op]:
        return [(key, None) for key in self._db.keys(prefix=keys.chunk_prefix(msg_id))]

    def _message_deletes(self, msg_id: int) -> list[Op]:
        ops: list[Op] = [(keys.message_head(msg_id), None), (keys.message_meta(msg_id), None)]
        ops.extend(self._chunk_deletes(msg_id))
        return ops

    def _message_removed(self, msg_id: int) -> list[Op]:
        """Writes removing a message whatever its head says (an administrator's delete):
        the head (counted off if there is one), the metadata and every chunk, staged ones
        included (a DSN queued a moment ago may not have landed; nothing would ever find
        its chunks again: the sweep looks at receiving markers only)."""
        if self._writer.read(keys.message_head(msg_id)) is not None:
            self._counters.add(MESSAGES, -1)
        ops = self._message_deletes(msg_id)
        on_disk = {key for key, _ in ops}
        staged = self._writer.staged_inserts(keys.chunk_prefix(msg_id))
        ops.extend((key, None) for key in staged if key not in on_disk)
        # An operator deleting a big message (the first move on a full disk) must get the
        # space back: a delete is a tombstone until a compaction reaches the range.
        ops.extend(self._note_dead_body(msg_id, len(ops) - 2))  # all but head and metadata
        return ops

    def _remove_record(self, queued: QueuedRecipient) -> list[Op]:
        record = queued.recipient
        state = State.READY if queued.state is State.LEASED else queued.state
        key = keys.record(STATE_FAMILY[state], record.zone, record.msg_id, record.address)
        return self._remove_key(key, state, record)

    def _remove_key(self, key: bytes, state: State, record: Recipient | None) -> list[Op]:
        """Writes removing one record, from its key alone if its value cannot be read."""
        _, zone, msg_id, address = keys.decode_record(key)
        # Revoked: the worker's report will be refused (a delivery it reports is still
        # recorded, as an event only: ``AdminMixin.delivered_after_drop``); put back if the
        # delete's batch fails (``_stage_removal``).
        lease = self._leases.get(key)
        if lease is not None:
            del self._leases[key]
            self._revoking[key] = lease
        ops: list[Op] = [(key, None)]
        if state is State.READY and self._hold_marks:
            # A leased one's hold on return goes with it, here where every removal passes
            # (a delete, a purge, an orphan's removal ...): a mark left behind would hold a
            # later record under the same key, or at the next start (``holdmarks.py``).  A
            # revoked lease's stays in memory until the delete lands (``_forget_revoked``):
            # if it fails, the lease is put back, and its attempt's end must find it.
            if lease is None:
                ops.extend(unmark(self._hold_marks, key))
            else:
                ops.extend(unmark_on_disk(self._hold_marks, key))
        if self._retry_marks and lease is None:
            forget(self._retry_marks, key)  # a retry's mark goes with its record too
        if state is State.DEFERRED and record is not None:
            # (A corrupt deferred record leaves its due entry; promote_due drops dangling ones.)
            ops.append((keys.due(zone, record.next_attempt_ms, msg_id, address), None))
        self._counters.move(zone, recipient_domain(address), state, None)
        return ops

    def _stage_removal(self, ops: list[Op]) -> asyncio.Future[None]:
        """Stage an administrator's delete (``_remove_key``'s writes among ``ops``): the
        leases it revoked are forgotten once it lands, and put back if it fails."""
        revoked = [key for key, value in ops if value is None and key in self._revoking]
        landed = functools.partial(self._forget_revoked, revoked) if revoked else None
        return self._writer.submit(ops, sync=False, effect=landed)

    def _forget_revoked(self, revoked: list[bytes]) -> None:
        for key in revoked:
            self._revoking.pop(key, None)
            self._hold_marks.pop(key, None)  # its on-disk mark went with the delete
            forget(self._retry_marks, key)

    def _message_zones(self, msg_id: int) -> tuple[str, ...]:
        """The zones a message has records in, from its metadata or, if that is unreadable,
        every zone with anything queued (so even a damaged message can be found)."""
        meta = self._meta_or_none(msg_id)
        return meta.zones if meta is not None else tuple(sorted(self._counters.zones()))

    def _meta_or_none(self, msg_id: int) -> MessageMeta | None:
        """A message's metadata as the latest staged state shows it; None if it is gone or
        damaged (quarantined: reported once, kept on disk for the operator)."""
        key = keys.message_meta(msg_id)
        value = self._writer.read(key)
        if value is None:
            return None
        try:
            return MessageMeta.decode(key, msg_id, value)
        except StorageCorruption as exc:
            self._quarantine(exc)
            return None

    def _raw_records(self, msg_id: int) -> Iterator[tuple[State, bytes, Recipient | None]]:
        """Every record of a message, decodable or not, as the latest staged state shows:
        a record whose move is still on its way to disk included, or a drop would miss it
        and it would land after its message was gone."""
        for zone in self._message_zones(msg_id):
            for family, state in FAMILY_STATE.items():
                prefix = keys.record_message_prefix(family, zone, msg_id)
                for key, value in self._writer.scan(prefix):
                    yield state, key, self._decode_record(key, value)

    async def _make_ready(self, chosen: Iterable[QueuedRecipient]) -> int:
        ops: list[Op] = []
        oldest: dict[str, bytes] = {}
        moved = 0
        for queued in chosen:
            record = queued.recipient
            ops.extend(self._remove_record(queued))
            self._counters.move(record.zone, record.domain, None, State.READY)
            ready_key = keys.record(keys.READY, record.zone, record.msg_id, record.address)
            fresh = replace(record, next_attempt_ms=0, hold_reason="")
            ops.append((ready_key, fresh.encode()))
            if record.zone not in oldest or ready_key < oldest[record.zone]:
                oldest[record.zone] = ready_key
            moved += 1
        if ops:
            await self._writer.submit(ops, sync=False, effect=self._readied(oldest))
        return moved

    async def _hold_or_mark(
        self, chosen: Iterable[QueuedRecipient], reason: str
    ) -> tuple[int, int]:
        """Hold these recipients: ready and deferred ones now, leased ones when their
        attempt ends undelivered (marked: ``holdmarks.py``); (held now, marked).  Held ones
        are skipped.  A ready one counts as leased if its lease is out now, whatever state
        the caller read it in.

        Everything is decided and staged before the first ``await``, so no lease, outcome
        or release can come between what the caller read and what this marks.
        """
        ops: list[Op] = []
        marked: list[bytes] = []
        held = 0
        for queued in chosen:
            record = queued.recipient
            if queued.state not in (State.READY, State.LEASED, State.DEFERRED):
                continue
            if queued.state is not State.DEFERRED:
                key = keys.record(keys.READY, record.zone, record.msg_id, record.address)
                if key in self._leases:
                    ops.append(mark(self._hold_marks, key, reason))
                    marked.append(key)
                    if self._retry_marks:
                        forget(self._retry_marks, key)  # held on return, not retried
                    continue
            ops.extend(self._remove_record(queued))
            self._counters.move(record.zone, record.domain, None, State.HELD)
            on_hold = replace(record, hold_reason=reason)
            held_key = keys.record(keys.HELD, record.zone, record.msg_id, record.address)
            ops.append((held_key, on_hold.encode()))
            held += 1
        if ops:
            await write_hold(self._writer, self._hold_marks, ops, marked, reason)
        return held, len(marked)

    def _read_head(self, msg_id: int) -> tuple[int, int]:
        """``(created_ms, recipients still queued)``; raises, changing nothing, if it is bad.

        Read before a transition changes anything, so a missing or corrupt head leaves the
        lease, the counters and the record as they were.
        """
        head_key = keys.message_head(msg_id)
        value = self._writer.read(head_key)
        if value is None:
            raise NotFound(f"message {format_id(msg_id)} has no head")
        try:
            return decode_head(head_key, value)
        except StorageCorruption as exc:
            self._quarantine(exc)  # reported once, kept on disk for the operator
            raise

    def _recipients_gone(self, msg_id: int, head: tuple[int, int], gone: int = 1) -> list[Op]:
        """Writes for ``gone`` recipients leaving the queue: the head's count, or the message."""
        created, remaining = head
        if remaining > gone:
            return [(keys.message_head(msg_id), encode_head(created, remaining - gone))]
        self._counters.add(MESSAGES, -1)
        ops = self._message_deletes(msg_id)
        # Delivered or bounced, a big body is as dead as a deleted one: its space comes back
        # only when a compaction reaches it, which the zone marks' ranges do not promise.
        ops.extend(self._note_dead_body(msg_id, len(ops) - 2))  # all but head and metadata
        return ops

    def _current(self, lease: Lease) -> None:
        current = self._leases.get(lease.key)
        if current is None or current.token != lease.token:
            raise LeaseError(
                f"lease {lease.token} for {lease.recipient.address} in zone "
                f"{lease.recipient.zone} is not current (released, expired or taken over)"
            )

    def _ended(self, lease: Lease) -> None:
        """``_current``, for a report that ends ``lease`` undelivered (deferred, bounced,
        held, returned).  Refused because a delete still being written revoked it, it is
        over all the same: nothing of it is on the wire any more, so should that delete
        fail, ``_put_back_revoked`` must not lease the record to a worker that has moved
        on (nobody would report it again, and it would never be handed out); it is left
        ready instead, to be tried again.  A delivery keeps its revoked lease: its record
        is completed after the heal (``AdminMixin._delivered_again``)."""
        try:
            self._current(lease)
        except LeaseError:
            revoked = self._revoking.get(lease.key)
            if revoked is not None and revoked.token == lease.token:
                del self._revoking[lease.key]
            raise

    def _take(self, lease: Lease) -> None:
        self._current(lease)
        del self._leases[lease.key]

    def holds(self, lease: Lease) -> bool:
        """Whether ``lease`` is still current (not released, revoked or taken over)."""
        current = self._leases.get(lease.key)
        return current is not None and current.token == lease.token

    def is_leased(self, key: bytes) -> bool:
        """Whether the ready record at ``key`` is handed to a worker right now."""
        return key in self._leases

    def leased(self, zone: str | None = None) -> int:
        if zone is None:
            return len(self._leases)
        return self._leases.in_zone(zone)
