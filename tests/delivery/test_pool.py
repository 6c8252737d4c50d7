"""Source address pools: the choice by ratio (pure), and 1,000 deliveries seen at smtp-sink."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.delivery.inproc import config_for, dns_for, running
from tests.storage.conftest import async_test
from tests.support.smtpsink import run_smtp_sink
from zoneq.config.zones import PoolAddress
from zoneq.delivery.pool import Source, SourcePool


def pool(*entries: tuple[str, float], helo: str | None = None) -> SourcePool:
    return SourcePool(
        [
            PoolAddress(address=a, ratio=r, ehlo_name=helo and f"{helo}{n}")
            for n, (a, r) in enumerate(entries)
        ],
        "zone.test",
    )


@pytest.mark.parametrize(
    ("entries", "picks", "expected"),
    [
        # Smooth: the heavy address's turns are spread out, not bunched (nginx's sequence).
        ((("a", 3), ("b", 1)), 8, "aaba" * 2),
        ((("a", 5), ("b", 1), ("c", 1)), 7, "aabacaa"),
        ((("a", 1), ("b", 1)), 4, "abab"),
        ((("a", 1),), 3, "aaa"),
        ((("a", 0.5), ("b", 1.5)), 4, "babb"),  # ratios need not be integers
    ],
)
def test_weighted_round_robin_sequence(
    entries: tuple[tuple[str, float], ...], picks: int, expected: str
) -> None:
    chooser = pool(*((f"127.0.0.{ord(n) - 96}", r) for n, r in entries))
    got = "".join(
        chr(96 + int(str(chooser.choose().address).rsplit(".", 1)[1])) for _ in range(picks)
    )
    assert got == expected


@given(st.lists(st.integers(min_value=1, max_value=20), min_size=1, max_size=6), st.integers(1, 5))
def test_each_address_gets_exactly_its_ratio_in_every_full_round(
    weights: list[int], rounds: int
) -> None:
    chooser = pool(*((f"127.0.0.{n + 1}", float(w)) for n, w in enumerate(weights)))
    counts = Counter(chooser.choose().address for _ in range(sum(weights) * rounds))
    assert counts == {f"127.0.0.{n + 1}": w * rounds for n, w in enumerate(weights)}


@given(
    st.lists(st.integers(min_value=1, max_value=20), min_size=2, max_size=6),
    st.data(),
)
def test_resting_addresses_are_never_chosen_while_others_are_left(
    weights: list[int], data: st.DataObject
) -> None:
    addresses = [f"127.0.0.{n + 1}" for n in range(len(weights))]
    resting = data.draw(st.sets(st.sampled_from(addresses), max_size=len(addresses) - 1))
    chooser = pool(*zip(addresses, map(float, weights), strict=True))
    chosen = {chooser.choose(resting).address for _ in range(3 * sum(weights))}
    assert chosen and not chosen & resting
    # The others keep their ratio among themselves.
    awake = [(a, w) for a, w in zip(addresses, weights, strict=True) if a not in resting]
    fresh = pool(*((a, float(w)) for a, w in awake))
    counts = Counter(fresh.choose(resting).address for _ in range(sum(w for _, w in awake)))
    assert counts == dict(awake)


def test_all_resting_uses_the_whole_pool_and_no_pool_lets_the_system_choose() -> None:
    chooser = pool(("127.0.0.1", 1), ("127.0.0.2", 1), helo="out")
    both = {"127.0.0.1", "127.0.0.2"}
    assert {chooser.choose(both).address for _ in range(4)} == both
    assert chooser.choose() == Source("127.0.0.1", "out0")  # each address's own EHLO name
    assert chooser.choose() == Source("127.0.0.2", "out1")
    assert pool(("127.0.0.1", 1)).choose() == Source("127.0.0.1", "zone.test")  # zone's name
    assert SourcePool([], "zone.test").choose({"127.0.0.1"}) == Source(None, "zone.test")


# --- at the sink ---------------------------------------------------------------------------------

DELIVERIES = 1000


@pytest.mark.integration
@async_test
async def test_a_thousand_deliveries_leave_from_the_pool_by_ratio(tmp_path: Path) -> None:
    """Pool 127.0.0.1 : 127.0.0.2 = 3 : 1, read from smtp-sink's record of each client."""
    with run_smtp_sink(host="127.0.0.9") as sink, dns_for(tmp_path, ["ok.test"], sink.host) as dns:
        zone = {
            "connections": 8,
            "pool": [
                {"address": "127.0.0.1", "ratio": 3, "ehlo_name": "one.zoneq.test"},
                {"address": "127.0.0.2", "ratio": 1, "ehlo_name": "two.zoneq.test"},
            ],
        }
        config = config_for(tmp_path, dns, sink.port, zone)
        async with running(config) as core:
            # One recipient each: a delivery is a transaction, and each picks its address.
            await asyncio.gather(*(core.queue([f"u{n}@ok.test"]) for n in range(DELIVERIES)))
            await core.until(lambda: core.store.message_count() == 0, timeout=120)
            reported = Counter(e.source_ip for e in core.events("delivered"))
        received = sink.messages(DELIVERIES, timeout=10)
    assert len(received) == DELIVERIES
    by_client: Counter[str] = Counter()
    for message in received:
        by_client[message.client_addr] += 1
        # Each address says its own EHLO name (it should match its PTR).
        expected = {"127.0.0.1": "one.zoneq.test", "127.0.0.2": "two.zoneq.test"}
        assert message.helo == expected[message.client_addr]
    share = by_client["127.0.0.1"] / DELIVERIES
    assert abs(share - 0.75) <= 0.075, by_client  # within 10% of 75/25
    assert reported == by_client  # the events name the address the sink saw
