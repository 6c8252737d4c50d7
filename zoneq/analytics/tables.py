"""The report's tables, each a Spark DataFrame computed from the events (and the queue).

Definitions (the HTML report repeats them next to each table):

* an *attempt* is an event of kind delivered, deferred, bounced or expired: each is the
  outcome of one SMTP attempt (expired is the last, failed attempt of a recipient that ran
  out of time);
* ``deferral_rate`` = deferred / attempts: how often an attempt had to be tried again;
* ``bounce_rate`` = (bounced + expired) / (delivered + bounced + expired): the share of the
  recipients that finished and did not arrive;
* latency = delivered event time - the message's queued-at time (its id's time), in ms;
  percentiles are nearest-rank (the smallest value with at least p of the values at or
  below it), as Spark's ``percentile_approx`` gives exactly while a group has fewer than
  ``PERCENTILE_ACCURACY`` values, and within 1/``PERCENTILE_ACCURACY`` of the rank above;
* ``recipients`` in the hourly volumes counts an accepted event as the recipients it
  queued (one event per message and zone, ``events.py``) and every other event as one.

Times are UTC (the session's time zone is set to UTC in ``session.py``).
"""

from __future__ import annotations

from typing import Final

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

PERCENTILE_ACCURACY: Final = 10_000
TOP_REPLIES: Final = 10
ATTEMPT_KINDS: Final = ("delivered", "deferred", "bounced", "expired")
REPLY_KINDS: Final = ("deferred", "bounced", "expired", "delayed")
ALL_KINDS: Final = ("accepted", "delivered", "deferred", "bounced", "expired", "dropped", "delayed")
NO_MX: Final = "(no MX reached)"
NO_SOURCE: Final = "(none)"
HOUR_MS: Final = 3_600_000


def _count_kind(kind: str) -> Column:
    return F.sum(F.when(F.col("kind") == kind, 1).otherwise(0)).cast("long").alias(kind)


def _ratio(numerator: Column, denominator: Column) -> Column:
    return F.when(denominator > 0, numerator / denominator)


def _percentiles(column: str, name: str, points: tuple[float, ...]) -> list[Column]:
    values = F.percentile_approx(column, list(points), PERCENTILE_ACCURACY)
    return [
        values[i].cast("long").alias(f"{name}_p{round(p * 100)}_ms") for i, p in enumerate(points)
    ]


def zones(events: DataFrame) -> DataFrame:
    """Per zone: recipients accepted and events of every other kind."""
    accepted = F.sum(F.when(F.col("kind") == "accepted", F.col("recipients")).otherwise(0))
    counts = [_count_kind(kind) for kind in ALL_KINDS if kind != "accepted"]
    return (
        events.groupBy("zone").agg(accepted.cast("long").alias("accepted"), *counts).orderBy("zone")
    )


def hourly(events: DataFrame) -> DataFrame:
    """Per zone, hour and outcome: recipients (volumes by outcome per hour)."""
    hour = F.from_unixtime(F.floor(F.col("time_ms") / HOUR_MS) * 3600, "yyyy-MM-dd HH:00")
    weight = F.when(F.col("kind") == "accepted", F.col("recipients")).otherwise(1)
    return (
        events.groupBy("zone", hour.alias("hour"), F.col("kind").alias("outcome"))
        .agg(F.sum(weight).cast("long").alias("recipients"))
        .orderBy("zone", "hour", "outcome")
    )


def delivery(events: DataFrame) -> DataFrame:
    """Per zone: delivered recipients, latency percentiles, attempts per delivered one."""
    delivered = events.where(F.col("kind") == "delivered").withColumn(
        "latency_ms", F.col("time_ms") - F.col("queued_at_ms")
    )
    return (
        delivered.groupBy("zone")
        .agg(
            F.count(F.lit(1)).alias("delivered"),
            *_percentiles("latency_ms", "latency", (0.5, 0.95, 0.99)),
            F.avg("attempt").alias("attempts_mean"),
            F.max("attempt").cast("long").alias("attempts_max"),
        )
        .orderBy("zone")
    )


def attempts(events: DataFrame) -> DataFrame:
    """Per zone: how many delivered recipients needed 1, 2, ... attempts."""
    return (
        events.where(F.col("kind") == "delivered")
        .groupBy("zone", F.col("attempt").alias("attempts"))
        .agg(F.count(F.lit(1)).alias("delivered"))
        .orderBy("zone", "attempts")
    )


def rates_by(events: DataFrame, key: str, label: str, missing: str) -> DataFrame:
    """Per zone and ``key`` (domain, MX, source address): attempts, outcomes and rates."""
    tried = events.where(F.col("kind").isin(*ATTEMPT_KINDS)).withColumn(
        label, F.coalesce(F.col(key), F.lit(missing))
    )
    counts = tried.groupBy("zone", label).agg(
        F.count(F.lit(1)).alias("attempts"), *[_count_kind(kind) for kind in ATTEMPT_KINDS]
    )
    finished = F.col("delivered") + F.col("bounced") + F.col("expired")
    return counts.select(
        "*",
        _ratio(F.col("deferred"), F.col("attempts")).alias("deferral_rate"),
        _ratio(F.col("bounced") + F.col("expired"), finished).alias("bounce_rate"),
    ).orderBy("zone", F.desc("attempts"), label)


def replies(events: DataFrame) -> DataFrame:
    """Per zone and category (outcome): the ``TOP_REPLIES`` most frequent reply texts."""
    failed = events.where(F.col("kind").isin(*REPLY_KINDS)).select(
        "zone",
        F.col("kind").alias("outcome"),
        F.coalesce(F.col("code").cast("string"), F.lit("")).alias("code"),
        F.coalesce(F.col("enhanced"), F.lit("")).alias("enhanced"),
        F.coalesce(F.col("text"), F.lit("")).alias("text"),
    )
    counted = failed.groupBy("zone", "outcome", "code", "enhanced", "text").agg(
        F.count(F.lit(1)).alias("events")
    )
    order = Window.partitionBy("zone", "outcome").orderBy(
        F.desc("events"), "text", "code", "enhanced"
    )
    return (
        counted.withColumn("rank", F.row_number().over(order))
        .where(F.col("rank") <= TOP_REPLIES)
        .orderBy("zone", "outcome", "rank")
    )


def queue_age(queue: DataFrame) -> DataFrame:
    """Per zone and state, at export time: recipients waiting and how long they have."""
    return (
        queue.groupBy("zone", "state")
        .agg(
            F.count(F.lit(1)).alias("recipients"),
            *_percentiles("age_ms", "age", (0.5, 0.95)),
            F.max("age_ms").alias("age_max_ms"),
        )
        .orderBy("zone", "state")
    )


def queue_domains(queue: DataFrame) -> DataFrame:
    """Per zone and destination domain, at export time: recipients waiting, oldest age."""
    return (
        queue.groupBy("zone", "domain")
        .agg(F.count(F.lit(1)).alias("recipients"), F.max("age_ms").alias("age_max_ms"))
        .orderBy("zone", F.desc("recipients"), "domain")
    )
