"""Disk space policy for the queue: a floor for new mail, and a reserve for recovery.

Two defences, because LevelDB on a full disk is stuck in a particular way: after ENOSPC it
refuses every write, deletes included, until reopened, and reopening replays the log into a
new table, which needs about a log's worth of free space (measured here: with incompressible
bodies, freeing 1 MiB was not enough).  A queue that cannot write deletes cannot deliver
either, so it would never drain on its own.

* The floor (Postfix's ``queue_minfree``): new mail is refused with a temporary error while
  free space is below ``min_free``, so zoneq's own intake never fills the disk, and
  deliveries, which free space, carry on.
* The reserve: a file of ``reserve`` bytes kept in the queue directory.  When a write fails
  for want of space anyway (something else filled the disk), the reserve is deleted so the
  reopen and the deletes that follow can run; it is put back once there is room again.  It
  must cover the logs a reopen replays, up to two memtables (the one being flushed and the
  current one): 4x LevelDB's write buffer is safe (with 2x, healing failed now and then).

Free space is read with ``statvfs`` at most once per ``interval`` seconds (the check sits on
the intake path), and once per MiB of body written while DATA streams in: a client need not
declare SIZE= (RFC 1870), and one fast message could otherwise cross the floor and the disk
between two readings.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from zoneq.errors import InsufficientStorage

RESERVE_NAME: Final = "zoneq.reserve"  # LevelDB leaves files it does not recognise alone
# Body bytes written between two statvfs readings at most (``admit_write``).
RECHECK_BYTES: Final = 1 << 20


class SpaceGuard:
    def __init__(
        self,
        directory: Path,
        *,
        min_free: int = 0,
        reserve: int = 0,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = Path(directory)
        self.min_free = min_free
        self.reserve = reserve
        self._interval = interval
        self._clock = clock
        self._checked_at = float("-inf")
        self._free = 0
        # Body bytes admitted since the last statvfs: a client on loopback can stream far
        # more than the headroom within one interval, so they count against the reading.
        self._written = 0

    @property
    def reserve_path(self) -> Path:
        return self.directory / RESERVE_NAME

    def free_bytes(self, *, fresh: bool = False) -> int:
        now = self._clock()
        if fresh or now - self._checked_at >= self._interval:
            stat = os.statvfs(self.directory)
            self._free = stat.f_bavail * stat.f_frsize
            self._checked_at = now
            self._written = 0
        return self._free

    def admit(self, size: int = 0, *, fresh: bool = False) -> None:
        """Raise ``InsufficientStorage`` if taking ``size`` more bytes would cross the floor."""
        if self.min_free <= 0:
            return
        free = self.free_bytes(fresh=fresh) - self._written
        if free - size < self.min_free:
            raise InsufficientStorage(
                f"queue file system has {free} bytes free; new mail waits until it has more "
                f"than {self.min_free + size} (min_free {self.min_free} + {size} to write)"
            )

    def admit_write(self, size: int) -> None:
        """``admit`` for ``size`` bytes of a body being written now, counted as taken until
        the next statvfs, which runs once per interval or per ``RECHECK_BYTES`` written,
        whichever comes first: LevelDB's own flushes and compactions take more than the
        bytes written (measured on a tmpfs: 34 MiB of incompressible chunks used 60 MiB),
        so an estimate alone overshoots.  At most ~2 us of statvfs per MiB."""
        if self.min_free > 0:
            self.admit(size, fresh=self._written >= RECHECK_BYTES)
            self._written += size

    def release(self) -> bool:
        """Give the reserve back to the file system (after a write failed for space)."""
        with contextlib.suppress(FileNotFoundError):
            self.reserve_path.unlink()
            self.free_bytes(fresh=True)
            return True
        return False

    def restore(self) -> bool:
        """Put the reserve (back) in place if there is room for it and the floor above it."""
        if self.reserve <= 0 or self.reserve_path.exists():
            return False
        if self.free_bytes(fresh=True) < self.reserve + max(self.min_free, self.reserve):
            return False
        partial = self.reserve_path.with_suffix(".partial")
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                # Blocks really allocated, not a sparse file that frees nothing when deleted.
                os.posix_fallocate(fd, 0, self.reserve)
                os.fsync(fd)
            finally:
                os.close(fd)
            partial.replace(self.reserve_path)
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
            return False
        self.free_bytes(fresh=True)
        return True
