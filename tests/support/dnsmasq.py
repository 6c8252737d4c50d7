"""A real dnsmasq on loopback, serving zone data written by the test.

``running_dnsmasq(records, directory)`` writes a configuration file into ``directory``,
starts dnsmasq in the foreground on 127.0.0.1 and a free port, waits until it answers a
real DNS query, yields a ``Dnsmasq`` handle, and stops the process by its PID afterwards
(terminate, wait, kill if it will not go).  ``records`` are dnsmasq configuration lines
such as ``mx-host=ok.test,mx1.ok.test,10``; the fixture adds the listening and isolation
options itself (``no-resolv``, ``no-hosts``, ``local=/test/``), so nothing is forwarded
and nothing of the machine's own name service leaks into a test.

If dnsmasq is not installed the test is skipped, with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import dns.exception
import dns.message
import dns.query

from tests.support.testbed import missing

__all__ = ["Dnsmasq", "dnsmasq_binary", "free_port", "running_dnsmasq", "silent_udp_port"]

# dnsmasq lives in sbin on most systems, which is often not on an unprivileged PATH.
_SBIN_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")
_START_TIMEOUT = 10.0
_STOP_TIMEOUT = 5.0


@dataclass
class Dnsmasq:
    """A running dnsmasq: where it listens, its PID, and how to stop it early."""

    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        """Stop the process (idempotent): SIGTERM by PID, then SIGKILL if it lingers."""
        if self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=_STOP_TIMEOUT)


def dnsmasq_binary() -> str | None:
    """The dnsmasq executable, or None if it is not installed."""
    search = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN_DIRS])
    return shutil.which("dnsmasq", path=search)


def free_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1 (DNS uses both), found by binding 0."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port: int = udp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no port free for both UDP and TCP on 127.0.0.1")


@contextlib.contextmanager
def silent_udp_port() -> Iterator[int]:
    """A UDP port that is bound but never answers: a dead upstream that times out.

    Holding the socket open (rather than picking a closed port) means no ICMP "port
    unreachable" comes back, so queries forwarded there time out instead of failing fast.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def _answers(port: int) -> bool:
    query = dns.message.make_query("probe.test.", "A")
    try:
        dns.query.udp(query, "127.0.0.1", port=port, timeout=0.2)
    except (OSError, dns.exception.DNSException):
        return False
    return True


def _config(port: int, directory: Path, records: Sequence[str], ttl: int | None) -> str:
    lines = [
        f"port={port}",
        "listen-address=127.0.0.1",
        "bind-interfaces",
        "no-resolv",
        "no-hosts",
        "local=/test/",
        # dnsmasq's default is 0, which no resolver caches: a test sees a changed record at
        # once.  A benchmark gives a real MX record's minutes instead (or a record does).
        *([f"local-ttl={ttl}"] if ttl is not None else []),
        # Run as root (as in some containers), dnsmasq would write a system-wide PID file.
        f"pid-file={directory / 'dnsmasq.pid'}",
        "log-facility=-",
        *records,
    ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def running_dnsmasq(
    records: Sequence[str], directory: Path, *, ttl: int | None = None
) -> Iterator[Dnsmasq]:
    """Start dnsmasq with ``records`` (answered with ``ttl``, if given); yield it once it
    answers; stop it by PID afterwards."""
    binary = dnsmasq_binary()
    if binary is None:
        missing("dnsmasq is not installed (Debian/Ubuntu: apt-get install dnsmasq-base)")
    directory.mkdir(parents=True, exist_ok=True)
    # A port found free can be taken before dnsmasq binds it; try a few times.
    for attempt in range(3):
        port = free_port()
        conf = directory / "dnsmasq.conf"
        conf.write_text(_config(port, directory, records, ttl))
        log = directory / f"dnsmasq-{attempt}.log"
        with log.open("wb") as log_file:
            process = subprocess.Popen(
                [binary, "--keep-in-foreground", f"--conf-file={conf}"],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        server = Dnsmasq(port, process, log)
        try:
            if _wait_until_answering(server):
                break
        except BaseException:
            server.stop()
            raise
        server.stop()
        if "Address already in use" not in log.read_text(errors="replace"):
            raise RuntimeError(f"dnsmasq did not start:\n{log.read_text(errors='replace')}")
    else:
        raise RuntimeError("dnsmasq could not bind a free port in 3 attempts")
    try:
        yield server
    finally:
        server.stop()


def _wait_until_answering(server: Dnsmasq) -> bool:
    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False
        if _answers(server.port):
            return True
        time.sleep(0.05)
    return False
