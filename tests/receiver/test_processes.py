"""``receiver.processes = 2``: a real ``zoneq serve`` whose SMTP sessions run in receiver
processes that hand their mail to the core over the intake socket.

The parts are real: the queue on disk, smtp-sink as the MX (``tests/reliability/bed.py``),
dnsmasq as DNS, SIGKILL by PID, strace to fail the core's syncs.  A ledger
(``tests/support/ledger.py``) records what got its 250, and smtp-sink's dumps show what came
out.  Each test stops every process it started, by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import aiosmtplib
import pytest

from tests.conftest import long_tests
from tests.receiver.harness import Raw
from tests.receiver.processes import ReceiverServe, owner_of, start_receiver_serve
from tests.reliability.bed import WORKERS, Bed, data_dir_of, inspect_queue, mail_bed
from tests.reliability.test_fsync import inject_eio, stop_tracer
from tests.support.ledger import SENDER, Dumps, Ledger, Load, audit, send_until_cut, wait_settled
from tests.support.serve import smtp_port
from zoneq.storage import keys
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

RECEIVERS = 2
RECIPIENTS = ("r1@ok.test", "r2@ok.test", "r3@ok.test")
DELIVERY_TIMEOUT = 60.0
WAIT = 30.0


@contextlib.contextmanager
def serving(
    bed: Bed,
    log: Path,
    storage: Mapping[str, str] | None = None,
    receiver: Mapping[str, str] | None = None,
) -> Iterator[tuple[ReceiverServe, int]]:
    """``zoneq serve`` with ``RECEIVERS`` receiver processes, all of them connected; more
    ``receiver`` keys (TOML values as text) when given."""
    path = bed.config(receiver={"processes": str(RECEIVERS), **(receiver or {})}, storage=storage)
    serve = start_receiver_serve(path, log)
    try:
        serve.wait_ready(WORKERS + RECEIVERS)
        assert len(serve.receivers()) == RECEIVERS
        yield serve, smtp_port(path)
    finally:
        serve.cleanup()


def wait_until(what: str, condition: Callable[[], bool], timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def leftovers(config: Path) -> tuple[list[bytes], list[bytes], dict[bytes, int], dict[bytes, int]]:
    """(receiving markers, message keys, counters, recount) of a stopped serve's queue, read
    without ``recover`` (which would sweep exactly what this is looking for)."""

    async def read() -> tuple[list[bytes], list[bytes], dict[bytes, int], dict[bytes, int]]:
        store = QueueStore.open(data_dir_of(config))
        try:
            marks = list(store.database.keys(prefix=keys.RECEIVING))
            messages = list(store.database.keys(prefix=keys.MESSAGE))
            counters = {k: v for k, v in store.counters().items() if v}
            recount = {k: v for k, v in store.recount().items() if v}
            return marks, messages, counters, recount
        finally:
            await store.close()

    return asyncio.run(read())


async def send_some(port: int, ledger: Ledger, clients: int, each: int) -> int:
    load = Load(RECIPIENTS, sizes=(300, 70_000))
    sent = await asyncio.gather(
        *(send_until_cut(port, ledger, f"c{n}", load, limit=each) for n in range(clients))
    )
    return sum(sent)


# --- mail goes through -------------------------------------------------------------------


def test_mail_through_receiver_processes_reaches_the_mx_and_sigterm_says_421(
    tmp_path: Path,
) -> None:
    ledger, dumps = Ledger(), Dumps()
    with mail_bed(tmp_path) as bed, serving(bed, tmp_path / "serve.log") as (serve, port):
        assert asyncio.run(send_some(port, ledger, clients=6, each=5)) == 30
        assert wait_settled(bed.sink, dumps, ledger.expected(), timeout=DELIVERY_TIMEOUT, quiet=1)
        # One session idle at SIGTERM: the receivers stop first and say 421 4.3.2.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
            idle_file = idle.makefile("rb")
            assert idle_file.readline().startswith(b"220 ")
            idle.sendall(b"EHLO client.test\r\n")
            while not idle_file.readline().startswith(b"250 "):
                pass
            assert serve.terminate() < 20
            assert serve.process.returncode == 0
            assert idle_file.readline().startswith(b"421 4.3.2 ")
        log = serve.log_text()
        first_dump = _any_dump(bed)
    result = audit(ledger, dumps)
    assert not result.problems(), result.problems()
    assert result.duplicate_count == 0
    # The trace field names the configured host, whichever process received the message.
    trace = r"Received: from client\.src\.test \(\[127\.0\.0\.1\]\)\s+by mx\.zoneq\.test"
    assert re.search(trace, first_dump), first_dump[:600]
    assert log.count("disconnected: 0 open message(s)") == RECEIVERS  # spares given back
    marks, messages, counters, recount = leftovers(bed.directory / "zoneq" / "zones.toml")
    assert (marks, messages) == ([], [])
    assert counters == recount


def _any_dump(bed: Bed) -> str:
    files = sorted(bed.sink.dump_dir.glob("msg.*"))
    assert files
    return files[0].read_text(errors="replace")


def test_a_taken_port_is_a_start_up_error_naming_the_address(tmp_path: Path) -> None:
    with mail_bed(tmp_path) as bed, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = bed.config(receiver={"processes": "2"})
        listen = f'listen = "127.0.0.1:{smtp_port(config)}"'
        config.write_text(config.read_text().replace(listen, f'listen = "127.0.0.1:{port}"'))
        serve = start_receiver_serve(config, tmp_path / "serve.log")
        try:
            serve.process.wait(timeout=WAIT)
            assert serve.process.returncode == 1
            assert f"SMTP receiver cannot listen on 127.0.0.1:{port}" in serve.log_text()
            assert "receiver receiver-0 started" not in serve.log_text()
        finally:
            serve.cleanup()


# --- the connection limit, counted in the core ---------------------------------------------

LIMIT = 3
ROUNDS = 200  # 20 to 59 of 600 reconnections were refused before the fix


async def silent_client(port: int, seconds: float) -> bytes | None:
    """Everything a client that never sends a byte is told until the server closes the
    connection; None if it is still open after ``seconds``."""
    raw = await Raw.connect(port)
    try:
        return await asyncio.wait_for(raw.reader.read(), seconds)
    except TimeoutError:
        return None
    finally:
        await raw.close()


def test_past_the_limit_a_silent_client_is_told_421_and_closed_at_once(tmp_path: Path) -> None:
    # The core's answer comes after the greeting; a refusal must not wait for the client
    # to speak (one that never does would hold its session until the idle timeout).
    receiver = {"max_connections_per_client": str(LIMIT)}
    with (
        mail_bed(tmp_path) as bed,
        serving(bed, tmp_path / "serve.log", receiver=receiver) as (_, port),
    ):

        async def connect_ten() -> list[bytes | None]:
            return await asyncio.gather(*(silent_client(port, 3.0) for _ in range(10)))

        told = asyncio.run(connect_ten())
    assert told.count(None) == LIMIT, told
    for said in told:
        if said is not None:
            assert said.startswith(b"220 ") and b"\r\n421 4.7.0 " in said, said


async def reconnect_without_reading_221(port: int, rounds: int) -> list[str]:
    """Postfix's way with its default ``smtp_skip_quit_response = yes``: the greeting,
    EHLO, QUIT and close without waiting for the 221, then connect again at once, ``rounds``
    times.  The refusals it was given."""
    refused = []
    for _ in range(rounds):
        raw = await Raw.connect(port)
        reply = await raw.reply()
        if reply.startswith("220 "):
            reply = await raw.cmd("EHLO client.test")
        if reply.startswith("250"):
            await raw.send(b"QUIT\r\n")
        else:
            refused.append(reply)
        await raw.close()
    return refused


def test_clients_within_the_limit_reconnecting_at_once_are_never_refused(
    tmp_path: Path,
) -> None:
    # A new connection may land on the other receiver process, whose ADMIT can reach the
    # core before the first process's RELEASE of the connection just closed.
    receiver = {"max_connections_per_client": str(LIMIT)}
    with (
        mail_bed(tmp_path) as bed,
        serving(bed, tmp_path / "serve.log", receiver=receiver) as (_, port),
    ):

        async def clients() -> list[list[str]]:
            each = (reconnect_without_reading_221(port, rounds=ROUNDS) for _ in range(LIMIT))
            return await asyncio.wait_for(asyncio.gather(*each), 120)

        refused = [reply for replies in asyncio.run(clients()) for reply in replies]
    assert refused == [], f"{len(refused)} of {ROUNDS * LIMIT} refused: {refused[:3]}"


# --- a receiver killed -------------------------------------------------------------------


async def cut_mid_data(serve: ReceiverServe, port: int) -> tuple[int, str]:
    """A session that has sent 200 KB of DATA (three chunks stored) when the receiver
    process holding it is killed; (the victim's PID, its name)."""
    raw = await Raw.connect(port)
    await raw.start(rcpt="r1@ok.test", mail=f"MAIL FROM:<{SENDER}>")
    await raw.send(b"Subject: cut\r\n\r\n" + (b"x" * 78 + b"\r\n") * 2_500)
    await asyncio.sleep(1.0)  # let the receiver store the full chunks
    client_port = raw.writer.get_extra_info("sockname")[1]
    victim = owner_of(serve.receivers(), port, client_port)
    assert victim is not None, "no receiver process holds the session"
    name = serve.receiver_names()[victim]
    os.kill(victim, signal.SIGKILL)
    with contextlib.suppress(ConnectionError):
        assert await asyncio.wait_for(raw.reader.read(), 10) == b""  # never a 250
    await raw.close()
    return victim, name


def test_a_receiver_killed_mid_data_loses_nothing_leaves_nothing_and_is_restarted(
    tmp_path: Path,
) -> None:
    ledger, dumps = Ledger(), Dumps()
    with mail_bed(tmp_path) as bed, serving(bed, tmp_path / "serve.log") as (serve, port):
        assert asyncio.run(send_some(port, ledger, clients=2, each=3)) == 6
        victim, name = asyncio.run(cut_mid_data(serve, port))
        # The message cut mid-DATA is among them (and spare ids the receiver held).
        abandoned = re.compile(rf"receiver {name} disconnected: [1-9]\d* open message\(s\)")
        wait_until(
            "the core abandons its open messages",
            lambda: abandoned.search(serve.log_text()) is not None,
        )
        wait_until(
            "the supervisor restarts it",
            lambda: any(n == name and pid != victim for pid, n in serve.receiver_names().items()),
        )
        assert f"receiver {name} (pid {victim}) exited with -9" in serve.log_text()
        assert asyncio.run(send_some(port, ledger, clients=2, each=3)) == 6
        assert wait_settled(bed.sink, dumps, ledger.expected(), timeout=DELIVERY_TIMEOUT, quiet=1)
        serve.terminate()
    result = audit(ledger, dumps)
    assert not result.problems(), result.problems()
    assert not any(b"Subject: cut" in p.read_bytes() for p in bed.sink.dump_dir.glob("msg.*"))
    marks, messages, counters, recount = leftovers(bed.directory / "zoneq" / "zones.toml")
    assert (marks, messages) == ([], [])  # no orphan chunk, no marker
    assert counters == recount


# --- the core's faults reach the client as 4xx --------------------------------------------


async def one_message(port: int) -> tuple[int, str]:
    """One message over SMTP: the reply code and text of whatever ended it."""
    client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, start_tls=False, timeout=20)
    await client.connect()
    try:
        await client.sendmail(SENDER, ["r1@ok.test"], b"Subject: x\r\n\r\nbody\r\n")
    except aiosmtplib.SMTPResponseException as exc:
        return exc.code, exc.message
    finally:
        client.close()
    return 250, ""


def test_below_the_free_space_floor_mail_is_refused_with_452_through_a_receiver(
    tmp_path: Path,
) -> None:
    with mail_bed(tmp_path) as bed:
        storage = {"min_free": '"1000000TiB"'}
        with serving(bed, tmp_path / "serve.log", storage) as (serve, port):
            for _ in range(3):  # each receiver process may take the session
                code, text = asyncio.run(one_message(port))
                assert (code, text[:5]) == (452, "4.3.1"), text
            serve.terminate()
    assert inspect_queue(bed.directory / "zoneq" / "zones.toml").messages == 0


def test_failing_syncs_in_the_core_give_451_through_a_receiver_then_it_heals(
    tmp_path: Path,
) -> None:
    with mail_bed(tmp_path) as bed, serving(bed, tmp_path / "serve.log") as (serve, port):
        tracer = inject_eio(serve.pid, tmp_path / "strace.log")
        try:
            time.sleep(2.0)  # strace attaches to every thread
            code, text = asyncio.run(one_message(port))
        finally:
            stop_tracer(tracer)
        assert 400 <= code < 500, (code, text)
        assert text.startswith("4.3.0"), text
        healed = False
        deadline = time.monotonic() + WAIT
        while not healed and time.monotonic() < deadline:
            healed = asyncio.run(one_message(port))[0] == 250
            time.sleep(0.5)
        assert healed, "the store did not heal once the fault was gone"
        serve.terminate()


# --- the core killed while receivers send -------------------------------------------------


def test_core_sigkill_while_receivers_send_loses_no_acknowledged_message(tmp_path: Path) -> None:
    kills = 20 if long_tests() else 5  # the in-core receiver's crash test does 20 or 60
    begun = time.monotonic()
    ledger, dumps = Ledger(), Dumps()
    survivors: list[int] = []
    with mail_bed(tmp_path) as bed:
        config = bed.config(receiver={"processes": str(RECEIVERS)})
        port = smtp_port(config)
        for run in range(kills):
            serve = start_receiver_serve(config, tmp_path / f"serve-{run}.log")
            try:
                serve.wait_ready(WORKERS + RECEIVERS)
                asyncio.run(_send_then_kill(serve, port, ledger, run))
            finally:
                serve.kill()
                # Receivers see their core's socket close and exit by themselves.
                survivors += serve.wait_workers_gone(timeout=10.0)
                serve.cleanup()
        last = start_receiver_serve(config, tmp_path / "serve-last.log")
        try:
            last.wait_ready(WORKERS + RECEIVERS)
            wait_settled(bed.sink, dumps, ledger.expected(), timeout=DELIVERY_TIMEOUT, quiet=2)
            last.terminate()
        finally:
            last.cleanup()
        dumps.scan(bed.sink)
    state = inspect_queue(config)
    result = audit(ledger, dumps)
    print(
        f"\ncore killed under {RECEIVERS} receiver processes: {kills} kills, "
        f"{len(ledger.acknowledged)} acknowledged, {len(ledger.cut)} cut, "
        f"{len(ledger.refused)} refused (4xx); {result.summary()}; "
        f"{time.monotonic() - begun:.1f} s"
    )
    assert len(ledger.acknowledged) > kills, "too little was sent to mean anything"
    assert not result.problems(), result.problems()
    assert not ledger.refused_5xx, ledger.refused_5xx[:10]
    # Extra copies only from what was in flight: per kill, a delivery on each of the zone's
    # 4 connections, each to at most all 3 recipients.  (The clients never send a cut
    # message again, so the RFC 1047 window of the receivers adds none here.)
    assert result.duplicate_count <= kills * 4 * len(RECIPIENTS)
    assert state.messages == 0 and state.counters == state.recount
    assert not survivors, f"children outlived their killed core: {survivors}"


async def _send_then_kill(serve: ReceiverServe, port: int, ledger: Ledger, run: int) -> None:
    load = Load(RECIPIENTS)
    clients = [
        asyncio.create_task(send_until_cut(port, ledger, f"k{run}-{n}", load)) for n in range(3)
    ]
    await asyncio.sleep(0.3 + (run % 5) * 0.3)
    await asyncio.to_thread(serve.kill)
    await asyncio.wait_for(asyncio.gather(*clients), 60)
