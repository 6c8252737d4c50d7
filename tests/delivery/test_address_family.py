"""Address families: a zone's pool decides which MX addresses its connections may try.

The pure part (the pool's families and its per-family pick, the config check of ``ipv6``
against the pool) is table-driven and a Hypothesis property; the walk runs on real parts:
the in-process core and worker (``inproc.py``), dnsmasq answering A and AAAA records, and
Postfix's smtp-sink as the MX on 127.0.0.x or on ::1.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.delivery.inproc import InProc, config_for, running
from tests.support.dnsmasq import running_dnsmasq
from tests.support.smtpsink import run_smtp_sink
from zoneq.config import InvalidConfig, validate_config
from zoneq.config.zones import PoolAddress
from zoneq.delivery.pool import SourcePool, family_of

V4 = ("127.0.0.2", "127.0.0.3")
V6 = ("::1", "2001:db8::7")


def pool(*addresses: str) -> SourcePool:
    return SourcePool([PoolAddress(address=a) for a in addresses], "zone.test")


@pytest.mark.parametrize(
    ("addresses", "families"),
    [
        ((), None),  # no pool: the system picks, for either family
        (V4, frozenset({4})),
        (V6, frozenset({6})),
        ((V4[0], V6[0]), frozenset({4, 6})),
    ],
)
def test_a_pool_knows_its_families(
    addresses: tuple[str, ...], families: frozenset[int] | None
) -> None:
    assert pool(*addresses).families == families


def test_a_pool_refuses_a_family_it_does_not_have() -> None:
    with pytest.raises(LookupError, match="no IPv6 address"):
        pool(*V4).choose(family=6)


@given(
    st.lists(st.sampled_from([*V4, *V6]), min_size=1, max_size=4, unique=True),
    st.sampled_from([4, 6]),
    st.sets(st.sampled_from([*V4, *V6])),
)
def test_the_pick_for_a_family_is_of_that_family_at_the_pools_ratio(
    addresses: list[str], family: int, resting: set[str]
) -> None:
    chooser = pool(*addresses)
    mine = [a for a in addresses if family_of(a) == family]
    if not mine:
        with pytest.raises(LookupError):
            chooser.choose(resting, family)
        return
    awake = [a for a in mine if a not in resting] or mine
    picks = Counter(str(chooser.choose(resting, family).address) for _ in range(3 * len(awake)))
    # Equal ratios: each awake address of the family exactly three times, nothing else.
    assert picks == Counter({a: 3 for a in awake})


ZONES: dict[str, Any] = {"bounces": {}}


@pytest.mark.parametrize(
    ("zone", "problem"),
    [
        ({"ipv6": False, "pool": [{"address": "::1"}]}, "every pool address is IPv6"),
        ({"ipv6": False, "pool": [{"address": "::1"}, {"address": "2001:db8::1"}]}, "IPv6"),
        ({"ipv6": True, "pool": [{"address": "127.0.0.1"}]}, None),  # IPv4 only: fine
        ({"ipv6": False, "pool": [{"address": "127.0.0.1"}, {"address": "::1"}]}, None),
        ({"ipv6": True, "pool": [{"address": "::1"}]}, None),
        ({"ipv6": False}, None),  # no pool
    ],
)
def test_ipv6_off_with_an_ipv6_only_pool_is_an_error_naming_the_key(
    zone: dict[str, Any], problem: str | None
) -> None:
    data = {"zones": {**ZONES, "default": zone}}
    if problem is None:
        assert validate_config(data).zones["default"].ipv6 is zone["ipv6"]
        return
    with pytest.raises(InvalidConfig) as info:
        validate_config(data)
    problems = {p.key: p.text for p in info.value.problems}
    assert problem in problems["zones.default.ipv6"], problems


# --- the walk, on real parts ------------------------------------------------------------------


def ipv6_loopback() -> bool:
    """Can this machine listen and connect on ::1?  (Some sandboxes have no IPv6.)"""
    try:
        with socket.socket(socket.AF_INET6) as server:
            server.bind(("::1", 0))
            server.listen()
            with socket.create_connection(("::1", server.getsockname()[1]), timeout=2):
                return True
    except OSError:
        return False


def dead_count(core: InProc) -> int:
    # The worker's own dead-host cache: what the other delivery loops would skip.
    return len(core.worker._dead_hosts)


class Family(NamedTuple):
    source: str  # the pool's one address
    sink_host: str | None  # where the sink listens (None: a random 127.0.0.x)
    other: str  # an address of the other family
    has: str  # what the 4.4.4 text says the pool has
    client: str  # the client address the sink reports


FAMILIES = [
    pytest.param(Family("127.0.0.1", None, "::1", "IPv4", "127.0.0.1"), id="ipv4-pool"),
    pytest.param(
        Family("::1", "::1", "127.0.0.1", "IPv6", "ipv6:::1"),
        id="ipv6-pool",
        marks=pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here"),
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize("case", FAMILIES)
def test_a_pool_of_one_family_skips_mx_addresses_of_the_other_and_marks_nothing_dead(
    tmp_path: Path, case: Family
) -> None:
    """both.test's better MX has only an address of the other family, the second one both;
    other.test has only the other family's.  The zone keeps ``ipv6 = true`` (the default).
    Before the fix an IPv4 pool bound 127.0.0.1 to connect to ::1, failed, marked ::1 dead,
    and other.test was deferred as unreachable."""
    source, other = case.source, case.other
    with run_smtp_sink(host=case.sink_host) as sink:
        records = [
            "mx-host=both.test,mxo.both.test,10",
            "mx-host=both.test,mx.both.test,20",
            f"host-record=mxo.both.test,{other}",
            f"host-record=mx.both.test,{sink.host},{other}",
            "mx-host=other.test,mx.other.test,10",
            f"host-record=mx.other.test,{other}",
        ]
        with running_dnsmasq(records, tmp_path / "dns") as dns:
            config = config_for(tmp_path, dns, sink.port, {"pool": [{"address": source}]})

            async def main() -> None:
                async with running(config) as core:
                    await core.queue(["a@both.test"])
                    await core.queue(["b@other.test"])
                    await core.until(
                        lambda: bool(core.events("delivered") and core.events("deferred"))
                    )
                    (delivered,) = core.events("delivered")
                    assert (delivered.recipient, delivered.mx) == ("a@both.test", "mx.both.test")
                    assert delivered.source_ip == source
                    (deferred,) = core.events("deferred")
                    assert deferred.recipient == "b@other.test"
                    assert deferred.enhanced == "4.4.4"
                    assert deferred.text is not None
                    assert "no usable address family" in deferred.text
                    assert f"has {case.has} addresses only" in deferred.text
                    assert dead_count(core) == 0

            asyncio.run(main())
        (received,) = sink.messages(1)
    assert received.client_addr == case.client
    assert received.rcpt_args == ["<a@both.test>"]


@pytest.mark.integration
def test_a_pool_address_that_cannot_be_bound_is_our_fault_not_the_mxs(tmp_path: Path) -> None:
    """A pool address that left the host (here one it never had, from the documentation
    range: the bind fails in the kernel, nothing is sent): the recipient is deferred and
    the MX is not marked dead, so other zones' loops still use it."""
    with run_smtp_sink() as sink:
        records = ["mx-host=ok.test,mx.ok.test,10", f"host-record=mx.ok.test,{sink.host}"]
        with running_dnsmasq(records, tmp_path / "dns") as dns:
            config = config_for(tmp_path, dns, sink.port, {"pool": [{"address": "127.0.0.1"}]})
            # The start-up check passed; then the address went away (as it would if an
            # interface were reconfigured under a running zoneq).
            config.zones["default"].pool[0] = PoolAddress(address="192.0.2.55")

            async def main() -> None:
                async with running(config) as core:
                    await core.queue(["a@ok.test"])
                    await core.until(lambda: bool(core.events("deferred")))
                    (deferred,) = core.events("deferred")
                    assert deferred.enhanced is not None and deferred.enhanced.startswith("4.")
                    assert dead_count(core) == 0
                    assert core.store.message_count() == 1  # kept for the next attempt

            asyncio.run(main())
        assert sink.messages(1, timeout=0.3) == []
