"""Reads and administrators' operations on the queue store: browse, drop, hold, retry."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import Counter
from collections.abc import Iterator, Sequence

from zoneq.errors import NotFound, StorageCorruption, StorageUnavailable
from zoneq.protocol.domains import normal_domain
from zoneq.protocol.events import Event, EventKind
from zoneq.protocol.ids import format_id, id_time_ms
from zoneq.storage import keys, retrymarks
from zoneq.storage.base import (
    FAMILY_STATE,
    STATE_FAMILY,
    Lease,
    Outcome,
    QueuedRecipient,
    StoreBase,
    log,
)
from zoneq.storage.counters import MESSAGES, domain_key, zone_key
from zoneq.storage.held import Held
from zoneq.storage.holdmarks import unmark_message
from zoneq.storage.leveldb import Op
from zoneq.storage.owed import owed_deletes
from zoneq.storage.records import (
    MessageMeta,
    Recipient,
    State,
    domain_is,
    recipient_domain,
)
from zoneq.storage.writer import GroupWriter


def _retrieved(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # read, so asyncio does not log it as never retrieved


def same_mailbox(stored: str, given: str) -> bool:
    """Whether an administrator's ``given`` address names the ``stored`` recipient.

    RFC 5321 section 2.4: the domain part is case-insensitive, while the local part may be
    case-sensitive (only the destination host may fold it), so it is compared exactly.
    A U-label domain and its A-label are one domain (``normal_domain``).
    """
    local, at, domain = stored.rpartition("@")
    given_local, given_at, given_domain = given.rpartition("@")
    if not at or not given_at:
        return stored == given
    return local == given_local and normal_domain(domain) == normal_domain(given_domain)


def _scope(family: bytes, zone: str, msg_id: int | None) -> bytes:
    """The key prefix of a zone's records in ``family``, or of one message's there."""
    if msg_id is None:
        return keys.zone_prefix(family, zone)
    return keys.record_message_prefix(family, zone, msg_id)


class AdminMixin(StoreBase):
    def message(self, msg_id: int) -> MessageMeta:
        key = keys.message_meta(msg_id)
        value = self._writer.read(key)
        if value is None:
            raise NotFound(f"no message {format_id(msg_id)}")
        try:
            return MessageMeta.decode(key, msg_id, value)
        except StorageCorruption as exc:
            self._quarantine(exc)  # reported once, kept on disk for the operator
            raise

    def recipients(self, msg_id: int) -> list[QueuedRecipient]:
        """Every queued recipient of a message with its state (leased ones as LEASED)."""
        meta = self.message(msg_id)
        found: list[QueuedRecipient] = []
        for zone in meta.zones:
            for family, state in FAMILY_STATE.items():
                for key, record in self._records(keys.record_message_prefix(family, zone, msg_id)):
                    if state is State.READY and key in self._leases:
                        state_now = State.LEASED
                    else:
                        state_now = state
                    found.append(QueuedRecipient(state_now, record))
        return found

    def body(self, msg_id: int) -> Iterator[bytes]:
        """The stored body, chunk by chunk (never the whole message in memory)."""
        for _, value in self._db.items(prefix=keys.chunk_prefix(msg_id), fill_cache=False):
            yield value

    def chunk(self, msg_id: int, index: int) -> bytes:
        """One body chunk, read past the block cache (each is read once per delivery)."""
        key = keys.message_chunk(msg_id, index)
        staged = self._writer.pending(key)
        if staged is GroupWriter.MISSING:
            value = self._db.get(key, fill_cache=False)
        else:
            value = staged if isinstance(staged, bytes) else None
        if value is None:
            raise NotFound(f"message {format_id(msg_id)} has no chunk {index}")
        return value

    def browse(
        self, zone: str, state: State = State.READY, *, after: bytes | None = None, limit: int = 100
    ) -> tuple[list[Recipient], bytes | None]:
        """One page of a zone in key order and the key to pass as ``after`` for the next
        page (None at the end): any depth costs one seek per page, never a skip from the top.
        """
        if state is State.LEASED:
            return self._leased_page(zone, after, limit)
        prefix = keys.zone_prefix(STATE_FAMILY[state], zone)
        start = prefix if after is None else after + b"\x00"
        page: list[Recipient] = []
        for key, record in self._records(prefix, start=start):
            page.append(record)
            if len(page) >= limit:
                return page, key
        return page, None

    def _leased_page(
        self, zone: str, after: bytes | None, limit: int
    ) -> tuple[list[Recipient], bytes | None]:
        """A page of the zone's leased recipients, as ``browse``, from the lease table.

        Leased records are READY records with a lease out; scanning the READY family for
        them would read every ready record of the zone (millions behind a paused zone)
        synchronously on the core's event loop, stalling SMTP and the API meanwhile.  The
        leases are few (the workers' connections and the jobs planned ahead), so their keys
        are sorted here: the same order (oldest message first) and the same cursor (a READY
        key) as a scan, and each page's records are read by key, the latest staged state."""
        prefix = keys.zone_prefix(keys.READY, zone)
        leased = sorted(
            key for key in self._leases if key.startswith(prefix) and (after is None or key > after)
        )
        page: list[Recipient] = []
        for key in leased:
            value = self._writer.read(key)
            record = None if value is None else self._decode_record(key, value)
            if record is None:  # gone (or quarantined) while its lease is being revoked
                continue
            page.append(record)
            if len(page) >= limit:
                return page, key
        return page, None

    async def drop(self, msg_id: int, now_ms: int, address: str | None = None) -> int:
        """Remove a message (or one recipient of it) from the queue, no DSN; how many."""
        self._check()
        mid = format_id(msg_id)
        # Works from raw keys, so a message with a corrupt record (or metadata) can still be
        # removed by an administrator; only a one-recipient drop needs a readable head.
        head = self._read_head(msg_id) if address is not None else None
        try:
            size = self.message(msg_id).size  # for the events (issue 6)
        except (NotFound, StorageCorruption):
            size = 0
        ops: list[Op] = []
        dropped = 0
        for state, key, record in list(self._raw_records(msg_id)):
            _, zone, _, rcpt = keys.decode_record(key)
            if address is not None and not same_mailbox(rcpt, address):
                continue
            ops.extend(self._remove_key(key, state, record))  # a hold on return goes too
            event = Event(
                EventKind.DROPPED,
                now_ms,
                zone,
                mid,
                rcpt,
                recipient_domain(rcpt),
                id_time_ms(msg_id),
                size=size,
                attempt=record.attempts if record is not None else 0,
            )
            ops.append(self._event_op(event))
            dropped += 1
        if head is not None:
            if not dropped:
                raise NotFound(f"no queued recipient {address} in message {mid}")
            if head[1] > dropped:
                ops.extend(self._recipients_gone(msg_id, head, dropped))
            else:
                ops.extend(self._message_removed(msg_id))
        elif dropped or self._writer.read(keys.message_head(msg_id)) is not None:
            ops.extend(self._message_removed(msg_id))
            # A delete is silent, as ``postsuper -d`` is: no notice of the failures it owed.
            ops.extend(owed_deletes(self._writer, msg_id))
        else:
            raise NotFound(f"no queued message {mid}")
        await self._stage_removal(ops)
        return dropped

    async def delivered_after_drop(self, lease: Lease, now_ms: int, outcome: Outcome) -> bool:
        """Record a delivery reported for a recipient deleted while it was on the wire; True
        if it was recorded (or held to be), False if ``lease`` was refused for another reason.

        The delete (``drop``, or a purge: ``drop_many``) revoked the lease and wrote the
        DROPPED event, and the report is refused; but the remote took responsibility for
        the message with its 2xx after the final dot (RFC 5321 section 6.1), so the
        delivery happened all the same, and the log, the delivered totals and the export
        must say so (Postfix's delivery agent, too, logs status=sent for a message
        ``postsuper -d`` deleted from the active queue).  Only its DELIVERED event is
        written: the record stays gone, and the delete has already settled the counters
        and the message's head.  A lease still held, or whose record is still there, was
        not revoked by a delete: nothing is written for it.

        While the store cannot write, the event is held and written after the heal, as
        every outcome is (``held.py``): it is the only record of that delivery.
        """
        replay = functools.partial(self._delivered_again, lease, now_ms, outcome)
        held = Held(lease, replay, revoked=True)
        if self._hold_if_failed(held):
            return True
        if self.holds(lease) or self._writer.read(lease.key) is not None:
            return False
        record = lease.recipient.after_attempt(now_ms, outcome.reply)
        log.info(
            "message %s: %s, deleted while on the wire, was delivered via %s (%s)",
            format_id(record.msg_id),
            record.address,
            outcome.mx or "?",
            outcome.reply,
        )
        event = self._outcome_event(EventKind.DELIVERED, record, now_ms, outcome)
        with contextlib.suppress(StorageUnavailable):  # held if its batch fails (``_settle``)
            await self._settle(held, [event], sync=False)
        return True

    async def _delivered_again(self, lease: Lease, now_ms: int, outcome: Outcome) -> None:
        """A held ``delivered_after_drop``, made again after the heal: a completion if the
        delete's own batch failed too and gave the lease back (``_put_back_revoked``), for
        the recipient is still queued and was delivered."""
        if self.holds(lease):
            await self.complete(lease, now_ms, outcome)
        else:
            await self.delivered_after_drop(lease, now_ms, outcome)

    def drop_orphans(self, msg_id: int, leases: Sequence[Lease], now_ms: int) -> int:
        """Remove leased records of a message that is gone, each with a DROPPED event; how
        many (0 if the message is there after all, or the store cannot write now).

        Such a record (an orphan, say one that landed after its message was deleted, by a
        version that let that happen) can never be delivered; kept leased it would stay
        counted and out of circulation for good, and again after every restart.  Only when
        the message has neither head nor metadata: a head without metadata is damage,
        quarantined and kept for the operator.  While the database cannot write, the leases
        are given back (found again once it heals).  Not a coroutine: the
        queue service calls it while handing out jobs; the write lands on its own.
        """
        mine = [lease for lease in leases if self.holds(lease)]
        if not mine:
            return 0
        if self._writer.read(keys.message_head(msg_id)) is not None:
            meta_key = keys.message_meta(msg_id)
            self._quarantine(StorageCorruption(meta_key, "a queued message has no metadata"))
            return 0
        if self._writer.failed is not None:
            for lease in mine:
                # Given back without moving the cursor back: scanned again (and removed)
                # once a reopen resets the cursors, not by every refill in the meantime.
                self._take(lease)
            return 0
        ops: list[Op] = []
        gone = Outcome(reply="its message was gone (removed while this record was moving)")
        for lease in mine:
            self._take(lease)  # the caller's own, not a worker's: nothing to revoke
            ops.extend(self._remove_key(lease.key, State.READY, lease.recipient))
            ops.append(self._outcome_event(EventKind.DROPPED, lease.recipient, now_ms, gone))
        log.warning(
            "removed %d record(s) of message %s: the message is gone", len(mine), format_id(msg_id)
        )
        landing = self._writer.submit(ops, sync=False)
        # A failed write is the store's to report and heal (``_on_failure``); the records are
        # on disk still, and found again when next handed out.
        landing.add_done_callback(_retrieved)
        return len(mine)

    async def hold(self, msg_id: int, reason: str = "held by administrator") -> int:
        """Put a message's ready and deferred recipients on hold; how many.  Leased ones are
        held when their attempt ends undelivered (``hold_counted``)."""
        held, _ = await self.hold_counted(msg_id, reason)
        return held

    async def hold_counted(
        self, msg_id: int, reason: str = "held by administrator"
    ) -> tuple[int, int]:
        """Hold a message: its ready and deferred recipients now, its leased ones when their
        attempt ends undelivered (marked: ``holdmarks.py``); (held now, marked).

        Its recipients are read and held with no ``await`` in between (``_hold_or_mark``),
        so no lease, outcome or release can come between what this reads and what it marks.
        """
        self._check()
        return await self._hold_or_mark(self.recipients(msg_id), reason)

    async def unhold(self, msg_id: int) -> int:
        """Release a held message; how many were held (``unhold_counted``)."""
        moved, _ = await self.unhold_counted(msg_id)
        return moved

    async def unhold_counted(self, msg_id: int) -> tuple[int, int]:
        """Release a held message: its recipients are ready at once, and those on the wire
        are no longer held when they return (their marks go in the same group); (made
        ready, marks cancelled), as ``hold_counted`` answers (held now, marked)."""
        self._check()
        unmarked = unmark_message(self._hold_marks, msg_id) if self._hold_marks else []
        landing = self._writer.submit(unmarked, sync=False) if unmarked else None
        moved = await self._make_ready(q for q in self.recipients(msg_id) if q.state is State.HELD)
        if landing is not None:
            await landing
        return moved, len(unmarked)

    async def retry_now(
        self, zone: str, *, msg_id: int | None = None, domain: str | None = None
    ) -> int:
        """Deferred recipients of a zone (or one message / domain in it) are ready at once,
        and leased ones are if their attempt defers (``retry_on_return``); how many of both."""
        self._check()
        on_return = self.retry_on_return(zone, msg_id=msg_id, domain=domain)
        wanted = None if domain is None else normal_domain(domain)
        chosen = (
            QueuedRecipient(State.DEFERRED, record)
            for _, record in self._records(_scope(keys.DEFERRED, zone, msg_id))
            if wanted is None or domain_is(record.domain, wanted)
        )
        return on_return + await self._make_ready(chosen)

    def retry_on_return(
        self, zone: str, *, msg_id: int | None = None, domain: str | None = None
    ) -> int:
        """Mark the leased recipients of a zone (or one message / domain in it): due at once
        if their attempt defers (``retrymarks.py``); how many.  One to be held on return is
        left alone: a retry resets delays and never releases a hold (as for held ones).
        A zone's walk marks first, so an attempt that defers behind its position is caught."""
        self._check()
        prefix = _scope(keys.READY, zone, msg_id)
        wanted = None if domain is None else normal_domain(domain)
        leased = [
            lease
            for key, lease in self._leases.items()
            if key.startswith(prefix)
            and key not in self._hold_marks
            and (wanted is None or domain_is(lease.recipient.domain, wanted))
        ]
        return retrymarks.mark(self._retry_marks, leased)

    def count(self, zone: str, state: State) -> int:
        """O(1): recipients of ``zone`` in ``state``."""
        if state is State.LEASED:
            return self.leased(zone)
        return self._counters.get(zone_key(zone, state.value))

    def domain_count(self, zone: str, domain: str, state: State) -> int:
        """O(1): recipients of ``zone`` for one destination domain in ``state``."""
        # domain_key puts the domain in its normal form: either form of a name counts.
        return self._counters.get(domain_key(zone, domain, state.value))

    def domain_counts(self, zone: str, state: State) -> dict[str, int]:
        """Recipients of ``zone`` per destination domain in ``state``: from the counters,
        or for LEASED (kept in memory only, no counter) from the leases out, which the
        workers' connections bound."""
        if state is State.LEASED:
            leased: Counter[str] = Counter(
                normal_domain(lease.recipient.domain)
                for lease in self._leases.values()
                if lease.recipient.zone == zone
            )
            return dict(leased)
        return dict(self._counters.items("domain-" + state.value, zone))

    def message_count(self) -> int:
        return self._counters.get(MESSAGES)

    def zones(self) -> set[str]:
        """Zones with anything queued."""
        return self._counters.zones()

    def counters(self) -> dict[bytes, int]:
        return self._counters.snapshot()
