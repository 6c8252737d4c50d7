"""The worker keeps connections under the core's slots and says so (issue 5), in process.

The real core (store, queue service, IPC server) and the real worker (``inproc.py``), dnsmasq
for MX, the project's fault server as the MX.  A domain allowed one connection gets its
messages one after the other on one connection, which the core counts as held while it is
idle; once the worker's idle timeout closes it, the core hears of it at once and the slot is
free, without waiting for any delivery.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.delivery.inproc import config_for, dns_for, running
from tests.support.faultserver import Faults, FaultServer
from zoneq.queue.slots import SlotState

pytestmark = pytest.mark.integration

IDLE_CLOSE_BOUND_S = 5.0 + 1.0 + 4.0  # the cache's idle time, its pruning period, slack


def test_one_connection_carries_a_limited_domain_and_its_idle_close_frees_the_slot(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with FaultServer(Faults()) as mx:
            with dns_for(tmp_path, ["one.test"], mx.host) as dns:
                config = config_for(tmp_path, dns, mx.port, delivery={"domain_connections": 1})
                async with running(config) as core:
                    for n in range(3):
                        await core.queue([f"r{n}@one.test"])
                    await core.until(lambda: len(core.events("delivered")) == 3)
                    # One connection for all three: each job took up the one kept before.
                    assert len(mx.sessions) == 1
                    slots = core.service._zone("default").slots
                    await core.until(lambda: [s.state for s in slots.held()] == [SlotState.IDLE])
                    assert slots.in_flight("one.test") == 1  # idle, still counted
                    began = time.monotonic()
                    await core.until(lambda: slots.held() == [], timeout=IDLE_CLOSE_BOUND_S)
                    assert time.monotonic() - began <= IDLE_CLOSE_BOUND_S
                    assert mx.sessions[0].commands[-1] == b"QUIT"
                    # A new message now opens a new connection: the slot was free.
                    await core.queue(["r9@one.test"])
                    await core.until(lambda: len(core.events("delivered")) == 4)
                    assert len(mx.sessions) == 2

    asyncio.run(main())
