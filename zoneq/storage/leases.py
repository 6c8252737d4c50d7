"""The leases out, by record key, with how many each zone has kept as they change.

``/api/v1/queue`` and ``/metrics`` ask every zone's leased count (issue 4: counts are
O(1)).  Counting them by walking the leases cost one pass over up to a zone window per
zone per call; here the count moves with every lease taken or given back, one Counter
step each, so the delivery path pays a few hundred nanoseconds per lease for it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zoneq.storage.base import Lease

__all__ = ["LeaseTable"]

_MISSING = object()


class LeaseTable(dict[bytes, "Lease"]):
    """A ``dict`` of leases whose every change also moves ``in_zone``'s count.

    Every mutating ``dict`` method the store uses goes through ``__setitem__`` or
    ``__delitem__``; the others are refused, so no path can change the leases uncounted.
    """

    __slots__ = ("_zones",)

    def __init__(self) -> None:
        super().__init__()
        self._zones: Counter[str] = Counter()

    def in_zone(self, zone: str) -> int:
        return self._zones[zone]

    def __setitem__(self, key: bytes, lease: Lease) -> None:
        old = dict.get(self, key)
        if old is not None:
            self._forget(old)
        dict.__setitem__(self, key, lease)
        self._zones[lease.recipient.zone] += 1

    def __delitem__(self, key: bytes) -> None:
        self._forget(dict.pop(self, key))

    def pop(self, key: bytes, default: object = _MISSING) -> object:  # type: ignore[override]
        if key in self:
            lease = dict.pop(self, key)
            self._forget(lease)
            return lease
        if default is _MISSING:
            raise KeyError(key)
        return default

    def update(  # type: ignore[override]
        self, leases: Mapping[bytes, Lease] | Iterable[tuple[bytes, Lease]] = ()
    ) -> None:
        pairs = leases.items() if isinstance(leases, Mapping) else leases
        for key, lease in pairs:
            self[key] = lease

    def clear(self) -> None:
        dict.clear(self)
        self._zones.clear()

    def _forget(self, lease: Lease) -> None:
        zone = lease.recipient.zone
        left = self._zones[zone] - 1
        if left:
            self._zones[zone] = left
        else:
            del self._zones[zone]

    def _refused(self, *args: object, **kwargs: object) -> None:
        raise TypeError("LeaseTable changes only through [], del, pop, update and clear")

    setdefault = popitem = __ior__ = _refused  # type: ignore[assignment]
