"""zoneq next to Postfix, in one run on one machine: issue 7's workloads, side by side.

One command, as root (Postfix is installed with apt-get where missing, as accept_bench.py
does, and runs as a throwaway instance under a temporary directory):

    python tools/bench/compare.py [--messages 10000] [--big-messages 1000] [--sessions 10]
        [--bulk 10000] [--huge-mb 100] [--depth 100000] [--only 1,2,3,4,5] [--json PATH]

Both MTAs listen on 127.0.0.1 and relay to one Postfix smtp-sink on a 127.x address (zoneq
through dnsmasq's MX records, Postfix through ``relayhost``); the sink dumps each
transaction to a file, which is how a delivery is counted.  Each workload runs against
zoneq, then against Postfix, each on a fresh queue; every process started is stopped by its
PID (Postfix with ``postfix -c DIR stop``, then its master's PID).

1. ``--messages`` 1 KB messages over ``--sessions`` smtp-source sessions: accepts/s (the
   smtp-source run) and end-to-end messages/s (its start to the last copy at the sink);
   and the ceiling, smtp-source straight into smtp-sink, in the same run;
2. ``--big-messages`` messages of 100 KB, the same figures;
3. one message to ``--bulk`` recipients over 100 domains: seconds until all delivered;
4. one ``--huge-mb`` MB message: seconds until delivered, and each zoneq process's peak
   anonymous memory (RssAnon) while it travels;
5. zoneq alone at ``--depth`` queued recipients (issue 7 says 1 million; the default is
   smaller because it takes long): a zone's count, the first browse page, the oldest ready
   recipient after 90 % were delivered, and ``zoneq serve``'s restart-to-ready time.

Each phase is bounded (``--timeout``); a phase that ran out is reported with what it got
and the exit status is 1.  A missing test-bed program exits with 77.
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
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for entry in (ROOT, ROOT / "tools" / "bench"):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

import accept_bench  # noqa: E402
from accept_bench import Missing, free_port, postconf, wait_listening  # noqa: E402

from tests.reliability.bed import SINK, Bed, mail_bed  # noqa: E402
from tests.support.serve import Serve, rss_anon_kib, smtp_port, start_serve  # noqa: E402
from tests.support.smtpsink import Sink  # noqa: E402

SENDER = "a@src.test"
DOMAINS = 100
POLL_S = 0.1
PEERS = ("zoneq", "postfix")


# --- counting at the sink --------------------------------------------------------------------


class SinkCounter:
    """Complete transactions and recipients the sink has dumped (each file read once)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.done: dict[str, int] = {}  # file name -> recipients

    def clear(self) -> None:
        for path in self.sink.dump_dir.glob("msg.*"):
            path.unlink(missing_ok=True)
        self.done.clear()

    def scan(self) -> tuple[int, int]:
        with os.scandir(self.sink.dump_dir) as entries:
            for entry in entries:
                if not entry.name.startswith("msg.") or entry.name in self.done:
                    continue
                with open(entry.path, "rb") as dump:
                    size = dump.seek(0, 2)
                    if size < 2:
                        continue
                    dump.seek(size - 2)
                    if dump.read(2) != b"\n\n":
                        continue  # still being written
                    dump.seek(0)
                    head = dump.read(1 << 20)
                self.done[entry.name] = head.split(b"\nReceived: ", 1)[0].count(b"X-Rcpt-Args:")
        return len(self.done), sum(self.done.values())

    def wait(self, transactions: int, recipients: int, deadline: float) -> float | None:
        """Monotonic time at which both counts were reached, None if the deadline came."""
        while time.monotonic() < deadline:
            got = self.scan()
            if got[0] >= transactions and got[1] >= recipients:
                return time.monotonic()
            time.sleep(POLL_S)
        return None


# --- the two MTAs ------------------------------------------------------------------------


def fresh(args: argparse.Namespace) -> Path:
    """A new directory for one MTA run, open to Postfix's own users (mkdtemp's is not)."""
    path = Path(tempfile.mkdtemp(dir=args.work))
    path.chmod(0o755)
    return path


@dataclass
class Mta:
    name: str
    port: int
    pids: Callable[[], list[int]]  # for the memory samples (zoneq only)


@contextlib.contextmanager
def zoneq_running(bed: Bed, directory: Path, connections: int) -> Iterator[Mta]:
    directory.mkdir(parents=True)
    bed.directory = directory
    config = bed.config(
        connections=connections,
        storage={"min_free": '"0"', "reserve": '"0"'},
        receiver={"max_message_size": '"300MiB"', "max_recipients": "20000"},
    )
    serve = start_serve(config, directory / "serve.log")
    try:
        serve.wait_ready(expected_workers=2)
        yield Mta("zoneq", smtp_port(config), lambda: [serve.pid, *serve.workers()])
    finally:
        serve.cleanup()


@contextlib.contextmanager
def postfix_running(sink: Sink, directory: Path) -> Iterator[Mta]:
    accept_bench.ensure_postfix()
    port = free_port()
    config_dir = accept_bench.setup_postfix(directory, port)
    postconf(
        config_dir,
        "-e",
        "smtpd_client_restrictions =",  # accept_bench holds every message; here they go on
        f"relayhost = [{sink.host}]:{sink.port}",
        "message_size_limit = 314572800",
        "smtpd_recipient_limit = 20000",
    )
    master: int | None = None
    try:
        subprocess.run(
            [accept_bench.POSTFIX, "-c", str(config_dir), "start"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        master = accept_bench.postfix_master_pid(config_dir)
        if not wait_listening(port, time.monotonic() + 30):
            raise RuntimeError(f"postfix is not listening on {port}")
        yield Mta("postfix", port, list)
    finally:
        accept_bench.stop_postfix(config_dir, master)


@contextlib.contextmanager
def peer(name: str, bed: Bed, directory: Path, connections: int) -> Iterator[Mta]:
    if name == "zoneq":
        with zoneq_running(bed, directory / "zoneq", connections) as mta:
            yield mta
    else:
        with postfix_running(bed.sink, directory / "postfix") as mta:
            yield mta


# --- the loads -----------------------------------------------------------------------------


def smtp_source(
    host: str, port: int, *, messages: int, size: int, sessions: int, timeout: float
) -> tuple[float, bool]:
    """Postfix's smtp-source: (seconds, completed)."""
    binary = accept_bench.smtp_source()
    command = [
        *(str(binary), "-s", str(sessions), "-m", str(messages), "-l", str(size)),
        *("-f", SENDER, "-t", "b@ok.test", f"{host}:{port}"),
    ]
    started = time.monotonic()
    done = subprocess.run(
        command,
        env=accept_bench.postfix_env(binary),
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    return time.monotonic() - started, done.returncode == 0


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


def workload_rates(
    bed: Bed, counter: SinkCounter, args: argparse.Namespace, *, name: str, count: int, size: int
) -> list[Figure]:
    accept = Figure(name, "accepts/s", "msg/s")
    e2e = Figure(name, "end to end", "msg/s")
    ceiling = Figure(name, "smtp-source -> smtp-sink", "msg/s")
    counter.clear()
    load: dict[str, Any] = {
        "messages": count,
        "size": size,
        "sessions": args.sessions,
        "timeout": args.timeout,
    }
    seconds, ok = smtp_source(bed.sink.host, bed.sink.port, **load)
    ceiling.values["sink"] = count / seconds if ok else None
    for who in PEERS:
        counter.clear()
        with peer(who, bed, fresh(args), args.connections) as mta:
            started = time.monotonic()
            seconds, ok = smtp_source("127.0.0.1", mta.port, **load)
            accept.values[who] = count / seconds if ok else None
            last = counter.wait(count, count, started + args.timeout)
            e2e.values[who] = count / (last - started) if ok and last else None
            if not last:
                got = counter.scan()[0]
                e2e.notes.append(f"{who}: {got} of {count} at the sink within {args.timeout} s")
    return [accept, e2e, ceiling]


def send_one(port: int, recipients: list[str], body: bytes, timeout: float) -> bool:
    """One message over one session; False (and why, on stderr) if it was not accepted."""
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=timeout) as client:
            client.sendmail(SENDER, recipients, body)
    except (smtplib.SMTPException, OSError) as exc:
        print(f"compare: not accepted: {exc}", file=sys.stderr)
        return False
    return True


def workload_bulk(bed: Bed, counter: SinkCounter, args: argparse.Namespace) -> list[Figure]:
    figure = Figure("3 bulk list", f"{args.bulk} recipients delivered", "s", better="lower")
    recipients = [f"u{n}@d{n % DOMAINS}.test" for n in range(args.bulk)]
    body = b"From: a@src.test\r\nSubject: list\r\n\r\n" + (b"x" * 78 + b"\r\n") * 25
    for who in PEERS:
        counter.clear()
        with peer(who, bed, fresh(args), args.connections) as mta:
            started = time.monotonic()
            sent = send_one(mta.port, recipients, body, args.timeout)
            last = counter.wait(1, args.bulk, started + args.timeout) if sent else None
            figure.values[who] = last - started if last else None
    return [figure]


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


def workload_huge(bed: Bed, counter: SinkCounter, args: argparse.Namespace) -> list[Figure]:
    size = args.huge_mb << 20
    line = b"y" * 76 + b"\r\n"
    body = b"From: a@src.test\r\nSubject: huge\r\n\r\n" + line * (size // len(line))
    figure = Figure("4 one huge message", f"{args.huge_mb} MB delivered", "s", better="lower")
    memory: list[Figure] = []
    for who in PEERS:
        counter.clear()
        with peer(who, bed, fresh(args), args.connections) as mta:
            sampler = RssSampler(mta.pids)
            sampler.start()
            started = time.monotonic()
            sent = send_one(mta.port, ["big@ok.test"], body, args.timeout)
            last = counter.wait(1, 1, started + args.timeout) if sent else None
            sampler.halt.set()
            sampler.join()
            figure.values[who] = last - started if last else None
            for n, pid in enumerate(sorted(sampler.peak)):
                role = "core" if n == 0 else f"worker {n}"
                memory.append(
                    Figure(
                        "4 one huge message", f"{who} {role} peak RssAnon", "MiB", better="lower"
                    )
                )
                memory[-1].values[who] = sampler.peak[pid] / 1024
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
    parser.add_argument("--connections", type=int, default=10, help="zoneq's per zone")
    parser.add_argument("--bulk", type=int, default=10_000)
    parser.add_argument("--huge-mb", type=int, default=100)
    parser.add_argument("--depth", type=int, default=100_000, help="issue 7: 1000000")
    parser.add_argument("--only", default="1,2,3,4,5", help="workloads to run, e.g. 1,3")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per phase")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if os.geteuid() != 0:
        print("compare: must run as root (Postfix)", file=sys.stderr)
        return 1
    only = {int(n) for n in args.only.split(",")}
    figures: list[Figure] = []
    info = machine()
    begun = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zoneq-compare-") as work:
        args.work = work
        os.chmod(work, 0o755)  # Postfix's own users enter the spool under it
        remotes = {f"d{n}.test": SINK for n in range(DOMAINS)}
        try:
            # A long listen queue, as delivery_bench gives its sink: with smtp-sink's usual
            # 16, a burst of connections is refused and zoneq backs off from a busy host.
            with mail_bed(Path(work), port=None, remotes=remotes, backlog=1024) as bed:
                counter = SinkCounter(bed.sink)
                if 1 in only:
                    figures += workload_rates(
                        bed, counter, args, name="1 1 KB messages", count=args.messages, size=1024
                    )
                if 2 in only:
                    figures += workload_rates(
                        bed,
                        counter,
                        args,
                        name="2 100 KB messages",
                        count=args.big_messages,
                        size=100 * 1024,
                    )
                if 3 in only:
                    figures += workload_bulk(bed, counter, args)
                if 4 in only:
                    figures += workload_huge(bed, counter, args)
                if 5 in only:
                    figures += workload_depth(bed, args)
        except Missing as exc:
            print(f"compare: {exc}", file=sys.stderr)
            return 77
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    info["seconds"] = round(time.monotonic() - begun, 1)
    print(f"\nzoneq vs Postfix, {info}\n")
    print(table(figures))
    for f in figures:
        for note in f.notes:
            print(f"  {f.workload}, {f.figure}: {note}")
    if args.json:
        payload = {"machine": info, "figures": [asdict(f) | {"ratio": f.ratio()} for f in figures]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    incomplete = [f for f in figures if any(v is None for v in f.values.values())]
    return 1 if incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
