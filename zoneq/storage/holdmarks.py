"""Holds that wait for an attempt: the marks of leased recipients to hold when they return.

A hold cannot move a recipient that is leased (it may be on the wire, and its worker's
report must still find it ready), so the store *marks* it instead, in the same step that
holds the rest: in memory (``StoreBase._hold_marks``: ready key -> the hold's reason) and on
disk as ``meta "hold-on-return" <ready key>`` -> reason, in the hold's own batch, synced
before the hold answers.

The decision is the store's, at the moment an outcome is written, so no window is left
between a hold and the outcome it should catch (a report claimed but not yet written, a job
given back while the hold's write is on its way): ``defer`` and ``release`` (a job given
back, or a gone worker's) of a marked lease hold the recipient instead (a deferral keeps
its DEFERRED event and attempt count); ``complete`` and ``bounce`` finish as usual (a hold
cannot call back a message the remote has; a bounce's DSN is owed whatever the hold).
Every one of them removes the mark; so does any other removal of the record (it passes
through ``StoreBase._remove_key``: a delete, a purge, an orphan's removal, a failed commit
undone), so no mark outlives its recipient; and so does a release, of the message
(``unhold``) or of its zone (``QueueAdmin.release_zone``).  An administrator's delete, which
revokes the lease, forgets the mark in memory only once its batch lands: a delete that fails
gives the lease back (``StoreBase._put_back_revoked``), and the attempt's end must still find
its mark (one whose attempt ended during that write is held when the storage heals:
``HeldMixin._settle_stray_marks``).  A lease does not survive a restart, so at start-up
(``recover``) every marked recipient still ready is held and every mark removed (Postfix's
``postsuper -h`` holds a message whatever queue it is in).

Messages without a hold pay one truthiness test of an empty dict per outcome.
"""

from __future__ import annotations

from zoneq.storage import keys
from zoneq.storage.leveldb import Op
from zoneq.storage.writer import GroupWriter

HOLD_MARKS = keys.meta("hold-on-return")  # + a ready key -> the hold's reason


def hold_mark_key(ready_key: bytes) -> bytes:
    """The on-disk mark of the leased recipient at ``ready_key``."""
    return HOLD_MARKS + ready_key


def mark(marks: dict[bytes, str], ready_key: bytes, reason: str) -> Op:
    """Mark the leased recipient at ``ready_key`` in memory; the write that marks it on disk."""
    marks[ready_key] = reason
    return hold_mark_key(ready_key), reason.encode()


def unmark(marks: dict[bytes, str], ready_key: bytes) -> list[Op]:
    """Forget ``ready_key``'s mark; the delete of its on-disk mark, if it had one."""
    if marks.pop(ready_key, None) is None:
        return []
    return [(hold_mark_key(ready_key), None)]


def unmark_on_disk(marks: dict[bytes, str], ready_key: bytes) -> list[Op]:
    """The delete of ``ready_key``'s on-disk mark, its mark kept in memory: for a delete that
    revoked its lease, which may yet fail and give the lease back, marked still, to the
    attempt on the wire.  Forgotten once the delete lands (``StoreBase._forget_revoked``)."""
    return [(hold_mark_key(ready_key), None)] if ready_key in marks else []


def unmark_message(marks: dict[bytes, str], msg_id: int) -> list[Op]:
    """Forget every mark of a message (released); the deletes on disk."""
    return _unmark_all(marks, [key for key in marks if keys.decode_record(key)[2] == msg_id])


def unmark_zone(marks: dict[bytes, str], zone: str) -> list[Op]:
    """Forget every mark in a zone (released: whichever hold made them, a zone's or one of
    its messages', every held recipient there is ready again); the deletes on disk.  A
    ready key begins with its zone's prefix (``keys.text`` is prefix-safe)."""
    prefix = keys.zone_prefix(keys.READY, zone)
    return _unmark_all(marks, [key for key in marks if key.startswith(prefix)])


def _unmark_all(marks: dict[bytes, str], mine: list[bytes]) -> list[Op]:
    return [op for key in mine for op in unmark(marks, key)]


async def write_hold(
    writer: GroupWriter, marks: dict[bytes, str], ops: list[Op], marked: list[bytes], reason: str
) -> None:
    """Write a hold's batch: synced if it marks any (the administrator is told they will be
    held, and a restart must keep that).  If it fails, the marks are undone: a recipient the
    administrator was not told is held must not be held on return."""
    try:
        await writer.submit(ops, sync=bool(marked))
    except BaseException:
        for key in marked:
            if marks.get(key) == reason:
                del marks[key]
        raise
