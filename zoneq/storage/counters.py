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

from zoneq.storage import keys
from zoneq.storage.leveldb import Database, Op

_VALUE: Final = struct.Struct(">q")
MESSAGES: Final = keys.counter("messages", "", "")


# Cached: every commit and every outcome needs two of these, and building one costs three
# text encodings.  Bounded, so a bulk sender's long tail of domains cannot grow it forever.
@functools.lru_cache(maxsize=1024)
def zone_key(zone: str, state: str) -> bytes:
    return keys.counter(state, zone, "")


@functools.lru_cache(maxsize=65536)
def domain_key(zone: str, domain: str, state: str) -> bytes:
    return keys.counter("domain-" + state, zone, domain)


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
