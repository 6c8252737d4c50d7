"""A zone worker process: ``connections`` delivery loops serving one zone for the core.

Each loop asks the core for a job (waiting for one if there is none), makes one delivery
attempt (``attempt.py``) with the body fetched chunk by chunk over IPC, and reports one
outcome per recipient.  The report also asks for the next job (``Report.lease_jobs``), so
a busy loop spends one IPC round trip per message, not two; only when the reply brings no
job does the loop go back to a waiting lease.  The worker holds nothing durable: if it
dies, the core returns its leases at once and the supervisor starts a new one.  SIGTERM
stops it taking new jobs; the ones in hand finish and are reported, then it exits.  A
report is written to the socket before the loop awaits anything, and awaited to its reply,
so a stop cannot lose one; jobs that come with a report's reply after SIGTERM are given
back untried.

Kept connections count against the core's connection limits (issue 5): each job names its
slot, a report says which jobs' connections are kept (``kept``) and which kept ones were
closed since (``closed``, ``transport/cache.py``), and the core may ask for some to be
closed (``close`` in its replies).  A kept connection closed for idling, or at the core's
request, is reported at once in a report of its own, since a job may be waiting for its
slot; one taken up under another slot rides with the next job's report.

A worker the core has not heard from for a minute is taken for hung and killed, its leases
going back to ready (``supervisor.py``).  Its loops may all be busy for longer than that (a
slow MX may take 10 minutes to answer the final dot, RFC 5321 4.5.3.2.6), so a worker that
has written nothing to the core for ``HEARTBEAT_S`` sends an empty report: as long as its
event loop runs, the core hears from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import uvloop

from zoneq.config import Config
from zoneq.config.zones import Smarthost
from zoneq.delivery.attempt import Relay, Settings, attempt
from zoneq.delivery.hostcache import DeadHostCache
from zoneq.delivery.mx import MxResolver, system_nameservers
from zoneq.delivery.ourselves import ourselves
from zoneq.delivery.pool import SourcePool
from zoneq.delivery.transport import ConnectionCache, TlsPolicy
from zoneq.delivery.transport.data import exact_size
from zoneq.errors import TemporaryFailure, ZoneqError
from zoneq.ipc.client import IpcClient
from zoneq.ipc.messages import Hello, Job, Outcome, RecipientReport
from zoneq.logs import REPEATS
from zoneq.plugin import PluginHost
from zoneq.protocol.ids import format_id

DEAD_HOST_CAP_S = 3600.0  # the longest an MX address is skipped after repeated failures

log = logging.getLogger("zoneq.worker")

LEASE_WAIT_MS = 5_000
PRUNE_INTERVAL_S = 1.0
# Well under the core's deadline for a silent worker (60 s, ``runtime.WORKER_SILENCE_S``),
# so a loaded machine delaying a few ticks does not get a live worker killed.
HEARTBEAT_S = 2.0


def settings_for(config: Config, zone: str) -> Settings:
    zone_config = config.zones[zone]
    hostname = config.server.resolved_hostname()
    helo_name = zone_config.ehlo_name or hostname
    return Settings(
        helo_name=helo_name,
        port=config.delivery.mx_port,
        ipv6=zone_config.ipv6,
        tls=TlsPolicy(config.delivery.tls),
        tls_policy={d: TlsPolicy(p) for d, p in config.delivery.tls_policy.items()},
        sources=SourcePool(zone_config.pool, helo_name) if zone_config.pool else None,
        relay=relay_for(zone_config.smarthost),
        zone=zone,
        zone_header=config.routing.zone_header,
        rules=config.reply_rules.compiled(),
        max_addresses=config.delivery.max_mx_addresses,
    )


def relay_for(smarthost: Smarthost | None) -> Relay | None:
    """The zone's smarthost as the attempt uses it; ``implicit`` is TLS that is required."""
    if smarthost is None:
        return None
    auth = smarthost.auth
    implicit = smarthost.tls == "implicit"
    return Relay(
        host=_relay_host(smarthost.host),
        port=smarthost.port,
        tls=TlsPolicy.REQUIRED if implicit else TlsPolicy(smarthost.tls),
        implicit_tls=implicit,
        auth=(auth.username, auth.password) if auth is not None else None,
    )


def _relay_host(host: str) -> str:
    """The config's smarthost without an address literal's brackets and its ``IPv6:`` tag
    (RFC 5321 section 4.1.3: ``[192.0.2.25]``, ``[IPv6:2001:db8::25]``), so an address
    reaches the attempt as an address; a name (bracketed or not) stays a name."""
    if not (host.startswith("[") and host.endswith("]")):
        return host
    inner = host[1:-1]
    return inner[5:] if inner[:5].lower() == "ipv6:" else inner


def resolver_for(config: Config) -> MxResolver:
    nameservers = config.delivery.nameservers or system_nameservers()
    hostname = config.server.resolved_hostname()
    # RFC 5321 section 5.1: our names *and addresses* (listeners, pools, interfaces).
    us = ourselves(config)
    return MxResolver(
        nameservers=nameservers,
        port=config.delivery.dns_port,
        lifetime=config.delivery.dns_timeout_s,
        timeout=min(5.0, config.delivery.dns_timeout_s),
        clock=time.monotonic,
        rng=random.Random(),
        own_names={hostname},
        own_addresses=us.addresses,
        allow_loopback=us.allow_loopback,
    )


class Worker:
    def __init__(
        self, config: Config, zone: str, client: IpcClient, plugins: PluginHost | None = None
    ) -> None:
        self._config = config
        self._plugins = plugins
        self._zone = zone
        self._client = client
        self._settings = settings_for(config, zone)
        self._resolver = resolver_for(config)
        backoff = config.delivery.dead_host_backoff_s
        self._dead_hosts = DeadHostCache(
            clock=time.monotonic, base=backoff, cap=max(backoff, DEAD_HOST_CAP_S)
        )
        # One cache for all of this worker's loops: a connection one loop finished with is
        # the next loop's to reuse for the same destination.
        self._connections = ConnectionCache()
        # The count of resting addresses the core last acknowledged (it assumes 0 of a
        # worker that has said nothing): told again only when it changes.
        self._dead_hosts_told = 0
        self.stopping = asyncio.Event()

    async def run(self) -> None:
        loops = self._config.zones[self._zone].connections
        tasks = [asyncio.create_task(self._loop(n)) for n in range(loops)]
        pruner = asyncio.create_task(self._tend())
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            pruner.cancel()
            await self._connections.close()

    async def _tend(self) -> None:
        """QUIT kept connections that have idled too long (RFC 5321 4.1.1.10: say goodbye),
        and tell the core at once of the slots closes free; and tell it the count of MX
        addresses the dead-host cache rests whenever that changes (for ``/metrics``), or
        after ``HEARTBEAT_S`` with nothing sent, so the core knows this worker is alive.

        The count is taken here, once a tick, not with every delivery report: it is a scan
        of the cache, and a dead period ends on its own with no delivery to notice it.
        """
        cache = self._connections
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cache.urgent.wait(), PRUNE_INTERVAL_S)
            cache.prune()
            dead = self._dead_hosts.resting()
            urgent = cache.urgent.is_set()
            quiet = self._client.quiet_s() >= HEARTBEAT_S
            if not urgent and dead == self._dead_hosts_told and not quiet:
                continue
            closed = cache.released() if urgent else ()
            try:
                reply = await self._client.report((), closed=closed, dead_hosts=dead)
            except ZoneqError as exc:
                if self._client.closed:
                    return  # the core is gone; the loops see it too
                log.warning("closed slots or dead-host count not reported: %s", exc)
                cache.close_slots(closed)  # still closed: owed to the next report
                await asyncio.sleep(PRUNE_INTERVAL_S)
                continue
            self._dead_hosts_told = dead
            cache.close_slots(reply.close)

    async def _lease(self) -> tuple[Job, ...]:
        """Wait for a job, or for SIGTERM: a stopping worker does not sit out a lease wait.

        Cancelling the request is safe: jobs the core grants to a cancelled lease are given
        back to it as RETURNED by the IPC client.
        """
        lease = asyncio.ensure_future(self._client.lease_reply(max_jobs=1, wait_ms=LEASE_WAIT_MS))
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait((lease, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not lease.done():
            lease.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lease
            return ()
        reply = lease.result()
        self._connections.close_slots(reply.close)
        return reply.jobs

    async def _loop(self, number: int) -> None:
        jobs: tuple[Job, ...] = ()
        while True:
            if not jobs:
                if self.stopping.is_set():
                    return
                try:
                    jobs = await self._lease()
                except ZoneqError as exc:
                    if self._client.closed:
                        raise  # the core is gone: exit, the supervisor decides what next
                    log.warning("loop %d: lease failed: %s", number, exc, extra=REPEATS)
                    await asyncio.sleep(1)
                continue
            if self.stopping.is_set():
                reports = [_returned(r.token) for job in jobs for r in job.recipients]
            else:
                reports = [report for job in jobs for report in await self._deliver(job)]
            kept = tuple(job.slot for job in jobs if self._connections.end(job.slot))
            closed = self._connections.released()
            more = 0 if self.stopping.is_set() else 1
            try:
                reply = await self._client.report(
                    tuple(reports), lease_jobs=more, kept=kept, closed=closed
                )
            except ZoneqError as exc:
                if self._client.closed:
                    raise  # the core is gone: exit, the supervisor decides what next
                # The core could not take the report (its storage failed, or a message was
                # damaged): it voids those leases itself, so drop them and go on.  Dying
                # here would cut off the jobs of this worker's other loops, and those
                # recipients would be sent again.
                log.warning(
                    "loop %d: report of %d outcome(s) failed: %s", number, len(reports), exc
                )
                # The core applied ``closed`` before it failed, or it never got the report;
                # telling it again is harmless either way (a slot ends once).
                self._connections.close_slots(closed)
                jobs = ()
                await asyncio.sleep(1)
                continue
            self._connections.close_slots(reply.close)
            if reply.refused:
                log.warning(
                    "core refused %d stale report(s) of %s",
                    len(reply.refused),
                    _refused_messages(jobs, reply.refused),
                )
            jobs = reply.jobs

    async def _deliver(self, job: Job) -> list[RecipientReport]:
        self._connections.begin(job.slot)  # ended when the report is made (``_loop``)
        try:
            return await attempt(
                job,
                settings=self._settings,
                resolver=self._resolver,
                dead_hosts=self._dead_hosts,
                # Counted against the size as stored: a torn chunk is not sent cut short.
                body=lambda: exact_size(self._client.iter_body(job), job.size),
                connections=self._connections,
                plugins=self._plugins,
            )
        except Exception as exc:  # a bug or a local fault must not lose the job
            log.exception("delivery of %s to %s failed locally", format_id(job.msg_id), job.domain)
            return [
                RecipientReport(
                    r.token,
                    Outcome.DEFERRED,
                    reply=f"451 4.3.0 local error: {type(exc).__name__}",
                    enhanced="4.3.0",
                )
                for r in job.recipients
            ]


def _refused_messages(jobs: Sequence[Job], refused: Sequence[int]) -> str:
    """The messages, as ids people can pass to ``zoneq queue show``, whose reports the core
    refused: only those a refused token belongs to, not every job of the batch."""
    stale = set(refused)
    ids = {job.msg_id for job in jobs for r in job.recipients if r.token in stale}
    return ", ".join(format_id(msg_id) for msg_id in sorted(ids))


def _returned(token: int) -> RecipientReport:
    return RecipientReport(token, Outcome.RETURNED, reply="worker stopping")


def main(config: Config, zone: str, name: str) -> int:
    """``zoneq worker``: :func:`run` on uvloop, as the core runs.  A worker's CPU goes mostly
    to the event loop's own work per socket event (two sockets per message: the MX and the
    core), which libuv does in C (tools/bench/delivery_bench.py)."""
    # A worker follows the core's lifecycle: a hangup of the terminal reaches the whole
    # process group, and the core, which ignores it (no reload), would lose its workers.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return uvloop.run(run(config, zone, name))


async def run(config: Config, zone: str, name: str) -> int:
    """The worker's main: connect, deliver until SIGTERM or the core goes away."""
    # The send-time hooks run here, in the worker (a plugin that cannot load stops the
    # worker at start, with the reason, rather than failing every delivery).
    plugins = PluginHost.from_config(config)
    try:
        client = await IpcClient.connect(
            Path(config.server.ipc_socket), Hello(zone=zone, worker=name, pid=os.getpid())
        )
    except ZoneqError as exc:  # no core listening, or it refused the hello: one line, exit 1
        log.error("worker %s of zone %s: %s", name, zone, exc)
        await plugins.close()
        return 1
    try:
        # Inside the try: a worker that cannot be built still closes its IPC connection
        # and its plugins (the supervisor restarts it).
        worker = Worker(config, zone, client, plugins)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, worker.stopping.set)
        await worker.run()
    except TemporaryFailure as exc:
        log.error("worker %s of zone %s: %s", name, zone, exc)
        return 1
    finally:
        with contextlib.suppress(Exception):
            await client.close()
        await plugins.close()
    return 0
