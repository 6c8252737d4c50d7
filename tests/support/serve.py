"""``zoneq serve`` as a real process, for the tests that need the whole program.

``write_serve_config`` writes a zones.toml for a test bed (the remote MX's port, dnsmasq's
port, loopback MX allowed, no TLS).  ``running_serve(config, log)`` starts ``zoneq serve
--config F`` with its output (and its workers', which inherit it) in ``log``, waits until the
IPC socket exists, every worker has said hello to the core and the receiver answers with
its 220 greeting, and yields a ``Serve`` handle; on the way out it stops everything it
started.

Workers are found as the core's children (``/proc/<pid>/task/<pid>/children``, or a scan of
``/proc/*/stat`` for the parent PID where the kernel has no such file).  Every process ever
seen is remembered with its start time, so a PID that the kernel has since given to another
process is never signalled.  Stopping is by PID only: SIGTERM to the core and a bounded
wait, then SIGKILL; then SIGKILL to any worker that outlived its core (a core killed with
SIGKILL cannot stop its workers; they are expected to notice the closed socket and exit).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0
KILL_TIMEOUT = 5.0


def set_config_line(config: Path, section: str, line: str) -> None:
    """Replace the first ``key = ...`` line of ``config`` with ``line`` (``key = value``),
    or add it at the top of ``[section]``."""
    text = config.read_text()
    key = line.split(" = ", maxsplit=1)[0]
    changed, count = re.subn(rf"^{key} = .*$", line, text, count=1, flags=re.M)
    config.write_text(
        changed if count else text.replace(f"[{section}]\n", f"[{section}]\n{line}\n")
    )


def write_serve_config(
    directory: Path,
    *,
    mx_port: int,
    dns_port: int,
    connections: int = 4,
    processes: int = 1,
) -> Path:
    """A config for ``zoneq serve`` with its queue and socket under ``directory``, its SMTP
    receiver and its HTTP API each on a free port of 127.0.0.1 (read them back with
    :func:`smtp_port` and :func:`api_port`)."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    path = directory / "zones.toml"
    path.write_text(
        f"""
[server]
hostname = "mx.zoneq.test"
data_dir = "{directory / "queue"}"
ipc_socket = "{directory / "zoneq.sock"}"

[receiver]
listen = "127.0.0.1:{port}"

[api]
listen = "127.0.0.1:{free_port()}"

[delivery]
mx_port = {mx_port}
nameservers = ["127.0.0.1"]
dns_port = {dns_port}
dns_timeout = "5s"
allow_loopback_mx = true
tls = "none"

[zones.default]
processes = {processes}
connections = {connections}

[zones.bounces]
processes = 1
connections = 2
"""
    )
    return path


def free_port() -> int:
    """A port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def smtp_port(config: Path) -> int:
    """The port the receiver of ``config`` listens on."""
    return _port(config, "receiver")


def api_port(config: Path) -> int:
    """The port the HTTP API of ``config`` listens on."""
    return _port(config, "api")


def api_get(port: int, path: str, token: str | None = None) -> tuple[int, str]:
    """GET ``path`` of the HTTP API on 127.0.0.1:``port``: the status and the body's text
    (an error status is returned, not raised)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _port(config: Path, section: str) -> int:
    listen: str = tomllib.loads(config.read_text())[section]["listen"]
    return int(listen.rpartition(":")[2])


# --- /proc ------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22), None if gone."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def alive(pid: int, started: int | None = None) -> bool:
    """Running (not a zombie), and the same process if ``started`` is given."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return started is None or int(fields[19]) == started


def children(pid: int) -> list[int]:
    """The PIDs whose parent is ``pid``."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    with contextlib.suppress(OSError):
        return [int(p) for p in path.read_text().split()]
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def rss_anon_kib(pid: int) -> int | None:
    """``RssAnon`` of /proc/<pid>/status in KiB (anonymous memory only: not LevelDB's mapped
    files, not shared libraries), None if the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    match = re.search(r"^RssAnon:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


# --- the process ------------------------------------------------------------------------


@dataclass
class Serve:
    """A running ``zoneq serve``: its core process and the workers seen so far."""

    process: subprocess.Popen[bytes]
    config: Path
    log: Path
    started: dict[int, int] = field(default_factory=dict)  # every PID seen -> start time

    @property
    def pid(self) -> int:
        return self.process.pid

    def workers(self) -> list[int]:
        """The core's worker processes now (remembered for the clean-up)."""
        pids = [p for p in children(self.pid) if alive(p)] if self.running() else []
        for pid in pids:
            ticks = start_time(pid)
            if ticks is not None:
                self.started.setdefault(pid, ticks)
        return pids

    def running(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def connected(self) -> set[int]:
        """PIDs of the workers whose hello the core has logged."""
        return {
            int(p) for p in re.findall(r"worker pid (\d+) of zone \S+ connected", self.log_text())
        }

    def ready(self, expected_workers: int) -> list[int] | None:
        """The workers, if the socket exists and ``expected_workers`` of them have connected
        to the core; None if not yet.  Raises if the core has exited."""
        if not self.running():
            raise RuntimeError(
                f"zoneq serve exited with {self.process.returncode}:\n{self.log_text()}"
            )
        pids = self.workers()
        if (
            _ipc_socket(self.config).exists()
            and len(pids) >= expected_workers
            and set(pids) <= self.connected()
            and self.greets()
        ):
            return pids
        return None

    def greets(self) -> bool:
        """The receiver answers a connection with its 220 greeting (RFC 5321 3.1), then QUIT.
        A listening socket alone is not ready: a client connected before the greeting can
        be dropped (``SMTPServerDisconnected`` while connecting).  True when the config has
        no plain receiver to ask."""
        try:
            port = smtp_port(self.config)
        except (KeyError, ValueError):
            return True
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2.0) as probe:
                greeting = probe.makefile("rb").readline(512)
                if not greeting.startswith(b"220"):
                    return False
                probe.sendall(b"QUIT\r\n")
                return True
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log, for an assertion's message."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_ready(self, expected_workers: int, timeout: float = START_TIMEOUT) -> list[int]:
        """Wait until the socket exists and ``expected_workers`` workers have connected."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.ready(expected_workers)
            if pids is not None:
                return pids
            time.sleep(0.05)
        raise RuntimeError(
            f"zoneq serve not ready within {timeout} s (workers {self.workers()}, "
            f"SMTP greeting {'seen' if self.greets() else 'not seen'}):\n"
            f"{self.log_text()}"
        )

    def terminate(self, timeout: float = STOP_TIMEOUT) -> float:
        """SIGTERM the core and wait for it (bounded); SIGKILL if it will not go.  Returns the
        seconds it took; raises if SIGKILL was needed (after killing, so nothing leaks)."""
        if not self.running():
            return 0.0
        self.workers()  # remember them: once the core is gone they are nobody's children
        begun = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"zoneq serve ignored SIGTERM for {timeout} s") from None
        return time.monotonic() - begun

    def kill(self) -> list[int]:
        """SIGKILL the core by PID and reap it; its workers as they were just before."""
        workers = self.workers()
        if self.running():
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=KILL_TIMEOUT)
        return workers

    def survivors(self) -> list[int]:
        """Workers seen earlier that still run although they belong to no live core."""
        return [pid for pid, ticks in self.started.items() if alive(pid, ticks)]

    def wait_workers_gone(self, timeout: float) -> list[int]:
        """Wait (bounded) for every worker seen to exit; those still running."""
        deadline = time.monotonic() + timeout
        while self.survivors() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.survivors()

    def cleanup(self) -> None:
        """Stop whatever is left, core first, then each remembered worker, by PID."""
        if self.running():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.terminate(timeout=10.0)
            if self.running():
                self.kill()
        for pid in self.wait_workers_gone(timeout=5.0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + KILL_TIMEOUT
        while self.survivors() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.survivors():
            raise RuntimeError(f"processes survived SIGKILL: {self.survivors()}")


def _ipc_socket(config: Path) -> Path:
    match = re.search(r'^ipc_socket\s*=\s*"([^"]+)"', config.read_text(), re.MULTILINE)
    assert match, f"no ipc_socket in {config}"
    return Path(match.group(1))


def start_serve(config: Path, log: Path, python_args: tuple[str, ...] = ("-m", "zoneq")) -> Serve:
    """Start ``zoneq serve --config config`` (not waiting for it) with its output in ``log``;
    ``python_args`` run zoneq's main another way (``-c`` with code that changes a constant)."""
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, *python_args, "serve", "--config", str(config)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    serve = Serve(process, config, log)
    ticks = start_time(process.pid)
    if ticks is not None:
        serve.started[process.pid] = ticks
    return serve


@contextlib.contextmanager
def running_serve(config: Path, log: Path, expected_workers: int = 2) -> Iterator[Serve]:
    """``zoneq serve`` up with its workers connected; everything it started stopped after."""
    serve = start_serve(config, log)
    try:
        serve.wait_ready(expected_workers)
        yield serve
    finally:
        serve.cleanup()
