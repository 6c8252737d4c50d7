"""The fault tests' bookkeeping: what a client was told, and what reached the remote MX.

A client sends over SMTP and writes each (Message-ID, recipients) to a :class:`Ledger` only
once the 250 came back; an exchange that a fault cut short goes to ``cut`` (it may have been
stored or not, never in part), a clean refusal to ``refused`` (4xx) or ``refused_5xx``
(which a local fault must never cause).  smtp-sink dumps every transaction to a file;
:class:`Dumps` reads them back as copies per (Message-ID, recipient), and DSNs to the sender
as bounces per (Message-ID, recipient) they report failed.  :func:`audit` puts the two side
by side; a DSN is a correct outcome only for a recipient at a domain whose MX refuses.

Every message names itself on its last body line and its content is known by digest, so a
copy that arrives damaged or cut is caught as well as one that never arrives.

An extra copy must be explained.  A SIGKILL test calls :meth:`Ledger.kill_now` right before
the signal (the client transactions under way then, and which of them had sent DATA) and,
once the workers are gone, :meth:`Kill.settle` (which pairs that instance of zoneq put at the
MX while its queue still holds them: delivered, but the kill came before the outcome was
written).  Each such pair explains one extra copy, per kill; every other extra copy needs a
possible duplicate the core logged (RFC 1047's window) for that message and recipient: the
log names the queue id, which a copy's Received field (or a queue read at a kill) ties to
its Message-ID.  An extra DSN is counted per pair it reports, and a logged duplicate of a
DSN explains an extra report of only the pairs that DSN reports: a message to several
domains that refuse gets a DSN for each, and one may not excuse another.  A message refused
with 4xx that reached the MX anyway is a duplicate in waiting (its client sends it again),
allowed only when it was under way at a kill: RFC 1047's window on the receiving side,
where the commit may land but the reply is lost or turned into a 4xx.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import shutil
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import NamedTuple

import aiosmtplib

from tests.support.smtpsink import Sink, parse_dump
from zoneq.errors import NotFound
from zoneq.protocol.ids import format_id
from zoneq.storage import keys
from zoneq.storage.store import QueueStore

SENDER = "sender@src.test"
CLIENT_TIMEOUT = 10.0
SIZES = (300, 2_000, 20_000, 70_000, 150_000)  # within one chunk, and across several
# The core names the message by its queue id (zoneq/queue/service.py): the recipient address
# alone would let a duplicate logged for one message excuse an extra copy of another.
DUPLICATE_LOG = re.compile(r"possible duplicate: ([0-9a-f]{16}) to (\S+) via")
# The Received field zoneq writes first carries its queue id (zoneq/receiver/message.py),
# folded anywhere (RFC 5322 section 2.2.3): how a copy at the MX names its queue id.
RECEIVED_ID = re.compile(rb"^Received: [^\n]* \(zoneq\) with \S+ id ([0-9a-f]{16})", re.MULTILINE)
FOLD = re.compile(rb"\r?\n[ \t]+")
# A DSN's per-recipient fields form one block (RFC 3464 section 2.3); only Action "failed"
# reports a bounce ("delayed" says the message is still queued, section 2.3.3).
BLOCK_END = re.compile(rb"\r?\n\r?\n")
FINAL_RECIPIENT = re.compile(rb"^Final-Recipient: *rfc822; *(\S+)", re.MULTILINE | re.IGNORECASE)
ACTION_FAILED = re.compile(rb"^Action: *failed\b", re.MULTILINE | re.IGNORECASE)
# Both line ends: smtp-sink dumps LF, the queue stores the message as it came (CRLF).
MESSAGE_ID = re.compile(rb"^Message-ID: (\S+)\r?$", re.MULTILINE | re.IGNORECASE)
Pair = tuple[str, str]  # (Message-ID, recipient)


class Extra(NamedTuple):
    """What an extra arrival at the MX is counted as: one more copy of ``message_id`` to
    ``recipient`` or, with ``dsn``, one more DSN to the sender reporting that pair failed."""

    message_id: str
    recipient: str
    dsn: bool = False


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
class Kill:
    """What was in flight when the core got its SIGKILL."""

    open: dict[str, list[str]]  # client transactions under way: Message-ID -> recipients
    data: set[str]  # of those, the ones whose DATA command had gone out
    # Pairs this instance of zoneq put at the MX (a copy, or a DSN reporting them) while its
    # queue still holds them: the delivery was done, its outcome not yet written.
    delivering: set[Pair] = field(default_factory=set)
    bouncing: set[Pair] = field(default_factory=set)
    # Pairs reported by DSNs the killed queue held (generated, not yet delivered, or
    # delivered without the outcome written): the kill landed during bounce generation.
    dsns_queued: set[Pair] = field(default_factory=set)
    queue_ids: dict[str, str] = field(default_factory=dict)  # held then: queue id -> Message-ID

    def settle(self, seen: Dumps, sink: Sink, data_dir: Path, scratch: Path) -> None:
        """Fill in the deliveries in flight, once the killed core's workers are gone (they
        may finish a transaction after the core died): ``seen`` is scanned since the last
        kill, the queue read from a copy (``scratch``) so the next start recovers it itself."""
        before_delivered, before_bounced = seen.delivered(), seen.bounces()
        seen.scan(sink)
        queued = queued_pairs(data_dir, scratch)
        grew = {p for p, n in seen.delivered().items() if n > before_delivered[p]}
        grew_bounces = {p for p, n in seen.bounces().items() if n > before_bounced[p]}
        self.delivering = grew & queued.pairs
        self.bouncing = grew_bounces & queued.bounces
        self.dsns_queued = queued.bounces
        self.queue_ids = queued.ids


@dataclass
class Ledger:
    acknowledged: dict[str, list[str]] = field(default_factory=dict)  # 250 came back
    cut: dict[str, list[str]] = field(default_factory=dict)  # exchange cut by a fault
    digests: dict[str, str] = field(default_factory=dict)  # every message ever sent
    refused: dict[str, list[str]] = field(default_factory=dict)  # a clean 4xx: id -> rcpts
    refusals: list[str] = field(default_factory=list)  # the 4xx replies, for the report
    refused_5xx: list[str] = field(default_factory=list)  # must stay empty
    under_way: dict[str, list[str]] = field(default_factory=dict)  # transactions open now
    in_data: set[str] = field(default_factory=set)  # of those, past the DATA command
    kills: list[Kill] = field(default_factory=list)

    def kill_now(self) -> Kill:
        """Note what is under way; call right before the SIGKILL, in the clients' event loop
        (so that no client moves between the note and the signal)."""
        kill = Kill(dict(self.under_way), set(self.in_data))
        self.kills.append(kill)
        return kill

    def kills_mid_data(self) -> int:
        """Kills that cut a message after its DATA command: it never got a reply."""
        return sum(1 for kill in self.kills if kill.data & self.cut.keys())

    def kills_with_dsns(self) -> int:
        """Kills that found DSNs in the queue: bounce generation was cut short."""
        return sum(1 for kill in self.kills if kill.dsns_queued)

    def killed_under_way(self) -> set[str]:
        """Every message under way at some kill."""
        return {m for kill in self.kills for m in kill.open}

    def queue_ids(self) -> dict[str, str]:
        """Queue ids to Message-IDs, as the queues read at the kills held them (a DSN copy
        carries no Received field of zoneq's: this is how its queue id is known)."""
        return {q: m for kill in self.kills for q, m in kill.queue_ids.items()}

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
            sent = message_id
            ledger.under_way[sent] = recipients
            try:
                await transaction(client, ledger, message_id, recipients, wire)
            except aiosmtplib.SMTPResponseException as error:
                if error.code == 421:  # the server is closing: a cut exchange
                    raise
                if error.code < 500:
                    ledger.refused[message_id] = recipients
                note_refusal(ledger, message_id, error)
                message_id = ""
                await client.rset()
                continue
            finally:
                ledger.under_way.pop(sent, None)
                ledger.in_data.discard(sent)
            ledger.acknowledged[message_id] = recipients
            acknowledged += 1
            message_id = ""
            if load.pause:
                await asyncio.sleep(load.pause)
    except (aiosmtplib.SMTPException, OSError) as error:
        if message_id:
            ledger.cut[message_id] = recipients
        elif isinstance(error, aiosmtplib.SMTPResponseException):
            # Refused outside a transaction: the greeting (RFC 5321 section 3.1 lets a server
            # answer 554 instead of 220, or 421 while it closes) or the RSET after a refusal.
            note_refusal(ledger, "session", error)
    finally:
        ledger.under_way.pop(message_id, None)
        ledger.in_data.discard(message_id)
        client.close()
    return acknowledged


def note_refusal(ledger: Ledger, what: str, error: aiosmtplib.SMTPResponseException) -> None:
    """Note a refusal of ``what`` (a Message-ID, or the session): a 5xx is one a local fault
    must never cause, a 4xx one the client may meet and sends again."""
    note = f"{what}: {error.code} {error.message}"
    (ledger.refused_5xx if error.code >= 500 else ledger.refusals).append(note)


async def until_data(ledger: Ledger, *, wanted: bool, timeout: float = 3.0) -> None:
    """When ``wanted``, wait (bounded) until a client has sent DATA and awaits its reply."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while wanted and not ledger.in_data and loop.time() < deadline:
        await asyncio.sleep(0)  # every turn of the loop: DATA may be open only briefly


async def transaction(
    client: aiosmtplib.SMTP, ledger: Ledger, message_id: str, recipients: list[str], wire: bytes
) -> None:
    """MAIL, RCPT and DATA one by one (aiosmtplib's ``sendmail`` does the same, without
    PIPELINING), so that the ledger knows when the DATA command has gone out.  Any refusal
    raises (a recipient refused is a refused message: the client sends no DATA)."""
    await client.mail(SENDER)
    for recipient in recipients:
        await client.rcpt(recipient)
    ledger.in_data.add(message_id)
    await client.data(wire)


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
    queue_id: str = ""  # zoneq's, from its Received field ("" for a DSN: zoneq wrote it)


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
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                # A transaction the client broke off (zoneq abandons a message whose body
                # chunk is gone): smtp-sink removes its file, here between glob and read.
                continue
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

    def queue_ids(self) -> dict[str, str]:
        """Queue ids to Message-IDs, from the copies' Received fields."""
        return {c.queue_id: c.message_id for c in self.copies.values() if c.queue_id}

    def dsn_reports(self) -> dict[str, list[Pair]]:
        """The pairs each DSN (by its own Message-ID) reports."""
        return {c.message_id: c.bounce_of for c in self.copies.values() if c.bounce_of}


def parse_copy(data: bytes) -> Copy:
    dump = parse_dump(data)
    recipients = []
    for arg in dump.rcpt_args:
        match = re.search(r"<([^>]*)>", arg)
        recipients.append(match.group(1).lower() if match else arg.strip().lower())
    content = dump.content
    message_id = message_id_of(content)
    start = content.find(f"\nFrom: {SENDER}\n".encode())
    digest = hashlib.sha256(content[start + 1 :]).hexdigest() if start >= 0 else ""
    bounce_of = reported(content, message_id) if SENDER in recipients else []
    return Copy(message_id, recipients, digest, bounce_of, queue_id_of(content))


def message_id_of(content: bytes) -> str:
    found = MESSAGE_ID.search(content)
    return found.group(1).decode() if found else ""


def queue_id_of(content: bytes) -> str:
    """The queue id in the Received field zoneq wrote, "" if there is none."""
    header = content.split(b"\n\n", 1)[0]
    found = RECEIVED_ID.search(FOLD.sub(b" ", header))
    return found.group(1).decode() if found else ""


def reported(dsn: bytes, message_id: str) -> list[Pair]:
    """The (Message-ID, recipient) pairs a DSN reports failed.  Its returned headers carry
    the original Message-ID (RFC 3464 section 2); its own pairs with nothing sent."""
    original = re.findall(rb"Message-ID: (<[^>\s]+>)", dsn, re.IGNORECASE)
    failed = [
        found.group(1)
        for block in BLOCK_END.split(dsn)
        if (found := FINAL_RECIPIENT.search(block)) and ACTION_FAILED.search(block)
    ]
    return [
        (returned.decode(), r.decode().lower())
        for returned in original
        if returned.decode() != message_id
        for r in failed
    ]


@dataclass(frozen=True)
class Queued:
    """What a stopped zoneq's queue holds."""

    pairs: set[Pair]  # (Message-ID, recipient) still to deliver
    bounces: set[Pair]  # the pairs its queued DSNs report
    ids: dict[str, str]  # queue id -> Message-ID, DSNs included


def queued_pairs(data_dir: Path, scratch: Path) -> Queued:
    """What a stopped zoneq's queue holds, read from a copy at ``scratch``: opening the
    queue recovers it, and that is for the next ``zoneq serve`` to do."""
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(data_dir, scratch, ignore=shutil.ignore_patterns("*.sock", "LOCK"))

    async def read() -> Queued:
        store = QueueStore.open(scratch)
        store.recover()
        queued = Queued(set(), set(), {})
        try:
            ids = {keys.decode_message_key(k)[0] for k in store.database.keys(prefix=keys.MESSAGE)}
            for msg_id in sorted(ids):
                try:
                    rcpts = [q.recipient.address.lower() for q in store.recipients(msg_id)]
                except NotFound:
                    continue  # chunks without a committed head: swept as an orphan
                head = b"".join(islice(store.body(msg_id), 3))  # headers and DSN fields
                message_id = message_id_of(head)
                queued.ids[format_id(msg_id)] = message_id
                if SENDER in rcpts:
                    queued.bounces.update(reported(head, message_id))
                queued.pairs.update((message_id, r) for r in rcpts if r != SENDER)
        finally:
            await store.close()
        shutil.rmtree(scratch, ignore_errors=True)
        return queued

    return asyncio.run(read())


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


def logged_duplicates(logs: Sequence[Path]) -> Counter[tuple[str, str]]:
    """Possible duplicates the core logged (the RFC 1047 window), per (queue id, recipient)."""
    count: Counter[tuple[str, str]] = Counter()
    for log in logs:
        for match in DUPLICATE_LOG.finditer(log.read_text(errors="replace")):
            count[(match.group(1), match.group(2).lower())] += 1
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
    # Extra copies, and extra DSN reports, per pair that no kill explains: each needs a
    # logged possible duplicate.
    unexplained: Counter[Extra] = field(default_factory=Counter)
    explained: int = 0  # extra copies and DSNs explained by a delivery in flight at a kill
    refused_delivered: list[str] = field(default_factory=list)  # 4xx, then delivered anyway
    refused_under_way: int = 0  # the same, but under way at a kill: allowed
    bounced_wrongly: list[Pair] = field(default_factory=list)  # at a domain that accepts
    delivered_and_bounced: list[Pair] = field(default_factory=list)
    queue_ids: dict[str, str] = field(default_factory=dict)  # queue id -> Message-ID
    dsn_reports: dict[str, list[Pair]] = field(default_factory=dict)  # by the DSN's Message-ID

    @property
    def duplicate_count(self) -> int:
        return sum(self.duplicates.values())

    def unexplained_duplicates(self, logged: Counter[tuple[str, str]]) -> dict[Extra, int]:
        """Extra copies and DSN reports that neither a kill nor a possible duplicate the
        core logged (``logged_duplicates``) explains, as in ``unexplained``."""
        excused = self.excused(logged)
        return {p: n - excused[p] for p, n in self.unexplained.items() if n > excused[p]}

    def excused(self, logged: Counter[tuple[str, str]]) -> Counter[Extra]:
        """The extra copies the possible duplicates logged per (queue id, recipient) may
        explain, one each, keyed as in ``unexplained``."""
        excused: Counter[Extra] = Counter()
        for (queue_id, recipient), n in logged.items():
            message_id = self.queue_ids.get(queue_id)
            if message_id is None:
                continue  # no copy of it reached the MX, and no queue read at a kill held it
            if recipient == SENDER:  # a DSN: one extra report of each pair it reports
                for original, failed in self.dsn_reports.get(message_id, []):
                    excused[Extra(original, failed, dsn=True)] += n
            else:
                excused[Extra(message_id, recipient)] += n
        return excused

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
        if self.refused_delivered:
            found.append(
                f"{len(self.refused_delivered)} message(s) refused with 4xx yet delivered or "
                f"bounced, not under way at any kill: {self.refused_delivered[:5]}"
            )
        if self.bounced_wrongly:
            found.append(f"reported failed, yet the remote accepts: {self.bounced_wrongly[:5]}")
        if self.delivered_and_bounced:
            found.append(f"delivered and reported failed: {self.delivered_and_bounced[:5]}")
        return found

    def summary(self) -> str:
        return (
            f"{len(self.expected)} acknowledged pair(s), {self.copies} copies, "
            f"{self.duplicate_count} duplicate(s) ({self.explained} copies or DSNs in flight "
            f"at a kill), {sum(self.bounces.values())} bounce report(s), {self.partial} partial "
            f"dump(s), {self.refused_under_way} refused under way at a kill yet delivered"
        )


def audit(ledger: Ledger, dumps: Dumps, *, may_bounce: Collection[str] = ()) -> Audit:
    """The verdict; ``may_bounce``: the domains whose MX refuses (every other accepts all,
    so a DSN reporting one of its recipients is a fault, not an outcome)."""
    delivered = dumps.delivered()
    bounces = dumps.bounces()
    bounced = set(bounces)
    expected = ledger.expected()
    duplicates: Counter[str] = Counter()
    for (_, recipient), n in delivered.items():
        if n > 1:
            duplicates[recipient] += n - 1
    sent = set(ledger.acknowledged) | set(ledger.cut) | set(ledger.refused)
    # Each kill explains one extra copy of each pair it caught in flight (and one extra DSN).
    in_flight = Counter(p for kill in ledger.kills for p in kill.delivering)
    in_flight_dsn = Counter(p for kill in ledger.kills for p in kill.bouncing)
    unexplained: Counter[Extra] = Counter()
    explained = 0
    for book, caught, dsn in ((delivered, in_flight, False), (bounces, in_flight_dsn, True)):
        for pair, n in book.items():
            extra = n - 1
            explained += min(extra, caught[pair]) if extra > 0 else 0
            if extra > caught[pair]:
                unexplained[Extra(*pair, dsn=dsn)] += extra - caught[pair]
    landed = {m for m, _ in delivered} | {m for m, _ in bounced}
    refused_landed = sorted(set(ledger.refused) & landed)
    under_way = ledger.killed_under_way()
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
        unexplained=unexplained,
        explained=explained,
        refused_delivered=[m for m in refused_landed if m not in under_way],
        refused_under_way=sum(1 for m in refused_landed if m in under_way),
        bounced_wrongly=sorted(p for p in bounced if p[1].rpartition("@")[2] not in may_bounce),
        delivered_and_bounced=sorted(set(delivered) & bounced),
        queue_ids=ledger.queue_ids() | dumps.queue_ids(),
        dsn_reports=dumps.dsn_reports(),
    )
