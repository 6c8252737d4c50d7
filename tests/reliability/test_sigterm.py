"""SIGTERM under load: ``zoneq serve`` stops within 30 s, and nothing is lost after restart.

Three clients send over SMTP while the default zone delivers to smtp-sink, which waits a
second before answering each final dot, so deliveries are in flight when SIGTERM comes.  The
core must exit (status 0) within 30 s, its workers with it; the clients see 421 or a closed
connection (a cut exchange, never a 250 for mail that is then lost).  A restart delivers
the rest.  Extra copies are allowed only where the core logged a possible duplicate.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import long_tests
from tests.reliability.bed import WORKERS, inspect_queue, mail_bed
from tests.support.ledger import (
    Dumps,
    Ledger,
    Load,
    audit,
    logged_duplicates,
    send_for,
    wait_settled,
)
from tests.support.serve import Serve, smtp_port, start_serve

pytestmark = pytest.mark.integration

ROUNDS = 4 if long_tests() else 1
STOP_LIMIT_S = 30.0
RECIPIENTS = ("r1@ok.test", "r2@ok.test", "r3@ok.test")


async def load_and_stop(serve: Serve, port: int, ledger: Ledger, run: int) -> float:
    """Three clients sending; SIGTERM in the middle; the seconds the core took to exit."""
    load = Load(RECIPIENTS, pause=0.05)
    clients = asyncio.create_task(send_for(port, ledger, f"term-{run}", load, 4.0, clients=3))
    await asyncio.sleep(2.0)  # mid-load: clients sending, deliveries waiting for the sink
    took = await asyncio.to_thread(serve.terminate, STOP_LIMIT_S)
    await clients
    return took


def test_sigterm_under_load_stops_within_30_s_and_loses_nothing(tmp_path: Path) -> None:
    ledger = Ledger()
    dumps = Dumps()
    stops: list[tuple[float, int | None]] = []
    survivors: list[int] = []
    logs: list[Path] = []
    with mail_bed(tmp_path, "-W", ".:1") as bed:
        config = bed.config(connections=8)
        port = smtp_port(config)
        for run in range(ROUNDS):
            logs.append(tmp_path / f"serve-{run}.log")
            serve = start_serve(config, logs[-1])
            try:
                serve.wait_ready(expected_workers=WORKERS)

                took = asyncio.run(load_and_stop(serve, port, ledger, run))
                stops.append((took, serve.process.returncode))
                survivors += serve.wait_workers_gone(timeout=5.0)
            finally:
                serve.cleanup()
        logs.append(tmp_path / "serve-last.log")
        last = start_serve(config, logs[-1])
        try:
            last.wait_ready(expected_workers=WORKERS)
            settled = wait_settled(bed.sink, dumps, ledger.expected(), timeout=90.0)
            last.terminate()
        finally:
            last.cleanup()
        dumps.scan(bed.sink)
    state = inspect_queue(config)
    result = audit(ledger, dumps)
    logged = logged_duplicates(logs)
    print(
        f"\nSIGTERM under load: {ROUNDS} stop(s) in {[round(s, 1) for s, _ in stops]} s, exit "
        f"{[c for _, c in stops]}; {len(ledger.acknowledged)} acknowledged, "
        f"{len(ledger.cut)} cut, {len(ledger.refusals)} refused 4xx; {result.summary()}; "
        f"{sum(logged.values())} possible duplicate(s) logged"
    )
    assert all(took < STOP_LIMIT_S and code == 0 for took, code in stops), stops
    assert not survivors, f"workers outlived a stopped core (killed by PID): {survivors}"
    assert settled, result.problems()
    assert not result.problems(), result.problems()
    assert not ledger.refused_5xx, ledger.refused_5xx
    assert not result.unexplained_duplicates(logged), (result.duplicates, logged)
    assert result.partial == 0  # no transaction cut off mid-DATA by the stop
    assert state.messages == 0, state.counters
    assert state.counters == state.recount
