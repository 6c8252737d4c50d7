"""Provider replies change what the zone does next: a block switches the source address, a
"slow down" lowers the domain's concurrency.  Real store, service, IPC and worker in this
process (``inproc.py``); the remote MX is the fault server answering MAIL with the text."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.delivery.inproc import ZONE, config_for, dns_for, running
from tests.queue.test_service import Clock
from tests.storage.conftest import MINUTE, SECOND, async_test
from tests.support.faultserver import Faults, FaultServer
from zoneq.storage.records import State

pytestmark = pytest.mark.integration

SPAMHAUS = b"554 5.7.1 Service unavailable; Client host [127.0.0.1] blocked using zen.spamhaus.org"
GMAIL_RATE = (
    b"421 4.7.28 Our system has detected an unusual rate of unsolicited mail originating "
    b"from your IP address. To protect our users from spam, mail sent from your IP address "
    b"has been temporarily rate limited."
)
# Without the rest, the second attempt would leave from 127.0.0.1 again (ratio 100 to 1).
POOL = [{"address": "127.0.0.1", "ratio": 100}, {"address": "127.0.0.2", "ratio": 1}]


@async_test
async def test_a_blocked_address_rests_and_the_next_attempt_uses_the_other(
    tmp_path: Path,
) -> None:
    clock = Clock()
    async with FaultServer(Faults(mail_reply=SPAMHAUS)) as server:
        with dns_for(tmp_path, ["blk.test"], server.host) as dns:
            config = config_for(tmp_path, dns, server.port, {"pool": POOL, "retry": "1m"})
            async with running(config, clock=clock) as core:
                await core.queue(["a@blk.test"])
                await core.until(lambda: len(core.events("deferred")) == 1)
                feedback = core.service._zone(ZONE).slots.feedback
                assert feedback is not None
                first = core.events("deferred")[0].source_ip
                assert feedback.rested("blk.test") == {first}
                clock.now += MINUTE  # the retry is due
                await core.service.promote_due()
                await core.until(lambda: len(core.events("deferred")) == 2)
                second = core.events("deferred")[1].source_ip
                # A 5xx, yet deferred, not bounced: the block is of our address, not of the
                # recipient (reply rules); and nothing reached the bounce zone.
                assert core.events("bounced") == []
                assert core.store.count(ZONE, State.DEFERRED) == 1
    assert (first, second) == ("127.0.0.1", "127.0.0.2")
    assert len(server.sessions) == 2


@async_test
async def test_unusual_rate_halves_the_domain_concurrency_for_the_period(tmp_path: Path) -> None:
    clock = Clock()
    async with FaultServer(Faults(mail_reply=GMAIL_RATE)) as server:
        with dns_for(tmp_path, ["slow.test", "other.test"], server.host, hosts=2) as dns:
            config = config_for(
                tmp_path, dns, server.port, {"connections": 1}, delivery={"domain_connections": 4}
            )
            async with running(config, clock=clock) as core:
                await core.queue(["a@slow.test"])
                await core.until(lambda: len(core.events("deferred")) == 1)
                # The rule settled it at the first MX host: the second was not asked.
                assert len(server.sessions) == 1
                slots = core.service._zone(ZONE).slots
                assert slots.limit("slow.test") == 2 and slots.limit("other.test") == 4
                core.worker.stopping.set()  # the core alone from here: lease by hand
                await core.task
                for n in range(6):
                    await core.queue([f"b{n}@slow.test"])
                    await core.queue([f"c{n}@other.test"])
                # The stopped worker's last lease may still wait in the core and take a job,
                # which the worker's client gives back untried: let that settle first.
                await asyncio.sleep(0.3)
                await core.until(lambda: core.service.in_flight() == 0)
                clock.now += SECOND
                jobs = await core.service.lease(ZONE, "by-hand", max_jobs=20)
                domains = [job.domain for job in jobs]
                # slow.test: one start now (slow_down_rate 1/s on the fake clock), then it
                # waits; other.test goes on at its full limit of four.
                assert domains.count("slow.test") == 1
                assert domains.count("other.test") == 4
                clock.now += 10 * MINUTE  # slow_down_period: back to normal
                assert slots.limit("slow.test") == 4
                more = await core.service.lease(ZONE, "by-hand", max_jobs=20)
                assert [job.domain for job in more].count("slow.test") == 3  # 4 minus the 1
