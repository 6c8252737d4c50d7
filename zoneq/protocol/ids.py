"""Message ids: time-ordered, unique across restarts.

ZoneMTA's scheme: milliseconds since the epoch times 4096 plus a counter, so ids sort by
arrival time and a range scan of a zone is oldest-first.  Uniqueness across restarts comes
from the floor: at start-up the store hands over the largest id it holds, and every new id is
greater than it even if the clock went backwards while zoneq was down.  Within a
millisecond the 12-bit counter gives 4096 ids; past that the generator borrows the next
millisecond, so ids stay unique and ordered however fast they are asked for.

Pure: the caller passes ``now_ms``.
"""

from __future__ import annotations

from typing import Final

COUNTER_BITS: Final = 12
ID_HEX_WIDTH: Final = 16


class IdGenerator:
    """Issues strictly increasing ids from a clock reading and a floor."""

    __slots__ = ("_last",)

    def __init__(self, floor: int = 0) -> None:
        self._last = floor

    def next(self, now_ms: int) -> int:
        candidate = now_ms << COUNTER_BITS
        if candidate <= self._last:
            candidate = self._last + 1
        self._last = candidate
        return candidate

    @property
    def last(self) -> int:
        """The largest id issued (or the floor): what must survive a restart."""
        return self._last

    def raise_floor(self, floor: int) -> None:
        """Never issue ``floor`` or anything below it (ids seen in the store)."""
        self._last = max(self._last, floor)


def id_time_ms(msg_id: int) -> int:
    """The millisecond an id was issued in (approximately, if ids were borrowed ahead)."""
    return msg_id >> COUNTER_BITS


def format_id(msg_id: int) -> str:
    """Fixed-width lowercase hex, as people and the API see it (sorts like the id)."""
    return f"{msg_id:0{ID_HEX_WIDTH}x}"


def parse_id(text: str) -> int:
    """Inverse of :func:`format_id`, in either case (an id copied from a tool that shows
    hex in upper case names the same message); ``ValueError`` for anything else."""
    if len(text) != ID_HEX_WIDTH or text.strip("0123456789abcdefABCDEF"):
        raise ValueError(f"not a message id: {text!r} (expected {ID_HEX_WIDTH} hex digits)")
    return int(text, 16)


__all__ = ["COUNTER_BITS", "IdGenerator", "format_id", "id_time_ms", "parse_id"]
