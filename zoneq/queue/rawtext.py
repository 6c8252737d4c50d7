"""Raw message text as it streams in: line ends made CRLF, and the header section found.

A raw upload may end its lines in CRLF, bare LF or bare CR.  SMTP refuses the bare ones
(RFC 5321 section 2.3.8: only CRLF ends a line; accepting others is the 2023 smuggling
hole), but a file on disk, ``sendmail``-style, routinely has LF: so every line end is made
CRLF as the text arrives (``CrlfLines``).  The stored text is then what goes on the wire,
its size is the SIZE= the delivery announces (RFC 1870), and there is one notion of "line"
for everything that reads it afterwards.  A CR at the end of one piece is held back until
the next shows whether an LF follows; text that ends without a line end gets one (RFC 5322
section 2.3: the body is lines, each ending in CRLF).

``HeaderSection`` buffers the start of that (CRLF) text until the header section has ended,
by the rule Python's ``email`` parser applies, so the fields parsed, the Bcc removed and the
recipients taken are the same lines: the section is every line that is a field (a name and
a colon), a fold (starting with a space or tab) or an mbox ``From `` line, up to the first
empty line, the first line that is none of these, or the end of the text (a message with
no body).  It is bounded: a section still open past ``limit`` octets is refused.
"""

from __future__ import annotations

import re
from typing import Final

from zoneq.protocol.encoder import to_crlf

__all__ = ["HEADER_LIMIT", "CrlfLines", "HeaderSection", "SectionTooLong", "crlf"]

HEADER_LIMIT: Final = 1 << 20
"""The most of a header section buffered while looking for its end (1 MiB)."""

# email.feedparser's headerRE, on bytes: what the parser takes as a line of the header
# section (BytesParser decodes non-ASCII octets to surrogates, which this class excludes).
_SECTION_LINE: Final = re.compile(rb"From |[\x21-\x39\x3b-\x7e]*:|[\t ]")


# ``data`` with every CRLF, bare CR and bare LF made CRLF: the delivery encoder's own.
crlf = to_crlf


class CrlfLines:
    """Pieces of text in, the same text with CRLF line ends out (see the module docstring)."""

    def __init__(self) -> None:
        self._held_cr = False
        self._seen = False
        self._ends_line = False

    def feed(self, data: bytes) -> bytes:
        if self._held_cr:
            data = b"\r" + data
            self._held_cr = False
        if data.endswith(b"\r"):
            data = data[:-1]  # a CRLF cut in two, or a bare CR: the next piece tells
            self._held_cr = True
        out = crlf(data)
        if out:
            self._seen = True
            self._ends_line = out.endswith(b"\n")
        return out

    def end(self) -> bytes:
        """What is still owed at the end of the text: a held CR, or a last line end."""
        if self._held_cr:
            self._held_cr = False
            self._ends_line = True
            return b"\r\n"
        if self._seen and not self._ends_line:
            self._ends_line = True
            return b"\r\n"
        return b""


class SectionTooLong(ValueError):
    """The header section goes on past the limit."""


class HeaderSection:
    """The start of a CRLF text, buffered until its header section has ended."""

    def __init__(self, limit: int = HEADER_LIMIT) -> None:
        self.limit = limit
        self.text = bytearray()
        self.end: int | None = None
        """Where the section ends in ``text``: the empty line (or the first line of the
        body) starts there; None while it goes on."""
        self._scan = 0  # the start of the first line not yet looked at

    def feed(self, data: bytes) -> bool:
        """Take the next piece of text; whether the section has now ended.  Raises
        ``SectionTooLong`` when it goes on past ``limit``."""
        text = self.text
        text += data
        while (line_end := text.find(b"\r\n", self._scan)) >= 0:
            start = self._scan
            if line_end == start or _SECTION_LINE.match(text, start) is None:
                self.end = start  # the empty line, or a line that is the body's first
                break
            self._scan = line_end + 2
        if (len(text) if self.end is None else self.end) > self.limit:
            raise SectionTooLong(f"header section longer than {self.limit} octets")
        return self.end is not None

    def finish(self) -> None:
        """The text has ended (after ``CrlfLines.end``): so has the section."""
        if self.end is None:
            self.end = len(self.text)

    @property
    def section(self) -> bytes:
        assert self.end is not None
        return bytes(self.text[: self.end])

    @property
    def rest(self) -> bytes:
        assert self.end is not None
        return bytes(self.text[self.end :])
