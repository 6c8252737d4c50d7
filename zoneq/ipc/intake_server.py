"""The core's end of the receiver processes' sockets: their requests made on the queue.

Theory of operation
-------------------
Each receiver process gets one end of a Unix socket pair when the supervisor starts it;
``IntakeServer.attach`` serves the other end here.  No socket file exists, so nothing but
the child the core started can ever speak on it, and a child's crash is seen exactly: the
socket reads EOF when the process is gone (the kernel closes its descriptors).

Frames (``intake_messages.py``) are handled in the order they arrive, each in a task of its
own started in that order, so the synchronous part of every store call (where the store
records what a message has written) runs in frame order; an ABANDON cannot overtake the
CHUNK before it.  A COMMIT is answered only when the store's commit future has resolved,
which is when the group-committed batch is synced: that reply is what lets the child send
250.  Replies finished in one turn of the loop leave in one write (``batching.py``).

Each connection keeps the messages it has begun and not yet committed (``open``) and the
client addresses it has counted.  A child may only touch its own messages: a frame naming
another is a protocol error, and the connection is dropped.  When the connection ends for
any reason, its running requests are awaited, then every open message is abandoned and
every counted client released, at once.  A message whose commit succeeded but whose reply
could not be delivered is the window of RFC 1047: the client never saw 250 and will send it
again, so a duplicate is possible; it is logged with its id.

An ADMIT over the limit waits a moment for a release before it is refused (``_admit``):
the release of the client's last connection may be on another receiver's socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Final

from zoneq.errors import ProtocolError, ZoneqError
from zoneq.ipc.batching import FrameBatcher
from zoneq.ipc.framing import FrameDecoder, encode_frame
from zoneq.ipc.intake_messages import (
    INTAKE_MAX_FRAME,
    MessageSink,
    Op,
    Status,
    decode_dropped,
    decode_message,
    decode_recipients,
    status_of,
)
from zoneq.logs import REPEATS
from zoneq.protocol.ids import format_id

__all__ = ["IntakeServer"]

log = logging.getLogger("zoneq.ipc.intake")

_READ_SIZE: Final = 262_144
# How long an ADMIT over the limit waits for a release before it is answered refused.
ADMIT_GRACE_S: Final = 0.2


@dataclass(eq=False)
class _Child:
    name: str
    out: FrameBatcher
    writer: asyncio.StreamWriter
    open: set[int] = field(default_factory=set)
    clients: Counter[str] = field(default_factory=Counter)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    gone: bool = False


class IntakeServer:
    """Serves ``sink`` to receiver processes, one socket each."""

    def __init__(self, sink: MessageSink) -> None:
        self._sink = sink
        self._serving: dict[str, asyncio.Task[None]] = {}
        # Clients with an ADMIT over the limit waiting for a release (``_admit``).  An
        # entry goes at the client's next release, which comes: its count is at the limit.
        self._released: dict[str, asyncio.Event] = {}

    @property
    def connected(self) -> list[str]:
        return sorted(self._serving)

    async def attach(self, sock: socket.socket, name: str) -> None:
        """Serve the core's end ``sock`` of receiver ``name``'s socket pair."""
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=_READ_SIZE)
        task = asyncio.create_task(self._serve(name, reader, writer), name=f"intake {name}")
        self._serving[name] = task
        task.add_done_callback(lambda done: self._forget(name, done))

    def _forget(self, name: str, task: asyncio.Task[None]) -> None:
        if self._serving.get(name) is task:
            del self._serving[name]

    async def close(self) -> None:
        """End every connection (their open messages abandoned)."""
        tasks = list(self._serving.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- one connection ----------------------------------------------------------------

    async def _serve(
        self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        child = _Child(name, FrameBatcher(writer), writer)
        decoder = FrameDecoder(INTAKE_MAX_FRAME)
        try:
            while data := await reader.read(_READ_SIZE):
                for frame in decoder.feed(data):
                    self._dispatch(child, frame)
        except ProtocolError as exc:
            log.warning("receiver %s broke the intake protocol: %s; disconnecting", name, exc)
        except (ConnectionError, OSError):
            pass  # the child is gone: the same as EOF
        except asyncio.CancelledError:
            pass  # close(): clean up below all the same
        finally:
            await self._end(child)

    def _dispatch(self, child: _Child, frame: object) -> None:
        if not isinstance(frame, list) or not frame or not isinstance(frame[0], int):
            raise ProtocolError("intake frame is not [op, ...]")
        op, args = frame[0], frame[1:]
        if op == Op.RELEASE and len(args) == 1 and child.clients[args[0]] > 0:
            child.clients[args[0]] -= 1
            self._release(args[0])
        elif op == Op.ABANDON and len(args) == 1:
            # One not open (committed, or never begun) is left alone: a child can only
            # ever abandon its own messages.
            if args[0] in child.open:
                child.open.discard(args[0])
                self._start(child, self._abandon(args[0]))
        elif op == Op.HELLO and len(args) == 2:
            log.info("receiver pid %s (%s) connected", args[1], child.name)
        elif op in (Op.ADMIT, Op.BEGIN, Op.CHUNK, Op.COMMIT) and args and _is_rid(args[0]):
            self._start(child, self._request(child, Op(op), args[0], args[1:]))
        else:
            raise ProtocolError(f"intake frame refused: op {op!r} with {len(args)} argument(s)")

    def _start(self, child: _Child, work: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        child.tasks.add(task)
        task.add_done_callback(child.tasks.discard)

    async def _request(self, child: _Child, op: Op, rid: int, args: list[object]) -> None:
        try:
            value = await self._call(child, op, args)
        except ProtocolError as exc:
            # Not the store's fault: the child sent nonsense.  Cut it off.
            log.warning("receiver %s: %s; disconnecting", child.name, exc)
            child.writer.close()
            return
        except (ZoneqError, ValueError) as exc:
            log.warning("receiver %s: %s refused: %s", child.name, op.name, exc, extra=REPEATS)
            self._reply(child, [rid, status_of(exc), str(exc)])
            return
        self._reply(child, [rid, Status.OK, value])

    async def _call(self, child: _Child, op: Op, args: list[object]) -> object:
        sink = self._sink
        if op is Op.ADMIT:
            (client,) = _shape(args, 1)
            if not isinstance(client, str):
                raise ProtocolError("ADMIT: client is not a string")
            admitted = await self._admit(client)
            if admitted:
                child.clients[client] += 1
            return admitted
        if op is Op.BEGIN:
            now_ms, size_hint = _shape(args, 2)
            if not (_is_rid(now_ms) and _is_rid(size_hint)):
                raise ProtocolError("BEGIN: bad time or size")
            assert isinstance(now_ms, int) and isinstance(size_hint, int)
            msg_id = await sink.begin(now_ms, size_hint)
            child.open.add(msg_id)
            return msg_id
        if op is Op.CHUNK:
            owner, index, data = _shape(args, 3)
            if not (self._owned(child, owner) and _is_rid(index) and isinstance(data, bytes)):
                raise ProtocolError("CHUNK: not an open message of this receiver")
            assert isinstance(owner, int) and isinstance(index, int)
            await sink.write_chunk(owner, index, data)
            return None
        # A fifth argument, the dropped recipients, only when a plugin dropped some.
        shape = _shape(args, 5 if len(args) > 4 else 4)
        message_obj, recipients_obj, now_ms, tail, *rest = shape
        message = decode_message(message_obj)
        dropped = decode_dropped(rest[0]) if rest else ()
        recipients = decode_recipients(recipients_obj, allow_empty=bool(dropped))
        ok = self._owned(child, message.msg_id) and _is_rid(now_ms)
        if not ok or not (tail is None or isinstance(tail, bytes)):
            raise ProtocolError("COMMIT: not an open message of this receiver")
        assert isinstance(now_ms, int)
        await sink.commit(message, recipients, now_ms, tail=tail, dropped=dropped)
        # Durable now.  Off the open list: a crash from here on must not abandon it.
        child.open.discard(message.msg_id)
        if child.gone:
            log.warning(
                "message %s committed after receiver %s went away: its client saw no 250 and "
                "may send it again (a duplicate, RFC 1047)",
                format_id(message.msg_id),
                child.name,
            )
        return None

    async def _admit(self, client: str) -> bool:
        """Count a connection from ``client``; over the limit, wait up to ``ADMIT_GRACE_S``
        for one of its connections to be released before refusing.

        Why: the client may have closed a connection already that the core has not heard of
        yet.  A client closing without waiting for the 221 (Postfix's default
        ``smtp_skip_quit_response``) reconnects at once, and the new connection can land on
        another receiver process, whose ADMIT then overtakes the old one's RELEASE (frames
        are ordered on one socket, not across two): a client within its limit was told 421
        (69 connections of 600).  A refusal comes that much later, which costs only a
        client over the limit."""
        sink = self._sink
        if await sink.admit(client) is True:
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ADMIT_GRACE_S
        while (left := deadline - loop.time()) > 0:
            released = self._released.setdefault(client, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(released.wait(), left)
            if await sink.admit(client) is True:
                return True
        return False

    def _release(self, client: str) -> None:
        """A counted connection of ``client`` ended: ADMITs waiting for it try again."""
        self._sink.release(client)
        released = self._released.pop(client, None)
        if released is not None:
            released.set()

    @staticmethod
    def _owned(child: _Child, msg_id: object) -> bool:
        return isinstance(msg_id, int) and msg_id in child.open

    async def _abandon(self, msg_id: int) -> None:
        try:
            await self._sink.abandon(msg_id)
        except ZoneqError as exc:
            # The sweep removes the chunks later (the receiving marker stays).
            log.warning("message %s: abandon failed: %s", format_id(msg_id), exc, extra=REPEATS)

    def _reply(self, child: _Child, reply: list[object]) -> None:
        if not child.gone:
            child.out.write(encode_frame(reply, max_frame=INTAKE_MAX_FRAME))

    async def _end(self, child: _Child) -> None:
        child.gone = True
        with contextlib.suppress(Exception):
            child.writer.close()
        # Requests running finish first (a commit in flight lands or fails), so that what
        # is still open afterwards is exactly what no client was told 250 for.
        while child.tasks:
            await asyncio.gather(*list(child.tasks), return_exceptions=True)
        doomed = sorted(child.open)
        child.open.clear()
        for msg_id in doomed:
            await self._abandon(msg_id)
        for client, count in child.clients.items():
            for _ in range(count):
                self._release(client)
        child.clients.clear()
        # Spare ids begun ahead (intake_client.py) are among them when the child crashed.
        log.info("receiver %s disconnected: %d open message(s) abandoned", child.name, len(doomed))


def _is_rid(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shape(args: list[object], count: int) -> list[object]:
    if len(args) != count:
        raise ProtocolError(f"intake request with {len(args)} argument(s), not {count}")
    return args
