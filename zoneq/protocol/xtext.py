"""xtext codecs for DSN parameters: RFC 3461 xtext and RFC 6533 utf-8-addr-xtext.

ENVID and ORCPT arrive in SMTP as xtext (RFC 3461 section 4) and are stored as received,
an ORCPT of the utf-8 addr-type in its 7-bit utf-8-addr-xtext form (``normal_orcpt``);
the DSN builder decodes them, and writes internationalized addresses in that form too.
``normal_orcpt`` is the one ORCPT grammar of both sides: the receiver stores only what it
returns and the delivery side sends only what it returns.  Pure functions; bad input
raises ``ProtocolError``.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Final

from zoneq.errors import ProtocolError

__all__ = [
    "MAX_ORCPT",
    "normal_orcpt",
    "printable_xtext_decode",
    "utf8_xtext_decode",
    "utf8_xtext_encode",
    "xtext_decode",
    "xtext_encode",
]

# RFC 3461 section 4.2: an ORCPT parameter "MUST NOT exceed 500 characters", as sent.  The
# receiver measures it as received; a utf-8 address stored in xtext may be longer (each
# non-ASCII character is up to ten), and is then not sent on (``sendable_orcpt``).
MAX_ORCPT: Final = 500
# RFC 3461 section 4: xchar is "!" to "~" except "+" and "="; hexchar is "+" and two hex
# digits (upper case per the RFC; lower case accepted, it is unambiguous).
_XTEXT_TOKEN: Final = re.compile(r"\+([0-9A-Fa-f]{2})|([\x21-\x2a\x2c-\x3c\x3e-\x7e]+)")
# RFC 6533 section 3: EmbeddedUnicodeChar is "\x{" HEXPOINT "}".
_EMBEDDED_CHAR: Final = re.compile(r"\\x\{([0-9A-Fa-f]{1,6})\}")
_MAX_CODE_POINT: Final = 0x10FFFF
# RFC 3461 section 4.2: addr-type is an atom (RFC 5322 section 3.2.3 atext), less "=",
# which an esmtp-value cannot carry (RFC 5321 section 4.1.2).
_ADDR_TYPE: Final = re.compile(r"[A-Za-z0-9!#$%&'*+/?^_`{|}~-]+")
# RFC 3461 sections 4.2 and 4.4: before xtext encoding, ORCPT and ENVID "MUST consist
# entirely of printable (graphic and white space) characters from the US-ASCII repertoire".
_PRINTABLE_ASCII: Final = re.compile(r"[\x20-\x7e]*")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def xtext_encode(value: str) -> str:
    """Encode ``value`` as RFC 3461 xtext (section 4).

    The text is taken as UTF-8 octets; every octet outside "!".."~", and "+" and "=", becomes
    "+" and two upper-case hex digits.  ASCII input (all RFC 3461 defines) gives plain xtext.
    """
    out: list[str] = []
    for octet in value.encode("utf-8"):
        if 0x21 <= octet <= 0x7E and octet not in (0x2B, 0x3D):
            out.append(chr(octet))
        else:
            out.append(f"+{octet:02X}")
    return "".join(out)


def xtext_decode(value: str) -> str:
    """Decode RFC 3461 xtext (section 4): "+HH" becomes the octet HH.

    The octets are read as UTF-8 (a superset of the ASCII RFC 3461 carries), so
    ``xtext_decode(xtext_encode(s)) == s`` for any string.  Raises ``ProtocolError`` for
    anything that is not xtext: a character outside "!".."~", a bare "=", a "+" without two
    hex digits, or octets that are not UTF-8.
    """
    data = bytearray()
    pos = 0
    while pos < len(value):
        match = _XTEXT_TOKEN.match(value, pos)
        if match is None:
            raise ProtocolError(f"not xtext (RFC 3461 section 4) at offset {pos}: {value!r}")
        hexchar, run = match.groups()
        if hexchar is not None:
            data.append(int(hexchar, 16))
        else:
            data += run.encode("ascii")
        pos = match.end()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"xtext does not decode to UTF-8: {value!r}") from exc


def _is_qchar(char: str) -> bool:
    # RFC 6533 section 3: QCHAR is printable ASCII except "+", "=" and "\".
    return "\x21" <= char <= "\x7e" and char not in "+=\\"


def utf8_xtext_encode(value: str) -> str:
    """Encode an address as RFC 6533 utf-8-addr-xtext (section 3), the 7-bit form.

    Every character that is not a QCHAR (printable ASCII except "+", "=" and "\\") becomes
    ``\\x{HEX}`` with its code point in upper-case hex, so ``usér@example.com`` is
    ``us\\x{E9}r@example.com``.  This is how an internationalized address is written in the
    ASCII-only ``message/delivery-status`` part.
    """
    return "".join(char if _is_qchar(char) else f"\\x{{{ord(char):02X}}}" for char in value)


def utf8_xtext_decode(value: str) -> str:
    """Decode RFC 6533 utf-8-addr-xtext or utf-8-addr-unitext (section 3).

    ``\\x{HEX}`` becomes the character with that code point; QCHARs and (the unitext form)
    non-ASCII characters stand for themselves.  Raises ``ProtocolError`` for anything else:
    a bare "\\", "+", "=", space or control character, or an escape that is not a Unicode
    scalar value.
    """
    out: list[str] = []
    pos = 0
    while pos < len(value):
        char = value[pos]
        if char == "\\":
            match = _EMBEDDED_CHAR.match(value, pos)
            if match is None:
                raise ProtocolError(f"bad \\x{{...}} escape at offset {pos}: {value!r}")
            code = int(match.group(1), 16)
            if code > _MAX_CODE_POINT or 0xD800 <= code <= 0xDFFF:
                raise ProtocolError(f"\\x{{{match.group(1)}}} is not a Unicode scalar value")
            out.append(chr(code))
            pos = match.end()
        elif _is_qchar(char) or (char > "\x7f" and unicodedata.category(char) != "Cs"):
            out.append(char)
            pos += 1
        else:
            raise ProtocolError(f"character {char!r} not allowed at offset {pos}: {value!r}")
    return "".join(out)


def printable_xtext_decode(value: str) -> str:
    """``xtext_decode``, and the decoded text printable US-ASCII, as RFC 3461 sections 4.2
    (ORCPT) and 4.4 (ENVID) require: ``x+0D+0Ay`` and ``caf+C3+A9`` are refused
    (``ProtocolError``), the first a CR LF for any later hop to write into a DSN."""
    decoded = xtext_decode(value)
    if not _PRINTABLE_ASCII.fullmatch(decoded):
        raise ProtocolError(f"xtext decodes to other than printable US-ASCII: {value!r}")
    return decoded


def normal_orcpt(value: str, *, unitext: bool) -> str:
    """An ORCPT value (``addr-type;xtext``, RFC 3461 section 4.2) in the form zoneq stores
    and sends, or ``ProtocolError``.

    The addr-type is an atom; its address must decode to printable US-ASCII, except for the
    utf-8 addr-type (RFC 6533 section 3), whose address is returned in utf-8-addr-xtext:
    the unitext form (raw UTF-8, allowed only with SMTPUTF8, ``unitext``) could not be sent
    to a next hop without SMTPUTF8, and the xtext form can be sent to any.  No length is
    checked: ``MAX_ORCPT`` applies to the parameter as sent, which the caller measures.
    """
    addr_type, semicolon, encoded = value.partition(";")
    if not semicolon or not encoded or not _ADDR_TYPE.fullmatch(addr_type):
        raise ProtocolError(f"ORCPT is not addr-type;xtext: {value!r}")
    if addr_type.lower() != "utf-8":
        printable_xtext_decode(encoded)
        return value
    if not unitext and not encoded.isascii():
        raise ProtocolError(f"ORCPT in utf-8-addr-unitext without SMTPUTF8: {value!r}")
    address = utf8_xtext_decode(encoded)
    if _CONTROL.search(address):  # \x{D} decodes to a CR: never in an address
        raise ProtocolError(f"ORCPT decodes to a control character: {value!r}")
    return f"{addr_type};{utf8_xtext_encode(address)}"
