"""Intake: what an SMTP receiver hands the queue, and how it travels from a receiver process.

Theory of operation
-------------------
The receiver (``zoneq.receiver``) talks to a ``MessageSink``: ``begin`` a message at MAIL,
``write_chunk`` its text as chunks fill, ``commit`` it at the final dot (the returned
awaitable resolves once the message is durable, and only then may the client be told 250),
``abandon`` it otherwise; ``admit`` and ``release`` count connections per client address.
In the core the sink is the queue store itself (``zoneq.runtime.StoreSink``); in a receiver
process it is ``IntakeClient``, which forwards every call to the core over a Unix socket
where ``IntakeServer`` makes the same calls on the store.  So there is one receiver, and the
values it builds here (``ReceivedMessage``, ``ReceivedRecipient``) are plain data that this
module encodes as msgpack frames (``framing.py``) and that never name the storage layer.

Frames (lists, the first item the operation; ``rid`` a request id the reply carries back):

    child -> core   [HELLO, name, pid]                       no reply
                    [ADMIT, rid, client]                     -> bool
                    [RELEASE, client]                        no reply
                    [BEGIN, rid, now_ms, size_hint]          -> message id
                    [CHUNK, rid, msg_id, index, data]        -> None
                    [COMMIT, rid, message, recipients, now_ms, tail(, dropped)]
                                                             -> None, once synced
                    [ABANDON, msg_id]                        no reply
    core -> child   [rid, status, value]    status OK, FULL (452 4.3.1) or FAULT (451 4.3.0)

``dropped`` (recipients a plugin dropped, each ``[address, zone, reason]``) is sent only
when there are some, so the frame of the usual message is what it always was; with it,
``recipients`` may be empty (every recipient dropped: only the events are stored).
Likewise ``message`` has a twelfth field, the routing header that chose the zone
(``ReceivedMessage.zone_header``), only when one did.

Requests without a reply are safe to fire and forget because the core handles one
connection's frames in order: an ABANDON can never overtake the CHUNK before it.

Pure: no asyncio, no sockets.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from zoneq.errors import InsufficientStorage, ProtocolError, TemporaryFailure, ZoneqError

__all__ = [
    "INTAKE_MAX_FRAME",
    "ConnectionCounts",
    "CoreUnreachable",
    "DroppedRecipient",
    "MessageSink",
    "Op",
    "ReceivedMessage",
    "ReceivedRecipient",
    "Status",
    "decode_dropped",
    "decode_message",
    "decode_recipients",
    "encode_dropped",
    "encode_message",
    "encode_recipients",
    "error_from_reply",
    "status_of",
]


INTAKE_MAX_FRAME: Final = 128 * 1024 * 1024
"""The largest frame on the intake socket, both ways.

A COMMIT carries the whole recipient list, and ``receiver.max_recipients`` goes up to
100,000: at up to 512 octets of RCPT line each (RFC 5321 section 4.5.3.1.4, path and
ORCPT together) plus the zone and NOTIFY, a bulk list can pack to ~60 MiB, past the 16 MiB
a worker's frames are held to.  Refused for size, such a message could only ever get 451.
Both ends are zoneq's own processes, and the receiver holds the list in memory already."""


class CoreUnreachable(TemporaryFailure):
    """The core cannot be reached (its socket closed): the receiver answers 421 4.3.0 and
    closes, the client retries later (RFC 5321 section 3.8)."""


class Op(enum.IntEnum):
    HELLO = 0
    ADMIT = 1
    RELEASE = 2
    BEGIN = 3
    CHUNK = 4
    COMMIT = 5
    ABANDON = 6


class Status(enum.IntEnum):
    OK = 0
    FULL = 1  # InsufficientStorage: 452 4.3.1
    FAULT = 2  # any other local fault: 451 4.3.0


def status_of(exc: BaseException) -> Status:
    """The status an exception from the store travels as."""
    return Status.FULL if isinstance(exc, InsufficientStorage) else Status.FAULT


def error_from_reply(status: object, text: object) -> ZoneqError:
    """The exception a failed reply is raised as in the receiver process: the same families
    the store raises in the core, so the receiver answers the same 452 / 451."""
    detail = f"core: {text}"
    if status == Status.FULL:
        return InsufficientStorage(detail)
    if status == Status.FAULT:
        return TemporaryFailure(detail)
    return ProtocolError(f"unknown reply status {status!r}")


@dataclass(frozen=True, slots=True)
class ReceivedRecipient:
    """One accepted RCPT: the address, its zone, and RFC 3461 NOTIFY / ORCPT."""

    address: str
    zone: str
    notify: tuple[str, ...] = ()
    orcpt: str | None = None


@dataclass(frozen=True, slots=True)
class DroppedRecipient:
    """An accepted RCPT that a plugin dropped: told 250, never queued; the commit writes a
    DROPPED event for it with ``reason`` as its text.  ``zone`` is the one routing gave."""

    address: str
    zone: str
    reason: str


@dataclass(frozen=True, slots=True)
class ReceivedMessage:
    """Everything the receiver knows of a message at the final dot, but its text."""

    msg_id: int
    sender: str
    size: int
    chunks: int
    received_ms: int
    ret: str | None = None
    envid: str | None = None
    smtputf8: bool = False
    body_8bit: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)
    # The routing header field that chose the recipients' zone, if one did: stored with
    # the message so that delivery removes that field (``MessageMeta.zone_header``).
    zone_header: str | None = None


class MessageSink(Protocol):
    """Where the receiver puts what it accepts (see the module docstring)."""

    def admit(self, client: str) -> asyncio.Future[bool]:
        """Count a new connection from ``client``; False if it has too many already.

        Already done when the answer is known at once (in the core): the receiver then
        answers 421 instead of its greeting.  A receiver process has to ask the core; it
        greets meanwhile, so the round trip is not one more wait for every connection, and
        a refusal is a 421 as soon as it comes, whether or not the client has spoken (RFC
        5321 section 3.8 allows 421 at any time).
        """
        ...

    def release(self, client: str) -> None:
        """A connection ``admit`` counted has ended."""
        ...

    async def begin(self, now_ms: int, size_hint: int) -> int:
        """A new message id; raises ``InsufficientStorage`` / ``TemporaryFailure``."""
        ...

    async def write_chunk(self, msg_id: int, index: int, data: bytes) -> None: ...

    def commit(
        self,
        message: ReceivedMessage,
        recipients: Sequence[ReceivedRecipient],
        now_ms: int,
        *,
        tail: bytes | None,
        dropped: Sequence[DroppedRecipient] = (),
    ) -> Awaitable[None]:
        """Resolves once the message is durable.  A future, not a coroutine: the caller
        shields it (a session closing must not cancel a commit in flight).  ``dropped``
        recipients get their DROPPED events in the same batch; with no ``recipients`` only
        those events are stored and the message's chunks removed."""
        ...

    async def abandon(self, msg_id: int) -> None: ...


class ConnectionCounts:
    """Open connections per client address, against one limit (``receiver.
    max_connections_per_client``).  Kept in the core so the limit holds across receiver
    processes: the kernel spreads one client's connections over all of them."""

    __slots__ = ("_counts", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        self.limit = limit
        self._counts: dict[str, int] = {}

    def admit(self, client: str) -> bool:
        count = self._counts.get(client, 0)
        if count >= self.limit:
            return False
        self._counts[client] = count + 1
        return True

    def release(self, client: str) -> None:
        left = self._counts.get(client, 0) - 1
        if left > 0:
            self._counts[client] = left
        else:
            self._counts.pop(client, None)

    def open(self, client: str) -> int:
        return self._counts.get(client, 0)


# --- the wire ----------------------------------------------------------------------------

_MESSAGE_FIELDS: Final = 11


def encode_message(message: ReceivedMessage) -> list[object]:
    m = message
    fields: list[object] = [
        m.msg_id,
        m.sender,
        m.size,
        m.chunks,
        m.received_ms,
        m.ret,
        m.envid,
        m.smtputf8,
        m.body_8bit,
        m.headers,
        m.source,
    ]
    if m.zone_header is not None:
        fields.append(m.zone_header)
    return fields


def decode_message(obj: object) -> ReceivedMessage:
    """A ``ReceivedMessage`` from its frame form; ``ProtocolError`` if it is not one."""
    if not isinstance(obj, list) or len(obj) not in (_MESSAGE_FIELDS, _MESSAGE_FIELDS + 1):
        raise ProtocolError("message: not a list of 11 or 12 fields")
    fields = obj[:_MESSAGE_FIELDS]
    msg_id, sender, size, chunks, received, ret, envid, utf8, bit8, headers, source = fields
    zone_header = obj[_MESSAGE_FIELDS] if len(obj) > _MESSAGE_FIELDS else None
    _need(all(_is_int(v) for v in (msg_id, size, chunks, received)), "message: bad numbers")
    _need(isinstance(sender, str), "message: bad sender")
    _need(all(v is None or isinstance(v, str) for v in (ret, envid)), "message: bad RET/ENVID")
    _need(isinstance(utf8, bool) and isinstance(bit8, bool), "message: bad flags")
    _need(_is_str_map(headers) and _is_str_map(source), "message: bad headers or source")
    _need(zone_header is None or isinstance(zone_header, str), "message: bad zone header")
    return ReceivedMessage(
        msg_id, sender, size, chunks, received, ret, envid, utf8, bit8, headers, source, zone_header
    )


def encode_recipients(recipients: Sequence[ReceivedRecipient]) -> list[object]:
    return [[r.address, r.zone, list(r.notify), r.orcpt] for r in recipients]


def decode_recipients(obj: object, *, allow_empty: bool = False) -> list[ReceivedRecipient]:
    """The recipients from their frame form; ``ProtocolError`` if malformed.  Empty only
    when ``allow_empty`` (a commit whose every recipient was dropped)."""
    _need(isinstance(obj, list) and (allow_empty or bool(obj)), "recipients: none or not a list")
    assert isinstance(obj, list)
    out: list[ReceivedRecipient] = []
    for item in obj:
        _need(isinstance(item, list) and len(item) == 4, "recipient: not 4 fields")
        address, zone, notify, orcpt = item
        _need(isinstance(address, str) and isinstance(zone, str), "recipient: bad address")
        _need(isinstance(notify, list) and all(isinstance(n, str) for n in notify), "NOTIFY")
        _need(orcpt is None or isinstance(orcpt, str), "recipient: bad ORCPT")
        out.append(ReceivedRecipient(address, zone, tuple(notify), orcpt))
    return out


def encode_dropped(dropped: Sequence[DroppedRecipient]) -> list[object]:
    return [[d.address, d.zone, d.reason] for d in dropped]


def decode_dropped(obj: object) -> list[DroppedRecipient]:
    """The dropped recipients from their frame form (non-empty); ``ProtocolError`` if not."""
    _need(isinstance(obj, list) and bool(obj), "dropped: not a non-empty list")
    assert isinstance(obj, list)
    out: list[DroppedRecipient] = []
    for item in obj:
        _need(isinstance(item, list) and len(item) == 3, "dropped: not 3 fields")
        _need(all(isinstance(v, str) for v in item), "dropped: not strings")
        address, zone, reason = item
        out.append(DroppedRecipient(address, zone, reason))
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_str_map(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _need(condition: bool, what: str) -> None:
    if not condition:
        raise ProtocolError(f"intake frame: {what}")
