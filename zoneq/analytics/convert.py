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
a line that is not JSON of the schema's types is an error naming its file, like Spark's
FAILFAST mode.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq

from zoneq.analytics.errors import AnalyticsError
from zoneq.analytics.inputs import EVENT_USED, local_path
from zoneq.protocol.columns import EVENT_COLUMNS, QUEUE_COLUMNS, ColumnType

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


EVENT_SCHEMA: Final = arrow_schema(EVENT_COLUMNS, EVENT_USED)
QUEUE_SCHEMA: Final = arrow_schema(QUEUE_COLUMNS, [name for name, _, _ in QUEUE_COLUMNS])


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
        _convert_tree(root / "events", target / "events", EVENT_SCHEMA)
        if (root / "queue").is_dir():
            _convert_tree(root / "queue", target / "queue", QUEUE_SCHEMA)
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


def _convert_tree(source: Path, target: Path, schema: pa.Schema) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for number, path in enumerate(json_files(source)):
        _convert_file(path, target / f"part-{number:06d}.parquet", schema)


def _convert_file(source: Path, target: Path, schema: pa.Schema) -> None:
    parse = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    read = pj.ReadOptions(block_size=BLOCK_BYTES)
    try:
        size = source.stat().st_size
        if size == 0:
            return
        if size <= WHOLE_FILE_BYTES:
            table = pj.read_json(source, read_options=read, parse_options=parse)
            pq.write_table(table.select(schema.names), target, compression="none")
            return
        with pq.ParquetWriter(target, schema, compression="none") as writer:
            for batch in pj.open_json(source, read_options=read, parse_options=parse):
                writer.write_batch(batch.select(schema.names))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AnalyticsError(f"{source}: not a JSON lines export file: {first[:300]}") from exc
