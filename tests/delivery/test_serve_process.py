"""``zoneq serve`` as a real process: memory on a 100 MB message, a killed core, SIGTERM.

Messages are queued with the store before ``serve`` starts and the queue is inspected after
it stopped (LevelDB admits one process at a time).  dnsmasq answers the MX lookups; Postfix's
smtp-sink is the remote MX and dumps each transaction to a file, which is how a test sees
what was delivered.  ``tests/support/serve.py`` starts and stops the processes, by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.receiver.processes import start_receiver_serve
from tests.support.dnsmasq import Dnsmasq, running_dnsmasq
from tests.support.serve import (
    rss_anon_kib,
    running_serve,
    smtp_port,
    start_serve,
    write_serve_config,
)
from tests.support.smtpsink import Sink, run_smtp_sink
from zoneq.storage.records import MessageMeta, NewRecipient
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

CHUNK = 65_536
LINE = 64  # octets per body line with its CRLF: 1,024 lines to a chunk, none split
BIG_CHUNKS = 1_600  # 100 MiB
GROWTH_LIMIT_KIB = 32 * 1024
WORDS = (
    b"the quick brown fox jumps over a lazy dog while seven zone workers "
    b"relay outbound mail through leveldb queues and smtp sessions daily "
)
SENDER = "sender@src.test"


@dataclass
class Bed:
    sink: Sink
    dns: Dnsmasq
    directory: Path

    def config(self, connections: int = 4) -> Path:
        return write_serve_config(
            self.directory / "zoneq",
            mx_port=self.sink.port,
            dns_port=self.dns.port,
            connections=connections,
        )


@contextlib.contextmanager
def serve_bed(directory: Path, *sink_options: str) -> Iterator[Bed]:
    """smtp-sink (with ``sink_options``) as the MX of ok.test and src.test, via dnsmasq."""
    sink_ip = f"127.0.{random.randint(1, 250)}.{random.randint(2, 250)}"
    with run_smtp_sink(*sink_options, host=sink_ip) as sink:
        records = [
            "mx-host=ok.test,mx.ok.test,10",
            f"host-record=mx.ok.test,{sink_ip}",
            "mx-host=src.test,mx.src.test,10",
            f"host-record=mx.src.test,{sink_ip}",
        ]
        with running_dnsmasq(records, directory / "dns") as dns:
            yield Bed(sink, dns, directory)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def data_dir(config: Path) -> Path:
    return config.parent / "queue"


# --- queueing and inspecting, while serve is not running ---------------------------------


async def queue_small(directory: Path, count: int) -> set[str]:
    """``count`` one-chunk messages, each with its own Message-ID; the Message-IDs."""
    store = QueueStore.open(directory, chunk_size=CHUNK)
    store.recover()
    ids = set()
    try:
        for n in range(count):
            message_id = f"<serve-{n}.{random.getrandbits(32):08x}@src.test>"
            body = (
                f"From: {SENDER}\r\nTo: r{n}@ok.test\r\nSubject: serve {n}\r\n"
                f"Message-ID: {message_id}\r\n\r\nMessage {n}.\r\n"
            ).encode()
            msg_id = store.begin(now_ms())
            meta = MessageMeta(msg_id, SENDER, len(body), 1, now_ms())
            await store.commit(
                meta, [NewRecipient(f"r{n}@ok.test", "default")], now_ms(), tail=body
            )
            ids.add(message_id)
    finally:
        await store.close()
    return ids


def big_body(message_id: str, chunks: int) -> Iterator[bytes]:
    """``chunks`` chunks of mail-like text, CRLF lines of 64 octets, one chunk at a time."""
    head = (
        f"From: {SENDER}\r\nTo: big@ok.test\r\nSubject: one hundred megabytes\r\n"
        f"Message-ID: {message_id}\r\nMIME-Version: 1.0\r\n"
        "Content-Type: text/plain; charset=us-ascii\r\n"
    ).encode()
    pad = -(len(head) + len(b"X-Padding: \r\n") + 2) % LINE or LINE
    head += b"X-Padding: " + b"x" * pad + b"\r\n\r\n"  # the header ends on a line boundary
    text = WORDS * 2
    line = 0
    for index in range(chunks):
        prefix = head if index == 0 else b""
        lines = []
        for _ in range((CHUNK - len(prefix)) // LINE):
            lead = b"." if line % 997 == 0 else b" "  # some lines to dot-stuff
            start = (line * 7) % len(WORDS)
            lines.append(b"%s%08d %s\r\n" % (lead, line, text[start : start + LINE - 12]))
            line += 1
        chunk = prefix + b"".join(lines)
        assert len(chunk) == CHUNK
        yield chunk


@dataclass
class BigMessage:
    size: int
    dumped_size: int  # the content as smtp-sink dumps it: LF line ends
    tail: bytes  # the last line, LF
    digest: str  # SHA-256 of the content as dumped


async def queue_big(directory: Path, chunks: int) -> BigMessage:
    store = QueueStore.open(directory, chunk_size=CHUNK)
    store.recover()
    size = lines = 0
    last = b""
    digest = hashlib.sha256()
    try:
        msg_id = store.begin(now_ms())
        for index, chunk in enumerate(big_body("<big@src.test>", chunks)):
            await store.write_chunk(msg_id, index, chunk)
            size += len(chunk)
            lines += chunk.count(b"\n")
            last = chunk[-LINE:]
            digest.update(chunk.replace(b"\r\n", b"\n"))  # chunks end on line ends
        meta = MessageMeta(msg_id, SENDER, size, chunks, now_ms())
        await store.commit(meta, [NewRecipient("big@ok.test", "default")], now_ms())
    finally:
        await store.close()
    return BigMessage(size, size - lines, last.replace(b"\r\n", b"\n"), digest.hexdigest())


@dataclass
class QueueState:
    messages: int
    counters: dict[bytes, int]
    recount: dict[bytes, int]


async def inspect(directory: Path) -> QueueState:
    store = QueueStore.open(directory, chunk_size=CHUNK)
    store.recover()
    try:
        counters = {k: v for k, v in store.counters().items() if v}
        recount = {k: v for k, v in store.recount().items() if v}
        return QueueState(store.message_count(), counters, recount)
    finally:
        await store.close()


# --- what the sink received --------------------------------------------------------------


def dumps(sink: Sink) -> tuple[list[str], int]:
    """Message-IDs of the complete dumps (one per copy delivered), and how many are not
    complete yet."""
    ids = []
    partial = 0
    for path in sorted(sink.dump_dir.glob("msg.*")):
        data = path.read_bytes()
        match = re.search(rb"^Message-ID: (\S+)$", data, re.MULTILINE | re.IGNORECASE)
        if data.endswith(b"\n\n") and match:
            ids.append(match.group(1).decode())
        else:
            partial += 1
    return ids, partial


def wait_delivered(sink: Sink, expected: set[str], timeout: float, quiet: float = 2.5) -> list[str]:
    """Wait (bounded) until every expected Message-ID was dumped and then nothing new came
    for ``quiet`` seconds (redeliveries still under way are counted too); every copy's ID."""
    deadline = time.monotonic() + timeout
    seen: tuple[int, int] = (-1, -1)
    since = time.monotonic()
    while time.monotonic() < deadline:
        ids, partial = dumps(sink)
        if (len(ids), partial) != seen:
            seen, since = (len(ids), partial), time.monotonic()
        if expected <= set(ids) and partial == 0 and time.monotonic() - since >= quiet:
            return ids
        time.sleep(0.1)
    ids, partial = dumps(sink)
    missing = len(expected - set(ids))
    pytest.fail(f"after {timeout} s: {missing} message(s) never delivered, {partial} partial")


def wait_some_delivered(sink: Sink, count: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids, _ = dumps(sink)
        if len(ids) >= count:
            return len(ids)
        time.sleep(0.05)
    pytest.fail(f"fewer than {count} message(s) delivered within {timeout} s")


# --- the tests ---------------------------------------------------------------------------


def big_dump(sink: Sink, big: BigMessage) -> Path | None:
    """The dump of the big message once it is complete (its size and last line are there)."""
    for path in sink.dump_dir.glob("msg.*"):
        with contextlib.suppress(FileNotFoundError), path.open("rb") as dump:
            dump.seek(0, 2)
            if dump.tell() < big.dumped_size:
                continue
            dump.seek(-(len(big.tail) + 1), 2)
            if dump.read() == big.tail + b"\n":
                return path
    return None


def dumped_digest(path: Path) -> str:
    """SHA-256 of a dump's content (after smtp-sink's own headers, without its final LF),
    read a chunk at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as dump:
        start = dump.read(8192).index(f"\nFrom: {SENDER}\n".encode()) + 1
        end = dump.seek(0, 2) - 1
        dump.seek(start)
        while dump.tell() < end:
            digest.update(dump.read(min(CHUNK, end - dump.tell())))
    return digest.hexdigest()


def test_a_100_mb_message_grows_no_process_by_more_than_32_mb(tmp_path: Path) -> None:
    # smtp-sink answers DATA after 1 s: the baseline is taken before any of the body moved.
    with serve_bed(tmp_path, "-w", "1") as bed:
        config = bed.config(connections=2)
        begun = time.monotonic()
        big = asyncio.run(queue_big(data_dir(config), BIG_CHUNKS))
        queued_s = time.monotonic() - begun
        serve = start_serve(config, tmp_path / "serve.log")
        try:
            samples: dict[int, list[int]] = {}  # pid -> RssAnon in KiB, every ~50 ms
            baseline: dict[int, int] = {}  # sample index when the workers were all connected
            deadline = time.monotonic() + 120
            delivered: Path | None = None
            while time.monotonic() < deadline:
                pids = [serve.pid, *serve.workers()]
                for pid in pids:
                    kib = rss_anon_kib(pid)
                    if kib is not None:
                        samples.setdefault(pid, []).append(kib)
                if not baseline and serve.ready(expected_workers=2) is not None:
                    baseline = {pid: len(samples[pid]) - 1 for pid in pids if pid in samples}
                    ready_s = time.monotonic() - begun
                delivered = big_dump(bed.sink, big) if baseline else None
                if delivered is not None:
                    break
                time.sleep(0.05)
            delivered_s = time.monotonic() - begun
            assert delivered, f"the 100 MB message was not delivered in time:\n{serve.log_text()}"
            stop_s = serve.terminate()
            restarts = sorted(set(samples) - set(baseline) - {serve.pid})
        finally:
            serve.cleanup()
        assert dumped_digest(delivered) == big.digest  # every octet arrived, in order
        state = asyncio.run(inspect(data_dir(config)))

    print(
        f"\n100 MB message ({big.size} octets): queued in {queued_s:.1f} s, serve ready at "
        f"{ready_s:.1f} s, delivered at {delivered_s:.1f} s, stopped in {stop_s:.1f} s"
    )
    growth = {}
    for pid, at in baseline.items():
        role = "core" if pid == serve.pid else "worker"
        base, peak = samples[pid][at], max(samples[pid][at:])
        growth[pid] = peak - base
        print(
            f"  {role} pid {pid}: RssAnon baseline {base / 1024:.1f} MiB, peak "
            f"{peak / 1024:.1f} MiB, growth {(peak - base) / 1024:.1f} MiB "
            f"({len(samples[pid])} samples)"
        )
    assert not restarts, f"workers restarted during the delivery: {restarts}"
    assert state.messages == 0
    assert state.counters == state.recount
    assert len(growth) == 3  # the core and the two zones' workers
    too_much = {pid: kib for pid, kib in growth.items() if kib >= GROWTH_LIMIT_KIB}
    assert not too_much, f"RssAnon grew by 32 MiB or more (KiB by pid): {too_much}"


def test_the_core_killed_mid_delivery_and_restarted_loses_nothing(tmp_path: Path) -> None:
    count, connections = 30, 4
    # smtp-sink answers the final dot after 1 s: deliveries are in flight when the core dies.
    with serve_bed(tmp_path, "-W", ".:1") as bed:
        config = bed.config(connections=connections)
        expected = asyncio.run(queue_small(data_dir(config), count))
        first = start_serve(config, tmp_path / "serve-1.log")
        try:
            workers = first.wait_ready(expected_workers=2)
            wait_some_delivered(bed.sink, 5, timeout=30)
            killed = time.monotonic()
            first.kill()  # SIGKILL, the core only: its workers must notice and go
            before = len(dumps(bed.sink)[0])
            survivors = first.wait_workers_gone(timeout=10)
            workers_gone_s = time.monotonic() - killed
        finally:
            first.cleanup()
        # The kernel dropped LevelDB's lock with the dead core: the restart must open it.
        with running_serve(config, tmp_path / "serve-2.log") as second:
            ids = wait_delivered(bed.sink, expected, timeout=45)
            second.terminate()
        state = asyncio.run(inspect(data_dir(config)))

    copies = {i: ids.count(i) for i in set(ids)}
    print(
        f"\nkilled core: {before} of {count} received by the sink at the kill, workers {workers} "
        "gone "
        f"{workers_gone_s:.1f} s after it (survivors {survivors}); {len(ids)} copies in all, "
        f"{len(ids) - len(copies)} duplicate(s) "
        f"{sorted(n for n in copies.values() if n > 1)}"
    )
    assert not survivors, f"workers outlived their killed core (killed by PID): {survivors}"
    assert set(ids) == expected  # every message delivered at least once, nothing else
    # Duplicates only for the jobs in flight at the kill (received by the sink, not yet
    # reported to the core): one per connection of the one default worker at most.
    assert len(ids) <= count + connections * 1
    assert state.messages == 0, state.counters
    assert state.counters == state.recount


def test_sigterm_under_load_stops_within_30_s_and_a_restart_delivers_the_rest(
    tmp_path: Path,
) -> None:
    count, connections = 40, 4
    with serve_bed(tmp_path, "-W", ".:1") as bed:
        config = bed.config(connections=connections)
        expected = asyncio.run(queue_small(data_dir(config), count))
        first = start_serve(config, tmp_path / "serve-1.log")
        try:
            first.wait_ready(expected_workers=2)
            # smtp-sink dumps a message on the dot, then waits 1 s to answer: with 8 dumped,
            # some deliveries are reported and others are in hand, waiting for that answer.
            wait_some_delivered(bed.sink, 8, timeout=30)
            stop_s = first.terminate(timeout=30)  # SIGKILLs and raises if it takes longer
            code = first.process.returncode
            survivors = first.wait_workers_gone(timeout=5)
        finally:
            first.cleanup()
        before, partial = dumps(bed.sink)
        with running_serve(config, tmp_path / "serve-2.log") as second:
            ids = wait_delivered(bed.sink, expected, timeout=45)
            second.terminate()
        state = asyncio.run(inspect(data_dir(config)))

    print(
        f"\nSIGTERM under load: stopped in {stop_s:.1f} s (exit {code}) with {len(before)} of "
        f"{count} received by the sink and {partial} dump(s) left incomplete; {len(ids)} "
        "copies in all"
    )
    assert code == 0
    assert not survivors, f"workers outlived a stopped core (killed by PID): {survivors}"
    assert partial == 0  # no transaction was cut off mid-DATA
    assert set(ids) == expected
    assert len(ids) == count  # finished jobs were reported before exit: no duplicates
    assert state.messages == 0, state.counters
    assert state.counters == state.recount


def test_mail_submitted_over_smtp_reaches_the_mx(tmp_path: Path) -> None:
    """The whole product: a client sends to zoneq serve's SMTP port, and the message comes
    out at the recipient's MX (smtp-sink), Received header on top, body intact."""
    import asyncio
    from email.message import EmailMessage

    import aiosmtplib

    with serve_bed(tmp_path) as bed:
        config = bed.config()
        with running_serve(config, tmp_path / "serve.log"):
            message = EmailMessage()
            message["From"] = SENDER
            message["To"] = "someone@ok.test"
            message["Subject"] = "through zoneq"
            message["Message-ID"] = "<through-zoneq@src.test>"
            message.set_content("Hello through zoneq.\n.a line with a leading dot\n")

            async def submit() -> tuple[dict[str, object], str]:
                return await aiosmtplib.send(
                    message, hostname="127.0.0.1", port=smtp_port(config), timeout=10
                )

            errors, reply = asyncio.run(submit())
            assert errors == {}
            assert "queued as" in reply
            (got,) = bed.sink.messages(1, timeout=20)
    assert got.rcpt_args == ["RCPT TO:<someone@ok.test>"] or "someone@ok.test" in got.rcpt_args[0]
    text = got.content.decode()
    assert text.startswith("Received: from ")  # ours, added at the top (RFC 5321 4.4)
    assert "by mx.zoneq.test (zoneq)" in text
    assert "Subject: through zoneq" in text
    assert "Hello through zoneq.\n.a line with a leading dot\n" in text


def _reply(stream: socket.socket) -> tuple[int, bytes]:
    """One SMTP reply (all its lines) from a blocking socket: (code, text)."""
    data = b""
    while True:
        piece = stream.recv(4096)
        if not piece:
            raise ConnectionError(f"connection closed after {data!r}")
        data += piece
        lines = data.split(b"\r\n")
        if len(lines) > 1 and len(lines[-2]) >= 4 and lines[-2][3:4] == b" ":
            return int(lines[-2][:3]), data


@pytest.mark.parametrize("receivers", [0, 2], ids=["in-core", "receiver-processes"])
def test_a_100_mb_message_sent_over_smtp_grows_no_serve_process_by_more_than_32_mb(
    tmp_path: Path, receivers: int
) -> None:
    # Issue 4: DATA streams into the store's chunks as it arrives.  The client writes the
    # body a chunk at a time (it never holds the message either), and every process of
    # serve (the core and its children: zone workers, and with ``receiver.processes`` the
    # receiver processes that take the session and stream it to the core) is sampled from
    # before MAIL until the 250.
    with serve_bed(tmp_path) as bed:
        config = bed.config(connections=2)
        lines = 'max_message_size = "200MiB"\n' + f"processes = {receivers}\n"
        config.write_text(config.read_text().replace("[receiver]\n", "[receiver]\n" + lines))
        serve = start_receiver_serve(config, tmp_path / "serve.log")  # counts receivers too
        try:
            serve.wait_ready(2 + receivers)
            receiver_pids = serve.receivers()
            assert len(receiver_pids) == receivers
            pids = [serve.pid, *serve.workers()]
            peaks: dict[int, int] = {}
            baseline = {pid: rss_anon_kib(pid) or 0 for pid in pids}
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    for pid in [serve.pid, *serve.workers()]:
                        kib = rss_anon_kib(pid)
                        if kib is not None:
                            peaks[pid] = max(peaks.get(pid, 0), kib)
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            line = (WORDS * 2)[: LINE - 2] + b"\r\n"
            chunk = line * (CHUNK // LINE)
            try:
                with socket.create_connection(("127.0.0.1", smtp_port(config)), 30) as smtp:
                    assert _reply(smtp)[0] == 220
                    for command, code in (
                        (b"EHLO client.test", 250),
                        (f"MAIL FROM:<{SENDER}> SIZE={BIG_CHUNKS * CHUNK + 200}".encode(), 250),
                        (b"RCPT TO:<big@ok.test>", 250),
                        (b"DATA", 354),
                    ):
                        smtp.sendall(command + b"\r\n")
                        got = _reply(smtp)
                        assert got[0] == code, got
                    smtp.sendall(f"From: {SENDER}\r\nSubject: big\r\n\r\n".encode())
                    for _ in range(BIG_CHUNKS):
                        smtp.sendall(chunk)
                    smtp.sendall(b".\r\n")
                    final = _reply(smtp)
                    assert final[0] == 250, final
                    smtp.sendall(b"QUIT\r\n")
            finally:
                stop.set()
                sampler.join()
        finally:
            serve.cleanup()
    growth = {pid: peak - baseline.get(pid, peak) for pid, peak in peaks.items()}
    print(
        f"\n100 MB over SMTP: RssAnon growth by pid (KiB): {growth} (core {serve.pid}, "
        f"receivers {receiver_pids})"
    )
    assert growth[serve.pid] < GROWTH_LIMIT_KIB, growth
    assert set(receiver_pids) <= set(growth), (receiver_pids, growth)  # sampled throughout
    assert all(kib < GROWTH_LIMIT_KIB for kib in growth.values()), growth
