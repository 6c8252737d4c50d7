"""Frames on the core-worker socket: a 4-byte big-endian length, then a msgpack payload.

Theory of operation
-------------------
A Unix stream socket delivers bytes, not messages, so each message is prefixed with its
length.  ``encode_frame`` packs one object; a ``FrameDecoder`` is fed whatever ``read()``
returned, in whatever pieces, and hands back every frame completed so far, keeping the tail
of an unfinished frame for the next call.

The length is checked as soon as its 4 bytes are in, before any of the payload is buffered,
so a peer that announces a 4 GiB frame is refused at once instead of being allowed to fill
our memory.  A payload that is not exactly one msgpack object is refused too.  Both raise
``ProtocolError``; the decoder is then unusable and the caller closes the connection (there
is no way to find the next frame boundary in a corrupted stream).

Strings travel as msgpack str and bytes as bin (``use_bin_type``), and str is decoded as str
(``raw=False``), so ``bytes`` and ``str`` survive the round trip as themselves.

Pure: no asyncio, no sockets.
"""

from __future__ import annotations

import struct
from typing import Final

import msgpack

from zoneq.errors import ProtocolError

__all__ = ["DEFAULT_MAX_FRAME", "HEADER_SIZE", "FrameDecoder", "encode_frame"]

# A body chunk plus its envelope must fit; 16 MiB leaves room for generous chunk sizes while
# bounding what one connection can make the core buffer.
DEFAULT_MAX_FRAME: Final = 16 * 1024 * 1024

_HEADER: Final = struct.Struct(">I")
HEADER_SIZE: Final = _HEADER.size


def encode_frame(obj: object, *, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """One frame holding ``obj``.

    Raises ``ValueError`` if ``obj`` cannot be packed (a type msgpack does not carry, an int
    outside 64 bits) or packs larger than ``max_frame``: that is a bug on the sending side,
    not the peer's fault, so it is not a ``ProtocolError``.
    """
    try:
        payload = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"cannot encode frame: {exc}") from exc
    if len(payload) > max_frame:
        raise ValueError(f"frame of {len(payload)} bytes exceeds the limit of {max_frame}")
    return _HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Reassembles frames from a byte stream cut at arbitrary points."""

    __slots__ = ("_buffer", "_failed", "_max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if max_frame < 1:
            raise ValueError(f"max_frame must be at least 1, not {max_frame}")
        self._max_frame = max_frame
        self._buffer = bytearray()
        self._failed = False

    @property
    def buffered(self) -> int:
        """Bytes held of a frame not yet complete."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[object]:
        """Add ``data`` and return the objects of every frame it completed, in order.

        Raises ``ProtocolError`` for an oversize frame or a payload that is not one msgpack
        object; after that every call raises, since the stream cannot be resynchronised.
        Frames completed earlier in the same call are dropped with it: the caller is about
        to close the connection, and acting on half a batch from a broken peer helps nobody.
        """
        if self._failed:
            raise ProtocolError("frame stream already failed")
        buffer = self._buffer
        buffer += data
        objects: list[object] = []
        offset = 0
        try:
            while len(buffer) - offset >= HEADER_SIZE:
                (length,) = _HEADER.unpack_from(buffer, offset)
                if length > self._max_frame:
                    raise ProtocolError(
                        f"frame of {length} bytes exceeds the limit of {self._max_frame}"
                    )
                end = offset + HEADER_SIZE + length
                if len(buffer) < end:
                    break
                objects.append(_unpack(bytes(buffer[offset + HEADER_SIZE : end])))
                offset = end
        except ProtocolError:
            self._failed = True
            buffer.clear()
            raise
        # One deletion per call rather than per frame: deleting from the front of a
        # bytearray moves the rest, which for many small frames in one read adds up.
        del buffer[:offset]
        return objects


def _unpack(payload: bytes) -> object:
    try:
        return msgpack.unpackb(payload, raw=False)
    # msgpack reports bad input as ValueError subclasses (FormatError, StackError, ExtraData,
    # UnicodeDecodeError, a non-str map key), OutOfData for a truncated object, and TypeError
    # for an unhashable map key.  All mean the same here: the peer sent garbage.
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ProtocolError(f"frame payload is not valid msgpack ({detail})") from None
