"""The composition root: builds zoneq's parts from a config and runs them.

``zoneq serve`` runs the core: the queue is opened (the directory's LevelDB lock keeps a
second zoneq off it) and recovered (leases from a previous run are gone, so every in-flight
recipient is ready again; uncommitted chunks are swept); the queue service serves the zone
workers over the IPC socket; the supervisor starts ``processes`` workers per zone and
restarts the ones that die; deferred recipients are promoted when due; and maintenance runs
while the process lives (orphan sweeps, event retention, compaction, the disk reserve).
The SMTP receiver accepts mail on ``receiver.listen`` and is the first thing stopped on
SIGTERM (sessions get 421, messages mid-DATA are abandoned); the HTTP API (``zoneq.api``)
on ``api.listen`` is stopped right after it.  A port that cannot be bound stops serve at
start with the address named (``ListenError``).

This is the one place that reads the wall clock for the queue: every store operation
takes ``now_ms`` from here, so the store and the protocol core stay testable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import uvloop

from zoneq.api.app import start_api
from zoneq.config import Config
from zoneq.errors import ListenError, StorageUnavailable
from zoneq.ipc.core import QueueHandler
from zoneq.ipc.server import IpcServer
from zoneq.plugin import PluginHost
from zoneq.queue.service import QueueService
from zoneq.receiver.server import SmtpReceiver
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore
from zoneq.supervisor import Supervisor

log = logging.getLogger("zoneq")

T = TypeVar("T")


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
    """``serve`` on uvloop (asyncio's API on libuv): the receiver's cost per message is
    mostly event-loop work per socket event, and uvloop does it in C (about 10% less CPU
    per accepted message in tools/bench/accept_bench.py)."""
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
    async with contextlib.AsyncExitStack() as running:
        # Unwound in reverse on the way out, so the receiver (started last of the servers
        # that take mail) is the first thing stopped: no new mail while the rest winds down.
        running.push_async_callback(store.close)
        # The core's plugin host hears every committed outcome (the outcome hooks); the
        # workers load their own for the send-time hooks.
        plugins = PluginHost.from_config(config)
        running.push_async_callback(plugins.close)
        service = QueueService.from_config(store, config, clock=now_ms, plugins=plugins)
        server = IpcServer(Path(config.server.ipc_socket), QueueHandler(service, set(config.zones)))
        await server.start()
        running.push_async_callback(server.close)
        supervisor = Supervisor(
            {name: zone.processes for name, zone in config.zones.items()}, config_path
        )
        running.push_async_callback(supervisor.stop)
        promoter = asyncio.create_task(service.run(stop))
        running.push_async_callback(_cancel, promoter)
        api = await _listening(
            "HTTP API", config.api.listen, start_api(store, service, config, clock=now_ms)
        )
        if api is not None:
            running.push_async_callback(api.close)  # stopped right after the receiver
        receiver = SmtpReceiver(store, config, clock=now_ms)
        await _listening("SMTP receiver", config.receiver.listen, receiver.start())
        running.push_async_callback(receiver.close)
        log.info("accepting SMTP on %s", config.receiver.listen)
        await supervisor.start()
        while not stop.is_set():
            await maintain(store, config)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), config.storage.sweep_interval_ms / 1000)
        log.info("stopping: %s", describe(store))


async def _listening(what: str, address: str, starting: Awaitable[T]) -> T:
    """``starting``'s result; a port that cannot be bound is a start-up error naming it (a
    zoneq that runs without its receiver or its API looks alive and is not)."""
    try:
        return await starting
    except OSError as exc:
        raise ListenError(f"{what} cannot listen on {address}: {exc.strerror or exc}") from None


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
