"""O(1) queue sizes, kept by the single writer and persisted in the same batch as the change.

Apache James answered ``getSize`` with a full scan; here every transition adjusts the counts
it changes in memory, and the group writer asks for the changed ones when it seals a group,
so the persisted counts always match the records written in that batch, also after a crash.
A count that falls to zero is deleted rather than stored, so per-domain counters do not pile
up for every domain ever seen.

Counted, for every zone: recipients per state (``ready``, ``deferred``, ``held``) and the same
per destination domain; store-wide: ``messages``.  Leased recipients are a subset of ready
ones and are counted in memory by the lease table, not here.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator
from typing import Final

from zoneq.protocol.domains import normal_domain
from zoneq.storage import keys
from zoneq.storage.leveldb import Database, Op

_VALUE: Final = struct.Struct(">q")
MESSAGES: Final = keys.counter("messages", "", "")


# Cached: every commit and every outcome needs two of these, and building one costs three
# text encodings.  Bounded, so a bulk sender's long tail of domains cannot grow it forever.
@functools.lru_cache(maxsize=1024)
def zone_key(zone: str, state: str) -> bytes:
    return keys.counter(state, zone, "")


_DOMAIN: Final = "domain-"
_DOMAIN_PREFIX: Final = keys.COUNTER + _DOMAIN.encode()


@functools.lru_cache(maxsize=65536)
def domain_key(zone: str, domain: str, state: str) -> bytes:
    # Keyed by the domain's normal form whoever asks (the commit path's inline split, a
    # record's stored domain, an address): a U-label and its A-label are one count, and a
    # record stored before domains were normalised leaves the count it entered.
    return keys.counter(_DOMAIN + state, zone, normal_domain(domain))


class Counters:
    __slots__ = ("_dirty", "_values")

    def __init__(self) -> None:
        self._values: dict[bytes, int] = {}
        self._dirty: set[bytes] = set()

    def get(self, key: bytes) -> int:
        return self._values.get(key, 0)

    def add(self, key: bytes, delta: int) -> None:
        self._values[key] = self._values.get(key, 0) + delta
        self._dirty.add(key)

    def move(self, zone: str, domain: str, source: str | None, target: str | None) -> None:
        """One recipient changes state (``None``: enters or leaves the queue)."""
        if source is not None:
            self.add(zone_key(zone, str(source)), -1)
            self.add(domain_key(zone, domain, str(source)), -1)
        if target is not None:
            self.add(zone_key(zone, str(target)), 1)
            self.add(domain_key(zone, domain, str(target)), 1)

    def seal(self) -> list[Op]:
        """The changed counters as writes, for the group being sealed."""
        ops: list[Op] = []
        values = self._values
        for key in self._dirty:
            value = values.get(key, 0)
            if value == 0:
                values.pop(key, None)
                ops.append((key, None))
            else:
                ops.append((key, _VALUE.pack(value)))
        self._dirty.clear()
        return ops

    def load(self, db: Database) -> None:
        self._values = {
            key: _VALUE.unpack(value)[0] for key, value in db.items(prefix=keys.COUNTER)
        }
        self._dirty.clear()
        self._fold_domains()

    def _fold_domains(self) -> None:
        """Move per-domain counts stored under a form that is not normal (a U-label,
        written before domains were normalised) to the normal form's key, as every later
        change to them will be made there; the old key is deleted with the next group."""
        for key in [k for k in self._values if k.startswith(_DOMAIN_PREFIX)]:
            name, zone, domain = keys.decode_counter(key)
            normal = normal_domain(domain)
            if normal != domain:
                self.add(keys.counter(name, zone, normal), self._values[key])
                self.add(key, -self._values[key])

    def items(self, name: str, zone: str) -> Iterator[tuple[str, int]]:
        """``(sub, value)`` for every counter ``name`` of ``zone`` (e.g. per-domain counts)."""
        prefix = keys.counter(name, zone, "")[:-1]  # drop the empty sub's terminator
        for key, value in self._values.items():
            if key.startswith(prefix) and value:
                _, _, sub = keys.decode_counter(key)
                yield sub, value

    def zones(self) -> set[str]:
        found = set()
        for key, value in self._values.items():
            if value and key != MESSAGES:
                _, zone, _ = keys.decode_counter(key)
                found.add(zone)
        return found

    def snapshot(self) -> dict[bytes, int]:
        return {k: v for k, v in self._values.items() if v}
