"""The HTML report: one self-contained file, tables and PNG charts (base64) per zone.

People read charts faster than tables (issue 6), so every zone gets its hourly volumes and
its worst destination domains as charts, and the whole export gets outcome, failure
category, latency and queue-age charts across zones.  The charts are drawn with
matplotlib's Agg backend (no display needed) and embedded as ``data:`` URIs, so the file
can be mailed or archived alone.  This module does not touch Spark: it renders rows the
job has already collected.

Charts are drawn on their own ``Figure`` objects, never through pyplot's global state, so
``draw_charts`` may run while other threads work (the job draws each chart as soon as its
table is there, while Spark computes the rest); ``render`` only assembles the page.
"""

from __future__ import annotations

import base64
import html
import io
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from matplotlib.figure import Figure

# Figure.savefig picks the Agg canvas for PNG by itself: no backend, no display, no pyplot.
logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its INFO lines are not ours

Rows = list[dict[str, Any]]
Charts = dict[str, str]  # chart id -> base64 PNG

MAX_ZONE_CHARTS: Final = 25  # zones with their own charts, the busiest first
MAX_TABLE_ROWS: Final = 50  # rows shown per zone and table (the CSV files have them all)
TOP_DOMAINS_CHARTED: Final = 10
TOP_CATEGORIES_CHARTED: Final = 20  # (zone, category) bars in the failures chart
OUTCOME_COLOURS: Final = {
    "accepted": "#4c72b0",
    "delivered": "#55a868",
    "deferred": "#dd8452",
    "bounced": "#c44e52",
    "expired": "#8172b3",
    "dropped": "#937860",
    "delayed": "#ccb974",
}
DEFINITIONS: Final = """
<ul class="defs">
<li><b>attempts</b>: events of kind delivered, deferred, bounced or expired (one per SMTP
attempt).</li>
<li><b>deferral rate</b> = deferred / attempts; <b>bounce rate</b> = (bounced + expired) /
(delivered + bounced + expired).</li>
<li><b>latency</b>: delivered time minus queued-at time, the time the message's id was
issued at SMTP MAIL FROM (or the start of an API submission): it includes the client's
transfer of the message and its commit, not only the time from acceptance to delivery;
percentiles are nearest-rank.</li>
<li><b>category</b> of a failure (deferred, bounced, expired, delayed): the reply rule's that
fits its reply, else the reply's RFC 3463 class (network, policy, addressing, ...); events of
exports older than categories are filed under their outcome.</li>
<li><b>queue age</b>: now minus queued-at, at the time of each node's last queue export.</li>
<li>Times are UTC.</li>
</ul>
"""
STYLE: Final = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #f0f0f0; }
td.text { text-align: left; }
section.zone { border-top: 2px solid #888; margin-top: 2em; }
img { max-width: 100%; }
"""


def _figure(height: float) -> Figure:
    # constrained layout fits the labels in one pass; bbox_inches="tight" drew every
    # chart twice (a third of the report's rendering time)
    return Figure(figsize=(8, height), layout="constrained")


def chart_png(fig: Figure) -> str:
    """The figure as a base64 PNG."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _img(chart_id: str, title: str, charts: Charts) -> str:
    return (
        f'<figure><img data-chart="{html.escape(chart_id)}" alt="{html.escape(title)}" '
        f'src="data:image/png;base64,{charts[chart_id]}"><figcaption>{html.escape(title)}'
        "</figcaption></figure>"
    )


def _outcomes_chart(zones: Rows) -> Figure:
    names = [row["zone"] for row in zones]
    kinds = ("delivered", "deferred", "bounced", "expired", "dropped")
    return _stacked_bars(names, zones, kinds, 0.4)


def _stacked_bars(names: list[str], rows: Rows, kinds: Sequence[str], per_bar: float) -> Figure:
    """One horizontal bar per row, named ``names``, its ``kinds`` counts stacked."""
    fig = _figure(max(2.0, per_bar * len(rows) + 1))
    ax = fig.subplots()
    left = [0.0] * len(rows)
    for kind in kinds:
        values = [float(row[kind]) for row in rows]
        ax.barh(names, values, left=left, label=kind, color=OUTCOME_COLOURS[kind])
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_xlabel("events")
    ax.legend(loc="lower right", fontsize="small")
    return fig


def _latency_chart(delivery: Rows) -> Figure:
    fig = _figure(max(2.0, 0.5 * len(delivery) + 1))
    ax = fig.subplots()
    names = [row["zone"] for row in delivery]
    height = 0.25
    for i, point in enumerate(("p50", "p95", "p99")):
        values = [(row[f"latency_{point}_ms"] or 0) / 1000 for row in delivery]
        ax.barh([y + i * height for y in range(len(names))], values, height, label=point)
    ax.set_yticks([y + height for y in range(len(names))], names)
    ax.set_xlabel("seconds from queued to delivered")
    ax.legend(fontsize="small")
    return fig


def _queue_chart(queue_age: Rows) -> Figure:
    fig = _figure(max(2.0, 0.4 * len(queue_age) + 1))
    ax = fig.subplots()
    labels = [f"{row['zone']} ({row['state']})" for row in queue_age]
    ax.barh(labels, [row["age_max_ms"] / 3_600_000 for row in queue_age], label="oldest")
    ax.barh(labels, [(row["age_p50_ms"] or 0) / 3_600_000 for row in queue_age], label="median")
    ax.set_xlabel("hours waiting at export time")
    ax.legend(fontsize="small")
    return fig


def _hourly_chart(rows: Rows) -> Figure:
    fig = _figure(2.8)
    ax = fig.subplots()
    hours = sorted({row["hour"] for row in rows})
    positions = range(len(hours))
    for kind, colour in OUTCOME_COLOURS.items():
        by_hour = {row["hour"]: row["recipients"] for row in rows if row["outcome"] == kind}
        if by_hour:
            ax.plot(positions, [by_hour.get(h, 0) for h in hours], label=kind, color=colour)
    ax.set_ylabel("recipients per hour")
    step = max(1, len(hours) // 12)
    ax.set_xticks(positions[::step], hours[::step], rotation=45, fontsize="small")
    ax.legend(fontsize="small", ncol=4)
    return fig


def _domains_chart(rows: Rows) -> Figure:
    top = rows[:TOP_DOMAINS_CHARTED]
    fig = _figure(max(2.0, 0.35 * len(top) + 1))
    ax = fig.subplots()
    names = [row["domain"] for row in top]
    height = 0.4
    deferral = [row["deferral_rate"] or 0 for row in top]
    bounce = [row["bounce_rate"] or 0 for row in top]
    ax.barh([y for y in range(len(names))], deferral, height, label="deferral rate")
    ax.barh([y + height for y in range(len(names))], bounce, height, label="bounce rate")
    ax.set_yticks([y + height / 2 for y in range(len(names))], names)
    ax.set_xlim(0, 1)
    ax.legend(fontsize="small")
    return fig


def _categories_chart(rows: Rows) -> Figure:
    """The most frequent failure categories across zones, split by outcome."""
    top = sorted(rows, key=lambda row: (-row["events"], row["zone"], row["category"]))
    top = top[:TOP_CATEGORIES_CHARTED][::-1]  # barh draws bottom up: the largest on top
    names = [f"{row['zone']}: {row['category']}" for row in top]
    return _stacked_bars(names, top, ("deferred", "bounced", "expired", "delayed"), 0.35)


def _table(rows: Rows, columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "<p><i>none</i></p>"
    names = list(columns if columns is not None else rows[0].keys())
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    body = []
    for row in rows[:MAX_TABLE_ROWS]:
        cells = []
        for name in names:
            value = row.get(name)
            css = ' class="text"' if isinstance(value, str) else ""
            shown = f"{value:.4f}" if isinstance(value, float) else "" if value is None else value
            cells.append(f"<td{css}>{html.escape(str(shown))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    more = len(rows) - MAX_TABLE_ROWS
    note = f"<p>... and {more} more rows in the CSV file.</p>" if more > 0 else ""
    return f"<table><tr>{head}</tr>{''.join(body)}</table>{note}"


def _of(rows: Rows, zone: str) -> Rows:
    return [{k: v for k, v in row.items() if k != "zone"} for row in rows if row["zone"] == zone]


def _charted_zones(zones: Rows) -> list[str]:
    busiest = sorted(zones, key=lambda row: (-row["accepted"], row["zone"]))
    return [row["zone"] for row in busiest[:MAX_ZONE_CHARTS]]


def draw_charts(tables: Mapping[str, Rows]) -> Charts:
    """Every chart ``tables`` has the rows for: ``delivery`` gives the latency chart,
    ``queue_age`` the queue-age chart, ``categories`` the failures-by-category chart, and
    ``zones`` with ``hourly`` and ``domains`` the outcome chart and each busy zone's two."""
    drawn: Charts = {}

    def draw(chart_id: str, make: Callable[[Rows], Figure], rows: Rows) -> None:
        if rows:
            drawn[chart_id] = chart_png(make(rows))

    draw("latency", _latency_chart, tables.get("delivery", []))
    draw("queue-age", _queue_chart, tables.get("queue_age", []))
    draw("categories", _categories_chart, tables.get("categories", []))
    if {"zones", "hourly", "domains"} <= tables.keys():
        draw("outcomes", _outcomes_chart, tables["zones"])
        for zone in _charted_zones(tables["zones"]):
            draw(f"hourly:{zone}", _hourly_chart, _of(tables["hourly"], zone))
            draw(f"domains:{zone}", _domains_chart, _of(tables["domains"], zone))
    return drawn


def render(
    tables: dict[str, Rows], *, inputs: Sequence[str], events: int, charts: Charts | None = None
) -> str:
    """The whole report as one HTML document; ``charts`` from ``draw_charts`` (drawn here
    when not given)."""
    drawn = draw_charts(tables) if charts is None else charts
    zones = tables["zones"]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>zoneq analytics</title>",
        f"<style>{STYLE}</style></head><body><h1>zoneq analytics</h1>",
        f"<p>{events} events from {len(inputs)} export(s): ",
        html.escape(", ".join(inputs)),
        "</p>",
        DEFINITIONS,
        "<h2>All zones</h2>",
        _table(zones),
    ]
    if "outcomes" in drawn:
        parts.append(_img("outcomes", "Outcomes per zone", drawn))
    if "categories" in drawn:
        parts.append(_img("categories", "Failures by category", drawn))
    if tables["delivery"]:
        parts.append(_table(tables["delivery"]))
    if "latency" in drawn:
        parts.append(_img("latency", "Delivery latency per zone", drawn))
    if tables["queue_age"]:
        parts.append("<h3>Queue at export time</h3>" + _table(tables["queue_age"]))
    if "queue-age" in drawn:
        parts.append(_img("queue-age", "Queue age per zone", drawn))
    for row in zones:
        parts.append(_zone_section(row["zone"], tables, drawn))
    parts.append("</body></html>")
    return "".join(parts)


def _zone_section(zone: str, tables: dict[str, Rows], charts: Charts) -> str:
    name = html.escape(zone)
    parts = [f'<section class="zone" data-zone="{name}"><h2>Zone {name}</h2>']
    if f"hourly:{zone}" in charts:
        parts.append(_img(f"hourly:{zone}", f"{zone}: volume per hour", charts))
    if f"domains:{zone}" in charts:
        title = f"{zone}: deferral and bounce rates, busiest domains"
        parts.append(_img(f"domains:{zone}", title, charts))
    for title, key in (
        ("Delivery", "delivery"),
        ("Attempts per delivered recipient", "attempts"),
        ("By destination domain", "domains"),
        ("By MX host", "mx"),
        ("By source address", "sources"),
        ("Failures by category", "categories"),
        ("Most frequent replies per category", "replies"),
        ("Queue by state", "queue_age"),
        ("Queue by destination domain", "queue_domains"),
    ):
        parts.append(f"<h3>{title}</h3>{_table(_of(tables[key], zone))}")
    parts.append("</section>")
    return "".join(parts)
