"""Delivery status notifications: bounces and delay notices (RFC 3464, RFC 6522, RFC 3461).

``build_dsn`` turns a ``DsnRequest`` into a complete RFC 5322 message, CRLF line endings
throughout, shaped as RFC 6522 requires::

    multipart/report; report-type=delivery-status
      1. text/plain                    what happened, for people
      2. message/delivery-status       the same, for programs (RFC 3464 section 2)
      3. message/rfc822                the original (RET=FULL and the body is given), or
         text/rfc822-headers           only its header section (RET=HDRS, body not given,
                                       or a body that MIME cannot carry: NUL, long lines,
                                       or 8-bit octets in a 7-bit notice, see below);
         (message/global and message/global-headers instead when the original's headers
         are UTF-8, RFC 6532 / RFC 6533; no third part at all if there is nothing to return)

``should_send_dsn`` decides whether a notice is wanted at all (RFC 3461 section 4.1 NOTIFY,
and never to the null reverse-path).

Sending the result is the caller's job, and two rules apply to it:

* The notice goes out with the null reverse-path, ``MAIL FROM:<>`` (RFC 5321 section 4.5.5,
  RFC 3461 section 6.1), so a notice that fails in turn is dropped instead of bouncing back and
  forth.  The ``From:`` header names the postmaster address; the envelope sender stays empty.
* A notice to an ASCII envelope sender is 7-bit throughout, so it reaches any server,
  with or without 8BITMIME or SMTPUTF8: the notice is built once, when it is queued, long
  before anyone knows what the sender's MX offers, and a notice that a server refuses for
  its encoding is lost (it is never bounced in turn).  So message/global and
  message/global-headers are quoted-printable there (RFC 6532 sections 3.5 and 3.7 and
  RFC 6533 section 6 allow any content-transfer-encoding for them), and an 8-bit body in
  message/rfc822, which may not be encoded at all (RFC 2046 section 5.2.1), is not
  returned: the header section goes back alone (RFC 3461 section 4.3 lets the MTA do so)
  and the human-readable part says why.
* A notice to a UTF-8 envelope sender needs ``SMTPUTF8`` anyway (its RCPT TO, RFC 6531),
  and a server that offers SMTPUTF8 offers 8BITMIME too (RFC 6531 section 3.1), so there
  the original goes back as it is, 8-bit included, and the top level is labelled
  ``Content-Transfer-Encoding: 8bit`` (RFC 2045 sections 6.2 and 6.4: 8-bit data must be
  labelled so, and a multipart can only be 7bit, 8bit or binary).  ``transport_needs``
  gives the flags.  The machine-readable part itself is always 7-bit.

Pure: no I/O, no clock, no randomness.  The date, the Message-ID and every other value come
in the request, and the MIME boundary is derived from the content, so the same request always
gives the same bytes.

Hostile input: the remote server's reply, the envelope addresses, ENVID and ORCPT come from
outside.  Nothing taken from them can start a line of its own: CR, LF and the other control
and line-separator characters are replaced before anything is formatted, and the
machine-readable fields are folded only at existing whitespace so they stay within the
RFC 5322 section 2.1.1 line limits.  Values that are ours (host name, postmaster address,
Message-ID, dates) are checked when the request is built and refused with ``ValueError``.
"""

from __future__ import annotations

import binascii
import enum
import hashlib
import io
import re
import textwrap
import unicodedata
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from email.generator import BytesGenerator
from email.headerregistry import Address
from email.message import EmailMessage, Message, MIMEPart
from email.parser import BytesParser
from email.policy import EmailPolicy
from email.policy import default as _default_policy
from email.utils import format_datetime
from typing import Final

from zoneq.errors import ProtocolError
from zoneq.protocol.replies import EnhancedStatus
from zoneq.protocol.xtext import (
    utf8_xtext_decode,
    utf8_xtext_encode,
    xtext_decode,
    xtext_encode,
)

__all__ = [
    "AUTO_SUBMITTED",
    "FROM_DISPLAY_NAME",
    "LOCAL_DIAGNOSTIC_TYPE",
    "MAX_FIELD_CHARS",
    "SMTP_DIAGNOSTIC_TYPE",
    "SUBJECT_DELAYED",
    "SUBJECT_DELIVERED",
    "SUBJECT_FAILED",
    "Action",
    "DsnRequest",
    "DsnTransport",
    "Notify",
    "ReportedRecipient",
    "Ret",
    "build_dsn",
    "check_from_address",
    "diagnostic_type_of",
    "should_send_dsn",
    "transport_needs",
    "utf8_xtext_decode",
    "utf8_xtext_encode",
    "xtext_decode",
    "xtext_encode",
]


class Action(enum.StrEnum):
    """RFC 3464 section 2.3.3: what the reporting MTA did with one recipient."""

    FAILED = "failed"
    DELAYED = "delayed"
    DELIVERED = "delivered"
    RELAYED = "relayed"  # passed on to a system that will not send DSNs itself
    EXPANDED = "expanded"  # delivered to an alias or list that forwarded it further


class Ret(enum.StrEnum):
    """RFC 3461 section 4.3: how much of the original to return."""

    FULL = "FULL"
    HDRS = "HDRS"


class Notify(enum.StrEnum):
    """RFC 3461 section 4.1 NOTIFY keywords.

    A ``StrEnum``, so the keyword strings the queue stores compare equal to the members.
    """

    NEVER = "NEVER"
    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"
    DELAY = "DELAY"


SUBJECT_FAILED: Final = "Undelivered Mail Returned to Sender"
SUBJECT_DELAYED: Final = "Delayed Mail (still being retried)"
SUBJECT_DELIVERED: Final = "Successful Mail Delivery Report"
# RFC 3834 section 5: marks the notice as machine-generated, so vacation responders and
# other auto-responders stay quiet about it.
AUTO_SUBMITTED: Final = "auto-replied"
FROM_DISPLAY_NAME: Final = "Mail Delivery System"

# RFC 3464 section 2.3.6: the diagnostic-type names where the Diagnostic-Code text came
# from.  "smtp" is for a reply a remote SMTP server sent; text this MTA wrote itself (an
# NXDOMAIN, an expired message, a connection that failed) takes a type of our own, as
# Postfix writes "X-Postfix".
SMTP_DIAGNOSTIC_TYPE: Final = "smtp"
LOCAL_DIAGNOSTIC_TYPE: Final = "X-zoneq"
# The start of an SMTP reply as ``Reply.__str__`` writes it: a 2xx to 5xx code (RFC 5321
# section 4.2), then a space or the end.
_SMTP_REPLY: Final = re.compile(r"[2-5][0-9][0-9](?: |$)")

MAX_FIELD_CHARS: Final = 900
"""Longest value of one machine-readable field; longer values are cut and end in ``...``.

With the longest field name in front, one unfolded line stays below the 998-octet limit of
RFC 5322 section 2.1.1, so a value never has to be broken where it has no whitespace (which
would add a space that was not in it).  900 characters is well above a real SMTP reply:
RFC 5321 section 4.5.3.1.5 limits a reply line to 512 octets.
"""

_SOFT_LINE: Final = 78  # RFC 5322 section 2.1.1: lines SHOULD be no longer than 78
_TEXT_WIDTH: Final = 76  # the human-readable part, wrapped a little narrower
_TRUNCATED: Final = "..."

# One policy for the whole notice: CRLF everywhere (RFC 5322 section 2.1); 8-bit content
# passed through as it is instead of being re-encoded; and header fields that came from
# parsed text (the RFC 3464 fields, formatted and folded here) or were set raw (To) written
# back exactly as they were, instead of being refolded by the email package.
_POLICY: Final = _default_policy.clone(linesep="\r\n", refold_source="none", cte_type="8bit")
# The same, writing non-ASCII addresses in headers as raw UTF-8 (RFC 6532), for notices to
# an internationalized envelope sender.  Only used then: otherwise the email package would
# emit UTF-8 where RFC 2047 encoded-words belong.
_POLICY_UTF8: Final = _POLICY.clone(utf8=True)

# RFC 3464 section 2.1.2 (address-type, diagnostic-type) and 2.2.2 (mta-name-type) are
# atoms.
_ATOM: Final = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]{1,64}")
# Our own host name: printable ASCII without spaces or ";" (it follows "dns;").
_HOST: Final = re.compile(r"[\x21-\x3a\x3c-\x7e]{1,255}")
# RFC 5322 section 3.6.4 msg-id with dot-atom-text on both sides (atext and ".").
_ID_TEXT: Final = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]+"
_MESSAGE_ID: Final = re.compile(rf"<?{_ID_TEXT}@{_ID_TEXT}>?")


# ---------------------------------------------------------------------------------------------
# Decision


def _is_null_sender(envelope_sender: str) -> bool:
    return envelope_sender.strip() in ("", "<>")


def should_send_dsn(envelope_sender: str, notify: Collection[str] | None, action: Action) -> bool:
    """Whether a DSN with ``action`` should go to ``envelope_sender``.

    ``notify`` is the recipient's RFC 3461 NOTIFY keywords (``Notify`` members or the
    keyword strings, any case); ``None`` or empty means NOTIFY was not given (an empty
    NOTIFY= is a syntax error, so an empty collection can only mean "absent").

    * Never to the null reverse-path ``<>`` (RFC 5321 section 4.5.5, RFC 3461 section 6.1):
      a notice about a notice would loop.
    * NOTIFY=NEVER: nothing at all (section 4.1; NEVER may not be combined with other
      keywords, so if it is, NEVER wins).
    * failed: yes when NOTIFY is absent (section 4.1: the default is FAILURE) or includes
      FAILURE.
    * delayed: only when NOTIFY includes DELAY.  Without NOTIFY, section 4.1 leaves delay
      notices to the MTA; zoneq sends none, because senders who did not ask for them mostly
      read them as bounces and resend.
    * delivered, relayed, expanded: only when NOTIFY includes SUCCESS (sections 5.2.2 and
      5.2.7: relayed and expanded are the success reports of a relay to a server without DSN
      support and of a mailing list or alias).
    """
    if _is_null_sender(envelope_sender):
        return False
    keywords = {keyword.upper() for keyword in notify or ()}
    if not keywords:
        return action is Action.FAILED
    if Notify.NEVER in keywords:
        return False
    match action:
        case Action.FAILED:
            return Notify.FAILURE in keywords
        case Action.DELAYED:
            return Notify.DELAY in keywords
        case Action.DELIVERED | Action.RELAYED | Action.EXPANDED:
            return Notify.SUCCESS in keywords


# ---------------------------------------------------------------------------------------------
# Inputs


def _require_aware(label: str, when: datetime | None) -> None:
    # A naive datetime would be written as "-0000" (zone unknown, RFC 5322 section 3.3),
    # which is almost always a caller's bug rather than a real lack of knowledge.
    if when is not None and when.utcoffset() is None:
        raise ValueError(f"{label} must be timezone-aware, not {when!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportedRecipient:
    """One recipient's per-recipient block (RFC 3464 section 2.3).

    ``final_recipient`` is the envelope address (RCPT TO) as delivery used it.
    ``original_recipient`` is the RFC 3461 ORCPT value exactly as received, ``type;xtext``
    (``rfc822;bob+2Bx@example.com``, ``utf-8;us\\x{E9}r@example.com``); it is decoded here.
    ``diagnostic`` is the remote reply (or a local explanation) on one line, written after
    ``diagnostic_type`` (RFC 3464 section 2.3.6).  Left as None, the type is "smtp" when
    the text is an SMTP reply and a ``remote_mta`` sent it, else ``LOCAL_DIAGNOSTIC_TYPE``
    (``diagnostic_type_of``).
    ``will_retry_until`` is only for ``Action.DELAYED`` (RFC 3464 section 2.3.9).

    Raises ``ValueError`` for an invalid status code, an empty final recipient, a naive
    datetime, a bad diagnostic type, or ``will_retry_until`` with another action.
    """

    final_recipient: str
    action: Action
    status: str
    original_recipient: str | None = None
    diagnostic: str | None = None
    diagnostic_type: str | None = None
    remote_mta: str | None = None
    last_attempt: datetime | None = None
    will_retry_until: datetime | None = None

    def __post_init__(self) -> None:
        # RFC 3464 section 2.3.4: Status is an RFC 3463 code.  Its class is not checked
        # against the action: an expired message is "failed" with a 4.x.x status (4.4.7).
        if EnhancedStatus.parse(self.status) is None:
            raise ValueError(f"status must be an RFC 3463 code such as 5.1.1, not {self.status!r}")
        if not _strip_angles(_clean(self.final_recipient)):
            raise ValueError("final_recipient is empty")
        if self.diagnostic_type is not None and not _ATOM.fullmatch(self.diagnostic_type):
            raise ValueError(f"diagnostic_type must be an atom, not {self.diagnostic_type!r}")
        _require_aware("last_attempt", self.last_attempt)
        _require_aware("will_retry_until", self.will_retry_until)
        if self.will_retry_until is not None and self.action is not Action.DELAYED:
            raise ValueError("will_retry_until is only meaningful for Action.DELAYED")


def diagnostic_type_of(rcpt: ReportedRecipient) -> str:
    """The diagnostic-type ``rcpt``'s Diagnostic-Code is written with.

    An explicit ``diagnostic_type`` wins.  Otherwise "smtp" only for an SMTP reply from a
    remote MTA: a failure with no remote MTA (an NXDOMAIN or null MX found before any
    connection) or text that is no reply ("delivery time expired", a refused connection)
    was written here, even when it borrows a reply code's shape.
    """
    if rcpt.diagnostic_type is not None:
        return rcpt.diagnostic_type
    remote = _clean(rcpt.remote_mta or "").strip()
    text = _clean(rcpt.diagnostic or "").strip()
    if remote and _SMTP_REPLY.match(text):
        return SMTP_DIAGNOSTIC_TYPE
    return LOCAL_DIAGNOSTIC_TYPE


@dataclass(frozen=True, slots=True, kw_only=True)
class DsnRequest:
    """Everything one notice is built from.

    ``envelope_sender`` is the original MAIL FROM, which the notice is addressed to.
    ``envelope_id`` is the RFC 3461 ENVID as received (xtext).  ``original_headers`` is the
    original message's header block; ``original_body`` its body, returned only with
    ``Ret.FULL`` (a caller that caps the returned size passes ``None`` and the headers are
    returned alone).  ``message_id`` is the notice's own Message-ID, with or without angle
    brackets; ``date`` is its Date.

    Raises ``ValueError`` for a null ``envelope_sender`` (never bounce a bounce) or one
    too long for a header line, no recipients, a naive datetime, or a host name,
    postmaster address or Message-ID that could not be written safely.
    """

    reporting_mta: str
    envelope_sender: str
    ret: Ret
    arrival_date: datetime
    recipients: tuple[ReportedRecipient, ...]
    original_headers: bytes
    postmaster_from: str
    message_id: str
    date: datetime
    envelope_id: str | None = None
    original_body: bytes | None = None

    def __post_init__(self) -> None:
        sender = _strip_angles(_clean(self.envelope_sender))
        if _is_null_sender(self.envelope_sender) or not sender:
            raise ValueError("no DSN to the null reverse-path (RFC 5321 section 4.5.5)")
        if len(sender) > MAX_FIELD_CHARS:
            # RFC 5321 section 4.5.3.1.3 allows 256 octets; this only keeps To: in one line.
            raise ValueError(f"envelope_sender is longer than {MAX_FIELD_CHARS} characters")
        if not self.recipients:
            raise ValueError("a DSN reports at least one recipient (RFC 3464 section 2.1)")
        if not _HOST.fullmatch(self.reporting_mta):
            raise ValueError(f"reporting_mta is not a host name: {self.reporting_mta!r}")
        if not _MESSAGE_ID.fullmatch(self.message_id):
            raise ValueError(f"message_id is not id-left@id-right: {self.message_id!r}")
        check_from_address(self.postmaster_from)
        _require_aware("arrival_date", self.arrival_date)
        _require_aware("date", self.date)


def check_from_address(address: str) -> None:
    """Raise ``ValueError`` unless ``address`` can be the notice's From (``postmaster_from``):
    an ASCII addr-spec with a domain, so every notice's header section stays 7-bit.

    Our own configuration (``[server] bounce_from`` checks it with this at load), so refused
    rather than repaired.  The email package's parser raises a variety of exceptions on
    malformed input (even IndexError), hence the broad catch, turned into the one
    ValueError callers expect.
    """
    if not address.isascii() or any(char.isspace() for char in address):
        raise ValueError(f"postmaster_from must be an ASCII address: {address!r}")
    try:
        parsed = Address(addr_spec=address)
    except Exception as exc:
        raise ValueError(f"postmaster_from is not an address: {address!r}") from exc
    if not parsed.domain:
        raise ValueError(f"postmaster_from has no domain: {address!r}")
    if not parsed.username:
        raise ValueError(f"postmaster_from has no local part: {address!r}")


# ---------------------------------------------------------------------------------------------
# Making outside text safe


def _clean(text: str) -> str:
    """``text`` with nothing left that could break a line or hide in it.

    Control characters (CR and LF among them) and the Unicode line and paragraph separators
    become spaces, so a value can never start a header of its own; format characters
    (zero-width and bidirectional controls, which can disguise text) are dropped; lone
    surrogates (undecodable bytes) become U+FFFD so the text can always be encoded.
    """
    out: list[str] = []
    for char in text:
        category = unicodedata.category(char)
        if category in ("Cc", "Zl", "Zp"):
            out.append(" ")
        elif category == "Cs":
            out.append("\ufffd")
        elif category != "Cf":
            out.append(char)
    return "".join(out)


def _strip_angles(address: str) -> str:
    address = address.strip()
    if address.startswith("<") and address.endswith(">"):
        address = address[1:-1].strip()
    return address


def _capped(pieces: Iterable[str], limit: int = MAX_FIELD_CHARS) -> str:
    """Join ``pieces`` up to ``limit`` characters, never cutting a piece (an escape) in two.

    A value that is too long ends in ``...`` (counted in ``limit``).
    """
    kept: list[str] = []
    length = 0
    for piece in pieces:
        if length + len(piece) > limit:
            while kept and length + len(_TRUNCATED) > limit:
                length -= len(kept.pop())
            return "".join(kept).rstrip() + _TRUNCATED
        kept.append(piece)
        length += len(piece)
    return "".join(kept)


def _escape_non_ascii(char: str) -> str:
    # message/delivery-status is 7-bit (RFC 3464 section 2.1.1).  Non-ASCII text is written
    # with the same \x{HEX} notation RFC 6533 uses for addresses, so nothing is lost.
    return char if char.isascii() else f"\\x{{{ord(char):02X}}}"


def _field_text(text: str) -> str:
    """Outside text as a 7-bit, single-line field value of at most ``MAX_FIELD_CHARS``."""
    return _capped(_escape_non_ascii(char) for char in _clean(text).strip())


def _typed_address(address: str) -> str:
    """An address with its RFC 3464 address-type: rfc822 if ASCII, else RFC 6533 utf-8."""
    address = _strip_angles(_clean(address))
    if address.isascii():
        return "rfc822; " + _capped(address)
    return "utf-8; " + _capped(utf8_xtext_encode(char) for char in address)


def _decode_orcpt(orcpt: str) -> tuple[str, str]:
    """ORCPT ``type;xtext`` (RFC 3461 section 4.2) as (address-type, decoded address)."""
    addr_type, semicolon, encoded = _clean(orcpt).strip().partition(";")
    addr_type = addr_type.strip()
    encoded = encoded.strip()
    if not semicolon:
        # No type given: RFC 3464 section 2.3.1 says "unknown" when it cannot be told.
        addr_type, encoded = "unknown", addr_type
    if not _ATOM.fullmatch(addr_type):
        addr_type = "unknown"
    # RFC 6533 section 3: the utf-8 type carries utf-8-addr-xtext / -unitext; every other
    # type carries RFC 3461 xtext.  A value that does not decode is reported as received
    # (the notice must still go out; it is only the label that is imperfect).
    decode = utf8_xtext_decode if addr_type.lower() == "utf-8" else xtext_decode
    try:
        address = decode(encoded)
    except ProtocolError:
        address = encoded
    return addr_type, _clean(address).strip()


def _original_recipient_field(orcpt: str) -> str:
    """The Original-Recipient value, or "" if the ORCPT holds no address."""
    addr_type, address = _decode_orcpt(orcpt)
    if not address:
        return ""
    # RFC 3461 section 6.3 / RFC 3464 section 2.3.1: the ORCPT value, decoded from xtext.
    # Non-ASCII can only be carried by the utf-8 type, re-encoded to its 7-bit form.
    if addr_type.lower() == "utf-8" or not address.isascii():
        return "utf-8; " + _capped(utf8_xtext_encode(char) for char in address)
    return f"{addr_type}; {_capped(address)}"


def _envelope_id(envid: str) -> str:
    # RFC 3464 section 2.2.1: Original-Envelope-Id holds the ENVID decoded from xtext.
    try:
        decoded = xtext_decode(envid.strip())
    except ProtocolError:
        decoded = envid
    return _field_text(decoded)


def _host(host: str) -> str:
    return _field_text("".join(_clean(host).split()))


# ---------------------------------------------------------------------------------------------
# The machine-readable part (RFC 3464 section 2)


def _fold(name: str, value: str) -> list[str]:
    """One field as folded lines (RFC 5322 section 2.2.3), folding only at whitespace.

    Each continuation line starts with the whitespace that was already in the value, so
    unfolding (removing the CRLFs) gives back exactly ``value``.  ``value`` is at most
    ``MAX_FIELD_CHARS`` long, so even unfolded the line fits in 998 octets.
    """
    lines: list[str] = []
    current = f"{name}:"
    # Each chunk is a word with the whitespace before it; the first gets the space that
    # follows the colon.
    for chunk in re.findall(r"[ \t]*[^ \t]+|[ \t]+$", " " + value):
        fits = len(current) + len(chunk) <= _SOFT_LINE
        if fits or current == f"{name}:" or chunk.isspace():
            current += chunk
        else:
            lines.append(current)
            current = chunk
    lines.append(current)
    return lines


def _block(fields: Iterable[tuple[str, str]]) -> bytes:
    lines: list[str] = []
    for name, value in fields:
        lines.extend(_fold(name, value))
    return ("\r\n".join(lines) + "\r\n").encode("ascii")


def _per_message_fields(req: DsnRequest) -> Iterator[tuple[str, str]]:
    # Order as in the RFC 3464 section 2.2 grammar.
    if req.envelope_id is not None:
        envid = _envelope_id(req.envelope_id)
        if envid:
            yield "Original-Envelope-Id", envid
    yield "Reporting-MTA", f"dns; {req.reporting_mta}"
    yield "Arrival-Date", format_datetime(req.arrival_date)


def _per_recipient_fields(rcpt: ReportedRecipient) -> Iterator[tuple[str, str]]:
    # Order as in the RFC 3464 section 2.3 grammar.
    if rcpt.original_recipient is not None:
        original = _original_recipient_field(rcpt.original_recipient)
        if original:
            yield "Original-Recipient", original
    yield "Final-Recipient", _typed_address(rcpt.final_recipient)
    yield "Action", rcpt.action.value
    yield "Status", rcpt.status
    if rcpt.remote_mta is not None:
        remote = _host(rcpt.remote_mta)
        if remote:
            yield "Remote-MTA", f"dns; {remote}"
    if rcpt.diagnostic is not None:
        diagnostic = _field_text(rcpt.diagnostic)
        if diagnostic:
            yield "Diagnostic-Code", f"{diagnostic_type_of(rcpt)}; {diagnostic}"
    if rcpt.last_attempt is not None:
        yield "Last-Attempt-Date", format_datetime(rcpt.last_attempt)
    if rcpt.will_retry_until is not None:
        yield "Will-Retry-Until", format_datetime(rcpt.will_retry_until)


def _status_part(req: DsnRequest, policy: EmailPolicy[EmailMessage]) -> MIMEPart:
    # The email package models message/delivery-status as a list of header blocks.  The
    # blocks are formatted here (RFC 3464 grammar, folded above) and parsed into that model,
    # so the package writes the fields back verbatim instead of applying its own header
    # rules (RFC 2047 encoded-words, refolding) to them.
    parser = BytesParser(policy=policy)
    blocks: list[Message | str] = [parser.parsebytes(_block(_per_message_fields(req)), True)]
    blocks.extend(
        parser.parsebytes(_block(_per_recipient_fields(rcpt)), True) for rcpt in req.recipients
    )
    part = MIMEPart(policy=policy)
    part["Content-Type"] = "message/delivery-status"
    part["Content-Description"] = "Delivery report"
    part.set_payload(blocks)
    return part


# ---------------------------------------------------------------------------------------------
# The human-readable part


def _wrap(text: str, first: str = "", rest: str = "") -> str:
    return textwrap.fill(
        text,
        width=_TEXT_WIDTH,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=True,
        break_on_hyphens=False,
    )


def _readable(text: str) -> str:
    # Unicode kept (this part may be UTF-8), line breaks and controls neutralised.
    return " ".join(_clean(text).split())


def _outcome(rcpt: ReportedRecipient) -> str:
    match rcpt.action:
        case Action.FAILED:
            return "Delivery failed. It will not be retried."
        case Action.DELAYED:
            if rcpt.will_retry_until is None:
                return "Delivery is delayed. It will be retried."
            until = format_datetime(rcpt.will_retry_until)
            return f"Delivery is delayed. It will be retried until {until}."
        case Action.DELIVERED:
            return "Delivered. Nothing more will be done."
        case Action.RELAYED:
            return (
                "Passed on to a mail system that does not send delivery reports;"
                " no further report will follow."
            )
        case Action.EXPANDED:
            return "Delivered to a list or alias, which passed it on to its members."


def _recipient_text(rcpt: ReportedRecipient) -> list[str]:
    lines = [_wrap(f"<{_strip_angles(_readable(rcpt.final_recipient))}>: {rcpt.action.value}")]
    indent = "    "
    if rcpt.original_recipient is not None:
        _, original = _decode_orcpt(rcpt.original_recipient)
        if original:
            text = f"Originally addressed to: {_readable(original)}"
            lines.append(_wrap(text, indent, indent * 2))
    lines.append(_wrap(_outcome(rcpt), indent, indent))
    lines.append(f"{indent}Status: {rcpt.status}")
    if rcpt.remote_mta is not None and _readable(rcpt.remote_mta):
        lines.append(_wrap(f"Remote server: {_readable(rcpt.remote_mta)}", indent, indent * 2))
    if rcpt.diagnostic is not None and _readable(rcpt.diagnostic):
        diagnostic = _capped(_readable(rcpt.diagnostic))
        lines.append(_wrap(f"Reply: {diagnostic}", indent, indent * 2))
    if rcpt.last_attempt is not None:
        lines.append(f"{indent}Last attempt: {format_datetime(rcpt.last_attempt)}")
    return lines


def _human_text(req: DsnRequest, returned: _Returned | None) -> str:
    actions = {rcpt.action for rcpt in req.recipients}
    paragraphs = [f"This is the mail delivery system at {req.reporting_mta}."]
    if Action.FAILED in actions:
        paragraphs.append(
            "Your message could not be delivered to one or more of its recipients, listed"
            " below. The mail system has given up on them and will not try again."
        )
    if Action.DELAYED in actions:
        paragraphs.append(
            "Delivery of your message to one or more of its recipients, listed below, has"
            " been delayed. The mail system is still trying and will keep trying for the"
            " time shown; you do not need to send the message again."
        )
    if actions & {Action.DELIVERED, Action.RELAYED, Action.EXPANDED}:
        paragraphs.append(
            "You asked to be told about successful delivery. The outcome for the recipients"
            " listed below is shown."
        )
    body = [_wrap(paragraph) for paragraph in paragraphs]
    body.extend("\n".join(_recipient_text(rcpt)) for rcpt in req.recipients)
    if returned is not None:
        attached = f"The {returned.what} of your message is attached below."
        if returned.withheld is not None:
            attached += f" Its body is not returned: {returned.withheld}."
        body.append(_wrap(attached))
    body.append(_wrap("The machine-readable details are in the delivery report (RFC 3464)."))
    return "\n\n".join(body) + "\n"


def _text_part(text: str, policy: EmailPolicy[EmailMessage]) -> MIMEPart:
    part = MIMEPart(policy=policy)
    if text.isascii():
        part.set_content(text, subtype="plain", charset="us-ascii", cte="7bit")
    else:
        # Quoted-printable keeps this part 7-bit even when addresses are not ASCII.
        part.set_content(text, subtype="plain", charset="utf-8", cte="quoted-printable")
    part["Content-Description"] = "Notification"
    return part


# ---------------------------------------------------------------------------------------------
# The returned original (RFC 6522 section 3, RFC 6533)


_LINE_END: Final = re.compile(rb"\r\n|\r|\n")
_MAX_LINE_OCTETS: Final = 998


def _header_block(headers: bytes) -> bytes:
    """The header section alone: up to the first empty line, CRLF after every line."""
    kept: list[bytes] = []
    for line in _LINE_END.split(headers):
        if not line.strip(b" \t"):
            break
        kept.append(line + b"\r\n")
    return b"".join(kept)


def _fits_8bit(data: bytes) -> bool:
    # RFC 2045 section 2.8 (8bit data; 7bit in 2.7 is stricter still): lines of at most 998
    # octets and no NUL.  message/rfc822 may not be base64 or quoted-printable encoded
    # (RFC 2046 section 5.2.1), so content that breaks these rules cannot be returned in
    # it.  (message/global could be encoded, RFC 6532 section 3.5; one rule for both keeps
    # this simple, and such content is rare: our SMTP server enforces the line limit.)
    return b"\x00" not in data and all(
        len(line) <= _MAX_LINE_OCTETS for line in data.split(b"\r\n")
    )


# Why a RET=FULL body stays home, as the human-readable part says it.
_WITHHELD_UNCARRIABLE: Final = (
    "it holds data no mail message can carry (a NUL octet or a line over 998 octets)"
)
_WITHHELD_8BIT: Final = (
    "it holds 8-bit characters, and this notice is kept to 7-bit text so that every mail"
    " server on the way can pass it on"
)


@dataclass(frozen=True, slots=True)
class _Returned:
    """The third part, what it holds ("full text" or "header section"), and why the body
    was left out when RET=FULL asked for it (None: it was not asked for or not given)."""

    part: MIMEPart
    what: str
    withheld: str | None = None


def _quoted_printable(data: bytes) -> str:
    # binascii's encoder in text mode keeps each CRLF as a line break (the original is
    # line-oriented: the CRLFs are its own), encodes "=", 8-bit octets and whitespace at a
    # line's end, breaks lines at 76 with soft breaks (RFC 2045 section 6.7), and a line
    # of a lone "." becomes "=2E".  ``data`` has CRLF line ends only (``_LINE_END``), which
    # is what the text mode expects; "=_" (our boundaries) can never appear in its output.
    return binascii.b2a_qp(data, quotetabs=False, istext=True, header=False).decode("ascii")


def _opaque_part(
    content_type: str,
    data: bytes,
    description: str,
    policy: EmailPolicy[EmailMessage],
    *,
    seven_bit: bool,
) -> MIMEPart:
    part = MIMEPart(policy=policy)
    part["Content-Type"] = content_type
    # Only message/global and message/global-headers are encoded (``_original_part`` never
    # puts 8-bit data in message/rfc822 or text/rfc822-headers of a 7-bit notice), and
    # they may be: RFC 6532 sections 3.5 and 3.7, RFC 6533 section 6.  Quoted-printable
    # rather than base64, so the original stays readable.
    encode = seven_bit and not data.isascii()
    plain = "7bit" if data.isascii() else "8bit"
    part["Content-Transfer-Encoding"] = "quoted-printable" if encode else plain
    part["Content-Description"] = description
    # The original goes back as it was received (line ends aside), handed to the email
    # package as an opaque payload rather than parsed and regenerated: regenerating could
    # alter it (refolding, repaired MIME structure) and the package's generator fails on
    # some malformed messages, and a bounce must be built whatever the original was.
    # surrogateescape carries 8-bit octets through unchanged.
    part.set_payload(_quoted_printable(data) if encode else data.decode("ascii", "surrogateescape"))
    return part


def _returned_headers(req: DsnRequest) -> bytes | None:
    """The original's header section as the third part returns it, or None if it has none
    that can be carried (then there is no third part)."""
    headers = _header_block(req.original_headers)
    if not headers or not _fits_8bit(headers):
        return None
    return headers


def _original_part(
    req: DsnRequest, policy: EmailPolicy[EmailMessage], *, seven_bit: bool
) -> _Returned | None:
    """The third part, or None if nothing can be returned.

    RET=FULL with a body gives the whole message; otherwise (RET=HDRS, the body withheld
    by the caller, or a body that cannot be carried, see ``_fits_8bit``) the header section
    alone.  No header section, or one that cannot be carried, means no third part
    (RFC 6522 section 3 makes it optional).

    ``seven_bit``: the notice must be 7-bit (its recipient is ASCII, see the module
    docstring).  message/global and message/global-headers are then quoted-printable;
    message/rfc822 may not be encoded (RFC 2046 section 5.2.1), so an 8-bit body under
    ASCII headers is not returned (RFC 3461 section 4.3 allows headers only).
    """
    headers = _returned_headers(req)
    if headers is None:
        return None
    # Internationalized headers (RFC 6532) may not appear in message/rfc822 or
    # text/rfc822-headers; message/global (RFC 6532 section 3.7) and message/global-headers
    # (RFC 6533) are the types for them.
    international = not headers.isascii()
    withheld: str | None = None
    if req.ret is Ret.FULL and req.original_body is not None:
        whole = headers + b"\r\n" + _LINE_END.sub(b"\r\n", req.original_body)
        if not _fits_8bit(whole):
            withheld = _WITHHELD_UNCARRIABLE
        elif seven_bit and not international and not whole.isascii():
            withheld = _WITHHELD_8BIT
        else:
            content_type = "message/global" if international else "message/rfc822"
            part = _opaque_part(
                content_type, whole, "Original message", policy, seven_bit=seven_bit
            )
            return _Returned(part, "full text")
    # RFC 6522 section 4 (was RFC 3462): text/rfc822-headers.
    content_type = "message/global-headers" if international else "text/rfc822-headers"
    part = _opaque_part(
        content_type, headers, "Original message headers", policy, seven_bit=seven_bit
    )
    return _Returned(part, "header section", withheld)


# ---------------------------------------------------------------------------------------------
# The notice


def _subject(actions: Collection[Action]) -> str:
    if Action.FAILED in actions:
        return SUBJECT_FAILED
    if Action.DELAYED in actions:
        return SUBJECT_DELAYED
    return SUBJECT_DELIVERED


class _Generator(BytesGenerator):
    """``BytesGenerator`` that also passes 8-bit octets through in opaque message/* parts.

    The stdlib writes a message/* part whose payload is a string (not a parsed message) as
    it is, a documented case (CPython issue 7970), but ``BytesGenerator`` encodes that
    string as strict ASCII, while it writes every other payload with ``surrogateescape``.
    Doing the same here is what lets a returned 8-bit original (``_opaque_part``) through.
    """

    def _encode(self, s: str) -> bytes:
        return s.encode("ascii", "surrogateescape")


def _flatten(message: EmailMessage, policy: EmailPolicy[EmailMessage]) -> bytes:
    buffer = io.BytesIO()
    _Generator(buffer, policy=policy).flatten(message)
    return buffer.getvalue()


def _boundaries(req: DsnRequest) -> Iterator[str]:
    # Derived from the content instead of drawn at random (this module is pure).  "=_" cannot
    # occur in base64 or quoted-printable text, and build_dsn checks each candidate against
    # the finished message anyway, so even content crafted to contain it only moves us on to
    # the next candidate.
    seed = hashlib.sha256()
    for item in (req.message_id.encode("utf-8", "replace"), req.original_headers):
        seed.update(len(item).to_bytes(8, "big") + item)
    seed.update(req.original_body or b"")
    counter = 0
    while True:
        digest = seed.copy()
        digest.update(counter.to_bytes(8, "big"))
        yield f"=_zoneq_{digest.hexdigest()[:40]}"
        counter += 1


@dataclass(frozen=True, slots=True)
class DsnTransport:
    """What the SMTP transaction that carries a built notice must announce."""

    body_8bit: bool  # BODY=8BITMIME (RFC 6152)
    smtputf8: bool  # SMTPUTF8 (RFC 6531)


def transport_needs(req: DsnRequest, notice: bytes) -> DsnTransport:
    """The flags ``notice`` (``build_dsn(req)``) must be sent with.

    * ``smtputf8`` when the envelope sender, who receives the notice, is not ASCII: its
      RCPT TO needs SMTPUTF8 (RFC 6531), and the delivery session refuses (5.6.7) a server
      that does not offer it.  Only then is the notice allowed any octet above 0x7F (a
      UTF-8 To:, a raw message/global, an 8-bit body returned in message/rfc822).
    * ``body_8bit`` when any octet is above 0x7F: RFC 6152 section 3 forbids sending it
      without ``BODY=8BITMIME`` (which an SMTPUTF8 server offers, RFC 6531 section 3.1).

    For an ASCII sender both are False: the notice is 7-bit (``build_dsn``), a returned
    UTF-8 original included, so no server is refused for lacking either.  The
    delivery-status part itself is always 7-bit (non-ASCII is written as \\x{HEX}), so
    message/global-delivery-status is never produced.
    """
    sender = _strip_angles(_clean(req.envelope_sender))
    return DsnTransport(body_8bit=not notice.isascii(), smtputf8=not sender.isascii())


def build_dsn(req: DsnRequest) -> bytes:
    """The complete notice as RFC 5322 bytes with CRLF line endings.

    Send it with ``MAIL FROM:<>`` to ``req.envelope_sender`` (see the module docstring for
    8BITMIME and SMTPUTF8).
    """
    sender = _strip_angles(_clean(req.envelope_sender))
    # An ASCII sender's notice is 7-bit throughout; see the module docstring.
    seven_bit = sender.isascii()
    policy = _POLICY if seven_bit else _POLICY_UTF8

    message = EmailMessage(policy=policy)
    message["From"] = Address(FROM_DISPLAY_NAME, addr_spec=req.postmaster_from)
    # The envelope sender is already a valid RFC 5321 mailbox, which is an RFC 5322 (or,
    # with SMTPUTF8, RFC 6532) addr-spec; it is set as it is because the email package's
    # address parser refuses internationalized local parts.  _clean() has removed CR and
    # LF, the only way to escape a header.
    message.set_raw("To", sender)
    message["Subject"] = _subject({rcpt.action for rcpt in req.recipients})
    message["Date"] = req.date
    message["Message-ID"] = "<" + req.message_id.strip("<>") + ">"
    message["MIME-Version"] = "1.0"
    message["Auto-Submitted"] = AUTO_SUBMITTED
    message["Content-Type"] = "multipart/report"
    message.set_param("report-type", "delivery-status")  # RFC 3464 section 2, RFC 6522

    original = _original_part(req, policy, seven_bit=seven_bit)
    parts: list[Message | str] = [
        _text_part(_human_text(req, original), policy),
        _status_part(req, policy),
    ]
    if original is not None:
        parts.append(original.part)
    if not seven_bit:
        # RFC 2045 sections 6.2 and 6.4: 8-bit data inside must be labelled 8bit, and a
        # multipart can only be 7bit, 8bit or binary.  A UTF-8 sender's notice always
        # holds some (its To: at least); an ASCII sender's never does.
        message["Content-Transfer-Encoding"] = "8bit"
    message.set_payload(parts)

    for boundary in _boundaries(req):
        message.set_boundary(boundary)
        data = _flatten(message, policy)
        # One delimiter before each part and the close delimiter: any other occurrence
        # means the content contains the boundary, which would cut the message apart.
        if data.count(b"--" + boundary.encode("ascii")) == len(parts) + 1:
            return data
    raise AssertionError("unreachable: _boundaries() never ends")
