"""What the receiver adds to and reads from a message: the trace header and a few headers.

Pure: no I/O, no clock (the caller passes the time).

* ``received_header`` builds the ``Received:`` trace field that RFC 5321 section 4.4
  requires of every SMTP server that accepts a message, folded (RFC 5322 section 2.2.3) so
  that no line is over 78 characters where a break is possible.
* ``HeaderScan`` reads the header section at the start of the message text (the first
  stored chunk): the number of ``Received:`` fields, for loop detection (RFC 5321 section
  6.3), Message-ID, Subject and From, for people browsing the queue, and every field for
  the ``message:headers`` hook and the routing header (``hooks.py``).  Those come from
  that chunk only: a header section longer than a chunk loses the ones past it.  The
  Received count does not stop there: ``HeaderScan.more`` goes on counting in the chunks
  that follow until the section ends, so a loop whose trace fields are long (51 of them
  fill a 64 KiB chunk at ~1.3 KiB each) is still caught.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import Final

__all__ = [
    "MAX_RECEIVED",
    "HeaderScan",
    "address_literal",
    "protocol_keyword",
    "received_header",
    "scan_headers",
]

MAX_RECEIVED: Final = 50
"""More ``Received:`` fields than this and the message is taken to be looping (554 5.4.6).

RFC 5321 section 6.3 suggests a limit "large enough" to be safe (at least 100 is a common
reading, Postfix uses 50 by default with hopcount_limit); zoneq follows Postfix."""

_FOLD_WIDTH: Final = 78
_BROWSED: Final = {"message-id": "Message-ID", "subject": "Subject", "from": "From"}
_MAX_VALUE: Final = 998  # RFC 5322 section 2.1.1: what one line may hold
_MAX_CARRY: Final = 1000  # RFC 5321 section 4.5.3.1.6: a text line, CRLF included


# The Received field is built for every message, mostly from the same few values (one
# hostname, a few clients, one date per second): remembering the pieces cut it from ~22 us
# to ~3 us a message (about 2.5% of the core's CPU per message in accept_bench.py).
# Bounded caches, keyed by the peer's text at most 512 octets long (a command line).
@functools.lru_cache(maxsize=1024)
def address_literal(ip: str) -> str:
    """RFC 5321 section 4.1.3: ``[192.0.2.1]``, ``[IPv6:2001:db8::1]``."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return "[" + _clean(ip) + "]"
    if address.version == 6:
        return f"[IPv6:{address.compressed}]"
    return f"[{address}]"


@functools.lru_cache(maxsize=1024)
def _clean(text: str) -> str:
    """Peer-supplied text made safe inside the trace field: printable ASCII other than the
    characters that delimit its clauses (comments, the date separator)."""
    return "".join(c if 33 <= ord(c) < 127 and c not in "()\\;<>" else "?" for c in text)


def protocol_keyword(*, utf8: bool, esmtp: bool, tls: bool, auth: bool) -> str:
    """The ``with`` keyword of the Received field: SMTP after HELO, else ESMTP or UTF8SMTP
    (RFC 6531 section 3.7.3) with "S" for TLS and "A" for AUTH (RFC 3848 section 2)."""
    if not esmtp and not utf8:
        return "SMTP"
    return ("UTF8SMTP" if utf8 else "ESMTP") + ("S" if tls else "") + ("A" if auth else "")


def received_header(
    *,
    helo: str,
    client_ip: str,
    hostname: str,
    protocol: str,
    msg_id: str,
    recipient: str | None,
    now_ms: int,
) -> bytes:
    """The ``Received:`` field, CRLF-terminated (RFC 5321 section 4.4, RFC 5322 3.6.7).

    ``recipient`` is given only when the message has exactly one (section 7.2: listing
    several would disclose the others).  ``protocol`` is from ``protocol_keyword``.
    """
    parts = [
        "Received:",
        "from",
        _clean(helo) or "unknown",
        f"({address_literal(client_ip)})",
        "by",
        _clean(hostname),
        "(zoneq)",
        "with",
        protocol,
        "id",
        msg_id + ("" if recipient else ";"),
    ]
    if recipient:
        parts += ["for", f"<{recipient}>;"]
    parts += _date_words(now_ms // 1000)
    return _fold(parts).encode("utf-8") + b"\r\n"


@functools.lru_cache(maxsize=4)
def _date_words(second: int) -> tuple[str, ...]:
    """The RFC 5322 date-time of ``second`` (since the epoch, UTC), as words to fold."""
    return tuple(format_datetime(datetime.fromtimestamp(second, tz=UTC)).split(" "))


def _fold(words: list[str]) -> str:
    """Join words with spaces, breaking before a word that would pass the width."""
    lines: list[str] = []
    line = ""
    for word in words:
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= _FOLD_WIDTH:
            line += " " + word
        else:
            lines.append(line)
            line = "\t" + word
    lines.append(line)
    return "\r\n".join(lines)


@dataclass(slots=True)
class HeaderScan:
    """What ``scan_headers`` found: Received fields counted, and the browsing headers."""

    received: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    raw: list[bytes] = field(default_factory=list)
    """Every field in the section, unfolded, undecoded: decoded by ``fields`` only when a
    plugin or the routing header needs them, not for every message."""
    carry: bytes | None = None
    """While the section goes on past the text scanned so far: the start of its last,
    unfinished line (a line is at most 1,000 octets, RFC 5321 4.5.3.1.6, which the
    receiver enforces); ``None`` once the section has ended."""

    def more(self, text: bytes) -> None:
        """Count the Received fields in ``text``, the next piece of the message, while the
        header section goes on.  The section ends at the empty line, or at a line that is
        neither a field nor a fold of one (the body of a message with no empty line)."""
        carry = self.carry
        if carry is None:
            return
        text = carry + text
        end = text.rfind(b"\r\n")
        if end < 0:
            # No line ends here: a line past the receiver's limit is not a header section.
            self.carry = text if len(text) <= _MAX_CARRY else None
            return
        self.carry = text[end + 2 :]
        for line in text[:end].split(b"\r\n"):
            if line[:1] in (b" ", b"\t"):
                continue  # a fold of the field before (RFC 5322 section 2.2.3)
            name, colon, _ = line.partition(b":")
            if not colon:
                self.carry = None  # the empty line, or the body began
                return
            if name.rstrip(b" \t").lower() == b"received":
                self.received += 1

    def fields(self) -> tuple[tuple[str, str], ...]:
        """(name, value) pairs in message order, values unfolded and stripped (the shape
        of ``message:headers``); non-UTF-8 octets are replaced."""
        pairs: list[tuple[str, str]] = []
        for raw in self.raw:
            name, colon, value = raw.partition(b":")
            if colon:
                pairs.append(
                    (
                        name.strip(b" \t").decode("ascii", "replace"),
                        value.strip(b" \t").decode("utf-8", "replace"),
                    )
                )
        return tuple(pairs)


def scan_headers(text: bytes) -> HeaderScan:
    """Read the header section at the start of ``text`` (up to the first empty line, or
    the last complete line of ``text`` when the section goes on past it)."""
    end = text.find(b"\r\n\r\n")
    carry: bytes | None = None
    if end >= 0:
        section = text[: end + 2]
    elif text.startswith(b"\r\n"):
        section = b""  # no header section at all
    else:
        cut = text.rfind(b"\r\n") + 2 if b"\r\n" in text else 0
        section, carry = text[:cut], text[cut:]
    fields: list[bytes] = []
    scan = HeaderScan(raw=fields, carry=carry)
    for line in section.split(b"\r\n")[:-1]:
        if line[:1] in (b" ", b"\t") and fields:
            fields[-1] += b" " + line.strip(b" \t")  # unfold (RFC 5322 section 2.2.3)
        else:
            fields.append(line)
    for raw in fields:
        name, colon, value = raw.partition(b":")
        if not colon:
            scan.carry = None  # not a field: the body began (``more`` has nothing to read)
            continue
        key = name.strip(b" \t").decode("ascii", "replace").lower()
        if key == "received":
            scan.received += 1
        elif key in _BROWSED and _BROWSED[key] not in scan.headers:
            text_value = value.strip(b" \t").decode("utf-8", "replace")
            scan.headers[_BROWSED[key]] = text_value[:_MAX_VALUE]
    return scan
