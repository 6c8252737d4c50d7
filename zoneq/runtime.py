"""The composition root: builds zoneq's parts from a config and runs them.

``zoneq serve`` runs the core: the queue is opened (the directory's LevelDB lock keeps a
second zoneq off it) and recovered (leases from a previous run are gone, so every in-flight
recipient is ready again; uncommitted chunks are swept); the queue service serves the zone
workers over the IPC socket; the supervisor starts ``processes`` workers per zone and
restarts the ones that die; deferred recipients are promoted when due; and maintenance runs
while the process lives (orphan sweeps, event retention, compaction, the disk reserve).
The SMTP receiver accepts mail on ``receiver.listen`` and is the first thing stopped on
SIGTERM (sessions get 421, messages mid-DATA are abandoned); the admin API attaches here
as it is built.

This is the one place that reads the wall clock for the queue: every store operation
takes ``now_ms`` from here, so the store and the protocol core stay testable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from pathlib import Path

import uvloop

from zoneq.config import Config
from zoneq.errors import StorageUnavailable
from zoneq.ipc.core import QueueHandler
from zoneq.ipc.server import IpcServer
from zoneq.queue.service import QueueService
from zoneq.receiver.server import SmtpReceiver
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore
from zoneq.supervisor import Supervisor

log = logging.getLogger("zoneq")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def open_store(config: Config) -> QueueStore:
    store = QueueStore.open(
        Path(config.server.data_dir),
        sync_commits=config.storage.sync_commits,
        chunk_size=config.storage.chunk_size,
        min_free=int(config.storage.min_free),
        reserve=int(config.storage.reserve),
    )
    swept = store.recover()
    store.space.restore()
    if swept:
        log.info("swept %d uncommitted message(s) left by the previous run", swept)
    return store


def describe(store: QueueStore) -> str:
    parts = [f"{store.message_count()} message(s) queued"]
    for zone in sorted(store.zones()):
        counts = ", ".join(
            f"{state.value} {store.count(zone, state)}"
            for state in (State.READY, State.DEFERRED, State.HELD)
        )
        parts.append(f"zone {zone}: {counts}")
    return "; ".join(parts)


async def maintain(store: QueueStore, config: Config) -> None:
    """One round of housekeeping; a storage fault is logged and retried next round."""
    try:
        swept = await store.sweep(now_ms(), config.storage.receive_timeout_ms)
        trimmed = await store.trim_events(now_ms() - config.storage.event_retention_ms)
        store.compact()
        if store.space.restore():
            log.info("recovery reserve of %d bytes in place", store.space.reserve)
    except StorageUnavailable as exc:
        log.warning("maintenance skipped, queue storage unavailable: %s", exc)
        return
    if swept or trimmed:
        log.info("maintenance: swept %d orphan(s), trimmed %d event(s)", swept, trimmed)


def run(config: Config, config_path: Path | None = None) -> None:
    """``serve`` on uvloop: libuv's event loop halves asyncio's own cost per socket event,
    which is most of the receiver's cost per message (tools/bench/accept_bench.py)."""
    uvloop.run(serve(config, config_path))


async def serve(config: Config, config_path: Path | None = None) -> None:
    """Run until SIGTERM or SIGINT, then stop the workers and close the store cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        # The handler only sets a flag; the work of stopping happens below (huey's rule).
        loop.add_signal_handler(signum, stop.set)
    store = open_store(config)
    log.info("queue open at %s: %s", config.server.data_dir, describe(store))
    service = QueueService.from_config(store, config, clock=now_ms)
    server = IpcServer(Path(config.server.ipc_socket), QueueHandler(service, set(config.zones)))
    await server.start()
    receiver = SmtpReceiver(store, config, clock=now_ms)
    await receiver.start()
    log.info("accepting SMTP on %s", config.receiver.listen)
    supervisor = Supervisor(
        {name: zone.processes for name, zone in config.zones.items()}, config_path
    )
    await supervisor.start()
    promoter = asyncio.create_task(service.run(stop))
    try:
        while not stop.is_set():
            await maintain(store, config)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), config.storage.sweep_interval_ms / 1000)
    finally:
        log.info("stopping: %s", describe(store))
        await receiver.close()  # first: no new mail while the rest winds down
        await supervisor.stop()
        await server.close()
        promoter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await promoter
        await store.close()
