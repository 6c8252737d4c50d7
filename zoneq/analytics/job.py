"""The analytics job: exports in, per-zone tables (Parquet, CSV) and an HTML report out.

Spark does the heavy part: it reads the events (only the columns used), caches them once,
and computes every table with one aggregation each.  The tables are small (zones x hours,
zones x domains, ...), so they come back to the driver as Arrow tables and the driver
writes them (pyarrow for Parquet and CSV) together with the HTML report into ``out``, a
local directory of the driver also when the job runs on a cluster.  Writing them through
Spark instead cost two more jobs per table, seconds in all, for a few kilobytes.

Spark and Java errors become one ``AnalyticsError`` line at this one boundary
(``spark_errors``), never a JVM stack trace.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet
import pyspark
from py4j.protocol import Py4JError, Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession

from zoneq.analytics import inputs, report, session, tables
from zoneq.analytics.errors import AnalyticsError
from zoneq.analytics.java import check_java
from zoneq.protocol.columns import EVENT_VERSION, QUEUE_COLUMNS, QUEUE_VERSION

EVENT_TABLES: Final[dict[str, Callable[[DataFrame], DataFrame]]] = {
    "zones": tables.zones,
    "hourly": tables.hourly,
    "delivery": tables.delivery,
    "attempts": tables.attempts,
    "domains": lambda events: tables.rates_by(events, "domain", "domain", tables.NO_SOURCE),
    "mx": lambda events: tables.rates_by(events, "mx", "mx", tables.NO_MX),
    "sources": lambda events: tables.rates_by(events, "source_ip", "source_ip", tables.NO_SOURCE),
    "replies": tables.replies,
}
QUEUE_TABLES: Final[dict[str, Callable[[DataFrame], DataFrame]]] = {
    "queue_age": tables.queue_age,
    "queue_domains": tables.queue_domains,
}
REPORT_FILE: Final = "report.html"
# Spark jobs submitted at once.  Each small job spends much of its time planning and
# compiling on the driver while executor cores wait; several in flight keep both busy.
PARALLEL_JOBS: Final = 4

log = logging.getLogger(__name__)
logging.getLogger("py4j").setLevel(logging.WARNING)  # a line per gateway connection


@dataclass(frozen=True, slots=True)
class Report:
    events: int
    queued: int
    tables: dict[str, list[dict[str, Any]]]
    html: Path
    seconds: float


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, Py4JJavaError):
        text = str(exc.java_exception.toString())
    elif isinstance(exc, PySparkException):
        text = exc.getMessage() or str(exc)
    else:
        text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:600]


@contextlib.contextmanager
def spark_errors() -> Iterator[None]:
    """Spark's and the JVM's exceptions as one ``AnalyticsError`` with a one-line message."""
    try:
        yield
    except (PySparkException, Py4JError) as exc:
        text = _one_line(exc)
        if "No FileSystem for scheme" in text:
            text += (
                " (that file system's jars are not on Spark's class path: for s3a, e.g. "
                "spark-submit --packages org.apache.hadoop:hadoop-aws:<Hadoop version>)"
            )
        raise AnalyticsError(f"Spark: {text}") from exc


def build_report(
    spark: SparkSession, sources: Sequence[str], out: Path, *, input_format: str = "auto"
) -> Report:
    """Read ``sources`` (export directories), write the tables and report into ``out``."""
    started = time.monotonic()
    roots = inputs.normalise(sources)
    fmt = inputs.detect_format(sources, input_format)
    with spark_errors():
        events = inputs.read_events(spark, roots, fmt)
        queue = inputs.read_queue(spark, roots, fmt)
        if queue is None:
            queue = spark.createDataFrame([], inputs.spark_schema(QUEUE_COLUMNS))
        # JSON is parsed once into Spark's columnar cache; Parquet is columnar already, and
        # each table reading just its few columns from it was faster than caching them all.
        cached = fmt == "jsonl"
        if cached:
            events = events.cache()
        try:
            with ThreadPoolExecutor(PARALLEL_JOBS, thread_name_prefix="zoneq-spark") as pool:
                checks = (
                    pool.submit(inputs.check_version, events, EVENT_VERSION, "event"),
                    pool.submit(inputs.check_version, queue, QUEUE_VERSION, "queue"),
                )
                count, queued = (check.result() for check in checks)
                log.debug("inputs checked: %.1f s", time.monotonic() - started)
                jobs = {
                    name: pool.submit(_arrow, make, frame)
                    for frame, makers in ((events, EVENT_TABLES), (queue, QUEUE_TABLES))
                    for name, make in makers.items()
                }
                arrow = {name: job.result() for name, job in jobs.items()}
        finally:
            if cached:
                events.unpersist()
    log.debug("tables computed: %.1f s", time.monotonic() - started)
    rows = {name: table.to_pylist() for name, table in arrow.items()}
    out.mkdir(parents=True, exist_ok=True)
    for name, table in arrow.items():
        _write_table(out, name, table)
    page = out / REPORT_FILE
    page.write_text(report.render(rows, inputs=list(sources), events=count), encoding="utf-8")
    log.debug("report written: %.1f s", time.monotonic() - started)
    return Report(count, queued, rows, page, time.monotonic() - started)


def _arrow(make: Callable[[DataFrame], DataFrame], frame: DataFrame) -> pa.Table:
    return make(frame).toArrow()


def _write_table(out: Path, name: str, table: pa.Table) -> None:
    for sub in ("parquet", "csv"):
        (out / sub).mkdir(exist_ok=True)
    pyarrow.parquet.write_table(table, out / "parquet" / f"{name}.parquet")
    pyarrow.csv.write_csv(table, out / "csv" / f"{name}.csv")


def run(
    sources: Sequence[str],
    out: Path,
    *,
    master: str | None = None,
    input_format: str = "auto",
    driver_memory: str | None = None,
) -> Report:
    """The whole job: check Java, start Spark, build the report, stop Spark."""
    inputs.normalise(sources)  # a bad local path is refused before the JVM starts
    check_java(pyspark.__version__)
    with spark_errors():
        spark = session.start(master, driver_memory=driver_memory)
    try:
        return build_report(spark, sources, out, input_format=input_format)
    finally:
        with contextlib.suppress(Exception):
            spark.stop()


def default_driver_memory() -> str:
    """Half the machine's memory for a local driver (the default 1 GiB caches ~3 M events)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return "2g"
    return f"{max(1, total // 2 // (1 << 30))}g"
