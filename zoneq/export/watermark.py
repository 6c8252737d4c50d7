"""The watermark of an export directory: the last event id it holds, and its format.

Kept as a small JSON file inside the export directory, so the export and its watermark
travel together (copy the directory elsewhere, and the next run still continues where the
last one stopped).  It is replaced atomically (write, fsync, rename), and only after every
file of the run is in place: a run that dies half-way leaves the old watermark, and the
next run discards that run's files and writes them again (see ``files.discard_unfinished``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from zoneq.export.files import Format, fsync_dir
from zoneq.protocol.ids import format_id, parse_id

WATERMARK_FILE: Final = ".zoneq-export.json"
WATERMARK_VERSION: Final = 1


class ExportError(Exception):
    """An export cannot go on; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Watermark:
    fmt: Format
    after: int | None = None  # the last event id exported; None: nothing yet
    events: int = 0  # events exported into this directory so far

    @property
    def run_start(self) -> str:
        """The name every part file of the next run starts with (16 hex digits)."""
        return format_id(self.after if self.after is not None else 0)


def load(directory: Path) -> Watermark | None:
    path = directory / WATERMARK_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the export watermark {path}: {exc}") from exc
    try:
        if data["version"] != WATERMARK_VERSION:
            raise ValueError(f"watermark version {data['version']!r} is not {WATERMARK_VERSION}")
        after = data["after"]
        return Watermark(
            fmt=Format(data["format"]),
            after=None if after is None else parse_id(after),
            events=int(data["events"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"the export watermark {path} is not valid: {exc}") from exc


def save(directory: Path, mark: Watermark) -> None:
    path = directory / WATERMARK_FILE
    tmp = path.with_name(path.name + ".tmp")
    data = {
        "version": WATERMARK_VERSION,
        "format": mark.fmt.value,
        "after": None if mark.after is None else format_id(mark.after),
        "events": mark.events,
    }
    with tmp.open("w", encoding="utf-8") as out:
        json.dump(data, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync_dir(directory)  # the rename is the directory's data (POSIX fsync(2))
