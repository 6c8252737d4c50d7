"""A JSON submission made into an RFC 5322 message with the standard library's ``email``.

``EmailMessage`` folds and encodes every header (RFC 2047 for non-ASCII) and builds MIME
(RFC 2045-2049) with the right boundaries and transfer encodings.  It does not stop header
injection on its own: it refuses CR or LF in a value as given, but it *decodes* RFC 2047
encoded-words before writing a header, and before CPython 3.11.10 (CVE-2024-6923,
``verify_generated_headers``) an encoded CR or LF (``=?utf-8?q?a=0D=0ABcc:...?=``) comes out
as a real line break: a second field, or the end of the header section.  So, two checks:

- every value that goes into a header is refused when it holds a control character, as sent
  or once its encoded-words are decoded (``_plain``), and an address may hold no
  encoded-word at all (its display name is sent as Unicode text; the API encodes it);
- every header field of every part is checked as written (``_Checked``, CPython's rule):
  a line break not followed by a space or a tab is refused, whatever let it through.

Folding (``_Checked``): fields are folded within 78 octets where they can be (RFC 5322
section 2.1.1's SHOULD), and non-ASCII text goes as RFC 2047 encoded-words of at most 75
characters (its section 2).  But the email package also turns an ASCII word too long for
78 octets into encoded-words, only to wrap it, and RFC 2047 section 5 allows them only in
*text, phrases and comments: a List-Unsubscribe URL (RFC 2369, RFC 8058 one-click), an
In-Reply-To or References msg-id would be broken.  A field that needs no encoded-word when written
unfolded is written without any, folded at its spaces (a longer word on a line of its own);
a line still over 998 octets (the MUST) is refused, naming the JSON field.  Folded at its
spaces too: an address field the package folds into other mailboxes (it drops a display
name's quotes, CPython gh-80222: ``"Doe, John" <j@x>`` read as ``Doe`` and ``John <j@x>``;
RFC 5322 3.2.4, 3.4), found by parsing it back, and a field with a line of only white space
(obs-FWS, RFC 5322 4.2; with encoded-words, that white space joins the line before).  An
address field whose encoded-word the package split over a fold (its ``?=`` encoded into the
next word: no encoded-word to a reader) is written with ``email.header.Header`` instead.

Domains are written as A-labels (IDNA, UTS 46): RFC 2047 section 5 forbids an encoded-word
in an addr-spec, which is how the email package writes a non-ASCII domain.  A non-ASCII
local part has no ASCII form: it is written as UTF-8 (RFC 6532), in a message that needs
SMTPUTF8 (RFC 6531), which the intake flags when an envelope address is non-ASCII; a
non-ASCII local part only in a header (Reply-To, or From with an ASCII ``envelope_from``)
would go out as UTF-8 to servers without SMTPUTF8, and is refused.

Attachments are sent base64; a ``multipart/*`` or ``message/*`` type is refused, as those
parts may only be 7bit, 8bit or binary (RFC 2045 section 6.4, RFC 2046 section 5.2.1).  A
whole message to forward goes as ``application/octet-stream``, or through the raw upload.

Bounds, checked before anything is built (``check_bounds``): to, cc and bcc together hold
at most ``receiver.max_recipients`` addresses, the limit SMTP answers 452 past; and each
value zoneq writes into a header field (Subject, ``headers.*``, an address with its display
name) at most ``HEADER_FIELD_MAX`` octets, Postfix's ``header_size_limit``.  The email
package folds a field in time that grows with the square of its length (a 900 KB Subject:
half a minute), so a cap is what keeps a build short.

Bcc addresses go into the envelope only (RFC 5322 section 3.6.3: showing them would
disclose them).  Date and Message-ID are added, as RFC 6409 section 8 lets a submission
server do and RFC 5322 section 3.6 expects.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from email.errors import HeaderParseError, MessageError
from email.header import Header, decode_header
from email.headerregistry import Address, AddressHeader, Group
from email.message import EmailMessage
from email.policy import EmailPolicy
from email.utils import format_datetime, getaddresses, make_msgid
from typing import Final

import idna

from zoneq.api.models import Submission
from zoneq.queue.intake import NUL_REFUSED, Envelope, Unacceptable, check_address
from zoneq.queue.line_limit import MAX_LINE, LineTooLong, check_lines

# RFC 5322 section 3.6.8: a field name is printable ASCII but the colon.
_FIELD_NAME: Final = re.compile(r"[!-9;-~]{1,76}")
_MIME_TYPE: Final = re.compile(r"[A-Za-z0-9!#$&^_.+-]{1,64}/[A-Za-z0-9!#$&^_.+-]{1,64}")
# Not in a header value: C0 but TAB, DEL, C1 (NEL among them), and the line and paragraph
# separators, where ``str.splitlines`` (and so the email package) breaks a line.
_CONTROL: Final = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
# What ``email.header.decode_header`` takes for an encoded-word (RFC 2047 section 2, and
# looser: the email package's own parser also decodes words with spaces inside).
_ENCODED_WORD: Final = re.compile(r"=\?[^?]*\?[qQbB]\?.*?\?=", re.DOTALL)
# CPython's NEWLINE_WITHOUT_FWSP (Lib/email/policy.py, 3.11.10 and later) lets a CR or an
# LF followed by a space through; here any bare CR or LF is refused too (RFC 5322 2.2: CR
# and LF only together), and a CRLF must be followed by a space or a tab (folding, 2.2.3).
_UNFOLDED_BREAK: Final = re.compile(rb"\r(?!\n)|(?<!\r)\n|\r\n(?![ \t])")
# RFC 5322 3.2.2 and 4.2: a folded line of only white space is obsolete syntax (obs-FWS),
# which "MUST NOT" be generated; the email package writes one where a run of spaces meets
# the fold (matched in a field with its CRLF, so its last line too).
_WHITE_LINE: Final = re.compile(rb"\r\n([ \t]+)(?=\r\n)")
# The email package fills a folded line with its encoded-words: at 78 they are 77 long.  RFC
# 2047 section 2 allows 75, so headers are folded at 76 (the fold's space and 75).
_ENCODED_WORD_FOLD: Final = 76
# An RFC 2047 encoded-word's start, as the email package writes one.
_WRITTEN_WORD: Final = re.compile(rb"=\?[^?\s]+\?[qQbB]\?")
# Where a field may fold (RFC 5322 2.2.3): before a run of spaces or tabs that a word
# follows, so that no line is only white space.
_FOLD_POINT: Final = re.compile(rb"(?<=[^ \t])(?=[ \t]+[^ \t])")
_UNFOLD: Final = re.compile(rb"\r\n(?=[ \t])")
# The JSON key each field zoneq writes comes from, to name it in an error.
_JSON_KEY: Final = {
    "from": "from", "to": "to", "cc": "cc", "reply-to": "reply_to", "subject": "subject",
    "content-disposition": "attachments (a filename)",
}  # fmt: skip
# Postfix's header_size_limit (102400): the most a header field's value may hold, in octets.
HEADER_FIELD_MAX: Final = 100 * 1024
# Maintypes whose parts may not be base64-encoded (RFC 2045 6.4, RFC 2046 5.2.1).
_UNENCODABLE: Final = frozenset({"multipart", "message"})
# Fields zoneq writes itself, from the JSON's own keys, or that a client must not forge.
RESERVED: Final = frozenset(
    {
        "from", "to", "cc", "bcc", "reply-to", "subject", "date", "message-id", "sender",
        "mime-version", "content-type", "content-transfer-encoding", "content-disposition",
        "received", "return-path",
    }
)  # fmt: skip


class _Checked(EmailPolicy):
    """``policy.SMTP`` with a check of every generated header field, as CPython 3.11.10
    does (its fix for CVE-2024-6923, which this Python may lack), and stricter: a line
    break must be a CRLF followed by a space or a tab, or it starts another field.  No
    encoded-word only to wrap ASCII, and no line over 998 octets (the module docstring)."""

    def fold_binary(self, name: str, value: str) -> bytes:
        # EmailPolicy's own folding (not this method again) on a clone.
        narrow = self.clone(max_line_length=_ENCODED_WORD_FOLD)
        folded = EmailPolicy.fold_binary(narrow, name, value)
        # The package can also leave an empty line where a word fills a line exactly (a
        # display name's word of 76 octets at 76), or a line of only white space, and on
        # this Python it drops the quotes of a display name it folds (CPython gh-80222):
        # folded at the spaces instead, too.
        width = self.max_line_length or MAX_LINE
        # The read-back (a parse) last: the cheap tests decide most fields.
        if _WRITTEN_WORD.search(folded) or _broken(folded) or self._misread(name, value, folded):
            # Written on one line (no limit: None), the field holds an encoded-word only
            # where its text needs one.
            wide = EmailPolicy.fold_binary(self.clone(max_line_length=None), name, value)
            if not _WRITTEN_WORD.search(wide):
                folded = _fold_at_spaces(wide, width)
            # (Misread with white space aside is misread exactly too.)
            elif isinstance(value, AddressHeader) and self._misread(
                name, value, folded, loose=True
            ):
                # The package can also split an encoded-word over a fold, its closing
                # ``?=`` encoded into the next word (``=?utf-8?b?Ojo6Og==`` CRLF
                # `` =?utf-8?q?=3F=3D?=``): no encoded-word to a reader, which shows it.
                folded = _fold_at_spaces(_address_field(name, value), width)
                if self._misread(name, value, folded, loose=True):
                    key = _JSON_KEY.get(name.lower(), f"headers.{name}")
                    raise Unacceptable(
                        f"{key}: the {name} field cannot be written so that "
                        "it reads back as given; simplify its display name"
                    )
        # Where encoded-words keep the package's fold, a line of only white space goes onto
        # the end of the line before: unfolding (2.2.3) gives the same value.
        folded = _WHITE_LINE.sub(rb"\1", folded)
        if _broken(folded):
            raise Unacceptable(f"header field {name!r}: would hold a line break (injection)")
        try:
            check_lines(folded.removesuffix(b"\r\n"))
        except LineTooLong:
            key = _JSON_KEY.get(name.lower(), f"headers.{name}")
            raise Unacceptable(
                f"{key}: the {name} field would have a line longer than {MAX_LINE} octets "
                "(RFC 5322 section 2.1.1): shorten its longest word"
            ) from None
        return folded

    def _misread(self, name: str, value: str, folded: bytes, *, loose: bool = False) -> bool:
        """Whether the address field ``folded`` reads back as other mailboxes than
        ``value`` holds.  A display name with specials (``,`` ``;`` ``(`` ``"`` ``.``...)
        must stay a quoted-string (RFC 5322 3.2.4, 3.4): folded without its quotes, a
        ``"Doe, John" <j@x>`` is read as the two mailboxes ``Doe`` and ``John <j@x>``.
        ``loose``: display names compared without their white space, as this Python's
        parser puts a space between adjacent encoded-words, which RFC 2047 6.2 says to
        drop (a long word is split into several).

        Read back one address (or group) at a time: the package's parser copies the rest
        of the value at every token, so a whole list of thousands takes seconds."""
        if not isinstance(value, AddressHeader) or b"\r\n" not in folded[:-2]:
            return False
        text = _UNFOLD.sub(b"", folded.removesuffix(b"\r\n")).partition(b":")[2]
        # UTF-8 only with UTF8_POLICY (RFC 6532); kept as surrogates where it is not.
        entries = _entries(text.decode("utf-8", "surrogateescape"))
        if len(entries) != len(value.groups):
            return True
        return any(
            self._misread_one(name, entry, group, loose)
            for entry, group in zip(entries, value.groups, strict=True)
        )

    def _misread_one(self, name: str, entry: str, group: Group, loose: bool) -> bool:
        try:
            read = self.header_factory(name, entry.strip())
        # The package's parser can fail inside its own code on what it wrote unquoted (a
        # ``(`` left open, a ``:`` read as a group's): not read back as given either.
        except (HeaderParseError, ValueError, IndexError, AttributeError, TypeError):
            return True
        if not isinstance(read, AddressHeader):
            return True
        return _shape(read.groups, loose) != _shape((group,), loose)


# What opens a part of an address list in which a comma separates nothing (RFC 5322 3.2.4,
# 3.2.2, 3.4, 3.4.1), and what closes it; a group (``:`` to ``;``) only at the top.
_OPENS: Final = {'"': '"', "(": ")", "<": ">", "[": "]"}
# Where a backslash quotes the next character (a quoted-pair, 3.2.1).
_QUOTING: Final = frozenset({'"', ")", "]"})


def _entries(text: str) -> list[str]:
    """An address list's text split at the commas between its addresses and groups (RFC
    5322 3.4): not one in a quoted-string, a comment, an angle-addr, a domain-literal or a
    group.  Text the package wrote badly (a quote or a comment left open) gives another
    number of entries than it should have, which ``_misread`` counts as misread."""
    entries: list[str] = []
    start, escaped = 0, False
    closers: list[str] = []  # of what is open, innermost last
    for at, char in enumerate(text):
        inside = closers[-1] if closers else ""
        if escaped:
            escaped = False
        elif char == "\\" and inside in _QUOTING:
            escaped = True
        elif char == inside:
            closers.pop()
        elif inside in ('"', "]"):
            continue  # literal text
        elif char == "(":
            closers.append(")")  # comments nest (3.2.2)
        elif inside == ")":
            continue
        elif char in _OPENS:
            closers.append(_OPENS[char])
        elif char == ":" and not closers:
            closers.append(";")
        elif char == "," and not closers:
            entries.append(text[start:at])
            start = at + 1
    entries.append(text[start:])
    return entries


def _shape(groups: tuple[Group, ...], loose: bool) -> object:
    """What ``_misread`` compares of an address field's groups."""
    if not loose:
        return groups

    def squeezed(text: str | None) -> str | None:
        return None if text is None else "".join(text.split())

    return [
        (squeezed(g.display_name), [(squeezed(a.display_name), a.addr_spec) for a in g.addresses])
        for g in groups
    ]


def _broken(field: bytes) -> bool:
    """Whether a written field (it ends in CRLF) holds a line break that is no fold, or a
    line of only white space."""
    return (
        _UNFOLDED_BREAK.search(field.removesuffix(b"\r\n")) is not None
        or _WHITE_LINE.search(field) is not None
    )


def _address_field(name: str, value: AddressHeader) -> bytes:
    """The field ``name: value`` (CRLF-ended, unfolded) with each non-ASCII display name
    written by the legacy ``email.header.Header``, which keeps every encoded-word whole and
    within 75 characters (RFC 2047 section 2), its Q encoding to the characters section 5
    (3) allows in a phrase.  None of those is a special (RFC 5322 3.2.3), so the words go
    unquoted; they hold no white space, so ``_fold_at_spaces`` can fold between them."""

    def shown(text: str | None) -> str | None:
        if text is None or text.isascii():
            return text
        # ``header_name``: the first word may go on the field name's line.
        return " ".join(Header(text, "utf-8", header_name=name).encode(maxlinelen=75).split())

    lists: list[str] = []
    for group in value.groups:
        boxes = [
            Address(shown(box.display_name) or "", box.username, box.domain)
            for box in group.addresses
        ]
        if group.display_name is None:
            lists.extend(str(box) for box in boxes)
        else:
            lists.append(str(Group(shown(group.display_name), boxes)))
    return f"{name}: {', '.join(lists)}\r\n".encode()


def _fold_at_spaces(field: bytes, width: int) -> bytes:
    """``field`` (CRLF-ended) folded before its white space (RFC 5322 2.2.3: unfolding
    takes the CRLF out, so the value is unchanged) into lines of ``width`` where a word
    allows; the first word stays on the field name's line."""
    pieces = _FOLD_POINT.split(_UNFOLD.sub(b"", field.removesuffix(b"\r\n")))
    lines = [b"".join(pieces[:2])]
    for piece in pieces[2:]:
        if len(lines[-1]) + len(piece) <= width:
            lines[-1] += piece
        else:
            lines.append(piece)
    return b"\r\n".join(lines) + b"\r\n"


POLICY: Final = _Checked(linesep="\r\n")
UTF8_POLICY: Final = POLICY.clone(utf8=True)  # RFC 6532: UTF-8 in header fields, with SMTPUTF8


def _decoded_words(value: str, what: str) -> list[str]:
    """The text of each RFC 2047 encoded-word in ``value``, decoded as the email package
    would (an unknown charset as Latin-1: every octet shows)."""
    if not _ENCODED_WORD.search(value):
        return []
    try:
        parts = decode_header(value)
    except HeaderParseError:
        raise Unacceptable(f"{what}: an encoded-word (RFC 2047) that does not decode") from None
    texts = []
    for data, charset in parts:
        if charset is None or isinstance(data, str):
            continue
        try:
            texts.append(data.decode(charset, "surrogateescape"))
        except LookupError:
            texts.append(data.decode("latin-1"))
    return texts


def _plain(value: str, what: str) -> str:
    """Refuse control characters (CR, LF, NUL...) in a value that goes into a header, as
    sent or inside an encoded-word."""
    if found := _CONTROL.search(value):
        raise Unacceptable(f"{what}: control character {found.group()!r} not allowed")
    for text in _decoded_words(value, what):
        if found := _CONTROL.search(text):
            raise Unacceptable(
                f"{what}: an encoded-word (RFC 2047) decodes to the control character "
                f"{found.group()!r}, not allowed"
            )
    return value


@dataclass(frozen=True, slots=True)
class _Mailbox:
    header: Address  # as written: an A-label domain
    envelope: str  # as given; ``Envelope.checked`` A-labels its domain if the local part is ASCII
    what: str

    @property
    def utf8(self) -> bool:
        return not self.header.username.isascii()


def _domain(domain: str, what: str) -> str:
    """The domain as written in a header: an A-label for a non-ASCII name (RFC 5890)."""
    if domain.isascii():
        return domain
    try:
        return idna.encode(domain, uts46=True).decode("ascii")
    except idna.IDNAError as exc:
        raise Unacceptable(f"{what}: {domain!r} is not a valid domain name (IDNA): {exc}") from None


def _mailbox(value: str, what: str) -> _Mailbox:
    """One ``Name <addr>`` or bare address, checked; its ``Address`` for the header."""
    _plain(value, what)
    if "=?" in value:
        # RFC 2047 section 5 keeps encoded-words out of addr-specs and quoted strings, and
        # getaddresses splits a display name's encoded-word at a colon inside it.  Even a
        # lone "=?" is refused: the email package reads from it to the next "?=" as one
        # encoded-word, across the addresses after it, which would vanish from the field.
        raise Unacceptable(
            f"{what}: no encoded-word (RFC 2047) in an address, nor its opening '=?'; "
            "give the name as plain text"
        )
    found = getaddresses([value])
    if len(found) != 1 or not found[0][1]:
        raise Unacceptable(f"{what}: expected one address, got {value!r}")
    name, addr = found[0]
    check_address(addr, what=what)
    local, _, domain = addr.rpartition("@")
    domain = _domain(domain, what)
    try:
        if local.isascii():
            header = Address(display_name=name, addr_spec=f"{local}@{domain}")
        else:
            # The email package parses no UTF-8 local part (RFC 6532 section 3.2 extends
            # atext): its shape is checked on an ASCII stand-in, a dot-atom only.
            stand_in = "".join(c if c.isascii() else "u" for c in local)
            if Address(addr_spec=f"{stand_in}@{domain}").username != stand_in:
                raise ValueError("a non-ASCII local part must be a dot-atom")
            header = Address(display_name=name, username=local, domain=domain)
    except (ValueError, IndexError, MessageError) as exc:
        raise Unacceptable(f"{what}: {value!r} is not an address: {exc}") from None
    return _Mailbox(header, addr, what)


def _mailboxes(values: list[str], what: str) -> list[_Mailbox]:
    return [_mailbox(value, f"{what}[{i}]") for i, value in enumerate(values)]


def _addresses(boxes: list[_Mailbox]) -> list[Address]:
    return [box.header for box in boxes]


def _octets(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


def _header_values(submission: Submission) -> list[tuple[str, str]]:
    """Each value written into a header field (a Bcc address is parsed as one), with the
    JSON key that names it."""
    lists = {
        "to": submission.to, "cc": submission.cc, "bcc": submission.bcc,
        "reply_to": submission.reply_to,
    }  # fmt: skip
    values = [("from", submission.from_), ("subject", submission.subject)]
    for key, listed in lists.items():
        values.extend((f"{key}[{i}]", value) for i, value in enumerate(listed))
    values.extend((f"headers.{name}", value) for name, value in submission.headers.items())
    return values


def check_bounds(submission: Submission, *, max_recipients: int) -> None:
    """``Unacceptable`` naming the key when the submission is over a bound (the module
    docstring); cheap, linear in its size, so it runs before the build."""
    count = len(submission.to) + len(submission.cc) + len(submission.bcc)
    if count > max_recipients:
        raise Unacceptable(
            f"to, cc and bcc: {count} addresses in all, more than receiver.max_recipients "
            f"({max_recipients}) for one message; send the rest in another"
        )
    for key, value in _header_values(submission):
        if _octets(value) > HEADER_FIELD_MAX:
            raise Unacceptable(
                f"{key}: longer than {HEADER_FIELD_MAX} octets, the most zoneq writes into "
                "one header field"
            )


def build(submission: Submission, *, hostname: str, now_ms: int) -> tuple[bytes, Envelope]:
    """The message's bytes (CRLF lines) and its envelope; ``Unacceptable`` for bad input."""
    sender = _mailbox(submission.from_, "from")
    to = _mailboxes(submission.to, "to")
    cc = _mailboxes(submission.cc, "cc")
    bcc = _mailboxes(submission.bcc, "bcc")
    reply_to = _mailboxes(submission.reply_to, "reply_to")
    if not (to or cc or bcc):
        raise Unacceptable("no recipients: give at least one of to, cc, bcc")
    if submission.envelope_from is not None:
        mail_from = submission.envelope_from
    else:
        mail_from = sender.envelope
    # Checked, U-label domains of ASCII local parts A-labelled (RFC 6531 wants SMTPUTF8
    # only for a non-ASCII local part), repeats removed (RFC 5321 2.4: the domain's case).
    recipients = tuple(box.envelope for box in (*to, *cc, *bcc))
    envelope = Envelope(mail_from, recipients).checked()
    msg = EmailMessage(policy=_policy([sender, *to, *cc, *reply_to], envelope))
    try:
        msg["From"] = sender.header
        if to:
            msg["To"] = _addresses(to)
        if cc:
            msg["Cc"] = _addresses(cc)
        if reply_to:
            msg["Reply-To"] = _addresses(reply_to)
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
    # The email package's own refusals (a second line of defence); MessageError covers
    # HeaderParseError and, on a newer Python, HeaderWriteError (not ValueErrors).  Its
    # parser can also fail inside its own code on what it is given (an IndexError in
    # get_obs_local_part): the client's input too, not a fault of ours.
    except (ValueError, MessageError, IndexError, AttributeError, TypeError) as exc:
        raise Unacceptable(str(exc) or type(exc).__name__) from None
    return data, envelope


def _policy(shown: list[_Mailbox], envelope: Envelope) -> EmailPolicy:
    """UTF-8 header fields when a shown address needs them, if the message gets SMTPUTF8:
    the intake flags it for a non-ASCII envelope address (``Intake``, RFC 6531)."""
    needing = [box.what for box in shown if box.utf8]
    if not needing:
        return POLICY
    if all(a.isascii() for a in (envelope.sender, *envelope.recipients)):
        raise Unacceptable(
            f"{needing[0]}: a non-ASCII local part needs SMTPUTF8 (RFC 6531), which the "
            "message only gets with a non-ASCII envelope address"
        )
    return UTF8_POLICY


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
        maintype, _, subtype = attachment.content_type.lower().partition("/")
        if maintype in _UNENCODABLE:
            raise Unacceptable(
                f"{what}.content_type: {maintype}/* cannot be sent base64-encoded (RFC 2045 "
                "6.4, RFC 2046 5.2.1): send it as application/octet-stream, or the whole "
                "message through /api/v1/messages/raw"
            )
        try:
            content = base64.b64decode(attachment.content, validate=True)
        except (binascii.Error, ValueError):
            raise Unacceptable(f"{what}.content: not valid base64") from None
        msg.add_attachment(content, maintype=maintype, subtype=subtype, filename=filename)
