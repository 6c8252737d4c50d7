"""The core's side of IPC: the queue service served to zone workers.

Translates between the wire messages (``messages.py``) and the queue service's values, so
neither knows the other's types: the service stays testable without sockets, and the wire
format can change without touching it.
"""

from __future__ import annotations

import os

from zoneq.errors import ProtocolError
from zoneq.ipc.figures import WorkerFigures
from zoneq.ipc.messages import (
    ChunkReply,
    ChunkRequest,
    Hello,
    Job,
    JobRecipient,
    LeaseReply,
    LeaseRequest,
    Outcome,
    Report,
    ReportReply,
    Welcome,
)
from zoneq.ipc.server import ConnectionInfo
from zoneq.queue import service as queue

_RESULT = {
    Outcome.DELIVERED: queue.Result.DELIVERED,
    Outcome.DEFERRED: queue.Result.DEFERRED,
    Outcome.BOUNCED: queue.Result.BOUNCED,
    Outcome.RETURNED: queue.Result.RETURNED,
}

# A worker's LEASE may wait at most this long, so a stuck request cannot pin a connection.
MAX_WAIT_MS = 30_000


class QueueHandler:
    """``CoreHandler`` for ``IpcServer``, backed by a ``QueueService``."""

    def __init__(
        self,
        service: queue.QueueService,
        zones: set[str],
        figures: WorkerFigures | None = None,
    ) -> None:
        self._service = service
        self._zones = zones
        # What the workers report of their own state (their dead-host caches), for /metrics.
        self.figures = figures if figures is not None else WorkerFigures(zones)

    async def hello(self, conn: ConnectionInfo, msg: Hello) -> Welcome:
        if msg.zone not in self._zones:
            raise ProtocolError(f"no zone {msg.zone!r} is configured")
        return Welcome(core_pid=os.getpid())

    def _zone(self, conn: ConnectionInfo) -> str:
        if conn.zone is None:
            raise ProtocolError("HELLO first")
        return conn.zone

    async def lease(self, conn: ConnectionInfo, msg: LeaseRequest) -> LeaseReply:
        zone = self._zone(conn)
        jobs = await self._service.lease(
            zone, conn.owner, max(1, msg.max_jobs), min(msg.wait_ms, MAX_WAIT_MS)
        )
        close = self._service.closing(zone, conn.owner)
        return LeaseReply(jobs=tuple(map(_job, jobs)), close=close)

    async def chunk(self, conn: ConnectionInfo, msg: ChunkRequest) -> ChunkReply:
        self._zone(conn)
        return ChunkReply(data=self._service.chunk(msg.msg_id, msg.index))

    async def report(self, conn: ConnectionInfo, msg: Report) -> ReportReply:
        zone = self._zone(conn)
        if msg.dead_hosts is not None:
            # Before the commit: a figure is no less true when the storage fails.
            self.figures.dead_hosts_of(conn.owner, zone, msg.dead_hosts)
        outcomes = [
            queue.RecipientOutcome(
                token=item.token,
                result=_RESULT[item.outcome],
                reply=item.reply,
                code=item.code,
                enhanced=item.enhanced,
                mx=item.mx,
                source_ip=item.source_ip,
                possible_duplicate=item.possible_duplicate,
                relayed=item.relayed,
                local_reply=item.local_reply,
            )
            for item in msg.results
        ]
        # Closed slots first, before anything awaits: they are about connections the worker
        # had before this report's, so a slot closed and kept again ends up idle, not free.
        self._service.closed(zone, conn.owner, msg.closed)
        accepted, refused = await self._service.report(conn.owner, outcomes, frozenset(msg.kept))
        jobs: list[queue.Job] = []
        if msg.lease_jobs:
            # After the commit, and without waiting: the reply carries the report's fate,
            # which must not sit behind an empty queue (messages.py).
            jobs = await self._service.lease(zone, conn.owner, msg.lease_jobs, 0)
        return ReportReply(
            accepted=tuple(accepted),
            refused=tuple(refused),
            jobs=tuple(map(_job, jobs)),
            close=self._service.closing(zone, conn.owner),
        )

    def disconnected(self, conn: ConnectionInfo) -> None:
        self.figures.forget(conn.owner)
        self._service.disconnected(conn.owner)


def _job(job: queue.Job) -> Job:
    return Job(
        body=job.body,
        msg_id=job.msg_id,
        sender=job.sender,
        size=job.size,
        chunks=job.chunks,
        domain=job.domain,
        envid=job.envid,
        ret=job.ret,
        smtputf8=job.smtputf8,
        body_8bit=job.body_8bit,
        rested=tuple(sorted(job.rested)),
        slot=job.slot,
        last_attempt=job.last_attempt,
        zone_header=job.zone_header,
        recipients=tuple(
            JobRecipient(
                token=r.token,
                address=r.address,
                notify=r.notify,
                orcpt=r.orcpt,
                attempts=r.attempts,
            )
            for r in job.recipients
        ),
    )
