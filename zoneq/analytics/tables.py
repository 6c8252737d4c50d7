"""The Spark side of the report: four aggregations over the events and the queue.

Definitions (the HTML report repeats them next to each table):

* an *attempt* is an event of kind delivered, deferred, bounced or expired: each is the
  outcome of one SMTP attempt (expired is the last, failed attempt of a recipient that ran
  out of time);
* ``deferral_rate`` = deferred / attempts: how often an attempt had to be tried again;
* ``bounce_rate`` = (bounced + expired) / (delivered + bounced + expired): the share of the
  recipients that finished and did not arrive;
* latency = delivered event time - the message's queued-at time (its id's time), in ms.
  The id is issued when the transaction begins (SMTP MAIL FROM, or an API submission's
  start), so latency includes the client's RCPT and DATA transfer and the commit, not only
  the time from the 250 to delivery.  Kept so on purpose: measuring from the ACCEPTED
  event would need a join per message (a second shuffle beside the one-pass aggregation),
  and would lose every delivery whose ACCEPTED event is in an earlier incremental export
  or already trimmed by retention; the transfer is milliseconds next to queueing and
  delivery, and a client that trickles DATA is then seen as the latency it is;
  percentiles are nearest-rank (the smallest value with at least p of the values at or
  below it), as Spark's ``percentile_approx`` gives exactly while a group has fewer than
  ``PERCENTILE_ACCURACY`` values, and within 1/``PERCENTILE_ACCURACY`` of the rank above;
* ``recipients`` in the hourly volumes counts an accepted event as the recipients it
  queued (one event per message and zone, ``events.py``) and every other event as one;
* a failure's *category* (deferred, bounced, expired, delayed) is the event's ``category``
  (the reply rule's, else the reply's RFC 3463 class; event schema version 2); an event
  without one (schema version 1) is filed under its outcome, as reports did before.

Times are UTC (the session's time zone is set to UTC in ``session.py``).

Why so few queries: on a cold JVM each Spark query costs about a second before its first
row (planning, generating and compiling its code, which then runs interpreted until the
JIT catches up), more than reading a million Parquet rows.  So every table that is a count
or a sum comes out of *one* aggregation, ``facets``: each event row is turned into one row
per facet it counts in (its hour, its attempt number, its domain with its MX, its source
address, its reply line), and one ``groupBy`` counts them all.  Domain and MX share a row
because a domain has only a few MX hosts, so the pairs are hardly more than the domains:
one row fewer per attempt cut the aggregation's CPU by about a seventh (1 M events, 3.1
CPU-s instead of 3.6, warm JVM); the source address joined to them multiplied the groups
instead (domains x addresses) and saved nothing.  The driver then pivots and sorts those
few thousand counts into the report's tables (``derive.py``).  Only what cannot be summed
from counts gets a query of its own: the latency percentiles (``delivery``) and the queue
tables.  No query sorts (``orderBy`` is a range-partitioning job of its own); the driver
sorts the small results.
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

# The facets of one event, and the key columns (``num``, ``s1``..``s3``) each one fills.
HOURLY: Final = 0  # num: the hour (time_ms // HOUR_MS); every event, so also the counts
ATTEMPTS: Final = 1  # num: the attempt number of a delivered event
# s1: the destination domain of an attempt, s2: its MX host (NO_MX when none was reached)
DOMAIN: Final = 2
SOURCE: Final = 4  # s1: the source address of an attempt (NO_SOURCE when none)
REPLY: Final = 5  # s1, s2, s3: text, code, enhanced code of a reply (top TOP_REPLIES only)
# s4: a failure's category, on its HOURLY and REPLY rows (null on every other row).  On the
# hourly rows it costs no row of its own: the outcomes by category are summed from them.
# table -> (the facet its rows come from, the key column holding its label, the label)
RATE_FACETS: Final = {
    "domains": (DOMAIN, "s1", "domain"),
    "mx": (DOMAIN, "s2", "mx"),
    "sources": (SOURCE, "s1", "source_ip"),
}
FACET_KEYS: Final = ("v", "zone", "kind", "facet", "num", "s1", "s2", "s3", "s4")


def _facet(
    facet: int,
    num: Column | None = None,
    *,
    s1: Column | None = None,
    s2: Column | None = None,
    s3: Column | None = None,
    s4: Column | None = None,
) -> Column:
    """One facet row; the keys it does not use are null (Columns need a session: built
    here, not at import)."""
    text = F.lit(None).cast("string")
    return F.struct(
        F.lit(facet).alias("facet"),
        (F.lit(None) if num is None else num).cast("long").alias("num"),
        *((text if c is None else c).alias(f"s{i}") for i, c in enumerate((s1, s2, s3, s4), 1)),
    )


def facets(events: DataFrame) -> DataFrame:
    """Counts per zone, kind and facet value: ``n`` events, ``weight`` recipients.

    ``weight`` is the recipients an accepted event queued and 1 for any other event (the
    hourly volumes' unit).  The schema version ``v`` is a key as well, so the same pass
    also checks the export's version (on the hourly rows; null on the others).  Reply lines
    are ranked here (``rank``, among the zone's replies of that category, whatever their
    outcome) and only the first ``TOP_REPLIES`` leave Spark: reply texts can carry queue
    ids and be nearly unique, and the driver should not get them all.
    """
    kind = F.col("kind")
    tried = kind.isin(*ATTEMPT_KINDS)
    replied = kind.isin(*REPLY_KINDS)
    category = F.when(replied, F.coalesce(F.col("category"), kind))
    rows = F.array(
        _facet(HOURLY, F.floor(F.col("time_ms") / HOUR_MS), s4=category),
        F.when(kind == "delivered", _facet(ATTEMPTS, F.col("attempt"))),
        F.when(tried, _facet(DOMAIN, s1=F.col("domain"), s2=F.coalesce(F.col("mx"), F.lit(NO_MX)))),
        F.when(tried, _facet(SOURCE, s1=F.coalesce(F.col("source_ip"), F.lit(NO_SOURCE)))),
        F.when(
            replied,
            _facet(
                REPLY,
                s1=F.coalesce(F.col("text"), F.lit("")),
                s2=F.coalesce(F.col("code").cast("string"), F.lit("")),
                s3=F.coalesce(F.col("enhanced"), F.lit("")),
                s4=category,
            ),
        ),
    )
    weight = F.when(kind == "accepted", F.col("recipients")).otherwise(1)
    exploded = events.select(
        "v", "zone", "kind", weight.alias("weight"), F.explode(rows).alias("f")
    ).where(F.col("f").isNotNull())
    # The version is counted on the hourly rows (one per event); elsewhere it would only
    # split a reply line of version 1 and 2 exports read together into two ranked rows.
    exploded = exploded.withColumn("v", F.when(F.col("f.facet") == HOURLY, F.col("v")))
    counts = exploded.groupBy(
        "v", "zone", "kind", *(F.col(f"f.{key}").alias(key) for key in FACET_KEYS[3:])
    ).agg(F.count(F.lit(1)).alias("n"), F.sum("weight").cast("long").alias("weight"))
    # Only the REPLY rows' rank is used: within their zone and category (``s4``).
    order = Window.partitionBy("facet", "zone", "s4").orderBy(F.desc("n"), "s1", "s2", "s3", "kind")
    ranked = counts.withColumn("rank", F.row_number().over(order))
    return ranked.where((F.col("facet") != REPLY) | (F.col("rank") <= TOP_REPLIES))


def _percentiles(column: str, name: str, points: tuple[float, ...]) -> list[Column]:
    values = F.percentile_approx(column, list(points), PERCENTILE_ACCURACY)
    return [
        values[i].cast("long").alias(f"{name}_p{round(p * 100)}_ms") for i, p in enumerate(points)
    ]


def delivery(events: DataFrame) -> DataFrame:
    """Per zone: delivered recipients, latency percentiles, attempts per delivered one."""
    delivered = events.where(F.col("kind") == "delivered").withColumn(
        "latency_ms", F.col("time_ms") - F.col("queued_at_ms")
    )
    return delivered.groupBy("zone").agg(
        F.count(F.lit(1)).alias("delivered"),
        *_percentiles("latency_ms", "latency", (0.5, 0.95, 0.99)),
        F.avg("attempt").alias("attempts_mean"),
        F.max("attempt").cast("long").alias("attempts_max"),
    )


def queue_age(queue: DataFrame) -> DataFrame:
    """Per zone and state, at export time: recipients waiting and how long they have.

    Grouped by the schema version ``v`` as well: the job refuses the queue export unless
    ``v`` has one value, and then the groups are the same."""
    return queue.groupBy("zone", "state", "v").agg(
        F.count(F.lit(1)).alias("recipients"),
        *_percentiles("age_ms", "age", (0.5, 0.95)),
        F.max("age_ms").alias("age_max_ms"),
    )


def queue_domains(queue: DataFrame) -> DataFrame:
    """Per zone and destination domain, at export time: recipients waiting, oldest age."""
    return queue.groupBy("zone", "domain").agg(
        F.count(F.lit(1)).alias("recipients"), F.max("age_ms").alias("age_max_ms")
    )
