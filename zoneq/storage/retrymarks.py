"""Retries that wait for an attempt: the marks of leased recipients to make due at once.

An administrator's "retry now" (of a message, a domain or a zone) resets the delay of
deferred recipients; one that is leased at that moment (an attempt on the wire, or a job the
queue service has not handed out yet) cannot be moved, since its worker's report must still
find it ready.  So the store *marks* it instead (``StoreBase._retry_marks``: ready key -> the
lease's token), and the retry counts it.  When that lease ends in a deferral (``defer``) the
recipient is written back as ready, due now, instead of waiting its retry interval; the
attempt stays on record (its DEFERRED event, its attempt count), as a hold on return keeps
it (``holdmarks.py``).  Postfix's ``postqueue -f`` leaves active mail alone; an operator
who says "retry now" during an outage means every recipient of that scope.

Memory only, unlike a hold's mark: a lease does not survive a restart, and at start-up every
recipient that was in flight is ready at once anyway (``maintenance.recover``).  A mark holds
its lease's token, so it can only ever act on that lease: a mark a path left behind (a lease
that did not outlive a reopen) never makes a later lease of the same record due early.
Every end of a lease forgets it: a deferral acts on it; a delivery, a bounce, a job given back
(ready at once already) or a hold on return drop it; and so does any removal of the record
(``StoreBase._remove_key``: a delete, a purge, an orphan's removal) and a hold of it; a
delete that revokes the lease forgets it once its batch lands, since one that fails gives
the lease back, and its deferral must still be due at once.

Outcomes without a pending retry pay one truthiness test of an empty dict.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the store's base imports this module)
    from zoneq.storage.base import Lease


def mark(marks: dict[bytes, int], leases: Iterable[Lease]) -> int:
    """Mark these leases to be due at once if they end in a deferral; how many."""
    marked = 0
    for lease in leases:
        marks[lease.key] = lease.token
        marked += 1
    return marked


def due_now(marks: dict[bytes, int], lease: Lease) -> bool:
    """Whether ``lease`` was marked by a retry; forgets its mark either way."""
    return marks.pop(lease.key, None) == lease.token


def forget(marks: dict[bytes, int], key: bytes) -> None:
    """Forget the mark on ``key`` (its lease ended undeferred, or its record went)."""
    marks.pop(key, None)
