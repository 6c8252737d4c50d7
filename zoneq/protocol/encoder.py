"""Streaming encoder for the SMTP DATA payload: line endings, dot-stuffing, folding, terminator.

Theory of operation
-------------------
A message body arrives as ordered chunks (the store keeps 64 KiB chunks) and must reach the wire
without ever being held whole.  Per chunk, :class:`DotStuffer` does five things, in this order:

0. **NUL octets are dropped.**  NUL is not message text (RFC 5322 section 3.5 ``text``; RFC 2045
   sections 2.7-2.8 forbid it in 7bit and 8bit data; only BINARYMIME, RFC 3030, carries it, and
   zoneq never sends that).  The SMTP smuggling research (SEC Consult, 2023) found receivers that
   take ``<CR><LF>NUL.<CR><LF>`` for the end of data: they drop NULs, or end a line at one.
   Dot-stuffing a line that starts with NULs then ``.`` would cover the first kind only; with no
   NUL on the wire neither kind can be fooled, which is also the fix proposed on oss-security
   (2024-04-30): strip the NULs, then dot-stuff.  The receiver refuses NUL in DATA, so only text
   that came in another way (or before that check) loses anything, and only octets that were
   never allowed.
1. **Line endings.**  Every CRLF, bare CR and bare LF becomes one CRLF (RFC 5321 section 2.3.8:
   a client sends CR and LF only as a CRLF pair).  This is what stops SMTP smuggling
   (CVE-2023-51764/-51765/-51766): ``<LF>.<LF>`` or ``<CR>.<CR>`` in a stored body would otherwise
   reach a receiver that takes it for the end of data.
2. **Dot-stuffing.**  A line that starts with ``.`` gets a second ``.`` (RFC 5321 section 4.5.2).
3. **Folding.**  A line longer than ``max_line_length`` octets (CRLF not counted) is broken by
   inserting CRLF SPACE, as Postfix's ``smtp_line_length_limit`` does: RFC 5321 section
   4.5.3.1.6 caps a text line at 1000 octets with its CRLF, and a receiver may refuse longer
   ones.  The space turns the break into header folding inside headers (RFC 5322 section 2.2.3)
   and leaves the least damage elsewhere.  The doubled dot is *not* counted, as the RFC has it
   ("not counting the leading dot duplicated for transparency"): the receiver, the API and
   ``zoneq.queue.line_limit`` accept a line of 998 octets after unstuffing, so one that
   starts with ``.`` must reach the recipient unchanged, 999 octets on the wire.  A line is
   folded only when its text (what the recipient gets) is over ``max_line_length``.
   ``max_line_length=0`` turns folding off.
4. **Terminator.**  :meth:`DotStuffer.finish` adds CRLF if the body did not end with a line
   ending, then ``.`` CRLF, so the payload always ends in CRLF ``.`` CRLF (section 4.1.1.4).
   An empty body is sent as ``.`` CRLF alone.

Chunk boundaries carry only two pieces of state, so nothing is ever held back:

* ``_col``: octets already sent on the current wire line, a doubled dot not counted.  Zero means
  "at the start of a line", the only place a dot needs doubling (a folded continuation starts
  with SPACE, so it is never zero mid-line, and a doubled dot alone counts one).  Folding uses it
  to know how much room the line has left, and only breaks a line when a further octet actually
  arrives, so a line ending exactly at the limit is not followed by an empty continuation.  A
  wire line that starts with ``.`` is always a dot-stuffed one: that dot is the one not counted.
* ``_skip_lf``: the previous chunk ended in CR.  That CR was already sent as CRLF; if the next
  chunk starts with LF, that LF is the second half of the same line ending and is dropped.

Hence the output does not depend on where the chunk boundaries fall.

Speed: the work is done with ``bytes`` methods that run in C (``replace``, ``count``, ``find``),
never a Python loop per octet or per line on the common path.  A chunk that is already pure CRLF
(what the store normally holds) skips normalisation, dot-stuffing is one ``replace`` of
CRLF ``.`` with CRLF ``..``, and a cheap scan (:func:`_fits`) usually proves that no line is too
long, so the exact folding code (a split into lines) only runs on chunks that may need it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from zoneq.errors import ProtocolError

__all__ = ["DEFAULT_MAX_LINE_LENGTH", "DotStuffer", "dot_stuff", "dot_unstuff"]

#: RFC 5321 section 4.5.3.1.6: 1000 octets per text line including CRLF.
DEFAULT_MAX_LINE_LENGTH = 998

_CRLF = b"\r\n"
_FOLD = b"\r\n "  # Postfix-style break: the continuation line starts with one SPACE.
_TERMINATOR = b".\r\n"


def _count_byte(data: bytes, byte: bytes) -> int:
    """How many times the single octet ``byte`` occurs in ``data``.

    On CPython 3.11 ``bytes.count`` of one octet is a plain loop, while ``replace`` finds single
    octets with ``memchr``: measured on a 64 KiB chunk, this is over twice as fast despite the
    copy.
    """
    return len(data) - len(data.replace(byte, b""))


def to_crlf(data: bytes) -> bytes:
    """Turn every CRLF, bare CR and bare LF of ``data`` into CRLF (RFC 5321 section 2.3.8)."""
    if b"\r" not in data:
        return data.replace(b"\n", _CRLF)  # LF-only text (or no line ending at all)
    crlf = data.count(_CRLF)
    if _count_byte(data, b"\r") == crlf and _count_byte(data, b"\n") == crlf:
        return data  # every CR and every LF belongs to a CRLF pair: already clean
    # CRLF -> LF first, so that every CR left over is a bare one; then all are LF, then CRLF.
    return data.replace(_CRLF, b"\n").replace(b"\r", b"\n").replace(b"\n", _CRLF)


def _fits(wire: bytes, col: int, limit: int) -> bool:
    """Cheap, conservative check: True only if no line of ``wire`` exceeds ``limit`` octets.

    ``wire`` has CRLF line endings only and continues a line that already holds ``col`` octets.
    Measuring every line exactly needs a split (one object per line); instead, look for an LF in
    windows of ``limit // 2 + 1`` octets stepping from the first LF to the last.  If each window
    holds one, no two LFs are more than ``limit + 2`` apart (two windows' worth, less one), which
    is a line of at most ``limit`` octets plus its CRLF.  A False may be a false alarm; the caller
    then measures exactly.
    """
    first = wire.find(b"\n")
    if first < 0:
        return col + len(wire) <= limit
    last = wire.rfind(b"\n")
    # First line: ``col`` earlier octets, then everything before its CR.  Last: the open tail.
    if col + first - 1 > limit or len(wire) - last - 1 > limit:
        return False
    step = limit // 2 + 1
    find = wire.find
    return all(find(b"\n", start + 1, start + 1 + step) >= 0 for start in range(first, last, step))


def _fold_segment(segment: bytes, col: int, limit: int) -> bytes:
    """Break one line piece (no CR or LF in it) that continues a line of ``col`` octets."""
    room = limit - col
    if len(segment) <= room:
        return segment
    # ``room`` may be 0: the line is exactly full, so the break goes before the first octet.
    pieces = [segment[:room]]
    step = limit - 1  # each continuation line spends one octet on its leading SPACE
    pieces.extend(segment[i : i + step] for i in range(room, len(segment), step))
    return _FOLD.join(pieces)


def _fold(wire: bytes, col: int, limit: int) -> bytes:
    """Fold every line of ``wire`` (CRLF endings only) that is longer than ``limit`` octets,
    a doubled dot not counted (RFC 5321 4.5.3.1.6): such a line starts as if at column -1.
    ``col`` is the first line's, already -1 when it starts with a doubled dot."""
    lines = wire.split(_CRLF)
    lines[0] = _fold_segment(lines[0], col, limit)
    lines[1:] = [
        _fold_segment(line, -(line[:1] == b"."), limit) if len(line) > limit else line
        for line in lines[1:]
    ]
    return _CRLF.join(lines)


class DotStuffer:
    """Turns body chunks into SMTP DATA wire bytes; see the module docstring.

    Call :meth:`feed` for each chunk in order and send what it returns, then send what
    :meth:`finish` returns.  Nothing is held back between calls: each returned piece is final.
    """

    def __init__(self, max_line_length: int = DEFAULT_MAX_LINE_LENGTH) -> None:
        # With a limit of 1, a continuation line (SPACE plus at least one octet) could never
        # make progress.
        if max_line_length != 0 and max_line_length < 2:
            raise ValueError("max_line_length must be 0 (no folding) or at least 2")
        self._limit = max_line_length
        self._col = 0
        self._skip_lf = False
        self._finished = False

    def feed(self, chunk: bytes) -> bytes:
        """Encode the next chunk of the body; the result may be empty."""
        if self._finished:
            raise RuntimeError("feed() called after finish()")
        # NULs go first (``in`` is memchr: free on the common path), so that CR NUL LF cut
        # across chunks is one line ending, as it is in one chunk.
        if b"\0" in chunk:
            chunk = chunk.replace(b"\0", b"")
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk[0] == 0x0A:  # LF completing the CR that ended the previous chunk
                chunk = chunk[1:]
        if not chunk:
            return b""
        # A trailing CR is sent now as CRLF; an LF opening the next chunk is then dropped.
        self._skip_lf = chunk[-1] == 0x0D
        wire = to_crlf(chunk).replace(b"\r\n.", b"\r\n..")
        col = self._col
        if col == 0 and wire[0] == 0x2E:  # the chunk starts a line with "."
            wire = b"." + wire
            col = -1  # the doubled dot is not counted
        if self._limit and not _fits(wire, col, self._limit):
            wire = _fold(wire, col, self._limit)
        last_lf = wire.rfind(b"\n")
        if last_lf < 0:  # the line goes on
            self._col = col + len(wire)
        else:
            self._col = len(wire) - last_lf - 1 - wire.startswith(b".", last_lf + 1)
        return wire

    def finish(self) -> bytes:
        """End the body: CRLF if the last line is open, then the ``.`` CRLF terminator."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        return _TERMINATOR if self._col == 0 else _CRLF + _TERMINATOR


def dot_stuff(
    chunks: Iterable[bytes], max_line_length: int = DEFAULT_MAX_LINE_LENGTH
) -> Iterator[bytes]:
    """Yield the DATA wire bytes for a body given as chunks, terminator included."""
    stuffer = DotStuffer(max_line_length)
    for chunk in chunks:
        wire = stuffer.feed(chunk)
        if wire:
            yield wire
    yield stuffer.finish()


def dot_unstuff(wire: bytes) -> bytes:
    """Recover the body from a complete DATA payload that ends in CRLF ``.`` CRLF.

    Follows the receiver's rule of RFC 5321 section 4.5.2: the first ``.`` of a line is
    dropped (``..x`` gives ``.x``; a single ``.x`` gives ``x``).  Folding is not undone: the
    inserted CRLF SPACE cannot be told apart from body text.  The body comes back with CRLF line
    endings and ends in CRLF unless it is empty.

    Raises ProtocolError for a bare CR or LF, a missing terminator, or a ``.`` line before the
    end (data after the end of the payload).
    """
    if wire == _TERMINATOR:
        return b""  # an empty body: the terminator is the first line
    if not wire.endswith(b"\r\n.\r\n"):
        raise ProtocolError("DATA payload does not end with CRLF . CRLF")
    # A leading CRLF puts every line, the first included, after a CRLF for the searches below.
    body = _CRLF + wire[: -len(_TERMINATOR)]
    crlf = body.count(_CRLF)
    if body.count(b"\r") != crlf or body.count(b"\n") != crlf:
        raise ProtocolError("bare CR or LF in DATA payload")
    if b"\r\n.\r\n" in body:
        raise ProtocolError("end-of-data line before the end of the DATA payload")
    return body.replace(b"\r\n.", _CRLF)[len(_CRLF) :]
