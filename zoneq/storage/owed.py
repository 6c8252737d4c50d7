"""Failure notices owed: kept on disk until a message's one DSN is composed.

Theory of operation
-------------------
A bulk message fails in many jobs (one per domain and 50 recipients), and a DSN per job
gave its sender hundreds of notices where Postfix sends one per queue file.  So a failed
recipient leaves the queue in one batch with an ``owed`` record saying what its notice
must list (status, the remote's reply, when it failed), and the message's first such
record comes with the part of the original the notice returns (``OwedOriginal``): the
message itself leaves the queue with its last recipient, before the notice is composed.

The queue service composes one DSN per message from all its owed records once none of its
recipients is ready or in flight, or soon after the first failure anyway (``bounces.py``),
and queues it in the batch that deletes the records it lists (``settle_owed``).  So a
failure taken off the queue is on disk as owed or in a queued DSN, never neither and never
both: a crash in between leaves the records, composed at the next start.

The messages with owed records are kept in memory (``owed_messages``): added when a
record is staged (again when a held outcome is replayed, ``held.py``), read from disk once
after a start, and dropped when their notice's batch lands with nothing new owed, or when
a look finds nothing of theirs on disk or on its way (a settle whose batch failed its sync
but reached LevelDB's log; an administrator's delete, which removes the records: a delete
is silent, as ``postsuper -d`` is).  The keys each message has staged and not landed are
kept too, so that whether a failure is on its way costs a look at its own few keys, never
a scan of the writer's overlay: a settle of thousands of messages at a start-up sorted the
whole overlay once per message (quadratic: 5,000 owed took 62 s of a blocked loop).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import msgpack

from zoneq.errors import StorageCorruption
from zoneq.storage import keys
from zoneq.storage.base import StoreBase, run_all
from zoneq.storage.leveldb import Op
from zoneq.storage.records import MessageMeta, Notice
from zoneq.storage.writer import GroupWriter

_FAILURE_VERSION = 1
_ORIGINAL_VERSION = 1


@dataclass(frozen=True, slots=True)
class OwedFailure:
    """One failed recipient an owed notice lists (an RFC 3464 per-recipient block)."""

    zone: str
    address: str
    status: str  # RFC 3463, e.g. "5.1.1"
    diagnostic: str | None
    remote_mta: str | None
    failed_ms: int  # its Last-Attempt-Date (RFC 3464 section 2.3.7)
    orcpt: str | None = None

    def encode(self) -> bytes:
        """The value; zone and address are in the key."""
        return msgpack.packb(
            [
                _FAILURE_VERSION,
                self.status,
                self.diagnostic,
                self.remote_mta,
                self.failed_ms,
                self.orcpt,
            ]
        )

    @classmethod
    def decode(cls, key: bytes, value: bytes) -> OwedFailure:
        try:
            zone, pos = keys.split_text(key, len(keys.owed_prefix(0)) + 1)
            address, _ = keys.split_text(key, pos)
            items = msgpack.unpackb(value)
            if not isinstance(items, list) or items[:1] != [_FAILURE_VERSION]:
                raise ValueError(f"unknown owed failure format {items!r:.40}")
            _, status, diagnostic, remote_mta, failed_ms, orcpt = items
            return cls(zone, address, status, diagnostic, remote_mta, int(failed_ms), orcpt)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise StorageCorruption(key, str(exc)) from exc


@dataclass(frozen=True, slots=True)
class OwedOriginal:
    """What an owed notice needs of the failed message: its metadata (the sender, RET,
    ENVID) and the text it returns: ``start`` holds its header section, ``full`` the whole
    text when it is returned whole (RET=FULL and small), else None."""

    meta: MessageMeta
    start: bytes
    full: bytes | None

    def encode(self) -> bytes:
        # ``full`` starts with ``start`` when given: stored once.
        start = b"" if self.full is not None else self.start
        return msgpack.packb([_ORIGINAL_VERSION, self.meta.encode(), start, self.full])

    @classmethod
    def decode(cls, key: bytes, msg_id: int, value: bytes) -> OwedOriginal:
        try:
            items = msgpack.unpackb(value)
            if not isinstance(items, list) or items[:1] != [_ORIGINAL_VERSION]:
                raise ValueError(f"unknown owed original format {items!r:.40}")
            _, meta, start, full = items
            text = full if full is not None else start
            return cls(MessageMeta.decode(key, msg_id, meta), bytes(text), full)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise StorageCorruption(key, str(exc)) from exc


@dataclass(frozen=True, slots=True)
class Owed:
    """What a bounce writes so that its recipient's notice is owed: its failure, and how
    to read the original, called only if the message has none on record yet."""

    failure: OwedFailure
    original: Callable[[], OwedOriginal | None]

    @property
    def size(self) -> int:
        """Octets it holds while held in memory (``held.py``): the original is read later."""
        return len(self.failure.diagnostic or "") + len(self.failure.address)


@dataclass(frozen=True, slots=True)
class OwedNotice:
    """Everything owed for one message, as on disk: composed into one DSN."""

    msg_id: int
    original: OwedOriginal | None  # None: lost (a damaged value); the notice goes without
    failures: tuple[OwedFailure, ...]
    keys: tuple[bytes, ...]  # deleted in the notice's batch


def owed_deletes(writer: GroupWriter, msg_id: int) -> list[Op]:
    """Deletes of every owed record of ``msg_id``, staged ones included: for an
    administrator's delete of the message, which is silent (no DSN), as Postfix's
    ``postsuper -d`` is.  The message is forgotten in memory at its next look, once the
    delete has landed (``OwedMixin.owed``): forgotten now, a delete whose batch failed
    would leave its records on disk and unlooked at until the next start."""
    return [(key, None) for key, _ in writer.scan(keys.owed_prefix(msg_id))]


class OwedMixin(StoreBase):
    """The ``owed`` family: failures whose notice is not composed yet."""

    _owed_ids: set[int] | None = None  # (``owed_messages``: read from disk once)
    # msg_id -> its owed keys staged and maybe not landed yet (``_on_the_way``)
    _owed_staged: dict[int, set[bytes]] | None = None

    def _owed_ops(self, msg_id: int, owed: Owed) -> list[Op]:
        """The writes that make ``owed``'s notice owed; in the batch that bounces it."""
        failure = owed.failure
        ops: list[Op] = [
            (keys.owed_failure(msg_id, failure.zone, failure.address), failure.encode())
        ]
        if self._writer.read(keys.owed_original(msg_id)) is None:
            original = owed.original()
            if original is not None:
                ops.append((keys.owed_original(msg_id), original.encode()))
        self._owed_known().add(msg_id)
        self._staged_owed().setdefault(msg_id, set()).update(key for key, _ in ops)
        return ops

    def _staged_owed(self) -> dict[int, set[bytes]]:
        if self._owed_staged is None:
            self._owed_staged = {}
        return self._owed_staged

    def _on_the_way(self, msg_id: int) -> bool:
        """Whether an owed record of ``msg_id`` is staged and not landed yet.  Its keys
        leave the writer's overlay when their group lands, or all at once when a write
        fails (the outcome is then held, and stages them again when replayed)."""
        staged = self._staged_owed()
        mine = staged.get(msg_id)
        if mine is None:
            return False
        mine = {key for key in mine if self._staged_insert(key)}
        if mine:
            staged[msg_id] = mine
        else:
            del staged[msg_id]
        return bool(mine)

    def _staged_insert(self, key: bytes) -> bool:
        value = self._writer.pending(key)
        return value is not None and value is not self._writer.MISSING

    def _owes_nothing(self, msg_id: int) -> bool:
        """Whether ``msg_id`` has no owed record on disk (a staged delete not landed yet
        still counts: its batch may fail) and none on its way: an O(1) seek, no scan."""
        if self._on_the_way(msg_id):
            return False
        return next(iter(self._db.keys(prefix=keys.owed_prefix(msg_id))), None) is None

    def _forget_if_done(self, msg_id: int) -> None:
        if self._owes_nothing(msg_id):
            self._owed_known().discard(msg_id)

    def _owed_known(self) -> set[int]:
        if self._owed_ids is None:
            found = {keys.decode_owed(key) for key in self._db.keys(prefix=keys.OWED)}
            self._owed_ids = found
        return self._owed_ids

    def owed_messages(self) -> list[int]:
        """The messages that may have failures owed a notice, oldest first."""
        return sorted(self._owed_known())

    def owes(self, msg_id: int) -> bool:
        """Whether ``msg_id`` may have failures owed a notice (``owed_messages``)."""
        return msg_id in self._owed_known()

    def owed(self, msg_id: int) -> OwedNotice | None:
        """What is owed for ``msg_id`` and durable (None: nothing).  A record still on its
        way waits for the next look: listed now, it could be listed again should its batch
        fail and be written later (``held.py``).  A damaged record is quarantined and
        deleted with the rest: the failure it named cannot be told."""
        original: OwedOriginal | None = None
        failures: list[OwedFailure] = []
        found: list[bytes] = []
        for key, value in self._durable(keys.owed_prefix(msg_id)):
            found.append(key)
            try:
                if key == keys.owed_original(msg_id):
                    original = OwedOriginal.decode(key, msg_id, value)
                else:
                    failures.append(OwedFailure.decode(key, value))
            except StorageCorruption as exc:
                self._quarantine(exc)
        if not found:
            # Nothing durable left to tell: forgotten unless a record is on its way, or
            # being deleted by a batch that may yet fail.
            self._forget_if_done(msg_id)
            return None
        if self._on_the_way(msg_id):
            # A failure on its way found the original on record, and did not write it
            # again: the original stays, for that failure's notice.
            found = [key for key in found if key != keys.owed_original(msg_id)]
        return OwedNotice(msg_id, original, tuple(failures), tuple(found))

    def _durable(self, prefix: bytes) -> Iterable[tuple[bytes, bytes]]:
        """The durable keys under ``prefix``, less those a staged write deletes."""
        pending = self._writer.pending
        for key, value in self._db.items(prefix=prefix):
            if pending(key) is not None:
                yield key, value

    def has_ready(self, msg_id: int, zones: Iterable[str]) -> bool:
        """Whether any recipient of ``msg_id`` in ``zones`` is ready or leased."""
        return any(
            next(iter(self._durable(keys.record_message_prefix(keys.READY, zone, msg_id))), None)
            for zone in zones
        )

    def settle_owed(self, owed: OwedNotice, notice: Notice | None, now_ms: int) -> Awaitable[None]:
        """Queue ``notice`` (None: nobody is to be told) and delete what it was composed
        from, in one synced batch: it is told once, crash or not."""
        self._check()
        ops: list[Op] = [(key, None) for key in owed.keys]
        effects: list[Callable[[], None]] = [self._owed_landed(owed.msg_id)]
        if notice is not None:
            notice_ops, ready = self._notice_ops(notice, now_ms)
            ops.extend(notice_ops)
            effects.append(self._readied(ready))
        return self._writer.submit(ops, sync=True, effect=run_all(effects))

    def _owed_landed(self, msg_id: int) -> Callable[[], None]:
        """Effect of a notice's batch landing: the message owes nothing more, unless a
        failure of it was staged meanwhile (its own batch not landed yet)."""

        def effect() -> None:
            self._forget_if_done(msg_id)

        return effect

    def _notice_ops(self, notice: Notice, now_ms: int) -> tuple[list[Op], dict[str, bytes]]:
        """A generated message's writes (``store.py``)."""
        raise NotImplementedError


__all__ = ["Owed", "OwedFailure", "OwedMixin", "OwedNotice", "OwedOriginal"]
