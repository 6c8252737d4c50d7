"""The driver side of the report: Spark's small results pivoted and sorted into its tables.

``tables.facets`` leaves a few thousand counts per zone (``FACET_COLUMNS``); the tables of
the report are sums and pivots of those, done here with pyarrow's vectorised kernels
instead of a Spark query each (see ``tables.py`` for why).  The results have the column
names and types the tables always had: counts ``int64``, attempt numbers and ranks
``int32``, rates ``float64``.

Sorting happens here as well, in Spark's order: strings by their UTF-8 bytes (pyarrow
compares strings as bytes too), nulls first in ascending order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import pyarrow as pa
import pyarrow.compute as pc

from zoneq.analytics.tables import (
    ALL_KINDS,
    ATTEMPT_KINDS,
    ATTEMPTS,
    HOUR_MS,
    HOURLY,
    RATE_FACETS,
    REPLY,
    REPLY_KINDS,
)

Order = Sequence[tuple[str, str]]
_ASC: Final = "ascending"
_DESC: Final = "descending"


def sort(table: pa.Table, order: Order) -> pa.Table:
    """Spark's order: nulls first when ascending, last when descending."""
    keys = [(name, how, "at_start" if how == _ASC else "at_end") for name, how in order]
    return table.sort_by(keys)


def _facet(facets: pa.Table, facet: int) -> pa.Table:
    return facets.filter(pc.equal(facets["facet"], facet))


def _pivot(table: pa.Table, keys: list[str], value: str, kinds: Sequence[str]) -> pa.Table:
    """Per ``keys``: the sum of ``value`` for each kind, one column per kind (0 if none)."""
    zero = pa.scalar(0, pa.int64())
    columns = {key: table[key] for key in keys}
    for kind in kinds:
        columns[kind] = pc.if_else(pc.equal(table["kind"], kind), table[value], zero)
    summed = (
        pa.table(columns)
        .group_by(keys, use_threads=False)
        .aggregate([(kind, "sum") for kind in kinds])
    )
    return _renamed(summed, keys, kinds)


def _renamed(summed: pa.Table, keys: list[str], kinds: Sequence[str]) -> pa.Table:
    """``group_by`` names its outputs ``<column>_sum`` and puts the keys last."""
    return pa.table({**{k: summed[k] for k in keys}, **{k: summed[f"{k}_sum"] for k in kinds}})


def versions(facets: pa.Table) -> dict[int | None, int]:
    """Events per schema version (every event has exactly one hourly facet row)."""
    hourly_rows = _facet(facets, HOURLY)
    summed = hourly_rows.group_by("v", use_threads=False).aggregate([("n", "sum")])
    return dict(zip(summed["v"].to_pylist(), summed["n_sum"].to_pylist(), strict=True))


def zones(facets: pa.Table) -> pa.Table:
    """Per zone: recipients accepted and events of every other kind."""
    hourly_rows = _facet(facets, HOURLY)
    accepted = pc.equal(hourly_rows["kind"], "accepted")
    # an accepted event weighs the recipients it queued; every other event weighs 1
    value = pc.if_else(accepted, hourly_rows["weight"], hourly_rows["n"])
    table = pa.table({"zone": hourly_rows["zone"], "kind": hourly_rows["kind"], "value": value})
    return sort(_pivot(table, ["zone"], "value", ALL_KINDS), [("zone", _ASC)])


def hourly(facets: pa.Table) -> pa.Table:
    """Per zone, hour and outcome: recipients (volumes by outcome per hour)."""
    rows = _facet(facets, HOURLY)
    summed = rows.group_by(["zone", "num", "kind"], use_threads=False).aggregate(
        [("weight", "sum")]
    )
    start = pc.cast(pc.multiply(summed["num"], HOUR_MS), pa.timestamp("ms"))
    table = pa.table(
        {
            "zone": summed["zone"],
            "hour": pc.strftime(start, format="%Y-%m-%d %H:00"),
            "outcome": summed["kind"],
            "recipients": summed["weight_sum"],
        }
    )
    return sort(table, [("zone", _ASC), ("hour", _ASC), ("outcome", _ASC)])


def attempts(facets: pa.Table) -> pa.Table:
    """Per zone: how many delivered recipients needed 1, 2, ... attempts."""
    summed = (
        _facet(facets, ATTEMPTS)
        .group_by(["zone", "num"], use_threads=False)
        .aggregate([("n", "sum")])
    )
    table = pa.table(
        {
            "zone": summed["zone"],
            "attempts": pc.cast(summed["num"], pa.int32()),
            "delivered": summed["n_sum"],
        }
    )
    return sort(table, [("zone", _ASC), ("attempts", _ASC)])


def rates(facets: pa.Table, facet: int, key: str, label: str) -> pa.Table:
    """Per zone and ``label`` (domain, MX, source address; in the ``facet`` rows' column
    ``key``): attempts, outcomes and rates."""
    rows = _facet(facets, facet)
    keyed = pa.table({"zone": rows["zone"], label: rows[key], "kind": rows["kind"], "n": rows["n"]})
    counts = _pivot(keyed, ["zone", label], "n", ATTEMPT_KINDS)
    failed = pc.add(counts["bounced"], counts["expired"])
    finished = pc.add(counts["delivered"], failed)
    tried = pc.add(finished, counts["deferred"])
    table = pa.table(
        {
            "zone": counts["zone"],
            label: counts[label],
            "attempts": tried,
            **{kind: counts[kind] for kind in ATTEMPT_KINDS},
            "deferral_rate": _ratio(counts["deferred"], tried),
            "bounce_rate": _ratio(failed, finished),
        }
    )
    return sort(table, [("zone", _ASC), ("attempts", _DESC), (label, _ASC)])


def _ratio(numerator: pa.ChunkedArray, denominator: pa.ChunkedArray) -> pa.ChunkedArray:
    """numerator / denominator as float64, null where the denominator is 0."""
    positive = pc.greater(denominator, 0)
    quotient = pc.divide(pc.cast(numerator, pa.float64()), pc.cast(denominator, pa.float64()))
    return pc.if_else(positive, quotient, pa.scalar(None, pa.float64()))


def replies(facets: pa.Table) -> pa.Table:
    """Per zone and failure category: the most frequent reply texts (ranked by Spark), with
    the outcome each came with."""
    rows = _facet(facets, REPLY)
    table = pa.table(
        {
            "zone": rows["zone"],
            "category": rows["s4"],
            "outcome": rows["kind"],
            "code": rows["s2"],
            "enhanced": rows["s3"],
            "text": rows["s1"],
            "events": rows["n"],
            "rank": pc.cast(rows["rank"], pa.int32()),
        }
    )
    return sort(table, [("zone", _ASC), ("category", _ASC), ("rank", _ASC)])


def categories(facets: pa.Table) -> pa.Table:
    """Per zone and failure category: its events of each failed outcome and in all, the
    most frequent first (summed from the hourly rows, which carry the category)."""
    rows = _facet(facets, HOURLY)
    rows = rows.filter(pc.is_valid(rows["s4"]))
    keyed = pa.table(
        {"zone": rows["zone"], "category": rows["s4"], "kind": rows["kind"], "n": rows["n"]}
    )
    counts = _pivot(keyed, ["zone", "category"], "n", REPLY_KINDS)
    total = counts[REPLY_KINDS[0]]
    for kind in REPLY_KINDS[1:]:
        total = pc.add(total, counts[kind])
    table = counts.append_column("events", total)
    return sort(table, [("zone", _ASC), ("events", _DESC), ("category", _ASC)])


def event_tables(facets: pa.Table) -> dict[str, pa.Table]:
    """Every table of the report that comes from the facet counts."""
    made = {
        "zones": zones(facets),
        "hourly": hourly(facets),
        "attempts": attempts(facets),
    }
    for name, (facet, key, label) in RATE_FACETS.items():
        made[name] = rates(facets, facet, key, label)
    made["replies"] = replies(facets)
    made["categories"] = categories(facets)
    return made


def delivery(table: pa.Table) -> pa.Table:
    return sort(table, [("zone", _ASC)])


def queue_versions(queue_age: pa.Table) -> dict[int | None, int]:
    """Queued recipients per schema version of the queue export."""
    summed = queue_age.group_by("v", use_threads=False).aggregate([("recipients", "sum")])
    return dict(zip(summed["v"].to_pylist(), summed["recipients_sum"].to_pylist(), strict=True))


def queue_age(table: pa.Table) -> pa.Table:
    return sort(table.drop_columns(["v"]), [("zone", _ASC), ("state", _ASC)])


def queue_domains(table: pa.Table) -> pa.Table:
    return sort(table, [("zone", _ASC), ("recipients", _DESC), ("domain", _ASC)])
