"""Message ids: strictly increasing whatever the clock does, above the floor, printable."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zoneq.protocol.ids import (
    COUNTER_BITS,
    ID_HEX_WIDTH,
    IdGenerator,
    format_id,
    id_time_ms,
    parse_id,
)

T0 = 1_700_000_000_000
# Clock readings: realistic wall clocks plus the edges (0, one tick, far future within u64).
CLOCK = st.one_of(
    st.integers(T0 - 10_000, T0 + 10_000),
    st.integers(0, 2**51),
    st.sampled_from([0, 1, T0, 2**51]),
)
U64 = st.integers(0, 2**64 - 1)


@given(st.lists(CLOCK, min_size=1, max_size=300))
@example([T0, T0 - 1, T0 - 1000, T0])  # the clock steps back
@example([T0] * 5000)  # more than 4096 ids in one millisecond
@example([T0 + 1, T0, T0 + 1])
def test_ids_strictly_increase_for_any_clock(readings: list[int]) -> None:
    gen = IdGenerator()
    ids = [gen.next(now) for now in readings]
    assert all(a < b for a, b in itertools.pairwise(ids))


@given(st.lists(st.tuples(CLOCK, st.integers(1, 6000)), min_size=1, max_size=4))
@settings(max_examples=25, deadline=None)
def test_ids_strictly_increase_through_bursts(bursts: list[tuple[int, int]]) -> None:
    gen = IdGenerator()
    last = -1
    for now, count in bursts:
        for _ in range(count):
            msg_id = gen.next(now)
            assert msg_id > last
            last = msg_id


def test_more_than_4096_ids_in_one_millisecond_borrow_the_next() -> None:
    gen = IdGenerator()
    ids = [gen.next(T0) for _ in range(3 * (1 << COUNTER_BITS) + 5)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    assert id_time_ms(ids[0]) == T0
    assert id_time_ms(ids[(1 << COUNTER_BITS) - 1]) == T0
    assert id_time_ms(ids[1 << COUNTER_BITS]) == T0 + 1  # borrowed ahead
    # The next real millisecond after a borrow still yields larger ids.
    assert gen.next(T0 + 1) > ids[-1]


def test_ids_carry_their_time() -> None:
    gen = IdGenerator()
    assert id_time_ms(gen.next(T0)) == T0
    assert id_time_ms(gen.next(T0 + 5)) == T0 + 5


@given(floor=U64.filter(lambda f: f < 2**63), readings=st.lists(CLOCK, min_size=1, max_size=50))
@example(floor=(T0 + 1_000) << COUNTER_BITS, readings=[T0, T0 + 1_000, T0 + 2_000])
def test_floor_is_respected(floor: int, readings: list[int]) -> None:
    gen = IdGenerator(floor)
    ids = [gen.next(now) for now in readings]
    assert all(msg_id > floor for msg_id in ids)
    assert all(a < b for a, b in itertools.pairwise(ids))


@given(first=st.lists(CLOCK, min_size=1, max_size=20), floor=U64.filter(lambda f: f < 2**63))
def test_raise_floor_never_lowers(first: list[int], floor: int) -> None:
    gen = IdGenerator()
    issued = [gen.next(now) for now in first]
    gen.raise_floor(floor)
    following = gen.next(0)  # the clock went all the way back
    assert following > floor
    assert following > max(issued)


def test_raise_floor_below_last_is_a_no_op() -> None:
    gen = IdGenerator()
    a = gen.next(T0)
    gen.raise_floor(5)
    assert gen.next(T0) == a + 1


# --- printable form ---------------------------------------------------------------------


@given(U64)
@example(0)
@example(2**64 - 1)
def test_format_parse_round_trip(msg_id: int) -> None:
    text = format_id(msg_id)
    assert len(text) == ID_HEX_WIDTH
    assert text == text.lower()
    assert parse_id(text) == msg_id


@given(U64, U64)
def test_format_preserves_order(a: int, b: int) -> None:
    assert (format_id(a) < format_id(b)) == (a < b)


def test_format_known_value() -> None:
    assert format_id(1) == "0000000000000001"
    assert format_id(0xDEADBEEF) == "00000000deadbeef"


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "0",
        "123",
        "0x00000000deadbe",
        " 0000000deadbeef",
        "0000000deadbeef ",
        "0000000deadbeef\n",
        "000000000000000g",
        "-000000000000001",
        "+000000000000001",
        "0000_00000000001",
        "00000000000000001",  # 17 digits
        "\u0661" * 16,  # ARABIC-INDIC DIGIT ONE: int() would accept it
        "\uff10" * 16,  # FULLWIDTH DIGIT ZERO: int() would accept it too
    ],
)
def test_parse_id_rejects_garbage(garbage: str) -> None:
    with pytest.raises(ValueError):
        parse_id(garbage)


@pytest.mark.parametrize(
    ("text", "msg_id"),
    [
        ("00000000deadbeef", 0xDEADBEEF),
        ("00000000DEADBEEF", 0xDEADBEEF),  # as a tool showing hex in upper case copies it
        ("00000000DeadBeef", 0xDEADBEEF),
        ("FFFFFFFFFFFFFFFF", 2**64 - 1),
    ],
)
def test_parse_id_reads_either_case(text: str, msg_id: int) -> None:
    assert parse_id(text) == msg_id


@given(st.text(max_size=20))
def test_parse_id_accepts_only_what_format_id_writes_in_either_case(text: str) -> None:
    try:
        value = parse_id(text)
    except ValueError:
        return
    assert format_id(value) == text.lower()
