"""``zoneq analytics --prepare``: record the JVM's class-data archive now, as a set-up step.

The archive (``classcache.py``) saves every local report 3-4 s of JVM start on 2 cores,
but the run that records it pays about 10 s more.  Left to chance that is the first real
report somebody waits for; recorded here it is paid once, when the machine is set up
(``tools/dev``), as the JDK's own default CDS archive of its classes (``classes.jsa``) is
made when the JDK is installed.  Every report is still a new, cold JVM: only class
parsing and verification are cached.

The archive must hold the classes real reports load, so the real job (``job.run``: the
same Spark session options, readers, queries, tables and HTML report) runs on a tiny
export made here: a few hundred event rows and a few queue rows covering every event
kind, several zones and days, and every column of ``zoneq.protocol.columns``, with nulls
where a column allows them.  The rows are built from the column list generically (a
value of each column's type), with realistic values for the columns the report reads,
so a column added to the schema is covered without a change here.  The export, the
tables and the report go to a temporary directory that is removed afterwards.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.parquet as pq

from zoneq.analytics.classcache import archive_name, usable
from zoneq.analytics.errors import AnalyticsError
from zoneq.analytics.java import check_java, java_command
from zoneq.protocol.columns import (
    EVENT_COLUMNS,
    EVENT_VERSION,
    QUEUE_COLUMNS,
    QUEUE_VERSION,
    ColumnType,
)
from zoneq.protocol.events import EventKind
from zoneq.protocol.ids import COUNTER_BITS, format_id

Columns = Sequence[tuple[str, ColumnType, bool]]

EVENT_ROWS: Final = 336  # 7 kinds x 4 zones x 12: every pair, over two UTC days
QUEUE_ROWS: Final = 32
ZONES: Final = ("default", "bulk", "transactional", "bounces")
# storage's queue states (``State``); zoneq.analytics may not import zoneq.storage.
QUEUE_STATES: Final = ("ready", "leased", "deferred", "held")
START_MS: Final = 1_700_000_000_000
STEP_MS: Final = 517_000  # 336 events over ~48 h: two days, every hour of each
# One reply per outcome, as remote servers give them (RFC 5321 code, RFC 3463 enhanced).
REPLIES: Final[dict[EventKind, tuple[int, str, str]]] = {
    EventKind.DELIVERED: (250, "2.0.0", "250 2.0.0 Ok: queued as 4Xk2"),
    EventKind.DEFERRED: (451, "4.3.0", "451 4.3.0 Try again later"),
    EventKind.BOUNCED: (550, "5.1.1", "550 5.1.1 No such user"),
    EventKind.EXPIRED: (421, "4.7.0", "421 4.7.0 Too many connections from your IP"),
    EventKind.DELAYED: (452, "4.2.2", "452 4.2.2 Mailbox full"),
}

# The layout ``zoneq export`` writes (``zoneq/export/files.py``, ``watermark.py``): the
# analytics layer may not import the export layer, and the job needs only these names.
EVENTS_DIR: Final = "events"
QUEUE_FILE: Final = "queue/current.parquet"
WATERMARK_FILE: Final = ".zoneq-export.json"
WATERMARK_VERSION: Final = 1

_ARROW_TYPES: Final[dict[ColumnType, pa.DataType]] = {
    "int32": pa.int32(),
    "int64": pa.int64(),
    "string": pa.string(),
    "bool": pa.bool_(),
}


def arrow_schema(columns: Columns) -> pa.Schema:
    return pa.schema([pa.field(n, _ARROW_TYPES[kind], null) for n, kind, null in columns])


def plain_value(name: str, kind: ColumnType, nullable: bool, row: int) -> Any:
    """A value of the column's type for row ``row``: a few distinct values per column, and
    a null in every fifth row of a nullable one (the JVM loads the null-handling paths)."""
    if nullable and row % 5 == 4:
        return None
    if kind == "bool":
        return row % 2 == 1
    if kind == "string":
        return f"{name}-{row % 3}"
    return row


def plain_row(columns: Columns, row: int) -> dict[str, Any]:
    return {name: plain_value(name, kind, nullable, row) for name, kind, nullable in columns}


def event_rows(count: int = EVENT_ROWS, columns: Columns = EVENT_COLUMNS) -> list[dict[str, Any]]:
    """``count`` event rows in time order, every kind in every zone; the columns the report
    reads hold what real events hold (``zoneq.protocol.events``)."""
    kinds = list(EventKind)
    rows = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        time_ms = START_MS + i * STEP_MS
        queued_at = time_ms - (i % 9 + 1) * 45_000
        per_recipient = kind is not EventKind.ACCEPTED  # ACCEPTED: one per message and zone
        domain = f"example{i % 6}.test" if per_recipient else ""
        code, enhanced, text = REPLIES.get(kind, (None, None, None))
        known = {
            "v": EVENT_VERSION,
            "id": format_id((time_ms << COUNTER_BITS) + i % 4096),
            "kind": kind.value,
            "time_ms": time_ms,
            "zone": ZONES[i // len(kinds) % len(ZONES)],
            "message_id": format_id(queued_at << COUNTER_BITS),
            "recipient": f"user{i % 5}@{domain}" if per_recipient else "",
            "domain": domain,
            "queued_at_ms": queued_at,
            "size": 1_000 + i * 37,
            "attempt": 1 + i % 3 if code is not None else 0,
            "mx": f"mx{i % 4}.{domain}" if code is not None else None,
            "source_ip": f"127.0.1.{i % 3 + 1}" if code is not None else None,
            "code": code,
            "enhanced": enhanced if i % 4 else None,  # some servers send no enhanced code
            "text": text,
            "possible_duplicate": kind is EventKind.DELIVERED and i % 11 == 0,
            "recipients": 1 + i % 7 if not per_recipient else 1,
        }
        row = plain_row(columns, i)
        row.update({name: value for name, value in known.items() if name in row})
        rows.append(row)
    return rows


def queue_rows(count: int = QUEUE_ROWS, columns: Columns = QUEUE_COLUMNS) -> list[dict[str, Any]]:
    """``count`` queued recipients at the export's clock, every state in every zone."""
    exported_at = START_MS + EVENT_ROWS * STEP_MS
    rows = []
    for i in range(count):
        age = (i + 1) * 600_000
        known = {
            "v": QUEUE_VERSION,
            "exported_at_ms": exported_at,
            "zone": ZONES[i % len(ZONES)],
            "state": QUEUE_STATES[i // len(ZONES) % len(QUEUE_STATES)],
            "domain": f"example{i % 6}.test",
            "message_id": format_id((exported_at - age) << COUNTER_BITS),
            "queued_at_ms": exported_at - age,
            "attempts": i % 4,
            "next_attempt_ms": exported_at + (i % 3) * 60_000,
            "age_ms": age,
            "last_reply": "" if i % 4 == 0 else REPLIES[EventKind.DEFERRED][2],
        }
        row = plain_row(columns, i)
        row.update({name: value for name, value in known.items() if name in row})
        rows.append(row)
    return rows


def _utc_day(time_ms: int) -> str:
    return dt.datetime.fromtimestamp(time_ms / 1000, dt.UTC).strftime("%Y-%m-%d")


def write_export(root: Path) -> Path:
    """A tiny Parquet export in ``root``, in zoneq export's layout; ``root``.

    Zone names here need no escaping in a directory name (``export.files.escape_path_name``).
    """
    events = event_rows()
    schema = arrow_schema(EVENT_COLUMNS)
    run = format_id(0)
    for (day, zone), group in groupby(
        sorted(events, key=lambda r: (_utc_day(r["time_ms"]), r["zone"], r["id"])),
        key=lambda r: (_utc_day(r["time_ms"]), r["zone"]),
    ):
        part = list(group)
        path = root / EVENTS_DIR / f"day={day}" / f"zone={zone}" / f"part-{run}-{part[0]['id']}"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(part, schema), path.with_suffix(".parquet"))
    queue = root / QUEUE_FILE
    queue.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(queue_rows(), arrow_schema(QUEUE_COLUMNS)), queue)
    mark = {
        "version": WATERMARK_VERSION,
        "format": "parquet",
        "after": events[-1]["id"],
        "events": len(events),
    }
    (root / WATERMARK_FILE).write_text(json.dumps(mark), encoding="utf-8")
    return root


def archive_path(directory: Path, env: Mapping[str, str]) -> Path | None:
    """Where the job keeps the archive for the Java and Spark it would start (as
    ``job._class_cache`` names it), found without importing PySpark; None when there is
    no Java or no Spark."""
    java = java_command(env)
    spec = importlib.util.find_spec("pyspark")
    home = env.get("SPARK_HOME")
    if home is None and spec is not None and spec.submodule_search_locations:
        home = next(iter(spec.submodule_search_locations))
    jars = Path(home) / "jars" if home else None
    if java is None or jars is None or not jars.is_dir():
        return None
    return directory / archive_name(java, jars)


@dataclass(frozen=True, slots=True)
class Prepared:
    path: Path
    recorded: bool  # False: a usable archive was there already
    seconds: float


def prepare(directory: Path, *, force: bool = False, driver_memory: str | None = None) -> Prepared:
    """Record the archive in ``directory`` unless a usable one is there (``force``: again).

    ``AnalyticsError`` when it cannot (no Java, no local JVM, no archive written); an
    archive already there is only replaced once Java is known to run.
    """
    started = time.monotonic()
    path = archive_path(directory, os.environ)
    if path is not None and usable(path) and not force:
        return Prepared(path, recorded=False, seconds=time.monotonic() - started)
    # Imported here: the fast path above must not pay for importing PySpark and the job.
    import pyspark  # noqa: PLC0415

    from zoneq.analytics import job, session  # noqa: PLC0415

    check_java(pyspark.__version__)
    if session.under_spark_submit():
        raise AnalyticsError(
            "--prepare records the archive of a local driver JVM; under spark-submit the "
            "JVM is running already: run zoneq analytics --prepare directly"
        )
    directory.mkdir(parents=True, exist_ok=True)  # unwritable: say so now, not after a run
    if path is not None and force:
        path.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="zoneq-prepare-") as scratch:
        export = write_export(Path(scratch) / "export")
        job.run(
            [str(export)],
            Path(scratch) / "report",
            master=session.DEFAULT_MASTER,
            driver_memory=driver_memory or job.default_driver_memory(),  # as reports
            class_cache=directory,
        )
    path = archive_path(directory, os.environ)
    if path is None or not usable(path):
        raise AnalyticsError(
            f"the JVM wrote no class-data archive into {directory} (it needs JDK 13 or "
            "newer and a writable directory); reports still run, each fully cold"
        )
    return Prepared(path, recorded=True, seconds=time.monotonic() - started)


__all__ = [
    "Prepared",
    "archive_path",
    "event_rows",
    "plain_value",
    "prepare",
    "queue_rows",
    "write_export",
]
