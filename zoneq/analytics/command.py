"""``zoneq analytics``: the PySpark job over one or more exports (see ``job.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zoneq.analytics.errors import AnalyticsError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "analytics",
        help="per-zone analytics (PySpark) over event exports: tables and an HTML report",
        description=(
            "Read one or more export directories (plain paths or file://, hdfs://, s3a:// "
            "URIs; several nodes' exports together) and write per-zone tables as Parquet "
            "and CSV, and a self-contained HTML report, into --out.  With --prepare, "
            "record the JVM's class-data archive instead (a set-up step: later local "
            "reports start seconds faster)."
        ),
    )
    parser.add_argument("inputs", nargs="*", help="export directories written by zoneq export")
    parser.add_argument("--out", type=Path, default=None, help="report directory (local)")
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="record the class-data archive now by running the job on a tiny generated "
        "export, then exit (at once when a usable archive is there); no inputs or --out",
    )
    parser.add_argument(
        "--force", action="store_true", help="with --prepare: record the archive again"
    )
    parser.add_argument(
        "--master",
        default=None,
        help="Spark master (default: local[*] on loopback, or spark-submit's master)",
    )
    parser.add_argument(
        "--input-format",
        choices=["auto", "parquet", "jsonl"],
        default="auto",
        help="format of the exports (auto: from their watermark files, else parquet)",
    )
    parser.add_argument(
        "--driver-memory", default=None, help="Spark driver memory (default: half the RAM)"
    )
    parser.add_argument(
        "--class-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="where a local run keeps the JVM's class-data archive, which makes later "
        "starts seconds faster (default: $XDG_CACHE_HOME/zoneq or ~/.cache/zoneq)",
    )
    parser.add_argument(
        "--no-class-cache",
        action="store_true",
        help="neither use nor write the class-data archive (every start fully cold)",
    )
    parser.set_defaults(func=_cmd_analytics)


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``spark-submit tools/analytics/zoneq_report.py`` (same arguments)."""
    parser = argparse.ArgumentParser(prog="zoneq_report")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["analytics", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code


def _missing_extra(exc: ImportError) -> int:
    print(
        f"zoneq analytics: needs the analytics extra (pip install 'zoneq[analytics]'): {exc}",
        file=sys.stderr,
    )
    return 2


def _usage_error(args: argparse.Namespace) -> str | None:
    if args.prepare:
        if args.inputs or args.out is not None or args.master is not None:
            return "--prepare takes no inputs, --out or --master (it runs locally on its own)"
        if args.no_class_cache:
            return "--prepare records the class-data archive: not with --no-class-cache"
        return None
    if args.force:
        return "--force goes with --prepare"
    if not args.inputs or args.out is None:
        return "give one or more export directories and --out REPORT_DIR (or --prepare)"
    return None


def _cmd_analytics(args: argparse.Namespace) -> int:
    problem = _usage_error(args)
    if problem is not None:
        print(f"zoneq analytics: {problem}", file=sys.stderr)
        return 2
    if args.prepare:
        return _cmd_prepare(args)
    try:
        # Imported here: pyspark is an optional extra, and loading it costs every other
        # zoneq command time for nothing.
        from zoneq.analytics import job  # noqa: PLC0415
        from zoneq.analytics.classcache import default_dir  # noqa: PLC0415
    except ImportError as exc:
        return _missing_extra(exc)
    try:
        done = job.run(
            args.inputs,
            args.out,
            master=args.master,
            input_format=args.input_format,
            driver_memory=args.driver_memory or job.default_driver_memory(),
            class_cache=None if args.no_class_cache else args.class_cache or default_dir(),
        )
    except AnalyticsError as exc:
        print(f"zoneq analytics: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"zoneq analytics: cannot write the report: {exc}", file=sys.stderr)
        return 1
    print(
        f"{done.events} events, {done.queued} queued recipients -> {done.html} "
        f"({len(done.tables)} tables, {done.seconds:.1f} s)"
    )
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    try:
        # pyarrow, which warmup needs, is of the analytics extra too
        from zoneq.analytics import warmup  # noqa: PLC0415
        from zoneq.analytics.classcache import default_dir  # noqa: PLC0415
    except ImportError as exc:
        return _missing_extra(exc)
    try:
        done = warmup.prepare(
            args.class_cache or default_dir(),
            force=args.force,
            driver_memory=args.driver_memory,
        )
    except ImportError as exc:  # PySpark, imported once a recording is due
        return _missing_extra(exc)
    except AnalyticsError as exc:
        print(f"zoneq analytics: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"zoneq analytics: cannot record the class-data archive: {exc}", file=sys.stderr)
        return 1
    if done.recorded:
        size = done.path.stat().st_size / 1e6
        print(f"class-data archive recorded in {done.seconds:.1f} s: {done.path} ({size:.0f} MB)")
    else:
        print(f"class-data archive already recorded: {done.path} (--force records it again)")
    return 0
