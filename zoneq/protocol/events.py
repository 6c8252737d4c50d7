"""Delivery events: the record every queue transition writes, and the analytics read.

An event is written in the same LevelDB batch as the transition it describes (so the log can
never disagree with the queue), under ``event <time_ms> <seq>``.  The value is a msgpack map
with the field names below plus ``v`` (the schema version), so an export is readable without
this module and a reader can refuse a schema it does not know.

Version 2 added ``category``: why a failure failed (``reply_rules.failure_category``).
Records of version 1 are still in databases written before it; they decode with no
category (``READABLE_VERSIONS``) and are written out again as version 2.

Pure: no clock, no I/O; the caller supplies every value.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any, Final

SCHEMA_VERSION: Final = 2
READABLE_VERSIONS: Final = frozenset({1, SCHEMA_VERSION})
# Fields a record of each older version lacks (decoded as their defaults).
_ADDED_SINCE: Final[dict[int, frozenset[str]]] = {1: frozenset({"category"})}


class EventKind(enum.StrEnum):
    ACCEPTED = "accepted"  # committed to the queue (one event per message and zone)
    DELIVERED = "delivered"  # 2xx after the final dot
    DEFERRED = "deferred"  # temporary failure; another attempt is scheduled
    BOUNCED = "bounced"  # permanent failure; a DSN goes to the sender unless suppressed
    EXPIRED = "expired"  # gave up after the zone's max age; a DSN goes to the sender
    DROPPED = "dropped"  # removed by an administrator or a plugin, no DSN
    DELAYED = "delayed"  # RFC 3461 NOTIFY=DELAY notice sent; still queued


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    time_ms: int
    zone: str
    message_id: str
    recipient: str
    domain: str
    queued_at_ms: int
    size: int = 0
    attempt: int = 0
    mx: str | None = None
    source_ip: str | None = None
    code: int | None = None
    enhanced: str | None = None
    text: str | None = None
    # RFC 1047: the connection was lost after the final dot, so the remote may have the
    # message although we will try again.  Logged so duplicates can be explained.
    possible_duplicate: bool = False
    # ACCEPTED is written once per (message, zone), not per recipient: a bulk message with
    # 10,000 recipients would otherwise write 10,000 events in its commit.  ``recipient`` and
    # ``domain`` are then empty and this says how many recipients were queued.
    recipients: int = 1
    # Why a deferred, bounced, expired or delayed recipient failed: the category of the
    # reply rule that fits the reply, else the RFC 3463 subject of its status (``network``,
    # ``policy``, ...; ``reply_rules.failure_category``).  None for every other kind: a
    # delivered, accepted or dropped recipient did not fail.
    category: str | None = None

    def to_record(self) -> dict[str, Any]:
        return event_record(
            self.kind,
            self.time_ms,
            self.zone,
            self.message_id,
            recipient=self.recipient,
            domain=self.domain,
            queued_at_ms=self.queued_at_ms,
            size=self.size,
            attempt=self.attempt,
            mx=self.mx,
            source_ip=self.source_ip,
            code=self.code,
            enhanced=self.enhanced,
            text=self.text,
            possible_duplicate=self.possible_duplicate,
            recipients=self.recipients,
            category=self.category,
        )

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Event:
        version = record.get("v")
        if not isinstance(version, int) or version not in READABLE_VERSIONS:
            raise ValueError(
                f"event schema version {version!r} is not one of {sorted(READABLE_VERSIONS)}"
            )
        known = {f.name for f in fields(cls)} - _ADDED_SINCE.get(version, frozenset())
        unknown = set(record) - known - {"v"}
        if unknown:
            raise ValueError(f"unknown event fields: {sorted(unknown)}")
        values = {k: v for k, v in record.items() if k != "v"}
        values["kind"] = EventKind(values["kind"])
        return cls(**values)


def event_record(
    kind: EventKind,
    time_ms: int,
    zone: str,
    message_id: str,
    *,
    recipient: str,
    domain: str,
    queued_at_ms: int,
    size: int = 0,
    attempt: int = 0,
    mx: str | None = None,
    source_ip: str | None = None,
    code: int | None = None,
    enhanced: str | None = None,
    text: str | None = None,
    possible_duplicate: bool = False,
    recipients: int = 1,
    category: str | None = None,
) -> dict[str, Any]:
    """The stored form of an event, built without an ``Event`` (the schema's one definition).

    The store writes events on every transition; constructing the frozen dataclass first
    cost as much as encoding it, so the hot paths call this directly.  A test keeps it in
    step with ``Event``'s fields.
    """
    return {
        "v": SCHEMA_VERSION,
        "kind": kind.value,
        "time_ms": time_ms,
        "zone": zone,
        "message_id": message_id,
        "recipient": recipient,
        "domain": domain,
        "queued_at_ms": queued_at_ms,
        "size": size,
        "attempt": attempt,
        "mx": mx,
        "source_ip": source_ip,
        "code": code,
        "enhanced": enhanced,
        "text": text,
        "possible_duplicate": possible_duplicate,
        "recipients": recipients,
        "category": category,
    }


EVENT_FIELDS: Final = tuple(f.name for f in fields(Event))
