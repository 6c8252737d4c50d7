"""Administrators' queue operations, as the API and ``zoneq queue`` offer them.

After Postfix's ``postsuper`` / ``postqueue`` and Apache James's queue administration:
browse a zone oldest-first, delete a message or one recipient, purge by filter, retry now
(message, domain or zone), hold and release (message or zone), pause and resume a zone, and
move a zone's recipients to another.

Operations over a whole zone walk it a page at a time (``store.browse``: one seek per page
at any depth) and act on each page's chosen recipients in one batch of the store's
(``zoneq.storage.bulk``), so a purge of a million recipients runs as a thousand batches of
``batch`` with the event loop free between them; SMTP sessions and workers keep being served.
The page read and the batch built from it happen with no ``await`` in between, so every
record is acted on in the state it was read in.

Holds go through the queue service, because recipients it has leased ahead for its job queue
must be given back before they can be held (a held recipient must not go out).  A zone's hold
stops the service handing out (or leasing) the zone for the whole walk, else a worker's lease
between two pages would take recipients the walk then passes over as leased.  A hold (of a
message or a zone) also holds its recipients on the wire once their attempt ends undelivered
(``QueueService.hold``, ``storage/holdmarks.py``); a release cancels that.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final

from zoneq.errors import NotFound
from zoneq.protocol.domains import bare_domain
from zoneq.protocol.ids import id_time_ms
from zoneq.queue.service import HoldCount, QueueService
from zoneq.storage import keys
from zoneq.storage.base import STATE_FAMILY, QueuedRecipient
from zoneq.storage.moves import Moved
from zoneq.storage.records import Recipient, State, domain_is, recipient_domain
from zoneq.storage.store import QueueStore

__all__ = [
    "MIN_PURGE_AGE_MS",
    "QUEUED_STATES",
    "BadCursor",
    "BrowsePage",
    "QueueAdmin",
    "Selection",
]

QUEUED_STATES: Final = (State.READY, State.DEFERRED, State.HELD)
DEFAULT_BATCH: Final = 1000
HOLD_REASON: Final = "held by administrator"
# An age under this is no filter on its own: a busy queue's backlog is minutes old, so
# "older than 0" or "older than 5m" selects nearly all of it.  Below it, a purge with no
# other filter needs the same explicit "all" as one with no filter at all.
MIN_PURGE_AGE_MS: Final = 3_600_000


@dataclass(frozen=True, slots=True)
class Selection:
    """Which recipients a purge removes; every field given must match (None: any)."""

    zone: str | None = None
    state: State | None = None
    sender_domain: str | None = None
    recipient_domain: str | None = None
    older_than_ms: int | None = None  # queued before this instant (ms since the epoch)

    def is_everything(self) -> bool:
        return self == Selection()


@dataclass(frozen=True, slots=True)
class BrowsePage:
    recipients: list[QueuedRecipient]
    cursor: str | None  # opaque: pass back for the next page; None at the end


def encode_cursor(key: bytes) -> str:
    return base64.urlsafe_b64encode(key).decode().rstrip("=")


class BadCursor(ValueError):
    """A cursor the caller made up or took from another listing: the caller's fault."""


def decode_cursor(cursor: str, prefix: bytes) -> bytes:
    """The key a cursor stands for; ``BadCursor`` if it is not one of this listing's."""
    try:
        key = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
    except (binascii.Error, ValueError):
        raise BadCursor(f"not a cursor: {cursor!r}") from None
    if not key.startswith(prefix) or key == prefix:
        raise BadCursor("cursor belongs to another zone or state; start from the first page")
    return key


def _normal(domain: str | None) -> str | None:
    """A domain filter in the queue's normal form (``recipient_domain``), no root dot."""
    return None if domain is None else bare_domain(domain)


class _SenderDomains:
    """Sender domain by message id, remembering only the last message: a zone's records
    are in message order, so one message's recipients come together."""

    def __init__(self, store: QueueStore) -> None:
        self._store = store
        self._last: tuple[int, str] = (-1, "")

    def __call__(self, msg_id: int) -> str | None:
        if self._last[0] != msg_id:
            try:
                domain = recipient_domain(self._store.message(msg_id).sender)
            except NotFound:
                return None
            self._last = (msg_id, domain)
        return self._last[1]


class QueueAdmin:
    def __init__(
        self,
        store: QueueStore,
        service: QueueService,
        zones: Sequence[str],
        *,
        clock: Callable[[], int],
        batch: int = DEFAULT_BATCH,
    ) -> None:
        self.store = store
        self.service = service
        self._configured = tuple(zones)
        self.clock = clock
        self.batch = batch

    # --- reads ----------------------------------------------------------------------------

    def zones(self) -> list[str]:
        """Configured zones and any zone with something queued (an old config's zone)."""
        return sorted(set(self._configured) | self.store.zones())

    def check_zone(self, zone: str) -> str:
        if zone not in self._configured and zone not in self.store.zones():
            raise NotFound(f"no zone {zone!r}")
        return zone

    def counts(self) -> dict[str, dict[str, int | bool]]:
        """O(1) per zone: recipients per state (leased ones are a part of ready)."""
        paused = self.service.paused()
        result: dict[str, dict[str, int | bool]] = {}
        for zone in self.zones():
            entry: dict[str, int | bool] = {
                state.value: self.store.count(zone, state) for state in State
            }
            entry["paused"] = zone in paused
            result[zone] = entry
        return result

    def browse(
        self, zone: str, state: State, cursor: str | None = None, limit: int = 100
    ) -> BrowsePage:
        """One page of a zone's recipients in ``state``, oldest message first."""
        self.check_zone(zone)
        family = STATE_FAMILY[State.READY if state is State.LEASED else state]
        after = None if cursor is None else decode_cursor(cursor, keys.zone_prefix(family, zone))
        page, last = self.store.browse(zone, state, after=after, limit=limit)
        listed = [QueuedRecipient(self._state_of(state, r), r) for r in page]
        return BrowsePage(listed, None if last is None else encode_cursor(last))

    def _state_of(self, state: State, record: Recipient) -> State:
        if state is State.READY:
            key = keys.record(keys.READY, record.zone, record.msg_id, record.address)
            if self.store.is_leased(key):
                return State.LEASED
        return state

    # --- per message ----------------------------------------------------------------------

    async def delete(self, msg_id: int, recipient: str | None = None) -> int:
        return await self.store.drop(msg_id, self.clock(), recipient)

    async def hold_message(self, msg_id: int, reason: str = HOLD_REASON) -> HoldCount:
        self.store.message(msg_id)  # NotFound for an unknown message
        return await self.service.hold(msg_id, reason)

    async def release_message(self, msg_id: int) -> HoldCount:
        """Released now, and on the wire no longer to be held on return: as a hold answers."""
        self.store.message(msg_id)
        return HoldCount(*await self.store.unhold_counted(msg_id))

    async def retry_message(self, msg_id: int) -> int:
        """The message's deferred recipients are ready at once, and those on the wire are
        if their attempt defers (``storage/retrymarks.py``); how many of both."""
        moved = 0
        for zone in self.store.message(msg_id).zones:
            moved += await self.store.retry_now(zone, msg_id=msg_id)
        return moved

    # --- over zones -----------------------------------------------------------------------

    async def purge(self, selection: Selection) -> int:
        """Remove (no DSN) every queued recipient the selection matches; how many."""
        zones = [self.check_zone(selection.zone)] if selection.zone is not None else self.zones()
        states = [selection.state] if selection.state else list(QUEUED_STATES)
        senders = _SenderDomains(self.store)
        # Either form of a name (U-label or A-label) selects the same recipients.
        wanted = _normal(selection.recipient_domain)
        sender = _normal(selection.sender_domain)

        def pick(record: Recipient) -> bool:
            # "is not None": an empty filter matches nothing here, never everything (the
            # API refuses one; this keeps a caller's slip from widening a purge).
            if wanted is not None and not domain_is(record.domain, wanted):
                return False
            return sender is None or senders(record.msg_id) == sender

        now = self.clock()
        purged = 0
        for zone in zones:
            for state in states:
                purged += await self._walk(
                    zone,
                    state,
                    pick,
                    lambda chosen: self.store.drop_many(chosen, now),
                    before_ms=selection.older_than_ms,
                )
        return purged

    async def retry(self, zone: str | None = None, domain: str | None = None) -> int:
        """Deferred recipients of a zone (every zone if None), or of one destination domain
        in it, are ready at once: their delays are reset.  Those on the wire are ready at
        once if their attempt defers (``storage/retrymarks.py``): marked before the walk,
        so one that defers behind the walk's position is caught too.  How many of both."""
        zones = [self.check_zone(zone)] if zone is not None else self.zones()
        wanted = _normal(domain)
        moved = 0
        for name in zones:
            moved += self.store.retry_on_return(name, domain=wanted)
            moved += await self._walk(
                name,
                State.DEFERRED,
                lambda r: wanted is None or domain_is(r.domain, wanted),
                self.store.ready_many,
            )
        return moved

    async def hold_zone(self, zone: str, reason: str = HOLD_REASON) -> int:
        """Hold every ready and deferred recipient of a zone (those with a worker finish)."""
        self.check_zone(zone)
        held = 0
        with self.service.holding(zone):  # nothing of it leased between two pages
            for state in (State.READY, State.DEFERRED):
                held += await self._walk(
                    zone, state, lambda _: True, lambda chosen: self.store.hold_many(chosen, reason)
                )
        return held

    async def release_zone(self, zone: str) -> int:
        """Make every held recipient of a zone ready, and cancel the holds its recipients on
        the wire would take when their attempt ends (``storage/holdmarks.py``), as a
        message's release does.  The marks go first: an attempt that ended undelivered
        during the walk would otherwise be held behind the walk's position, and stay held
        after the release answered."""
        self.check_zone(zone)
        await self.store.unmark_zone(zone)
        return await self._walk(zone, State.HELD, lambda _: True, self.store.ready_many)

    async def move(self, zone: str, to: str, state: State | None = None) -> Moved:
        """Move a zone's recipients (only those in ``state``, if given) to ``to``, a
        configured zone, each in the state it is in (``storage/moves.py``).  Those on the
        wire stay (``Moved.in_flight``): their worker's report must find them."""
        self.check_zone(zone)
        if to not in self._configured:
            # A zone without a worker would strand them as the old one did.
            raise NotFound(f"no zone {to!r} in the config to move to")
        states = [state] if state is not None else list(QUEUED_STATES)
        # Nothing of the zone is leased during the walk, and its jobs not handed out yet
        # go back to the store first, so they are moved with the rest (as ``hold_zone``).
        with self.service.holding(zone):
            return await self.store.move_zone(zone, to, states=states, batch=self.batch)

    async def pause(self, zone: str) -> None:
        await self.service.pause(self.check_zone(zone))

    async def resume(self, zone: str) -> None:
        await self.service.resume(self.check_zone(zone))

    async def _walk(
        self,
        zone: str,
        state: State,
        pick: Callable[[Recipient], bool],
        act: Callable[[list[QueuedRecipient]], Awaitable[int]],
        *,
        before_ms: int | None = None,
    ) -> int:
        """Page through ``zone``'s recipients in ``state`` and ``act`` on the picked ones,
        one batch per page.  ``before_ms``: stop at the first message queued at or after
        it (records are in message-id order, and ids are time-ordered)."""
        after: bytes | None = None
        total = 0
        while True:
            page, last = self.store.browse(zone, state, after=after, limit=self.batch)
            chosen: list[QueuedRecipient] = []
            for record in page:
                if before_ms is not None and id_time_ms(record.msg_id) >= before_ms:
                    last = None
                    break
                if pick(record):
                    chosen.append(QueuedRecipient(state, record))
            if chosen:
                total += await act(chosen)
            else:
                await asyncio.sleep(0)  # a page of nothing still yields the loop
            if last is None:
                return total
            after = last
