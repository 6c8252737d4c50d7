"""O(1) queue sizes, kept by the single writer and persisted in the same batch as the change.

Apache James answered ``getSize`` with a full scan; here every transition adjusts the counts
it changes in memory, and the group writer asks for the changed ones when it seals a group,
so the persisted counts always match the records written in that batch, also after a crash.
A count that falls to zero is deleted rather than stored, so per-domain counters do not pile
up for every domain ever seen.

Counted, for every zone: recipients per state (``ready``, ``deferred``, ``held``) and the same
per destination domain; store-wide: ``messages``.  Leased recipients are a subset of ready
ones and are counted in memory by the lease table, not here.

There is one per-domain counter per zone, state and destination domain: 50,000 of them for a
bulk sender's long tail.  The zone list (every ``/metrics`` scrape, ``GET /api/v1/queue``, the
service's promotion pass) and one zone's per-domain counts are therefore read from an index of
the non-zero counters, by zone and name, kept as counts change: a count only enters or leaves
it when it crosses zero, so ``add`` pays two truth tests on its common path (about 20 ns),
and ``zones()`` costs O(zones) rather than a walk of every counter (issue 4).
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


# Cached: a domain with one recipient queued at a time crosses zero twice per recipient, and
# decoding a key costs three text decodes.  Smaller than domain_key's cache: only counters that
# keep crossing zero profit, and a long tail of one-off domains would only churn it.
@functools.lru_cache(maxsize=8192)
def _group(key: bytes) -> tuple[tuple[str, str], str]:
    """A counter key's ``(name, zone)`` group and its sub (a domain, or "")."""
    name, zone, sub = keys.decode_counter(key)
    return (name, zone), sub


class Counters:
    __slots__ = ("_dirty", "_groups", "_values")

    def __init__(self) -> None:
        self._values: dict[bytes, int] = {}
        self._dirty: set[bytes] = set()
        # (name, zone) -> {key: sub} of every non-zero counter but MESSAGES.  A group that
        # empties is kept, so a domain that keeps entering and leaving costs no allocation;
        # there are at most six groups per zone (three states, per zone and per domain).
        self._groups: dict[tuple[str, str], dict[bytes, str]] = {}

    def get(self, key: bytes) -> int:
        return self._values.get(key, 0)

    def add(self, key: bytes, delta: int) -> None:
        values = self._values
        old = values.get(key, 0)
        new = values[key] = old + delta
        self._dirty.add(key)
        # The groups hold exactly the non-zero counters: only a crossing of zero changes them.
        if not old:
            if new:
                self._enter(key)
        elif not new:
            self._leave(key)

    def _enter(self, key: bytes) -> None:
        if key == MESSAGES:  # store-wide, in no zone
            return
        group, sub = _group(key)
        subs = self._groups.get(group)
        if subs is None:
            self._groups[group] = {key: sub}
        else:
            subs[key] = sub

    def _leave(self, key: bytes) -> None:
        if key != MESSAGES:
            del self._groups[_group(key)[0]][key]

    def move(self, zone: str, domain: str, source: str | None, target: str | None) -> None:
        """One recipient changes state (``None``: enters or leaves the queue)."""
        # No str() of the state: a StrEnum member hashes, compares and encodes as its value,
        # so the key caches answer it as they answer the text, and str() of a StrEnum member
        # runs Enum.__str__ in Python (about 150 ns, twice per move: more than the index).
        if source is not None:
            self.add(zone_key(zone, source), -1)
            self.add(domain_key(zone, domain, source), -1)
        if target is not None:
            self.add(zone_key(zone, target), 1)
            self.add(domain_key(zone, domain, target), 1)

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
        self._groups = {}
        for key, value in self._values.items():
            if value:
                self._enter(key)
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
        """``(sub, value)`` for every non-zero counter ``name`` of ``zone`` (e.g. per-domain
        counts): O(those counters), whatever other zones hold."""
        values = self._values
        for key, sub in self._groups.get((name, zone), {}).items():
            yield sub, values[key]

    def zones(self) -> set[str]:
        """Zones with a non-zero count: O(zones)."""
        return {zone for (_, zone), subs in self._groups.items() if subs}

    def snapshot(self) -> dict[bytes, int]:
        return {k: v for k, v in self._values.items() if v}
