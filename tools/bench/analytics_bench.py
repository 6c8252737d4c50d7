"""Benchmark: the full analytics report over 1 M and 10 M events, cold start included.

    python tools/bench/analytics_bench.py                       # 1 M, Parquet and JSON lines
    python tools/bench/analytics_bench.py --events 1000000 10000000 --formats parquet
    python tools/bench/analytics_bench.py --dir bench-data --reuse --class-cache off  # again

For each size an export directory is generated in zoneq export's layout (events/day=/zone=/
part files, a queue/current file and the watermark), with a realistic mix: 8 zones, 2,000
destination domains (Zipf-like), 300 MX hosts, 8 source addresses, a week of traffic,
outcomes in the proportions of a bulk sender, reply texts from a small set (each with the
category zoneq's core gives it: the shipped reply rules', else its RFC 3463 class).  Then
``zoneq analytics`` runs as a fresh process (JVM start, Spark session, reading, every table,
the HTML report) and its wall time is measured.  The generated data is synthetic because
writing 10 M events through a real store would take longer than the report itself; the
export and analytics tests cover real events.

Each export is reported on up to three times (``--class-cache``), and each run's line and
row say which it was: ``cached``, a run mapping the class-data archive, is what a machine
set up by ``tools/dev`` runs (set-up records the archive once, ``zoneq analytics
--prepare``); ``off``, a fully cold JVM without the archive (a machine where it was never
recorded); ``first``, the run that records it (its JVM writes it at exit, counted), which
set-up pays instead of the first report.  Every run is a new process and a new JVM.  The
job's own phase times (its DEBUG log, seconds since the job started, after Python's
imports) are printed under each.  ``--repeat N`` runs each mode N times in turn (off,
first, cached, off, ...), and the summary gives each one's median.

Generating the 1 M JSON lines export takes longer than a report: ``--dir D --reuse`` keeps
the exports in D and uses one again when its watermark has the same count and format.

Issue 6's goal: the full report for 1 M events in at most 15 s on 2 cores, 10 M in 150 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from zoneq.export.files import (  # noqa: E402
    EVENTS_DIR,
    QUEUE_DIR,
    QUEUE_STEM,
    Format,
    part_name,
    partition_dir,
    write_rows,
)
from zoneq.export.watermark import ExportError, Watermark, load, save  # noqa: E402
from zoneq.protocol.columns import EVENT_COLUMNS, EVENT_VERSION, QUEUE_COLUMNS  # noqa: E402
from zoneq.protocol.ids import COUNTER_BITS, format_id  # noqa: E402
from zoneq.protocol.provider_replies import PROVIDER_RULES  # noqa: E402
from zoneq.protocol.reply_rules import rule_report  # noqa: E402

T0 = 1_700_000_000_000
DAY = 86_400_000
ZONES = [f"zone-{i}" for i in range(8)]
KINDS = ["accepted", "delivered", "deferred", "bounced", "expired", "dropped", "delayed"]
KIND_P = [0.15, 0.55, 0.20, 0.06, 0.01, 0.005, 0.025]
TEXTS = {
    "delivered": ["250 2.0.0 Ok: queued as {}", "250 2.6.0 Message accepted"],
    "deferred": [
        "451 4.3.0 Try again later",
        "421 4.7.0 Too many connections from your IP",
        "450 4.2.1 Mailbox busy",
        "452 4.3.1 Insufficient system storage",
        "554 5.7.1 Service unavailable; Client host [127.0.1.3] blocked using zen.spamhaus.org",
        "421 4.7.28 Our system has detected an unusual rate of unsolicited mail: rate limited",
    ],
    "bounced": ["550 5.1.1 No such user", "554 5.7.1 Rejected by policy", "552 5.2.2 Full"],
    "expired": ["451 4.3.0 Try again later", "421 4.7.0 Too many connections from your IP"],
    "delayed": ["451 4.3.0 Try again later"],
}
# No reply at all for some deferrals (connection refused, no MX answered): the worker's
# own status; one in TEXT_CHOICES of the deferrals.
NO_REPLY = (None, "4.4.1", "no MX host could be reached")
TEXT_CHOICES = 7


def _reply_parts(kind: str, choice: int) -> tuple[int | None, str | None, str | None, str | None]:
    """(code, enhanced, text, category) of the ``choice``-th reply of ``kind``."""
    texts = TEXTS.get(kind)
    if texts is None:
        return None, None, None, None
    if kind == "deferred" and choice == TEXT_CHOICES - 1:
        code, enhanced, text = NO_REPLY
    else:
        text = texts[choice % len(texts)]
        code, enhanced = int(text[:3]), text.split()[1]
    if kind == "delivered":
        return code, enhanced, text, None
    return code, enhanced, text, rule_report(PROVIDER_RULES, code, enhanced, text).category


ROWS_PER_FILE = 500_000


def generate(n: int, directory: Path, fmt: Format, seed: int = 6) -> None:
    """An export of ``n`` events in ``directory``."""
    rng = np.random.default_rng(seed)
    days = 7
    time_ms = np.sort(rng.integers(T0, T0 + days * DAY, n))
    kind_idx = rng.choice(len(KINDS), n, p=KIND_P)
    zone_idx = rng.integers(0, len(ZONES), n)
    domain_idx = np.minimum(rng.zipf(1.3, n), 2000) - 1
    mx_idx = domain_idx % 300
    source_idx = rng.integers(0, 8, n)
    attempt = np.where(kind_idx == 0, 0, 1 + rng.poisson(0.4, n))
    latency = rng.exponential(120_000, n).astype(np.int64)
    kinds = np.array(KINDS)[kind_idx]
    text_choice = rng.integers(0, TEXT_CHOICES, n)
    parts = {(k, c): _reply_parts(k, c) for k in KINDS for c in range(TEXT_CHOICES)}
    replies = [parts[(k, c)] for k, c in zip(kinds, text_choice, strict=True)]
    columns = {
        "v": np.full(n, EVENT_VERSION, np.int32),
        "id": [format_id((int(t) << COUNTER_BITS) + i % 4096) for i, t in enumerate(time_ms)],
        "kind": kinds,
        "time_ms": time_ms,
        "zone": np.array(ZONES)[zone_idx],
        "message_id": [
            format_id(int(t - lat) << COUNTER_BITS) for t, lat in zip(time_ms, latency, strict=True)
        ],
        "recipient": np.where(kind_idx == 0, "", "user@d.test"),
        "domain": np.where(kind_idx == 0, "", np.char.add("d", domain_idx.astype(str))),
        "queued_at_ms": time_ms - latency,
        "size": rng.integers(500, 200_000, n),
        "attempt": attempt.astype(np.int32),
        "mx": [
            None if k in (0, 5) else f"mx{m}.test" for k, m in zip(kind_idx, mx_idx, strict=True)
        ],
        "source_ip": [f"127.0.1.{s}" for s in source_idx],
        "code": [r[0] for r in replies],
        "enhanced": [r[1] for r in replies],
        "text": [r[2] for r in replies],
        "possible_duplicate": np.zeros(n, bool),
        "recipients": np.where(kind_idx == 0, rng.integers(1, 50, n), 1).astype(np.int32),
        "category": [r[3] for r in replies],
    }
    schema = pa.schema(
        [
            pa.field(
                name,
                {
                    "int32": pa.int32(),
                    "int64": pa.int64(),
                    "string": pa.string(),
                    "bool": pa.bool_(),
                }[t],
                nullable,
            )
            for name, t, nullable in EVENT_COLUMNS
        ]
    )
    table = pa.Table.from_pydict(columns, schema)
    day_idx = (time_ms - T0) // DAY
    run = format_id(0)
    for day in range(days):
        for z, zone in enumerate(ZONES):
            mask = (day_idx == day) & (zone_idx == z)
            part = table.filter(pa.array(mask))
            for start in range(0, part.num_rows, ROWS_PER_FILE):
                chunk = part.slice(start, ROWS_PER_FILE)
                day_name = time.strftime("%Y-%m-%d", time.gmtime((T0 + day * DAY) / 1000))
                path = partition_dir(directory, day_name, zone)
                path = path / part_name(run, chunk.column("id")[0].as_py(), fmt)
                path.parent.mkdir(parents=True, exist_ok=True)
                if fmt is Format.PARQUET:
                    pq.write_table(chunk, path, compression="snappy")
                else:
                    write_rows(path, chunk.to_pylist(), EVENT_COLUMNS, fmt)
    queue_rows = [
        {
            "v": 1,
            "exported_at_ms": T0 + days * DAY,
            "zone": ZONES[i % len(ZONES)],
            "state": ["ready", "deferred", "held"][i % 3],
            "domain": f"d{i % 500}",
            "message_id": format_id((T0 + i) << COUNTER_BITS),
            "queued_at_ms": T0 + days * DAY - i * 1000,
            "attempts": i % 5,
            "next_attempt_ms": 0,
            "age_ms": i * 1000,
            "last_reply": "451 4.3.0 Try again later",
        }
        for i in range(min(n // 100, 100_000))
    ]
    write_rows(directory / QUEUE_DIR / (QUEUE_STEM + fmt.suffix), queue_rows, QUEUE_COLUMNS, fmt)
    save(directory, Watermark(fmt, int(time_ms[-1]) << COUNTER_BITS, n))


class TreeCpu:
    """CPU seconds (user + system) of a process and all its descendants, sampled from /proc
    while they run: the JVM that PySpark starts is never waited for by this process, so
    getrusage(RUSAGE_CHILDREN) would not count it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, float] = {}
        self.tick = os.sysconf("SC_CLK_TCK")

    def _stat(self, pid: int) -> list[str] | None:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        return text[text.rindex(")") + 2 :].split()

    def sample(self) -> None:
        todo = [self.pid]
        while todo:
            pid = todo.pop()
            fields = self._stat(pid)
            if fields is None:
                continue
            self.seen[pid] = (int(fields[11]) + int(fields[12])) / self.tick
            # every thread's children: the job starts its JVM from a worker thread
            for task in Path(f"/proc/{pid}/task").glob("*"):
                with contextlib.suppress(OSError):
                    todo.extend(int(k) for k in (task / "children").read_text().split())

    @property
    def seconds(self) -> float:
        return sum(self.seen.values())


PHASE_LOGGER = "zoneq.analytics.job DEBUG "
CACHE_MODES = ("off", "first", "cached")


def run_report(
    directory: Path, out: Path, cache: Path | None
) -> tuple[float, float, str, list[str]]:
    """Wall seconds, CPU seconds (the process and its JVM, user + system), its summary and
    its phase lines.  ``cache``: the class-cache directory, None for ``--no-class-cache``.

    On a shared machine the wall time depends on the others' load; the CPU time much less,
    so both are printed (2 cores: a run needs at least CPU / 2 seconds of wall time)."""
    started = time.monotonic()
    cache_args = ["--no-class-cache"] if cache is None else ["--class-cache", str(cache)]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zoneq",
            "--log-level",
            "DEBUG",
            "analytics",
            str(directory),
            "--out",
            str(out),
            *cache_args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    cpu = TreeCpu(process.pid)
    deadline = started + 1800
    while process.poll() is None and time.monotonic() < deadline:
        cpu.sample()
        time.sleep(0.1)
    if process.poll() is None:
        process.kill()
    stdout, stderr = process.communicate()
    elapsed = time.monotonic() - started
    if process.returncode != 0:
        raise SystemExit(f"zoneq analytics failed:\n{stderr[-2000:]}")
    phases = [
        line.split(PHASE_LOGGER, 1)[1] for line in stderr.splitlines() if PHASE_LOGGER in line
    ]
    return elapsed, cpu.seconds, stdout.strip(), phases


ARCHIVE_STATE = {
    "off": "fully cold JVM, no class-data archive (a machine never set up)",
    "first": "records the class-data archive, as tools/dev's set-up does once",
    "cached": "maps the archive: what a set-up machine runs",
}


def reusable(directory: Path, n: int, fmt: Format) -> bool:
    """Whether ``directory`` holds a complete generated export of ``n`` events in ``fmt``
    (its watermark is written last)."""
    try:
        mark = load(directory)
    except ExportError:
        return False
    if mark is None or mark.fmt is not fmt or mark.events != n:
        return False
    # an export generated before the event schema's current version is made again
    part = next((directory / EVENTS_DIR).rglob(f"part-*{fmt.suffix}"), None)
    if part is None:
        return False
    if fmt is Format.PARQUET:
        return "category" in pq.read_schema(part).names
    with part.open(encoding="utf-8") as lines:
        return json.loads(lines.readline()).get("v") == EVENT_VERSION


Result = tuple[int, str, str, float, float, float, float, float]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--formats", nargs="+", default=["parquet", "jsonl"])
    parser.add_argument("--dir", type=Path, default=None, help="where to generate (default: tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the generated exports")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="use an export already in --dir (same count and format) instead of generating "
        "it again; implies --keep",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of each mode, alternating")
    parser.add_argument(
        "--class-cache",
        nargs="+",
        choices=CACHE_MODES,
        default=list(CACHE_MODES),
        help="runs per export: off (no class-data archive), first (records it), cached",
    )
    parser.add_argument(
        "--class-cache-dir",
        type=Path,
        default=None,
        help="class-data archive directory to use (default: one in --dir, made by 'first')",
    )
    return parser


def _prepare(directory: Path, n: int, fmt: Format, reuse: bool) -> tuple[float, int]:
    """The export in ``directory`` generated (or reused); seconds spent and its bytes."""
    started = time.monotonic()
    if not (reuse and reusable(directory, n, fmt)):
        shutil.rmtree(directory, ignore_errors=True)
        generate(n, directory, fmt)
    generated = time.monotonic() - started
    return generated, sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _run_modes(
    args: argparse.Namespace, directory: Path, out: Path, cache: Path
) -> list[tuple[str, float, float, float]]:
    """Each ``--class-cache`` mode ``--repeat`` times in turn: (mode, wall s, cpu s, load)."""
    done = []
    for _ in range(args.repeat):
        for mode in args.class_cache:
            archives = list(cache.glob("*.jsa"))
            if mode == "first":
                for archive in archives:
                    archive.unlink()
            elif mode == "cached" and not archives:
                print("      (no class-data archive yet: this run records it)")
            seconds, cpu, said, phases = run_report(
                directory, out, None if mode == "off" else cache
            )
            load_1m = os.getloadavg()[0]
            done.append((mode, seconds, cpu, load_1m))
            print(
                f"  {directory.name:>22} {mode:7} report {seconds:6.1f} s, cpu {cpu:5.1f} s, "
                f"load {load_1m:.2f} ({ARCHIVE_STATE[mode]})"
            )
            print(f"      {said}")
            print("".join(f"      {phase}\n" for phase in phases), end="", flush=True)
    return done


def _summary(results: list[Result], repeat: int) -> None:
    print()
    print(
        f"{'events':>12} {'format':8} {'classes':7} {'export MB':>10} {'generate s':>11} "
        f"{'report s':>9} {'cpu s':>7} {'load 1m':>7}"
    )
    for n, name, mode, size, generated, seconds, cpu, load_1m in results:
        print(
            f"{n:>12,} {name:8} {mode:7} {size / 1e6:>10.1f} {generated:>11.1f} "
            f"{seconds:>9.1f} {cpu:>7.1f} {load_1m:>7.2f}"
        )
    if repeat > 1:
        print("medians:")
        for key in dict.fromkeys(r[:3] for r in results):
            runs = [r for r in results if r[:3] == key]
            print(
                f"{key[0]:>12,} {key[1]:8} {key[2]:7} report "
                f"{statistics.median(r[5] for r in runs):6.1f} s, cpu "
                f"{statistics.median(r[6] for r in runs):5.1f} s, load "
                f"{statistics.median(r[7] for r in runs):.2f} ({ARCHIVE_STATE[key[2]]})"
            )
    keys = ("events", "format", "class_cache", "report_s", "cpu_s", "load_1m")
    rows = [(r[0], r[1], r[2], round(r[5], 2), round(r[6], 2), round(r[7], 2)) for r in results]
    print(json.dumps([dict(zip(keys, row, strict=True)) for row in rows]))


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    if args.reuse and args.dir is None:
        parser.error("--reuse needs --dir")
    keep = args.keep or args.reuse
    base = args.dir or Path(tempfile.mkdtemp(prefix="zoneq-analytics-bench-"))
    # one archive serves every size and format (it holds classes, not data)
    cache = args.class_cache_dir or base / "class-cache"
    load_avg = os.getloadavg()
    print(
        f"cores: {os.cpu_count()}, load average before: "
        f"{load_avg[0]:.2f} {load_avg[1]:.2f} {load_avg[2]:.2f}"
    )
    results: list[Result] = []
    try:
        for n in args.events:
            for name in args.formats:
                directory = base / f"export-{n}-{name}"
                generated, size = _prepare(directory, n, Format(name), args.reuse)
                out = base / f"report-{n}-{name}"
                for mode, seconds, cpu, load_1m in _run_modes(args, directory, out, cache):
                    results.append((n, name, mode, size, generated, seconds, cpu, load_1m))
                if not keep:
                    shutil.rmtree(directory, ignore_errors=True)
    finally:
        if not keep and args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    _summary(results, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
