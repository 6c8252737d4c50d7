"""Turning failed recipients into the DSN the envelope sender gets (RFC 3464).

One failure notice per message, listing every recipient of it that failed close together
(RFC 3464 allows any number of per-recipient blocks), as Postfix sends one per queue file:
a bulk message refused at one domain in 200 jobs of 50, or failing at three domains, gives
its sender one DSN.  Each failure leaves the queue with a durable record that its notice
is owed (``zoneq/storage/owed.py``); ``OwedNotices`` composes a message's records into
one DSN once none of its recipients is ready or in flight, or ``OWED_WAIT_S`` after it
first saw one (a slow or paused domain must not hold the others' notice back for long),
and at start-up whatever a stop left owed.  Delay and "relayed" notices are still one
per message and worker report (``QueueService``): each is owed once per recipient and
written with the flag that says so.

Every notice is queued in the bounce zone with the null reverse-path (RFC 5321 section
4.5.5), so it can never itself be bounced.  No notice goes to ``<>`` or for NOTIFY=NEVER
(``should_send_dsn``).  The original comes back whole only when the sender asked for
RET=FULL and it is small; otherwise its header section alone (RFC 3461 section 4.3 lets
the MTA choose).  The notice is queued with the BODY=8BITMIME and SMTPUTF8 flags its
content needs (``transport_needs``).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Awaitable, Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from zoneq.errors import NotFound, StorageCorruption
from zoneq.protocol.dsn import (
    Action,
    DsnRequest,
    ReportedRecipient,
    Ret,
    build_dsn,
    transport_needs,
)
from zoneq.protocol.dsn import should_send_dsn as _should_send
from zoneq.protocol.ids import format_id, id_time_ms
from zoneq.storage.owed import OwedFailure, OwedNotice
from zoneq.storage.records import MessageMeta, NewRecipient, Notice, Recipient, recipient_domain
from zoneq.storage.store import QueueStore

log = logging.getLogger("zoneq.queue")

# Originals up to this size are returned whole for RET=FULL; larger ones as headers only.
FULL_RETURN_LIMIT: Final = 256 * 1024
# The header section is looked for within this many bytes of the body's start.
HEADER_LIMIT: Final = 256 * 1024
# How long a message's failures may wait for its other recipients still being tried before
# they are told anyway: a slow, paused or resting domain must not hold the notice for long.
OWED_WAIT_S: Final = 30.0
# Messages settled per pass, each pass awaited before the next (``OwedNotices``).
SETTLE_STEP: Final = 256


@dataclass(frozen=True, slots=True)
class Failure:
    """One recipient that failed (or expired), and what the remote end said."""

    recipient: Recipient
    status: str  # RFC 3463 enhanced status, e.g. "5.1.1"
    diagnostic: str | None  # the remote reply, one line, e.g. "550 5.1.1 no such user"
    remote_mta: str | None
    action: Action = Action.FAILED
    will_retry_until_ms: int | None = None  # for Action.DELAYED (RFC 3464 section 2.3.9)
    failed_ms: int | None = None  # its Last-Attempt-Date (section 2.3.7); None: the notice's


def default_bounce_from(reporting_mta: str) -> str:
    """The notice's From when ``[server] bounce_from`` is unset, as Postfix and sendmail
    sign theirs."""
    return f"MAILER-DAEMON@{reporting_mta}"


def wants_notice(meta: MessageMeta, failure: Failure) -> bool:
    if meta.is_bounce:
        return False
    return _should_send(meta.sender, failure.recipient.notify or None, failure.action)


def any_wanted(meta: MessageMeta, failures: Sequence[Failure]) -> bool:
    """Whether any of ``failures`` owes the sender a notice: if not, the original need not
    be read at all."""
    return any(wants_notice(meta, f) for f in failures)


def header_section(start: bytes) -> bytes:
    """The header section at the start of a body (up to the empty line)."""
    for end in (b"\r\n\r\n", b"\n\n"):
        at = start.find(end)
        if at >= 0:
            return start[: at + len(end)]
    return start[:HEADER_LIMIT]


def compose(
    meta: MessageMeta,
    failures: Sequence[Failure],
    *,
    original_start: bytes,
    original_full: bytes | None,
    reporting_mta: str,
    bounce_zone: str,
    now_ms: int,
    bounce_from: str | None = None,
) -> Notice | None:
    """The notice for ``failures`` of ``meta``'s message, or None if nobody should get one.

    ``original_start`` is the beginning of the stored message (enough for its headers);
    ``original_full`` the whole stored message, header section included, when it is small
    enough to return, else None.  ``bounce_from`` is the notice's From address
    (``[server] bounce_from``); None gives ``MAILER-DAEMON@<reporting_mta>``.
    """
    wanted = [f for f in failures if wants_notice(meta, f)]
    if not wanted:
        return None
    now = datetime.fromtimestamp(now_ms / 1000, UTC)
    ret = Ret.FULL if (meta.ret or "").upper() == "FULL" else Ret.HDRS
    if ret is Ret.FULL and original_full is not None:
        # The stored message is header section and body in one; the DSN takes them apart
        # (it writes headers, the empty line, then the body).
        headers = header_section(original_full)
        body: bytes | None = original_full[len(headers) :]
    else:
        headers, body = header_section(original_start), None
    request = DsnRequest(
        reporting_mta=reporting_mta,
        envelope_sender=meta.sender,
        ret=ret,
        arrival_date=datetime.fromtimestamp(id_time_ms(meta.msg_id) / 1000, UTC),
        recipients=tuple(
            ReportedRecipient(
                final_recipient=f.recipient.address,
                action=f.action,
                status=f.status,
                original_recipient=f.recipient.orcpt,
                diagnostic=f.diagnostic,
                remote_mta=f.remote_mta,
                last_attempt=(
                    now if f.failed_ms is None else datetime.fromtimestamp(f.failed_ms / 1000, UTC)
                ),
                will_retry_until=(
                    datetime.fromtimestamp(f.will_retry_until_ms / 1000, UTC)
                    if f.will_retry_until_ms is not None
                    else None
                ),
            )
            for f in wanted
        ),
        original_headers=headers,
        original_body=body,
        postmaster_from=bounce_from or default_bounce_from(reporting_mta),
        message_id=f"<{format_id(meta.msg_id)}.{now_ms}.dsn@{reporting_mta}>",
        date=now,
        envelope_id=meta.envid,
    )
    notice = build_dsn(request)
    needs = transport_needs(request, notice)
    notice_meta = MessageMeta(
        msg_id=0,
        sender="",  # the null reverse-path: a DSN is never bounced (RFC 5321 4.5.5)
        size=len(notice),
        chunks=0,
        received_ms=now_ms,
        smtputf8=needs.smtputf8,
        body_8bit=needs.body_8bit,
        headers={"Subject": "delivery status notification"},
        source={"protocol": "dsn", "original": format_id(meta.msg_id)},
        is_bounce=True,
    )
    return Notice(notice_meta, (NewRecipient(meta.sender, bounce_zone),), notice)


def owed_failure(failure: Failure, now_ms: int) -> OwedFailure:
    """The record that ``failure`` is owed a notice (``zoneq/storage/owed.py``)."""
    recipient = failure.recipient
    return OwedFailure(
        recipient.zone,
        recipient.address,
        failure.status,
        failure.diagnostic,
        failure.remote_mta,
        now_ms,
        recipient.orcpt,
    )


def failure_of(msg_id: int, owed: OwedFailure) -> Failure:
    """The failure an owed record names.  Only failures owed a notice are recorded, so its
    NOTIFY is not kept: the default (RFC 3461 section 4.1) tells of a failure."""
    recipient = Recipient(
        owed.zone, msg_id, owed.address, recipient_domain(owed.address), orcpt=owed.orcpt
    )
    return Failure(
        recipient, owed.status, owed.diagnostic, owed.remote_mta, failed_ms=owed.failed_ms
    )


@dataclass(frozen=True, slots=True)
class NoticeSettings:
    """Where notices come from and go (``[server]`` and ``[routing]``)."""

    reporting_mta: str
    bounce_zone: str
    bounce_from: str | None = None


class OwedNotices:
    """Composes each message's owed failures into its one DSN (see the top of the module).

    In passes of ``SETTLE_STEP`` messages, each awaited before the next, so the event loop
    serves sessions in between (as ``held.py``'s replay does): a start-up owing 5,000
    messages settled in one pass blocked it for 62 s.  A pass reads each message's
    records, composes their notices in a thread (``compose`` is pure, and a
    10,000-recipient notice took 1.6 s of the loop), then reads the records again and
    stages the batch that queues the DSN and deletes them with no ``await`` in between.  A
    message whose records changed meanwhile (another pass took them, a failure came, an
    administrator deleted it) is looked at again next round: a record is never listed
    twice, and never told after its delete.

    Whether a notice still waits for its message's other recipients is looked at when a
    report touches the message, at its first look, and once its wait is up; not for every
    message every round (10,000 waiting for a paused zone cost 4 s of reads a round)."""

    def __init__(
        self,
        store: QueueStore,
        settings: NoticeSettings,
        *,
        wait_s: float = OWED_WAIT_S,
    ) -> None:
        self._store = store
        self._settings = settings
        self._wait_s = wait_s
        self._deadline: dict[int, float] = {}  # msg_id -> when its notice waits no more
        self._due: list[tuple[float, int]] = []  # a heap of those deadlines
        self._composing: set[int] = set()  # messages a pass is composing the notice of

    async def settle(
        self, now_ms: int, *, among: Collection[int] | None = None, every: bool = False
    ) -> int:
        """Queue the notices owed now, of the messages ``among`` (a report touched them),
        else of those a round looks at (seen for the first time, or their wait up); or of
        every message at once with ``every`` (as at start-up).  How many were settled.
        Raises ``StorageUnavailable`` if the store cannot write."""
        chosen = self._chosen(among, every, time.monotonic())
        settled = 0
        for start in range(0, len(chosen), SETTLE_STEP):
            settled += await self._settle_step(chosen[start : start + SETTLE_STEP], now_ms, every)
        return settled

    def _chosen(self, among: Collection[int] | None, every: bool, now: float) -> list[int]:
        if every:
            return self._store.owed_messages()
        if among is not None:
            return sorted(msg_id for msg_id in among if self._store.owes(msg_id))
        new = {msg_id for msg_id in self._store.owed_messages() if msg_id not in self._deadline}
        return sorted(new.union(self._due_by(now)))

    def _due_by(self, now: float) -> list[int]:
        """The messages whose wait is up at ``now``; those no longer owing are forgotten."""
        due: list[int] = []
        while self._due and self._due[0][0] <= now:
            deadline, msg_id = heapq.heappop(self._due)
            if self._deadline.get(msg_id) != deadline:
                continue  # settled, or its deadline moved (``_look_again``)
            if self._store.owes(msg_id):
                due.append(msg_id)
            else:
                del self._deadline[msg_id]
        return due

    async def _settle_step(self, msg_ids: Sequence[int], now_ms: int, every: bool) -> int:
        now = time.monotonic()
        taken = [
            owed
            for msg_id in msg_ids
            if msg_id not in self._composing  # another pass has it: its re-read tells
            and (every or not self._waiting(msg_id, now))
            and (owed := self._taken(msg_id, now)) is not None
        ]
        if not taken:
            return 0
        mine = {owed.msg_id for owed in taken}
        self._composing.update(mine)
        try:
            notices = await self._composed(taken, now_ms)
        finally:
            self._composing.difference_update(mine)
        landing: list[Awaitable[None]] = []
        for owed, notice in zip(taken, notices, strict=True):
            again = self._store.owed(owed.msg_id)
            if again is None or again.keys != owed.keys:
                self._look_again(owed.msg_id, now)  # changed while composed
                continue
            landing.append(self._store.settle_owed(again, notice, now_ms))
            self._deadline.pop(owed.msg_id, None)
        await asyncio.gather(*landing)
        return len(landing)

    def _taken(self, msg_id: int, now: float) -> OwedNotice | None:
        """What ``msg_id`` owes and is durable; None, to be looked at next round, while
        its records are on their way to disk (None too if it owes nothing any more)."""
        owed = self._store.owed(msg_id)
        if owed is None and self._store.owes(msg_id):
            self._look_again(msg_id, now)
        return owed

    def _look_again(self, msg_id: int, now: float) -> None:
        self._deadline[msg_id] = now
        heapq.heappush(self._due, (now, msg_id))

    def _waiting(self, msg_id: int, now: float) -> bool:
        """Whether the message's notice waits for recipients of it still ready or in flight
        (but never more than ``wait_s`` since its failures were first seen here)."""
        deadline = self._deadline.get(msg_id)
        if deadline is None:
            deadline = self._deadline[msg_id] = now + self._wait_s
            heapq.heappush(self._due, (deadline, msg_id))
        if now >= deadline:
            return False
        try:
            meta = self._store.message(msg_id)
        except (NotFound, StorageCorruption):
            return False  # gone with its last recipient (or damaged): nothing to wait for
        return self._store.has_ready(msg_id, meta.zones)

    async def _composed(self, taken: Sequence[OwedNotice], now_ms: int) -> list[Notice | None]:
        """The notices of ``taken``, composed in a thread: ``compose`` reads nothing but its
        arguments, and costs about 7 ms a notice plus 0.16 ms a failure it lists (the
        ``email`` package's header folding), which the event loop must not wait out."""
        return await asyncio.to_thread(lambda: [self._compose(owed, now_ms) for owed in taken])

    def _compose(self, owed: OwedNotice, now_ms: int) -> Notice | None:
        original = owed.original
        if original is None:
            log.error(
                "message %s: %d failure(s) not told, the notice's original is lost",
                format_id(owed.msg_id),
                len(owed.failures),
            )
            return None
        try:
            return compose(
                original.meta,
                [failure_of(owed.msg_id, f) for f in owed.failures],
                original_start=original.start,
                original_full=original.full,
                reporting_mta=self._settings.reporting_mta,
                bounce_zone=self._settings.bounce_zone,
                now_ms=now_ms,
                bounce_from=self._settings.bounce_from,
            )
        except ValueError:
            # A record no DSN can carry (``build_dsn`` refuses it) must not wedge every
            # later notice behind it: it is dropped, loudly.
            log.exception("message %s: its owed notice cannot be built", format_id(owed.msg_id))
            return None
