"""The columns of zoneq's export files: one definition for the writer and the Spark job.

``zoneq export`` (``zoneq.export``) writes these columns and the analytics job
(``zoneq.analytics``) reads them; the two are sibling layers that may not import each other,
so the shared contract lives here, in the pure core.  Types are named in a neutral
vocabulary that each side maps to its own (pyarrow, Spark SQL).

Every row carries ``v``: the event schema version (``events.SCHEMA_VERSION``) for event
rows, ``QUEUE_VERSION`` for queue rows, so a reader can refuse an export it does not know
instead of misreading it.
"""

from __future__ import annotations

from typing import Final, Literal

from zoneq.protocol.events import EVENT_FIELDS, READABLE_VERSIONS, SCHEMA_VERSION

ColumnType = Literal["int32", "int64", "string", "bool"]

EVENT_VERSION: Final = SCHEMA_VERSION
# What a reader accepts: version 1 exports lack ``category`` (a null column to a reader).
EVENT_VERSIONS: Final = READABLE_VERSIONS
QUEUE_VERSION: Final = 1

# (name, type, nullable).  ``id`` is the event's key as 16 hex digits (``ids.format_id``).
EVENT_COLUMNS: Final[tuple[tuple[str, ColumnType, bool], ...]] = (
    ("v", "int32", False),
    ("id", "string", False),
    ("kind", "string", False),
    ("time_ms", "int64", False),
    ("zone", "string", False),
    ("message_id", "string", False),
    ("recipient", "string", False),
    ("domain", "string", False),
    ("queued_at_ms", "int64", False),
    ("size", "int64", False),
    ("attempt", "int32", False),
    ("mx", "string", True),
    ("source_ip", "string", True),
    ("code", "int32", True),
    ("enhanced", "string", True),
    ("text", "string", True),
    ("possible_duplicate", "bool", False),
    ("recipients", "int32", False),
    # version 2; a version 1 export has no such column, which readers take as null
    ("category", "string", True),
)

# One row per queued recipient at export time (``storage.export.queue_records`` plus ``v``
# and the export's own clock reading).
QUEUE_COLUMNS: Final[tuple[tuple[str, ColumnType, bool], ...]] = (
    ("v", "int32", False),
    ("exported_at_ms", "int64", False),
    ("zone", "string", False),
    ("state", "string", False),
    ("domain", "string", False),
    ("message_id", "string", False),
    ("queued_at_ms", "int64", False),
    ("attempts", "int32", False),
    ("next_attempt_ms", "int64", False),
    ("age_ms", "int64", False),
    ("last_reply", "string", False),
)

# Keep the columns in step with the event schema: a field added to ``Event`` must be
# added here, or the export would silently drop it.
assert {name for name, _, _ in EVENT_COLUMNS} == {"v", "id", *EVENT_FIELDS}

__all__ = [
    "EVENT_COLUMNS",
    "EVENT_VERSION",
    "EVENT_VERSIONS",
    "QUEUE_COLUMNS",
    "QUEUE_VERSION",
    "ColumnType",
]
