"""Text lines of at most 998 octets, checked as the text streams in.

RFC 5322 section 2.1.1: "Each line of characters MUST be no more than 998 characters ...
excluding the CRLF" (RFC 5321 section 4.5.3.1.6: 1000 octets with it).  The SMTP receiver
refuses a longer line with 500 5.5.2; a submission over the HTTP API is refused too rather
than stored: the delivery encoder would fold it on the way out, so the recipient would get
other text than was accepted (and a DKIM signature over it would break).

``LineLimit`` is fed CRLF text (``zoneq.queue.rawtext.CrlfLines``'s output: a CRLF is never
cut in two between pieces, as a trailing CR is held back) and counts lines from 1, so the
refusal can name the line.  One ``bytes.split`` per piece keeps the scan at C speed.
"""

from __future__ import annotations

from typing import Final

from zoneq.protocol.encoder import DEFAULT_MAX_LINE_LENGTH

__all__ = ["MAX_LINE", "LineLimit", "LineTooLong", "check_lines"]

MAX_LINE: Final = DEFAULT_MAX_LINE_LENGTH
"""The most octets a line may hold, its CRLF not counted (RFC 5322 section 2.1.1)."""


class LineTooLong(ValueError):
    """A line of the text is longer than the limit."""

    def __init__(self, line: int, limit: int) -> None:
        super().__init__(
            f"line {line} of the message is longer than {limit} octets (RFC 5322 section "
            f"2.1.1: {limit} at most, the CRLF not counted)"
        )
        self.line = line
        self.limit = limit


class LineLimit:
    """CRLF text in, piece by piece; ``LineTooLong`` as soon as a line is over ``limit``."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        self.limit = limit
        self.line = 1  # the number of the line the next octet belongs to
        self._run = 0  # octets of that line seen so far

    def feed(self, text: bytes) -> None:
        lines = text.split(b"\r\n")
        limit = self.limit
        self._run += len(lines[0])
        if len(lines) > 1:
            if self._run > limit:
                raise LineTooLong(self.line, limit)
            whole = lines[1:-1]
            if whole and max(map(len, whole)) > limit:  # rare: find which, for the message
                first = next(i for i, line in enumerate(whole) if len(line) > limit)
                raise LineTooLong(self.line + 1 + first, limit)
            self.line += len(lines) - 1
            self._run = len(lines[-1])
        if self._run > limit:
            raise LineTooLong(self.line, limit)


def check_lines(text: bytes, limit: int = MAX_LINE) -> None:
    """``LineTooLong`` when a line of the whole ``text`` is over ``limit``."""
    LineLimit(limit).feed(text)
