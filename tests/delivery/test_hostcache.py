"""The dead-host cache with an injected clock: expiry, backoff growth and cap, revival, bound."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.delivery.hostcache import DeadHostCache

IP = "192.0.2.1"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(clock: FakeClock, **overrides: float) -> DeadHostCache:
    settings = {"base": 60.0, "cap": 600.0, "max_entries": 100}
    settings.update(overrides)
    return DeadHostCache(
        clock=clock,
        base=settings["base"],
        cap=settings["cap"],
        max_entries=int(settings["max_entries"]),
    )


def test_unknown_host_is_alive() -> None:
    cache = make(FakeClock())
    assert not cache.is_dead(IP)
    assert cache.dead_for(IP) == 0


def test_dead_host_expires_on_its_own() -> None:
    clock = FakeClock()
    cache = make(clock)
    assert cache.mark_dead(IP) == 60
    assert cache.is_dead(IP)
    clock.advance(59.9)
    assert cache.is_dead(IP)
    assert cache.dead_for(IP) == pytest.approx(0.1)
    clock.advance(0.1)
    assert not cache.is_dead(IP)


def test_backoff_doubles_up_to_the_cap() -> None:
    clock = FakeClock()
    cache = make(clock)
    periods = []
    for _ in range(7):
        period = cache.mark_dead(IP)
        periods.append(period)
        clock.advance(period)  # the probe after the dead period fails again
    assert periods == [60, 120, 240, 480, 600, 600, 600]


def test_failures_while_dead_do_not_extend_the_period() -> None:
    clock = FakeClock()
    cache = make(clock)
    cache.mark_dead(IP)
    clock.advance(10)
    # Connections that were under way when the host died report in late.
    assert cache.mark_dead(IP) == 50
    assert cache.mark_dead(IP) == 50
    clock.advance(50)
    assert not cache.is_dead(IP)
    assert cache.mark_dead(IP) == 120  # the second real failure, not the fourth


def test_failure_count_is_forgotten_long_after_expiry() -> None:
    clock = FakeClock()
    cache = make(clock)
    cache.mark_dead(IP)
    clock.advance(60)
    cache.mark_dead(IP)  # 120 s
    clock.advance(120 + 599)
    assert cache.mark_dead(IP) == 240  # still within cap after the period: keeps growing
    clock.advance(240 + 600)
    assert not cache.is_dead(IP)
    assert len(cache) == 0  # checking it dropped the stale entry
    assert cache.mark_dead(IP) == 60  # starts again from base


def test_mark_alive_forgets_at_once() -> None:
    clock = FakeClock()
    cache = make(clock)
    cache.mark_dead(IP)
    clock.advance(60)
    cache.mark_dead(IP)
    cache.mark_alive(IP)
    assert not cache.is_dead(IP)
    assert len(cache) == 0
    assert cache.mark_dead(IP) == 60
    cache.mark_alive("198.51.100.7")  # unknown: nothing to do


def test_addresses_are_compared_in_canonical_form() -> None:
    cache = make(FakeClock())
    cache.mark_dead("2001:DB8:0:0::0001")
    assert cache.is_dead("2001:db8::1")
    cache.mark_alive("2001:db8::1")
    assert not cache.is_dead("2001:DB8:0:0::0001")


def test_keys_must_be_addresses() -> None:
    cache = make(FakeClock())
    with pytest.raises(ValueError):
        cache.mark_dead("mx.example.org")


def test_hosts_are_independent() -> None:
    cache = make(FakeClock())
    cache.mark_dead(IP)
    assert not cache.is_dead("192.0.2.2")


def test_size_is_bounded_forgetting_the_oldest() -> None:
    clock = FakeClock()
    cache = make(clock, max_entries=3)
    for last in range(1, 6):
        cache.mark_dead(f"192.0.2.{last}")
        clock.advance(1)
    assert len(cache) == 3
    assert not cache.is_dead("192.0.2.1")
    assert not cache.is_dead("192.0.2.2")
    assert all(cache.is_dead(f"192.0.2.{last}") for last in (3, 4, 5))


def test_settings_are_checked() -> None:
    clock = FakeClock()
    with pytest.raises(ValueError, match="base"):
        make(clock, base=0)
    with pytest.raises(ValueError, match="base"):
        make(clock, base=100, cap=50)
    with pytest.raises(ValueError, match="max_entries"):
        make(clock, max_entries=0)


@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["dead", "alive", "wait"]), st.floats(0, 2000)), max_size=40
    )
)
def test_never_dead_longer_than_the_cap(steps: list[tuple[str, float]]) -> None:
    clock = FakeClock()
    cache = make(clock)
    for action, seconds in steps:
        if action == "dead":
            assert 0 < cache.mark_dead(IP) <= 600
        elif action == "alive":
            cache.mark_alive(IP)
        else:
            clock.advance(seconds)
        assert 0 <= cache.dead_for(IP) <= 600
