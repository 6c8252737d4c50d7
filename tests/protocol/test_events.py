"""Event records: one schema, written by ``event_record`` and read back by ``Event``."""

from __future__ import annotations

from dataclasses import fields

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.protocol.events import EVENT_FIELDS, SCHEMA_VERSION, Event, EventKind, event_record

TEXT = st.text(max_size=20)
OPTIONAL_TEXT = st.none() | TEXT
U63 = st.integers(0, 2**63 - 1)

events = st.builds(
    Event,
    kind=st.sampled_from(EventKind),
    time_ms=U63,
    zone=TEXT,
    message_id=TEXT,
    recipient=TEXT,
    domain=TEXT,
    queued_at_ms=U63,
    size=U63,
    attempt=st.integers(0, 1000),
    mx=OPTIONAL_TEXT,
    source_ip=OPTIONAL_TEXT,
    code=st.none() | st.integers(200, 599),
    enhanced=OPTIONAL_TEXT,
    text=OPTIONAL_TEXT,
    possible_duplicate=st.booleans(),
    recipients=st.integers(1, 100_000),
    category=OPTIONAL_TEXT,
)


def test_the_record_has_exactly_the_event_fields_and_the_version() -> None:
    record = event_record(
        EventKind.DELIVERED, 1, "z", "m", recipient="r", domain="d", queued_at_ms=0
    )
    assert set(record) == {*EVENT_FIELDS, "v"}
    assert record["v"] == SCHEMA_VERSION
    assert tuple(f.name for f in fields(Event)) == EVENT_FIELDS


@given(events)
def test_records_round_trip_through_msgpack(event: Event) -> None:
    stored = msgpack.unpackb(msgpack.packb(event.to_record()))
    assert Event.from_record(stored) == event


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"v": 3}, "schema version"),
        ({"v": None}, "schema version"),
        ({"colour": "red"}, "unknown event fields"),
        # version 1 had no category: a record claiming both is not one zoneq wrote
        ({"v": 1}, "unknown event fields"),
    ],
)
def test_a_record_of_another_schema_is_refused(change: dict[str, object], problem: str) -> None:
    record = event_record(EventKind.ACCEPTED, 1, "z", "m", recipient="", domain="", queued_at_ms=0)
    record.update(change)
    with pytest.raises(ValueError, match=problem):
        Event.from_record(record)


@given(events)
def test_a_version_1_record_decodes_with_no_category(event: Event) -> None:
    """Databases written before version 2 hold records without ``category``: they still
    decode, and are written out again as version 2 with a null category."""
    record = event.to_record()
    del record["category"]
    record["v"] = 1
    decoded = Event.from_record(msgpack.unpackb(msgpack.packb(record)))
    assert decoded.category is None
    assert decoded.to_record() == {**record, "v": SCHEMA_VERSION, "category": None}
