"""The hold marks' pure helpers: which marks a release of a message or a zone forgets.

Zone names here include ones that are prefixes of each other and ones with NUL and 0x01
bytes, the cases where a careless prefix match would take another zone's marks.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zoneq.storage import keys
from zoneq.storage.holdmarks import hold_mark_key, mark, unmark_message, unmark_zone
from zoneq.storage.leveldb import Op

ZONES = ["a", "ab", "a\x00", "a\x01", "bulk", "b\u00fclk"]

# (zone, msg_id, address) of a marked leased recipient.
Marked = tuple[str, int, str]

marked = st.lists(
    st.tuples(st.sampled_from(ZONES), st.integers(0, 3), st.sampled_from(["x@a.test", "y@b"])),
    unique=True,
    max_size=12,
)


def marks_of(recipients: list[Marked]) -> dict[bytes, str]:
    marks: dict[bytes, str] = {}
    for zone, msg_id, address in recipients:
        mark(marks, keys.record(keys.READY, zone, msg_id, address), f"hold {zone}")
    return marks


def ready_key(recipient: Marked) -> bytes:
    return keys.record(keys.READY, *recipient)


@settings(max_examples=300, deadline=None)
@given(marked, st.one_of(st.sampled_from(ZONES), st.integers(0, 3)))
@example([("a", 1, "x@a.test"), ("ab", 1, "x@a.test"), ("a\x00", 2, "y@b")], "a")
def test_a_release_forgets_its_marks_and_no_others(
    recipients: list[Marked], released: str | int
) -> None:
    """A zone's release (a name) forgets that zone's marks, a message's (an id) that
    message's in every zone; each gives the deletes of exactly those on disk."""
    marks = marks_of(recipients)

    def release() -> list[Op]:
        if isinstance(released, str):
            return unmark_zone(marks, released)
        return unmark_message(marks, released)

    place = 0 if isinstance(released, str) else 1  # the zone, or the message id
    mine = {ready_key(r) for r in recipients if r[place] == released}
    assert sorted(release()) == sorted((hold_mark_key(key), None) for key in mine)
    assert set(marks) == {ready_key(r) for r in recipients} - mine
    assert release() == []  # forgotten: a second release writes nothing


@pytest.mark.parametrize(
    ("zone", "kept"),
    [("a", ["ab", "a\x00", "a\x01"]), ("ab", ["a", "a\x00", "a\x01"]), ("bulk", ZONES[:4])],
)
def test_a_zone_is_never_matched_by_a_prefix_of_its_name(zone: str, kept: list[str]) -> None:
    marks = marks_of([(z, 1, "x@a.test") for z in [zone, *kept]])
    assert unmark_zone(marks, zone) == [
        (hold_mark_key(keys.record(keys.READY, zone, 1, "x@a.test")), None)
    ]
    assert sorted(keys.decode_record(key)[1] for key in marks) == sorted(kept)
