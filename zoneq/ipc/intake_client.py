"""A receiver process's ``MessageSink``: the core, over the socket the supervisor handed it.

Every call becomes one frame (``intake_messages.py``); the ones that need an answer carry
a request id and return (or are) a future that the reader task resolves when the core's
reply comes.  Frames written in one turn of the loop leave in one write (``batching.py``),
so many sessions asking at once cost the core one wake-up.

Spare message ids: a message costs three round trips to the core (ADMIT at connect, BEGIN
at MAIL, COMMIT at the dot), each a wait for the core to be scheduled, and on a busy machine
those waits, not CPU, bound the accept rate.  So the client keeps a few ids begun ahead
(``_spares``): MAIL takes one at once, and asks for a replacement in the background, which
leaves in the same write as the commit or the next request.  A spare is what ``begin``
would have returned moments earlier: the core checked the free-space floor for it (and
checks again at the commit), and it is used only if at most ``SPARE_MAX_AGE_S`` old (ids
are time-ordered: the queue delivers oldest first) and the client declared no SIZE above
``SPARE_MAX_SIZE`` (a large declaration gets its own check at MAIL, RFC 1870).  The pool
grows by one each time MAIL finds none ready, up to ``SPARES_MAX``: about the number of
sessions that start messages at once.  Stale spares are abandoned; at close all are, and
a crash leaves them to the core, which abandons every open id of a dead receiver.

When the socket ends (the core died, or is stopping) every pending call fails with
``CoreUnreachable``, as does every later one, and ``lost`` is set: the receiver answers
421 4.3.0 to its clients and the process exits.  Nothing needs to be undone here: the core
abandons every message this process had open when it sees the socket close.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
from collections import deque
from collections.abc import Sequence
from typing import Final, cast

from zoneq.errors import ProtocolError
from zoneq.ipc.batching import FrameBatcher
from zoneq.ipc.framing import FrameDecoder, encode_frame
from zoneq.ipc.intake_messages import (
    INTAKE_MAX_FRAME,
    CoreUnreachable,
    DroppedRecipient,
    Op,
    ReceivedMessage,
    ReceivedRecipient,
    Status,
    encode_dropped,
    encode_message,
    encode_recipients,
    error_from_reply,
)

__all__ = ["IntakeClient"]

log = logging.getLogger("zoneq.ipc.intake")

_READ_SIZE: Final = 262_144
SPARE_MAX_AGE_S: Final = 1.0
SPARE_MAX_SIZE: Final = 1 << 20
SPARES_MAX: Final = 16


class IntakeClient:
    """Implements ``MessageSink`` by asking the core (``intake_server.py``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._out = FrameBatcher(writer)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[object]] = {}
        self.lost = asyncio.Event()
        self._closing = False
        self._spares: deque[tuple[float, asyncio.Future[object]]] = deque()
        self._spares_wanted = 0
        self._task = asyncio.create_task(self._read_replies(), name="intake replies")

    @classmethod
    async def from_fd(cls, fd: int, name: str) -> IntakeClient:
        """Talk to the core over inherited descriptor ``fd``; say who we are."""
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=_READ_SIZE)
        client = cls(reader, writer)
        client._send([Op.HELLO, name, os.getpid()])
        return client

    # --- MessageSink ---------------------------------------------------------------------

    def admit(self, client: str) -> asyncio.Future[bool]:
        return cast("asyncio.Future[bool]", self._ask(Op.ADMIT, client))

    def release(self, client: str) -> None:
        if not self.lost.is_set():
            self._send([Op.RELEASE, client])

    async def begin(self, now_ms: int, size_hint: int) -> int:
        if size_hint <= SPARE_MAX_SIZE:
            spare = self._take_spare(now_ms)
            if spare is not None:
                return spare
            self._spares_wanted = min(SPARES_MAX, self._spares_wanted + 1)
        self._top_up(now_ms)
        return _message_id(await self._ask(Op.BEGIN, now_ms, size_hint))

    async def write_chunk(self, msg_id: int, index: int, data: bytes) -> None:
        await self._ask(Op.CHUNK, msg_id, index, data)

    def commit(
        self,
        message: ReceivedMessage,
        recipients: Sequence[ReceivedRecipient],
        now_ms: int,
        *,
        tail: bytes | None,
        dropped: Sequence[DroppedRecipient] = (),
    ) -> asyncio.Future[None]:
        # The core answers None: the future's value is never read, only its outcome.
        meta, rcpts = encode_message(message), encode_recipients(recipients)
        if dropped:  # only then: the usual frame stays as it was
            answer = self._ask(Op.COMMIT, meta, rcpts, now_ms, tail, encode_dropped(dropped))
        else:
            answer = self._ask(Op.COMMIT, meta, rcpts, now_ms, tail)
        self._top_up(now_ms)  # the session's next MAIL finds an id ready
        return cast("asyncio.Future[None]", answer)

    async def abandon(self, msg_id: int) -> None:
        # No reply: the core handles our frames in order, and if the socket is gone the
        # core abandons every open message of ours by itself.
        if not self.lost.is_set():
            self._send([Op.ABANDON, msg_id])

    # --- the connection ----------------------------------------------------------------

    async def close(self) -> None:
        """Send what is held, then close (the core abandons whatever is still open)."""
        self._closing = True
        while self._spares and not self.lost.is_set():
            _, future = self._spares.popleft()
            if future.done() and not future.cancelled() and future.exception() is None:
                await self.abandon(_message_id(future.result()))
            else:
                future.cancel()  # the core abandons it with the rest
        self._out.flush()
        self._writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    # --- spare ids --------------------------------------------------------------------

    def _take_spare(self, now_ms: int) -> int | None:
        """A fresh spare id ready now, or None; stale and refused ones are dropped."""
        now = asyncio.get_running_loop().time()
        while self._spares:
            asked, future = self._spares[0]
            if not future.done():
                return None
            self._spares.popleft()
            if future.cancelled() or future.exception() is not None:
                continue  # e.g. below the floor then: MAIL asks for itself and is told
            msg_id = _message_id(future.result())
            if now - asked > SPARE_MAX_AGE_S:
                self._send([Op.ABANDON, msg_id])
                continue
            self._top_up(now_ms)
            return msg_id
        return None

    def _top_up(self, now_ms: int) -> None:
        """Ask for spares until ``_spares_wanted`` are held or on their way."""
        if self.lost.is_set():
            return
        now = asyncio.get_running_loop().time()
        while len(self._spares) < self._spares_wanted:
            self._spares.append((now, self._ask(Op.BEGIN, now_ms, 0)))

    def _ask(self, op: Op, *args: object) -> asyncio.Future[object]:
        if self.lost.is_set():
            raise CoreUnreachable("the core's socket is closed")
        rid = next(self._ids)
        # ValueError (too large) before it is pending.
        frame = encode_frame([op, rid, *args], max_frame=INTAKE_MAX_FRAME)
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        self._out.write(frame)
        return future

    def _send(self, frame: list[object]) -> None:
        self._out.write(encode_frame(frame, max_frame=INTAKE_MAX_FRAME))

    async def _read_replies(self) -> None:
        decoder = FrameDecoder(INTAKE_MAX_FRAME)
        why = "the core closed the socket"
        try:
            while data := await self._reader.read(_READ_SIZE):
                for reply in decoder.feed(data):
                    self._settle(reply)
        except ProtocolError as exc:
            why = f"bad reply from the core: {exc}"
        except (ConnectionError, OSError) as exc:
            why = f"the core's socket failed: {exc}"
        finally:
            self._lose(why)

    def _settle(self, reply: object) -> None:
        if not isinstance(reply, list) or len(reply) != 3:
            raise ProtocolError(f"reply is not [rid, status, value]: {reply!r}")
        rid, status, value = reply
        future = self._pending.pop(rid, None) if isinstance(rid, int) else None
        if future is None:
            raise ProtocolError(f"reply to an unknown request {rid!r}")
        if future.done():
            return
        if status == Status.OK:
            future.set_result(value)
        else:
            future.set_exception(error_from_reply(status, value))

    def _lose(self, why: str) -> None:
        self._spares.clear()
        if self.lost.is_set():
            return
        if not self._closing:
            log.warning("intake: %s", why)
        self.lost.set()
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(CoreUnreachable(why))
                # Retrieved here so an abandoned future does not warn at exit.
                future.exception()
        self._writer.close()


def _message_id(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"BEGIN answered {value!r}, not a message id")
    return value
