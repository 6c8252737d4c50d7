"""The event log's faults and limits: a corrupt event record, retention under load, a purge's
events, and part files made durable.

Every store here is a real QueueStore on disk; the commands are the real ``zoneq export``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import TOKEN, api_running, make_config
from tests.export.conftest import Traffic
from tests.storage.conftest import StoreFactory, async_test, queue_message
from zoneq import runtime
from zoneq.export.command import corrupt_summary
from zoneq.export.files import Format, write_rows
from zoneq.export.run import export_events
from zoneq.export.sources import ApiSource, DirectorySource
from zoneq.protocol.columns import EVENT_COLUMNS
from zoneq.protocol.events import Event, EventKind
from zoneq.protocol.ids import format_id
from zoneq.storage import keys
from zoneq.storage.export import event_records, is_corrupt
from zoneq.storage.store import QueueStore

ROOT = Path(__file__).resolve().parents[2]
GARBAGE = b"\xc1garbage"  # 0xc1 is the one byte msgpack never uses: FormatError


def _rows(out: Path) -> list[str]:
    return [
        line
        for path in sorted((out / "events").rglob("part-*.jsonl"))
        for line in path.read_text().splitlines()
    ]


async def _corrupt_store(path: Path) -> tuple[int, bytes]:
    """A store after some traffic, one event in the middle overwritten; (events, its key)."""
    store = QueueStore.open(path)
    store.recover()
    await Traffic(store).day(messages=12, rounds=3)
    event_keys = list(store.database.keys(prefix=keys.EVENT))
    bad = event_keys[len(event_keys) // 2]
    store.database.write([(bad, GARBAGE)], sync=True)
    await store.close()
    return len(event_keys), bad


# --- 1: a corrupt event record ----------------------------------------------------------------


@pytest.mark.integration
def test_a_corrupt_event_is_skipped_named_and_passed_for_good(tmp_path: Path) -> None:
    total, bad = asyncio.run(_corrupt_store(tmp_path / "queue"))
    out = tmp_path / "export"
    argv = [
        sys.executable,
        "-m",
        "zoneq",
        "export",
        str(out),
        "--data-dir",
        str(tmp_path / "queue"),
    ]
    argv += ["--format", "jsonl", "--only", "events"]
    first = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert first.returncode == 0, first.stderr
    assert f"events: {total - 1} exported" in first.stdout
    assert f"1 corrupt event record(s) skipped: keys {bad.hex()}" in first.stdout
    assert bad.hex() in first.stderr  # logged as an error, with its key
    assert len(_rows(out)) == total - 1
    second = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert second.returncode == 0, second.stderr
    assert "events: 0 exported" in second.stdout
    assert "skipped" not in second.stdout  # the watermark moved past it
    assert len(_rows(out)) == total - 1


@async_test
async def test_the_api_stream_carries_a_skip_marker_and_goes_on(
    stores: StoreFactory, tmp_path: Path
) -> None:
    store = stores.open()
    await Traffic(store).day(messages=12, rounds=3)
    event_keys = list(store.database.keys(prefix=keys.EVENT))
    bad = event_keys[3]
    store.database.write([(bad, GARBAGE)], sync=True)
    records = list(event_records(store))
    markers = [r for r in records if is_corrupt(r)]
    assert markers == [
        {
            "id": format_id(keys.decode_event(bad)),
            "corrupt": markers[0]["corrupt"],
            "key": bad.hex(),
        }
    ]
    assert "FormatError" in markers[0]["corrupt"]
    assert [r["id"] for r in records] == [format_id(keys.decode_event(k)) for k in event_keys]
    async with api_running(store) as api:
        source = ApiSource(api.base.removeprefix("http://"), TOKEN)
        done = await asyncio.to_thread(export_events, source, tmp_path / "out", Format.JSONL)
    assert (done.events, done.corrupt) == (len(event_keys) - 1, (bad.hex(),))
    assert done.after == keys.decode_event(event_keys[-1])
    assert len(_rows(tmp_path / "out")) == len(event_keys) - 1


@async_test
async def test_a_corrupt_last_event_still_moves_the_watermark(
    stores: StoreFactory, tmp_path: Path
) -> None:
    store = stores.open()
    await Traffic(store).send(3)
    await store.drain()
    last = list(store.database.keys(prefix=keys.EVENT))[-1]
    store.database.write([(last, GARBAGE)], sync=True)
    source = DirectorySource(store)
    try:
        done = export_events(source, tmp_path, Format.JSONL)
        again = export_events(source, tmp_path, Format.JSONL)
    finally:
        source.close()
    assert done.after == keys.decode_event(last) and done.corrupt == (last.hex(),)
    assert (again.events, again.corrupt) == (0, ())


TWELVE = " ".join(f"k{i}" for i in range(10)) + " (and 2 more)"


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (1, "1 corrupt event record(s) skipped: keys k0"),
        (3, "3 corrupt event record(s) skipped: keys k0 k1 k2"),
        (12, "12 corrupt event record(s) skipped: keys " + TWELVE),
    ],
)
def test_the_summary_names_the_first_keys(count: int, expected: str) -> None:
    assert corrupt_summary([f"k{i}" for i in range(count)]) == expected


# --- 2: retention keeps up ----------------------------------------------------------------------


@async_test
async def test_one_maintenance_round_trims_every_expired_event(stores: StoreFactory) -> None:
    """120,000 events past retention and 50 inside it: one ``maintain()`` leaves the 50."""
    store = stores.open()
    now = time.time_ns() // 1_000_000
    old = now - 40 * 86_400_000  # retention is 30 days by default
    for start in range(0, 120_000, 20_000):
        ops = [store._event_op(_event(old + i)) for i in range(start, start + 20_000)]
        await store._writer.submit(ops, sync=False)
    await store._writer.submit([store._event_op(_event(now + i)) for i in range(50)], sync=False)
    await store.drain()
    config = make_config()
    assert config.storage.event_retention_ms == 30 * 86_400_000
    begun = time.monotonic()
    await runtime.maintain(store, config)
    took = time.monotonic() - begun
    left = [event.time_ms for _, event in store.events()]
    assert left == [now + i for i in range(50)]
    print(f"trimmed 120,000 events in {took:.2f} s")


@async_test
async def test_trimming_in_batches_resumes_after_the_last_key(stores: StoreFactory) -> None:
    store = stores.open()
    ops = [store._event_op(_event(1_000 + i)) for i in range(25)]
    await store._writer.submit(ops, sync=False)
    assert await store.trim_expired_events(1_010, batch=4) == 10
    assert await store.trim_expired_events(2_000, batch=5) == 15  # exactly 3 full batches
    assert list(store.events()) == []


def _event(time_ms: int) -> Event:
    return Event(EventKind.DELIVERED, time_ms, "bulk", format_id(1), "a@b.test", "b.test", 0)


# --- 6: a purge's DROPPED events carry the message size -----------------------------------------


@async_test
async def test_a_purge_records_each_messages_size(stores: StoreFactory) -> None:
    store = stores.open()
    small = await queue_message(store, [("a@x.test", "bulk")], body=(b"Subject: s\r\n\r\nhi\r\n",))
    big = await queue_message(
        store,
        [("b@x.test", "bulk"), ("c@y.test", "bulk")],
        body=(b"Subject: b\r\n\r\n", b"x" * 5000),
    )
    sizes = {small: store.message(small).size, big: store.message(big).size}
    assert sizes[small] < sizes[big]
    async with api_running(store) as api:
        status, body = await api.call("POST", "/api/v1/queue/purge", json={"zone": "bulk"})
    assert (status, body) == (200, {"count": 3})
    dropped = [e for _, e in store.events() if e.kind is EventKind.DROPPED]
    assert sorted((e.recipient, e.size) for e in dropped) == [
        ("a@x.test", sizes[small]),
        ("b@x.test", sizes[big]),
        ("c@y.test", sizes[big]),
    ]


# --- 4: part files are durable before the watermark moves ---------------------------------------


@pytest.mark.parametrize("fmt", list(Format))
def test_part_files_and_their_directories_are_fsynced(
    tmp_path: Path, fmt: Format, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power loss cannot be simulated here: record what is fsynced, by inode."""
    synced: list[tuple[int, int]] = []
    real = os.fsync

    def recording(fd: int) -> None:
        info = os.fstat(fd)
        synced.append((info.st_dev, info.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    path = tmp_path / "events" / "day=2023-11-14" / "zone=bulk" / f"part-0-0{fmt.suffix}"
    row: dict[str, Any] = {name: None for name, _, _ in EVENT_COLUMNS}
    row.update(v=2, id=format_id(1), kind="delivered", time_ms=1, zone="bulk", message_id="m")
    row.update(recipient="a@b", domain="b", queued_at_ms=0, size=1, attempt=0, recipients=1)
    row.update(possible_duplicate=False)
    assert write_rows(path, [row], EVENT_COLUMNS, fmt) == 1

    def inode(p: Path) -> tuple[int, int]:
        info = p.stat()
        return info.st_dev, info.st_ino

    assert inode(path) in synced  # the data, under its final name's inode
    for directory in (path.parent, path.parent.parent, tmp_path / "events", tmp_path):
        assert inode(directory) in synced, directory  # the new names in each directory
    assert synced.index(inode(path)) < synced.index(inode(path.parent))  # data first
