"""Recipients deferred because every MX address rests in the dead-host cache say why.

RFC 3464 section 2.3.6: the Diagnostic-Code carries the actual problem.  A bounce at
expiry used to say only "no MX host could be reached (all are resting after failures)",
with no host and no cause, when the last attempt found the host resting.  The cache keeps
the last failure's text (a pure unit, table-driven with a fake clock); the walk reports it
with the host and address (real parts: dnsmasq, the real resolver and transport, and an
address on 127.0.0.0/8 where nothing listens, so the connection is refused).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from tests.delivery.test_next_hop import BODY, FAST, HELO, job, resolver
from tests.storage.conftest import async_test
from tests.support.dnsmasq import Dnsmasq, running_dnsmasq
from zoneq.delivery.attempt import Settings, attempt
from zoneq.delivery.hostcache import DeadHostCache
from zoneq.ipc.messages import Outcome, RecipientReport

DOWN = "127.0.0.31"
RECORDS = ["mx-host=down.test,mx.down.test,10", f"host-record=mx.down.test,{DOWN}"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("marks", "elapsed", "expected"),
    [
        ([], 0.0, None),  # never failed
        ([("refused", 0.0)], 0.0, "refused"),
        ([("refused", 0.0)], 60.0, None),  # the period ended: it is tried, not resting
        # A failure while dead does not lengthen the period, but its text is the latest.
        ([("refused", 0.0), ("timed out", 10.0)], 20.0, "timed out"),
        ([("refused", 0.0), ("", 10.0)], 20.0, "refused"),  # no text keeps the last one
    ],
)
def test_a_dead_address_keeps_its_last_failure(
    marks: list[tuple[str, float]], elapsed: float, expected: str | None
) -> None:
    clock = Clock()
    cache = DeadHostCache(clock=clock, base=60.0)
    for reason, at in marks:
        clock.now = 1000.0 + at
        cache.mark_dead(DOWN, reason)
    clock.now = 1000.0 + elapsed
    assert cache.why_dead(DOWN) == expected


def test_an_address_marked_alive_has_no_failure_to_tell() -> None:
    cache = DeadHostCache(clock=Clock(), base=60.0)
    cache.mark_dead(DOWN, "refused")
    cache.mark_alive(DOWN)
    assert cache.why_dead(DOWN) is None


@pytest.fixture(scope="module")
def dns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dnsmasq]:
    with running_dnsmasq(RECORDS, tmp_path_factory.mktemp("dns")) as server:
        yield server


def refused_port() -> int:
    """A port on ``DOWN`` that nothing listens on: the kernel refuses the connection."""
    with socket.socket() as probe:
        probe.bind((DOWN, 0))
        return int(probe.getsockname()[1])


async def deliver_once(dns: Dnsmasq, port: int, dead: DeadHostCache) -> RecipientReport:
    [report] = await attempt(
        job("down.test", "a@down.test"),
        settings=Settings(helo_name=HELO, port=port, timeouts=FAST),
        resolver=resolver(dns),
        dead_hosts=dead,
        body=lambda: [BODY],
    )
    return report


@pytest.mark.integration
@async_test
async def test_a_resting_mx_is_reported_with_the_failure_that_put_it_to_rest(
    dns: Dnsmasq,
) -> None:
    dead = DeadHostCache(clock=time.monotonic, base=60)
    port = refused_port()
    first = await deliver_once(dns, port, dead)
    assert first.outcome is Outcome.DEFERRED and first.mx == "mx.down.test"
    assert "refused" in first.reply.lower() or "111" in first.reply, first.reply
    assert dead.is_dead(DOWN)
    second = await deliver_once(dns, port, dead)
    assert second.outcome is Outcome.DEFERRED and second.enhanced == "4.4.1"
    assert second.reply == f"mx.down.test[{DOWN}] resting after: {first.reply}"
