"""What a delivery is asked to do: TLS policy, timeouts, recipients and MAIL options."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterable, Callable, Iterable
from dataclasses import dataclass
from typing import Final

from zoneq.protocol.dsn import Notify, Ret


class TlsPolicy(enum.StrEnum):
    """Whether to use STARTTLS (RFC 3207)."""

    NONE = "none"
    """Never: plaintext even when STARTTLS is offered."""
    OPPORTUNISTIC = "opportunistic"
    """When offered, without certificate checks; plaintext if it is not offered or fails."""
    REQUIRED = "required"
    """Always, certificate checked by default; no TLS means DEFER, nothing sent in plaintext."""


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds to wait at each step (RFC 5321 section 4.5.3.2 where it names the step)."""

    greeting: float = 300.0
    """TCP connect and the 220 greeting, 4.5.3.2.1 (aiosmtplib bounds each by this value)."""
    ehlo: float = 300.0
    """EHLO/HELO: not named by the RFC; like MAIL."""
    starttls: float = 300.0
    """STARTTLS reply and the TLS handshake: not named by the RFC; like MAIL."""
    mail: float = 300.0
    """MAIL, 4.5.3.2.2."""
    rcpt: float = 300.0
    """Each RCPT, 4.5.3.2.3."""
    data_init: float = 120.0
    """The 354 reply to DATA, 4.5.3.2.4."""
    data_block: float = 180.0
    """Each write of the body to make progress (flow control), 4.5.3.2.5."""
    data_end: float = 600.0
    """The reply after the final dot, 4.5.3.2.6: the server may be scanning the message."""
    rset: float = 20.0
    """RSET between transactions: not named by the RFC; a sound server answers at once."""
    quit: float = 30.0
    """QUIT: not named by the RFC; the outcome is settled by then, so there is no long wait."""


RFC5321_TIMEOUTS: Final = Timeouts()


@dataclass(frozen=True, slots=True)
class Recipient:
    """A recipient with its RFC 3461 DSN parameters (sent only if the server offers DSN).

    ``notify`` empty means no NOTIFY parameter; NEVER must stand alone (section 4.1).
    ``orcpt`` is the ORCPT value as received, ``addr-type;xtext`` (section 4.2).
    """

    address: str
    notify: frozenset[Notify] = frozenset()
    orcpt: str | None = None


@dataclass(frozen=True, slots=True)
class MailOptions:
    """MAIL parameters, each sent only when the server offers the extension.

    ``ret`` and ``envid`` (ENVID as received, xtext): RFC 3461 sections 4.3 and 4.4.
    ``size``: the message size in octets, RFC 1870; a server limit below it bounces with 5.3.4
    before anything is sent.  ``eight_bit``: the body is 8-bit MIME (``BODY=8BITMIME``, RFC
    6152).  To a server without 8BITMIME zoneq sends such a body unchanged, 8-bit octets and
    all: there is no converting it here.  That departs from RFC 6152 section 3, which has the
    client convert the body to 7-bit MIME or else return it as undeliverable, and from
    Postfix, which by default (``disable_mime_output_conversion = no``) converts 8-bit MIME
    to 7-bit quoted-printable for such a server.  ``smtputf8``: the message needs SMTPUTF8
    (RFC 6531), e.g. for UTF-8 headers; non-ASCII addresses imply it.  Without SMTPUTF8 at
    the server, such mail bounces with 5.6.7 (RFC 6531 section 3.4).
    """

    ret: Ret | None = None
    envid: str | None = None
    size: int | None = None
    eight_bit: bool = False
    smtputf8: bool = False


BodySource = Callable[[], AsyncIterable[bytes] | Iterable[bytes]]
"""Opens the message body from its first octet, as chunks.  Called once per transaction (more
than once after a 452 "too many recipients"), so it must start over each time."""
