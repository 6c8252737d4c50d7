"""The fault tests' bookkeeping: what a client was told, and what reached the remote MX.

A client sends over SMTP and writes each (Message-ID, recipients) to a :class:`Ledger` only
once the 250 came back; an exchange that a fault cut short goes to ``cut`` (it may have been
stored or not, never in part), a clean refusal to ``refused`` (4xx) or ``refused_5xx``
(which a local fault must never cause).  smtp-sink dumps every transaction to a file;
:class:`Dumps` reads them back as copies per (Message-ID, recipient), and DSNs to the sender
as bounces per (Message-ID, recipient) they report.  :func:`audit` puts the two side by side.

Every message names itself on its last body line and its content is known by digest, so a
copy that arrives damaged or cut is caught as well as one that never arrives.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiosmtplib

from tests.support.smtpsink import Sink, parse_dump

SENDER = "sender@src.test"
CLIENT_TIMEOUT = 10.0
SIZES = (300, 2_000, 20_000, 70_000, 150_000)  # within one chunk, and across several
DUPLICATE_LOG = re.compile(r"possible duplicate: \S+ to (\S+) via")


# --- the messages ----------------------------------------------------------------------------


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


def make_message(
    message_id: str, recipients: Sequence[str], size: int, sender: str = SENDER
) -> tuple[bytes, str]:
    """The message as sent (CRLF), and the SHA-256 of its text as smtp-sink dumps it (LF)."""
    head = [
        f"From: {sender}",
        f"To: {', '.join(recipients)}",
        f"Subject: fault test {message_id}",
        f"Message-ID: {message_id}",
        "",
    ]
    lines = [line.encode() for line in head] + body_lines(message_id, size)
    wire = b"\r\n".join(lines) + b"\r\n"
    return wire, hashlib.sha256(b"\n".join(lines) + b"\n").hexdigest()


@dataclass
class Ledger:
    acknowledged: dict[str, list[str]] = field(default_factory=dict)  # 250 came back
    cut: dict[str, list[str]] = field(default_factory=dict)  # exchange cut by a fault
    digests: dict[str, str] = field(default_factory=dict)  # every message ever sent
    refused: dict[str, list[str]] = field(default_factory=dict)  # a clean 4xx: id -> rcpts
    refusals: list[str] = field(default_factory=list)  # the 4xx replies, for the report
    refused_5xx: list[str] = field(default_factory=list)  # must stay empty

    def expected(self) -> set[tuple[str, str]]:
        """Every (Message-ID, recipient) that got its 250."""
        return {(m, r) for m, rs in self.acknowledged.items() for r in rs}

    def given(self, message_id: str) -> list[str]:
        """The recipients a message was sent to, whatever became of it."""
        for book in (self.acknowledged, self.cut, self.refused):
            if message_id in book:
                return book[message_id]
        return []


@dataclass
class Load:
    """A client's choice of recipients and sizes (``pick`` recipients from ``pool``)."""

    pool: Sequence[str]
    pick: tuple[int, int] = (1, 3)
    sizes: Sequence[int] = SIZES
    pause: float = 0.0  # between messages: a steady load instead of a flood

    def recipients(self) -> list[str]:
        low, high = self.pick
        return random.sample(list(self.pool), random.randint(low, min(high, len(self.pool))))


async def send_until_cut(
    port: int,
    ledger: Ledger,
    tag: str,
    load: Load,
    *,
    limit: int = 100_000,
    stop: asyncio.Event | None = None,
) -> int:
    """Send messages one after another on one connection until the server goes away (or
    ``limit`` were sent, or ``stop`` is set); each goes in the ledger only once its 250 came
    back.  The number acknowledged."""
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
        for n in range(limit):
            if stop is not None and stop.is_set():
                break
            message_id = f"<{tag}-{n}.{random.getrandbits(32):08x}@src.test>"
            recipients = load.recipients()
            wire, digest = make_message(message_id, recipients, random.choice(load.sizes))
            ledger.digests[message_id] = digest
            try:
                errors, _reply = await client.sendmail(SENDER, recipients, wire)
            except aiosmtplib.SMTPResponseException as error:
                if error.code == 421:  # the server is closing: a cut exchange
                    raise
                note = f"{message_id}: {error.code} {error.message}"
                if error.code >= 500:
                    ledger.refused_5xx.append(note)
                else:
                    ledger.refused[message_id] = recipients
                    ledger.refusals.append(note)
                message_id = ""
                await client.rset()
                continue
            assert not errors, (message_id, errors)
            ledger.acknowledged[message_id] = recipients
            acknowledged += 1
            message_id = ""
            if load.pause:
                await asyncio.sleep(load.pause)
    except (aiosmtplib.SMTPException, OSError):
        if message_id:
            ledger.cut[message_id] = recipients
    finally:
        client.close()
    return acknowledged


async def send_for(
    port: int, ledger: Ledger, tag: str, load: Load, seconds: float, *, clients: int = 1
) -> int:
    """``clients`` connections sending for about ``seconds`` (each reconnecting when cut);
    the number acknowledged."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds

    async def one(index: int) -> int:
        total = 0
        for attempt in range(1000):
            if loop.time() >= deadline:
                break
            total += await send_until_cut(port, ledger, f"{tag}-{index}-{attempt}", load, stop=stop)
            await asyncio.sleep(0.05)  # the server dropped us: reconnect, not too eagerly
        return total

    tasks = [asyncio.create_task(one(i)) for i in range(clients)]
    await asyncio.sleep(seconds)
    stop.set()
    return sum(await asyncio.wait_for(asyncio.gather(*tasks), CLIENT_TIMEOUT * 2))


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

    def bounces(self) -> Counter[tuple[str, str]]:
        """DSNs per (Message-ID, recipient) they report."""
        return Counter(pair for copy in self.copies.values() for pair in copy.bounce_of)

    def bounced(self) -> set[tuple[str, str]]:
        return set(self.bounces())


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
        # The DSN's returned headers carry the original Message-ID (RFC 3464 section 2);
        # the DSN's own Message-ID pairs with nothing sent and is ignored by the audit.
        original = re.findall(rb"Message-ID: (<[^>\s]+>)", content, re.IGNORECASE)
        failed = re.findall(rb"Final-Recipient: rfc822; *(\S+)", content, re.IGNORECASE)
        for returned in original:
            if returned.decode() != message_id:
                bounce_of += [(returned.decode(), r.decode().lower()) for r in failed]
    return Copy(message_id, recipients, digest, bounce_of)


def wait_settled(
    sink: Sink,
    dumps: Dumps,
    done: set[tuple[str, str]] | None,
    *,
    timeout: float,
    quiet: float = 2.5,
    sleep: float = 0.1,
) -> bool:
    """Wait (bounded) until every pair of ``done`` is delivered or bounced and then no new
    dump came for ``quiet`` seconds (redeliveries still under way are counted too)."""
    deadline = time.monotonic() + timeout
    seen, since = (-1, -1), time.monotonic()
    while time.monotonic() < deadline:
        counts = dumps.scan(sink)
        if counts != seen:
            seen, since = counts, time.monotonic()
        settled = set(dumps.delivered()) | dumps.bounced()
        if (done is None or done <= settled) and time.monotonic() - since >= quiet:
            return True
        time.sleep(sleep)
    return False


def logged_duplicates(logs: Sequence[Path]) -> Counter[str]:
    """Possible duplicates the core logged (the RFC 1047 window), per recipient address."""
    count: Counter[str] = Counter()
    for log in logs:
        for match in DUPLICATE_LOG.finditer(log.read_text(errors="replace")):
            count[match.group(1).lower()] += 1
    return count


# --- the verdict -----------------------------------------------------------------------------


@dataclass
class Audit:
    """The ledger against the sink.  ``problems()`` is empty when nothing went wrong."""

    expected: set[tuple[str, str]]
    missing: list[tuple[str, str]]  # acknowledged, neither delivered nor bounced
    damaged: list[str]  # a copy whose content is not what was sent
    unknown: list[str]  # delivered but never sent
    wrong_rcpt: list[tuple[str, str]]  # delivered to a recipient not given
    cut_partly: list[str]  # a cut message delivered to some of its recipients only
    copies: int
    duplicates: Counter[str]  # extra copies per recipient
    bounces: Counter[tuple[str, str]]
    partial: int

    @property
    def duplicate_count(self) -> int:
        return sum(self.duplicates.values())

    def unexplained_duplicates(self, logged: Counter[str]) -> dict[str, int]:
        """Extra copies beyond the possible duplicates the core logged, per recipient."""
        return {r: n - logged[r] for r, n in self.duplicates.items() if n > logged[r]}

    def problems(self) -> list[str]:
        found = []
        if self.missing:
            found.append(f"{len(self.missing)} acknowledged pair(s) lost: {self.missing[:5]}")
        if self.damaged:
            found.append(f"copies not as sent: {self.damaged[:5]}")
        if self.unknown:
            found.append(f"delivered but never sent: {self.unknown[:5]}")
        if self.wrong_rcpt:
            found.append(f"delivered to a recipient not given: {self.wrong_rcpt[:5]}")
        if self.cut_partly:
            found.append(f"cut messages delivered to some recipients only: {self.cut_partly}")
        return found

    def summary(self) -> str:
        return (
            f"{len(self.expected)} acknowledged pair(s), {self.copies} copies, "
            f"{self.duplicate_count} duplicate(s), {sum(self.bounces.values())} bounce report(s)"
            f", {self.partial} partial dump(s)"
        )


def audit(ledger: Ledger, dumps: Dumps) -> Audit:
    delivered = dumps.delivered()
    bounces = dumps.bounces()
    bounced = set(bounces)
    expected = ledger.expected()
    duplicates: Counter[str] = Counter()
    for (_, recipient), n in delivered.items():
        if n > 1:
            duplicates[recipient] += n - 1
    sent = set(ledger.acknowledged) | set(ledger.cut) | set(ledger.refused)
    return Audit(
        expected=expected,
        missing=sorted(expected - set(delivered) - bounced),
        damaged=sorted(
            copy.message_id
            for copy in dumps.copies.values()
            if SENDER not in copy.recipients and copy.digest != ledger.digests.get(copy.message_id)
        ),
        unknown=sorted({m for m, _ in delivered} - sent),
        wrong_rcpt=sorted((m, r) for m, r in delivered if r not in ledger.given(m)),
        cut_partly=sorted(
            m
            for m, rs in ledger.cut.items()
            if 0 < sum((m, r) in delivered or (m, r) in bounced for r in rs) < len(rs)
        ),
        copies=sum(delivered.values()),
        duplicates=duplicates,
        bounces=bounces,
        partial=dumps.partial,
    )
