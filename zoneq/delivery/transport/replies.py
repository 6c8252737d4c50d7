"""Cutting the bytes an SMTP server sends into replies, with no I/O (sans-IO).

A reply is one or more lines, ``CODE-text`` for every line but the last and ``CODE text``
(or just ``CODE``) for the last (RFC 5321 section 4.2.1).  With PIPELINING (RFC 2920) a
server answers a group of commands with several replies, in order, in as many or as few
packets as it likes: several replies in one read, or one reply split over several.
:class:`ReplyReader` keeps whatever is not yet a whole reply and returns every whole one, in
order, so none is dropped and none is paired with the wrong command.  Each reply is parsed by
:func:`zoneq.protocol.replies.parse_reply`.

A server that sends endless text without a line end, or an endless multiline reply, would
make the buffer grow without bound; past ``max_line`` octets for one line or ``max_reply``
for one reply the reader gives up with a ProtocolError (RFC 5321 section 4.5.3.1.5 allows 512
octets per reply line; the limits here are generous, as real servers exceed it).
"""

from __future__ import annotations

from typing import Final

from zoneq.errors import ProtocolError
from zoneq.protocol.replies import Reply, parse_reply

MAX_LINE: Final = 8192
MAX_REPLY: Final = 65536


def _tolerant(line: bytes) -> bytes:
    """A remote reply line (ending LF) with any CR in its text made harmless.

    ``parse_reply`` refuses a bare CR, which suits the replies zoneq builds; but a server's
    "250 2.0.0 queued as 12345 <CR> ABC" or "250 Ok <CR><CR><LF>" is still a 250, and the
    client acts on the code, not the text (RFC 5321 section 4.2).  Refusing it would leave
    the final dot without a usable reply: a possible duplicate, retried into a second copy.
    So trailing CRs go and any other CR becomes a space.  A lone LF ends a line here, so
    none is ever inside one.
    """
    text = line.rstrip(b"\r\n").replace(b"\r", b" ")
    return text + b"\r\n"


class ReplyReader:
    """Feed it bytes as they arrive; it returns the replies they complete, in order.

    Lines end with LF (a bare LF is tolerated, as aiosmtplib does, and so is a CR anywhere
    in the text: :func:`_tolerant`; the client acts on the code).  After a ProtocolError the reader
    is spent: the connection is in no known state and must be closed.
    """

    def __init__(self, max_line: int = MAX_LINE, max_reply: int = MAX_REPLY) -> None:
        self._max_line = max_line
        self._max_reply = max_reply
        self._buffer = bytearray()
        self._lines: list[bytes] = []  # the lines of the reply being read
        self._size = 0
        self._failed: ProtocolError | None = None

    @property
    def pending(self) -> bool:
        """Is part of a reply waiting for the rest?"""
        return bool(self._buffer or self._lines)

    @property
    def failed(self) -> ProtocolError | None:
        """Why the reader gave up, if it has."""
        return self._failed

    def feed(self, data: bytes) -> list[Reply]:
        """The replies ``data`` completes.  Whole replies before garbage are still returned
        (the server did send them); the ProtocolError is then raised by the next call (see
        :attr:`failed`), or by this one if it completed none."""
        if self._failed is not None:
            raise self._failed
        replies: list[Reply] = []
        try:
            self._feed(data, replies)
        except ProtocolError as exc:
            self._failed = exc
            if not replies:
                raise
        return replies

    def _feed(self, data: bytes, replies: list[Reply]) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            line = bytes(buffer[start : end + 1])
            start = end + 1
            if len(line) > self._max_line:
                raise ProtocolError(f"reply line longer than {self._max_line} octets")
            self._size += len(line)
            if self._size > self._max_reply:
                raise ProtocolError(f"reply longer than {self._max_reply} octets")
            line = _tolerant(line)
            self._lines.append(line)
            if line[3:4] != b"-":  # the last line of this reply
                lines, self._lines, self._size = self._lines, [], 0
                replies.append(parse_reply(lines))
        del buffer[:start]
        if len(buffer) > self._max_line:
            raise ProtocolError(f"reply line longer than {self._max_line} octets")
