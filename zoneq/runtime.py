"""The composition root: builds zoneq's parts from a config and runs them.

``zoneq serve`` runs the core: the queue is opened (the directory's LevelDB lock keeps a
second zoneq off it) and recovered (leases from a previous run are gone, so every in-flight
recipient is ready again; uncommitted chunks are swept); the queue service serves the zone
workers over the IPC socket; the supervisor starts ``processes`` workers per zone and
restarts the ones that die; deferred recipients are promoted when due; and maintenance runs
while the process lives (orphan sweeps, event retention, compaction, the disk reserve).
The SMTP receiver accepts mail on ``receiver.listen`` and is the first thing stopped on
SIGTERM (sessions get 421, messages mid-DATA are abandoned).  It runs in the core, or with
``receiver.processes`` > 0 in that many receiver processes: the core binds the listening
socket, hands it to each, and serves their queue requests (``zoneq.ipc.intake_server``) on
the store through the same ``StoreSink`` the in-core receiver uses; the HTTP API (``zoneq.api``)
on ``api.listen`` is stopped right after it.  A port that cannot be bound stops serve at
start with the address named (``ListenError``).

This is the one place that reads the wall clock for the queue: every store operation
takes ``now_ms`` from here, so the store and the protocol core stay testable.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import TypeVar

import uvloop

from zoneq.api.app import start_api
from zoneq.config import Config
from zoneq.errors import DataDirError, ListenError, StorageUnavailable
from zoneq.ipc.core import QueueHandler
from zoneq.ipc.intake_messages import (
    ConnectionCounts,
    DroppedRecipient,
    ReceivedMessage,
    ReceivedRecipient,
)
from zoneq.ipc.intake_server import IntakeServer
from zoneq.ipc.server import IpcServer, SocketInUse, SocketUnusable
from zoneq.plugin import PluginHost
from zoneq.queue.service import QueueService
from zoneq.receiver.server import SmtpReceiver
from zoneq.storage.records import MessageMeta, NewRecipient, State
from zoneq.storage.store import DroppedRecipient as StoreDropped
from zoneq.storage.store import QueueStore
from zoneq.supervisor import Supervisor, Watch

log = logging.getLogger("zoneq")

T = TypeVar("T")


# Issue 7: a SIGTERM'd zoneq is gone within 30 s.  The workers' grace is most of that: a
# delivery waiting for the reply to its final dot is let finish (RFC 5321 4.5.3.2.6 allows
# the MX 10 minutes, so a slow one is killed and logged as a possible duplicate, RFC 1047).
# What runs before and after it is quick (receivers answer 421 and abandon DATA in
# progress; the IPC server and the store close in well under a second), so 20 s leaves
# those 10 s of margin on a loaded machine.
WORKER_GRACE_S = 20.0
# A worker the core has not heard from for this long is hung (SIGSTOP, a blocked event
# loop): it is killed, so its leases go back to ready and a new one takes its place.  A
# live worker writes every 2 s at least (``delivery/worker.py``); a minute leaves room for
# a loaded machine.
WORKER_SILENCE_S = 60.0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def open_store(config: Config) -> QueueStore:
    """The queue at ``server.data_dir``, recovered; a directory that cannot be made or
    opened is a start-up error naming the key (``DataDirError``), not a traceback."""
    path = Path(config.server.data_dir)
    try:
        store = QueueStore.open(
            path,
            sync_commits=config.storage.sync_commits,
            chunk_size=config.storage.chunk_size,
            min_free=int(config.storage.min_free),
            reserve=int(config.storage.reserve),
        )
    except StorageUnavailable as exc:
        raise DataDirError(f"server.data_dir: {exc}") from None
    swept = store.recover()
    store.space.restore()
    if store.space.reserve and not store.space.reserve_path.exists():
        # Not fatal (mail still flows), but the operator set a reserve and does not have one.
        log.warning(
            "storage.reserve: the recovery reserve of %d bytes is not in place: %s has %d "
            "bytes free, and it needs the reserve plus the larger of storage.min_free and "
            "the reserve; until then a full disk needs an operator (retried at each "
            "maintenance round)",
            store.space.reserve,
            path,
            store.space.free_bytes(),
        )
    if swept:
        log.info("swept %d uncommitted message(s) left by the previous run", swept)
    return store


def describe(store: QueueStore) -> str:
    parts = [f"{store.message_count()} message(s) queued"]
    for zone in sorted(store.zones()):
        parts.append(f"zone {zone}: {_zone_counts(store, zone)}")
    return "; ".join(parts)


async def move_unconfigured(store: QueueStore, config: Config) -> None:
    """Move the recipients of every stored zone the config no longer has (removed or
    renamed) into configured ones: zoneq's own notices to ``routing.bounce_zone``, the rest
    to ``routing.default_zone``.  Only configured zones get workers, so left there they
    would never be tried, never expire and never bounce.  Batched and crash-safe, so a
    stop midway is finished by the next start (``zoneq/storage/moves.py``)."""
    default, notices = config.routing.default_zone, config.routing.bounce_zone
    for zone in sorted(store.zones() - set(config.zones)):
        log.warning(
            "zone %s is not in the config but holds %s: moving them to zone %s (zoneq's own "
            "notices to zone %s)",
            zone,
            _zone_counts(store, zone),
            default,
            notices,
        )
        try:
            moved = await store.move_zone(zone, default, notices_to=notices)
        except StorageUnavailable as exc:
            # Mail for the configured zones still flows; what was moved stays moved, and
            # the next start moves the rest.
            log.error("zone %s: its recipients were not all moved: %s", zone, exc)
            continue
        log.warning("zone %s: %d recipient(s) moved", zone, moved.moved)


def _zone_counts(store: QueueStore, zone: str) -> str:
    return ", ".join(
        f"{state.value} {store.count(zone, state)}"
        for state in (State.READY, State.DEFERRED, State.HELD)
    )


async def maintain(store: QueueStore, config: Config) -> None:
    """One round of housekeeping; a storage fault is logged and retried next round."""
    try:
        swept = await store.sweep(now_ms(), config.storage.receive_timeout_ms)
        # Clamped at 0: a retention longer than the time since 1970 (up to the 100 years a
        # duration may be) keeps everything, and a negative time cannot be packed in a key.
        cutoff = max(0, now_ms() - config.storage.event_retention_ms)
        trimmed = await store.trim_expired_events(cutoff)
        await store.compact()  # in a thread: the loop keeps serving meanwhile
        if store.space.restore():
            log.info("recovery reserve of %d bytes in place", store.space.reserve)
    except StorageUnavailable as exc:
        log.warning("maintenance skipped, queue storage unavailable: %s", exc)
        return
    if swept or trimmed:
        log.info("maintenance: swept %d orphan(s), trimmed %d event(s)", swept, trimmed)


def run(config: Config, config_path: Path | None = None, config_text: str | None = None) -> None:
    """``serve`` on uvloop (asyncio's API on libuv): the receiver's cost per message is
    mostly event-loop work per socket event, and uvloop does it in C (about 10% less CPU
    per accepted message in tools/bench/accept_bench.py)."""
    uvloop.run(serve(config, config_path, config_text))


async def serve(
    config: Config, config_path: Path | None = None, config_text: str | None = None
) -> None:
    """Run until SIGTERM or SIGINT, then stop the workers and close the store cleanly.
    ``config_text`` is the text ``config`` was loaded from (``config_path``), which every
    child process is handed (``Supervisor``)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        # The handler only sets a flag; the work of stopping happens below (huey's rule).
        loop.add_signal_handler(signum, stop.set)
    # SIGHUP's default action ends the process at once: no 421, no worker stop, no store
    # close.  A closing terminal or ssh session sends it; zoneq has no reload to offer.
    loop.add_signal_handler(signal.SIGHUP, _hangup_ignored)
    store = open_store(config)
    async with contextlib.AsyncExitStack() as running:
        # Unwound in reverse on the way out, so the receiver (started last of the servers
        # that take mail) is the first thing stopped: no new mail while the rest winds down.
        running.push_async_callback(store.close)
        # Before the service, so its zones and the workers see the moved recipients.
        await move_unconfigured(store, config)
        log.info("queue open at %s: %s", config.server.data_dir, describe(store))
        if (warning := config.server.hostname_warning()) is not None:  # RFC 5321 4.1.1.1
            log.warning("%s", warning)
        # The core's plugin host hears every committed outcome (the outcome hooks); the
        # workers load their own for the send-time hooks.
        plugins = PluginHost.from_config(config)
        running.push_async_callback(plugins.close)
        service = QueueService.from_config(store, config, clock=now_ms, plugins=plugins)
        handler = QueueHandler(service, set(config.zones))
        server = IpcServer(Path(config.server.ipc_socket), handler)
        try:
            await server.start()
        except (SocketInUse, SocketUnusable) as exc:
            raise ListenError(f"server.ipc_socket {exc}") from None
        running.push_async_callback(server.close)
        supervisor = Supervisor(
            {name: zone.processes for name, zone in config.zones.items()},
            config_path,
            grace=WORKER_GRACE_S,
            config_text=config_text,
            watch=Watch(server.heard, silence=WORKER_SILENCE_S),
        )
        running.push_async_callback(supervisor.stop)
        promoter = asyncio.create_task(service.run(stop))
        running.push_async_callback(_cancel, promoter)
        api = await _listening(
            "HTTP API",
            config.api.listen,
            start_api(
                store, service, config, clock=now_ms, plugins=plugins, workers=handler.figures
            ),
        )
        if api is not None:
            running.push_async_callback(api.close)  # stopped right after the receiver
        sink = StoreSink(store, config)
        await _start_receiving(running, sink, config, config_path, plugins, config_text=config_text)
        log.info("accepting SMTP on %s", config.receiver.listen)
        if config.receiver.tls_listen is not None:  # bound like listen, just above
            log.info("accepting SMTP with implicit TLS on %s", config.receiver.tls_listen)
        await supervisor.start()
        # Everything built at start-up (modules, config, compiled rules) lives as long as
        # the process: moved out of the collector's sight, a full collection no longer
        # walks it (gc.freeze, Python 3.7+).  The collector took about 3% of the core's
        # CPU per accepted message in tools/bench/accept_bench.py.
        gc.freeze()
        while not stop.is_set():
            await maintain(store, config)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), config.storage.sweep_interval_ms / 1000)
        log.info("stopping: %s", describe(store))


class StoreSink:
    """The receiver's ``MessageSink`` on the store: in the core's own receiver, and behind
    the intake server for receiver processes.  Connections per client are counted here,
    once for all receivers, so ``max_connections_per_client`` holds across processes."""

    def __init__(self, store: QueueStore, config: Config) -> None:
        self._store = store
        self._clients = ConnectionCounts(config.receiver.max_connections_per_client)

    def admit(self, client: str) -> asyncio.Future[bool]:
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        answer.set_result(self._clients.admit(client))
        return answer

    def release(self, client: str) -> None:
        self._clients.release(client)

    async def begin(self, now_ms: int, size_hint: int) -> int:
        return self._store.begin(now_ms, size_hint)

    async def write_chunk(self, msg_id: int, index: int, data: bytes) -> None:
        await self._store.write_chunk(msg_id, index, data)

    def commit(
        self,
        message: ReceivedMessage,
        recipients: Sequence[ReceivedRecipient],
        now_ms: int,
        *,
        tail: bytes | None,
        dropped: Sequence[DroppedRecipient] = (),
    ) -> asyncio.Future[None]:
        m = message
        meta = MessageMeta(
            m.msg_id,
            m.sender,
            m.size,
            m.chunks,
            m.received_ms,
            ret=m.ret,
            envid=m.envid,
            smtputf8=m.smtputf8,
            body_8bit=m.body_8bit,
            headers=m.headers,
            source=m.source,
            zone_header=m.zone_header,
        )
        news = [NewRecipient(r.address, r.zone, r.notify, r.orcpt) for r in recipients]
        gone = [StoreDropped(d.address, d.zone, d.reason) for d in dropped]
        return self._store.commit(meta, news, now_ms, tail=tail, dropped=gone)

    async def abandon(self, msg_id: int) -> None:
        await self._store.abandon(msg_id)


async def _start_receiving(
    running: contextlib.AsyncExitStack,
    sink: StoreSink,
    config: Config,
    config_path: Path | None,
    plugins: PluginHost,
    *,
    config_text: str | None,
) -> None:
    """The receiver in the core (with the core's ``plugins``; receiver processes load their
    own), or ``receiver.processes`` of them, handed the listening sockets bound here (the
    implicit-TLS one too); each stop is pushed so that the receivers go first (then the
    listening sockets, then the intake server)."""
    listen = config.receiver.listen
    if config.receiver.processes == 0:
        receiver = SmtpReceiver(sink, config, clock=now_ms, plugins=plugins)
        await _listening("SMTP receiver", listen, receiver.start())
        running.push_async_callback(receiver.close)
        return
    intake = IntakeServer(sink)
    running.push_async_callback(intake.close)
    listener = await _listening("SMTP receiver", listen, _bind(*config.receiver.listen_address))
    running.callback(listener.close)
    tls_listener = None
    if (tls_listen := config.receiver.tls_listen_address) is not None:
        # The same words as the in-core receiver's ListenError for this port.
        what = "SMTP receiver (implicit TLS)"
        tls_listener = await _listening(what, str(config.receiver.tls_listen), _bind(*tls_listen))
        running.callback(tls_listener.close)
    receivers = Supervisor.receivers(
        config.receiver.processes,
        config_path,
        listener=listener,
        attach=intake.attach,
        tls_listener=tls_listener,
        grace=15,
        config_text=config_text,
    )
    running.push_async_callback(receivers.stop)
    await receivers.start()


async def _bind(host: str, port: int) -> socket.socket:
    """A listening socket of the receiver processes (they accept on it, the core does not):
    ``receiver.listen``, or ``receiver.tls_listen``, whose TLS they do themselves."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


async def _listening(what: str, address: str, starting: Awaitable[T]) -> T:
    """``starting``'s result; a port that cannot be bound is a start-up error naming it (a
    zoneq that runs without its receiver or its API looks alive and is not)."""
    try:
        return await starting
    except OSError as exc:
        raise ListenError(f"{what} cannot listen on {address}: {exc.strerror or exc}") from None


def _hangup_ignored() -> None:
    log.warning(
        "SIGHUP ignored: zoneq does not reload its configuration; restart it to apply changes"
    )


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
