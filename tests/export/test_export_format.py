"""An export directory keeps one format, whichever part is exported, and is an export from
its first run on (events/ and the watermark), even before any event.

Readers take a directory to hold one format: a queue written as Parquet into a JSON lines
export is one the analytics job never reads (it reported 0 queued recipients, exit 0).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.export.conftest import Traffic, stopped_directory
from tests.storage.conftest import StoreFactory, async_test
from tests.support.command import zoneq
from zoneq.analytics import inputs
from zoneq.export import watermark
from zoneq.export.files import Format
from zoneq.export.run import export_events, export_format, export_queue
from zoneq.export.sources import DirectorySource
from zoneq.export.watermark import ExportError


@pytest.mark.integration
def test_only_queue_keeps_the_exports_format_unless_told_another(tmp_path: Path) -> None:
    data = str(stopped_directory(tmp_path / "queue"))
    out = tmp_path / "export"
    first = zoneq("export", str(out), "--data-dir", data, "--format", "jsonl", "--only", "events")
    assert first.returncode == 0, first.stderr
    # no --format: the queue is written in the format the export holds
    queue = zoneq("export", str(out), "--data-dir", data, "--only", "queue")
    assert queue.returncode == 0, queue.stderr
    assert (out / "queue" / "current.jsonl").is_file()
    assert not (out / "queue" / "current.parquet").exists()
    # another format, asked for, is refused as for the events, and changes nothing
    other = zoneq("export", str(out), "--data-dir", data, "--only", "queue", "--format", "parquet")
    assert other.returncode == 1
    assert "holds a jsonl export; an incremental export must keep its format" in other.stderr
    assert (out / "queue" / "current.jsonl").is_file()
    # and a plain run goes on in JSON lines too
    again = zoneq("export", str(out), "--data-dir", data)
    assert again.returncode == 0, again.stderr
    assert "events: 0 exported" in again.stdout
    assert not any(out.rglob("*.parquet"))


def without_pyarrow(tmp_path: Path) -> dict[str, str]:
    """An environment where ``import pyarrow`` fails, as where the analytics extra is not
    installed: a ``pyarrow`` package that raises, ahead of site-packages."""
    shadow = tmp_path / "no-pyarrow" / "pyarrow"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("no pyarrow here")\n')
    return {**os.environ, "PYTHONPATH": str(shadow.parent)}


@pytest.mark.integration
@pytest.mark.parametrize("only", [None, "queue"])
def test_a_parquet_export_without_pyarrow_creates_nothing(tmp_path: Path, only: str | None) -> None:
    data = str(stopped_directory(tmp_path / "queue"))
    out = tmp_path / "export"
    argv = ["export", str(out), "--data-dir", data, *(["--only", only] if only else [])]
    env = without_pyarrow(tmp_path)
    done = zoneq(*argv, env=env)
    assert done.returncode == 1
    assert "Parquet export needs pyarrow" in done.stderr, done.stderr
    assert not out.exists()  # no lock, no events/day=.../zone=... left behind
    # JSON lines needs no extra
    jsonl = zoneq(*argv, "--format", "jsonl", env=env)
    assert jsonl.returncode == 0, jsonl.stderr
    assert any(out.rglob("*.jsonl"))


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        ((), Format.PARQUET),  # a new directory
        (("current.jsonl",), Format.JSONL),  # a queue-only export from before watermarks
        (("current.parquet",), Format.PARQUET),
        (("current.jsonl", "current.parquet"), Format.PARQUET),  # no telling: the default
    ],
)
def test_without_a_watermark_the_queue_file_tells_the_format(
    tmp_path: Path, held: tuple[str, ...], expected: Format
) -> None:
    (tmp_path / "queue").mkdir()
    for name in held:
        (tmp_path / "queue" / name).write_bytes(b"")
    assert export_format(tmp_path, None) is expected
    assert export_format(tmp_path, Format.JSONL) is Format.JSONL  # asked for: as asked


@async_test
async def test_a_first_queue_export_pins_the_format(stores: StoreFactory, tmp_path: Path) -> None:
    store = stores.open()
    await Traffic(store).send(3)
    source = DirectorySource(store)
    try:
        assert export_queue(source, tmp_path, Format.JSONL, now_ms=2_000_000_000_000) > 0
        with pytest.raises(ExportError, match="holds a jsonl export"):
            export_events(source, tmp_path, Format.PARQUET)
        with pytest.raises(ExportError, match="holds a jsonl export"):
            export_queue(source, tmp_path, Format.PARQUET, now_ms=2_000_000_000_000)
    finally:
        source.close()
    mark = watermark.load(tmp_path)
    assert mark is not None and mark.fmt is Format.JSONL and mark.after is None


@pytest.mark.parametrize("only", ["events", "queue"])
@async_test
async def test_an_idle_nodes_export_is_an_export(
    stores: StoreFactory, tmp_path: Path, only: str
) -> None:
    """No event yet (an idle node, or only its queue exported): still a directory the
    analytics job takes, so one idle node does not sink a report over all nodes."""
    source = DirectorySource(stores.open())
    try:
        if only == "events":
            assert export_events(source, tmp_path / "out", Format.PARQUET).events == 0
        else:
            assert export_queue(source, tmp_path / "out", Format.PARQUET, now_ms=1) == 0
    finally:
        source.close()
    assert (tmp_path / "out" / "events").is_dir()
    assert inputs.normalise([str(tmp_path / "out")]) == [(tmp_path / "out").resolve().as_uri()]
