"""``zoneq analytics --prepare`` with a real JVM: it records the class-data archive once,
and a later report's JVM maps that very file.

One recording (a JVM run of 15-80 s, by the machine's load) serves the module.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.analytics.test_warmup import archive_path, zoneq
from zoneq.analytics import classcache, warmup

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Recorded:
    cache: Path
    archive: Path
    said: str


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    cache = tmp_path_factory.mktemp("prepare") / "cache"
    archive = archive_path(cache)
    done = zoneq("analytics", "--prepare", "--class-cache", str(cache))
    assert done.returncode == 0, done.stderr[-3000:]
    return Recorded(cache, archive, done.stdout)


def test_prepare_records_a_usable_archive(recorded: Recorded) -> None:
    assert classcache.usable(recorded.archive)
    assert list(recorded.cache.iterdir()) == [recorded.archive]  # nothing else left behind
    assert recorded.archive.stat().st_size > 10_000_000  # thousands of Spark's classes
    assert "recorded in" in recorded.said and str(recorded.archive) in recorded.said


def test_a_second_prepare_keeps_the_archive(recorded: Recorded) -> None:
    written = recorded.archive.stat().st_mtime_ns
    started = time.monotonic()
    done = zoneq("analytics", "--prepare", "--class-cache", str(recorded.cache))
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"already recorded: {recorded.archive}" in done.stdout
    assert recorded.archive.stat().st_mtime_ns == written
    # no JVM: a Python start and a file read (a recording takes 15 s and more)
    assert elapsed < 10, elapsed


def descendants(pid: int) -> list[int]:
    """``pid``'s processes below it, through every thread (the job starts its JVM from a
    worker thread)."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found.extend(children)
            todo.extend(children)
    return found


def mapping_jvm(process: subprocess.Popen[str], archive: Path) -> Iterator[tuple[str, str]]:
    """(command line, memory map) of each of ``process``'s descendants that maps ``archive``."""
    for child in descendants(process.pid):
        try:
            maps = Path(f"/proc/{child}/maps").read_text()
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(archive) in maps:
            yield cmdline, maps


def test_a_report_afterwards_maps_the_prepared_archive(recorded: Recorded, tmp_path: Path) -> None:
    """The report's driver JVM has the archive mapped into its memory (``/proc/PID/maps``),
    which is what -XX:SharedArchiveFile does when the JVM accepts it; not recorded again."""
    export = warmup.write_export(tmp_path / "export")
    written = recorded.archive.stat().st_mtime_ns
    command = [sys.executable, "-m", "zoneq", "analytics", str(export)]
    command += ["--out", str(tmp_path / "report"), "--class-cache", str(recorded.cache)]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while process.poll() is None and not seen and time.monotonic() < deadline:
            seen = [cmdline for cmdline, _ in mapping_jvm(process, recorded.archive)]
            time.sleep(0.05)
        stdout, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr[-3000:]
    assert seen, "no JVM of the report mapped the archive"
    assert f"-XX:SharedArchiveFile={recorded.archive}" in seen[0]
    assert "ArchiveClassesAtExit" not in seen[0]
    assert recorded.archive.stat().st_mtime_ns == written
    assert f"{warmup.EVENT_ROWS} events" in stdout
