"""A failed fsync: clients get 4xx, never 5xx, never a 250 for mail that is then lost.

LevelDB syncs its log with ``fdatasync`` (checked with ``strace -f -e
trace=fsync,fdatasync``: no ``fsync`` at all).  While clients send to ``zoneq serve``,
strace attaches to the core (all its threads, ``-f``) and makes every ``fdatasync`` fail
with EIO; after a few seconds strace is stopped, which detaches it, and the fault is over.

LevelDB remembers a failed sync as a background error and refuses every later write until
the database is reopened; the store reopens it by itself at most once a second
(``StoreBase._check``), after a sync of its own succeeds (a reopen syncs a new log and
manifest, so it would fail too and leave no handle).  So: 4xx while the fault lasts, 250s
again after it without a restart, every acknowledged message delivered, and the queue
consistent afterwards.

Delivery of what is queued must go on meanwhile (issue 7).  smtp-sink waits a second
before answering each final dot (``-W .:1``), so the clients queue a backlog before the
fault that the zone's connections drain at a few messages a second.  Deliveries are
counted at the sink over the fault window, and separately over its tail, from
``IN_FLIGHT_S`` on: a transaction already at the sink when the fault began has answered
by then, so a copy that lands later was handed out during the fault.  Their outcomes are
held in memory until the store heals (``zoneq/storage/held.py``), which ``/metrics`` shows.

A commit whose sync failed was still written to the log file (LevelDB writes, then syncs),
and a reopen replays the log; the store removes such a message after the reopen, since its
client was told 4xx and sends it again.  The audit fails the run if a message refused with
4xx reaches the MX all the same: no kill happens here to excuse it.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import subprocess
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import long_tests
from tests.reliability.bed import WORKERS, QueueState, data_dir_of, inspect_queue, mail_bed
from tests.support.ledger import (
    Audit,
    Dumps,
    Ledger,
    Load,
    audit,
    logged_duplicates,
    send_for,
    wait_settled,
)
from tests.support.serve import Serve, api_get, api_port, smtp_port, start_serve
from tests.support.testbed import missing

pytestmark = pytest.mark.integration

FAULTS = 3 if long_tests() else 1
BEFORE_S, FAULT_S, AFTER_S = 1.5, 3.0, 4.0
# smtp-sink's wait before its reply to the final dot, plus room for the reply to arrive.
SINK_DELAY = ("-W", ".:1")
IN_FLIGHT_S = 1.5
RECIPIENTS = ("r1@ok.test", "r2@ok.test")


def strace_binary() -> str:
    found = shutil.which("strace")
    if found is None:
        missing("strace is not installed (Debian: apt-get install strace)")
    assert found is not None
    return found


def inject_eio(pid: int, log: Path) -> subprocess.Popen[bytes]:
    """strace attached to every thread of ``pid``, failing each fdatasync with EIO."""
    with log.open("ab") as out:
        tracer = subprocess.Popen(
            [
                strace_binary(),
                *("-f", "-qq", "-p", str(pid)),
                *("-e", "trace=fdatasync", "-e", "inject=fdatasync:error=EIO"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return tracer


def stop_tracer(tracer: subprocess.Popen[bytes]) -> None:
    """SIGTERM makes strace detach (the traced process runs on); by PID, bounded."""
    if tracer.poll() is None:
        tracer.send_signal(signal.SIGTERM)
        try:
            tracer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            tracer.kill()
            tracer.wait(timeout=5)


@dataclass
class Phase:
    """One fault: messages acknowledged before, during and after it, and copies that
    reached the sink while it lasted (all of them, and those of its tail)."""

    before: int
    during: int
    after: int
    delivered: int
    delivered_late: int
    held: float  # /metrics' zoneq_outcomes_held at the end of the fault


async def fault_while_sending(
    serve: Serve,
    port: int,
    ledger: Ledger,
    run: int,
    trace_log: Path,
    *,
    copies: Callable[[], int],
    held: Callable[[], float],
) -> Phase:
    """Send through a fault of ``FAULT_S``; ``copies`` counts what the sink holds, ``held``
    what the core holds in memory."""
    total = BEFORE_S + FAULT_S + AFTER_S
    load = Load(RECIPIENTS, sizes=(300, 20_000), pause=0.1)
    clients = asyncio.create_task(send_for(port, ledger, f"eio-{run}", load, total, clients=2))
    await asyncio.sleep(BEFORE_S)
    before = len(ledger.acknowledged)
    tracer = inject_eio(serve.pid, trace_log)
    try:
        at_start = await asyncio.to_thread(copies)
        await asyncio.sleep(IN_FLIGHT_S)
        at_tail = await asyncio.to_thread(copies)
        await asyncio.sleep(FAULT_S - IN_FLIGHT_S)
        at_end = await asyncio.to_thread(copies)
        held_at_end = await asyncio.to_thread(held)
    finally:
        stop_tracer(tracer)
    during = len(ledger.acknowledged) - before
    await clients
    after = len(ledger.acknowledged) - before - during
    return Phase(before, during, after, at_end - at_start, at_end - at_tail, held_at_end)


@dataclass
class Run:
    ledger: Ledger
    phases: list[Phase]
    seen: list[int]  # 4xx refusals during each fault
    eios: int
    settled: bool
    core_restarted: bool
    workers_restarted: bool
    exit_code: int | None  # of the core, on SIGTERM after the faults
    audit: Audit
    logged: Counter[tuple[str, str]]
    state: QueueState


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The scenario, once for the module's checks."""
    strace_binary()
    tmp_path = tmp_path_factory.mktemp("fsync")
    ledger = Ledger()
    dumps = Dumps()
    phases: list[Phase] = []
    seen: list[int] = []
    logs = [tmp_path / "serve.log"]
    trace_log = tmp_path / "strace.log"
    with mail_bed(tmp_path, *SINK_DELAY) as bed:
        config = bed.config(connections=4)
        port = smtp_port(config)

        def copies() -> int:
            return dumps.scan(bed.sink)[0]

        def held() -> float:
            token = (data_dir_of(config) / "api.token").read_text().strip()
            status, text = api_get(api_port(config), "/metrics", token)
            assert status == 200, text
            found = re.search(r"^zoneq_outcomes_held (\S+)$", text, re.MULTILINE)
            assert found is not None, text
            return float(found.group(1))

        serve = start_serve(config, logs[0])
        try:
            workers = serve.wait_ready(expected_workers=WORKERS)
            for n in range(FAULTS):
                refusals_before = len(ledger.refusals)
                phase = fault_while_sending(
                    serve, port, ledger, n, trace_log, copies=copies, held=held
                )
                phases.append(asyncio.run(phase))
                seen.append(len(ledger.refusals) - refusals_before)
            settled = wait_settled(bed.sink, dumps, ledger.expected(), timeout=90.0)
            core_restarted = not serve.running()
            workers_restarted = set(serve.workers()) != set(workers)
            serve.terminate()
            exit_code = serve.process.returncode
        finally:
            serve.cleanup()
        dumps.scan(bed.sink)
    result = Run(
        ledger=ledger,
        phases=phases,
        seen=seen,
        eios=trace_log.read_text(errors="replace").count("(INJECTED)"),
        settled=settled,
        core_restarted=core_restarted,
        workers_restarted=workers_restarted,
        exit_code=exit_code,
        audit=audit(ledger, dumps),
        logged=logged_duplicates(logs),
        state=inspect_queue(config),
    )
    delivered = {m for m, _ in dumps.delivered()}
    print(
        f"\nfailed fdatasync: {FAULTS} fault(s), {phases}; "
        f"{result.eios} EIO(s) injected; {len(ledger.refusals)} refused 4xx "
        f"(e.g. {ledger.refusals[:1]}), {len(set(ledger.refused) & delivered)} of them "
        f"delivered all the same (replayed from the log); {result.audit.summary()}; "
        f"{sum(result.logged.values())} possible duplicate(s) logged; core died: "
        f"{core_restarted}, workers restarted: {workers_restarted}, exit on SIGTERM {exit_code}"
    )
    return result


def test_clients_get_4xx_never_5xx_while_fdatasync_fails(run: Run) -> None:
    assert run.eios > 0, "strace injected nothing"
    assert all(n > 0 for n in run.seen), f"the fault was never seen by a client: {run.seen}"
    assert not run.ledger.refused_5xx, run.ledger.refused_5xx[:5]


def test_delivery_of_what_is_queued_goes_on_while_fdatasync_fails(run: Run) -> None:
    assert all(p.before > p.delivered for p in run.phases), f"no backlog: {run.phases}"
    assert all(p.delivered_late > 0 for p in run.phases), f"delivery stalled: {run.phases}"
    # Their outcomes wait in memory (zoneq/storage/held.py), shown to the operator.
    assert all(p.held > 0 for p in run.phases), run.phases


def test_the_store_heals_by_itself_once_the_fault_is_gone(run: Run) -> None:
    assert all(p.after > 0 for p in run.phases), f"no 250 after the fault: {run.phases}"
    assert not run.core_restarted


def test_workers_ride_out_a_storage_fault(run: Run) -> None:
    assert not run.workers_restarted


def test_serve_still_stops_cleanly_after_a_storage_fault(run: Run) -> None:
    assert run.exit_code == 0


def test_no_acknowledged_message_is_lost_or_damaged(run: Run) -> None:
    assert run.settled, run.audit.problems()
    assert not run.audit.problems(), run.audit.problems()
    assert run.state.messages == 0, run.state.counters
    assert run.state.counters == run.state.recount


def test_extra_copies_only_where_a_possible_duplicate_was_logged(run: Run) -> None:
    assert not run.audit.unexplained_duplicates(run.logged), run.audit.duplicates
