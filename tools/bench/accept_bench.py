"""Accept benchmark: durable 250s per second into zoneq, and the same load into Postfix.

Prints, in one run (figures depend on the machine; compare the ratio):

1. zoneq: ``python -m zoneq serve`` on a config in a temporary directory (the queue there,
   ``[receiver] listen`` on a free port of 127.0.0.1, commits synced as by default), then
   Postfix's smtp-source with ``--sessions`` sessions sending ``--messages`` 1 KB messages
   (one recipient each) to it.  The wall time of the whole smtp-source run gives
   accepts/s, and the CPU time of the server's process tree (receiver processes included)
   meanwhile gives CPU per message, a figure that other work on a shared machine disturbs
   far less than the rate.  ``--receivers 0,2`` runs this once per value of ``[receiver]
   processes`` (0: the receiver in the core; N: N receiver processes feeding the core over
   its intake socket), each compared with the Postfix run of the same round;
   ``--rounds R`` repeats every phase R times, interleaved, and prints each round's ratios
   and their median (the load of a shared machine drifts between phases).
   The queue is then opened after ``zoneq serve`` has stopped and its messages counted: a
   250 counts only if its message is there.
2. The p99 (and p50, max) time from sending the final dot to reading the 250, measured by
   a small client of this module, twice: "idle", ``--latency-messages`` messages in
   sequence over one connection, nothing else running; and "loaded", ``--load-clients``
   extra sessions of that client timing each of their messages while smtp-source's
   sessions run (they stop when smtp-source ends).  With group commit the loaded figure is
   the one that matters: a 250 waits for the sync of a group that other sessions fill.
   (The loaded clients add their sessions to smtp-source's; accepts/s counts
   smtp-source's messages only.)
3. Postfix (Debian's package; installed with apt-get if missing, it does not start by
   itself): a throwaway instance with its own configuration, queue and data directories
   under the temporary directory, smtpd alone on a free port of 127.0.0.1, and the same two
   loads.  Postfix fsyncs a queue file before its 250, as zoneq syncs its commit.  The
   accepted messages are counted in its queue afterwards.

Neither side delivers during the run, so the figure is accepting alone.  zoneq's workers
(one process, one connection per zone) are given a name server that never answers (a UDP
socket held open here) and a long DNS timeout: the one job leased waits, nothing else
happens.  Postfix holds every message (``check_client_access static:HOLD``): cleanup
writes it to the hold queue, which the queue manager leaves alone.

Each phase is bounded (``--timeout``): past it, what was accepted so far is reported and
the exit status is 1.  A missing test-bed program (smtp-source from ``$ZONEQ_TESTBED``,
default the repository's ``.testbed``) exits with status 77.  Must run as root (Postfix).
Every process started is stopped by its PID; Postfix with ``postfix -c DIR stop``.

    python tools/bench/accept_bench.py [--messages 10000] [--sessions 10]
        [--latency-messages 500] [--load-clients 2] [--receivers 0,1,2,3] [--rounds 1]
        [--timeout 300] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the repository's tests.support, for ``zoneq serve``

from tests.receiver.processes import start_receiver_serve  # noqa: E402
from tests.support.serve import Serve  # noqa: E402

EXIT_MISSING = 77  # the test bed is incomplete (the automake "skipped" status)
MESSAGE_SIZE = 1024
SENDER = "a@src.test"
RECIPIENT = "b@ok.test"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
IO_TIMEOUT_S = 30.0
POSTFIX = "/usr/sbin/postfix"
POSTCONF = "/usr/sbin/postconf"


class Missing(Exception):
    """A test-bed program is not installed."""


# --- helpers -----------------------------------------------------------------------------


def testbed() -> Path:
    return Path(os.environ.get("ZONEQ_TESTBED") or ROOT / ".testbed")


def smtp_source() -> Path:
    binary = testbed() / "postfix" / "usr" / "sbin" / "smtp-source"
    if not os.access(binary, os.X_OK):
        raise Missing(f"smtp-source not found at {binary} (set ZONEQ_TESTBED)")
    return binary


def postfix_env(binary: Path) -> dict[str, str]:
    return dict(os.environ, LD_LIBRARY_PATH=str(binary.parents[2] / "usr" / "lib" / "postfix"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_listening(port: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return True
        time.sleep(0.05)
    return False


def message_body(size: int = MESSAGE_SIZE) -> bytes:
    """A ``size``-byte message text (CRLF lines, none starting with a dot)."""
    head = (
        f"From: {SENDER}\r\nTo: {RECIPIENT}\r\nSubject: accept bench\r\n"
        "Message-ID: <accept-bench@src.test>\r\n\r\n"
    ).encode()
    lines = [b"x" * 76] * ((size - len(head) - 2) // 78)
    body = head + b"\r\n".join(lines) + b"\r\n"
    return body + b"y" * max(0, size - len(body) - 2) + b"\r\n"


@dataclass
class Phase:
    name: str
    expected: int
    accepted: int = 0  # 250s seen by the client
    stored: int = -1  # messages found in the queue afterwards (-1: not counted)
    delivery_events: int = -1  # zoneq: events logged by deliveries (should be few)
    cpu_seconds: float = -1.0  # CPU used by the server's processes during the load
    busiest_thread_seconds: float = -1.0  # of that, the busiest single thread's
    busiest_thread: str = ""  # the process it belongs to
    seconds: float = 0.0
    complete: bool = False
    note: str = ""
    latencies_ms: list[float] = field(default_factory=list, repr=False)

    @property
    def cpu_ms_per_message(self) -> float:
        return 1000 * self.cpu_seconds / self.accepted if self.accepted else 0.0

    @property
    def busiest_ms_per_message(self) -> float:
        return 1000 * self.busiest_thread_seconds / self.accepted if self.accepted else 0.0

    @property
    def rate(self) -> float:
        return self.accepted / self.seconds if self.seconds > 0 else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return 0.0
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict[str, object]:
        out = asdict(self) | {"rate": self.rate}
        del out["latencies_ms"]
        if self.latencies_ms:
            out |= {f"p{int(q * 100)}_ms": self.percentile(q) for q in (0.5, 0.99)}
            out["max_ms"] = max(self.latencies_ms)
        return out


# --- the loads ---------------------------------------------------------------------------


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU of ``root`` and every process below it, including their children
    that have exited and been waited for (``/proc/PID/stat`` fields 14-17).

    CPU per message is a figure that other work on the machine disturbs much less than
    the rate: compare it alongside the ratio on a busy machine.
    """
    parents: dict[int, int] = {}
    times: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry.name)] = int(fields[1])
            times[int(entry.name)] = sum(int(x) for x in fields[11:15])
    tree = _tree(root, parents)
    return sum(times.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


def _tree(root: int, parents: dict[int, int]) -> set[int]:
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    return tree


def thread_cpu_seconds(root: int) -> dict[tuple[int, int], float]:
    """User + system CPU of every thread of ``root``'s process tree, by (pid, tid).

    The busiest thread's CPU per message bounds the rate whatever the number of cores
    (1000 / its ms per message): one event loop serving every SMTP session is such a
    bound, and several receiver processes lift it.  Threads that exited during the run
    are not seen (Postfix's smtpd processes are reused, ``max_use``, so few are).
    """
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(fields[1])
    out: dict[tuple[int, int], float] = {}
    for pid in _tree(root, parents):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                    ticks = int(fields[11]) + int(fields[12])
                    out[(pid, int(task.name))] = ticks / os.sysconf("SC_CLK_TCK")
    return out


def run_measured(
    name: str, server_pid: int | None, port: int, args: argparse.Namespace
) -> tuple[Phase, Phase]:
    """``run_smtp_source``, with the CPU the server's process tree used meanwhile, and the
    end of DATA -> 250 times of ``--load-clients`` timed sessions running alongside."""
    server = name.split(maxsplit=1)[0]
    loaded = Phase(f"{server} loaded", 0)
    stop = threading.Event()
    timed = [Phase(f"{server} loaded {n}", args.messages) for n in range(args.load_clients)]
    clients = [
        threading.Thread(target=time_messages, args=(p, port, args.timeout, stop), daemon=True)
        for p in timed
    ]
    before = tree_cpu_seconds(server_pid) if server_pid is not None else 0.0
    threads = thread_cpu_seconds(server_pid) if server_pid is not None else {}
    for client in clients:
        client.start()
    try:
        phase = run_smtp_source(name, port, args.messages, args.sessions, args.timeout)
    finally:
        stop.set()
        for client in clients:
            client.join(IO_TIMEOUT_S * 2)  # each stops at its next message (socket timeouts)
    if server_pid is not None:
        phase.cpu_seconds = tree_cpu_seconds(server_pid) - before
        after = thread_cpu_seconds(server_pid)
        used = {key: after[key] - threads.get(key, 0.0) for key in after}
        if used:
            busiest = max(used, key=used.__getitem__)
            phase.busiest_thread_seconds = used[busiest]
            phase.busiest_thread = process_name(busiest[0])
    for one in timed:
        loaded.expected += one.accepted
        loaded.accepted += one.accepted
        loaded.latencies_ms += one.latencies_ms
        loaded.seconds = max(loaded.seconds, one.seconds)
        loaded.note = "; ".join(n for n in (loaded.note, one.note) if n)
    loaded.complete = bool(timed) and not any(c.is_alive() for c in clients) and not loaded.note
    return phase, loaded


def process_name(pid: int) -> str:
    """``zoneq receiver --name receiver-0`` and the like: whose thread was busiest."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    words = [w.decode(errors="replace") for w in argv if w]
    if "zoneq" in words:
        words = words[words.index("zoneq") :][:4]
    return " ".join(Path(words[0]).name if i == 0 else w for i, w in enumerate(words))


def run_smtp_source(
    name: str,
    port: int,
    messages: int,
    sessions: int,
    timeout: float,
    *,
    host: str = "127.0.0.1",
    size: int = MESSAGE_SIZE,
    numbered: bool = False,
) -> Phase:
    """smtp-source's run, bounded by ``timeout`` (then killed, and reported with the count
    it had printed).  ``numbered``: each message to its own recipient (``-N``: a sequence
    number before the local part), so that copies at a sink can be told apart: smtp-source's
    Message-Id (PID, file descriptor, a counter) may repeat."""
    binary = smtp_source()
    phase = Phase(name, messages)
    command = [
        str(binary),
        "-c",  # a running count of completed DATA commands, for a timeout's report
        *(["-N"] if numbered else []),
        "-s",
        str(sessions),
        "-m",
        str(messages),
        "-l",
        str(size),
        "-f",
        SENDER,
        "-t",
        RECIPIENT,
        f"{host}:{port}",
    ]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, env=postfix_env(binary), capture_output=True, timeout=timeout, check=False
        )
        output = done.stdout
        phase.complete = done.returncode == 0
        if done.returncode != 0:
            err = done.stderr.decode(errors="replace").strip()[-200:]
            phase.note = f"smtp-source exit {done.returncode}: {err}"
    except subprocess.TimeoutExpired as late:  # run() has killed it by its PID
        output = late.stdout or b""
        phase.note = f"timed out after {timeout:.0f} s"
    phase.seconds = time.perf_counter() - started
    counts = re.findall(rb"\d+", output)
    phase.accepted = int(counts[-1]) if counts else 0
    if phase.complete:
        phase.accepted = messages  # -c counts at the end of DATA; exit 0 means all went
    return phase


class _Client:
    """A minimal blocking SMTP client, enough to time the final dot."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), IO_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb")

    def reply(self) -> tuple[int, str]:
        lines = []
        while True:
            line = self.reader.readline(4096)
            if not line:
                raise ConnectionError("connection closed")
            lines.append(line.decode(errors="replace").rstrip())
            if line[3:4] != b"-":
                return int(line[:3]), " / ".join(lines)

    def command(self, text: str, expect: int) -> None:
        self.sock.sendall(text.encode() + b"\r\n")
        code, said = self.reply()
        if code != expect:
            raise RuntimeError(f"{text!r}: {said}")

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            self.command("QUIT", 221)
        self.reader.close()
        self.sock.close()


def run_latency(name: str, port: int, messages: int, timeout: float) -> Phase:
    """``messages`` in sequence over one connection: the time from the final dot to 250."""
    phase = Phase(name, messages)
    time_messages(phase, port, timeout)
    return phase


def time_messages(
    phase: Phase, port: int, timeout: float, stop: threading.Event | None = None
) -> None:
    """Up to ``phase.expected`` messages in sequence over one connection (until ``stop`` is
    set, if given), each timed from the final dot to its 250, into ``phase``."""
    messages = phase.expected
    body = message_body()
    deadline = time.monotonic() + timeout
    started = time.perf_counter()
    client: _Client | None = None
    try:
        client = _Client(port)
        code, said = client.reply()
        if code != 220:
            raise RuntimeError(f"greeting: {said}")
        client.command("EHLO bench.src.test", 250)
        for _ in range(messages):
            if stop is not None and stop.is_set():
                phase.complete = True
                break
            if time.monotonic() > deadline:
                phase.note = f"timed out after {timeout:.0f} s"
                break
            client.command(f"MAIL FROM:<{SENDER}>", 250)
            client.command(f"RCPT TO:<{RECIPIENT}>", 250)
            client.command("DATA", 354)
            client.sock.sendall(body)
            sent = time.perf_counter()
            client.sock.sendall(b".\r\n")
            code, said = client.reply()
            answered = time.perf_counter()
            if code != 250:
                raise RuntimeError(f"end of data: {said}")
            phase.latencies_ms.append((answered - sent) * 1000)
            phase.accepted += 1
        else:
            phase.complete = True
    except (OSError, RuntimeError, ValueError) as exc:
        phase.note = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        if client is not None:
            client.close()
    phase.seconds = time.perf_counter() - started


# --- zoneq -------------------------------------------------------------------------------


def write_zoneq_config(directory: Path, smtp_port: int, dns_port: int, receivers: int) -> Path:
    path = directory / "zones.toml"
    path.write_text(
        f"""
[server]
hostname = "mx.zoneq.test"
data_dir = "{directory / "queue"}"
ipc_socket = "{directory / "zoneq.sock"}"

[receiver]
listen = "127.0.0.1:{smtp_port}"
processes = {receivers}

[storage]
min_free = "0"
reserve = "0"

[delivery]
nameservers = ["127.0.0.1"]
dns_port = {dns_port}
dns_timeout = "2s"
allow_loopback_mx = true
tls = "none"

[zones.default]
processes = 1
connections = 1

[zones.bounces]
processes = 1
connections = 1
"""
    )
    return path


def count_zoneq_queue(config_path: Path) -> tuple[int, int]:
    """Messages in the queue of ``config_path`` and delivery events logged (deferrals and
    the like: the workers' activity during the run); ``zoneq serve`` must have stopped."""
    import asyncio

    from zoneq.config import load_config
    from zoneq.runtime import open_store

    async def count() -> tuple[int, int]:
        store = open_store(load_config(config_path))
        try:
            events = sum(1 for _, e in store.events() if e.kind.value != "accepted")
            return store.message_count(), events
        finally:
            await store.close()

    return asyncio.run(count())


def stop_serve(serve: Serve) -> str:
    """SIGTERM by PID, a bounded wait, SIGKILL if needed; its workers likewise."""
    note = ""
    try:
        serve.terminate(timeout=STOP_TIMEOUT_S)
    except RuntimeError as exc:
        note = str(exc)
    serve.cleanup()  # SIGKILLs any remembered worker left over, by PID
    return note


Result = tuple[Phase, Phase, Phase]  # the smtp-source load, idle latency, loaded latency


def bench_zoneq(args: argparse.Namespace, directory: Path, receivers: int) -> Result:
    directory.mkdir()
    load = Phase(f"zoneq rx={receivers}", args.messages)
    latency = Phase("zoneq latency", args.latency_messages)
    loaded = Phase("zoneq loaded", 0)
    # A name server that never answers: the workers' one lookup waits, nothing is delivered.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent_dns:
        silent_dns.bind(("127.0.0.1", 0))
        port = free_port()
        config = write_zoneq_config(directory, port, silent_dns.getsockname()[1], receivers)
        serve = start_receiver_serve(config, directory / "serve.log")
        try:
            # The server's CPU below is the core's process tree: receivers included.
            serve.wait_ready(expected_workers=2 + receivers, timeout=START_TIMEOUT_S)
            if not wait_listening(port, time.monotonic() + START_TIMEOUT_S):
                raise RuntimeError(f"zoneq serve is not listening on {port}")
            load, loaded = run_measured(load.name, serve.pid, port, args)
            latency = run_latency("zoneq latency", port, args.latency_messages, args.timeout)
        except RuntimeError as exc:
            load.note = load.note or str(exc)[:300]
        finally:
            note = stop_serve(serve)
            if note:
                load.note = f"{load.note}; {note}".strip("; ")
    if not serve.running():
        try:
            stored, events = count_zoneq_queue(config)
            load.stored = stored - latency.accepted - loaded.accepted
            load.delivery_events = events
        except Exception as exc:  # reported, not fatal
            load.note = f"{load.note}; queue not counted: {exc}".strip("; ")
    return load, latency, loaded


# --- Postfix -----------------------------------------------------------------------------


POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
SYSTEM_MASTER_PID = Path("/var/spool/postfix/pid/master.pid")
SYSTEM_MASTER = "/usr/lib/postfix/sbin/master"
# Debian's postinst makes /etc/postfix/main.cf and starts the system Postfix (port 25)
# unless told otherwise: "No configuration" leaves it unconfigured.
POSTFIX_PRESEED = b"postfix postfix/main_mailer_type select No configuration\n"


def ensure_postfix() -> str:
    """Install Debian's postfix where missing, without configuring or starting the system
    instance (only the throwaway instances of the benchmarks should run).  Returns a
    warning, empty if none: a system Postfix master running that this did not start."""
    if not (os.access(POSTFIX, os.X_OK) and os.access(POSTCONF, os.X_OK)):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(
            ["debconf-set-selections"],
            input=POSTFIX_PRESEED,
            check=True,
            capture_output=True,
            timeout=60,
        )
        with services_held(POLICY_RC_D):
            for command in (["apt-get", "update"], ["apt-get", "install", "-y", "postfix"]):
                subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)
        if not os.access(POSTFIX, os.X_OK):
            raise Missing("postfix could not be installed")
    pid = system_postfix_master(SYSTEM_MASTER_PID)
    if pid is None:
        return ""
    # Not ours (our instances keep their pid files under their own queue directories):
    # reported, never stopped.
    warning = (
        f"a system Postfix master (PID {pid}, {SYSTEM_MASTER_PID}) is running; "
        "it shares the CPUs with the measured MTAs"
    )
    print(f"warning: {warning}", file=sys.stderr)
    return warning


@contextlib.contextmanager
def services_held(policy: Path) -> Iterator[None]:
    """A policy-rc.d that forbids every service start (exit 101, invoke-rc.d(8)) while the
    block runs, unless the machine has its own policy (then that one is left alone)."""
    if policy.exists() or policy.is_symlink():
        yield
        return
    policy.write_text("#!/bin/sh\n# zoneq's benchmark is installing postfix\nexit 101\n")
    try:
        policy.chmod(0o755)
        yield
    finally:
        policy.unlink(missing_ok=True)


def system_postfix_master(pid_file: Path) -> int | None:
    """The PID in ``pid_file`` if that process is running Postfix's master program (a stale
    pid file, or a PID since given to another program, is None)."""
    try:
        pid = int(pid_file.read_text().split()[0])
        exe = os.readlink(f"/proc/{pid}/exe")
    except (OSError, ValueError, IndexError):
        return None
    return pid if exe == SYSTEM_MASTER else None


def postconf(config_dir: Path, *options: str) -> None:
    subprocess.run(
        [POSTCONF, "-c", str(config_dir), *options], check=True, capture_output=True, timeout=30
    )


def setup_postfix(directory: Path, port: int) -> Path:
    """A throwaway instance: its own config, queue and data directories; smtpd alone on
    127.0.0.1:``port``; every message held.  Returns its configuration directory."""
    config_dir = directory / "etc"
    queue_dir = directory / "spool"
    data_dir = directory / "data"
    for path in (config_dir, queue_dir, data_dir):
        path.mkdir(parents=True)
    shutil.chown(data_dir, "postfix")
    shutil.copy("/etc/postfix/master.cf", config_dir / "master.cf")
    (config_dir / "main.cf").write_text(
        f"""compatibility_level = 3.6
queue_directory = {queue_dir}
data_directory = {data_dir}
mail_owner = postfix
setgid_group = postdrop
myhostname = mx.postfix.test
mydomain = postfix.test
mydestination =
inet_interfaces = 127.0.0.1
inet_protocols = ipv4
mynetworks = 127.0.0.0/8
relayhost = [127.0.0.1]:9
smtpd_client_restrictions = check_client_access static:HOLD
alias_maps =
alias_database =
biff = no
smtpd_tls_security_level = none
smtp_tls_security_level = none
maillog_file = {directory / "maillog"}
maillog_file_prefixes = {directory}
"""
    )
    # smtpd on our port only, nothing chrooted (the temporary spool has no /etc in it).
    postconf(config_dir, "-M#", "smtp/inet")
    postconf(config_dir, "-M", f"127.0.0.1:{port}/inet=127.0.0.1:{port} inet n - n - - smtpd")
    postconf(config_dir, "-F", "*/*/chroot = n")
    subprocess.run(
        [POSTFIX, "-c", str(config_dir), "check"], check=True, capture_output=True, timeout=60
    )
    return config_dir


def postfix_master_pid(config_dir: Path) -> int | None:
    queue_dir = Path(
        subprocess.run(
            [POSTCONF, "-c", str(config_dir), "-h", "queue_directory"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
    )
    with contextlib.suppress(OSError, ValueError):
        return int((queue_dir / "pid" / "master.pid").read_text().split()[0])
    return None


def start_postfix(config_dir: Path) -> int | None:
    """``postfix -c DIR start`` (raises if it fails); its master's PID, for the stop."""
    subprocess.run(
        [POSTFIX, "-c", str(config_dir), "start"],
        check=True,
        capture_output=True,
        timeout=START_TIMEOUT_S,
    )
    return postfix_master_pid(config_dir)


def stop_postfix(config_dir: Path, master_pid: int | None) -> str:
    """``postfix -c DIR stop``, a bounded wait for its master; SIGKILL to it by PID if needed."""
    subprocess.run(
        [POSTFIX, "-c", str(config_dir), "stop"], capture_output=True, timeout=60, check=False
    )
    if master_pid is None:
        return ""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and Path(f"/proc/{master_pid}").exists():
        time.sleep(0.1)
    if Path(f"/proc/{master_pid}").exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(master_pid, signal.SIGKILL)
        return f"postfix master {master_pid} killed"
    return ""


def count_postfix_queue(config_dir: Path) -> int:
    queue_dir = config_dir.parent / "spool"
    total = 0
    for sub in ("incoming", "active", "deferred", "hold", "maildrop"):
        total += sum(1 for p in (queue_dir / sub).rglob("*") if p.is_file())
    return total


def bench_postfix(args: argparse.Namespace, directory: Path) -> Result:
    load = Phase("postfix accept", args.messages)
    latency = Phase("postfix latency", args.latency_messages)
    loaded = Phase("postfix loaded", 0)
    try:
        ensure_postfix()
        port = free_port()
        config_dir = setup_postfix(directory, port)
    except (subprocess.SubprocessError, OSError, LookupError) as exc:
        load.note = f"postfix not set up: {exc}"[:300]
        return load, latency, loaded
    master_pid: int | None = None
    try:
        master_pid = start_postfix(config_dir)
        if not wait_listening(port, time.monotonic() + START_TIMEOUT_S):
            raise RuntimeError(f"postfix is not listening on {port}")
        load, loaded = run_measured("postfix accept", master_pid, port, args)
        latency = run_latency("postfix latency", port, args.latency_messages, args.timeout)
    except (subprocess.SubprocessError, RuntimeError) as exc:
        load.note = load.note or str(exc)[:300]
    finally:
        note = stop_postfix(config_dir, master_pid)
        if note:
            load.note = f"{load.note}; {note}".strip("; ")
    load.stored = count_postfix_queue(config_dir) - latency.accepted - loaded.accepted
    return load, latency, loaded


# --- the run -----------------------------------------------------------------------------


def load_average() -> str:
    """The 1-minute load average: how busy the machine was (other work skews the figures;
    compare the ratio of a run, not absolute rates across runs)."""
    with contextlib.suppress(OSError):
        return Path("/proc/loadavg").read_text().split()[0]
    return "?"


def latency_columns(phase: Phase) -> str:
    """p50, p99 and max of ``phase``'s end of DATA -> 250 times, 9 columns each."""
    if not phase.latencies_ms:
        return f"{'-':>9}{'-':>9}{'-':>9}"
    return (
        f"{phase.percentile(0.5):>9.2f}{phase.percentile(0.99):>9.2f}"
        f"{max(phase.latencies_ms):>9.2f}"
    )


def table(
    args: argparse.Namespace,
    zoneqs: list[Result],
    postfix: Result,
    loads: tuple[str, str],
) -> str:
    pf, pl, pu = postfix
    rows = [
        f"CPUs: {os.cpu_count()}; load average {loads[0]} at the start, {loads[1]} at the "
        f"end; smtp-source sessions: {args.sessions}; messages: "
        f"{args.messages} x {MESSAGE_SIZE} B; end of DATA -> 250, idle: "
        f"{args.latency_messages} sequential messages on one connection, nothing else "
        f"running; loaded: {args.load_clients} timed session(s) beside smtp-source's",
        f"{'':<18}{'':>13}{'':>8}{'':>9}{'':>12}{'':>11}{'':>9}"
        f"{'idle: end of DATA -> 250':>27}{'loaded: end of DATA -> 250':>33}",
        f"{'phase':<18}{'accepted':>13}{'stored':>8}{'seconds':>9}{'per second':>12}"
        f"{'CPU ms/msg':>11}{'1 thread':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
        f"{'n':>6}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}  note",
    ]
    for load, lat, loaded in [*zoneqs, postfix]:
        label = load.name.replace(" accept", "")
        stored = str(load.stored) if load.stored >= 0 else "-"
        busiest = f"1 thread of {load.busiest_thread}" if load.busiest_thread else ""
        notes = "; ".join(n for n in (load.note, lat.note, loaded.note, busiest) if n)
        cpu = f"{load.cpu_ms_per_message:.3f}" if load.cpu_seconds >= 0 else "-"
        one = f"{load.busiest_ms_per_message:.3f}" if load.busiest_thread_seconds >= 0 else "-"
        rows.append(
            f"{label:<18}{f'{load.accepted}/{load.expected}':>13}{stored:>8}"
            f"{load.seconds:>9.2f}{load.rate:>12.0f}{cpu:>11}{one:>9}{latency_columns(lat)}"
            f"{loaded.accepted:>6}{latency_columns(loaded)}"
            f"  {notes}".rstrip()
        )
    events = ", ".join(str(zq.delivery_events) for zq, _, _ in zoneqs)
    rows.append(
        f"  zoneq: {events} delivery event(s) logged during the run(s) (workers idle on a "
        "silent name server); 'stored': messages found in the queue afterwards; rx=N: "
        "[receiver] processes = N (0: in the core); '1 thread': CPU per message of the "
        "busiest thread, whose 1000/x is the most that layout can accept per second with "
        "cores to spare"
    )
    for zq, zl, zu in zoneqs:
        ratio = zq.rate / pf.rate if pf.rate else 0.0
        ok = all(p.complete for p in (zq, zl, zu, pf, pl, pu))
        verdict = "result:" if ok else "result: INCOMPLETE"
        rows.append(
            f"{verdict} {zq.name} {zq.rate:.0f} accepts/s = {ratio:.2f} x Postfix "
            f"{pf.rate:.0f} accepts/s (goal 2.00 x); p99 end of DATA -> 250 idle: "
            f"{zl.percentile(0.99):.2f} ms vs {pl.percentile(0.99):.2f} ms, under load: "
            f"{zu.percentile(0.99):.2f} ms vs {pu.percentile(0.99):.2f} ms; CPU per message: "
            f"{zq.cpu_ms_per_message:.3f} ms vs {pf.cpu_ms_per_message:.3f} ms"
        )
    return "\n".join(rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--sessions", type=int, default=10, help="smtp-source sessions")
    parser.add_argument(
        "--latency-messages", type=int, default=500, help="sequential messages timed"
    )
    parser.add_argument(
        "--load-clients",
        type=int,
        default=2,
        help="timed sessions beside smtp-source's, each timing every message it sends",
    )
    parser.add_argument(
        "--receivers",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[0],
        help="[receiver] processes values to measure, e.g. 0,1,2,3 (one zoneq run each)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="repeat every phase, interleaved")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per phase")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    for name in ("messages", "sessions", "latency_messages", "load_clients", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if any(not 0 <= n <= 64 for n in args.receivers):
        parser.error("--receivers: each value from 0 to 64")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        smtp_source()
    except Missing as exc:
        print(exc, file=sys.stderr)
        return EXIT_MISSING
    if os.geteuid() != 0:
        print("the Postfix half needs root", file=sys.stderr)
        return EXIT_MISSING
    phases: list[Phase] = []
    ratios: dict[str, list[float]] = {}
    report: list[dict[str, object]] = []
    for round_no in range(args.rounds):
        load_before = load_average()
        directory = Path(tempfile.mkdtemp(prefix="zoneq-abench-"))
        directory.chmod(0o755)  # Postfix's daemons (user postfix) must reach their queue
        try:
            zoneqs = [bench_zoneq(args, directory / f"zoneq-{n}", n) for n in args.receivers]
            try:
                postfix = bench_postfix(args, directory / "postfix")
            except Missing as exc:
                print(exc, file=sys.stderr)
                return EXIT_MISSING
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        loads = (load_before, load_average())
        if args.rounds > 1:
            print(f"round {round_no + 1} of {args.rounds}")
        print(table(args, zoneqs, postfix, loads))
        for zq, _, _ in zoneqs:
            ratio = zq.rate / postfix[0].rate if postfix[0].rate else 0.0
            ratios.setdefault(zq.name, []).append(ratio)
        round_phases = [phase for result in [*zoneqs, postfix] for phase in result]
        phases += round_phases
        report.append({"load_average": loads, "phases": [p.summary() for p in round_phases]})
    if args.rounds > 1:
        for name, values in ratios.items():
            each = ", ".join(f"{v:.2f}" for v in values)
            print(f"{name}: median {statistics.median(values):.2f} x Postfix (rounds: {each})")
    if args.json is not None:
        summary = {
            "cpus": os.cpu_count(),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "message_size": MESSAGE_SIZE,
            "rounds": report,
            "ratios": ratios,
        }
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if all(p.complete for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
