"""The analytics job: exports in, per-zone tables (Parquet, CSV) and an HTML report out.

Spark does the heavy part: it reads the events (only the columns used) and runs four
aggregations at once (``tables.py``: one pass for every count, one for the latency
percentiles, two over the queue).  Their results are small (zones x hours, zones x domains,
...), so they come back to the driver as Arrow tables; the driver pivots and sorts them
into the report's tables (``derive.py``) and writes those (pyarrow for Parquet and CSV)
with the HTML report into ``out``, a local directory of the driver also when the job runs
on a cluster.  Writing them through Spark instead cost two more jobs per table, seconds in
all, for a few kilobytes.

The driver's own work overlaps Spark's: the charts of a table are drawn as soon as its
query is done, while the others still run, and matplotlib is imported while the JVM starts.

Spark and Java errors become one ``AnalyticsError`` line at this one boundary
(``spark_errors``), never a JVM stack trace.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv
import pyarrow.parquet
import pyspark
from py4j.protocol import Py4JError, Py4JJavaError
from pyspark import SparkContext
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession

from zoneq.analytics import classcache, convert, derive, inputs, session, tables
from zoneq.analytics.errors import AnalyticsError
from zoneq.analytics.java import check_java, java_command
from zoneq.protocol.columns import EVENT_VERSIONS, QUEUE_COLUMNS, QUEUE_VERSION

REPORT_FILE: Final = "report.html"
REPORT_MODULE: Final = "zoneq.analytics.report"  # matplotlib: imported while the JVM starts
# The Spark queries, over the events or the queue; all four are submitted at once: each
# spends much of its time planning and compiling on the driver while executor cores wait,
# so several in flight keep both busy.
EVENT_QUERIES: Final[dict[str, Callable[[DataFrame], DataFrame]]] = {
    "facets": tables.facets,
    "delivery": tables.delivery,
}
QUEUE_QUERIES: Final[dict[str, Callable[[DataFrame], DataFrame]]] = {
    "queue_age": tables.queue_age,
    "queue_domains": tables.queue_domains,
}
TABLES: Final = (
    "zones",
    "hourly",
    "delivery",
    "attempts",
    "domains",
    "mx",
    "sources",
    "replies",
    "categories",
    "queue_age",
    "queue_domains",
)

# The keys of the event queries' results that no exported event leaves null, each as
# (query, result column, the facet rows it is a key of (None: every row), event column).
NULL_KEYS: Final[tuple[tuple[str, str, int | None, str], ...]] = (
    ("facets", "zone", None, "zone"),
    ("facets", "kind", None, "kind"),
    ("facets", "num", tables.HOURLY, "time_ms"),
    ("facets", "num", tables.ATTEMPTS, "attempt"),
    ("facets", "s1", tables.DOMAIN, "domain"),
    ("delivery", "zone", None, "zone"),
)
MAX_CAUSES: Final = 16  # of a JVM exception's cause chain walked (a chain can loop)

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
        text = _java_cause(exc.java_exception)
    elif isinstance(exc, PySparkException):
        text = exc.getMessage() or str(exc)
    else:
        text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:600]


def _java_cause(error: Any) -> str:
    """What a JVM exception says went wrong: its innermost cause, after the file it was
    reading when a layer says which (Spark's FAILED_READ_FILE).

    A task's failure reaches the driver wrapped in layers ("Exception thrown in
    awaitResult", then FAILED_READ_FILE with the path, MALFORMED_RECORD_IN_PARSING, and
    last the parser's own message); the outermost line names neither the file nor what is
    wrong in it."""
    chain = [error]
    while len(chain) < MAX_CAUSES and (cause := chain[-1].getCause()) is not None:
        chain.append(cause)
    innermost = str(chain[-1].toString())
    for layer in chain[:-1]:
        if (path := _file_read(layer)) is not None:
            return f"reading {path}: {innermost}"
    return innermost


def _file_read(error: Any) -> str | None:
    """The path of Spark's FAILED_READ_FILE error (a SparkThrowable), else None."""
    try:
        if not str(error.getCondition()).startswith("FAILED_READ_FILE"):
            return None
        path = error.getMessageParameters().get("path")
    except Py4JError:  # not a SparkThrowable: no such method
        return None
    return None if path is None else str(path)


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


class _Results:
    """What the queries gave, turned into the report's tables as each one arrives."""

    def __init__(self) -> None:
        self.arrow: dict[str, pa.Table] = {}
        self.rows: dict[str, list[dict[str, Any]]] = {}
        self.versions: dict[int | None, int] = {}
        self.queue_versions: dict[int | None, int] = {}

    def add(self, query: str, result: pa.Table) -> dict[str, list[dict[str, Any]]]:
        """Derive the tables of ``query``'s result; their rows."""
        if query == "facets":
            self.versions = derive.versions(result)
            made = derive.event_tables(result)
        elif query == "delivery":
            made = {"delivery": derive.delivery(result)}
        elif query == "queue_age":
            self.queue_versions = derive.queue_versions(result)
            made = {"queue_age": derive.queue_age(result)}
        else:
            made = {"queue_domains": derive.queue_domains(result)}
        self.arrow.update(made)
        rows = {name: table.to_pylist() for name, table in made.items()}
        self.rows.update(rows)
        return rows


def build_report(
    spark: SparkSession,
    sources: Sequence[str],
    out: Path,
    *,
    input_format: str = "auto",
    json_on_driver: bool | None = None,
    shown: Sequence[str] | None = None,
    started: float | None = None,
) -> Report:
    """Read ``sources`` (export directories), write the tables and report into ``out``.

    JSON lines exports are converted to Parquet on the driver first (``convert.py``) when
    ``json_on_driver`` says so; by default when Spark is local and the inputs are local
    directories.  ``shown``: the inputs as the page names them (default ``sources``).
    ``started``: the ``time.monotonic()`` the phase times and ``Report.seconds`` count from
    (default now; ``run`` passes its own start, so they include starting Spark).
    """
    started = time.monotonic() if started is None else started
    inputs.normalise(sources)
    fmt = inputs.detect_format(sources, input_format, spark)
    if json_on_driver is None:
        json_on_driver = session.is_local(spark.sparkContext.master or "") and convert.applies(
            sources
        )
    if fmt == "jsonl" and json_on_driver:
        with tempfile.TemporaryDirectory(prefix="zoneq-analytics-") as scratch:
            converted = convert.convert(sources, Path(scratch))
            log.debug("JSON converted to Parquet: %.1f s", time.monotonic() - started)
            return _build(spark, converted, "parquet", out, shown=shown or sources, started=started)
    return _build(spark, sources, fmt, out, shown=shown or sources, started=started)


def _build(
    spark: SparkSession,
    sources: Sequence[str],
    fmt: str,
    out: Path,
    *,
    shown: Sequence[str],
    started: float,
) -> Report:
    report = importlib.import_module(REPORT_MODULE)
    roots = inputs.normalise(sources)
    results = _Results()
    charts: dict[str, str] = {}
    with spark_errors():
        events = inputs.read_events(spark, roots, fmt)
        queue = inputs.read_queue(spark, roots, fmt)
        if queue is None:
            queue = spark.createDataFrame([], inputs.spark_schema(QUEUE_COLUMNS))
        # JSON read by Spark (on a cluster) is parsed once into its columnar cache: two
        # queries read the events.  Parquet is columnar already, read twice more cheaply.
        cached = fmt == "jsonl"
        if cached:
            events = events.cache()
        try:
            with ThreadPoolExecutor(4, thread_name_prefix="zoneq-spark") as pool:
                running: dict[Future[pa.Table], str] = {
                    pool.submit(_arrow, make, frame): name
                    for frame, makers in ((events, EVENT_QUERIES), (queue, QUEUE_QUERIES))
                    for name, make in makers.items()
                }
                try:
                    for done in as_completed(running):
                        _refuse_null_keys(running[done], done.result(), spark, roots, fmt)
                        rows = results.add(running[done], done.result())
                        log.debug("%s: %.1f s", running[done], time.monotonic() - started)
                        charts.update(report.draw_charts(rows))
                except Exception:
                    with contextlib.suppress(Exception):
                        spark.sparkContext.cancelAllJobs()  # the pool would wait for them
                    raise
        except (PySparkException, Py4JError):
            # A Spark error (a file of another schema, say) is often a version mismatch
            # underneath: say that instead when the versions alone can be read.
            _refuse_other_versions(events, queue)
            raise
        finally:
            if cached:
                events.unpersist()
    count = inputs.check_versions(results.versions, EVENT_VERSIONS, "event")
    inputs.refuse_empty(count, roots, fmt, spark)
    queued = inputs.check_versions(results.queue_versions, {QUEUE_VERSION}, "queue")
    log.debug("tables and charts: %.1f s", time.monotonic() - started)
    out.mkdir(parents=True, exist_ok=True)
    for name in TABLES:
        _write_table(out, name, results.arrow[name])
    rows = {name: results.rows[name] for name in TABLES}
    page = out / REPORT_FILE
    html = report.render(rows, inputs=list(shown), events=count, charts=charts)
    page.write_text(html, encoding="utf-8")
    log.debug("report written: %.1f s", time.monotonic() - started)
    return Report(count, queued, rows, page, time.monotonic() - started)


def _refuse_null_keys(
    query: str, result: pa.Table, spark: SparkSession, roots: Sequence[str], fmt: str
) -> None:
    """``AnalyticsError`` naming a part file and the column if ``query``'s result has a
    null key from an event that never has one (else nothing): the report would file its
    rows under a zone or an hour of None, and fail drawing them."""
    for name, column, facet, source in NULL_KEYS:
        if name != query:
            continue
        values = result if facet is None else result.filter(pc.equal(result["facet"], facet))
        if pc.any(pc.is_null(values[column])).as_py():
            events = inputs.read_events(spark, roots, fmt)
            # A row of a version this zoneq does not read may lack any column: say that.
            inputs.check_versions(inputs.count_versions(events), EVENT_VERSIONS, "event")
            where = inputs.file_with_null(spark, roots, fmt, source) or "the event export"
            raise AnalyticsError(
                f"{where}: {source} is null or missing in an event (an export always writes it)"
            )


def _refuse_other_versions(events: DataFrame, queue: DataFrame) -> None:
    """``AnalyticsError`` if either export holds another schema version (else nothing)."""
    for frame, expected, what in (
        (events, EVENT_VERSIONS, "event"),
        (queue, {QUEUE_VERSION}, "queue"),
    ):
        try:
            versions = inputs.count_versions(frame)
        except (PySparkException, Py4JError):
            return
        inputs.check_versions(versions, expected, what)


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
    class_cache: Path | None = None,
) -> Report:
    """The whole job: check Java, start Spark, build the report, stop Spark.

    The JVM takes seconds to start; the driver's own preparation runs meanwhile:
    importing matplotlib and, for local JSON lines inputs, converting them to Parquet.
    ``class_cache``: the directory of the JVM's class-data archive (``classcache.py``) for
    a local run, None for none.
    """
    started = time.monotonic()
    inputs.normalise(sources)  # a bad local path is refused before the JVM starts
    fmt = inputs.detect_format(sources, input_format)
    check_java(pyspark.__version__)
    local = session.runs_here(master)
    cache = _class_cache(class_cache) if local else None
    with (
        ThreadPoolExecutor(1, thread_name_prefix="zoneq-jvm") as starter,
        tempfile.TemporaryDirectory(prefix="zoneq-analytics-") as scratch,
    ):
        starting = starter.submit(_start, master, driver_memory, cache)
        try:
            importlib.import_module(REPORT_MODULE)
            readable, fmt_read = list(sources), fmt
            if fmt == "jsonl" and local and convert.applies(sources):
                readable, fmt_read = convert.convert(sources, Path(scratch)), "parquet"
                log.debug("JSON converted to Parquet: %.1f s", time.monotonic() - started)
        except BaseException:
            with contextlib.suppress(Exception):
                _stop(starting.result(), cache)
            raise
        spark = starting.result()
        log.debug("Spark started: %.1f s", time.monotonic() - started)
        if fmt_read == fmt and input_format == "auto" and inputs.held_formats(readable) != {fmt}:
            # Not all inputs are local: detect again, listing remote ones through Hadoop.
            fmt_read = "auto"
        try:
            return build_report(
                spark, readable, out, input_format=fmt_read, shown=sources, started=started
            )
        finally:
            _stop(spark, cache)


def _stop(spark: SparkSession, cache: classcache.ClassCache | None) -> None:
    jvm = getattr(SparkContext._gateway, "proc", None)  # the JVM PySpark started
    with contextlib.suppress(Exception):
        spark.stop()
    if cache is not None:
        cache.finish(jvm)


def _start(
    master: str | None, driver_memory: str | None, cache: classcache.ClassCache | None
) -> SparkSession:
    with spark_errors():
        return session.start(master, driver_memory=driver_memory, class_cache=cache)


def _class_cache(directory: Path | None) -> classcache.ClassCache | None:
    """The class-data archive in ``directory`` for the Java and Spark about to start."""
    java = java_command(os.environ)
    jars = Path(os.environ.get("SPARK_HOME") or Path(pyspark.__file__).parent) / "jars"
    if directory is None or java is None or not jars.is_dir():
        return None
    try:
        return classcache.ClassCache.at(directory, java, jars)
    except OSError as exc:  # an unwritable cache directory costs speed, not the report
        log.warning("no JVM class cache in %s: %s", directory, exc)
        return None


def default_driver_memory() -> str:
    """Half the machine's memory for a local driver (the default 1 GiB caches ~3 M events)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return "2g"
    return f"{max(1, total // 2 // (1 << 30))}g"
