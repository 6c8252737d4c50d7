"""Every report table computed again in plain Python, from the same event records.

Written from the definitions in ``zoneq/analytics/tables.py``'s docstring, not from its
code: loops and dicts, no Spark.  Each function returns rows as dicts with the table's
columns, in the table's order.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

Row = dict[str, Any]
ATTEMPT_KINDS = ("delivered", "deferred", "bounced", "expired")
REPLY_KINDS = ("deferred", "bounced", "expired", "delayed")
OTHER_KINDS = ("delivered", "deferred", "bounced", "expired", "dropped", "delayed")


def nearest_rank(values: list[int], p: float) -> int:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


def zones(events: list[Row]) -> list[Row]:
    out: dict[str, Row] = {}
    for e in events:
        row = out.setdefault(
            e["zone"], {"zone": e["zone"], "accepted": 0} | dict.fromkeys(OTHER_KINDS, 0)
        )
        if e["kind"] == "accepted":
            row["accepted"] += e["recipients"]
        else:
            row[e["kind"]] += 1
    return [out[z] for z in sorted(out)]


def hourly(events: list[Row]) -> list[Row]:
    counts: Counter[tuple[str, str, str]] = Counter()
    for e in events:
        hour = time.strftime("%Y-%m-%d %H:00", time.gmtime(e["time_ms"] // 1000))
        counts[(e["zone"], hour, e["kind"])] += e["recipients"] if e["kind"] == "accepted" else 1
    return [
        {"zone": z, "hour": h, "outcome": k, "recipients": n}
        for (z, h, k), n in sorted(counts.items())
    ]


def delivery(events: list[Row]) -> list[Row]:
    latency: dict[str, list[int]] = defaultdict(list)
    attempts: dict[str, list[int]] = defaultdict(list)
    for e in events:
        if e["kind"] == "delivered":
            latency[e["zone"]].append(e["time_ms"] - e["queued_at_ms"])
            attempts[e["zone"]].append(e["attempt"])
    return [
        {
            "zone": z,
            "delivered": len(latency[z]),
            "latency_p50_ms": nearest_rank(latency[z], 0.5),
            "latency_p95_ms": nearest_rank(latency[z], 0.95),
            "latency_p99_ms": nearest_rank(latency[z], 0.99),
            "attempts_mean": sum(attempts[z]) / len(attempts[z]),
            "attempts_max": max(attempts[z]),
        }
        for z in sorted(latency)
    ]


def attempts(events: list[Row]) -> list[Row]:
    counts = Counter((e["zone"], e["attempt"]) for e in events if e["kind"] == "delivered")
    return [{"zone": z, "attempts": a, "delivered": n} for (z, a), n in sorted(counts.items())]


def rates_by(events: list[Row], key: str, missing: str) -> list[Row]:
    groups: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for e in events:
        if e["kind"] in ATTEMPT_KINDS:
            value = e[key] if e[key] is not None else missing
            groups[(e["zone"], value)][e["kind"]] += 1
    rows = []
    for (zone, value), c in groups.items():
        tried = sum(c.values())
        finished = c["delivered"] + c["bounced"] + c["expired"]
        rows.append(
            {"zone": zone, key: value, "attempts": tried}
            | {k: c[k] for k in ATTEMPT_KINDS}
            | {
                "deferral_rate": c["deferred"] / tried,
                "bounce_rate": (c["bounced"] + c["expired"]) / finished if finished else None,
            }
        )
    return sorted(rows, key=lambda r: (r["zone"], -r["attempts"], r[key]))


def category(e: Row) -> str:
    """A failure's category: its own, or (schema version 1: none) its outcome."""
    return e.get("category") or e["kind"]


def replies(events: list[Row], top: int = 10) -> list[Row]:
    counts: Counter[tuple[str, str, str, str, str, str]] = Counter()
    for e in events:
        if e["kind"] in REPLY_KINDS:
            code = "" if e["code"] is None else str(e["code"])
            key = (e["zone"], category(e), e["kind"], code, e["enhanced"] or "", e["text"] or "")
            counts[key] += 1
    per: dict[tuple[str, str], list[tuple[int, str, str, str, str]]] = defaultdict(list)
    for (zone, cat, kind, code, enhanced, text), n in counts.items():
        per[(zone, cat)].append((n, text, code, enhanced, kind))
    rows = []
    for (zone, cat), items in sorted(per.items()):
        items.sort(key=lambda i: (-i[0], i[1], i[2], i[3], i[4]))
        for rank, (n, text, code, enhanced, kind) in enumerate(items[:top], 1):
            rows.append(
                {
                    "zone": zone,
                    "category": cat,
                    "outcome": kind,
                    "code": code,
                    "enhanced": enhanced,
                    "text": text,
                    "events": n,
                    "rank": rank,
                }
            )
    return rows


def categories(events: list[Row]) -> list[Row]:
    counts: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for e in events:
        if e["kind"] in REPLY_KINDS:
            counts[(e["zone"], category(e))][e["kind"]] += 1
    rows = [
        {"zone": zone, "category": cat}
        | {k: c[k] for k in REPLY_KINDS}
        | {"events": sum(c.values())}
        for (zone, cat), c in counts.items()
    ]
    return sorted(rows, key=lambda r: (r["zone"], -r["events"], r["category"]))


def queue_age(queue: list[Row]) -> list[Row]:
    ages: dict[tuple[str, str], list[int]] = defaultdict(list)
    for q in queue:
        ages[(q["zone"], q["state"])].append(q["age_ms"])
    return [
        {
            "zone": z,
            "state": s,
            "recipients": len(a),
            "age_p50_ms": nearest_rank(a, 0.5),
            "age_p95_ms": nearest_rank(a, 0.95),
            "age_max_ms": max(a),
        }
        for (z, s), a in sorted(ages.items())
    ]


def queue_domains(queue: list[Row]) -> list[Row]:
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for q in queue:
        groups[(q["zone"], q["domain"])].append(q["age_ms"])
    rows = [
        {"zone": z, "domain": d, "recipients": len(a), "age_max_ms": max(a)}
        for (z, d), a in groups.items()
    ]
    return sorted(rows, key=lambda r: (r["zone"], -r["recipients"], r["domain"]))


def all_tables(events: list[Row], queue: list[Row]) -> dict[str, list[Row]]:
    makers: dict[str, Callable[[], list[Row]]] = {
        "zones": lambda: zones(events),
        "hourly": lambda: hourly(events),
        "delivery": lambda: delivery(events),
        "attempts": lambda: attempts(events),
        "domains": lambda: rates_by(events, "domain", "(none)"),
        "mx": lambda: rates_by(events, "mx", "(no MX reached)"),
        "sources": lambda: rates_by(events, "source_ip", "(none)"),
        "replies": lambda: replies(events),
        "categories": lambda: categories(events),
        "queue_age": lambda: queue_age(queue),
        "queue_domains": lambda: queue_domains(queue),
    }
    return {name: make() for name, make in makers.items()}
