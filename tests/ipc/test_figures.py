"""WorkerFigures: the latest count per worker connection, summed per zone, gone with the
connection; every configured zone shown, 0 until a worker says otherwise."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.ipc.figures import WorkerFigures

ZONES = ("default", "bulk")

# One step: the worker on connection ``owner`` of ``zone`` says ``count``; None: it is gone.
Step = tuple[str, str, int | None]
CASES: list[tuple[str, list[Step], dict[str, int]]] = [
    ("nothing said", [], {"default": 0, "bulk": 0}),
    ("one worker", [("w#1", "default", 2)], {"default": 2, "bulk": 0}),
    (
        "the latest value counts, not the sum of reports",
        [("w#1", "default", 2), ("w#1", "default", 1)],
        {"default": 1, "bulk": 0},
    ),
    (
        "a zone's workers add up",
        [("w#1", "default", 2), ("w#2", "default", 3), ("w#3", "bulk", 1)],
        {"default": 5, "bulk": 1},
    ),
    (
        "a worker that disconnects stops counting",
        [("w#1", "default", 2), ("w#2", "default", 3), ("w#1", "default", None)],
        {"default": 3, "bulk": 0},
    ),
    (
        "back to none once the host is alive again",
        [("w#1", "default", 1), ("w#1", "default", 0)],
        {"default": 0, "bulk": 0},
    ),
    (
        "a connection gone that never said anything",
        [("w#9", "bulk", None)],
        {"default": 0, "bulk": 0},
    ),
    (
        "a zone the figures were not told of still shows",
        [("w#1", "other", 4)],
        {"default": 0, "bulk": 0, "other": 4},
    ),
]


def play(figures: WorkerFigures, steps: list[Step]) -> None:
    for owner, zone, count in steps:
        if count is None:
            figures.forget(owner)
        else:
            figures.dead_hosts_of(owner, zone, count)


@pytest.mark.parametrize(("steps", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_dead_hosts_per_zone(steps: list[Step], expected: dict[str, int]) -> None:
    figures = WorkerFigures(ZONES)
    play(figures, steps)
    assert figures.dead_hosts() == expected


def test_a_negative_count_is_refused_and_changes_nothing() -> None:
    figures = WorkerFigures(ZONES)
    figures.dead_hosts_of("w#1", "default", 2)
    with pytest.raises(ValueError, match="cannot be negative"):
        figures.dead_hosts_of("w#1", "default", -1)
    assert figures.dead_hosts()["default"] == 2


steps = st.lists(
    st.tuples(
        st.sampled_from(["w#1", "w#2", "w#3", "w#4"]),
        st.sampled_from(ZONES),
        st.none() | st.integers(0, 10_000),
    ),
    max_size=40,
)


@given(steps)
def test_totals_are_the_sum_of_each_connected_workers_latest_value(sequence: list[Step]) -> None:
    figures = WorkerFigures(ZONES)
    play(figures, sequence)
    # The model: the last word of each connection still up, added up per zone.
    latest: dict[str, tuple[str, int]] = {}
    for owner, zone, count in sequence:
        if count is None:
            latest.pop(owner, None)
        else:
            latest[owner] = (zone, count)
    expected = {zone: sum(n for z, n in latest.values() if z == zone) for zone in ZONES}
    assert figures.dead_hosts() == expected
