"""Logging set-up for every zoneq process, and the filter that keeps a fault from flooding it.

Why a filter: a local fault is reported where it is met, and during one (a full disk, a
failed sync) that is once per refused MAIL, per worker report, per lease; at a few
thousand messages a second the log grows by megabytes a second and the first, useful
lines scroll away.  Such a report is logged with ``extra=REPEATS``; ``RepeatFilter`` lets
the first ``burst`` of them from each call site through in every ``window`` and counts
the rest; the next one from that call site after the window says how many were held
back, and so does the process's exit, so nothing goes unreported.  The key is the logger,
the level and the message *template* (``record.msg`` before its arguments are applied):
"refusing MAIL from %s" from many clients is one flood, not many.

Only marked records are held back: a line about one message (a possible duplicate, RFC
1047; a quarantined record) is the only trace of that message's story and always passes,
however many there are.  Syslog's "last message repeated N times" catches only exact
repeats, which these are not (each names another client or lease).
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

__all__ = ["REPEATS", "RepeatFilter", "configure"]

FORMAT: Final = "%(asctime)s %(name)s %(levelname)s %(message)s"
MAX_SITES: Final = 1024
"""Call sites tracked at once.  Templates come from the code, so there are a few hundred at
most; a log call formatting its own text (an f-string) would make each line a new site, so
the table is bounded and the oldest site forgotten."""

REPEATS: Final[Mapping[str, object]] = MappingProxyType({"repeats": True})
"""``extra=`` of a log call that reports a fault once per operation (see the module doc)."""

_Key = tuple[str, int, str]


@dataclass(slots=True)
class _Site:
    started: float
    passed: int = 0
    held: int = 0
    text: str = ""  # the window's first message, rendered: what the exit report names


class RepeatFilter(logging.Filter):
    """At most ``burst`` records per call site per ``window`` seconds; see the module doc."""

    def __init__(
        self,
        *,
        burst: int = 5,
        window: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if burst < 1 or window <= 0:
            raise ValueError("burst must be at least 1 and window positive")
        self.burst = burst
        self.window = window
        self._clock = clock
        self._sites: dict[_Key, _Site] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "repeats", False):
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        site = self._sites.get(key)
        if site is None or now - site.started >= self.window:
            held = 0 if site is None else site.held
            if site is None and len(self._sites) >= MAX_SITES:
                del self._sites[next(iter(self._sites))]
            self._sites[key] = _Site(now, passed=1, text=record.getMessage())
            if held:
                _append(record, f"({held} more like this held back in the previous window)")
            return True
        if site.passed < self.burst:
            site.passed += 1
            return True
        site.held += 1
        return False

    def pending(self) -> list[tuple[str, int, str, int]]:
        """Each call site with records held back in its current window: its logger name,
        level, first message and the count.  Counted once: the counts are cleared."""
        found = []
        for (name, level, _template), site in self._sites.items():
            if site.held:
                found.append((name, level, site.text, site.held))
                site.held = 0
        return found


def _append(record: logging.LogRecord, note: str) -> None:
    # The message is rendered now, once, so that the note cannot disturb its arguments.
    record.msg = f"{record.getMessage()} {note}"
    record.args = None


def configure(level: str) -> RepeatFilter:
    """The process's root handler at ``level`` with a ``RepeatFilter``; at exit the counts
    still held back are logged, one line per call site."""
    logging.basicConfig(level=level.upper(), format=FORMAT)
    repeats = RepeatFilter()
    for handler in logging.getLogger().handlers:
        handler.addFilter(repeats)
    atexit.register(_report_held, repeats)
    return repeats


def _report_held(repeats: RepeatFilter) -> None:
    for name, level, text, held in repeats.pending():
        logging.getLogger(name).log(level, "%d more like this held back at exit: %s", held, text)
