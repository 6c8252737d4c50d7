"""Delivery benchmark: how fast zoneq empties its queue into a fast SMTP server.

Prints, in one run (figures depend on the machine; compare the ratio):

1. N queued 1 KB messages, one recipient each, spread over D domains (every domain MX'ed
   by dnsmasq to one Postfix smtp-sink on 127.0.0.x), delivered by zoneq: messages/s from
   the first job leased to the queue being empty.  The messages are all committed before
   the core (queue service, IPC server, supervisor and its ``python -m zoneq worker``
   processes) starts, and no job is handed out until every worker process has connected
   (a start gate: a worker's start-up, mostly imports, would otherwise overlap the first
   seconds of delivery and be counted in its CPU), so the figure is delivery alone.  Next
   to it, Postfix's smtp-source sends the same number of 1 KB messages straight to the
   same kind of smtp-sink, one message per connection as zoneq does, with as many parallel
   sessions as zoneq has connections: the ceiling with no queue at all.  The ratio of the
   two is printed.
2. One message with R recipients over the same D domains: seconds from the workers' start
   until the queue is empty.

With them: the worker processes and connections, the CPU count, and the CPU seconds each
party (core, workers, smtp-sink, smtp-source) spent in each phase from the start gate on,
also per message, to show where time goes; the workers' start-up CPU is shown apart.

The core runs in this process as ``zoneq serve`` builds and runs it (the store opened from
the config, the service with the config's delivery limits, on uvloop), on a config written
to a temporary directory; the DNS answers carry a TTL (``--dns-ttl``) as real ones do, so
workers cache them.  smtp-sink dumps nothing (no ``-d``) and has a large listen backlog.
Each phase is bounded (``--timeout``): past it, what was delivered so far is reported and
the exit status is 1.  A missing test-bed program (smtp-sink, smtp-source from
``$ZONEQ_TESTBED``, default the repository's ``.testbed``; dnsmasq) exits with status 77,
saying what is missing.

    python tools/bench/delivery_bench.py [--messages 10000] [--processes 2]
        [--connections 10] [--domains 100] [--bulk-recipients N] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import dns.exception
import dns.message
import dns.query
import uvloop

from zoneq.config import Config, load_config
from zoneq.ipc.core import QueueHandler
from zoneq.ipc.server import IpcServer
from zoneq.queue.service import QueueService
from zoneq.runtime import now_ms, open_store
from zoneq.storage.records import MessageMeta, NewRecipient, State
from zoneq.storage.store import QueueStore
from zoneq.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
EXIT_MISSING = 77  # the test bed is incomplete (the automake "skipped" status)
ZONE = "default"
SENDER = "sender@src.test"
SINK_BACKLOG = 1024
MESSAGE_SIZE = 1024
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
POLL_S = 0.02


def message_body(size: int = MESSAGE_SIZE) -> bytes:
    head = (
        b"From: sender@src.test\r\nTo: bench@bench.test\r\nSubject: delivery bench\r\n"
        b"Message-ID: <bench@src.test>\r\n\r\n"
    )
    filler = size - len(head) - 2
    lines = [b"x" * 76] * (filler // 78)
    body = head + b"\r\n".join(lines) + b"\r\n"
    return body + b"y" * max(0, size - len(body) - 2) + b"\r\n"


BODY = message_body()


class Missing(Exception):
    """A test-bed program is not installed."""


# --- the test bed ------------------------------------------------------------------------


def testbed() -> Path:
    return Path(os.environ.get("ZONEQ_TESTBED") or ROOT / ".testbed")


def postfix_tool(name: str) -> Path:
    binary = testbed() / "postfix" / "usr" / "sbin" / name
    if not os.access(binary, os.X_OK):
        raise Missing(f"{name} not found at {binary} (set ZONEQ_TESTBED or run tools/dev test)")
    return binary


def postfix_env(binary: Path) -> dict[str, str]:
    return dict(os.environ, LD_LIBRARY_PATH=str(binary.parents[2] / "usr" / "lib" / "postfix"))


def dnsmasq_binary() -> str:
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])
    found = shutil.which("dnsmasq", path=search)
    if found is None:
        raise Missing("dnsmasq is not installed (Debian/Ubuntu: apt-get install dnsmasq-base)")
    return found


class Processes:
    """Every child started here, stopped by its PID (TERM, then KILL if it lingers)."""

    def __init__(self) -> None:
        self._children: list[subprocess.Popen[bytes]] = []

    def start(self, command: list[str], log: Path, env: dict[str, str] | None = None):
        with log.open("ab") as out:
            child = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        self._children.append(child)
        return child

    @staticmethod
    def stop(child: subprocess.Popen[bytes]) -> None:
        if child.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=STOP_TIMEOUT_S)

    def stop_all(self) -> None:
        for child in reversed(self._children):
            self.stop(child)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (Linux /proc; 0.0 where unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def free_port(host: str, udp: bool = False) -> int:
    with socket.socket() as tcp:
        tcp.bind((host, 0))
        port = int(tcp.getsockname()[1])
        if udp:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.bind((host, port))
        return port


def start_sink(procs: Processes, host: str, directory: Path) -> tuple[int, int]:
    """smtp-sink on ``host``, no dump, a large backlog; returns its port and PID."""
    binary = postfix_tool("smtp-sink")
    privileges = ["-u", "nobody"] if os.geteuid() == 0 else []
    log = directory / "smtp-sink.log"
    for _attempt in range(5):  # the free port may be taken between probe and bind
        port = free_port(host)
        command = [str(binary), *privileges, f"{host}:{port}", str(SINK_BACKLOG)]
        child = procs.start(command, log, postfix_env(binary))
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and child.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection((host, port), 0.5):
                return port, child.pid  # smtp-sink sees a connection that closes at once: harmless
            time.sleep(0.05)
        procs.stop(child)
    raise RuntimeError(f"smtp-sink would not start: {log.read_text(errors='replace')}")


def start_dnsmasq(procs: Processes, records: list[str], directory: Path, ttl: int) -> int:
    """dnsmasq on 127.0.0.1 answering ``records`` (nothing forwarded); returns its port."""
    binary = dnsmasq_binary()
    for attempt in range(3):
        port = free_port("127.0.0.1", udp=True)
        conf = directory / "dnsmasq.conf"
        lines = [
            f"port={port}",
            "listen-address=127.0.0.1",
            "bind-interfaces",
            "no-resolv",
            "no-hosts",
            "local=/test/",
            f"local-ttl={ttl}",  # dnsmasq's default is 0: nothing would be cached
            f"pid-file={directory / 'dnsmasq.pid'}",
            "log-facility=-",
            *records,
        ]
        conf.write_text("\n".join(lines) + "\n")
        log = directory / f"dnsmasq-{attempt}.log"
        child = procs.start([binary, "--keep-in-foreground", f"--conf-file={conf}"], log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and child.poll() is None:
            query = dns.message.make_query("probe.test.", "A")
            with contextlib.suppress(OSError, dns.exception.DNSException):
                dns.query.udp(query, "127.0.0.1", port=port, timeout=0.2)
                return port
            time.sleep(0.05)
        procs.stop(child)
    raise RuntimeError("dnsmasq would not start")


# --- the phases --------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    expected: int  # messages (or recipients) to deliver
    delivered: int = 0
    seconds: float = 0.0
    complete: bool = False
    note: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.delivered / self.seconds if self.seconds > 0 else 0.0


def run_smtp_source(
    host: str, port: int, *, sink_pid: int, messages: int, sessions: int, timeout: float
) -> Phase:
    binary = postfix_tool("smtp-source")
    phase = Phase("smtp-source", messages)
    command = [
        str(binary),
        "-c",  # a running count of completed DATA commands, for a timeout's report
        "-s",
        str(sessions),
        "-m",
        str(messages),
        "-l",
        str(MESSAGE_SIZE),
        "-M",
        "bench.test",
        "-f",
        SENDER,
        "-t",
        "user@d0.test",
        f"{host}:{port}",
    ]
    sink_before = cpu_seconds(sink_pid)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            env=postfix_env(binary),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        output, code = done.stdout, done.returncode
        phase.complete = code == 0
        if code != 0:
            phase.note = f"exit {code}: {done.stderr.decode(errors='replace').strip()[-200:]}"
    except subprocess.TimeoutExpired as late:  # run() has killed it by its PID
        output = late.stdout or b""
        phase.note = f"timed out after {timeout:.0f} s"
    phase.seconds = time.perf_counter() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    phase.extra["cpu_smtp_source"] = (
        children.ru_utime + children.ru_stime - children_before.ru_utime - children_before.ru_stime
    )
    phase.extra["cpu_smtp_sink"] = cpu_seconds(sink_pid) - sink_before
    counts = re.findall(rb"\d+", output)
    phase.delivered = int(counts[-1]) if counts else 0
    if phase.complete:
        phase.delivered = messages  # -c counts at the end of DATA; exit 0 means all went
    return phase


def write_config(directory: Path, args: argparse.Namespace, sink_port: int, dns_port: int):
    path = directory / "zones.toml"
    path.write_text(
        f"""
[server]
hostname = "mx.zoneq.test"
data_dir = "{directory / "queue"}"
ipc_socket = "{directory / "zoneq.sock"}"

[storage]
min_free = "0"
reserve = "0"

[delivery]
mx_port = {sink_port}
nameservers = ["127.0.0.1"]
dns_port = {dns_port}
dns_timeout = "5s"
allow_loopback_mx = true
tls = "none"

[zones.{ZONE}]
processes = {args.processes}
connections = {args.connections}

[zones.bounces]
processes = 1
connections = 2
"""
    )
    return path


async def commit_all(store: QueueStore, messages: list[list[str]]) -> None:
    """Commit every message (synced group commits, many in flight at once)."""
    batch = 500
    for start in range(0, len(messages), batch):
        pending = []
        for recipients in messages[start : start + batch]:
            msg_id = store.begin(now_ms())
            meta = MessageMeta(msg_id, SENDER, len(BODY), 1, now_ms())
            rcpts = [NewRecipient(address, ZONE) for address in recipients]
            pending.append(store.commit(meta, rcpts, now_ms(), tail=BODY))
        await asyncio.gather(*pending)


def outcome_counts(store: QueueStore) -> tuple[Counter[str], int, int, Counter[str]]:
    """Event kinds, the first and last delivery times (ms) of the zone, and the replies of
    deferrals and bounces (to say why a run did not finish)."""
    kinds: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    first, last = 0, 0
    for _, event in store.events():
        kinds[event.kind.value] += 1
        if event.kind.value in ("deferred", "bounced"):
            failures[f"{event.kind.value}: {event.text}"] += 1
        if event.kind.value == "delivered" and event.zone == ZONE:
            first = event.time_ms if not first else min(first, event.time_ms)
            last = max(last, event.time_ms)
    return kinds, first, last, failures


def timed_service(
    store: QueueStore, config: Config, gate: asyncio.Event
) -> tuple[QueueService, list[float]]:
    """The service as ``zoneq serve`` builds it, holding every lease until ``gate`` opens
    and noting when the first job is asked for after that."""
    service = QueueService.from_config(store, config, clock=now_ms)
    first_lease: list[float] = []
    lease = service.lease

    async def timed_lease(*a, **kw):  # observes the service; zoneq is unchanged
        if not gate.is_set():
            await gate.wait()
        if not first_lease:
            first_lease.append(time.perf_counter())
        return await lease(*a, **kw)

    service.lease = timed_lease  # type: ignore[method-assign]
    return service, first_lease


async def all_connected(server: IpcServer, workers: int, deadline: float) -> None:
    """Wait until ``workers`` worker processes are connected to the core (the start gate)."""
    while server.connection_count < workers:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"only {server.connection_count} of {workers} workers connected")
        await asyncio.sleep(POLL_S)


async def run_zoneq(
    name: str,
    config_path: Path,
    messages: list[list[str]],
    *,
    timeout: float,
    by_message: bool,
    sink_pid: int,
) -> Phase:
    """Commit ``messages``, then start the core and its workers; time until the queue empties.

    ``by_message``: the figure is from the first job leased (delivery starts) and counts
    messages; otherwise from the workers' start, counting recipients.
    """
    recipients = sum(len(r) for r in messages)
    phase = Phase(name, len(messages) if by_message else recipients)
    config = load_config(config_path)
    store = open_store(config)
    try:
        committed = time.perf_counter()
        await commit_all(store, messages)
        phase.extra["commit_seconds"] = time.perf_counter() - committed
        gate = asyncio.Event()
        service, first_lease = timed_service(store, config, gate)
        server = IpcServer(Path(config.server.ipc_socket), QueueHandler(service, set(config.zones)))
        await server.start()
        processes = {z: c.processes for z, c in config.zones.items()}
        supervisor = Supervisor(processes, config_path, 10)
        stop = asyncio.Event()
        started = time.perf_counter()
        await supervisor.start()
        promoter = asyncio.create_task(service.run(stop, interval_s=1.0))
        try:
            await all_connected(server, sum(processes.values()), started + timeout)
            workers = [p for n, p in supervisor.pids().items() if n.startswith(f"{ZONE}-")]
            startup = sum(cpu_seconds(pid) for pid in workers)
            sink_before = cpu_seconds(sink_pid)
            core_before = time.process_time()
            gate.set()
            phase.note = await until_empty(store, service, started + timeout)
            phase.complete = not phase.note
            finished = time.perf_counter()
            phase.extra["cpu_core"] = time.process_time() - core_before
            phase.extra["cpu_workers"] = sum(cpu_seconds(pid) for pid in workers) - startup
            phase.extra["cpu_smtp_sink"] = cpu_seconds(sink_pid) - sink_before
            phase.extra["workers_startup_cpu_seconds"] = startup
        finally:
            stop.set()
            await supervisor.stop()
            await server.close()
            await promoter
        if by_message:
            phase.delivered = len(messages) - store.message_count()
        else:
            left = (State.READY, State.DEFERRED, State.HELD)
            phase.delivered = recipients - sum(store.count(ZONE, state) for state in left)
        begin = first_lease[0] if (by_message and first_lease) else started
        phase.seconds = finished - begin
        account(phase, store, started, finished, first_lease)
    finally:
        await store.close()
    return phase


def account(
    phase: Phase, store: QueueStore, started: float, finished: float, first_lease: list[float]
) -> None:
    """The detail figures of a zoneq phase, and its outcomes from the event log."""
    kinds, first_ms, last_ms, failures = outcome_counts(store)
    if failures:
        reply, count = failures.most_common(1)[0]
        phase.note += f" (most common failure, {count}x: {reply[:120]})"
    phase.extra["workers_start_to_empty_seconds"] = finished - started
    phase.extra["start_to_first_lease_seconds"] = first_lease[0] - started if first_lease else -1
    phase.extra["first_to_last_delivery_seconds"] = (last_ms - first_ms) / 1000
    for kind in ("delivered", "deferred", "bounced"):
        phase.extra[f"events_{kind}"] = kinds[kind]


async def until_empty(store: QueueStore, service: QueueService, deadline: float) -> str:
    """Wait for an empty queue; '' then, else why not (timed out, or only retries left)."""
    stuck_since: float | None = None
    while store.message_count() > 0:
        now = time.perf_counter()
        if now > deadline:
            return "timed out"
        deferred = store.count(ZONE, State.DEFERRED)
        idle = (
            deferred
            and not store.count(ZONE, State.READY)
            and not store.leased(ZONE)
            and not service.in_flight()
        )
        if not idle:
            stuck_since = None
        elif stuck_since is None:
            stuck_since = now
        elif now - stuck_since > 2.0:
            return f"{deferred} recipient(s) deferred, nothing else to do"
        await asyncio.sleep(POLL_S)
    return ""


# --- the run -----------------------------------------------------------------------------


def layout(args: argparse.Namespace) -> tuple[list[list[str]], list[list[str]]]:
    singles = [[f"user{i}@d{i % args.domains}.test"] for i in range(args.messages)]
    bulk = [[f"rcpt{i}@d{i % args.domains}.test" for i in range(args.bulk_recipients)]]
    return singles, bulk


def table(args: argparse.Namespace, source: Phase, single: Phase, bulk: Phase | None) -> str:
    rows = [
        f"CPUs: {os.cpu_count()}; zone {ZONE}: {args.processes} worker process(es) x "
        f"{args.connections} connection(s) = {args.processes * args.connections}; "
        f"smtp-source sessions: {args.sessions}; domains: {args.domains}; "
        f"message size: {MESSAGE_SIZE} B",
        f"{'phase':<44}{'delivered':>13}{'seconds':>10}{'per second':>16}  note",
    ]
    for label, phase, unit in (
        ("smtp-source -> smtp-sink (no queue)", source, "msg"),
        (f"zoneq: {args.messages} queued messages", single, "msg"),
        (f"zoneq: 1 message x {args.bulk_recipients} recipients", bulk, "rcpt"),
    ):
        if phase is None:
            continue
        rows.append(
            f"{label:<44}{f'{phase.delivered}/{phase.expected}':>13}{phase.seconds:>10.2f}"
            f"{phase.rate:>11.0f} {unit:<4}  {phase.note}".rstrip()
        )
    s = single.extra
    if s:
        rows.append(
            f"  zoneq detail: workers start -> first lease {s['start_to_first_lease_seconds']:.2f}"
            f" s; -> empty (or given up) {s['workers_start_to_empty_seconds']:.2f} s;"
            f" first -> last delivery {s['first_to_last_delivery_seconds']:.2f} s;"
            " commit of the queue "
            f"{s['commit_seconds']:.2f} s (not timed)"
        )
    # zoneq's from the workers' start to the empty queue, the workers' start-up included.
    for label, phase in (("smtp-source", source), ("zoneq queued", single), ("zoneq bulk", bulk)):
        if phase is None or not phase.extra:
            continue
        cpu = ", ".join(
            f"{key.removeprefix('cpu_').replace('_', '-')} {value:.2f} s"
            f" ({value / max(1, phase.delivered) * 1000:.3f} ms each)"
            for key, value in phase.extra.items()
            if key.startswith("cpu_")
        )
        rows.append(f"  CPU seconds, {label}: {cpu}")
    if s:
        rows.append(
            f"  workers' start-up (imports, before the gate): "
            f"{s['workers_startup_cpu_seconds']:.2f} CPU s, not counted above"
        )
    ratio = single.rate / source.rate if source.rate else 0.0
    verdict = (
        "result:"
        if source.complete and single.complete and bulk and bulk.complete
        else ("result: INCOMPLETE")
    )
    bulk_text = f"in {bulk.seconds:.2f} s" if bulk and bulk.complete else "not finished"
    rows.append(
        f"{verdict} zoneq {single.rate:.0f} msg/s = {ratio:.1%} of smtp-source "
        f"{source.rate:.0f} msg/s; 1 message x {args.bulk_recipients} recipients "
        f"delivered {bulk_text}"
    )
    return "\n".join(rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--processes", type=int, default=2, help="worker processes of the zone")
    parser.add_argument(
        "--connections", type=int, default=10, help="connections per worker process"
    )
    parser.add_argument("--domains", type=int, default=100)
    parser.add_argument("--bulk-recipients", type=int, default=None, help="default: --messages")
    parser.add_argument(
        "--sessions", type=int, default=None, help="smtp-source sessions (default: connections)"
    )
    parser.add_argument("--dns-ttl", type=int, default=300, help="TTL of the DNS answers")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per phase")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.bulk_recipients is None:
        args.bulk_recipients = args.messages
    if args.sessions is None:
        args.sessions = args.processes * args.connections
    for name in ("messages", "processes", "connections", "domains", "bulk_recipients"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    procs = Processes()
    directory = Path(tempfile.mkdtemp(prefix="zoneq-dbench-"))
    try:
        try:
            postfix_tool("smtp-source")
            host = f"127.0.{random.randint(1, 250)}.{random.randint(2, 250)}"
            sink_port, sink_pid = start_sink(procs, host, directory)
            records = [f"host-record=mx.sink.test,{host}"]
            records += [f"mx-host=d{i}.test,mx.sink.test,10" for i in range(args.domains)]
            dns_port = start_dnsmasq(procs, records, directory, args.dns_ttl)
        except Missing as exc:
            print(exc, file=sys.stderr)
            return EXIT_MISSING
        config_path = write_config(directory, args, sink_port, dns_port)
        singles, bulk_messages = layout(args)

        source = run_smtp_source(
            host,
            sink_port,
            sink_pid=sink_pid,
            messages=args.messages,
            sessions=args.sessions,
            timeout=args.timeout,
        )
        limits = {"timeout": args.timeout, "sink_pid": sink_pid}
        single = uvloop.run(run_zoneq("queued", config_path, singles, by_message=True, **limits))
        bulk: Phase | None = None
        if single.complete:  # the queue directory is reused: start the bulk one afresh
            shutil.rmtree(directory / "queue", ignore_errors=True)
            bulk = uvloop.run(
                run_zoneq("bulk", config_path, bulk_messages, by_message=False, **limits)
            )
    finally:
        procs.stop_all()
        shutil.rmtree(directory, ignore_errors=True)

    print(table(args, source, single, bulk))
    if args.json is not None:
        report = {
            "cpus": os.cpu_count(),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "message_size": MESSAGE_SIZE,
            "phases": [asdict(p) | {"rate": p.rate} for p in (source, single, bulk) if p],
            "ratio": single.rate / source.rate if source.rate else None,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    ok = source.complete and single.complete and bulk is not None and bulk.complete
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
