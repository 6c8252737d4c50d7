"""The receiver's crash test: ``zoneq serve`` killed with SIGKILL while a client sends.

The core (which runs the SMTP receiver) is killed at random moments, at least 20 times
(60 with ``--long`` or ``ZONEQ_LONG_TESTS=1``), each time restarted on the same queue.  A
client sends messages one after another over SMTP and writes each (Message-ID, recipients)
to a ledger (``tests/support/ledger.py``) only once the 250 came back.  smtp-sink is the MX
of ok.test and dumps each transaction to a file, so copies are counted per (Message-ID, recipient).

After the last restart every ledger entry must reach every one of its recipients (or be
bounced to the sender); every copy that reaches the MX must be whole (a message cut by a kill
may be stored or not, never in part); the queue must end empty with its counters matching a
recount.  Extra copies are allowed only for what was in flight at a kill: a (message,
recipient) that the killed instance had put at the MX while its queue still held it (read
from a copy of the queue after each kill), one extra copy per such kill, or where the core
logged a possible duplicate.  A 4xx-refused message may reach the MX only if it was under
way at a kill.  Every other kill waits (bounded) until the client has sent DATA, so that
kills inside a transaction are certain, not left to chance; at least one must cut a message
off with no reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import long_tests
from tests.support.dnsmasq import Dnsmasq, running_dnsmasq
from tests.support.ledger import (
    CLIENT_TIMEOUT,
    Dumps,
    Ledger,
    Load,
    audit,
    logged_duplicates,
    send_until_cut,
    until_data,
    wait_settled,
)
from tests.support.serve import Serve, smtp_port, start_serve, write_serve_config
from tests.support.smtpsink import Sink, run_smtp_sink
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

KILLS = 60 if long_tests() else 20
CONNECTIONS = 4
PROCESSES = 1
RECIPIENTS = ("r1@ok.test", "r2@ok.test", "r3@ok.test")
DELIVERY_TIMEOUT = 60.0
QUIET = 2.5  # seconds without a new dump before the last serve is stopped


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


# --- the test ------------------------------------------------------------------------------


def stop_killed(serve: Serve) -> list[int]:
    """After ``serve.kill()``: wait (bounded) for the workers to go; kill survivors by PID."""
    survivors = serve.wait_workers_gone(timeout=10.0)
    serve.cleanup()  # SIGKILL, by PID, to any worker still there
    return survivors


async def one_run(serve: Serve, port: int, ledger: Ledger, run: int) -> None:
    """Send until a random moment (on odd runs), or the first DATA after it (on even runs),
    then SIGKILL the core."""
    client = asyncio.create_task(send_until_cut(port, ledger, f"crash-{run}", Load(RECIPIENTS)))
    await asyncio.sleep(random.uniform(0.2, 1.5))
    await until_data(ledger, wanted=run % 2 == 0)
    ledger.kill_now()
    serve.kill()
    await asyncio.wait_for(client, timeout=CLIENT_TIMEOUT * 2)


def test_sigkill_at_random_moments_loses_no_acknowledged_message(tmp_path: Path) -> None:
    begun = time.monotonic()
    ledger = Ledger()
    dumps = Dumps()
    seen = Dumps()  # the sink as it was at each kill
    settle_s = 0.0  # reading the queue after each kill
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
            settling = time.monotonic()
            ledger.kills[-1].settle(seen, bed.sink, config.parent / "queue", tmp_path / "copy")
            settle_s += time.monotonic() - settling
        loop_s = time.monotonic() - begun

        # The last start: everything acknowledged must come out, then a quiet spell.
        expected = {(m, r) for m, rs in ledger.acknowledged.items() for r in rs}
        last = start_serve(config, tmp_path / "serve-last.log")
        try:
            last.wait_ready(expected_workers=PROCESSES + 1)
            wait_settled(bed.sink, dumps, expected, timeout=DELIVERY_TIMEOUT, quiet=QUIET)
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

    result = audit(ledger, dumps)
    logged = logged_duplicates(sorted(tmp_path.glob("serve-*.log")))
    delivered = dumps.delivered()
    cut_stored = sum(1 for m in ledger.cut if any((m, r) in delivered for r in ledger.cut[m]))
    print(
        f"\nreceiver crash: {KILLS} kills ({ledger.kills_mid_data()} cut a message after "
        f"its DATA), {len(ledger.acknowledged)} messages acknowledged, {len(ledger.cut)} cut "
        f"by a kill ({cut_stored} of them stored and delivered), {len(ledger.refused)} refused;"
        f" {result.summary()}; {sum(logged.values())} possible duplicate(s) logged; "
        f"{len(survivors)} worker(s) outlived a killed core; loop {loop_s:.1f} s "
        f"({settle_s:.1f} s reading queues), last stop {stop_s:.1f} s, runtime {runtime_s:.1f} s"
    )
    # Nothing acknowledged lost, nothing damaged or unknown, cut messages whole or absent,
    # nothing refused with 4xx delivered unless it was under way at a kill.
    assert not result.problems(), result.problems()
    assert not ledger.refused_5xx, ledger.refused_5xx[:10]
    assert not result.unexplained_duplicates(logged), (result.unexplained, logged)
    assert ledger.kills_mid_data() > 0, "no kill cut a message off after its DATA command"
    assert queued == 0, counters
    assert counters == recount
    assert not survivors, f"workers outlived their killed core (killed by PID): {survivors}"
