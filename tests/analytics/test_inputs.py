"""Which format an export holds, and refusing to read it as the other one.

Read as Parquet, a JSON lines export gives 0 rows and an empty report that looks like a
quiet day; these tests make that a clear error.  One real local Spark session lists a
``file://`` export through Hadoop's FileSystem, the way ``hdfs://`` and ``s3a://`` are.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.export.conftest import Traffic
from zoneq.analytics import inputs
from zoneq.analytics.errors import AnalyticsError
from zoneq.export.files import Format
from zoneq.export.run import export_events
from zoneq.export.sources import DirectorySource
from zoneq.export.watermark import WATERMARK_FILE
from zoneq.storage.store import QueueStore

ROOT = Path(__file__).resolve().parents[2]


def _export(root: Path, fmt: Format, messages: int = 8) -> Path:
    async def make() -> Path:
        store = QueueStore.open(root / "queue")
        store.recover()
        if messages:
            await Traffic(store).day(messages=messages, rounds=2)
        source = DirectorySource(store)
        try:
            export_events(source, root / "export", fmt)
        finally:
            source.close()
        await store.close()
        return root / "export"

    return asyncio.run(make())


@pytest.fixture(scope="module")
def jsonl_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(tmp_path_factory.mktemp("jsonl"), Format.JSONL)


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("part-0-1.parquet", "parquet"),
        ("part-0-1.jsonl", "jsonl"),
        (".tmp-part-0-1.jsonl", None),  # unfinished: Spark skips it too
        ("_SUCCESS", None),
        ("part-0-1.csv", None),
        ("notes", None),
    ],
)
def test_part_file_names_say_their_format(name: str, fmt: str | None) -> None:
    assert inputs._part_format(name) == fmt


def test_a_requested_format_the_files_contradict_is_refused(jsonl_export: Path) -> None:
    assert inputs.detect_format([str(jsonl_export)], "auto") == "jsonl"
    assert inputs.detect_format([str(jsonl_export)], "jsonl") == "jsonl"
    with pytest.raises(AnalyticsError, match="--input-format parquet, but the inputs hold jsonl"):
        inputs.detect_format([str(jsonl_export)], "parquet")


def test_without_a_watermark_the_part_files_tell(jsonl_export: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(jsonl_export, copy)
    (copy / WATERMARK_FILE).unlink()
    assert inputs.detect_format([str(copy)], "auto") == "jsonl"


@pytest.mark.parametrize("fmt", [Format.PARQUET, Format.JSONL])
def test_an_idle_nodes_export_read_as_its_own_format_is_not_refused(
    tmp_path: Path, fmt: Format
) -> None:
    """Its watermark names the format but it holds no part file: 0 events is its day,
    not a sign of the wrong --input-format."""
    idle = _export(tmp_path, fmt, messages=0)
    assert (idle / "events").is_dir() and (idle / WATERMARK_FILE).exists()
    inputs.refuse_empty(0, [str(idle)], fmt.value, None)  # type: ignore[arg-type]


@pytest.mark.integration
def test_the_command_refuses_parquet_for_a_json_lines_export(
    jsonl_export: Path, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "zoneq", "analytics", str(jsonl_export)]
    argv += ["--out", str(tmp_path / "report"), "--input-format", "parquet"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "--input-format parquet, but the inputs hold jsonl part files" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "report" / "report.html").exists()


@pytest.mark.integration
def test_through_hadoop_a_json_export_read_as_parquet_is_refused(
    spark: Any, jsonl_export: Path, tmp_path: Path
) -> None:
    """The remote path: no watermark read locally, the files listed through Hadoop."""
    uri = jsonl_export.as_uri()
    assert inputs.hadoop_part_format(spark, uri) == "jsonl"
    assert inputs.hadoop_part_format(spark, tmp_path.as_uri()) is None  # no events/ at all
    assert inputs.held_formats([uri], spark) == {"jsonl"}
    # What used to happen: read as Parquet, the export is 0 rows, and the report was empty.
    assert inputs.read_events(spark, [uri], "parquet").count() == 0
    with pytest.raises(AnalyticsError, match="0 events read as parquet, but the inputs hold"):
        inputs.refuse_empty(0, [uri], "parquet", spark)
    inputs.refuse_empty(1, [uri], "jsonl", spark)  # events read: nothing to refuse


@pytest.mark.parametrize(
    "twice",
    [
        lambda export: [str(export), str(export)],
        lambda export: [str(export), export.as_uri()],
        lambda export: [f"{export}/", f"{export.parent}/../{export.parent.name}/{export.name}"],
        lambda export: [str(export), str(export.parent / "link")],  # a symlink to it
        lambda export: ["hdfs:///exports/node1", "hdfs:///exports/node1/"],
    ],
    ids=["same", "uri", "spelt-otherwise", "symlink", "remote"],
)
def test_an_export_given_twice_is_refused(
    jsonl_export: Path, twice: Callable[[Path], list[str]]
) -> None:
    """Given twice, a JSON lines export's events were counted twice (a Parquet one's once)."""
    (jsonl_export.parent / "link").unlink(missing_ok=True)
    (jsonl_export.parent / "link").symlink_to(jsonl_export)
    with pytest.raises(AnalyticsError, match=r"^inputs .* are the same export \("):
        inputs.normalise(twice(jsonl_export))


@pytest.mark.parametrize(
    ("held", "accepted"),
    [
        (["events/"], True),
        (["queue/current.jsonl"], True),  # an older zoneq's first export of a queue alone
        ([WATERMARK_FILE], True),  # an older zoneq's export of an idle node
        (["notes.txt", "other/"], False),
        ([], False),
    ],
)
def test_an_export_is_a_directory_an_export_run_wrote(
    tmp_path: Path, held: list[str], accepted: bool
) -> None:
    for name in held:
        if name.endswith("/"):
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).parent.mkdir(exist_ok=True)
            (tmp_path / name).write_text("")
    if accepted:
        assert inputs.normalise([str(tmp_path)]) == [tmp_path.resolve().as_uri()]
    else:
        with pytest.raises(AnalyticsError, match="not a zoneq export"):
            inputs.normalise([str(tmp_path)])
