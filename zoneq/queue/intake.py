"""Committing a message that arrives as a stream of bytes (the HTTP API's submissions).

The SMTP receiver has its own loop around the SMTP state machine; this is the same life for
a message that comes whole from a trusted client: ``store.begin``, the body re-cut into
``storage.chunk_size`` chunks and written as it arrives (never the whole message in memory),
then one ``store.commit`` with the last partial chunk as its tail.  Only when the commit has
returned (the batch is synced) is the message queued; anything else abandons it, removing
every chunk written, so a failed submission leaves nothing behind.

Line ends are made CRLF as the text arrives (``zoneq.queue.rawtext``: bare CR and LF
included, and a last line end added), so the stored text is what goes on the wire and its
size is exact; NUL is refused, and so is a line over 998 octets (RFC 5322 section 2.1.1,
``zoneq.queue.line_limit``: the error names the line).  The header section is buffered
until it ends (up to 1 MiB, found by the ``email`` parser's own rule, so a message without
an empty line, or one whose section spans chunks, is read whole) and stored on top with
the Date and Message-ID it lacks.

The envelope is given by the caller, or what is missing of it taken from that section: the
first ``Sender``/``From`` address as the sender, and every ``To``, ``Cc`` and ``Bcc``
address as recipients, like ``sendmail -t``.  When the recipients come from there, the
``Bcc`` field is removed from the stored text, since showing it to the other recipients
would disclose them (RFC 5322 section 3.6.3).  Addresses are checked as RFC 5321 has them
(``check_address``), and a recipient with the percent hack is refused, as the SMTP
receiver refuses it at RCPT from every client.  An ASCII local part at a U-label domain is
queued with the domain's A-label, so the message needs no SMTPUTF8 for it (RFC 6531), and a
recipient given twice (in another case of the domain, or quoted) is queued once: local parts
are least quoted, ``"bob"`` is ``bob`` (``Envelope.checked``).
A header section stored in UTF-8 (RFC 6532) does need SMTPUTF8, whatever the envelope.

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
import ipaddress
import re
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email import policy
from email.errors import HeaderParseError
from email.message import Message
from email.parser import BytesHeaderParser
from email.utils import format_datetime, getaddresses, make_msgid
from typing import Final

from zoneq.config import Config
from zoneq.errors import ZoneqError
from zoneq.plugin import Drop, PluginHost
from zoneq.protocol.domains import EMPTY_LABEL, ascii_address, has_empty_label, normal_domain
from zoneq.protocol.local_parts import canonical_address, is_local_part
from zoneq.protocol.relay_addresses import is_percent_hack
from zoneq.protocol.replies import Reply
from zoneq.queue.consults import ROUTE_DEADLINE_S, consult_all
from zoneq.queue.line_limit import LineLimit, LineTooLong
from zoneq.queue.rawtext import CrlfLines, HeaderSection, SectionTooLong
from zoneq.queue.routing import HEADER, Route, Router
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
    "check_recipient",
    "envelope_address",
    "unique_recipients",
]

# RFC 5321 section 4.5.3.1: local part 64 octets, domain 255, a path 256 with its brackets.
_MAX_LOCAL: Final = 64
_MAX_DOMAIN: Final = 255
_MAX_ADDRESS: Final = 254
_MAX_LABEL: Final = 63  # RFC 1035 section 2.3.4
# A sub-domain's letters, digits and hyphens (RFC 5321 4.1.2), a U-label's non-ASCII
# (RFC 6531 3.3), and "_", which real names carry though the grammar has no room for it.
_DOMAIN_LABEL: Final = re.compile(r"[A-Za-z0-9_\-\u0080-\U0010ffff]+")
_LDH_LABEL: Final = re.compile(r"[A-Za-z0-9-]+")
_DCONTENT: Final = re.compile(r"[\x21-\x5a\x5e-\x7e]+")  # RFC 5321 4.1.3
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


def _literal_problem(literal: str) -> str | None:
    """What is wrong with an address literal, ``[`` included (RFC 5321 section 4.1.3:
    IPv4, ``IPv6:`` and an IPv6 address, or a tag, a colon and dcontent), or None."""
    inner = literal[1:-1] if literal.endswith("]") else ""
    if not inner:
        return "an address literal needs its closing ]"
    tag, colon, value = inner.partition(":")
    try:
        if not colon:
            ipaddress.IPv4Address(inner)
        elif tag.lower() == "ipv6":
            ipaddress.IPv6Address(value)
        elif not (_LDH_LABEL.fullmatch(tag) and _DCONTENT.fullmatch(value)):
            return "not an address literal"
    except ValueError:
        return "not an IP address literal"
    return None


def _domain_problem(domain: str) -> str | None:
    """What is wrong with ``domain`` as RFC 5321 section 4.1.2 has it, or None."""
    if domain.startswith("["):
        return _literal_problem(domain)
    if has_empty_label(domain):  # the SMTP receiver's test, IDNA's full stops included
        return EMPTY_LABEL
    for label in domain.split("."):
        if len(label.encode()) > _MAX_LABEL:
            return f"domain label longer than {_MAX_LABEL} octets (RFC 1035 2.3.4)"
        if not _DOMAIN_LABEL.fullmatch(label):
            return f"{label!r} is not a domain label"
    return None


def check_address(address: str, *, what: str = "address") -> str:
    """An envelope address as RFC 5321 section 4.1.2 allows it (``local@domain``, the
    domain a name or an address literal), within the octet limits of section 4.5.3.1, or
    ``Unacceptable``.

    Whitespace, control characters and angle brackets are refused outright: in an envelope
    they could only be an attempt to smuggle a second command or header.  A local part is
    a dot-string or a quoted string (so a second unquoted ``@`` is refused: ``a@b@c`` is
    no mailbox); finer rules (dots in a row) are left to the domain that owns it, as the
    SMTP receiver leaves them."""
    octets = len(address.encode())
    if not address or octets > _MAX_ADDRESS:
        raise Unacceptable(f"{what} {address!r}: empty or longer than {_MAX_ADDRESS} octets")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 or c in "<>,;" for c in address):
        raise Unacceptable(f"{what} {address!r}: whitespace, control or <>,; characters")
    local, at, domain = address.rpartition("@")
    if not at or not local or not domain:
        raise Unacceptable(f"{what} {address!r}: expected local-part@domain")
    if len(local.encode()) > _MAX_LOCAL or len(domain.encode()) > _MAX_DOMAIN:
        raise Unacceptable(f"{what} {address!r}: local part or domain too long (RFC 5321)")
    if not is_local_part(local):  # the SMTP receiver's check at MAIL and RCPT
        raise Unacceptable(
            f"{what} {address!r}: the local part is not a dot-string or quoted string (RFC 5321)"
        )
    problem = _domain_problem(domain)
    if problem is not None:
        raise Unacceptable(f"{what} {address!r}: {problem}")
    return address


def check_recipient(address: str) -> str:
    """``check_address``, and the relay rule the SMTP receiver applies at RCPT to every
    client, trusted or not: no percent hack (``zoneq.protocol.relay_addresses``)."""
    check_address(address, what="recipient")
    if is_percent_hack(address):
        raise Unacceptable(f"recipient {address!r}: percent-hack addresses are not accepted")
    return address


def envelope_address(address: str, *, what: str = "address") -> str:
    """A checked address as the envelope (and the SMTP receiver) stores it: the local part
    least quoted (``canonical_address``: ``"bob"@x`` is ``bob@x``, RFC 5322 3.4.1), and an
    ASCII local part at a U-label domain with the domain's A-label (RFC 5890 2.3.2.1).

    RFC 6531 needs SMTPUTF8 only for an address with no ASCII form, that is a non-ASCII
    local part; a domain has one.  Kept as a U-label, it would make the whole message need
    SMTPUTF8, and every recipient bounce at an MX without it (``smtputf8`` below).  A
    non-ASCII local part is kept as given: the message needs SMTPUTF8 anyway."""
    try:
        return ascii_address(canonical_address(address))
    except ValueError as exc:
        raise Unacceptable(f"{what} {address!r}: {exc}") from None


def unique_recipients(addresses: Iterable[str]) -> tuple[str, ...]:
    """``addresses`` without repeats, the first spelling kept: RFC 5321 section 2.4 makes
    domains case-insensitive (and a U-label is its A-label, ``normal_domain``) but leaves
    local parts to their domain, so ``Bob@x`` and ``bob@x`` are two mailboxes."""
    first: dict[tuple[str, str], str] = {}
    for address in addresses:
        local, _, domain = address.rpartition("@")
        first.setdefault((local, normal_domain(domain)), address)
    return tuple(first.values())


@dataclass(frozen=True, slots=True)
class Envelope:
    """MAIL FROM ("" for the null reverse-path) and RCPT TO addresses."""

    sender: str
    recipients: tuple[str, ...]

    def checked(self) -> Envelope:
        """This envelope checked (``Unacceptable``), as it is queued (``envelope_address``:
        local parts least quoted, U-labels A-labelled), recipients without repeats."""
        sender = self.sender
        if sender:
            sender = envelope_address(check_address(sender, what="sender"), what="sender")
        if not self.recipients:
            raise Unacceptable("no recipients")
        recipients = unique_recipients(
            envelope_address(check_recipient(rcpt), what="recipient") for rcpt in self.recipients
        )
        return Envelope(sender, recipients)


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
    """The header section, as parsed and as it will be stored."""

    fields: Message
    text: bytes  # fields added + the section (without Bcc, if asked) + what followed it
    browse: dict[str, str] = field(default_factory=dict)
    utf8: bool = False  # the section as stored holds UTF-8 (RFC 6532): it needs SMTPUTF8


@dataclass(frozen=True, slots=True)
class _Stored:
    """A body streamed into the store: all but its ``tail`` (the commit writes that)."""

    header: _Header
    size: int
    chunks: int
    eight_bit: bool
    tail: bytes | None


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


def _read_header(found: HeaderSection, *, strip_bcc: bool, now_ms: int, hostname: str) -> _Header:
    section = found.section
    fields = BytesHeaderParser(policy=policy.default).parsebytes(section)
    if strip_bcc:
        section = _without_bcc(section)
    # RFC 5322 section 3.6 requires a Date and asks for a Message-ID; RFC 6409 section 8.2
    # and 8.3 let a submission server add them (Postfix's cleanup does the same).  Added on
    # top of the header section, so they never land in the body.
    missing = b""
    if "Date" not in fields:
        date = format_datetime(datetime.fromtimestamp(now_ms / 1000, tz=UTC))
        missing += f"Date: {date}\r\n".encode()
        fields["Date"] = date
    if "Message-ID" not in fields:
        message_id = make_msgid(domain=hostname)
        missing += f"Message-ID: {message_id}\r\n".encode()
        fields["Message-ID"] = message_id
    browse = {}
    for name in _BROWSED:
        if (value := _browse_value(fields, name)) is not None:
            browse[name] = value[:_MAX_BROWSED_VALUE]
    return _Header(fields, missing + section + found.rest, browse, utf8=_utf8(section))


def _utf8(section: bytes) -> bool:
    """Whether a header section is UTF-8 beyond ASCII (RFC 6532), which needs SMTPUTF8.
    Other 8-bit bytes (a legacy Latin-1 Subject) are not RFC 6532 text: SMTPUTF8 would not
    make them right, and asking for it would only bounce them at servers without it, so
    they go as they came, as before and as Postfix sends them."""
    if section.isascii():
        return False
    try:
        section.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _raw_values(fields: Message, name: str) -> list[str]:
    """Every ``name`` field's value as it was sent (folds kept, encoded-words not decoded)."""
    wanted = name.lower()
    values = [str(value) for key, value in fields.raw_items() if key.lower() == wanted]
    try:
        # The parser kept non-ASCII octets as surrogates; RFC 6532 says they are UTF-8.
        return [v.encode("utf-8", "surrogateescape").decode("utf-8") for v in values]
    except UnicodeDecodeError:
        raise Unacceptable(f"the {name} field is not UTF-8 (RFC 6532 section 3.2)") from None


def _browse_value(fields: Message, name: str) -> str | None:
    """The first ``name`` field, decoded; as sent when the stdlib's structured parser
    cannot read it (an unclosed ``[`` in an address field fails in it with
    ``HeaderParseError`` or, inside its own error handling, ``AttributeError``)."""
    try:
        value = fields.get(name)
    except (HeaderParseError, ValueError, IndexError, AttributeError):
        value = next(iter(_raw_values(fields, name)), None)
    return None if value is None else str(value)


def _addresses(fields: Message, names: Iterable[str]) -> list[str]:
    """The addresses in the fields ``names``, read from the text as sent by the lenient
    RFC 5322 parser ``getaddresses`` (the one the JSON path uses), not from the values the
    structured parser decoded: an encoded-word cannot turn into an address here."""
    values = [value for name in names for value in _raw_values(fields, name)]
    return [addr for _, addr in getaddresses(values) if addr]


def envelope_from_headers(
    fields: Message, sender: str | None = None, recipients: Sequence[str] = ()
) -> Envelope:
    """``sendmail -t``: recipients from To, Cc and Bcc; the sender from Sender or From.
    ``sender`` given is the envelope sender instead (``sendmail -t -f``; "" for the null
    reverse-path), and so are ``recipients`` given (``sendmail -f``-less with addresses)."""
    if sender is not None:
        senders = [sender]
    else:
        senders = _addresses(fields, ["Sender"]) or _addresses(fields, ["From"])
    if not senders:
        raise Unacceptable("no envelope sender given and no From or Sender field to take it from")
    wanted = recipients or _addresses(fields, ["To", "Cc", "Bcc"])
    if not wanted:
        raise Unacceptable("no recipients given and no To, Cc or Bcc field to take them from")
    return Envelope(senders[0], tuple(wanted)).checked()


class Intake:
    """Queues messages streamed in by a trusted client.  ``clock``: ms since the epoch."""

    def __init__(
        self,
        store: QueueStore,
        config: Config,
        *,
        clock: Callable[[], int],
        plugins: PluginHost | None = None,
        route_deadline_s: float = ROUTE_DEADLINE_S,
    ) -> None:
        self.store = store
        self.route_deadline_s = route_deadline_s
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
        recipients: Sequence[str] = (),
    ) -> Receipt:
        """Store ``body`` and queue it for ``envelope``; when that is None, for
        ``recipients`` (none: To, Cc and Bcc, the Bcc field then removed) from ``sender``
        (None: Sender or From; "" the null reverse-path).

        Raises ``Unacceptable``, ``TooLarge`` or ``Refused`` (the client's, or a plugin's
        verdict on it) or a ``TemporaryFailure`` (ours, ``PluginFailure`` included: try
        again later); in every case nothing is stored.
        """
        if envelope is not None:
            envelope = envelope.checked()
        else:  # refused before any of the text is read
            if sender:
                envelope_address(check_address(sender, what="sender"), what="sender")
            for rcpt in recipients:
                envelope_address(check_recipient(rcpt), what="recipient")
        if size_hint > self.max_size:
            raise TooLarge(f"message of {size_hint} octets is over {self.max_size}")
        now = self.clock()
        msg_id = self.store.begin(now, size_hint=size_hint)
        landing: asyncio.Future[None] | None = None
        try:
            text = await self._stream(
                msg_id, now, body, strip_bcc=envelope is None and not recipients
            )
            fields = text.header.fields
            if envelope is None:
                envelope = envelope_from_headers(fields, sender, recipients)
            meta = MessageMeta(
                msg_id=msg_id,
                sender=envelope.sender,
                size=text.size,
                chunks=text.chunks,
                received_ms=now,
                # RFC 6531: a non-ASCII address needs SMTPUTF8 (a U-label domain with an
                # ASCII local part has its A-label by now), and so does a header section
                # in UTF-8 (RFC 6532 section 3: ``To: bob@bücher.example`` sent as is,
                # though the envelope has the A-label); RFC 6152: 8-bit, 8BITMIME.  The
                # JSON path writes encoded-words, ASCII, unless the envelope needs it.
                smtputf8=text.header.utf8
                or not all(a.isascii() for a in (envelope.sender, *envelope.recipients)),
                body_8bit=text.eight_bit,
                headers=text.header.browse,
                source=source,
                zone_header=self._routing_field(fields),
            )
            routed = await self._route(envelope, fields, source)
            landing = self.store.commit(
                meta, routed.queued, self.clock(), tail=text.tail, dropped=routed.dropped
            )
            await asyncio.shield(landing)
        except BaseException:
            # Abandon unless the commit landed after all (cancelled while it synced: the
            # batch goes on by itself, and removing a queued message's chunks would lose it).
            if landing is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.shield(landing)
            if landing is None or not landing.done() or landing.exception() is not None:
                # A failed store cannot abandon either, but stops counting the message as
                # streaming in: its receiving marker stays, and the next sweep after the
                # DATA timeout (or the reopen's recovery) removes the chunks.
                with contextlib.suppress(ZoneqError):
                    await asyncio.shield(self.store.abandon(msg_id))
            raise
        queued = routed.queued
        zones = tuple(dict.fromkeys(r.zone for r in queued))
        addresses = tuple(r.address for r in queued)
        return Receipt(msg_id, meta.size, addresses, zones, tuple(routed.refused))

    def _routing_field(self, fields: Message) -> str | None:
        """The routing header's field name when that header chose the zone (it names a
        defined one: an API client is trusted), for the metadata: delivery removes that
        field, even once the config names another (``MessageMeta.zone_header``)."""
        header = fields.get(self.zone_header)
        if header is None:
            return None
        decided = self.router.decide("", trusted=True, zone_header=str(header))
        return self.zone_header if decided.rule == HEADER else None

    async def _route(self, envelope: Envelope, fields: Message, source: dict[str, str]) -> _Routed:
        """Every recipient through the rules and the ``queue:route`` plugins (see the module
        docstring).  Raises ``Refused`` when all were refused, ``PluginFailure`` when a
        plugin misbehaves, ``RoutingTooSlow`` when the plugins took too long for them all."""
        header = fields.get(self.zone_header)
        zone_header = None if header is None else str(header)
        client_ip = source.get("client")
        sender = envelope.sender
        routed = _Routed()
        asks = [
            (
                rcpt,
                self.router.decide(
                    rcpt, sender=sender, client_ip=client_ip, trusted=True, zone_header=zone_header
                ),
            )
            for rcpt in envelope.recipients
        ]
        # Side by side under one deadline (zoneq.queue.consults); no SMTP session: the
        # plugins see RouteArgs.session None for mail from the API.
        verdicts = await consult_all(
            self.router, asks, sender=sender, deadline_s=self.route_deadline_s
        )
        for (rcpt, rules), verdict in zip(asks, verdicts, strict=True):
            if isinstance(verdict, Route):
                routed.queued.append(NewRecipient(rcpt, verdict.zone))
            elif isinstance(verdict, Drop):
                routed.dropped.append(
                    DroppedRecipient(rcpt, verdict.zone or rules.zone, verdict.reason)
                )
            else:
                routed.refused.append(Refusal(rcpt, verdict))
        if not routed.queued and not routed.dropped:
            raise Refused(routed.refused)
        return routed

    async def _stream(
        self, msg_id: int, now: int, body: AsyncIterable[bytes], *, strip_bcc: bool
    ) -> _Stored:
        """Write the body's full chunks, its line ends made CRLF (``zoneq.queue.rawtext``):
        the header section buffered until it ends, then each ``chunk_size`` of text as it
        fills.  What was stored, but the last partial chunk: that is the commit's tail."""
        step = self.store.chunk_size
        lines = CrlfLines()
        limit = LineLimit()  # the client's lines, numbered as it sent them
        found: HeaderSection | None = HeaderSection()
        header: _Header | None = None
        buffer = bytearray()
        taken = 0  # the client's text after CRLF, held against the size limit
        stored = index = 0  # octets stored (the fields we add included), chunks written
        eight_bit = False
        pieces = aiter(body)
        ended = False
        while not ended:
            data = await anext(pieces, None)
            ended = data is None
            if data is None:
                text = lines.end()
            elif data.find(b"\x00") >= 0:  # one C-speed scan per piece, as it arrives
                raise Unacceptable(NUL_REFUSED)
            else:
                text = lines.feed(data)
            taken += len(text)
            if taken > self.max_size:
                raise TooLarge(f"message is over {self.max_size} octets")
            try:
                limit.feed(text)
            except LineTooLong as exc:
                raise Unacceptable(str(exc)) from None
            if found is not None:
                if not self._section_ended(found, text, ended=ended):
                    continue
                header = self._read_header(found, now, strip_bcc=strip_bcc)
                text, found = header.text, None
            buffer += text
            while len(buffer) >= step:
                piece = bytes(buffer[:step])
                del buffer[:step]
                eight_bit = eight_bit or not piece.isascii()
                await self.store.write_chunk(msg_id, index, piece)
                stored += len(piece)
                index += 1
        assert header is not None  # the loop ends only after the section has
        tail = bytes(buffer) if buffer else None
        if tail is not None:
            eight_bit = eight_bit or not tail.isascii()
            stored += len(tail)
        return _Stored(header, stored, index + (tail is not None), eight_bit, tail)

    @staticmethod
    def _section_ended(found: HeaderSection, text: bytes, *, ended: bool) -> bool:
        """Whether the header section has ended with ``text`` (or the message did)."""
        try:
            done = found.feed(text)
        except SectionTooLong as exc:
            raise Unacceptable(str(exc)) from None
        if not (done or ended):
            return False
        found.finish()
        if not found.text:
            raise Unacceptable("empty message")
        return True

    def _read_header(self, found: HeaderSection, now: int, *, strip_bcc: bool) -> _Header:
        hostname = self.config.server.resolved_hostname()
        return _read_header(found, strip_bcc=strip_bcc, now_ms=now, hostname=hostname)
