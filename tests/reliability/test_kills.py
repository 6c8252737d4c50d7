"""SIGKILL of the core at random moments while mail is received, delivered and bounced.

A client sends over SMTP to ``zoneq serve`` (ledger of 250s, ``tests/support/ledger.py``),
to recipients at ok.test (smtp-sink accepts) and at bad.test (a second smtp-sink that
answers RCPT with 550, so DSNs are being generated and delivered to the sender all the
time).  Each round the core is killed at a random moment: while the client sends, or after
it stopped, while only deliveries and bounces run.  Then it is started again on the same
queue.  After the last start every acknowledged (message, recipient) must have been
delivered (ok.test) or reported by a DSN (bad.test), whole.  Extra copies (and extra DSNs)
only for what was in flight at a kill: a pair the killed instance had put at the MX (or
reported in a DSN it had delivered) while its queue still held it, read from a copy of the
queue after each kill, one extra per such kill; or where the core logged a possible
duplicate.  A 4xx-refused message may reach the MX only if it was under way at a kill.
The kills while receiving wait (bounded) for an open DATA, half of them with ``--long``:
at least one kill must cut a message off after its DATA command, and with only three
receive kills in the short profile a random schedule could miss.  Likewise every third
round sends to bad.test only and waits (bounded, through the HTTP API's counts) until a DSN
is queued or being delivered in the bounces zone before it kills: at least one kill must
find DSNs in the killed queue (read from its copy), or bounce generation went untested.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from tests.conftest import long_tests
from tests.reliability.bed import WORKERS, data_dir_of, inspect_queue, loopback_ip, mail_bed
from tests.support.ledger import (
    Dumps,
    Ledger,
    Load,
    audit,
    logged_duplicates,
    send_until_cut,
    until_data,
    wait_settled,
)
from tests.support.serve import Serve, api_port, smtp_port, start_serve
from tests.support.smtpsink import run_smtp_sink
from zoneq.api.client import ApiClient

pytestmark = pytest.mark.integration

KILLS = 25 if long_tests() else 6
CONNECTIONS = 4
RECIPIENTS = ("r1@ok.test", "r2@ok.test", "r3@ok.test", "x1@bad.test", "x2@bad.test")
REFUSED = tuple(r for r in RECIPIENTS if r.endswith("@bad.test"))
DELIVERY_TIMEOUT = 60.0
DSN_WAIT_S = 5.0


def bounces_under_way(api: ApiClient) -> bool:
    """Whether the bounces zone holds a DSN that is queued or being delivered."""
    zone = api.call("GET", "/api/v1/queue")["zones"].get("bounces", {})
    return bool(zone.get("ready", 0) + zone.get("leased", 0))


async def until_bouncing(api: ApiClient, timeout: float = DSN_WAIT_S) -> bool:
    """Wait (bounded) until a DSN is under way; whether one was seen.  The API call is
    blocking, so it runs in a thread while the client keeps sending."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await asyncio.to_thread(bounces_under_way, api):
            return True
        await asyncio.sleep(0.005)
    return False


async def one_round(serve: Serve, port: int, api: ApiClient, ledger: Ledger, run: int) -> str:
    """Send, and kill the core at a random moment; what was going on at the kill."""
    bouncing = run % 3 == 2  # to bad.test only: every message makes a DSN
    load = Load(REFUSED if bouncing else RECIPIENTS, sizes=(300, 2_000, 70_000))
    stop = asyncio.Event()
    client = asyncio.create_task(send_until_cut(port, ledger, f"kill-{run}", load, stop=stop))
    await asyncio.sleep(random.uniform(0.3, 1.5))
    moment = "receive"
    if bouncing:
        moment = "bounce" if await until_bouncing(api) else "bounce not seen"
    elif run % 2 == 1:  # stop sending first: the kill lands in delivery or bounces
        moment = "delivery"
        stop.set()
        await asyncio.wait_for(client, timeout=30)
        await asyncio.sleep(random.uniform(0.0, 1.0))
    wanted = moment == "receive" and (run % 4 == 0 or not long_tests())
    await until_data(ledger, wanted=wanted)
    ledger.kill_now()
    serve.kill()
    await asyncio.wait_for(client, timeout=30)
    return moment


def test_sigkill_during_receive_delivery_and_bounces_loses_nothing(tmp_path: Path) -> None:
    begun = time.monotonic()
    ledger = Ledger()
    dumps = Dumps()
    seen = Dumps()  # the sink as it was at each kill
    settle_s = 0.0  # reading the queue after each kill
    moments: list[str] = []
    survivors: list[int] = []
    bad_ip = loopback_ip()
    with (
        mail_bed(tmp_path, remotes={"bad.test": bad_ip}) as bed,
        run_smtp_sink("-f", "RCPT", host=bad_ip, port=bed.port),
    ):
        config = bed.config(connections=CONNECTIONS)
        port = smtp_port(config)
        token = data_dir_of(config) / "api.token"  # generated at the first start
        for run in range(KILLS):
            serve = start_serve(config, tmp_path / f"serve-{run}.log")
            try:
                serve.wait_ready(expected_workers=WORKERS)
                api = ApiClient("127.0.0.1", api_port(config), token.read_text().strip())
                moments.append(asyncio.run(one_round(serve, port, api, ledger, run)))
            finally:
                serve.kill()
                survivors += serve.wait_workers_gone(timeout=10.0)
                serve.cleanup()  # SIGKILL, by PID, to any worker still there
            settling = time.monotonic()
            ledger.kills[-1].settle(seen, bed.sink, data_dir_of(config), tmp_path / "copy")
            settle_s += time.monotonic() - settling
        loop_s = time.monotonic() - begun

        last = start_serve(config, tmp_path / "serve-last.log")
        try:
            last.wait_ready(expected_workers=WORKERS)
            settled = wait_settled(bed.sink, dumps, ledger.expected(), timeout=DELIVERY_TIMEOUT)
            stop_s = last.terminate()
        finally:
            last.cleanup()
        dumps.scan(bed.sink)
    state = inspect_queue(config)
    result = audit(ledger, dumps, may_bounce=("bad.test",))
    logged = logged_duplicates(sorted(tmp_path.glob("serve-*.log")))

    delivered_bad = sorted((m, r) for m, r in dumps.delivered() if r.endswith("@bad.test"))
    dsn_duplicates = sum(n - 1 for n in result.bounces.values())
    print(
        f"\nkills: {KILLS} ({moments.count('receive')} while receiving, "
        f"{moments.count('delivery')} while only delivering and bouncing, "
        f"{moments.count('bounce')} of {sum(m.startswith('bounce') for m in moments)} "
        f"sending to bad.test only once a DSN was under way; "
        f"{ledger.kills_mid_data()} cut a message after its DATA, "
        f"{ledger.kills_with_dsns()} found DSNs queued, "
        f"{sum(len(k.dsns_queued) for k in ledger.kills)} pair(s) in them); "
        f"{len(ledger.acknowledged)} messages acknowledged, {len(ledger.cut)} cut, "
        f"{len(ledger.refusals)} refused 4xx; {result.summary()}, "
        f"{dsn_duplicates} duplicate DSN report(s), {sum(logged.values())} possible "
        f"duplicate(s) logged; loop {loop_s:.1f} s ({settle_s:.1f} s reading queues), last stop "
        f"{stop_s:.1f} s, runtime {time.monotonic() - begun:.1f} s"
    )
    assert settled, f"not settled in {DELIVERY_TIMEOUT} s: {result.problems()}"
    assert not result.problems(), result.problems()
    assert not ledger.refused_5xx, ledger.refused_5xx
    assert not delivered_bad, f"bad.test answers 550, yet: {delivered_bad[:5]}"
    assert not result.unexplained_duplicates(logged), (result.unexplained, logged)
    assert ledger.kills_mid_data() > 0, "no kill cut a message off after its DATA command"
    assert ledger.kills_with_dsns() > 0, f"no kill found a DSN in the queue: {moments}"
    assert any(r.endswith("@bad.test") for _, r in result.expected), "no bounce was exercised"
    assert state.messages == 0, state.counters
    assert state.counters == state.recount
    assert not survivors, f"workers outlived their killed core (killed by PID): {survivors}"
