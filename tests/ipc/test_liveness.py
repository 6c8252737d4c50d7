"""How the core tells a live worker from a hung one: ``IpcServer.heard`` over a real socket,
``IpcClient.quiet_s``, and a real worker process that keeps talking while it has nothing
to say (``HEARTBEAT_S``), so the supervisor's watch (``zoneq/supervisor.py``) never takes
it for hung.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import pytest

from tests.ipc.test_server_client import HELLO, FakeCore, run, serving, within
from tests.support.serve import write_serve_config
from zoneq.delivery.worker import HEARTBEAT_S
from zoneq.ipc.client import IpcClient
from zoneq.ipc.messages import Report, ReportReply
from zoneq.ipc.server import ConnectionInfo, IpcServer
from zoneq.supervisor import Supervisor

PID = HELLO.pid


def test_heard_is_the_time_of_the_last_bytes_from_each_helloed_worker(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (server, core):
            before = time.monotonic()
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            hello_at = server.heard()[PID]
            assert before <= hello_at <= time.monotonic()
            await asyncio.sleep(0.2)
            assert server.heard() == {PID: hello_at}  # silence: the time stays put
            assert client.quiet_s() >= 0.2
            await within(client.chunk(7, 0))
            assert server.heard()[PID] >= hello_at + 0.2
            assert client.quiet_s() < 0.2
            await within(client.close())
            await within(core.disconnected_event.wait())
            assert server.heard() == {}  # gone: nothing left to watch

    run(body)


def test_a_connection_not_helloed_is_not_in_heard(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (server, _):
            _, writer = await asyncio.open_unix_connection(tmp_path / "core.sock")
            await asyncio.sleep(0.05)
            assert server.connection_count == 1
            assert server.heard() == {}
            writer.close()

    run(body)


def test_a_worker_the_core_stopped_reading_counts_as_heard(tmp_path: Path) -> None:
    """With every request slot of the connection taken, the core reads nothing more from
    it: that silence is the core's, not the worker's.  Once the core reads again, the
    silence counts from then."""

    async def body() -> None:
        async with serving(tmp_path, max_in_flight=1) as (server, core):
            core.lease_gate = asyncio.Event()
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            leases = [asyncio.create_task(client.lease()) for _ in range(2)]
            await asyncio.sleep(0.3)  # the second lease waits unread for the first
            assert core.running_leases == 1
            assert time.monotonic() - server.heard()[PID] < 0.05
            core.lease_gate.set()
            await within(asyncio.gather(*leases))
            resumed = server.heard()[PID]
            await asyncio.sleep(0.2)
            assert server.heard()[PID] == resumed
            await client.close()

    run(body)


class TimedCore(FakeCore):
    """A ``FakeCore`` that notes when each report came, and what it carried."""

    def __init__(self) -> None:
        super().__init__()
        self.reports: list[tuple[float, Report]] = []

    async def report(self, conn: ConnectionInfo, msg: Report) -> ReportReply:
        self.reports.append((time.monotonic(), msg))
        return await super().report(conn, msg)


@pytest.mark.integration
def test_a_worker_with_nothing_to_say_still_reports_every_heartbeat(tmp_path: Path) -> None:
    """A real worker whose every loop waits on a lease the core never answers (as loops
    busy with a slow MX write nothing either) sends empty reports, one per heartbeat."""
    config = write_serve_config(tmp_path / "zoneq", mx_port=25, dns_port=53, connections=2)
    core = TimedCore()
    core.lease_gate = asyncio.Event()  # never set

    async def body() -> None:
        server = IpcServer(tmp_path / "zoneq" / "zoneq.sock", core)
        await server.start()
        supervisor = Supervisor({"default": 1}, config, grace=5)
        await supervisor.start()
        try:
            deadline = time.monotonic() + 20  # a worker's start, then three heartbeats
            while len(core.reports) < 3:
                assert time.monotonic() < deadline, core.verbs()
                await asyncio.sleep(0.05)
        finally:
            await supervisor.stop()
            await server.close()

    asyncio.run(body())
    first, *_ = core.reports
    assert first[1].results == ()  # nothing to report but that it is alive
    times = [at for at, _ in core.reports[:3]]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert all(HEARTBEAT_S - 0.1 <= gap <= HEARTBEAT_S + 1.5 for gap in gaps), gaps
