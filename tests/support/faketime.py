"""A wall clock that jumps, for child processes: libfaketime (Debian's ``faketime``).

libfaketime is preloaded (``LD_PRELOAD``) into a process and shifts what the C library's
clock calls return; the setting is in the environment, so every process the child starts
(``zoneq serve``'s workers) inherits it.  Two ways are used here:

* ``FAKETIME=+5d``: a fixed offset from the start: a process started "five days later".
* ``FAKETIME_TIMESTAMP_FILE=F`` with ``FAKETIME_NO_CACHE=1``: the offset is read from ``F``
  on every clock call (without it the file is read again only every 10 s, or every
  ``FAKETIME_CACHE_DURATION`` seconds), so rewriting ``F`` makes the clock of a running
  process jump: an NTP step, or a host resumed after days (:class:`ClockFile`).
  ``FAKETIME`` must then be unset: it wins over the file.

``FAKETIME_DONT_FAKE_MONOTONIC=1`` always: a clock step moves CLOCK_REALTIME only, and
asyncio's (uvloop's) timers, the delivery timeouts and the dead-host cache run on the
monotonic clock, as they should.  Measured with libfaketime 0.9.10 (Debian 12): with it,
CLOCK_MONOTONIC, _COARSE, _RAW, CLOCK_BOOTTIME and uvloop's ``loop.time()`` stay put
while ``time.time()`` jumps.  Beware its known bug with this setting (libfaketime issue
426): ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` fails with EINVAL, and Python
3.11's ``time.sleep`` uses exactly that, so a process under this environment must not call
``time.sleep`` (``zoneq serve`` does not: it waits on its event loop).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from tests.support.testbed import missing

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
DAY_S = 86_400.0
# Prints the wall clock once at start and once per line read; it never sleeps (see above).
_ECHO_CLOCK = (
    "import sys, time\n"
    "print(time.time(), flush=True)\n"
    "for _ in sys.stdin:\n"
    "    print(time.time(), flush=True)\n"
)


def libfaketime() -> Path:
    """The preload library; a missing one skips (or fails, on a set-up test bed)."""
    if not LIBFAKETIME.exists():
        missing(f"libfaketime not found at {LIBFAKETIME} (Debian: apt-get install faketime)")
    return LIBFAKETIME


@contextlib.contextmanager
def faked_clock(settings: Mapping[str, str | None]) -> Iterator[None]:
    """Processes started inside run under libfaketime with ``settings`` (a None value
    unsets the variable); the test's own process is not affected (``LD_PRELOAD`` acts at
    exec), and the environment is restored on the way out."""
    fake: dict[str, str | None] = {
        "LD_PRELOAD": str(libfaketime()),
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        **settings,
    }
    saved = {key: os.environ.get(key) for key in fake}
    try:
        _apply(fake)
        yield
    finally:
        _apply(saved)


def _apply(values: Mapping[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class ClockFile:
    """The offset file of processes started under :meth:`settings`; :meth:`set` moves
    their wall clocks at once, while they run."""

    def __init__(self, path: Path, offset: str = "+0") -> None:
        self.path = path
        self.set(offset)

    def set(self, offset: str) -> None:
        """Write ``offset`` (libfaketime's syntax: ``+0``, ``+5d``, ``-2h``) to a temporary
        file renamed over the real one: a reader sees the old offset or the new, never a
        half-written file (which it would read as no offset at all)."""
        partial = self.path.with_name(self.path.name + ".new")
        partial.write_text(offset + "\n")
        os.replace(partial, self.path)

    def settings(self) -> dict[str, str | None]:
        """For :func:`faked_clock`: follow this file, re-read on every clock call."""
        return {
            "FAKETIME": None,
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            "FAKETIME_NO_CACHE": "1",
        }

    def jump_seen(self, offset: str, timeout: float = 10.0) -> float:
        """How far (seconds) the wall clock of a process running under this file moves when
        the file is set to ``offset`` (set back to ``+0`` afterwards): a check of the
        mechanism itself, so that a test built on it cannot pass because no clock moved."""
        with faked_clock(self.settings()):
            child = subprocess.Popen(
                [sys.executable, "-c", _ECHO_CLOCK],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        try:
            assert child.stdout is not None
            before = float(child.stdout.readline())  # printed at once: no unbounded wait
            self.set(offset)
            out, _ = child.communicate("now\n", timeout=timeout)
            return float(out.split()[0]) - before
        finally:
            self.set("+0")
            if child.poll() is None:
                child.kill()
                child.wait(timeout=timeout)
