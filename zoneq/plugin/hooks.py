"""The hook table: every hook's name, what it is called with, and what it may return.

Theory of operation
-------------------
A hook is called with one frozen argument object (so adding a field later breaks no
plugin) and answers with ``None`` ("no opinion") or one of the result types its row in
``SPECS`` allows.  Anything else is *garbage*: the host treats it like an exception, as a
failure of that plugin, and never guesses what was meant.  How the answers of several
plugins combine is the hook's ``mode``:

* ``FIRST``: plugins are asked in config order; the first answer that is not None decides
  and the rest are not asked (a rejection at RCPT);
* ``CHAIN``: plugins are asked in config order, each seeing the previous ones' choice
  (``queue:route``: a routing plugin first, then a suppression list that needs the final
  zone); a choice replaces the value and the round goes on, a refusal stops it;
* ``COLLECT``: every plugin is asked and added header fields accumulate in order; a reply
  stops the round (a plugin that cannot sign may defer the delivery);
* ``NOTIFY``: every plugin is told, results are ignored, a failure is logged and does not
  stop the others (delivery outcomes: nothing to decide any more).

Which hooks exist and where they are called comes from ZoneMTA's plugin API, which its
users built signing, webhooks and suppression on (ARCHITECTURE.md section 5).
"""

from __future__ import annotations

import enum
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Final

from zoneq.protocol.replies import Reply

__all__ = [
    "SPECS",
    "AddHeaders",
    "AuthArgs",
    "ConnectArgs",
    "Drop",
    "Hook",
    "HookSpec",
    "MailFromArgs",
    "MessageHeadersArgs",
    "Mode",
    "OutcomeArgs",
    "Phase",
    "RcptToArgs",
    "RouteArgs",
    "SenderHeadersArgs",
    "Session",
]


class Hook(enum.StrEnum):
    """Hook names as plugins and logs spell them."""

    SMTP_AUTH = "smtp:auth"
    SMTP_MAIL_FROM = "smtp:mail_from"
    SMTP_RCPT_TO = "smtp:rcpt_to"
    MESSAGE_HEADERS = "message:headers"
    QUEUE_ROUTE = "queue:route"
    SENDER_CONNECT = "sender:connect"
    SENDER_HEADERS = "sender:headers"
    DELIVERED = "delivered"
    DEFERRED = "deferred"
    BOUNCED = "bounced"


class Phase(enum.StrEnum):
    """Where a hook runs, which decides what a failure becomes (issue 5)."""

    RECEIVE = "receive"  # a failure answers the SMTP client 451 4.3.0
    ROUTE = "route"  # per recipient, at receive time: 451 4.3.0 as well
    SEND = "send"  # a failure is logged and the delivery deferred, never lost
    OUTCOME = "outcome"  # a failure is logged


class Mode(enum.Enum):
    FIRST = "first"
    CHAIN = "chain"
    COLLECT = "collect"
    NOTIFY = "notify"


# --- arguments ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Session:
    """The SMTP client a receive-time hook is about."""

    client_ip: str
    helo: str | None = None
    user: str | None = None
    """The authenticated user name (RFC 4954), None when the client did not authenticate."""
    trusted: bool = False
    """Authenticated or in ``receiver.allow_networks``."""


@dataclass(frozen=True, slots=True)
class AuthArgs:
    session: Session
    mechanism: str
    username: str
    password: str = field(repr=False)  # kept out of logs and tracebacks


@dataclass(frozen=True, slots=True)
class MailFromArgs:
    session: Session
    sender: str
    """The reverse path without brackets; empty for the null sender ``<>``."""


@dataclass(frozen=True, slots=True)
class RcptToArgs:
    session: Session
    sender: str
    recipient: str
    zone: str
    """The zone routing chose for this recipient."""


@dataclass(frozen=True, slots=True)
class MessageHeadersArgs:
    session: Session
    sender: str
    recipients: tuple[str, ...]
    headers: tuple[tuple[str, str], ...]
    """(name, value) pairs in message order, values unfolded."""


@dataclass(frozen=True, slots=True)
class RouteArgs:
    sender: str
    recipient: str
    zone: str
    """The zone the routing rules chose; return another zone's name to override it."""
    rule: str
    """Which rule chose it: ``header``, ``sender_domain``, ``recipient_domain``,
    ``client_network`` or ``default``."""
    session: Session | None = None
    """None for mail not received over SMTP (the API, our own bounces)."""


@dataclass(frozen=True, slots=True)
class ConnectArgs:
    zone: str
    domain: str
    mx_host: str
    mx_address: str
    source_address: str | None
    """The pool address the connection binds to; None: chosen by the system."""


BodyReader = Callable[[], AsyncIterator[bytes]]
"""Each call starts a fresh pass over the body's chunks (CRLF line ends, not dot-stuffed)."""


@dataclass(frozen=True, slots=True)
class SenderHeadersArgs:
    zone: str
    message_id: str
    sender: str
    recipients: tuple[str, ...]
    domain: str
    headers: bytes
    """The header section as sent, CRLF line ends, ending with the empty line."""
    body: BodyReader = field(repr=False)


@dataclass(frozen=True, slots=True)
class OutcomeArgs:
    zone: str
    message_id: str
    sender: str
    recipient: str
    reply: Reply | None
    """The remote server's reply, or None when there was none (DNS, connection failure)."""
    attempts: int


# --- results --------------------------------------------------------------------------------

# RFC 5322 section 2.2: a field is a name of printable characters except the colon, a
# colon, and a body whose line breaks are CRLF followed by white space (folding).
_FIELD: Final = re.compile(rb"[\x21-\x39\x3b-\x7e]+:(?:[^\r\n]|\r\n[ \t])*\r\n")


@dataclass(frozen=True, slots=True)
class AddHeaders:
    """Header fields to add in front of the message, each complete with its final CRLF."""

    fields: tuple[bytes, ...]

    def __post_init__(self) -> None:
        for item in self.fields:
            if not isinstance(item, bytes) or not _FIELD.fullmatch(item):
                raise ValueError(
                    f"not a header field ending in CRLF (RFC 5322 section 2.2): {item!r:.80}"
                )


@dataclass(frozen=True, slots=True)
class Drop:
    """Accept the recipient but do not deliver; an event records ``reason``."""

    reason: str
    zone: str | None = None
    """The zone the recipient was in when dropped, where its DROPPED event is counted: the
    host sets it (the rules' zone, or the one a plugin earlier in the ``queue:route`` chain
    chose); whatever a plugin puts here is replaced."""


# --- the table ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HookSpec:
    args: type
    results: tuple[type, ...]
    mode: Mode
    phase: Phase


SPECS: Final[dict[Hook, HookSpec]] = {
    # True: accept the credentials; False: refuse them (535 5.7.8); a reply: answer that.
    Hook.SMTP_AUTH: HookSpec(AuthArgs, (bool, Reply), Mode.FIRST, Phase.RECEIVE),
    Hook.SMTP_MAIL_FROM: HookSpec(MailFromArgs, (Reply,), Mode.FIRST, Phase.RECEIVE),
    Hook.SMTP_RCPT_TO: HookSpec(RcptToArgs, (Reply,), Mode.FIRST, Phase.RECEIVE),
    Hook.MESSAGE_HEADERS: HookSpec(MessageHeadersArgs, (Reply,), Mode.FIRST, Phase.RECEIVE),
    # A zone name overrides the rules; a reply refuses the recipient; Drop accepts and drops.
    Hook.QUEUE_ROUTE: HookSpec(RouteArgs, (str, Reply, Drop), Mode.CHAIN, Phase.ROUTE),
    Hook.SENDER_CONNECT: HookSpec(ConnectArgs, (Reply,), Mode.FIRST, Phase.SEND),
    Hook.SENDER_HEADERS: HookSpec(SenderHeadersArgs, (AddHeaders, Reply), Mode.COLLECT, Phase.SEND),
    Hook.DELIVERED: HookSpec(OutcomeArgs, (), Mode.NOTIFY, Phase.OUTCOME),
    Hook.DEFERRED: HookSpec(OutcomeArgs, (), Mode.NOTIFY, Phase.OUTCOME),
    Hook.BOUNCED: HookSpec(OutcomeArgs, (), Mode.NOTIFY, Phase.OUTCOME),
}
