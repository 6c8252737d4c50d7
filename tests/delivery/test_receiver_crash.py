"""The receiver's crash test: ``zoneq serve`` killed with SIGKILL while a client sends.

The core (which runs the SMTP receiver) is killed at random moments, at least 20 times
(60 with ``ZONEQ_LONG_TESTS=1``), each time restarted on the same queue.  A client sends
messages one after another over SMTP and writes each (Message-ID, recipients) to a ledger
only once the 250 came back.  smtp-sink is the MX of ok.test and dumps each transaction to a
file, so copies are counted per (Message-ID, recipient).

After the last restart every ledger entry must reach every one of its recipients (or be
bounced to the sender); every copy that reaches the MX must be whole (a message cut by a kill
may be stored or not, never in part); the queue must end empty with its counters matching a
recount.  Extra copies are allowed only for what was in flight at a kill: at most one per
delivery connection per kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiosmtplib
import pytest

from tests.support.dnsmasq import Dnsmasq, running_dnsmasq
from tests.support.serve import Serve, smtp_port, start_serve, write_serve_config
from tests.support.smtpsink import Sink, parse_dump, run_smtp_sink
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

KILLS = 60 if os.environ.get("ZONEQ_LONG_TESTS") == "1" else 20
CONNECTIONS = 4
PROCESSES = 1
SENDER = "sender@src.test"
RECIPIENTS = ("r1@ok.test", "r2@ok.test", "r3@ok.test")
DELIVERY_TIMEOUT = 60.0
QUIET = 2.5  # seconds without a new dump before the last serve is stopped
CLIENT_TIMEOUT = 10.0


@dataclass
class Bed:
    sink: Sink
    dns: Dnsmasq
    directory: Path


@contextlib.contextmanager
def serve_bed(directory: Path) -> Iterator[Bed]:
    """smtp-sink (dumping each transaction to a file) as the MX of ok.test and src.test."""
    sink_ip = f"127.0.{random.randint(1, 250)}.{random.randint(2, 250)}"
    with run_smtp_sink(host=sink_ip) as sink:
        records = [
            "mx-host=ok.test,mx.ok.test,10",
            f"host-record=mx.ok.test,{sink_ip}",
            "mx-host=src.test,mx.src.test,10",
            f"host-record=mx.src.test,{sink_ip}",
        ]
        with running_dnsmasq(records, directory / "dns") as dns:
            yield Bed(sink, dns, directory)


# --- the messages and the ledger -----------------------------------------------------------


def body_lines(message_id: str, size: int) -> list[bytes]:
    """Body lines (without line ends) of about ``size`` octets, the last naming the message."""
    seed = hashlib.sha256(message_id.encode()).hexdigest()
    lines = []
    total = 0
    n = 0
    while total < size:
        lead = "." if n % 97 == 0 else " "  # some lines to dot-stuff
        line = f"{lead}{n:06d} {seed[n % 32 : n % 32 + 32]} {'x' * (n % 40)}".encode()
        lines.append(line)
        total += len(line) + 2
        n += 1
    lines.append(f"END {message_id} {n} lines".encode())
    return lines


def make_message(message_id: str, recipients: list[str], size: int) -> tuple[bytes, str]:
    """The message as sent (CRLF), and the SHA-256 of its text as smtp-sink dumps it (LF)."""
    head = [
        f"From: {SENDER}",
        f"To: {', '.join(recipients)}",
        f"Subject: crash test {message_id}",
        f"Message-ID: {message_id}",
        "",
    ]
    lines = [line.encode() for line in head] + body_lines(message_id, size)
    wire = b"\r\n".join(lines) + b"\r\n"
    return wire, hashlib.sha256(b"\n".join(lines) + b"\n").hexdigest()


@dataclass
class Ledger:
    acknowledged: dict[str, list[str]] = field(default_factory=dict)  # 250 came back
    cut: dict[str, list[str]] = field(default_factory=dict)  # exchange cut by a kill
    digests: dict[str, str] = field(default_factory=dict)  # every message ever sent
    refused: list[str] = field(default_factory=list)  # a clean 4xx/5xx reply


async def send_until_cut(port: int, ledger: Ledger, run: int) -> int:
    """Send messages one after another on one connection until the server goes away; each
    goes in the ledger only once its 250 came back.  The number acknowledged."""
    acknowledged = 0
    client = aiosmtplib.SMTP(
        hostname="127.0.0.1",
        port=port,
        local_hostname="client.src.test",
        start_tls=False,
        timeout=CLIENT_TIMEOUT,
    )
    message_id = ""
    recipients: list[str] = []
    try:
        await client.connect()
        for n in range(100_000):
            message_id = f"<crash-{run}-{n}.{random.getrandbits(32):08x}@src.test>"
            recipients = random.sample(RECIPIENTS, random.randint(1, 3))
            size = random.choice((300, 2_000, 20_000, 70_000, 150_000))
            wire, digest = make_message(message_id, recipients, size)
            ledger.digests[message_id] = digest
            try:
                errors, _reply = await client.sendmail(SENDER, recipients, wire)
            except aiosmtplib.SMTPResponseException as error:
                if error.code >= 500 or error.code == 421:
                    raise
                ledger.refused.append(f"{message_id}: {error.code} {error.message}")
                await client.rset()
                continue
            assert not errors, (message_id, errors)
            ledger.acknowledged[message_id] = recipients
            acknowledged += 1
            message_id = ""
    except (aiosmtplib.SMTPException, OSError):
        if message_id:
            ledger.cut[message_id] = recipients
    finally:
        client.close()
    return acknowledged


# --- what the sink received ------------------------------------------------------------------


@dataclass
class Copy:
    message_id: str
    recipients: list[str]
    digest: str  # of the content after the Received field zoneq added
    bounce_of: list[tuple[str, str]]  # (Message-ID, recipient) a DSN reports


@dataclass
class Dumps:
    copies: dict[str, Copy] = field(default_factory=dict)  # by dump file name, complete only
    partial: int = 0

    def scan(self, sink: Sink) -> tuple[int, int]:
        """Read the dump files completed since the last scan; (complete, partial) counts."""
        partial = 0
        for path in sorted(sink.dump_dir.glob("msg.*")):
            if path.name in self.copies:
                continue
            data = path.read_bytes()
            if not data.endswith(b"\n\n"):
                partial += 1
                continue
            self.copies[path.name] = parse_copy(data)
        self.partial = partial
        return len(self.copies), partial

    def delivered(self) -> Counter[tuple[str, str]]:
        """Copies per (Message-ID, recipient), DSNs to the sender left out."""
        count: Counter[tuple[str, str]] = Counter()
        for copy in self.copies.values():
            for recipient in copy.recipients:
                if recipient != SENDER:
                    count[(copy.message_id, recipient)] += 1
        return count

    def bounced(self) -> set[tuple[str, str]]:
        return {pair for copy in self.copies.values() for pair in copy.bounce_of}


def parse_copy(data: bytes) -> Copy:
    dump = parse_dump(data)
    recipients = []
    for arg in dump.rcpt_args:
        match = re.search(r"<([^>]*)>", arg)
        recipients.append(match.group(1).lower() if match else arg.strip().lower())
    content = dump.content
    found = re.search(rb"^Message-ID: (\S+)$", content, re.MULTILINE | re.IGNORECASE)
    message_id = found.group(1).decode() if found else ""
    start = content.find(f"\nFrom: {SENDER}\n".encode())
    digest = hashlib.sha256(content[start + 1 :]).hexdigest() if start >= 0 else ""
    bounce_of = []
    if SENDER in recipients:
        original = re.findall(rb"Message-ID: (<[^>\s]+>)", content, re.IGNORECASE)
        failed = re.findall(rb"Final-Recipient: rfc822; *(\S+)", content, re.IGNORECASE)
        for returned in original:
            bounce_of += [(returned.decode(), r.decode().lower()) for r in failed]
    return Copy(message_id, recipients, digest, bounce_of)


# --- the test ------------------------------------------------------------------------------


def stop_killed(serve: Serve) -> list[int]:
    """After ``serve.kill()``: wait (bounded) for the workers to go; kill survivors by PID."""
    survivors = serve.wait_workers_gone(timeout=10.0)
    serve.cleanup()  # SIGKILL, by PID, to any worker still there
    return survivors


async def one_run(serve: Serve, port: int, ledger: Ledger, run: int) -> tuple[int, bool]:
    """Send until a random moment, then SIGKILL the core.  (acknowledged, cut mid-message)."""
    client = asyncio.create_task(send_until_cut(port, ledger, run))
    await asyncio.sleep(random.uniform(0.2, 1.5))
    cuts_before = len(ledger.cut)
    serve.kill()
    acknowledged = await asyncio.wait_for(client, timeout=CLIENT_TIMEOUT * 2)
    return acknowledged, len(ledger.cut) > cuts_before


def test_sigkill_at_random_moments_loses_no_acknowledged_message(tmp_path: Path) -> None:
    begun = time.monotonic()
    ledger = Ledger()
    dumps = Dumps()
    survivors: list[int] = []
    with serve_bed(tmp_path) as bed:
        config = write_serve_config(
            tmp_path / "zoneq",
            mx_port=bed.sink.port,
            dns_port=bed.dns.port,
            connections=CONNECTIONS,
            processes=PROCESSES,
        )
        port = smtp_port(config)
        for run in range(KILLS):
            serve = start_serve(config, tmp_path / f"serve-{run}.log")
            try:
                serve.wait_ready(expected_workers=PROCESSES + 1)
                asyncio.run(one_run(serve, port, ledger, run))
            finally:
                serve.kill()
                survivors += stop_killed(serve)
        loop_s = time.monotonic() - begun

        # The last start: everything acknowledged must come out, then a quiet spell.
        expected = {(m, r) for m, rs in ledger.acknowledged.items() for r in rs}
        last = start_serve(config, tmp_path / "serve-last.log")
        try:
            last.wait_ready(expected_workers=PROCESSES + 1)
            deadline = time.monotonic() + DELIVERY_TIMEOUT
            seen, since = (-1, -1), time.monotonic()
            while time.monotonic() < deadline:
                counts = dumps.scan(bed.sink)
                if counts != seen:
                    seen, since = counts, time.monotonic()
                done = set(dumps.delivered()) | dumps.bounced()
                if expected <= done and time.monotonic() - since >= QUIET:
                    break
                time.sleep(0.1)
            stop_s = last.terminate()
        finally:
            last.cleanup()
        dumps.scan(bed.sink)

    async def inspect() -> tuple[int, dict[bytes, int], dict[bytes, int]]:
        store = QueueStore.open(config.parent / "queue")
        store.recover()
        try:
            counters = {k: v for k, v in store.counters().items() if v}
            recount = {k: v for k, v in store.recount().items() if v}
            return store.message_count(), counters, recount
        finally:
            await store.close()

    queued, counters, recount = asyncio.run(inspect())
    runtime_s = time.monotonic() - begun

    delivered = dumps.delivered()
    bounced = dumps.bounced()
    copies = sum(delivered.values())
    duplicates = sum(n - 1 for n in delivered.values())
    missing = sorted(expected - set(delivered) - bounced)
    sent = set(ledger.acknowledged) | set(ledger.cut)
    unknown = sorted({m for m, _ in delivered} - sent)
    damaged = sorted(
        copy.message_id
        for copy in dumps.copies.values()
        if SENDER not in copy.recipients and copy.digest != ledger.digests.get(copy.message_id)
    )
    wrong_rcpt = sorted(
        (m, r)
        for m, r in delivered
        if r not in (ledger.acknowledged.get(m) or ledger.cut.get(m) or [])
    )
    cut_stored = sum(1 for m in ledger.cut if any((m, r) in delivered for r in ledger.cut[m]))
    # A message cut by a kill was stored whole, with all its recipients, or not at all.
    cut_partly = sorted(
        m
        for m, rs in ledger.cut.items()
        if 0 < sum((m, r) in delivered or (m, r) in bounced for r in rs) < len(rs)
    )
    limit = KILLS * CONNECTIONS * PROCESSES
    print(
        f"\nreceiver crash: {KILLS} kills, {len(ledger.acknowledged)} messages acknowledged "
        f"({len(expected)} message-recipient pairs), {len(ledger.cut)} cut by a kill "
        f"({cut_stored} of them stored and delivered), {len(ledger.refused)} refused; "
        f"{copies} copies, {duplicates} duplicate(s) (limit {limit}), {len(bounced)} bounced, "
        f"{dumps.partial} dump(s) left incomplete by a kill, {len(survivors)} worker(s) outlived "
        f"a killed core; loop {loop_s:.1f} s, last stop "
        f"{stop_s:.1f} s, runtime {runtime_s:.1f} s"
    )
    assert not missing, f"{len(missing)} acknowledged pair(s) never delivered: {missing[:10]}"
    assert not damaged, f"copies delivered with content not as sent: {damaged[:10]}"
    assert not unknown, f"delivered but never sent: {unknown[:10]}"
    assert not wrong_rcpt, f"delivered to a recipient not given: {wrong_rcpt[:10]}"
    assert not cut_partly, f"cut messages delivered to only some recipients: {cut_partly}"
    assert duplicates <= limit
    assert queued == 0, counters
    assert counters == recount
    assert not survivors, f"workers outlived their killed core (killed by PID): {survivors}"
