"""``zoneq export``: the event log (and the current queue) to JSON lines or Parquet files."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from zoneq.config import Config, load_config
from zoneq.errors import ConfigError, StorageUnavailable, StoreLocked
from zoneq.export.files import Format, MissingDependency, require_writer
from zoneq.export.lock import exclusive
from zoneq.export.run import export_events, export_format, export_queue
from zoneq.export.sources import (
    ApiSource,
    DirectorySource,
    Source,
    api_settings,
    api_unreachable,
)
from zoneq.export.watermark import ExportError
from zoneq.protocol.ids import format_id


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "export",
        help="export delivery events (and the queue) as JSON lines or Parquet",
        description=(
            "Write the events since the last export into OUT, partitioned "
            "events/day=YYYY-MM-DD/zone=NAME/, and the current queue into OUT/queue/. "
            "Reads the data directory when zoneq is stopped, the running core's API otherwise."
        ),
    )
    parser.add_argument("out", type=Path, help="export directory (keeps its own watermark)")
    parser.add_argument("--config", type=Path, default=None, help="a zones.toml file")
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="the queue directory (default: from config)"
    )
    parser.add_argument(
        "--format",
        choices=[f.value for f in Format],
        default=None,
        help=(
            "parquet (the default for a new export; needs the analytics extra) or jsonl; "
            "an export keeps its format (default: the one OUT holds)"
        ),
    )
    parser.add_argument(
        "--only", choices=["events", "queue"], default=None, help="export just one of the two"
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar (default: when stderr is a terminal)",
    )
    parser.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"zoneq export: configuration error:\n{exc}", file=sys.stderr)
        return 2
    data_dir: Path = args.data_dir if args.data_dir is not None else config.server.data_dir
    requested = None if args.format is None else Format(args.format)
    progress = sys.stderr.isatty() if args.progress is None else bool(args.progress)
    try:
        # Before the lock, which creates the directory: a run refused for want of pyarrow
        # must leave nothing behind.  (The format is read again under the lock.)
        require_writer(export_format(args.out, requested))
        # The export directory first: a second run into it is refused before it opens (and
        # holds) the data directory, and events and queue come from one run.
        with exclusive(args.out), _source(data_dir, config) as source:
            # Without --format, the export goes on in the format it holds: `--only queue`
            # into a JSON lines export must not turn its queue into Parquet, which the
            # analytics job (reading the directory as JSON lines) would not see.
            fmt = export_format(args.out, requested)
            if args.only != "queue":
                done = export_events(source, args.out, fmt, progress=progress)
                mark = "none" if done.after is None else format_id(done.after)
                print(
                    f"events: {done.events} exported in {done.files} file(s) to {args.out} "
                    f"(watermark {mark})"
                )
                if done.corrupt:
                    print(corrupt_summary(done.corrupt))
            if args.only != "events":
                now_ms = time.time_ns() // 1_000_000
                queued = export_queue(source, args.out, fmt, now_ms=now_ms)
                print(f"queue: {queued} queued recipient(s) exported to {args.out}")
    except (ExportError, MissingDependency, StorageUnavailable) as exc:
        print(f"zoneq export: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"zoneq export: cannot write the export: {exc}", file=sys.stderr)
        return 1
    return 0


def corrupt_summary(keys: Sequence[str], shown: int = 10) -> str:
    """The summary line for skipped event records, naming their keys (the first few)."""
    named = " ".join(keys[:shown]) + (
        f" (and {len(keys) - shown} more)" if len(keys) > shown else ""
    )
    return f"{len(keys)} corrupt event record(s) skipped: keys {named}"


@contextlib.contextmanager
def _source(data_dir: Path, config: Config) -> Iterator[Source]:
    """The data directory, or the running core's API when zoneq holds the directory."""
    with contextlib.ExitStack() as stack:
        source: Source
        try:
            source = stack.enter_context(DirectorySource.open(data_dir))
        except StoreLocked as exc:
            listen, token = api_settings(config)
            # LevelDB's lock says only that some process holds the directory: a running
            # zoneq, or another export of a stopped one.  Only the API can tell them apart.
            if (reason := api_unreachable(listen)) is not None:
                raise ExportError(
                    f"the data directory {data_dir} is held by another process (a running "
                    "zoneq, or another zoneq export reading it), and no zoneq API answers "
                    f"({reason}); if zoneq is stopped, run this again when the other export "
                    "has finished"
                ) from exc
            source = ApiSource(listen, token)
        yield source
