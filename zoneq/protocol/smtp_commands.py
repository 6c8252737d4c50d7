"""Parsing of SMTP command lines for the server side (``smtp_server``).

Theory of operation
-------------------
``smtp_server`` cuts the byte stream into lines (only CRLF ends one) and decodes each as
UTF-8; everything about the *text* of one command line lives here.  ``split_command``
separates the verb from its argument; ``parse_mail`` and ``parse_rcpt`` turn the argument
of MAIL and RCPT into values (the path and the RFC 5321 section 4.1.2 esmtp parameters, with
the meanings of RFC 1652, 1870, 3461 and 6531).  A fault in the peer's text raises
``CommandError`` carrying the exact reply to send, so the state machine never has to map
error kinds to codes: it catches the error and queues ``error.reply``.

Pure: no I/O, no clock.  Values are frozen dataclasses and enums.

Choices:

* ENVID and ORCPT are kept *raw*, exactly as received (xtext), after checking that they
  decode to printable US-ASCII (RFC 3461 sections 4.2 and 4.4): the queue stores them that
  way and the DSN builder (``dsn``) decodes them.  The exception is an ORCPT of the utf-8
  addr-type (RFC 6533 section 3), stored in its 7-bit utf-8-addr-xtext form whichever form
  came (``normal_orcpt``), so that any next hop can be sent it; the raw UTF-8 form is
  refused without SMTPUTF8 on MAIL.
* An unrecognised MAIL/RCPT parameter keyword is 555 5.5.4 (RFC 5321 section 4.1.1.11);
  a recognised keyword with a bad value is 501 5.5.4; BODY=BINARYMIME, a value defined by
  RFC 3030 but not offered, is 504 5.5.4 (parameter not implemented).
* A space after ``FROM:`` / ``TO:`` is tolerated (RFC 5321 forbids it, many clients send
  it, and it is unambiguous).
* MAIL's ``AUTH=`` (RFC 4954 section 5) is accepted where EHLO advertised AUTH, from
  authenticated clients or not (the RFC's MUST), checked (xtext decoding to an addr-spec or
  ``<>``, else 501 5.5.4) and then dropped: zoneq does not pass the AUTH identity on to the
  next hop, which is what the RFC allows a server that does not trust it (it is then
  treated as ``<>``).  The session's own AUTH user is what zoneq records.
* A mailbox is returned with its local part least quoted (``local_parts``, RFC 5321
  section 4.1.2): ``"bob"@x`` is stored as ``bob@x``, the one mailbox it names.
* A source route (``<@a,@b:user@c>``, RFC 5321 section 4.1.2 A-d-l) is parsed, never
  followed.  In a reverse-path it is dropped (appendix C: servers "MUST be prepared to
  receive" it, section 3.6.1: they SHOULD ignore it).  In a forward-path it is handed on
  in ``RcptCommand.route`` so that the driver can refuse it (section 3.6.1: servers "MAY
  decline ... to accept addresses that specify source routes"); the receiver does.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Final

from zoneq.errors import ProtocolError
from zoneq.protocol.domains import EMPTY_LABEL, has_empty_label
from zoneq.protocol.dsn import Notify, Ret
from zoneq.protocol.local_parts import canonical_address, is_local_part
from zoneq.protocol.replies import EnhancedStatus, Reply
from zoneq.protocol.xtext import (
    MAX_ORCPT,
    normal_orcpt,
    printable_xtext_decode,
    xtext_decode,
)

__all__ = [
    "BodyType",
    "CommandError",
    "MailCommand",
    "RcptCommand",
    "parse_mail",
    "parse_rcpt",
    "split_command",
    "syntax_error",
]

# RFC 5321 section 4.5.3.1: local-part 64 octets, path (with the angle brackets) 256.
MAX_LOCAL_PART: Final = 64
MAX_PATH: Final = 256
# RFC 3461 section 4.4: ENVID is at most 100 characters (ORCPT's 500: xtext.MAX_ORCPT).
MAX_ENVID: Final = 100
# RFC 1870 section 3: size-value = 1*20DIGIT.
_SIZE_VALUE: Final = re.compile(r"[0-9]{1,20}")
# RFC 5321 section 4.1.2: esmtp-keyword = (ALPHA / DIGIT) *(ALPHA / DIGIT / "-").
_KEYWORD: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
# RFC 5321 section 4.1.2: esmtp-value = 1*(%d33-60 / %d62-126); RFC 6531 section 3.3 adds
# UTF-8 non-ASCII characters.
_VALUE: Final = re.compile(r"[\x21-\x3c\x3e-\x7e\u0080-\U0010ffff]+")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")  # never in an address
# RFC 5321 section 4.1.2: A-d-l = At-domain *( "," At-domain ); At-domain = "@" Domain.
# The domains are only checked to be printable words: the route is never followed.
_HOP: Final = r"@[^\x00-\x20\x7f@,:<>\\\"]+"
_ROUTE: Final = re.compile(rf"{_HOP}(?:,{_HOP})*")


class CommandError(ProtocolError):
    """The peer's command is at fault; ``reply`` is what to answer (the session goes on)."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(str(reply))
        self.reply = reply


def _reply(code: int, text: str, klass: int, subject: int, detail: int) -> Reply:
    return Reply(code, (text,), EnhancedStatus(klass, subject, detail))


def syntax_error(text: str) -> Reply:
    """500 5.5.2 (RFC 3463 section 3.6: syntax error)."""
    return _reply(500, text, 5, 5, 2)


def bad_arguments(text: str) -> Reply:
    """501 5.5.4 (RFC 3463 section 3.6: invalid command arguments)."""
    return _reply(501, text, 5, 5, 4)


def _unsupported_parameter(keyword: str) -> Reply:
    # RFC 5321 section 4.1.1.11: parameters not recognised are answered with 555.
    return _reply(555, f"Unsupported parameter {keyword}", 5, 5, 4)


class BodyType(enum.StrEnum):
    """RFC 1652 section 3 BODY values offered (8BITMIME); BINARYMIME is not."""

    SEVEN_BIT = "7BIT"
    EIGHT_BIT_MIME = "8BITMIME"


@dataclass(frozen=True, slots=True)
class MailCommand:
    """A parsed ``MAIL FROM``: ``sender`` is "" for the null reverse-path ``<>``."""

    sender: str
    size: int | None = None
    body: BodyType | None = None
    smtputf8: bool = False
    ret: Ret | None = None
    envid: str | None = None


@dataclass(frozen=True, slots=True)
class RcptCommand:
    """A parsed ``RCPT TO``.  ``notify`` is None without a NOTIFY parameter; ``orcpt`` is
    the ``addr-type;xtext`` value (RFC 3461 section 4.2), checked, kept raw but for the
    utf-8 addr-type's 7-bit form (``normal_orcpt``)."""

    recipient: str
    notify: frozenset[Notify] | None = None
    orcpt: str | None = None
    route: str | None = None  # the A-d-l ("@a,@b") of a source-routed path, if any


def split_command(line: str) -> tuple[str, str]:
    """Split a command line (CRLF removed) into upper-case verb and argument text.

    RFC 5321 section 4.1.1: verbs are case-insensitive and separated from the argument by
    one space.  Raises ``CommandError`` (500 5.5.2) when the line does not begin with a verb.
    """
    verb, space, rest = line.partition(" ")
    if not (verb.isascii() and verb.isalpha()):  # [A-Za-z]+, without a regex call
        raise CommandError(syntax_error("Syntax error, command unrecognized"))
    return verb.upper(), rest if space else ""


def _split_path(argument: str, prefix: str) -> tuple[str, str]:
    """Cut ``FROM:<path>`` / ``TO:<path>`` into the path's content and the parameter text."""
    if argument[: len(prefix)].upper() != prefix:
        raise CommandError(bad_arguments(f"Syntax: {prefix}<address>"))
    rest = argument[len(prefix) :].lstrip(" ")
    if not rest.startswith("<"):
        raise CommandError(bad_arguments("Address must be enclosed in <>"))
    if '"' not in rest:
        # No quoted-string: the first ">" closes the path (nearly every client's case;
        # the loop below costs a few microseconds per command).
        return _path_end(rest, rest.find(">"))
    # Find the closing ">" outside any quoted-string (RFC 5321 section 4.1.2 Quoted-string).
    quoted = False
    escaped = False
    for index in range(1, len(rest)):
        char = rest[index]
        if escaped:
            escaped = False
        elif char == "\\" and quoted:
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == ">" and not quoted:
            return _path_end(rest, index)
    raise CommandError(bad_arguments("Address must be enclosed in <>"))


def _path_end(rest: str, index: int) -> tuple[str, str]:
    """The path ``rest[1:index]`` (``rest[index]`` its closing ">", -1 for none) and the
    parameter text after it."""
    if index < 0:
        raise CommandError(bad_arguments("Address must be enclosed in <>"))
    params = rest[index + 1 :]
    if params and not params.startswith(" "):
        raise CommandError(bad_arguments("Space required after the address"))
    if index + 1 > MAX_PATH:
        raise CommandError(_reply(501, "Path too long", 5, 1, 3))
    return rest[1:index], params.strip(" ")


def _split_route(path: str) -> tuple[str | None, str]:
    """``"@a,@b:user@c"`` -> ``("@a,@b", "user@c")`` (RFC 5321 section 4.1.2: Path =
    "<" [ A-d-l ":" ] Mailbox ">"); a path without a route -> ``(None, path)``."""
    if not path.startswith("@"):
        return None, path
    route, colon, mailbox = path.partition(":")
    if not colon or not _ROUTE.fullmatch(route):
        raise CommandError(_reply(501, "Bad source route", 5, 1, 3))
    return route, mailbox


def _check_mailbox(path: str, *, utf8: bool, postmaster_ok: bool = False) -> str:
    """Validate a mailbox (a path's content without its source route) and return it with
    its local part least quoted (``canonical_address``): ``"bob"@x`` and ``bob@x`` are one
    mailbox (RFC 5322 section 3.4.1), so they are one recipient, one sender in the DSNs
    and events, and one key for the plugins, as the HTTP API's intake stores them."""
    if postmaster_ok and path.lower() == "postmaster":
        return path  # RFC 5321 section 4.1.1.3: "<Postmaster>" without a domain.
    local, at, domain = path.rpartition("@")
    if not at or not local or not domain:
        raise CommandError(_reply(501, "Bad address syntax", 5, 1, 3))
    # Controls are never allowed.  The local part is a Dot-string or a Quoted-string (RFC
    # 5321 section 4.1.2), as the HTTP API's intake has it: so no space outside quotes and
    # no second "@" (``a@b@c``, the old user@host@relay routing, refused like the percent
    # hack).  Finer domain syntax is left to the next hop.
    if _CONTROL.search(path) is not None or " " in domain or not is_local_part(local):
        raise CommandError(_reply(501, "Bad address syntax", 5, 1, 3))
    if has_empty_label(domain):
        # Refused here as the HTTP API refuses it (``zoneq.queue.intake``).
        raise CommandError(_reply(501, f"Bad address syntax: {EMPTY_LABEL}", 5, 1, 3))
    if len(local.encode("utf-8")) > MAX_LOCAL_PART:
        raise CommandError(_reply(501, "Local part too long", 5, 1, 3))
    if not path.isascii() and not utf8:
        # RFC 6531 section 3.5: non-ASCII addresses need the SMTPUTF8 parameter.
        raise CommandError(_reply(553, "Non-ASCII address requires SMTPUTF8", 5, 6, 7))
    return canonical_address(path)


def _parameters(text: str) -> dict[str, str | None]:
    """Parse ``KEY[=VALUE] ...`` (RFC 5321 section 4.1.2) into upper-case keys -> values."""
    params: dict[str, str | None] = {}
    for word in text.split(" "):
        if not word:
            continue  # several spaces: tolerated
        keyword, equals, value = word.partition("=")
        if not _KEYWORD.fullmatch(keyword) or (equals and not _VALUE.fullmatch(value)):
            raise CommandError(bad_arguments(f"Bad parameter syntax: {word}"))
        key = keyword.upper()
        if key in params:
            raise CommandError(bad_arguments(f"Duplicate parameter {key}"))
        params[key] = value if equals else None
    return params


def _no_value(key: str, value: str | None) -> None:
    if value is not None:
        raise CommandError(bad_arguments(f"{key} takes no value"))


def _value(key: str, value: str | None) -> str:
    if value is None:
        raise CommandError(bad_arguments(f"{key} requires a value"))
    return value


_MAIL_PARAMETERS: Final = frozenset({"SIZE", "BODY", "SMTPUTF8", "RET", "ENVID"})
_MAIL_PARAMETERS_AUTH: Final = _MAIL_PARAMETERS | {"AUTH"}


def _size(value: str | None, max_size: int) -> int:
    """RFC 1870 section 3: SIZE=digits; over the limit is 552 5.3.4 (section 6)."""
    text = _value("SIZE", value)
    if not _SIZE_VALUE.fullmatch(text):
        raise CommandError(bad_arguments("SIZE must be a number"))
    size = int(text)
    if size > max_size:
        raise CommandError(_reply(552, "Message size exceeds fixed maximum", 5, 3, 4))
    return size


def _body(value: str | None) -> BodyType:
    """RFC 1652 section 3: BODY=7BIT / 8BITMIME."""
    text = _value("BODY", value).upper()
    if text == "BINARYMIME":
        raise CommandError(_reply(504, "BODY=BINARYMIME not supported", 5, 5, 4))
    try:
        return BodyType(text)
    except ValueError:
        raise CommandError(bad_arguments("BODY must be 7BIT or 8BITMIME")) from None


def _ret(value: str | None) -> Ret:
    """RFC 3461 section 4.3: RET=FULL / HDRS."""
    try:
        return Ret(_value("RET", value).upper())
    except ValueError:
        raise CommandError(bad_arguments("RET must be FULL or HDRS")) from None


def _envid(value: str | None) -> str:
    """RFC 3461 section 4.4: ENVID=xtext of printable US-ASCII, at most 100 characters;
    kept raw."""
    envid = _value("ENVID", value)
    if len(envid) > MAX_ENVID:
        raise CommandError(bad_arguments("ENVID too long"))
    try:
        printable_xtext_decode(envid)
    except ProtocolError:
        raise CommandError(bad_arguments("Bad ENVID parameter syntax")) from None
    return envid


def _check_auth(value: str | None) -> None:
    """RFC 4954 section 5: ``AUTH=`` xtext whose decoded form is an addr-spec or ``<>``.

    Only the shape is checked (an "@" between a local part and a domain, no controls):
    the value is never used, so finer addr-spec syntax would refuse mail for nothing.
    """
    try:
        identity = xtext_decode(_value("AUTH", value))
    except ProtocolError:
        raise CommandError(bad_arguments("AUTH is not xtext")) from None
    if identity == "<>":
        return
    local, at, domain = identity.rpartition("@")
    if not (at and local and domain) or _CONTROL.search(identity):
        raise CommandError(bad_arguments("AUTH must be an address or <>"))


def parse_mail(argument: str, *, esmtp: bool, max_size: int, auth: bool = False) -> MailCommand:
    """Parse the argument of MAIL (``FROM:<path> params``).

    ``esmtp`` is False after HELO: then no parameter is allowed (RFC 1869 section 4.2,
    carried into RFC 5321 section 4.1.1.11).  A SIZE over ``max_size`` is 552 5.3.4
    (RFC 1870 section 6).  ``auth`` says whether EHLO advertised AUTH: only then is the
    ``AUTH=`` parameter known (checked, not kept); otherwise it is 555 like any other.
    """
    path, param_text = _split_path(argument, "FROM:")
    params = _parameters(param_text)
    if params and not esmtp:
        raise CommandError(_unsupported_parameter(next(iter(params))))
    smtputf8 = "SMTPUTF8" in params
    if smtputf8:
        _no_value("SMTPUTF8", params["SMTPUTF8"])  # RFC 6531 section 3.4
    # The reverse-path's route is dropped (appendix C): bounces go to the mailbox itself.
    sender = "" if path == "" else _check_mailbox(_split_route(path)[1], utf8=smtputf8)
    size = _size(params["SIZE"], max_size) if "SIZE" in params else None
    body = _body(params["BODY"]) if "BODY" in params else None
    ret = _ret(params["RET"]) if "RET" in params else None
    envid = _envid(params["ENVID"]) if "ENVID" in params else None
    known = _MAIL_PARAMETERS_AUTH if auth else _MAIL_PARAMETERS
    for key in params:
        if key not in known:
            raise CommandError(_unsupported_parameter(key))
    if "AUTH" in params:
        _check_auth(params["AUTH"])
    return MailCommand(sender, size, body, smtputf8, ret, envid)


def _parse_notify(value: str) -> frozenset[Notify]:
    """RFC 3461 section 4.1: NEVER alone, or a list of SUCCESS, FAILURE, DELAY."""
    words = value.upper().split(",")
    try:
        notify = [Notify(word) for word in words]
    except ValueError:
        raise CommandError(bad_arguments("Bad NOTIFY value")) from None
    if len(set(notify)) != len(notify) or (Notify.NEVER in notify and len(notify) > 1):
        raise CommandError(bad_arguments("Bad NOTIFY value"))
    return frozenset(notify)


def _check_orcpt(value: str, *, smtputf8: bool) -> str:
    """RFC 3461 section 4.2: ``addr-type ";" xtext``, at most 500 characters as received.

    Stored as ``normal_orcpt`` gives it (a utf-8 address in its xtext form), however long
    that is: the limit is on the parameter as sent, and a valid unitext value must not
    cost the client its recipient.  Delivery leaves out one too long to send on.
    """
    if len(value) > MAX_ORCPT:
        raise CommandError(bad_arguments("ORCPT too long"))
    try:
        return normal_orcpt(value, unitext=smtputf8)
    except ProtocolError:
        raise CommandError(bad_arguments("Bad ORCPT parameter syntax")) from None


def parse_rcpt(argument: str, *, esmtp: bool, smtputf8: bool) -> RcptCommand:
    """Parse the argument of RCPT (``TO:<path> params``).

    ``smtputf8`` says whether the transaction's MAIL carried SMTPUTF8 (RFC 6531 section
    3.5: only then may the address be non-ASCII).
    """
    path, param_text = _split_path(argument, "TO:")
    route, mailbox = _split_route(path)
    recipient = _check_mailbox(mailbox, utf8=smtputf8, postmaster_ok=True)
    params = _parameters(param_text)
    if params and not esmtp:
        raise CommandError(_unsupported_parameter(next(iter(params))))
    notify: frozenset[Notify] | None = None
    orcpt: str | None = None
    for key, value in params.items():
        if key == "NOTIFY":
            notify = _parse_notify(_value(key, value))
        elif key == "ORCPT":
            orcpt = _check_orcpt(_value(key, value), smtputf8=smtputf8)
        else:
            raise CommandError(_unsupported_parameter(key))
    return RcptCommand(recipient, notify, orcpt, route)
