"""Committing a message that arrives as a stream of bytes (the HTTP API's submissions).

The SMTP receiver has its own loop around the SMTP state machine; this is the same life for
a message that comes whole from a trusted client: ``store.begin``, the body re-cut into
``storage.chunk_size`` chunks and written as it arrives (never the whole message in memory),
then one ``store.commit`` with the last partial chunk as its tail.  Only when the commit has
returned (the batch is synced) is the message queued; anything else abandons it, removing
every chunk written, so a failed submission leaves nothing behind.

The envelope is given by the caller, or taken from the header section (the first chunk):
the first ``Sender``/``From`` address and every ``To``, ``Cc`` and ``Bcc`` address, like
``sendmail -t``.  A ``Bcc`` field is then removed from the stored text, since showing it to
the other recipients would disclose them (RFC 5322 section 3.6.3).

Routing is the receiver's (issue 5): the rules with the envelope sender and the client's
address, and the routing header (``routing.zone_header``) honoured, since an API client
holds the bearer token and so is trusted like an authenticated SMTP client.  The header is
left in the stored text: the delivery side removes it from the copy that goes out.  Then
the ``queue:route`` plugins, per recipient: a ``Drop`` is stored as a DROPPED event in the
commit's batch; a reply refuses that recipient alone (``Receipt.refused``: an HTTP client,
unlike SMTP after DATA, can be told per recipient), and when every recipient is refused
nothing is stored (``Refused``); a misbehaving plugin is ``PluginFailure``, a local and
temporary fault, and nothing is stored either.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email import policy
from email.message import Message
from email.parser import BytesHeaderParser
from email.utils import format_datetime, getaddresses, make_msgid
from typing import Final

from zoneq.config import Config
from zoneq.errors import ZoneqError
from zoneq.plugin import Drop, PluginHost
from zoneq.protocol.replies import Reply
from zoneq.queue.routing import Route, Router
from zoneq.storage.records import MessageMeta, NewRecipient
from zoneq.storage.store import DroppedRecipient, QueueStore

__all__ = [
    "NUL_REFUSED",
    "Envelope",
    "Intake",
    "Receipt",
    "Refusal",
    "Refused",
    "TooLarge",
    "Unacceptable",
    "check_address",
]

# RFC 5321 section 4.5.3.1: local part 64 octets, domain 255, a path 256 with its brackets.
_MAX_LOCAL: Final = 64
_MAX_DOMAIN: Final = 255
_MAX_ADDRESS: Final = 254
_BROWSED: Final = ("Message-ID", "Subject", "From")
_MAX_BROWSED_VALUE: Final = 998  # RFC 5322 section 2.1.1: what one line may hold
_BCC_FIELD: Final = re.compile(rb"^bcc[ \t]*:", re.IGNORECASE)
# RFC 5321 section 4.5.2 and RFC 2045 sections 2.7-2.8: NUL is not allowed in message text
# (only BINARYMIME, RFC 3030, would allow it, and a submission does not declare it), and a
# "\r\n\x00.\r\n" is one of the 2023 SMTP smuggling sequences: a relay that drops the NUL
# ends the message early and delivers the rest as a second, forged one.
NUL_REFUSED: Final = "NUL (0x00) is not allowed in message text (RFC 5321 4.5.2, RFC 2045 2.7)"


class Unacceptable(ZoneqError):
    """The submission itself is wrong (an address, an empty envelope): the client's fault."""


class TooLarge(ZoneqError):
    """The message is over ``receiver.max_message_size``."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """A recipient a ``queue:route`` plugin refused, with the plugin's reply."""

    recipient: str
    reply: Reply


class Refused(ZoneqError):
    """Every recipient was refused by a ``queue:route`` plugin: nothing was stored."""

    def __init__(self, refusals: Sequence[Refusal]) -> None:
        listed = "; ".join(f"{r.recipient}: {r.reply}" for r in refusals)
        super().__init__(f"every recipient was refused: {listed}")
        self.refusals = tuple(refusals)

    @property
    def transient(self) -> bool:
        """Whether trying again later may succeed: any refusal was 4yz (RFC 5321 4.2.1)."""
        return any(r.reply.is_transient for r in self.refusals)


def check_address(address: str, *, what: str = "address") -> str:
    """An envelope address as RFC 5321 allows it (``local@domain``), or ``Unacceptable``.

    Whitespace, control characters and angle brackets are refused outright: in an envelope
    they could only be an attempt to smuggle a second command or header."""
    if not address or len(address) > _MAX_ADDRESS:
        raise Unacceptable(f"{what} {address!r}: empty or longer than {_MAX_ADDRESS} octets")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 or c in "<>,;" for c in address):
        raise Unacceptable(f"{what} {address!r}: whitespace, control or <>,; characters")
    local, at, domain = address.rpartition("@")
    if not at or not local or not domain:
        raise Unacceptable(f"{what} {address!r}: expected local-part@domain")
    if len(local.encode()) > _MAX_LOCAL or len(domain.encode()) > _MAX_DOMAIN:
        raise Unacceptable(f"{what} {address!r}: local part or domain too long (RFC 5321)")
    return address


@dataclass(frozen=True, slots=True)
class Envelope:
    """MAIL FROM ("" for the null reverse-path) and RCPT TO addresses."""

    sender: str
    recipients: tuple[str, ...]

    def checked(self) -> Envelope:
        if self.sender:
            check_address(self.sender, what="sender")
        if not self.recipients:
            raise Unacceptable("no recipients")
        for rcpt in self.recipients:
            check_address(rcpt, what="recipient")
        return self


@dataclass(frozen=True, slots=True)
class Receipt:
    """What was queued."""

    msg_id: int
    size: int
    recipients: tuple[str, ...]
    """Those queued: not the refused, nor the dropped (a plugin's drop is not told)."""
    zones: tuple[str, ...]
    refused: tuple[Refusal, ...] = ()


@dataclass(slots=True)
class _Routed:
    """Each recipient's fate: queued, dropped (an event) or refused (told the client)."""

    queued: list[NewRecipient] = field(default_factory=list)
    dropped: list[DroppedRecipient] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)


@dataclass(slots=True)
class _Header:
    """The header section of the first chunk, as parsed and as it will be stored."""

    fields: Message
    text: bytes  # the first chunk, possibly without its Bcc field
    browse: dict[str, str] = field(default_factory=dict)


def _header_end(data: bytes) -> int:
    """Where the header section of ``data`` ends (after the empty line), or -1."""
    ends = [i + len(sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := data.find(sep)) >= 0]
    if data.startswith((b"\r\n", b"\n")):
        return 0
    return min(ends) if ends else -1


def _without_bcc(section: bytes) -> bytes:
    """The header section minus every Bcc field and its folded continuation lines."""
    kept: list[bytes] = []
    dropping = False
    for line in section.splitlines(keepends=True):
        if line[:1] in (b" ", b"\t") and dropping:
            continue
        dropping = bool(_BCC_FIELD.match(line))
        if not dropping:
            kept.append(line)
    return b"".join(kept)


def _read_header(first: bytes, *, strip_bcc: bool, now_ms: int, hostname: str) -> _Header:
    end = _header_end(first)
    section = first if end < 0 else first[:end]
    fields = BytesHeaderParser(policy=policy.default).parsebytes(section)
    text = first
    if strip_bcc and end >= 0:
        text = _without_bcc(first[:end]) + first[end:]
    # RFC 5322 section 3.6 requires a Date and asks for a Message-ID; RFC 6409 section 8.2
    # and 8.3 let a submission server add them (Postfix's cleanup does the same).  Added on
    # top of the header section, so they never land in a later chunk.
    missing = b""
    if fields.get("Date") is None:
        date = format_datetime(datetime.fromtimestamp(now_ms / 1000, tz=UTC))
        missing += f"Date: {date}\r\n".encode()
        fields["Date"] = date
    if fields.get("Message-ID") is None:
        message_id = make_msgid(domain=hostname)
        missing += f"Message-ID: {message_id}\r\n".encode()
        fields["Message-ID"] = message_id
    browse = {}
    for name in _BROWSED:
        value = fields.get(name)
        if value is not None:
            browse[name] = str(value)[:_MAX_BROWSED_VALUE]
    return _Header(fields, missing + text, browse)


def _addresses(fields: Message, names: Iterable[str]) -> list[str]:
    values = [str(v) for name in names for v in fields.get_all(name, [])]
    return [addr for _, addr in getaddresses(values) if addr]


def envelope_from_headers(fields: Message, sender: str | None = None) -> Envelope:
    """``sendmail -t``: recipients from To, Cc and Bcc; the sender from Sender or From,
    unless ``sender`` is given (``sendmail -t -f``; "" for the null reverse-path)."""
    if sender is not None:
        senders = [sender]
    else:
        senders = _addresses(fields, ["Sender"]) or _addresses(fields, ["From"])
    if not senders:
        raise Unacceptable("no envelope sender given and no From or Sender field to take it from")
    recipients = tuple(dict.fromkeys(_addresses(fields, ["To", "Cc", "Bcc"])))
    if not recipients:
        raise Unacceptable("no recipients given and no To, Cc or Bcc field to take them from")
    return Envelope(senders[0], recipients).checked()


class Intake:
    """Queues messages streamed in by a trusted client.  ``clock``: ms since the epoch."""

    def __init__(
        self,
        store: QueueStore,
        config: Config,
        *,
        clock: Callable[[], int],
        plugins: PluginHost | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.max_size = int(config.receiver.max_message_size)
        self.router = Router.from_config(config, plugins)  # the rules, compiled once
        self.zone_header = config.routing.zone_header

    async def receive(
        self,
        body: AsyncIterable[bytes],
        envelope: Envelope | None,
        *,
        source: dict[str, str],
        size_hint: int = 0,
        sender: str | None = None,
    ) -> Receipt:
        """Store ``body`` and queue it for ``envelope`` (None: from the headers, with
        ``sender`` as the envelope sender if given).

        Raises ``Unacceptable``, ``TooLarge`` or ``Refused`` (the client's, or a plugin's
        verdict on it) or a ``TemporaryFailure`` (ours, ``PluginFailure`` included: try
        again later); in every case nothing is stored.
        """
        if envelope is not None:
            envelope.checked()
        elif sender:
            check_address(sender, what="sender")
        if size_hint > self.max_size:
            raise TooLarge(f"message of {size_hint} octets is over {self.max_size}")
        now = self.clock()
        msg_id = self.store.begin(now, size_hint=size_hint)
        landing: asyncio.Future[None] | None = None
        try:
            meta, envelope, fields, tail = await self._stream(
                msg_id, now, body, envelope, source, sender=sender
            )
            routed = await self._route(envelope, fields, source)
            landing = self.store.commit(
                meta, routed.queued, self.clock(), tail=tail, dropped=routed.dropped
            )
            await asyncio.shield(landing)
        except BaseException:
            # Abandon unless the commit landed after all (cancelled while it synced: the
            # batch goes on by itself, and removing a queued message's chunks would lose it).
            if landing is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.shield(landing)
            if landing is None or not landing.done() or landing.exception() is not None:
                # A failed store cannot abandon either: its receiving marker stays, and the
                # sweep (or the next start's recovery) removes the chunks.
                with contextlib.suppress(ZoneqError):
                    await asyncio.shield(self.store.abandon(msg_id))
            raise
        queued = routed.queued
        zones = tuple(dict.fromkeys(r.zone for r in queued))
        addresses = tuple(r.address for r in queued)
        return Receipt(msg_id, meta.size, addresses, zones, tuple(routed.refused))

    async def _route(self, envelope: Envelope, fields: Message, source: dict[str, str]) -> _Routed:
        """Every recipient through the rules and the ``queue:route`` plugins (see the module
        docstring).  Raises ``Refused`` when all were refused, ``PluginFailure`` when a
        plugin misbehaves."""
        header = fields.get(self.zone_header)
        zone_header = None if header is None else str(header)
        client_ip = source.get("client")
        sender = envelope.sender
        routed = _Routed()
        for rcpt in envelope.recipients:
            rules = self.router.decide(
                rcpt, sender=sender, client_ip=client_ip, trusted=True, zone_header=zone_header
            )
            # No SMTP session: RouteArgs.session is None for mail from the API.
            verdict = await self.router.consult(rcpt, rules, sender=sender)
            if isinstance(verdict, Route):
                routed.queued.append(NewRecipient(rcpt, verdict.zone))
            elif isinstance(verdict, Drop):
                routed.dropped.append(DroppedRecipient(rcpt, rules.zone, verdict.reason))
            else:
                routed.refused.append(Refusal(rcpt, verdict))
        if not routed.queued and not routed.dropped:
            raise Refused(routed.refused)
        return routed

    def _read_header(self, first: bytes, envelope: Envelope | None, now: int) -> _Header:
        hostname = self.config.server.resolved_hostname()
        return _read_header(first, strip_bcc=envelope is None, now_ms=now, hostname=hostname)

    async def _stream(
        self,
        msg_id: int,
        now: int,
        body: AsyncIterable[bytes],
        envelope: Envelope | None,
        source: dict[str, str],
        *,
        sender: str | None,
    ) -> tuple[MessageMeta, Envelope, Message, bytes | None]:
        """Write the body's full chunks; the commit's metadata, the envelope, the header
        fields and the tail."""
        step = self.store.chunk_size
        buffer = bytearray()
        header: _Header | None = None
        index = received = stored = 0
        eight_bit = False
        async for data in body:
            received += len(data)
            if received > self.max_size:
                raise TooLarge(f"message is over {self.max_size} octets")
            if data.find(b"\x00") >= 0:  # one C-speed scan per chunk, as it arrives
                raise Unacceptable(NUL_REFUSED)
            buffer += data
            while len(buffer) >= step:
                piece = bytes(buffer[:step])
                del buffer[:step]
                if header is None:
                    header = self._read_header(piece, envelope, now)
                    piece = header.text
                eight_bit = eight_bit or not piece.isascii()
                await self.store.write_chunk(msg_id, index, piece)
                stored += len(piece)
                index += 1
        tail: bytes | None = bytes(buffer) if buffer else None
        if header is None:
            if tail is None:
                raise Unacceptable("empty message")
            header = self._read_header(tail, envelope, now)
            tail = header.text
        if tail is not None:
            eight_bit = eight_bit or not tail.isascii()
            stored += len(tail)
        if envelope is None:
            envelope = envelope_from_headers(header.fields, sender)
        meta = MessageMeta(
            msg_id=msg_id,
            sender=envelope.sender,
            size=stored,
            chunks=index + (1 if tail is not None else 0),
            received_ms=now,
            # RFC 6531: a non-ASCII address needs SMTPUTF8; RFC 6152: 8-bit text 8BITMIME.
            smtputf8=not all(a.isascii() for a in (envelope.sender, *envelope.recipients)),
            body_8bit=eight_bit,
            headers=header.browse,
            source=source,
        )
        return meta, envelope, header.fields, tail
