"""Tests for zoneq.protocol.retry: durations, schedules, next-attempt times."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.protocol.retry import (
    BOUNCE_MAX_AGE,
    DEFAULT_MAX_AGE,
    DEFAULT_SCHEDULE,
    RetrySchedule,
    format_duration,
    parse_duration,
)

S = 1_000
M = 60 * S
H = 60 * M
D = 24 * H


# --- parse_duration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", 30 * S),
        ("15m", 15 * M),
        ("2h", 2 * H),
        ("3d", 3 * D),
        ("1h30m", H + 30 * M),
        ("1d2h3m4s", D + 2 * H + 3 * M + 4 * S),
        ("1d4s", D + 4 * S),
        ("90", 90 * S),
        ("0", 0),
        ("0s", 0),
        ("  15m  ", 15 * M),
        ("\t2h\n", 2 * H),
        ("007m", 7 * M),
        ("90m", 90 * M),
        ("100000d", 100_000 * D),
    ],
)
def test_parse_duration_valid(text: str, expected: int) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("-5s", "negative"),
        ("-90", "negative"),
        (" -1h", "negative"),
        ("abc", "invalid"),
        ("15x", "invalid"),
        ("15M", "invalid"),
        ("1H", "invalid"),
        ("m", "invalid"),
        ("1.5h", "invalid"),
        ("1h 30m", "invalid"),
        ("1h30", "invalid"),
        ("h1", "invalid"),
        ("+5s", "invalid"),
        ("30m1h", "largest first"),
        ("1h1h", "largest first"),
        ("1s1m", "largest first"),
        ("1ms", "invalid"),  # no millisecond unit
        ("\u0663s", "invalid"),  # Arabic-Indic digit: int() would accept it, we do not
        ("\u0663", "invalid"),
        ("15m | 30m", "invalid"),
    ],
)
def test_parse_duration_invalid(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_duration(text)


@pytest.mark.parametrize(
    ("ms", "expected"),
    [
        (0, "0s"),
        (S, "1s"),
        (90 * S, "1m30s"),
        (H + 30 * M, "1h30m"),
        (3 * D, "3d"),
        (D + 4 * S, "1d4s"),
    ],
)
def test_format_duration(ms: int, expected: str) -> None:
    assert format_duration(ms) == expected


@pytest.mark.parametrize(("ms", "problem"), [(-1000, "negative"), (1500, "whole number")])
def test_format_duration_invalid(ms: int, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        format_duration(ms)


@st.composite
def rendered_durations(draw: st.DrawFn) -> tuple[str, int]:
    """A duration written in any accepted form, with its value in milliseconds."""
    if draw(st.booleans()):
        seconds = draw(st.integers(0, 10**9))
        return str(seconds), seconds * S
    units = [("d", D), ("h", H), ("m", M), ("s", S)]
    chosen = draw(st.lists(st.sampled_from(range(4)), min_size=1, max_size=4, unique=True))
    parts: list[str] = []
    total = 0
    for rank in sorted(chosen):
        unit, size = units[rank]
        count = draw(st.integers(0, 10**6))
        parts.append(f"{count}{unit}")
        total += count * size
    padding = draw(st.sampled_from(["", " ", "\t", "  "]))
    return f"{padding}{''.join(parts)}{padding}", total


@given(rendered_durations())
def test_parse_duration_of_rendered_text(case: tuple[str, int]) -> None:
    text, expected = case
    assert parse_duration(text) == expected


@given(st.integers(0, 10**12).map(lambda n: n * S))
def test_format_then_parse_round_trips(ms: int) -> None:
    assert parse_duration(format_duration(ms)) == ms


@given(st.text(max_size=12))
def test_parse_duration_never_fails_otherwise(text: str) -> None:
    # Any input either parses to a non-negative int or raises ValueError -- nothing else.
    try:
        value = parse_duration(text)
    except ValueError:
        return
    assert value >= 0


# --- RetrySchedule.parse ------------------------------------------------------------------


def test_default_schedule() -> None:
    schedule = RetrySchedule.parse()
    assert schedule == RetrySchedule((15 * M, 30 * M, 2 * H, 4 * H), 72 * H)
    assert RetrySchedule.parse(DEFAULT_SCHEDULE, DEFAULT_MAX_AGE) == schedule


def test_bounce_max_age() -> None:
    schedule = RetrySchedule.parse(DEFAULT_SCHEDULE, BOUNCE_MAX_AGE)
    assert schedule.max_age_ms == 24 * H


@pytest.mark.parametrize(
    ("spec", "max_age", "intervals", "max_age_ms"),
    [
        ("15m | 30m | 2h | 4h", "72h", (15 * M, 30 * M, 2 * H, 4 * H), 72 * H),
        ("15m|30m", "1d", (15 * M, 30 * M), D),
        ("  1h  ", "1h", (H,), H),  # max age equal to the first interval is allowed
        ("90 | 1h30m", "3d", (90 * S, 90 * M), 3 * D),
        ("4h | 1h", "2d", (4 * H, H), 2 * D),  # decreasing is odd but not wrong
        ("5m", "10000", (5 * M,), 10_000 * S),
    ],
)
def test_schedule_parse_valid(
    spec: str, max_age: str, intervals: tuple[int, ...], max_age_ms: int
) -> None:
    schedule = RetrySchedule.parse(spec, max_age)
    assert schedule.intervals_ms == intervals
    assert schedule.max_age_ms == max_age_ms


@pytest.mark.parametrize(
    ("spec", "max_age", "problem"),
    [
        ("", "72h", "empty"),
        ("   ", "72h", "empty"),
        ("|", "72h", "entry 1 is empty"),
        ("15m || 2h", "72h", "entry 2 is empty"),
        ("15m | 2h |", "72h", "entry 3 is empty"),
        ("15m | 0s", "72h", "entry 2 is zero"),
        ("0", "72h", "entry 1 is zero"),
        ("15m | -1h", "72h", "entry 2: negative"),
        ("15m | soon", "72h", "entry 2: invalid"),
        ("15m", "", "max age: empty"),
        ("15m", "forever", "max age: invalid"),
        ("15m", "-1d", "max age: negative"),
        ("2h | 4h", "1h", "shorter than the first retry interval"),
        ("15m", "0", "shorter than the first retry interval"),
    ],
)
def test_schedule_parse_invalid(spec: str, max_age: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        RetrySchedule.parse(spec, max_age)


@pytest.mark.parametrize(
    ("intervals", "max_age_ms", "problem"),
    [
        ((), H, "empty"),
        ((M, 0), H, "interval 2 .* positive"),
        ((-M,), H, "interval 1 .* positive"),
        ((2 * H,), H, "shorter"),
    ],
)
def test_schedule_constructor_validates(
    intervals: tuple[int, ...], max_age_ms: int, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        RetrySchedule(intervals, max_age_ms)


def test_schedule_is_frozen() -> None:
    schedule = RetrySchedule.parse()
    with pytest.raises(dataclasses.FrozenInstanceError):
        schedule.max_age_ms = 1  # type: ignore[misc]


# --- next_attempt / expires_at --------------------------------------------------------------

Q = 1_700_000_000_000  # an arbitrary queue time, ms since the epoch
DEFAULT = RetrySchedule.parse()


def test_expires_at() -> None:
    assert DEFAULT.expires_at(Q) == Q + 72 * H
    assert DEFAULT.expires_at(0) == 72 * H


@pytest.mark.parametrize(
    ("attempts", "now", "expected"),
    [
        # Regular intervals, counted from the failure time.
        (1, Q, Q + 15 * M),
        (2, Q + 15 * M, Q + 45 * M),
        (3, Q + 45 * M, Q + 45 * M + 2 * H),
        (4, Q + 3 * H, Q + 7 * H),
        # The last interval repeats.
        (5, Q + 7 * H, Q + 11 * H),
        (50, Q + 20 * H, Q + 24 * H),
        # Counted from now, not from the queue time: a late attempt is not "in the past".
        (1, Q + 5 * H, Q + 5 * H + 15 * M),
        # Next regular attempt would land after expiry: one last attempt at expiry instead.
        (20, Q + 70 * H, Q + 72 * H),
        (20, Q + 72 * H - 1, Q + 72 * H),
        # Exactly at the boundary: the regular attempt is the expiry itself.
        (20, Q + 68 * H, Q + 72 * H),
        # Expired: give up.
        (20, Q + 72 * H, None),
        (20, Q + 100 * H, None),
        (1, Q + 72 * H, None),
        # A clock that stepped back (now before queue time) still gives a sane answer.
        (1, Q - H, Q - H + 15 * M),
    ],
)
def test_next_attempt(attempts: int, now: int, expected: int | None) -> None:
    assert DEFAULT.next_attempt(attempts, Q, now) == expected


def test_final_attempt_then_give_up() -> None:
    # The attempt scheduled at the expiry time fails: that recipient is given up.
    final = DEFAULT.next_attempt(17, Q, Q + 70 * H)
    assert final == Q + 72 * H
    assert DEFAULT.next_attempt(18, Q, final) is None


@pytest.mark.parametrize("attempts", [0, -1])
def test_next_attempt_rejects_attempts_below_one(attempts: int) -> None:
    with pytest.raises(ValueError, match="attempts"):
        DEFAULT.next_attempt(attempts, Q, Q)


@pytest.mark.parametrize(
    ("attempts", "expected"),
    [(1, 15 * M), (2, 30 * M), (3, 2 * H), (4, 4 * H), (5, 4 * H), (1000, 4 * H)],
)
def test_interval_after(attempts: int, expected: int) -> None:
    assert DEFAULT.interval_after(attempts) == expected


def test_walk_whole_life_of_a_recipient() -> None:
    # Fail every attempt at exactly its scheduled time until given up.
    now = Q
    attempts = 0
    times: list[int] = []
    while True:
        attempts += 1
        nxt = DEFAULT.next_attempt(attempts, Q, now)
        if nxt is None:
            break
        times.append(nxt)
        now = nxt
    # 15m + 30m + 2h = 2h45m, then 4h steps: 2h45m + 17*4h = 70h45m, then final at 72h.
    assert times[:4] == [Q + 15 * M, Q + 45 * M, Q + 165 * M, Q + 405 * M]
    assert times[-2:] == [Q + 70 * H + 45 * M, Q + 72 * H]
    assert len(times) == 3 + 17 + 1
    assert now == DEFAULT.expires_at(Q)


# --- properties ---------------------------------------------------------------------------


@st.composite
def schedules(draw: st.DrawFn, *, sorted_intervals: bool = False) -> RetrySchedule:
    intervals = draw(st.lists(st.integers(1, 10 * D), min_size=1, max_size=6))
    if sorted_intervals:
        intervals.sort()
    max_age = draw(st.integers(intervals[0], 30 * D))
    return RetrySchedule(tuple(intervals), max_age)


times = st.integers(0, 2**45)
offsets = st.integers(-D, 60 * D)


@given(schedules(), st.integers(1, 100), times, offsets)
def test_next_attempt_bounds(
    schedule: RetrySchedule, attempts: int, queued: int, offset: int
) -> None:
    now = queued + offset
    result = schedule.next_attempt(attempts, queued, now)
    expiry = schedule.expires_at(queued)
    # None exactly when expired.
    assert (result is None) == (now >= expiry)
    if result is not None:
        assert now < result <= expiry
        # Either the regular interval or the capped final attempt.
        assert result in (now + schedule.interval_after(attempts), expiry)


@given(schedules(sorted_intervals=True), st.integers(1, 100), times, offsets)
def test_waits_do_not_shrink_for_a_non_decreasing_spec(
    schedule: RetrySchedule, attempts: int, queued: int, offset: int
) -> None:
    now = queued + offset
    first = schedule.next_attempt(attempts, queued, now)
    second = schedule.next_attempt(attempts + 1, queued, now)
    assert (first is None) == (second is None)
    if first is not None and second is not None:
        assert second >= first


@st.composite
def whole_second_schedules(draw: st.DrawFn) -> RetrySchedule:
    # Whole seconds only: that is all the textual syntax can express.
    intervals = draw(st.lists(st.integers(1, 10 * 86_400), min_size=1, max_size=6))
    max_age = draw(st.integers(intervals[0], 30 * 86_400))
    return RetrySchedule(tuple(i * S for i in intervals), max_age * S)


@given(whole_second_schedules(), st.sampled_from(["|", " | ", "  |\t"]))
def test_parse_of_rendered_schedule_round_trips(schedule: RetrySchedule, separator: str) -> None:
    spec = separator.join(format_duration(i) for i in schedule.intervals_ms)
    assert RetrySchedule.parse(spec, format_duration(schedule.max_age_ms)) == schedule
