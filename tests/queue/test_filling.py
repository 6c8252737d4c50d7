"""``Filling``: pure planning of jobs across refill windows (``zoneq/queue/scheduler.py``)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoneq.queue.scheduler import Filling, Planned

Item = tuple[int, str, int]  # (msg_id, domain, n)


def group(item: Item) -> tuple[int, str]:
    return item[0], item[1]


def sizes(jobs: list[Planned[Item]]) -> list[tuple[int, str, int]]:
    return [(job.msg_id, job.domain, len(job.items)) for job in jobs]


def bulk(msg_id: int, count: int, domains: int) -> list[Item]:
    return [(msg_id, f"d{n % domains}", n) for n in range(count)]


@pytest.mark.parametrize(
    ("windows", "cuts", "wanted", "left_open"),
    [
        # Cut inside a bulk message: its partial jobs wait, the next window tops them up.
        ([bulk(1, 60, 2)], [True], [], 60),
        ([bulk(1, 60, 2), bulk(1, 60, 2)], [True, True], [(1, "d0", 50), (1, "d1", 50)], 20),
        # Not cut: nothing more is coming now, everything goes.
        ([bulk(1, 60, 2)], [False], [(1, "d0", 30), (1, "d1", 30)], 0),
        # Fewer than one job's worth of the last message: not held.
        ([[(1, "a", 0), (2, "a", 1)]], [True], [(1, "a", 1), (2, "a", 1)], 0),
        # The next message starts: the open one is whole and goes first.
        (
            [bulk(1, 60, 2), [(2, "d0", 0)]],
            [True, False],
            [(1, "d0", 30), (1, "d1", 30), (2, "d0", 1)],
            0,
        ),
    ],
)
def test_plan(
    windows: list[list[Item]], cuts: list[bool], wanted: list[tuple[int, str, int]], left_open: int
) -> None:
    filling: Filling[Item] = Filling(group=group, max_recipients=50, limit=1000)
    jobs: list[Planned[Item]] = []
    for items, cut in zip(windows, cuts, strict=True):
        jobs = filling.plan(items, cut=cut)
    assert sizes(jobs) == wanted
    assert len(filling) == left_open


def test_over_the_limit_the_fullest_open_jobs_go_first() -> None:
    filling: Filling[Item] = Filling(group=group, max_recipients=50, limit=40)
    items = [(1, "big", n) for n in range(30)] + [(1, "small", n) for n in range(20)]
    assert sizes(filling.plan(items, cut=True)) == [(1, "big", 30)]
    assert len(filling) == 20
    assert sizes(filling.flush()) == [(1, "small", 20)]
    assert len(filling) == 0


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 120), min_size=1, max_size=4),
    domains=st.integers(1, 12),
    window=st.integers(1, 300),
    limit=st.integers(0, 2000),
    size=st.integers(1, 60),
)
def test_every_item_once_in_jobs_of_one_message_and_domain(
    counts: list[int], domains: int, window: int, limit: int, size: int
) -> None:
    # Messages in key order, read a window at a time as the service does.
    stream = [
        (msg_id, f"d{n % domains:02d}", n)
        for msg_id, count in enumerate(counts)
        for n in sorted(range(count), key=lambda n: f"u{n:03d}@d{n % domains:02d}")
    ]
    filling: Filling[Item] = Filling(group=group, max_recipients=size, limit=limit)
    jobs: list[Planned[Item]] = []
    for start in range(0, len(stream), window):
        items = stream[start : start + window]
        jobs += filling.plan(items, cut=len(items) == window)
        assert len(filling) <= limit
    jobs += filling.flush()
    assert Counter(item for job in jobs for item in job.items) == Counter(stream)
    assert all(0 < len(job.items) <= size for job in jobs)
    assert all({group(item) for item in job.items} == {(job.msg_id, job.domain)} for job in jobs)
    if len(counts) == 1 and window >= size and limit >= domains * size:
        # One message, windows of at least a job, room for every domain's partial job:
        # as few jobs as can be.
        per_group = Counter(group(item) for item in stream)
        assert len(jobs) == sum(-(-n // size) for n in per_group.values())
