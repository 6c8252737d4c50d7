"""Values stored under the queue's keys, and their msgpack encodings.

Recipient records are msgpack arrays (they are written on every transition, so they are kept
small and fast to pack); message metadata is a msgpack map (written once, read by the admin
API and by delivery, and the place new fields will be added).  Both carry a format version as
their first element / ``v`` field so an old zoneq refuses a newer store instead of misreading
it.  A value that cannot be decoded raises ``StorageCorruption`` naming its key; the caller
quarantines that record and goes on with the rest.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, TypeVar

import msgpack

from zoneq.errors import StorageCorruption
from zoneq.protocol.domains import normal_domain

RECORD_VERSION: Final = 1
META_VERSION: Final = 1

_T = TypeVar("_T")


class State(enum.StrEnum):
    READY = "ready"
    LEASED = "leased"  # in memory only: a READY record handed to a worker
    DEFERRED = "deferred"
    HELD = "held"


def recipient_domain(address: str) -> str:
    """The destination domain in its one normal form: lower-case A-labels.

    ``bob@bücher.example`` and ``bob@xn--bcher-kva.example`` go to one domain, so they
    share its counts, its job queue, its connection limit and its routing (``normal_domain``
    in ``zoneq.protocol.domains``); the address itself is kept as the client gave it (RCPT
    TO carries it unchanged, RFC 6531).  A name IDNA refuses is kept lower-cased rather
    than refused: the address was accepted already, and failing here would lose it.  An
    address literal (``[192.0.2.1]``) is ASCII and only lower-cased.

    Queues written before this: their records keep the domain they were stored with (a
    U-label, lower-cased), and are not rewritten.  They are still delivered (the MX lookup
    encodes the name itself) and form their own job queue under that form until they
    leave; their per-domain counts join the A-label's when the store opens (``Counters``
    keys every domain by its normal form), so a purge or a count by either form sees them.
    """
    _, at, domain = address.rpartition("@")
    return normal_domain(domain) if at else ""


def domain_is(stored: str, wanted: str) -> bool:
    """Whether a record's stored domain is ``wanted`` (in normal form): a record stored
    before domains were normalised holds a U-label, and is found by either form too."""
    return stored == wanted or normal_domain(stored) == wanted


@dataclass(frozen=True, slots=True)
class NewRecipient:
    """A recipient as the receiver hands it to :meth:`QueueStore.commit`."""

    address: str
    zone: str
    # RFC 3461 DSN parameters as given at RCPT (NOTIFY keywords, ORCPT "type;addr").
    notify: tuple[str, ...] = ()
    orcpt: str | None = None


@dataclass(frozen=True, slots=True)
class Recipient:
    """One queued recipient of one message in one zone (the ``delivery-zone`` record)."""

    zone: str
    msg_id: int
    address: str
    domain: str
    attempts: int = 0
    first_attempt_ms: int = 0
    last_attempt_ms: int = 0
    next_attempt_ms: int = 0
    last_reply: str = ""
    notify: tuple[str, ...] = ()
    orcpt: str | None = None
    hold_reason: str = ""
    # RFC 3461 NOTIFY=DELAY: a delay notice went to the sender already (one per recipient).
    delay_notified: bool = False

    def encode(self) -> bytes:
        return msgpack.packb(
            [
                RECORD_VERSION,
                self.domain,
                self.attempts,
                self.first_attempt_ms,
                self.last_attempt_ms,
                self.next_attempt_ms,
                self.last_reply,
                list(self.notify),
                self.orcpt,
                self.hold_reason,
                self.delay_notified,
            ]
        )

    @classmethod
    def decode(cls, key: bytes, zone: str, msg_id: int, address: str, value: bytes) -> Recipient:
        try:
            items = msgpack.unpackb(value)
            if not isinstance(items, list) or items[0] != RECORD_VERSION:
                raise ValueError(f"unknown record format {items[:1]!r}")
            _, domain, attempts, first, last, nxt, reply, notify, orcpt, hold = items[:10]
            # Records written before the delay flag existed have ten elements.
            notified = bool(items[10]) if len(items) > 10 else False
            return cls(
                zone=zone,
                msg_id=msg_id,
                address=address,
                domain=str(domain),
                attempts=int(attempts),
                first_attempt_ms=int(first),
                last_attempt_ms=int(last),
                next_attempt_ms=int(nxt),
                last_reply=str(reply),
                notify=tuple(str(n) for n in notify),
                orcpt=None if orcpt is None else str(orcpt),
                hold_reason=str(hold),
                delay_notified=notified,
            )
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            raise StorageCorruption(key, str(exc)) from exc

    def after_attempt(self, now_ms: int, reply: str, next_attempt_ms: int = 0) -> Recipient:
        return replace(
            self,
            attempts=self.attempts + 1,
            first_attempt_ms=self.first_attempt_ms or now_ms,
            last_attempt_ms=now_ms,
            last_reply=reply,
            next_attempt_ms=next_attempt_ms,
        )


@functools.lru_cache(maxsize=4096)
def new_record_value(domain: str, notify: tuple[str, ...], orcpt: str | None) -> bytes:
    """The value of a recipient's record at commit (no attempts yet): it depends only on
    these, so it is encoded once and shared; on the commit path this was a dataclass and an
    encode per recipient.  ``domain`` is put in its normal form here too (cached with the
    value, so free): the commit path splits the address inline, lower-casing only."""
    return Recipient("", 0, "", normal_domain(domain), notify=notify, orcpt=orcpt).encode()


@dataclass(frozen=True, slots=True)
class MessageMeta:
    """The ``*`` key: everything known about a message except its body and recipients.

    Recipients are not listed here: each has its own record, and a list message with
    10,000 recipients would otherwise carry a ~300 KB value that every reader decodes.
    ``zones`` says where to find the records; the store fills it and ``recipient_count``
    in at commit.
    """

    msg_id: int
    sender: str  # envelope MAIL FROM, "" for the null reverse-path <>
    size: int  # body octets as stored
    chunks: int  # number of body chunk keys
    received_ms: int
    zones: tuple[str, ...] = ()
    recipient_count: int = 0
    ret: str | None = None  # RFC 3461 RET=FULL|HDRS
    envid: str | None = None  # RFC 3461 ENVID (xtext as received)
    smtputf8: bool = False
    body_8bit: bool = False
    # A few parsed headers for browsing (Message-ID, Subject, From) and where it came from
    # (client address, HELO name, authenticated user, "smtp" or "http").
    headers: dict[str, str] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)
    is_bounce: bool = False  # a DSN we generated: shorter lifetime, never bounced itself
    # The routing header's field name (``routing.zone_header`` when the message came) if
    # that header chose its zone: delivery removes this field, so a header renamed in the
    # config since is still never delivered (issue 5).  None otherwise; and for metadata
    # written before the field existed, which delivery treats as naming the current one.
    zone_header: str | None = None

    def encode(
        self, zones: Sequence[str] | None = None, recipient_count: int | None = None
    ) -> bytes:
        """The msgpack value; ``zones`` and ``recipient_count`` override the fields (the
        store fills them in at commit without copying the dataclass).

        ``zone_header`` is written only when set: the usual message's value stays as it
        was, and a zoneq from before the field reads a value that has it (unknown keys are
        ignored), so the format keeps its version."""
        fields = {
            "v": META_VERSION,
            "sender": self.sender,
            "zones": list(self.zones if zones is None else zones),
            "rcpts": self.recipient_count if recipient_count is None else recipient_count,
            "size": self.size,
            "chunks": self.chunks,
            "received": self.received_ms,
            "ret": self.ret,
            "envid": self.envid,
            "utf8": self.smtputf8,
            "8bit": self.body_8bit,
            "headers": self.headers,
            "source": self.source,
            "bounce": self.is_bounce,
        }
        if self.zone_header is not None:
            fields["zone_header"] = self.zone_header
        return msgpack.packb(fields)

    @classmethod
    def decode(cls, key: bytes, msg_id: int, value: bytes) -> MessageMeta:
        """The metadata in ``value``; ``StorageCorruption`` if any field is missing or of the
        wrong type.  Every field is checked here, once, because a value that decodes but
        carries, say, ``"chunks": "3"`` would otherwise reach a worker inside a job, which
        refuses it and exits, and the next worker would take the same job: for ever."""
        try:
            data = msgpack.unpackb(value)
            if not isinstance(data, dict):
                raise ValueError(f"metadata is a {type(data).__name__}, not a map")
            if data.get("v") != META_VERSION:
                raise ValueError(f"unknown metadata format {data.get('v')!r}")
            return cls(
                msg_id=msg_id,
                sender=_typed(data, "sender", str),
                zones=tuple(_strings(data, "zones")),
                recipient_count=_count(data, "rcpts"),
                size=_count(data, "size"),
                chunks=_count(data, "chunks"),
                received_ms=_typed(data, "received", int),
                ret=_optional_str(data, "ret"),
                envid=_optional_str(data, "envid"),
                smtputf8=_typed(data, "utf8", bool),
                body_8bit=_typed(data, "8bit", bool),
                headers=_string_map(data, "headers"),
                source=_string_map(data, "source"),
                is_bounce=_typed(data, "bounce", bool),
                zone_header=_added_str(data, "zone_header"),
            )
        except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as exc:
            raise StorageCorruption(key, str(exc)) from exc


def _typed(data: dict[str, Any], name: str, kind: type[_T]) -> _T:
    """``data[name]``, which must be a ``kind`` (bool is not taken for int: msgpack keeps
    them apart, so a bool where a count belongs is damage, not an encoding)."""
    value = data[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{name}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _count(data: dict[str, Any], name: str) -> int:
    value = _typed(data, name, int)
    if value < 0:
        raise ValueError(f"{name}: {value} is negative")
    return value


def _optional_str(data: dict[str, Any], name: str) -> str | None:
    value = data[name]
    return None if value is None else _typed(data, name, str)


def _added_str(data: dict[str, Any], name: str) -> str | None:
    """An optional field added after its format's version: absent (written before it) or
    None is None."""
    return None if data.get(name) is None else _typed(data, name, str)


def _strings(data: dict[str, Any], name: str) -> list[str]:
    items = _typed(data, name, list)
    if not all(isinstance(item, str) for item in items):
        raise TypeError(f"{name}: expected a list of str")
    return items


def _string_map(data: dict[str, Any], name: str) -> dict[str, str]:
    items = _typed(data, name, dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in items.items()):
        raise TypeError(f"{name}: expected a map of str to str")
    return items


@dataclass(frozen=True, slots=True)
class Notice:
    """A message zoneq generates itself (a DSN): small, queued whole in one batch.

    The store assigns its id and fills in its size and chunk count.
    """

    meta: MessageMeta
    recipients: tuple[NewRecipient, ...]
    body: bytes


def encode_head(created_ms: int, remaining: int) -> bytes:
    """The ``#`` key: the message exists and is complete; recipients still queued."""
    return msgpack.packb([created_ms, remaining])


def decode_head(key: bytes, value: bytes) -> tuple[int, int]:
    """``(created_ms, recipients still queued)``; ``StorageCorruption`` unless the value is
    exactly two integers, the count above 0 (a message with none left has no head)."""
    try:
        items = msgpack.unpackb(value)
        if not isinstance(items, list) or len(items) != 2:
            raise ValueError(f"head is {items!r}, not [created, remaining]")
        created, remaining = items
        if not all(type(item) is int for item in items):
            raise TypeError(f"head is {items!r}, not two integers")
        if remaining < 1:
            raise ValueError(f"head counts {remaining} recipients")
        return created, remaining
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise StorageCorruption(key, str(exc)) from exc
