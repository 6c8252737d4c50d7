"""Postfix's smtp-sink as a remote MX for the tests.

The binary comes from the test bed (``$ZONEQ_TESTBED/postfix/usr/sbin/smtp-sink``, the test
bed defaulting to the repository's ``.testbed``); tests skip with the reason when it is
missing.  ``run_smtp_sink`` starts it on a free port of a 127.0.0.x address with the given
options, with ``-d`` dumping each transaction to a file, and stops it by its PID.

The dump directory is not under pytest's ``tmp_path``: as root, smtp-sink must drop to
``nobody`` (``-u``), who cannot enter pytest's private temporary directories.  It is a world-
writable ``mkdtemp`` directory, removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.testbed import missing

ROOT = Path(__file__).resolve().parents[2]


def testbed() -> Path:
    return Path(os.environ.get("ZONEQ_TESTBED") or ROOT / ".testbed")


def smtp_sink_binary() -> Path:
    """The smtp-sink binary, or skip the test saying where it was looked for."""
    binary = testbed() / "postfix" / "usr" / "sbin" / "smtp-sink"
    if not os.access(binary, os.X_OK):
        missing(f"smtp-sink not found at {binary} (set ZONEQ_TESTBED or run tools/dev test)")
    return binary


@dataclass(frozen=True)
class SinkMessage:
    """One dumped transaction: smtp-sink's X- headers, and the content as received."""

    client_addr: str
    helo: str
    mail_args: str
    rcpt_args: list[str]
    content: bytes  # LF line endings (smtp-sink writes lines with LF), dot-stuffing undone


@dataclass(frozen=True)
class Sink:
    host: str
    port: int
    dump_dir: Path
    pid: int

    def messages(self, expected: int, timeout: float = 5.0) -> list[SinkMessage]:
        """Wait (bounded) for ``expected`` complete dump files and parse them."""
        deadline = time.monotonic() + timeout
        while True:
            files = sorted(self.dump_dir.glob("msg.*"))
            complete = [p for p in files if p.read_bytes().endswith(b"\n\n")]
            if len(complete) >= expected or time.monotonic() > deadline:
                return [parse_dump(p.read_bytes()) for p in complete]
            time.sleep(0.05)


def parse_dump(data: bytes) -> SinkMessage:
    """Split smtp-sink's dump format (see smtp-sink(1), DUMP FILE FORMAT)."""
    fields: dict[str, list[str]] = {}
    lines = data.split(b"\n")
    pos = 0
    while not lines[pos].startswith(b"Received: "):
        name, _, value = lines[pos].decode().partition(": ")
        fields.setdefault(name, []).append(value)
        pos += 1
    pos += 3  # the three-line Received: header ends smtp-sink's own headers
    content = b"\n".join(lines[pos:])
    # The dump ends with an added empty line: drop its LF.
    content = content[:-1] if content.endswith(b"\n") else content
    return SinkMessage(
        client_addr=fields["X-Client-Addr"][0],
        helo=fields.get("X-Helo-Args", [""])[0],
        mail_args=fields["X-Mail-Args"][0],
        rcpt_args=fields.get("X-Rcpt-Args", []),
        content=content,
    )


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _free_port(host: str) -> int:
    with socket.socket(_family(host)) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _free_host(port: int | None) -> str:
    """A random 127.0.0.x, one where ``port`` is free when several sinks share a port: two
    sinks drawn on the same address made the second fail to bind while the first answered
    its readiness probe, so two domains' MX hosts were one sink (a flaky test in CI)."""
    for _attempt in range(50):
        host = f"127.0.0.{random.randint(2, 250)}"
        if port is None:
            return host
        with socket.socket(socket.AF_INET) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return host
    raise RuntimeError(f"no 127.0.0.x address with port {port} free")


def _wait_listening(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"smtp-sink exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return  # smtp-sink sees a connection that closes at once: harmless
        time.sleep(0.05)
    raise RuntimeError(f"smtp-sink did not listen on {host}:{port} within {timeout} s")


@contextlib.contextmanager
def run_smtp_sink(
    *options: str, host: str | None = None, port: int | None = None, backlog: int = 16
) -> Iterator[Sink]:
    """Start smtp-sink with ``options`` (e.g. ``"-r", "RCPT"``); yield where it listens
    (``host`` may be ``"::1"``: the sink then reports clients as ``ipv6:::1``).
    ``port``: this one (several MX hosts on one port, as zoneq's ``mx_port`` needs), else a
    free one.  ``backlog``: its listen queue; benchmarks need a long one, or a burst of
    connections is refused and the sender backs off from a host that is merely busy."""
    binary = smtp_sink_binary()
    host = host or _free_host(port)
    dump_dir = Path(tempfile.mkdtemp(prefix="zoneq-sink-"))
    dump_dir.chmod(0o777)
    log = dump_dir / "smtp-sink.log"
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parents[2] / "usr" / "lib" / "postfix"))
    privileges = ["-u", "nobody"] if os.geteuid() == 0 else []
    proc: subprocess.Popen[bytes] | None = None
    try:
        for _attempt in range(5):  # the free port may be taken between probe and bind
            port = _free_port(host) if port is None else port
            # Postfix writes an IPv6 address in brackets: [::1]:port.
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            with log.open("ab") as stderr:
                dump = ["-d", f"{dump_dir}/msg."]
                proc = subprocess.Popen(
                    [str(binary), *privileges, *dump, *options, address, str(backlog)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )
            try:
                _wait_listening(host, port, proc, timeout=5.0)
                break
            except RuntimeError:
                _stop(proc)
                proc = None
        if proc is None:
            raise RuntimeError(f"smtp-sink would not start: {log.read_text(errors='replace')}")
        yield Sink(host=host, port=port, dump_dir=dump_dir, pid=proc.pid)
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(dump_dir, ignore_errors=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate smtp-sink by its PID, then kill it if it lingers."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
