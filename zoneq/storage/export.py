"""Snapshot readers for exports: the event log and the current queue as plain records.

Both readers take an optional LevelDB snapshot (``store.database.snapshot()``) so that an
export made while the core runs sees one consistent moment: events and queue records that
land while it is being written are not half in it.  The event log is ordered by event id,
and event ids are issued in the order transitions are staged, which is the order the group
writer lands them (``writer.py``: one group at a time, in sequence).  So when an export has
seen event id N, every event with an id below N is already on disk, and "everything after
N" is a safe watermark for the next export: nothing is skipped, nothing read twice.

The records are plain dicts (JSON- and msgpack-ready), the same that the admin API serves
as NDJSON and that ``zoneq export`` writes to files.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Final

from zoneq.errors import StorageCorruption
from zoneq.protocol.ids import format_id, id_time_ms
from zoneq.storage import keys
from zoneq.storage.base import FAMILY_STATE
from zoneq.storage.records import Recipient, State
from zoneq.storage.store import QueueStore

CORRUPT: Final = "corrupt"  # the field that marks a skipped, undecodable event record

QUEUE_FIELDS = (
    "zone",
    "state",
    "domain",
    "message_id",
    "queued_at_ms",
    "attempts",
    "next_attempt_ms",
    "age_ms",
    "last_reply",
)


def event_records(
    store: QueueStore,
    *,
    after: int | None = None,
    snapshot: object | None = None,
    limit: int | None = None,
) -> Iterator[dict[str, Any]]:
    """Event records after event id `after`, oldest first: Event.to_record() plus "id":
    format_id(event_id).

    A record that does not decode comes out, in its place, as a *skip marker*:
    ``{"id": <its event id>, "corrupt": <why>, "key": <its key in hex>}`` and no other
    field (:func:`is_corrupt`).  A consumer writes no row for it but counts it and moves
    its watermark past it: otherwise one damaged value would stop every export at the same
    event, run after run.  The markers travel through the API's NDJSON stream too, so an
    export through the running core learns of them the same way.  ``limit`` counts
    decoded events only.
    """
    start = None if after is None else keys.event(after)
    skipped: list[dict[str, Any]] = []

    def corrupt(key: bytes, reason: str) -> None:
        skipped.append({"id": format_id(keys.decode_event(key)), CORRUPT: reason, "key": key.hex()})

    events = store.events(after=start, snapshot=snapshot, on_corrupt=corrupt)
    for key, event in itertools.islice(events, limit):
        yield from skipped  # each marker before the next good event: id order is kept
        skipped.clear()
        record = event.to_record()
        record["id"] = format_id(keys.decode_event(key))
        yield record
    if limit is None:
        yield from skipped


def is_corrupt(record: dict[str, Any]) -> bool:
    """A skip marker from :func:`event_records` (an event record that did not decode)."""
    return CORRUPT in record


def queue_records(
    store: QueueStore, *, now_ms: int, snapshot: object | None = None
) -> Iterator[dict[str, Any]]:
    """One record per queued recipient: zone, state, domain, message_id, queued_at_ms,
    attempts, next_attempt_ms, age_ms, last_reply.

    ``state`` is ready, leased (a ready recipient handed to a worker right now), deferred or
    held.  A record that cannot be decoded is skipped here; the store's own reads quarantine
    and report it.
    """
    db = store.database
    for family, state in FAMILY_STATE.items():
        for key, value in db.items(prefix=family, snapshot=snapshot, fill_cache=False):
            try:
                _, zone, msg_id, address = keys.decode_record(key)
                record = Recipient.decode(key, zone, msg_id, address, value)
            except (StorageCorruption, ValueError, UnicodeDecodeError):
                continue
            shown = State.LEASED if state is State.READY and store.is_leased(key) else state
            queued_at = id_time_ms(msg_id)
            yield {
                "zone": zone,
                "state": shown.value,
                "domain": record.domain,
                "message_id": format_id(msg_id),
                "queued_at_ms": queued_at,
                "attempts": record.attempts,
                "next_attempt_ms": record.next_attempt_ms,
                "age_ms": max(0, now_ms - queued_at),
                "last_reply": record.last_reply,
            }


__all__ = ["CORRUPT", "QUEUE_FIELDS", "event_records", "is_corrupt", "queue_records"]
