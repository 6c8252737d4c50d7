"""The core's end of the worker socket: accepts workers and hands their requests to a handler.

Theory of operation
-------------------
``IpcServer`` listens on a Unix socket created with mode 0600, so only our own user can
connect: a worker can lease mail and report its fate, which nobody else may do.  The socket
is bound, then chmod-ed, and only then listened on; until ``listen()`` a connect is refused,
so there is no moment when the socket is open to others.  A socket file left by a core that
died is removed at start; one that still answers belongs to a live core and is left alone.
A missing directory for the socket is created, mode 0700 like a runtime directory (only our
own user has business there; missing ancestors get the umask's mode, as ``mkdir -p -m``
gives them); one that cannot be (a regular file in the way) is a
``SocketUnusable`` naming the path, as is a bind the kernel refuses.

Each connection is served by a reader loop.  The first request must be ``Hello``; it is
handled inline (nothing else is read until it is answered), so requests pipelined behind it
always see the connection's zone and owner.  After that every request runs in a task of its
own and its reply is written when it completes, so a ``LeaseRequest`` waiting for mail does
not hold up a ``ChunkRequest`` behind it.  At most ``max_in_flight`` requests of one
connection run at once; beyond that the reader stops reading and the socket's buffers push
back on the worker.  Replies finished in the same turn of the event loop leave in one write
(``batching.py``): one group commit settles many reports at once.

A handler's exception becomes an ``ErrorReply`` for that request (zoneq errors mapped to
their kind; anything else logged and sent as "internal") and the connection carries on.  A
peer that breaks the protocol (bad frame, bad message, a request before ``Hello``, a
reused request id) is sent an ``ErrorReply`` when the offending request's id is known and is
then disconnected: the stream cannot be trusted after that.

When a connection ends, for any reason (EOF, reset, protocol error, ``close()``), its running
requests are cancelled and awaited, and only then is ``CoreHandler.disconnected`` called,
exactly once.  So when ``disconnected`` runs, no handler call for that connection is running
or will start, and the core can return all of the worker's leases in one go.  Handlers must
therefore tolerate cancellation (the core's writes are atomic batches, so a cancelled
report either committed or did not).  EOF counts as the worker gone even if it only shut
its writing half: a crashed worker looks just the same, and its long-polling lease requests
must not go on granting it mail.  A refused ``Hello`` (an error from the handler, another
protocol version) is answered and then the connection is closed too: it could do nothing
else.

A worker that hangs (SIGSTOP, a blocked event loop) keeps its connection open and so its
leases, so ``heard`` tells the supervisor when each helloed worker was last heard from, by
PID: the time its last bytes were read.  A live worker writes at least every few seconds
(``delivery/worker.py``).  While a connection's reader is held back by ``max_in_flight``
the worker counts as heard now, and its silence counts again when the reader resumes: it is
the core that stopped listening, not the worker talking.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from zoneq.errors import ProtocolError, ZoneqError
from zoneq.ipc.batching import FrameBatcher
from zoneq.ipc.framing import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame
from zoneq.ipc.messages import (
    ChunkReply,
    ChunkRequest,
    ErrorReply,
    Hello,
    LeaseReply,
    LeaseRequest,
    Reply,
    Report,
    ReportReply,
    Request,
    Welcome,
    decode_request,
    open_envelope,
    reply_type_for,
    seal,
)

__all__ = ["ConnectionInfo", "CoreHandler", "IpcServer", "SocketInUse", "SocketUnusable"]

log = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT: Final = 256
_READ_SIZE: Final = 256 * 1024
_BACKLOG: Final = 128


class SocketInUse(ZoneqError):
    """Another process is accepting connections on the socket path."""


class SocketUnusable(ZoneqError):
    """The socket path cannot be bound: its directory cannot be created, or the kernel
    refuses the bind (permissions, a read-only file system)."""


@dataclass(frozen=True, slots=True)
class ConnectionInfo:
    """Who is at the other end of one connection.

    ``owner`` is unique for the server's lifetime (``worker#serial``), so the core can use it
    as the owner of the leases it grants on this connection.  ``zone``, ``worker`` and
    ``pid`` are ``None`` until a ``Hello`` has been accepted.
    """

    owner: str
    serial: int
    zone: str | None = None
    worker: str | None = None
    pid: int | None = None


class CoreHandler(Protocol):
    """What the core's queue service provides to serve workers.

    The coroutines return the reply or raise (a ``ZoneqError`` subclass to send its kind).
    ``disconnected`` is called exactly once per accepted connection, helloed or not, after
    every call for that connection has finished.
    """

    async def hello(self, conn: ConnectionInfo, msg: Hello) -> Welcome: ...

    async def lease(self, conn: ConnectionInfo, msg: LeaseRequest) -> LeaseReply: ...

    async def chunk(self, conn: ConnectionInfo, msg: ChunkRequest) -> ChunkReply: ...

    async def report(self, conn: ConnectionInfo, msg: Report) -> ReportReply: ...

    def disconnected(self, conn: ConnectionInfo) -> None: ...


class IpcServer:
    """Serves ``CoreHandler`` to workers over the Unix socket at ``path``."""

    def __init__(
        self,
        path: Path,
        handler: CoreHandler,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
        self.path = path
        self._handler = handler
        self._max_frame = max_frame
        self._max_in_flight = max_in_flight
        self._server: asyncio.Server | None = None
        self._inode: int | None = None
        self._serials = itertools.count(1)
        self._connections: dict[asyncio.Task[None], _Connection] = {}
        self._closing = False

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    def heard(self) -> dict[int, float]:
        """When each worker with a helloed connection was last heard from (its PID, a
        ``time.monotonic()`` reading)."""
        now = time.monotonic()
        heard: dict[int, float] = {}
        for connection in self._connections.values():
            pid = connection.info.pid
            if pid is not None:
                heard[pid] = max(heard.get(pid, 0.0), connection.heard(now))
        return heard

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("IpcServer already started")
        _make_directory(self.path)
        await _remove_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _bind(sock, self.path)
            os.chmod(self.path, 0o600)
            # Remembered so close() removes the file only if it is still ours.
            self._inode = os.stat(self.path).st_ino
            sock.listen(_BACKLOG)
            sock.setblocking(False)
            self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=_READ_SIZE)
        except BaseException:
            sock.close()
            self._unlink()
            raise
        log.info("IPC server listening on %s", self.path)

    async def close(self) -> None:
        """Stop accepting, end every connection (each reported to ``disconnected``), and
        remove the socket file."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        # The connection tasks catch their cancellation and clean up; gather only waits.
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        self._unlink()

    def _unlink(self) -> None:
        if self._inode is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        self._inode = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        serial = next(self._serials)
        if self._closing:
            writer.close()
            return
        connection = _Connection(
            self._handler,
            reader,
            writer,
            serial=serial,
            max_frame=self._max_frame,
            max_in_flight=self._max_in_flight,
        )
        self._connections[task] = connection
        try:
            await connection.run()
        finally:
            del self._connections[task]


class _Connection:
    """One worker's connection: reader loop, request tasks, and the end-of-life sequence."""

    def __init__(
        self,
        handler: CoreHandler,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        serial: int,
        max_frame: int,
        max_in_flight: int,
    ) -> None:
        self._handler = handler
        self._reader = reader
        self._writer = writer
        self._out = FrameBatcher(writer)
        self._max_frame = max_frame
        self._info = ConnectionInfo(owner=f"?#{serial}", serial=serial)
        self._helloed = False
        self._slots = asyncio.Semaphore(max_in_flight)
        self._running: dict[int, asyncio.Task[None]] = {}
        self._heard = time.monotonic()
        self._held_back = False  # the reader waits for a request slot

    @property
    def info(self) -> ConnectionInfo:
        return self._info

    def heard(self, now: float) -> float:
        """When the peer was last heard from; ``now`` while the reader is held back, since
        it is the core that is not listening then."""
        return now if self._held_back else self._heard

    async def run(self) -> None:
        try:
            await self._read_loop()
        except ProtocolError as exc:
            log.warning("IPC %s: protocol error, disconnecting: %s", self._info.owner, exc)
        except asyncio.CancelledError:
            # Server shutdown.  Not re-raised: the clean-up below must finish, and the
            # server's close() is the one waiting for us.
            pass
        except OSError as exc:
            log.info("IPC %s: connection failed: %s", self._info.owner, exc)
        except Exception:
            # A bug of ours, not the peer's; the clean-up still runs so leases come back.
            log.exception("IPC %s: connection failed unexpectedly", self._info.owner)
        finally:
            await self._end()

    async def _read_loop(self) -> None:
        decoder = FrameDecoder(self._max_frame)
        while True:
            data = await self._reader.read(_READ_SIZE)
            if not data:
                return
            self._heard = time.monotonic()
            for obj in decoder.feed(data):
                await self._dispatch(obj)

    async def _dispatch(self, obj: object) -> None:
        envelope = open_envelope(obj)
        try:
            request = decode_request(envelope)
            if envelope.id in self._running:
                raise ProtocolError(f"request id {envelope.id} is already in use")
            if not self._helloed and not isinstance(request, Hello):
                raise ProtocolError(f"{envelope.verb!r} before hello")
            if self._helloed and isinstance(request, Hello):
                raise ProtocolError("hello sent twice")
        except ProtocolError as exc:
            # Tell the peer why before hanging up, since we know which request it was.
            self._send(envelope.id, ErrorReply.from_exception(exc))
            raise
        if isinstance(request, Hello):
            await self._hello(envelope.id, request)
            return
        await self._acquire_slot()
        task = asyncio.create_task(self._answer(envelope.id, request))
        self._running[envelope.id] = task

    async def _acquire_slot(self) -> None:
        if not self._slots.locked():
            await self._slots.acquire()
            return
        self._held_back = True
        try:
            await self._slots.acquire()
        finally:
            self._held_back = False
            # The peer's silence counts again from now: what it sent meanwhile is unread.
            self._heard = time.monotonic()

    async def _hello(self, req_id: int, msg: Hello) -> None:
        info = ConnectionInfo(
            owner=f"{msg.worker}#{self._info.serial}",
            serial=self._info.serial,
            zone=msg.zone,
            worker=msg.worker,
            pid=msg.pid,
        )
        reply = await self._call(info, msg)
        self._send(req_id, reply)
        if isinstance(reply, ErrorReply):
            # Without a hello nothing else may be asked; better to say so by hanging up
            # than to leave a connection that can only fail.
            raise ProtocolError(f"hello refused: {reply.kind}: {reply.message}")
        self._info = info
        self._helloed = True
        log.info("IPC %s: worker pid %d of zone %s connected", info.owner, msg.pid, msg.zone)

    async def _answer(self, req_id: int, request: Request) -> None:
        try:
            reply = await self._call(self._info, request)
            self._send(req_id, reply)
            with contextlib.suppress(ConnectionError):
                await self._writer.drain()
        finally:
            del self._running[req_id]
            self._slots.release()

    async def _call(self, info: ConnectionInfo, request: Request) -> Reply:
        """The handler's reply to ``request``, or the ``ErrorReply`` its exception maps to."""
        handler = self._handler
        reply: Reply
        try:
            match request:
                case Hello():
                    reply = await handler.hello(info, request)
                case LeaseRequest():
                    reply = await handler.lease(info, request)
                case ChunkRequest():
                    reply = await handler.chunk(info, request)
                case Report():
                    reply = await handler.report(info, request)
        except ZoneqError as exc:
            return ErrorReply.from_exception(exc)
        except Exception as exc:
            log.exception("IPC %s: handler failed on %s", info.owner, request.VERB)
            return ErrorReply.from_exception(exc)
        expected = reply_type_for(request)
        if not isinstance(reply, expected):
            log.error(
                "IPC %s: handler answered %s with %s, not %s",
                info.owner,
                request.VERB,
                type(reply).__name__,
                expected.__name__,
            )
            return ErrorReply("internal", "internal error (wrong reply type)")
        return reply

    def _send(self, req_id: int, reply: Reply) -> None:
        if self._writer.is_closing():
            return
        try:
            frame = encode_frame(seal(req_id, reply), max_frame=self._max_frame)
        except ValueError:
            # Our bug (a chunk bigger than a frame, a value msgpack cannot carry): the peer
            # gets an error for this request, not a broken stream.
            log.exception("IPC %s: cannot encode reply to request %d", self._info.owner, req_id)
            frame = encode_frame(
                seal(req_id, ErrorReply("internal", "internal error (reply not encodable)"))
            )
        self._out.write(frame)

    async def _end(self) -> None:
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        finished = asyncio.gather(*tasks, return_exceptions=True)
        while not finished.done():
            # A cancellation arriving now (close() racing the peer's hang-up) must not skip
            # the guarantee that disconnected() runs, and runs after every request task.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(finished)
        try:
            self._handler.disconnected(self._info)
        except Exception:
            log.exception("IPC %s: disconnected() failed", self._info.owner)
        self._out.flush()  # a last error reply (a refused hello, a protocol error)
        self._writer.close()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await self._writer.wait_closed()
        log.info("IPC %s: disconnected", self._info.owner)


def _make_directory(path: Path) -> None:
    """Create the socket's directory if it is missing (its own ancestors too)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        # mkdir's EEXIST for a name in the way that is not a directory.
        raise SocketUnusable(f"{path}: {path.parent} is not a directory") from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise SocketUnusable(f"{path}: cannot create its directory: {reason}") from None


def _bind(sock: socket.socket, path: Path) -> None:
    try:
        sock.bind(os.fspath(path))
    except OSError as exc:
        raise SocketUnusable(f"{path}: cannot bind: {exc.strerror or exc}") from None


async def _remove_stale_socket(path: Path) -> None:
    """Remove a socket file nobody listens on; refuse to touch anything else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketInUse(f"{path} exists and is not a socket; not removing it")
    try:
        _, writer = await asyncio.open_unix_connection(path)
    except (ConnectionRefusedError, FileNotFoundError):
        # Nobody listening: left behind by a core that died.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    raise SocketInUse(f"{path}: another process is accepting connections on it")
