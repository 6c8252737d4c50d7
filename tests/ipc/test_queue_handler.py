"""The core's handler with the real queue behind it: a LevelDB store on disk, the queue
service, the IPC server on a Unix socket, and the worker's client.

What is checked here is the one-round-trip delivery loop: a ``Report`` that asks for the
next job (``lease_jobs``) is committed first and then answered with a job that was ready,
never held up waiting for one; and a ``Report`` without it leases nothing.  And the
worker's count of dead MX addresses: kept per connection while it is up, gone with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tests.storage.conftest import async_test, queue_message
from zoneq.config import load_config
from zoneq.errors import NotFound
from zoneq.ipc.client import IpcClient
from zoneq.ipc.core import QueueHandler
from zoneq.ipc.figures import WorkerFigures
from zoneq.ipc.messages import Hello, Job, Outcome, RecipientReport
from zoneq.ipc.server import IpcServer
from zoneq.queue.service import QueueService
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

Z = "default"
HELLO = Hello(zone=Z, worker="w1", pid=1)
TIMEOUT_S = 5.0


@asynccontextmanager
async def core_and_client(
    tmp_path: Path, figures: WorkerFigures | None = None
) -> AsyncIterator[tuple[QueueStore, QueueService, IpcClient]]:
    config = load_config()
    store = QueueStore.open(tmp_path / "queue")
    store.recover()
    service = QueueService.from_config(store, config)
    handler = QueueHandler(service, set(config.zones), figures)
    server = IpcServer(tmp_path / "core.sock", handler)
    await server.start()
    client = await IpcClient.connect(tmp_path / "core.sock", HELLO)
    try:
        yield store, service, client
    finally:
        await client.close()
        await server.close()
        await store.close()


def delivered(job: Job) -> tuple[RecipientReport, ...]:
    return tuple(
        RecipientReport(r.token, Outcome.DELIVERED, reply="250 2.0.0 ok", code=250)
        for r in job.recipients
    )


@async_test
async def test_each_report_brings_the_next_job_until_the_queue_is_empty(tmp_path: Path) -> None:
    async with core_and_client(tmp_path) as (store, service, client):
        ids = [await queue_message(store, [(f"u{n}@d{n}.example", Z)]) for n in range(5)]
        (job,) = await asyncio.wait_for(client.lease(wait_ms=1000), TIMEOUT_S)
        seen = [job.msg_id]
        while True:
            reply = await asyncio.wait_for(client.report(delivered(job), lease_jobs=1), TIMEOUT_S)
            assert reply.accepted == tuple(r.token for r in job.recipients)
            assert reply.refused == ()
            # Committed before the reply: the reported message is gone already.
            with pytest.raises(NotFound):
                store.message(job.msg_id)
            if not reply.jobs:
                break
            (job,) = reply.jobs
            seen.append(job.msg_id)
        assert seen == ids  # oldest first, one round trip each
        assert service.in_flight() == 0
        assert store.message_count() == 0
        assert store.count(Z, State.READY) == 0


@async_test
async def test_report_asking_for_a_job_does_not_wait_for_one(tmp_path: Path) -> None:
    async with core_and_client(tmp_path) as (store, service, client):
        await queue_message(store, [("only@d.example", Z)])
        (job,) = await client.lease(wait_ms=1000)
        started = time.monotonic()
        reply = await asyncio.wait_for(client.report(delivered(job), lease_jobs=1), TIMEOUT_S)
        # The plain lease would wait up to its wait_ms; this answers at once, empty.
        assert reply.jobs == ()
        assert time.monotonic() - started < 1.0
        assert reply.accepted == (job.recipients[0].token,)
        assert service.in_flight() == 0


@async_test
async def test_report_without_lease_jobs_leases_nothing(tmp_path: Path) -> None:
    async with core_and_client(tmp_path) as (store, service, client):
        for n in range(2):
            await queue_message(store, [(f"u{n}@d{n}.example", Z)])
        (job,) = await client.lease()
        reply = await client.report(delivered(job))
        assert reply.jobs == ()
        assert service.in_flight() == 0  # the second message was not handed out
        (second,) = await client.lease()
        assert second.msg_id != job.msg_id


@async_test
async def test_stale_report_is_refused_and_still_leases(tmp_path: Path) -> None:
    async with core_and_client(tmp_path) as (store, service, client):
        for n in range(2):
            await queue_message(store, [(f"u{n}@d{n}.example", Z)])
        (job,) = await client.lease()
        token = job.recipients[0].token
        first = await client.report(delivered(job))
        assert first.accepted == (token,)
        again = await client.report(delivered(job), lease_jobs=1)
        assert again.accepted == ()
        assert again.refused == (token,)
        (next_job,) = again.jobs
        assert next_job.msg_id != job.msg_id
        assert service.in_flight() == 1  # the next job is the worker's now
        assert store.message_count() == 1


async def until(condition: Callable[[], bool]) -> None:
    """Wait (bounded) for ``condition``: a disconnect reaches the core a moment later."""
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@async_test
async def test_the_dead_host_count_is_kept_per_worker_until_it_disconnects(
    tmp_path: Path,
) -> None:
    figures = WorkerFigures([Z])
    async with core_and_client(tmp_path, figures) as (store, _, client):
        other = await IpcClient.connect(tmp_path / "core.sock", Hello(zone=Z, worker="w2", pid=2))
        try:
            await client.report((), dead_hosts=2)
            await other.report((), dead_hosts=1)
            assert figures.dead_hosts() == {Z: 3}
            # A report that does not say leaves the figure as it was.
            await queue_message(store, [("u@d.example", Z)])
            (job,) = await client.lease()
            await client.report(delivered(job))
            assert figures.dead_hosts() == {Z: 3}
            await client.report((), dead_hosts=0)
            assert figures.dead_hosts() == {Z: 1}
        finally:
            await other.close()
        await until(lambda: figures.dead_hosts() == {Z: 0})
