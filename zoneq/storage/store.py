"""The queue store: a message's life in LevelDB, as operations.

Theory of operation
-------------------
The layout is ZoneMTA's (see ``keys.py``): a body as ordered chunk keys, a ``#`` head and a
``*`` metadata key per message, one record per (zone, message, recipient).  The lifecycle is
Kannader's: ``begin`` / ``write_chunk`` while DATA streams, ``commit`` before the ``250``,
``lease`` to a worker, then exactly one of ``complete``, ``defer``, ``bounce``, ``release``
or ``hold_leased`` for the lease; ``drop``, ``hold``, ``unhold`` and ``retry_now`` for
administrators; ``promote_due`` to bring deferred recipients back; ``recover`` and ``sweep``
for garbage.  Every transition is one atomic batch (through :class:`GroupWriter`) that also
writes its events and counter changes.

One departure from ZoneMTA: a recipient's record lives in exactly one of three families by
state, ``delivery-zone`` (ready), ``deferred`` (plus a ``due`` index by next-attempt time) and
``held``.  With a single family the lease scan has to step over every deferred recipient
again and again (ZoneMTA's scanner did), which turns a down destination with a million
deferred recipients into a million skips per scan.  Here the ready family holds only what can
be sent, so a scan skips at most the recipients that are leased right now.

Leases are in memory only: a core that dies loses them, so at start-up everything that was
in flight is simply ready again (at-least-once, as Postfix and ZoneMTA).  A lease carries a
token; a report with a token that is not the current one is refused (``LeaseError``).

Low-water marks: deleted keys stay as tombstones until compaction, and after 900k deliveries
a seek to the start of a zone was measured at ~500 ms.  So each zone keeps a cursor, the
smallest key that may hold a ready record that is not leased; scans start there, every
transition that makes a record ready moves the cursor back to it (once durable), and
:meth:`compact` compacts the deleted range behind the cursor with an explicit range.

Everything here runs on the event loop thread; only the group writer's thread touches the
database for writes.  Reads go through the writer's overlay so they see staged writes.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from zoneq.errors import LeaseError, NotFound, StorageCorruption
from zoneq.protocol.events import EventKind, event_record
from zoneq.protocol.ids import format_id, id_time_ms
from zoneq.storage import keys
from zoneq.storage.admin import AdminMixin
from zoneq.storage.base import (
    READY_STATE,
    Lease,
    Outcome,
    QueuedRecipient,
    log,
    ready_prefix,
    run_all,
)
from zoneq.storage.bulk import BulkMixin
from zoneq.storage.counters import MESSAGES, domain_key, zone_key
from zoneq.storage.held import Held, HeldMixin, notice_size
from zoneq.storage.holdmarks import unmark
from zoneq.storage.leveldb import Database, Op
from zoneq.storage.maintenance import MaintenanceMixin
from zoneq.storage.moves import MovesMixin
from zoneq.storage.owed import Owed, OwedMixin
from zoneq.storage.records import (
    MessageMeta,
    NewRecipient,
    Notice,
    Recipient,
    State,
    encode_head,
    new_record_value,
    recipient_domain,
)
from zoneq.storage.retrymarks import due_now, forget
from zoneq.storage.space import SpaceGuard
from zoneq.storage.stepback import step_back_bound
from zoneq.storage.writer import GroupWriter


class LeaseScan(list[Lease]):
    """What one lease scan leased, and ``last_key``: the last key it read (None if it read
    none), where a scan that ``accept`` turned records down in may go on from next time."""

    def __init__(self, leases: Iterable[Lease] = (), last_key: bytes | None = None) -> None:
        super().__init__(leases)
        self.last_key = last_key


@dataclass(frozen=True, slots=True)
class DroppedRecipient:
    """A recipient a plugin dropped while the message was received: accepted (the client
    was told 250), never queued, and recorded by one DROPPED event in the commit's batch.
    ``zone`` is the zone routing gave it; ``reason`` becomes the event's text."""

    address: str
    zone: str
    reason: str


class QueueStore(AdminMixin, BulkMixin, MovesMixin, MaintenanceMixin, HeldMixin, OwedMixin):
    """The LevelDB queue of one zoneq node.  Create with :meth:`open`, then :meth:`recover`."""

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        sync_commits: bool = True,
        chunk_size: int = 65_536,
        min_free: int = 0,
        reserve: int = 0,
    ) -> QueueStore:
        """Open (creating) the queue at ``path``; ``min_free`` and ``reserve`` in bytes are the
        free-space floor for new mail and the recovery reserve (``space.py``), 0 for none."""
        db = Database(path)
        space = SpaceGuard(db.path, min_free=min_free, reserve=reserve)
        return cls(db, sync_commits=sync_commits, chunk_size=chunk_size, space=space)

    def begin(self, now_ms: int, size_hint: int = 0) -> int:
        """A new message id for a DATA (or API submission) about to stream in.

        Raises ``InsufficientStorage`` (answer 452 4.3.1) when free space is below the floor;
        ``size_hint`` is the client's SIZE= declaration (RFC 1870) when it gave one.
        """
        self._check()
        self.space.admit(size_hint)
        msg_id = self._ids.next(now_ms)
        self._receiving[msg_id] = 0
        return msg_id

    async def write_chunk(self, msg_id: int, index: int, data: bytes) -> None:
        """Store body chunk ``index`` (unsynced: the commit's sync makes it durable).

        Raises ``InsufficientStorage`` (452 4.3.1 for this message) when the chunk would take
        free space below the floor: a client need not declare SIZE= (RFC 1870 makes it
        optional), so ``begin`` alone cannot keep a big message from filling the disk.
        """
        self._check()
        self.space.admit_write(len(data))
        ops: list[Op] = [(keys.message_chunk(msg_id, index), data)]
        if index == 0:
            # The marker goes in the same batch as the first chunk, so no chunk is ever on
            # disk without it: the sweep finds every orphan by scanning markers only.
            ops.append((keys.receiving(msg_id), b""))
        staged = self._receiving.get(msg_id)
        if staged is not None and index >= staged:
            self._receiving[msg_id] = index + 1
        await self._writer.submit(ops, sync=False)

    def commit(
        self,
        meta: MessageMeta,
        recipients: Sequence[NewRecipient],
        now_ms: int,
        *,
        tail: bytes | None = None,
        dropped: Sequence[DroppedRecipient] = (),
    ) -> asyncio.Future[None]:
        """Stage a received message and its recipients; await the result: it resolves once
        they are durable (synced), and only then may the client be told 250.

        ``tail`` is the last body chunk (index ``meta.chunks - 1``) if the caller has not
        written it yet: a message that fits in one chunk then costs one batch, not two.
        A plain function returning the writer's future, not a coroutine: this is the
        busiest path, and the frame was measurable.  If it fails (raising here or in the
        future), the message is still being received: the caller abandons it and answers
        4xx.

        ``dropped``: recipients a plugin dropped (issue 5: "dropped with an event"), one
        DROPPED event each in the same batch, so the events exist exactly when the client
        was told 250.  With no ``recipients`` left the message is not stored at all: the
        batch holds only those events and removes the chunks written so far.
        """
        self._check()
        self.space.admit()
        msg_id = meta.msg_id
        if recipients:
            ops, ready = self._message_ops(meta, recipients, now_ms)
            if tail is not None:
                ops.append((keys.message_chunk(msg_id, meta.chunks - 1), tail))
        elif dropped:
            ops, ready = self._chunks_gone(msg_id), {}
        else:
            raise ValueError("a message needs at least one recipient")
        if dropped:
            ops.extend(self._dropped_ops(meta, dropped, now_ms))
        ops.append((keys.receiving(msg_id), None))

        def landed() -> None:
            self._receiving.pop(msg_id, None)
            for zone, key in ready.items():
                self._cursor_back(zone, key)

        def failed(future: asyncio.Future[None]) -> None:
            if future.cancelled() or future.exception() is not None:
                self._failed_commits[msg_id] = now_ms

        # Not visible before it is durable: nothing reads a message being committed (it
        # becomes leasable only once it has landed).
        landing = self._writer.submit(ops, sync=self.sync_commits, effect=landed, visible=False)
        landing.add_done_callback(failed)
        return landing

    async def abandon(self, msg_id: int) -> None:
        """The client went away mid-DATA (or the message was refused): remove its chunks.

        The message stops being "still streaming" whatever happens here: if the store is
        failed (or this write fails), its receiving marker stays on disk and the reopen's
        recovery or the next sweep after the DATA timeout removes the chunks.  Left in
        ``_receiving`` they would be skipped as live until a restart.
        """
        try:
            self._check()
            ops = self._chunks_gone(msg_id)
        finally:
            self._receiving.pop(msg_id, None)
        chunks = len(ops)  # every chunk staged or on disk (``_chunks_gone``)
        ops.append((keys.receiving(msg_id), None))
        ops.extend(self._note_dead_body(msg_id, chunks))
        await self._writer.submit(ops, sync=False)

    def _chunks_gone(self, msg_id: int) -> list[Op]:
        """Deletes of every chunk of a message being received: those staged (not on disk
        yet) and those on disk."""
        staged = self._receiving.get(msg_id, 0)
        doomed = {keys.message_chunk(msg_id, index) for index in range(staged)}
        doomed.update(key for key, _ in self._chunk_deletes(msg_id))
        return [(key, None) for key in sorted(doomed)]

    def _dropped_ops(
        self, meta: MessageMeta, dropped: Sequence[DroppedRecipient], now_ms: int
    ) -> list[Op]:
        """One DROPPED event per recipient a plugin dropped at receive time."""
        mid = format_id(meta.msg_id)
        queued_at = id_time_ms(meta.msg_id)
        return [
            self._event_record_op(
                now_ms,
                event_record(
                    EventKind.DROPPED,
                    now_ms,
                    d.zone,
                    mid,
                    recipient=d.address,
                    domain=recipient_domain(d.address),
                    queued_at_ms=queued_at,
                    size=meta.size,
                    text=d.reason,
                ),
            )
            for d in dropped
        ]

    def _message_ops(
        self, meta: MessageMeta, recipients: Sequence[NewRecipient], now_ms: int
    ) -> tuple[list[Op], dict[str, bytes]]:
        """The writes that queue a message, and each zone's oldest new ready key.

        This is the hot path of both SMTP acceptance and bulk submission (a list message
        may have 10,000 recipients), so per-recipient work is kept to one key and a cached
        value: the record of a new recipient depends only on its domain and DSN parameters.
        """
        if not recipients:
            raise ValueError("a message needs at least one recipient")
        msg_id = meta.msg_id
        id_bytes = keys.u64(msg_id)
        ops: list[Op] = []
        append = ops.append
        text = keys.text
        # Per zone: the key prefix of this message, and recipients per domain.
        zones: dict[str, tuple[bytes, dict[str, int]]] = {}
        seen: set[bytes] = set()
        last_zone: str | None = None
        prefix = b""
        domains: dict[str, int] = {}
        for rcpt in recipients:
            zone = rcpt.zone
            if zone != last_zone:  # almost every message has a single zone
                entry = zones.get(zone)
                if entry is None:
                    entry = zones[zone] = (ready_prefix(zone) + id_bytes, {})
                prefix, domains = entry
                last_zone = zone
            address = rcpt.address
            key = prefix + text(address)
            if key in seen:
                continue  # a recipient given twice is delivered once (as Postfix does)
            seen.add(key)
            _, at, domain = address.rpartition("@")  # records.recipient_domain, inlined
            domain = domain.lower() if at else ""
            append((key, new_record_value(domain, rcpt.notify, rcpt.orcpt)))
            domains[domain] = domains.get(domain, 0) + 1
        ops.extend(self._accepted_ops(meta, now_ms, zones))
        self._counters.add(MESSAGES, 1)
        ops.append((keys.message_head(msg_id), encode_head(now_ms, len(seen))))
        ops.append((keys.message_meta(msg_id), meta.encode(tuple(zones), len(seen))))
        # The low-water target of each zone: the message's own prefix, which sorts before
        # every key this commit adds to that zone and after every older message's.
        return ops, {zone: entry[0] for zone, entry in zones.items()}

    def _accepted_ops(
        self, meta: MessageMeta, now_ms: int, zones: dict[str, tuple[bytes, dict[str, int]]]
    ) -> list[Op]:
        """Counter changes and one ACCEPTED event per zone for a commit."""
        add = self._counters.add
        queued_at = id_time_ms(meta.msg_id)
        mid = format_id(meta.msg_id)
        ops: list[Op] = []
        for zone, (_, per_domain) in zones.items():
            total = 0
            for domain, n in per_domain.items():
                add(domain_key(zone, domain, READY_STATE), n)
                total += n
            add(zone_key(zone, READY_STATE), total)
            record = event_record(
                EventKind.ACCEPTED,
                now_ms,
                zone,
                mid,
                recipient="",
                domain="",
                queued_at_ms=queued_at,
                size=meta.size,
                recipients=total,
            )
            ops.append(self._event_record_op(now_ms, record))
        return ops

    def lease(
        self,
        zone: str,
        limit: int,
        owner: str,
        *,
        accept: Callable[[Recipient], bool] | None = None,
        after: bytes | None = None,
    ) -> LeaseScan:
        """Lease up to ``limit`` ready recipients of ``zone``, oldest message first.

        ``accept`` lets the scheduler pass over a recipient (say its domain is at its
        connection limit) without moving the zone's cursor past it.  ``after``: scan only
        the keys after this one (the caller turned down everything before it moments ago),
        leaving the cursor where it is; the result's ``last_key`` says where the scan
        stopped.  While the database cannot write, leasing goes on from the failed handle
        (``held.py``).
        """
        if self._writer.failed is not None:
            limit = self._may_lease_while_failed(limit)
        prefix = keys.zone_prefix(keys.READY, zone)
        start = self._cursors.get(zone, prefix)
        if after is not None:
            start = max(start, after + b"\x00")  # the next possible key after ``after``
        stop = keys.prefix_upper_bound(prefix)
        leases = LeaseScan()
        passed_over: bytes | None = None
        last: bytes | None = None
        pending = self._writer.pending
        missing = GroupWriter.MISSING
        for key, durable in self._db.items(start=start, stop=stop):
            last = key
            if key in self._leases:
                continue
            staged = pending(key)
            if staged is None:
                continue  # a staged delete: on its way out
            value = durable if staged is missing else staged
            assert isinstance(value, bytes)
            record = self._decode_record(key, value)
            if record is None:
                continue
            if accept is not None and not accept(record):
                if passed_over is None:
                    passed_over = key
                continue
            lease = Lease(next(self._tokens), key, record, owner)
            self._leases[key] = lease
            leases.append(lease)
            if len(leases) >= limit:
                break
        if after is None:  # (with ``after``, what lies before it is not known: it stays)
            if passed_over is not None:
                self._cursors[zone] = passed_over
            elif last is not None:
                self._cursors[zone] = last + b"\x00"  # the next possible key after ``last``
        leases.last_key = last
        return leases

    def release(self, lease: Lease) -> None:
        """Give a lease back unchanged (the worker did not try): ready again at once, or
        held if its message was held meanwhile (``holdmarks.py``)."""
        self._ended(lease)  # refused if revoked, before anything changes
        if self._hold_marks and lease.key in self._hold_marks:
            # Still leased until the task below stages the hold: never handed out meanwhile.
            hold = self.hold_leased(lease, self._hold_marks[lease.key], 0)
            task = asyncio.get_running_loop().create_task(hold)
            self._replays.add(task)  # drained with the held outcomes' replays
            task.add_done_callback(self._replays.discard)
            task.add_done_callback(_released_held)
            return
        del self._leases[lease.key]
        if self._retry_marks:  # ready again at once: nothing left for a retry to do
            forget(self._retry_marks, lease.key)
        self._cursor_back(lease.recipient.zone, lease.key)

    def release_owner(self, owner: str) -> int:
        """Return every lease of ``owner`` (its connection dropped); how many.  Those a
        delete still being written revoked are over too (``_ended``): nobody will report
        them, so a failed delete must leave their records ready, not leased to nobody."""
        for key in [key for key, lease in self._revoking.items() if lease.owner == owner]:
            del self._revoking[key]
        mine = [lease for lease in self._leases.values() if lease.owner == owner]
        for lease in mine:
            self.release(lease)
        return len(mine)

    async def complete(
        self, lease: Lease, now_ms: int, outcome: Outcome, *, notice: Notice | None = None
    ) -> None:
        """Delivered: the recipient leaves the queue (and the message with its last one).

        ``notice``: a "relayed" DSN to queue (RFC 3461 section 5.2.2), committed in the same
        batch as the completion, as ``bounce`` does with its DSN.
        """
        replay = functools.partial(self.complete, lease, now_ms, outcome, notice=notice)
        held = Held(lease, replay, notice_size(notice))
        if self._hold_if_failed(held):
            return
        self._current(lease)  # a stale lease is refused before anything else is looked at
        head = self._outcome_head(lease)
        record = lease.recipient.after_attempt(now_ms, outcome.reply)
        ops: list[Op] = [(lease.key, None)]
        ops.append(self._outcome_event(EventKind.DELIVERED, record, now_ms, outcome))
        self._counters.move(record.zone, record.domain, State.READY, None)
        if head is not None:
            ops.extend(self._recipients_gone(record.msg_id, head))
        if self._hold_marks:  # delivered: a hold on return has nothing left to hold
            ops.extend(unmark(self._hold_marks, lease.key))
        if self._retry_marks:  # nor a retry anything to retry
            forget(self._retry_marks, lease.key)
        if notice is None:
            await self._write_outcome(held, ops, sync=False)
            return
        notice_ops, ready = self._notice_ops(notice, now_ms)
        ops.extend(notice_ops)
        await self._write_outcome(held, ops, sync=True, effect=self._readied(ready))

    async def defer(
        self,
        lease: Lease,
        now_ms: int,
        next_attempt_ms: int,
        outcome: Outcome,
        *,
        delay_notice: Notice | None = None,
    ) -> None:
        """A temporary failure: wait in ``deferred`` until ``next_attempt_ms``.

        ``delay_notice``: an RFC 3461 NOTIFY=DELAY notice to queue in the same batch; the
        record then remembers it was sent, so a recipient gets at most one.
        """
        replay = functools.partial(
            self.defer, lease, now_ms, next_attempt_ms, outcome, delay_notice=delay_notice
        )
        held = Held(lease, replay, notice_size(delay_notice))
        if self._hold_if_failed(held):
            return
        self._ended(lease)
        if self._hold_marks and lease.key in self._hold_marks:
            # Its message was held while it was on the wire: held, not deferred.
            reason = self._hold_marks[lease.key]
            await self._held_at_end(held, reason, now_ms, outcome, delay_notice)
            return
        # An administrator's retry came while this was on the wire (``retrymarks.py``):
        # ready again at once, this attempt on record (its event, its count).
        retry = bool(self._retry_marks) and due_now(self._retry_marks, lease)
        record = lease.recipient.after_attempt(
            now_ms, outcome.reply, 0 if retry else next_attempt_ms
        )
        if delay_notice is not None:
            record = replace(record, delay_notified=True)
        effects: list[Callable[[], None]]
        if retry:
            ops: list[Op] = [(lease.key, record.encode())]
            effects = [self._readied({record.zone: lease.key})]
        else:
            ops = [(lease.key, None), *self._defer_ops(record)]
            self._counters.move(record.zone, record.domain, State.READY, State.DEFERRED)
            due_key = keys.due(record.zone, next_attempt_ms, record.msg_id, record.address)
            effects = [self._due_landed(record.zone, due_key)]
        ops.append(self._outcome_event(EventKind.DEFERRED, record, now_ms, outcome))
        if delay_notice is not None:
            notice_ops, ready = self._notice_ops(delay_notice, now_ms)
            ops.extend(notice_ops)
            ops.append(self._outcome_event(EventKind.DELAYED, record, now_ms, outcome))
            effects.append(self._readied(ready))
        await self._write_outcome(
            held,
            ops,
            sync=delay_notice is not None,
            effect=run_all(effects) if len(effects) > 1 else effects[0],
        )

    async def hold_leased(
        self, lease: Lease, reason: str, now_ms: int, outcome: Outcome | None = None
    ) -> None:
        """End a lease by holding its recipient (``outcome``: the failed attempt, written
        with its DEFERRED event; None: returned untried, ``now_ms`` unused).  How a marked
        lease ends undelivered (``holdmarks.py``), and how a damaged message's lease ends
        (``QueueService``'s quarantine).  Removes the lease's mark, if it has one."""
        held = Held(lease, functools.partial(self.hold_leased, lease, reason, now_ms, outcome))
        if self._hold_if_failed(held):
            return
        self._ended(lease)
        await self._held_at_end(held, reason, now_ms, outcome)

    def _held_at_end(
        self,
        held: Held,
        reason: str,
        now_ms: int,
        outcome: Outcome | None,
        delay_notice: Notice | None = None,
    ) -> Awaitable[None]:
        """Stage the hold that ends ``held``'s lease (the lease checked current)."""
        lease = held.lease
        record = lease.recipient
        if outcome is not None:
            record = record.after_attempt(now_ms, outcome.reply)
        if delay_notice is not None:
            record = replace(record, delay_notified=True)
        record = replace(record, hold_reason=reason)
        held_key = keys.record(keys.HELD, record.zone, record.msg_id, record.address)
        ops: list[Op] = [(lease.key, None), (held_key, record.encode())]
        ops.extend(unmark(self._hold_marks, lease.key))
        if self._retry_marks:  # a hold wins over a retry (``retrymarks.py``)
            forget(self._retry_marks, lease.key)
        if outcome is not None:
            ops.append(self._outcome_event(EventKind.DEFERRED, record, now_ms, outcome))
        self._counters.move(record.zone, record.domain, State.READY, State.HELD)
        effect = None
        if delay_notice is not None and outcome is not None:
            # The delay was real (RFC 3461 section 4.1): the sender is told all the same.
            notice_ops, ready = self._notice_ops(delay_notice, now_ms)
            ops.extend(notice_ops)
            ops.append(self._outcome_event(EventKind.DELAYED, record, now_ms, outcome))
            effect = self._readied(ready)
        return self._write_outcome(held, ops, sync=delay_notice is not None, effect=effect)

    async def bounce(
        self,
        lease: Lease,
        now_ms: int,
        outcome: Outcome,
        *,
        expired: bool = False,
        notice: Notice | None = None,
        owed: Owed | None = None,
    ) -> None:
        """A permanent failure (or give-up): the recipient leaves the queue.

        ``notice`` is the DSN to queue, or ``owed`` the record that one is owed, which the
        queue service composes with the message's other failures (``owed.py``); either is
        committed in the same batch as the bounce, so a crash can neither lose the DSN nor
        queue it twice.
        """
        replay = functools.partial(
            self.bounce, lease, now_ms, outcome, expired=expired, notice=notice, owed=owed
        )
        held = Held(lease, replay, notice_size(notice) + (owed.size if owed else 0))
        if self._hold_if_failed(held):
            return
        self._ended(lease)  # a stale lease is refused before anything else is looked at
        head = self._outcome_head(lease)
        record = lease.recipient.after_attempt(now_ms, outcome.reply)
        kind = EventKind.EXPIRED if expired else EventKind.BOUNCED
        ops: list[Op] = [(lease.key, None)]
        ops.append(self._outcome_event(kind, record, now_ms, outcome))
        self._counters.move(record.zone, record.domain, State.READY, None)
        if head is not None:
            ops.extend(self._recipients_gone(record.msg_id, head))
        if self._hold_marks:  # bounced (its DSN is owed whatever the hold): done
            ops.extend(unmark(self._hold_marks, lease.key))
        if self._retry_marks:
            forget(self._retry_marks, lease.key)
        effect = None
        if notice is not None:
            notice_ops, ready = self._notice_ops(notice, now_ms)
            ops.extend(notice_ops)
            effect = self._readied(ready)
        if owed is not None:
            ops.extend(self._owed_ops(record.msg_id, owed))
        durable = notice is not None or owed is not None
        await self._write_outcome(held, ops, sync=durable, effect=effect)

    def _outcome_head(self, lease: Lease) -> tuple[int, int] | None:
        """The head of the message a final outcome is about, or None if it is missing or
        corrupt (quarantined: reported once, and kept on disk for an operator).

        The outcome is written all the same: the recipient was delivered (or bounced) and
        must leave the queue with its event, or it would be sent again after every restart
        (a lease the store kept, a report that failed, a worker that died of it).  Only the
        count of recipients left goes unwritten, so the message's other keys stay after
        its last recipient, in quarantine, for the operator to inspect and delete.
        """
        msg_id = lease.recipient.msg_id
        try:
            return self._read_head(msg_id)
        except NotFound:
            self._quarantine(StorageCorruption(keys.message_head(msg_id), "missing"))
        except StorageCorruption:
            pass  # quarantined by _read_head
        log.error(
            "message %s: its head is damaged; the outcome for %s is written, the message "
            "stays in quarantine",
            format_id(msg_id),
            lease.recipient.address,
        )
        return None

    def check_body(self, msg_id: int) -> None:
        """Raise ``StorageCorruption`` (quarantined) if the stored body is not whole: a chunk
        missing, or the chunks' lengths not adding up to the metadata's ``size`` (a torn or
        lost write; chunks carry no checksum, so a length is what can be checked).

        Reads the whole body: for a worker's local fault only (``QueueService.report``),
        never on the delivery path.  ``NotFound`` if the message is gone.
        """
        meta = self.message(msg_id)
        stored = 0
        for index in range(meta.chunks):
            try:
                stored += len(self.chunk(msg_id, index))  # past the block cache
            except NotFound:
                key = keys.message_chunk(msg_id, index)
                error = StorageCorruption(key, f"chunk {index} of {meta.chunks} is missing")
                break
        else:
            if stored == meta.size:
                return
            error = StorageCorruption(
                keys.message_meta(msg_id), f"body is {stored} octets, not {meta.size}"
            )
        self._quarantine(error)
        raise error

    def _notice_ops(self, notice: Notice, now_ms: int) -> tuple[list[Op], dict[str, bytes]]:
        """A generated message (a DSN), whole: it is small, so it goes in one batch."""
        step = self.chunk_size
        body = notice.body
        meta = replace(
            notice.meta,
            msg_id=self._ids.next(now_ms),
            size=len(body),
            chunks=-(-len(body) // step),
        )
        ops, ready = self._message_ops(meta, notice.recipients, now_ms)
        for index in range(meta.chunks):
            chunk = body[index * step : (index + 1) * step]
            ops.append((keys.message_chunk(meta.msg_id, index), chunk))
        return ops, ready

    def _defer_ops(self, record: Recipient) -> list[Op]:
        return [
            (
                keys.record(keys.DEFERRED, record.zone, record.msg_id, record.address),
                record.encode(),
            ),
            (keys.due(record.zone, record.next_attempt_ms, record.msg_id, record.address), b""),
        ]

    async def promote_due(
        self, zone: str, now_ms: int, limit: int = 10_000, *, longest_ms: int | None = None
    ) -> int:
        """Move recipients whose next attempt is due back to ready; how many were moved.

        ``longest_ms``: the zone's longest retry interval.  Given, recipients due further
        ahead than a forward-moving clock allows are promoted too: the wall clock stepped
        back since they were deferred (``stepback.py``).  That costs nothing while no due
        time lies that far ahead (an upper bound kept in memory), one reverse seek the
        first time per zone, and one scan of those recipients when it does.
        """
        self._check()
        prefix = keys.zone_prefix(keys.DUE, zone)
        start = self._due_marks.get(zone, prefix)
        stop = prefix + keys.u64(now_ms + 1)
        ops: list[Op] = []
        ready: list[bytes] = []
        last = self._promote_keys(zone, self._db.keys(start=start, stop=stop), ops, ready, limit)
        if last is not None:
            self._due_marks[zone] = last + b"\x00"
        if longest_ms is not None and len(ready) < limit:
            bound = prefix + keys.u64(step_back_bound(now_ms, longest_ms))
            self._promote_stepped_back(zone, bound, ops, ready, limit)
        if ops:
            oldest = {zone: min(ready)} if ready else {}
            await self._writer.submit(ops, sync=False, effect=self._readied(oldest))
        return len(ready)

    def _promote_keys(
        self, zone: str, due_keys: Iterable[bytes], ops: list[Op], ready: list[bytes], limit: int
    ) -> bytes | None:
        """Stage the move to ready of the recipients of ``due_keys`` (into ``ops``, their
        ready keys into ``ready``) until ``ready`` holds ``limit``; the last key read."""
        last: bytes | None = None
        for due_key in due_keys:
            last = due_key
            if self._writer.pending(due_key) is None:
                continue  # staged delete (dropped or retried already)
            _, _, msg_id, address = keys.decode_due(due_key)
            deferred_key = keys.record(keys.DEFERRED, zone, msg_id, address)
            value = self._writer.read(deferred_key)
            ops.append((due_key, None))
            if value is None:
                continue  # a dangling index entry: just remove it
            record = self._decode_record(deferred_key, value)
            if record is None:
                continue
            ready_key = keys.record(keys.READY, zone, msg_id, address)
            ops.append((deferred_key, None))
            ops.append((ready_key, record.encode()))
            self._counters.move(zone, record.domain, State.DEFERRED, State.READY)
            ready.append(ready_key)
            if len(ready) >= limit:
                break
        return last

    def _promote_stepped_back(
        self, zone: str, bound: bytes, ops: list[Op], ready: list[bytes], limit: int
    ) -> None:
        """Stage the promotion of the recipients due at or after ``bound`` (a due key
        prefix): times no forward-moving clock can have set by now."""
        prefix = keys.zone_prefix(keys.DUE, zone)
        if self._due_ceiling(zone, prefix) <= bound:
            return  # the common case: nothing lies that far ahead, and no seek is made
        # Below the due mark nothing is left but what ``_due_landed`` moved it back for.
        start = max(bound, self._due_marks.get(zone, prefix))
        before = len(ready)
        due_keys = self._db.keys(start=start, stop=keys.prefix_upper_bound(prefix))
        self._promote_keys(zone, due_keys, ops, ready, limit)
        if len(ready) < limit:
            # All of them staged: the next call need not look again, nor step over their
            # tombstones (0.4 us each until compaction: 400 ms a call for a million).
            self._due_ceilings[zone] = bound
        if len(ready) > before:
            log.warning(
                "zone %s: %d deferred recipients were due further ahead than the longest retry "
                "interval (the wall clock stepped back); they are ready now",
                zone,
                len(ready) - before,
            )

    def _due_ceiling(self, zone: str, prefix: bytes) -> bytes:
        """A key above every live due key of ``zone`` (``prefix``): kept in memory, raised by
        every deferral that lands (``_due_landed``), and found by one reverse seek the first
        time (the keys the last run left)."""
        ceiling = self._due_ceilings.get(zone)
        if ceiling is None:
            top = next(self._db.keys(prefix=prefix, reverse=True), None)
            ceiling = prefix if top is None else top + b"\x00"
            self._due_ceilings[zone] = ceiling
        return ceiling

    def next_due(self, zone: str) -> int | None:
        """When the zone's earliest deferred recipient is due (ms), or None."""
        prefix = keys.zone_prefix(keys.DUE, zone)
        start = self._due_marks.get(zone, prefix)
        for due_key in self._db.keys(start=start, stop=keys.prefix_upper_bound(prefix)):
            if self._writer.pending(due_key) is None:
                continue
            return keys.decode_due(due_key)[1]
        return None


def new_recipients(addresses: Iterable[tuple[str, str]]) -> tuple[NewRecipient, ...]:
    """``(address, zone)`` pairs as commit input (tests and tools)."""
    return tuple(NewRecipient(address=a, zone=z) for a, z in addresses)


__all__ = [
    "DroppedRecipient",
    "Lease",
    "LeaseScan",
    "Outcome",
    "QueueStore",
    "QueuedRecipient",
    "new_recipients",
]


def _released_held(task: asyncio.Task[None]) -> None:
    """A job given back and held on return (``QueueStore.release``): a lease revoked
    meanwhile (the message deleted) leaves nothing to hold; anything else is logged."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, LeaseError):
        log.error("a recipient given back was not held: %s", exc)
