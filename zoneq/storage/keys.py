"""Key encoding for the LevelDB queue.

Theory of operation
-------------------
LevelDB orders keys bytewise, and every queue operation is a range scan, so the encoding
must keep three promises for any zone name or address (spaces, ``~``, NUL, any UTF-8):

1. no two different tuples encode to the same key, and no key of one tuple is a prefix of the
   key of a different tuple of the same family (so a prefix scan never picks up a neighbour:
   zone ``"a"`` must not see zone ``"a b"``);
2. bytewise order of keys equals the order of the tuples (element by element), so a range
   scan of ``delivery-zone <zone>`` is oldest-message-first;
3. every element can be decoded back.

ZoneMTA joined elements with spaces, which breaks 1 as soon as a zone or an address contains
one.  Here text is UTF-8 with ``0x01`` written as ``0x01 0x02`` and ``0x00`` as ``0x01 0x01``,
and a single ``0x00`` ending it.  The encoded text never contains ``0x00``, so the terminator
is unambiguous whatever follows it (a raw integer may start with any byte), no encoded
string is a prefix of another's encoding, and since ``0x00`` sorts below every byte of
encoded text a shorter string sorts first; the escapes keep ``0x00 < 0x01 < 0x02``.
(FoundationDB's ``0x00 0xFF`` escape is not prefix-free without its type codes: zone ``a``
would be a prefix of zone ``a<NUL>b``.)  Integers (message ids, event ids, times, chunk
numbers) are fixed-width big-endian unsigned, which sorts numerically.  Each family has a
fixed element schema, so no type tags are needed.  The family name leads every key as
readable text, as in ZoneMTA.

Families (ARCHITECTURE.md section 3, with the recipient record split by state, see
``zoneq/storage/store.py``)::

    message <id:u64> '#'                   head: created time, recipients still queued
    message <id:u64> '*'                   metadata (envelope, DSN, headers, size, source)
    message <id:u64> 'c' <n:u32>           body chunk n, in receiving order
    receiving <id:u64>                     DATA in progress: chunks without a commit yet
    delivery-zone <zone> <id:u64> <rcpt>   recipient ready (or leased) in <zone>
    deferred <zone> <id:u64> <rcpt>        recipient waiting for its next attempt
    due <zone> <ms:u64> <id:u64> <rcpt>    deferred index, ordered by next-attempt time
    held <zone> <id:u64> <rcpt>            recipient on hold by an administrator
    owed <id:u64> '*'                      a failure notice owed: the original's part it returns
    owed <id:u64> 'r' <zone> <rcpt>        a failed recipient that notice will list (``owed.py``)
    event <event-id:u64>                   delivery event (time-ordered id, as message ids)
    counter <name> <zone> <sub>            persisted O(1) counter (u64 value)
    meta <name>                            store-wide values (schema version, ...)
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from typing import Final

_U64: Final = struct.Struct(">Q")
_U32: Final = struct.Struct(">I")
_TERM: Final = b"\x00"
_UNESCAPE: Final = re.compile(b"\x01([\x01\x02])")


def text(value: str) -> bytes:
    """One text element: UTF-8, NUL escaped, NUL terminated (order- and prefix-safe)."""
    try:
        raw = value.encode()
    except UnicodeEncodeError:  # lone surrogates (undecodable input kept as-is)
        raw = value.encode("utf-8", "surrogatepass")
    if b"\x00" in raw or b"\x01" in raw:
        # 0x01 first, so the 0x01 bytes the second replace inserts are not escaped again.
        raw = raw.replace(b"\x01", b"\x01\x02").replace(b"\x00", b"\x01\x01")
    return raw + _TERM


def u64(value: int) -> bytes:
    return _U64.pack(value)


def _family(name: str) -> bytes:
    return text(name)


MESSAGE: Final = _family("message")
RECEIVING: Final = _family("receiving")
READY: Final = _family("delivery-zone")
DEFERRED: Final = _family("deferred")
DUE: Final = _family("due")
HELD: Final = _family("held")
OWED: Final = _family("owed")
EVENT: Final = _family("event")
COUNTER: Final = _family("counter")
META: Final = _family("meta")

# The three families a queued recipient's record can live in, one at a time.
RECORD_FAMILIES: Final = (READY, DEFERRED, HELD)

HEAD_PART: Final = b"#"
META_PART: Final = b"*"
CHUNK_PART: Final = b"c"
OWED_FAILURE_PART: Final = b"r"


def message_prefix(msg_id: int) -> bytes:
    return MESSAGE + _U64.pack(msg_id)


def message_head(msg_id: int) -> bytes:
    return MESSAGE + _U64.pack(msg_id) + HEAD_PART


def message_meta(msg_id: int) -> bytes:
    return MESSAGE + _U64.pack(msg_id) + META_PART


def message_chunk(msg_id: int, index: int) -> bytes:
    return MESSAGE + _U64.pack(msg_id) + CHUNK_PART + _U32.pack(index)


def chunk_prefix(msg_id: int) -> bytes:
    return MESSAGE + _U64.pack(msg_id) + CHUNK_PART


def owed_prefix(msg_id: int) -> bytes:
    return OWED + _U64.pack(msg_id)


def owed_original(msg_id: int) -> bytes:
    return OWED + _U64.pack(msg_id) + META_PART


def owed_failure(msg_id: int, zone: str, rcpt: str) -> bytes:
    return OWED + _U64.pack(msg_id) + OWED_FAILURE_PART + text(zone) + text(rcpt)


def receiving(msg_id: int) -> bytes:
    return RECEIVING + _U64.pack(msg_id)


def zone_prefix(family: bytes, zone: str) -> bytes:
    """All keys of ``family`` in ``zone`` (for READY, DEFERRED, HELD and DUE)."""
    return family + text(zone)


def record(family: bytes, zone: str, msg_id: int, rcpt: str) -> bytes:
    """A recipient record key in READY, DEFERRED or HELD."""
    return family + text(zone) + _U64.pack(msg_id) + text(rcpt)


def record_message_prefix(family: bytes, zone: str, msg_id: int) -> bytes:
    return family + text(zone) + _U64.pack(msg_id)


def due(zone: str, due_ms: int, msg_id: int, rcpt: str) -> bytes:
    return DUE + text(zone) + _U64.pack(due_ms) + _U64.pack(msg_id) + text(rcpt)


def event(event_id: int) -> bytes:
    return EVENT + _U64.pack(event_id)


def counter(name: str, zone: str, sub: str) -> bytes:
    return COUNTER + text(name) + text(zone) + text(sub)


def meta(name: str) -> bytes:
    return META + text(name)


# --- decoding -------------------------------------------------------------------------------


def _read_text(key: bytes, pos: int) -> tuple[str, int]:
    """Decode one text element starting at ``pos``; return it and the position after it."""
    end = key.find(b"\x00", pos)
    if end < 0:
        raise ValueError(f"unterminated text element in key {key!r}")
    raw = key[pos:end]
    if b"\x01" in raw:
        raw = _UNESCAPE.sub(lambda m: b"\x00" if m.group(1) == b"\x01" else b"\x01", raw)
    return raw.decode("utf-8", "surrogatepass"), end + 1


def split_text(key: bytes, pos: int = 0) -> tuple[str, int]:
    """Public form of the text decoder, for families with several text elements."""
    return _read_text(key, pos)


def decode_record(key: bytes) -> tuple[bytes, str, int, str]:
    """``(family, zone, msg_id, rcpt)`` of a READY, DEFERRED or HELD key."""
    for family in RECORD_FAMILIES:
        if key.startswith(family):
            zone, pos = _read_text(key, len(family))
            (msg_id,) = _U64.unpack_from(key, pos)
            rcpt, end = _read_text(key, pos + 8)
            if end != len(key):
                raise ValueError(f"trailing bytes in record key {key!r}")
            return family, zone, msg_id, rcpt
    raise ValueError(f"not a recipient record key: {key!r}")


def decode_due(key: bytes) -> tuple[str, int, int, str]:
    """``(zone, due_ms, msg_id, rcpt)`` of a DUE key."""
    if not key.startswith(DUE):
        raise ValueError(f"not a due key: {key!r}")
    zone, pos = _read_text(key, len(DUE))
    due_ms, msg_id = struct.unpack_from(">QQ", key, pos)
    rcpt, end = _read_text(key, pos + 16)
    if end != len(key):
        raise ValueError(f"trailing bytes in due key {key!r}")
    return zone, due_ms, msg_id, rcpt


def decode_message_key(key: bytes) -> tuple[int, bytes, int | None]:
    """``(msg_id, part, chunk_index or None)`` of a MESSAGE key."""
    if not key.startswith(MESSAGE) or len(key) < len(MESSAGE) + 9:
        raise ValueError(f"not a message key: {key!r}")
    (msg_id,) = _U64.unpack_from(key, len(MESSAGE))
    part = key[len(MESSAGE) + 8 : len(MESSAGE) + 9]
    if part == CHUNK_PART:
        (index,) = _U32.unpack_from(key, len(MESSAGE) + 9)
        return msg_id, part, index
    return msg_id, part, None


def decode_owed(key: bytes) -> int:
    """The message id of an OWED key."""
    (msg_id,) = _U64.unpack_from(key, len(OWED))
    return int(msg_id)


def decode_receiving(key: bytes) -> int:
    (msg_id,) = _U64.unpack_from(key, len(RECEIVING))
    return int(msg_id)


def decode_event(key: bytes) -> int:
    (event_id,) = _U64.unpack_from(key, len(EVENT))
    return int(event_id)


def decode_counter(key: bytes) -> tuple[str, str, str]:
    name, pos = _read_text(key, len(COUNTER))
    zone, pos = _read_text(key, pos)
    sub, _ = _read_text(key, pos)
    return name, zone, sub


def prefix_upper_bound(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with ``prefix`` (None: no bound)."""
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        return None
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


def zones_in(keys: Iterator[bytes], family: bytes) -> Iterator[str]:
    """Zone names of a sorted stream of ``family`` keys, each once (for start-up discovery)."""
    last: str | None = None
    for key in keys:
        zone, _ = _read_text(key, len(family))
        if zone != last:
            last = zone
            yield zone
