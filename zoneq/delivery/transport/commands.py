"""The command lines of a mail transaction (RFC 5321 section 4.1.1), with their parameters.

Lines are written to the connection as they are built here, so nothing from a message may put
a CR or LF (or any control character) into one: that would inject a command (RFC 5321 section
2.3.8 forbids control characters in commands).  Addresses with them are settled by the
session before any line is built (``has_control``); ENVID and the HELO name are checked by
:func:`check_arguments` when ``deliver`` is called; :func:`_line` refuses anything that
slipped through.

An ORCPT is sent in the form ``normal_orcpt`` gives, the receiver's own grammar (so a
utf-8 one an older zoneq stored raw goes out as utf-8-addr-xtext); one it refuses (stored
by an older zoneq: an address decoding to a CR LF), or one longer in that form than the
500 characters a parameter may have (RFC 3461 section 4.2: the receiver measures it as
received, in the shorter unitext form), is left out of the RCPT, logged once per
``deliver``, not made the whole job's failure: section 4.2 makes ORCPT optional information.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Final

from zoneq.delivery.transport.options import MailOptions, Recipient
from zoneq.errors import ProtocolError
from zoneq.protocol.dsn import Notify
from zoneq.protocol.xtext import MAX_ORCPT, normal_orcpt

log = logging.getLogger(__name__)

_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_BYTES: Final = re.compile(rb"[\x00-\x1f\x7f]")
# ENVID is xtext (RFC 3461 section 4); a HELO name has no spaces.
_PRINTABLE: Final = re.compile(r"[\x21-\x7e]+")

RSET: Final = b"RSET\r\n"
DATA: Final = b"DATA\r\n"
END_OF_DATA_ALONE: Final = b".\r\n"


def has_control(address: str) -> bool:
    return bool(_CONTROL.search(address))


def check_arguments(helo_name: str, recipients: Sequence[Recipient], options: MailOptions) -> None:
    """Refuse (ValueError) what is a caller's mistake rather than a remote outcome; log an
    ORCPT that ``rcpt_line`` will leave out (stored data, not the caller's mistake)."""
    if not _PRINTABLE.fullmatch(helo_name):
        raise ValueError(f"helo_name must be printable ASCII without spaces: {helo_name!r}")
    if options.envid is not None and not _PRINTABLE.fullmatch(options.envid):
        raise ValueError(f"ENVID must be xtext (RFC 3461 section 4.4): {options.envid!r}")
    if options.size is not None and options.size < 0:
        raise ValueError(f"size must not be negative: {options.size}")
    for recipient in recipients:
        if Notify.NEVER in recipient.notify and len(recipient.notify) > 1:
            raise ValueError("NOTIFY=NEVER cannot be combined (RFC 3461 section 4.1)")
        if recipient.orcpt is not None and sendable_orcpt(recipient.orcpt) is None:
            log.warning(
                "ORCPT of %s left out, not addr-type;xtext of at most %d characters "
                "(RFC 3461 4.2): %r",
                recipient.address,
                MAX_ORCPT,
                recipient.orcpt,
            )


def sendable_orcpt(orcpt: str) -> str | None:
    """``orcpt`` as it is sent (``normal_orcpt``: a utf-8 address in its 7-bit form), or
    None when it cannot be sent at all: not addr-type;xtext, or too long as sent."""
    try:
        sent = normal_orcpt(orcpt, unitext=True)
    except ProtocolError:
        return None
    return sent if len(sent) <= MAX_ORCPT else None


def _address(address: str) -> bytes:
    return b"<" + address.encode("utf-8") + b">"


def _line(words: list[bytes]) -> bytes:
    line = b" ".join(words)
    if _CONTROL_BYTES.search(line):  # pragma: no cover - the checks above keep them out
        raise ValueError(f"a command may not contain control characters: {line!r}")
    return line + b"\r\n"


def mail_line(sender: str, options: MailOptions, ext: Mapping[str, str], utf8: bool) -> bytes:
    """MAIL FROM with each parameter the server offers (RFC 1870, 6152, 6531, 3461)."""
    words = [b"MAIL", b"FROM:" + _address(sender)]
    if options.size is not None and "SIZE" in ext:
        words.append(b"SIZE=%d" % options.size)
    if options.eight_bit and "8BITMIME" in ext:
        words.append(b"BODY=8BITMIME")
    if utf8:
        words.append(b"SMTPUTF8")
    if "DSN" in ext:
        if options.ret is not None:
            words.append(b"RET=" + options.ret.value.encode("ascii"))
        if options.envid is not None:
            words.append(b"ENVID=" + options.envid.encode("ascii"))
    return _line(words)


def rcpt_line(recipient: Recipient, ext: Mapping[str, str]) -> bytes:
    """RCPT TO with NOTIFY and ORCPT when the server offers DSN (RFC 3461 section 4)."""
    words = [b"RCPT", b"TO:" + _address(recipient.address)]
    if "DSN" in ext:
        if recipient.notify:
            # A fixed order, so the command is the same whatever the set's order.
            keywords = [n.value for n in Notify if n in recipient.notify]
            words.append(b"NOTIFY=" + ",".join(keywords).encode("ascii"))
        orcpt = None if recipient.orcpt is None else sendable_orcpt(recipient.orcpt)
        if orcpt is not None:
            words.append(b"ORCPT=" + orcpt.encode("ascii"))
    return _line(words)
