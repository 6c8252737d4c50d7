"""The events of the SMTP server state machine (``smtp_server.py``): what the peer did.

Events with ``needs_decision`` wait for the driver's ``accept`` or ``reject``; the others are
information (a body chunk, a reset, the end of the session).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from zoneq.protocol.dsn import Notify, Ret
from zoneq.protocol.replies import Reply
from zoneq.protocol.smtp_commands import (
    BodyType,
)

__all__ = [
    "AuthRequest",
    "AuthResponse",
    "DataChunk",
    "DataEnd",
    "DataStart",
    "Event",
    "Hello",
    "MailFrom",
    "Quit",
    "RcptTo",
    "Reset",
    "StartTLS",
]


@dataclass(frozen=True, slots=True)
class Event:
    """Base of all events.  ``needs_decision`` events wait for ``accept``/``reject``."""

    _awaits_decision: ClassVar[bool] = False

    @property
    def needs_decision(self) -> bool:
        """True when the machine waits for ``accept``/``reject`` on this event."""
        return self._awaits_decision


@dataclass(frozen=True, slots=True)
class Hello(Event):
    """EHLO or HELO, already answered; any transaction in progress was dropped."""

    command: str
    domain: str


@dataclass(frozen=True, slots=True)
class MailFrom(Event):
    """MAIL FROM (RFC 5321 4.1.1.2, RFC 1652, 1870, 3461, 6531).  ``address`` "" is <>.

    ``envid`` is the raw xtext, checked to decode (the queue stores it as received)."""

    _awaits_decision: ClassVar[bool] = True
    address: str
    size: int | None = None
    body: BodyType | None = None
    smtputf8: bool = False
    ret: Ret | None = None
    envid: str | None = None


@dataclass(frozen=True, slots=True)
class RcptTo(Event):
    """RCPT TO (RFC 5321 4.1.1.3, RFC 3461 4.1-4.2).  ``orcpt`` is the raw ``type;xtext``;
    ``route`` the source route ("@a,@b") the path carried before ``address``, if any: the
    machine never follows it, the driver decides whether to accept such an address."""

    _awaits_decision: ClassVar[bool] = True
    address: str
    notify: frozenset[Notify] | None = None
    orcpt: str | None = None
    route: str | None = None


@dataclass(frozen=True, slots=True)
class DataStart(Event):
    """DATA with at least one accepted recipient: accept gives 354."""

    _awaits_decision: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class DataChunk(Event):
    """Message text, dot-unstuffed, CRLF line ends kept."""

    data: bytes


@dataclass(frozen=True, slots=True)
class DataEnd(Event):
    """The final dot.  ``rejected`` set: already answered with it, discard the message.
    Otherwise the driver commits the message and accepts (250), or rejects."""

    rejected: Reply | None = None

    @property
    def needs_decision(self) -> bool:
        return self.rejected is None


@dataclass(frozen=True, slots=True)
class Reset(Event):
    """RSET: the transaction (if any) is dropped.  Already answered."""


@dataclass(frozen=True, slots=True)
class StartTLS(Event):
    """Send ``data_to_send()`` (the 220), run the TLS handshake, call ``tls_established``."""


@dataclass(frozen=True, slots=True)
class AuthRequest(Event):
    """AUTH (RFC 4954 section 4); ``initial`` is the decoded initial response, if any."""

    _awaits_decision: ClassVar[bool] = True
    mechanism: str
    initial: bytes | None = None


@dataclass(frozen=True, slots=True)
class AuthResponse(Event):
    """The client's (decoded) answer to a ``challenge``."""

    _awaits_decision: ClassVar[bool] = True
    data: bytes


@dataclass(frozen=True, slots=True)
class Quit(Event):
    """QUIT, answered with 221: send ``data_to_send()`` and close."""


# Bad-sequence replies (RFC 5321 section 4.1.4, 503 with RFC 3463 X.5.1).
