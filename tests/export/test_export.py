"""zoneq export: snapshot readers, part files, the watermark, and the command.

The events come from a real QueueStore on disk driven through its lifecycle (``conftest``);
the files are read back with pyarrow and json, independently of the writer.
"""

from __future__ import annotations

import asyncio
import json
import smtplib
import subprocess
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.export.conftest import ZONES, Traffic, stopped_directory
from tests.storage.conftest import StoreFactory, async_test
from tests.support.bed import ok_test_bed
from tests.support.command import zoneq
from tests.support.serve import running_serve, smtp_port
from zoneq.export import watermark
from zoneq.export.files import Format, escape_path_name, part_name, utc_day, write_rows
from zoneq.export.run import export_events, export_queue
from zoneq.export.sources import DirectorySource
from zoneq.export.watermark import ExportError
from zoneq.protocol.columns import EVENT_COLUMNS, QUEUE_COLUMNS
from zoneq.protocol.events import EVENT_FIELDS, EventKind
from zoneq.protocol.ids import format_id, parse_id
from zoneq.storage.export import QUEUE_FIELDS, event_records, queue_records
from zoneq.storage.store import QueueStore

EVENT_NAMES = [name for name, _, _ in EVENT_COLUMNS]

# --- pure parts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("zone", "directory"),
    [
        ("bulk", "bulk"),
        ("eu west/2=a", "eu west%2F2%3Da"),
        ("50%", "50%25"),
        ("zöne", "zöne"),
        ("a:b?c#d", "a%3Ab%3Fc%23d"),
        ("tab\there", "tab%09here"),
        ("", "__HIVE_DEFAULT_PARTITION__"),
    ],
)
def test_partition_names_escape_like_hive(zone: str, directory: str) -> None:
    assert escape_path_name(zone) == directory


@given(st.text(min_size=1))
def test_partition_names_are_one_safe_path_element_and_reversible(zone: str) -> None:
    name = escape_path_name(zone)
    # one path element ("zone=" + name, so never "." or ".."), without NUL
    assert "/" not in name and "\x00" not in name
    assert unquote(name) == zone  # what Hive and Spark's unescapePathName give back


@pytest.mark.parametrize(
    ("time_ms", "day"),
    [(0, "1970-01-01"), (1_700_000_000_000, "2023-11-14"), (1_700_006_399_999, "2023-11-14")],
)
def test_days_are_utc(time_ms: int, day: str) -> None:
    assert utc_day(time_ms) == day


def test_export_columns_are_the_event_fields() -> None:
    assert set(EVENT_NAMES) == {"v", "id", *EVENT_FIELDS}
    assert [name for name, _, _ in QUEUE_COLUMNS][2:] == list(QUEUE_FIELDS)


# --- readers over a real store --------------------------------------------------------------


@async_test
async def test_event_records_are_every_event_in_id_order(stores: StoreFactory) -> None:
    store = stores.open()
    await Traffic(store).day(messages=40, rounds=4)
    records = list(event_records(store))
    ids = [parse_id(r["id"]) for r in records]
    assert ids == sorted(set(ids))
    assert len(records) == sum(1 for _ in store.events())
    kinds = {r["kind"] for r in records}
    assert {"accepted", "delivered", "deferred", "bounced", "dropped"} <= kinds
    for record in records:
        assert set(record) == set(EVENT_NAMES)
        if record["kind"] != EventKind.ACCEPTED:
            assert record["size"] > 0, record  # the outcome events carry the message size
            assert record["attempt"] >= 1 or record["kind"] == EventKind.DROPPED
    outcome = next(r for r in records if r["kind"] == "delivered")
    assert outcome["code"] == 250 and outcome["mx"] and outcome["queued_at_ms"] > 0
    # after / limit page through the same sequence
    middle = ids[len(ids) // 2]
    assert [r["id"] for r in event_records(store, after=middle)] == [
        format_id(i) for i in ids if i > middle
    ]
    assert [r["id"] for r in event_records(store, limit=5)] == [format_id(i) for i in ids[:5]]


@async_test
async def test_queue_records_show_each_queued_recipient(stores: StoreFactory) -> None:
    store = stores.open()
    traffic = Traffic(store)
    await traffic.day(messages=30, rounds=3)
    leased = store.lease("bulk", 1, "someone")
    now = traffic.now + 1000
    rows = list(queue_records(store, now_ms=now))
    expected = {
        (q.recipient.zone, format_id(q.recipient.msg_id), q.recipient.address): q
        for msg_id in traffic.messages
        for q in _queued(store, msg_id)
    }
    assert len(rows) == len(expected) > 0
    for row in rows:
        assert set(row) == set(QUEUE_FIELDS)
        assert row["age_ms"] == now - row["queued_at_ms"]
        matching = [q for key, q in expected.items() if key[:2] == (row["zone"], row["message_id"])]
        assert row["state"] in {q.state.value for q in matching}
    assert [r["state"] for r in rows].count("leased") == len(leased)


def _queued(store: QueueStore, msg_id: int) -> list[Any]:
    try:
        return store.recipients(msg_id)
    except Exception:  # the message is gone
        return []


# --- files -----------------------------------------------------------------------------------


def read_export(out: Path) -> list[dict[str, Any]]:
    """Every event row in an export directory, read without zoneq's writer."""
    rows: list[dict[str, Any]] = []
    for path in sorted((out / "events").rglob("part-*")):
        if path.suffix == ".parquet":
            part = pq.read_table(path).to_pylist()
        else:
            part = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        day, zone = path.parent.parent.name, path.parent.name
        for row in part:  # each row sits in its own day and zone's directory
            assert day == f"day={utc_day(row['time_ms'])}"
            assert zone == f"zone={escape_path_name(row['zone'])}"
        rows.extend(part)
    return rows


@pytest.mark.parametrize("fmt", list(Format))
@async_test
async def test_export_writes_every_event_once_partitioned(
    stores: StoreFactory, tmp_path: Path, fmt: Format
) -> None:
    store = stores.open()
    await Traffic(store).day(messages=40, rounds=4)
    expected = list(event_records(store))
    source = DirectorySource(store)
    try:
        done = export_events(source, tmp_path / "out", fmt, batch=50)
        queued = export_queue(source, tmp_path / "out", fmt, now_ms=2_000_000_000_000)
    finally:
        source.close()
    rows = read_export(tmp_path / "out")
    assert sorted(rows, key=lambda r: r["id"]) == expected
    assert done.events == len(expected) and done.after == parse_id(expected[-1]["id"])
    assert {r["zone"] for r in rows} == set(ZONES)
    mark = watermark.load(tmp_path / "out")
    assert mark is not None and mark.after == done.after and mark.events == len(expected)
    queue_file = tmp_path / "out" / "queue" / f"current{fmt.suffix}"
    assert queue_file.is_file() and queued == len(list(queue_records(store, now_ms=0))) > 0


@async_test
async def test_incremental_exports_while_delivering_lose_and_double_nothing(
    stores: StoreFactory, tmp_path: Path
) -> None:
    """Two exports from snapshots of a store that is delivering at the same time (as the
    running core serves them): together they hold every event exactly once."""
    store = stores.open()
    traffic = Traffic(store)
    await traffic.day(messages=30, rounds=3)
    out = tmp_path / "out"
    exported_during: list[int] = []

    async def export_while_delivering() -> None:
        finished = threading.Event()

        def export() -> None:
            source = DirectorySource(store)
            try:
                export_events(source, out, Format.PARQUET, batch=7)
            finally:
                source.close()
                finished.set()

        worker = asyncio.create_task(asyncio.to_thread(export))
        before = sum(1 for _ in store.events())
        while not finished.is_set():  # bounded: the export of a few hundred events ends
            await traffic.send(3)
            await traffic.deliver()
        await worker
        exported_during.append(sum(1 for _ in store.events()) - before)

    await export_while_delivering()
    await traffic.day(messages=10, rounds=2)  # more between the two exports
    await export_while_delivering()
    assert all(n > 0 for n in exported_during), "no event was written during an export"
    rows = read_export(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an event was exported twice"
    mark = watermark.load(out)
    assert mark is not None and mark.after is not None
    in_store = [r["id"] for r in event_records(store) if parse_id(r["id"]) <= mark.after]
    assert sorted(ids) == in_store, "an event up to the watermark is missing"
    # and the next export picks up exactly the rest
    source = DirectorySource(store)
    try:
        export_events(source, out, Format.PARQUET)
    finally:
        source.close()
    assert sorted(r["id"] for r in read_export(out)) == [r["id"] for r in event_records(store)]


@async_test
async def test_a_run_that_dies_before_its_watermark_is_written_again_once(
    stores: StoreFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = stores.open()
    await Traffic(store).day(messages=20, rounds=2)
    out = tmp_path / "out"
    source = DirectorySource(store)
    try:
        with monkeypatch.context() as patch:

            def die(directory: Path, mark: watermark.Watermark) -> None:
                raise OSError("killed before the watermark moved")

            patch.setattr(watermark, "save", die)
            with pytest.raises(OSError, match="killed"):
                export_events(source, out, Format.JSONL, batch=10)
        assert any((out / "events").rglob("part-*"))  # the dead run's files are there
        done = export_events(source, out, Format.JSONL, batch=10)
    finally:
        source.close()
    assert done.discarded > 0
    ids = [r["id"] for r in read_export(out)]
    assert sorted(ids) == [r["id"] for r in event_records(store)]


def test_part_names_sort_by_run_then_first_event() -> None:
    names = [
        part_name(format_id(run), format_id(first), Format.PARQUET)
        for run, first in [(0, 5), (0, 70), (9, 10), (300, 301)]
    ]
    assert names == sorted(names)


@async_test
async def test_an_incremental_export_keeps_its_format(stores: StoreFactory, tmp_path: Path) -> None:
    store = stores.open()
    await Traffic(store).send(3)
    source = DirectorySource(store)
    try:
        export_events(source, tmp_path, Format.PARQUET)
        with pytest.raises(ExportError, match="holds a parquet export"):
            export_events(source, tmp_path, Format.JSONL)
    finally:
        source.close()


# --- the command -----------------------------------------------------------------------------


@pytest.mark.integration
def test_command_exports_a_stopped_zoneqs_directory(tmp_path: Path) -> None:
    stopped_directory(tmp_path / "queue")
    out = tmp_path / "export"
    first = zoneq("export", str(out), "--data-dir", str(tmp_path / "queue"), "--format", "jsonl")
    assert first.returncode == 0, first.stderr
    assert "events:" in first.stdout and "queue:" in first.stdout
    second = zoneq("export", str(out), "--data-dir", str(tmp_path / "queue"), "--format", "jsonl")
    assert second.returncode == 0, second.stderr
    assert "events: 0 exported" in second.stdout
    assert (out / "queue" / "current.jsonl").is_file()
    assert len(read_export(out)) > 0


@pytest.mark.integration
def test_command_refuses_a_missing_directory_clearly(tmp_path: Path) -> None:
    done = zoneq("export", str(tmp_path / "out"), "--data-dir", str(tmp_path / "nothing"))
    assert done.returncode == 1
    assert "no zoneq queue database at" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "nothing").exists()  # and it did not create one


@pytest.mark.integration
def test_command_exports_a_running_zoneq_through_its_api(tmp_path: Path) -> None:
    """A real ``zoneq serve`` holds the directory, so ``zoneq export`` reads the same records
    through the API; two exports with mail delivered in between hold every event once."""
    with (
        ok_test_bed(tmp_path) as (sink, config),
        running_serve(config, tmp_path / "serve.log") as serve,
    ):
        port = smtp_port(config)
        out = tmp_path / "export"

        def send(count: int) -> None:
            try:
                with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
                    for i in range(count):
                        client.sendmail(
                            "a@src.test", [f"r{i}@ok.test"], b"Subject: x\r\n\r\nhi\r\n"
                        )
            except (smtplib.SMTPException, OSError) as exc:
                raise AssertionError(f"{exc!r}; serve.log ends:\n{serve.log_tail()}") from exc

        def export() -> subprocess.CompletedProcess[str]:
            return zoneq(
                "export", str(out), "--config", str(config), "--format", "jsonl", timeout=120
            )

        def export_until_delivered(count: int) -> int:
            """Export again and again (bounded) until ``count`` deliveries are exported:
            the delivered events land a little after the sink's 250; how many runs."""
            runs = 0
            while runs < 40:
                runs += 1
                done = export()
                assert done.returncode == 0, f"{done.stderr}\nserve.log ends:\n{serve.log_tail()}"
                if [r["kind"] for r in read_export(out)].count("delivered") >= count:
                    return runs
                time.sleep(0.5)
            raise AssertionError(f"{count} deliveries never showed up in the export")

        send(5)
        assert len(sink.messages(5, timeout=60)) == 5
        export_until_delivered(5)
        send(4)  # delivered while the next exports run
        assert export_until_delivered(9) >= 1
        assert len(sink.messages(9, timeout=60)) == 9
    rows = read_export(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))
    kinds = [r["kind"] for r in rows]
    assert kinds.count("accepted") == 9 and kinds.count("delivered") == 9
    assert all(
        r["mx"] and r["source_ip"] and r["size"] > 0 and r["code"] == 250
        for r in rows
        if r["kind"] == "delivered"
    )
    assert (out / "queue" / "current.jsonl").is_file()


@pytest.mark.parametrize("fmt", list(Format))
def test_undecodable_text_is_written_not_refused(tmp_path: Path, fmt: Format) -> None:
    """A lone surrogate (bytes the receiver could not decode, kept as-is) must not stop the
    export at that event forever: Parquet gets U+FFFD, JSON lines a \\u escape."""
    row = {name: 0 for name in EVENT_NAMES} | {
        "id": format_id(1),
        "kind": "delivered",
        "zone": "z",
        "message_id": format_id(1),
        "recipient": "b\udcffd@x.test",
        "domain": "x.test",
        "possible_duplicate": False,
        "mx": None,
        "source_ip": None,
        "code": None,
        "enhanced": None,
        "text": "t\ud800",
        "category": "n\udcffetwork",
    }
    path = tmp_path / f"part{fmt.suffix}"
    assert write_rows(path, [row], EVENT_COLUMNS, fmt) == 1
    if fmt is Format.PARQUET:
        back = pq.read_table(path).to_pylist()[0]
        assert back["recipient"].startswith("b") and "\ufffd" in back["recipient"]
        assert back["category"].startswith("n\ufffd") and back["category"].endswith("etwork")
    else:
        back = json.loads(path.read_text())
        assert back["recipient"] == "b\udcffd@x.test" and back["text"] == "t\ud800"
