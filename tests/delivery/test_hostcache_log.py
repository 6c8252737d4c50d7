"""What the dead-host cache tells the operator: one line per address per period, not per job.

Also its count of addresses resting now.  The clock is injected, as in test_hostcache.py.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.delivery.test_hostcache import FakeClock, make

IP = "192.0.2.1"
LOGGER = "zoneq.delivery"


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_marking_dead_logs_the_address_and_the_period(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    cache = make(FakeClock())
    cache.mark_dead(IP)
    assert lines(caplog) == [f"MX address {IP} marked dead for 60 s (failure 1)"]


def test_failures_during_the_period_log_nothing_more(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    cache = make(clock)
    cache.mark_dead(IP)
    for _ in range(50):  # every queued job asks, and concurrent connections fail too
        clock.advance(1.0)
        assert cache.is_dead(IP)
        cache.mark_dead(IP)
    assert len(lines(caplog)) == 1


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        # (seconds to advance, then what to do); the lines expected, in order
        ([(60, "ask"), (0, "ask"), (1, "ask")], ["dead 60 1", "again 60 1"]),
        (
            [(60, "ask"), (0, "fail"), (120, "ask")],
            ["dead 60 1", "again 60 1", "dead 120 2", "again 120 2"],
        ),
        ([(60, "ask"), (0, "alive"), (0, "ask")], ["dead 60 1", "again 60 1", "alive"]),
        ([(10, "alive"), (0, "alive")], ["dead 60 1", "alive"]),
        ([(10, "ask"), (10, "ask")], ["dead 60 1"]),
    ],
)
def test_each_period_logs_its_marking_and_its_probe_once(
    caplog: pytest.LogCaptureFixture, events: list[tuple[float, str]], expected: list[str]
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    cache = make(clock)
    cache.mark_dead(IP)
    for seconds, action in events:
        clock.advance(seconds)
        if action == "ask":
            cache.is_dead(IP)
        elif action == "fail":
            cache.mark_dead(IP)
        else:
            cache.mark_alive(IP)
    words = {
        "dead": f"MX address {IP} marked dead for {{}} s (failure {{}})",
        "again": f"MX address {IP}: trying again after {{}} s dead (failure {{}})",
        "alive": f"MX address {IP} is alive again",
    }
    want = [words[w.split()[0]].format(*w.split()[1:]) for w in expected]
    assert lines(caplog) == want


def test_alive_for_an_unknown_address_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    make(FakeClock()).mark_alive(IP)
    assert lines(caplog) == []


@given(
    st.lists(
        st.tuples(st.integers(0, 20), st.floats(0, 200, allow_nan=False)),
        max_size=40,
    )
)
def test_resting_counts_the_addresses_inside_a_period(marks: list[tuple[int, float]]) -> None:
    clock = FakeClock()
    cache = make(clock)
    for host, advance in marks:
        cache.mark_dead(f"192.0.2.{host}")
        clock.advance(advance)
    addresses = {f"192.0.2.{host}" for host, _ in marks}
    assert cache.resting() == sum(1 for a in addresses if cache.dead_for(a) > 0)
    clock.advance(601.0)  # past every period (the cap is 600 s)
    assert cache.resting() == 0
