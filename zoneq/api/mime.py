"""A JSON submission made into an RFC 5322 message with the standard library's ``email``.

``EmailMessage`` with ``policy.SMTP`` folds and encodes every header (RFC 2047 for
non-ASCII), builds MIME (RFC 2045-2049) with the right boundaries and transfer encodings,
and refuses CR or LF in any header value: together with the checks here, which also refuse
NUL and other control characters, no field of the JSON can end a header and start another
(header injection), or end the header section and start the body.

Bcc addresses go into the envelope only (RFC 5322 section 3.6.3: showing them would
disclose them).  Date and Message-ID are added, as RFC 6409 section 8 lets a submission
server do and RFC 5322 section 3.6 expects.
"""

from __future__ import annotations

import base64
import binascii
import re
from datetime import UTC, datetime
from email import policy
from email.headerregistry import Address
from email.message import EmailMessage
from email.utils import format_datetime, getaddresses, make_msgid
from typing import Final

from zoneq.api.models import Submission
from zoneq.queue.intake import NUL_REFUSED, Envelope, Unacceptable, check_address

# RFC 5322 section 3.6.8: a field name is printable ASCII but the colon.
_FIELD_NAME: Final = re.compile(r"[!-9;-~]{1,76}")
_MIME_TYPE: Final = re.compile(r"[A-Za-z0-9!#$&^_.+-]{1,64}/[A-Za-z0-9!#$&^_.+-]{1,64}")
# Fields zoneq writes itself, from the JSON's own keys, or that a client must not forge.
RESERVED: Final = frozenset(
    {
        "from", "to", "cc", "bcc", "reply-to", "subject", "date", "message-id", "sender",
        "mime-version", "content-type", "content-transfer-encoding", "content-disposition",
        "received", "return-path",
    }
)  # fmt: skip


def _plain(value: str, what: str) -> str:
    """Refuse control characters (CR, LF, NUL...) in a value that goes into a header."""
    for char in value:
        if (ord(char) < 32 and char != "\t") or ord(char) == 127:
            raise Unacceptable(f"{what}: control character {char!r} not allowed")
    return value


def _mailbox(value: str, what: str) -> Address:
    """One ``Name <addr>`` or bare address, checked; an ``Address`` for the header."""
    _plain(value, what)
    found = getaddresses([value])
    if len(found) != 1 or not found[0][1]:
        raise Unacceptable(f"{what}: expected one address, got {value!r}")
    name, addr = found[0]
    check_address(addr, what=what)
    try:
        return Address(display_name=name, addr_spec=addr)
    except (ValueError, IndexError) as exc:
        raise Unacceptable(f"{what}: {value!r} is not an address: {exc}") from None


def _mailboxes(values: list[str], what: str) -> list[Address]:
    return [_mailbox(value, f"{what}[{i}]") for i, value in enumerate(values)]


def build(submission: Submission, *, hostname: str, now_ms: int) -> tuple[bytes, Envelope]:
    """The message's bytes (CRLF lines) and its envelope; ``Unacceptable`` for bad input."""
    sender = _mailbox(submission.from_, "from")
    to = _mailboxes(submission.to, "to")
    cc = _mailboxes(submission.cc, "cc")
    bcc = _mailboxes(submission.bcc, "bcc")
    reply_to = _mailboxes(submission.reply_to, "reply_to")
    if not (to or cc or bcc):
        raise Unacceptable("no recipients: give at least one of to, cc, bcc")
    msg = EmailMessage(policy=policy.SMTP)
    try:
        msg["From"] = sender
        if to:
            msg["To"] = to
        if cc:
            msg["Cc"] = cc
        if reply_to:
            msg["Reply-To"] = reply_to
        msg["Subject"] = _plain(submission.subject, "subject")
        msg["Date"] = format_datetime(datetime.fromtimestamp(now_ms / 1000, tz=UTC))
        msg["Message-ID"] = make_msgid(domain=hostname)
        for name, value in submission.headers.items():
            if not _FIELD_NAME.fullmatch(name):
                raise Unacceptable(f"headers: {name!r} is not a header field name")
            if name.lower() in RESERVED:
                raise Unacceptable(f"headers: {name!r} is set by zoneq or from its own key")
            msg[name] = _plain(value, f"headers.{name}")
        _body(msg, submission)
        data = msg.as_bytes()
    except ValueError as exc:  # the email package's own refusals (a second line of defence)
        raise Unacceptable(str(exc)) from None
    if submission.envelope_from is not None:
        mail_from = submission.envelope_from
    else:
        mail_from = sender.addr_spec
    recipients = tuple(dict.fromkeys(a.addr_spec for a in (*to, *cc, *bcc)))
    return data, Envelope(mail_from, recipients).checked()


def _text(value: str | None, what: str) -> str:
    """A body part's text; NUL refused (RFC 5321 4.5.2, RFC 2045 2.7-2.8: not in 7bit or
    8bit text, and a smuggling sequence's ingredient).  Attachments are base64: any octet."""
    if value is None:
        return ""
    if "\x00" in value:
        raise Unacceptable(f"{what}: {NUL_REFUSED}")
    return value


def _body(msg: EmailMessage, submission: Submission) -> None:
    text, html = _text(submission.text, "text"), submission.html
    if html is not None:
        msg.set_content(text)
        msg.add_alternative(_text(html, "html"), subtype="html")
    else:
        msg.set_content(text)
    for index, attachment in enumerate(submission.attachments):
        what = f"attachments[{index}]"
        filename = _plain(attachment.filename, f"{what}.filename")
        if not _MIME_TYPE.fullmatch(attachment.content_type):
            raise Unacceptable(
                f"{what}.content_type: {attachment.content_type!r} is not type/subtype"
            )
        try:
            content = base64.b64decode(attachment.content, validate=True)
        except (binascii.Error, ValueError):
            raise Unacceptable(f"{what}.content: not valid base64") from None
        maintype, _, subtype = attachment.content_type.partition("/")
        msg.add_attachment(content, maintype=maintype, subtype=subtype, filename=filename)
