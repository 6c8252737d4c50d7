"""The only module that imports plyvel: a thin LevelDB handle with zoneq's errors.

plyvel's exceptions become zoneq's at this one boundary (STYLE.md, after httpcore):

* an I/O error on a write (full disk, failed fsync) -> ``StorageUnavailable``.  LevelDB
  remembers such an error and refuses every later write until the database is reopened
  (measured here: after ENOSPC even deletes fail), so the caller must :meth:`reopen`;
* the lock file held by another process -> ``StoreLocked``, with a message that says so;
* a corruption error -> ``StorageUnavailable`` for writes; reads of a single bad value are
  handled above this layer.

Writes take a list of ``(key, value-or-None)`` pairs and go as one ``WriteBatch``, so every
queue transition is atomic.  ``sync=True`` fsyncs LevelDB's log, which also makes every
earlier unsynced write durable (the log is one append-only file).

:meth:`compact_range` may run in a thread of its own (the maintenance round: ``maintenance.py``)
while the event loop goes on: plyvel releases the GIL around LevelDB's ``CompactRange``.  But
plyvel's ``close`` deletes the C++ handle without waiting for a call in another thread, and a
``CompactRange`` on a deleted handle is a use after free (a crash).  So a compaction holds
``_compacting`` around its call, :meth:`close` waits for it, and :meth:`reopen` (on the event
loop, after a failed write) does not wait: it fails as a reopen does while its cause lasts,
and its owner tries again a second later (``StoreBase._check``).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import plyvel

from zoneq.errors import DiskFull, StorageUnavailable, StoreLocked

Op = tuple[bytes, bytes | None]

# The file ``Database.probe_sync`` writes (not a LevelDB file name, so LevelDB leaves it).
SYNC_PROBE = "zoneq-sync-probe"


class Database:
    """An open LevelDB directory.  Reads, writes and compactions are thread-safe; open,
    close and reopen belong to one thread (the event loop's) and never run under a
    compaction in another."""

    # The write buffer is LevelDB's memtable, and a full one is kept while it is flushed: up
    # to twice this in anonymous memory while a big message streams in.  At 16 MiB that was
    # 30 MiB of the 32 MiB a 100 MB message may add to a process (issue 4), measured by
    # writing 1,600 chunks; at 8 MiB it is 15 MiB, leaving room for the receiver's buffers.
    def __init__(self, path: Path, *, write_buffer_mb: int = 8, cache_mb: int = 32) -> None:
        self.path = Path(path)
        self._options: dict[str, Any] = {
            "create_if_missing": True,
            "write_buffer_size": write_buffer_mb << 20,
            "lru_cache_size": cache_mb << 20,
            # Body chunks are already as dense as they get; keys compress well.
            "compression": "snappy",
        }
        self._db: Any = None
        self._compacting = threading.Lock()  # held by a compaction; see the module's doc
        self.open()

    # --- lifecycle ------------------------------------------------------------------------

    def open(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a parent that is a file, no permission, read-only
            raise StorageUnavailable(f"cannot create {self.path}: {exc.strerror}") from exc
        try:
            self._db = plyvel.DB(os.fspath(self.path), **self._options)
        except plyvel.IOError as exc:
            text = _text(exc)
            if "lock" in text.lower():
                raise StoreLocked(
                    f"the queue directory {self.path} is in use by another zoneq process "
                    f"(LevelDB allows one process per database): {text}"
                ) from exc
            if "No space left" in text:
                raise DiskFull(f"cannot open {self.path}, disk full: {text}") from exc
            raise StorageUnavailable(f"cannot open {self.path}: {text}") from exc
        except plyvel.Error as exc:
            raise StorageUnavailable(f"cannot open {self.path}: {_text(exc)}") from exc

    def close(self) -> None:
        """Close the handle, once a compaction running in another thread has ended (at
        most one range's: the maintenance round hands them over one at a time)."""
        with self._compacting:
            self._close()

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def reopen(self) -> None:
        """Close and open again: the only way to clear LevelDB's sticky write error.

        A sync is tried first, on a file of our own: opening syncs a new log and manifest,
        so while the disk cannot sync the open would fail and leave no handle at all, where
        the failed one still reads (and the queue goes on delivering, ``held.py``).  While
        a compaction runs, ``StorageUnavailable`` at once and nothing closed: waiting for
        it would hold the event loop for as long as the compaction takes.
        """
        self.probe_sync()
        if not self._compacting.acquire(blocking=False):
            raise StorageUnavailable(f"cannot reopen {self.path} yet: a compaction is running")
        try:
            self._close()
            self.open()
        finally:
            self._compacting.release()

    def probe_sync(self) -> None:
        """Write and fdatasync a byte in the database's directory, or raise as a write would.

        LevelDB ignores a file whose name is not one of its own.
        """
        probe = self.path / SYNC_PROBE
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"\0")
                os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiskFull(f"cannot sync in {self.path}, disk full: {exc}") from exc
            raise StorageUnavailable(f"cannot sync in {self.path}: {exc}") from exc

    @property
    def is_open(self) -> bool:
        return self._db is not None and not self._db.closed

    @property
    def inline_safe(self) -> bool:
        """Whether a small unsynced write may run on the event loop thread (``writer.py``).

        True for this class: such a write is a memtable insert and a log append, a few
        microseconds.  A subclass that overrides ``write`` may block in it (the tests hold
        writes at a gate to stage races with a write in flight), so its writes always go
        through the writer thread.
        """
        return type(self).write is Database.write

    # --- access ---------------------------------------------------------------------------

    def _handle(self) -> Any:
        if self._db is None:
            raise StorageUnavailable(f"the queue database {self.path} is not open")
        return self._db

    def get(self, key: bytes, *, fill_cache: bool = True) -> bytes | None:
        """The value at ``key``; ``fill_cache=False`` for data read once (message bodies),
        which would otherwise push the queue's index blocks out of LevelDB's block cache and
        grow the process by the cache's size for nothing."""
        try:
            value: bytes | None = self._handle().get(key, fill_cache=fill_cache)
        except plyvel.Error as exc:
            raise StorageUnavailable(f"read failed: {_text(exc)}") from exc
        return value

    def write(self, ops: Sequence[Op], *, sync: bool) -> None:
        db = self._handle()
        try:
            with db.write_batch(sync=sync) as batch:
                put = batch.put
                delete = batch.delete
                for key, value in ops:
                    if value is None:
                        delete(key)
                    else:
                        put(key, value)
        except plyvel.Error as exc:
            text = _text(exc)
            if "No space left" in text:
                raise DiskFull(f"write failed, disk full: {text}") from exc
            raise StorageUnavailable(f"write failed: {text}") from exc
        except RuntimeError as exc:  # plyvel: "Database is closed"
            raise StorageUnavailable(f"write failed: {exc}") from exc

    def items(
        self,
        *,
        prefix: bytes | None = None,
        start: bytes | None = None,
        stop: bytes | None = None,
        reverse: bool = False,
        snapshot: Any = None,
        fill_cache: bool = True,
    ) -> Iterator[tuple[bytes, bytes]]:
        """Key/value pairs in order; ``start`` inclusive, ``stop`` exclusive."""
        it: Iterator[tuple[bytes, bytes]] = self._iterator(
            prefix,
            start,
            stop,
            reverse=reverse,
            snapshot=snapshot,
            include_value=True,
            fill_cache=fill_cache,
        )
        return it

    def keys(
        self,
        *,
        prefix: bytes | None = None,
        start: bytes | None = None,
        stop: bytes | None = None,
        reverse: bool = False,
    ) -> Iterator[bytes]:
        it: Iterator[bytes] = self._iterator(
            prefix, start, stop, reverse=reverse, snapshot=None, include_value=False
        )
        return it

    def _iterator(
        self,
        prefix: bytes | None,
        start: bytes | None,
        stop: bytes | None,
        *,
        reverse: bool,
        snapshot: Any,
        include_value: bool,
        fill_cache: bool = True,
    ) -> Any:
        source = snapshot if snapshot is not None else self._handle()
        common = {"reverse": reverse, "include_value": include_value, "fill_cache": fill_cache}
        if prefix is not None:
            return source.iterator(prefix=prefix, **common)
        return source.iterator(start=start, stop=stop, **common)

    def first_key(self, start: bytes, stop: bytes | None) -> bytes | None:
        """The first key in ``[start, stop)``: one seek."""
        for key in self._handle().iterator(start=start, stop=stop, include_value=False):
            k: bytes = key
            return k
        return None

    @contextmanager
    def snapshot(self) -> Iterator[Any]:
        """A consistent read view (used by exports while the server runs)."""
        snap = self._handle().snapshot()
        try:
            yield snap
        finally:
            snap.close()

    def compact_range(self, start: bytes, stop: bytes) -> None:
        """Compact an explicit range (plyvel 1.5.1's argument-less call does nothing).

        Safe in a thread of its own: the handle is taken, and used, under ``_compacting``,
        so it is never one that :meth:`close` or :meth:`reopen` is deleting."""
        with self._compacting:
            try:
                self._handle().compact_range(start=start, stop=stop)
            except plyvel.Error as exc:
                raise StorageUnavailable(f"compaction failed: {_text(exc)}") from exc


def _text(exc: BaseException) -> str:
    arg = exc.args[0] if exc.args else exc
    if isinstance(arg, bytes):
        return arg.decode("utf-8", "replace")
    return str(arg)
