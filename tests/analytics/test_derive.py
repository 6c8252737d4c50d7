"""The driver-side derivation of the report's tables from the facet counts (no Spark).

``facet_table`` below builds what ``tables.facets`` returns, from its documented contract
(one row per zone, kind and facet value, with its event count, recipients and, for reply
lines, their rank); the derived tables must equal ``reference.py``'s plain-Python
computation from the same events.  The Spark side of the contract is checked against the
same reference in ``test_job.py``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.analytics import reference
from zoneq.analytics import derive, tables

Row = dict[str, Any]
KEY = tuple[Any, ...]


def facet_table(events: list[Row]) -> pa.Table:
    counts: Counter[KEY] = Counter()
    weights: Counter[KEY] = Counter()
    for e in events:
        kind = e["kind"]
        category = (e.get("category") or kind) if kind in tables.REPLY_KINDS else None
        keys: list[tuple[int, int | None, str | None, str | None, str | None, str | None]] = [
            (tables.HOURLY, e["time_ms"] // tables.HOUR_MS, None, None, None, category)
        ]
        if kind == "delivered":
            keys.append((tables.ATTEMPTS, e["attempt"], None, None, None, None))
        if kind in tables.ATTEMPT_KINDS:
            keys.append((tables.DOMAIN, None, e["domain"], e["mx"] or tables.NO_MX, None, None))
            source = e["source_ip"] or tables.NO_SOURCE
            keys.append((tables.SOURCE, None, source, None, None, None))
        if kind in tables.REPLY_KINDS:
            code = "" if e["code"] is None else str(e["code"])
            text = e["text"] or ""
            keys.append((tables.REPLY, None, text, code, e["enhanced"] or "", category))
        for key in keys:
            # the version is kept on the hourly rows only (tables.facets)
            full = (e["v"] if key[0] == tables.HOURLY else None, e["zone"], kind, *key)
            counts[full] += 1
            weights[full] += e["recipients"] if kind == "accepted" else 1
    groups: dict[KEY, list[KEY]] = defaultdict(list)
    for full in counts:  # ranked within facet, zone and category (s4), whatever the kind
        groups[(full[3], full[1], full[8])].append(full)
    rows = []
    for members in groups.values():
        members.sort(key=lambda k: (-counts[k], k[5], k[6], k[7], k[2]))
        for rank, full in enumerate(members, 1):
            if full[3] == tables.REPLY and rank > tables.TOP_REPLIES:
                break
            names = ("v", "zone", "kind", "facet", "num", "s1", "s2", "s3", "s4")
            row = dict(zip(names, full, strict=True))
            rows.append(row | {"n": counts[full], "weight": weights[full], "rank": rank})
    schema = pa.schema(
        [
            ("v", pa.int32()),
            ("zone", pa.string()),
            ("kind", pa.string()),
            ("facet", pa.int32()),
            ("num", pa.int64()),
            ("s1", pa.string()),
            ("s2", pa.string()),
            ("s3", pa.string()),
            ("s4", pa.string()),
            ("n", pa.int64()),
            ("weight", pa.int64()),
            ("rank", pa.int32()),
        ]
    )
    return pa.Table.from_pylist(rows, schema)


# Zones and texts include non-ASCII and upper/lower case: sorting is by UTF-8 bytes.
events_strategy = st.lists(
    st.fixed_dictionaries(
        {
            "v": st.sampled_from([1, 2]),
            "zone": st.sampled_from(["a", "B", "zöne", "z"]),
            "kind": st.sampled_from(tables.ALL_KINDS),
            "time_ms": st.integers(0, 5 * tables.HOUR_MS),
            "attempt": st.integers(0, 3),
            "domain": st.sampled_from(["d1.test", "D2.test", "é.test"]),
            "mx": st.sampled_from([None, "mx1.test", "mx2.test"]),
            "source_ip": st.sampled_from([None, "127.0.1.1", "127.0.1.2"]),
            "code": st.sampled_from([None, 250, 421, 451, 550]),
            "enhanced": st.sampled_from([None, "4.3.0", "5.1.1"]),
            "text": st.sampled_from([None, "", "Try again", "No such user", "Über voll"]),
            "recipients": st.integers(1, 5),
            # None: a version 1 event, or a version 2 one stored before categories; the
            # texts of two categories may be the same (and an outcome's name a category)
            "category": st.sampled_from([None, "network", "blocklisted", "Über", "deferred"]),
        }
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(events_strategy)
def test_derived_tables_equal_the_plain_python_reference(events: list[Row]) -> None:
    facets = facet_table(events)
    made = {name: table.to_pylist() for name, table in derive.event_tables(facets).items()}
    expected = {
        "zones": reference.zones(events),
        "hourly": reference.hourly(events),
        "attempts": reference.attempts(events),
        "domains": reference.rates_by(events, "domain", tables.NO_SOURCE),
        "mx": reference.rates_by(events, "mx", tables.NO_MX),
        "sources": reference.rates_by(events, "source_ip", tables.NO_SOURCE),
        "replies": reference.replies(events, tables.TOP_REPLIES),
        "categories": reference.categories(events),
    }
    assert made == expected
    assert derive.versions(facets) == (dict(Counter(e["v"] for e in events)))


def test_many_reply_lines_keep_the_top_ones_in_order() -> None:
    """More distinct reply lines than TOP_REPLIES in one zone and outcome."""
    events = [
        {
            "v": 1,
            "zone": "z",
            "kind": "deferred",
            "time_ms": 0,
            "attempt": 1,
            "domain": "d",
            "mx": None,
            "source_ip": None,
            "code": 451,
            "enhanced": "4.3.0",
            "text": f"text {i % 15}",
            "recipients": 1,
        }
        for i in range(100)
    ]
    made = derive.replies(facet_table(events)).to_pylist()
    assert made == reference.replies(events)
    assert [row["rank"] for row in made] == list(range(1, tables.TOP_REPLIES + 1))


def test_versions_count_every_event_once_per_version() -> None:
    events = [
        {"v": v, "zone": "z", "kind": "accepted", "time_ms": 0, "attempt": 0, "domain": "",
         "mx": None, "source_ip": None, "code": None, "enhanced": None, "text": None,
         "recipients": 7}
        for v in (1, 1, 2, None)
    ]  # fmt: skip
    assert derive.versions(facet_table(events)) == {1: 2, 2: 1, None: 1}


@pytest.mark.parametrize(
    ("values", "order", "expected"),
    [
        ([3, None, 1], "ascending", [None, 1, 3]),  # Spark: nulls first when ascending
        ([3, None, 1], "descending", [3, 1, None]),  # and last when descending
        (["é", "b", "Z", None, "a"], "ascending", [None, "Z", "a", "b", "é"]),  # UTF-8 bytes
        (["é", "b", "Z", "a"], "descending", ["é", "b", "a", "Z"]),
    ],
)
def test_sorting_follows_spark(values: list[Any], order: str, expected: list[Any]) -> None:
    table = pa.table({"x": values})
    assert derive.sort(table, [("x", order)])["x"].to_pylist() == expected


def test_sorting_by_several_keys_breaks_ties_in_turn() -> None:
    table = pa.table({"zone": ["b", "a", "a", "a"], "n": [1, 1, 5, 5], "k": ["x", "y", "z", "w"]})
    ordered = derive.sort(table, [("zone", "ascending"), ("n", "descending"), ("k", "ascending")])
    assert ordered["k"].to_pylist() == ["w", "z", "y", "x"]


def test_empty_facets_give_empty_tables_with_their_columns() -> None:
    made = derive.event_tables(facet_table([]))
    assert all(table.num_rows == 0 for table in made.values())
    assert made["zones"].column_names == ["zone", *tables.ALL_KINDS]
    assert made["domains"].column_names[:3] == ["zone", "domain", "attempts"]
