"""``zoneq analytics --prepare``'s tiny export and its command line (no JVM here: fast).

Recording a real archive and a report mapping it is ``test_prepare.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.command import zoneq
from tests.support.testbed import missing
from zoneq import cli
from zoneq.analytics import warmup
from zoneq.analytics.classcache import DYNAMIC_MAGIC
from zoneq.protocol.columns import (
    EVENT_COLUMNS,
    EVENT_VERSION,
    QUEUE_COLUMNS,
    QUEUE_VERSION,
    ColumnType,
)
from zoneq.protocol.events import EventKind

TYPES: tuple[ColumnType, ...] = ("int32", "int64", "string", "bool")


def table(
    rows: list[dict[str, object]], columns: Sequence[tuple[str, ColumnType, bool]]
) -> pa.Table:
    """The rows as Arrow with the export's schema: raises if a value does not fit its type
    or a non-nullable column holds a null."""
    built = pa.Table.from_pylist(rows, warmup.arrow_schema(columns))
    for name, _, nullable in columns:
        if not nullable:
            assert built.column(name).null_count == 0, name
    return built


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return warmup.write_export(tmp_path_factory.mktemp("tiny") / "export")


def read_events(export: Path) -> pa.Table:
    schema = warmup.arrow_schema(EVENT_COLUMNS)
    files = sorted((export / "events").rglob("*.parquet"))
    return pa.concat_tables(pq.read_table(path, schema=schema) for path in files)


def test_every_kind_appears_in_every_zone(export: Path) -> None:
    events = read_events(export).to_pylist()
    pairs = {(row["kind"], row["zone"]) for row in events}
    assert pairs == {(kind.value, zone) for kind in EventKind for zone in warmup.ZONES}
    assert {row["v"] for row in events} == {EVENT_VERSION}


def test_every_column_holds_values_and_nullable_ones_nulls_too(export: Path) -> None:
    events = read_events(export)
    assert events.num_rows == warmup.EVENT_ROWS
    for name, _, nullable in EVENT_COLUMNS:
        column = events.column(name)
        assert column.null_count < events.num_rows, name
        assert (column.null_count > 0) is nullable, name
    queue = pq.read_table(export / warmup.QUEUE_FILE)
    assert queue.schema.equals(warmup.arrow_schema(QUEUE_COLUMNS))
    assert set(queue.column("state").to_pylist()) == set(warmup.QUEUE_STATES)
    assert set(queue.column("v").to_pylist()) == {QUEUE_VERSION}


def test_the_layout_is_zoneq_exports(export: Path) -> None:
    """events/day=D/zone=Z/part-*.parquet with each row in its own day and zone, and the
    watermark the job reads the format from."""
    days = set()
    for path in (export / "events").rglob("*.parquet"):
        day, zone = path.parent.parent.name, path.parent.name
        assert day.startswith("day=") and zone.startswith("zone=") and path.name.startswith("part-")
        rows = pq.read_table(path, schema=warmup.arrow_schema(EVENT_COLUMNS)).to_pylist()
        assert {warmup._utc_day(row["time_ms"]) for row in rows} == {day[4:]}
        assert {row["zone"] for row in rows} == {zone[5:]}
        days.add(day)
    assert len(days) >= 2  # hours of more than one day
    mark = json.loads((export / warmup.WATERMARK_FILE).read_text())
    assert mark["format"] == "parquet" and mark["events"] == warmup.EVENT_ROWS


column_names = st.from_regex(r"[a-z][a-z_]{0,11}", fullmatch=True).filter(
    lambda name: name not in {n for n, _, _ in EVENT_COLUMNS}
)
extra_columns = st.lists(
    st.tuples(column_names, st.sampled_from(TYPES), st.booleans()),
    max_size=4,
    unique_by=lambda column: column[0],
)


@settings(max_examples=60, deadline=None)
@given(extra=extra_columns, count=st.integers(min_value=1, max_value=60))
def test_a_column_added_to_the_schema_gets_values_of_its_type(
    extra: list[tuple[str, ColumnType, bool]], count: int
) -> None:
    """A new column (schema version 2 adds one) needs no change here: every row holds a
    value of its type, the known columns keep their meaning."""
    columns = [*EVENT_COLUMNS, *extra]
    rows = warmup.event_rows(count, columns)
    built = table(rows, columns)
    assert built.num_rows == count
    assert built.column("kind").to_pylist()[:7] == [k.value for k in EventKind][:count]
    times = built.column("time_ms").to_pylist()
    assert times == sorted(times)
    assert all(q <= t for q, t in zip(built.column("queued_at_ms").to_pylist(), times, strict=True))


@settings(max_examples=40, deadline=None)
@given(extra=extra_columns, count=st.integers(min_value=1, max_value=40))
def test_queue_rows_fit_any_queue_schema(
    extra: list[tuple[str, ColumnType, bool]], count: int
) -> None:
    columns = [*QUEUE_COLUMNS, *extra]
    built = table(warmup.queue_rows(count, columns), columns)
    ages = built.column("age_ms").to_pylist()
    queued = built.column("queued_at_ms").to_pylist()
    exported = built.column("exported_at_ms").to_pylist()
    assert all(e - q == a > 0 for e, q, a in zip(exported, queued, ages, strict=True))


@pytest.mark.parametrize(
    ("kind", "nullable", "rows", "values"),
    [
        ("int32", False, range(3), [0, 1, 2]),
        ("int64", True, range(3, 6), [3, None, 5]),
        ("string", False, range(4), ["c-0", "c-1", "c-2", "c-0"]),
        ("string", True, range(3, 6), ["c-0", None, "c-2"]),
        ("bool", False, range(2), [False, True]),
    ],
)
def test_plain_values_follow_the_type(
    kind: ColumnType, nullable: bool, rows: range, values: list[object]
) -> None:
    assert [warmup.plain_value("c", kind, nullable, row) for row in rows] == values


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--prepare", "some-export"], "--prepare takes no inputs"),
        (["--prepare", "--out", "report"], "--prepare takes no inputs"),
        (["--prepare", "--master", "spark://h:7077"], "--prepare takes no inputs"),
        (["--prepare", "--no-class-cache"], "not with --no-class-cache"),
        (["--force", "some-export", "--out", "report"], "--force goes with --prepare"),
        ([], "give one or more export directories"),
        (["some-export"], "give one or more export directories"),
    ],
)
def test_the_command_line_says_what_is_wrong(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["analytics", *argv]) == 2
    assert said in capsys.readouterr().err


def archive_path(cache: Path) -> Path:
    """Where ``--prepare`` keeps the archive for this Java and Spark (skips without Java)."""
    path = warmup.archive_path(cache, os.environ)
    if path is None:
        missing("java (PySpark needs Java 17+)")
        raise AssertionError("unreachable: missing() skips or fails")
    return path


def test_without_java_prepare_says_what_to_install(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(tmp_path / "empty")  # no java on it
    done = zoneq("analytics", "--prepare", "--class-cache", str(tmp_path / "cache"), env=env)
    assert done.returncode == 1
    assert "no Java found (PATH)" in done.stderr and "openjdk-17-jre-headless" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "cache").exists()  # nothing half-made


def test_a_usable_archive_is_kept_and_no_jvm_starts(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = archive_path(cache)
    cache.mkdir()
    path.write_bytes(DYNAMIC_MAGIC + b"classes")  # complete as far as usable() can tell
    written = path.stat().st_mtime_ns
    done = zoneq("analytics", "--prepare", "--class-cache", str(cache))
    assert done.returncode == 0, done.stderr
    assert f"already recorded: {path}" in done.stdout
    assert path.stat().st_mtime_ns == written and path.read_bytes() == DYNAMIC_MAGIC + b"classes"
    assert "Spark" not in done.stderr and "log level" not in done.stderr  # no JVM started
