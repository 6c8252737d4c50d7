"""zoneq's exception tree.

One root, and families chosen by what the caller does next (STYLE.md, after aiosmtplib and
httpcore): a ``TemporaryFailure`` becomes a 4xx to a sending client or a deferral, never a 5xx;
a ``ConfigError`` stops start-up and names the key; a ``LeaseError`` means a worker's report
no longer matches the queue and is refused.  Third-party exceptions (plyvel, dnspython,
aiosmtplib) are mapped to these at exactly one place, the module that owns that library.
"""

from __future__ import annotations


class ZoneqError(Exception):
    """Root of every error zoneq raises on purpose."""


class TemporaryFailure(ZoneqError):
    """A local fault that may clear by itself: answer 4xx, defer, retry later."""


class StorageUnavailable(TemporaryFailure):
    """The queue database refused a read or write (failed sync, full disk, closed handle).

    LevelDB keeps refusing writes after such a failure; the store reopens the database to
    clear it.  Nothing written by the failed operation may be assumed durable.
    """


class DiskFull(StorageUnavailable):
    """A write failed for want of space (ENOSPC)."""


class InsufficientStorage(TemporaryFailure):
    """Free space is below the floor kept for the queue: new mail is refused (452 4.3.1,
    RFC 3463 section 3.4) while deliveries, which free space, go on (Postfix's queue_minfree).
    """


class StorageCorruption(ZoneqError):
    """A record could not be decoded.  The record is quarantined; the rest of the queue goes on."""

    def __init__(self, key: bytes, reason: str) -> None:
        super().__init__(f"corrupt record at key {key!r}: {reason}")
        self.key = key
        self.reason = reason


class StoreLocked(ZoneqError):
    """Another process holds the data directory's LevelDB lock."""


class DataDirError(ZoneqError):
    """The queue's directory (``server.data_dir``) cannot be created or opened: a start-up
    error naming the key and the path, never a traceback."""


class ListenError(ZoneqError):
    """A server of zoneq's (the SMTP receiver, the HTTP API, the IPC socket for the workers)
    cannot listen where configured."""


class NotFound(ZoneqError):
    """The message, recipient or zone named does not exist (any more)."""


class LeaseError(ZoneqError):
    """A report carried a lease token that is not (or no longer) the current one.

    ZoneMTA did not check this, so a stale worker could complete someone else's delivery.
    """


class ConfigError(ZoneqError):
    """A configuration problem, naming the key (dotted path) and what is wrong with it."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
        self.problem = problem


class ProtocolError(ZoneqError):
    """Bytes from a peer that do not follow the protocol (their fault, not ours)."""
