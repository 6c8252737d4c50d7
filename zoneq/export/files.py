"""Export files: partition paths, JSON lines and Parquet part files, written atomically.

Layout of an export directory (one per node; the Spark job reads several together)::

    events/day=YYYY-MM-DD/zone=NAME/part-<run>-<first>.parquet   (or .jsonl)
    queue/current.parquet                                         (the latest queue export)
    .zoneq-export.json                                            (the watermark)

``day`` is the event's UTC day.  The directory names follow Hive's ``key=value`` convention
so other tools can prune by day and zone, with Hive's (and Spark's) escaping of the few
characters a path cannot carry; but every row also carries its own ``zone`` and ``time_ms``,
so a reader never depends on the directory names (zone names may hold any character).

``<run>`` is the watermark the run started from and ``<first>`` the first event id in the
file, both 16 hex digits.  A run that dies before moving the watermark leaves files named
with the watermark still in force; the next run deletes those first (``discard_unfinished``),
so a crash can neither lose events nor leave them in the export twice.

Each file is written under a temporary name and renamed into place (POSIX rename is atomic),
so a reader never sees half a file.  pyarrow is imported only when Parquet is asked for: the
JSON lines path works without the ``analytics`` extra.
"""

from __future__ import annotations

import datetime as dt
import enum
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

from zoneq.protocol.columns import ColumnType

EVENTS_DIR: Final = "events"
QUEUE_DIR: Final = "queue"
QUEUE_STEM: Final = "current"
PART_PREFIX: Final = "part-"

Row = TypeVar("Row")

# Hive's FileUtils.escapePathName set (Spark uses the same): these become %XX.
_ESCAPED: Final = frozenset("\"#%'*/:=?\\\x7f{[]^") | frozenset(chr(c) for c in range(0x20))


class Format(enum.StrEnum):
    PARQUET = "parquet"
    JSONL = "jsonl"

    @property
    def suffix(self) -> str:
        return "." + self.value


class MissingDependency(RuntimeError):
    """A library of the ``analytics`` extra is not installed."""


def escape_path_name(value: str) -> str:
    """A partition value as Hive and Spark write it in a directory name."""
    if not value:
        return "__HIVE_DEFAULT_PARTITION__"
    return "".join(f"%{ord(c):02X}" if c in _ESCAPED else c for c in value)


def utc_day(time_ms: int) -> str:
    return dt.datetime.fromtimestamp(time_ms / 1000, dt.UTC).strftime("%Y-%m-%d")


def partition_dir(root: Path, day: str, zone: str) -> Path:
    return root / EVENTS_DIR / f"day={day}" / f"zone={escape_path_name(zone)}"


def part_name(run_start: str, first_id: str, fmt: Format) -> str:
    return f"{PART_PREFIX}{run_start}-{first_id}{fmt.suffix}"


def discard_unfinished(root: Path, run_start: str) -> int:
    """Delete part files left by a run from ``run_start`` that never moved the watermark
    (and stray temporary files); how many."""
    removed = 0
    events = root / EVENTS_DIR
    if not events.is_dir():
        return 0
    for path in events.rglob("*"):
        name = path.name
        stale_part = name.startswith(PART_PREFIX) and name[len(PART_PREFIX) :] >= run_start
        if path.is_file() and (stale_part or name.startswith(".tmp-")):
            path.unlink()
            removed += 1
    return removed


def _arrow_schema(columns: Sequence[tuple[str, ColumnType, bool]]) -> Any:
    pa = _pyarrow()
    types = {"int32": pa.int32(), "int64": pa.int64(), "string": pa.string(), "bool": pa.bool_()}
    return pa.schema([pa.field(name, types[kind], nullable) for name, kind, nullable in columns])


def _pyarrow() -> Any:
    try:
        # Optional: only Parquet needs pyarrow (and the submodule must be loaded to be used).
        import pyarrow as pa  # noqa: PLC0415
        import pyarrow.parquet  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise MissingDependency(
            "Parquet export needs pyarrow: pip install 'zoneq[analytics]' (or use --format jsonl)"
        ) from exc
    return pa


def require_writer(fmt: Format) -> None:
    """Raise ``MissingDependency`` now if ``fmt``'s writer is not installed (pyarrow, for
    Parquet): called before an export run creates anything, since a refused run's
    directories (``out``, its lock, an empty partition) would be left behind."""
    if fmt is Format.PARQUET:
        _pyarrow()


def write_rows(
    path: Path,
    rows: Iterable[dict[str, Any]],
    columns: Sequence[tuple[str, ColumnType, bool]],
    fmt: Format,
    *,
    batch: int = 65_536,
) -> int:
    """Write ``rows`` (dicts with at least ``columns``) to ``path`` atomically, streaming
    (Parquet: one row group per ``batch`` rows); how many rows."""
    make_dirs(path.parent)
    tmp = path.with_name(f".tmp-{path.name}")
    names = [name for name, _, _ in columns]
    count = 0
    if fmt is Format.PARQUET:
        pa = _pyarrow()
        schema = _arrow_schema(columns)
        with pa.parquet.ParquetWriter(tmp, schema, compression="snappy") as writer:
            for chunk in batched(rows, batch):
                try:
                    table = pa.Table.from_pylist(chunk, schema)
                except UnicodeEncodeError:
                    table = pa.Table.from_pylist([_valid_utf8(row) for row in chunk], schema)
                writer.write_table(table)
                count += len(chunk)
    else:
        with tmp.open("w", encoding="utf-8") as out:
            for line in _json_lines(rows, names):
                out.write(line)
                count += 1
    durable_replace(tmp, path)
    return count


def durable_replace(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` over ``path`` so that both survive a power loss: the file's data is
    fsynced before the rename (else the new name may point at an empty or partial file),
    and the directory after it (the rename itself is directory data, POSIX fsync(2)).  The
    watermark is saved after this, so it never points past events that are not on disk.
    Costs a few milliseconds per part file, small next to encoding the Parquet."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def make_dirs(directory: Path) -> None:
    """``mkdir -p``, fsyncing the parent of each directory it creates: a new partition
    directory's own name is data of its parent, lost with it unless synced."""
    created: list[Path] = []
    missing = directory
    while not missing.exists() and missing != missing.parent:
        created.append(missing)
        missing = missing.parent
    directory.mkdir(parents=True, exist_ok=True)
    for made in reversed(created):
        fsync_dir(made.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def batched(items: Iterable[Row], size: int) -> Iterator[list[Row]]:
    """Lists of up to ``size`` items (``itertools.batched`` is Python 3.12)."""
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def _valid_utf8(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with lone surrogates (undecodable input kept as-is by the receiver) replaced:
    Parquet strings must be UTF-8.  Rare, so only a batch that failed pays for the check;
    otherwise one bad address would stop every later export at the same event."""
    return {
        key: value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        if isinstance(value, str)
        else value
        for key, value in row.items()
    }


def _json_lines(rows: Iterable[dict[str, Any]], names: Sequence[str]) -> Iterable[str]:
    # ensure_ascii=False keeps UTF-8 addresses and zone names readable (RFC 6531 mail);
    # lone surrogates (undecodable input kept as-is) still come out as \\u escapes.
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    for row in rows:
        line = dumps({n: row[n] for n in names})
        try:
            line.encode()
        except UnicodeEncodeError:
            line = json.dumps({n: row[n] for n in names}, separators=(",", ":"))
        yield line + "\n"


__all__ = [
    "EVENTS_DIR",
    "QUEUE_DIR",
    "QUEUE_STEM",
    "Format",
    "MissingDependency",
    "batched",
    "discard_unfinished",
    "durable_replace",
    "escape_path_name",
    "fsync_dir",
    "make_dirs",
    "part_name",
    "partition_dir",
    "require_writer",
    "utc_day",
    "write_rows",
]
