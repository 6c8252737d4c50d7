"""A zone worker's end of the core socket: one connection shared by all its delivery loops.

Theory of operation
-------------------
``IpcClient.connect`` opens the socket and sends ``Hello``; it returns only once the core
has answered ``Welcome``.  ``request`` then gives each request a fresh id, writes it, and
waits on a future kept under that id; one reader task matches replies to futures by id, so
any number of coroutines may have requests outstanding at once and replies may arrive in
any order.  An ``ErrorReply`` is raised as the zoneq error its kind names.

If the connection ends (the core went away, the core broke the protocol, or ``close()``),
every outstanding request fails with ``ConnectionLost`` (a ``TemporaryFailure``: the mail
stays queued and the core takes the leases back) and later requests fail at once: a worker
reconnects by making a new client, it is not done behind its back.

Cancelling a request does not cancel it in the core.  For a ``LeaseRequest`` (or a
``Report`` that also leases) that matters: the core may grant jobs nobody will deliver.
So the id of a cancelled leasing request is remembered, and if its reply brings jobs they
are given back straight away (a ``Report`` with outcome ``RETURNED``) instead of sitting
leased until the connection ends.

Requests written in the same turn of the event loop leave in one write (``batching.py``).
``quiet_s`` says how long ago the last one was written: a worker with nothing to say for a
while sends an empty ``Report`` instead, so the core can tell it from a hung one
(``supervisor.py``).

``iter_body`` streams a job's body chunk by chunk, fetching the next chunk while the caller
sends the current one, so at most two chunks of a message are held at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final, overload

from zoneq.errors import ProtocolError, TemporaryFailure
from zoneq.ipc.batching import FrameBatcher
from zoneq.ipc.framing import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame
from zoneq.ipc.messages import (
    ChunkReply,
    ChunkRequest,
    ErrorReply,
    Hello,
    Job,
    LeaseReply,
    LeaseRequest,
    Outcome,
    RecipientReport,
    Reply,
    Report,
    ReportReply,
    Request,
    Welcome,
    decode_reply,
    open_envelope,
    reply_type_for,
    seal,
)

__all__ = ["ConnectionLost", "CoreUnavailable", "IpcClient"]

log = logging.getLogger(__name__)

_READ_SIZE: Final = 256 * 1024


class CoreUnavailable(TemporaryFailure):
    """The core cannot be reached: its socket is missing or refuses connections."""


class ConnectionLost(CoreUnavailable):
    """The connection to the core ended; requests on it fail and must be retried anew."""


class IpcClient:
    """A connection to the core.  Make one with ``IpcClient.connect``."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._out = FrameBatcher(writer)
        self._max_frame = max_frame
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._abandoned_leases: set[int] = set()
        self._background: set[asyncio.Task[None]] = set()
        # Why the connection ended; None while it is up.
        self._lost: str | None = None
        self._sent_at = time.monotonic()
        self._reader_task = asyncio.create_task(self._read_loop())
        self.welcome: Welcome | None = None

    @classmethod
    async def connect(
        cls, path: Path, hello: Hello, *, max_frame: int = DEFAULT_MAX_FRAME
    ) -> IpcClient:
        """Connect to the core at ``path`` and introduce the worker with ``hello``.

        Raises ``CoreUnavailable`` if nothing listens there, and the error the core sends if
        it refuses the hello (``ProtocolError`` for a version it does not speak).
        """
        try:
            reader, writer = await asyncio.open_unix_connection(path, limit=_READ_SIZE)
        except OSError as exc:
            raise CoreUnavailable(f"cannot connect to the core at {path}: {exc}") from exc
        client = cls(reader, writer, max_frame=max_frame)
        try:
            client.welcome = await client.request(hello)
        except BaseException:
            await client.close()
            raise
        return client

    @property
    def closed(self) -> bool:
        return self._lost is not None

    def quiet_s(self) -> float:
        """Seconds since the last request was written (since the connection opened if none
        was)."""
        return time.monotonic() - self._sent_at

    async def close(self) -> None:
        """End the connection; outstanding requests fail with ``ConnectionLost``."""
        self._connection_ended("client closed")
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader_task
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    def abort(self) -> None:
        """Drop the connection at once, without waiting (for tests and emergencies)."""
        self._writer.transport.abort()
        self._connection_ended("connection aborted")

    @overload
    async def request(self, msg: Hello) -> Welcome: ...
    @overload
    async def request(self, msg: LeaseRequest) -> LeaseReply: ...
    @overload
    async def request(self, msg: ChunkRequest) -> ChunkReply: ...
    @overload
    async def request(self, msg: Report) -> ReportReply: ...

    async def request(self, msg: Request) -> Reply:
        """Send ``msg`` and return the core's reply, raising the error of an ``ErrorReply``.

        Raises ``ConnectionLost`` if the connection is or becomes closed before the reply,
        and ``ValueError`` if ``msg`` cannot be encoded (too large, a value out of range).
        """
        if self._lost is not None:
            raise ConnectionLost(self._lost)
        req_id = next(self._ids)
        frame = encode_frame(seal(req_id, msg), max_frame=self._max_frame)
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = future
        try:
            self._out.write(frame)
            self._sent_at = time.monotonic()
            await self._writer.drain()
            reply = await future
        except ConnectionError as exc:
            # A write to a socket the core has closed; the reader sees the end too.
            self._connection_ended(f"connection to the core lost: {exc}")
            raise ConnectionLost(f"connection to the core lost: {exc}") from exc
        except asyncio.CancelledError:
            if isinstance(msg, LeaseRequest) or (isinstance(msg, Report) and msg.lease_jobs):
                self._abandon_lease(req_id, future)
            raise
        finally:
            self._pending.pop(req_id, None)
        if isinstance(reply, ErrorReply):
            raise reply.to_exception()
        if not isinstance(reply, reply_type_for(msg)):
            raise ProtocolError(f"core answered {msg.VERB} with {reply.VERB}")
        return reply

    async def lease(self, max_jobs: int = 1, wait_ms: int = 0) -> tuple[Job, ...]:
        """Up to ``max_jobs`` jobs; empty if none is ready within ``wait_ms``."""
        reply = await self.request(LeaseRequest(max_jobs=max_jobs, wait_ms=wait_ms))
        return reply.jobs

    async def lease_reply(self, max_jobs: int = 1, wait_ms: int = 0) -> LeaseReply:
        """As :meth:`lease`, the whole reply: with the slots whose connections to close."""
        return await self.request(LeaseRequest(max_jobs=max_jobs, wait_ms=wait_ms))

    async def chunk(self, msg_id: int, index: int) -> bytes:
        reply = await self.request(ChunkRequest(msg_id=msg_id, index=index))
        return reply.data

    async def report(
        self,
        results: tuple[RecipientReport, ...],
        *,
        lease_jobs: int = 0,
        kept: tuple[int, ...] = (),
        closed: tuple[int, ...] = (),
        dead_hosts: int | None = None,
    ) -> ReportReply:
        """Report ``results``; with ``lease_jobs``, the reply also brings up to that many
        jobs that were ready (none if none was: then ``lease`` waits for one).  ``kept``
        and ``closed``: connection slots kept idle, and idle ones closed; ``dead_hosts``:
        the worker's count of resting MX addresses, if it has changed (``messages.py``)."""
        return await self.request(
            Report(
                results=results,
                lease_jobs=lease_jobs,
                kept=kept,
                closed=closed,
                dead_hosts=dead_hosts,
            )
        )

    async def iter_body(self, job: Job, *, read_ahead: bool = True) -> AsyncIterator[bytes]:
        """The body of ``job``, chunk by chunk, in order.

        With ``read_ahead`` the next chunk is fetched while the caller handles the current
        one.  If the caller stops early, the fetch in flight is cancelled.
        """
        if job.chunks == 0:
            return
        if job.body is not None and job.chunks == 1:
            yield job.body  # it came with the job: no request
            return
        fetch: asyncio.Task[bytes] = asyncio.create_task(self.chunk(job.msg_id, 0))
        try:
            for index in range(job.chunks):
                data = await fetch
                more = index + 1 < job.chunks
                if more and read_ahead:
                    fetch = asyncio.create_task(self.chunk(job.msg_id, index + 1))
                yield data
                if more and not read_ahead:
                    fetch = asyncio.create_task(self.chunk(job.msg_id, index + 1))
        finally:
            fetch.cancel()
            if fetch.done() and not fetch.cancelled():
                # Mark a read-ahead's failure as seen: the caller stopped before needing it.
                fetch.exception()

    # -----------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        decoder = FrameDecoder(self._max_frame)
        reason = "the core closed the connection"
        try:
            while True:
                data = await self._reader.read(_READ_SIZE)
                if not data:
                    break
                for obj in decoder.feed(data):
                    envelope = open_envelope(obj)
                    self._deliver(envelope.id, decode_reply(envelope))
        except ProtocolError as exc:
            log.error("IPC: protocol error from the core, disconnecting: %s", exc)
            reason = f"protocol error from the core: {exc}"
        except OSError as exc:
            reason = f"connection to the core lost: {exc}"
        finally:
            self._connection_ended(reason)

    def _deliver(self, req_id: int, reply: Reply) -> None:
        future = self._pending.get(req_id)
        if future is not None:
            if not future.done():
                future.set_result(reply)
            return
        if req_id in self._abandoned_leases:
            self._abandoned_leases.discard(req_id)
            self._give_back(_leased_jobs(reply))
            return
        # A reply to a request cancelled meanwhile; nothing waits for it.
        log.debug("IPC: dropping reply %d (%s) nobody waits for", req_id, reply.VERB)

    def _abandon_lease(self, req_id: int, future: asyncio.Future[Reply]) -> None:
        if not future.done() or future.cancelled():
            # Still unanswered (cancelling the caller cancels the future it waited on).
            if self._lost is None:
                self._abandoned_leases.add(req_id)
        elif future.exception() is None:
            # The reply came in just as the caller was cancelled: its jobs are ours to return.
            self._give_back(_leased_jobs(future.result()))

    def _give_back(self, jobs: tuple[Job, ...]) -> None:
        results = tuple(
            RecipientReport(
                token=recipient.token, outcome=Outcome.RETURNED, reply="lease request cancelled"
            )
            for job in jobs
            for recipient in job.recipients
        )
        if not results or self._lost is not None:
            return
        task = asyncio.create_task(self._report_quietly(results))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _report_quietly(self, results: tuple[RecipientReport, ...]) -> None:
        try:
            await self.report(results)
        except Exception as exc:
            # The leases end anyway when the connection does, or when they time out.
            log.warning("IPC: could not give back %d leases: %s", len(results), exc)

    def _connection_ended(self, reason: str) -> None:
        if self._lost is not None:
            return
        self._lost = reason
        self._abandoned_leases.clear()
        for future in self._pending.values():
            if not future.done():
                # One exception object per waiter: a shared one would collect every
                # waiter's traceback.
                future.set_exception(ConnectionLost(reason))
        self._out.flush()  # requests written this turn (a give-back) still go out
        self._writer.close()


def _leased_jobs(reply: Reply) -> tuple[Job, ...]:
    """The jobs a reply grants (a lease, or a report that also leased)."""
    if isinstance(reply, LeaseReply | ReportReply):
        return reply.jobs
    return ()
