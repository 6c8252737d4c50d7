"""JSON lines exports converted to Parquet on the driver (no Spark here: fast).

The files are written with ``zoneq export``'s own writer; the converted Parquet must hold
the same rows (the columns the report uses), skip what Spark skips, and refuse a damaged
file by name.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from zoneq.analytics import convert
from zoneq.analytics.errors import AnalyticsError
from zoneq.analytics.inputs import EVENT_USED
from zoneq.export.files import Format, partition_dir, write_rows
from zoneq.protocol.columns import EVENT_COLUMNS, QUEUE_COLUMNS


def event(i: int) -> dict[str, Any]:
    rng = random.Random(i)
    kind = rng.choice(["accepted", "delivered", "deferred", "bounced"])
    return {
        "v": 2,
        "id": f"{i:016x}",
        "kind": kind,
        "time_ms": 1_700_000_000_000 + i,
        "zone": rng.choice(["bulk", "zöne"]),
        "message_id": f"{i // 3:016x}",
        "recipient": f"user{i}@d.test",
        "domain": "d.test",
        "queued_at_ms": 1_700_000_000_000,
        "size": 1000 + i,
        "attempt": rng.randint(0, 3),
        "mx": rng.choice([None, "mx.d.test"]),
        "source_ip": rng.choice([None, "127.0.1.1"]),
        "code": rng.choice([None, 250, 451]),
        "enhanced": rng.choice([None, "4.3.0"]),
        "text": rng.choice([None, 'quoted "text"\\ and ünïcode', "Try again"]),
        "category": None
        if kind in ("accepted", "delivered")
        else rng.choice(["network", "policy"]),
        "possible_duplicate": False,
        "recipients": rng.randint(1, 9),
    }


def used(row: dict[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in EVENT_USED}


def converted_rows(directory: Path, sub: str) -> list[dict[str, Any]]:
    files = sorted((directory / sub).rglob("*.parquet"))
    return [row for path in files for row in pq.read_table(path).to_pylist()]


@pytest.fixture
def export(tmp_path: Path) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path / "export"
    rows = [event(i) for i in range(300)]
    for day, chunk in (("2023-11-14", rows[:120]), ("2023-11-15", rows[120:])):
        write_rows(partition_dir(root / "events", day, "bulk") / "part-a.jsonl", chunk,
                   EVENT_COLUMNS, Format.JSONL)  # fmt: skip
    return root, rows


def test_rows_survive_the_conversion(tmp_path: Path, export: tuple[Path, list[Any]]) -> None:
    root, rows = export
    queue = [
        {"v": 1, "exported_at_ms": 5, "zone": "bulk", "state": "ready", "domain": "d.test",
         "message_id": "0" * 16, "queued_at_ms": 1, "attempts": 0, "next_attempt_ms": 0,
         "age_ms": 4, "last_reply": ""}
    ]  # fmt: skip
    write_rows(root / "queue" / "current.jsonl", queue, QUEUE_COLUMNS, Format.JSONL)
    [out] = convert.convert([str(root)], tmp_path / "scratch")
    assert converted_rows(Path(out), "events") == [used(row) for row in rows]
    assert converted_rows(Path(out), "queue") == queue
    assert pq.read_schema(next((Path(out) / "events").rglob("*.parquet"))).names == list(EVENT_USED)


@pytest.mark.parametrize(
    "name",
    [".tmp-part-b.jsonl", "_part-c.jsonl", "part-d.json", "part-e.jsonl.gz"],
)
def test_files_spark_would_skip_are_skipped(
    tmp_path: Path, export: tuple[Path, list[Any]], name: str
) -> None:
    root, rows = export
    write_rows(root / "events" / name, [event(1000)], EVENT_COLUMNS, Format.JSONL)
    hidden_dir = root / "events" / "_unfinished" / "part-f.jsonl"
    write_rows(hidden_dir, [event(1001)], EVENT_COLUMNS, Format.JSONL)
    [out] = convert.convert([str(root)], tmp_path / "scratch")
    assert len(converted_rows(Path(out), "events")) == len(rows)


def line(**fields: Any) -> str:
    """An event's JSON line: ``event(1)``'s columns, with ``fields`` over them (a value of
    ``...`` leaves the field out)."""
    row = {**used(event(1)), **fields}
    return json.dumps({name: value for name, value in row.items() if value is not ...})


@pytest.mark.parametrize(
    ("line", "value"),
    [
        (line(v=1, zone="z", extra=[1, 2]), ("zone", "z")),
        ('{"kind": "accepted", "zone": "z"}', ("v", None)),  # refused later as "missing"
        (line(v=1, text=None), ("text", None)),
        (line(v=1, mx=...), ("mx", None)),
    ],
)
def test_unknown_fields_are_ignored_and_missing_ones_are_null(
    tmp_path: Path, line: str, value: tuple[str, Any]
) -> None:
    root = tmp_path / "export"
    (root / "events").mkdir(parents=True)
    (root / "events" / "part-a.jsonl").write_text(line + "\n")
    [out] = convert.convert([str(root)], tmp_path / "scratch")
    [row] = converted_rows(Path(out), "events")
    assert row[value[0]] == value[1]


@pytest.mark.parametrize(
    ("damaged", "reason"),
    [
        ("{not json", "not JSON"),
        ('{"v": "one", "kind": "accepted"}', 'v is not int32: "one"'),
        ('{"v": 1, "time_ms": 1.5}', "time_ms is not int64: 1.5"),
        ('{"v": 1, "attempt": 3000000000}', "attempt is not int32: 3000000000"),
        ('{"v": 1, "zone": 5}', "zone is not string: 5"),
        ("[1, 2]", "a JSON list, not an object"),
    ],
)
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_damaged_line_names_its_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damaged: str, reason: str, streamed: bool
) -> None:
    """The line counts from the file's start, from 1, whichever block of pyarrow's it is
    in (pyarrow's own "row N" counts from its block's start, from 0)."""
    monkeypatch.setattr(convert, "BLOCK_BYTES", 4096)  # many blocks in a small file
    if streamed:
        monkeypatch.setattr(convert, "WHOLE_FILE_BYTES", 0)
    root = tmp_path / "export"
    (root / "events").mkdir(parents=True)
    part = root / "events" / "part-a.jsonl"
    part.write_text("\n".join([line()] * 1000 + ["", damaged, line()]) + "\n")
    with pytest.raises(AnalyticsError) as caught:
        convert.convert([str(root)], tmp_path / "scratch")
    assert str(caught.value).startswith(
        f"{part}: line 1002: not a JSON lines export record: {reason}"
    )


@pytest.mark.parametrize("column", ["zone", "time_ms", "kind", "domain", "attempt"])
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_null_where_an_export_writes_none_is_refused_by_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, column: str, streamed: bool
) -> None:
    """The report would file such a row under a zone or an hour of None (and crash)."""
    if streamed:
        monkeypatch.setattr(convert, "WHOLE_FILE_BYTES", 0)
    root = tmp_path / "export"
    (root / "events").mkdir(parents=True)
    part = root / "events" / "part-a.jsonl"
    lines = [line(), line(**{column: None}), line(**{column: ...})]
    part.write_text("\n".join(lines) + "\n")
    with pytest.raises(AnalyticsError) as caught:
        convert.convert([str(root)], tmp_path / "scratch")
    assert str(caught.value) == (
        f"{part}: line 2: not a JSON lines export record: "
        f"{column} is null or missing (an export always writes it)"
    )
    # a row of a version this zoneq does not read is left to the version check
    part.write_text("\n".join([line(), line(v=3, **{column: None})]) + "\n")
    [out] = convert.convert([str(root)], tmp_path / "again")
    assert len(converted_rows(Path(out), "events")) == 2


def test_an_empty_file_is_no_rows(tmp_path: Path) -> None:
    root = tmp_path / "export"
    (root / "events").mkdir(parents=True)
    (root / "events" / "part-a.jsonl").write_text("")
    [out] = convert.convert([str(root)], tmp_path / "scratch")
    assert converted_rows(Path(out), "events") == []


def test_a_large_file_is_streamed_with_the_same_rows(
    tmp_path: Path, export: tuple[Path, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, rows = export
    monkeypatch.setattr(convert, "WHOLE_FILE_BYTES", 0)  # every file takes the streaming path
    [out] = convert.convert([str(root)], tmp_path / "scratch")
    assert converted_rows(Path(out), "events") == [used(row) for row in rows]


def test_only_local_inputs_are_converted() -> None:
    assert convert.applies(["/srv/export", "file:///srv/other"])
    assert not convert.applies(["/srv/export", "hdfs:///exports/node2"])
