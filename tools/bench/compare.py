"""zoneq next to Postfix, in one run on one machine: issue 7's workloads, side by side.

One command, as root (Postfix is installed with apt-get where missing, as accept_bench.py
does, and runs as a throwaway instance under a temporary directory):

    python tools/bench/compare.py [--messages 10000] [--big-messages 1000] [--sessions 10]
        [--bulk 10000] [--huge-mb 100] [--depth 100000] [--only 1,2,3,4,5] [--json PATH]

Both MTAs listen on 127.0.0.1 and relay to one Postfix smtp-sink on a 127.x address (zoneq
through dnsmasq's MX records, Postfix through ``relayhost``, an address: no DNS at all).
The DNS answers carry a TTL of ``--dns-ttl`` (300 s), as real MX records do (minutes to
hours); with dnsmasq's default of 0 nothing can be cached and each zoneq delivery would
ask three questions (MX, A, AAAA) that Postfix never asks.  The sink dumps each
transaction to a file, which is how a delivery is counted.  Each workload runs against
zoneq, then against Postfix, each on a fresh queue; every process started is stopped by its
PID (Postfix with ``postfix -c DIR stop``, then its master's PID).

1. ``--messages`` 1 KB messages over ``--sessions`` smtp-source sessions: accepts/s (the
   smtp-source run) and end-to-end messages/s, first accept to last delivery at the sink;
   and the ceiling, smtp-source straight into smtp-sink, in the same run.  smtp-source
   cannot say when its first 250 came, so a probe message of the same size goes first,
   over one session of this script, and the clock starts at its 250 (the same for both
   MTAs; the probe counts among the messages delivered).  Copies at the sink are told
   apart by (Message-ID, recipient), each smtp-source message having its own recipient
   (``-N``): only distinct ones count towards "all delivered", and the extra copies are
   reported as a figure of their own;
2. ``--big-messages`` messages of 100 KB, the same figures;
3. one message to ``--bulk`` recipients over 100 domains: seconds from the start of the
   client's session until every recipient has its copy, and the duplicate copies;
4. one ``--huge-mb`` MB message: seconds until delivered, and each zoneq process's peak
   anonymous memory (RssAnon) while it travels;
5. zoneq alone at ``--depth`` queued recipients (issue 7 says 1 million; the default is
   smaller because it takes long): a zone's count, the first browse page, the oldest ready
   recipient after 90 % were delivered, and ``zoneq serve``'s restart-to-ready time.

Delivery concurrency is the same on both sides unless told otherwise: zoneq's default zone
runs ``--processes`` worker processes x ``--connections`` connections, its domain limit
raised to their product (workload 1 and 2 go to one domain), and Postfix relays with
``default_destination_concurrency_limit`` set to that product (its relayhost is one
destination).  The JSON's ``machine`` records each side's settings: the concurrency,
whether zoneq syncs its commits (``storage.sync_commits``, read back from the config it
ran with) and the file system of each data directory (on tmpfs an fsync costs nothing).

Each phase is bounded (``--timeout``); a phase that ran out, or an MTA that would not
start, is reported with what it got (a note under the table and in the JSON) and the exit
status is 1.  A missing test-bed program exits with 77.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import smtplib
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for entry in (ROOT, ROOT / "tools" / "bench"):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

import accept_bench  # noqa: E402
from accept_bench import Missing, Phase, free_port, postconf, wait_listening  # noqa: E402

from tests.reliability.bed import SINK, Bed, mail_bed  # noqa: E402
from tests.support.ledger import parse_copy  # noqa: E402
from tests.support.serve import Serve, rss_anon_kib, smtp_port, start_serve  # noqa: E402
from tests.support.smtpsink import Sink  # noqa: E402
from zoneq.config.loader import load_config  # noqa: E402

SENDER = "a@src.test"
DOMAINS = 100
POLL_S = 0.1
HEAD_BYTES = 1 << 20  # of a dump: smtp-sink's fields and the message header
PEERS = ("zoneq", "postfix")


# --- counting at the sink --------------------------------------------------------------------


class SinkCounter:
    """Copies at the sink by (Message-ID, recipient), from complete dump files (each read
    once, its head only: a 100 MB copy's recipients and Message-ID are near the top)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.read: set[str] = set()  # dump files counted
        self.copies: Counter[tuple[str, str]] = Counter()

    def clear(self) -> None:
        for path in self.sink.dump_dir.glob("msg.*"):
            path.unlink(missing_ok=True)
        self.read.clear()
        self.copies.clear()

    def scan(self) -> tuple[int, int]:
        """(distinct (Message-ID, recipient) pairs delivered, extra copies of them)."""
        with os.scandir(self.sink.dump_dir) as entries:
            for entry in entries:
                if not entry.name.startswith("msg.") or entry.name in self.read:
                    continue
                with open(entry.path, "rb") as dump:
                    size = dump.seek(0, 2)
                    if size < 2:
                        continue
                    dump.seek(size - 2)
                    if dump.read(2) != b"\n\n":
                        continue  # still being written
                    dump.seek(0)
                    head = dump.read(HEAD_BYTES)
                self.read.add(entry.name)
                copy = parse_copy(head)
                self.copies.update((copy.message_id, r) for r in copy.recipients)
        return len(self.copies), self.copies.total() - len(self.copies)

    def wait(self, pairs: int, deadline: float) -> float | None:
        """Monotonic time at which ``pairs`` distinct pairs were in, None if the deadline
        came first."""
        while time.monotonic() < deadline:
            if self.scan()[0] >= pairs:
                return time.monotonic()
            time.sleep(POLL_S)
        return None


# --- the two MTAs ------------------------------------------------------------------------


def fresh(args: argparse.Namespace) -> Path:
    """A new directory for one MTA run, open to Postfix's own users (mkdtemp's is not)."""
    path = Path(tempfile.mkdtemp(dir=args.work))
    path.chmod(0o755)
    return path


def file_system(path: Path) -> str:
    """The type of the file system ``path`` is on (the longest mount point of /proc/mounts
    above it): on tmpfs an fsync costs nothing, so a figure means something else."""
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 3:
                continue
            # fstab(5) escapes: a space in a mount point is written \040.
            point = fields[1].encode().decode("unicode_escape")
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


@dataclass
class Mta:
    name: str
    port: int
    core: int | None  # zoneq serve's own PID (its workers are the other PIDs)
    pids: Callable[[], list[int]]  # for the memory samples (zoneq only)
    settings: dict[str, object]  # what the figures depend on, for the JSON and the notes


def concurrency(args: argparse.Namespace) -> int:
    return int(args.processes * args.connections)


def zoneq_config(bed: Bed, args: argparse.Namespace) -> Path:
    """The bed's config with the default zone's delivery as wide as Postfix's (``concurrency``
    connections, the domain limit no lower)."""
    total = concurrency(args)
    path = bed.config(
        connections=args.connections,
        storage={"min_free": '"0"', "reserve": '"0"'},
        receiver={"max_message_size": '"300MiB"', "max_recipients": "20000"},
        delivery={"domain_connections": str(total)},
    )
    text = path.read_text()
    zone = "[zones.default]\nprocesses = 1\n"
    if zone not in text:
        raise RuntimeError(f"no default zone to widen in {path}")
    path.write_text(text.replace(zone, f"[zones.default]\nprocesses = {args.processes}\n"))
    return path


@contextlib.contextmanager
def zoneq_running(bed: Bed, directory: Path, args: argparse.Namespace) -> Iterator[Mta]:
    directory.mkdir(parents=True)
    bed.directory = directory
    config = zoneq_config(bed, args)
    loaded = load_config(config)  # what the server reads, defaults included
    settings: dict[str, object] = {
        "delivery": f"{args.processes} processes x {args.connections} connections "
        f"= {concurrency(args)}, domain_connections {loaded.delivery.domain_connections}",
        "sync_commits": loaded.storage.sync_commits,
        "file_system": file_system(directory),
    }
    serve = start_serve(config, directory / "serve.log")
    try:
        serve.wait_ready(expected_workers=args.processes + 1)  # and the bounce zone's
        yield Mta(
            "zoneq", smtp_port(config), serve.pid, lambda: [serve.pid, *serve.workers()], settings
        )
    finally:
        serve.cleanup()


@contextlib.contextmanager
def postfix_running(sink: Sink, directory: Path, args: argparse.Namespace) -> Iterator[Mta]:
    warning = accept_bench.ensure_postfix()
    port = free_port()
    config_dir = accept_bench.setup_postfix(directory, port)
    postconf(
        config_dir,
        "-e",
        "smtpd_client_restrictions =",  # accept_bench holds every message; here they go on
        f"relayhost = [{sink.host}]:{sink.port}",
        "message_size_limit = 314572800",
        "smtpd_recipient_limit = 20000",
        # The relayhost is one destination: as many connections to it as zoneq opens.
        f"default_destination_concurrency_limit = {concurrency(args)}",
    )
    limits = subprocess.run(
        [
            *(accept_bench.POSTCONF, "-c", str(config_dir), "-x", "-h"),
            *("smtp_destination_concurrency_limit", "initial_destination_concurrency"),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()
    settings: dict[str, object] = {
        "delivery": f"smtp_destination_concurrency_limit {limits[0]} (slow start from "
        f"initial_destination_concurrency {limits[1]})",
        "sync_commits": True,  # Postfix fsyncs every queue file before its 250
        "file_system": file_system(directory),
    }
    if warning:
        settings["warning"] = warning
    master: int | None = None
    try:
        master = accept_bench.start_postfix(config_dir)
        if not wait_listening(port, time.monotonic() + 30):
            raise RuntimeError(f"postfix is not listening on {port}")
        yield Mta("postfix", port, master, list, settings)
    finally:
        accept_bench.stop_postfix(config_dir, master)


@contextlib.contextmanager
def peer(name: str, bed: Bed, args: argparse.Namespace) -> Iterator[Mta]:
    directory = fresh(args)
    if name == "zoneq":
        with zoneq_running(bed, directory / "zoneq", args) as mta:
            args.peers[name] = mta.settings
            yield mta
    else:
        with postfix_running(bed.sink, directory / "postfix", args) as mta:
            args.peers[name] = mta.settings
            yield mta


# --- the loads -----------------------------------------------------------------------------


@dataclass
class Figure:
    workload: str
    figure: str
    unit: str
    values: dict[str, float | None] = field(default_factory=dict)
    better: str = "higher"  # or "lower"
    notes: list[str] = field(default_factory=list)  # why a value is missing

    def ratio(self) -> float | None:
        z, p = self.values.get("zoneq"), self.values.get("postfix")
        if not z or not p:
            return None
        return z / p if self.better == "higher" else p / z


@contextlib.contextmanager
def noted(who: str, *figures: Figure) -> Iterator[None]:
    """One MTA's phase: if it fails (the MTA does not start, a client or a wait breaks),
    the failure goes in the figures' notes, their missing values are None (exit status 1),
    and the run goes on with the next phase.  A missing test-bed program still ends it."""
    try:
        yield
    except Missing:
        raise
    except Exception as exc:
        said = str(exc).strip().splitlines()
        for figure in figures:
            figure.values.setdefault(who, None)
            figure.notes.append(f"{who}: {type(exc).__name__}: {said[0] if said else ''}"[:300])


def source(host: str, port: int, args: argparse.Namespace, count: int, size: int) -> Phase:
    """smtp-source's ``count`` messages of ``size`` octets, each to its own recipient."""
    name = f"{count} x {size} B to {host}:{port}"
    return accept_bench.run_smtp_source(
        name, port, count, args.sessions, args.timeout, host=host, size=size, numbered=True
    )


def rate(run: Phase, figure: Figure, who: str) -> None:
    figure.values[who] = run.expected / run.seconds if run.complete else None
    if not run.complete:
        figure.notes.append(f"{who}: {run.accepted} of {run.expected} accepted; {run.note}")


def workload_rates(
    bed: Bed, counter: SinkCounter, args: argparse.Namespace, *, name: str, count: int, size: int
) -> list[Figure]:
    accept = Figure(name, "accepts/s", "msg/s")
    e2e = Figure(name, "end to end", "msg/s")
    extra = Figure(name, "duplicate copies at the sink", "copies", better="lower")
    ceiling = Figure(name, "smtp-source -> smtp-sink", "msg/s")
    counter.clear()
    with noted("sink", ceiling):
        rate(source(bed.sink.host, bed.sink.port, args, count, size), ceiling, "sink")
    probe = accept_bench.message_body(size)
    for who in PEERS:
        counter.clear()
        with noted(who, accept, e2e, extra), peer(who, bed, args) as mta:
            first = send_one(mta.port, ["probe@ok.test"], probe, args.timeout)
            run = source("127.0.0.1", mta.port, args, count, size)
            rate(run, accept, who)
            wanted = run.accepted + 1 if first is not None else run.accepted
            deadline = (first or time.monotonic()) + args.timeout
            last = counter.wait(wanted, deadline)
            got, extra.values[who] = counter.scan()
            if first is None:
                e2e.notes.append(f"{who}: the probe was not accepted: no first accept to time")
            elif last is None:
                e2e.notes.append(f"{who}: {got} of {wanted} at the sink within {args.timeout} s")
            e2e.values[who] = got / (last - first) if run.complete and first and last else None
    return [accept, e2e, extra, ceiling]


def send_one(port: int, recipients: list[str], body: bytes, timeout: float) -> float | None:
    """One message over one session: the monotonic time its 250 came, or None (and why, on
    stderr) if it was not accepted."""
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=timeout) as client:
            client.sendmail(SENDER, recipients, body)
            return time.monotonic()
    except (smtplib.SMTPException, OSError) as exc:
        print(f"compare: not accepted: {exc}", file=sys.stderr)
        return None


def workload_bulk(bed: Bed, counter: SinkCounter, args: argparse.Namespace) -> list[Figure]:
    figure = Figure("3 bulk list", f"{args.bulk} recipients delivered", "s", better="lower")
    extra = Figure("3 bulk list", "duplicate copies at the sink", "copies", better="lower")
    recipients = [f"u{n}@d{n % DOMAINS}.test" for n in range(args.bulk)]
    head = b"From: a@src.test\r\nSubject: list\r\nMessage-ID: <bulk@src.test>\r\n\r\n"
    body = head + (b"x" * 78 + b"\r\n") * 25
    for who in PEERS:
        counter.clear()
        with noted(who, figure, extra), peer(who, bed, args) as mta:
            started = time.monotonic()
            sent = send_one(mta.port, recipients, body, args.timeout)
            last = counter.wait(args.bulk, started + args.timeout) if sent else None
            got, extra.values[who] = counter.scan()
            figure.values[who] = last - started if last else None
            if not last:
                figure.notes.append(f"{who}: {got} of {args.bulk} delivered")
    return [figure, extra]


class RssSampler(threading.Thread):
    """Peak RssAnon (KiB) per PID of ``pids()``, sampled every 50 ms until stopped."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.peak: dict[int, int] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.05):
            for pid in self.pids():
                kib = rss_anon_kib(pid)
                if kib is not None:
                    self.peak[pid] = max(self.peak.get(pid, 0), kib)


def roles(peak: dict[int, int], core: int | None) -> list[tuple[str, int]]:
    """(role, KiB) for each sampled PID: "core" is the server's own PID, whatever its
    number; the others are workers, numbered in PID order."""
    workers = sorted(pid for pid in peak if pid != core)
    named = [("core", peak[core])] if core in peak else []
    return named + [(f"worker {n}", peak[pid]) for n, pid in enumerate(workers, 1)]


def workload_huge(bed: Bed, counter: SinkCounter, args: argparse.Namespace) -> list[Figure]:
    size = args.huge_mb << 20
    line = b"y" * 76 + b"\r\n"
    head = b"From: a@src.test\r\nSubject: huge\r\nMessage-ID: <huge@src.test>\r\n\r\n"
    body = head + line * (size // len(line))
    figure = Figure("4 one huge message", f"{args.huge_mb} MB delivered", "s", better="lower")
    memory: list[Figure] = []
    for who in PEERS:
        counter.clear()
        with noted(who, figure), peer(who, bed, args) as mta:
            sampler = RssSampler(mta.pids)
            sampler.start()
            try:
                started = time.monotonic()
                sent = send_one(mta.port, ["big@ok.test"], body, args.timeout)
                last = counter.wait(1, started + args.timeout) if sent else None
            finally:
                sampler.halt.set()
                sampler.join()
            figure.values[who] = last - started if last else None
            for role, kib in roles(sampler.peak, mta.core):
                memory.append(
                    Figure(
                        "4 one huge message", f"{who} {role} peak RssAnon", "MiB", better="lower"
                    )
                )
                memory[-1].values[who] = kib / 1024
    return [figure, *memory]


def workload_depth(bed: Bed, args: argparse.Namespace) -> list[Figure]:
    """zoneq alone: ``args.depth`` recipients queued with the store, then timed reads."""
    from zoneq.runtime import now_ms
    from zoneq.storage.records import MessageMeta, NewRecipient, State
    from zoneq.storage.store import Outcome, QueueStore

    directory = fresh(args) / "zoneq"
    directory.mkdir()
    bed.directory = directory
    config = bed.config(storage={"min_free": '"0"', "reserve": '"0"'})
    queue = directory / "zoneq" / "queue"
    per_message = 1000
    body = b"From: a@src.test\r\nSubject: depth\r\n\r\nx\r\n"
    figures = {
        "count": Figure("5 depth (zoneq)", f"zone count at {args.depth}", "ms", better="lower"),
        "browse": Figure("5 depth (zoneq)", "first browse page (100)", "ms", better="lower"),
        "oldest": Figure(
            "5 depth (zoneq)", "oldest ready after 90 % delivered", "ms", better="lower"
        ),
        "restart": Figure("5 depth (zoneq)", "restart to ready", "s", better="lower"),
    }

    def timed(operation: Callable[[], object]) -> float:
        started = time.perf_counter()
        operation()
        return (time.perf_counter() - started) * 1000

    async def fill_and_drain() -> None:
        store = QueueStore.open(queue)
        store.recover()
        try:
            for first in range(0, args.depth, per_message):
                msg_id = store.begin(now_ms())
                meta = MessageMeta(msg_id, SENDER, len(body), 1, now_ms())
                rcpts = [
                    NewRecipient(f"u{n}@d{n % DOMAINS}.test", "default")
                    for n in range(first, min(first + per_message, args.depth))
                ]
                await store.commit(meta, rcpts, now_ms(), tail=body)
            figures["count"].values["zoneq"] = timed(lambda: store.count("default", State.READY))
            figures["browse"].values["zoneq"] = timed(lambda: store.browse("default", limit=100))
            done = 0
            while done < args.depth * 9 // 10:
                leases = store.lease("default", min(5000, args.depth * 9 // 10 - done), "bench")
                await asyncio.gather(
                    *(store.complete(lease, now_ms(), Outcome("250 ok")) for lease in leases)
                )
                done += len(leases)
            await store.drain()
            # A fresh store (as after a restart) has no low-water mark: the seek is the
            # honest figure for "the oldest ready recipient" at this depth of tombstones.
        finally:
            await store.close()
        fresh = QueueStore.open(queue)
        fresh.recover()
        try:
            figures["oldest"].values["zoneq"] = timed(lambda: fresh.lease("default", 1, "bench"))
        finally:
            await fresh.close()

    asyncio.run(fill_and_drain())
    started = time.monotonic()
    serve: Serve = start_serve(config, directory / "serve.log")
    try:
        serve.wait_ready(expected_workers=2, timeout=args.timeout)
        figures["restart"].values["zoneq"] = time.monotonic() - started
    finally:
        serve.cleanup()
    return list(figures.values())


# --- the run -------------------------------------------------------------------------------


def machine() -> dict[str, object]:
    load = os.getloadavg()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in load],
        "kernel": os.uname().release,
    }


def table(figures: list[Figure]) -> str:
    rows = [f"{'workload':<22} {'figure':<36} {'zoneq':>10} {'postfix':>10} {'ratio':>7}"]
    for f in figures:

        def cell(who: str, f: Figure = f) -> str:
            value = f.values.get(who)
            return "-" if value is None else f"{value:,.1f}"

        ratio = f.ratio()
        if "sink" in f.values:
            rows.append(f"{f.workload:<22} {f.figure:<36} {cell('sink'):>10} {'(ceiling)':>10}")
            continue
        shown = "-" if ratio is None else f"{ratio:.2f}x"
        rows.append(
            f"{f.workload:<22} {f.figure + ' (' + f.unit + ')':<36} "
            f"{cell('zoneq'):>10} {cell('postfix'):>10} {shown:>7}"
        )
    return "\n".join(rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--big-messages", type=int, default=1_000)
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument(
        "--processes", type=int, default=2, help="zoneq's worker processes (default zone)"
    )
    parser.add_argument(
        "--connections", type=int, default=10, help="zoneq's connections per worker process"
    )
    parser.add_argument("--bulk", type=int, default=10_000)
    parser.add_argument("--huge-mb", type=int, default=100)
    parser.add_argument("--depth", type=int, default=100_000, help="issue 7: 1000000")
    parser.add_argument("--only", default="1,2,3,4,5", help="workloads to run, e.g. 1,3")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per phase")
    parser.add_argument("--dns-ttl", type=int, default=300, help="TTL of the DNS answers")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    for name in ("messages", "big_messages", "sessions", "processes", "connections", "bulk"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    args.peers = {}  # each MTA's settings, as it last ran
    return args


def run_workloads(bed: Bed, args: argparse.Namespace, figures: list[Figure]) -> None:
    """The chosen workloads in turn, each one's figures added as soon as it is done."""
    only = {int(n) for n in args.only.split(",")}
    counter = SinkCounter(bed.sink)
    if 1 in only:
        figures += workload_rates(
            bed, counter, args, name="1 1 KB messages", count=args.messages, size=1024
        )
    if 2 in only:
        figures += workload_rates(
            bed, counter, args, name="2 100 KB messages", count=args.big_messages, size=100 << 10
        )
    if 3 in only:
        figures += workload_bulk(bed, counter, args)
    if 4 in only:
        figures += workload_huge(bed, counter, args)
    if 5 in only:
        figures += workload_depth(bed, args)


def report(info: dict[str, object], figures: list[Figure], args: argparse.Namespace) -> None:
    print(f"\nzoneq vs Postfix, {info}\n")
    print(table(figures))
    for who, settings in args.peers.items():
        print(f"  {who}: " + "; ".join(f"{k} {v}" for k, v in settings.items()))
    for f in figures:
        for note in f.notes:
            print(f"  {f.workload}, {f.figure}: {note}")
    if args.json:
        payload = {"machine": info, "figures": [asdict(f) | {"ratio": f.ratio()} for f in figures]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if os.geteuid() != 0:
        print("compare: must run as root (Postfix)", file=sys.stderr)
        return 1
    figures: list[Figure] = []
    info = machine()
    info["dns_ttl"] = args.dns_ttl
    begun = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zoneq-compare-") as work:
        args.work = work
        os.chmod(work, 0o755)  # Postfix's own users enter the spool under it
        remotes = {f"d{n}.test": SINK for n in range(DOMAINS)}
        try:
            # A long listen queue, as delivery_bench gives its sink: with smtp-sink's usual
            # 16, a burst of connections is refused and zoneq backs off from a busy host.
            with mail_bed(
                Path(work), port=None, remotes=remotes, backlog=1024, dns_ttl=args.dns_ttl
            ) as bed:
                run_workloads(bed, args, figures)
        except Missing as exc:
            print(f"compare: {exc}", file=sys.stderr)
            return 77
        except Exception as exc:  # the bed itself broke: report what was measured until then
            info["stopped_early"] = f"{type(exc).__name__}: {exc}"
            print(f"compare: the run stopped early: {info['stopped_early']}", file=sys.stderr)
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    info["seconds"] = round(time.monotonic() - begun, 1)
    info["peers"] = args.peers
    report(info, figures, args)
    incomplete = [f for f in figures if any(v is None for v in f.values.values())]
    return 1 if incomplete or "stopped_early" in info else 0


if __name__ == "__main__":
    sys.exit(main())
