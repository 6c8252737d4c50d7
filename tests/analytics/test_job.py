"""The analytics job on a real local Spark session over exports of real events.

Two "nodes" (two QueueStores on disk, driven through their lifecycle) are exported with
``zoneq export``'s own code; the job reads both together, and every figure of every table
is checked against ``reference.py``, a plain-Python computation from the same records.
One Spark session serves the whole module (it takes seconds to start).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pyarrow.csv
import pyarrow.parquet as pq
import pytest

from tests.analytics import reference
from tests.export.conftest import ZONES, Traffic
from tests.support.testbed import missing
from zoneq.analytics import classcache, job, session
from zoneq.analytics.errors import AnalyticsError
from zoneq.export.files import Format, write_rows
from zoneq.export.run import export_events, export_queue
from zoneq.export.sources import DirectorySource
from zoneq.protocol.columns import EVENT_COLUMNS
from zoneq.storage.export import event_records, queue_records
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NOW = 1_700_300_000_000  # the queue export's clock: after every generated event


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        missing("java (PySpark needs Java 17+)")
    spark = session.start("local[2]")
    try:
        yield spark
    finally:
        spark.stop()


class Exports:
    """Two nodes' exports in both formats, and the records they were made from."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.events: list[dict[str, Any]] = []
        self.queue: list[dict[str, Any]] = []
        self.dirs: dict[Format, list[str]] = {fmt: [] for fmt in Format}

    async def node(self, name: str, seed: int) -> None:
        store = QueueStore.open(self.root / name / "queue")
        store.recover()
        traffic = Traffic(store)
        traffic.rng.seed(seed)
        await traffic.day(messages=90, rounds=9)
        self.events.extend(event_records(store))
        self.queue.extend(queue_records(store, now_ms=NOW))
        source = DirectorySource(store)
        try:
            for fmt in Format:
                out = self.root / name / f"export-{fmt.value}"
                export_events(source, out, fmt, batch=64)
                export_queue(source, out, fmt, now_ms=NOW)
                self.dirs[fmt].append(str(out))
        finally:
            source.close()
        await store.close()


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Exports:
    made = Exports(tmp_path_factory.mktemp("nodes"))

    async def build() -> None:
        await made.node("node1", 1)
        await made.node("node2", 2)

    asyncio.run(build())
    return made


@pytest.fixture(scope="module")
def parquet_report(
    spark: Any, exports: Exports, tmp_path_factory: pytest.TempPathFactory
) -> job.Report:
    out = tmp_path_factory.mktemp("report")
    # one input as a file:// URI, one as a plain path: both forms are accepted
    sources = [Path(exports.dirs[Format.PARQUET][0]).as_uri(), exports.dirs[Format.PARQUET][1]]
    return job.build_report(spark, sources, out)


def _same(actual: list[dict[str, Any]], expected: list[dict[str, Any]], table: str) -> None:
    assert len(actual) == len(expected), table
    for got, want in zip(actual, expected, strict=True):
        assert set(got) == set(want), table
        for key, value in want.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=1e-12), (table, key, want)
            else:
                assert got[key] == value, (table, key, want)


def test_every_figure_matches_a_plain_python_computation(
    parquet_report: job.Report, exports: Exports
) -> None:
    expected = reference.all_tables(exports.events, exports.queue)
    assert set(parquet_report.tables) == set(expected)
    for name, rows in expected.items():
        assert rows, f"the generated traffic leaves table {name} empty: it tests nothing"
        _same(parquet_report.tables[name], rows, name)
    assert parquet_report.events == len(exports.events)
    assert parquet_report.queued == len(exports.queue)
    # both nodes' zones are there, and the traffic had every outcome the tables split by
    assert {r["zone"] for r in parquet_report.tables["zones"]} == set(ZONES)
    kinds = {e["kind"] for e in exports.events}
    assert {"accepted", "delivered", "deferred", "bounced", "expired", "dropped"} <= kinds


def test_tables_are_written_as_parquet_and_csv(parquet_report: job.Report) -> None:
    out = parquet_report.html.parent
    for name, rows in parquet_report.tables.items():
        assert pq.read_table(out / "parquet" / f"{name}.parquet").to_pylist() == rows
        csv = pyarrow.csv.read_csv(out / "csv" / f"{name}.csv")
        assert csv.num_rows == len(rows) and csv.column_names == list(rows[0])


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.zones: list[str] = []
        self.charts: dict[str, bytes] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "section" and values.get("data-zone") is not None:
            self.zones.append(str(values["data-zone"]))
        if tag == "img":
            src = str(values["src"])
            assert src.startswith("data:image/png;base64,"), "charts are embedded"
            self.charts[str(values["data-chart"])] = base64.b64decode(src.split(",", 1)[1])


def test_html_report_holds_each_zone_and_chart(parquet_report: job.Report) -> None:
    page = _Page()
    page.feed(parquet_report.html.read_text(encoding="utf-8"))
    page.close()
    assert sorted(page.zones) == sorted(ZONES)
    expected = {"outcomes", "categories", "latency", "queue-age"}
    expected |= {f"hourly:{zone}" for zone in ZONES} | {f"domains:{zone}" for zone in ZONES}
    assert set(page.charts) == expected
    for png in page.charts.values():
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    assert 'src="http' not in parquet_report.html.read_text()  # self-contained


@pytest.mark.parametrize("on_driver", [True, False], ids=["pyarrow", "spark-reader"])
def test_json_lines_exports_give_the_same_tables(
    spark: Any, exports: Exports, parquet_report: job.Report, tmp_path: Path, on_driver: bool
) -> None:
    """Both ways of reading JSON lines: converted by pyarrow on the driver (local runs)
    and Spark's own reader (what a cluster runs)."""
    report = job.build_report(
        spark, exports.dirs[Format.JSONL], tmp_path / "out", json_on_driver=on_driver
    )
    assert report.tables == parquet_report.tables
    assert report.events == parquet_report.events and report.queued == parquet_report.queued


def _copy_with_version(source: str, target: Path, version: int) -> Path:
    """A copy of a JSON lines export with every event row of schema ``version``; version 1
    rows lose the ``category`` field, as an older zoneq wrote them."""
    shutil.copytree(source, target)
    for path in (target / "events").rglob("part-*.jsonl"):
        rows = [json.loads(line) | {"v": version} for line in path.read_text().splitlines()]
        if version == 1:
            rows = [{k: v for k, v in row.items() if k != "category"} for row in rows]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return target


def _as_parquet(jsonl_export: Path, target: Path) -> Path:
    """The same export in Parquet files with version 1's columns: no ``category`` column
    at all, as an older zoneq wrote them."""
    v1_columns = [column for column in EVENT_COLUMNS if column[0] != "category"]
    for path in (jsonl_export / "events").rglob("part-*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        part = target / path.relative_to(jsonl_export).with_suffix(".parquet")
        write_rows(part, rows, v1_columns, Format.PARQUET)
        assert "category" not in pq.read_schema(part).names
    return target


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "jsonl-spark-reader"])
def test_a_version_1_export_still_reports_with_outcomes_as_categories(
    spark: Any, exports: Exports, tmp_path: Path, fmt: str
) -> None:
    """Exports written before categories: every figure as before, and each failure filed
    under its outcome, as the plain-Python reference does for events without a category."""
    old = _copy_with_version(exports.dirs[Format.JSONL][0], tmp_path / "v1", 1)
    rows = [json.loads(line) for p in (old / "events").rglob("*.jsonl") for line in p.open()]
    assert rows and all("category" not in row for row in rows)
    source = _as_parquet(old, tmp_path / "v1-parquet") if fmt == "parquet" else old
    report = job.build_report(spark, [str(source)], tmp_path / "out", json_on_driver=fmt == "jsonl")
    assert report.events == len(rows)
    for name in ("zones", "replies", "categories"):
        _same(report.tables[name], reference.all_tables(rows, [])[name], name)
    kinds = {r["category"] for r in report.tables["categories"]}
    assert kinds <= set(reference.REPLY_KINDS) and {"deferred", "bounced"} <= kinds


def test_the_replies_rank_within_each_category(parquet_report: job.Report) -> None:
    """The categories the core gave (schema version 2): the shipped rule's name for the
    block list reply, the RFC 3463 classes for the rest; ranks count from 1 in each."""
    replies = parquet_report.tables["replies"]
    listed = [r for r in replies if "spamhaus" in r["text"]]
    assert listed and {r["category"] for r in listed} == {"blocklisted"}
    assert {r["category"] for r in replies if r["enhanced"] == "5.1.1"} == {"addressing"}
    groups: dict[tuple[str, str], list[int]] = {}
    for row in replies:
        groups.setdefault((row["zone"], row["category"]), []).append(row["rank"])
    assert all(ranks == list(range(1, len(ranks) + 1)) for ranks in groups.values())
    # one category holds both outcomes of a text (a deferral, and its expiry at the end)
    assert any(len({r["outcome"] for r in replies if (r["zone"], r["category"]) == g}) > 1
               for g in groups)  # fmt: skip


@pytest.mark.parametrize("on_driver", [True, False], ids=["pyarrow", "spark-reader"])
def test_another_schema_version_is_refused_clearly(
    spark: Any, exports: Exports, tmp_path: Path, on_driver: bool
) -> None:
    newer = _copy_with_version(exports.dirs[Format.JSONL][0], tmp_path / "v3", 3)
    with pytest.raises(
        AnalyticsError, match=r"schema version 3; this zoneq reads versions 1 and 2 only"
    ):
        job.build_report(spark, [str(newer)], tmp_path / "out", json_on_driver=on_driver)
    assert not (tmp_path / "out").exists()  # nothing written from a refused export


@pytest.mark.parametrize(
    ("on_driver", "message"),
    [
        (True, r"^/.*part-[^/]*\.jsonl: line \d+: not a JSON lines export record: "),
        # the file Spark was reading and the parser's message, not Spark's outer wrapper
        (False, r"^Spark: reading file:/.*/part-[^/]*\.jsonl: .*JsonParseException: "),
    ],
    ids=["pyarrow", "spark-reader"],
)
def test_a_damaged_file_is_one_clear_error(
    spark: Any, exports: Exports, tmp_path: Path, on_driver: bool, message: str
) -> None:
    damaged = _copy_with_version(exports.dirs[Format.JSONL][0], tmp_path / "bad", 1)
    part = next((damaged / "events").rglob("part-*.jsonl"))
    part.write_text(part.read_text() + "{not json\n")
    with pytest.raises(AnalyticsError, match=message) as caught:
        job.build_report(spark, [str(damaged)], tmp_path / "out", json_on_driver=on_driver)
    assert "\n" not in str(caught.value) and "\tat " not in str(caught.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", [("zone", "null"), ("time_ms", "missing")], ids="-".join)
@pytest.mark.parametrize("on_driver", [True, False], ids=["pyarrow", "spark-reader"])
def test_an_event_without_a_key_column_is_refused_naming_it(
    spark: Any, exports: Exports, tmp_path: Path, on_driver: bool, damage: tuple[str, str]
) -> None:
    """Such a row used to reach the report's charts and end in a Python traceback."""
    column, how = damage
    where = (
        r"^/.*/part-[^/]*\.jsonl: line \d+: not a JSON lines export record: "
        if on_driver
        else r"^file:/.*/part-[^/]*\.jsonl: "
    )
    damaged = tmp_path / "damaged"
    shutil.copytree(exports.dirs[Format.JSONL][0], damaged)
    part = max((damaged / "events").rglob("part-*.jsonl"))
    rows = [json.loads(line) for line in part.read_text().splitlines()]
    rows[-1] = {k: v for k, v in rows[-1].items() if k != column}
    if how == "null":
        rows[-1][column] = None
    part.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(AnalyticsError, match=where + f"{column} is null or missing"):
        job.build_report(spark, [str(damaged)], tmp_path / "out", json_on_driver=on_driver)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("on_driver", [True, False], ids=["pyarrow", "spark-reader"])
def test_an_idle_nodes_export_adds_no_events_to_the_report(
    spark: Any, exports: Exports, tmp_path: Path, on_driver: bool
) -> None:
    """An older zoneq's export of a node's queue alone (no events/ directory) is a node
    with no events, not an input that sinks the report over every node."""
    busy, other = (Path(d) for d in exports.dirs[Format.JSONL])
    idle = tmp_path / "idle"
    shutil.copytree(other / "queue", idle / "queue")
    report = job.build_report(
        spark, [str(busy), str(idle)], tmp_path / "out", json_on_driver=on_driver
    )
    busy_events = sum(
        len(part.read_text().splitlines()) for part in (busy / "events").rglob("part-*.jsonl")
    )
    assert report.events == busy_events > 0
    assert report.queued == len(exports.queue) > 0  # both nodes' queues


# --- the command and the spark-submit script ------------------------------------------------


def run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False, env=env
    )


def test_command_refuses_a_missing_path(tmp_path: Path) -> None:
    done = run(
        [
            sys.executable,
            "-m",
            "zoneq",
            "analytics",
            str(tmp_path / "nope"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert done.returncode == 1
    assert "no such export directory" in done.stderr
    assert "Traceback" not in done.stderr and "Exception" not in done.stderr


def test_command_says_when_there_is_no_java(exports: Exports, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(tmp_path)  # a PATH without java (the interpreter is given by path)
    done = run(
        [
            sys.executable,
            "-m",
            "zoneq",
            "analytics",
            exports.dirs[Format.PARQUET][0],
            "--out",
            str(tmp_path / "out"),
        ],
        env=env,
    )
    assert done.returncode == 1
    assert "no Java found" in done.stderr and "Java 17" in done.stderr
    assert "Traceback" not in done.stderr


def test_spark_submit_runs_the_same_job(exports: Exports, tmp_path: Path) -> None:
    """tools/analytics/zoneq_report.py under PySpark's own spark-submit, on loopback."""
    import pyspark

    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    if not submit.exists():
        missing(f"spark-submit (not in {submit.parent})")
    out = tmp_path / "out"
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    done = run(
        [
            str(submit),
            "--master",
            "local[1]",
            "--conf",
            "spark.driver.host=127.0.0.1",
            "--conf",
            "spark.driver.bindAddress=127.0.0.1",
            "--conf",
            "spark.ui.enabled=false",
            str(ROOT / "tools" / "analytics" / "zoneq_report.py"),
            *exports.dirs[Format.PARQUET],
            "--out",
            str(out),
        ],
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "report.html").is_file()
    assert pq.read_table(out / "parquet" / "zones.parquet").num_rows == len(ZONES)


def test_the_class_cache_is_recorded_then_used(exports: Exports, tmp_path: Path) -> None:
    """The first local run records the JVM's class-data archive and waits for it to be
    written; the next maps it (not recorded again) and gives the same report."""
    cache = tmp_path / "cache"
    command = [sys.executable, "-m", "zoneq", "analytics", *exports.dirs[Format.PARQUET]]
    first = run([*command, "--out", str(tmp_path / "one"), "--class-cache", str(cache)])
    assert first.returncode == 0, first.stderr[-3000:]
    [archive] = cache.glob("spark-classes-*.jsa")
    assert classcache.usable(archive)
    written = archive.stat().st_mtime_ns
    second = run([*command, "--out", str(tmp_path / "two"), "--class-cache", str(cache)])
    assert second.returncode == 0, second.stderr[-3000:]
    assert archive.stat().st_mtime_ns == written
    for name in ("zones", "hourly", "domains", "replies", "queue_age"):
        one = pq.read_table(tmp_path / "one" / "parquet" / f"{name}.parquet")
        assert pq.read_table(tmp_path / "two" / "parquet" / f"{name}.parquet").equals(one)
    assert "cds" not in first.stderr + second.stderr  # the JDK's CDS notes are silenced
