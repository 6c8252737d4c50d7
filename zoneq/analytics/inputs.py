"""Reading exports: several export directories (one per node) as one events table.

An input is an export directory as ``zoneq export`` writes it (``events/`` and optionally
``queue/``), given as a plain path or a ``file://``, ``hdfs://`` or ``s3a://`` URI; Spark's
Hadoop file system layer resolves the scheme, so the same job runs on a cluster unchanged.
Files are found recursively (``recursiveFileLookup``) and read with the schema of
``zoneq.protocol.columns``: the rows carry their own zone and time, so the ``day=``/``zone=``
directory names are never parsed (zone names may hold any character), and no pass over the
data is spent inferring a schema.  Spark skips files starting with ``.`` or ``_``, which is
where ``zoneq export`` keeps its unfinished files and its watermark.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Final
from urllib.parse import urlparse

from pyspark.sql import DataFrame, DataFrameReader, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from zoneq.analytics.errors import AnalyticsError
from zoneq.protocol.columns import (
    EVENT_COLUMNS,
    EVENT_VERSION,
    EVENT_VERSIONS,
    QUEUE_COLUMNS,
    QUEUE_VERSION,
    ColumnType,
)

FORMATS: Final = ("parquet", "jsonl")
WATERMARK_FILE: Final = ".zoneq-export.json"  # written by zoneq export, read for its format
_SPARK_TYPES: Final[dict[ColumnType, T.DataType]] = {
    "int32": T.IntegerType(),
    "int64": T.LongType(),
    "string": T.StringType(),
    "bool": T.BooleanType(),
}
# The columns the report uses: reading fewer columns from Parquet is most of its speed.
EVENT_USED: Final = (
    "v",
    "kind",
    "time_ms",
    "zone",
    "domain",
    "queued_at_ms",
    "attempt",
    "mx",
    "source_ip",
    "code",
    "enhanced",
    "text",
    "recipients",
    "category",
)


def spark_schema(columns: Sequence[tuple[str, ColumnType, bool]]) -> T.StructType:
    return T.StructType(
        [T.StructField(name, _SPARK_TYPES[kind], nullable) for name, kind, nullable in columns]
    )


def local_path(uri: str) -> Path | None:
    """The local path an input names, or None for a remote file system."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(parsed.path)
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # a plain path (or C:\ on Windows)
        return Path(uri)
    return None


def normalise(inputs: Sequence[str]) -> list[str]:
    """Absolute URIs for Spark, one per export.  Refused here: a local input that does not
    exist or is not an export, and an export given twice (``/x`` and ``file:///x``, say),
    which would count its JSON lines events twice (Spark reads each path given) and its
    Parquet ones once (Spark dedupes those files)."""
    roots: dict[str, str] = {}  # root -> the input naming it
    for uri in inputs:
        root = _root(uri)
        if root in roots:
            raise AnalyticsError(
                f"inputs {roots[root]} and {uri} are the same export ({root}); give each "
                "export once"
            )
        roots[root] = uri
    return list(roots)


def _root(uri: str) -> str:
    path = local_path(uri)
    if path is None:
        return uri.rstrip("/")
    if not path.is_dir():
        raise AnalyticsError(f"input {uri}: no such export directory")
    # events/ is made by every events export; an older zoneq's export of an idle node, or
    # of its queue alone, holds only the watermark or queue/, and is an export all the same
    # (no events: an empty day), which must not sink a report over every node.
    if not any((path / name).exists() for name in ("events", "queue", WATERMARK_FILE)):
        raise AnalyticsError(
            f"input {uri}: not a zoneq export (no events/ or queue/ directory, no watermark)"
        )
    return path.resolve().as_uri()


def detect_format(inputs: Sequence[str], requested: str, spark: SparkSession | None = None) -> str:
    """The format to read ``inputs`` as: ``requested``, or for ``auto`` the format the
    inputs hold (Parquet when none says).

    What an input holds is its watermark's format, else its first part file's suffix; a
    remote input (``hdfs://``, ``s3a://``) is listed through Hadoop's FileSystem, so only
    when ``spark`` is given (without it, remote inputs are judged later, with it).  A
    ``requested`` format that the part files contradict is refused here: read as the other
    format, the files would give an empty report and a success.
    """
    found = held_formats(inputs, spark)
    if requested != "auto":
        if found and requested not in found:
            raise AnalyticsError(
                f"--input-format {requested}, but the inputs hold {' and '.join(sorted(found))} "
                f"part files; use --input-format {'/'.join(sorted(found))} (or auto)"
            )
        return requested
    if len(found) > 1:
        raise AnalyticsError(
            f"the inputs mix export formats ({', '.join(sorted(found))}); "
            "analyse each format separately or re-export"
        )
    return found.pop() if found else "parquet"


def held_formats(
    inputs: Sequence[str], spark: SparkSession | None = None, *, parts_only: bool = False
) -> set[str]:
    """The export formats found in ``inputs`` (remote ones only with ``spark``): a local
    one's watermark says, unless ``parts_only`` asks for the part files there are."""
    found: set[str] = set()
    for uri in inputs:
        path = local_path(uri)
        held = _local_format(path, parts_only) if path is not None else None
        if held is None and spark is not None:
            held = hadoop_part_format(spark, uri)
        if held is not None:
            found.add(held)
    return found


def _part_format(name: str) -> str | None:
    """``parquet`` or ``jsonl`` for a part file's name; None for anything else (Spark
    skips ``.``- and ``_``-names, where the export keeps unfinished files)."""
    if name.startswith((".", "_")):
        return None
    suffix = name.rpartition(".")[2]
    return suffix if suffix in FORMATS else None


def _local_format(root: Path, parts_only: bool = False) -> str | None:
    if not parts_only:
        try:
            return str(json.loads((root / WATERMARK_FILE).read_text())["format"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    for _, _, names in os.walk(root / "events"):
        for name in names:
            if (fmt := _part_format(name)) is not None:
                return fmt
    return None


def hadoop_part_format(spark: SparkSession, uri: str) -> str | None:
    """The first part file's format under ``uri``/events, listed through Hadoop's
    FileSystem (any scheme Spark can read); None when there is none.  Stops at the first
    one: an export directory holds one format (``zoneq export`` keeps it)."""
    jvm = spark._jvm
    assert jvm is not None
    path = jvm.org.apache.hadoop.fs.Path(f"{uri.rstrip('/')}/events")
    fs = path.getFileSystem(spark._jsc.hadoopConfiguration())
    if not fs.exists(path):
        return None
    files = fs.listFiles(path, True)  # recursive
    while files.hasNext():
        fmt = _part_format(str(files.next().getPath().getName()))
        if fmt is not None:
            return fmt
    return None


def refuse_empty(count: int, roots: Sequence[str], fmt: str, spark: SparkSession) -> None:
    """``AnalyticsError`` when 0 events were read but the inputs hold part files: they were
    read as the wrong format (or filtered out), and an empty report would look like a quiet
    day."""
    if count:
        return
    # Part files, not watermarks: an idle node's export has a watermark and no events.
    found = held_formats(roots, spark, parts_only=True)
    if found:
        raise AnalyticsError(
            f"0 events read as {fmt}, but the inputs hold {' and '.join(sorted(found))} "
            "part files; check --input-format"
        )


def _reader(
    spark: SparkSession, columns: Sequence[tuple[str, ColumnType, bool]], fmt: str
) -> DataFrameReader:
    reader = spark.read.schema(spark_schema(columns)).option("recursiveFileLookup", "true")
    if fmt == "jsonl":
        # FAILFAST: a damaged line is an error with its text, not a silent row of nulls.
        return reader.option("pathGlobFilter", "*.jsonl").option("mode", "FAILFAST").format("json")
    return reader.option("pathGlobFilter", "*.parquet").format("parquet")


def read_events(spark: SparkSession, roots: Sequence[str], fmt: str) -> DataFrame:
    """Every input's events; an input without events/ (an idle node's) has none."""
    return _all_events(spark, roots, fmt).select(*EVENT_USED)


def _all_events(spark: SparkSession, roots: Sequence[str], fmt: str) -> DataFrame:
    present = [f"{root}/events" for root in roots if _exists(spark, f"{root}/events")]
    if not present:
        return spark.createDataFrame([], spark_schema(EVENT_COLUMNS))
    return _reader(spark, EVENT_COLUMNS, fmt).load(present)


def file_with_null(spark: SparkSession, roots: Sequence[str], fmt: str, column: str) -> str | None:
    """The part file of an event of a version this zoneq reads with ``column`` null, or
    None: a pass over the inputs, for an error message only."""
    known = F.col("v").isin(*EVENT_VERSIONS)
    found = (
        _all_events(spark, roots, fmt)
        .where(known & F.col(column).isNull())
        .select(F.input_file_name().alias("file"))
        .first()
    )
    return None if found is None or not found["file"] else str(found["file"])


def read_queue(spark: SparkSession, roots: Sequence[str], fmt: str) -> DataFrame | None:
    """Every input's current queue export, or None if no input has one."""
    present = [f"{root}/queue" for root in roots if _exists(spark, f"{root}/queue")]
    if not present:
        return None
    return _reader(spark, QUEUE_COLUMNS, fmt).load(present)


def _exists(spark: SparkSession, uri: str) -> bool:
    """Through Hadoop's FileSystem, so hdfs:// and s3a:// answer as well as local paths."""
    jvm = spark._jvm
    assert jvm is not None
    path = jvm.org.apache.hadoop.fs.Path(uri)
    fs = path.getFileSystem(spark._jsc.hadoopConfiguration())
    return bool(fs.exists(path))


def count_versions(frame: DataFrame) -> dict[int | None, int]:
    """Rows per schema version ``v``: a query reading that one column only."""
    return {row["v"]: row["count"] for row in frame.groupBy("v").count().collect()}


def check_versions(versions: Mapping[int | None, int], expected: Collection[int], what: str) -> int:
    """The rows counted per schema version, refusing any version not in ``expected``; how
    many rows.

    The counts come out of the job's first aggregation (``v`` is one of its keys), so the
    check costs no pass over the data of its own.
    """
    others = sorted((v for v in versions if v not in expected), key=lambda v: (v is None, v))
    if others:
        shown = ", ".join("missing" if v is None else str(v) for v in others)
        known = sorted(expected)
        readable = " and ".join(map(str, known))
        raise AnalyticsError(
            f"the {what} export has schema version {shown}; this zoneq reads "
            f"version{'s' if len(known) > 1 else ''} {readable} only "
            "(export again with a matching zoneq)"
        )
    return sum(versions.values())


__all__ = [
    "EVENT_VERSION",
    "EVENT_VERSIONS",
    "FORMATS",
    "QUEUE_VERSION",
    "check_versions",
    "count_versions",
    "detect_format",
    "file_with_null",
    "hadoop_part_format",
    "held_formats",
    "normalise",
    "read_events",
    "read_queue",
    "refuse_empty",
]
