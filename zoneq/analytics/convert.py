"""JSON lines exports turned into Parquet on the driver, before Spark reads them (local runs).

Spark's JSON reader parses row by row with Jackson: 1 M exported events (360 MB of JSON)
cost it 15-20 CPU seconds, several times the whole Parquet report.  pyarrow's JSON reader
(C++, parsing blocks of a file in parallel) reads the same in about 2 CPU seconds, and
Parquet is what the rest of the job reads fastest.  So when Spark runs in this process
(``local[*]``) and the inputs are local directories, ``convert`` writes the columns the
report uses into temporary Parquet exports of the same layout and the job reads those.  On
a cluster the executors read the inputs where they are (``hdfs://``, ``s3a://``) and
Spark's own reader stays.

The conversion keeps the JSON reader's rules: files named ``*.jsonl`` anywhere under
``events/`` and ``queue/``, skipping names that start with ``.`` or ``_`` (where ``zoneq
export`` keeps its unfinished files, and what Spark skips); fields outside the schema are
ignored, a missing field is null (so a missing ``v`` is refused as Spark's would be), and
a line that is not JSON of the schema's types is an error naming its file and line, like
Spark's FAILFAST mode.  A row of a version this zoneq reads with a null in a column the
export never leaves null (``zoneq.protocol.columns``) is refused too: the report's tables
would file it under a zone or hour of None.

pyarrow's messages count rows from the start of the block they failed in, from 0, so on
either error the file is read again line by line (only then) for the 1-based line number.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

from zoneq.analytics.errors import AnalyticsError
from zoneq.analytics.inputs import EVENT_USED, local_path
from zoneq.protocol.columns import (
    EVENT_COLUMNS,
    EVENT_VERSIONS,
    QUEUE_COLUMNS,
    QUEUE_VERSION,
    ColumnType,
)

_ARROW_TYPES: Final[dict[ColumnType, pa.DataType]] = {
    "int32": pa.int32(),
    "int64": pa.int64(),
    "string": pa.string(),
    "bool": pa.bool_(),
}
# Files up to this size are parsed whole (in parallel blocks); larger ones stream block by
# block, so memory stays bounded whatever wrote them (zoneq export's parts are far smaller).
WHOLE_FILE_BYTES: Final = 256 << 20
BLOCK_BYTES: Final = 16 << 20  # pyarrow's unit of parallel parsing; a line must fit in one
SUFFIX: Final = ".jsonl"


def arrow_schema(columns: Sequence[tuple[str, ColumnType, bool]], keep: Sequence[str]) -> pa.Schema:
    return pa.schema(
        [pa.field(name, _ARROW_TYPES[kind]) for name, kind, _ in columns if name in keep]
    )


def required(
    columns: Sequence[tuple[str, ColumnType, bool]], keep: Sequence[str]
) -> tuple[str, ...]:
    """The kept columns never null in an export (``v`` aside: the version check's)."""
    return tuple(
        name for name, _, nullable in columns if name in keep and not nullable and name != "v"
    )


@dataclass(frozen=True, slots=True)
class Kind:
    """What a tree of part files holds: its columns, those never null, its versions."""

    schema: pa.Schema
    required: tuple[str, ...]
    versions: Collection[int]


EVENTS: Final = Kind(
    arrow_schema(EVENT_COLUMNS, EVENT_USED), required(EVENT_COLUMNS, EVENT_USED), EVENT_VERSIONS
)
_QUEUE_NAMES: Final = [name for name, _, _ in QUEUE_COLUMNS]
QUEUE: Final = Kind(
    arrow_schema(QUEUE_COLUMNS, _QUEUE_NAMES),
    required(QUEUE_COLUMNS, _QUEUE_NAMES),
    (QUEUE_VERSION,),
)
# The integers each integer type holds: pyarrow refuses a JSON number outside them.
_INT_RANGES: Final = {pa.int32(): 1 << 31, pa.int64(): 1 << 63}


def applies(sources: Sequence[str]) -> bool:
    """Whether every input is a local directory (the caller checks that Spark is local)."""
    return all(local_path(uri) is not None for uri in sources)


def convert(sources: Sequence[str], into: Path) -> list[str]:
    """Parquet copies of the JSON lines exports ``sources`` under ``into``; their paths."""
    converted = []
    for index, uri in enumerate(sources):
        root = local_path(uri)
        assert root is not None, "convert() is for local inputs only (see applies())"
        target = into / f"input-{index}"
        _convert_tree(root / "events", target / "events", EVENTS)
        if (root / "queue").is_dir():
            _convert_tree(root / "queue", target / "queue", QUEUE)
        converted.append(str(target))
    return converted


def json_files(directory: Path) -> Iterator[Path]:
    """The ``*.jsonl`` files under ``directory``, hidden names (``.``, ``_``) skipped."""
    for parent, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not _hidden(d))
        for name in sorted(files):
            if name.endswith(SUFFIX) and not _hidden(name):
                yield Path(parent) / name


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def _convert_tree(source: Path, target: Path, kind: Kind) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for number, path in enumerate(json_files(source)):
        _convert_file(path, target / f"part-{number:06d}.parquet", kind)


def _convert_file(source: Path, target: Path, kind: Kind) -> None:
    schema = kind.schema
    parse = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    read = pj.ReadOptions(block_size=BLOCK_BYTES)
    try:
        size = source.stat().st_size
        if size == 0:
            return
        if size <= WHOLE_FILE_BYTES:
            table = pj.read_json(source, read_options=read, parse_options=parse)
            _refuse_nulls(source, table, kind)
            pq.write_table(table.select(schema.names), target, compression="none")
            return
        with pq.ParquetWriter(target, schema, compression="none") as writer:
            for batch in pj.open_json(source, read_options=read, parse_options=parse):
                _refuse_nulls(source, pa.Table.from_batches([batch]), kind)
                writer.write_batch(batch.select(schema.names))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        if (found := first_bad_line(source, lambda row: _wrong_type(row, schema))) is not None:
            raise _bad_line(source, *found) from exc
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AnalyticsError(f"{source}: not a JSON lines export file: {first[:300]}") from exc


def _refuse_nulls(source: Path, table: pa.Table, kind: Kind) -> None:
    """``AnalyticsError`` naming the line if a row of a known version has a null where the
    export never writes one; a row of another version is left to the version check."""
    known = pc.is_in(table["v"], value_set=pa.array(kind.versions, pa.int32()))
    if not any(pc.any(pc.and_(known, pc.is_null(table[name]))).as_py() for name in kind.required):
        return
    found = first_bad_line(source, lambda row: _null(row, kind))
    if found is None:  # the file changed since it was read
        raise AnalyticsError(f"{source}: a row has a null where the export writes none")
    raise _bad_line(source, *found)


def first_bad_line(path: Path, fault: Callable[[Any], str | None]) -> tuple[int, str] | None:
    """The 1-based number of the first line of ``path`` that is not JSON, or whose value
    ``fault`` finds fault with, and what is wrong with it; None if no line is.  Blank lines
    are skipped, as pyarrow skips them."""
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                return number, f"not JSON ({exc})"
            if (reason := fault(row)) is not None:
                return number, reason
    return None


def _bad_line(source: Path, number: int, reason: str) -> AnalyticsError:
    return AnalyticsError(f"{source}: line {number}: not a JSON lines export record: {reason}")


def _wrong_type(row: Any, schema: pa.Schema) -> str | None:
    """Why ``row`` does not fit ``schema`` as pyarrow converts it, or None."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    for field in schema:
        value = row.get(field.name)
        if value is not None and not _fits(value, field.type):
            return f"{field.name} is not {field.type}: {json.dumps(value)[:80]}"
    return None


def _fits(value: Any, kind: pa.DataType) -> bool:
    if kind in _INT_RANGES:  # a JSON true is no integer, nor is 1.0 (pyarrow refuses both)
        limit = _INT_RANGES[kind]
        return type(value) is int and -limit <= value < limit
    if kind == pa.string():
        return isinstance(value, str)
    return isinstance(value, bool)


def _null(row: Any, kind: Kind) -> str | None:
    if not isinstance(row, dict) or row.get("v") not in kind.versions:
        return None
    for name in kind.required:
        if row.get(name) is None:
            return f"{name} is null or missing (an export always writes it)"
    return None
