"""One export run at a time per export directory: an exclusive ``flock`` on a lock file.

Two runs into one directory that overlap in time would both start from the same watermark
and both write its events, and the one that finishes last would save the older watermark
over the other's, so the next run would export the same events yet again.  LevelDB's own
lock does not stop this: runs through the running core's API each get a snapshot of their
own, and two exports of different stopped data directories may share an export directory.

``flock(2)`` rather than a PID file: the kernel releases it when its holder dies, however it
dies (SIGKILL included), so a crashed run never leaves a lock someone must remove by hand.
A second run is refused at once rather than left to wait: a cron export that overruns its
interval must not pile up waiting runs, and the next run exports whatever this one had to
(the watermark makes every run incremental); the refusal exits non-zero, so cron reports it.

The file is a dot-file at the top of the export directory, never removed (removing a lock
file someone else has just opened would let a third run lock a new file of the same name).
Readers never see it: Spark skips names starting with ``.`` or ``_`` and is only pointed at
``events/`` and ``queue/``, and ``zoneq analytics`` reads only part files there.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from zoneq.export.watermark import ExportError

LOCK_FILE: Final = ".zoneq-export.lock"

# The directories this thread holds: ``zoneq export`` holds its directory for the whole
# command and the run functions take it again, which must not refuse itself.  Per thread, so
# two runs in two threads of one process still exclude each other (flock locks belong to
# open file descriptions, so the second one's own open is refused, as another process' is).
_held = threading.local()


def _held_here() -> set[str]:
    held: set[str] | None = getattr(_held, "dirs", None)
    if held is None:
        held = _held.dirs = set()
    return held


@contextlib.contextmanager
def exclusive(out: Path) -> Iterator[None]:
    """Hold ``out``'s export lock while the block runs (creating ``out`` if need be);
    ``ExportError`` at once when another run holds it."""
    out.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(out)
    held = _held_here()
    if key in held:
        yield
        return
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise ExportError(
                f"another export is writing to {out} (it holds {out / LOCK_FILE}); "
                "run this one again when it has finished"
            ) from exc
        held.add(key)
        try:
            yield
        finally:
            held.discard(key)
    finally:
        os.close(fd)  # releases the lock


__all__ = ["LOCK_FILE", "exclusive"]
