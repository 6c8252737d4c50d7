"""``LeaseTable``: the per-zone leased count always equals a recount of the leases."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoneq.storage.base import Lease
from zoneq.storage.leases import LeaseTable
from zoneq.storage.records import Recipient

ZONES = ("a", "b", "c")


def lease(key: int, zone: str) -> Lease:
    return Lease(key, b"k%d" % key, Recipient(zone, 1, f"r{key}@x.test", "x.test"), "w")


_STEP = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 9), st.sampled_from(ZONES)),
    st.tuples(st.just("del"), st.integers(0, 9), st.none()),
    st.tuples(st.just("pop"), st.integers(0, 9), st.none()),
    st.tuples(
        st.just("update"),
        st.lists(st.tuples(st.integers(0, 9), st.sampled_from(ZONES)), max_size=4),
        st.none(),
    ),
    st.tuples(st.just("clear"), st.none(), st.none()),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_STEP, max_size=40))
def test_the_zone_counts_follow_every_change(steps: list[tuple[str, object, object]]) -> None:
    table = LeaseTable()
    model: dict[bytes, Lease] = {}
    for verb, arg, zone in steps:
        if verb == "set":
            assert isinstance(arg, int) and isinstance(zone, str)
            table[b"k%d" % arg] = model[b"k%d" % arg] = lease(arg, zone)
        elif verb == "del":
            assert isinstance(arg, int)
            key = b"k%d" % arg
            if key in model:
                del model[key]
                del table[key]
            else:
                with pytest.raises(KeyError):
                    del table[key]
        elif verb == "pop":
            assert isinstance(arg, int)
            key = b"k%d" % arg
            assert table.pop(key, None) == model.pop(key, None)
        elif verb == "update":
            assert isinstance(arg, list)
            pairs = {b"k%d" % k: lease(k, z) for k, z in arg}
            model.update(pairs)
            table.update(pairs)
        else:
            model.clear()
            table.clear()
        assert dict(table) == model
        recount = Counter(item.recipient.zone for item in model.values())
        assert {zone: table.in_zone(zone) for zone in ZONES} == {z: recount[z] for z in ZONES}


def test_changes_that_would_go_uncounted_are_refused() -> None:
    table = LeaseTable()
    with pytest.raises(TypeError):
        table.setdefault(b"k1", lease(1, "a"))
    with pytest.raises(TypeError):
        table.popitem()
    with pytest.raises(KeyError):
        table.pop(b"nope")
