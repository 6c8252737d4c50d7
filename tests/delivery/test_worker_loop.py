"""The worker's delivery loop against the real core handler: one IPC round trip per message.

A real store, queue service and IPC server run here; the supervisor starts a real worker
process; dnsmasq and smtp-sink are the DNS and the MX (the bed of ``test_end_to_end``).  The
core's handler is the real one, counted: a busy loop's report brings its next job, so the
worker asks with a plain lease only when it has nothing (at start, and once the queue is
empty), not once per message.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import pytest

from tests.delivery.test_end_to_end import Bed, bed, queue, until_empty, write_config
from tests.storage.conftest import async_test
from zoneq.config import load_config
from zoneq.errors import NotFound
from zoneq.ipc.core import QueueHandler
from zoneq.ipc.messages import LeaseReply, LeaseRequest, Report, ReportReply
from zoneq.ipc.server import ConnectionInfo, IpcServer
from zoneq.queue.service import QueueService
from zoneq.storage.store import QueueStore
from zoneq.supervisor import Supervisor

pytestmark = pytest.mark.integration
__all__ = ["bed"]  # the fixture, imported for pytest

MESSAGES = 40
CONNECTIONS = 4

H = TypeVar("H", bound=QueueHandler)


class CountingHandler(QueueHandler):
    """The core's handler, counting the requests it answers for the default zone."""

    def __init__(self, service: QueueService, zones: set[str]) -> None:
        super().__init__(service, zones)
        self.calls: Counter[str] = Counter()
        self.jobs_with_reports = 0

    async def lease(self, conn: ConnectionInfo, msg: LeaseRequest) -> LeaseReply:
        if conn.zone == "default":
            self.calls["lease"] += 1
        return await super().lease(conn, msg)

    async def report(self, conn: ConnectionInfo, msg: Report) -> ReportReply:
        reply = await super().report(conn, msg)
        # An empty report is a heartbeat (a worker idle for 2 s), not a job's report.
        if conn.zone == "default" and msg.results:
            self.calls["report"] += 1
            self.jobs_with_reports += len(reply.jobs)
        return reply


async def deliver_all(
    config_path: Path, handler_type: Callable[[QueueService, set[str]], H], messages: int = MESSAGES
) -> tuple[H, int]:
    """Queue ``messages``, serve them with a ``handler_type`` core handler and a real worker
    until the queue is empty; the handler, and how many times a worker was restarted."""
    config = load_config(config_path)
    store = QueueStore.open(Path(config.server.data_dir))
    store.recover()
    # All of them land in one group commit, before or while the worker starts.
    await asyncio.gather(*(queue(store, [f"u{n}@src.test"]) for n in range(messages)))
    handler = handler_type(QueueService.from_config(store, config), set(config.zones))
    server = IpcServer(Path(config.server.ipc_socket), handler)
    await server.start()
    supervisor = Supervisor({z: c.processes for z, c in config.zones.items()}, config_path, 10)
    await supervisor.start()
    try:
        await until_empty(store)
        return handler, supervisor.restarts()
    finally:
        await supervisor.stop()
        await server.close()
        await store.close()


@async_test
async def test_a_busy_loop_takes_its_next_job_with_its_report(bed: Bed) -> None:
    handler, _ = await deliver_all(write_config(bed, connections=CONNECTIONS), CountingHandler)
    assert handler.calls["report"] == MESSAGES  # one job per message, each reported once
    # Every job after a loop's first came with a report: at most one plain lease per loop
    # to start, and one per loop once the queue ran dry (the old loop made one per message).
    assert handler.calls["lease"] <= 2 * CONNECTIONS + 2, handler.calls
    assert handler.jobs_with_reports >= MESSAGES - 2 * CONNECTIONS
    assert len(bed.sink.messages(MESSAGES)) == MESSAGES


class FailingReportHandler(QueueHandler):
    """The core's handler, answering the first report of the default zone with the error a
    damaged message used to send back (``not-found``), after applying it."""

    def __init__(self, service: QueueService, zones: set[str]) -> None:
        super().__init__(service, zones)
        self.failed = 0

    async def report(self, conn: ConnectionInfo, msg: Report) -> ReportReply:
        if conn.zone == "default" and msg.results and not self.failed:
            self.failed += 1
            # Applied (as a report failing late would be), but no next job handed out.
            await super().report(conn, replace(msg, lease_jobs=0))
            raise NotFound("message 0000000000000001 has no head")
        return await super().report(conn, msg)


@async_test
async def test_a_report_answered_with_an_error_does_not_kill_the_worker(bed: Bed) -> None:
    config_path = write_config(bed, connections=2)
    handler, restarts = await deliver_all(config_path, FailingReportHandler, messages=6)
    assert handler.failed == 1
    # The loop logged the failed report and went on: no worker died (and with it the
    # other loop's job, sent again by the next one).
    assert restarts == 0
    assert len(bed.sink.messages(6)) == 6
