"""One export run at a time per export directory, and a clear word when the data directory
is held by someone else.

Real stores on disk (``QueueStore``), the real run functions, the real ``zoneq export``
command in processes of its own, a real API for the probe.
"""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import api_running
from tests.export.conftest import Traffic, stopped_directory
from tests.export.test_export import read_export
from tests.storage.conftest import StoreFactory, async_test
from tests.support.command import zoneq
from tests.support.serve import ROOT, free_port
from zoneq.export.files import Format
from zoneq.export.lock import LOCK_FILE, exclusive
from zoneq.export.run import export_events, export_queue
from zoneq.export.sources import DirectorySource, api_unreachable
from zoneq.export.watermark import ExportError
from zoneq.storage.export import event_records

WAIT_S = 30.0  # every wait below is bounded: a broken lock fails the test, never hangs it


class SlowSource:
    """A run's source whose event stream stops at its start until told to go on: the run
    has read the watermark and holds the lock meanwhile (a slow API stream, a big store)."""

    def __init__(self, inner: DirectorySource) -> None:
        self.inner = inner
        self.started = threading.Event()
        self.go_on = threading.Event()

    def count_events(self, after: int | None) -> int | None:
        return None

    def queue(self, now_ms: int) -> Iterator[dict[str, Any]]:
        return self.inner.queue(now_ms)

    def events(self, after: int | None) -> Iterator[dict[str, Any]]:
        self.started.set()
        if not self.go_on.wait(WAIT_S):
            raise AssertionError("the slow run was never let go on")
        yield from self.inner.events(after)


@async_test
async def test_overlapping_runs_the_second_refused_then_every_event_once(
    stores: StoreFactory, tmp_path: Path
) -> None:
    """Run A starts from a snapshot and is slow; run B, from a later snapshot with more
    events, starts meanwhile (two cron exports through the API): B is refused at once, with
    the directory named, for the events and for the queue.  After A, a normal run: every
    event of the store in the export exactly once."""
    store = stores.open()
    traffic = Traffic(store)
    await traffic.day(messages=40, rounds=4)
    slow = SlowSource(DirectorySource(store))
    await traffic.day(messages=40, rounds=4)  # B would see these too
    later = DirectorySource(store)
    out = tmp_path / "out"
    results: dict[str, Any] = {}

    def run_a() -> None:
        try:
            results["A"] = export_events(slow, out, Format.JSONL)
        except BaseException as exc:  # reported by the assertion below
            results["A"] = exc

    runner = threading.Thread(target=run_a, name="export-A")
    runner.start()
    try:
        assert slow.started.wait(WAIT_S), "run A never started"
        with pytest.raises(ExportError, match=f"another export is writing to {out}"):
            export_events(later, out, Format.JSONL)
        with pytest.raises(ExportError, match=f"another export is writing to {out}"):
            export_queue(later, out, Format.JSONL, now_ms=traffic.now)
    finally:
        slow.go_on.set()
        runner.join(WAIT_S)
        later.close()
        slow.inner.close()
    assert not runner.is_alive()
    first = results["A"]
    assert not isinstance(first, BaseException), repr(first)
    assert not (out / "queue").exists()  # B's queue export wrote nothing
    await traffic.day(messages=20, rounds=2)
    final = DirectorySource(store)
    try:
        last = export_events(final, out, Format.JSONL)
    finally:
        final.close()
    expected = [record["id"] for record in event_records(store)]
    counts = collections.Counter(row["id"] for row in read_export(out))
    assert first.events + last.events == len(expected) == sum(counts.values())
    assert sorted(counts) == sorted(expected)
    assert max(counts.values()) == 1


def test_the_lock_is_per_thread_reentrant_and_a_dot_file(tmp_path: Path) -> None:
    """The command holds the directory and the run functions take it again in the same
    thread; another thread is still refused.  The lock file is a dot-file beside
    ``events/`` and ``queue/``, where neither Spark nor the readers look."""
    out = tmp_path / "out"
    refused: list[BaseException] = []

    def other_thread() -> None:
        try:
            with exclusive(out):
                pass
        except ExportError as exc:
            refused.append(exc)

    with exclusive(out), exclusive(out):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(WAIT_S)
    assert len(refused) == 1 and str(out) in str(refused[0])
    with exclusive(out):  # released on leaving: free again
        pass
    assert [p.name for p in out.iterdir()] == [LOCK_FILE] and LOCK_FILE.startswith(".")


# A process that takes an export directory's lock through the same code and keeps it.
HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from zoneq.export.lock import exclusive
    with exclusive(Path(sys.argv[1])):
        print("held", flush=True)
        time.sleep(60)
    """
)


@pytest.mark.integration
def test_the_command_is_refused_while_another_process_holds_the_directory(
    tmp_path: Path,
) -> None:
    """``zoneq export`` into a directory another process is exporting to ends at once, non-
    zero, naming the directory; once the holder dies (SIGKILL: the kernel releases a flock
    with its process), the next run exports everything."""

    stopped_directory(tmp_path / "queue")
    out = tmp_path / "export"
    argv = ("export", str(out), "--data-dir", str(tmp_path / "queue"), "--format", "jsonl")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        refused = zoneq(*argv)
        assert refused.returncode == 1
        assert f"zoneq export: another export is writing to {out}" in refused.stderr
        assert "Traceback" not in refused.stderr
        assert not (out / "events").exists()  # it wrote nothing
    finally:
        holder.kill()
        holder.wait(WAIT_S)
    done = zoneq(*argv)
    assert done.returncode == 0, done.stderr
    assert "events:" in done.stdout and "queue:" in done.stdout
    assert len(read_export(out)) > 0


@pytest.mark.integration
def test_a_data_directory_held_while_no_api_answers_is_named_as_held(
    stores: StoreFactory, tmp_path: Path
) -> None:
    """LevelDB's lock held by another process and no zoneq API listening (a stopped zoneq's
    directory being read by another export): the error says the directory is held, by
    zoneq or another export, and only then that the API did not answer."""
    stores.open()  # holds the LevelDB lock, as another `zoneq export` would
    port = free_port()
    config = tmp_path / "zones.toml"
    config.write_text(f'[api]\nlisten = "127.0.0.1:{port}"\n[zones.default]\n[zones.bounces]\n')
    out = tmp_path / "export"
    done = zoneq("export", str(out), "--config", str(config), "--data-dir", str(stores.path))
    assert done.returncode == 1
    assert done.stderr.startswith(
        f"zoneq export: the data directory {stores.path} is held by another process "
        "(a running zoneq, or another zoneq export reading it), and no zoneq API answers "
        f"(http://127.0.0.1:{port}/health: "
    ), done.stderr
    assert "Traceback" not in done.stderr
    assert not (out / "events").exists()


@async_test
async def test_the_probe_tells_an_api_from_nothing(stores: StoreFactory) -> None:
    async with api_running(stores.open()) as api:
        listen = api.base.removeprefix("http://")
        assert await asyncio.to_thread(api_unreachable, listen) is None
    port = free_port()
    reason = await asyncio.to_thread(api_unreachable, f"127.0.0.1:{port}")
    assert reason is not None and reason.startswith(f"http://127.0.0.1:{port}/health: ")
