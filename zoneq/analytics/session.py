"""The Spark session: local[*] on loopback by default, the UI off, UTC, quiet logs.

``spark.driver.host`` / ``spark.driver.bindAddress`` keep the driver's ports (its RPC and
block manager) on 127.0.0.1 for a local run; the test bed's rule is that nothing listens
beyond loopback.  With ``--master`` pointing at a cluster the driver must be reachable by
the executors, so then the addresses are left to Spark's own settings
(``SPARK_LOCAL_IP``, ``spark-defaults.conf``, ``spark-submit --conf``).
"""

from __future__ import annotations

import os
import tempfile
from typing import Final

from pyspark.sql import SparkSession

from zoneq.analytics.classcache import ClassCache

DEFAULT_MASTER: Final = "local[*]"
LOOPBACK: Final = "127.0.0.1"
APP_NAME: Final = "zoneq-analytics"

# Spark's log4j2 default prints INFO/WARN lines (native-hadoop, default log level) on
# stderr at every start; the job reports its own errors, so only Spark's errors are kept.
_LOG4J2: Final = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} spark %p %c{1}: %m%n
"""


def is_local(master: str) -> bool:
    return master == "local" or master.startswith("local[")


def _log_config() -> str:
    path = os.path.join(tempfile.gettempdir(), "zoneq-analytics-log4j2.properties")
    if not os.path.exists(path):
        with open(path, "w", encoding="utf-8") as out:
            out.write(_LOG4J2)
    return path


def under_spark_submit() -> bool:
    """Whether spark-submit started this Python (its JVM is already up, with its master)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def runs_here(master: str | None) -> bool:
    """Whether ``start(master)`` gives a Spark running in this process's JVM (local mode),
    known before it starts: under spark-submit its master is known only from the session."""
    if master is None:
        return not under_spark_submit()
    return is_local(master)


def start(
    master: str | None = None,
    *,
    driver_memory: str | None = None,
    class_cache: ClassCache | None = None,
) -> SparkSession:
    """A Spark session for the job.  ``master`` None: spark-submit's when it launched us,
    else ``local[*]``.  ``class_cache``: the JVM's class-data archive (local runs only)."""
    if master is None and not under_spark_submit():
        master = DEFAULT_MASTER
    builder = SparkSession.builder.appName(APP_NAME)
    if master is not None:
        builder = builder.master(master)
    builder = (
        builder.config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        # The tables are small after the first aggregation; Spark's default of 200 shuffle
        # partitions turns each into 200 tiny tasks (seconds of overhead per table).
        .config("spark.sql.shuffle.partitions", str(max(4, (os.cpu_count() or 2) * 2)))
        .config("spark.sql.adaptive.enabled", "true")
    )
    java_options = [f"-Dlog4j2.configurationFile=file:{_log_config()}"]
    if master is not None and is_local(master):
        os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)
        builder = builder.config("spark.driver.host", LOOPBACK).config(
            "spark.driver.bindAddress", LOOPBACK
        )
        # A report is a few short queries: the JVM's C2 compiler spends more CPU compiling
        # them than they run for.  C1 only, measured on 1 M Parquet events with 2 cores
        # (tools/bench/analytics_bench.py, class cache on): 16-19 CPU-s for the whole job
        # instead of 23.  The serial collector: G1's concurrent marking and refinement
        # threads and its write barriers cost CPU a short run never earns back; measured
        # fully cold (no class cache), 4 runs each, alternating: 20.0 CPU-s for the whole
        # job instead of 23.2 (its pauses are short on a heap this size).
        java_options.extend(("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"))
        if class_cache is not None and not under_spark_submit():
            java_options.extend(class_cache.java_options())
    builder = builder.config("spark.driver.extraJavaOptions", " ".join(java_options))
    if driver_memory is not None and not under_spark_submit():  # its JVM is running already
        builder = builder.config("spark.driver.memory", driver_memory)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
