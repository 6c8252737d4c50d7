"""The counters' index of non-zero counts: ``zones()`` in O(zones), ``items()`` in O(one group).

The oracle is the full walk ``zones()`` and ``items()`` used to be: decode every non-zero
counter.  A stateful property drives :class:`Counters` with ``move``, ``add``, ``seal`` and
``load`` (through a real LevelDB directory, with per-domain counts left under a U-label as a
queue written before domains were normalised has them) beside a plain dict model of the
counts, and checks after every step that the index answers what the walk of the model gives.
A scale test with 50,000 domains in one zone counts the values the index reads, so it fails
on any walk of every counter whatever the machine's speed; a store test checks the answers
against a scan of the records, before and after a reopen.
"""

from __future__ import annotations

import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests.storage.conftest import T0, async_test, queue_message
from tests.storage.test_store import LATER, OK, lease_one
from zoneq.protocol.domains import normal_domain
from zoneq.storage import keys
from zoneq.storage.counters import MESSAGES, Counters
from zoneq.storage.leveldb import Database
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

_VALUE = struct.Struct(">q")
STATES = ("ready", "deferred", "held")
NAMES = STATES + tuple("domain-" + s for s in STATES)
# "" is not a real zone, but its counters are still not MESSAGES (store-wide, zone "").
ZONES = ("default", "bulk", "z\x00one", "")
# A U-label and its A-label are one count; "" is an address without a domain.
DOMAINS = ("example.net", "Example.NET", "bücher.example", "xn--bcher-kva.example", "")

Groups = dict[tuple[str, str], dict[str, int]]


def walk(values: dict[bytes, int]) -> tuple[set[str], Groups]:
    """The oracle: what a walk of every counter finds (zones, and (name, zone) -> sub -> n)."""
    zones: set[str] = set()
    groups: Groups = {}
    for key, value in values.items():
        if not value or key == MESSAGES:
            continue
        name, zone, sub = keys.decode_counter(key)
        zones.add(zone)
        groups.setdefault((name, zone), {})[sub] = value
    return zones, groups


def assert_index_matches(counters: Counters, values: dict[bytes, int]) -> None:
    zones, groups = walk(values)
    assert counters.zones() == zones
    for name in NAMES:
        for zone in (*ZONES, *zones):
            found = list(counters.items(name, zone))
            assert len(found) == len({sub for sub, _ in found}), found  # each sub once
            assert dict(found) == groups.get((name, zone), {}), (name, zone)


def zone_counter(zone: str, state: str) -> bytes:
    return keys.counter(state, zone, "")


def domain_counter(zone: str, domain: str, state: str) -> bytes:
    return keys.counter("domain-" + state, zone, normal_domain(domain))


# As the store passes them (State members) and as text; leased ones are the lease table's.
states = st.sampled_from([None, State.READY, State.DEFERRED, State.HELD, *STATES])


class CountersMachine(RuleBasedStateMachine):
    """``Counters`` beside a dict model; ``persisted`` is what the database holds."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="zoneq-counters-"))
        self.db = Database(self.root / "db")
        self.counters = Counters()
        self.model: dict[bytes, int] = {}
        self.persisted: dict[bytes, int] = {}
        self.changed: set[bytes] = set()

    def teardown(self) -> None:
        self.db.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def bump(self, key: bytes, delta: int) -> None:
        self.model[key] = self.model.get(key, 0) + delta
        self.changed.add(key)

    @rule(
        zone=st.sampled_from(ZONES),
        domain=st.sampled_from(DOMAINS),
        source=states,
        dest=states,  # ("target" names a rule's bundle in Hypothesis)
    )
    def move(self, zone: str, domain: str, source: str | None, dest: str | None) -> None:
        self.counters.move(zone, domain, source, dest)
        for state, delta in ((source, -1), (dest, 1)):
            if state is not None:
                self.bump(zone_counter(zone, str(state)), delta)
                self.bump(domain_counter(zone, domain, str(state)), delta)

    @rule(
        key=st.one_of(
            st.just(MESSAGES),
            st.builds(zone_counter, st.sampled_from(ZONES), st.sampled_from(STATES)),
            st.builds(
                domain_counter,
                st.sampled_from(ZONES),
                st.sampled_from(DOMAINS),
                st.sampled_from(STATES),
            ),
        ),
        delta=st.integers(-3, 3),
    )
    def add(self, key: bytes, delta: int) -> None:
        self.counters.add(key, delta)
        self.bump(key, delta)

    @rule()
    def seal(self) -> None:
        self.db.write(self.counters.seal(), sync=False)
        for key in self.changed:  # what changed since the last seal is written, 0 deleted
            self.persisted[key] = self.model[key]
            if not self.model[key]:
                del self.persisted[key]
        self.changed.clear()
        on_disk = {k: _VALUE.unpack(v)[0] for k, v in self.db.items(prefix=keys.COUNTER)}
        assert on_disk == self.persisted  # zero counts deleted, the rest written

    @rule(
        zone=st.sampled_from(ZONES),
        state=st.sampled_from(STATES),
        count=st.integers(1, 3),
    )
    def legacy_u_label(self, zone: str, state: str, count: int) -> None:
        """A per-domain count stored under a U-label, as before domains were normalised."""
        key = keys.counter("domain-" + state, zone, "bücher.example")
        self.db.write([(key, _VALUE.pack(count))], sync=False)
        self.persisted[key] = count

    @rule(fresh=st.booleans())
    def load(self, fresh: bool) -> None:
        """Open as the store does: the database's counts, U-label ones folded; changes not
        sealed are gone (``fresh``: a new object, else the old one with a stale index)."""
        if fresh:
            self.counters = Counters()
        self.counters.load(self.db)
        self.model = dict(self.persisted)
        self.changed.clear()
        for key, value in list(self.model.items()):
            name, zone, sub = keys.decode_counter(key)
            if name.startswith("domain-") and normal_domain(sub) != sub:
                self.bump(keys.counter(name, zone, normal_domain(sub)), value)
                self.bump(key, -value)

    @invariant()
    def index_is_the_walk(self) -> None:
        assert self.counters.snapshot() == {k: v for k, v in self.model.items() if v}
        assert_index_matches(self.counters, self.model)


CountersMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
test_counters_index = CountersMachine.TestCase


# --- scale ----------------------------------------------------------------------------------


class Touches(dict[bytes, int]):
    """A counters dict that counts the entries read through it (iteration or lookup)."""

    reads = 0

    def __iter__(self) -> Iterator[bytes]:
        for key in super().__iter__():
            self.reads += 1
            yield key

    def items(self) -> Any:
        for pair in super().items():
            self.reads += 1
            yield pair

    def values(self) -> Any:
        for value in super().values():
            self.reads += 1
            yield value

    def __getitem__(self, key: bytes) -> int:
        self.reads += 1
        return super().__getitem__(key)

    def get(self, key: bytes, default: Any = None) -> Any:
        self.reads += 1
        return super().get(key, default)


def test_zones_and_items_do_not_walk_50000_domains(tmp_path: Path) -> None:
    big = 50_000
    counters = Counters()
    for i in range(big):
        counters.move("bulk", f"d{i}.test", None, State.READY)
    for domain in ("a.test", "b.test", "c.test"):
        counters.move("small", domain, None, State.DEFERRED)
    counters.add(MESSAGES, big)
    db = Database(tmp_path / "db")
    try:
        db.write(counters.seal(), sync=False)
        loaded = Counters()  # the index as load builds it, from a real database
        loaded.load(db)
    finally:
        db.close()
    for c in (counters, loaded):
        touches = Touches(c._values)  # what the answers read of the counts, and nothing else
        c._values = touches
        assert c.zones() == {"bulk", "small"}
        assert touches.reads == 0, "zones() walked the counters"
        assert dict(c.items("domain-deferred", "small")) == {"a.test": 1, "b.test": 1, "c.test": 1}
        assert dict(c.items("domain-ready", "small")) == {}
        assert touches.reads == 3, "items() read more than the zone's own counters"
        touches.reads = 0
        assert len(dict(c.items("domain-ready", "bulk"))) == big
        assert touches.reads == big
        # The index shrinks with the counts: a zone whose counts are all gone is not listed.
        for domain in ("a.test", "b.test", "c.test"):
            c.move("small", domain, State.DEFERRED, None)
        assert c.zones() == {"bulk"}


# --- through the store ----------------------------------------------------------------------


def assert_store_matches_records(store: QueueStore) -> None:
    """zones() and domain_counts() equal a walk of the counts a scan of the records gives."""
    truth = store.recount()
    zones, groups = walk(truth)
    assert store.zones() == zones
    for zone in zones | {"default", "bulk"}:
        for state in (State.READY, State.DEFERRED, State.HELD):
            expected = groups.get(("domain-" + state.value, zone), {})
            assert store.domain_counts(zone, state) == expected


@async_test
async def test_store_answers_match_a_scan_before_and_after_reopen(stores: Any) -> None:
    store = stores.open()
    await queue_message(
        store,
        [("a@one.example", "default"), ("b@Bücher.example", "default"), ("c@two.example", "bulk")],
    )
    await queue_message(store, [("d@xn--bcher-kva.example", "default"), ("e@one.example", "bulk")])
    await store.drain()
    assert_store_matches_records(store)
    assert store.zones() == {"default", "bulk"}
    assert store.domain_counts("default", State.READY) == {
        "one.example": 1,
        "xn--bcher-kva.example": 2,  # U-label and A-label: one domain
    }
    # bulk empties: one delivered, one deferred then back to ready, then delivered
    await store.complete(lease_one(store, "bulk"), T0, OK)
    await store.defer(lease_one(store, "bulk"), T0, T0 + 1, LATER)
    await store.drain()
    assert_store_matches_records(store)
    assert store.domain_counts("bulk", State.DEFERRED) == {"one.example": 1}
    assert store.domain_counts("bulk", State.READY) == {}
    await store.promote_due("bulk", T0 + 2)
    await store.complete(lease_one(store, "bulk"), T0 + 2, OK)
    await store.drain()
    assert_store_matches_records(store)
    assert store.zones() == {"default"}
    await store.close()

    again = stores.open()  # load() builds the index from the database
    assert_store_matches_records(again)
    assert again.zones() == {"default"}
    assert again.domain_counts("default", State.READY) == {
        "one.example": 1,
        "xn--bcher-kva.example": 2,
    }
