"""The log's flood guard (``zoneq.logs``): marked fault reports are held back past a burst,
counted, and the count is always reported; unmarked lines always pass."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.logs import REPEATS, RepeatFilter

TEMPLATES = ("refusing MAIL from %s: %s", "report of lease %d not written: %s")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(template: str, *args: object, marked: bool = True) -> logging.LogRecord:
    made = logging.LogRecord("zoneq.test", logging.WARNING, __file__, 1, template, args, None)
    if marked:
        made.__dict__.update(REPEATS)
    return made


HELD_NOTE = re.compile(r"\((\d+) more like this held back in the previous window\)$")


@pytest.mark.parametrize(
    ("count", "burst", "passed"),
    [(1, 5, 1), (5, 5, 5), (6, 5, 5), (1000, 5, 5), (3, 1, 1)],
)
def test_a_burst_passes_and_the_rest_is_held(count: int, burst: int, passed: int) -> None:
    repeats = RepeatFilter(burst=burst, window=60, clock=Clock())
    let_through = [
        repeats.filter(record(TEMPLATES[0], f"10.0.0.{n}", "disk full")) for n in range(count)
    ]
    assert sum(let_through) == passed
    assert let_through[:passed] == [True] * passed
    held = [(text, n) for _name, _level, text, n in repeats.pending()]
    assert held == (
        [("refusing MAIL from 10.0.0.0: disk full", count - passed)] if count > passed else []
    )
    assert repeats.pending() == []  # counted once


def test_the_next_window_says_how_many_were_held() -> None:
    clock = Clock()
    repeats = RepeatFilter(burst=2, window=10, clock=clock)
    for n in range(7):
        repeats.filter(record(TEMPLATES[1], n, "EIO"))
    clock.now = 10.0
    first = record(TEMPLATES[1], 99, "EIO")
    assert repeats.filter(first)
    assert first.getMessage() == (
        "report of lease 99 not written: EIO (5 more like this held back in the previous window)"
    )


def test_unmarked_lines_and_other_call_sites_are_never_held() -> None:
    repeats = RepeatFilter(burst=1, window=60, clock=Clock())
    assert all(repeats.filter(record("possible duplicate: %s", n, marked=False)) for n in range(50))
    assert repeats.filter(record(TEMPLATES[0], "a", "b"))
    assert repeats.filter(record(TEMPLATES[1], 1, "b"))  # another template: its own burst
    assert not repeats.filter(record(TEMPLATES[0], "c", "d"))


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="burst"):
        RepeatFilter(burst=0)
    with pytest.raises(ValueError, match="window"):
        RepeatFilter(window=0)


@given(
    st.lists(
        st.tuples(st.sampled_from(TEMPLATES), st.floats(min_value=0, max_value=5)),
        max_size=300,
    ),
    st.integers(min_value=1, max_value=4),
)
def test_every_held_record_is_reported_exactly_once(
    stream: list[tuple[str, float]], burst: int
) -> None:
    """Passed + held announced by later windows + held at exit == records logged; and as
    windows start at a call site's first record, any span of ``window`` seconds lets at
    most two windows' bursts through."""
    clock = Clock()
    window = 3.0
    repeats = RepeatFilter(burst=burst, window=window, clock=clock)
    announced = 0
    passed_in_window: dict[str, list[float]] = {t: [] for t in TEMPLATES}
    for template, step in stream:
        clock.now += step
        made = record(template, 1, "x")
        if repeats.filter(made):
            times = passed_in_window[template]
            times.append(clock.now)
            note = HELD_NOTE.search(made.getMessage())
            announced += int(note.group(1)) if note else 0
    at_exit = sum(n for *_rest, n in repeats.pending())
    total_passed = sum(len(v) for v in passed_in_window.values())
    assert total_passed + announced + at_exit == len(stream)
    for times in passed_in_window.values():
        for start in times:
            assert sum(1 for t in times if start <= t < start + window) <= 2 * burst


def test_a_process_reports_what_it_held_back_when_it_exits() -> None:
    """Through ``configure`` as every zoneq process sets logging up: 5 lines, then one
    line at exit with the count of the other 95."""
    script = (
        "import logging\n"
        "from zoneq.logs import REPEATS, configure\n"
        "configure('info')\n"
        "log = logging.getLogger('zoneq.receiver')\n"
        "text = 'refusing MAIL from %s: queue unavailable'\n"
        "for n in range(100):\n"
        "    log.warning(text, f'10.0.0.{n}', extra=REPEATS)\n"
        "log.warning('possible duplicate: %s', 'kept')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    lines = done.stderr.splitlines()
    assert sum("refusing MAIL from" in line for line in lines) == 6
    assert any("possible duplicate: kept" in line for line in lines)
    assert lines[-1].endswith(
        "95 more like this held back at exit: refusing MAIL from 10.0.0.0: queue unavailable"
    )
