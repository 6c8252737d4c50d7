"""One export run: the new events since the watermark, and optionally the current queue.

Events are read oldest first from the source (one snapshot), cut into batches, and each
batch is written as one part file per (day, zone) it touches.  Only when every file is in
place does the watermark move to the last event written.  One run at a time per export
directory (``lock.py``).  See ``files.py`` for the layout
and for what a run that dies half-way leaves behind (nothing the next run keeps).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from zoneq.export import watermark
from zoneq.export.files import (
    EVENTS_DIR,
    QUEUE_DIR,
    QUEUE_STEM,
    Format,
    batched,
    discard_unfinished,
    make_dirs,
    part_name,
    partition_dir,
    utc_day,
    write_rows,
)
from zoneq.export.lock import exclusive
from zoneq.export.sources import Source
from zoneq.export.watermark import ExportError, Watermark
from zoneq.protocol.columns import EVENT_COLUMNS, QUEUE_COLUMNS, QUEUE_VERSION
from zoneq.protocol.ids import parse_id
from zoneq.storage.export import is_corrupt

BATCH: Final = 200_000


@dataclass(frozen=True, slots=True)
class EventsExported:
    events: int
    files: int
    after: int | None  # the new watermark
    discarded: int  # files of an unfinished earlier run, deleted first
    corrupt: tuple[str, ...] = ()  # keys (hex) of event records that did not decode, skipped


class Progress:
    """A progress bar on stderr (tqdm), or nothing."""

    def __init__(self, *, enabled: bool, total: int | None, desc: str) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm  # noqa: PLC0415  (only when a bar is shown)

            self._bar = tqdm(total=total, unit=" events", unit_scale=True, desc=desc)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def export_events(
    source: Source, out: Path, fmt: Format, *, progress: bool = False, batch: int = BATCH
) -> EventsExported:
    """Append the events after ``out``'s watermark to ``out`` and move the watermark.

    Holds ``out``'s export lock from reading the watermark to saving it (``lock.py``):
    ``ExportError`` at once while another run is writing there."""
    with exclusive(out):
        return _export_events(source, out, fmt, progress=progress, batch=batch)


def _export_events(
    source: Source, out: Path, fmt: Format, *, progress: bool, batch: int
) -> EventsExported:
    mark = _kept_format(out, fmt)
    # An idle node's export holds no event yet, but it is an export all the same: the
    # analytics job takes a directory with events/ for one (an empty day, not an error).
    make_dirs(out / EVENTS_DIR)
    discarded = discard_unfinished(out, mark.run_start)
    bar = Progress(
        enabled=progress,
        total=source.count_events(mark.after) if progress else None,
        desc="events",
    )
    last, count, files = mark.after, 0, 0
    corrupt: list[str] = []
    try:
        for chunk in batched(source.events(mark.after), batch):
            rows = [record for record in chunk if not is_corrupt(record)]
            corrupt.extend(record["key"] for record in chunk if is_corrupt(record))
            files += _write_batch(out, rows, mark.run_start, fmt)
            # Past the skipped records too: the next run must not stop at them again.
            last = parse_id(chunk[-1]["id"])
            count += len(rows)
            bar.update(len(chunk))
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"an event record could not be exported: {exc!r}") from exc
    finally:
        bar.close()
    watermark.save(out, Watermark(fmt, last, mark.events + count))
    return EventsExported(count, files, last, discarded, tuple(corrupt))


def export_format(out: Path, requested: Format | None) -> Format:
    """The format to export into ``out`` in: ``requested``, else the one ``out`` holds
    (its watermark's, or for a queue-only export written before the queue had one, its
    queue file's), else Parquet.  A ``requested`` format ``out`` does not hold is refused
    later, by ``export_events`` and ``export_queue``."""
    if requested is not None:
        return requested
    mark = watermark.load(out)
    if mark is not None:
        return mark.fmt
    held = [fmt for fmt in Format if (out / QUEUE_DIR / (QUEUE_STEM + fmt.suffix)).exists()]
    return held[0] if len(held) == 1 else Format.PARQUET


def _kept_format(out: Path, fmt: Format) -> Watermark:
    """``out``'s watermark (a new one in ``fmt`` if it has none), refusing another format:
    readers take a directory to hold one format, and would miss the other one's files."""
    mark = watermark.load(out)
    if mark is None:
        return Watermark(fmt)
    if mark.fmt is not fmt:
        raise ExportError(
            f"{out} holds a {mark.fmt.value} export; an incremental export must keep its "
            f"format (use --format {mark.fmt.value}, or a new directory)"
        )
    return mark


def _write_batch(out: Path, chunk: list[dict[str, Any]], run_start: str, fmt: Format) -> int:
    """One part file per (day, zone) in ``chunk``, each in event order; how many."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in chunk:
        groups.setdefault((utc_day(record["time_ms"]), record["zone"]), []).append(record)
    for (day, zone), rows in groups.items():
        path = partition_dir(out, day, zone) / part_name(run_start, rows[0]["id"], fmt)
        write_rows(path, rows, EVENT_COLUMNS, fmt)
    return len(groups)


def export_queue(source: Source, out: Path, fmt: Format, *, now_ms: int) -> int:
    """Replace ``out``'s queue export with the queue as it is now; how many recipients
    (under ``out``'s export lock, as ``export_events``)."""
    with exclusive(out):
        return _export_queue(source, out, fmt, now_ms=now_ms)


def _export_queue(source: Source, out: Path, fmt: Format, *, now_ms: int) -> int:
    mark = _kept_format(out, fmt)
    if mark.after is None:
        # Before any event, a queue export pins the directory's format as an events export
        # does (saving the same watermark again changes nothing), and makes the directory
        # an export the analytics job reads.
        make_dirs(out / EVENTS_DIR)
        watermark.save(out, mark)
    path = out / QUEUE_DIR / (QUEUE_STEM + fmt.suffix)
    for other in Format:  # a format switch must not leave the old file for readers
        if other is not fmt:
            (out / QUEUE_DIR / (QUEUE_STEM + other.suffix)).unlink(missing_ok=True)
    try:
        return write_rows(path, _queue_rows(source, now_ms), QUEUE_COLUMNS, fmt)
    except (KeyError, TypeError) as exc:
        raise ExportError(f"a queue record could not be exported: {exc!r}") from exc


def _queue_rows(source: Source, now_ms: int) -> Iterator[dict[str, Any]]:
    for record in source.queue(now_ms):
        record["v"] = QUEUE_VERSION
        record["exported_at_ms"] = now_ms
        yield record
