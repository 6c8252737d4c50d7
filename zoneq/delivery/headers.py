"""The copy of a message that goes out: fields added in front, the routing header taken out.

Theory of operation
-------------------
The stored message is what the client sent, plus our Received field, including the routing
header (``routing.zone_header``, ``X-Sending-Zone``) that chose its zone; issue 5 says that
header is never delivered.  The field removed is the one named when the message came
(``Job.zone_header``, from its metadata), so renaming the header in the config does not let
mail queued before the rename leak the old one; mail queued before that name was recorded
has the configured name removed.  Plugins at ``sender:headers`` (DKIM) may add fields in front
(RFC 6376 section 5.6: a DKIM-Signature is prepended, like a trace field).  Both changes are
made while the body streams: :class:`OutgoingBody` wraps the body source, buffers chunks
only until the header section has ended (the first empty line, RFC 5322 section 2.1), and
yields ``added + header section without the routing field + the rest`` followed by the
remaining chunks as they come.  Memory stays bounded by one chunk plus the header section,
and a header section that never ends within ``HEADER_LIMIT`` is treated as ending there
(what comes after is passed through as it is).

Most messages are one chunk with a header section well inside it, so the usual cost is one
search for the empty line and one for the header's name.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Final

from zoneq.delivery.transport import BodySource
from zoneq.delivery.transport.data import body_chunks

__all__ = ["HEADER_LIMIT", "OutgoingBody", "without_field"]

HEADER_LIMIT: Final = 1 << 20
"""The most of a header section buffered while looking for its end."""


def _header_end(data: bytes | bytearray) -> int | None:
    """Where the header section ends (after the empty line), or None if not yet seen."""
    if data.startswith(b"\r\n"):
        return 2  # no header fields at all
    if data.startswith(b"\n"):
        return 1
    crlf = data.find(b"\r\n\r\n")
    # A bare-LF empty line counts too, if it comes first; looked for only up to the CRLF one
    # (most mail has none, and a search to the end of a 64 KiB chunk is wasted time).
    lf = data.find(b"\n\n", 0, len(data) if crlf < 0 else crlf)
    if lf >= 0:
        return lf + 2
    return crlf + 4 if crlf >= 0 else None


def without_field(header: bytes, name: str) -> bytes:
    """``header`` (a header section) without any field called ``name``, continuation lines
    (folding, RFC 5322 section 2.2.3) included; the same bytes when there is none."""
    needle = name.lower().encode()
    if needle not in header.lower():
        return header
    start = re.compile(re.escape(needle) + rb"[ \t]*:", re.IGNORECASE)
    kept: list[bytes] = []
    dropping = False
    for line in header.splitlines(keepends=True):
        if dropping and line[:1] in (b" ", b"\t"):
            continue  # a continuation of the field being dropped
        dropping = start.match(line) is not None
        if not dropping:
            kept.append(line)
    return b"".join(kept)


async def _sections(source: BodySource) -> AsyncGenerator[tuple[bool, bytes], None]:
    """The body as ``(True, header section)`` once, then ``(False, piece)`` for the rest."""
    head: bytearray | None = bytearray()  # None once the header section is behind us
    chunks = body_chunks(source())
    try:
        async for chunk in chunks:
            if head is None:
                yield False, chunk
                continue
            head += chunk
            end = _header_end(head)
            if end is None:
                if len(head) < HEADER_LIMIT:
                    continue
                end = len(head)
            yield True, bytes(head[:end])
            if end < len(head):
                yield False, bytes(head[end:])
            head = None
        if head is not None:  # ended inside the header section (no body)
            yield True, bytes(head)
    finally:
        await chunks.aclose()


class OutgoingBody:
    """A body source (``BodySource``) for the copy that goes out; see the module docstring.

    ``header()`` and ``body()`` give the header section as sent (without ``added``) and the
    rest, separately, for the ``sender:headers`` hook.  ``header()`` reads the source once
    per attempt (the hook and the SMTPUTF8 check both ask); a failed read is not kept.
    """

    def __init__(self, source: BodySource, drop: str, added: bytes = b"") -> None:
        self._source = source
        self._drop = drop
        self.added = added
        self._header: bytes | None = None  # ``header()``, once read

    def __call__(self) -> AsyncIterator[bytes]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[bytes]:
        # ``_sections`` inlined, with a fast path: this runs for every message sent, and most
        # are one chunk holding the whole header section, with nothing to add or remove,
        # which then goes out as it is, not copied.
        head: bytearray | None = None
        done = False
        chunks = body_chunks(self._source())
        try:
            async for chunk in chunks:
                if done:
                    yield chunk
                    continue
                if head is None:
                    end = _header_end(chunk)
                    if end is not None:
                        done = True
                        yield self._edited(chunk, end)
                        continue
                    head = bytearray(chunk)
                else:
                    head += chunk
                end = _header_end(head)
                if end is None and len(head) >= HEADER_LIMIT:
                    end = len(head)
                if end is not None:
                    done = True
                    yield self._edited(bytes(head), end)
                    head = None
            if not done:  # ended inside the header section (no body)
                yield self._edited(bytes(head or b""), len(head or b""))
        finally:
            await chunks.aclose()

    def _edited(self, data: bytes, end: int) -> bytes:
        """``data`` (header section up to ``end``, then body) as it goes out."""
        header = data[:end] if end < len(data) else data
        kept = without_field(header, self._drop)
        if kept is header and not self.added:
            return data
        return self.added + kept + data[end:]

    async def header(self) -> bytes:
        """The header section as it goes out (routing header removed, nothing added)."""
        if self._header is None:
            self._header = await self._read_header()
        return self._header

    async def _read_header(self) -> bytes:
        sections = _sections(self._source)
        try:
            async for _is_head, data in sections:  # the first item is the header section
                return without_field(data, self._drop)
        finally:
            await sections.aclose()
        return b""

    async def body(self) -> AsyncIterator[bytes]:
        """Everything after the header section, chunk by chunk."""
        async for is_head, data in _sections(self._source):
            if not is_head:
                yield data
