"""A pool address that can no longer be bound (it left the host after start).

The pick is pure and table-driven (an injected clock); the walk runs on real parts: the
in-process core and worker (``inproc.py``), dnsmasq, and Postfix's smtp-sink on loopback,
with a documentation address (RFC 5737) that this host cannot bind as the address that left.
Before the fix the walk marked the whole family unbindable at the first failed bind and
deferred the job, and the round-robin kept handing the address out at its full ratio: with
ratio 1:1, about half the jobs were deferred.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Collection, Sequence
from pathlib import Path

import pytest

from tests.delivery.inproc import config_for, dns_for, running
from tests.support.smtpsink import run_smtp_sink
from zoneq.config.zones import PoolAddress
from zoneq.delivery.pool import SourcePool


def _unbindable() -> str:
    """A documentation address (RFC 5737) on no interface of this host: picked, not
    assumed, since a test machine may hold one (this workplace's have 192.0.2.2)."""
    for candidate in ("192.0.2.1", "198.51.100.1", "203.0.113.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((candidate, 0))
            except OSError:
                return candidate
    raise RuntimeError("every documentation address binds here: no address that left")


GONE = _unbindable()
JOBS = 6


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def picks(
    chooser: SourcePool,
    count: int,
    resting: Collection[str] = (),
    family: int | None = None,
    exclude: Collection[str] = (),
) -> list[str | None]:
    return [chooser.choose(resting, family, exclude).address for _ in range(count)]


@pytest.mark.parametrize(
    ("rested", "elapsed", "resting", "expected"),
    [
        # Rested after a failed bind: the others take its turns, even one the core rests
        # (it binds; the rest is advice, a failed bind is certain).
        ([GONE], 0.0, (), ["127.0.0.1"] * 4),
        ([GONE], 0.0, ("127.0.0.1",), ["127.0.0.1"] * 4),
        # The rest is bounded: after it the address is back at its ratio.
        ([GONE], 60.0, (), [GONE, "127.0.0.1"] * 2),
        # Every address rested: all are tried again (one may be back).
        ([GONE, "127.0.0.1"], 0.0, (), [GONE, "127.0.0.1"] * 2),
    ],
)
def test_an_unbindable_address_is_left_out_for_its_rest(
    rested: Sequence[str], elapsed: float, resting: Sequence[str], expected: list[str]
) -> None:
    clock = Clock()
    chooser = SourcePool(
        [PoolAddress(address=GONE), PoolAddress(address="127.0.0.1")], "z", clock=clock
    )
    for address in rested:
        chooser.rest_unbindable(address, 60.0)
    clock.now += elapsed
    assert picks(chooser, 4, resting=resting) == expected


@pytest.mark.parametrize(
    ("exclude", "family", "expected"),
    [
        ({GONE}, 4, ["127.0.0.1"] * 3),
        ({GONE, "127.0.0.1"}, 6, ["::1"] * 3),  # the other family is not touched
    ],
)
def test_excluded_addresses_are_never_picked(
    exclude: set[str], family: int, expected: list[str]
) -> None:
    chooser = SourcePool([PoolAddress(address=a) for a in (GONE, "127.0.0.1", "::1")], "z")
    assert picks(chooser, 3, family=family, exclude=exclude) == expected


def test_a_family_with_every_address_excluded_has_none_to_give() -> None:
    chooser = SourcePool([PoolAddress(address=GONE), PoolAddress(address="::1")], "z")
    with pytest.raises(LookupError, match="no IPv4 address left"):
        chooser.choose(family=4, exclude={GONE})


@pytest.mark.integration
def test_jobs_go_out_from_the_pools_other_address_of_the_family(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Pool 127.0.0.1 and 192.0.2.1 (1:1, both IPv4): every job is delivered from
    127.0.0.1, none deferred, the MX is not marked dead, and the address that left is
    tried once, then rested for the worker's other jobs."""
    domains = [f"d{n}.test" for n in range(JOBS)]
    with run_smtp_sink(host="127.0.0.9") as sink, dns_for(tmp_path, domains, sink.host) as dns:
        pool = [{"address": "127.0.0.1"}, {"address": "127.0.0.2"}]
        config = config_for(tmp_path, dns, sink.port, {"pool": pool})
        # The start-up check passed; then the address went away (as it would if an
        # interface were reconfigured under a running zoneq).
        config.zones["default"].pool[1] = PoolAddress(address=GONE)

        async def main() -> None:
            async with running(config) as core:
                for domain in domains:  # one job at a time: each picks its own source
                    await core.queue([f"a@{domain}"])
                    await core.until(
                        lambda: core.store.message_count() == 0 or bool(core.events("deferred"))
                    )
                assert core.events("deferred") == []
                delivered = core.events("delivered")
                assert [e.source_ip for e in delivered] == ["127.0.0.1"] * JOBS
                assert len(core.worker._dead_hosts) == 0  # our fault, not the MX's

        with caplog.at_level(logging.ERROR, logger="zoneq.delivery"):
            asyncio.run(main())
        received = sink.messages(JOBS)
    assert [m.client_addr for m in received] == ["127.0.0.1"] * JOBS
    failed_binds = [r for r in caplog.records if "cannot be bound" in r.getMessage()]
    assert len(failed_binds) == 1, failed_binds  # then rested (60 s), not chosen again
