"""Frames written in one turn of the event loop leave in one socket write.

Why: every ``transport.write`` is a ``send`` system call on the spot, and on the far side
one more wake-up and ``recv``.  Under load the core answers many requests of one worker in
the same turn (one group commit settles every report in it at once), and a worker's
delivery loops often ask in the same turn too.  Holding the turn's frames and writing them
together at the start of the loop's next turn (``call_soon``: one zero-timeout poll later,
before any I/O of that turn is handled) turns N sends, and N wake-ups of the peer, into
one, for a delay of one poll.

Order is kept: frames leave in the order they were written, so the peer reads exactly the
byte stream it would without batching.  ``flush`` sends what is held at once; owners call
it before they close the connection, so nothing written is left behind (a worker's last
report must reach the core).
"""

from __future__ import annotations

import asyncio

__all__ = ["FrameBatcher"]


class FrameBatcher:
    """Collects frames for ``writer`` and writes each turn's frames with one call."""

    __slots__ = ("_frames", "_writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._frames: list[bytes] = []

    @property
    def held(self) -> int:
        """Frames written and not yet handed to the transport."""
        return len(self._frames)

    def write(self, frame: bytes) -> None:
        """Queue ``frame``; it goes out with the rest of this turn's frames."""
        if not self._frames:
            asyncio.get_running_loop().call_soon(self.flush)
        self._frames.append(frame)

    def flush(self) -> None:
        """Hand every held frame to the transport now (dropped if it is closing)."""
        frames = self._frames
        if not frames:
            return
        self._frames = []
        if self._writer.is_closing():
            return
        self._writer.write(frames[0] if len(frames) == 1 else b"".join(frames))
